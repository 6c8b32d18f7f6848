//! One typed snapshot of what an agent did ([`AgentStats`]), read from
//! the counters the data path bumps (relaxed atomics) and from the few
//! tables that change only as peers come and go. Taking one never holds
//! a lock the post path takes.

use gpudirect::metrics::{DataPath, Direction, Histogram, PathTraffic};
use crate::transfers::core::Core;
use crate::transfers::stats::{BroadcastRefusals, TransferStats};
use crate::transfers::transfer::Op;

/// Peers listed one by one in a snapshot, the busiest by bytes; the
/// others are summed in [`AgentStats::other_peers`].
pub const MAX_LISTED_PEERS: usize = 16;

/// What an agent did so far: from [`Agent::stats`](crate::Agent::stats).
/// Every count is since the agent started and never goes down.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct AgentStats {
    /// The agent's name.
    pub agent: String,
    /// How long the agent has run when the snapshot was taken (a
    /// monotonic clock): rates between two snapshots divide by its
    /// difference, whatever the scraper's own timing.
    pub uptime: std::time::Duration,
    /// Per NIC, in the agent's NIC order: bytes and posts by direction
    /// and path.
    pub nics: Vec<NicTraffic>,
    /// Per op: the requests' counters and latencies.
    pub ops: Vec<OpStats>,
    /// The [`MAX_LISTED_PEERS`] peers that moved the most bytes (then by
    /// name), busiest first.
    pub peers: Vec<PeerStats>,
    /// Every other peer, summed.
    pub other_peers: OtherPeers,
    /// Connections (queue pairs) alive now, to every peer.
    pub connections: usize,
    /// What happened to peers, by kind.
    pub peer_events: PeerEventCounts,
    /// What this agent refused, by reason.
    pub refusals: Refusals,
}

/// One NIC's traffic.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct NicTraffic {
    /// The RDMA device.
    pub device: String,
    /// Every (direction, path) pair, zeros included.
    pub traffic: Vec<PathTraffic>,
}

impl NicTraffic {
    /// Bytes that went `direction` on `path`.
    pub fn bytes(&self, direction: Direction, path: DataPath) -> u64 {
        self.traffic.iter().filter(|t| t.direction == direction && t.path == path).map(|t| t.bytes).sum()
    }
}

/// The requests of one op.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct OpStats {
    /// Which op.
    pub op: Op,
    /// Every request of it, to every peer, summed.
    pub requests: TransferStats,
    /// From post to the completion that finished the post (done or
    /// failed).
    pub latency: Histogram,
}

/// One peer's requests.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PeerStats {
    /// Its name.
    pub name: String,
    /// Every request to it, both ops summed.
    pub requests: TransferStats,
    /// Connections (queue pairs) to it alive now.
    pub connections: usize,
}

/// The peers not listed, summed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct OtherPeers {
    /// How many.
    pub peers: usize,
    /// Their requests, summed.
    pub requests: TransferStats,
    /// Their connections alive now.
    pub connections: usize,
}

/// What happened to peers, counted since the agent started (whoever
/// took them from [`Agent::peer_events`](crate::Agent::peer_events)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PeerEventCounts {
    /// Connections whose queue pair failed ([`PeerEvent::Lost`](crate::PeerEvent::Lost)).
    pub lost: u64,
    /// Peers that restarted ([`PeerEvent::Replaced`](crate::PeerEvent::Replaced)).
    pub replaced: u64,
    /// Names claimed before their metadata was loaded, then found to be
    /// someone else ([`PeerEvent::Impostor`](crate::PeerEvent::Impostor)).
    pub impostors: u64,
}

/// What the agent refused, by reason; each was also logged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Refusals {
    /// Control requests refused ([`Agent::refused_requests`](crate::Agent::refused_requests)).
    pub control: u64,
    /// Broadcast messages refused ([`Agent::broadcast_refusals`](crate::Agent::broadcast_refusals)).
    pub broadcast: BroadcastRefusals,
    /// Messages dropped because the connection they came on was no
    /// longer known here (closed, and pushed out of the bounded memory
    /// of closed connections).
    pub unknown_sender: u64,
    /// Peers' metadata refused because its seal did not verify: from a
    /// rendezvous ([`Agent::lookup`](crate::Agent::lookup)) or given to
    /// [`Agent::load_remote`](crate::Agent::load_remote).
    pub metadata_seal: u64,
}

/// The snapshot of the agent of `core`.
pub(crate) fn take(core: &Core) -> AgentStats {
    let pool = &core.pool;
    let nics = pool.nics.iter().map(|n| NicTraffic { device: n.desc.device.clone(), traffic: n.paths.read() }).collect();
    let by_peer = core.every_peer();
    let mut ops = [(Op::Write, TransferStats::default()), (Op::Read, TransferStats::default())];
    for (_, [w, r]) in &by_peer {
        ops[0].1 = ops[0].1.plus(w);
        ops[1].1 = ops[1].1.plus(r);
    }
    let ops = ops.into_iter().map(|(op, requests)| OpStats { op, requests, latency: core.latency[op.direction() as usize].read() }).collect();
    let conns = pool.connections_by_peer();
    let mut peers: Vec<PeerStats> = by_peer
        .into_iter()
        .map(|(name, [w, r])| PeerStats { connections: conns.get(name.as_str()).copied().unwrap_or(0), requests: w.plus(&r), name })
        .collect();
    peers.sort_by(|a, b| b.requests.bytes.cmp(&a.requests.bytes).then_with(|| a.name.cmp(&b.name)));
    let mut other_peers = OtherPeers::default();
    for p in peers.drain(MAX_LISTED_PEERS.min(peers.len())..) {
        other_peers.peers += 1;
        other_peers.requests = other_peers.requests.plus(&p.requests);
        other_peers.connections += p.connections;
    }
    let [lost, replaced, impostors] = pool.events.lock().seen;
    AgentStats {
        agent: pool.name.to_string(),
        uptime: core.started.elapsed(),
        nics,
        ops,
        peers,
        other_peers,
        connections: pool.connections(),
        peer_events: PeerEventCounts { lost, replaced, impostors },
        refusals: Refusals {
            control: pool.refused(),
            broadcast: core.cast_refusals.read(),
            unknown_sender: core.unknown_sender.load(std::sync::atomic::Ordering::Relaxed),
            metadata_seal: core.metadata_seal.load(std::sync::atomic::Ordering::Relaxed),
        },
    }
}
