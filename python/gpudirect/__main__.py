"""``python -m gpudirect doctor|nccl-log``: the command's text, from Python."""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from . import _native
from ._native import GpudirectError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpudirect", description="GPUDirect RDMA diagnostics")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("doctor", help="does GPUDirect RDMA work here, for this job, and why not")
    d.add_argument("--json", action="store_true", help="the JSON report")
    d.add_argument("-v", "--verbose", action="store_true", help="every finding with its evidence")
    d.add_argument("--env-file", help="judge a job script's variables (nothing in it runs)")
    d.add_argument("--pid", type=int, help="judge a running process's environment")
    d.add_argument("--nccl-log", help="judge the variables an NCCL log shows NCCL read")
    d.add_argument("--capture", help="also write what the judgement read to this file")
    d.add_argument("--from", dest="from_capture", help="judge a capture instead of this machine")
    d.add_argument("--gpu", type=int, help="only this GPU (CUDA ordinal)")
    d.add_argument("-d", "--device", help="only this RDMA device")
    n = sub.add_parser("nccl-log", help="what an NCCL_DEBUG=INFO log says about GPUDirect RDMA")
    n.add_argument("file", help="the log, or - for standard input")
    n.add_argument("--json", action="store_true", help="the JSON report")
    args = parser.parse_args(argv)
    try:
        if args.command == "doctor":
            report, text, code = _native.doctor(
                env_file=args.env_file,
                pid=args.pid,
                nccl_log=args.nccl_log,
                capture=args.capture,
                from_capture=args.from_capture,
                gpu=args.gpu,
                device=args.device,
                verbose=args.verbose,
            )
        else:
            log = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8", errors="replace").read()
            report, text, code = _native.explain_nccl_log(log)
    except (GpudirectError, OSError) as e:
        print(f"gpudirect {args.command}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(report + "\n" if args.json else text)
    return code


if __name__ == "__main__":
    sys.exit(main())
