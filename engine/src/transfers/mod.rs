//! Moving bytes: memory registered under names (`memory`), where GPU
//! memory goes (`placement`), the NICs (`nic`), prepared requests and
//! their posts (`transfer`), the progress core that reaps and finishes
//! them (`core`), notification messages (`notify`, in slots of
//! `msgbuf`) and the counters (`stats`).

pub(in crate) mod core;
pub(in crate) mod transfer;
pub(in crate) mod memory;
pub(in crate) mod msgbuf;
pub(in crate) mod nic;
pub(in crate) mod notify;
pub(in crate) mod placement;
pub(in crate) mod stats;
