//! The human-readable report: verdict sentence first, then sections.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use super::{describe_support, Direction, RankSummary, Report};

/// Consecutive channel numbers as ranges: `00-03, 05`.
pub(super) fn channel_ranges(channels: &BTreeSet<u64>) -> String {
    let mut parts = Vec::new();
    let mut iter = channels.iter().copied().peekable();
    while let Some(start) = iter.next() {
        let mut end = start;
        while iter.peek() == Some(&end.saturating_add(1)) && end != u64::MAX {
            end += 1;
            iter.next();
        }
        parts.push(if start == end {
            format!("{start:02}")
        } else {
            format!("{start:02}-{end:02}")
        });
    }
    parts.join(", ")
}

/// Beyond this the text would bury the verdict; `--json` has every rank.
const MAX_RANKS_SHOWN: usize = 64;

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.headline)?;
        if !self.evidence.is_empty() {
            writeln!(f, "\nEvidence:")?;
            for e in &self.evidence {
                writeln!(f, "  - {e}")?;
            }
        }
        if let Some(s) = &self.settle_with {
            writeln!(f, "\nTo settle it: {s}")?;
        }
        writeln!(
            f,
            "\nNCCL version: {}",
            if self.nccl_versions.is_empty() {
                "not in this log".to_string()
            } else {
                self.nccl_versions.join(", ")
            }
        )?;
        if !self.networks.is_empty() {
            writeln!(f, "Network: {}", self.networks.join(", "))?;
        }
        for p in &self.providers {
            let nics = p.nics.map(|n| format!(", {n} NIC(s)")).unwrap_or_default();
            writeln!(f, "Libfabric provider: {}{nics} (line {})", p.name, p.line)?;
        }
        if let Some(s) = self.plugin_dmabuf {
            writeln!(f, "Plugin registers dma-buf: {}", if s { "yes" } else { "no" })?;
        }
        if !self.net_devices.is_empty() {
            writeln!(f, "\nNICs:")?;
            for d in &self.net_devices {
                writeln!(
                    f,
                    "  line {}: {}{}",
                    d.line,
                    d.printed,
                    on(d.host.as_deref())
                )?;
            }
        }
        if !self.gdr_support.is_empty() {
            writeln!(f, "\nGPUDirect RDMA per HCA / GPU:")?;
            for s in &self.gdr_support {
                writeln!(f, "  line {}: {}", s.line, describe_support(s))?;
            }
        }
        if !self.environment.is_empty() {
            writeln!(f, "\nEnvironment:")?;
            for e in &self.environment {
                writeln!(f, "  {}={} (line {})", e.name, e.value, e.line)?;
            }
            for j in self.environment_judged.iter().filter(|j| j.status == "warn" || j.status == "fail") {
                writeln!(f, "  [{}] {}", j.status, j.summary)?;
            }
        }
        if !self.ranks.is_empty() {
            writeln!(f, "\nConnections per rank:")?;
            for r in self.ranks.iter().take(MAX_RANKS_SHOWN) {
                self.write_rank(f, r)?;
            }
            if self.ranks.len() > MAX_RANKS_SHOWN {
                writeln!(
                    f,
                    "  ... and {} more ranks (see --json)",
                    self.ranks.len() - MAX_RANKS_SHOWN
                )?;
            }
        }
        if !self.misleading.is_empty() {
            writeln!(f, "\nNot evidence (misleading lines):")?;
            for m in &self.misleading {
                let times = if m.count > 1 {
                    format!(" (x{})", m.count)
                } else {
                    String::new()
                };
                writeln!(f, "  line {}: '{}'{times}: {}", m.line, m.text, m.why)?;
            }
        }
        if !self.warnings.is_empty() {
            writeln!(f, "\nNCCL warnings:")?;
            for w in self.warnings.iter().take(10) {
                writeln!(f, "  line {}: {}{}", w.line, w.text, on(w.host.as_deref()))?;
            }
            if self.warnings.len() > 10 {
                writeln!(
                    f,
                    "  ... and {} more (see --json)",
                    self.warnings.len() - 10
                )?;
            }
        }
        if !self.causes.is_empty() {
            writeln!(f, "\nLikely causes to check next:")?;
            for (i, c) in self.causes.iter().enumerate() {
                writeln!(f, "  {}. {c}", i + 1)?;
            }
        }
        Ok(())
    }
}

fn on(host: Option<&str>) -> String {
    host.map(|h| format!(" [{h}]")).unwrap_or_default()
}

impl Report {
    fn write_rank(&self, f: &mut fmt::Formatter<'_>, r: &RankSummary) -> fmt::Result {
        type Row<'a> = (Direction, u64, &'a str, Option<bool>);
        let gpu = r
            .gpu
            .as_ref()
            .map(|g| format!(", GPU {g}"))
            .unwrap_or_default();
        let host = r
            .host
            .as_ref()
            .map(|h| format!(" on {h}"))
            .unwrap_or_default();
        writeln!(f, "  rank {}{host}{gpu}:", r.rank)?;
        // One row per (direction, peer, transport), listing its channels.
        let mut rows: BTreeMap<Row, BTreeSet<Option<u64>>> = BTreeMap::new();
        for c in self
            .connections
            .iter()
            .filter(|c| c.rank == r.rank && c.host == r.host)
        {
            let peer = if c.direction == Direction::Receive {
                c.from_rank
            } else {
                c.to_rank
            };
            rows.entry((c.direction, peer, c.via.as_str(), c.gdr))
                .or_default()
                .insert(c.channel);
        }
        for ((dir, peer, via, gdr), channels) in rows {
            let arrow = match dir {
                Direction::Send => format!("send to {peer}"),
                Direction::Receive => format!("receive from {peer}"),
                Direction::Unspecified => format!("to {peer}"),
            };
            let note = if gdr == Some(false) {
                "  (no GDRDMA: host memory)"
            } else {
                ""
            };
            let known: BTreeSet<u64> = channels.iter().flatten().copied().collect();
            let shown = match (known.is_empty(), channels.contains(&None)) {
                (true, _) => "unknown (the line was cut before it)".to_owned(),
                (false, true) => format!("{} and one cut before its channel", channel_ranges(&known)),
                (false, false) => channel_ranges(&known),
            };
            writeln!(f, "    {arrow:<18} via {via:<22} channels {shown}{note}")?;
        }
        Ok(())
    }
}
