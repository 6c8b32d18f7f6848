"""The shapes of what :mod:`gpudirect` takes and returns, for type
annotations: the literal strings an argument accepts and the dicts a call
returns. Lengths and offsets are in bytes everywhere."""

from __future__ import annotations

from typing import List, Literal, Tuple, TypedDict

__all__ = ["Op", "GpuPolicy", "Status", "Registration", "NicStats", "TransferStats", "PeerEvent", "BroadcastRefusals"]

Op = Literal["write", "read"]
"""What a request does: write local memory into the peer's, or read the peer's into local memory."""

GpuPolicy = Literal["require", "prefer", "host-staged"]
"""How GPU memory is registered: GPUDirect RDMA or an error; GPUDirect RDMA or, with a warning, staged through host memory; always staged."""

Status = Literal["idle", "in-flight", "done"]
"""Where a request or broadcast stands: never posted (or refused), posted and not finished, finished."""

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

