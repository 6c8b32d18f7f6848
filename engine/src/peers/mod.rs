//! Who the agent talks to: the control listener that hands out queue
//! pairs after the secret's handshake (`control`), the connection pool
//! (`conn`), peers' memory (`peer`) and what happened to peers
//! (`events`).

pub(crate) mod conn;
pub(crate) mod control;
pub(crate) mod events;
pub(crate) mod peer;
