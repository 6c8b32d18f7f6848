"""The inference side: vLLM's ``WeightTransferEngine`` for the backend
``gpudirect``, made in each vLLM worker by
``WeightTransferEngineFactory.create_engine``."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from .. import Agent, EngineError, Rendezvous
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


@dataclass
class GpudirectWeightTransferInitInfo(WeightTransferInitInfo):
    """What a worker needs to join a trainer; the trainer engine sends it
    (``client.init_weight_transfer_engine``), with the same wire
    parameters it uses itself.

    Each worker's rank is ``rank_offset`` plus its place among all of a
    vLLM deployment's workers (data-parallel index times TP x PP, plus its
    rank), as vLLM's NCCL backend counts; ranks run from 0 to
    ``num_workers - 1``."""

    rendezvous: str
    """The gpudirect rendezvous server, "HOST:PORT"."""
    group: str
    """The name the trainer and its workers share (their agents are
    ``<group>.t`` and ``<group>.w<rank>``)."""
    session: str
    """The trainer's session (16 hex digits): anything of another session,
    such as a trainer that restarted, is refused."""
    num_workers: int
    rank_offset: int = 0
    bucket_bytes: int = 64 << 20
    checksum: bool = False
    timeout: float = 60.0
    """Seconds any one wait may take (a bucket, the trainer's lookup)."""
    devices: Optional[List[str]] = None
    """RDMA devices; default every one (GPU memory goes on the nearest)."""
    listen: Optional[str] = None
    """The agent's control address, "IP:PORT" (default: any, a free port)."""

    def __post_init__(self) -> None:
        _wire.check_bucket_bytes(self.bucket_bytes)
        self.timeout = check_timeout(self.timeout)
        check_workers(self.num_workers)
        if isinstance(self.rank_offset, bool) or not isinstance(self.rank_offset, int) or self.rank_offset < 0:
            raise ValueError(f"rank_offset={self.rank_offset!r}: 0 or more")
        _session(self.session)


@dataclass
class GpudirectWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """One update: the parameters as vLLM's NCCL backend lists them, and
    its version and session."""

    names: List[str]
    dtype_names: List[str]
    shapes: List[List[int]]
    version: int
    session: str

    def __post_init__(self) -> None:
        if not all(isinstance(x, list) for x in (self.names, self.dtype_names, self.shapes)):
            raise ValueError("names, dtype_names and shapes are lists")
        n = len(self.names)
        if n > _wire.MAX_PARAMS:
            raise ValueError(f"{n} parameters in one update: at most {_wire.MAX_PARAMS}")
        if not all(isinstance(x, str) for x in self.names):
            raise ValueError("a parameter's name is not a string")
        if n == 0:
            raise ValueError("an update lists no parameters: there is nothing the trainer could confirm")
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"names, dtype_names and shapes differ in length: {n}, {len(self.dtype_names)}, {len(self.shapes)}")
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 1:
            raise ValueError(f"version={self.version!r}: a whole number from 1")
        _session(self.session)
        # Not a field: asdict() (what the trainer sends) leaves it out.
        self.dtypes: List[Any] = []
        for name, d, s in zip(self.names, self.dtype_names, self.shapes):
            dtype = getattr(torch, str(d), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"{name}: dtype {d!r} is not a torch dtype")
            if not isinstance(s, (list, tuple)) or not all(isinstance(x, int) and x >= 0 for x in s):
                raise ValueError(f"{name}: shape {s!r} is not a list of sizes")
            self.dtypes.append(dtype)

    def nbytes(self) -> List[int]:
        """Each parameter's size in bytes."""
        out = []
        for dtype, shape in zip(self.dtypes, self.shapes):
            n = dtype.itemsize
            for x in shape:
                n *= x
            out.append(n)
        return out


def _session(s: Any) -> int:
    # Exactly one spelling per session: int(s, 16) alone takes signs, 0x,
    # underscores, spaces and other scripts' digits.
    if not isinstance(s, str) or not re.fullmatch("[0-9a-f]{16}", s):
        raise ValueError(f"session={s!r}: 16 lowercase hex digits")
    return int(s, 16)


def new_session() -> str:
    """A fresh random session id."""
    return secrets.token_hex(8)


class GpudirectWeightTransferEngine(WeightTransferEngine[GpudirectWeightTransferInitInfo, GpudirectWeightTransferUpdateInfo]):
    """Receives weights into two registered buckets (GPU memory, with
    GPUDirect RDMA required, where the model is on a GPU; host memory
    where it is on the CPU) and hands each bucket's parameters to the
    model's ``load_weights`` while the next bucket arrives.

    ``update_weights`` returns only when every byte of the update's
    version arrived and was loaded; notifications and bytes of another
    version or session are refused and counted (``refusals``). When the
    trainer stalls or dies, it raises :class:`WeightTransferError` within
    the init info's ``timeout``, naming the trainer, the version and the
    bucket; ``weight_version`` then stays the last complete version and
    ``partial_version`` names the one the model holds part of."""

    init_info_cls = GpudirectWeightTransferInitInfo
    update_info_cls = GpudirectWeightTransferUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: Optional[GpudirectWeightTransferInitInfo] = None
        self.rank = -1
        self.weight_version = 0
        """The last version of the current trainer session every byte of
        which was loaded (0: none)."""
        self.partial_version: Optional[int] = None
        """A version of which some weights were loaded but not all."""
        self.refusals: Dict[str, int] = {}
        """Notifications and buckets refused, by reason."""
        self._agent: Optional[Agent] = None
        self._inbox: Optional[Inbox] = None
        self._buckets: Any = None
        self._ack: Any = None
        self._layerwise = False
        self._joined: Optional[str] = None

    def init_transfer_engine(self, init_info: GpudirectWeightTransferInitInfo) -> None:
        """Opens this worker's agent, registers its buckets, publishes it and
        loads the trainer and the other workers (a relay broadcast forwards
        between workers), each within ``timeout``."""
        # The secret comes from this process's environment only: init info
        # arrives over vLLM's HTTP routes, and a path in it would let
        # whoever reaches them pick a file they know as the secret.
        secret = require_secret(None)
        self.shutdown()
        p = self.parallel_config
        rank = init_info.rank_offset + p.data_parallel_index * p.world_size + p.rank
        if rank >= init_info.num_workers:
            raise WeightTransferError(f"this worker's rank {rank} is not below num_workers={init_info.num_workers}: count every worker of every replica")
        agent = Agent(worker_name(init_info.group, rank), devices=init_info.devices, listen=init_info.listen, secret_file=secret, timeout=init_info.timeout)
        try:
            slot = _wire.HEADER + init_info.bucket_bytes
            on_gpu = torch.device(self.device).type == "cuda"
            self._buckets = torch.zeros(2 * slot, dtype=torch.uint8, device=self.device)
            if on_gpu:
                agent.register_gpu("b", self._buckets, policy="require")
            else:
                agent.register("b", self._buckets)
            self._ack = torch.zeros(_wire.ACK_SLOT, dtype=torch.uint8)
            agent.register("a", self._ack)
            rdv = Rendezvous(init_info.rendezvous, timeout=init_info.timeout, secret_file=secret)
            agent.publish(rdv)
            deadline = time.monotonic() + init_info.timeout
            agent.lookup(trainer_name(init_info.group), rdv, _left(deadline))
            for r in range(init_info.num_workers):
                if r != rank:
                    agent.lookup(worker_name(init_info.group, r), rdv, _left(deadline))
        except BaseException:
            agent.close()
            raise
        if init_info.session != self._joined:
            # Versions count within a trainer's session: a restarted
            # trainer numbers from 1 again.
            self.weight_version, self.partial_version = 0, None
        self._agent, self.info, self.rank, self._joined = agent, init_info, rank, init_info.session
        trainer = trainer_name(init_info.group)
        self._inbox = Inbox(agent, lambda peer: peer == trainer, self.refusals, "not_trainer")

    def start_weight_update(self) -> None:
        """Starts vLLM's layerwise reload when vLLM loaded this model (it
        recorded what reloading needs), as vLLM's NCCL backend does; a
        model it did not load takes ``load_weights`` directly."""
        from vllm.model_executor.model_loader.reload import layerwise

        self._layerwise = self.model in layerwise.LAYERWISE_INFO
        if self._layerwise:
            layerwise.initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        """Finishes vLLM's layerwise reload, when started."""
        if self._layerwise:
            from vllm.model_executor.model_loader.reload import layerwise

            layerwise.finalize_layerwise_reload(self.model, self.model_config)
            self._layerwise = False

    def update_weights(self, update_info: Dict[str, Any]) -> None:
        """Receives and loads one update (``update_info`` as the trainer
        sent it). Waits for the model's own device only (the base class
        synchronizes the current accelerator, which on a CPU worker of a
        CUDA build of torch would start CUDA)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update_info: GpudirectWeightTransferUpdateInfo) -> None:
        """Every bucket of the update's version, in order: wait for the
        trainer's notification (refusing others), check the header (and
        the checksum), load, acknowledge."""
        v = update_info.version
        nbytes = update_info.nbytes()
        model_bytes = _model_bytes(self.model)
        room = 4 * model_bytes + (64 << 20)
        if sum(nbytes) > room:
            raise ValueError(
                f"version {v} lists {sum(nbytes)} bytes of parameters for a model of {model_bytes}: "
                f"at most {room} (4x the model, plus 64 MiB) are taken"
            )
        info, agent, inbox = self.info, self._agent, self._inbox
        if info is None or agent is None or inbox is None:
            raise WeightTransferError("gpudirect weight transfer is not initialized: init_transfer_engine first")
        session = _session(info.session)
        if _session(update_info.session) != session:
            count(self.refusals, "other_session")
            raise WeightTransferError(
                f"update of session {update_info.session} refused: this worker joined session {info.session} (the trainer restarted: init again)"
            )
        if v <= self.weight_version:
            count(self.refusals, "stale_version")
            raise WeightTransferError(f"version {v} refused: this worker already holds version {self.weight_version}")
        plan = _wire.plan(nbytes, info.bucket_bytes)
        trainer = trainer_name(info.group)
        slot = _wire.HEADER + info.bucket_bytes
        partial: Dict[int, Any] = {}
        ahead: Dict[int, int] = {}
        k = 0
        reachable = True
        try:
            for k in range(plan.count):
                nonce = self._wait_bucket(inbox, trainer, session, v, k, plan.count, ahead)
                base = (k % 2) * slot
                head = _wire.Header.unpack(bytes(self._buckets[base : base + _wire.HEADER].cpu().numpy()))
                want = plan.length(k)
                if head is None or (head.session, head.version, head.bucket, head.length) != (session, v, k, want):
                    count(self.refusals, "wrong_bytes")
                    raise WeightTransferError(
                        f"bucket {k} of version {v} from {trainer!r}: its bytes are not that bucket's ({head}); the update is refused"
                    )
                payload = self._buckets[base + _wire.HEADER : base + _wire.HEADER + want]
                if info.checksum and _wire.checksum(payload) != head.checksum:
                    count(self.refusals, "checksum")
                    raise WeightTransferError(f"bucket {k} of version {v} from {trainer!r}: checksum mismatch; the update is refused")
                self.partial_version = v
                try:
                    self._load(update_info, plan, k, payload, partial)
                except Exception as e:
                    raise WeightTransferError(f"bucket {k} of version {v}: the model's load_weights failed: {type(e).__name__}: {e}") from e
                try:
                    self._ack_bucket(agent, trainer, _wire.Note("ack", session, v, k, nonce=nonce), info.timeout)
                except EngineError as e:
                    reachable = False  # a nak would wait on the same dead path
                    raise WeightTransferError(
                        f"bucket {k} of version {v} loaded, but its acknowledgement to the trainer {trainer!r} failed: {e}; "
                        f"this worker's model is not at version {v} until the trainer confirms it"
                    ) from e
        except WeightTransferTimeout:
            raise
        except BaseException as e:
            if reachable:
                self._nak(agent, trainer, session, v, k, str(e))
            raise
        self.weight_version, self.partial_version = v, None

    def _wait_bucket(self, inbox: Inbox, trainer: str, session: int, v: int, k: int, buckets: int, ahead: Dict[int, int]) -> int:
        """Until the trainer's put of bucket ``k`` of version ``v``; its
        nonce. The put of bucket ``k + 1`` may come first: the trainer
        sends it into the other slot while bucket ``k``'s broadcast is
        still in flight, and either broadcast can be whole here first. It
        is kept in ``ahead`` for the next call (dropping it lost the
        bucket: the worker then waited for a put already taken)."""
        assert self.info is not None
        if k in ahead:
            return ahead.pop(k)
        deadline = time.monotonic() + self.info.timeout
        while True:
            # The deadline holds however many notifications are queued.
            got = inbox.get(deadline) if time.monotonic() < deadline else None
            if got is None:
                raise WeightTransferTimeout(
                    f"no bucket {k} of version {v} from the trainer {trainer!r} within {self.info.timeout:g} s "
                    f"(it stalled, died or lost its link); this worker's model is not at version {v}"
                    + (f" (it holds part of it; still whole at version {self.weight_version})" if k else "")
                )
            peer, raw = got
            note = _wire.Note.decode(raw)
            if peer != trainer:
                count(self.refusals, "not_trainer")
            elif note is None or note.kind != "put":
                count(self.refusals, "malformed")
            elif note.session != session:
                count(self.refusals, "other_session")
            elif note.version < v:
                count(self.refusals, "stale_version")
            elif note.version > v:
                count(self.refusals, "other_version")
            elif note.bucket == k + 1 < buckets:
                ahead[note.bucket] = note.nonce
            elif note.bucket != k:
                count(self.refusals, "out_of_order")
            else:
                return note.nonce

    def _load(self, u: GpudirectWeightTransferUpdateInfo, plan: _wire.Plan, k: int, payload: Any, partial: Dict[int, Any]) -> None:
        weights: List[Tuple[str, Any]] = []
        for p in plan.buckets[k]:
            src = payload[p.at : p.at + p.length]
            if p.start == 0 and p.last:
                raw = src
            else:
                buf = partial.get(p.index)
                if buf is None:
                    buf = partial[p.index] = torch.empty(plan.nbytes[p.index], dtype=torch.uint8, device=payload.device)
                buf[p.start : p.start + p.length].copy_(src)
                if not p.last:
                    continue
                raw = partial.pop(p.index)
            weights.append((u.names[p.index], raw.view(u.dtypes[p.index]).view(u.shapes[p.index])))
        if weights:
            self.model.load_weights(weights)
        if payload.device.type == "cuda":
            # load_weights copies on the stream: done before the slot is
            # given back to the trainer.
            torch.cuda.synchronize(payload.device)

    def _ack_bucket(self, agent: Agent, trainer: str, note: _wire.Note, timeout: float) -> None:
        req = agent.prepare("write", [("a", 0, trainer, "acks", self.rank * _wire.ACK_SLOT, _wire.ACK_SLOT)], note.encode())
        req.post()
        req.wait(timeout)

    def _nak(self, agent: Agent, trainer: str, session: int, v: int, k: int, why: str) -> None:
        # A second of the bound at most: the update already failed, and
        # the trainer learns of it from its own bound if this is lost.
        try:
            self._ack_bucket(agent, trainer, _wire.Note("nak", session, v, k, why[:400]), 1.0)
        except Exception:
            pass

    def shutdown(self) -> None:
        """Closes the agent and frees the buckets; a later init starts over."""
        if self._inbox is not None:
            self._inbox.close()
        if self._agent is not None:
            self._agent.close()
        self._agent = self._inbox = None
        self._buckets = self._ack = None
        self.info = None


def _model_bytes(model: Any) -> int:
    """The bytes of a model's parameters and buffers (meta tensors too)."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
