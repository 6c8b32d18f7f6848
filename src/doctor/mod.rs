//! `gpudirect doctor`: whether GPUDirect RDMA works on this machine, and
//! exactly why not.
//!
//! Every check returns [`Finding`]s: a status, what it read (evidence) and,
//! when something is wrong, the fix. File-based checks read the machine
//! through a [`SysRoot`], so tests run them against fixture trees; live
//! probes (verbs, CUDA) sit behind [`probes::Probes`] so the file-based checks work
//! on a machine with neither.

use serde::Serialize;

use gpudirect::sysroot::SysRoot;

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Fine.
    Ok,
    /// Works, but something is off (slower path, fragile setting).
    Warn,
    /// Prevents GPUDirect RDMA.
    Fail,
    /// Could not be checked here (say why in the summary).
    Skipped,
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
            Status::Skipped => "skipped",
        })
    }
}

/// One finding of one check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// Stable identifier, `area.check` (e.g. `topology.path`, `acs.bridge`).
    pub check: String,
    /// Outcome.
    pub status: Status,
    /// One line saying what was found.
    pub summary: String,
    /// What was read to reach it (file paths and their contents, command answers).
    pub evidence: Vec<String>,
    /// What to do, when status is warn or fail.
    pub fix: Option<String>,
    /// Which GPU–NIC pairs this finding makes unusable whatever their
    /// registration path: the verdict reads this, never the `check` text.
    #[serde(skip)]
    pub blocks: Option<Blocker>,
}

/// What a finding blocks, typed: the NIC's port or GID, the device
/// nodes, ACS on a bridge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Blocker {
    /// This NIC's port is not active (or the device cannot be opened).
    Port(String),
    /// This NIC has no usable GID.
    Gid(String),
    /// These devices have no uverbs node here (every device when empty).
    DeviceNodes(Vec<String>),
    /// This bridge's ACS redirects peer-to-peer traffic.
    AcsBridge(String),
}

impl Blocker {
    /// Whether it blocks the pair of `nic` whose path crosses `bridges`.
    pub fn blocks(&self, nic: &str, bridges: &[String]) -> bool {
        match self {
            Blocker::Port(n) | Blocker::Gid(n) => n == nic,
            Blocker::DeviceNodes(devs) => devs.is_empty() || devs.iter().any(|d| d == nic),
            Blocker::AcsBridge(b) => bridges.contains(b),
        }
    }
}

impl Finding {
    /// A finding with no evidence or fix yet.
    pub fn new(check: impl Into<String>, status: Status, summary: impl Into<String>) -> Finding {
        Finding { check: check.into(), status, summary: summary.into(), evidence: Vec::new(), fix: None, blocks: None }
    }

    /// Marks what it blocks.
    pub fn blocking(mut self, b: Blocker) -> Finding {
        self.blocks = Some(b);
        self
    }

    /// Adds a line of evidence.
    pub fn evidence(mut self, e: impl Into<String>) -> Finding {
        self.evidence.push(e.into());
        self
    }

    /// Sets the fix.
    pub fn fix(mut self, f: impl Into<String>) -> Finding {
        self.fix = Some(f.into());
        self
    }
}

/// What the doctor needs from the machine beyond its files.
pub struct Machine {
    /// Where sysfs/procfs/dev are read.
    pub root: SysRoot,
    /// The environment variables to judge: the job's, as NCCL will see
    /// them, with where each came from ([`jobenv`]).
    pub job: jobenv::JobEnv,
}

impl Machine {
    /// The machine at `root`, judged with the variables `env` of the
    /// environment and nothing else.
    #[cfg(test)]
    pub fn new(root: SysRoot, env: Vec<(String, String)>) -> Machine {
        Machine { root, job: jobenv::JobEnv { vars: env, ..Default::default() } }
    }
}

/// `s` as it may be shown in a text report: control characters (a
/// newline, a carriage return, a terminal escape) written as escapes, so
/// text from a job file, a capture or a peer cannot forge a line of the
/// report or drive the terminal.
pub fn shown(s: &str) -> String {
    s.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
}

/// The kernel driver bound to the device whose sysfs directory is
/// `device` (its `driver` link's target: `bnxt_en`, `virtio_net`); `None`
/// when the link does not resolve here (a capture that did not record it).
pub(crate) fn driver_name(root: &SysRoot, device: &str) -> Option<String> {
    root.resolve(&format!("{device}/driver")).and_then(|p| p.rsplit('/').next().map(str::to_owned)).filter(|d| d != "driver")
}

pub mod acs;
pub mod bandwidth;
pub mod capture;
pub mod diff;
pub mod env;
pub mod input;
pub mod iommu;
pub mod jobenv;
pub mod jobfile;
pub mod log;
pub mod open;
pub mod pci;
pub mod plan;
pub mod pod;
pub mod probes;
pub mod report;
pub mod sources;
pub mod stack;

#[cfg(test)]
mod unseen_tests;
