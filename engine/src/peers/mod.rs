//! Who the agent talks to and how it trusts them: the metadata that
//! describes an agent (`desc`), the cluster secret's handshake (`auth`),
//! the control listener that hands out queue pairs (`control`), the
//! connection pool (`conn`), peers' memory (`peer`) and what happened to
//! peers (`events`).

pub(in crate) mod auth;
pub(in crate) mod conn;
pub(in crate) mod control;
pub(in crate) mod desc;
pub(in crate) mod events;
pub(in crate) mod peer;
