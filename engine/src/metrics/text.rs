//! [`AgentStats`] in Prometheus' text exposition format (version 0.0.4):
//! what the endpoint serves. The names, their labels and what each
//! counts are the README's table ("Metrics"). Label values are the
//! agent's, its NICs' and its peers' names (escaped as the format says),
//! never a secret, a key or a memory address.

use std::fmt::Write;

use gpudirect::metrics::{escape_label as escape, write_family as family, write_path_traffic, LATENCY_BOUNDS};
use crate::metrics::snapshot::AgentStats;
use crate::transfers::stats::TransferStats;
use crate::transfers::transfer::Op;

fn op_label(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}

/// The outcomes of [`TransferStats`], as `outcome` labels.
fn outcomes(s: &TransferStats) -> [(&'static str, u64); 4] {
    [("posted", s.posts), ("completed", s.completed), ("failed", s.failed), ("refused", s.refused)]
}

/// `stats` in the text format.
pub fn prometheus_text(stats: &AgentStats) -> String {
    let mut out = String::with_capacity(8192);
    let agent = || ("agent", stats.agent.clone());
    family(&mut out, "gpudirect_uptime_seconds", "gauge", "How long the agent had run when this snapshot was taken (monotonic): divide counter differences by its difference for rates exact to the snapshot.", &[(vec![agent()], format!("{:.6}", stats.uptime.as_secs_f64()))]);
    write_path_traffic(&mut out, &stats.agent, stats.nics.iter().map(|n| (n.device.as_str(), n.traffic.as_slice())));
    let mut reqs = Vec::new();
    let mut connects = Vec::new();
    for o in &stats.ops {
        for (outcome, n) in outcomes(&o.requests) {
            reqs.push((vec![agent(), ("op", op_label(o.op).to_owned()), ("outcome", outcome.to_owned())], n.to_string()));
        }
        connects.push((vec![agent(), ("op", op_label(o.op).to_owned())], o.requests.connects.to_string()));
    }
    family(&mut out, "gpudirect_requests_total", "counter", "Transfer requests by op and outcome (posted, completed, failed, refused before anything went out).", &reqs);
    family(&mut out, "gpudirect_connects_total", "counter", "Connections set up by posts (the first to a peer, and one per reconnect), by op.", &connects);
    let _ = writeln!(out, "# HELP gpudirect_request_seconds Time from a post to the completion that finished it (done or failed), by op; one post in 8 per posting thread is timed.\n# TYPE gpudirect_request_seconds histogram");
    for o in &stats.ops {
        let labels = format!("agent=\"{}\",op=\"{}\"", escape(&stats.agent), op_label(o.op));
        let mut cumulative = 0;
        for (i, n) in o.latency.counts.iter().enumerate() {
            cumulative += n;
            let le = LATENCY_BOUNDS.get(i).map_or_else(|| "+Inf".to_owned(), |b| b.to_string());
            let _ = writeln!(out, "gpudirect_request_seconds_bucket{{{labels},le=\"{le}\"}} {cumulative}");
        }
        let _ = writeln!(out, "gpudirect_request_seconds_sum{{{labels}}} {}", o.latency.sum_seconds);
        let _ = writeln!(out, "gpudirect_request_seconds_count{{{labels}}} {}", o.latency.count);
    }
    let r = &stats.refusals;
    let b = &r.broadcast;
    let reasons = [
        ("control", r.control),
        ("unknown_sender", r.unknown_sender),
        ("metadata_seal", r.metadata_seal),
        ("broadcast_forged", b.forged),
        ("broadcast_unknown", b.unknown),
        ("broadcast_not_owner", b.not_owner),
        ("broadcast_unpublished", b.unpublished),
        ("broadcast_unknown_peers", b.unknown_peers),
        ("broadcast_busy", b.busy),
        ("broadcast_malformed", b.malformed),
    ];
    let refusals: Vec<_> = reasons.iter().map(|(why, n)| (vec![agent(), ("reason", (*why).to_owned())], n.to_string())).collect();
    family(&mut out, "gpudirect_refusals_total", "counter", "What this agent refused or dropped, by reason (each also logged).", &refusals);
    family(&mut out, "gpudirect_connections", "gauge", "Connections (queue pairs) to peers, by state.", &[(vec![agent(), ("state", "live".to_owned())], stats.connections.to_string())]);
    let e = &stats.peer_events;
    let events: Vec<_> = [("lost", e.lost), ("replaced", e.replaced), ("impostor", e.impostors)]
        .iter()
        .map(|(kind, n)| (vec![agent(), ("kind", (*kind).to_owned())], n.to_string()))
        .collect();
    family(&mut out, "gpudirect_peer_events_total", "counter", "What happened to peers: connections lost, peers restarted, names claimed by another agent.", &events);
    let mut peer_bytes = Vec::new();
    let mut peer_reqs = Vec::new();
    let mut peer_conns = Vec::new();
    for p in &stats.peers {
        peer_bytes.push((vec![agent(), ("peer", p.name.clone())], p.requests.bytes.to_string()));
        for (outcome, n) in outcomes(&p.requests) {
            peer_reqs.push((vec![agent(), ("peer", p.name.clone()), ("outcome", outcome.to_owned())], n.to_string()));
        }
        peer_conns.push((vec![agent(), ("peer", p.name.clone())], p.connections.to_string()));
    }
    family(&mut out, "gpudirect_peer_bytes_total", "counter", "Bytes of the requests to each of the busiest peers.", &peer_bytes);
    family(&mut out, "gpudirect_peer_requests_total", "counter", "Requests to each of the busiest peers, by outcome.", &peer_reqs);
    family(&mut out, "gpudirect_peer_connections", "gauge", "Connections alive to each of the busiest peers.", &peer_conns);
    let o = &stats.other_peers;
    family(&mut out, "gpudirect_other_peers", "gauge", "Peers not listed one by one (beyond the busiest).", &[(vec![agent()], o.peers.to_string())]);
    family(&mut out, "gpudirect_other_peers_bytes_total", "counter", "Bytes of the requests to the peers not listed, summed.", &[(vec![agent()], o.requests.bytes.to_string())]);
    out
}
