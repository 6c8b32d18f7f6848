"""Tests of testbed/compare_peers.py's report: medians, ranges, ratios and
failures from a guest log (python3 -m unittest, stdlib only)."""

import json
import os
import tempfile
import unittest

import compare_peers as cp


def line(kind, **obj):
    return "PEERS-%s %s" % (kind, json.dumps(obj))


def result(engine, wl, rep, mbps, cpu_us, requests=100, size=1 << 20):
    secs = requests * size / (mbps * 1e6)
    return line("RESULT", engine=engine, workload=wl, rep=rep, secs=secs, cpu=cpu_us * requests / 1e6, user=cpu_us * requests / 2e6, requests=requests, bytes=requests * size, notifications=0)


LOG = "\n".join([
    "testbed: booting",
    line("META", kernel="6.1", nproc=2, cpu="QEMU", repeat=3, scale=1, engines=cp.ENGINES, env={"UCX_TLS": "rc"}),
    result("gpudirect-py", "write-1m", 1, 300, 50),
    result("gpudirect-py", "write-1m", 2, 200, 60),
    "[peers] chatter PEERS-RESULT {not json",
    result("gpudirect-py", "write-1m", 3, 250, 40),
    result("mooncake", "write-1m", 1, 100, 100),
    result("mooncake", "write-1m", 2, 125, 80),
    result("mooncake", "write-1m", 3, 150, 120),
    line("FAIL", engine="nixl", workload="write-1m", rep=1, why="no UCX transport", at_start=True),
    line("UNAVAILABLE", engine="nixl", why="no UCX transport"),
    line("CEILING", op="read", size=65536, rep=1, mbps=60.0),
    line("CEILING", op="read", size=65536, rep=2, mbps=58.0),
    line("CEILING", op="write", size=4096, rep=1, error="no perftest"),
    line("DONE"),
])


class Report(unittest.TestCase):
    def setUp(self):
        self.parsed = cp.parse_log(LOG)

    def test_parse_skips_what_is_not_json(self):
        self.assertEqual(len(self.parsed["RESULT"]), 6)
        self.assertEqual(self.parsed["UNAVAILABLE"][0]["engine"], "nixl")

    def test_medians_and_ranges(self):
        s = cp.summarize(self.parsed["RESULT"])
        med, lo, hi = s[("gpudirect-py", "write-1m")]["mbps"]
        self.assertAlmostEqual(med, 250)
        self.assertAlmostEqual(lo, 200)
        self.assertAlmostEqual(hi, 300)
        self.assertAlmostEqual(s[("mooncake", "write-1m")]["cpu_us"][0], 100)
        self.assertEqual(s[("mooncake", "write-1m")]["n"], 3)

    def test_ratios_of_medians(self):
        s = cp.summarize(self.parsed["RESULT"])
        mb, cpu, user = cp.ratios(s, "gpudirect-py", "mooncake", "write-1m")
        self.assertAlmostEqual(mb, 2.0)
        self.assertAlmostEqual(cpu, 0.5)
        self.assertAlmostEqual(user, 0.5)
        self.assertAlmostEqual(s[("mooncake", "write-1m")]["user_us"][0], 50)
        self.assertIsNone(cp.ratios(s, "gpudirect-py", "nixl", "write-1m"))

    def test_a_peer_without_measured_cpu_gives_no_cpu_ratio(self):
        # A smoke run short enough that the peer's CPU time read as zero.
        parsed = cp.parse_log("\n".join([result("gpudirect-py", "write-1m", 1, 300, 50), result("mooncake", "write-1m", 1, 100, 0), line("DONE")]))
        s = cp.summarize(parsed["RESULT"])
        mb, cpu, user = cp.ratios(s, "gpudirect-py", "mooncake", "write-1m")
        self.assertAlmostEqual(mb, 3.0)
        self.assertIsNone(cpu)
        self.assertIsNone(user)
        self.assertIn("3.00x, not measured, not measured", cp.render_markdown(parsed, {}))

    def test_markdown_names_failures_and_needs(self):
        md = cp.render_markdown(self.parsed, "mooncake==x nixl==y")
        self.assertIn("| gpudirect (Python) | 250 (200-300) |", md)
        self.assertIn("| write-1m | 2.00x, 0.50x, 0.50x | — |", md)
        self.assertIn("NIXL (UCX) did not run: no UCX transport", md)
        self.assertIn("P2PHANDSHAKE", md)
        self.assertIn("`UCX_TLS=rc`", md)
        self.assertNotIn("did not finish", md)
        self.assertIn("| ib_read_bw 64 KiB | 59.0 (58.0-60.0) |", md)
        self.assertNotIn("ib_write_bw 4 KiB", md)

    def test_unfinished_run_is_said(self):
        md = cp.render_markdown(cp.parse_log(LOG.replace(line("DONE"), "")), "")
        self.assertIn("did not finish", md)

    def test_render_exit_status_and_files(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "log")
            with open(log, "w") as f:
                f.write(LOG)
            self.assertEqual(cp.main(["render", log, d]), 1)
            with open(os.path.join(d, "peers.svg")) as f:
                svg = f.read()
            self.assertTrue(svg.startswith("<svg") and "Mooncake TE" in svg)
            with open(log, "w") as f:
                f.write("testbed: boot failed\n")
            self.assertEqual(cp.main(["render", log, d]), 3)


if __name__ == "__main__":
    unittest.main()
