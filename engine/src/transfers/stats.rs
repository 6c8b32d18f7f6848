//! Counters of transfers, per request and per peer: plain atomics the
//! post and completion paths bump (one relaxed add each, no lock), and
//! the plain-data [`TransferStats`] they are read into.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// What a request, or every request of an agent to one peer, did so far
/// ([`TransferRequest::stats`](crate::TransferRequest::stats),
/// [`Agent::peer_stats`](crate::Agent::peer_stats)).
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

impl TransferStats {
    /// Both summed.
    pub(crate) fn plus(&self, o: &TransferStats) -> TransferStats {
        TransferStats {
            posts: self.posts + o.posts,
            bytes: self.bytes + o.bytes,
            completed: self.completed + o.completed,
            failed: self.failed + o.failed,
            refused: self.refused + o.refused,
            connects: self.connects + o.connects,
        }
    }
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

/// Broadcast messages this agent refused, by reason
/// ([`Agent::broadcast_refusals`](crate::Agent::broadcast_refusals)).
/// Every one came over a connection of a peer that proved the cluster's
/// secret, and is something no honest source or receiver sends (or a
/// broadcast this agent could not take); none was acted on, and a
/// warning named the peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct BroadcastRefusals {
    /// A start not sent by the source its plan names, naming another
    /// agent as this receiver, or reusing the id of a broadcast in
    /// progress here.
    pub forged: u64,
    /// A chunk of a broadcast no source started here.
    pub unknown: u64,
    /// A chunk from an agent that is neither its source nor the receiver
    /// owning that chunk, a forward asked for by anyone but the source,
    /// or a chunk past the plan's end.
    pub not_owner: u64,
    /// A start naming memory this agent did not publish (not registered
    /// under that name, or host-staged GPU memory), or a range past its
    /// end; or naming, for another receiver, a range that is not inside
    /// the memory that receiver published (in the metadata loaded here),
    /// its end past the integer limit included.
    pub unpublished: u64,
    /// A start naming a receiver (or a source) whose metadata this agent
    /// has not loaded, so it could not forward to it.
    pub unknown_peers: u64,
    /// A start that found this agent at its bound of broadcasts in
    /// progress (in all, or from that source).
    pub busy: u64,
    /// Bytes with a broadcast message's magic that do not decode as one.
    pub malformed: u64,
}

/// Why a broadcast message was refused: one counter each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Forged,
    Unknown,
    NotOwner,
    Unpublished,
    UnknownPeers,
    Busy,
    Malformed,
}

/// The counters behind [`BroadcastRefusals`].
#[derive(Default, Debug)]
pub(crate) struct RefusalCounters([AtomicU64; 7]);

impl RefusalCounters {
    pub(crate) fn count(&self, why: Refusal) {
        self.0[why as usize].fetch_add(1, Relaxed);
    }

    pub(crate) fn read(&self) -> BroadcastRefusals {
        let n = |why: Refusal| self.0[why as usize].load(Relaxed);
        BroadcastRefusals {
            forged: n(Refusal::Forged),
            unknown: n(Refusal::Unknown),
            not_owner: n(Refusal::NotOwner),
            unpublished: n(Refusal::Unpublished),
            unknown_peers: n(Refusal::UnknownPeers),
            busy: n(Refusal::Busy),
            malformed: n(Refusal::Malformed),
        }
    }
}
