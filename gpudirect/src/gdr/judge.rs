//! The one judge of GPUDirect RDMA: each fact judged once ([`Judgement`]),
//! and the paths they leave ([`plan`]). A registration under
//! [`GpuPolicy::Require`](crate::GpuPolicy::Require) and `gpudirect doctor`
//! both decide from these.

use crate::error::gdr::{Cause, Sides};
use super::facts::{DmaBufProbe, GdrFacts, GpuFacts, HostFacts, NicFacts, PEER_MEMORY_FILES};
use crate::policy::RegistrationPath;

/// What the facts allow: the zero-copy paths to try, in order, and the
/// causes that ruled the others out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Paths to try, best first.
    pub try_paths: Vec<RegistrationPath>,
    /// Why the paths not listed are unavailable.
    pub causes: Vec<Cause>,
}

/// A fact the choice of registration path rests on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Fact {
    /// Whether CUDA answers for the GPU and its
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` (116).
    GpuGdr,
    /// Whether the GPU can export dma-buf: the driver's CUDA version and
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (124).
    GpuDmaBuf,
    /// Whether the NIC's provider can register dma-buf (the `fd = -1` probe).
    NicDmaBuf,
    /// Whether the kernel has dma-buf memory regions (5.12).
    KernelDmaBuf,
    /// Whether a peer-memory client (`nvidia-peermem`) is loaded.
    PeerMemory,
}

/// One fact, judged once: what it rules out (if anything), what was read,
/// and the fix. [`plan`] is these judgements taken together; `gpudirect
/// doctor` prints each as a finding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judgement {
    /// Which fact.
    pub fact: Fact,
    /// What the fact rules out and why ([`Cause::path`]); `None` when it
    /// rules out nothing.
    pub cause: Option<Cause>,
    /// Whether the fact could be learned. An unknown fact rules nothing
    /// out: the registration itself will tell.
    pub known: bool,
    /// One line: what was found.
    pub summary: String,
    /// What was read to reach it.
    pub evidence: Vec<String>,
    /// What to do, when the fact rules something out.
    pub fix: Option<String>,
}

impl Judgement {
    fn ok(fact: Fact, summary: String, evidence: String) -> Self {
        Judgement { fact, cause: None, known: true, summary, evidence: vec![evidence], fix: None }
    }

    fn unknown(fact: Fact, summary: String, evidence: Vec<String>) -> Self {
        Judgement { fact, cause: None, known: false, summary, evidence, fix: None }
    }

    fn against(fact: Fact, cause: Cause, sides: &Sides<'_>, summary: String, evidence: Vec<String>) -> Self {
        let fix = Some(cause.fix_on(sides));
        Judgement { fact, cause: Some(cause), known: true, summary, evidence, fix }
    }

    /// The zero-copy paths this fact rules out (none, one or both).
    pub fn rules_out(&self) -> &'static [RegistrationPath] {
        match self.cause.as_ref().map(Cause::path) {
            None => &[],
            Some(None) => &[RegistrationPath::DmaBuf, RegistrationPath::PeerMemory],
            Some(Some(RegistrationPath::DmaBuf)) => &[RegistrationPath::DmaBuf],
            Some(Some(_)) => &[RegistrationPath::PeerMemory],
        }
    }
}

impl GpuFacts {
    /// Judges the GPU's facts: [`Fact::GpuGdr`], then [`Fact::GpuDmaBuf`].
    pub fn judge(&self) -> [Judgement; 2] {
        let sides = Sides { gpu: Some(self), ..Sides::default() };
        let gpu = &self.label;
        let gdr = match (&self.cuda_unavailable, self.gdr_supported) {
            (Some(why), _) => {
                let c = Cause::CudaUnavailable(why.clone());
                Judgement::against(Fact::GpuGdr, c.clone(), &sides, c.checked_on(&sides), vec![why.clone()])
            }
            (None, Some(true)) => Judgement::ok(
                Fact::GpuGdr,
                format!("{gpu} supports GPUDirect RDMA"),
                "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 1".into(),
            ),
            (None, Some(false)) => Judgement::against(
                Fact::GpuGdr,
                Cause::GpuWithoutGdr,
                &sides,
                format!("{gpu} does not support GPUDirect RDMA"),
                vec!["CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 0".into()],
            ),
            (None, None) => Judgement::unknown(Fact::GpuGdr, format!("{gpu}: attribute 116 unreadable"), vec![]),
        };
        let old_driver = self.driver_version.filter(|&v| v < 11070);
        // The module flavour is evidence for this fact, never a verdict of
        // its own: attribute 124 is CUDA's answer and already accounts for it.
        let module = format!("NVIDIA kernel module: {} (/proc/driver/nvidia/version)", self.module);
        let mut dma_buf = match (&self.cuda_unavailable, old_driver, self.dma_buf_supported) {
            (Some(why), _, _) => Judgement::unknown(Fact::GpuDmaBuf, format!("{gpu}: dma-buf export not checked (CUDA unavailable)"), vec![why.clone()]),
            (None, Some(v), _) => {
                let c = Cause::CudaTooOldForDmaBuf(v);
                Judgement::against(Fact::GpuDmaBuf, c.clone(), &sides, format!("{gpu} cannot export dma-buf: {}", c.checked_on(&sides)), vec![])
            }
            (None, None, Some(true)) => Judgement::ok(
                Fact::GpuDmaBuf,
                format!("{gpu} can export dma-buf"),
                "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 1".into(),
            ),
            (None, None, Some(false)) => Judgement::against(
                Fact::GpuDmaBuf,
                Cause::GpuWithoutDmaBuf,
                &sides,
                format!("{gpu} cannot export dma-buf"),
                vec!["CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0".into()],
            ),
            (None, None, None) => Judgement::unknown(Fact::GpuDmaBuf, format!("{gpu}: attribute 124 unreadable"), vec![]),
        };
        dma_buf.evidence.push(module);
        [gdr, dma_buf]
    }
}

impl NicFacts {
    /// Judges the NIC's fact: [`Fact::NicDmaBuf`].
    pub fn judge(&self) -> Judgement {
        let sides = Sides { nic: Some(self), ..Sides::default() };
        let nic = &self.device;
        match self.dma_buf {
            DmaBufProbe::Supported(errno) => Judgement::ok(
                Fact::NicDmaBuf,
                format!("{nic} can register dma-buf memory"),
                format!("ibv_reg_dmabuf_mr(fd = -1) answered {errno}"),
            ),
            DmaBufProbe::Unsupported(errno) => Judgement::against(
                Fact::NicDmaBuf,
                Cause::NicWithoutDmaBuf(errno),
                &sides,
                format!("{nic} cannot register dma-buf memory"),
                vec![format!("ibv_reg_dmabuf_mr(fd = -1) answered {errno}")],
            ),
        }
    }
}

impl HostFacts {
    /// Judges the host's facts: [`Fact::KernelDmaBuf`], then [`Fact::PeerMemory`].
    pub fn judge(&self) -> [Judgement; 2] {
        let sides = Sides { host: Some(self), ..Sides::default() };
        let release = self.kernel_release.clone().unwrap_or_else(|| "unknown".into());
        let kernel = match self.kernel_version() {
            Some(v) if v >= (5, 12) => Judgement::ok(
                Fact::KernelDmaBuf,
                format!("kernel {release} supports dma-buf memory regions (5.12+)"),
                "/proc/sys/kernel/osrelease".into(),
            ),
            Some(_) => Judgement::against(
                Fact::KernelDmaBuf,
                Cause::KernelTooOldForDmaBuf(release.clone()),
                &sides,
                format!("kernel {release} predates dma-buf memory regions (5.12)"),
                vec!["/proc/sys/kernel/osrelease".into()],
            ),
            None => Judgement::unknown(Fact::KernelDmaBuf, "kernel release unreadable (/proc/sys/kernel/osrelease)".into(), vec![]),
        };
        let api = match self.peer_memory_api {
            Some(true) => "/proc/kallsyms: ib_register_peer_memory_client present (MLNX/DOCA OFED ib_core)",
            Some(false) => "/proc/kallsyms: no ib_register_peer_memory_client (inbox ib_core)",
            None => "/proc/kallsyms: unreadable",
        };
        let peer = if self.peer_memory_found.is_empty() {
            Judgement::against(
                Fact::PeerMemory,
                Cause::NoPeerMemoryClient,
                &sides,
                "no peer-memory client is loaded".into(),
                vec![format!("none of {} exists", PEER_MEMORY_FILES.join(", ")), api.into()],
            )
        } else {
            Judgement {
                evidence: vec![api.into()],
                ..Judgement::ok(Fact::PeerMemory, format!("peer-memory client loaded: {}", self.peer_memory_found.join(", ")), String::new())
            }
        };
        [kernel, peer]
    }
}

impl GdrFacts {
    /// Every fact judged, GPU, NIC and host in that order.
    pub fn judge(&self) -> Vec<Judgement> {
        let mut all = Vec::with_capacity(5);
        all.extend(self.gpu.judge());
        all.push(self.nic.judge());
        all.extend(self.host.judge());
        all
    }
}

/// Decides which zero-copy paths the facts allow (dma-buf before peer
/// memory): those no judgement rules out.
pub fn plan(f: &GdrFacts) -> Plan {
    let judged = f.judge();
    let open = |p: RegistrationPath| judged.iter().all(|j| !j.rules_out().contains(&p));
    let try_paths = [RegistrationPath::DmaBuf, RegistrationPath::PeerMemory].into_iter().filter(|&p| open(p)).collect();
    Plan { try_paths, causes: judged.into_iter().filter_map(|j| j.cause).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::errno::Errno;
    use crate::error::gdr::GdrError;
    use crate::gdr::facts::ModuleFlavour;

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
    fn each_fact_is_judged_once_and_the_plan_is_their_sum() {
        let j = good().judge();
        let facts: Vec<Fact> = j.iter().map(|j| j.fact).collect();
        assert_eq!(facts, [Fact::GpuGdr, Fact::GpuDmaBuf, Fact::NicDmaBuf, Fact::KernelDmaBuf, Fact::PeerMemory]);
        assert!(j.iter().all(|j| j.known && j.cause.is_none() && j.rules_out().is_empty() && j.fix.is_none()), "{j:#?}");
        // The classic ConnectX deployment: a provider without dma-buf, with
        // nvidia-peermem loaded. Only the NIC's fact rules anything out, and
        // only dma-buf.
        let mut f = good();
        f.nic.dma_buf = DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP));
        let nic = f.nic.judge();
        assert_eq!(nic.rules_out(), [RegistrationPath::DmaBuf]);
        assert_eq!(nic.summary, "mlx5_0 cannot register dma-buf memory");
        assert_eq!(nic.evidence, ["ibv_reg_dmabuf_mr(fd = -1) answered EOPNOTSUPP (Operation not supported)"]);
        assert!(nic.fix.as_deref().unwrap().contains("rdma-core 34+"));
        assert_eq!(plan(&f).try_paths, [RegistrationPath::PeerMemory]);
        // Unknown facts rule nothing out; CUDA unavailable rules out both.
        f.gpu.gdr_supported = None;
        f.gpu.dma_buf_supported = None;
        let [gdr, dmabuf] = f.gpu.judge();
        assert!(!gdr.known && !dmabuf.known && gdr.rules_out().is_empty() && dmabuf.rules_out().is_empty());
        f.gpu.cuda_unavailable = Some("libcuda.so.1 cannot be loaded".into());
        let [gdr, _] = f.gpu.judge();
        assert_eq!(gdr.rules_out(), [RegistrationPath::DmaBuf, RegistrationPath::PeerMemory]);
        assert!(plan(&f).try_paths.is_empty());
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
}
