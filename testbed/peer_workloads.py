"""One side of a transfer engine in testbed/compare-peers: gpudirect's
Python engine, Mooncake's Transfer Engine or NIXL (UCX backend), driven by
testbed/compare_peers.py over stdin/stdout. examples/peer_workloads.rs is
the same for gpudirect's Rust engine; the two must agree on the protocol,
the workloads and the bytes (see PROTOCOL below).

Usage: python peer_workloads.py ENGINE target|initiator
       ENGINE: gpudirect-py | mooncake | nixl; the device is
       $PEERS_DEVICE (default rxe0), the address $PEERS_HOST (127.0.0.1);
       $PEERS_QPS_PER_RAIL overrides gpudirect's queue pairs per rail.

PROTOCOL (one line each way, in order):
  -> READY <hex>          this side's blob (metadata, address) once it is up
  <- PEER <hex>           the other side's blob
  <- PREP <workload>      target: fill (reads) or poison (writes) its slots
  <- RUN <workload> <n>   initiator: warm up, time n requests, check bytes
  -> RESULT <secs> <cpu_secs> <user_secs> <requests> <bytes> <notifications sent>
  <- CHECK <workload> <k> target: wait for k notifications, check bytes
  -> OK                   (or ERR <why>, after which the side exits)
  <- QUIT
Workloads: write-1m, read-1m (one 1 MiB request at a time), write-64x64k,
read-64x64k, write-64x4k, read-64x4k (64 scattered blocks per request, one
completion each; writes carry one notification per request). Both sides
hold BUF bytes; block g of a workload lives at local slot (5g+1) mod S and
remote slot (7g+3) mod S (S = BUF / block), so no two blocks of a request
are adjacent on either side. Its 8-byte words are (w+1)<<56 | g<<32 | i.
"""

import os
import resource
import sys
import threading
import time

import numpy as np

BUF = 16 << 20
POISON = 0xEE
WARMUP = 4
WAIT = 30.0
WORKLOADS = {
    # name: (op, block bytes, blocks per request, distinct requests)
    "write-1m": ("write", 1 << 20, 1, 8),
    "write-64x64k": ("write", 64 << 10, 64, 2),
    "write-64x4k": ("write", 4 << 10, 64, 2),
    "read-1m": ("read", 1 << 20, 1, 8),
    "read-64x64k": ("read", 64 << 10, 64, 2),
    "read-64x4k": ("read", 4 << 10, 64, 2),
}
ORDER = list(WORKLOADS)


class Plan:
    """Where each block of a workload lives on each side, and its bytes."""

    def __init__(self, name):
        self.name = name
        self.wid = ORDER.index(name)
        self.op, self.block, self.per_req, self.nreqs = WORKLOADS[name]
        self.notify = self.op == "write" and self.per_req > 1
        slots = BUF // self.block
        n = self.per_req * self.nreqs
        self.local = [((5 * g + 1) % slots) * self.block for g in range(n)]
        self.remote = [((7 * g + 3) % slots) * self.block for g in range(n)]

    def requests(self):
        """Per request: [(local offset, remote offset, length)]."""
        return [[(self.local[g], self.remote[g], self.block) for g in range(r * self.per_req, (r + 1) * self.per_req)] for r in range(self.nreqs)]

    def data(self, g):
        words = self.block // 8
        base = np.uint64(((self.wid + 1) << 56) | (g << 32))
        return (np.arange(words, dtype=np.uint64) | base).view(np.uint8)

    def fill(self, buf, offsets):
        for g, off in enumerate(offsets):
            buf[off:off + self.block] = self.data(g)

    def poison(self, buf, offsets):
        for off in offsets:
            buf[off:off + self.block] = POISON

    def check(self, buf, offsets):
        for g, off in enumerate(offsets):
            if not np.array_equal(buf[off:off + self.block], self.data(g)):
                bad = int(np.argmax(buf[off:off + self.block] != self.data(g)))
                return f"block {g} at offset {off}: byte {bad} is {buf[off + bad]:#x}, not {self.data(g)[bad]:#x}"
        return None


# ------------------------------------------------------------------ engines
# Each engine: __init__(role, buf) brings it up over buf; blob() -> bytes;
# connect(peer_blob); requests(plan) -> opaque requests; run(req) does one
# and returns when it completed; notifications() -> how many arrived since
# the last call (target). Errors raise.

class GpudirectPy:
    def __init__(self, role, buf):
        import gpudirect
        self.timeout_error = gpudirect.EngineTimeoutError
        self.name = "peers-" + role
        qps = os.environ.get("PEERS_QPS_PER_RAIL")
        self.agent = gpudirect.Agent(self.name, devices=[os.environ.get("PEERS_DEVICE", "rxe0")], listen=os.environ.get("PEERS_HOST", "127.0.0.1") + ":0", qps_per_rail=int(qps) if qps else None)
        self.agent.register("buf", buf)
        self.peer = None

    def blob(self):
        return self.agent.metadata()

    def connect(self, blob):
        self.peer = self.agent.load_remote(blob)

    def requests(self, plan):
        return [self.agent.prepare(plan.op, [("buf", lo, self.peer, "buf", ro, n) for lo, ro, n in entries], b"batch" if plan.notify else None) for entries in plan.requests()]

    def run(self, req):
        req.post()
        req.wait(WAIT)

    def notifications(self):
        try:
            self.agent.wait_notification(0.2)
        except self.timeout_error:
            return len(self.agent.notifications())
        return 1 + len(self.agent.notifications())


class Mooncake:
    def __init__(self, role, buf):
        from mooncake.engine import TransferEngine, TransferNotify, TransferOpcode
        self.Notify, self.Opcode = TransferNotify, TransferOpcode
        self.te = TransferEngine()
        self.host = os.environ.get("PEERS_HOST", "127.0.0.1")
        rc = self.te.initialize(self.host, "P2PHANDSHAKE", "rdma", os.environ.get("PEERS_DEVICE", "rxe0"))
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize returned {rc}")
        self.addr = buf.ctypes.data
        rc = self.te.register_memory(self.addr, BUF)
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self.target = None
        self.raddr = None

    def blob(self):
        return f"{self.host}:{self.te.get_rpc_port()} {self.addr}".encode()

    def connect(self, blob):
        self.target, raddr = blob.decode().split()
        self.raddr = int(raddr)

    def requests(self, plan):
        code = self.Opcode.Write if plan.op == "write" else self.Opcode.Read
        out = []
        for entries in plan.requests():
            lo = [self.addr + e[0] for e in entries]
            ro = [self.raddr + e[1] for e in entries]
            ln = [e[2] for e in entries]
            note = self.Notify("peers-initiator", "batch") if plan.notify else None
            out.append((code, lo, ro, ln, note))
        return out

    def run(self, req):
        code, lo, ro, ln, note = req
        if len(lo) == 1 and note is None:
            rc = self.te.transfer_sync(self.target, lo[0], ro[0], ln[0], code)
        else:
            rc = self.te.batch_transfer_sync(self.target, lo, ro, ln, code, note)
        if rc != 0:
            raise RuntimeError(f"transfer returned {rc}")

    def notifications(self):
        time.sleep(0.002)
        return len(self.te.get_notifies())


class Nixl:
    def __init__(self, role, buf):
        from nixl_cu12._api import nixl_agent, nixl_agent_config
        self.name = "peers-" + role
        self.agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        if "UCX" not in self.agent.backends:
            raise RuntimeError(f"NIXL's UCX backend did not start (plugins: {self.agent.get_plugin_list()})")
        self.addr = buf.ctypes.data
        self.agent.register_memory([(self.addr, BUF, 0, "")], "DRAM")
        self.peer = None
        self.raddr = None

    def blob(self):
        return b"%d " % self.addr + self.agent.get_agent_metadata()

    def connect(self, blob):
        raddr, md = blob.split(b" ", 1)
        self.raddr = int(raddr)
        self.peer = self.agent.add_remote_agent(md)
        if isinstance(self.peer, bytes):
            self.peer = self.peer.decode()

    def requests(self, plan):
        reqs = plan.requests()
        flat = [e for entries in reqs for e in entries]
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(self.addr + lo, n, 0) for lo, _, n in flat], "DRAM")
        remote = self.agent.prep_xfer_dlist(self.peer, [(self.raddr + ro, n, 0) for _, ro, n in flat], "DRAM")
        self._keep = (local, remote)
        op = "WRITE" if plan.op == "write" else "READ"
        out, at = [], 0
        for entries in reqs:
            idx = list(range(at, at + len(entries)))
            at += len(entries)
            out.append(self.agent.make_prepped_xfer(op, local, idx, remote, idx, b"batch" if plan.notify else b""))
        return out

    def run(self, req):
        state = self.agent.transfer(req)
        while state == "PROC":
            state = self.agent.check_xfer_state(req)
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer state {state}")

    def notifications(self):
        time.sleep(0.002)
        return sum(len(v) for v in self.agent.get_new_notifs().values())


ENGINES = {"gpudirect-py": GpudirectPy, "mooncake": Mooncake, "nixl": Nixl}


# ------------------------------------------------------------------- sides

def say(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def cpu_seconds():
    """(user + system, user) of this process, every thread."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_utime


def initiator_run(eng, buf, name, n):
    plan = Plan(name)
    if plan.op == "write":
        plan.fill(buf, plan.local)
    else:
        plan.poison(buf, plan.local)
    reqs = eng.requests(plan)
    for i in range(WARMUP):
        eng.run(reqs[i % len(reqs)])
    (cpu0, user0), t0 = cpu_seconds(), time.perf_counter()
    for i in range(n):
        eng.run(reqs[i % len(reqs)])
    secs, (cpu, user) = time.perf_counter() - t0, cpu_seconds()
    cpu, user = cpu - cpu0, user - user0
    if plan.op == "read":
        bad = plan.check(buf, plan.local)
        if bad:
            raise RuntimeError(f"{name}: read back wrong: {bad}")
    notes = (n + WARMUP) if plan.notify else 0
    say(f"RESULT {secs:.6f} {cpu:.6f} {user:.6f} {n} {n * plan.per_req * plan.block} {notes}")


class Counter:
    """Drains the target's notifications on a thread, as a receiver does."""

    def __init__(self, eng):
        self.eng, self.count, self.error, self.stop = eng, 0, None, False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        try:
            while not self.stop:
                got = self.eng.notifications()
                with self.lock:
                    self.count += got
        except Exception as e:  # noqa: BLE001 - reported on the next CHECK
            self.error = f"{type(e).__name__}: {e}"

    def take(self, k, deadline):
        while True:
            with self.lock:
                if self.count >= k or self.error or time.monotonic() > deadline:
                    got, self.count = self.count, 0
                    return got, self.error
            time.sleep(0.01)


def target_cmd(eng, buf, counter, words):
    plan = Plan(words[1])
    if words[0] == "PREP":
        if plan.op == "write":
            plan.poison(buf, plan.remote)
        else:
            plan.fill(buf, plan.remote)
        return
    want = int(words[2])
    got, err = counter.take(want, time.monotonic() + WAIT)
    if err:
        raise RuntimeError(f"notifications: {err}")
    if got != want:
        raise RuntimeError(f"{plan.name}: {got} notifications arrived, {want} were sent")
    if plan.op == "write":
        bad = plan.check(buf, plan.remote)
        if bad:
            raise RuntimeError(f"{plan.name}: wrong bytes at the target: {bad}")


def main():
    engine, role = sys.argv[1], sys.argv[2]
    buf = np.full(BUF, POISON, dtype=np.uint8)
    try:
        eng = ENGINES[engine](role, buf)
        say("READY " + eng.blob().hex())
        counter = None
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            if words[0] == "QUIT":
                break
            if words[0] == "PEER":
                eng.connect(bytes.fromhex(words[1]))
                if role == "target":
                    counter = Counter(eng)
                say("OK")
            elif words[0] == "RUN":
                initiator_run(eng, buf, words[1], int(words[2]))
            elif words[0] in ("PREP", "CHECK"):
                target_cmd(eng, buf, counter, words)
                say("OK")
            else:
                raise RuntimeError(f"unknown command {line.strip()!r}")
    except Exception as e:  # noqa: BLE001 - the driver reports it and goes on
        say(f"ERR {type(e).__name__}: {e}".replace("\n", " "))
        sys.stdout.flush()
        os._exit(1)
    if counter:
        counter.stop = True
    sys.stdout.flush()
    # Engines' own threads may not stop on interpreter exit.
    os._exit(0)


if __name__ == "__main__":
    main()
