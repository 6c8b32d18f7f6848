"""gpudirect from Python: the transfer engine (agents, named memory,
transfers with a notification after the data, awaitable from asyncio),
whether GPUDirect RDMA works here for this job, and what an NCCL log says
about it.

Everything is the Rust library's (the same code as the ``gpudirect``
command and the Rust crate ``gpudirect_engine``); this package is a thin layer
that releases the GIL around every post and wait.

>>> import gpudirect
>>> report = gpudirect.doctor()
>>> report["verdict"]["line"]
'GPUDirect RDMA: ...'

One step of a KV-cache mover (the decode side registers ``"kv"`` and
hands over its ``metadata()``)::

    agent = gpudirect.Agent("prefill-0", devices=["mlx5_0"])
    agent.register("kv", kv_blocks)          # a numpy array, in place
    peer = agent.load_remote(decode_metadata)
    req = agent.prepare("write", [("kv", 0, peer, "kv", 0, kv_blocks.nbytes)], notify=b"layer 0")
    req.post()
    await req                                # or req.wait(timeout)

Weight sync: one trainer range into every inference agent's, the
trainer's NIC sending it once (receivers forward to each other)::

    cast = agent.broadcast("params", 0, nbytes, [(p, "weights", 0) for p in peers], b"step 7")
    cast.post()
    await cast                               # BroadcastIncompleteError names the dead
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import ctypes

from . import _aio, _gpu, types
from .types import GpuPolicy

from . import _native
from ._native import (
    AbortedError,
    AuthError,
    ConfigError,
    ControlError,
    DoctorError,
    DuplicateNameError,
    EmptyRequestError,
    EngineError,
    EngineTimeoutError,
    BroadcastIncompleteError,
    CudaError,
    GpudirectError,
    GpuMemoryError,
    GpuPlacementError,
    InFlightError,
    LengthMismatchError,
    MetadataError,
    MixedPeersError,
    NoRailError,
    NotificationTooLongError,
    NotPublishedError,
    PartlyPostedError,
    PeerLostError,
    RefusedError,
    Rendezvous,
    RendezvousError,
    RendezvousServer,
    Request,
    Broadcast,
    TooManyConnectionsError,
    UnknownMemoryError,
    UnknownPeerError,
    UnsupportedError,
    VerbsError,
    WrongPeerError,
)

__all__ = [
    "types",
    "Agent",
    "Request",
    "Broadcast",
    "Rendezvous",
    "RendezvousServer",
    "doctor",
    "explain_nccl_log",
    "fleet_check",
    "GpudirectError",
    "DoctorError",
    "EngineError",
    "AbortedError",
    "AuthError",
    "ConfigError",
    "ControlError",
    "DuplicateNameError",
    "EmptyRequestError",
    "EngineTimeoutError",
    "BroadcastIncompleteError",
    "CudaError",
    "GpuMemoryError",
    "GpuPlacementError",
    "InFlightError",
    "LengthMismatchError",
    "MetadataError",
    "MixedPeersError",
    "NoRailError",
    "NotificationTooLongError",
    "NotPublishedError",
    "PartlyPostedError",
    "PeerLostError",
    "RefusedError",
    "RendezvousError",
    "TooManyConnectionsError",
    "UnknownMemoryError",
    "UnknownPeerError",
    "UnsupportedError",
    "VerbsError",
    "WrongPeerError",
]


class Agent(_native.Agent):
    """An agent of the transfer engine: its NICs (``devices``; default:
    every RDMA device), the memory registered with it under names, the
    peers loaded into it, and the transfers between them.

    ``listen`` is where its control port binds, ``"IP:PORT"`` (port 0: a
    free one; ``agent.control_addr`` says which). The default is any
    address with a free port when the agent has a cluster secret, and
    ``"127.0.0.1:0"`` (this host only) when it has none, so one host works
    out of the box. For several hosts, give every agent and the rendezvous
    the same secret: ``secret_file=`` (or ``GPUDIRECT_SECRET_FILE`` in the
    environment) naming a file of 32 random bytes. A network ``listen``
    address without a secret raises :class:`AuthError` naming that fix,
    unless ``insecure=True`` (anyone who reaches the port is then
    believed). ``timeout`` (seconds) bounds a connection's setup;
    ``qps_per_rail`` sets the queue pairs per pair of NICs (1 to 8);
    ``max_connections`` the connections per NIC before the least recently
    used idle one is closed (default 64). ``metrics`` serves what
    :meth:`stats` returns over HTTP in Prometheus' text format (GET
    ``/metrics``, from threads of the agent's own): ``"PORT"`` on
    loopback (``"0"``: a free one; ``agent.metrics_addr`` says which) or
    ``"IP:PORT"``; ``""`` serves none; by default ``GPUDIRECT_METRICS``
    is read the same way. A bad value, or an address already taken,
    raises :class:`ConfigError`. To export through prometheus_client
    instead, see :class:`gpudirect.metrics.Collector`. Errors are :class:`EngineError`
    subclasses, one per kind of the Rust ``EngineError``, with its message.
    Lengths and offsets are in bytes everywhere; :mod:`gpudirect.types`
    names the literal strings and the dicts the calls take and return.
    """

    def register(self, name: str, buffer: Any) -> int:
        """Register host memory in place under ``name``; returns its length
        in bytes. ``buffer`` is a writable, C-contiguous buffer (bytearray,
        NumPy array, mmap), or an array that NumPy can view without copying
        (a CPU ``torch.Tensor``, anything with ``__array_interface__`` or
        CPU DLPack).

        The object stays alive, and a bytearray cannot be resized, until
        ``deregister(name)`` and until no prepared request names it: the
        registration holds a buffer export on it. A PyTorch tensor's
        storage is held too, so ``set_()`` or assigning ``.data`` cannot
        free the registered bytes; ``resize_`` that grows a tensor
        reallocates its storage in place, which nothing can stop: do not
        resize a registered tensor.
        """
        try:
            view = memoryview(buffer)
        except TypeError:
            view = memoryview(_host_array(name, buffer))
        if not view.c_contiguous:
            raise ValueError(f"{name}: the buffer is not C-contiguous: register a contiguous one (numpy.ascontiguousarray)")
        view = view.cast("B")
        if view.readonly:
            raise ValueError(f"{name}: the buffer is read-only: register a writable one (bytearray, a numpy array)")
        # A ctypes view holds a buffer export for as long as it lives, on
        # every CPython from 3.9 (the buffer API is in the stable ABI only
        # from 3.11).
        export = (ctypes.c_char * view.nbytes).from_buffer(view)
        return self._register_raw(name, ctypes.addressof(export), view.nbytes, (export, _gpu.owner(buffer)))

    def register_gpu(self, name: str, array: Any, *, policy: GpuPolicy = "require", gpu: Optional[int] = None) -> int:
        """Register a CUDA array (``__cuda_array_interface__`` or DLPack: a
        ``torch.Tensor`` on a GPU, CuPy, JAX) under ``name`` on the NICs
        nearest its GPU; returns its length in bytes.

        The range is judged before anything is registered: memory mapped
        with ``cuMemCreate``/``cuMemMap`` (PyTorch's ``expandable_segments``)
        registers when every mapping it spans is GPUDirect RDMA capable,
        and otherwise raises :class:`GpuMemoryError` naming the allocator
        setting to change; so do stream-ordered pool memory, another GPU's
        memory, unmapped holes, and small tensors that share a page with
        others. ``policy``: ``"require"`` (GPUDirect RDMA or an error),
        ``"prefer"`` (else staged through host memory, with a warning) or
        ``"host-staged"``. The array, and a PyTorch tensor's storage, are
        kept alive until ``deregister(name)`` and until no request names
        it, so ``set_()`` or assigning ``.data`` cannot free the registered
        memory (``resize_`` that grows a tensor reallocates its storage in
        place: do not resize a registered tensor).
        ``registration(name)["took"]`` says how long registering took.
        Lengths and offsets everywhere are in bytes.
        """
        ptr, nbytes, ordinal = _gpu.cuda_range(array, gpu)
        if nbytes == 0 or ptr == 0:
            raise ValueError(f"{name}: an empty array cannot be registered")
        return self._register_gpu_raw(name, ordinal, ptr, nbytes, _gpu.owner(array), policy)

    def close(self) -> None:
        """Close the agent now rather than when it is collected: its
        registrations are dropped (each buffer is released once no request
        holds it), its control port stops listening, and its NICs'
        resources go once no request or broadcast holds them. Awaits on it
        fail with :class:`EngineError`; every later call on it raises
        :class:`EngineError`. Requests already made keep working or fail on
        their own. Closing twice does nothing. ``with Agent(...) as a:``
        closes it at the end of the block."""
        d = getattr(self, "_aio_driver", None)
        if d is not None:
            d.close(EngineError(f"the agent {self.name!r} was closed while awaited"))
        super().close()

    def __enter__(self) -> "Agent":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def notification(self) -> Tuple[str, bytes]:
        """The next notification as ``(peer, bytes)``, awaited on the
        running asyncio loop (the agent's descriptor on the loop: no thread,
        no polling). Cancel-safe: a cancelled await takes nothing. For a
        bound, ``asyncio.wait_for(agent.notification(), t)``.
        """
        return await _aio.notification(self)

def _host_array(name: str, obj: Any) -> Any:
    """A NumPy view, without a copy, of host memory that does not speak the
    buffer protocol (a CPU torch.Tensor, __array_interface__, CPU DLPack)."""
    if not (hasattr(obj, "__array_interface__") or hasattr(obj, "__dlpack__") or hasattr(obj, "__array__")):
        raise ValueError(f"{name}: {type(obj).__name__} is not a buffer: register a bytearray, a NumPy array or a CPU tensor")
    try:
        import numpy as np
    except ImportError as e:
        raise ValueError(f"{name}: registering a {type(obj).__name__} needs NumPy to view it without a copy") from e
    if hasattr(obj, "__dlpack_device__") and int(obj.__dlpack_device__()[0]) != 1:
        raise ValueError(f"{name}: the array is not in host memory: register GPU memory with register_gpu()")
    if hasattr(obj, "__array_interface__"):
        arr = np.asarray(obj)
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
    else:
        arr = np.asarray(obj)
    if arr.base is None and arr is not obj:
        raise ValueError(f"{name}: {type(obj).__name__} could not be viewed without a copy: register its memory directly")
    return arr


_Path = Union[str, "os.PathLike[str]"]


def _path(p: Optional[_Path]) -> Optional[str]:
    return None if p is None else os.fspath(p)


def doctor(
    *,
    env_file: Optional[_Path] = None,
    pid: Optional[int] = None,
    nccl_log: Optional[_Path] = None,
    capture: Optional[_Path] = None,
    from_capture: Optional[_Path] = None,
    gpu: Optional[int] = None,
    device: Optional[str] = None,
) -> Dict[str, Any]:
    """Judge this machine, or a capture, for the job's environment.

    Returns the report ``gpudirect doctor --json`` prints (schema in
    docs/doctor-json.md): ``report["verdict"]["available"]`` says whether
    NCCL will use GPUDirect RDMA here, ``report["verdict"]["line"]`` says it
    in a sentence, ``report["findings"]`` holds every check.
    ``report["verdict"]["open"]`` lists what "available" would rest on that
    was not read or seen: deciding variables a job file leaves to the
    running job (``${NCCL_IB_HCA:-...}``, ``$(cmd)``, a Kubernetes
    ``valueFrom``) or names in a form not read, and machine facts not
    recorded (a PCIe path, a network plugin's library); then ``available``
    is false and the line says "cannot tell". ``report["verdict"]
    ["unsettled"]`` names those variables.

    The job's environment is this process's ``NCCL_*``/``UCX_*`` variables,
    or those of ``env_file`` (a job script, Dockerfile, Compose or
    Kubernetes YAML, Python or TOML file, read as the shell or launcher
    would; nothing in it runs), of process
    ``pid``, or those an NCCL log (``nccl_log``) shows NCCL read. With
    ``from_capture``, a capture written by ``capture=`` (or ``gpudirect
    doctor --capture``) is judged instead of this machine, with this
    process's variables laid over the captured ones.

    Raises DoctorError when an input cannot be read or a capture written.
    The GIL is released while the machine is probed.
    """
    text, _, _ = _native.doctor(
        env_file=_path(env_file),
        pid=pid,
        nccl_log=_path(nccl_log),
        capture=_path(capture),
        from_capture=_path(from_capture),
        gpu=gpu,
        device=device,
    )
    return json.loads(text)


def fleet_check(
    dir: Optional[_Path] = None,
    *,
    job: Optional[str] = None,
    rendezvous: Optional[str] = None,
    etcd: Optional[List[str]] = None,
    expect: Optional[int] = None,
    nodes: Optional[str] = None,
    wait: Optional[float] = None,
    since: Optional[int] = None,
    timeout: float = 30.0,
) -> Dict[str, Any]:
    """The job's GPUDirect RDMA verdict across its nodes, before launch.

    Judges every capture the nodes posted (``gpudirect fleet post``) with
    the doctor's judge and returns the report ``gpudirect fleet check
    --json`` prints (docs/fleet-json.md): ``report["available_everywhere"]``,
    ``report["line"]``, ``report["staging"]`` (the nodes that would stage,
    grouped by cause, with the fix and their names folded as
    ``node[003-007]``), ``report["differences"]`` and ``report["shared"]``.
    With ``expect``, nodes that sent no capture (after waiting up to
    ``wait`` seconds) are counted in ``report["missing"]``; with ``nodes``
    (a Slurm host list, ``"node[001-064]"``) they are also named in
    ``report["missing_nodes"]``, and captures from nodes not in it are
    listed in ``report["unexpected"]``, not judged, and fail the check.
    Captures beyond ``expect`` are counted in ``report["surplus"]`` and
    fail the check too (without names, a stray cannot be told apart).
    ``wait`` needs ``expect`` or ``nodes`` (what to wait for). With
    ``since`` (the job's start, seconds since the epoch:
    ``$SLURM_JOB_START_TIME``), a capture posted before it (an earlier
    run's, under the same job id) fails the check instead of being judged.
    The same checks as ``gpudirect fleet check``, made by the same code.

    The captures are read from exactly one place: ``dir`` (``dir/job/``,
    a folder every node shares), ``rendezvous`` (``"host:port"`` of
    ``gpudirect rendezvous``) or ``etcd`` (endpoint URLs); the last two
    need ``job`` and prove the cluster secret (``GPUDIRECT_SECRET_FILE``),
    each request within ``timeout`` seconds.

    Raises DoctorError when the captures cannot be listed, none or more
    than one place is given, the job id is not a plain name, ``wait`` has
    nothing to wait for, or ``expect`` and ``nodes`` are both given;
    ValueError for a negative or infinite ``wait`` or ``timeout``. The GIL is
    released while it waits and judges.
    """
    where = None if dir is None else os.fspath(dir)
    out, _, _ = _native.fleet_check(where, job=job, rendezvous=rendezvous, etcd=etcd, expect=expect, nodes=nodes, wait=wait, since=since, timeout=timeout)
    return json.loads(out)


def explain_nccl_log(text: str) -> Dict[str, Any]:
    """What an ``NCCL_DEBUG=INFO`` log says about GPUDirect RDMA.

    Returns the report ``gpudirect nccl-log --json`` prints:
    ``report["verdict"]`` is ``"used"``, ``"partial"``, ``"not-used"`` or
    ``"unknown"``; ``report["headline"]`` says it in a sentence (with the
    cost when not used); ``report["environment_judged"]`` judges the
    variables NCCL read by the doctor's rules.
    """
    out, _, _ = _native.explain_nccl_log(text)
    return json.loads(out)
