//! Why GPUDirect RDMA is not available, as data: each [`Cause`] with
//! what was checked and its fix, and the [`GdrError`] a registration under
//! [`GpuPolicy::Require`](crate::GpuPolicy::Require) returns. Plain data
//! and errors over the facts (`gdr/facts.rs`): the judge (`gdr/judge.rs`)
//! decides which causes hold; the crate's [`Error`](crate::Error) wraps the
//! error.

use crate::gdr::facts::{GdrFacts, GpuFacts, HostFacts, ModuleFlavour, NicFacts, PEER_MEMORY_FILES};
use crate::errno::Errno;
use crate::policy::RegistrationPath;

/// One reason a zero-copy path is unavailable: what was checked, and the fix.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Cause {
    /// No CUDA driver, or no such GPU.
    CudaUnavailable(String),
    /// Attribute 116 is 0.
    GpuWithoutGdr,
    /// Attribute 124 is 0.
    GpuWithoutDmaBuf,
    /// The CUDA driver predates dma-buf export (11.7).
    CudaTooOldForDmaBuf(i32),
    /// The NIC's provider cannot register dma-buf memory.
    NicWithoutDmaBuf(Errno),
    /// The kernel predates dma-buf memory regions (5.12).
    KernelTooOldForDmaBuf(String),
    /// No peer-memory client is loaded.
    NoPeerMemoryClient,
    /// A registration was attempted and failed.
    RegistrationFailed {
        /// The path tried.
        path: RegistrationPath,
        /// The failing call.
        call: &'static str,
        /// What it said.
        error: String,
    },
}

impl Cause {
    /// The path this cause rules out (`None`: both).
    pub fn path(&self) -> Option<RegistrationPath> {
        match self {
            Cause::CudaUnavailable(_) | Cause::GpuWithoutGdr => None,
            Cause::GpuWithoutDmaBuf | Cause::CudaTooOldForDmaBuf(_) | Cause::NicWithoutDmaBuf(_) | Cause::KernelTooOldForDmaBuf(_) => {
                Some(RegistrationPath::DmaBuf)
            }
            Cause::NoPeerMemoryClient => Some(RegistrationPath::PeerMemory),
            Cause::RegistrationFailed { path, .. } => Some(*path),
        }
    }

    /// What was checked and what it showed.
    pub fn checked(&self, f: &GdrFacts) -> String {
        self.checked_on(&Sides::of(f))
    }

    /// What to do about it.
    pub fn fix(&self, f: &GdrFacts) -> String {
        self.fix_on(&Sides::of(f))
    }

    pub(crate) fn checked_on(&self, s: &Sides<'_>) -> String {
        let gpu = s.gpu.map_or("the GPU", |g| g.label.as_str());
        match self {
            Cause::CudaUnavailable(why) => format!("CUDA could not be used for {gpu}: {why}"),
            Cause::GpuWithoutGdr => format!("{gpu} reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 0"),
            Cause::GpuWithoutDmaBuf => {
                let module = match s.gpu.map(|g| &g.module) {
                    Some(ModuleFlavour::Open) => "the open kernel module is loaded".to_string(),
                    Some(ModuleFlavour::Proprietary) => "the proprietary kernel module is loaded (/proc/driver/nvidia/version)".to_string(),
                    Some(ModuleFlavour::NotLoaded) | None => "/proc/driver/nvidia/version is missing".to_string(),
                    Some(ModuleFlavour::Unknown(l)) => format!("/proc/driver/nvidia/version says {l:?}"),
                };
                format!("{gpu} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0; {module}")
            }
            Cause::CudaTooOldForDmaBuf(v) => format!("the CUDA driver is {}, dma-buf export needs 11.7 or newer", version(*v)),
            Cause::NicWithoutDmaBuf(errno) => format!(
                "{}: ibv_reg_dmabuf_mr(fd = -1) probe answered {errno}: the provider cannot register dma-buf memory",
                s.nic.map_or("the NIC", |n| n.device.as_str())
            ),
            Cause::KernelTooOldForDmaBuf(r) => format!("kernel {r} predates dma-buf memory regions (5.12)"),
            Cause::NoPeerMemoryClient => {
                let api = match s.host.and_then(|h| h.peer_memory_api) {
                    Some(true) => "; /proc/kallsyms has ib_register_peer_memory_client, so ib_core accepts peer-memory clients",
                    Some(false) => "; /proc/kallsyms has no ib_register_peer_memory_client (inbox ib_core)",
                    None => "",
                };
                format!("none of {} exists{api}", PEER_MEMORY_FILES.join(", "))
            }
            Cause::RegistrationFailed { path, call, error } => format!("{path} registration: {call} failed: {error}"),
        }
    }

    pub(crate) fn fix_on(&self, s: &Sides<'_>) -> String {
        match self {
            Cause::CudaUnavailable(_) => "install the NVIDIA driver (in containers, expose it with the NVIDIA container toolkit) and check CUDA_VISIBLE_DEVICES".into(),
            Cause::GpuWithoutGdr => "this GPU model cannot do GPUDirect RDMA (GeForce and some cloud SKUs): use a data-center GPU, or accept host staging".into(),
            Cause::GpuWithoutDmaBuf => match s.gpu.map(|g| &g.module) {
                Some(ModuleFlavour::Proprietary) => "install the open kernel module flavour (nvidia-open; the default from driver 560), Turing or newer GPU".into(),
                _ => "dma-buf export needs the open NVIDIA kernel module, a Turing or newer GPU and CUDA 11.7+".into(),
            },
            Cause::CudaTooOldForDmaBuf(_) => "upgrade the NVIDIA driver to one with CUDA 11.7 or newer".into(),
            Cause::NicWithoutDmaBuf(_) => "use a NIC whose provider supports dma-buf (mlx5, efa, bnxt_re, irdma with rdma-core 34+); Soft-RoCE (rxe) never does".into(),
            Cause::KernelTooOldForDmaBuf(_) => "upgrade to kernel 5.12 or newer".into(),
            Cause::NoPeerMemoryClient => match s.host.and_then(|h| h.peer_memory_api) {
                Some(true) => "`modprobe nvidia-peermem`".into(),
                _ => "peer memory needs MLNX/DOCA OFED's ib_core plus `modprobe nvidia-peermem`; dma-buf is the supported path on inbox kernels".into(),
            },
            Cause::RegistrationFailed { path: RegistrationPath::PeerMemory, error, .. } if error.contains("EFAULT") => {
                "EFAULT from ibv_reg_mr on GPU memory means no peer-memory client took the range: `modprobe nvidia-peermem`".into()
            }
            Cause::RegistrationFailed { error, .. } if error.contains("ENOMEM") => {
                "check the locked-memory limit (`ulimit -l`) and the GPU's BAR1 size (nvidia-smi -q -d MEMORY): registrations beyond BAR1 fail".into()
            }
            Cause::RegistrationFailed { .. } => "see the error; with PCIe ACS or an IOMMU in DMA mode between GPU and NIC, peer-to-peer DMA is blocked".into(),
        }
    }
}

/// The sides of the facts a text may name; a side's own judgement knows
/// only its side.
#[derive(Default)]
pub(crate) struct Sides<'a> {
    pub(crate) gpu: Option<&'a GpuFacts>,
    pub(crate) nic: Option<&'a NicFacts>,
    pub(crate) host: Option<&'a HostFacts>,
}

impl<'a> Sides<'a> {
    pub(crate) fn of(f: &'a GdrFacts) -> Self {
        Sides { gpu: Some(&f.gpu), nic: Some(&f.nic), host: Some(&f.host) }
    }
}

fn version(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

/// GPUDirect RDMA is not available and the policy allows no fallback.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render())]
pub struct GdrError {
    /// The facts the decision was made on.
    pub facts: GdrFacts,
    /// Every cause found, in the order checked.
    pub causes: Vec<Cause>,
}

impl GdrError {
    fn render(&self) -> String {
        let f = &self.facts;
        let mut s = format!(
            "GPUDirect RDMA is not available between {} and {}, and the policy is Require (no fallback):",
            f.gpu.label, f.nic.device
        );
        for (i, c) in self.causes.iter().enumerate() {
            let what = match c.path() {
                Some(p) => format!("{p}"),
                None => "both paths".into(),
            };
            s.push_str(&format!("\n  {}. [{what}] {}.\n     fix: {}", i + 1, c.checked(f), c.fix(f)));
        }
        s.push_str("\n  Or pass GpuPolicy::Prefer to fall back to host staging (about half the bandwidth).");
        s
    }

    /// Whether a cause of this kind is among the causes.
    pub fn has(&self, pred: impl Fn(&Cause) -> bool) -> bool {
        self.causes.iter().any(pred)
    }
}

