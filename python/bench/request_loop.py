"""The Python side of testbed/python-insns: N requests of 16 writes of 64
bytes, each posted and waited for, both agents in this process on one
device: the loop benches/engine.rs runs in Rust (GPUDIRECT_INSNS_LOOP), so
callgrind's counts of N and 2N give Python's cost per request.

Usage: python request_loop.py N [--time]   (--time: print microseconds per request)
"""

import os
import sys
import time

import gpudirect

ENTRIES, SIZE = 16, 64


def main() -> None:
    n = int(sys.argv[1])
    dev = os.environ.get("GPUDIRECT_TEST_DEVICE", "rxe0")
    src = gpudirect.Agent("loop-src", devices=[dev], listen="127.0.0.1:0")
    dst = gpudirect.Agent("loop-dst", devices=[dev], listen="127.0.0.1:0")
    src.register("src", bytearray(SIZE))
    dst.register("dst", bytearray(SIZE))
    src.load_remote(dst.metadata())
    req = src.prepare("write", [("src", 0, "loop-dst", "dst", 0, SIZE)] * ENTRIES)
    started = time.perf_counter()
    for _ in range(n):
        req.post()
        req.wait(10.0)
    if "--time" in sys.argv:
        print(f"PY_US_PER_REQUEST {(time.perf_counter() - started) / n * 1e6:.1f}")


if __name__ == "__main__":
    main()
