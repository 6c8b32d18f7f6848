//! Who the agent talks to and how it trusts them: the metadata that
//! describes an agent (`desc`), the cluster secret's handshake (`auth`),
//! the control listener that hands out queue pairs (`control`), the
//! connection pool (`conn`), peers' memory (`peer`) and what happened to
//! peers (`events`).

pub(in crate::engine) mod auth;
pub(in crate::engine) mod conn;
pub(in crate::engine) mod control;
pub(in crate::engine) mod desc;
pub(in crate::engine) mod events;
pub(in crate::engine) mod peer;
