"""The engine from Python on a real RDMA device (Soft-RoCE in the guest):
processes exchanging NumPy blocks, concurrent awaits, buffer lifetime, the
GIL released during waits, each error kind as its exception."""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import gpudirect
from conftest import DEVICE, needs_device

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "kv_mover.py")


def agent(name: str) -> gpudirect.Agent:
    return gpudirect.Agent(name, devices=[DEVICE], listen="127.0.0.1:0")


def pair():
    a, b = agent("prefill"), agent("decode")
    assert a.load_remote(b.metadata()) == "decode"
    return a, b


def test_each_engine_error_kind_is_its_own_exception_with_the_rust_message():
    kinds = gpudirect._native._error_kinds()
    assert len(kinds) == 28
    classes = set()
    for message, exc in kinds:
        assert isinstance(exc, gpudirect.EngineError) and isinstance(exc, gpudirect.GpudirectError)
        assert str(exc) == message
        classes.add(type(exc))
    assert len(classes) == 28, "two kinds share an exception class"
    # Messages speak Python: no Rust paths.
    assert not [m for m, _ in kinds if "::" in m], [m for m, _ in kinds if "::" in m]
    unknown = [m for m, e in kinds if isinstance(e, gpudirect.UnknownPeerError)][0]
    assert "load its metadata first (Agent.load_remote())" in unknown, unknown
    for cls in classes:
        assert cls.__name__ in gpudirect.__all__ and getattr(gpudirect, cls.__name__) is cls


@needs_device
@pytest.mark.parametrize("prefills", [1, 2])
def test_kv_mover_between_processes_checks_every_byte(prefills):
    """Two (three) processes: prefills write NumPy blocks into one decode,
    one notification per layer; decode checks each layer on arrival."""
    out = subprocess.run(
        [sys.executable, EXAMPLE, "--prefills", str(prefills), "--device", DEVICE, "--steps", "3", "--timeout", "60"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{prefills * 3 * 8} layers from {prefills} prefill(s)" in out.stdout
    assert "every byte verified" in out.stdout


@needs_device
def test_many_concurrent_awaits_lose_nothing():
    a, b = pair()
    n = 64
    src = np.arange(n * 4096, dtype=np.uint8).reshape(n, 4096) ^ 0x5A
    dst = np.zeros_like(src)
    a.register("src", src)
    b.register("dst", dst)
    a.load_remote(b.metadata())  # again: it names "dst" now
    reqs = [a.prepare("write", [("src", i * 4096, "decode", "dst", i * 4096, 4096)], notify=b"%d" % i) for i in range(n)]

    async def main():
        # Cancelled awaits take nothing: what they waited for goes to the next.
        for _ in range(3):
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(b.notification(), 0.02)
        waiters = [asyncio.ensure_future(b.notification()) for _ in range(n)]
        await asyncio.sleep(0)
        for r in reqs:
            r.post()
        await asyncio.wait_for(asyncio.gather(*reqs), 30)
        got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
        return got

    got = asyncio.run(main())
    assert sorted(int(m) for _, m in got) == list(range(n)), "a notification lost or handed out twice"
    assert all(p == "prefill" for p, _ in got)
    assert np.array_equal(dst, src)
    assert all(r.status() == "done" for r in reqs)
    stats = a.peer_stats("decode")
    assert stats["posts"] == n and stats["completed"] == n and stats["bytes"] == n * 4096 and stats["failed"] == 0
    assert a.nic_stats()[0]["device"] == DEVICE and a.nic_stats()[0]["bytes"] == n * 4096
    assert reqs[0].stats()["completed"] == 1 and reqs[0].peer == "decode" and reqs[0].nbytes == 4096
    assert b.notifications() == []


@needs_device
def test_awaits_from_many_tasks_and_a_blocking_thread_together():
    """A thread's blocking waits reap what tasks await: no await hangs."""
    a, b = pair()
    src, dst = bytearray(os.urandom(1 << 16)), bytearray(1 << 16)
    a.register("s", src)
    b.register("d", dst)
    a.load_remote(b.metadata())
    req = a.prepare("write", [("s", 0, "decode", "d", 0, len(src))])
    other = a.prepare("write", [("s", 0, "decode", "d", 0, len(src))])
    stop = threading.Event()

    def blocking():
        while not stop.is_set():
            other.post()
            other.wait(10.0)

    t = threading.Thread(target=blocking)
    t.start()
    try:
        async def main():
            for _ in range(200):
                req.post()
                await asyncio.wait_for(req, 10)
        asyncio.run(main())
    finally:
        stop.set()
        t.join()
    assert dst == src


@needs_device
def test_a_registered_array_lives_until_deregistered_and_no_longer():
    a, b = pair()
    block = np.frombuffer(os.urandom(1 << 16), dtype=np.uint8).copy()
    held = block.copy()
    b.register("held", held)
    a.load_remote(b.metadata())
    alive = weakref.ref(held)
    del held
    gc.collect()
    assert alive() is not None, "a registered array was freed"
    # Its bytes are still what the NIC reads.
    into = np.zeros(1 << 16, dtype=np.uint8)
    a.register("into", into)
    req = a.prepare("read", [("into", 0, "decode", "held", 0, 1 << 16)])
    req.post()
    req.wait(10.0)
    assert np.array_equal(into, block)
    b.deregister("held")
    gc.collect()
    assert alive() is None, "a deregistered array is still held"
    # A request keeps its local memory until it goes.
    a_kept = weakref.ref(into)
    del into
    a.deregister("into")
    gc.collect()
    assert a_kept() is not None, "a prepared request's memory was released under it"
    del req
    gc.collect()
    assert a_kept() is None
    # A bytearray cannot change size while registered.
    buf = bytearray(4096)
    a.register("ba", buf)
    with pytest.raises(BufferError):
        buf.extend(b"x")
    a.deregister("ba")
    buf.extend(b"x")
    with pytest.raises(ValueError, match="read-only"):
        a.register("ro", bytes(16))
    with pytest.raises(ValueError, match="contiguous"):
        a.register("nc", np.zeros((8, 8), dtype=np.uint8)[:, ::2])


@needs_device
def test_other_threads_run_while_a_wait_blocks():
    a, b = pair()
    count = 0
    stop = threading.Event()

    def spin():
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.05)
        before = count
        started = time.monotonic()
        with pytest.raises(gpudirect.EngineTimeoutError, match="no completion within"):
            b.wait_notification(0.5)
        assert time.monotonic() - started >= 0.45
        during = count - before
    finally:
        stop.set()
        t.join()
    # With the GIL held the spinner would not move for 0.5 s.
    assert during > 10_000, f"the other thread advanced {during} times in a 0.5 s wait"


@needs_device
def test_errors_from_real_calls_are_their_kinds():
    a, b = pair()
    a.register("m", bytearray(64))
    with pytest.raises(gpudirect.DuplicateNameError, match="already registered"):
        a.register("m", bytearray(64))
    with pytest.raises(gpudirect.UnknownPeerError, match="load its metadata first"):
        a.prepare("write", [("m", 0, "nobody", "x", 0, 64)])
    with pytest.raises(gpudirect.UnknownMemoryError):
        a.prepare("write", [("m", 0, "decode", "x", 0, 64)])
    with pytest.raises(gpudirect.UnknownMemoryError):
        a.prepare("write", [("nope", 0, "decode", "x", 0, 64)])
    b.register("x", bytearray(64))
    a.load_remote(b.metadata())
    with pytest.raises(ValueError):
        a.prepare("write", [("m", 32, "decode", "x", 0, 64)])
    with pytest.raises(ValueError, match="write"):
        a.prepare("send", [("m", 0, "decode", "x", 0, 64)])
    with pytest.raises(gpudirect.EmptyRequestError):
        a.prepare("write", [])
    with pytest.raises(gpudirect.NotificationTooLongError):
        a.prepare("write", [("m", 0, "decode", "x", 0, 64)], notify=bytes(4096))
    with pytest.raises(gpudirect.MetadataError):
        a.load_remote(b"not metadata")
    with pytest.raises(gpudirect.NotPublishedError):
        server = gpudirect.RendezvousServer()
        a.lookup("absent", gpudirect.Rendezvous(server.addr), timeout=0.2)


@needs_device
def test_publish_and_lookup_through_a_rendezvous_server():
    server = gpudirect.RendezvousServer("127.0.0.1:0")
    rdv = gpudirect.Rendezvous(server.addr)
    a, b = agent("prefill"), agent("decode")
    b.register("t", bytearray(16))
    b.publish(rdv)
    assert a.lookup("decode", rdv, timeout=5) == "decode"
    a.register("s", bytearray(b"0123456789abcdef"))
    req = a.prepare("write", [("s", 0, "decode", "t", 0, 16)], notify=b"hi")
    req.post()
    req.wait(10)
    assert b.wait_notification(10) == ("prefill", b"hi")
    server.close()
    with pytest.raises(gpudirect.ConfigError):
        server.addr


@needs_device
def test_threads_registering_posting_and_deregistering_on_one_agent():
    """Eight threads share one agent: each registers its own buffer, writes
    it into its slice of the peer's table, waits, checks, deregisters, 20
    times over, while another thread reads the agent's statistics. Every
    byte lands where it should and nothing deadlocks."""
    a, b = pair()
    threads, rounds, size = 8, 20, 16 << 10
    table = np.zeros((threads, size), dtype=np.uint8)
    b.register("table", table)
    a.load_remote(b.metadata())
    errors = []
    stop = threading.Event()

    def worker(i):
        try:
            for r in range(rounds):
                name = f"t{i}-{r}"
                buf = np.full(size, (i * rounds + r) % 251, dtype=np.uint8)
                a.register(name, buf)
                req = a.prepare("write", [(name, 0, "decode", "table", i * size, size)])
                req.post()
                req.wait(20.0)
                del req
                a.deregister(name)
                if not np.all(table[i] == (i * rounds + r) % 251):
                    errors.append(f"thread {i} round {r}: wrong bytes in its slice")
        except Exception as e:  # reported below, with the thread
            errors.append(f"thread {i}: {e!r}")

    def reader():
        while not stop.is_set():
            a.nic_stats()
            a.peer_stats("decode")
            a.connections()

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    r = threading.Thread(target=reader)
    r.start()
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
    stop.set()
    r.join(10)
    assert not any(w.is_alive() for w in workers), "a thread is stuck"
    assert errors == []
    assert a.peer_stats("decode")["completed"] == threads * rounds


class HostArray:
    """Host memory behind ``__array_interface__`` only (as a CPU tensor
    exposes it through NumPy): no buffer protocol of its own."""

    def __init__(self, n):
        self._a = np.zeros(n, dtype=np.uint8)
        self.__array_interface__ = self._a.__array_interface__


@needs_device
def test_host_arrays_without_the_buffer_protocol_register_in_place():
    a, b = pair()
    src = HostArray(1 << 16)
    src._a[:] = np.arange(1 << 16) % 253
    dst = HostArray(1 << 16)
    assert a.register("s", src) == 1 << 16
    assert b.register("d", dst) == 1 << 16
    a.load_remote(b.metadata())
    req = a.prepare("write", [("s", 0, "decode", "d", 0, 1 << 16)])
    req.post()
    req.wait(10)
    assert np.array_equal(dst._a, src._a), "the registration was not the object's own memory"
    with pytest.raises(ValueError, match="not a buffer"):
        a.register("x", object())


@needs_device
def test_a_broadcast_awaited_reaches_every_receiver_and_the_source_nic_sends_it_once():
    n, size = 3, 3 << 20
    src = agent("trainer")
    receivers = [agent(f"infer-{i}") for i in range(n)]
    weights = [np.zeros(size, dtype=np.uint8) for _ in receivers]
    for r, w in zip(receivers, weights):
        r.register("weights", w)
    everyone = [src] + receivers
    for a in everyone:
        for b in everyone:
            if a is not b:
                a.load_remote(b.metadata())
    params = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    src.register("params", params)
    got = {}

    def receive(i):
        # Waiting is also what forwards this receiver's chunks.
        peer, msg = receivers[i].wait_notification(60.0)
        got[i] = (peer, msg, bool(np.array_equal(weights[i], params)))

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    cast = src.broadcast("params", 0, size, [(f"infer-{i}", "weights", 0) for i in range(n)], b"step 1")
    assert cast.nbytes == size and all(s == "pending" for _, s in cast.receivers())
    cast.post()

    async def main():
        await asyncio.wait_for(cast, 60)

    asyncio.run(main())
    for t in threads:
        t.join(60)
    assert got == {i: ("trainer", b"step 1", True) for i in range(n)}
    assert cast.status() == "done" and all(s == "whole" for _, s in cast.receivers())
    assert sum(s["bytes"] for s in src.nic_stats()) == size, "the source NIC sent the payload once"
    with pytest.raises(ValueError):
        src.broadcast("params", 0, size, [("infer-0", "weights", 1)], b"x")  # past its end
    with pytest.raises(gpudirect.UnknownPeerError):
        src.broadcast("params", 0, size, [("nobody", "weights", 0)], b"x")


def assert_never_posted(x) -> None:
    """A wait and an await on `x` (a request or a broadcast never posted)
    raise at once rather than return and hide the missing post()."""
    with pytest.raises(gpudirect.EngineError, match="never posted"):
        x.wait(1.0)

    async def main():
        with pytest.raises(gpudirect.EngineError, match="never posted"):
            await x

    asyncio.run(main())


@needs_device
def test_waiting_for_a_broadcast_never_posted_raises():
    src, r = agent("trainer-np"), agent("infer-np")
    r.register("w", np.zeros(16, dtype=np.uint8))
    src.register("p", np.arange(16, dtype=np.uint8))
    src.load_remote(r.metadata())
    r.load_remote(src.metadata())
    assert_never_posted(src.broadcast("p", 0, 16, [("infer-np", "w", 0)], b"x"))


@needs_device
def test_an_agent_without_a_secret_listens_on_loopback_and_a_network_address_needs_one():
    for var in ("GPUDIRECT_SECRET_FILE", "GPUDIRECT_SECRET"):
        assert var not in os.environ, f"{var} is set: this test checks an agent without a secret"
    a = gpudirect.Agent("solo", devices=[DEVICE])
    assert a.control_addr.startswith("127.0.0.1:"), a.control_addr
    with pytest.raises(gpudirect.AuthError, match="secret"):
        gpudirect.Agent("exposed", devices=[DEVICE], listen="0.0.0.0:18998")


@needs_device
def test_waiting_for_a_request_never_posted_raises():
    a, b = pair()
    src = np.arange(16, dtype=np.uint8)
    a.register("s", src)
    b.register("t", np.zeros(16, dtype=np.uint8))
    a.load_remote(b.metadata())
    req = a.prepare("write", [("s", 0, "decode", "t", 0, 16)])
    assert_never_posted(req)
    req.post()
    req.wait(10.0)
    assert req.status() == "done"


def test_the_rendezvous_takes_a_secret_file_as_the_agent_does(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    with pytest.raises(gpudirect.AuthError, match="secret"):
        gpudirect.RendezvousServer("0.0.0.0:0")
    server = gpudirect.RendezvousServer("0.0.0.0:0", secret_file=str(secret))
    port = server.addr.rsplit(":", 1)[1]
    gpudirect.Rendezvous(f"127.0.0.1:{port}", timeout=5, secret_file=str(secret))
    with pytest.raises(gpudirect.AuthError):
        gpudirect.Rendezvous(f"127.0.0.1:{port}", secret_file=str(tmp_path / "missing"))
    server.close()


@needs_device
def test_publish_and_lookup_with_a_secret_file_everywhere(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    server = gpudirect.RendezvousServer("127.0.0.1:0", secret_file=str(secret))
    rdv = gpudirect.Rendezvous(server.addr, timeout=5, secret_file=str(secret))
    a = gpudirect.Agent("prefill", devices=[DEVICE], listen="127.0.0.1:0", secret_file=str(secret))
    b = gpudirect.Agent("decode", devices=[DEVICE], listen="127.0.0.1:0", secret_file=str(secret))
    b.register("t", bytearray(16))
    b.publish(rdv)
    assert a.lookup("decode", rdv, timeout=5) == "decode"
    stranger = gpudirect.Rendezvous(server.addr, timeout=2)
    with pytest.raises(gpudirect.RendezvousError):
        a.lookup("decode", stranger, timeout=1)
    server.close()


def test_engine_errors_pickle_with_their_kind_and_message():
    """multiprocessing and Ray send exceptions between processes by pickle."""
    import pickle

    for message, exc in gpudirect._native._error_kinds():
        assert type(exc).__module__ == "gpudirect._native"
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == message
    try:
        raise gpudirect.PeerLostError("transfer to agent \"decode\" failed")
    except gpudirect.EngineError as e:
        back = pickle.loads(pickle.dumps(e))
        assert isinstance(back, gpudirect.PeerLostError) and str(back) == str(e)
    for cls in (gpudirect.GpudirectError, gpudirect.DoctorError):
        e = cls("x")
        assert cls.__module__ == "gpudirect._native" and str(pickle.loads(pickle.dumps(e))) == "x"


@needs_device
def test_close_and_with_release_the_agent_and_later_calls_raise():
    import socket
    import weakref

    a = agent("prefill")
    with agent("decode") as b:
        assert a.load_remote(b.metadata()) == "decode"
        src, dst = np.full(4096, 7, dtype=np.uint8), np.zeros(4096, dtype=np.uint8)
        a.register("src", src)
        b.register("dst", dst)
        a.load_remote(b.metadata())
        req = a.prepare("write", [("src", 0, "decode", "dst", 0, 4096)], notify=b"before close")
        port = b.control_addr
        held = weakref.ref(dst)

        async def waiting():
            return await b.notification()

        async def main():
            task = asyncio.ensure_future(waiting())
            await asyncio.sleep(0.05)
            b.close()
            with pytest.raises(gpudirect.EngineError, match="closed while awaited"):
                await asyncio.wait_for(task, 5)

        asyncio.run(main())
    # Closed (twice: by close() and by the with block): every call raises,
    # the control port no longer listens, the registered array is let go.
    b.close()
    assert b.name == "decode"
    for call in (b.metadata, b.notifications, b.connections, lambda: b.register("x", bytearray(64))):
        with pytest.raises(gpudirect.EngineError, match="is closed"):
            call()
    host, p = port.rsplit(":", 1)
    with pytest.raises(OSError):
        socket.create_connection((host, int(p)), timeout=2).close()
    del dst
    gc.collect()
    assert held() is None, "a closed agent still holds a registered array"
    # The request made before: it fails on its own (the peer's port is
    # gone), it does not hang.
    with pytest.raises(gpudirect.ControlError, match="refused"):
        req.post()
        req.wait(30)
    a.close()


@needs_device
def test_the_engine_s_warnings_reach_python_logging(caplog):
    import logging

    caplog.set_level(logging.WARNING, logger="gpudirect")
    a = gpudirect.Agent("open-to-all", devices=[DEVICE], listen="0.0.0.0:0", insecure=True)
    deadline = time.monotonic() + 10
    want = "anyone who reaches it is believed"
    while time.monotonic() < deadline and not any(want in r.getMessage() for r in caplog.records):
        time.sleep(0.05)
    got = [r for r in caplog.records if want in r.getMessage()]
    assert got, [r.getMessage() for r in caplog.records]
    assert got[0].levelno == logging.WARNING and got[0].name.startswith("gpudirect.engine")
    a.close()


@needs_device
def test_abort_gives_up_on_a_post_and_the_next_one_reconnects():
    """What to do after ``wait(timeout)`` gave up: abort() frees a thread
    blocked in wait(), the post raises AbortedError, and the next post to
    the peer (started again) connects anew and moves every byte."""

    n = 16 << 20
    a = agent("abort-a")
    src = np.zeros(n, dtype=np.uint8)
    a.register("src", src)

    def target(note):
        b = agent("abort-b")
        dst = np.zeros(n, dtype=np.uint8)
        b.register("dst", dst)
        a.load_remote(b.metadata())
        return b, dst, a.prepare("write", [("src", 0, "abort-b", "dst", 0, n)], notify=note)

    b, _, big = target(b"big")
    assert big.abort() is False, "nothing was posted yet"
    big.post()
    big.wait(30)
    # Its queue pairs gone, the peer acknowledges nothing: the post stays in
    # flight until the retries run out (about half a second).
    b.close()
    big.post()
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(pytest.raises(gpudirect.AbortedError, big.wait)))
    waiter.start()
    time.sleep(0.05)
    assert big.abort() is True, "the post to a peer that acknowledges nothing had finished within 50 ms"
    waiter.join(10)
    assert not waiter.is_alive() and outcome and "aborted" in str(outcome[0].value)
    with pytest.raises(gpudirect.AbortedError):
        big.status()
    # A failed status is the wait's to raise: the failure, not "never posted".
    with pytest.raises(gpudirect.AbortedError, match="aborted"):
        big.wait(1.0)
    assert a.connections() == 0

    b, dst, again = target(b"again")
    src[:] = 0x5A
    again.post()
    again.wait(30)
    assert b.wait_notification(30) == ("abort-a", b"again")
    assert (dst == 0x5A).all()

    # Awaited on asyncio: the abort wakes the task (the flush may raise no
    # completion event), well before the retries would have ended it.
    b.close()
    again.post()

    async def main():
        task = asyncio.ensure_future(again)
        await asyncio.sleep(0.05)
        started = time.monotonic()
        assert again.abort() is True
        with pytest.raises(gpudirect.AbortedError):
            await asyncio.wait_for(task, 5)
        return time.monotonic() - started

    assert asyncio.run(main()) < 0.4
    a.close()


def test_a_metrics_address_of_neither_form_is_a_config_error(monkeypatch):
    """Parsed before any device is opened: runs on the host too."""
    monkeypatch.delenv("GPUDIRECT_METRICS", raising=False)
    for bad in ("nonsense", "localhost:9400", "70000", "127.0.0.1"):
        with pytest.raises(gpudirect.ConfigError, match="metrics=.*a port"):
            gpudirect.Agent("m", metrics=bad)
    monkeypatch.setenv("GPUDIRECT_METRICS", "not-an-address")
    with pytest.raises(gpudirect.ConfigError, match="GPUDIRECT_METRICS"):
        gpudirect.Agent("m")
    # An explicit metrics= wins over the environment; "" serves none.
    devices = [DEVICE] if DEVICE else None
    try:
        with gpudirect.Agent("m", devices=devices, listen="127.0.0.1:0", metrics="") as a:
            assert a.metrics_addr is None
    except gpudirect.EngineError as e:
        assert DEVICE is None and "GPUDIRECT_METRICS" not in str(e), e


@needs_device
def test_stats_and_the_metrics_endpoint_count_host_bytes(monkeypatch):
    """An agent serving metrics on a free loopback port writes and reads
    host memory: stats() counts it as path "host", the endpoint serves
    the same line, and gpudirect.metrics.Collector the same samples."""
    import urllib.request

    monkeypatch.delenv("GPUDIRECT_METRICS", raising=False)
    a = gpudirect.Agent("scraped", devices=[DEVICE], listen="127.0.0.1:0", metrics="0")
    b = agent("peer")
    assert b.metrics_addr is None
    host, port = a.metrics_addr.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0, a.metrics_addr
    n = 1 << 20
    src = np.arange(n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    a.register("s", src)
    b.register("t", dst)
    assert a.load_remote(b.metadata()) == "peer"
    write = a.prepare("write", [("s", 0, "peer", "t", 0, n)])
    for _ in range(3):
        write.post()
        write.wait(10.0)
    read = a.prepare("read", [("s", 0, "peer", "t", 0, 4096)])
    read.post()
    read.wait(10.0)
    assert np.array_equal(dst, src)

    s = a.stats()
    assert s["agent"] == "scraped"
    nic = s["nics"][0]
    assert nic["device"] == DEVICE and len(nic["traffic"]) == 6
    by = {(t["direction"], t["path"]): t["bytes"] for t in nic["traffic"]}
    assert by[("out", "host")] == 3 * n and by[("in", "host")] == 4096
    assert sum(v for (_, p), v in by.items() if p != "host") == 0, by
    ops = {o["op"]: o for o in s["ops"]}
    assert list(ops) == ["write", "read"]
    w = ops["write"]
    assert w["requests"]["completed"] == 3 and w["requests"]["bytes"] == 3 * n
    # One post in 8 per posting thread is timed: of these four, at most one.
    timed = w["latency"]["count"] + ops["read"]["latency"]["count"]
    assert timed <= 1 and sum(w["latency"]["counts"]) == w["latency"]["count"]
    assert (w["latency"]["sum_seconds"] > 0) == (w["latency"]["count"] > 0)
    assert len(w["latency"]["counts"]) == len(w["latency"]["bounds"]) + 1 and w["latency"]["bounds"][-1] == 10.0
    assert s["peers"][0]["name"] == "peer" and s["peers"][0]["requests"]["bytes"] == 3 * n + 4096
    assert s["other_peers"]["peers"] == 0 and s["connections"] >= 1
    assert s["refusals"]["control"] == 0 and s["refusals"]["broadcast"] == a.broadcast_refusals()
    assert s["peer_events"] == {"lost": 0, "replaced": 0, "impostors": 0}

    def scrape() -> str:
        with urllib.request.urlopen(f"http://{a.metrics_addr}/metrics", timeout=10) as r:
            assert r.status == 200
            return r.read().decode()

    text = scrape()
    line = f'gpudirect_bytes_total{{agent="scraped",nic="{DEVICE}",direction="out",path="host"}} {3 * n}\n'
    assert line in text, text
    # One post in 8 per posting thread is timed.
    timed = re.search(r'^gpudirect_request_seconds_count\{agent="scraped",op="write"\} (\d+)$', text, re.M)
    assert timed is not None and int(timed.group(1)) <= 3, text

    # The collector gives prometheus_client the samples the endpoint serves.
    import prometheus_client
    from prometheus_client.parser import text_string_to_metric_families

    from gpudirect.metrics import Collector

    def sample_set(t: str):
        # The uptime is each snapshot's own moment.
        return {
            (x.name, tuple(sorted(x.labels.items())), x.value)
            for f in text_string_to_metric_families(t)
            for x in f.samples
            if x.name != "gpudirect_uptime_seconds"
        }

    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector(a))
    ours = sample_set(prometheus_client.generate_latest(registry).decode())
    assert ours == sample_set(scrape()), sorted(ours ^ sample_set(scrape()))

    # The port is taken: a second agent there is a ConfigError naming it.
    with pytest.raises(gpudirect.ConfigError, match="metrics endpoint"):
        gpudirect.Agent("clash", devices=[DEVICE], listen="127.0.0.1:0", metrics=a.metrics_addr)
    a.close()
    assert list(Collector(a).collect()) == [], "a closed agent has nothing to report"
    with pytest.raises(gpudirect.EngineError, match="closed"):
        a.stats()
