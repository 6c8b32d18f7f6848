//! What two scrapes of an agent's endpoint say: the typed [`Snapshot`]
//! of one exposition (the families `gpudirect_bytes_total`,
//! `gpudirect_requests_total`, `gpudirect_refusals_total`,
//! `gpudirect_connections`, as the engine's `metrics/text.rs` writes
//! them), and the [`Frame`] between two: bytes by NIC, direction and
//! path over the interval and since the agent started, requests and
//! refusals that grew, and a [`Verdict`] per NIC on whether GPU memory
//! went through host memory. [`Watch`] keeps what a verdict needs across
//! frames: when the view first saw staged bytes grow on a NIC, and the
//! bytes since.
//!
//! A counter never goes down while its agent lives: one that did means
//! the agent restarted, and the frame says so ([`Continuity::Restarted`])
//! and counts from the restart instead of showing a negative rate.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant, SystemTime};

use gpudirect_engine::{DataPath, Direction};

use super::expo::{shown, Exposition, Kind, Sample};

/// Bytes indexed `[direction][path]`, in the orders of
/// [`Direction::ALL`] and [`DataPath::ALL`].
pub type Bytes = [[u64; 3]; 2];

/// The family every agent's endpoint serves; an exposition without it is
/// not an agent's.
pub const BYTES: &str = "gpudirect_bytes_total";
const REQUESTS: &str = "gpudirect_requests_total";
const REFUSALS: &str = "gpudirect_refusals_total";
const CONNECTIONS: &str = "gpudirect_connections";
const UPTIME: &str = "gpudirect_uptime_seconds";
/// A request's outcomes in the order they happen (others after them).
const OUTCOMES: [&str; 4] = ["posted", "completed", "failed", "refused"];

/// Why an exposition is not an agent's metrics as the view reads them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ViewError {
    /// No `gpudirect_bytes_total` counter declared.
    #[error("no {BYTES} counter: not a gpudirect agent's metrics endpoint")]
    NotAnAgent,
    /// A sample without a label its family has.
    #[error("line {line}: {family} without its {label} label")]
    MissingLabel {
        /// The family.
        family: &'static str,
        /// The label.
        label: &'static str,
        /// The sample's line.
        line: usize,
    },
    /// A label value the view does not know (a direction or path).
    #[error("line {line}: {family} with {label}={value}, which this view does not know")]
    UnknownValue {
        /// The family.
        family: &'static str,
        /// The label.
        label: &'static str,
        /// Its value (escaped).
        value: String,
        /// The sample's line.
        line: usize,
    },
    /// A count that is not a whole number.
    #[error("line {line}: {family}'s value is not a whole number")]
    NotACount {
        /// The family.
        family: &'static str,
        /// The sample's line.
        line: usize,
    },
    /// Two samples for one agent, NIC, direction and path (or op and
    /// outcome, ...), told apart only by labels the view does not read.
    #[error("line {line}: {family} repeats a series of line {first} (labels this view does not read?)")]
    Repeated {
        /// The family.
        family: &'static str,
        /// The later sample's line.
        line: usize,
        /// The earlier one's.
        first: usize,
    },
}

/// One agent's counters in one scrape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AgentCounters {
    /// Bytes by NIC.
    pub nics: BTreeMap<String, Bytes>,
    /// Per NIC, the (direction, path) series the endpoint did not serve
    /// (read as 0 above, and judged by none).
    pub unserved: BTreeMap<String, Vec<(usize, usize)>>,
    /// Requests by (op, outcome).
    pub requests: BTreeMap<(String, String), u64>,
    /// Refusals by reason.
    pub refusals: BTreeMap<String, u64>,
    /// Connections by state (a gauge).
    pub connections: BTreeMap<String, u64>,
    /// How long the agent had run at its snapshot, in microseconds (an
    /// endpoint may answer two scrapes with one snapshot, so rates divide
    /// by this, when given, rather than by the scrapes' spacing).
    pub uptime_us: Option<u64>,
}

/// One scrape, read: every agent's counters, and when it was taken.
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// By agent name.
    pub agents: BTreeMap<String, AgentCounters>,
    /// When the answer came (for rates).
    pub at: Instant,
    /// The same moment on the wall clock (for what is shown).
    pub wall: SystemTime,
}

fn label<'a>(s: &'a Sample, family: &'static str, label: &'static str) -> Result<&'a str, ViewError> {
    s.label(label).ok_or(ViewError::MissingLabel { family, label, line: s.line })
}

fn count(s: &Sample, family: &'static str) -> Result<u64, ViewError> {
    s.count.ok_or(ViewError::NotACount { family, line: s.line })
}

/// Puts `v` at `key`, refusing a key already filled.
fn put<K: Ord>(map: &mut BTreeMap<K, (u64, usize)>, key: K, v: u64, family: &'static str, line: usize) -> Result<(), ViewError> {
    match map.insert(key, (v, line)) {
        Some((_, first)) => Err(ViewError::Repeated { family, line, first }),
        None => Ok(()),
    }
}

fn values<K: Ord>(m: BTreeMap<K, (u64, usize)>) -> BTreeMap<K, u64> {
    m.into_iter().map(|(k, (v, _))| (k, v)).collect()
}

impl Snapshot {
    /// Reads the families the view needs from `e`, taken at `at`/`wall`.
    ///
    /// # Errors
    /// [`ViewError`]: not an agent's endpoint, a sample without its labels,
    /// an unknown direction or path, a count not whole, a series repeated.
    pub fn read(e: &Exposition, at: Instant, wall: SystemTime) -> Result<Snapshot, ViewError> {
        if e.types.get(BYTES) != Some(&Kind::Counter) {
            return Err(ViewError::NotAnAgent);
        }
        let mut bytes: BTreeMap<(String, String, usize, usize), (u64, usize)> = BTreeMap::new();
        let mut requests = BTreeMap::new();
        let mut refusals = BTreeMap::new();
        let mut connections = BTreeMap::new();
        let mut uptimes = BTreeMap::new();
        let mut names = BTreeSet::new();
        for s in &e.samples {
            match s.name.as_str() {
                BYTES => {
                    let (agent, nic) = (label(s, BYTES, "agent")?, label(s, BYTES, "nic")?);
                    let d = label(s, BYTES, "direction")?;
                    let d = Direction::ALL.iter().position(|x| x.as_str() == d).ok_or_else(|| ViewError::UnknownValue { family: BYTES, label: "direction", value: shown(d), line: s.line })?;
                    let p = label(s, BYTES, "path")?;
                    let p = DataPath::ALL.iter().position(|x| x.as_str() == p).ok_or_else(|| ViewError::UnknownValue { family: BYTES, label: "path", value: shown(p), line: s.line })?;
                    names.insert(agent.to_owned());
                    put(&mut bytes, (agent.to_owned(), nic.to_owned(), d, p), count(s, BYTES)?, BYTES, s.line)?;
                }
                REQUESTS => {
                    let key = (label(s, REQUESTS, "agent")?.to_owned(), label(s, REQUESTS, "op")?.to_owned(), label(s, REQUESTS, "outcome")?.to_owned());
                    names.insert(key.0.clone());
                    put(&mut requests, key, count(s, REQUESTS)?, REQUESTS, s.line)?;
                }
                REFUSALS => {
                    let key = (label(s, REFUSALS, "agent")?.to_owned(), label(s, REFUSALS, "reason")?.to_owned());
                    names.insert(key.0.clone());
                    put(&mut refusals, key, count(s, REFUSALS)?, REFUSALS, s.line)?;
                }
                CONNECTIONS => {
                    let key = (label(s, CONNECTIONS, "agent")?.to_owned(), label(s, CONNECTIONS, "state")?.to_owned());
                    names.insert(key.0.clone());
                    put(&mut connections, key, count(s, CONNECTIONS)?, CONNECTIONS, s.line)?;
                }
                UPTIME => {
                    let agent = label(s, UPTIME, "agent")?.to_owned();
                    if !(0.0..1e12).contains(&s.value) {
                        return Err(ViewError::NotACount { family: UPTIME, line: s.line });
                    }
                    names.insert(agent.clone());
                    put(&mut uptimes, agent, (s.value * 1e6) as u64, UPTIME, s.line)?;
                }
                _ => {}
            }
        }
        let mut agents: BTreeMap<String, AgentCounters> = names.into_iter().map(|n| (n, AgentCounters::default())).collect();
        let mut served: BTreeMap<(String, String), [[bool; 3]; 2]> = BTreeMap::new();
        for ((agent, nic, d, p), v) in values(bytes) {
            served.entry((agent.clone(), nic.clone())).or_default()[d][p] = true;
            if let Some(a) = agents.get_mut(&agent) {
                a.nics.entry(nic).or_default()[d][p] = v;
            }
        }
        for ((agent, nic), cells) in served {
            let missing: Vec<(usize, usize)> = (0..2).flat_map(|d| (0..3).map(move |p| (d, p))).filter(|&(d, p)| !cells[d][p]).collect();
            if let (Some(a), false) = (agents.get_mut(&agent), missing.is_empty()) {
                a.unserved.insert(nic, missing);
            }
        }
        for ((agent, op, outcome), v) in values(requests) {
            if let Some(a) = agents.get_mut(&agent) {
                a.requests.insert((op, outcome), v);
            }
        }
        for ((agent, reason), v) in values(refusals) {
            if let Some(a) = agents.get_mut(&agent) {
                a.refusals.insert(reason, v);
            }
        }
        for ((agent, state), v) in values(connections) {
            if let Some(a) = agents.get_mut(&agent) {
                a.connections.insert(state, v);
            }
        }
        for (agent, v) in values(uptimes) {
            if let Some(a) = agents.get_mut(&agent) {
                a.uptime_us = Some(v);
            }
        }
        Ok(Snapshot { agents, at, wall })
    }
}

/// Whether an agent's counters go on from the previous scrape's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Continuity {
    /// The same agent, counting on.
    Same,
    /// A counter went down: the agent restarted during the interval, and
    /// the interval's figures count from its restart.
    Restarted,
    /// Not in the previous scrape: its figures count from zero.
    New,
}

/// What a NIC's bytes say about GPUDirect RDMA.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Staged bytes grew while watched: GPU memory went through host
    /// memory.
    Staged {
        /// When the view first saw them grow.
        since: SystemTime,
        /// Staged bytes' share of every byte on the NIC since then (0 to 1).
        share: f64,
        /// Their share of the GPU's bytes (gdr and staged) since then.
        gpu_share: f64,
    },
    /// Staged bytes before the view began, none while watched.
    StagedBefore {
        /// Staged bytes' share of every byte since the agent started.
        share: f64,
        /// Their share of the GPU's bytes.
        gpu_share: f64,
    },
    /// GPU bytes moved, by GPUDirect RDMA only.
    NotStaged {
        /// Bytes moved by GPUDirect RDMA since the agent started.
        gdr: u64,
    },
    /// No GPU memory moved through this NIC (host memory only, or
    /// nothing): nothing to say about GPUDirect RDMA.
    NoGpuTraffic,
    /// The endpoint did not serve every direction and path of this NIC
    /// (`missing`, as `direction/path`): no verdict rests on a figure
    /// never read.
    Unread {
        /// The series not served.
        missing: String,
    },
}

/// One NIC's line of a frame.
#[derive(Clone, Debug, PartialEq)]
pub struct NicFrame {
    /// The RDMA device.
    pub nic: String,
    /// Bytes moved during the interval.
    pub interval: Bytes,
    /// Bytes a second over the interval.
    pub rates: [[f64; 3]; 2],
    /// Bytes since the agent started.
    pub total: Bytes,
    /// The NIC's verdict.
    pub verdict: Verdict,
}

impl NicFrame {
    /// Staged bytes' share of the bytes that went `direction` during the
    /// interval; `None` when none did.
    pub fn staged_share(&self, direction: usize) -> Option<f64> {
        let row = self.interval.get(direction)?;
        let all: u64 = row.iter().sum();
        (all > 0).then(|| row[2] as f64 / all as f64)
    }
}

/// One op's requests during the interval.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpRequests {
    /// `write` or `read`.
    pub op: String,
    /// Outcomes that grew, and by how much: `posted`, `completed`,
    /// `failed`, `refused` in that order, then any other.
    pub outcomes: Vec<(String, u64)>,
}

/// One agent in a frame.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentFrame {
    /// The agent's name.
    pub name: String,
    /// Whether its counters went on from the previous scrape's.
    pub continuity: Continuity,
    /// Its NICs, by name.
    pub nics: Vec<NicFrame>,
    /// Requests during the interval, by op.
    pub requests: Vec<OpRequests>,
    /// Refusals that grew during the interval: reason and how many.
    pub refusals: Vec<(String, u64)>,
    /// Connections alive now (the `live` state), when served.
    pub live: Option<u64>,
}

/// What the last interval showed.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// When the later scrape was taken.
    pub at: SystemTime,
    /// Time between the two scrapes.
    pub elapsed: Duration,
    /// Every agent the later scrape served.
    pub agents: Vec<AgentFrame>,
    /// Agents the earlier scrape served and the later one does not.
    pub gone: Vec<String>,
}

/// How far each counter of `cur` went since `prev`; `None` when one went
/// down (a restart).
fn grew<K: Ord + Clone>(prev: &BTreeMap<K, u64>, cur: &BTreeMap<K, u64>) -> Option<BTreeMap<K, u64>> {
    cur.iter().map(|(k, &v)| v.checked_sub(prev.get(k).copied().unwrap_or(0)).map(|d| (k.clone(), d))).collect()
}

fn bytes_grew(prev: &BTreeMap<String, Bytes>, cur: &BTreeMap<String, Bytes>) -> Option<BTreeMap<String, Bytes>> {
    let mut out = BTreeMap::new();
    for (nic, now) in cur {
        let before = prev.get(nic).copied().unwrap_or_default();
        let mut d = Bytes::default();
        for (dir, row) in d.iter_mut().enumerate() {
            for (path, cell) in row.iter_mut().enumerate() {
                *cell = now[dir][path].checked_sub(before[dir][path])?;
            }
        }
        out.insert(nic.clone(), d);
    }
    Some(out)
}

/// The interval's growth of an agent's counters (connections, a gauge,
/// left out), and whether they went on: counted from zero when the agent
/// restarted or is new.
fn interval(prev: Option<&AgentCounters>, cur: &AgentCounters) -> (Continuity, AgentCounters) {
    let since = |p: &AgentCounters| {
        if p.uptime_us.zip(cur.uptime_us).is_some_and(|(p, c)| c < p) {
            return None;
        }
        Some(AgentCounters {
            nics: bytes_grew(&p.nics, &cur.nics)?,
            requests: grew(&p.requests, &cur.requests)?,
            refusals: grew(&p.refusals, &cur.refusals)?,
            connections: BTreeMap::new(),
            unserved: BTreeMap::new(),
            uptime_us: None,
        })
    };
    let zero = AgentCounters::default();
    match prev.map(since) {
        Some(Some(growth)) => (Continuity::Same, growth),
        // From zero nothing goes down.
        Some(None) => (Continuity::Restarted, since(&zero).unwrap_or_default()),
        None => (Continuity::New, since(&zero).unwrap_or_default()),
    }
}

fn sum(b: &Bytes, path: usize) -> u64 {
    b.iter().map(|row| row[path]).fold(0, u64::saturating_add)
}

/// Staged bytes' share of all bytes, and of the GPU's (gdr and staged).
fn shares(b: &Bytes) -> (f64, f64) {
    let (gdr, host, staged) = (sum(b, 0), sum(b, 1), sum(b, 2));
    let all = gdr.saturating_add(host).saturating_add(staged);
    let ratio = |n: u64, d: u64| if d == 0 { 0.0 } else { n as f64 / d as f64 };
    (ratio(staged, all), ratio(staged, gdr.saturating_add(staged)))
}

/// Bytes on a NIC since the view first saw its staged bytes grow.
#[derive(Clone, Debug)]
struct Window {
    since: SystemTime,
    bytes: Bytes,
}

/// The view across scrapes: the previous snapshot, and per agent and NIC
/// when staged bytes were first seen to grow.
#[derive(Debug, Default)]
pub struct Watch {
    prev: Option<Snapshot>,
    windows: HashMap<(String, String), Window>,
}

impl Watch {
    /// A view that has seen nothing.
    pub fn new() -> Watch {
        Watch::default()
    }

    /// Takes a snapshot in; the frame between it and the previous one,
    /// from the second on.
    pub fn push(&mut self, cur: Snapshot) -> Option<Frame> {
        let prev = self.prev.replace(cur)?;
        let cur = self.prev.as_ref()?;
        let elapsed = cur.at.saturating_duration_since(prev.at);
        let secs = elapsed.as_secs_f64();
        let mut agents = Vec::new();
        for (name, counters) in &cur.agents {
            let (continuity, growth) = interval(prev.agents.get(name), counters);
            // The agent's own clock between its two snapshots, when it
            // gives one and went on; else the scrapes' spacing.
            let own = prev.agents.get(name).and_then(|p| p.uptime_us).zip(counters.uptime_us).filter(|_| continuity == Continuity::Same);
            let secs = own.map_or(secs, |(p, c)| c.saturating_sub(p) as f64 * 1e-6);
            let mut nics = Vec::new();
            for (nic, total) in &counters.nics {
                let moved = growth.nics.get(nic).copied().unwrap_or_default();
                let rates = moved.map(|row| row.map(|b| if secs > 0.0 { b as f64 / secs } else { 0.0 }));
                let key = (name.clone(), nic.clone());
                if sum(&moved, 2) > 0 && !self.windows.contains_key(&key) {
                    self.windows.insert(key.clone(), Window { since: cur.wall, bytes: Bytes::default() });
                }
                let verdict = match self.windows.get_mut(&key) {
                    Some(w) => {
                        for (acc, row) in w.bytes.iter_mut().zip(moved) {
                            for (a, b) in acc.iter_mut().zip(row) {
                                *a = a.saturating_add(b);
                            }
                        }
                        let (share, gpu_share) = shares(&w.bytes);
                        Verdict::Staged { since: w.since, share, gpu_share }
                    }
                    None if sum(total, 2) > 0 => {
                        let (share, gpu_share) = shares(total);
                        Verdict::StagedBefore { share, gpu_share }
                    }
                    // Staged bytes seen are evidence whatever else is
                    // missing; their absence is only where every series
                    // was served.
                    None if counters.unserved.contains_key(nic) => {
                        let missing = counters.unserved[nic].iter().map(|&(d, p)| format!("{}/{}", Direction::ALL[d].as_str(), DataPath::ALL[p].as_str())).collect::<Vec<_>>().join(", ");
                        Verdict::Unread { missing }
                    }
                    None if sum(total, 0) > 0 => Verdict::NotStaged { gdr: sum(total, 0) },
                    None => Verdict::NoGpuTraffic,
                };
                nics.push(NicFrame { nic: nic.clone(), interval: moved, rates, total: *total, verdict });
            }
            let mut by_op: BTreeMap<String, Vec<(String, u64)>> = BTreeMap::new();
            for ((op, outcome), n) in growth.requests {
                let outcomes = by_op.entry(op).or_default();
                if n > 0 {
                    outcomes.push((outcome, n));
                }
            }
            for outcomes in by_op.values_mut() {
                outcomes.sort_by_key(|(o, _)| (OUTCOMES.iter().position(|k| k == o).unwrap_or(OUTCOMES.len()), o.clone()));
            }
            agents.push(AgentFrame {
                name: name.clone(),
                continuity,
                nics,
                requests: by_op.into_iter().map(|(op, outcomes)| OpRequests { op, outcomes }).collect(),
                refusals: growth.refusals.into_iter().filter(|&(_, n)| n > 0).collect(),
                live: counters.connections.get("live").copied(),
            });
        }
        let gone = prev.agents.keys().filter(|a| !cur.agents.contains_key(*a)).cloned().collect();
        Some(Frame { at: cur.wall, elapsed, agents, gone })
    }
}

#[cfg(test)]
#[path = "view_tests.rs"]
mod tests;
