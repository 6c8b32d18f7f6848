"""The backend end to end with the real vLLM package, in a Soft-RoCE guest
(GPUDIRECT_TEST_DEVICE names its RDMA device; testbed/vllm-tests --guest).
A trainer process and two worker processes: each worker is made by
``WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend=
"gpudirect"), ...)`` after vLLM's ``load_general_plugins()`` and holds a
model whose ``load_weights`` fuses q/k/v and gate/up as vLLM's Llama does;
the trainer drives them through a ``VLLMWeightSyncClient`` that calls
each worker as vLLM's routes do. Without a device this file fails: it
never passes without having run."""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import socket
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, List

import pytest
import torch

import vllm.plugins
from vllm.config import VllmConfig
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

DEVICE = os.environ.get("GPUDIRECT_TEST_DEVICE")
TIMEOUT = 30.0
"""The engines' bound on any one wait, in seconds."""
WORKERS = 2
HIDDEN, FF, LAYERS, VOCAB = 256, 768, 4, 2048

ctx = mp.get_context("fork")  # vLLM and torch imported once, in this process


def trainer_model(seed: int) -> torch.nn.Module:
    """The trainer's model with Hugging Face names (about 16 MB)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Module()
    params = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        params.update({
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (HIDDEN // 2, HIDDEN),
            p + "self_attn.v_proj.weight": (HIDDEN // 2, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (FF, HIDDEN),
            p + "mlp.up_proj.weight": (FF, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FF),
            p + "input_layernorm.weight": (HIDDEN,),
        })
    for name, shape in params.items():
        m.register_parameter(name.replace(".", "__"), torch.nn.Parameter(torch.randn(shape, generator=g)))
    m.register_parameter("model__norm__weight", torch.nn.Parameter(torch.randn(HIDDEN, generator=g).to(torch.bfloat16)))
    return m


class HfSource(ModuleSource):
    """The trainer module's parameters under their dotted names; with
    ``die_after`` the trainer process kills itself after that many."""

    def __init__(self, module: torch.nn.Module, die_after: int = -1) -> None:
        super().__init__(module)
        self.die_after = die_after

    def metadata(self):
        return [type(m)(m.name.replace("__", "."), m.dtype, m.shape) for m in super().metadata()]

    def __iter__(self):
        for i, (name, t) in enumerate(super().__iter__()):
            if i == self.die_after:
                os.kill(os.getpid(), signal.SIGKILL)
            yield name.replace("__", "."), t


class FusedModel(torch.nn.Module):
    """A worker's model: q/k/v and gate/up stored fused, loaded as vLLM's
    Llama loads them (a stacked-parameter mapping with a shard per name)."""

    STACKED = [("qkv_proj", "q_proj", 0), ("qkv_proj", "k_proj", 1), ("qkv_proj", "v_proj", 2),
               ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self) -> None:
        super().__init__()
        self.p: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(VOCAB, HIDDEN), "model.norm.weight": torch.zeros(HIDDEN, dtype=torch.bfloat16)}
        for i in range(LAYERS):
            q = f"model.layers.{i}."
            self.p[q + "self_attn.qkv_proj.weight"] = torch.zeros(2 * HIDDEN, HIDDEN)
            self.p[q + "self_attn.o_proj.weight"] = torch.zeros(HIDDEN, HIDDEN)
            self.p[q + "mlp.gate_up_proj.weight"] = torch.zeros(2 * FF, HIDDEN)
            self.p[q + "mlp.down_proj.weight"] = torch.zeros(HIDDEN, FF)
            self.p[q + "input_layernorm.weight"] = torch.zeros(HIDDEN)
        self.loads = 0
        self.die_after = -1

    def load_weights(self, weights):
        loaded = set()
        for name, w in weights:
            for fused, part, shard in self.STACKED:
                if f".{part}." in name:
                    target = self.p[name.replace(part, fused)]
                    sizes = [HIDDEN, HIDDEN // 2, HIDDEN // 2] if fused == "qkv_proj" else [FF, FF]
                    start = sum(sizes[:shard])
                    target[start : start + sizes[shard]].copy_(w)
                    loaded.add(name.replace(part, fused))
                    break
            else:
                self.p[name].copy_(w)
                loaded.add(name)
        self.loads += 1
        if self.loads == self.die_after:
            os.kill(os.getpid(), signal.SIGKILL)
        return loaded


def expected(m: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """What a worker's FusedModel must hold after loading ``m``."""
    sd = {k.replace("__", "."): v.detach() for k, v in m.named_parameters()}
    out = {"model.embed_tokens.weight": sd["model.embed_tokens.weight"], "model.norm.weight": sd["model.norm.weight"]}
    for i in range(LAYERS):
        q = f"model.layers.{i}."
        a, mlp = q + "self_attn.", q + "mlp."
        out[a + "qkv_proj.weight"] = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
        out[a + "o_proj.weight"] = sd[a + "o_proj.weight"]
        out[mlp + "gate_up_proj.weight"] = torch.cat([sd[mlp + "gate_proj.weight"], sd[mlp + "up_proj.weight"]])
        out[mlp + "down_proj.weight"] = sd[mlp + "down_proj.weight"]
        out[q + "input_layernorm.weight"] = sd[q + "input_layernorm.weight"]
    return out


def worker_main(index: int, base: VllmConfig, secret: str, from_trainer: Connection, from_test: Connection) -> None:
    """A vLLM worker as far as the backend sees it: its engine, made by
    vLLM's factory, answering the calls vLLM's routes make."""
    os.environ["GPUDIRECT_SECRET_FILE"] = secret  # as a vLLM server's environment would have it
    config = copy.deepcopy(base)
    config.parallel_config.data_parallel_index = index  # replica ``index`` of a data-parallel deployment
    model = FusedModel()
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gpudirect"), config, torch.device("cpu"), model)
    conns = [from_trainer, from_test]
    while True:
        for c in wait(conns):
            try:
                seq, cmd, arg = c.recv()
            except EOFError:
                conns.remove(c)
                continue
            try:
                if cmd == "init":
                    out: Any = engine.init_transfer_engine(engine.parse_init_info(arg))
                elif cmd == "start":
                    out = engine.start_weight_update()
                elif cmd == "update":
                    out = engine.update_weights(arg)
                elif cmd == "finish":
                    out = engine.finish_weight_update()
                elif cmd == "die_after_loads":
                    model.loads, model.die_after = 0, arg
                    out = None
                elif cmd == "state":
                    out = {"weights": {k: v.clone() for k, v in model.p.items()}, "version": engine.weight_version,
                           "partial": engine.partial_version, "refusals": dict(engine.refusals), "name": engine._agent and engine._agent.name}
                elif cmd == "exit":
                    engine.shutdown()
                    c.send((seq, "ok", None))
                    return
                else:
                    raise ValueError(cmd)
                reply = ("ok", out)
            except Exception as e:
                reply = ("err", f"{type(e).__name__}: {e}")
            try:
                # The call's number goes back with the answer: an answer to a
                # caller that died is left unread, as an HTTP response is.
                c.send((seq,) + reply)
            except (BrokenPipeError, OSError):
                pass  # its caller died: the test reads the state instead


class PipeClient:
    """A ``VLLMWeightSyncClient`` over pipes: each call goes to every
    worker at once, as vLLM's routes fan a call out to its workers, and
    returns when all answered; a worker's error (or death) is raised."""

    def __init__(self, conns: List[Connection], procs: List[Any]) -> None:
        self.conns, self.procs = conns, procs
        self.seq = int.from_bytes(os.urandom(4), "little") << 16

    def _all(self, cmd: str, arg: Any = None, bound: float = 300.0) -> None:
        self.seq += 1
        for c in self.conns:
            c.send((self.seq, cmd, arg))
        errors = []
        for i, c in enumerate(self.conns):
            deadline = time.monotonic() + bound
            while True:
                if not c.poll(0.2):
                    if self.procs[i].is_alive() and time.monotonic() < deadline:
                        continue
                    errors.append(f"worker {i}: {'died' if not self.procs[i].is_alive() else 'no answer'}")
                    break
                try:
                    seq, status, out = c.recv()
                except EOFError:
                    seq, status, out = self.seq, "err", "died"
                if seq != self.seq:
                    continue  # the answer to an earlier caller
                if status != "ok":
                    errors.append(f"worker {i}: {out}")
                break
        if errors:
            raise RuntimeError(f"{cmd}: " + "; ".join(errors))

    def init_weight_transfer_engine(self, init_info):
        self._all("init", init_info)

    def start_weight_update(self):
        self._all("start")

    def update_weights(self, update_info):
        self._all("update", update_info)

    def finish_weight_update(self, weight_version=None):
        self._all("finish")


def trainer_main(conn: Connection, worker_conns: List[Connection], worker_pids: List[int], rdv: str, secret: str) -> None:
    """The trainer: its engine from vLLM's trainer factory, driving the
    workers; answers the test's commands."""
    from gpudirect.vllm import GpudirectTrainerInitInfo

    class Proc:
        def __init__(self, pid: int) -> None:
            self.pid = pid

        def is_alive(self) -> bool:
            # A sibling, not a child: a dead one shows as its pipe's end.
            try:
                os.kill(self.pid, 0)
                return True
            except OSError:
                return False

    client = PipeClient(worker_conns, [Proc(p) for p in worker_pids])
    source = HfSource(trainer_model(1))
    engine = None
    while True:
        cmd, arg = conn.recv()
        try:
            if cmd == "init":
                info = GpudirectTrainerInitInfo(rendezvous=rdv, serve_rendezvous=True, num_workers=WORKERS, rank=0, bucket_bytes=1 << 20,
                                                checksum=arg.get("checksum", True), timeout=TIMEOUT, secret_file=secret,
                                                devices=[DEVICE], worker_devices=[DEVICE], listen="127.0.0.1:0", worker_listen="127.0.0.1:0")
                engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
                out: Any = None
            elif cmd == "send":
                source = HfSource(trainer_model(arg["seed"]), arg.get("die_after", -1))
                engine.source = source
                before = sum(s["bytes"] for s in engine.agent.nic_stats())
                t = time.monotonic()
                engine.send_weights()
                took = time.monotonic() - t
                sent = sum(s["bytes"] for s in engine.agent.nic_stats()) - before
                out = {"sent": sent, "took": took, "version": engine.version}
            elif cmd == "stale":
                # A late chunk of the version just sent: bucket 0 again, with
                # its notification, as a slow path would deliver it.
                from gpudirect.vllm import _wire

                slot = _wire.HEADER + engine.info.bucket_bytes
                length = min(engine.info.bucket_bytes, sum(_wire.align(t.numel() * t.element_size()) for _, t in source))
                cast = engine.agent.broadcast("b", 0, _wire.HEADER + length, [(w, "b", 0) for w in engine._workers],
                                              _wire.Note("put", int(engine.session, 16), engine.version, 0).encode())
                cast.post()
                cast.wait(TIMEOUT)
                out = slot
            elif cmd == "expected":
                out = expected(source._module)
            else:
                raise ValueError(cmd)
            conn.send(("ok", out))
        except Exception as e:
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


class Bed:
    """The processes of one test: two workers and a trainer."""

    def __init__(self) -> None:
        assert DEVICE, "GPUDIRECT_TEST_DEVICE must name an RDMA device: run this file in the guest (testbed/vllm-tests --guest)"
        vllm.plugins.load_general_plugins()
        assert "gpudirect" in WeightTransferEngineFactory._registry, "vLLM did not load the gpudirect plugin"
        self.dir = tempfile.mkdtemp()
        self.secret = os.path.join(self.dir, "secret")
        with open(self.secret, "wb") as f:
            f.write(os.urandom(32))
        os.chmod(self.secret, 0o600)
        base = VllmConfig()
        self.workers, self.test_ends, self.trainer_ends = [], [], []
        for i in range(WORKERS):
            a, b = ctx.Pipe()
            c, d = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(i, base, self.secret, b, d), daemon=True)
            p.start()
            self.workers.append(p)
            self.trainer_ends.append(a)
            self.test_ends.append(c)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.rdv = f"127.0.0.1:{s.getsockname()[1]}"
        self.trainer = None
        self.start_trainer()

    def start_trainer(self) -> None:
        self.conn, child = ctx.Pipe()
        self.trainer = ctx.Process(target=trainer_main, args=(child, self.trainer_ends, [p.pid for p in self.workers], self.rdv, self.secret), daemon=True)
        self.trainer.start()

    def call(self, cmd: str, arg: Any = None, bound: float = 600.0) -> Any:
        self.conn.send((cmd, arg))
        assert self.conn.poll(bound), f"the trainer did not answer {cmd} within {bound} s"
        status, out = self.conn.recv()
        if status != "ok":
            raise RuntimeError(out)
        return out

    def ask(self, i: int, cmd: str, arg: Any = None) -> Any:
        self.test_ends[i].send((0, cmd, arg))
        assert self.test_ends[i].poll(600), f"worker {i} did not answer {cmd}"
        _, status, out = self.test_ends[i].recv()
        assert status == "ok", out
        return out

    def state(self, i: int) -> Dict[str, Any]:
        return self.ask(i, "state")

    def close(self) -> None:
        for p in self.workers + [self.trainer]:
            if p is not None and p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def bed():
    b = Bed()
    yield b
    b.close()


def assert_holds(bed: Bed, i: int, want: Dict[str, torch.Tensor], version: int) -> Dict[str, Any]:
    st = bed.state(i)
    assert st["version"] == version and st["partial"] is None, (i, st["version"], st["partial"])
    for name, w in want.items():
        got = st["weights"][name]
        assert got.dtype == w.dtype and torch.equal(got.view(torch.uint8), w.contiguous().view(torch.uint8)), f"worker {i}: {name} differs"
    return st


def test_three_versions_arrive_bit_exact_and_the_trainer_nic_sends_each_once(bed):
    bed.call("init", {"checksum": True})
    figures = []
    for version, seed in enumerate((11, 12, 13), start=1):
        got = bed.call("send", {"seed": seed})
        assert got["version"] == version
        want = bed.call("expected")
        for i in range(WORKERS):
            assert_holds(bed, i, want, version)
        payload = sum(t.numel() * t.element_size() for t in want.values())
        figures.append((got["sent"] / payload, payload / got["took"] / 1e6))
        if version == 2:
            bed.call("stale")
    for ratio, mbs in figures:
        print(f"trainer NIC bytes / payload {ratio:.4f}, {mbs:.1f} MB/s per update")
        assert ratio <= 1.05, f"the trainer's NIC sent {ratio:.3f}x the payload to {WORKERS} workers"
    for i in range(WORKERS):
        st = bed.state(i)
        assert st["refusals"].get("stale_version") == 1, st["refusals"]


def test_a_trainer_killed_mid_update_makes_each_worker_raise_within_its_bound(bed):
    t = time.monotonic()
    bed.conn.send(("send", {"seed": 21, "die_after": 20}))
    bed.trainer.join(TIMEOUT * 4)
    assert not bed.trainer.is_alive()
    for i in range(WORKERS):
        # The worker's update_weights raised (its answer went to the dead
        # trainer); its state says what the model holds.
        st = bed.state(i)
        assert st["version"] == 3 and st["partial"] == 4, (i, st["version"], st["partial"])
    took = time.monotonic() - t
    assert took < TIMEOUT * 3, f"the workers took {took:.0f} s to give up (bound {TIMEOUT:g} s a wait)"


def test_a_worker_killed_mid_update_makes_the_trainer_raise_naming_it(bed):
    bed.start_trainer()  # a new session: the workers join it again
    bed.call("init", {"checksum": False})
    bed.call("send", {"seed": 31})
    got = bed.call("send", {"seed": 32})  # connected: the figure without the checksum
    want = bed.call("expected")
    payload = sum(t.numel() * t.element_size() for t in want.values())
    print(f"without the checksum: trainer NIC bytes / payload {got['sent'] / payload:.4f}, {payload / got['took'] / 1e6:.1f} MB/s per update")
    for i in range(WORKERS):
        assert_holds(bed, i, want, 2)
    bed.ask(1, "die_after_loads", 3)
    t = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        bed.call("send", {"seed": 33})
    took = time.monotonic() - t
    msg = str(e.value)
    assert "WeightTransfer" in msg and ".w1" in msg and "version 3" in msg, msg
    assert took < TIMEOUT * 2.5, f"the trainer took {took:.0f} s to raise (bound {TIMEOUT:g} s a wait)"
    assert not bed.workers[1].is_alive()


def gloo_rank(rank: int, port: int, out: Connection) -> None:
    """One rank of the same update by torch.distributed's broadcast over
    gloo: rank 0 holds the trainer's parameters, the others receive."""
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORKERS + 1)
    params = [p.detach() for p in trainer_model(11).parameters()]
    if rank:
        params = [torch.empty_like(p) for p in params]
    dist.barrier()
    t = time.monotonic()
    for p in params:
        dist.broadcast(p, src=0)
    dist.barrier()
    took = time.monotonic() - t
    if rank == 0:
        out.send((sum(p.numel() * p.element_size() for p in params), took))
    dist.destroy_process_group()


def test_the_same_update_by_torch_distributed_broadcast_over_gloo(bed):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=gloo_rank, args=(r, port, b), daemon=True) for r in range(WORKERS + 1)]
    for p in procs:
        p.start()
    assert a.poll(600), "gloo did not finish"
    payload, took = a.recv()
    for p in procs:
        p.join(60)
    print(f"torch.distributed broadcast over gloo, {WORKERS} receivers: {payload / took / 1e6:.1f} MB/s per update ({payload} bytes, {took:.2f} s)")
