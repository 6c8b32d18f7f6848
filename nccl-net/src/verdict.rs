//! Which path a connection's bytes take, and what the policy does about a
//! GPU's traffic staged through host memory. Pure functions of the
//! library's judgement (the one judge of GPUDirect RDMA,
//! [`gpudirect::gdr::plan`]), the pair's PCIe distance and the job's NCCL
//! variables, so every case is tested on fixture facts.
//!
//! How a staged connection is recognised: NCCL registers a connection's
//! buffers right after `connect`/`accept` and before its first transfer.
//! With GPUDirect RDMA, the SIMPLE protocol's buffer (and LL128's, and on
//! the receiving side LL's too) is GPU memory (`NCCL_PTR_CUDA`, or a
//! dma-buf); only the sender's LL buffer, and LL buffers of shared p2p
//! connections, stay in host memory (NCCL's `transport/net.cc`,
//! `sendProxyConnect`/`recvProxyConnect`). Without it, every buffer is host
//! memory. So a connection that registered host memory and no GPU memory
//! before its first transfer stages that GPU's traffic; one with any GPU
//! registration does not, and is never refused.

use std::ffi::c_int;

use gpudirect::gdr::{plan, GdrFacts, Plan};
use gpudirect::nccl::{registration_stops, PluginLine, PluginPath};
use gpudirect::sysroot::SysRoot;
use gpudirect::topology::{pairs, PathLevel, PciTopology};
use gpudirect::metrics::DataPath;
use gpudirect::RegistrationPath;

use crate::abi;
use crate::config::GdrPolicy;

/// The library's judgement of one GPU with one NIC.
#[derive(Clone, Debug)]
pub struct PairJudgement {
    /// The GPU's CUDA ordinal.
    pub ordinal: usize,
    /// The facts judged.
    pub facts: GdrFacts,
    /// The zero-copy paths they leave, and the causes of the others' absence.
    pub plan: Plan,
    /// NCCL's view of the PCIe distance (PIX ... SYS), when the pair could
    /// be placed in the PCIe tree.
    pub nccl_level: Option<PathLevel>,
    /// nvidia-smi's name for it (`NODE` where NCCL says `PHB`), for the
    /// wording: the doctor names the pair so too.
    pub shown_level: Option<PathLevel>,
}

impl PairJudgement {
    /// Judges `facts` with the library's judge.
    pub fn new(ordinal: usize, facts: GdrFacts, nccl_level: Option<PathLevel>) -> PairJudgement {
        let plan = plan(&facts);
        PairJudgement { ordinal, facts, plan, nccl_level, shown_level: None }
    }

    /// The same, naming the distance `level` as nvidia-smi does.
    pub fn shown_as(mut self, level: Option<PathLevel>) -> PairJudgement {
        self.shown_level = level;
        self
    }

    /// Whether a zero-copy path exists between the two.
    pub fn possible(&self) -> bool {
        !self.plan.try_paths.is_empty()
    }

    /// `GPU2 (NVIDIA H200, 0000:17:00.0)`.
    pub fn gpu(&self) -> &str {
        &self.facts.gpu.label
    }
}

/// NCCL's view of the PCIe path between the GPU at `gpu_bus_id` (as CUDA
/// spells it) and the RDMA device `nic`, and nvidia-smi's name for it;
/// `None` when either cannot be placed in the tree (a software RDMA
/// device, a VM without the tree).
pub fn levels(root: &SysRoot, topo: &PciTopology, gpu_bus_id: &str, nic: &str) -> Option<(PathLevel, PathLevel)> {
    let gpu = topo.gpu_by_bus_id(gpu_bus_id)?;
    pairs(root, topo).into_iter().find(|p| p.gpu_index == gpu.index && p.nic == nic).map(|p| (p.nccl_level, p.level))
}

/// The `ptrSupport` a NIC advertises: host memory always; CUDA memory
/// only where the library's judge finds a zero-copy path for at least one
/// GPU, and dma-buf where that path is dma-buf. A NIC no GPU can reach
/// directly advertises host memory only, so NCCL never hands it GPU memory.
pub fn ptr_support(pairs: &[PairJudgement]) -> c_int {
    let mut s = abi::PTR_HOST;
    if pairs.iter().any(PairJudgement::possible) {
        s |= abi::PTR_CUDA;
    }
    if pairs.iter().any(|p| p.plan.try_paths.contains(&RegistrationPath::DmaBuf)) {
        s |= abi::PTR_DMABUF;
    }
    s
}

/// Which end of a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The sending end (`connect`): the NIC reads the GPU's memory.
    Send,
    /// The receiving end (`accept`): the NIC writes it.
    Recv,
}

/// The registrations a connection saw before its first transfer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    /// Host memory was registered.
    pub host: bool,
    /// GPU memory was registered, by this path (the first one seen).
    pub gpu: Option<RegistrationPath>,
}

/// Where a connection's bytes go between the NIC and their home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnPath {
    /// GPU memory, read or written by the NIC directly.
    Gdr(RegistrationPath),
    /// A GPU's traffic staged through host memory (NCCL copies between
    /// them), with why and what to do.
    Staged {
        /// What stands in the way.
        cause: String,
        /// What to do.
        fix: String,
    },
    /// Host memory with no GPU current on the calling thread: host memory
    /// is the data's home, nothing is staged.
    Host,
}

/// Judges a connection at its first transfer.
///
/// `gpu` is the library's judgement of the GPU current on NCCL's proxy
/// thread when the connection was set up, with this NIC (`None`: no GPU).
pub fn judge(side: Side, seen: Seen, gpu: Option<&PairJudgement>, nic: &str, nccl_env: &[(String, String)]) -> ConnPath {
    match (seen.gpu, gpu) {
        (Some(RegistrationPath::HostStaged), _) => ConnPath::Staged {
            cause: "the GPU memory was registered through a host-staged mirror".into(),
            fix: "see the registration's error in this log".into(),
        },
        (Some(path), _) => ConnPath::Gdr(path),
        (None, None) => ConnPath::Host,
        (None, Some(pair)) => {
            let (cause, fix) = staged_cause(side, pair, nic, nccl_env);
            ConnPath::Staged { cause, fix }
        }
    }
}

fn staged_cause(side: Side, pair: &PairJudgement, nic: &str, env: &[(String, String)]) -> (String, String) {
    let gpu = pair.gpu();
    if !pair.possible() {
        let causes: Vec<String> = pair.plan.causes.iter().map(|c| c.checked(&pair.facts)).collect();
        let fixes: Vec<String> = pair.plan.causes.iter().map(|c| c.fix(&pair.facts)).collect();
        return (
            format!("no zero-copy path between {gpu} and {nic}, so the plugin offered NCCL host memory only: {}", causes.join("; ")),
            fixes.join("; "),
        );
    }
    // The library's table, as the doctor and nccl-log judge by it: only
    // its registration rules, since NCCL already chose this network and
    // NIC for the connection.
    let p = gpudirect::nccl::Pair { nic: Some(nic), level: pair.nccl_level, shown: pair.shown_level, dma_buf_only: false, plugin_missing: None, sends: side == Side::Send };
    if let Some(stop) = registration_stops(env, &p) {
        return (format!("{gpu} <-> {nic}: {}", stop.cause()), stop.fix());
    }
    let paths: Vec<String> = pair.plan.try_paths.iter().map(ToString::to_string).collect();
    let read_note = if side == Side::Send {
        "; for sends NCCL also turns GPUDirect RDMA reads off by default on GPUs older than Ampere without NVLink (NCCL_NET_GDR_READ=1 turns them on)"
    } else {
        ""
    };
    (
        format!("NCCL registered only host memory for this connection although {} works between {gpu} and {nic}{read_note}", paths.join(" or ")),
        "run `gpudirect doctor --env-file <the job's environment>` on this node to see which of NCCL's checks declined GPUDirect RDMA".into(),
    )
}

/// The path of bytes a connection moves from or into one registration:
/// `gpu` is how that memory was registered (`None`: host memory), `staged`
/// whether the connection was judged [`ConnPath::Staged`]. From the
/// registration, never guessed: GPU memory is `gdr` unless registered
/// through a host mirror; host memory is `staged` only on a connection
/// judged to carry a GPU's traffic through it.
pub fn data_path(gpu: Option<RegistrationPath>, staged: bool) -> DataPath {
    match gpu {
        Some(path) => DataPath::of_gpu(path),
        None if staged => DataPath::Staged,
        None => DataPath::Host,
    }
}

/// What the plugin does with a judged connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Carry on; the path line goes to the log at INFO.
    Proceed,
    /// Carry on, the path line at WARN (`prefer`: staged, and said loudly).
    Warn,
    /// Refuse the connection; this WARN line says why (`require`).
    Refuse(PluginLine),
}

/// The path line for a connection (the one `gpudirect nccl-log` reads),
/// and what the policy does. `gpu` is the CUDA ordinal current when the
/// connection was set up.
pub fn decide(policy: GdrPolicy, side: Side, path: &ConnPath, gpu: Option<usize>, nic: &str) -> (PluginLine, Action) {
    let gpu = gpu.and_then(|g| u32::try_from(g).ok());
    let (line_path, action) = match path {
        ConnPath::Gdr(p) => (PluginPath::Gdr(p.to_string()), Action::Proceed),
        ConnPath::Host => (PluginPath::Host, Action::Proceed),
        ConnPath::Staged { cause, fix } => {
            let action = match policy {
                GdrPolicy::Off => Action::Proceed,
                GdrPolicy::Prefer => Action::Warn,
                GdrPolicy::Require => Action::Refuse(PluginLine::Refused { gpu, nic: nic.to_owned(), cause: cause.clone(), fix: fix.clone() }),
            };
            (PluginPath::Staged { cause: cause.clone(), fix: fix.clone() }, action)
        }
    };
    (PluginLine::Path { gpu, send: side == Side::Send, nic: nic.to_owned(), path: line_path }, action)
}

#[cfg(test)]
#[path = "verdict_tests.rs"]
mod tests;
