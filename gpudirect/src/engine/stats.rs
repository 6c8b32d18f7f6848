//! Counters of transfers, per request and per peer: plain atomics the
//! post and completion paths bump (one relaxed add each, no lock), and
//! the plain-data [`TransferStats`] they are read into.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What a request, or every request of an agent to one peer, did so far
/// ([`TransferRequest::stats`](super::TransferRequest::stats),
/// [`Agent::peer_stats`](super::Agent::peer_stats)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TransferStats {
    /// Posts that went out (all or part of their work requests).
    pub posts: u64,
    /// Bytes of those posts (written or read; notifications not counted).
    pub bytes: u64,
    /// Posts that finished, every byte in place.
    pub completed: u64,
    /// Posts that went out and failed (`PeerLost`, `PartlyPosted`).
    pub failed: u64,
    /// `post` calls refused before anything went out (no connection
    /// could be made, a repost while in flight, ...).
    pub refused: u64,
    /// Connections set up to the peer by these posts: the first, and one
    /// per reconnect after a loss or an eviction.
    pub connects: u64,
}

#[derive(Default, Debug)]
pub(crate) struct Counters {
    posts: AtomicU64,
    bytes: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    refused: AtomicU64,
    connects: AtomicU64,
}

impl Counters {
    pub(crate) fn posted(&self, bytes: u64) {
        self.posts.fetch_add(1, Relaxed);
        self.bytes.fetch_add(bytes, Relaxed);
    }

    pub(crate) fn completed(&self) {
        self.completed.fetch_add(1, Relaxed);
    }

    pub(crate) fn failed(&self) {
        self.failed.fetch_add(1, Relaxed);
    }

    pub(crate) fn connected(&self) {
        self.connects.fetch_add(1, Relaxed);
    }

    pub(crate) fn refused(&self) {
        self.refused.fetch_add(1, Relaxed);
    }

    pub(crate) fn read(&self) -> TransferStats {
        TransferStats {
            posts: self.posts.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            completed: self.completed.load(Relaxed),
            failed: self.failed.load(Relaxed),
            refused: self.refused.load(Relaxed),
            connects: self.connects.load(Relaxed),
        }
    }
}
