"""The training side: vLLM's ``TrainerWeightTransferEngine`` for the
backend ``gpudirect``, made by ``WeightTransferTrainerFactory.trainer_init``
with a :class:`GpudirectTrainerInitInfo`."""

from __future__ import annotations

import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Dict, List, Optional, Set

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from .. import Agent, EngineError, EngineTimeoutError, Rendezvous, RendezvousServer
from . import _wire
from ._common import (
    Inbox,
    WeightTransferError,
    WeightTransferTimeout,
    check_timeout,
    check_workers,
    count,
    require_secret,
    trainer_name,
    worker_name,
)
from .worker import GpudirectWeightTransferInitInfo, GpudirectWeightTransferUpdateInfo, new_session


@dataclass
class GpudirectTrainerInitInfo(TrainerInitInfo):
    """The trainer's side of the handshake. The wire parameters
    (``bucket_bytes``, ``checksum``, ``timeout``) go to the workers in
    their init info, so the two sides cannot disagree."""

    backend: ClassVar[str] = "gpudirect"

    rendezvous: str
    """The gpudirect rendezvous server, "HOST:PORT", that the workers
    reach too."""
    num_workers: int
    """Every worker of every vLLM replica this trainer feeds."""
    group: str = "vllm-weights"
    serve_rendezvous: bool = False
    """Start the rendezvous server in the trainer, listening on
    ``rendezvous``, instead of using a running one."""
    bucket_bytes: int = 64 << 20
    checksum: bool = False
    timeout: float = 60.0
    """Seconds any one wait may take: a worker's init, a bucket's
    broadcast, a worker's acknowledgement, the client's calls."""
    secret_file: Optional[str] = None
    """The trainer's copy of the cluster's secret (default:
    ``GPUDIRECT_SECRET_FILE`` in its environment). The workers take theirs
    from their own environment only, never from what the trainer sends."""
    devices: Optional[List[str]] = None
    listen: Optional[str] = None
    worker_devices: Optional[List[str]] = None
    worker_listen: Optional[str] = None


class GpudirectTrainerWeightTransferEngine(TrainerWeightTransferEngine[GpudirectTrainerInitInfo]):
    """Packs the source's parameters into two registered buckets and
    sends each to every worker by one relay broadcast (the trainer's NIC
    carries one copy; workers forward to each other), a bucket's slot
    reused only after every worker acknowledged loading it.

    ``send_weights`` raises :class:`WeightTransferError` naming the worker,
    the version and the bucket when a worker fails, stalls or dies, within
    the init info's ``timeout``; it never reports a partial update as
    done."""

    init_info_cls = GpudirectTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: Optional[WeightSource] = None, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.info: Optional[GpudirectTrainerInitInfo] = None
        self.session = new_session()
        self.version = 0
        """The last version sent whole (every worker loaded every bucket)."""
        self._attempts = 0
        self._nonces: Dict[int, int] = {}
        self.refusals: Dict[str, int] = {}
        """Acknowledgements refused, by reason."""
        self.agent: Optional[Agent] = None
        self._server: Optional[RendezvousServer] = None
        self._inbox: Optional[Inbox] = None
        self._buckets: Any = None
        self._acks: Any = None
        self._workers: List[str] = []

    @classmethod
    def trainer_init(
        cls, init_info: GpudirectTrainerInitInfo, *, client: VLLMWeightSyncClient, source: Optional[WeightSource] = None
    ) -> "GpudirectTrainerWeightTransferEngine":
        """Opens the trainer's agent (on the sender), publishes it, has every
        worker join through ``client.init_weight_transfer_engine`` and
        loads them all, within ``timeout``."""
        if source is None:
            raise ValueError("the gpudirect trainer engine sends a WeightSource: pass source=")
        _wire.check_bucket_bytes(init_info.bucket_bytes)
        check_workers(init_info.num_workers)
        timeout = check_timeout(init_info.timeout)
        secret = require_secret(init_info.secret_file)
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        if not engine.is_sender:
            return engine
        engine.info = init_info
        try:
            engine._open(init_info, secret, timeout)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _open(self, info: GpudirectTrainerInitInfo, secret: Optional[str], timeout: float) -> None:
        if info.serve_rendezvous:
            self._server = RendezvousServer(info.rendezvous, secret_file=secret)
        self.agent = agent = Agent(trainer_name(info.group), devices=info.devices, listen=info.listen, secret_file=secret, timeout=timeout)
        self._acks = torch.zeros(info.num_workers * _wire.ACK_SLOT, dtype=torch.uint8)
        agent.register("acks", self._acks)
        rdv = Rendezvous(info.rendezvous, timeout=timeout, secret_file=secret)
        agent.publish(rdv)
        worker_info = GpudirectWeightTransferInitInfo(
            rendezvous=info.rendezvous,
            group=info.group,
            session=self.session,
            num_workers=info.num_workers,
            bucket_bytes=info.bucket_bytes,
            checksum=info.checksum,
            timeout=timeout,
            devices=info.worker_devices,
            listen=info.worker_listen,
        )
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            joined = exe.submit(self.client.init_weight_transfer_engine, asdict(worker_info))
            deadline = time.monotonic() + timeout
            self._workers = [worker_name(info.group, r) for r in range(info.num_workers)]
            try:
                for w in self._workers:
                    _raise_if_failed(joined, "the workers' init")
                    agent.lookup(w, rdv, max(deadline - time.monotonic(), 0.001))
            except EngineError as e:
                raise WeightTransferError(f"not every worker of {info.group!r} joined within {timeout:g} s: {e}") from e
            try:
                joined.result(timeout=max(deadline - time.monotonic(), 0.001))
            except FutureTimeout:
                raise WeightTransferTimeout(f"the workers' init_weight_transfer_engine did not return within {timeout:g} s") from None
        finally:
            # Never joined: a client call that hangs must not hang the trainer.
            exe.shutdown(wait=False)
        workers = set(self._workers)
        self._inbox = Inbox(agent, lambda peer: peer in workers, self.refusals, "not_a_worker", limit=64 * len(workers) + 64)

    def send_weights(self, weight_version: Optional[str] = None) -> None:
        """One update: ``start_weight_update``, the workers'
        ``update_weights`` run concurrently with the buckets, then
        ``finish_weight_update(weight_version)``. Called on every trainer
        rank; only the sender sends."""
        assert self.source is not None
        source = self.source
        meta = source.metadata()
        if not self.is_sender:
            for _ in source:
                pass
            return
        info, agent = self.info, self.agent
        if info is None or agent is None:
            raise WeightTransferError("the gpudirect trainer engine is shut down")
        # Every attempt takes a version of its own, a failed one too: a late
        # chunk of a failed attempt is then never taken for its retry's.
        self._attempts += 1
        version = self._attempts
        update = GpudirectWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
            shapes=[list(m.shape) for m in meta],
            version=version,
            session=self.session,
        )
        _bounded(self.client.start_weight_update, (), info.timeout, f"start_weight_update before version {version}")
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            receiving = exe.submit(self.client.update_weights, asdict(update))
            self._push(source, meta, update, receiving)
            try:
                receiving.result(timeout=info.timeout)
            except FutureTimeout:
                raise WeightTransferTimeout(f"the workers' update_weights of version {version} did not return within {info.timeout:g} s") from None
            except Exception as e:
                raise WeightTransferError(f"version {version}: the inference side's update_weights failed after every bucket was acknowledged: {e}") from e
        finally:
            # A worker that died leaves its call unanswered: never joined.
            exe.shutdown(wait=False)
        self.version = version
        _bounded(self.client.finish_weight_update, (weight_version,), info.timeout, f"finish_weight_update of version {version}")

    def _push(self, source: WeightSource, meta: List[ParamMeta], update: GpudirectWeightTransferUpdateInfo, receiving: Future) -> None:
        assert self.info is not None and self.agent is not None and self._inbox is not None
        info, agent = self.info, self.agent
        plan = _wire.plan(update.nbytes(), info.bucket_bytes)
        slot = _wire.HEADER + info.bucket_bytes
        version, session = update.version, int(self.session, 16)
        nonces = self._nonces = {}
        casts: Dict[int, Any] = {}
        acked: Dict[int, Set[str]] = {}
        shipped = 0  # buckets sent so far; the next is being filled

        def ship(k: int) -> None:
            base = (k % 2) * slot
            length = plan.length(k)
            payload = self._buckets[base + _wire.HEADER : base + _wire.HEADER + length]
            device = self._buckets.device
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            head = _wire.Header(session, version, k, length, _wire.checksum(payload) if info.checksum else 0)
            self._buckets[base : base + _wire.HEADER].copy_(torch.frombuffer(bytearray(head.pack()), dtype=torch.uint8))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            nonces[k] = secrets.randbits(32)
            put = _wire.Note("put", session, version, k, nonce=nonces[k])
            cast = agent.broadcast("b", base, _wire.HEADER + length, [(w, "b", base) for w in self._workers], put.encode())
            cast.post()
            casts[k] = cast
            # Bucket k + 1 is filled next, into bucket k - 1's slot: that
            # bucket must be whole at every worker and acknowledged by each
            # before its first byte is overwritten (settling it only when
            # k + 1 ships would tear it while it is in flight or loading).
            self._settle(k - 1, casts, acked, version, receiving)

        it = iter(source)
        spans = plan.by_parameter()
        for i, m in enumerate(meta):
            try:
                name, tensor = next(it)
            except StopIteration:
                raise WeightTransferError(f"the WeightSource ended after {i} of the {len(meta)} parameters its metadata() declared") from None
            if name != m.name or tensor.dtype != m.dtype or tuple(tensor.shape) != tuple(m.shape):
                raise WeightTransferError(
                    f"the WeightSource yielded {name!r} {tensor.dtype} {tuple(tensor.shape)} where metadata() declared {m.name!r} {m.dtype} {tuple(m.shape)}"
                )
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if i == 0:
                self._place(raw.device)
            for k, piece in spans[i]:
                while shipped < k:
                    ship(shipped)
                    shipped += 1
                base = (k % 2) * slot + _wire.HEADER + piece.at
                self._buckets[base : base + piece.length].copy_(raw[piece.start : piece.start + piece.length])
        while shipped < plan.count:
            ship(shipped)
            shipped += 1
        self._settle(plan.count - 1, casts, acked, version, receiving)

    def _place(self, device: Any) -> None:
        """The two bucket slots, registered, on the source's device (GPU
        memory with GPUDirect RDMA required)."""
        assert self.info is not None and self.agent is not None
        if self._buckets is not None and self._buckets.device == device:
            return
        if self._buckets is not None:
            self.agent.deregister("b")
            self._buckets = None
        buckets = torch.zeros(2 * (_wire.HEADER + self.info.bucket_bytes), dtype=torch.uint8, device=device)
        if device.type == "cuda":
            self.agent.register_gpu("b", buckets, policy="require")
        else:
            self.agent.register("b", buckets)
        self._buckets = buckets

    def _settle(self, k: int, casts: Dict[int, Any], acked: Dict[int, Set[str]], version: int, receiving: Future) -> None:
        """Bucket ``k`` whole at every worker and acknowledged by each (its
        slot is free again), or :class:`WeightTransferError` naming who."""
        if k < 0:
            return
        assert self.info is not None and self._inbox is not None
        info = self.info
        cast = casts.pop(k)
        try:
            cast.wait(info.timeout)
        except EngineTimeoutError:
            stuck = [f"{w} ({s})" for w, s in cast.receivers() if s != "whole"]
            raise WeightTransferTimeout(
                f"bucket {k} of version {version} did not reach every worker within {info.timeout:g} s: {', '.join(stuck)}"
            ) from None
        except EngineError as e:
            raise WeightTransferError(f"bucket {k} of version {version} did not reach every worker: {e}") from e
        want = set(self._workers)
        got = acked.setdefault(k, set())
        deadline = time.monotonic() + info.timeout
        session = int(self.session, 16)
        while got != want:
            if receiving.done() and receiving.exception() is not None:
                raise WeightTransferError(
                    f"bucket {k} of version {version}: the inference side's update_weights failed ({receiving.exception()}); "
                    f"no acknowledgement from {', '.join(sorted(want - got))}"
                ) from receiving.exception()
            # The deadline holds however many notifications are queued.
            if time.monotonic() >= deadline:
                raise WeightTransferTimeout(
                    f"bucket {k} of version {version}: no acknowledgement from {', '.join(sorted(want - got))} within {info.timeout:g} s "
                    "(the worker stalled, died or lost its link)"
                )
            n = self._inbox.get(min(deadline, time.monotonic() + 0.5))
            if n is None:
                continue
            peer, raw = n
            note = _wire.Note.decode(raw)
            if peer not in want:
                count(self.refusals, "not_a_worker")
            elif note is None or note.kind not in ("ack", "nak"):
                count(self.refusals, "malformed")
            elif note.session != session or note.version != version:
                count(self.refusals, "other_version")
            elif note.kind == "nak":
                raise WeightTransferError(f"worker {peer!r} gave up on version {version} at bucket {note.bucket}: {note.reason!r}")
            elif note.kind == "ack" and self._nonces.get(note.bucket) != note.nonce:
                # Only the bucket's put carries its nonce: an ack without it
                # claims a bucket the worker never received, and would free
                # a slot it may still be loading from.
                count(self.refusals, "unproven_ack")
            else:
                acked.setdefault(note.bucket, set()).add(peer)
        del acked[k]

    def shutdown(self) -> None:
        """Closes the agent (and the rendezvous server it started)."""
        if self._inbox is not None:
            self._inbox.close()
        if self.agent is not None:
            self.agent.close()
        if self._server is not None:
            self._server.close()
        self.agent = self._inbox = self._server = None
        self._buckets = self._acks = None
        self.info = None


def _bounded(call: Any, args: tuple, timeout: float, what: str) -> Any:
    """``call(*args)`` on the inference side, or
    :class:`WeightTransferTimeout` once ``timeout`` passed (the call is
    left running, never joined)."""
    exe = ThreadPoolExecutor(max_workers=1)
    try:
        return exe.submit(call, *args).result(timeout=timeout)
    except FutureTimeout:
        raise WeightTransferTimeout(f"{what}: the inference side did not answer within {timeout:g} s") from None
    finally:
        exe.shutdown(wait=False)


def _raise_if_failed(f: Future, what: str) -> None:
    if f.done() and f.exception() is not None:
        raise WeightTransferError(f"{what} failed on the inference side: {f.exception()}") from f.exception()

