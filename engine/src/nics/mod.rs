//! Each NIC's resources: its protection domain, queues and counters
//! (`nic`), the registered slots notification messages land in
//! (`msgbuf`), and what wakes the threads and tasks that wait on its
//! completions (`ready`: one descriptor for any event loop; `wake`: tokio's
//! reactor). Below the peers and transfers that share them.

pub(crate) mod msgbuf;
pub(crate) mod nic;
pub(crate) mod ready;
#[cfg(feature = "tokio")]
pub(crate) mod wake;
