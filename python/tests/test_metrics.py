"""gpudirect.metrics.Collector over a stand-in agent (no RDMA device):
the families, labels and values prometheus_client gets, histogram buckets
cumulative up to +Inf, and the exposition's names those of the agent's own
endpoint. The same collector against a real agent's endpoint is in
test_engine.py."""

from __future__ import annotations

import sys

import pytest

import gpudirect
from gpudirect.metrics import Collector

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BOUNDS = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0, 10.0]


def transfer(posts=0, nbytes=0, completed=0, failed=0, refused=0, connects=0):
    return {"posts": posts, "bytes": nbytes, "completed": completed, "failed": failed, "refused": refused, "connects": connects}


def traffic(out_host=0, in_host=0, out_gdr=0):
    t = []
    for direction in ("out", "in"):
        for path in ("gdr", "host", "staged"):
            b = {("out", "host"): out_host, ("in", "host"): in_host, ("out", "gdr"): out_gdr}.get((direction, path), 0)
            t.append({"direction": direction, "path": path, "bytes": b, "posts": 1 if b else 0})
    return t


def snapshot():
    """An AgentStats as Agent.stats() returns it, with a number everywhere."""
    write_counts = [0] * 15
    write_counts[0], write_counts[3], write_counts[14] = 2, 1, 1
    read_counts = [0] * 15
    read_counts[6] = 1
    return {
        "agent": 'pre"fill',
        "uptime_seconds": 12.5,
        "nics": [
            {"device": "mlx5_0", "traffic": traffic(out_host=3 << 20, in_host=4096)},
            {"device": "mlx5_1", "traffic": traffic(out_gdr=1 << 20)},
        ],
        "ops": [
            {"op": "write", "requests": transfer(4, 4 << 20, 3, 1, 2, 1), "latency": {"bounds": BOUNDS, "counts": write_counts, "count": 4, "sum_seconds": 20.00013}},
            {"op": "read", "requests": transfer(1, 4096, 1, 0, 0, 0), "latency": {"bounds": BOUNDS, "counts": read_counts, "count": 1, "sum_seconds": 0.0009}},
        ],
        "peers": [{"name": "decode", "requests": transfer(5, (4 << 20) + 4096, 4, 1, 2, 1), "connections": 2}],
        "other_peers": {"peers": 3, "requests": transfer(7, 777), "connections": 1},
        "connections": 3,
        "peer_events": {"lost": 1, "replaced": 2, "impostors": 3},
        "refusals": {
            "control": 5,
            "unknown_sender": 6,
            "metadata_seal": 14,
            "broadcast": {"forged": 7, "unknown": 8, "not_owner": 9, "unpublished": 10, "unknown_peers": 11, "busy": 12, "malformed": 13},
        },
    }


class FakeAgent:
    def __init__(self, stats):
        self._stats = stats

    def stats(self):
        return self._stats


def families():
    return {f.name: f for f in Collector(FakeAgent(snapshot())).collect()}


def samples(f):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in f.samples}


def test_the_collector_yields_the_engine_s_families_with_their_types():
    got = {name: f.type for name, f in families().items()}
    assert got == {
        "gpudirect_bytes": "counter",
        "gpudirect_posts": "counter",
        "gpudirect_requests": "counter",
        "gpudirect_connects": "counter",
        "gpudirect_request_seconds": "histogram",
        "gpudirect_refusals": "counter",
        "gpudirect_uptime_seconds": "gauge",
        "gpudirect_connections": "gauge",
        "gpudirect_peer_events": "counter",
        "gpudirect_peer_bytes": "counter",
        "gpudirect_peer_requests": "counter",
        "gpudirect_peer_connections": "gauge",
        "gpudirect_other_peers": "gauge",
        "gpudirect_other_peers_bytes": "counter",
    }
    # describe() names the families (no samples), so a second collector of
    # them is refused at registration rather than writing each twice.
    described = {f.name: f.type for f in Collector(FakeAgent(snapshot())).describe()}
    assert described == got and all(not f.samples for f in Collector(FakeAgent(snapshot())).describe())
    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector(FakeAgent(snapshot())))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(Collector(FakeAgent(snapshot())))
    with pytest.raises(ValueError, match="at least one agent"):
        Collector()


def test_bytes_and_posts_by_nic_direction_and_path_every_pair_listed():
    f = families()
    a = 'pre"fill'
    b = samples(f["gpudirect_bytes"])
    assert len(b) == 12, "6 (direction, path) pairs for each of 2 NICs, zeros included"
    key = lambda nic, d, p: ("gpudirect_bytes_total", (("agent", a), ("direction", d), ("nic", nic), ("path", p)))
    assert b[key("mlx5_0", "out", "host")] == 3 << 20
    assert b[key("mlx5_0", "in", "host")] == 4096
    assert b[key("mlx5_1", "out", "gdr")] == 1 << 20
    assert b[key("mlx5_1", "in", "staged")] == 0
    assert sum(b.values()) == (4 << 20) + 4096
    assert sum(samples(f["gpudirect_posts"]).values()) == 3


def test_requests_refusals_events_and_peers_carry_their_labels_and_values():
    f = families()
    a = ("agent", 'pre"fill')
    req = samples(f["gpudirect_requests"])
    assert req[("gpudirect_requests_total", (a, ("op", "write"), ("outcome", "posted")))] == 4
    assert req[("gpudirect_requests_total", (a, ("op", "write"), ("outcome", "failed")))] == 1
    assert req[("gpudirect_requests_total", (a, ("op", "write"), ("outcome", "refused")))] == 2
    assert req[("gpudirect_requests_total", (a, ("op", "read"), ("outcome", "completed")))] == 1
    assert len(req) == 8
    assert samples(f["gpudirect_connects"]) == {
        ("gpudirect_connects_total", (a, ("op", "write"))): 1,
        ("gpudirect_connects_total", (a, ("op", "read"))): 0,
    }
    refusals = {dict(k[1])["reason"]: v for k, v in samples(f["gpudirect_refusals"]).items()}
    assert refusals == {
        "control": 5, "unknown_sender": 6, "metadata_seal": 14, "broadcast_forged": 7, "broadcast_unknown": 8, "broadcast_not_owner": 9,
        "broadcast_unpublished": 10, "broadcast_unknown_peers": 11, "broadcast_busy": 12, "broadcast_malformed": 13,
    }
    events = {dict(k[1])["kind"]: v for k, v in samples(f["gpudirect_peer_events"]).items()}
    assert events == {"lost": 1, "replaced": 2, "impostor": 3}
    assert samples(f["gpudirect_connections"]) == {("gpudirect_connections", (a, ("state", "live"))): 3}
    assert samples(f["gpudirect_peer_bytes"]) == {("gpudirect_peer_bytes_total", (a, ("peer", "decode"))): (4 << 20) + 4096}
    peer_req = {dict(k[1])["outcome"]: v for k, v in samples(f["gpudirect_peer_requests"]).items()}
    assert peer_req == {"posted": 5, "completed": 4, "failed": 1, "refused": 2}
    assert samples(f["gpudirect_peer_connections"]) == {("gpudirect_peer_connections", (a, ("peer", "decode"))): 2}
    assert samples(f["gpudirect_other_peers"]) == {("gpudirect_other_peers", (a,)): 3}
    assert samples(f["gpudirect_other_peers_bytes"]) == {("gpudirect_other_peers_bytes_total", (a,)): 777}


def test_latency_buckets_are_cumulative_up_to_inf_with_the_engine_s_bounds():
    f = families()["gpudirect_request_seconds"]
    write = [s for s in f.samples if s.labels.get("op") == "write"]
    buckets = [(s.labels["le"], s.value) for s in write if s.name == "gpudirect_request_seconds_bucket"]
    assert [le for le, _ in buckets] == [
        "0.00001", "0.000025", "0.00005", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.05", "0.1", "1", "10", "+Inf",
    ], "le as the engine's endpoint writes it"
    assert [v for _, v in buckets] == [2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 4]
    rest = {s.name: s.value for s in write if s.name != "gpudirect_request_seconds_bucket"}
    assert rest == {"gpudirect_request_seconds_count": 4, "gpudirect_request_seconds_sum": 20.00013}
    read = {s.labels["le"]: s.value for s in f.samples if s.labels.get("op") == "read" and "le" in s.labels}
    assert (read["0.0005"], read["0.001"], read["+Inf"]) == (0, 1, 1)


def test_the_exposition_names_are_the_engine_s():
    """generate_latest writes the engine endpoint's sample names (counters
    with _total) and label sets; it sorts labels by name, which Prometheus
    ignores."""
    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector(FakeAgent(snapshot())))
    text = prometheus_client.generate_latest(registry).decode()
    assert '# TYPE gpudirect_bytes_total counter\n' in text
    assert 'gpudirect_bytes_total{agent="pre\\"fill",direction="out",nic="mlx5_0",path="host"} 3.145728e+06\n' in text
    assert '# TYPE gpudirect_request_seconds histogram\n' in text
    assert 'gpudirect_request_seconds_bucket{agent="pre\\"fill",le="+Inf",op="write"} 4.0\n' in text
    assert '# TYPE gpudirect_connections gauge\n' in text
    # The engine's own exposition of the same kind of snapshot (its
    # metrics/text.rs format: labels in its order), read back by
    # prometheus_client's parser: same sample names, same label sets.
    engine = (
        '# HELP gpudirect_bytes_total x\n# TYPE gpudirect_bytes_total counter\n'
        'gpudirect_bytes_total{agent="pre\\"fill",nic="mlx5_0",direction="out",path="host"} 3145728\n'
        '# HELP gpudirect_request_seconds x\n# TYPE gpudirect_request_seconds histogram\n'
        'gpudirect_request_seconds_bucket{agent="pre\\"fill",op="write",le="0.00001"} 2\n'
        'gpudirect_request_seconds_sum{agent="pre\\"fill",op="write"} 20.00013\n'
        'gpudirect_request_seconds_count{agent="pre\\"fill",op="write"} 4\n'
        '# HELP gpudirect_refusals_total x\n# TYPE gpudirect_refusals_total counter\n'
        'gpudirect_refusals_total{agent="pre\\"fill",reason="broadcast_not_owner"} 9\n'
        '# HELP gpudirect_other_peers_bytes_total x\n# TYPE gpudirect_other_peers_bytes_total counter\n'
        'gpudirect_other_peers_bytes_total{agent="pre\\"fill"} 777\n'
    )
    ours = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    for f in text_string_to_metric_families(engine):
        for s in f.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key in ours, f"{key} not in prometheus_client's output:\n{text}"
            assert ours[key] == s.value, key
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert {n for n in names if n.endswith("_total")} == {
        "gpudirect_bytes_total", "gpudirect_posts_total", "gpudirect_requests_total", "gpudirect_connects_total",
        "gpudirect_refusals_total", "gpudirect_peer_events_total", "gpudirect_peer_bytes_total",
        "gpudirect_peer_requests_total", "gpudirect_other_peers_bytes_total",
    }
    assert "_created" not in text


def test_a_closed_agent_yields_nothing_and_a_failing_one_is_logged_and_left_out(caplog):
    class Closed:
        def stats(self):
            raise gpudirect.EngineError("the agent 'x' is closed")

    class Broken:
        def stats(self):
            raise gpudirect.ConfigError("a thread panicked holding this agent's handle")

    assert list(Collector(Closed()).collect()) == []
    assert list(Collector(Broken()).collect()) == []
    assert "a thread panicked" in caplog.text
    # The others of the collector still go out.
    fams = {f.name: f for f in Collector(Broken(), FakeAgent(snapshot())).collect()}
    assert {x.labels["agent"] for x in fams["gpudirect_bytes"].samples} == {'pre"fill'}


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "prometheus_client" or m.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match="pip install prometheus-client"):
        Collector(FakeAgent(snapshot()))


def test_importing_gpudirect_never_imports_prometheus_client():
    import subprocess

    code = "import sys, gpudirect, gpudirect.metrics, gpudirect.types; sys.exit('prometheus_client' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
