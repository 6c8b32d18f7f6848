"""A KV-cache mover between processes: prefill agents write each layer's
blocks (NumPy) into a decode agent's table, one notification per layer;
the decode side checks every byte of a layer the moment its notification
arrives (asyncio: ``await agent.notification()``).

With no role it is the whole demo: a rendezvous server here, one decode
process and ``--prefills`` prefill processes, every byte checked::

    python python/examples/kv_mover.py                 # 1 prefill -> 1 decode
    python python/examples/kv_mover.py --prefills 2    # 2 prefills -> 1 decode

Each role on its own (e.g. on two hosts; set GPUDIRECT_SECRET_FILE on both,
and give the rendezvous server's address)::

    gpudirect rendezvous --listen 10.0.0.1:7000 &
    python kv_mover.py --role decode --rendezvous 10.0.0.1:7000 --listen 10.0.0.1:0 --prefills 1
    python kv_mover.py --role prefill --rendezvous 10.0.0.1:7000 --listen 10.0.0.2:0 --index 0

The device comes from ``--device`` (default: GPUDIRECT_TEST_DEVICE, else
every RDMA device the agent finds).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import numpy as np

import gpudirect


def pattern(index: int, step: int, layer: int, blocks: int, block: int) -> np.ndarray:
    """What prefill ``index`` writes for ``layer`` at ``step``: a different
    byte stream per block, the same on both sides."""
    rng = np.random.default_rng([index, step, layer])
    return rng.integers(0, 256, size=(blocks, block), dtype=np.uint8)


def devices(args: argparse.Namespace):
    d = args.device or os.environ.get("GPUDIRECT_TEST_DEVICE")
    return [d] if d else None


async def decode(args: argparse.Namespace) -> None:
    shape = (args.prefills, args.steps, args.layers, args.blocks, args.block)
    table = np.zeros(shape, dtype=np.uint8)
    agent = gpudirect.Agent("decode", devices=devices(args), listen=args.listen)
    agent.register("kv-table", table)
    agent.publish(gpudirect.Rendezvous(args.rendezvous))
    expected = args.prefills * args.steps * args.layers
    seen = set()
    started = None
    while len(seen) < expected:
        peer, msg = await asyncio.wait_for(agent.notification(), args.timeout)
        started = started or time.monotonic()
        index, step, layer = (int(x) for x in msg.decode().split(":"))
        if (index, step, layer) in seen:
            raise SystemExit(f"decode: notification {msg!r} from {peer} arrived twice")
        seen.add((index, step, layer))
        # Blocks land in reverse order in the table, as a block table maps them.
        got = table[index, step, layer][::-1]
        if not np.array_equal(got, pattern(index, step, layer, args.blocks, args.block)):
            bad = int(np.argmax(np.any(got != pattern(index, step, layer, args.blocks, args.block), axis=1)))
            raise SystemExit(f"decode: {peer} layer {layer} step {step}: block {bad} differs when its notification arrived")
    secs = time.monotonic() - started
    print(
        f"decode: {expected} layers from {args.prefills} prefill(s), {table.nbytes >> 20} MiB, "
        f"every byte checked when its layer's notification arrived ({secs:.2f} s)"
    )


async def prefill(args: argparse.Namespace) -> None:
    name = f"prefill-{args.index}"
    kv = np.zeros((args.layers, args.blocks, args.block), dtype=np.uint8)
    agent = gpudirect.Agent(name, devices=devices(args), listen=args.listen)
    agent.register("kv", kv)
    decode = agent.lookup("decode", gpudirect.Rendezvous(args.rendezvous), timeout=args.timeout)
    layer_bytes = args.blocks * args.block
    for step in range(args.steps):
        for layer in range(args.layers):
            kv[layer] = pattern(args.index, step, layer, args.blocks, args.block)
        requests = []
        for layer in range(args.layers):
            base = (((args.index * args.steps + step) * args.layers + layer) * layer_bytes)
            entries = [
                ("kv", (layer * args.blocks + b) * args.block, decode, "kv-table", base + (args.blocks - 1 - b) * args.block, args.block)
                for b in range(args.blocks)
            ]
            req = agent.prepare("write", entries, notify=f"{args.index}:{step}:{layer}".encode())
            req.post()
            requests.append(req)
        # Every layer of this step in place before the buffer is refilled.
        await asyncio.wait_for(asyncio.gather(*requests), args.timeout)
    print(f"{name}: {args.steps} steps x {args.layers} layers x {args.blocks} blocks of {args.block} bytes written, one notification per layer")


def demo(args: argparse.Namespace) -> int:
    server = gpudirect.RendezvousServer("127.0.0.1:0")
    common = [
        "--rendezvous", server.addr, "--prefills", str(args.prefills), "--steps", str(args.steps),
        "--layers", str(args.layers), "--blocks", str(args.blocks), "--block", str(args.block),
        "--timeout", str(args.timeout), "--listen", "127.0.0.1:0",
    ]
    if args.device:
        common += ["--device", args.device]
    me = [sys.executable, os.path.abspath(__file__)]
    procs = [subprocess.Popen(me + ["--role", "decode"] + common)]
    procs += [subprocess.Popen(me + ["--role", "prefill", "--index", str(i)] + common) for i in range(args.prefills)]
    status = 0
    for p in procs:
        try:
            status |= p.wait(timeout=args.timeout + 30)
        except subprocess.TimeoutExpired:
            p.kill()
            status = 1
    server.close()
    print("kv_mover:", "every byte verified" if status == 0 else "FAILED")
    return status


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=["decode", "prefill"], help="one side only (default: the whole demo)")
    p.add_argument("--rendezvous", help="the rendezvous server, IP:PORT")
    p.add_argument("--listen", default="127.0.0.1:0", help="this agent's control address (IP:PORT)")
    p.add_argument("--device", help="RDMA device (default: GPUDIRECT_TEST_DEVICE, else all)")
    p.add_argument("--prefills", type=int, default=1)
    p.add_argument("--index", type=int, default=0, help="this prefill's index")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--block", type=int, default=16 << 10, help="bytes per block")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds any one wait may take")
    args = p.parse_args()
    if args.role is None:
        return demo(args)
    if not args.rendezvous:
        p.error("--role needs --rendezvous")
    asyncio.run(decode(args) if args.role == "decode" else prefill(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
