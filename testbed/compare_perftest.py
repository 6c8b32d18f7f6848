#!/usr/bin/env python3
"""The command line of testbed/compare-perftest's parser, report and plots
(perf_results.py reads, perf_render.py draws).

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
import os
import sys

from perf_render import fmt_num, fmt_ratio, render_markdown, render_svg
from perf_results import UsageError, _med, build_raw, parse_size, parse_sizes, plan, ratio, short_size, summarize

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
