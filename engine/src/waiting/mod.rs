//! Waiting without a thread per wait: tokio futures (`asynch`, `wake`)
//! and one descriptor for any other event loop (`ready`).

#[cfg(feature = "tokio")]
pub(in crate) mod asynch;
pub(in crate) mod ready;
#[cfg(feature = "tokio")]
pub(in crate) mod wake;
