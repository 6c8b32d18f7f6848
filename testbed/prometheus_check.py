"""Inside a Soft-RoCE guest: a real Prometheus (Debian's package) scrapes
a metrics endpoint every second while its process moves host memory; a
PromQL query over Prometheus' HTTP API must return the bytes moved, by
direction and path, within one scrape of the traffic's end. The process
is an engine agent (engine/tests/engine_metrics.rs), or with --plugin
the NCCL plugin driven by its harness (`nccl-net-harness metrics`: a
send and a receive comm under GPUDIRECT_NCCL_GDR=prefer on host memory,
which must show as the host path). Run by testbed/metrics-bed.

Usage: python3 testbed/prometheus_check.py ENGINE_METRICS_BINARY
       python3 testbed/prometheus_check.py --plugin HARNESS_BINARY PLUGIN_SO
"""
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

PROM = "127.0.0.1:9090"
TARGET = "127.0.0.1:9464"
SCRAPE = 1.0


def get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def query(q: str) -> dict:
    url = f"http://{PROM}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    body = json.loads(get(url))
    if body.get("status") != "success":
        raise SystemExit(f"prometheus_check: query {q!r}: {body}")
    return body["data"]


def main() -> int:
    if sys.argv[1] == "--plugin":
        command = [sys.argv[2], "metrics", "--plugin", sys.argv[3], "--bench", "65536", "--iters", "300"]
        extra, label = {"GPUDIRECT_NCCL_GDR": "prefer"}, "nccl-net"
    else:
        command, extra, label = [sys.argv[1]], {}, "metrics-src"
    work = tempfile.mkdtemp(prefix="prom-")
    cfg = os.path.join(work, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write(
            f"global:\n  scrape_interval: {int(SCRAPE)}s\n  scrape_timeout: 1s\n"
            f"scrape_configs:\n  - job_name: gpudirect\n    static_configs:\n      - targets: ['{TARGET}']\n"
        )
    stop = os.path.join(work, "stop")
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={cfg}", f"--storage.tsdb.path={work}/data", f"--web.listen-address={PROM}", "--log.level=warn"],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, "prometheus.log"), "w"),
    )
    agent = None
    try:
        t = time.monotonic()
        while True:
            try:
                get(f"http://{PROM}/-/ready", timeout=1)
                break
            except OSError:
                if time.monotonic() - t > 120 or prom.poll() is not None:
                    print(open(os.path.join(work, "prometheus.log")).read())
                    raise SystemExit("prometheus_check: Prometheus did not start")
                time.sleep(0.5)
        print(f"prometheus_check: Prometheus {PROM} ready after {time.monotonic() - t:.1f} s, scraping {TARGET} every {SCRAPE:.0f} s")
        go = os.path.join(work, "go")
        env = dict(os.environ, GPUDIRECT_METRICS=TARGET, GPUDIRECT_METRICS_STOP=stop, GPUDIRECT_METRICS_GO=go, **extra)
        agent = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        assert agent.stdout is not None
        # The traffic starts once Prometheus scraped the idle agent.
        t = time.monotonic()
        while not any(float(r["value"][1]) == 1 for r in query('up{job="gpudirect"}')["result"]):
            if time.monotonic() - t > 60:
                raise SystemExit("prometheus_check: Prometheus never scraped the agent")
            time.sleep(0.2)
        open(go, "w").close()
        moved = None
        for line in agent.stdout:
            if line.startswith("MOVED "):
                moved = json.loads(line[len("MOVED "):])
                break
        if moved is None:
            raise SystemExit(f"prometheus_check: the agent ended without moving its bytes (exit {agent.wait()})")
        ended = time.monotonic()
        want = {("out", "host"): moved["out_host"], ("in", "host"): moved["in_host"]}
        for d in ("out", "in"):
            for p in ("gdr", "staged"):
                want[(d, p)] = 0
        q = f'sum by (direction, path) (gpudirect_bytes_total{{agent="{label}"}})'
        got: dict = {}
        while time.monotonic() - ended < 30:
            got = {(r["metric"]["direction"], r["metric"]["path"]): int(float(r["value"][1])) for r in query(q)["result"]}
            if got == want:
                break
            time.sleep(0.1)
        took = time.monotonic() - ended
        print(f"prometheus_check: {q} -> {dict(sorted((f'{d}/{p}', v) for (d, p), v in got.items()))}")
        if got != want:
            raise SystemExit(f"prometheus_check: Prometheus says {got}, the agent moved {want}")
        scrapes = query('count_over_time(up{job="gpudirect"}[1m])')["result"]
        n = int(float(scrapes[0]["value"][1])) if scrapes else 0
        print(f"prometheus_check: the bytes moved, by path, {took:.1f} s after the traffic ended ({n} scrapes so far); no byte as gdr or staged")
        # Within one scrape: the next scrape after the end (one interval),
        # plus the scrape's and the query's own time in a slow guest.
        if took > SCRAPE + 2:
            raise SystemExit(f"prometheus_check: {took:.1f} s is more than one scrape after the traffic")
        return 0
    finally:
        open(stop, "w").close()
        if agent is not None:
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
        prom.terminate()
        try:
            prom.wait(timeout=30)
        except subprocess.TimeoutExpired:
            prom.kill()


if __name__ == "__main__":
    sys.exit(main())
