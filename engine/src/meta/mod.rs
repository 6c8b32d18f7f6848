//! Rendezvous: where agents publish their metadata and find each other by
//! name. [`Rendezvous`] is the interface; [`TcpRendezvous`] talks to a
//! small server one process hosts ([`RendezvousServer`], nothing to
//! install); `EtcdRendezvous` (feature `etcd`) keeps the metadata in an
//! etcd cluster, for jobs that already run one. Handing blobs over by hand ([`AgentMetadata::encode`],
//! [`Agent::load_remote`](super::Agent::load_remote)) needs none of it.
//!
//! Whatever a rendezvous returns is decoded as hostile input, like any
//! metadata: a bad blob is a typed error, never a panic.
//!
//! The same stores also carry postings ([`Board`]): named blobs under a
//! topic that many processes post and one reads together, such as every
//! node's doctor capture for a job's pre-launch gate.

mod board;
#[cfg(feature = "etcd")]
mod etcd;
#[cfg(feature = "etcd")]
mod sealed;
mod server;
mod tcp;

use std::time::Duration;

use crate::wire::desc::{AgentMetadata, MAX_NAME};
use crate::error::EngineError;

#[cfg(feature = "etcd")]
pub use etcd::{EtcdRendezvous, DEFAULT_BOARD_PREFIX, DEFAULT_PREFIX};
pub use board::{posting_name_ok, Board, Posting, MAX_ENTRIES, MAX_POSTING, MAX_POSTING_NAME, MAX_TOPIC};
pub use server::{RendezvousConfig, RendezvousServer};
pub use tcp::TcpRendezvous;

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

fn rdv_err(server: &str, reason: String) -> EngineError {
    EngineError::Rendezvous { server: server.to_owned(), reason }
}

/// Agent names as the metadata allows them, refused before anything is
/// sent (or an agent of that name is made).
pub(super) fn check_name(name: &str) -> Result<(), EngineError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(EngineError::Config(format!("agent name {name:?}: 1 to {MAX_NAME} bytes")));
    }
    // A NUL cannot name the agent's threads, and control characters have
    // no place in the log lines and metrics labels that show it.
    if name.chars().any(char::is_control) {
        return Err(EngineError::Config(format!("agent name {name:?}: no control characters")));
    }
    Ok(())
}

/// A blob the store returned for `name`, decoded as hostile input; the
/// metadata of another agent under that name is refused.
fn decode_for(name: &str, blob: &[u8], server: &str) -> Result<AgentMetadata, EngineError> {
    let md = AgentMetadata::decode(blob)?;
    if md.name != name {
        return Err(rdv_err(server, format!("asked for {name:?}, got the metadata of {:?}", md.name)));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::desc::tests::sample;

    /// What every rendezvous does: a publish is found, a second replaces
    /// it, a withdraw (twice is fine) leaves a lookup to wait and report
    /// how long it waited.
    pub(super) fn publish_replace_withdraw(rdv: &dyn Rendezvous) {
        let md = sample();
        rdv.publish(&md).unwrap();
        assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap(), md);
        let mut newer = md.clone();
        newer.memories.pop();
        rdv.publish(&newer).unwrap();
        assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap(), newer, "a publish replaces");
        rdv.withdraw("decode-0").unwrap();
        rdv.withdraw("decode-0").unwrap();
        match rdv.lookup("decode-0", Duration::from_millis(120)) {
            Err(EngineError::NotPublished { name, waited }) => assert_eq!((name.as_str(), waited), ("decode-0", Duration::from_millis(120))),
            r => panic!("{r:?}"),
        }
    }
}
