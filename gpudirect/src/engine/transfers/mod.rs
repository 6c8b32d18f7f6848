//! Moving bytes: memory registered under names (`memory`), where GPU
//! memory goes (`placement`), the NICs (`nic`), prepared requests and
//! their posts (`transfer`), the progress core that reaps and finishes
//! them (`core`), notification messages (`notify`, in slots of
//! `msgbuf`) and the counters (`stats`).

pub(in crate::engine) mod core;
pub(in crate::engine) mod transfer;
pub(in crate::engine) mod memory;
pub(in crate::engine) mod msgbuf;
pub(in crate::engine) mod nic;
pub(in crate::engine) mod notify;
pub(in crate::engine) mod placement;
pub(in crate::engine) mod stats;
