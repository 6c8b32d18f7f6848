//! GPUDirect RDMA: which path registers GPU memory with the NIC, and why
//! none can when none can.
//!
//! Two zero-copy paths exist. **dma-buf** (the modern one): CUDA exports the
//! memory as a dma-buf (`cuMemGetHandleForAddressRange`) and the NIC
//! registers that (`ibv_reg_dmabuf_mr`, iova = the device pointer).
//! **Peer memory** (the legacy one): plain `ibv_reg_mr` on the device
//! pointer, served by the `nvidia-peermem` kernel module. When neither
//! works, other stacks quietly copy through host memory at about half the
//! bandwidth. Here the caller decides, with [`GpuPolicy`]:
//! [`Require`](GpuPolicy::Require) (the default) returns a [`GdrError`]
//! listing each cause, what was checked and what to do; with
//! [`Prefer`](GpuPolicy::Prefer) the region falls back to host staging and
//! says so. Every GPU region reports the [`RegistrationPath`] used.
//!
//! The decision is a pure function of [`GdrFacts`], so every cause is
//! tested with injected facts; [`GdrFacts::gather`] collects them live.
//!
//! # When received data is really there
//! A receive completion (including the one a write with immediate data
//! consumes) means the NIC has issued every PCIe write of the message and
//! the CPU may read host memory. For GPU memory written directly (dma-buf
//! or peer memory) that is not yet a promise to the GPU's kernels: unless
//! the GPU orders inbound RDMA writes
//! (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` >= OWNER, as on
//! Hopper), the writes may still be in flight inside the GPU. Call
//! [`MemoryRegion::flush_gpu_writes`] after reaping the completion and
//! before launching the consumer kernel: it is free on GPUs that order
//! writes and issues `cuFlushGPUDirectRDMAWrites` on older ones (NCCL
//! issues a loopback RDMA read for the same purpose). Copies through the
//! region's own accessors (`read_at`) are ordered already: buffers are
//! allocated with `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`. Host-staged regions
//! copy into the GPU synchronously when the completion is reaped (or when
//! [`MemoryRegion::stage_in`] is called for a peer's write), so the data is
//! complete when that returns.

use std::fmt;

use crate::error::{Errno, Error, Result};
use crate::gpu::{self, Gpu, GpuBuffer};
use crate::mr::{AccessFlags, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::sysroot::SysRoot;

/// How a GPU memory region was registered with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RegistrationPath {
    /// Zero-copy through a dma-buf export of the GPU memory.
    DmaBuf,
    /// Zero-copy through the `nvidia-peermem` peer-memory client.
    PeerMemory,
    /// Not zero-copy: the NIC uses a pinned host mirror and every transfer
    /// is copied between it and the GPU.
    HostStaged,
}

impl fmt::Display for RegistrationPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegistrationPath::DmaBuf => "dma-buf",
            RegistrationPath::PeerMemory => "peer memory",
            RegistrationPath::HostStaged => "host-staged",
        })
    }
}

/// What to do when GPUDirect RDMA is not available.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuPolicy {
    /// GPUDirect RDMA or an error naming why not. The default.
    #[default]
    Require,
    /// GPUDirect RDMA if possible, otherwise host staging, reported by the
    /// region's path and a warning in the log.
    Prefer,
    /// Host staging, without trying GPUDirect RDMA.
    HostStaged,
}

impl std::str::FromStr for GpuPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "require" => Ok(GpuPolicy::Require),
            "prefer" => Ok(GpuPolicy::Prefer),
            "host-staged" | "hoststaged" | "staged" => Ok(GpuPolicy::HostStaged),
            _ => Err(format!("unknown GPU policy {s:?}: expected require, prefer or host-staged")),
        }
    }
}

/// Which NVIDIA kernel module is loaded (`/proc/driver/nvidia/version`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModuleFlavour {
    /// The open kernel module: can export dma-buf (Turing and newer).
    Open,
    /// The proprietary module: no dma-buf export.
    Proprietary,
    /// No NVIDIA module loaded (the file does not exist).
    NotLoaded,
    /// The file exists but says neither.
    Unknown(String),
}

impl ModuleFlavour {
    /// Reads `/proc/driver/nvidia/version` under `root`.
    pub fn read(root: &SysRoot) -> ModuleFlavour {
        match root.read("/proc/driver/nvidia/version") {
            Err(_) => ModuleFlavour::NotLoaded,
            Ok(text) => {
                let first = text.lines().next().unwrap_or_default().to_owned();
                if first.contains("Open Kernel Module") {
                    ModuleFlavour::Open
                } else if first.contains("Kernel Module") {
                    ModuleFlavour::Proprietary
                } else {
                    ModuleFlavour::Unknown(first)
                }
            }
        }
    }
}

/// The answer of the NIC's dma-buf probe: `ibv_reg_dmabuf_mr` with
/// `fd = -1`, as NCCL and UCX do. A provider that can register dma-buf
/// rejects the bad descriptor (`EBADF`); one that cannot says
/// `EOPNOTSUPP` or `EPROTONOSUPPORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DmaBufProbe {
    /// The provider can register dma-buf memory; the errno it gave.
    Supported(Errno),
    /// It cannot; the errno it gave.
    Unsupported(Errno),
}

impl DmaBufProbe {
    /// Classifies the errno of the `fd = -1` probe.
    pub fn from_errno(errno: Errno) -> DmaBufProbe {
        match errno.0 {
            libc::EOPNOTSUPP | libc::EPROTONOSUPPORT => DmaBufProbe::Unsupported(errno),
            _ => DmaBufProbe::Supported(errno),
        }
    }
}

/// The GPU side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFacts {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// `GPU0 (NVIDIA H200, 0000:17:00.0)` or just `GPU0` when unknown.
    pub label: String,
    /// PCI address (`0000:17:00.0`) when CUDA could tell.
    pub pci_bus_id: Option<String>,
    /// Why CUDA could not be asked (no driver, no such GPU); `None` when it could.
    pub cuda_unavailable: Option<String>,
    /// CUDA driver version (12080 = 12.8).
    pub driver_version: Option<i32>,
    /// Attribute 116.
    pub gdr_supported: Option<bool>,
    /// Attribute 124.
    pub dma_buf_supported: Option<bool>,
    /// The NVIDIA kernel module flavour.
    pub module: ModuleFlavour,
}

/// The NIC side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicFacts {
    /// RDMA device name.
    pub device: String,
    /// The dma-buf probe's answer.
    pub dma_buf: DmaBufProbe,
}

/// The host side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel_release: Option<String>,
    /// Peer-memory files found (e.g. `/sys/module/nvidia_peermem/version`).
    pub peer_memory_found: Vec<String>,
    /// Whether `/proc/kallsyms` lists `ib_register_peer_memory_client`
    /// (`None`: unreadable).
    pub peer_memory_api: Option<bool>,
}

/// The files whose existence shows a loaded peer-memory client, as NCCL,
/// UCX and libfabric check them.
pub const PEER_MEMORY_FILES: [&str; 4] = [
    "/sys/kernel/mm/memory_peers/nv_mem/version",
    "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
    "/sys/module/nvidia_peermem/version",
    "/sys/module/nv_peer_mem/version",
];

impl HostFacts {
    /// Reads the host facts under `root`.
    pub fn read(root: &SysRoot) -> HostFacts {
        HostFacts {
            kernel_release: root.read("/proc/sys/kernel/osrelease").ok(),
            peer_memory_found: PEER_MEMORY_FILES.iter().filter(|p| root.exists(p)).map(|p| p.to_string()).collect(),
            peer_memory_api: root
                .read("/proc/kallsyms")
                .ok()
                .map(|k| k.lines().any(|l| l.split_whitespace().nth(2) == Some("ib_register_peer_memory_client"))),
        }
    }

    /// `(major, minor)` of the kernel release, e.g. `(6, 1)` for `6.1.0-27-amd64`.
    pub fn kernel_version(&self) -> Option<(u32, u32)> {
        let r = self.kernel_release.as_deref()?;
        let mut it = r.split(|c: char| !c.is_ascii_digit());
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    }
}

/// Everything the path decision depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdrFacts {
    /// The GPU.
    pub gpu: GpuFacts,
    /// The NIC.
    pub nic: NicFacts,
    /// The host.
    pub host: HostFacts,
}

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
        let gpu = &f.gpu.label;
        match self {
            Cause::CudaUnavailable(why) => format!("CUDA could not be used for {gpu}: {why}"),
            Cause::GpuWithoutGdr => format!("{gpu} reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 0"),
            Cause::GpuWithoutDmaBuf => {
                let module = match &f.gpu.module {
                    ModuleFlavour::Open => "the open kernel module is loaded".to_string(),
                    ModuleFlavour::Proprietary => "the proprietary kernel module is loaded (/proc/driver/nvidia/version)".to_string(),
                    ModuleFlavour::NotLoaded => "/proc/driver/nvidia/version is missing".to_string(),
                    ModuleFlavour::Unknown(l) => format!("/proc/driver/nvidia/version says {l:?}"),
                };
                format!("{gpu} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0; {module}")
            }
            Cause::CudaTooOldForDmaBuf(v) => format!("the CUDA driver is {}, dma-buf export needs 11.7 or newer", version(*v)),
            Cause::NicWithoutDmaBuf(errno) => format!(
                "{}: ibv_reg_dmabuf_mr(fd = -1) probe answered {errno}: the provider cannot register dma-buf memory",
                f.nic.device
            ),
            Cause::KernelTooOldForDmaBuf(r) => format!("kernel {r} predates dma-buf memory regions (5.12)"),
            Cause::NoPeerMemoryClient => {
                let api = match f.host.peer_memory_api {
                    Some(true) => "; /proc/kallsyms has ib_register_peer_memory_client, so ib_core accepts peer-memory clients",
                    Some(false) => "; /proc/kallsyms has no ib_register_peer_memory_client (inbox ib_core)",
                    None => "",
                };
                format!("none of {} exists{api}", PEER_MEMORY_FILES.join(", "))
            }
            Cause::RegistrationFailed { path, call, error } => format!("{path} registration: {call} failed: {error}"),
        }
    }

    /// What to do about it.
    pub fn fix(&self, f: &GdrFacts) -> String {
        match self {
            Cause::CudaUnavailable(_) => "install the NVIDIA driver (in containers, expose it with the NVIDIA container toolkit) and check CUDA_VISIBLE_DEVICES".into(),
            Cause::GpuWithoutGdr => "this GPU model cannot do GPUDirect RDMA (GeForce and some cloud SKUs): use a data-center GPU, or accept host staging".into(),
            Cause::GpuWithoutDmaBuf => match f.gpu.module {
                ModuleFlavour::Proprietary => "install the open kernel module flavour (nvidia-open; the default from driver 560), Turing or newer GPU".into(),
                _ => "dma-buf export needs the open NVIDIA kernel module, a Turing or newer GPU and CUDA 11.7+".into(),
            },
            Cause::CudaTooOldForDmaBuf(_) => "upgrade the NVIDIA driver to one with CUDA 11.7 or newer".into(),
            Cause::NicWithoutDmaBuf(_) => "use a NIC whose provider supports dma-buf (mlx5, efa, bnxt_re, irdma with rdma-core 34+); Soft-RoCE (rxe) never does".into(),
            Cause::KernelTooOldForDmaBuf(_) => "upgrade to kernel 5.12 or newer".into(),
            Cause::NoPeerMemoryClient => match f.host.peer_memory_api {
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

/// What the facts allow: the zero-copy paths to try, in order, and the
/// causes that ruled the others out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Paths to try, best first.
    pub try_paths: Vec<RegistrationPath>,
    /// Why the paths not listed are unavailable.
    pub causes: Vec<Cause>,
}

/// Decides which zero-copy paths the facts allow (dma-buf before peer memory).
pub fn plan(f: &GdrFacts) -> Plan {
    let mut causes = Vec::new();
    if let Some(why) = &f.gpu.cuda_unavailable {
        causes.push(Cause::CudaUnavailable(why.clone()));
    }
    if f.gpu.gdr_supported == Some(false) {
        causes.push(Cause::GpuWithoutGdr);
    }
    let mut dma_buf = causes.is_empty();
    if let Some(v) = f.gpu.driver_version.filter(|&v| v < 11070) {
        causes.push(Cause::CudaTooOldForDmaBuf(v));
        dma_buf = false;
    } else if f.gpu.dma_buf_supported == Some(false) {
        causes.push(Cause::GpuWithoutDmaBuf);
        dma_buf = false;
    }
    if let DmaBufProbe::Unsupported(errno) = f.nic.dma_buf {
        causes.push(Cause::NicWithoutDmaBuf(errno));
        dma_buf = false;
    }
    if let Some((maj, min)) = f.host.kernel_version() {
        if (maj, min) < (5, 12) {
            causes.push(Cause::KernelTooOldForDmaBuf(f.host.kernel_release.clone().unwrap_or_default()));
            dma_buf = false;
        }
    }
    let gpu_ok = f.gpu.cuda_unavailable.is_none() && f.gpu.gdr_supported != Some(false);
    let peer = !f.host.peer_memory_found.is_empty();
    if !peer {
        causes.push(Cause::NoPeerMemoryClient);
    }
    let mut try_paths = Vec::new();
    if gpu_ok && dma_buf {
        try_paths.push(RegistrationPath::DmaBuf);
    }
    if gpu_ok && peer {
        try_paths.push(RegistrationPath::PeerMemory);
    }
    Plan { try_paths, causes }
}

impl GdrFacts {
    /// Gathers the facts live: CUDA for GPU `ordinal`, the dma-buf probe on
    /// the NIC of `pd`, and the host's files under `root` (`SysRoot::live()`
    /// on a real machine). Never fails: what cannot be learned is recorded
    /// as unknown or as the reason it is unavailable.
    pub fn gather(pd: &ProtectionDomain, ordinal: usize, root: &SysRoot) -> GdrFacts {
        GdrFacts { gpu: GpuFacts::gather(ordinal, root), nic: Self::gather_nic(pd), host: HostFacts::read(root) }
    }

    /// The NIC side alone: the dma-buf probe on the device of `pd`.
    pub fn gather_nic(pd: &ProtectionDomain) -> NicFacts {
        NicFacts { device: pd.context().name().to_owned(), dma_buf: DmaBufProbe::from_errno(MemoryRegion::probe_dmabuf(pd)) }
    }
}

impl GpuFacts {
    /// Asks CUDA about GPU `ordinal`.
    pub fn gather(ordinal: usize, root: &SysRoot) -> GpuFacts {
        let module = ModuleFlavour::read(root);
        let unknown = |why: String| GpuFacts {
            ordinal,
            label: format!("GPU{ordinal}"),
            pci_bus_id: None,
            cuda_unavailable: Some(why),
            driver_version: None,
            gdr_supported: None,
            dma_buf_supported: None,
            module: module.clone(),
        };
        match Gpu::open(ordinal) {
            Err(Error::CudaUnavailable(why)) => unknown(why),
            Err(e) => unknown(e.to_string()),
            Ok(gpu) => GpuFacts {
                ordinal,
                label: gpu.to_string(),
                pci_bus_id: Some(gpu.pci_bus_id().to_owned()),
                cuda_unavailable: None,
                driver_version: gpu::driver_version().ok(),
                gdr_supported: gpu.gpudirect_rdma_supported().ok(),
                dma_buf_supported: gpu.dma_buf_supported().ok(),
                module,
            },
        }
    }
}

impl MemoryRegion {
    /// Registers GPU memory for RDMA under `policy`, trying dma-buf, then
    /// peer memory, as the machine allows. The region reports the path
    /// used ([`MemoryRegion::location`]), which is also logged.
    ///
    /// # Errors
    /// With [`GpuPolicy::Require`], [`Error::Gdr`] listing every cause (what
    /// was checked, what it showed, the fix) when no zero-copy path works.
    /// With `Prefer` and `HostStaged`, only the errors of allocating and
    /// registering the host mirror ([`Error::Cuda`], [`Error::Verb`]).
    pub fn register_gpu(pd: &ProtectionDomain, buf: GpuBuffer, access: AccessFlags, policy: GpuPolicy) -> Result<MemoryRegion> {
        Self::register_gpu_at(pd, buf, access, policy, &SysRoot::live())
    }

    /// [`register_gpu`](Self::register_gpu) reading the host's files under `root`.
    ///
    /// # Errors
    /// As [`register_gpu`](Self::register_gpu).
    pub fn register_gpu_at(pd: &ProtectionDomain, buf: GpuBuffer, access: AccessFlags, policy: GpuPolicy, root: &SysRoot) -> Result<MemoryRegion> {
        if policy == GpuPolicy::HostStaged {
            return MemoryRegion::register_gpu_staged(pd, buf, access);
        }
        let facts = GdrFacts::gather(pd, buf.gpu().ordinal(), root);
        let Plan { try_paths, mut causes } = plan(&facts);
        let mut buf = Some(buf);
        for path in try_paths {
            let b = buf.take().expect("the buffer is put back after each failed try");
            let retry = match MemoryRegion::register_gpu_direct_or_return(pd, b, path, access) {
                Ok(mr) => return Ok(mr),
                Err((b, e)) => {
                    causes.push(Cause::RegistrationFailed { path, call: call_of(&e, path), error: detail(&e) });
                    b
                }
            };
            buf = Some(retry);
        }
        let err = GdrError { facts, causes };
        match policy {
            GpuPolicy::Prefer => {
                tracing::warn!("falling back to host staging: {err}");
                MemoryRegion::register_gpu_staged(pd, buf.expect("the buffer is back after the tries"), access)
            }
            _ => Err(Error::Gdr(Box::new(err))),
        }
    }
}

fn call_of(e: &Error, path: RegistrationPath) -> &'static str {
    match e {
        Error::Verb { verb, .. } => verb,
        Error::Cuda { call, .. } => call,
        _ if path == RegistrationPath::DmaBuf => "ibv_reg_dmabuf_mr",
        _ => "ibv_reg_mr",
    }
}

fn detail(e: &Error) -> String {
    match e {
        Error::Verb { errno, .. } => errno.to_string(),
        Error::Cuda { error, .. } => error.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An H200 with the open module, an mlx5 NIC, kernel 6.8, peermem loaded.
    fn good() -> GdrFacts {
        GdrFacts {
            gpu: GpuFacts {
                ordinal: 0,
                label: "GPU0 (NVIDIA H200, 0000:17:00.0)".into(),
                pci_bus_id: Some("0000:17:00.0".into()),
                cuda_unavailable: None,
                driver_version: Some(12080),
                gdr_supported: Some(true),
                dma_buf_supported: Some(true),
                module: ModuleFlavour::Open,
            },
            nic: NicFacts { device: "mlx5_0".into(), dma_buf: DmaBufProbe::Supported(Errno(libc::EBADF)) },
            host: HostFacts {
                kernel_release: Some("6.8.0-45-generic".into()),
                peer_memory_found: vec!["/sys/module/nvidia_peermem/version".into()],
                peer_memory_api: Some(true),
            },
        }
    }

    fn err(f: GdrFacts) -> GdrError {
        let p = plan(&f);
        assert!(p.try_paths.is_empty(), "{p:?}");
        GdrError { facts: f, causes: p.causes }
    }

    #[test]
    fn all_good_tries_dma_buf_then_peer_memory() {
        let p = plan(&good());
        assert_eq!(p.try_paths, vec![RegistrationPath::DmaBuf, RegistrationPath::PeerMemory]);
        assert!(p.causes.is_empty());
    }

    #[test]
    fn gpu_without_gdr_rules_out_both() {
        let mut f = good();
        f.gpu.gdr_supported = Some(false);
        let e = err(f);
        assert!(e.has(|c| *c == Cause::GpuWithoutGdr));
        let s = e.to_string();
        assert!(s.contains("[both paths] GPU0 (NVIDIA H200, 0000:17:00.0) reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 0"), "{s}");
        assert!(s.contains("fix: this GPU model cannot do GPUDirect RDMA (GeForce"), "{s}");
    }

    #[test]
    fn proprietary_module_without_dma_buf_falls_to_peer_memory() {
        let mut f = good();
        f.gpu.dma_buf_supported = Some(false);
        f.gpu.module = ModuleFlavour::Proprietary;
        let p = plan(&f);
        assert_eq!(p.try_paths, vec![RegistrationPath::PeerMemory]);
        assert_eq!(p.causes, vec![Cause::GpuWithoutDmaBuf]);
        let f2 = f.clone();
        f.host.peer_memory_found.clear();
        let e = err(f);
        let s = e.to_string();
        assert!(s.contains("reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0; the proprietary kernel module is loaded"), "{s}");
        assert!(s.contains("fix: install the open kernel module flavour (nvidia-open"), "{s}");
        assert!(s.contains("[peer memory] none of /sys/kernel/mm/memory_peers/nv_mem/version"), "{s}");
        assert!(s.contains("fix: `modprobe nvidia-peermem`"), "{s}");
        drop(f2);
    }

    #[test]
    fn old_cuda_rules_out_dma_buf() {
        let mut f = good();
        f.gpu.driver_version = Some(11040);
        f.host.peer_memory_found.clear();
        let e = err(f);
        assert!(e.has(|c| *c == Cause::CudaTooOldForDmaBuf(11040)));
        assert!(e.to_string().contains("the CUDA driver is 11.4, dma-buf export needs 11.7 or newer"), "{e}");
    }

    #[test]
    fn nic_without_dma_buf_is_named_with_its_errno() {
        let mut f = good();
        f.nic = NicFacts { device: "rxe0".into(), dma_buf: DmaBufProbe::from_errno(Errno(libc::EOPNOTSUPP)) };
        f.host.peer_memory_found.clear();
        f.host.peer_memory_api = Some(false);
        let e = err(f);
        let s = e.to_string();
        assert!(s.contains("[dma-buf] rxe0: ibv_reg_dmabuf_mr(fd = -1) probe answered EOPNOTSUPP (Operation not supported)"), "{s}");
        assert!(s.contains("Soft-RoCE (rxe) never does"), "{s}");
        assert!(s.contains("no ib_register_peer_memory_client (inbox ib_core)"), "{s}");
        assert!(s.contains("dma-buf is the supported path on inbox kernels"), "{s}");
        assert!(s.contains("GpuPolicy::Prefer"), "{s}");
        assert_eq!(DmaBufProbe::from_errno(Errno(libc::EPROTONOSUPPORT)), DmaBufProbe::Unsupported(Errno(libc::EPROTONOSUPPORT)));
        assert_eq!(DmaBufProbe::from_errno(Errno(libc::EBADF)), DmaBufProbe::Supported(Errno(libc::EBADF)));
    }

    #[test]
    fn old_kernel_rules_out_dma_buf() {
        let mut f = good();
        f.host.kernel_release = Some("5.10.0-32-amd64".into());
        let p = plan(&f);
        assert_eq!(p.try_paths, vec![RegistrationPath::PeerMemory]);
        assert_eq!(p.causes, vec![Cause::KernelTooOldForDmaBuf("5.10.0-32-amd64".into())]);
        let f = GdrFacts { host: HostFacts { peer_memory_found: vec![], ..f.host.clone() }, ..f };
        assert!(err(f).to_string().contains("kernel 5.10.0-32-amd64 predates dma-buf memory regions (5.12)"));
    }

    #[test]
    fn no_cuda_names_the_driver() {
        let mut f = good();
        f.gpu.cuda_unavailable = Some("the CUDA driver library (libcuda.so.1) cannot be loaded".into());
        f.gpu.gdr_supported = None;
        f.gpu.dma_buf_supported = None;
        f.gpu.driver_version = None;
        let e = err(f);
        assert!(e.to_string().contains("[both paths] CUDA could not be used for GPU0"), "{e}");
    }

    #[test]
    fn registration_failures_get_their_own_fixes() {
        let f = good();
        let c = Cause::RegistrationFailed { path: RegistrationPath::PeerMemory, call: "ibv_reg_mr", error: "EFAULT (Bad address)".into() };
        assert!(c.fix(&f).contains("modprobe nvidia-peermem"));
        let c = Cause::RegistrationFailed { path: RegistrationPath::DmaBuf, call: "ibv_reg_dmabuf_mr", error: "ENOMEM (Cannot allocate memory)".into() };
        assert!(c.fix(&f).contains("BAR1"));
        assert_eq!(c.path(), Some(RegistrationPath::DmaBuf));
    }

    #[test]
    fn host_facts_from_fixture_trees() {
        let dir = std::env::temp_dir().join(format!("gdr-host-facts-{}", std::process::id()));
        let root = SysRoot::at(&dir);
        let write = |p: &str, text: &str| {
            let path = root.path(p);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text).unwrap();
        };
        write("/proc/sys/kernel/osrelease", "6.1.0-27-amd64\n");
        write("/proc/kallsyms", "ffffffffc0a01230 T ib_register_peer_memory_client\t[ib_core]\nffffffffc0a01300 t other\n");
        write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build\nGCC version: gcc 12\n");
        let h = HostFacts::read(&root);
        assert_eq!(h.kernel_version(), Some((6, 1)));
        assert_eq!(h.peer_memory_api, Some(true));
        assert!(h.peer_memory_found.is_empty());
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::Open);
        write("/sys/module/nvidia_peermem/version", "1.0\n");
        write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n");
        let h = HostFacts::read(&root);
        assert_eq!(h.peer_memory_found, vec!["/sys/module/nvidia_peermem/version".to_string()]);
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::Proprietary);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::NotLoaded);
        assert_eq!(HostFacts::read(&root).peer_memory_api, None);
    }

    #[test]
    fn policies_parse() {
        assert_eq!("require".parse::<GpuPolicy>().unwrap(), GpuPolicy::Require);
        assert_eq!("Prefer".parse::<GpuPolicy>().unwrap(), GpuPolicy::Prefer);
        assert_eq!("host-staged".parse::<GpuPolicy>().unwrap(), GpuPolicy::HostStaged);
        assert!("always".parse::<GpuPolicy>().is_err());
        assert_eq!(GpuPolicy::default(), GpuPolicy::Require);
    }
}
