//! A [`Frame`] as the terminal shows it: per agent and NIC, MB/s by
//! direction and path over the interval (MB: 2^20 bytes, as `bw`), the
//! staged share of the interval's bytes, the totals since the agent
//! started, the NIC's verdict, and the requests and refusals that grew.
//! Staged figures are red when [`Style::colour`] says so. Names come from
//! the endpoint: control characters are shown escaped and long names cut.

use std::fmt::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use super::view::{AgentFrame, Continuity, Frame, NicFrame, Verdict};

/// How a frame is drawn.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Style {
    /// ANSI colours (red for staged bytes, refusals and failures).
    pub colour: bool,
    /// Clear the screen before the frame (a terminal, more frames to come).
    pub clear: bool,
}

const RED: &str = "\x1b[31m";
const RESET: &str = "\x1b[0m";
const CLEAR: &str = "\x1b[H\x1b[2J";
/// MB in MB/s.
const MB: f64 = (1u64 << 20) as f64;
/// The widest a name is shown.
const NAME_MAX: usize = 32;

/// A name from the endpoint as it may be shown: control characters
/// escaped, cut to [`NAME_MAX`] characters.
/// Characters that would not show as themselves: controls (C0, C1), and
/// the format and separator characters that reorder or hide text
/// (bidirectional overrides and isolates, zero-width ones, the line and
/// paragraph separators, the byte-order mark, the Arabic letter mark).
fn hidden(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{00AD}' | '\u{061C}' | '\u{115F}' | '\u{1160}' | '\u{17B4}' | '\u{17B5}' | '\u{180E}' | '\u{200B}'..='\u{200F}' | '\u{2028}'..='\u{202E}' | '\u{2060}'..='\u{206F}' | '\u{3164}' | '\u{FE00}'..='\u{FE0F}' | '\u{FEFF}' | '\u{FFA0}' | '\u{FFF9}'..='\u{FFFB}' | '\u{E0000}'..='\u{E007F}')
}

fn name(s: &str) -> String {
    let mut out: String = s.chars().take(NAME_MAX).flat_map(|c| if hidden(c) { c.escape_unicode().collect::<Vec<_>>() } else { vec![c] }).collect();
    if s.chars().nth(NAME_MAX).is_some() {
        out.push('…');
    }
    out
}

/// A local wall-clock time, `HH:MM` or `HH:MM:SS`; UTC (and said so)
/// when the local time is not known.
pub fn clock(t: SystemTime, seconds: bool) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let fallback = || {
        let day = secs % 86_400;
        let (h, m, s) = (day / 3600, day / 60 % 60, day % 60);
        if seconds { format!("{h:02}:{m:02}:{s:02} UTC") } else { format!("{h:02}:{m:02} UTC") }
    };
    let Ok(when) = libc::time_t::try_from(secs) else { return fallback() };
    // SAFETY: an all-zero `tm` is a valid value of a plain C struct.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r (unlike
    // localtime) writes only into `tm`.
    if unsafe { libc::localtime_r(&when, &mut tm) }.is_null() {
        return fallback();
    }
    if seconds {
        format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
    } else {
        format!("{:02}:{:02}", tm.tm_hour, tm.tm_min)
    }
}

/// `bytes` as B, KiB, MiB, GiB or TiB.
fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

/// A share as a percentage that says "some" and "not all" truthfully.
fn percent(share: f64) -> String {
    match share {
        s if s <= 0.0 => "0%".into(),
        s if s < 0.01 => "<1%".into(),
        s if s >= 1.0 => "100%".into(),
        s if s > 0.99 => ">99%".into(),
        s => format!("{:.0}%", s * 100.0),
    }
}

impl Style {
    /// `text` in red when colours are on and `red` holds.
    fn red(self, text: &str, red: bool) -> String {
        if self.colour && red {
            format!("{RED}{text}{RESET}")
        } else {
            text.to_owned()
        }
    }
}

/// One NIC's verdict as a sentence.
pub fn verdict(nic: &NicFrame) -> String {
    let n = name(&nic.nic);
    match &nic.verdict {
        &Verdict::Staged { since, share, gpu_share } => {
            format!("GPU traffic staged through host memory: {} of bytes on {n} since {} ({} of its GPU bytes)", percent(share), clock(since, false), percent(gpu_share))
        }
        &Verdict::StagedBefore { share, gpu_share } => format!(
            "GPU traffic staged through host memory before this view began: {} of bytes on {n} since the agent started ({} of its GPU bytes), none since",
            percent(share),
            percent(gpu_share)
        ),
        &Verdict::NotStaged { gdr } => format!("no GPU traffic staged on {n}: {} of GPU memory moved by GPUDirect RDMA since the agent started", size(gdr)),
        Verdict::Unread { missing } => format!("cannot tell whether GPU traffic is staged on {n}: the endpoint served no {missing} series"),
        Verdict::NoGpuTraffic if nic.total.iter().flatten().any(|&b| b > 0) => format!("no GPU traffic seen on {n} (host memory only)"),
        Verdict::NoGpuTraffic => format!("no GPU traffic seen on {n}"),
    }
}

fn agent(out: &mut String, a: &AgentFrame, style: Style) {
    let live = a.live.map(|n| format!(": {n} connection(s) live")).unwrap_or_default();
    let _ = writeln!(out, "agent {}{live}", name(&a.name));
    match a.continuity {
        Continuity::Same => {}
        Continuity::Restarted => {
            let _ = writeln!(out, "  {}", style.red("restarted during this interval (its counters went down): figures count from the restart", true));
        }
        Continuity::New => {
            let _ = writeln!(out, "  new since the previous scrape: figures count from its start");
        }
    }
    if a.nics.is_empty() {
        let _ = writeln!(out, "  no NIC listed");
    }
    let w = a.nics.iter().map(|n| name(&n.nic).chars().count()).max().unwrap_or(0).max(3);
    if !a.nics.is_empty() {
        let _ = writeln!(out, "  {:<w$} dir  {:>11} {:>11} {:>11} {:>7}  {:>11} {:>11} {:>12}", "NIC", "gdr MB/s", "host MB/s", "staged MB/s", "staged", "gdr total", "host total", "staged total");
    }
    for nic in &a.nics {
        for (d, dir) in ["out", "in"].iter().enumerate() {
            let r = nic.rates[d];
            let t = nic.total[d];
            let share = nic.staged_share(d).map_or_else(|| "-".to_owned(), percent);
            let moved = nic.interval[d][2] > 0;
            let _ = writeln!(
                out,
                "  {:<w$} {dir:<3}  {:>11.1} {:>11.1} {} {}  {:>11} {:>11} {}",
                name(&nic.nic),
                r[0] / MB,
                r[1] / MB,
                style.red(&format!("{:>11.1}", r[2] / MB), moved),
                style.red(&format!("{share:>7}"), moved),
                size(t[0]),
                size(t[1]),
                style.red(&format!("{:>12}", size(t[2])), t[2] > 0),
            );
        }
    }
    for nic in &a.nics {
        let staged = matches!(nic.verdict, Verdict::Staged { .. } | Verdict::StagedBefore { .. });
        let _ = writeln!(out, "  {}", style.red(&verdict(nic), staged));
    }
    let ops: Vec<String> = a
        .requests
        .iter()
        .filter(|o| !o.outcomes.is_empty())
        .map(|o| {
            let each: Vec<String> = o.outcomes.iter().map(|(what, n)| style.red(&format!("{n} {}", name(what)), what == "failed" || what == "refused")).collect();
            format!("{} {}", name(&o.op), each.join(", "))
        })
        .collect();
    let _ = writeln!(out, "  requests in the interval: {}", if ops.is_empty() { "none".to_owned() } else { ops.join("; ") });
    if !a.refusals.is_empty() {
        let each: Vec<String> = a.refusals.iter().map(|(why, n)| format!("{} +{n}", name(why))).collect();
        let _ = writeln!(out, "  {}", style.red(&format!("refused in the interval: {}", each.join(", ")), true));
    }
}

/// `frame`, scraped from `source`, as text.
pub fn render(frame: &Frame, source: &str, style: Style) -> String {
    let mut out = String::new();
    if style.clear {
        out.push_str(CLEAR);
    }
    let _ = writeln!(out, "gpudirect stats {}  {}  over the last {:.2} s (MB/s: 2^20 bytes a second)", name(source), clock(frame.at, true), frame.elapsed.as_secs_f64());
    if frame.agents.is_empty() {
        let _ = writeln!(out, "no agent served");
    }
    for a in &frame.agents {
        agent(&mut out, a, style);
    }
    for g in &frame.gone {
        let _ = writeln!(out, "agent {} no longer served", name(g));
    }
    out
}
