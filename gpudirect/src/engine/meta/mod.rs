//! Rendezvous: where agents publish their metadata and find each other by
//! name. [`Rendezvous`] is the interface; [`TcpRendezvous`] talks to a
//! small server one process hosts ([`RendezvousServer`], nothing to
//! install). Handing blobs over by hand ([`AgentMetadata::encode`],
//! [`Agent::load_remote`](super::Agent::load_remote)) needs none of it.
//!
//! Whatever a rendezvous returns is decoded as hostile input, like any
//! metadata: a bad blob is a typed error, never a panic.

mod tcp;

use std::time::Duration;

use super::desc::AgentMetadata;
use super::error::EngineError;

pub use tcp::{RendezvousServer, TcpRendezvous, MAX_ENTRIES};

/// Where agents publish their metadata and look each other up by name.
/// `Send + Sync`: one handle may serve every thread.
pub trait Rendezvous: Send + Sync {
    /// Publishes `md` under its name, replacing what was there.
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] when the store cannot be reached or
    /// refuses it.
    fn publish(&self, md: &AgentMetadata) -> Result<(), EngineError>;

    /// The metadata published under `name`, waiting up to `timeout` for
    /// it to appear.
    ///
    /// # Errors
    /// [`EngineError::NotPublished`] when nothing appeared in time;
    /// [`EngineError::Rendezvous`] when the store cannot be reached;
    /// [`EngineError::Metadata`] for a blob that does not decode.
    fn lookup(&self, name: &str, timeout: Duration) -> Result<AgentMetadata, EngineError>;

    /// Removes what is published under `name` (nothing there is fine).
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] when the store cannot be reached.
    fn withdraw(&self, name: &str) -> Result<(), EngineError>;
}
