//! Waiting without a thread per wait: tokio futures (`asynch`, `wake`)
//! and one descriptor for any other event loop (`ready`).

#[cfg(feature = "tokio")]
pub(in crate::engine) mod asynch;
pub(in crate::engine) mod ready;
#[cfg(feature = "tokio")]
pub(in crate::engine) mod wake;
