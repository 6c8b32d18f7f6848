//! Prometheus' text exposition format (version 0.0.4), the parts every
//! exporter of the workspace shares: label escaping, one family at a
//! time, the byte counters by path, and the address a user names for
//! the endpoint.

use std::fmt::Write;
use std::net::SocketAddr;

use crate::metrics::counting::PathTraffic;

/// The content type of the text format.
pub const PROMETHEUS_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The environment variable the engine's tools, the NCCL plugin and the
/// Python package read for where to serve metrics: `PORT` (on loopback)
/// or `IP:PORT`.
pub const METRICS_ENV: &str = "GPUDIRECT_METRICS";

/// A label value as the text format wants it: backslash, double quote
/// and line feed escaped.
pub fn escape_label(v: &str) -> String {
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

/// One sample: its label pairs (values escaped when written) and value.
pub type Sample<'a> = (Vec<(&'a str, String)>, String);

/// Writes one metric family: its help and type lines, then `samples`.
pub fn write_family(out: &mut String, name: &str, kind: &str, help: &str, samples: &[Sample<'_>]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape_label(v))).collect();
        let _ = writeln!(out, "{name}{{{}}} {value}", labels.join(","));
    }
}

/// Writes `gpudirect_bytes_total` and `gpudirect_posts_total`: each
/// NIC's traffic (its name, what it moved) by direction and path, every
/// series labelled `agent` too.
pub fn write_path_traffic<'a>(out: &mut String, agent: &str, nics: impl IntoIterator<Item = (&'a str, &'a [PathTraffic])>) {
    let mut bytes = Vec::new();
    let mut posts = Vec::new();
    for (nic, traffic) in nics {
        for t in traffic {
            let labels = vec![("agent", agent.to_owned()), ("nic", nic.to_owned()), ("direction", t.direction.as_str().to_owned()), ("path", t.path.as_str().to_owned())];
            bytes.push((labels.clone(), t.bytes.to_string()));
            posts.push((labels, t.posts.to_string()));
        }
    }
    write_family(
        out,
        "gpudirect_bytes_total",
        "counter",
        "Bytes moved through each NIC, by direction (out: from local memory, as writes and sends; in: into it, as reads and receives) and path \
         (gdr: GPU memory registered by dma-buf or peer memory; host: host memory; staged: a GPU's bytes through host memory), as the local registration says.",
        &bytes,
    );
    write_family(out, "gpudirect_posts_total", "counter", "Posts (or slices of one) that carried bytes, by NIC, direction and path.", &posts);
}

/// `v` as [`METRICS_ENV`] takes it: a port alone (digits only) on
/// loopback, or `IP:PORT`.
///
/// # Errors
/// A message naming the value otherwise.
pub fn parse_metrics_addr(v: &str) -> Result<SocketAddr, String> {
    // Digits only: Rust's integer parsing takes a leading `+`.
    if !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(port) = v.parse::<u16>() {
            return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
        }
    }
    v.parse().map_err(|_| {
        // Said back cut short: the value may be anything the environment holds.
        let shown: String = v.chars().take(64).collect();
        let cut = if shown.len() < v.len() { format!(" (cut from {} bytes)", v.len()) } else { String::new() };
        format!("{METRICS_ENV}={shown:?}{cut}: a port (served on loopback) or IP:PORT")
    })
}

/// Where [`METRICS_ENV`] asks for metrics: `None` when unset or empty.
///
/// # Errors
/// As [`parse_metrics_addr`].
pub fn metrics_addr_from_env() -> Result<Option<SocketAddr>, String> {
    metrics_addr_from(std::env::var(METRICS_ENV).ok().as_deref())
}

/// Where a value of [`METRICS_ENV`] (`None`: unset) asks for metrics:
/// `None` when unset or blank, else [`parse_metrics_addr`] of it trimmed.
///
/// # Errors
/// As [`parse_metrics_addr`].
pub fn metrics_addr_from(value: Option<&str>) -> Result<Option<SocketAddr>, String> {
    value.map(str::trim).filter(|v| !v.is_empty()).map(parse_metrics_addr).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn metrics_addresses() {
        assert_eq!(parse_metrics_addr("9400").unwrap(), SocketAddr::from(([127, 0, 0, 1], 9400)));
        assert_eq!(parse_metrics_addr("0.0.0.0:9400").unwrap(), SocketAddr::from(([0, 0, 0, 0], 9400)));
        for bad in ["+0", "", "host:1", "99999", "-1", "9400 "] {
            assert!(parse_metrics_addr(bad).is_err(), "{bad:?} taken");
        }
    }
}
