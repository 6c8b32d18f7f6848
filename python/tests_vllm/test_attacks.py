"""A hostile review of the gpudirect vLLM backend, host side (no RDMA
device): the worker and trainer engines driven with fake agents and
inboxes, crafted notifications, bucket bytes and init/update info. Each
test fails while the defect it names is there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import asdict
from typing import Any, Callable, List, Optional, Tuple

import pytest
import torch

import vllm.plugins
from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from gpudirect import EngineTimeoutError
from gpudirect.vllm import WeightTransferError, WeightTransferTimeout, _wire
from gpudirect.vllm import _common, trainer as trainer_mod, worker as worker_mod
from gpudirect.vllm.trainer import GpudirectTrainerInitInfo, GpudirectTrainerWeightTransferEngine
from gpudirect.vllm.worker import GpudirectWeightTransferInitInfo, GpudirectWeightTransferUpdateInfo

S = "0123456789abcdef"
SI = int(S, 16)
BUCKET = 1024
SLOT = _wire.HEADER + BUCKET
GROUP = "g"
T = "g.t"


# --------------------------------------------------------------- fakes


class Model(torch.nn.Module):
    """Records what load_weights got; a name it does not have raises
    KeyError, as vLLM's models do (params_dict[name])."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(300))
        self.b = torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))
        self.loaded: List[Tuple[str, torch.Tensor]] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, t in weights:
            params[name]  # KeyError for a name the model lacks
            self.loaded.append((name, t.clone()))


class Req:
    def __init__(self, agent: "WAgent", note: bytes) -> None:
        self.agent, self.note = agent, note

    def post(self) -> None:
        pass

    def wait(self, t: float) -> None:
        self.agent.sent.append(self.note)
        if self.agent.ack_fails:
            time.sleep(t)
            raise EngineTimeoutError(f"write to {T!r} timed out after {t} s")


class WAgent:
    """A worker's agent: acks/naks are recorded."""

    name = "g.w0"

    def __init__(self, ack_fails: bool = False) -> None:
        self.sent: List[bytes] = []
        self.ack_fails = ack_fails

    def prepare(self, op, segs, note):
        return Req(self, note)


class Inbox:
    """Items are (peer, raw) or callables returning (peer, raw) (called when
    taken, to write a bucket first). Empty: waits until the deadline."""

    def __init__(self, items=()) -> None:
        self.items = list(items)

    def get(self, deadline: float):
        if self.items:
            it = self.items.pop(0)
            return it() if callable(it) else it
        left = deadline - time.monotonic()
        if left > 0:
            time.sleep(left)
        return None

    def close(self) -> None:
        pass


def quiet_agents(made: List[Tuple[str, dict]]):
    """An Agent class that opens nothing: each one made is recorded in
    ``made`` as (name, keyword arguments); it registers, publishes and
    looks up nothing, and hears no notification."""

    class QuietAgent:
        def __init__(self, name, **kw):
            self.name = name
            made.append((name, kw))

        def register(self, *a, **k):
            pass

        register_gpu = register

        def publish(self, rdv):
            pass

        def lookup(self, *a):
            pass

        def wait_notification(self, t):
            time.sleep(t)
            raise EngineTimeoutError("quiet")

        def close(self):
            pass

    return QuietAgent


def flooding(name: str, junk: Tuple[str, bytes], stop: threading.Event):
    """An agent named ``name`` whose every wait returns ``junk`` at once,
    until ``stop`` is set (then it hears nothing)."""

    class Flood:
        def wait_notification(self, t):
            if stop.is_set():
                time.sleep(t)
                raise EngineTimeoutError("quiet")
            return junk

    agent = Flood()
    agent.name = name
    return agent


@pytest.fixture(scope="module")
def vllm_config():
    vllm.plugins.load_general_plugins()
    return VllmConfig()


def engine(vllm_config, model=None, timeout=1.0, agent=None, inbox=None, checksum=False):
    e = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gpudirect"), vllm_config, torch.device("cpu"), model or Model())
    e.info = GpudirectWeightTransferInitInfo(rendezvous="127.0.0.1:1", group=GROUP, session=S, num_workers=2, bucket_bytes=BUCKET,
                                             timeout=timeout, checksum=checksum)
    e.rank = 0
    e._joined = S
    e._agent = agent or WAgent()
    e._inbox = inbox or Inbox()
    e._buckets = torch.zeros(2 * SLOT, dtype=torch.uint8)
    return e


def update(version=1, names=("a", "b"), dtypes=("float32", "bfloat16"), shapes=((300,), (10,)), session=S):
    return GpudirectWeightTransferUpdateInfo(names=list(names), dtype_names=list(dtypes), shapes=[list(s) for s in shapes],
                                             version=version, session=session)


def stream(u, tensors, version=None, session=SI):
    """What the trainer would write, bucket by bucket: callables that write
    bucket k into the engine's slot and return its put notification."""
    p = _wire.plan(u.nbytes(), BUCKET)
    data = torch.zeros(p.count * BUCKET, dtype=torch.uint8)
    pos = 0
    for t in tensors:
        raw = t.contiguous().view(-1).view(torch.uint8)
        pos = _wire.align(pos)
        data[pos : pos + raw.numel()] = raw
        pos += raw.numel()
    v = u.version if version is None else version

    def writer(e, k):
        def go():
            base = (k % 2) * SLOT
            n = p.length(k)
            payload = data[k * BUCKET : k * BUCKET + n]
            e._buckets[base + _wire.HEADER : base + _wire.HEADER + n] = payload
            h = _wire.Header(session, v, k, n, _wire.checksum(payload))
            e._buckets[base : base + _wire.HEADER] = torch.frombuffer(bytearray(h.pack()), dtype=torch.uint8)
            return (T, _wire.Note("put", session, v, k).encode())

        return go

    return p, writer


def in_thread(fn: Callable[[], Any], limit: float):
    """fn's (result, exception, seconds), or (None, None, None) when it
    ran past ``limit`` (a hang)."""
    out: dict = {}

    def run():
        t0 = time.monotonic()
        try:
            out["r"] = fn()
        except BaseException as e:
            out["e"] = e
        out["s"] = time.monotonic() - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    if th.is_alive():
        return None, None, None
    return out.get("r"), out.get("e"), out["s"]


# ---------------------------------------------- worker: attacks that held from the start


def two_buckets(vllm_config):
    """A worker engine and an update of two parameters that spans two
    buckets: (model, engine, update, the parameters, the bucket writer)."""
    m = Model()
    e = engine(vllm_config, m)
    u = update()
    a, b = torch.randn(300), torch.randn(10).to(torch.bfloat16)
    p, w = stream(u, [a, b])
    assert p.count == 2
    return m, e, u, (a, b), w


def assert_landed(m, e, params) -> None:
    """Version 1 is whole at the worker: each parameter loaded as sent."""
    a, b = params
    assert e.weight_version == 1
    got = dict(m.loaded)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_a_non_trainer_put_and_another_session_are_refused_and_the_real_update_lands(vllm_config):
    m, e, u, params, w = two_buckets(vllm_config)
    forged = stream(u, [torch.ones(300), torch.ones(10).to(torch.bfloat16)])[1](e, 0)
    e._inbox = Inbox([("g.w1", _wire.Note("put", SI, 1, 0).encode()),          # a member posing: refused
                      (T, _wire.Note("put", SI ^ 1, 1, 0).encode()),           # another session
                      (T, _wire.Note("put", SI, 0, 0).encode()),               # a stale version
                      (T, b"garbage"), w(e, 0), w(e, 1)])
    e.receive_weights(u)
    assert_landed(m, e, params)
    assert e.refusals == {"not_trainer": 1, "other_session": 1, "stale_version": 1, "malformed": 1}
    del forged


def test_the_next_buckets_put_arriving_first_is_kept_and_the_update_lands(vllm_config):
    """The trainer posts bucket k + 1 (into the other slot) while bucket
    k's broadcast is in flight, and the two can be whole at a worker in
    either order. A worker that dropped the early put as out of order
    then waited for it until its timeout (seen in the guest: no
    acknowledgement of bucket 1 within 30 s). A put two ahead is still
    refused."""
    m, e, u, params, w = two_buckets(vllm_config)
    e._inbox = Inbox([(T, _wire.Note("put", SI, 1, 2).encode()), w(e, 1), w(e, 0)])
    r, exc, took = in_thread(lambda: e.receive_weights(u), 5)
    assert took is not None and exc is None, f"{exc!r} after {took} s"
    assert_landed(m, e, params)
    assert [n.bucket for n in map(_wire.Note.decode, e._agent.sent)] == [0, 1], "acknowledged in order"
    assert e.refusals == {"out_of_order": 1}


def test_a_put_over_stale_bucket_bytes_is_refused_not_loaded(vllm_config):
    m = Model()
    e = engine(vllm_config, m)
    u = update(version=2)
    p, w = stream(u, [torch.randn(300), torch.randn(10).to(torch.bfloat16)], version=1)  # the slot holds version 1's bytes
    go = w(e, 0)

    def stale():
        go()
        return (T, _wire.Note("put", SI, 2, 0).encode())

    e._inbox = Inbox([stale])
    with pytest.raises(WeightTransferError, match="bucket 0 of version 2"):
        e.receive_weights(u)
    assert e.weight_version == 0 and not m.loaded and e.refusals == {"wrong_bytes": 1}
    assert _wire.Note.decode(e._agent.sent[-1]).kind == "nak"


def test_a_stalled_trainer_times_out_naming_trainer_version_bucket(vllm_config):
    e = engine(vllm_config, timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(WeightTransferTimeout, match=r"no bucket 0 of version 1 from the trainer 'g.t'"):
        e.receive_weights(update())
    assert time.monotonic() - t0 < 1.0


# ------------------------------------------ worker: attacks that succeeded before their fixes


def test_an_empty_update_is_not_a_success_the_trainer_never_confirmed(vllm_config):
    """update_info with no parameters (from vLLM's HTTP route, or a buggy
    trainer) returns at once as 'version 1000 loaded', without one byte or
    notification from the trainer; every real update after it (1, 2, ...)
    is then refused as stale until re-init."""
    e = engine(vllm_config, timeout=0.3)
    r, exc, _ = in_thread(lambda: e.receive_weights(update(version=1000, names=(), dtypes=(), shapes=())), 5)
    assert isinstance(exc, (WeightTransferError, ValueError)), (
        f"an update of nothing, version 1000, nothing from the trainer: returned {r!r}, weight_version={e.weight_version}"
    )


def test_huge_shapes_in_update_info_are_refused_in_bounded_time_and_memory(tmp_path):
    """shapes=[[2**62]] float32 parses; planning it loops 2**38 times (64
    MiB buckets) appending Pieces: a hang that eats memory."""
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
        from gpudirect.vllm import _wire
        from gpudirect.vllm.worker import GpudirectWeightTransferUpdateInfo as U
        try:
            u = U(names=["w"], dtype_names=["float32"], shapes=[[2**62]], version=1, session="0123456789abcdef")
            p = _wire.plan(u.nbytes(), 64 << 20)
        except ValueError as e:
            print("refused:", e); sys.exit(0)
        except MemoryError:
            print("MemoryError"); sys.exit(3)
        print("planned", p.count); sys.exit(2)
    """)
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("update_info shapes=[[2**62]]: parse + plan still running after 20 s (unbounded loop/memory)")
    assert r.returncode == 0, (r.returncode, r.stdout[-300:], r.stderr[-300:])


def test_a_name_the_model_lacks_fails_as_weight_transfer_error(vllm_config):
    """Bad update_info (a name the model does not have) must fail as
    ValueError/WeightTransferError naming version and bucket, not as the
    model's raw KeyError."""
    e = engine(vllm_config)
    u = update(names=("nope", "b"))
    p, w = stream(u, [torch.randn(300), torch.randn(10).to(torch.bfloat16)])
    e._inbox = Inbox([w(e, 0), w(e, 1)])
    with pytest.raises((WeightTransferError, ValueError)):
        e.receive_weights(u)


def test_an_unreachable_trainer_at_the_ack_raises_weight_transfer_error_within_timeout(vllm_config):
    """Every byte arrived and was loaded; the trainer then became
    unreachable, so the acknowledgement's write times out. The worker must
    raise WeightTransferError naming version and bucket within `timeout`;
    it raises the engine's EngineTimeoutError after the ack's wait and the
    nak's wait (2 x timeout)."""
    to = 0.6
    e = engine(vllm_config, timeout=to, agent=WAgent(ack_fails=True))
    u = update(shapes=((100,), (10,)))
    p, w = stream(u, [torch.randn(100), torch.randn(10).to(torch.bfloat16)])
    assert p.count == 1
    e._inbox = Inbox([w(e, 0)])
    t0 = time.monotonic()
    with pytest.raises(Exception) as ei:
        e.receive_weights(u)
    took = time.monotonic() - t0
    assert isinstance(ei.value, WeightTransferError) and "version 1" in str(ei.value), f"{type(ei.value).__name__}: {ei.value}"
    assert took < to * 1.5, f"took {took:.2f} s with timeout {to} s"


def test_a_flood_of_member_notifications_does_not_hold_a_worker_past_its_timeout(vllm_config):
    """A member (another worker, or a process with the secret) sends
    notifications as fast as it can. _common.Inbox.get keeps handing out
    queued ones after the deadline (get_nowait), so _wait_bucket never
    sees None while the queue is non-empty: no WeightTransferTimeout."""
    stop = threading.Event()
    junk = ("g.w1", _wire.Note("put", SI, 1, 0).encode())

    inbox = _common.Inbox(flooding("g.w0", junk, stop))
    e = engine(vllm_config, timeout=0.5, inbox=inbox)
    try:
        r, exc, took = in_thread(lambda: e.receive_weights(update()), 6)
    finally:
        stop.set()
    inbox.close()
    assert took is not None, "receive_weights still waiting 6 s after a 0.5 s timeout (a member's flood of notifications)"
    assert isinstance(exc, WeightTransferTimeout), exc


def test_session_ids_are_exactly_16_hex_digits():
    """'-000000000000001', '0x00000000000001', '0000_0000_0000_1' and
    ' 00000000000001 ' pass _session (int(s, 16) takes signs, 0x, '_' and
    spaces); the negative one can never match a header (struct 'Q'), and
    spellings of one session compare unequal as strings in
    init_transfer_engine (_joined), resetting weight_version (a replay of
    version 1 of the same session is then taken)."""
    bad = []
    for s in ("-000000000000001", "0x00000000000001", "+000000000000001", "0000_0000_0000_1", " 00000000000001 ", "0123456789ABCDEF"[:15] + "\u0661"):
        try:
            GpudirectWeightTransferInitInfo(rendezvous="127.0.0.1:1", group="g", session=s, num_workers=1)
            bad.append(s)
        except ValueError:
            pass
    assert not bad, f"accepted as sessions: {bad!r}"


def test_init_info_from_http_cannot_name_the_workers_secret(vllm_config, tmp_path, monkeypatch):
    """init_info arrives over vLLM's HTTP route. A secret_file in it must
    not replace the worker's own (GPUDIRECT_SECRET_FILE): a caller who can
    reach the route would name a world-readable file of known content (a
    model's config.json, /etc/...), and its own rendezvous, and become the
    trainer without the cluster secret."""
    real = tmp_path / "secret"
    real.write_bytes(os.urandom(32))
    real.chmod(0o600)
    known = tmp_path / "config.json"
    known.write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 4096}\n')
    known.chmod(0o644)
    monkeypatch.setenv("GPUDIRECT_SECRET_FILE", str(real))
    made: List[Tuple[str, dict]] = []
    monkeypatch.setattr(worker_mod, "Agent", quiet_agents(made))
    monkeypatch.setattr(worker_mod, "Rendezvous", lambda *a, **k: object())
    e = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gpudirect"), vllm_config, torch.device("cpu"), Model())
    try:
        info = e.parse_init_info(dict(rendezvous="attacker.example:29600", group="g", session=S, num_workers=1, secret_file=str(known)))
        e.init_transfer_engine(info)
    except (WeightTransferError, ValueError):
        return  # refused: holds
    finally:
        e.shutdown()
    keys = [kw.get("secret_file") for _, kw in made]
    assert all(k in (None, str(real)) for k in keys), f"the worker's agent keys on {keys!r}, a 0644 file the HTTP caller named"


# ------------------------------------------------------------ trainer


class Cast:
    def __init__(self, on_post):
        self.on_post = on_post

    def post(self):
        self.on_post()

    def wait(self, t):
        pass

    def receivers(self):
        return []


class TAgent:
    name = T

    def __init__(self, on_cast):
        self.on_cast = on_cast
        self.notes: List[_wire.Note] = []

    def register(self, *a, **k):
        pass

    deregister = register

    def broadcast(self, name, off, length, dests, note):
        n = _wire.Note.decode(note)
        self.notes.append(n)
        return Cast(lambda: self.on_cast(n))


class Client:
    def __init__(self, update_weights: Callable[[dict], None]):
        self.updates: List[dict] = []
        self._uw = update_weights

    def init_weight_transfer_engine(self, d):
        pass

    def start_weight_update(self):
        pass

    def finish_weight_update(self, v):
        pass

    def update_weights(self, d):
        self.updates.append(d)
        self._uw(d)


class TModel(torch.nn.Module):
    def __init__(self, n=3 * 256):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n))  # 3 KiB: three 1 KiB buckets


def trainer(client, on_cast, timeout=1.0, inbox=None):
    eng = GpudirectTrainerWeightTransferEngine(client=client, source=ModuleSource(TModel()))
    eng.info = GpudirectTrainerInitInfo(rendezvous="127.0.0.1:1", num_workers=2, group=GROUP, bucket_bytes=BUCKET, timeout=timeout, rank=0)
    eng.session = S
    eng.agent = TAgent(on_cast)
    eng._inbox = inbox if inbox is not None else Inbox()
    eng._workers = ["g.w0", "g.w1"]
    return eng


def acks(inbox, who=("g.w0", "g.w1")):
    def on_cast(n):
        for w in who:
            inbox.items.append((w, _wire.Note("ack", n.session, n.version, n.bucket, nonce=n.nonce).encode()))

    return on_cast


def test_the_trainer_sends_and_counts_a_non_workers_ack():
    inbox = Inbox()
    inbox.items.append(("g.x", _wire.Note("ack", SI, 1, 0).encode()))
    eng = trainer(Client(lambda d: None), acks(inbox), inbox=inbox)
    eng.send_weights()
    assert eng.version == 1 and eng.refusals == {"not_a_worker": 1}


def test_a_failed_attempt_does_not_reuse_its_version_number():
    """send_weights fails (a worker's update_weights failed); the retry
    sends the same version number in the same session. A late ack or put
    of the failed attempt (same session, version, bucket) is then taken
    as the retry's: the trainer reuses a slot a worker is still loading,
    or a worker takes a put before the retry's bytes are whole; with
    checksum off (the default) that loads torn bytes and reports
    success."""
    inbox = Inbox()
    state = {"fail": True}

    def uw(d):
        if state["fail"]:
            raise RuntimeError("worker 1: connection reset")
        time.sleep(0.05)

    def on_cast(n):
        if not state["fail"]:
            acks(inbox)(n)

    eng = trainer(Client(uw), on_cast, timeout=0.5, inbox=inbox)
    with pytest.raises(WeightTransferError):
        eng.send_weights()
    state["fail"] = False
    eng.send_weights()
    v = [d["version"] for d in eng.client.updates]
    assert v[0] != v[1], f"both attempts sent as version {v[0]} of session {S}: late notifications of the failed one pass as the retry's"


def test_an_ack_for_a_bucket_not_yet_sent_is_refused():
    """A worker acks buckets 0, 1 and 2 when bucket 0 arrives. The trainer
    takes the acks of buckets it has not sent (a peer's claim as fact), so
    it later overwrites that worker's slot while the worker is loading
    it."""
    inbox = Inbox()

    def on_cast(n):
        inbox.items.append(("g.w1", _wire.Note("ack", n.session, n.version, n.bucket, nonce=n.nonce).encode()))
        if n.bucket == 0:
            for k in range(3):
                inbox.items.append(("g.w0", _wire.Note("ack", n.session, n.version, k).encode()))

    eng = trainer(Client(lambda d: None), on_cast, timeout=0.5, inbox=inbox)
    try:
        eng.send_weights()
    except WeightTransferError:
        return  # refused: holds
    assert eng.refusals, "acks of buckets 1 and 2 sent before the trainer shipped them: taken, none refused"


def test_a_worker_failure_after_the_last_ack_is_a_weight_transfer_error():
    """Every bucket acknowledged, then the inference side's update_weights
    fails: send_weights raises the client's RuntimeError, not
    WeightTransferError naming the version."""
    inbox = Inbox()

    def uw(d):
        time.sleep(0.2)
        raise RuntimeError("HTTP 500 from worker 1")

    eng = trainer(Client(uw), acks(inbox), inbox=inbox)
    with pytest.raises(Exception) as ei:
        eng.send_weights()
    assert isinstance(ei.value, WeightTransferError), f"{type(ei.value).__name__}: {ei.value}"
    assert eng.version == 0


def test_a_naks_reason_is_quoted_in_the_trainers_error():
    """A worker's nak reason (its text, any bytes) goes raw into the
    trainer's error: a newline forges a log line."""
    inbox = Inbox()

    def on_cast(n):
        inbox.items.append(("g.w0", _wire.Note("nak", n.session, n.version, n.bucket, "x\nINFO weight sync: version 1 sent whole").encode()))

    eng = trainer(Client(lambda d: time.sleep(2)), on_cast, timeout=0.5, inbox=inbox)
    with pytest.raises(WeightTransferError) as ei:
        eng.send_weights()
    assert "\n" not in str(ei.value), repr(str(ei.value))


def test_a_flood_of_member_notifications_does_not_hold_the_trainer_past_its_timeout():
    """As for the worker: _settle only times out when Inbox.get returns
    None, which the real Inbox never does while notifications queue."""
    stop = threading.Event()
    junk = ("g.x", _wire.Note("ack", SI, 1, 0).encode())

    inbox = _common.Inbox(flooding(T, junk, stop))
    eng = trainer(Client(lambda d: time.sleep(30)), lambda n: None, timeout=0.5, inbox=inbox)
    try:
        r, exc, took = in_thread(eng.send_weights, 6)
    finally:
        stop.set()
    inbox.close()
    assert took is not None, "send_weights still waiting 6 s after a 0.5 s timeout (a flood of notifications)"
    assert isinstance(exc, WeightTransferError), exc


@pytest.mark.parametrize("n", [-1, 0, True, "2", 2.0])
def test_trainer_init_refuses_a_bad_num_workers_before_opening_anything(monkeypatch, tmp_path, n):
    secret = tmp_path / "s"
    secret.write_bytes(os.urandom(32))
    made: List[Tuple[str, dict]] = []
    monkeypatch.setattr(trainer_mod, "Agent", quiet_agents(made))
    monkeypatch.setattr(trainer_mod, "Rendezvous", lambda *a, **k: object())
    info = GpudirectTrainerInitInfo(rendezvous="127.0.0.1:1", num_workers=n, secret_file=str(secret), timeout=0.5, rank=0)
    with pytest.raises(Exception) as ei:
        eng = GpudirectTrainerWeightTransferEngine.trainer_init(info, client=Client(lambda d: None), source=ModuleSource(TModel()))
        eng.shutdown()
        raise AssertionError("trainer_init returned an engine")
    opened = [name for name, _ in made]
    assert isinstance(ei.value, ValueError) and not opened, f"num_workers={n!r}: {type(ei.value).__name__}: {ei.value}; agents opened: {opened}"


def test_a_slot_is_not_refilled_before_its_bucket_is_whole_and_acknowledged():
    """The trainer filled bucket k into its slot before settling bucket
    k - 2, which still occupied that slot: a worker (or a relay) could
    read bucket k's bytes as bucket k - 2's. With the checksum off (the
    default) a worker loaded them and reported the version whole (seen in
    the guest: gate_up_proj of the last layer differed after an update
    that succeeded). Each slot's bytes must stay as posted until the
    bucket's wait returned and every worker's ack was taken."""
    inbox = Inbox()
    torn: List[str] = []
    eng: Any = None

    def snapshot(n):
        base = (n.bucket % 2) * SLOT
        return eng._buckets[base : base + SLOT].clone()

    def unchanged(n, posted, when):
        if not torch.equal(snapshot(n), posted):
            torn.append(f"bucket {n.bucket}'s slot rewritten {when}")

    class WatchedCast(Cast):
        def __init__(self, n):
            super().__init__(lambda: None)
            self.n = n

        def post(self):
            self.posted = snapshot(self.n)
            for w in ("g.w0", "g.w1"):
                ack = _wire.Note("ack", self.n.session, self.n.version, self.n.bucket, nonce=self.n.nonce).encode()
                # Checked when the trainer takes the ack off its inbox.
                inbox.items.append(lambda w=w, ack=ack: (unchanged(self.n, self.posted, f"before {w}'s ack was taken"), (w, ack))[1])

        def wait(self, t):
            unchanged(self.n, self.posted, "before its broadcast's wait")

    eng = trainer(Client(lambda d: time.sleep(0.05)), lambda n: None, inbox=inbox)
    eng.agent.broadcast = lambda name, off, length, dests, note: WatchedCast(_wire.Note.decode(note))
    eng.send_weights()
    assert eng.version == 1
    assert not torn, torn
