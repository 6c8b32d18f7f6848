"""Tests of testbed/compare_perftest.py, perf_results.py and perf_render.py: python3 -m unittest discover -s testbed -p 'test_compare_perftest.py'
(or, from testbed/: python3 -m unittest test_compare_perftest)."""

import json
import os
import sys
import tempfile
import unittest
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import compare_perftest as cp  # noqa: E402
import perf_render as rd  # noqa: E402
import perf_results as pr  # noqa: E402

SVG_NS = "{http://www.w3.org/2000/svg}"

# Real perftest 6.06 client outputs from the Soft-RoCE guest (GIDs trimmed).
WRITE_BW_65536 = """\
---------------------------------------------------------------------------------------
                    RDMA_Write BW Test
 Dual-port       : OFF\t\tDevice         : rxe0
 Number of qps   : 1\t\tTransport type : IB
 Connection type : RC\t\tUsing SRQ      : OFF
 PCIe relax order: ON
 ibv_wr* API     : OFF
 TX depth        : 128
 CQ Moderation   : 1
 Mtu             : 4096[B]
 Link type       : Ethernet
 GID index       : 1
 Max inline data : 0[B]
 rdma_cm QPs\t : OFF
 Data ex. method : Ethernet
---------------------------------------------------------------------------------------
 local address: LID 0000 QPN 0x0012 PSN 0xe13fe6 RKey 0x0003dd VAddr 0x0055b05ec7e000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
 remote address: LID 0000 QPN 0x0011 PSN 0x989336 RKey 0x00024a VAddr 0x005609ef89d000
 GID: 00:00:00:00:00:00:00:00:00:00:255:255:127:00:00:01
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 65536      1000             99.62              98.37  \t\t   0.001574
---------------------------------------------------------------------------------------
"""

READ_BW_4096 = """\
---------------------------------------------------------------------------------------
Device not recognized to implement inline feature. Disabling it
---------------------------------------------------------------------------------------
                    RDMA_Read BW Test
 TX depth        : 128
 Outstand reads  : 128
---------------------------------------------------------------------------------------
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 4096       500              81.22              63.42  \t\t   0.016236
---------------------------------------------------------------------------------------
"""

WRITE_BW_2 = """\
 #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]
 2          1000             0.11               0.09   \t\t   0.048006
---------------------------------------------------------------------------------------
"""

WRITE_LAT_2 = """\
---------------------------------------------------------------------------------------
                    RDMA_Write Latency Test
 TX depth        : 1
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 2       500          3533.34        7892.51      3998.38  \t       4092.41     \t419.10 \t\t6030.65 \t\t7892.51
---------------------------------------------------------------------------------------
"""

SWEEP_LAT = """\
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec] 
 2       100          3533.34        7892.51      3998.38  \t       4092.41     \t419.10 \t\t6030.65 \t\t7892.51
 4       100          3000.00        5000.00      3990.00  \t       4000.00     \t100.00 \t\t4900.00 \t\t5000.00
---------------------------------------------------------------------------------------
"""

GBITS_BW = """\
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      1000             0.84               0.83   \t\t   0.001574
"""

FAILED_CLIENT = """\
Couldn't connect to 127.0.0.1:18519
Unable to open file descriptor for socket connection Unable to init the socket connection
"""

OURS_BW = {
    "tool": "gpudirect bw", "op": "write", "tx_depth": 128,
    "results": [{"bytes": 65536, "iterations": 1000, "bw_peak_mb_s": 99.1, "bw_avg_mb_s": 97.5, "msg_rate_mpps": 0.00156}],
}
OURS_LAT = {
    "tool": "gpudirect lat", "op": "write",
    "results": [{"bytes": 2, "iterations": 500, "t_min_us": 3000.0, "t_max_us": 7000.0, "t_typical_us": 3900.0,
                 "t_avg_us": 4000.0, "t_stdev_us": 300.0, "p99_us": 5800.0, "p999_us": 6900.0}],
}


def run_block(n, tool, op, size, iters, tx, rep, body, rc=0, server=None, end=True, note=None):
    cmd = "ib_write_bw -d rxe0 127.0.0.1" if tool == "perftest" else "target/release/gpudirect bw --connect 127.0.0.1:1"
    s = "=== RUN BEGIN id=%d tool=%s op=%s bytes=%d iters=%d tx_depth=%d rep=%d port=%d ===\n$ %s\n%s" % (
        n, tool, op, size, iters, tx, rep, 18515 + n, cmd, body)
    if not s.endswith("\n"):
        s += "\n"
    if server is not None:
        s += "=== SERVER OUTPUT id=%d ===\n$ server cmd\n%s\n" % (n, server)
    if end:
        s += "=== RUN END id=%d rc=%d server_rc=0 secs=1.250%s ===\n" % (n, rc, " note=" + note if note else "")
    return s


def ours_json(obj, size=None, **over):
    o = json.loads(json.dumps(obj))
    if size is not None:
        o["results"][0]["bytes"] = size
    o["results"][0].update(over)
    return json.dumps(o, indent=2) + "\n"


def sample_log(runs_text, runs, done=True, ops="write lat", sizes=(2, 65536), repeat=1):
    head = (
        "testbed: booting\n"
        "=== HOST META BEGIN ===\ndate=2025-01-01 00:00:00 UTC\ngit_commit=0123456789abcdef\ngit_dirty=1\n"
        "kernel=6.8.0\ncpu_model=Some CPU\nnproc=16\nqemu_version=7.2.0\ncommand=testbed/compare-perftest --quick\n"
        "=== HOST META END ===\n"
        "=== GUEST META BEGIN ===\r\nkernel=6.1.0-57-amd64\r\ncpu_model=QEMU TCG CPU version 2.5+\r\nnproc=1\r\n"
        "perftest_version=6.06\r\nactive_mtu=4096 (5)\r\n=== GUEST META END ===\r\n"
        "=== PARAMS BEGIN ===\ndevice=rxe0\ngid_index=1\nops=%s\nrepeat=%d\ntimeout=120\nperftest_only=0\n"
        "plan=%s\nruns=%d\nsizes=%s\niters=1000\nlat_iters=500\ntx_depth=128\nmax_bytes=134217728\nmin_iters=16\n"
        "=== PARAMS END ===\n" % (ops, repeat, " ".join("%d:1000:128:500" % s for s in sizes), runs,
                                 " ".join(str(s) for s in sizes)))
    return head + runs_text + ("=== DONE ===\n" if done else "")


class SizesAndPlan(unittest.TestCase):
    def test_sizes(self):
        self.assertEqual(pr.parse_sizes("all")[0], 2)
        self.assertEqual(pr.parse_sizes("all")[-1], 8 << 20)
        self.assertEqual(len(pr.parse_sizes("all")), 23)
        self.assertEqual(pr.parse_sizes("quick"), [2, 4096, 65536, 1048576])
        self.assertEqual(pr.parse_sizes("64K,2, 1M,4096,4k"), [2, 4096, 65536, 1048576])
        self.assertEqual(len(pr.parse_sizes("default")), 12)
        for bad in ("", "x", "0", "2G", "-4"):
            with self.assertRaises(pr.UsageError):
                pr.parse_sizes(bad)

    def test_plan_caps_iterations_and_tx_depth(self):
        rows = dict((r[0], r[1:]) for r in pr.plan([2, 65536, 1 << 20, 8 << 20], 1000, 500, 128, 128 << 20, 16))
        self.assertEqual(rows[2], (1000, 128, 500))
        self.assertEqual(rows[65536], (1000, 128, 500))
        self.assertEqual(rows[1 << 20], (128, 128, 128))
        self.assertEqual(rows[8 << 20], (16, 16, 16))
        # no cap, and min_iters never raises above --iters
        self.assertEqual(pr.plan([8 << 20], 10, 5, 128, 0, 16), [(8 << 20, 10, 10, 5)])
        self.assertEqual(pr.plan([8 << 20], 10, 5, 128, 1 << 20, 16), [(8 << 20, 10, 10, 5)])


class PerftestParser(unittest.TestCase):
    def test_write_bw(self):
        p = pr.parse_perftest(WRITE_BW_65536)
        self.assertEqual(p["kind"], "bw")
        self.assertEqual(p["rows"], [{"bytes": 65536, "iterations": 1000, "bw_peak_mb_s": 99.62,
                                      "bw_avg_mb_s": 98.37, "msg_rate_mpps": 0.001574}])
        self.assertEqual(len(p["lines"]), 2)

    def test_read_bw_with_noise_lines(self):
        p = pr.parse_perftest(READ_BW_4096)
        self.assertEqual(p["rows"][0]["bw_avg_mb_s"], 63.42)
        self.assertEqual(p["rows"][0]["bytes"], 4096)

    def test_small_message_bw_uses_message_rate(self):
        row = pr.parse_perftest(WRITE_BW_2)["rows"][0]
        self.assertEqual(row["bw_avg_mb_s"], 0.09)
        self.assertAlmostEqual(pr.bw_value(row), 0.048006e6 * 2 / (1 << 20))
        big = pr.parse_perftest(WRITE_BW_65536)["rows"][0]
        self.assertEqual(pr.bw_value(big), 98.37)

    def test_gbits_converted(self):
        row = pr.parse_perftest(GBITS_BW)["rows"][0]
        self.assertAlmostEqual(row["bw_avg_mb_s"], 0.83e9 / 8 / (1 << 20))

    def test_write_lat(self):
        p = pr.parse_perftest(WRITE_LAT_2)
        self.assertEqual(p["kind"], "lat")
        self.assertEqual(p["rows"], [{"bytes": 2, "iterations": 500, "t_min_us": 3533.34, "t_max_us": 7892.51,
                                      "t_typical_us": 3998.38, "t_avg_us": 4092.41, "t_stdev_us": 419.10,
                                      "p99_us": 6030.65, "p999_us": 7892.51}])

    def test_sweep_rows(self):
        p = pr.parse_perftest(SWEEP_LAT)
        self.assertEqual([r["bytes"] for r in p["rows"]], [2, 4])
        self.assertEqual(p["rows"][1]["p99_us"], 4900.0)

    def test_no_table(self):
        self.assertIsNone(pr.parse_perftest(FAILED_CLIENT))
        self.assertIsNone(pr.parse_perftest(""))


class OursParser(unittest.TestCase):
    def test_pretty_json_after_banner(self):
        text = "some banner\n---\n" + json.dumps(OURS_BW, indent=2) + "\n"
        self.assertEqual(pr.parse_gpudirect_json(text), OURS_BW)

    def test_compact_lat(self):
        self.assertEqual(pr.parse_gpudirect_json(json.dumps(OURS_LAT)), OURS_LAT)

    def test_none(self):
        self.assertIsNone(pr.parse_gpudirect_json("gpudirect bw: error: {not json}"))
        self.assertIsNone(pr.parse_gpudirect_json('{"tool": "x"}'))


def make_raw(repeat=1):
    body = ""
    n = 0
    for rep in range(1, repeat + 1):
        n += 1
        body += run_block(n, "perftest", "write", 2, 1000, 128, rep, WRITE_BW_2)
        n += 1
        body += run_block(n, "gpudirect", "write", 2, 1000, 128, rep,
                          ours_json(OURS_BW, 2, bw_avg_mb_s=0.1, msg_rate_mpps=0.05 + 0.001 * rep))
        n += 1
        body += run_block(n, "perftest", "write", 65536, 1000, 128, rep, WRITE_BW_65536)
        n += 1
        body += run_block(n, "gpudirect", "write", 65536, 1000, 128, rep,
                          ours_json(OURS_BW, 65536, bw_avg_mb_s=90.0 + rep))
        n += 1
        body += run_block(n, "perftest", "lat", 2, 500, 0, rep, WRITE_LAT_2)
        n += 1
        body += run_block(n, "gpudirect", "lat", 2, 500, 0, rep, ours_json(OURS_LAT))
        n += 1
        body += run_block(n, "perftest", "lat", 65536, 500, 0, rep, "", rc=1,
                          server="Couldn't connect", note="server_not_listening")
        n += 1
        body += run_block(n, "gpudirect", "lat", 65536, 500, 0, rep, "gpudirect lat: error: boom\n", rc=1)
    return pr.build_raw(sample_log(body, n, repeat=repeat))


class LogAndReport(unittest.TestCase):
    def test_parse_log(self):
        raw = make_raw()
        self.assertTrue(raw["complete"])
        self.assertEqual(raw["host"]["git_commit"], "0123456789abcdef")
        self.assertEqual(raw["guest"]["kernel"], "6.1.0-57-amd64")  # \r stripped
        self.assertEqual(raw["params"]["sizes"], [2, 65536])
        self.assertEqual(raw["params"]["ops"], ["write", "lat"])
        self.assertEqual(raw["params"]["plan"][0], {"bytes": 2, "bw_iters": 1000, "bw_tx_depth": 128, "lat_iters": 500})
        self.assertEqual(len(raw["runs"]), 8)
        ok = {(r["tool"], r["op"], r["bytes"]): r for r in raw["runs"]}
        r = ok[("perftest", "write", 65536)]
        self.assertTrue(r["ok"])
        self.assertEqual(r["result"]["bw_avg_mb_s"], 98.37)
        self.assertEqual(r["command"], "ib_write_bw -d rxe0 127.0.0.1")
        self.assertEqual(r["secs"], 1.25)
        self.assertEqual(len(r["output"]), 2)  # only the table is kept
        self.assertEqual(ok[("gpudirect", "lat", 2)]["result"]["p99_us"], 5800.0)
        bad = ok[("perftest", "lat", 65536)]
        self.assertFalse(bad["ok"])
        self.assertIn("exit status 1", bad["error"])
        self.assertIn("server not listening", bad["error"])
        self.assertEqual(bad["server_output"], ["Couldn't connect"])
        self.assertIn("gpudirect lat: error: boom", ok[("gpudirect", "lat", 65536)]["output"])

    def test_wrong_size_and_nonzero_exit_are_failures(self):
        body = run_block(1, "perftest", "write", 4096, 1000, 128, 1, WRITE_BW_65536)
        body += run_block(2, "gpudirect", "write", 65536, 1000, 128, 1, ours_json(OURS_BW), rc=1)
        raw = pr.build_raw(sample_log(body, 2, ops="write", sizes=(4096, 65536)))
        self.assertFalse(raw["runs"][0]["ok"])
        self.assertIn("no result row for 4096 bytes", raw["runs"][0]["error"])
        self.assertFalse(raw["runs"][1]["ok"])
        self.assertIn("despite a result", raw["runs"][1]["error"])
        self.assertIn("result_discarded", raw["runs"][1])

    def test_truncated_log(self):
        body = run_block(1, "perftest", "write", 65536, 1000, 128, 1, WRITE_BW_65536)
        body += run_block(2, "gpudirect", "write", 65536, 1000, 128, 1, "partial\n", end=False)
        raw = pr.build_raw(sample_log(body, 4, done=False, ops="write lat", sizes=(65536,)), testbed_rc=124)
        self.assertFalse(raw["complete"])
        self.assertEqual(len(raw["runs"]), 2)
        self.assertTrue(raw["runs"][0]["ok"])
        self.assertIn("did not finish", raw["runs"][1]["error"])
        self.assertIn("124", raw["runs"][1]["error"])
        md = rd.render_markdown(raw)
        self.assertIn("incomplete: 2 of 4 runs recorded; testbed exit status 124", md)
        self.assertIn("## Latency (µs, one-way)\n\nNo runs.", md)

    def test_medians_and_ratio_table(self):
        raw = make_raw(repeat=3)
        s = pr.summarize(raw)
        # ours at 64 KiB: 91, 92, 93 -> median 92; perftest 98.37 each time
        self.assertEqual(s["write"][65536]["gpudirect"]["bw_mb_s"]["median"], 92.0)
        self.assertEqual(s["write"][65536]["perftest"]["bw_mb_s"]["n"], 3)
        md = rd.render_markdown(raw, s)
        self.assertIn("| 65536 | 64 KiB | 1000 | 128 | 98.37 (98.37–98.37) | 92.00 (91.00–93.00) | %.2f |"
                      % (92.0 / 98.37), md)
        # small messages: both from the message rate
        pt2 = 0.048006e6 * 2 / (1 << 20)
        ours2 = 0.052e6 * 2 / (1 << 20)
        self.assertIn("| %.2f |" % (ours2 / pt2), md.split("| 2 | 2 B |")[1].split("\n")[0] + "|")
        # latency: typical 3900/3998.38, p99 5800/6030.65; 64 KiB missing on both sides
        self.assertIn("| 2 | 2 B | 500 | 3998 (3998–3998) | 3900 (3900–3900) | %.2f | 6031 (6031–6031) | 5800 (5800–5800) | %.2f |"
                      % (3900 / 3998.38, 5800 / 6030.65), md)
        self.assertIn("| 65536 | 64 KiB | 500 | — | — | — | — | — | — |", md)
        self.assertIn("## Failed runs", md)
        self.assertIn("6 of 24 runs gave no result", md)
        self.assertIn("QEMU TCG", md)
        self.assertIn("0123456789abcdef (with uncommitted changes)", md)

    def test_ratio_helpers(self):
        self.assertIsNone(pr.ratio(None, 1))
        self.assertIsNone(pr.ratio(1, 0))
        self.assertEqual(pr.ratio(3, 2), 1.5)
        self.assertAlmostEqual(pr.geomean([2, 0.5, None]), 1.0)
        self.assertEqual(rd.nice_ceiling(93.0), (100, 20))


class Svg(unittest.TestCase):
    def parse(self, svg):
        return ET.fromstring(svg)

    def test_well_formed_with_both_curves(self):
        raw = make_raw(repeat=3)
        root = self.parse(rd.render_svg(raw))
        self.assertEqual(root.tag, SVG_NS + "svg")
        curves = root.findall(".//%sg[@class]" % SVG_NS)
        got = {(g.get("data-tool"), g.get("data-op")) for g in curves if g.get("class", "").startswith("curve")}
        self.assertEqual(got, {("perftest", "write"), ("gpudirect", "write")})
        for g in curves:
            if g.get("class", "").startswith("curve"):
                lines = g.findall(SVG_NS + "polyline")
                self.assertEqual(len(lines), 1)
                self.assertEqual(len(lines[0].get("points").split()), 2)
                dashed = lines[0].get("stroke-dasharray") is not None
                self.assertEqual(dashed, g.get("data-tool") == "perftest")
        texts = [t.text or "" for t in root.iter(SVG_NS + "text")]
        self.assertTrue(any("MB/s" in t for t in texts))
        self.assertTrue(any("log2" in t for t in texts))
        self.assertIn("2", texts)     # x tick labels
        self.assertIn("64K", texts)
        self.assertTrue(any(t.startswith("perftest") for t in texts))  # legend
        self.assertTrue(any(t.startswith("gpudirect") for t in texts))

    def test_three_panels_and_gaps(self):
        body = ""
        n = 0
        for op in ("write", "read", "send"):
            for size in (2, 4096, 65536):
                n += 1
                text = WRITE_BW_65536.replace("65536      1000", "%-10d 1000" % size)
                body += run_block(n, "perftest", op, size, 1000, 128, 1, text, rc=0 if size != 4096 else 1)
                n += 1
                body += run_block(n, "gpudirect", op, size, 1000, 128, 1, ours_json(OURS_BW, size))
        raw = pr.build_raw(sample_log(body, n, ops="write read send", sizes=(2, 4096, 65536)))
        root = self.parse(rd.render_svg(raw))
        panels = [g for g in root.iter(SVG_NS + "g") if g.get("class") == "panel"]
        self.assertEqual([p.get("data-op") for p in panels], ["write", "read", "send"])
        for g in root.iter(SVG_NS + "g"):
            if g.get("data-tool") == "perftest" and g.get("class", "").startswith("curve"):
                # the failed 4096 B point splits the line: two single points, no polyline
                self.assertEqual(len(g.findall(SVG_NS + "polyline")), 0)
                self.assertEqual(len(g.findall(SVG_NS + "rect")), 2)

    def test_no_bandwidth_data(self):
        raw = pr.build_raw(sample_log(run_block(1, "perftest", "lat", 2, 500, 0, 1, WRITE_LAT_2), 1,
                                      ops="lat", sizes=(2,)))
        root = self.parse(rd.render_svg(raw))
        self.assertTrue(any("no bandwidth data" in (t.text or "") for t in root.iter(SVG_NS + "text")))


class Cli(unittest.TestCase):
    def test_report_and_render(self):
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "guest.log")
            body = run_block(1, "perftest", "write", 65536, 1000, 128, 1, WRITE_BW_65536)
            body += run_block(2, "gpudirect", "write", 65536, 1000, 128, 1, ours_json(OURS_BW))
            with open(log, "w") as f:
                f.write(sample_log(body, 2, ops="write", sizes=(65536,)))
            out = os.path.join(d, "out")
            with open(os.devnull, "w") as null:
                old = sys.stdout
                sys.stdout = null
                try:
                    rc = cp.main(["report", "--log", log, "--out", out])
                    rc2 = cp.main(["render", "--raw", os.path.join(out, "raw.json"), "--out", out])
                finally:
                    sys.stdout = old
            self.assertEqual((rc, rc2), (0, 0))
            self.assertEqual(sorted(os.listdir(out)), ["bandwidth.svg", "comparison.md", "raw.json"])
            with open(os.path.join(out, "raw.json")) as f:
                raw = json.load(f)
            self.assertEqual(raw["schema"], 1)
            self.assertEqual(raw["runs"][1]["result"]["bw_avg_mb_s"], 97.5)
            ET.parse(os.path.join(out, "bandwidth.svg"))


if __name__ == "__main__":
    unittest.main()
