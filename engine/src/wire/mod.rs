//! What crosses between agents, as bytes: the cluster secret's proofs
//! (`auth`), an agent's bounded, sealed metadata (`desc`), notification
//! messages (`notify`) and broadcast messages (`castmsg`). The bottom
//! layer: these know nothing of agents, NICs or connections, and every
//! decoder treats its input as hostile.

pub(crate) mod auth;
pub(crate) mod castmsg;
pub(crate) mod desc;
pub(crate) mod notify;
