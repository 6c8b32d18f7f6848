"""The shapes of what :mod:`gpudirect` takes and returns, for type
annotations: the literal strings an argument accepts and the dicts a call
returns. Lengths and offsets are in bytes everywhere."""

from __future__ import annotations

from typing import List, Literal, Tuple, TypedDict

__all__ = [
    "Op",
    "GpuPolicy",
    "Status",
    "Direction",
    "DataPath",
    "Registration",
    "NicStats",
    "TransferStats",
    "PeerEvent",
    "BroadcastRefusals",
    "PathTraffic",
    "NicTraffic",
    "LatencyHistogram",
    "OpStats",
    "PeerStats",
    "OtherPeers",
    "PeerEventCounts",
    "Refusals",
    "AgentStats",
]

Op = Literal["write", "read"]
"""What a request does: write local memory into the peer's, or read the peer's into local memory."""

GpuPolicy = Literal["require", "prefer", "host-staged"]
"""How GPU memory is registered: GPUDirect RDMA or an error; GPUDirect RDMA or, with a warning, staged through host memory; always staged."""

Status = Literal["idle", "in-flight", "done"]
"""Where a request or broadcast stands: never posted (or refused), posted and not finished, finished."""

Direction = Literal["out", "in"]
"""Which way bytes went through a NIC: out of local memory (this agent's writes, broadcast chunks it sends or forwards) or into it (its reads)."""

DataPath = Literal["gdr", "host", "staged"]
"""The path bytes took, from the registration of the local memory that moved them: GPU memory the NIC reaches
directly (GPUDirect RDMA: dma-buf or peer memory), host memory, or a GPU's bytes staged through host memory."""

class Registration(TypedDict):
    """What :meth:`Agent.registration` returns."""

    name: str
    nbytes: int
    took: float
    """Seconds registering took."""
    paths: List[Tuple[str, str]]
    """(device, how the NIC reaches the memory) for each NIC it is registered on."""
    skipped: List[Tuple[str, str]]
    """(device, why not) for each NIC it is not registered on."""

class NicStats(TypedDict):
    """What one NIC carried (:meth:`Agent.nic_stats`)."""

    device: str
    bytes: int
    posts: int
    qp_bytes: List[int]
    """Bytes per queue pair of the rail."""

class TransferStats(TypedDict):
    """Counts over requests (:meth:`Agent.peer_stats`, :meth:`Request.stats`)."""

    posts: int
    bytes: int
    completed: int
    failed: int
    refused: int
    connects: int

class PeerEvent(TypedDict, total=False):
    """Something that happened to a peer (:meth:`Agent.peer_events`):
    ``kind`` "lost" (with ``completion``), "replaced" (``old`` and ``new``
    instance ids) or "impostor" (``control`` and ``gid`` of connections
    made under the peer's name from elsewhere than its metadata)."""

    kind: str
    peer: str
    completion: str
    old: int
    new: int
    control: str
    gid: str

class BroadcastRefusals(TypedDict):
    """Broadcast messages an agent refused, by reason (:meth:`Agent.broadcast_refusals`)."""

    forged: int
    unknown: int
    not_owner: int
    unpublished: int
    unknown_peers: int
    busy: int
    malformed: int


class PathTraffic(TypedDict):
    """What one NIC moved one way on one path (:class:`NicTraffic`)."""

    direction: Direction
    path: DataPath
    bytes: int
    """Bytes written or read (notifications not counted)."""
    posts: int
    """Posts (or slices of one) that carried bytes of this path."""

class NicTraffic(TypedDict):
    """One NIC's traffic (:class:`AgentStats`)."""

    device: str
    """The RDMA device."""
    traffic: List[PathTraffic]
    """Every (direction, path) pair, zeros included."""

class LatencyHistogram(TypedDict):
    """Request latencies, from post to the completion that finished the post (done or failed), of one post in 8 per
    posting thread (:class:`OpStats`)."""

    bounds: List[float]
    """Upper bounds of the buckets, in seconds, ascending."""
    counts: List[int]
    """Observations per bucket, not cumulative: ``counts[i]`` those at most ``bounds[i]`` seconds and above the
    bound before; one more than ``bounds``, the last those above every bound."""
    count: int
    """Observations in all."""
    sum_seconds: float
    """Their sum, in seconds."""

class OpStats(TypedDict):
    """The requests of one op (:class:`AgentStats`)."""

    op: Op
    requests: TransferStats
    """Every request of the op, to every peer, summed."""
    latency: LatencyHistogram

class PeerStats(TypedDict):
    """One of the busiest peers (:class:`AgentStats`)."""

    name: str
    requests: TransferStats
    """Every request to it, both ops summed."""
    connections: int
    """Connections (queue pairs) to it alive now."""

class OtherPeers(TypedDict):
    """The peers not listed one by one, summed (:class:`AgentStats`)."""

    peers: int
    """How many."""
    requests: TransferStats
    connections: int

class PeerEventCounts(TypedDict):
    """What happened to peers since the agent started, whoever took the events (:class:`AgentStats`)."""

    lost: int
    """Connections whose queue pair failed."""
    replaced: int
    """Peers that restarted."""
    impostors: int
    """Names claimed before their metadata was loaded, then found to be someone else."""

class Refusals(TypedDict):
    """What the agent refused or dropped, by reason; each was also logged (:class:`AgentStats`)."""

    control: int
    """Control requests refused (as :meth:`Agent.refused_requests`)."""
    unknown_sender: int
    """Messages dropped because the connection they came on was no longer known."""
    metadata_seal: int
    """Peers' metadata refused because its seal did not verify (from a rendezvous, or given to :meth:`Agent.load_remote`)."""
    broadcast: BroadcastRefusals
    """As :meth:`Agent.broadcast_refusals`."""

class AgentStats(TypedDict):
    """What an agent did so far, in one snapshot (:meth:`Agent.stats`): what its metrics endpoint serves, and what
    :class:`gpudirect.metrics.Collector` hands to prometheus_client. Every count is since the agent started and never
    goes down."""

    agent: str
    """The agent's name."""
    uptime_seconds: float
    """How long the agent had run when the snapshot was taken (a monotonic clock): rates between two snapshots divide
    by its difference."""
    nics: List[NicTraffic]
    """Per NIC, in the agent's NIC order."""
    ops: List[OpStats]
    """Per op: "write", then "read"."""
    peers: List[PeerStats]
    """The busiest peers by bytes (then by name), at most 16, busiest first."""
    other_peers: OtherPeers
    """Every other peer, summed."""
    connections: int
    """Connections (queue pairs) alive now, to every peer."""
    peer_events: PeerEventCounts
    refusals: Refusals
