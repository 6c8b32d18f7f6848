//! What happened to peers' connections, for applications that want to
//! know without waiting for a transfer to fail: a plain-data leaf, kept
//! by the connection pool in a bounded queue.

use std::collections::VecDeque;

use gpudirect::WcError;

/// Most events kept; past it the oldest go (and are counted as dropped).
pub const MAX_PEER_EVENTS: usize = 1024;

/// Something that happened to a peer, as [`Agent::peer_events`](crate::Agent::peer_events) reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEvent {
    /// A connection to `peer` failed (the peer died, its memory went
    /// away, the link did) and was retired; transfers in flight on it
    /// failed with [`EngineError::PeerLost`](crate::EngineError::PeerLost).
    /// The next transfer reconnects; after a restart, load the peer's new
    /// metadata first.
    Lost {
        /// The peer agent.
        peer: String,
        /// The failed completion that showed it.
        completion: WcError,
    },
    /// `peer` restarted: its run `new` replaced run `old` (the
    /// [`AgentMetadata::instance`](crate::AgentMetadata::instance)es),
    /// seen when its new metadata was loaded or its new run connected.
    /// Connections to the old run were retired.
    Replaced {
        /// The peer agent.
        peer: String,
        /// The run this agent knew.
        old: u64,
        /// The run that replaced it.
        new: u64,
    },
    /// Connections made under `peer`'s name before its metadata was loaded
    /// here came from another control address or GID than that metadata
    /// gives: another member of the cluster claimed the name. They were
    /// retired when the metadata was loaded; the next transfer connects
    /// to the agent the metadata describes.
    Impostor {
        /// The name claimed.
        peer: String,
        /// The control address the claimant gave.
        control: std::net::SocketAddr,
        /// The GID it sent from.
        gid: gpudirect::Gid,
    },
}

/// The bounded queue of events.
#[derive(Default)]
pub(crate) struct Events {
    queue: VecDeque<PeerEvent>,
    dropped: u64,
    /// Every event so far, by kind (lost, replaced, impostor): what a
    /// snapshot reports, whoever took the queue.
    pub(crate) seen: [u64; 3],
}

impl Events {
    pub(crate) fn push(&mut self, e: PeerEvent) {
        let kind = match e {
            PeerEvent::Lost { .. } => 0,
            PeerEvent::Replaced { .. } => 1,
            PeerEvent::Impostor { .. } => 2,
        };
        self.seen[kind] += 1;
        if self.queue.len() == MAX_PEER_EVENTS {
            self.queue.pop_front();
            self.dropped += 1;
        }
        self.queue.push_back(e);
    }

    /// Every event kept, oldest first, and how many were dropped since
    /// the last take.
    pub(crate) fn take(&mut self) -> (Vec<PeerEvent>, u64) {
        (self.queue.drain(..).collect(), std::mem::take(&mut self.dropped))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_is_bounded_and_counts_what_it_dropped() {
        let mut e = Events::default();
        for i in 0..MAX_PEER_EVENTS as u64 + 3 {
            e.push(PeerEvent::Replaced { peer: "p".into(), old: i, new: i + 1 });
        }
        let (got, dropped) = e.take();
        assert_eq!((got.len(), dropped), (MAX_PEER_EVENTS, 3));
        assert_eq!(got[0], PeerEvent::Replaced { peer: "p".into(), old: 3, new: 4 });
        assert_eq!(e.take(), (vec![], 0));
    }
}
