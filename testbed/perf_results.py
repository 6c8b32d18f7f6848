"""What testbed/compare-perftest measured: the size plan, perftest's and
`gpudirect bw|lat`'s output parsed, the guest log split into runs, and
the per-size summaries with ratios ours/perftest. compare_perftest.py is
the command line; perf_render.py draws the report from these.

Python 3 standard library only.
"""

import argparse
import json
import math
import os
import re
import statistics
import sys

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
