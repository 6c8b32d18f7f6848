//! [`AgentStats`] in Prometheus' text exposition format (version 0.0.4):
//! what the endpoint serves. The names, their labels and what each
//! counts are the README's table ("Metrics"). Label values are the
//! agent's, its NICs' and its peers' names (escaped as the format says),
//! never a secret, a key or a memory address.

use std::fmt::Write;

use crate::counting::LATENCY_BOUNDS;
use crate::metrics::snapshot::AgentStats;
use crate::transfers::stats::TransferStats;
use crate::transfers::transfer::Op;

/// The content type of [`prometheus_text`]'s output.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A label value as the text format wants it: backslash, double quote
/// and line feed escaped.
fn escape(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

fn op_label(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}

/// Writes one metric family: its help and type lines, then `samples`
/// (label pairs, value).
fn family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(Vec<(&str, String)>, String)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
        let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
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
    let mut bytes = Vec::new();
    let mut posts = Vec::new();
    for nic in &stats.nics {
        for t in &nic.traffic {
            let labels = vec![agent(), ("nic", nic.device.clone()), ("direction", t.direction.as_str().to_owned()), ("path", t.path.as_str().to_owned())];
            bytes.push((labels.clone(), t.bytes.to_string()));
            posts.push((labels, t.posts.to_string()));
        }
    }
    family(&mut out, "gpudirect_bytes_total", "counter", "Bytes this agent's NICs moved, by NIC, direction (out: its writes; in: its reads) and path (gdr: GPU memory registered by dma-buf or peer memory; host: host memory; staged: a GPU's bytes through host memory), as the local region's registration says.", &bytes);
    family(&mut out, "gpudirect_posts_total", "counter", "Posts (or slices of one) that carried bytes, by NIC, direction and path.", &posts);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
