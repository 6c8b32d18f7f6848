//! `gpudirect fleet`: the job's GPUDirect RDMA verdict across every node
//! of its allocation, before launch.
//!
//! GPUDirect RDMA is lost one node at a time (a peer-memory module that did
//! not load after a driver update, a pod without the SR-IOV network, one
//! rank's `NCCL_IB_DISABLE`), and a job runs at the speed of its worst
//! node. Each node posts its capture (`gpudirect fleet post --job ID`,
//! the doctor's `--capture` under the node's name) to where they meet: a
//! folder all nodes share, the project's rendezvous server or etcd, the
//! last two proven with the cluster's secret ([`Collection`]);
//! `gpudirect fleet check --job ID` judges every capture
//! with the doctor's own judge, in each node's own environment, and says
//! together:
//! - the verdict for the job: whether every node will use GPUDirect RDMA;
//! - the nodes that will not, grouped by cause (the checks that failed,
//!   with the fix), their names folded (`node[003-007,019]`): one cause on
//!   40 nodes is one line;
//! - what sets nodes apart from the majority even where the verdict holds
//!   (driver versions, peer memory, NCCL variables, NIC choice...): every
//!   check whose outcome on some nodes differs from the most common one;
//! - what every node shares that is wrong (the same bad variable
//!   everywhere): checks that warn or fail on all of them.
//!
//! It exits 1 when any node would stage (or a capture is missing or
//! unreadable), 3 when a node's verdict is left open by its job file, 0
//! when every node uses GPUDirect RDMA: a gate a launcher can run first.
//! `--wait SECS --expect N` waits for N captures to arrive.
//!
//! Bounds: at most [`MAX_NODES`] captures, each read up to the doctor's
//! capture limit; node names are the capture files' names, refused unless
//! made of letters, digits, `-`, `_` and `.`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::doctor::report::{Options, Report};
use crate::doctor::capture::Capture;
use crate::doctor::sources::{judge_capture, judge_this_machine_recording};
use crate::doctor::Status;

mod collect;
mod folder;
mod names;
mod request;

pub use collect::{Collection, Posted};
pub use names::{expand_hostlist, fold_names, MAX_NODES};
pub use request::{CheckArgs, CheckRequest, Place, PostArgs, PostRequest};
use names::natural;

/// The JSON layout's version (`schema`), raised only when a field changes meaning.
pub const SCHEMA_VERSION: u32 = 1;

/// The fleet's verdict and what it rests on (the `--json` output).
#[derive(Clone, Debug, Serialize)]
pub struct FleetReport {
    /// [`SCHEMA_VERSION`].
    pub schema: u32,
    /// The job id checked (the directory's subfolder), if any.
    pub job: Option<String>,
    /// Nodes judged.
    pub nodes: usize,
    /// Every node will use GPUDirect RDMA.
    pub available_everywhere: bool,
    /// The sentence printed first.
    pub line: String,
    /// Nodes that will not use it, grouped by cause.
    pub staging: Vec<Group>,
    /// Nodes whose verdict their job file leaves open (unsettled variables).
    pub open: Vec<Group>,
    /// Among the nodes that will use GPUDirect RDMA: checks whose outcome
    /// on some of them differs from the majority's.
    pub differences: Vec<Difference>,
    /// Checks that warn or fail on every node.
    pub shared: Vec<Shared>,
    /// Captures that could not be judged, with why.
    pub unreadable: Vec<Unreadable>,
    /// Nodes expected (`--expect`, `--nodes`) that sent no capture.
    pub missing: usize,
    /// Their names, when the nodes were named (`--nodes`).
    pub missing_nodes: Vec<String>,
    /// Nodes that posted but are not among those named (`--nodes`): not
    /// judged, and the gate stays shut.
    pub unexpected: Vec<String>,
    /// Captures beyond the number expected (`--expect N`): which is stray
    /// cannot be told without names, so the gate stays shut.
    pub surplus: usize,
    /// Nodes x the checks that matter, for [`svg`](Self::svg); not in the JSON.
    #[serde(skip)]
    pub grid: Grid,
}

/// Each node's outcome of each check that is not ok somewhere or not the
/// same everywhere (the picture's columns).
#[derive(Clone, Debug, Default)]
pub struct Grid {
    /// Row names, in natural order.
    pub nodes: Vec<String>,
    /// Column names (`area.check`).
    pub checks: Vec<String>,
    /// `cells[row][column]`: the node's outcome, `None` when it did not report the check.
    pub cells: Vec<Vec<Option<Status>>>,
    /// Rows whose node will not use GPUDirect RDMA.
    pub staging: Vec<bool>,
}

/// Nodes sharing one cause.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Group {
    /// What stands in the way: the failing checks' summaries (the first
    /// node's wording), or the verdict line where no check failed.
    pub cause: String,
    /// The checks that failed (`area.check`).
    pub checks: Vec<String>,
    /// What to do.
    pub fix: Option<String>,
    /// How many nodes.
    pub count: usize,
    /// Their names, folded (`node[003-007,019]`).
    pub folded: String,
    /// Their names.
    pub names: Vec<String>,
}

/// One check whose outcome differs on some nodes.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Difference {
    /// The check (`area.check`).
    pub check: String,
    /// The majority's outcome (`ok: summary`) and how many nodes have it.
    pub majority: String,
    /// How many nodes share the majority's outcome.
    pub majority_count: usize,
    /// The other outcomes, each with its nodes.
    pub others: Vec<Group>,
}

/// A check that warns or fails on every node.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Shared {
    /// The check.
    pub check: String,
    /// `warn` or `fail`.
    pub status: Status,
    /// The first node's summary.
    pub summary: String,
    /// What to do.
    pub fix: Option<String>,
}

/// A capture that could not be judged.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Unreadable {
    /// The file.
    pub file: String,
    /// Why.
    pub error: String,
}

impl FleetReport {
    /// 0 every node uses GPUDirect RDMA; 1 a node would stage, a capture
    /// is missing, unreadable or more than expected, or there is none at all (an empty fleet
    /// proves nothing, so the gate stays shut); 3 only open verdicts stand
    /// in the way.
    pub fn exit_status(&self) -> u8 {
        if !self.staging.is_empty() || !self.unreadable.is_empty() || self.missing > 0 || !self.unexpected.is_empty() || self.surplus > 0 || self.nodes == 0 {
            1
        } else if !self.open.is_empty() {
            3
        } else {
            0
        }
    }
}

/// This node's name: the kernel's host name.
pub fn this_node() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname").ok().map(|h| h.trim().to_owned()).filter(|h| valid_name(h))
}

/// Posts this node's capture under `job` as `node` (default: the host
/// name) to `to`, and returns where it went and this node's own report.
/// Without `from`, this machine is judged and captured in this process's
/// environment (the job's, when run from the job's launcher); with it,
/// that capture file is judged and posted as it is.
///
/// # Errors
/// A bad job or node name, a capture that cannot be read, the doctor's
/// error, or the collection's refusal.
pub fn post(to: &Collection, job: &str, node: Option<&str>, from: Option<&Path>) -> Result<(String, Report), String> {
    let node = match node {
        Some(n) if valid_name(n) => n.to_owned(),
        Some(n) => return Err(format!("node name {n:?}: use letters, digits, '-', '_' and '.' only")),
        None => this_node().ok_or("cannot tell this node's name from /proc/sys/kernel/hostname: pass --node")?,
    };
    if !valid_name(job) {
        return Err(format!("job id {job:?}: use letters, digits, '-', '_' and '.' only"));
    }
    let (text, report) = match from {
        Some(path) => {
            let text = crate::doctor::input::read_text(path, "capture", crate::doctor::input::CAPTURE_LIMIT).map_err(|e| e.to_string())?;
            let c = Capture::parse(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
            let report = judge_capture(c, &Options::default())?;
            (text, report)
        }
        None => {
            let (report, capture) = judge_this_machine_recording(&Options::default())?;
            (capture.to_text(), report)
        }
    };
    Ok((to.post(job, &node, &text)?, report))
}

/// What the fleet keeps of one node's report: its verdict and its
/// findings, each finding shared with every node that found the same.
#[derive(Debug)]
pub struct Node {
    /// The verdict's parts the fleet reads.
    pub verdict: NodeVerdict,
    /// Every finding, in check order.
    pub findings: Vec<Arc<Fact>>,
}

/// A node's verdict, as the fleet reads it.
#[derive(Debug)]
pub struct NodeVerdict {
    /// GPUDirect RDMA will be used.
    pub available: bool,
    /// Deciding variables left to the running job.
    pub unsettled: Vec<String>,
    /// The verdict sentence.
    pub line: Arc<str>,
}

/// One finding, as shared between nodes.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Fact {
    /// `area.check`.
    pub check: String,
    /// Outcome.
    pub status: Status,
    /// What was found.
    pub summary: String,
    /// What to do.
    pub fix: Option<String>,
}

/// One copy of each distinct finding and verdict line.
#[derive(Default)]
struct Interner {
    facts: HashMap<Arc<Fact>, ()>,
    lines: HashMap<Arc<str>, ()>,
}

impl Interner {
    fn node(&mut self, r: &Report) -> Node {
        let findings = r
            .findings
            .iter()
            .map(|f| {
                let fact = Fact { check: f.check.clone(), status: f.status, summary: f.summary.clone(), fix: f.fix.clone() };
                match self.facts.get_key_value(&fact) {
                    Some((k, ())) => Arc::clone(k),
                    None => {
                        let k = Arc::new(fact);
                        self.facts.insert(Arc::clone(&k), ());
                        k
                    }
                }
            })
            .collect();
        let line = match self.lines.get_key_value(r.verdict.line.as_str()) {
            Some((k, ())) => Arc::clone(k),
            None => {
                let k: Arc<str> = Arc::from(r.verdict.line.as_str());
                self.lines.insert(Arc::clone(&k), ());
                k
            }
        };
        Node { verdict: NodeVerdict { available: r.verdict.available, unsettled: r.verdict.unsettled.clone(), line }, findings }
    }
}

/// Where a job's captures live: `DIR/JOB/` (or `DIR/` without a job).
pub fn job_dir(dir: &Path, job: Option<&str>) -> Result<PathBuf, String> {
    match job {
        None => Ok(dir.to_path_buf()),
        Some(j) if valid_name(j) => Ok(dir.join(j)),
        Some(j) => Err(format!("job id {j:?}: use letters, digits, '-', '_' and '.' only")),
    }
}

/// Whether a node or job name is one this tool writes and reads (the
/// engine's rule for postings, so a name that fits a folder fits a board).
pub fn valid_name(s: &str) -> bool {
    gpudirect_engine::posting_name_ok(s)
}

/// Which nodes the check expects to have posted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expect {
    /// This many (`--expect N`): fewer captures fail the check.
    Count(usize),
    /// These names (`--nodes LIST`, the allocation's host list): each one
    /// missing is named, and a capture from a node not in it shuts the
    /// gate (a stray or impostor posting cannot stand in for a node).
    Names(Vec<String>),
}

impl Expect {
    /// How many nodes are expected.
    pub fn count(&self) -> usize {
        match self {
            Expect::Count(n) => *n,
            Expect::Names(v) => v.len(),
        }
    }
}

/// Who was expected and did not post, and who posted unexpected.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Attendance {
    /// Nodes expected that sent no capture.
    pub missing: usize,
    /// Their names, when the nodes were named.
    pub missing_nodes: Vec<String>,
    /// Nodes that posted but are not in the names expected (not judged).
    pub unexpected: Vec<String>,
    /// Captures beyond the number expected.
    pub surplus: usize,
}

/// Judges every capture posted under `job` in `from`.
///
/// # Errors
/// When the job cannot be listed.
pub fn check(from: &Collection, job: Option<&str>, expect: Option<&Expect>) -> Result<FleetReport, String> {
    check_since(from, job, expect, None)
}

/// [`check`], where a capture posted before `since` (the job's start, by
/// the time the place vouches for: the rendezvous server's clock, the
/// time sealed with it in etcd, a file's modification time) is reported
/// unreadable, not judged: a capture of an earlier run of the same job
/// id cannot stand in for this run's.
///
/// # Errors
/// When the job cannot be listed.
pub fn check_since(from: &Collection, job: Option<&str>, expect: Option<&Expect>, since: Option<std::time::SystemTime>) -> Result<FleetReport, String> {
    let named: Option<HashSet<&str>> = match expect {
        Some(Expect::Names(v)) => Some(v.iter().map(String::as_str).collect()),
        _ => None,
    };
    let mut seen: HashSet<String> = HashSet::new();
    let mut unexpected = Vec::new();
    let mut reports: Vec<(String, Arc<Node>)> = Vec::new();
    let mut unreadable = Vec::new();
    // Nodes built alike write the same bytes: each distinct capture is
    // judged once (by its contents' digest), however many nodes sent it;
    // and what a judgement found is kept once (interned), however many
    // nodes found it, so memory follows the distinct facts, not nodes x facts.
    let mut judged: HashMap<[u8; 32], Result<Arc<Node>, String>> = HashMap::new();
    let mut facts = Interner::default();
    let refused = from.for_each(job, since, named.as_ref(), |p| {
        if named.as_ref().is_some_and(|n| !n.contains(p.node.as_str())) {
            return unexpected.push(p.node);
        }
        seen.insert(p.node.clone());
        let text = match p.text {
            Ok(text) => text,
            Err(error) => return unreadable.push(Unreadable { file: p.place, error }),
        };
        // Read once: digested, and parsed from the same text when new.
        let digest: [u8; 32] = <Sha256 as Digest>::digest(text.as_bytes()).into();
        let result = judged.entry(digest).or_insert_with(|| {
            let c = Capture::parse(&text, &p.place).map_err(|e| e.to_string())?;
            let r = judge_capture(c, &Options::default())?;
            // A capture that does not show what the verdict needs (its
            // sysfs, the plugin's library) cannot be judged, only refused.
            let unseen: Vec<String> = r.verdict.open.iter().filter(|u| u.variable().is_none()).map(ToString::to_string).collect();
            if !unseen.is_empty() {
                return Err(format!("the capture does not show what the verdict rests on: {}", unseen.join("; ")));
            }
            Ok(Arc::new(facts.node(&r)))
        });
        match result {
            Ok(r) => reports.push((p.node, Arc::clone(r))),
            Err(e) => unreadable.push(Unreadable { file: p.place, error: e.clone() }),
        }
    })?;
    unreadable.extend(refused);
    let attendance = match expect {
        Some(Expect::Names(v)) => {
            let missing_nodes: Vec<String> = v.iter().filter(|n| !seen.contains(n.as_str())).cloned().collect();
            Attendance { missing: missing_nodes.len(), missing_nodes, unexpected, surplus: 0 }
        }
        Some(Expect::Count(n)) => {
            let posted = reports.len() + unreadable.len();
            Attendance { missing: n.saturating_sub(posted), surplus: posted.saturating_sub(*n), ..Attendance::default() }
        }
        None => Attendance::default(),
    };
    Ok(summarise(job, &reports, unreadable, attendance))
}

/// The fleet's report from every node's report.
pub fn summarise(job: Option<&str>, reports: &[(String, Arc<Node>)], unreadable: Vec<Unreadable>, attendance: Attendance) -> FleetReport {
    let Attendance { missing, missing_nodes, unexpected, surplus } = attendance;
    let mut staging: BTreeMap<Vec<String>, Vec<&(String, Arc<Node>)>> = BTreeMap::new();
    let mut open: BTreeMap<Vec<String>, Vec<&(String, Arc<Node>)>> = BTreeMap::new();
    for nr in reports {
        let r = &nr.1;
        if r.verdict.available {
            continue;
        }
        if !r.verdict.unsettled.is_empty() {
            open.entry(r.verdict.unsettled.clone()).or_default().push(nr);
            continue;
        }
        let failing: Vec<String> = r.findings.iter().filter(|f| f.status == Status::Fail).map(|f| f.check.clone()).collect();
        let key = if failing.is_empty() { vec![format!("verdict: {}", r.verdict.line)] } else { failing };
        staging.entry(key).or_default().push(nr);
    }
    let staging: Vec<Group> = staging.into_iter().map(|(checks, nodes)| cause_group(checks, &nodes)).collect();
    let open: Vec<Group> = open
        .into_iter()
        .map(|(vars, nodes)| {
            let names: Vec<String> = nodes.iter().map(|n| n.0.clone()).collect();
            Group {
                cause: format!("left to the running job: {}", vars.join(", ")),
                checks: vec![],
                fix: Some("settle these variables in the job file, or check the running ranks (`gpudirect doctor --pid`)".into()),
                count: names.len(),
                folded: fold_names(&names),
                names,
            }
        })
        .collect();
    // What sets nodes apart is asked of the nodes whose verdict holds (the
    // others are named above, with their cause); what is wrong everywhere,
    // of every node.
    let holding: Vec<(String, Arc<Node>)> = reports.iter().filter(|(_, r)| r.verdict.available).cloned().collect();
    let differences = differences(&holding);
    let shared = shared(reports);
    let grid = grid(reports, &staging, &differences, &shared);
    let bad = staging.iter().map(|g| g.count).sum::<usize>();
    let n = reports.len();
    let all_well = n > 0 && bad == 0 && open.is_empty() && unreadable.is_empty() && missing == 0 && unexpected.is_empty() && surplus == 0;
    let line = if n == 0 && unreadable.is_empty() && missing == 0 && unexpected.is_empty() {
        "fleet: no captures to judge: nothing shows any node will use GPUDirect RDMA".to_owned()
    } else if all_well {
        format!("fleet: GPUDirect RDMA on all {n} node(s)")
    } else {
        let mut parts = Vec::new();
        if bad > 0 {
            parts.push(format!("{bad} of {n} node(s) will NOT use GPUDirect RDMA ({} cause(s)): the job runs at the speed of its worst node", staging.len()));
        }
        let open_n: usize = open.iter().map(|g| g.count).sum();
        if open_n > 0 {
            parts.push(format!("{open_n} node(s) left open by their job file"));
        }
        if !unreadable.is_empty() {
            parts.push(format!("{} capture(s) unreadable", unreadable.len()));
        }
        if missing > 0 {
            parts.push(format!("{missing} node(s) sent no capture"));
        }
        if !unexpected.is_empty() {
            parts.push(format!("{} capture(s) from nodes not expected", unexpected.len()));
        }
        if surplus > 0 {
            parts.push(format!("{surplus} capture(s) more than expected"));
        }
        format!("fleet: {}", parts.join("; "))
    };
    FleetReport {
        schema: SCHEMA_VERSION,
        job: job.map(str::to_owned),
        nodes: n,
        available_everywhere: n > 0 && all_well,
        line,
        staging,
        open,
        differences,
        shared,
        unreadable,
        missing,
        missing_nodes,
        unexpected,
        surplus,
        grid,
    }
}

/// The picture's rows and columns: every node; every check that fails or
/// warns on some node, or differs between them.
fn grid(reports: &[(String, Arc<Node>)], staging: &[Group], differences: &[Difference], shared: &[Shared]) -> Grid {
    let mut checks: BTreeSet<String> = BTreeSet::new();
    checks.extend(staging.iter().flat_map(|g| g.checks.iter().filter(|c| !c.starts_with("verdict:")).cloned()));
    checks.extend(differences.iter().map(|d| d.check.clone()));
    checks.extend(shared.iter().map(|s| s.check.clone()));
    for (_, r) in reports {
        checks.extend(r.findings.iter().filter(|f| matches!(f.status, Status::Warn | Status::Fail)).map(|f| f.check.clone()));
    }
    let checks: Vec<String> = checks.into_iter().take(MAX_COLUMNS).collect();
    let bad: BTreeSet<&str> = staging.iter().flat_map(|g| g.names.iter().map(String::as_str)).collect();
    let rows = reports.iter().take(MAX_ROWS);
    let cells = rows
        .clone()
        .map(|(_, r)| checks.iter().map(|c| r.findings.iter().find(|f| &f.check == c).map(|f| f.status)).collect())
        .collect();
    Grid {
        nodes: rows.clone().map(|(n, _)| n.clone()).collect(),
        staging: rows.map(|(n, _)| bad.contains(n.as_str())).collect(),
        checks,
        cells,
    }
}

/// The most columns and rows the picture draws.
const MAX_COLUMNS: usize = 200;
const MAX_ROWS: usize = 20_000;

impl FleetReport {
    /// Nodes x checks as an SVG image: a row per node (its name red when it
    /// would stage), a column per check that fails or warns somewhere or
    /// differs between nodes; cells green (ok), amber (warn), red (fail),
    /// grey (skipped), empty (not reported).
    pub fn svg(&self) -> String {
        let g = &self.grid;
        let (cell, left, top) = (12usize, 10 + 7 * g.nodes.iter().map(String::len).max().unwrap_or(4), 10 + 6 * g.checks.iter().map(String::len).max().unwrap_or(4));
        let (w, h) = ((left + cell * g.checks.len() + 10).max(10 + 6 * self.line.len()), top + cell * g.nodes.len() + 30);
        let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;");
        let mut out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"monospace\" font-size=\"10\">\n<title>{}</title>\n",
            esc(&self.line)
        );
        for (j, c) in g.checks.iter().enumerate() {
            let x = left + j * cell + cell / 2 + 3;
            out.push_str(&format!("<text x=\"{x}\" y=\"{}\" transform=\"rotate(-90 {x} {})\">{}</text>\n", top - 4, top - 4, esc(c)));
        }
        for (i, n) in g.nodes.iter().enumerate() {
            let y = top + i * cell;
            let fill = if g.staging[i] { "#c0392b" } else { "#222" };
            out.push_str(&format!("<text x=\"4\" y=\"{}\" fill=\"{fill}\">{}</text>\n", y + cell - 3, esc(n)));
            for (j, st) in g.cells[i].iter().enumerate() {
                let color = match st {
                    Some(Status::Ok) => "#2ecc71",
                    Some(Status::Warn) => "#f39c12",
                    Some(Status::Fail) => "#e74c3c",
                    Some(Status::Skipped) => "#bdc3c7",
                    None => "#ffffff",
                };
                out.push_str(&format!(
                    "<rect x=\"{}\" y=\"{y}\" width=\"{}\" height=\"{}\" fill=\"{color}\" stroke=\"#eee\"><title>{} {}: {}</title></rect>\n",
                    left + j * cell,
                    cell - 1,
                    cell - 1,
                    esc(n),
                    esc(&g.checks[j]),
                    st.map_or("not reported".to_owned(), |s| s.to_string())
                ));
            }
        }
        out.push_str(&format!("<text x=\"4\" y=\"{}\">{}</text>\n</svg>\n", h - 10, esc(&self.line)));
        out
    }
}

fn cause_group(checks: Vec<String>, nodes: &[&(String, Arc<Node>)]) -> Group {
    let first = &nodes[0].1;
    let failing: Vec<_> = first.findings.iter().filter(|f| checks.contains(&f.check)).collect();
    let cause = if failing.is_empty() { first.verdict.line.to_string() } else { failing.iter().map(|f| format!("{}: {}", f.check, f.summary)).collect::<Vec<_>>().join("; ") };
    let mut fixes: Vec<&str> = Vec::new();
    for fix in failing.iter().filter_map(|f| f.fix.as_deref()) {
        if !fixes.contains(&fix) {
            fixes.push(fix);
        }
    }
    let names: Vec<String> = nodes.iter().map(|n| n.0.clone()).collect();
    Group { cause, checks, fix: (!fixes.is_empty()).then(|| fixes.join("; ")), count: names.len(), folded: fold_names(&names), names }
}

/// The outcome of a check on a node whose report does not have it.
const NOT_REPORTED: &str = "(not reported on this node)";

/// One check's outcomes over a set of nodes.
struct Outcomes<'a> {
    /// (status, summary) -> the nodes with it.
    by: BTreeMap<(Status, &'a str), Vec<&'a str>>,
    /// A finding of the check, for its fix.
    fact: &'a Fact,
}

/// Per check (in order): its outcomes over `nodes`, the nodes that did not
/// report it counted as one more outcome.
fn outcomes(nodes: &[(String, Arc<Node>)]) -> BTreeMap<&str, Outcomes<'_>> {
    let mut by_check: BTreeMap<&str, Outcomes<'_>> = BTreeMap::new();
    for (name, r) in nodes {
        for f in &r.findings {
            let o = by_check.entry(&f.check).or_insert_with(|| Outcomes { by: BTreeMap::new(), fact: f });
            o.by.entry((f.status, &f.summary)).or_default().push(name);
        }
    }
    for o in by_check.values_mut() {
        if o.by.values().map(Vec::len).sum::<usize>() < nodes.len() {
            let have: BTreeSet<&str> = o.by.values().flatten().copied().collect();
            let absent: Vec<&str> = nodes.iter().map(|(name, _)| name.as_str()).filter(|name| !have.contains(name)).collect();
            o.by.insert((Status::Skipped, NOT_REPORTED), absent);
        }
    }
    by_check
}

/// The checks whose outcome differs between `nodes`, each with the
/// majority's outcome and the others.
fn differences(nodes: &[(String, Arc<Node>)]) -> Vec<Difference> {
    let mut out = Vec::new();
    for (check, o) in outcomes(nodes) {
        if o.by.len() < 2 {
            continue;
        }
        let ((status, summary), majority) = o.by.iter().max_by_key(|(_, v)| v.len()).expect("at least one outcome");
        let others = o
            .by
            .iter()
            .filter(|(k, _)| **k != (*status, *summary))
            .map(|((st, sum), nodes)| {
                let names: Vec<String> = nodes.iter().map(|s| (*s).to_owned()).collect();
                Group { cause: format!("{st}: {sum}"), checks: vec![check.to_owned()], fix: None, count: names.len(), folded: fold_names(&names), names }
            })
            .collect();
        out.push(Difference { check: check.to_owned(), majority: format!("{status}: {summary}"), majority_count: majority.len(), others });
    }
    out
}

/// The checks that warn or fail, the same way, on every one of `nodes`.
fn shared(nodes: &[(String, Arc<Node>)]) -> Vec<Shared> {
    outcomes(nodes)
        .into_iter()
        .filter_map(|(check, o)| {
            let (&(status, summary), _) = o.by.iter().next().filter(|_| o.by.len() == 1)?;
            matches!(status, Status::Warn | Status::Fail).then(|| Shared { check: check.to_owned(), status, summary: summary.to_owned(), fix: o.fact.fix.clone() })
        })
        .collect()
}

/// The text report: the verdict line, then the groups.
impl std::fmt::Display for FleetReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self;
        // What captures carry is shown escaped: a capture's text cannot
        // forge a line of the gate's report.
        let s = |x: &str| crate::doctor::shown(x);
        writeln!(f, "{}", s(&r.line))?;
        for g in &r.staging {
            writeln!(f, "  NOT USED on {} node(s) {}: {}", g.count, s(&g.folded), s(&g.cause))?;
            if let Some(fix) = &g.fix {
                writeln!(f, "    fix: {}", s(fix))?;
            }
        }
        for g in &r.open {
            writeln!(f, "  OPEN on {} node(s) {}: {}", g.count, s(&g.folded), s(&g.cause))?;
        }
        for u in &r.unreadable {
            writeln!(f, "  UNREADABLE {}: {}", s(&u.file), s(&u.error))?;
        }
        if !r.missing_nodes.is_empty() {
            writeln!(f, "  MISSING: {} node(s) expected sent no capture: {}", r.missing, s(&fold_names(&r.missing_nodes)))?;
        } else if r.missing > 0 {
            writeln!(f, "  MISSING: {} node(s) expected sent no capture", r.missing)?;
        }
        if !r.unexpected.is_empty() {
            writeln!(f, "  NOT EXPECTED: {} capture(s) from nodes not in --nodes, not judged: {}", r.unexpected.len(), s(&fold_names(&r.unexpected)))?;
        }
        if r.surplus > 0 {
            writeln!(f, "  MORE THAN EXPECTED: {} capture(s) beyond --expect: a stray or an earlier run's cannot be told apart without names (use --nodes, and --since)", r.surplus)?;
        }
        for sh in &r.shared {
            writeln!(f, "  on every node, {} {}: {}", sh.status, s(&sh.check), s(&sh.summary))?;
            if let Some(fix) = &sh.fix {
                writeln!(f, "    fix: {}", s(fix))?;
            }
        }
        for d in &r.differences {
            writeln!(f, "  {} differs: {} node(s) {}", s(&d.check), d.majority_count, s(&d.majority))?;
            for g in &d.others {
                writeln!(f, "    {} node(s) {}: {}", g.count, s(&g.folded), s(&g.cause))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
