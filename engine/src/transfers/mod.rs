//! Moving bytes: memory registered under names, and where GPU memory goes
//! (`memory`, `placement`), prepared requests and their posts
//! (`transfer`), the progress core that reaps and finishes them (`core`)
//! and the counters (`stats`).

pub(crate) mod core;
pub(crate) mod memory;
pub(crate) mod placement;
pub(crate) mod stats;
pub(crate) mod transfer;
