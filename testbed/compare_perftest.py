#!/usr/bin/env python3
"""Parser, report and plot generator for testbed/compare-perftest.

testbed/compare-perftest runs perftest (ib_write_bw, ib_read_bw, ib_send_bw,
ib_write_lat) and `gpudirect bw` / `gpudirect lat` alternately inside one
Soft-RoCE guest and captures the guest's stdout in a log. This module turns
that log into

  raw.json        every run: parameters, exit status, parsed result, the
                  result lines it was parsed from (all output when it failed)
  comparison.md   medians per size and operation, ratios ours/perftest, the
                  machine and parameters, the failed runs
  bandwidth.svg   BW average against message size (log2 x axis), one panel
                  per operation, perftest dashed, gpudirect solid

Python 3 standard library only. Subcommands:

  plan    --sizes SPEC [--iters N] [--lat-iters N] [--tx-depth N]
          [--max-bytes B] [--min-iters N]
          prints "# max_bytes N", then one line per size:
          SIZE BW_ITERS BW_TX_DEPTH LAT_ITERS
  report  --log LOG --out DIR [--testbed-rc N]
          parses a captured guest log and writes the three files
  render  --raw RAW_JSON --out DIR
          rewrites comparison.md and bandwidth.svg from a raw.json
"""

import argparse
import json
import math
import os
import re
import statistics
import sys
from xml.sax.saxutils import escape

SCHEMA = 1
MIB = 1 << 20


def _perftest_all_sizes():
    """perftest's -a sweep (2 B .. 8 MiB), read from its one definition,
    PERFTEST_ALL_EXPONENTS in src/perf/sizes.rs, which bw -a and the rdma
    bench use too."""
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "src", "perf", "sizes.rs")
    with open(src, encoding="utf-8") as f:
        m = re.search(r"PERFTEST_ALL_EXPONENTS:[^=]*=\s*(\d+)\.\.=(\d+);", f.read())
    if not m:
        raise RuntimeError("%s: no PERFTEST_ALL_EXPONENTS range" % src)
    return [1 << p for p in range(int(m.group(1)), int(m.group(2)) + 1)]


ALL_SIZES = _perftest_all_sizes()
QUICK_SIZES = [2, 4096, 65536, 1048576]
DEFAULT_SIZES = ALL_SIZES[::2]  # every other power of two: 2, 8, 32, .. 8 MiB
BW_OPS = ("write", "read", "send")
ALL_OPS = ("write", "read", "send", "lat")
TOOLS = ("perftest", "gpudirect")

PERFTEST_NAME = {"write": "ib_write_bw", "read": "ib_read_bw", "send": "ib_send_bw", "lat": "ib_write_lat"}
OURS_NAME = {
    "write": "gpudirect bw --op write",
    "read": "gpudirect bw --op read",
    "send": "gpudirect bw --op send",
    "lat": "gpudirect lat --op write",
}
OP_TITLE = {"write": "RDMA write", "read": "RDMA read", "send": "send/receive", "lat": "RDMA write latency"}


class UsageError(Exception):
    pass


# ---------------------------------------------------------------- sizes, plan

_SIZE_RE = re.compile(r"^(\d+)\s*(k|kb|kib|m|mb|mib|g|gb|gib)?$", re.I)


def parse_size(tok):
    """'4096', '4K', '4KiB', '1M' -> bytes (binary units)."""
    m = _SIZE_RE.match(tok.strip())
    if not m:
        raise UsageError("bad size %r (bytes, or with K/M/G suffix)" % tok)
    n = int(m.group(1))
    unit = (m.group(2) or "").lower()[:1]
    n *= {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[unit]
    if n < 1 or n > (1 << 30):
        raise UsageError("size %r out of range (1 B to 1 GiB)" % tok)
    return n


def parse_sizes(spec):
    """'all' | 'quick' | 'default' | comma list -> sorted unique sizes."""
    s = spec.strip().lower()
    if s == "all":
        return list(ALL_SIZES)
    if s == "quick":
        return list(QUICK_SIZES)
    if s == "default":
        return list(DEFAULT_SIZES)
    toks = [t for t in re.split(r"[,\s]+", s) if t]
    if not toks:
        raise UsageError("empty size list")
    return sorted(set(parse_size(t) for t in toks))


def effective_iters(size, iters, max_bytes, min_iters):
    """Iterations for one size: `iters`, lowered so that a run moves about
    `max_bytes` at most, but never below `min_iters` (nor above `iters`)."""
    if max_bytes <= 0:
        return iters
    n = min(iters, max_bytes // size)
    return max(n, min(min_iters, iters), 1)


def plan(sizes, iters, lat_iters, tx_depth, max_bytes, min_iters):
    """[(size, bw_iters, bw_tx_depth, lat_iters)]; the tx depth never exceeds
    the iterations (perftest lowers it the same way)."""
    out = []
    for s in sizes:
        bi = effective_iters(s, iters, max_bytes, min_iters)
        li = effective_iters(s, lat_iters, max_bytes, min_iters)
        out.append((s, bi, min(tx_depth, bi), li))
    return out


def human_size(n):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return "%d %s" % (n >> shift, unit)
    return "%d B" % n


def short_size(n):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return "%d%s" % (n >> shift, unit)
    return str(n)


# ---------------------------------------------------------------- parsers

_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"
_ROW_RE = re.compile(r"^\s*\d+(?:\s+%s)+\s*$" % _NUM)

# Column names as perftest prints them, in any order, mapped to our keys.
_BW_COLS = [
    ("#bytes", "bytes"),
    ("#iterations", "iterations"),
    ("BW peak", "bw_peak"),
    ("BW average", "bw_avg"),
    ("MsgRate", "msg_rate_mpps"),
]
_LAT_COLS = [
    ("#bytes", "bytes"),
    ("#iterations", "iterations"),
    ("t_min", "t_min_us"),
    ("t_max", "t_max_us"),
    ("t_typical", "t_typical_us"),
    ("t_avg", "t_avg_us"),
    ("t_stdev", "t_stdev_us"),
    ("99.9% percentile", "p999_us"),
    ("99% percentile", "p99_us"),
]


def _header_keys(line, cols):
    """Keys of the columns named in a header line, in the order they appear."""
    found = []
    taken = []
    for name, key in cols:
        i = line.find(name)
        # "99% percentile" also matches inside "99.9% percentile": skip
        # matches that overlap a longer name already taken.
        while i >= 0 and any(a <= i < b for a, b in taken):
            i = line.find(name, i + 1)
        if i >= 0:
            found.append((i, key))
            taken.append((i, i + len(name)))
    return [k for _, k in sorted(found)]


def _bw_factor(header):
    """Multiplier from the header's bandwidth unit to MB/s (2^20 B/s)."""
    if "Gb/sec" in header:
        return 1e9 / 8 / MIB
    if "MiB/sec" in header or "MB/sec" in header:
        return 1.0
    return 1.0


def parse_perftest(text):
    """Result rows of a perftest bw or lat client output.

    Returns {"kind": "bw"|"lat", "header": str, "rows": [dict], "lines": [str]}
    or None when there is no result table. bw rows have bytes, iterations,
    bw_peak_mb_s, bw_avg_mb_s, msg_rate_mpps; lat rows bytes, iterations,
    t_min_us, t_max_us, t_typical_us, t_avg_us, t_stdev_us, p99_us, p999_us
    (those the header names)."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "#bytes" not in line:
            continue
        if "BW average" in line or "BW peak" in line:
            kind, keys = "bw", _header_keys(line, _BW_COLS)
        elif "t_min" in line or "t_typical" in line:
            kind, keys = "lat", _header_keys(line, _LAT_COLS)
        else:
            continue
        factor = _bw_factor(line) if kind == "bw" else 1.0
        rows, used = [], [line.rstrip()]
        for row in lines[i + 1:]:
            if not _ROW_RE.match(row):
                break
            used.append(row.rstrip())
            vals = row.split()
            d = {}
            for k, v in zip(keys, vals):
                if k in ("bytes", "iterations"):
                    d[k] = int(float(v))
                elif k in ("bw_peak", "bw_avg"):
                    d[k + "_mb_s"] = float(v) * factor
                else:
                    d[k] = float(v)
            rows.append(d)
        if rows:
            return {"kind": kind, "header": line.rstrip(), "rows": rows, "lines": used}
    return None


def parse_gpudirect_json(text):
    """The JSON object `gpudirect bw|lat --json` prints (possibly pretty
    printed, possibly after other lines). None when there is none."""
    dec = json.JSONDecoder()
    i = text.find("{")
    while i >= 0:
        try:
            obj, _ = dec.raw_decode(text, i)
        except ValueError:
            obj = None
        if isinstance(obj, dict) and isinstance(obj.get("results"), list):
            return obj
        i = text.find("{", i + 1)
    return None


def bw_value(row):
    """BW average in MB/s for medians and ratios. perftest prints MB/s with
    two decimals, too coarse for small messages (0.09 MB/s at 2 B); below
    10 MB/s the value is taken from the message rate (six decimals), which
    perftest computes from the same iterations and time."""
    bw = row.get("bw_avg_mb_s")
    rate = row.get("msg_rate_mpps")
    if bw is not None and bw >= 10:
        return bw
    if rate:
        return rate * 1e6 * row["bytes"] / MIB
    return bw


# ---------------------------------------------------------------- log

_BLOCK_RE = re.compile(r"^=== ([A-Z ]+?) (BEGIN|END) ===$")
_RUN_BEGIN_RE = re.compile(r"^=== RUN BEGIN (.*) ===$")
_RUN_END_RE = re.compile(r"^=== RUN END (.*) ===$")
_SERVER_RE = re.compile(r"^=== SERVER OUTPUT (.*) ===$")


def _kv(s):
    out = {}
    for tok in s.split():
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k] = v
    return out


def _int(v, default=None):
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _tail(lines, n=40):
    return lines[-n:] if len(lines) > n else lines


def parse_log(text):
    """A captured guest log -> {"host": {}, "guest": {}, "params": {},
    "runs": [...], "done": bool}. Runs hold their raw client and server
    output lines; see evaluate_run()."""
    host, guest, params, runs = {}, {}, {}, []
    block = None
    cur = None
    target = None
    done = False
    for raw in text.splitlines():
        line = raw.rstrip("\r\n").rstrip("\r")
        s = line.strip()
        if cur is not None:
            m = _RUN_END_RE.match(s)
            if m:
                kv = _kv(m.group(1))
                cur["rc"] = _int(kv.get("rc"))
                cur["server_rc"] = _int(kv.get("server_rc"))
                try:
                    cur["secs"] = float(kv.get("secs"))
                except (TypeError, ValueError):
                    cur["secs"] = None
                if kv.get("note"):
                    cur["note"] = kv["note"].replace("_", " ")
                cur["finished"] = True
                runs.append(cur)
                cur = None
                continue
            if _SERVER_RE.match(s):
                target = cur["server_output"]
                continue
            if _RUN_BEGIN_RE.match(s):  # previous run never ended
                runs.append(cur)
                cur = None
            else:
                if target is cur["output"] and line.startswith("$ ") and cur["command"] is None:
                    cur["command"] = line[2:]
                elif target is cur["server_output"] and line.startswith("$ ") and cur["server_command"] is None:
                    cur["server_command"] = line[2:]
                else:
                    target.append(line)
                continue
        m = _RUN_BEGIN_RE.match(s)
        if m:
            kv = _kv(m.group(1))
            cur = {
                "id": _int(kv.get("id")),
                "tool": kv.get("tool"),
                "op": kv.get("op"),
                "bytes": _int(kv.get("bytes")),
                "iters": _int(kv.get("iters")),
                "tx_depth": _int(kv.get("tx_depth")),
                "rep": _int(kv.get("rep")),
                "port": _int(kv.get("port")),
                "command": None,
                "server_command": None,
                "rc": None,
                "server_rc": None,
                "secs": None,
                "finished": False,
                "output": [],
                "server_output": [],
            }
            target = cur["output"]
            continue
        if s == "=== DONE ===":
            done = True
            continue
        m = _BLOCK_RE.match(s)
        if m:
            name, edge = m.group(1), m.group(2)
            block = {"HOST META": host, "GUEST META": guest, "PARAMS": params}.get(name) if edge == "BEGIN" else None
            continue
        if block is not None and "=" in line:
            k, v = line.split("=", 1)
            block[k.strip()] = v.strip()
    if cur is not None:
        runs.append(cur)
    return {"host": host, "guest": guest, "params": normalize_params(params), "runs": runs, "done": done}


def normalize_params(p):
    out = dict(p)
    for k in ("gid_index", "iters", "lat_iters", "tx_depth", "max_bytes", "min_iters", "repeat", "timeout", "runs"):
        if k in out:
            out[k] = _int(out[k], out[k])
    if isinstance(out.get("sizes"), str):
        out["sizes"] = [int(x) for x in out["sizes"].split()]
    if isinstance(out.get("ops"), str):
        out["ops"] = out["ops"].split()
    if isinstance(out.get("perftest_only"), str):
        out["perftest_only"] = out["perftest_only"] == "1"
    if isinstance(out.get("plan"), str):
        rows = []
        for item in out["plan"].split():
            f = item.split(":")
            if len(f) == 4:
                rows.append({"bytes": int(f[0]), "bw_iters": int(f[1]), "bw_tx_depth": int(f[2]), "lat_iters": int(f[3])})
        out["plan"] = rows
    return out


def evaluate_run(run, testbed_rc=None):
    """Parses a run's output; sets ok, error, result, and keeps only the
    lines worth keeping (the result table; everything when it failed)."""
    text = "\n".join(run.get("output", []))
    result, excerpt, error = None, None, None
    lat = run.get("op") == "lat"
    if run["tool"] == "perftest":
        parsed = parse_perftest(text)
        if parsed is None:
            error = "no result table in the output"
        elif parsed["kind"] != ("lat" if lat else "bw"):
            error = "unexpected %s table" % parsed["kind"]
        else:
            excerpt = parsed["lines"]
            result = next((r for r in parsed["rows"] if r.get("bytes") == run["bytes"]), None)
            if result is None:
                error = "no result row for %d bytes" % run["bytes"]
    else:
        obj = parse_gpudirect_json(text)
        if obj is None:
            error = "no JSON report in the output"
        else:
            rows = [r for r in obj["results"] if isinstance(r, dict)]
            result = next((dict(r) for r in rows if r.get("bytes") == run["bytes"]), None)
            excerpt = [json.dumps({k: v for k, v in obj.items() if k != "results"}, sort_keys=True)]
            excerpt += [json.dumps(r, sort_keys=True) for r in rows]
            if result is None:
                error = "no result for %d bytes in the JSON report" % run["bytes"]
            else:
                want = ("t_typical_us",) if lat else ("bw_avg_mb_s",)
                if any(not isinstance(result.get(k), (int, float)) for k in want):
                    error = "JSON result lacks %s" % ", ".join(want)
                    result = None
    discarded = None
    if not run.get("finished"):
        why = "the run did not finish (the guest stopped%s)" % (
            "; testbed exit status %s" % testbed_rc if testbed_rc not in (None, 0) else "")
        discarded, result, error = result, None, why
    elif run.get("rc") != 0:
        rc = run.get("rc")
        what = {124: "timed out", 137: "killed after the timeout"}.get(rc, "exit status %s" % rc)
        if result is not None:
            discarded, result, error = result, None, "%s despite a result" % what
        else:
            error = "%s: %s" % (what, error) if error else what
    if result is None and run.get("note"):
        error = "%s (%s)" % (error, run["note"]) if error else run["note"]
    out = {k: v for k, v in run.items() if k not in ("output", "server_output")}
    out["ok"] = result is not None
    out["error"] = None if result is not None else (error or "no result")
    out["result"] = result
    if discarded is not None:
        out["result_discarded"] = discarded
    if result is not None:
        out["output"] = excerpt
    else:
        out["output"] = _tail(run.get("output", []))
        out["server_output"] = _tail(run.get("server_output", []))
    return out


def build_raw(log_text, testbed_rc=None):
    parsed = parse_log(log_text)
    runs = [evaluate_run(r, testbed_rc) for r in parsed["runs"]]
    params = parsed["params"]
    expected = params.get("runs")
    return {
        "schema": SCHEMA,
        "generator": "testbed/compare-perftest",
        "host": parsed["host"],
        "guest": parsed["guest"],
        "params": params,
        "testbed_rc": testbed_rc,
        "complete": bool(parsed["done"]) and (expected is None or expected == len(runs)),
        "runs_expected": expected,
        "runs": runs,
    }


# ---------------------------------------------------------------- summary

def _stats(vals):
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(raw):
    """{op: {size: {tool: {"iters", "runs", "ok", metric: stats}}}}"""
    params = raw.get("params", {})
    ops = params.get("ops") or sorted({r["op"] for r in raw["runs"]})
    sizes = params.get("sizes") or sorted({r["bytes"] for r in raw["runs"]})
    summary = {}
    for op in ops:
        per_size = {}
        for size in sizes:
            cell = {}
            for tool in TOOLS:
                rs = [r for r in raw["runs"] if r["op"] == op and r["bytes"] == size and r["tool"] == tool]
                if not rs:
                    continue
                good = [r for r in rs if r["ok"]]
                entry = {"runs": len(rs), "ok": len(good), "iters": rs[0].get("iters"), "tx_depth": rs[0].get("tx_depth")}
                if op == "lat":
                    entry["t_typical_us"] = _stats([r["result"]["t_typical_us"] for r in good])
                    entry["p99_us"] = _stats([r["result"]["p99_us"] for r in good if r["result"].get("p99_us") is not None])
                    entry["t_avg_us"] = _stats([r["result"]["t_avg_us"] for r in good if r["result"].get("t_avg_us") is not None])
                else:
                    entry["bw_mb_s"] = _stats([bw_value(dict(r["result"], bytes=size)) for r in good])
                    entry["bw_peak_mb_s"] = _stats([r["result"]["bw_peak_mb_s"] for r in good if r["result"].get("bw_peak_mb_s") is not None])
                cell[tool] = entry
            if cell:
                per_size[size] = cell
        summary[op] = per_size
    return summary


def _med(cell, tool, metric):
    e = cell.get(tool)
    if not e or not e.get(metric):
        return None
    return e[metric]["median"]


def ratio(ours, theirs):
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def geomean(vals):
    vals = [v for v in vals if v is not None and v > 0]
    if not vals:
        return None
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


# ---------------------------------------------------------------- markdown

def fmt_num(v):
    if v is None:
        return "—"
    a = abs(v)
    if a >= 1000:
        return "%.0f" % v
    if a >= 100:
        return "%.1f" % v
    if a >= 1:
        return "%.2f" % v
    if a == 0:
        return "0"
    return "%.3g" % v


def fmt_stat(st, spread):
    if not st:
        return "—"
    s = fmt_num(st["median"])
    if spread and st["n"] > 1:
        s += " (%s–%s)" % (fmt_num(st["min"]), fmt_num(st["max"]))
    return s


def fmt_ratio(r):
    return "—" if r is None else "%.2f" % r


def _iters_cell(cell):
    its = sorted({e.get("iters") for e in cell.values() if e.get("iters") is not None})
    return "/".join(str(i) for i in its) or "—"


def _tx_cell(cell):
    its = sorted({e.get("tx_depth") for e in cell.values() if e.get("tx_depth") is not None})
    return "/".join(str(i) for i in its) or "—"


def machine_rows(raw):
    h, g, p = raw.get("host", {}), raw.get("guest", {}), raw.get("params", {})
    rows = []

    def add(k, v):
        if v not in (None, ""):
            rows.append((k, v))

    add("date", h.get("date"))
    commit = h.get("git_commit")
    if commit:
        add("gpudirect commit", commit + (" (with uncommitted changes)" if h.get("git_dirty") == "1" else ""))
    add("gpudirect binary", g.get("gpudirect_version") or h.get("gpudirect_version"))
    add("perftest", g.get("perftest_version"))
    emu = "qemu %s, TCG (software CPU emulation; the test bed does not use KVM), %s vCPU, %s" % (
        h.get("qemu_version", "?"), g.get("nproc", "?"), g.get("mem_total", "? memory"))
    add("emulation", emu)
    add("guest kernel", g.get("kernel"))
    add("guest CPU", g.get("cpu_model"))
    add("host CPU", "%s (%s CPUs)" % (h.get("cpu_model", "?"), h.get("nproc", "?")) if h.get("cpu_model") else None)
    add("host kernel", h.get("kernel"))
    dev = "%s (Soft-RoCE on lo), GID index %s" % (p.get("device", "?"), p.get("gid_index", "?"))
    if g.get("active_mtu"):
        dev += ", active MTU %s" % g["active_mtu"]
    add("device", dev)
    sizes = p.get("sizes") or []
    add("sizes", ", ".join(short_size(s) for s in sizes) + " (%d)" % len(sizes) if sizes else None)
    if p.get("iters") is not None:
        it = "bw %s, lat %s (perftest -n), at most %s per run and at least %s" % (
            p.get("iters"), p.get("lat_iters"), human_size(p["max_bytes"]) if p.get("max_bytes") else "unlimited bytes",
            p.get("min_iters"))
        add("iterations", it)
    add("tx depth", "%s (perftest -t; bw only; lowered to the iterations when fewer)" % p.get("tx_depth")
        if p.get("tx_depth") is not None else None)
    if p.get("repeat") is not None:
        add("repeats", "%s per size and tool; median taken; pairs alternate perftest/ours per size, "
            "and the pair order flips every other repeat" % p["repeat"])
    add("operations", ", ".join(p.get("ops") or []))
    add("per-tool timeout", "%s s" % p["timeout"] if p.get("timeout") is not None else None)
    add("command", "`%s`" % h["command"] if h.get("command") else None)
    return rows


def render_markdown(raw, summary=None):
    summary = summary if summary is not None else summarize(raw)
    p = raw.get("params", {})
    spread = (p.get("repeat") or 1) > 1
    out = []
    w = out.append
    w("# gpudirect vs perftest on Soft-RoCE")
    w("")
    w("Generated by `testbed/compare-perftest`: perftest and `gpudirect bw` / `gpudirect lat` run alternately, "
      "size by size, with the same sizes, iterations and tx depth, on `%s` inside one Soft-RoCE guest "
      "(`testbed/run`). Bandwidth is perftest's BW average in MB/s (2^20 bytes/s), the client's figure; "
      "latency is one-way (half the round trip) in µs. Ratios are ours/perftest: above 1 is faster for "
      "bandwidth, below 1 is faster for latency."
      % p.get("device", "rxe0"))
    w("")
    w("The guest is emulated (qemu TCG, one vCPU): Soft-RoCE's work and both tools share that one emulated "
      "CPU, so absolute numbers say nothing about real NICs; only the ratios are of interest, and even "
      "they carry emulator noise (see the ranges).")
    w("")
    if p.get("perftest_only"):
        w("**perftest only** (`--perftest-only`): our tools were not run, so there are no ratios.")
        w("")
    problems = []
    if not raw.get("complete", True):
        exp = raw.get("runs_expected")
        problems.append("The run is incomplete: %d of %s runs recorded%s." % (
            len(raw["runs"]), exp if exp is not None else "?",
            "; testbed exit status %s" % raw.get("testbed_rc") if raw.get("testbed_rc") not in (None, 0) else ""))
    failed = [r for r in raw["runs"] if not r["ok"]]
    if failed:
        problems.append("%d of %d runs gave no result; they are missing data points (see "
                        "[Failed runs](#failed-runs))." % (len(failed), len(raw["runs"])))
    for s in problems:
        w("**%s**" % s)
        w("")
    w("## Machine and parameters")
    w("")
    w("| | |")
    w("|---|---|")
    for k, v in machine_rows(raw):
        w("| %s | %s |" % (k, str(v).replace("|", "\\|")))
    w("")

    bw_ops = [op for op in summary if op in BW_OPS]
    if bw_ops:
        w("## Bandwidth (MB/s)")
        w("")
        w("BW average, median of the successful repeats%s. Values below 10 MB/s come from the message-rate "
          "column, since perftest prints MB/s with two decimals. ![bandwidth](bandwidth.svg)"
          % (" (min–max in parentheses)" if spread else ""))
        w("")
        for op in bw_ops:
            per = summary[op]
            w("### %s: `%s` vs `%s`" % (OP_TITLE[op], PERFTEST_NAME[op], OURS_NAME[op]))
            w("")
            if not per:
                w("No runs.")
                w("")
                continue
            w("| bytes | size | iters | tx depth | perftest | gpudirect | ours/perftest |")
            w("|---:|---:|---:|---:|---:|---:|---:|")
            rs = []
            for size in sorted(per):
                cell = per[size]
                pt, us = _med(cell, "perftest", "bw_mb_s"), _med(cell, "gpudirect", "bw_mb_s")
                r = ratio(us, pt)
                rs.append(r)
                w("| %d | %s | %s | %s | %s | %s | %s |" % (
                    size, human_size(size), _iters_cell(cell), _tx_cell(cell),
                    fmt_stat(cell.get("perftest", {}).get("bw_mb_s"), spread),
                    fmt_stat(cell.get("gpudirect", {}).get("bw_mb_s"), spread), fmt_ratio(r)))
            g = geomean(rs)
            w("")
            if g is not None:
                w("Geometric mean of ours/perftest over %d sizes: **%.2f**." % (len([x for x in rs if x]), g))
                w("")
    if "lat" in summary and not summary["lat"]:
        w("## Latency (µs, one-way)")
        w("")
        w("No runs.")
        w("")
    elif "lat" in summary:
        per = summary["lat"]
        w("## Latency (µs, one-way)")
        w("")
        w("### %s: `%s` vs `%s`" % (OP_TITLE["lat"], PERFTEST_NAME["lat"], OURS_NAME["lat"]))
        w("")
        w("t_typical (perftest's median) and the 99%% percentile, median of the successful repeats%s. "
          "Under TCG, small messages sit on a floor of a few ms that looks like the guest's scheduler tick "
          "(both processes and Soft-RoCE share one vCPU), so their ratios mostly compare that floor."
          % (" (min–max in parentheses)" if spread else ""))
        w("")
        w("| bytes | size | iters | perftest typical | gpudirect typical | ours/perftest | perftest p99 | gpudirect p99 | ours/perftest |")
        w("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rt, rp = [], []
        for size in sorted(per):
            cell = per[size]
            r1 = ratio(_med(cell, "gpudirect", "t_typical_us"), _med(cell, "perftest", "t_typical_us"))
            r2 = ratio(_med(cell, "gpudirect", "p99_us"), _med(cell, "perftest", "p99_us"))
            rt.append(r1)
            rp.append(r2)
            w("| %d | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                size, human_size(size), _iters_cell(cell),
                fmt_stat(cell.get("perftest", {}).get("t_typical_us"), spread),
                fmt_stat(cell.get("gpudirect", {}).get("t_typical_us"), spread), fmt_ratio(r1),
                fmt_stat(cell.get("perftest", {}).get("p99_us"), spread),
                fmt_stat(cell.get("gpudirect", {}).get("p99_us"), spread), fmt_ratio(r2)))
        w("")
        g1, g2 = geomean(rt), geomean(rp)
        if g1 is not None or g2 is not None:
            w("Geometric mean of ours/perftest: typical **%s**, p99 **%s**." % (
                fmt_ratio(g1), fmt_ratio(g2)))
            w("")
    w("## Failed runs")
    w("")
    if not failed:
        w("None: every run gave a result.")
    else:
        w("| run | tool | op | bytes | repeat | error | last output |")
        w("|---:|---|---|---:|---:|---|---|")
        for r in failed:
            last = next((x.strip() for x in reversed(r.get("output") or []) if x.strip()), "")
            if not last:
                last = next((x.strip() for x in reversed(r.get("server_output") or []) if x.strip()), "")
            w("| %s | %s | %s | %s | %s | %s | %s |" % (
                r.get("id"), r["tool"], r["op"], r["bytes"], r.get("rep"),
                (r.get("error") or "").replace("|", "\\|"), ("`%s`" % last.replace("`", "'").replace("|", "\\|")[:160]) if last else ""))
        w("")
        w("Their full output is in `raw.json`.")
    w("")
    return "\n".join(out)


# ---------------------------------------------------------------- SVG

COLORS = {"perftest": "#d95f02", "gpudirect": "#1f6fb4"}
DASH = {"perftest": "7 4", "gpudirect": None}


def nice_ceiling(v, ticks=5):
    """(top, step): a round axis top >= v with about `ticks` steps."""
    if v is None or v <= 0:
        return 1.0, 0.2
    raw_step = v / ticks
    mag = 10 ** math.floor(math.log10(raw_step))
    for m in (1, 2, 2.5, 5, 10):
        step = m * mag
        if step >= raw_step:
            break
    top = math.ceil(v / step - 1e-9) * step
    return top, step


def _fmt_tick(v):
    if abs(v - round(v)) < 1e-9:
        return "%d" % round(v)
    return ("%.2f" % v).rstrip("0").rstrip(".")


def render_svg(raw, summary=None):
    summary = summary if summary is not None else summarize(raw)
    ops = [op for op in BW_OPS if op in summary and summary[op]]
    p = raw.get("params", {})
    h = raw.get("host", {})
    pw, ph = 300, 230           # plot area of one panel
    ml, mr, mt, mb = 62, 18, 100, 58
    gap = 30
    n = max(len(ops), 1)
    width = ml + n * pw + (n - 1) * (gap + ml) + mr
    height = mt + ph + mb
    e = []
    a = e.append
    a('<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" '
      'font-family="DejaVu Sans, Arial, sans-serif" font-size="11">' % (width, height, width, height))
    a('<rect x="0" y="0" width="%d" height="%d" fill="white"/>' % (width, height))
    a('<text x="%d" y="20" font-size="15" font-weight="bold">Bandwidth: gpudirect bw vs perftest (Soft-RoCE %s, qemu TCG)</text>'
      % (ml, escape(str(p.get("device", "rxe0")))))
    sub = "BW average (MB/s = 2^20 B/s), median of %s repeat(s); %s; commit %s" % (
        p.get("repeat", "?"), h.get("date", "date unknown"), (h.get("git_commit") or "?")[:12])
    a('<text x="%d" y="38" fill="#444">%s</text>' % (ml, escape(sub)))
    # legend
    lx = ml
    for tool in TOOLS:
        label = "perftest (ib_<op>_bw)" if tool == "perftest" else "gpudirect bw --op <op>"
        dash = ' stroke-dasharray="%s"' % DASH[tool] if DASH[tool] else ""
        a('<g class="legend" data-tool="%s"><line x1="%d" y1="54" x2="%d" y2="54" stroke="%s" stroke-width="2"%s/>'
          '<text x="%d" y="58">%s</text></g>' % (tool, lx, lx + 28, COLORS[tool], dash, lx + 34, escape(label)))
        lx += 220
    if not ops:
        a('<text x="%d" y="%d" fill="#a00">no bandwidth data</text>' % (ml, mt + ph // 2))
        a("</svg>")
        return "\n".join(e) + "\n"
    # shared scales
    sizes = sorted({s for op in ops for s in summary[op]})
    lo = math.floor(math.log2(min(sizes)))
    hi = math.ceil(math.log2(max(sizes)))
    if hi == lo:
        lo, hi = lo - 1, hi + 1
    vmax = 0.0
    for op in ops:
        for cell in summary[op].values():
            for tool in TOOLS:
                v = _med(cell, tool, "bw_mb_s")
                if v is not None:
                    vmax = max(vmax, v)
    top, step = nice_ceiling(vmax * 1.05 if vmax > 0 else 1.0)
    span = hi - lo
    label_every = max(1, int(math.ceil((span + 1) / 8.0)))
    # Labels every `label_every` octaves from the left end, and always at the
    # right end (dropping the interior one that would crowd it).
    labels = {ex for ex in range(lo, hi + 1, label_every) if hi - ex >= max(1, 0.6 * label_every)}
    labels |= {lo, hi}
    for i, op in enumerate(ops):
        x0 = ml + i * (pw + gap + ml)
        y0 = mt
        X = lambda s: x0 + (math.log2(s) - lo) / span * pw  # noqa: E731
        Y = lambda v: y0 + ph - (v / top) * ph  # noqa: E731
        a('<g class="panel" data-op="%s">' % op)
        a('<text x="%.1f" y="%d" text-anchor="middle" font-size="13" font-weight="bold">%s</text>'
          % (x0 + pw / 2, y0 - 8, escape("%s (%s)" % (OP_TITLE[op], PERFTEST_NAME[op]))))
        # grid and y ticks
        k = 0
        while k * step <= top + 1e-9:
            v = k * step
            y = Y(v)
            a('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#e3e3e3"/>' % (x0, y, x0 + pw, y))
            a('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>' % (x0 - 4, y, x0, y))
            a('<text x="%.1f" y="%.1f" text-anchor="end">%s</text>' % (x0 - 7, y + 4, _fmt_tick(v)))
            k += 1
        # x ticks at every power of two, labels every `label_every`
        for ex in range(lo, hi + 1):
            x = x0 + (ex - lo) / span * pw
            labelled = ex in labels
            a('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="%s"/>'
              % (x, y0, x, y0 + ph, "#e3e3e3" if labelled else "#f3f3f3"))
            a('<line x1="%.1f" y1="%.1f" x2="%.1f" y2="%.1f" stroke="#333"/>'
              % (x, y0 + ph, x, y0 + ph + (5 if labelled else 3)))
            if labelled:
                a('<text x="%.1f" y="%.1f" text-anchor="middle">%s</text>' % (x, y0 + ph + 17, escape(short_size(1 << ex))))
        # axes
        a('<rect class="axes" x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>' % (x0, y0, pw, ph))
        a('<text x="%.1f" y="%d" text-anchor="middle">message size (bytes, log2 scale)</text>' % (x0 + pw / 2, y0 + ph + 36))
        a('<text transform="translate(%.1f,%.1f) rotate(-90)" text-anchor="middle">BW average (MB/s)</text>'
          % (x0 - 46, y0 + ph / 2))
        # curves
        for tool in TOOLS:
            pts = []
            for size in sorted(summary[op]):
                v = _med(summary[op][size], tool, "bw_mb_s")
                pts.append((size, v))
            if not any(v is not None for _, v in pts):
                continue
            color = COLORS[tool]
            dash = ' stroke-dasharray="%s"' % DASH[tool] if DASH[tool] else ""
            a('<g class="curve %s" data-tool="%s" data-op="%s">' % (tool, tool, op))
            seg = []
            segs = []
            for size, v in pts:
                if v is None:
                    if seg:
                        segs.append(seg)
                    seg = []
                else:
                    seg.append((X(size), Y(v)))
            if seg:
                segs.append(seg)
            for s in segs:
                if len(s) > 1:
                    a('<polyline fill="none" stroke="%s" stroke-width="2"%s points="%s"/>'
                      % (color, dash, " ".join("%.1f,%.1f" % q for q in s)))
            for size, v in pts:
                if v is None:
                    continue
                tip = "%s %s %s: %s MB/s" % (tool, op, human_size(size), fmt_num(v))
                if tool == "perftest":
                    a('<rect x="%.1f" y="%.1f" width="6" height="6" fill="%s"><title>%s</title></rect>'
                      % (X(size) - 3, Y(v) - 3, color, escape(tip)))
                else:
                    a('<circle cx="%.1f" cy="%.1f" r="3" fill="%s"><title>%s</title></circle>'
                      % (X(size), Y(v), color, escape(tip)))
            a("</g>")
        a("</g>")
    a("</svg>")
    return "\n".join(e) + "\n"


# ---------------------------------------------------------------- files, CLI

def write_outputs(raw, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    summary = summarize(raw)
    paths = {}
    for name, content in (
        ("raw.json", json.dumps(raw, indent=1, sort_keys=False) + "\n"),
        ("comparison.md", render_markdown(raw, summary)),
        ("bandwidth.svg", render_svg(raw, summary)),
    ):
        path = os.path.join(out_dir, name)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(content)
        os.replace(tmp, path)
        paths[name] = path
    return paths, summary


def console_summary(raw, summary):
    lines = []
    for op, per in summary.items():
        metric = "t_typical_us" if op == "lat" else "bw_mb_s"
        unit = "us" if op == "lat" else "MB/s"
        for size in sorted(per):
            cell = per[size]
            pt, us = _med(cell, "perftest", metric), _med(cell, "gpudirect", metric)
            lines.append("  %-5s %8s  perftest %10s  gpudirect %10s  %s  ratio %s" % (
                op, short_size(size), fmt_num(pt), fmt_num(us), unit, fmt_ratio(ratio(us, pt))))
    return "\n".join(lines)


def _positive_int(s):
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return v


def main(argv=None):
    ap = argparse.ArgumentParser(prog="compare_perftest.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("plan", help="sizes and per-size iterations")
    pp.add_argument("--sizes", default="default")
    pp.add_argument("--iters", type=_positive_int, default=1000)
    pp.add_argument("--lat-iters", type=_positive_int, default=500)
    pp.add_argument("--tx-depth", type=_positive_int, default=128)
    pp.add_argument("--max-bytes", default="128M")
    pp.add_argument("--min-iters", type=_positive_int, default=16)
    rp = sub.add_parser("report", help="parse a guest log and write the outputs")
    rp.add_argument("--log", required=True)
    rp.add_argument("--out", required=True)
    rp.add_argument("--testbed-rc", type=int, default=None)
    rn = sub.add_parser("render", help="rewrite comparison.md and bandwidth.svg from raw.json")
    rn.add_argument("--raw", required=True)
    rn.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "plan":
            mb = 0 if args.max_bytes in ("0", "none", "unlimited") else parse_size(args.max_bytes)
            if min(args.iters, args.lat_iters, args.tx_depth) < 1:
                raise UsageError("iterations and tx depth must be >= 1")
            print("# max_bytes %d" % mb)
            for row in plan(parse_sizes(args.sizes), args.iters, args.lat_iters, args.tx_depth, mb, args.min_iters):
                print("%d %d %d %d" % row)
            return 0
        if args.cmd == "report":
            with open(args.log, encoding="utf-8", errors="replace") as f:
                raw = build_raw(f.read(), args.testbed_rc)
            if not raw["runs"]:
                print("compare_perftest: no runs in %s" % args.log, file=sys.stderr)
                return 3
        else:
            with open(args.raw, encoding="utf-8") as f:
                raw = json.load(f)
        paths, summary = write_outputs(raw, args.out)
        print(console_summary(raw, summary))
        failed = [r for r in raw["runs"] if not r["ok"]]
        for r in failed:
            print("  missing: %s %s %d B rep %s: %s" % (r["tool"], r["op"], r["bytes"], r.get("rep"), r["error"]),
                  file=sys.stderr)
        print("wrote %s" % ", ".join(paths[k] for k in ("comparison.md", "bandwidth.svg", "raw.json")))
        return 1 if failed or not raw.get("complete", True) else 0
    except UsageError as e:
        print("compare_perftest: %s" % e, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
