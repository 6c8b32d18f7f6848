"""The native module of :mod:`gpudirect` (PyO3 over the Rust library).
Use the names :mod:`gpudirect` exports; ``gpudirect.Agent`` adds
``register``, ``register_gpu``, ``close`` and ``notification`` to the
class here. Lengths and offsets are in bytes everywhere."""

from typing import Any, Generator, List, Optional, Tuple, final

from .types import AgentStats, BroadcastRefusals, GpuPolicy, NicStats, Op, PeerEvent, Registration, Status, TransferStats

class GpudirectError(Exception):
    """Base class of every error gpudirect raises."""

class DoctorError(GpudirectError):
    """The doctor could not run: an input (capture, env file, process, NCCL log) could not be read, or a capture could not be written."""

def doctor(
    *,
    env_file: Optional[str] = None,
    pid: Optional[int] = None,
    nccl_log: Optional[str] = None,
    capture: Optional[str] = None,
    from_capture: Optional[str] = None,
    gpu: Optional[int] = None,
    device: Optional[str] = None,
    verbose: bool = False,
) -> Tuple[str, str, int]:
    """Judge this machine (or a capture) for GPUDirect RDMA: (JSON report,
    the text the command prints, its exit status). Use :func:`gpudirect.doctor`,
    which returns the report as a dict."""

def fleet_check(
    dir: Optional[str] = None,
    *,
    job: Optional[str] = None,
    rendezvous: Optional[str] = None,
    etcd: Optional[List[str]] = None,
    expect: Optional[int] = None,
    nodes: Optional[str] = None,
    wait: Optional[float] = None,
    since: Optional[int] = None,
    timeout: float = 30.0,
) -> Tuple[str, str, int]:
    """Judge every node's capture of a job together, from a shared folder,
    the rendezvous server or etcd: (JSON report, the text the command
    prints, its exit status). Use :func:`gpudirect.fleet_check`, which
    returns the report as a dict."""

def explain_nccl_log(text: str) -> Tuple[str, str, int]:
    """What an ``NCCL_DEBUG=INFO`` log says about GPUDirect RDMA: (JSON
    report, the text the command prints, its exit status)."""

class EngineError(GpudirectError):
    """A transfer-engine error; each kind has its subclass. The message is the Rust EngineError's, in Python's spellings."""

class VerbsError(EngineError):
    """A verbs call failed (registration, queue pair, posting, polling)."""

class GpuMemoryError(EngineError):
    """Device memory a NIC cannot be given; the message names the fix."""

class CudaError(EngineError):
    """CUDA cannot be used: no driver, no such GPU, or a driver call failed."""

class ControlError(EngineError):
    """The control connection to a peer failed (connect, handshake)."""

class MetadataError(EngineError):
    """Metadata from a peer, or handed over, is not a valid agent description."""

class GpuPlacementError(EngineError):
    """No NIC of this agent may carry the GPU's memory zero-copy; the message names each NIC and the fix."""

class UnknownPeerError(EngineError):
    """No agent of that name was loaded here: load its metadata first."""

class UnknownMemoryError(EngineError):
    """The agent has no memory registered under that name."""

class DuplicateNameError(EngineError):
    """Memory is already registered under that name."""

class PeerLostError(EngineError):
    """A transfer to the peer failed (it died, its memory went away, the link did); post again to reconnect."""

class AbortedError(EngineError):
    """The transfer was aborted (Request.abort()): its connection was flushed and retired; post again to reconnect."""

class PartlyPostedError(EngineError):
    """Posting stopped part way; the transfer failed and may be posted again."""

class AuthError(EngineError):
    """A peer, its request or its metadata was not believed (the cluster's secret, or not what was loaded)."""

class RefusedError(EngineError):
    """The peer's agent refused the connection."""

class WrongPeerError(EngineError):
    """The control address answered as another agent: its metadata is stale."""

class LengthMismatchError(EngineError):
    """A local and a remote range of one entry differ in length."""

class MixedPeersError(EngineError):
    """A request names the memory of several agents; a request targets one."""

class EmptyRequestError(EngineError):
    """A transfer request needs at least one entry."""

class InFlightError(EngineError):
    """The request is still in flight: wait for it before posting it again."""

class EngineTimeoutError(EngineError):
    """Waiting for a transfer or a notification took longer than allowed."""

class BroadcastIncompleteError(EngineError):
    """A broadcast ended with receivers that did not get the data (named in the message); every other receiver has its copy."""

class NotificationTooLongError(EngineError):
    """A notification longer than the engine carries."""

class TooManyConnectionsError(EngineError):
    """The agent has its maximum of connections."""

class NoRailError(EngineError):
    """No pair of NICs reaches all of the request's memory."""

class RendezvousError(EngineError):
    """A rendezvous store could not be reached, or refused a request."""

class NotPublishedError(EngineError):
    """Nothing was published under the name within the wait."""

class ConfigError(EngineError):
    """The configuration cannot work; the message says what to change."""

class UnsupportedError(EngineError):
    """Something the engine does not do yet; the message says what instead."""

def _error_kinds() -> List[Tuple[str, BaseException]]:
    """One error of each kind with its message (for tests)."""

@final
class Rendezvous:
    """A client of a rendezvous server, where agents publish and look up each other's metadata."""

    def __init__(self, server: str, *, timeout: float = 10.0, secret_file: Optional[str] = None) -> None:
        """``server`` is "HOST:PORT"; ``timeout`` bounds each request, in seconds;
        ``secret_file`` (or ``GPUDIRECT_SECRET_FILE``) holds the cluster's secret."""

@final
class RendezvousServer:
    """A rendezvous server in this process, serving until closed."""

    def __init__(self, listen: str = "127.0.0.1:0", *, secret_file: Optional[str] = None) -> None:
        """Binds ``listen`` ("IP:PORT"; port 0: a free one). A network address
        needs the cluster's secret: ``secret_file``, or the environment's."""
    @property
    def addr(self) -> str:
        """Where it listens, as "IP:PORT"."""
    def close(self) -> None:
        """Stops serving."""

class Agent:
    """An agent of the transfer engine; see :class:`gpudirect.Agent`."""

    def __init__(
        self,
        name: str,
        *,
        devices: Optional[List[str]] = None,
        listen: Optional[str] = None,
        secret_file: Optional[str] = None,
        insecure: bool = False,
        timeout: float = 30.0,
        qps_per_rail: Optional[int] = None,
        max_connections: Optional[int] = None,
        metrics: Optional[str] = None,
    ) -> None:
        """Opens the NICs (``devices``; default every RDMA device) and starts
        the control listener (``listen``, "IP:PORT"). ``timeout`` (seconds)
        bounds connection setup; ``qps_per_rail`` queue pairs per pair of
        NICs; ``max_connections`` per NIC. ``metrics`` serves the agent's
        metrics over HTTP (Prometheus' text format, GET ``/metrics``):
        "PORT" (on loopback; "0": a free one) or "IP:PORT"; "" serves none;
        None (the default) reads ``GPUDIRECT_METRICS`` the same way. A value
        of neither form, or an address that cannot be bound, raises
        :class:`ConfigError`."""
    @property
    def name(self) -> str:
        """This agent's name (also after close)."""
    @property
    def control_addr(self) -> str:
        """Where its control port listens, as "IP:PORT"."""
    @property
    def metrics_addr(self) -> Optional[str]:
        """Where its metrics endpoint listens, as "IP:PORT" (the port it got when 0 was asked for); None when it serves none."""
    def close(self) -> None:
        """Release the agent now; later calls raise :class:`EngineError`."""
    def _register_raw(self, name: str, addr: int, len: int, keep: object) -> int: ...
    def _register_gpu_raw(self, name: str, gpu: int, ptr: int, len: int, keep: object, policy: str) -> int: ...
    def registration(self, name: str) -> Registration:
        """What the registration ``name`` is: its size, how long registering took, which NICs carry it."""
    def deregister(self, name: str) -> None:
        """Remove a registration; its buffer is released once no request holds it."""
    def metadata(self) -> bytes:
        """This agent's sealed metadata (its memory, NICs, control address), for ``load_remote`` on its peers."""
    def load_remote(self, md: bytes) -> str:
        """Load a peer's metadata; returns its name. Connections made under that name from elsewhere are retired."""
    def publish(self, rendezvous: Rendezvous) -> None:
        """Publish this agent's metadata in the rendezvous (again after registering more)."""
    def lookup(self, name: str, rendezvous: Rendezvous, timeout: float = 30.0) -> str:
        """Look ``name`` up in the rendezvous, waiting up to ``timeout`` seconds for it, and load it; returns its name."""
    def prepare(self, op: Op, entries: List[Tuple[str, int, str, str, int, int]], notify: Optional[bytes] = None) -> "Request":
        """A request: each entry is (local name, local offset, peer, remote name, remote offset, length), in bytes;
        ``notify`` reaches the peer after every byte of it."""
    def broadcast(self, source: str, offset: int, length: int, targets: List[Tuple[str, str, int]], notify: bytes) -> "Broadcast":
        """``length`` bytes of local ``source`` from ``offset`` into each target (peer, remote name, remote offset),
        each receiver notified ``notify`` once its copy is whole."""
    def notifications(self) -> List[Tuple[str, bytes]]:
        """Notifications delivered so far, as (peer, bytes); never waits."""
    def wait_notification(self, timeout: Optional[float] = None) -> Tuple[str, bytes]:
        """The next notification, waiting ``timeout`` seconds or forever (the GIL released)."""
    def _event_fd(self) -> int: ...
    def _clear_events(self) -> None: ...
    def _poll_notification(self) -> Optional[Tuple[str, bytes]]: ...
    def nic_stats(self) -> List[NicStats]:
        """What each NIC carried."""
    def peer_stats(self, peer: str) -> Optional[TransferStats]:
        """What every request to ``peer`` did; None before one was prepared."""
    def connections(self) -> int:
        """Connections alive now (set up by either side)."""
    def peer_events(self) -> Tuple[List[PeerEvent], int]:
        """What happened to peers since the last call, and how many events were dropped unread."""
    def refused_requests(self) -> int:
        """Control requests refused so far (unproven, not as loaded, malformed)."""
    def broadcast_refusals(self) -> BroadcastRefusals:
        """Broadcast messages refused so far, by reason (each also logged with the peer)."""
    def stats(self) -> AgentStats:
        """What the agent did so far, in one snapshot (what its metrics endpoint serves): per NIC the bytes and posts
        by direction and path, per op the requests and their latencies, the busiest peers, connections, peer events
        and refusals."""

@final
class Broadcast:
    """One range of the source's memory into many receivers; post it, then wait, poll or await it."""

    @property
    def agent(self) -> Agent:
        """The source agent."""
    @property
    def nbytes(self) -> int:
        """Bytes each receiver gets."""
    def post(self) -> None:
        """Start it (again, once the last finished)."""
    def status(self) -> Status:
        """Where it stands, never waiting."""
    def wait(self, timeout: Optional[float] = None) -> None:
        """Until every receiver is whole or named failed (:class:`BroadcastIncompleteError`)."""
    def receivers(self) -> List[Tuple[str, str]]:
        """Each receiver and how it stands: "pending", "whole" or "failed: <why>"."""
    def _poll_completed(self) -> bool: ...
    def __await__(self) -> Generator[Any, None, None]:
        """``await broadcast``: as :meth:`wait`, on the running asyncio loop."""

@final
class Request:
    """A prepared transfer to one peer: post it, then wait, poll its status, or ``await`` it."""

    @property
    def agent(self) -> Agent:
        """The agent that prepared it."""
    @property
    def peer(self) -> str:
        """The peer it transfers to or from."""
    @property
    def nbytes(self) -> int:
        """Bytes it moves."""
    def post(self) -> None:
        """Post it (again, once the last post finished)."""
    def status(self) -> Status:
        """Where it stands, never waiting."""
    def wait(self, timeout: Optional[float] = None) -> None:
        """Until every byte is in place (``timeout`` seconds, or forever); raises its failure."""
    def abort(self) -> bool:
        """Give up on the post in flight: it fails with :class:`AbortedError`, its connection is flushed and retired (other posts on it fail too); whether one was in flight."""
    def _poll_completed(self) -> bool: ...
    def stats(self) -> TransferStats:
        """What its posts did."""
    def __await__(self) -> Generator[Any, None, None]:
        """``await request``: as :meth:`wait`, on the running asyncio loop."""
