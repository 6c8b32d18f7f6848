//! Running every check and reaching the verdict.

use serde::Serialize;

use gpudirect::gdr::{plan, GdrError, GdrFacts, GpuFacts, NicFacts};
use gpudirect::RegistrationPath;

use gpudirect::topology::{self, PathLevel};

use super::open::Unseen;
use super::shown;
use super::pci;
use super::probes::Probes;
use super::stack::PathsLeft;
use super::{env, stack, Finding, Machine, Status};

/// Version of the `--json` layout; bumped on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// The doctor's answer.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// [`SCHEMA_VERSION`].
    pub schema: u32,
    /// The one-line answer and what it is about.
    pub verdict: Verdict,
    /// Every finding, in check order.
    pub findings: Vec<Finding>,
    /// The measurements to make next, scale first, with the figure each
    /// should reach here (`--plan` prints them).
    pub plan: Vec<super::plan::Step>,
}

/// Whether GPUDirect RDMA works here, for which pair, by which path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// GPUDirect RDMA will be used between at least one GPU and one NIC:
    /// the machine allows it and NCCL, in the environment judged, will
    /// use it.
    pub available: bool,
    /// The machine allows it for at least one pair, whatever the
    /// environment says.
    pub hardware_allows: bool,
    /// When the machine allows it and the environment stops NCCL from
    /// using it: the variable, what NCCL makes of it and the fix.
    pub environment: Option<String>,
    /// The sentence printed first.
    pub line: String,
    /// `dma-buf` or `peer memory` when available.
    pub path: Option<String>,
    /// The GPU of the best pair (`GPU0 (...)`).
    pub gpu: Option<String>,
    /// The NIC of the best pair.
    pub nic: Option<String>,
    /// The PCIe relation of the best pair (`PIX`, `PXB`, `PHB`, `NODE`, `SYS`).
    pub topology: Option<String>,
    /// Variables that decide NCCL's use of GPUDirect RDMA but that the job
    /// file leaves to the running job (or names in a form not read): the
    /// names of `open`'s variables.
    pub unsettled: Vec<String>,
    /// What "available" would rest on that was not read or seen: when not
    /// empty, the machine and what was read allow it, but the verdict is
    /// open (`available` is false, the exit status 3).
    pub open: Vec<super::open::Unseen>,
}

impl Report {
    /// The doctor's exit status: 0 available, 1 not, 3 left open by
    /// variables only the running job settles.
    pub fn exit_status(&self) -> u8 {
        match (self.verdict.available, self.verdict.open.is_empty()) {
            (true, _) => 0,
            (false, false) => 3,
            (false, true) => 1,
        }
    }
}

/// What to look at.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// Only this GPU (CUDA ordinal).
    pub gpu: Option<usize>,
    /// Only this RDMA device.
    pub device: Option<String>,
}

struct Candidate {
    gpu: GpuFacts,
    nic: String,
    path: Result<RegistrationPath, GdrError>,
    level: Option<PathLevel>,
    /// The PCIe relation in NCCL's view, the one that decides.
    nccl_level: Option<PathLevel>,
    /// dma-buf is the only registration path for the pair.
    dma_buf_only: bool,
    /// The PCIe bridges between the two.
    bridges: Vec<String>,
    /// Failures that block the pair whatever its registration path.
    blocked: Vec<String>,
}

impl Candidate {
    /// Why NCCL, run with `vars`, will not use GPUDirect RDMA on this pair.
    fn stopped_by(&self, vars: &[(String, String)], site: &env::Site) -> Option<String> {
        let pair = env::PairInEnv { nic: &self.nic, level: self.level, nccl_level: self.nccl_level, dma_buf_only: self.dma_buf_only, site };
        env::nccl_stops(vars, &pair).map(|s| s.to_string())
    }
}

/// Runs every check and decides.
pub fn run(m: &Machine, probes: &dyn Probes, opts: &Options) -> Report {
    let root = &m.root;
    let rdma = probes.rdma();
    let gpus = probes.gpus(root);
    let host = probes.host(root);
    let topo = topology::discover(root);
    let pairs = topology::pairs(root, &topo);

    // The library's plan for every selected pair, first: the findings of
    // the facts it judged print its judgement, with the paths it left.
    let mut candidates = Vec::new();
    for g in gpus.as_ref().map(|v| v.as_slice()).unwrap_or_default() {
        if opts.gpu.is_some_and(|o| o != g.ordinal) {
            continue;
        }
        for d in rdma.as_ref().map(|v| v.as_slice()).unwrap_or_default() {
            if opts.device.as_deref().is_some_and(|o| o != d.name) {
                continue;
            }
            let Ok(dma_buf) = d.dma_buf else { continue };
            let facts = GdrFacts { gpu: g.clone(), nic: NicFacts { device: d.name.clone(), dma_buf }, host: host.clone() };
            let p = plan(&facts);
            let dma_buf_only = p.try_paths == [RegistrationPath::DmaBuf];
            let path = p.try_paths.first().copied().ok_or(GdrError { facts, causes: p.causes });
            let pair = pairs.iter().find(|pr| Some(&pr.gpu) == g.pci_bus_id.as_ref() && pr.nic == d.name);
            let level = pair.map(|pr| pr.level);
            let nccl_level = pair.map(|pr| pr.nccl_level);
            let bridges = pair.map(|pr| pr.bridges.clone()).unwrap_or_default();
            candidates.push(Candidate { gpu: g.clone(), nic: d.name.clone(), path, level, nccl_level, dma_buf_only, bridges, blocked: vec![] });
        }
    }
    let mut left = PathsLeft { no_pairs: candidates.is_empty(), host_allows: PathsLeft::host_paths(&host), ..PathsLeft::default() };
    for c in candidates.iter().filter(|c| c.path.is_ok()) {
        left.gpus.push(c.gpu.ordinal);
        left.nics.push(c.nic.clone());
    }

    let mut findings = stack::rdma(root, &rdma, &left);
    findings.extend(stack::cuda(root, &gpus, &left));
    findings.extend(stack::host(&host, &left));
    let (pci_findings, estimates) = pci::check(root, &topo, &m.job.vars);
    findings.extend(pci_findings);
    // What the variables are judged against: the devices seen, the
    // plugins on the machine, whether dma-buf is the only path.
    let usable_paths: Vec<bool> = candidates.iter().filter(|c| c.path.is_ok()).map(|c| c.dma_buf_only).collect();
    let site = env::Site {
        rdma_devices: rdma.as_ref().ok().map(|v| v.iter().map(|d| d.name.clone()).collect()),
        net_libs: env::find_net_libs(root, m.job.library_path.as_deref(), &env::plugin_names(env::var(&m.job.vars, "NCCL_NET_PLUGIN"))),
        dma_buf_only: !usable_paths.is_empty() && usable_paths.iter().all(|b| *b),
    };
    findings.extend(env::check(&m.job, &site));
    findings.extend(super::pod::check(root, &rdma, || probes.ip_link(), &m.job.vars));

    // What the registration facts cannot see blocks a pair whatever its
    // path: the NIC's port and GID, the device nodes, ACS on its bridges.
    for c in &mut candidates {
        c.blocked = findings.iter().filter(|f| f.blocks.as_ref().is_some_and(|b| b.blocks(&c.nic, &c.bridges))).map(|f| f.summary.clone()).collect();
    }
    findings.extend(nic_per_gpu(&candidates, &m.job.vars, &site));
    let unread: Vec<Unseen> = env::unsettled_deciding(&m.job)
        .into_iter()
        .map(|u| Unseen::Variable { name: u.name.clone(), origin: u.origin.clone(), text: u.text.clone(), why: u.why.clone(), alternatives: u.alternatives.clone() })
        .collect();
    let verdict = decide_branches(&candidates, &rdma, &gpus, &m.job.vars, &site, unread);
    let start = candidates.iter().find(|c| verdict.gpu.as_deref() == Some(c.gpu.label.as_str()) && verdict.nic.as_deref() == Some(c.nic.as_str()));
    let start = start.map(|c| super::plan::Start { ordinal: c.gpu.ordinal, bdf: c.gpu.pci_bus_id.as_deref(), nic: &c.nic });
    let ordinal_of = |e: &super::bandwidth::Estimate| {
        candidates.iter().find(|c| c.nic == e.nic && c.gpu.pci_bus_id.as_deref().is_some_and(|b| e.gpu.contains(b))).map(|c| c.gpu.ordinal)
    };
    let plan = super::plan::plan(start, &estimates, ordinal_of);
    Report { schema: SCHEMA_VERSION, verdict, findings, plan }
}

/// Orders pairs nearest first, dma-buf before peer memory.
fn nearness(c: &&Candidate) -> (PathLevel, bool) {
    (c.level.unwrap_or(PathLevel::Sys), c.path.as_ref().map(|p| *p != RegistrationPath::DmaBuf).unwrap_or(true))
}

/// Per GPU: the NIC NCCL will use with this environment (the nearest one
/// `NCCL_IB_HCA` lets it open, as NCCL's topology search prefers) and the
/// one it should (the nearest usable), with the `NCCL_IB_HCA` value that
/// gives every GPU its own when they differ.
fn nic_per_gpu(cands: &[Candidate], vars: &[(String, String)], site: &env::Site) -> Vec<Finding> {
    let usable: Vec<&Candidate> = cands.iter().filter(|c| c.path.is_ok() && c.blocked.is_empty()).collect();
    let mut gpus: Vec<usize> = usable.iter().map(|c| c.gpu.ordinal).collect();
    gpus.dedup();
    let nearest = |g: usize| usable.iter().filter(|c| c.gpu.ordinal == g).min_by_key(|c| nearness(c)).copied();
    let mut wanted: Vec<String> = gpus.iter().filter_map(|g| nearest(*g)).map(|c| format!("{}:1", c.nic)).collect();
    wanted.sort();
    wanted.dedup();
    let value = format!("NCCL_IB_HCA=={}", wanted.join(","));
    let level = |c: &Candidate| c.level.map_or_else(|| "PCIe path unknown".to_owned(), |l| l.to_string());
    let mut out = Vec::new();
    for g in gpus {
        let Some(should) = nearest(g) else { continue };
        let check = format!("nccl.nic.gpu{g}");
        let how = "NCCL picks, per GPU, the NIC it reaches by the shortest PCIe path among those NCCL_IB_HCA lets it open";
        if env::transport_off(vars).is_some() {
            out.push(Finding::new(check, Status::Skipped, format!("{}: NCCL will use no RDMA NIC: its RDMA transport is off (see the verdict)", should.gpu.label)));
            continue;
        }
        let will = usable.iter().filter(|c| c.gpu.ordinal == g && env::hca_allows(vars, &c.nic)).min_by_key(|c| nearness(c)).copied();
        let stops = |c: &Candidate| c.stopped_by(vars, site);
        let f = match will {
            None => Finding::new(check, Status::Fail, format!("{}: NCCL_IB_HCA lets NCCL open none of the NICs this GPU can use", should.gpu.label))
                .fix(format!("set {value}")),
            Some(w) if w.nic != should.nic => Finding::new(
                check,
                Status::Warn,
                format!("{}: NCCL will use {} ({}), not the nearest {} ({}), which NCCL_IB_HCA leaves out", w.gpu.label, w.nic, level(w), should.nic, level(should)),
            )
            .fix(format!("set {value}: every GPU's nearest NIC")),
            Some(w) => match stops(w) {
                Some(why) => Finding::new(check, Status::Fail, format!("{}: NCCL will use {} ({}) without GPUDirect RDMA: {why}", w.gpu.label, w.nic, level(w))),
                None => Finding::new(check, Status::Ok, format!("{}: NCCL will use {} ({}), the nearest NIC, with GPUDirect RDMA", w.gpu.label, w.nic, level(w))),
            },
        };
        out.push(f.evidence(how));
    }
    out
}

/// One value per variable set in branches (`None`: unset).
type Values = Vec<(String, Option<String>)>;

/// Most combinations of branch values the verdict is decided for.
const MAX_BRANCH_CASES: usize = 64;

/// [`decide`], where variables set in branches leave it open: when each
/// of their listed values (every combination, up to
/// [`MAX_BRANCH_CASES`]) gives the same verdict, that verdict holds and
/// the line names the branches; otherwise it stays open, naming a value
/// that would change it.
fn decide_branches(
    cands: &[Candidate],
    rdma: &Result<Vec<super::probes::RdmaDevice>, String>,
    gpus: &Result<Vec<GpuFacts>, String>,
    vars: &[(String, String)],
    site: &env::Site,
    open: Vec<Unseen>,
) -> Verdict {
    let listed: Vec<(String, Vec<Option<String>>, String)> = open
        .iter()
        .filter_map(|u| match u {
            Unseen::Variable { name, alternatives, origin, .. } if !alternatives.is_empty() => Some((name.clone(), alternatives.clone(), origin.clone())),
            _ => None,
        })
        .collect();
    let cases = listed.iter().try_fold(1usize, |n, (_, a, _)| n.checked_mul(a.len()).filter(|n| *n <= MAX_BRANCH_CASES));
    let first = decide(cands, rdma, gpus, vars, site, open.clone());
    let (Some(cases), false) = (cases, listed.is_empty()) else { return first };
    let rest: Vec<Unseen> = open.into_iter().filter(|u| !u.variable().is_some_and(|n| listed.iter().any(|(l, _, _)| l == n))).collect();
    let mut verdicts: Vec<(Values, Verdict)> = Vec::with_capacity(cases);
    for case in 0..cases {
        // The case'th combination, one value per listed variable.
        let (mut k, mut values, mut with) = (case, Vec::new(), vars.to_vec());
        for (name, alts, _) in &listed {
            let v = alts[k % alts.len()].clone();
            k /= alts.len();
            with.retain(|(n, _)| n != name);
            if let Some(v) = &v {
                with.push((name.clone(), v.clone()));
            }
            values.push((name.clone(), v));
        }
        verdicts.push((values, decide(cands, rdma, gpus, &with, site, rest.clone())));
    }
    // The same answer for the job: available or not, on the same pair
    // and path, with the same left open (why not may name each value).
    let same = |a: &Verdict, b: &Verdict| (a.available, a.hardware_allows, &a.path, &a.gpu, &a.nic, &a.open) == (b.available, b.hardware_allows, &b.path, &b.gpu, &b.nic, &b.open);
    let shown = |values: &[(String, Option<String>)]| {
        values.iter().map(|(n, v)| v.as_ref().map_or_else(|| format!("{n} unset"), |v| format!("{n}={v}"))).collect::<Vec<_>>().join(", ")
    };
    let names: Vec<String> = listed.iter().map(|(n, _, origin)| format!("{n} ({origin})")).collect();
    let (base_values, base) = &verdicts[0];
    match verdicts.iter().find(|(_, v)| !same(v, base)) {
        None => {
            let mut v = base.clone();
            let all: Vec<String> = verdicts.iter().map(|(values, _)| shown(values)).collect();
            v.line.push_str(&format!(" (the same for every value the branches give {}: {})", names.join(", "), all.join("; ")));
            v
        }
        Some((values, other)) => {
            let mut v = first;
            v.line.push_str(&format!(
                "; the branches decide it: with {} {}, with {} {}",
                shown(base_values),
                if base.available { "available" } else { "not" },
                shown(values),
                if other.available { "available" } else { "not" }
            ));
            v
        }
    }
}

fn decide(
    cands: &[Candidate],
    rdma: &Result<Vec<super::probes::RdmaDevice>, String>,
    gpus: &Result<Vec<GpuFacts>, String>,
    vars: &[(String, String)],
    site: &env::Site,
    mut open: Vec<Unseen>,
) -> Verdict {
    let not = |why: String| Verdict {
        available: false,
        hardware_allows: false,
        environment: None,
        line: format!("GPUDirect RDMA: not available: {why}"),
        path: None,
        gpu: None,
        nic: None,
        topology: None,
        unsettled: Vec::new(),
        open: Vec::new(),
    };
    match (rdma, gpus) {
        (Err(e), _) => return not(format!("no RDMA device can be used ({e})")),
        (Ok(v), _) if v.is_empty() => return not("no RDMA device is visible".into()),
        (_, Err(e)) => return not(format!("CUDA cannot be used ({e})")),
        (_, Ok(v)) if v.is_empty() => return not("CUDA sees no GPU".into()),
        _ => {}
    }
    let rank = nearness;
    let stops = |c: &Candidate| c.stopped_by(vars, site);
    let usable = || cands.iter().filter(|c| c.path.is_ok() && c.blocked.is_empty());
    // The path NCCL registers by in this environment, not the first the
    // library would try.
    let pair_of = |c: &Candidate| {
        let path = c.path.as_ref().map(|p| env::registration_path(vars, *p, c.dma_buf_only).to_string()).unwrap_or_default();
        let level = c.level.map_or_else(|| "PCIe path unknown".to_owned(), |l| l.to_string());
        (path, level)
    };
    // The best pair NCCL will use in this environment.
    if let Some(c) = usable().filter(|c| stops(c).is_none()).min_by_key(rank) {
        let (path, level) = pair_of(c);
        // "Available" rests on the pair's PCIe path (the distance rule
        // reads it) and, for a plugin's network, on its library having
        // been looked for: unseen, the verdict stays open.
        if c.level.is_none() {
            open.push(Unseen::Fact {
                what: format!(
                    "the PCIe path between {} and {} (the PCI devices of this machine's sysfs do not show where they sit, so NCCL's distance rule cannot be applied)",
                    c.gpu.label, c.nic
                ),
            });
        }
        if let Some(net) = env::var(vars, "NCCL_NET").filter(|n| env::plugin_network(n) && site.net_libs.is_none()) {
            open.push(Unseen::Fact {
                what: format!("whether the network plugin for NCCL_NET={net:?} is installed (its library directories were not looked in: capture again with this version)"),
            });
        }
        // What was read lets NCCL use it; what was not may not, and then
        // the verdict stays open.
        let allows = if open.is_empty() { "available" } else { "cannot tell: the hardware and what was read allow it" };
        let mut line = format!("GPUDirect RDMA: {allows} via {path} for {} <-> {} ({level})", c.gpu.label, c.nic);
        if let Some(nearest) = usable().min_by_key(rank).filter(|n| n.nic != c.nic || n.gpu.ordinal != c.gpu.ordinal) {
            if let Some(why) = stops(nearest) {
                line.push_str(&format!("; not on the nearer {} <-> {}: {why}", nearest.gpu.label, nearest.nic));
            }
        }
        let names: Vec<String> = open.iter().filter_map(Unseen::variable).map(str::to_owned).collect();
        if !open.is_empty() {
            let shown: Vec<String> = open.iter().map(ToString::to_string).collect();
            line.push_str(&format!(", but not read or not seen: {}", shown.join("; ")));
        }
        return Verdict {
            available: open.is_empty(),
            hardware_allows: true,
            environment: None,
            line,
            path: Some(path),
            gpu: Some(c.gpu.label.clone()),
            nic: Some(c.nic.clone()),
            topology: c.level.map(|l| l.to_string()),
            unsettled: names,
            open,
        };
    }
    // The machine allows it, the environment stops NCCL from using it.
    if let Some(c) = usable().min_by_key(rank) {
        let (path, level) = pair_of(c);
        let why = stops(c).unwrap_or_default();
        return Verdict {
            available: false,
            hardware_allows: true,
            line: format!(
                "GPUDirect RDMA: the hardware allows it for {} <-> {} ({path}, {level}), but NCCL with this environment will not use it: {why}",
                c.gpu.label, c.nic
            ),
            environment: Some(why),
            path: Some(path),
            gpu: Some(c.gpu.label.clone()),
            nic: Some(c.nic.clone()),
            topology: c.level.map(|l| l.to_string()),
            unsettled: Vec::new(),
            open: Vec::new(),
        };
    }
    // Not available: name the first reason of the closest pair.
    let Some(c) = cands.iter().min_by_key(|c| c.level.unwrap_or(PathLevel::Sys)) else {
        return not("no GPU and RDMA device pair matches the selection".into());
    };
    let why = match (&c.path, c.blocked.first()) {
        (Err(e), _) => e.causes.first().map(|cause| cause.checked(&e.facts)).unwrap_or_else(|| "no registration path".into()),
        (Ok(_), Some(b)) => b.clone(),
        (Ok(_), None) => "unknown".into(),
    };
    Verdict {
        available: false,
        hardware_allows: false,
        environment: None,
        line: format!("GPUDirect RDMA: not available for {} <-> {}: {why}", c.gpu.label, c.nic),
        path: None,
        gpu: Some(c.gpu.label.clone()),
        nic: Some(c.nic.clone()),
        topology: c.level.map(|l| l.to_string()),
        unsettled: Vec::new(),
        open: Vec::new(),
    }
}

/// Every finding with its evidence (`--verbose`).
impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", shown(&self.verdict.line))?;
        for x in &self.findings {
            writeln!(f, "[{:<7}] {}: {}", x.status.to_string(), shown(&x.check), shown(&x.summary))?;
            for e in &x.evidence {
                writeln!(f, "            evidence: {}", shown(e))?;
            }
            if let Some(fix) = &x.fix {
                writeln!(f, "            fix: {}", shown(fix))?;
            }
        }
        Ok(())
    }
}

/// What is worth reading when it matters: the verdict, then only the
/// problems (failures, then warnings) with their fixes, then how many
/// checks passed. The default text output.
pub struct Brief<'a>(pub &'a Report);

impl std::fmt::Display for Brief<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.0;
        writeln!(f, "{}", shown(&r.verdict.line))?;
        for status in [Status::Fail, Status::Warn] {
            for x in r.findings.iter().filter(|x| x.status == status) {
                writeln!(f, "[{:<7}] {}: {}", x.status.to_string(), shown(&x.check), shown(&x.summary))?;
                // Where a variable came from is half of what to change.
                if let Some(origin) = x.evidence.iter().find(|e| x.check.starts_with("env.") && e.starts_with("set by ")) {
                    writeln!(f, "            {}", shown(origin))?;
                }
                if let Some(fix) = &x.fix {
                    writeln!(f, "            fix: {}", shown(fix))?;
                }
            }
        }
        let quiet = r.findings.iter().filter(|x| !matches!(x.status, Status::Fail | Status::Warn)).count();
        writeln!(f, "({quiet} other checks passed or did not apply; --verbose shows every finding with its evidence)")
    }
}

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
