"""Attacks on the Python side of the metrics: Agent(metrics=...) parsing,
gpudirect.metrics.Collector with odd or broken agents, and what
prometheus_client then serves. Each test fails while the defect it looks
for is there. Host-runnable: metrics= is parsed before any device opens,
and the collector runs over stand-in agents."""

from __future__ import annotations

import copy

import pytest

import gpudirect
from gpudirect.metrics import Collector

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from test_metrics import FakeAgent, snapshot  # noqa: E402


def _metrics_error(value):
    """The ConfigError that Agent(metrics=value) raises about the metrics
    address, or None when the address was taken (whatever failed later:
    on a host without RDMA devices, opening one)."""
    try:
        with gpudirect.Agent("m", listen="127.0.0.1:0", metrics=value):
            return None
    except gpudirect.ConfigError as e:
        return e if "metrics=" in str(e) else None
    except gpudirect.EngineError:
        return None


@pytest.mark.parametrize(
    "bad",
    ["0x10", "127.0.0.1:99999", "127.0.0.1:-1", "1.2.3.4", ":9464", "9464:", "[::1]", "::1:9464", "localhost:9464", "9464 9465", "65536"],
)
def test_a_metrics_address_of_neither_form_is_refused(monkeypatch, bad):
    monkeypatch.delenv("GPUDIRECT_METRICS", raising=False)
    assert _metrics_error(bad) is not None, f"metrics={bad!r} was taken as an address"


# Port 0 only: where a device is, the agent really binds it.
@pytest.mark.parametrize("good", [" 0", "0\n", "[::1]:0", "127.0.0.1:0", "0"])
def test_a_metrics_address_of_either_form_is_taken(monkeypatch, good):
    monkeypatch.delenv("GPUDIRECT_METRICS", raising=False)
    assert _metrics_error(good) is None, f"metrics={good!r}: {_metrics_error(good)}"


@pytest.mark.parametrize("odd", ["+0", "+00"])
def test_a_port_is_digits_only(monkeypatch, odd):
    """Rust's u16 parser takes a leading '+': the
    documented forms are PORT and IP:PORT; '+9464' is neither and is
    served on 9464 without a word (here '+0': where a device is, a
    taken address is really bound)."""
    monkeypatch.delenv("GPUDIRECT_METRICS", raising=False)
    assert _metrics_error(odd) is not None, f"metrics={odd!r} was taken as a port"


def test_two_agents_collected_in_one_process_give_one_type_line_per_family():
    """A process with two agents registers a Collector for each (the
    collector is "of one agent"). The text format allows one TYPE line
    per metric name, all its samples in one group; two collectors each
    yielding the same families write every family twice, which
    `gpudirect stats` then refuses ("a second TYPE")."""
    registry = prometheus_client.CollectorRegistry()
    a = snapshot()
    a["agent"] = "prefill"
    b = copy.deepcopy(snapshot())
    b["agent"] = "decode"
    # A collector per agent is refused at registration, naming the clash;
    # one collector of both writes each family once.
    registry.register(Collector(FakeAgent(a)))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(Collector(FakeAgent(b)))
    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector(FakeAgent(a), FakeAgent(b)))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'agent="decode"' in text and 'agent="prefill"' in text
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    twice = sorted({t for t in types if types.count(t) > 1})
    assert not twice, f"TYPE lines given twice: {twice}"


def test_label_values_with_quotes_newlines_and_backslashes_round_trip():
    s = snapshot()
    s["agent"] = 'a"b\nc\\d\re\x1b[2J'
    s["nics"][0]["device"] = 'mlx5_"0"\n'
    s["peers"][0]["name"] = "\\n not a newline"
    registry = prometheus_client.CollectorRegistry()
    registry.register(Collector(FakeAgent(s)))
    text = prometheus_client.generate_latest(registry).decode()
    got = {(x.labels.get("agent"), x.labels.get("nic"), x.labels.get("peer")) for f in text_string_to_metric_families(text) for x in f.samples}
    assert (s["agent"], 'mlx5_"0"\n', None) in got
    assert (s["agent"], None, "\\n not a newline") in got
    # No sample line is split by a raw line feed from a label value (the
    # format's lines end at LF only; a raw CR in a value is allowed).
    assert all(line.startswith(("#", "gpudirect_")) for line in text.split("\n") if line), text


def test_a_broken_agent_does_not_take_the_process_s_other_metrics_down():
    """A process (vLLM, Ray Serve) serves its own metrics and registers
    Collector(agent). An agent whose stats() fails must not turn the
    whole scrape into an error: the process's other metrics still go
    out."""

    class Broken:
        def stats(self):
            raise RuntimeError("a bug in the agent's snapshot")

    registry = prometheus_client.CollectorRegistry()
    c = prometheus_client.Counter("vllm_requests", "the host process's own", registry=registry)
    c.inc()
    registry.register(Collector(Broken()))
    try:
        text = prometheus_client.generate_latest(registry).decode()
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"the whole scrape failed: {e!r}")
    assert "vllm_requests_total 1.0" in text

