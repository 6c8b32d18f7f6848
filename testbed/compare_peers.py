"""testbed/compare-peers' two halves (python3 standard library only).

  drive  (in the guest) runs each engine's target and initiator
         (testbed/peer_workloads.py, examples/peer_workloads.rs) through
         every workload, repeat after repeat with the engine order
         alternating, and prints one PEERS-* line of JSON per fact.
  render (on the host) turns those lines into peers.md (medians, ranges,
         ratios gpudirect/peer, what each peer needed) and peers.svg.

Usage: compare_peers.py drive --engines LIST --repeat R --scale F --python PY --rust BIN
       compare_peers.py render LOG OUT_DIR [--versions 'name=ver ...']
"""

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import time
from xml.sax.saxutils import escape

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ENGINES = ["gpudirect-rust", "gpudirect-py", "mooncake", "nixl"]
TITLE = {"gpudirect-rust": "gpudirect (Rust)", "gpudirect-py": "gpudirect (Python)", "mooncake": "Mooncake TE", "nixl": "NIXL (UCX)"}
WORKLOADS = ["write-1m", "write-64x64k", "write-64x4k", "read-1m", "read-64x64k", "read-64x4k"]
# Requests per workload and repeat at --scale 1: about 256 MiB moved per
# large workload, 64 MiB for 4 KiB blocks.
ITERS = {"write-1m": 256, "read-1m": 256, "write-64x64k": 64, "read-64x64k": 64, "write-64x4k": 256, "read-64x4k": 256}
WHAT = {
    "write-1m": "1 MiB writes, one at a time",
    "write-64x64k": "64 x 64 KiB scattered writes per request, one notification",
    "write-64x4k": "64 x 4 KiB scattered writes per request, one notification",
    "read-1m": "1 MiB reads, one at a time",
    "read-64x64k": "64 x 64 KiB scattered reads per request",
    "read-64x4k": "64 x 4 KiB scattered reads per request",
}
# What each engine needed to start in the bed: part of what a user weighs.
NEEDS = {
    "gpudirect-rust": "the device name; agents on 127.0.0.1 need no secret (any other address: the cluster's secret); metadata passed as bytes",
    "gpudirect-py": "as the Rust engine (`pip install ./python`, abi3 wheel)",
    "mooncake": "`initialize(host, \"P2PHANDSHAKE\", \"rdma\", device)`: no metadata service; the peer named as host:rpc_port, its buffers by raw virtual address",
    "nixl": ("the UCX backend (bundled in the wheel, as are libibverbs and the mlx5 provider); metadata blobs swapped both ways (add_remote_agent) and raw addresses. "
             "The bundled libibverbs looks for other providers under /usr/lib64/libibverbs (RHEL's path): on Debian it finds no rxe and UCX moves the bytes over "
             "TCP or shared memory without a word (in this bed NIXL then showed up to 5x the MB/s of its RDMA runs on batches, with next to no packets on rxe0). Here it gets a folder on "
             "LD_LIBRARY_PATH holding the system's rxe provider and the bundled libibverbs under the soname the provider asks for, and UCX_TLS=rc, "
             "UCX_NET_DEVICES=rxe0:1 so that any fallback fails. `nixl-cu12` declares torch as a dependency (installed here with --no-deps)"),
}
START_TIMEOUT = 120.0
STEP_TIMEOUT = 300.0


def emit(kind, obj):
    sys.stdout.write(f"PEERS-{kind} " + json.dumps(obj, sort_keys=True) + "\n")
    sys.stdout.flush()


class Side:
    """One engine process, spoken to a line at a time, every read bounded."""

    def __init__(self, argv, role, env, logdir):
        self.role = role
        self.errpath = os.path.join(logdir, f"{role}.stderr")
        self.proc = subprocess.Popen(argv + [role], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.errpath, "wb"), env=env, text=True, bufsize=1)

    def send(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word, timeout):
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.role}: no {word} within {timeout:.0f} s{self.stderr_tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            if not ready:
                continue
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.role} exited ({self.proc.wait()}) before {word}{self.stderr_tail()}")
            words = line.split()
            if words and words[0] == word:
                return words[1:]
            if words and words[0] == "ERR":
                raise RuntimeError(f"{self.role}: {line[4:].strip()}{self.stderr_tail()}")
            # Anything else an engine prints on stdout is its own chatter.

    def stderr_tail(self, n=6):
        try:
            with open(self.errpath, "rb") as f:
                lines = [l for l in f.read().decode(errors="replace").splitlines() if l.strip()]
        except OSError:
            return ""
        return ("; stderr: " + " | ".join(lines[-n:])) if lines else ""

    def close(self):
        try:
            self.send("QUIT")
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_pair(argv, env, logdir):
    target = Side(argv, "target", env, logdir)
    init = None
    try:
        tblob = target.expect("READY", START_TIMEOUT)[0]
        init = Side(argv, "initiator", env, logdir)
        iblob = init.expect("READY", START_TIMEOUT)[0]
        target.send("PEER " + iblob)
        target.expect("OK", START_TIMEOUT)
        init.send("PEER " + tblob)
        init.expect("OK", START_TIMEOUT)
        return target, init
    except Exception:
        target.close()
        if init:
            init.close()
        raise


def drive(args):
    engines = args.engines.split(",")
    commands = {"gpudirect-rust": [args.rust]}
    for e in ("gpudirect-py", "mooncake", "nixl"):
        commands[e] = [args.python, os.path.join(HERE, "peer_workloads.py"), e]
    env = dict(os.environ)
    envs = {e: dict(env) for e in engines}
    extra = {}
    for item in args.engine_env:
        eng, _, kv = item.partition(":")
        k, _, v = kv.partition("=")
        if eng in envs:
            envs[eng][k] = v
            extra.setdefault(eng, {})[k] = v
    counter = f"/sys/class/infiniband/{env.get('PEERS_DEVICE', 'rxe0')}/ports/1/hw_counters/sent_pkts"
    emit("META", {"date": time.strftime("%Y-%m-%d"), "kernel": os.uname().release, "nproc": os.cpu_count(), "cpu": _cpu_model(), "repeat": args.repeat, "scale": args.scale, "engines": engines,
                  "env": {k: v for k, v in env.items() if k.startswith(("UCX_", "MC_", "NIXL_", "PEERS_"))}, "engine_env": extra, "counter": counter})
    unavailable = {}
    for rep in range(1, args.repeat + 1):
        order = engines if rep % 2 else list(reversed(engines))
        for eng in order:
            if eng in unavailable:
                continue
            logdir = f"/tmp/compare-peers/{eng}.{rep}"
            os.makedirs(logdir, exist_ok=True)
            pair = None
            for wl in WORKLOADS:
                n = max(4, int(ITERS[wl] * args.scale))
                try:
                    if pair is None:
                        pair = start_pair(commands[eng], envs[eng], logdir)
                    target, init = pair
                    target.send(f"PREP {wl}")
                    target.expect("OK", STEP_TIMEOUT)
                    pkts = _packets(counter)
                    init.send(f"RUN {wl} {n}")
                    secs, cpu, user, reqs, nbytes, notes = init.expect("RESULT", STEP_TIMEOUT)
                    pkts = _packets(counter) - pkts
                    target.send(f"CHECK {wl} {notes}")
                    target.expect("OK", STEP_TIMEOUT)
                    # The largest RoCE MTU is 4096: fewer packets than that
                    # allows means the bytes took another path (an engine's
                    # TCP or shared-memory fallback), which is not this race.
                    if pkts * 4096 < int(nbytes):
                        raise RuntimeError(f"the bytes did not cross {counter.split('/')[4]}: {pkts} packets for {nbytes} bytes (a TCP or shared-memory fallback?)")
                    emit("RESULT", {"engine": eng, "workload": wl, "rep": rep, "secs": float(secs), "cpu": float(cpu), "user": float(user), "requests": int(reqs), "bytes": int(nbytes), "notifications": int(notes), "packets": pkts})
                    print(f"[peers] rep {rep} {eng:15} {wl:13} {int(nbytes) / float(secs) / 1e6:8.1f} MB/s {float(cpu) / int(reqs) * 1e6:9.1f} us CPU/req", file=sys.stderr, flush=True)
                except Exception as e:  # noqa: BLE001 - one engine's failure is reported, the others run
                    emit("FAIL", {"engine": eng, "workload": wl, "rep": rep, "why": str(e), "at_start": pair is None})
                    print(f"[peers] rep {rep} {eng} {wl}: {e}", file=sys.stderr, flush=True)
                    if pair:
                        for side in pair:
                            side.close()
                        pair = None
                    else:
                        # It did not start: it will not in later repeats either.
                        unavailable[eng] = str(e)
                        break
            if pair:
                for side in pair:
                    side.close()
        if args.ceiling:
            ceiling(rep, args.scale, env.get("PEERS_DEVICE", "rxe0"))
    for eng, why in unavailable.items():
        emit("UNAVAILABLE", {"engine": eng, "why": why})
    emit("DONE", {})
    return 0


def ceiling(rep, scale, device):
    """perftest's ib_write_bw / ib_read_bw in the same guest: what the bed
    itself carries (pipelined, 128 in flight: not the engines' workloads)."""
    for op in ("write", "read"):
        for size in (1 << 20, 64 << 10, 4 << 10):
            # As ITERS: about 256 MiB per large size, 64 MiB for 4 KiB.
            total = (256 << 20) if size > 4096 else (64 << 20)
            n = max(16, int(total * scale / size))
            cmd = [f"ib_{op}_bw", "-d", device, "-x", "1", "-F", "-s", str(size), "-n", str(n), "-p", "18650"]
            try:
                srv = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1.0)
                out = subprocess.run(cmd + ["127.0.0.1"], capture_output=True, text=True, timeout=STEP_TIMEOUT).stdout
                srv.wait(30)
            except (OSError, subprocess.SubprocessError) as e:
                emit("CEILING", {"op": op, "size": size, "rep": rep, "error": str(e)})
                continue
            rows = [l.split() for l in out.splitlines()]
            vals = [float(r[3]) for r in rows if len(r) >= 4 and r[0] == str(size)]
            emit("CEILING", {"op": op, "size": size, "rep": rep, "mbps": vals[0] if vals else None})


def _packets(path):
    with open(path) as f:
        return int(f.read())


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


# ------------------------------------------------------------------ render

def parse_log(text):
    out = {"META": [], "RESULT": [], "FAIL": [], "UNAVAILABLE": [], "CEILING": [], "DONE": []}
    for line in text.splitlines():
        i = line.find("PEERS-")
        if i < 0:
            continue
        kind, _, body = line[i + 6:].partition(" ")
        if kind in out:
            try:
                out[kind].append(json.loads(body))
            except ValueError:
                pass
    return out


def summarize(results):
    """(engine, workload) -> {metric: (median, min, max)}, over repeats."""
    cells = {}
    for r in results:
        cells.setdefault((r["engine"], r["workload"]), []).append(r)
    out = {}
    for key, runs in cells.items():
        m = {
            "mbps": [r["bytes"] / r["secs"] / 1e6 for r in runs],
            "rps": [r["requests"] / r["secs"] for r in runs],
            "cpu_us": [r["cpu"] / r["requests"] * 1e6 for r in runs],
            "user_us": [r.get("user", r["cpu"]) / r["requests"] * 1e6 for r in runs],
        }
        out[key] = {k: (statistics.median(v), min(v), max(v)) for k, v in m.items()}
        out[key]["n"] = len(runs)
    return out


def _num(v):
    return "%.0f" % v if v >= 100 else "%.1f" % v if v >= 10 else "%.2f" % v


def _cell(st):
    med, lo, hi = st
    return _num(med) if lo == hi else f"{_num(med)} ({_num(lo)}-{_num(hi)})"


def ratios(summary, ours, peer, wl):
    """MB/s, CPU and user CPU per request, ours over the peer's; a ratio
    whose peer figure is zero (a short run's CPU time below the clock's
    grain) is None: not measured, never a division by zero."""
    a, b = summary.get((ours, wl)), summary.get((peer, wl))
    if not a or not b:
        return None
    return tuple(a[k][0] / b[k][0] if b[k][0] else None for k in ("mbps", "cpu_us", "user_us"))


def render_markdown(parsed, versions):
    meta = parsed["META"][0] if parsed["META"] else {}
    summary = summarize(parsed["RESULT"])
    engines = [e for e in meta.get("engines", ENGINES)]
    lines = ["# gpudirect beside Mooncake's Transfer Engine and NIXL", "",
             "Made by `testbed/compare-peers` (the command below); every figure is from one guest boot, "
             "two processes per engine on one Soft-RoCE device (rxe over loopback), host memory. "
             "Each cell: the median over repeats, (the range); MB/s and requests/s are the initiator's "
             "from its first post to its last completion; CPU is the initiator process's user+system "
             "seconds over the same span (its engine threads included) per request, and its user-space part: "
             "rxe does the NIC's work in the kernel, partly in the poster's context, so system time holds "
             "work that a real NIC does in hardware. Every byte is checked "
             "after each workload (reads at the initiator, writes and notification counts at the target).", ""]
    lines.append("Measured %s. Machine: %s, %s vCPUs, kernel %s; %s repeats, scale %s; peers: %s." % (
        meta.get("date", "?"), meta.get("cpu", "?"), meta.get("nproc", "?"), meta.get("kernel", "?"), meta.get("repeat", "?"), meta.get("scale", "?"), versions or "?"))
    if meta.get("env"):
        lines.append("Environment given to every engine: " + ", ".join(f"`{k}={v}`" for k, v in sorted(meta["env"].items())) + ".")
    root = os.path.dirname(HERE) + "/"
    for e, kv in sorted(meta.get("engine_env", {}).items()):
        lines.append(f"Environment given to {TITLE.get(e, e)} alone: " + ", ".join(f"`{k}={v.replace(root, '')}`" for k, v in sorted(kv.items())) + ".")
    lines.append("")
    for wl in WORKLOADS:
        if not any((e, wl) in summary for e in engines):
            continue
        lines += [f"## {wl}: {WHAT[wl]}", "", "| engine | MB/s | requests/s | CPU µs/request | of which user space | runs |", "|---|---:|---:|---:|---:|---:|"]
        for e in engines:
            st = summary.get((e, wl))
            if st:
                lines.append(f"| {TITLE[e]} | {_cell(st['mbps'])} | {_cell(st['rps'])} | {_cell(st['cpu_us'])} | {_cell(st['user_us'])} | {st['n']} |")
            else:
                lines.append(f"| {TITLE[e]} | — | — | — | — | 0 |")
        lines.append("")
    ceil = {}
    for c in parsed["CEILING"]:
        if c.get("mbps"):
            ceil.setdefault((c["op"], c["size"]), []).append(c["mbps"])
    if ceil:
        lines += ["## What the bed carries", "",
                  "perftest in the same guest, between the engines' runs (`ib_write_bw`/`ib_read_bw -F`, 128 requests in flight, "
                  "one size per run): the ceiling of Soft-RoCE on these vCPUs, not the engines' workloads.", "",
                  "| perftest | MB/s |", "|---|---:|"]
        for (op, size), v in sorted(ceil.items(), key=lambda kv: (kv[0][0] != "write", -kv[0][1])):
            label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
            lines.append(f"| ib_{op}_bw {label} | {_cell((statistics.median(v), min(v), max(v)))} |")
        lines.append("")
    lines += ["## Ratios, gpudirect / peer (medians)", "",
              "MB/s, then CPU per request, then its user-space part: throughput above 1.00 and CPU below 1.00 favour gpudirect.", "",
              "| workload | " + " | ".join(f"{TITLE[o]} / {TITLE[p]}" for o in ("gpudirect-py", "gpudirect-rust") for p in ("mooncake", "nixl")) + " |",
              "|---|" + "---:|" * 4]
    for wl in WORKLOADS:
        row = []
        for o in ("gpudirect-py", "gpudirect-rust"):
            for p in ("mooncake", "nixl"):
                r = ratios(summary, o, p, wl)
                row.append("—" if r is None else ", ".join("not measured" if v is None else f"{v:.2f}x" if v >= 0.005 else "<0.01x" for v in r))
        lines.append(f"| {wl} | " + " | ".join(row) + " |")
    lines += ["", "## What each engine needed to start", ""]
    for e in engines:
        lines.append(f"- {TITLE[e]}: {NEEDS[e]}.")
    fails = parsed["FAIL"]
    if fails or parsed["UNAVAILABLE"]:
        lines += ["", "## Runs that failed", ""]
        for u in parsed["UNAVAILABLE"]:
            lines.append(f"- {TITLE.get(u['engine'], u['engine'])} did not run: {u['why']}")
        for f in fails:
            lines.append(f"- {TITLE.get(f['engine'], f['engine'])}, {f['workload']}, repeat {f['rep']}: {f['why']}")
    if not parsed["DONE"]:
        lines += ["", "The guest run did not finish: the figures above are the runs it completed."]
    return "\n".join(lines) + "\n"


COLORS = {"gpudirect-rust": "#1b6ca8", "gpudirect-py": "#5aa9e6", "mooncake": "#e07a1f", "nixl": "#76b041"}


def render_svg(parsed):
    """Grouped bars, one group per workload, MB/s median with the range."""
    summary = summarize(parsed["RESULT"])
    engines = (parsed["META"][0] if parsed["META"] else {}).get("engines", ENGINES)
    wls = [w for w in WORKLOADS if any((e, w) in summary for e in engines)]
    top = max([summary[k]["mbps"][2] for k in summary] or [1.0])
    step = 10 ** len(str(int(top))) / 10
    top = (int(top / step) + 1) * step
    W, H, L, B, T = 820, 380, 60, 60, 40
    gw = (W - L - 20) / max(1, len(wls))
    bw = gw * 0.8 / max(1, len(engines))
    y = lambda v: H - B - (H - B - T) * v / top  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14">MB/s per workload (median; whisker: range over repeats)</text>']
    for i in range(6):
        v = top * i / 5
        out.append(f'<line x1="{L}" x2="{W - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/><text x="{L - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for gi, wl in enumerate(wls):
        x0 = L + gi * gw + gw * 0.1
        for ei, e in enumerate(engines):
            st = summary.get((e, wl))
            if not st:
                continue
            med, lo, hi = st["mbps"]
            x = x0 + ei * bw
            out.append(f'<rect x="{x:.1f}" y="{y(med):.1f}" width="{bw * 0.9:.1f}" height="{y(0) - y(med):.1f}" fill="{COLORS[e]}"><title>{escape(TITLE[e])} {wl}: {med:.1f} MB/s</title></rect>')
            cx = x + bw * 0.45
            out.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(lo):.1f}" y2="{y(hi):.1f}" stroke="#333"/>')
        out.append(f'<text x="{L + gi * gw + gw / 2:.1f}" y="{H - B + 16}" text-anchor="middle">{wl}</text>')
    for ei, e in enumerate(engines):
        lx = L + ei * 180
        out.append(f'<rect x="{lx}" y="{H - 22}" width="12" height="12" fill="{COLORS[e]}"/><text x="{lx + 16}" y="{H - 12}">{escape(TITLE[e])}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def render(args):
    with open(args.log, encoding="utf-8", errors="replace") as f:
        parsed = parse_log(f.read())
    os.makedirs(args.out, exist_ok=True)
    meta = parsed["META"][0] if parsed["META"] else None
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write(render_markdown(parsed, args.versions))
        if meta:
            # From what the guest run recorded, so a log rendered later says how it was made.
            scale = ("%g" % meta["scale"]) if isinstance(meta.get("scale"), (int, float)) else meta.get("scale")
            f.write(f"\nReproduce: `testbed/compare-peers --repeat {meta.get('repeat')} --scale {scale} --smp {meta.get('nproc')} --engines {','.join(meta.get('engines', ENGINES))}`\n")
    with open(os.path.join(args.out, "peers.svg"), "w") as f:
        f.write(render_svg(parsed))
    with open(os.path.join(args.out, "peers.json"), "w") as f:
        json.dump(parsed, f, indent=1, sort_keys=True)
    if not parsed["RESULT"]:
        return 3
    return 1 if parsed["FAIL"] or parsed["UNAVAILABLE"] or not parsed["DONE"] else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive")
    d.add_argument("--engines", default=",".join(ENGINES))
    d.add_argument("--repeat", type=int, default=3)
    d.add_argument("--scale", type=float, default=1.0)
    d.add_argument("--python", required=True)
    d.add_argument("--rust", required=True)
    d.add_argument("--ceiling", action="store_true", help="also run perftest's ib_write_bw and ib_read_bw each repeat")
    d.add_argument("--engine-env", action="append", default=[], metavar="ENGINE:KEY=VALUE", help="set for that engine's processes only")
    r = sub.add_parser("render")
    r.add_argument("log")
    r.add_argument("out")
    r.add_argument("--versions", default="")
    args = ap.parse_args(argv)
    return drive(args) if args.cmd == "drive" else render(args)


if __name__ == "__main__":
    sys.exit(main())
