//! Waiting from async code: tokio futures over the progress core
//! (`asynch`), sleeping on what `nics::wake` registers.

#[cfg(feature = "tokio")]
pub(crate) mod asynch;
