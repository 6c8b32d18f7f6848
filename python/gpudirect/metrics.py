"""An agent's metrics through prometheus_client, for a process that
already exports its own: the same metric families, names and labels as
the agent's own endpoint (``Agent(metrics=...)``, ``GPUDIRECT_METRICS``),
read from :meth:`gpudirect.Agent.stats` at each scrape::

    from prometheus_client import REGISTRY, start_http_server
    from gpudirect.metrics import Collector

    REGISTRY.register(Collector(agent))
    start_http_server(9400)

``import gpudirect`` never imports prometheus_client; this module does so
only when a :class:`Collector` is made, and names the package to install
(``pip install prometheus-client``, or the ``gpudirect[metrics]`` extra)
when it is missing."""

from __future__ import annotations

import logging
from decimal import Decimal
from typing import TYPE_CHECKING, Iterator, List, Protocol, Tuple, Type

from ._native import EngineError
from .types import AgentStats, TransferStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

__all__ = ["Collector", "StatsSource"]

_log = logging.getLogger("gpudirect.metrics")


class StatsSource(Protocol):
    """What a :class:`Collector` reads: anything whose ``stats()`` returns
    an :class:`~gpudirect.types.AgentStats` (a :class:`gpudirect.Agent`)."""

    def stats(self) -> AgentStats:
        """The agent's snapshot, as :meth:`gpudirect.Agent.stats`."""
        ...


def _families() -> Tuple[Type[CounterMetricFamily], Type[GaugeMetricFamily], Type[HistogramMetricFamily]]:
    """prometheus_client's metric families, imported on first use."""
    try:
        from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
    except ImportError as e:
        raise ImportError(
            "gpudirect.metrics needs prometheus_client, which is not installed: "
            "pip install prometheus-client (or pip install 'gpudirect[metrics]')"
        ) from e
    return CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


def _le(bound: float) -> str:
    """A bucket bound as the agent's endpoint writes it (Rust's decimal
    form: ``0.00001``, ``0.1``, ``1``, ``10``), so that both give each
    series the same ``le`` label."""
    s = format(Decimal(repr(bound)), "f")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    return s


def _outcomes(s: TransferStats) -> List[Tuple[str, int]]:
    """A :class:`~gpudirect.types.TransferStats`' counts as ``outcome`` labels."""
    return [("posted", s["posts"]), ("completed", s["completed"]), ("failed", s["failed"]), ("refused", s["refused"])]


# The families' help texts: the agent endpoint's, word for word.
_HELP_BYTES = (
    "Bytes this agent's NICs moved, by NIC, direction (out: its writes; in: its reads) and path (gdr: GPU memory "
    "registered by dma-buf or peer memory; host: host memory; staged: a GPU's bytes through host memory), as the "
    "local region's registration says."
)
_HELP_POSTS = "Posts (or slices of one) that carried bytes, by NIC, direction and path."
_HELP_REQUESTS = "Transfer requests by op and outcome (posted, completed, failed, refused before anything went out)."
_HELP_CONNECTS = "Connections set up by posts (the first to a peer, and one per reconnect), by op."
_HELP_LATENCY = (
    "Time from a post to the completion that finished it (done or failed), by op; one post in 8 per posting thread is"
    " timed."
)
_HELP_REFUSALS = "What this agent refused or dropped, by reason (each also logged)."
_HELP_CONNECTIONS = "Connections (queue pairs) to peers, by state."
_HELP_UPTIME = (
    "How long the agent had run when this snapshot was taken (monotonic): divide counter differences by its difference"
    " for rates exact to the snapshot."
)
_HELP_PEER_EVENTS = "What happened to peers: connections lost, peers restarted, names claimed by another agent."
_HELP_PEER_BYTES = "Bytes of the requests to each of the busiest peers."
_HELP_PEER_REQUESTS = "Requests to each of the busiest peers, by outcome."
_HELP_PEER_CONNECTIONS = "Connections alive to each of the busiest peers."
_HELP_OTHER_PEERS = "Peers not listed one by one (beyond the busiest)."
_HELP_OTHER_PEERS_BYTES = "Bytes of the requests to the peers not listed, summed."


class Collector:
    """A prometheus_client custom collector of a process's agents: register
    one (``REGISTRY.register(Collector(agent))``, or ``Collector(a, b)``
    for several agents in one process: the text format allows each family
    once, so a second collector of the same families is refused at
    registration) and every scrape takes a fresh
    :meth:`~gpudirect.Agent.stats` snapshot of each and yields the
    families the agents' own endpoints serve, with the same names
    (prometheus_client adds counters' ``_total``), labels and help:
    ``gpudirect_bytes_total`` and ``gpudirect_posts_total`` (``agent``,
    ``nic``, ``direction``, ``path``), ``gpudirect_requests_total``
    (``agent``, ``op``, ``outcome``), ``gpudirect_connects_total``
    (``agent``, ``op``), ``gpudirect_request_seconds`` (a histogram by
    ``agent``, ``op``), ``gpudirect_refusals_total`` (``agent``,
    ``reason``), ``gpudirect_uptime_seconds`` (``agent``),
    ``gpudirect_connections`` (``agent``, ``state``),
    ``gpudirect_peer_events_total`` (``agent``, ``kind``),
    ``gpudirect_peer_bytes_total``, ``gpudirect_peer_requests_total``
    (with ``outcome``) and ``gpudirect_peer_connections`` (``agent``,
    ``peer``: the busiest peers), ``gpudirect_other_peers`` and
    ``gpudirect_other_peers_bytes_total`` (``agent``).

    A closed agent yields nothing; an agent whose snapshot fails otherwise
    is left out of that scrape and the failure logged (``gpudirect.metrics``
    logger, at error), so the process's other metrics still go out; its
    series are then absent, which ``absent()`` in PromQL sees. Raises
    ImportError naming the package to install when prometheus_client is
    missing.
    """

    def __init__(self, *agents: StatsSource) -> None:
        """Collect the metrics of ``agents`` (:class:`gpudirect.Agent`, or
        anything with its ``stats()``). Raises ImportError when
        prometheus_client is not installed, ValueError without an agent."""
        _families()
        if not agents:
            raise ValueError("Collector(agent, ...): at least one agent")
        self.agents = agents
        """The agents whose snapshots each scrape reads."""

    @property
    def agent(self) -> StatsSource:
        """The first agent."""
        return self.agents[0]

    def describe(self) -> List[Metric]:
        """The families' names (no samples): the registry refuses a second
        collector of the same names at registration."""
        counter, gauge, histogram = _families()
        return list(self._families([], counter, gauge, histogram))

    def _snapshots(self) -> List[AgentStats]:
        snaps = []
        for a in self.agents:
            try:
                snaps.append(a.stats())
            except EngineError as err:
                # A closed agent raises EngineError itself (never a
                # subclass): it has nothing to report.
                if type(err) is not EngineError:
                    _log.error("gpudirect.metrics: an agent's snapshot failed, left out of this scrape: %r", err)
            except Exception as err:  # noqa: BLE001 - one agent must not take the scrape down
                _log.error("gpudirect.metrics: an agent's snapshot failed, left out of this scrape: %r", err)
        return snaps

    def collect(self) -> Iterator[Metric]:
        """The agents' metric families, from snapshots taken now."""
        counter, gauge, histogram = _families()
        snaps = self._snapshots()
        if not snaps:
            return
        yield from self._families(snaps, counter, gauge, histogram)

    @staticmethod
    def _families(
        snaps: List[AgentStats],
        counter: Type[CounterMetricFamily],
        gauge: Type[GaugeMetricFamily],
        histogram: Type[HistogramMetricFamily],
    ) -> Iterator[Metric]:
        traffic = ["agent", "nic", "direction", "path"]
        nbytes = counter("gpudirect_bytes", _HELP_BYTES, labels=traffic)
        posts = counter("gpudirect_posts", _HELP_POSTS, labels=traffic)
        for s in snaps:
            for nic in s["nics"]:
                for t in nic["traffic"]:
                    labels = [s["agent"], nic["device"], t["direction"], t["path"]]
                    nbytes.add_metric(labels, t["bytes"])
                    posts.add_metric(labels, t["posts"])
        yield nbytes
        yield posts

        requests = counter("gpudirect_requests", _HELP_REQUESTS, labels=["agent", "op", "outcome"])
        connects = counter("gpudirect_connects", _HELP_CONNECTS, labels=["agent", "op"])
        latency = histogram("gpudirect_request_seconds", _HELP_LATENCY, labels=["agent", "op"])
        for s in snaps:
            for o in s["ops"]:
                for outcome, n in _outcomes(o["requests"]):
                    requests.add_metric([s["agent"], o["op"], outcome], n)
                connects.add_metric([s["agent"], o["op"]], o["requests"]["connects"])
                h = o["latency"]
                buckets: List[Tuple[str, float]] = []
                cumulative = 0
                for i, n in enumerate(h["counts"]):
                    cumulative += n
                    le = _le(h["bounds"][i]) if i < len(h["bounds"]) else "+Inf"
                    buckets.append((le, float(cumulative)))
                latency.add_metric([s["agent"], o["op"]], buckets, h["sum_seconds"])
        yield requests
        yield connects
        yield latency

        refusals = counter("gpudirect_refusals", _HELP_REFUSALS, labels=["agent", "reason"])
        for s in snaps:
            r = s["refusals"]
            b = r["broadcast"]
            for reason, n in [
                ("control", r["control"]),
                ("unknown_sender", r["unknown_sender"]),
                ("metadata_seal", r["metadata_seal"]),
                ("broadcast_forged", b["forged"]),
                ("broadcast_unknown", b["unknown"]),
                ("broadcast_not_owner", b["not_owner"]),
                ("broadcast_unpublished", b["unpublished"]),
                ("broadcast_unknown_peers", b["unknown_peers"]),
                ("broadcast_busy", b["busy"]),
                ("broadcast_malformed", b["malformed"]),
            ]:
                refusals.add_metric([s["agent"], reason], n)
        yield refusals

        uptime = gauge("gpudirect_uptime_seconds", _HELP_UPTIME, labels=["agent"])
        connections = gauge("gpudirect_connections", _HELP_CONNECTIONS, labels=["agent", "state"])
        events = counter("gpudirect_peer_events", _HELP_PEER_EVENTS, labels=["agent", "kind"])
        for s in snaps:
            uptime.add_metric([s["agent"]], s["uptime_seconds"])
            connections.add_metric([s["agent"], "live"], s["connections"])
            ev = s["peer_events"]
            for kind, n in [("lost", ev["lost"]), ("replaced", ev["replaced"]), ("impostor", ev["impostors"])]:
                events.add_metric([s["agent"], kind], n)
        yield uptime
        yield connections
        yield events

        peer_bytes = counter("gpudirect_peer_bytes", _HELP_PEER_BYTES, labels=["agent", "peer"])
        peer_requests = counter("gpudirect_peer_requests", _HELP_PEER_REQUESTS, labels=["agent", "peer", "outcome"])
        peer_connections = gauge("gpudirect_peer_connections", _HELP_PEER_CONNECTIONS, labels=["agent", "peer"])
        other = gauge("gpudirect_other_peers", _HELP_OTHER_PEERS, labels=["agent"])
        other_bytes = counter("gpudirect_other_peers_bytes", _HELP_OTHER_PEERS_BYTES, labels=["agent"])
        for s in snaps:
            for p in s["peers"]:
                peer_bytes.add_metric([s["agent"], p["name"]], p["requests"]["bytes"])
                for outcome, n in _outcomes(p["requests"]):
                    peer_requests.add_metric([s["agent"], p["name"], outcome], n)
                peer_connections.add_metric([s["agent"], p["name"]], p["connections"])
            other.add_metric([s["agent"]], s["other_peers"]["peers"])
            other_bytes.add_metric([s["agent"]], s["other_peers"]["requests"]["bytes"])
        yield peer_bytes
        yield peer_requests
        yield peer_connections
        yield other
        yield other_bytes
