//! Running every check and reaching the verdict.

use serde::Serialize;

use gpudirect::gdr::{plan, GdrError, GdrFacts, GpuFacts, HostFacts, NicFacts, RegistrationPath};

use super::pci::{self, PathLevel};
use super::probes::Probes;
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
}

/// Whether GPUDirect RDMA works here, for which pair, by which path.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Verdict {
    /// GPUDirect RDMA can be used between at least one GPU and one NIC.
    pub available: bool,
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
    /// NCCL's default `NCCL_NET_GDR_LEVEL` would use GDR for this pair.
    nccl_default: Option<bool>,
    blocked: Vec<String>,
}

/// Runs every check and decides.
pub fn run(m: &Machine, probes: &dyn Probes, opts: &Options) -> Report {
    let root = &m.root;
    let rdma = probes.rdma();
    let gpus = probes.gpus(root);
    let host = HostFacts::read(root);
    let topo = pci::discover(root);
    let pairs = pci::pairs(root, &topo);

    let mut findings = stack::rdma(root, &rdma);
    findings.extend(stack::cuda(root, &gpus));
    findings.extend(stack::host(&host));
    findings.extend(pci::check(root, &topo, &m.env));
    findings.extend(env::check(&m.env));

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
            let path = p.try_paths.first().copied().ok_or(GdrError { facts, causes: p.causes });
            let pair = pairs.iter().find(|pr| Some(&pr.gpu) == g.pci_bus_id.as_ref() && pr.nic == d.name);
            let level = pair.map(|pr| pr.level);
            let nccl_default = pair.map(|pr| pr.gdr_by_default);
            // Failures of checks about this pair's path (ACS on its bridges,
            // the NIC's port) block it whatever the registration path.
            let blocked = findings
                .iter()
                .filter(|f| f.status == Status::Fail)
                .filter(|f| {
                    f.check.ends_with(&format!(".{}", d.name))
                        || f.check == "rdma.uverbs"
                        || pair.is_some_and(|pr| pr.bridges.iter().any(|b| f.check == format!("acs.bridge.{b}")))
                })
                .map(|f| f.summary.clone())
                .collect();
            candidates.push(Candidate { gpu: g.clone(), nic: d.name.clone(), path, level, nccl_default, blocked });
        }
    }
    let verdict = decide(&candidates, &rdma, &gpus);
    Report { schema: SCHEMA_VERSION, verdict, findings }
}

fn decide(cands: &[Candidate], rdma: &Result<Vec<super::probes::RdmaDevice>, String>, gpus: &Result<Vec<GpuFacts>, String>) -> Verdict {
    let not = |why: String| Verdict { available: false, line: format!("GPUDirect RDMA: not available: {why}"), path: None, gpu: None, nic: None, topology: None };
    match (rdma, gpus) {
        (Err(e), _) => return not(format!("no RDMA device can be used ({e})")),
        (Ok(v), _) if v.is_empty() => return not("no RDMA device is visible".into()),
        (_, Err(e)) => return not(format!("CUDA cannot be used ({e})")),
        (_, Ok(v)) if v.is_empty() => return not("CUDA sees no GPU".into()),
        _ => {}
    }
    let best = cands
        .iter()
        .filter(|c| c.path.is_ok() && c.blocked.is_empty())
        .min_by_key(|c| (c.level.unwrap_or(PathLevel::Sys), c.path.as_ref().map(|p| *p != RegistrationPath::DmaBuf).unwrap_or(true)));
    if let Some(c) = best {
        let path = c.path.as_ref().map(|p| p.to_string()).unwrap_or_default();
        let level = c.level.map(|l| l.to_string());
        let mut line = format!("GPUDirect RDMA: available via {path} for {} <-> {}", c.gpu.label, c.nic);
        match c.level {
            Some(l) => {
                line.push_str(&format!(" ({l})"));
                if c.nccl_default == Some(false) {
                    line.push_str(&format!("; NCCL's default NCCL_NET_GDR_LEVEL (PXB) will not use it across {l}"));
                }
            }
            None => line.push_str(" (PCIe path unknown)"),
        }
        return Verdict { available: true, line, path: Some(path), gpu: Some(c.gpu.label.clone()), nic: Some(c.nic.clone()), topology: level };
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
        line: format!("GPUDirect RDMA: not available for {} <-> {}: {why}", c.gpu.label, c.nic),
        path: None,
        gpu: Some(c.gpu.label.clone()),
        nic: Some(c.nic.clone()),
        topology: c.level.map(|l| l.to_string()),
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.verdict.line)?;
        for x in &self.findings {
            writeln!(f, "[{:<7}] {}: {}", x.status.to_string(), x.check, x.summary)?;
            for e in &x.evidence {
                writeln!(f, "            evidence: {e}")?;
            }
            if let Some(fix) = &x.fix {
                writeln!(f, "            fix: {fix}")?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::probes::RdmaDevice;
    use gpudirect::gdr::{DmaBufProbe, ModuleFlavour};
    use gpudirect::sysroot::SysRoot;
    use gpudirect::Errno;

    struct Fake {
        nics: Vec<(&'static str, DmaBufProbe)>,
        gpus: Vec<(&'static str, bool)>,
    }

    impl Probes for Fake {
        fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
            Ok(self
                .nics
                .iter()
                .map(|(name, probe)| RdmaDevice {
                    name: name.to_string(),
                    fw_ver: "28.39.1002".into(),
                    ports: vec![gpudirect::PortAttr {
                        port: 1,
                        state: gpudirect::PortState::Active,
                        max_mtu: Some(gpudirect::Mtu::Mtu4096),
                        active_mtu: Some(gpudirect::Mtu::Mtu4096),
                        lid: 7,
                        link_layer: gpudirect::LinkLayer::InfiniBand,
                        gid_table_len: 1,
                    }],
                    gids: vec![],
                    chosen_gid: Err("not queried in this test".into()),
                    dma_buf: Ok(*probe),
                })
                .collect())
        }
        fn gpus(&self, _: &SysRoot) -> Result<Vec<GpuFacts>, String> {
            Ok(self
                .gpus
                .iter()
                .enumerate()
                .map(|(i, (bdf, dmabuf))| GpuFacts {
                    ordinal: i,
                    label: format!("GPU{i} (NVIDIA H100, {bdf})"),
                    pci_bus_id: Some(bdf.to_string()),
                    cuda_unavailable: None,
                    driver_version: Some(12080),
                    gdr_supported: Some(true),
                    dma_buf_supported: Some(*dmabuf),
                    module: ModuleFlavour::Open,
                })
                .collect())
        }
    }

    fn machine(name: &str) -> Machine {
        Machine { root: SysRoot::at(format!("{}/tests/data/machines/{name}", env!("CARGO_MANIFEST_DIR"))), env: vec![] }
    }

    const CAPABLE: DmaBufProbe = DmaBufProbe::Supported(Errno(libc::EBADF));

    #[test]
    fn dgx_pix_is_available_via_dma_buf() {
        let p = Fake { nics: vec![("mlx5_0", CAPABLE), ("mlx5_1", CAPABLE)], gpus: vec![("0000:18:00.0", true), ("0000:3a:00.0", true)] };
        let r = run(&machine("dgx-pix"), &p, &Options::default());
        assert!(r.verdict.available, "{r}");
        assert_eq!(r.verdict.line, "GPUDirect RDMA: available via dma-buf for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (PIX)");
        assert_eq!(r.verdict.topology.as_deref(), Some("PIX"));
        let json = serde_json::to_value(&r).unwrap();
        assert_eq!(json["schema"], 1);
        assert_eq!(json["verdict"]["path"], "dma-buf");
        assert!(json["findings"].as_array().unwrap().iter().all(|f| f["check"].is_string() && f["status"].is_string()));
        // Selecting the other GPU picks its own switch's NIC.
        let r = run(&machine("dgx-pix"), &p, &Options { gpu: Some(1), device: None });
        assert!(r.verdict.line.ends_with("GPU1 (NVIDIA H100, 0000:3a:00.0) <-> mlx5_1 (PIX)"), "{}", r.verdict.line);
    }

    #[test]
    fn without_gpu_dma_buf_peer_memory_is_needed() {
        let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:18:00.0", false)] };
        let r = run(&machine("dgx-pix"), &p, &Options::default());
        assert!(!r.verdict.available);
        assert!(r.verdict.line.contains("reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0"), "{}", r.verdict.line);
    }

    #[test]
    fn acs_redirect_blocks_the_pair() {
        let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:03:00.0", true)] };
        let r = run(&machine("acs-redirect"), &p, &Options::default());
        assert!(!r.verdict.available, "{r}");
        assert!(r.verdict.line.starts_with("GPUDirect RDMA: not available for GPU0 (NVIDIA H100, 0000:03:00.0) <-> mlx5_0: "), "{}", r.verdict.line);
        assert!(r.verdict.line.to_lowercase().contains("acs"), "{}", r.verdict.line);
    }

    #[test]
    fn cross_socket_pair_works_but_nccl_will_not_use_it() {
        let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:3b:00.0", true)] };
        let r = run(&machine("two-socket-sys"), &p, &Options::default());
        assert!(r.verdict.available, "{r}");
        assert!(r.verdict.line.contains("(SYS); NCCL's default NCCL_NET_GDR_LEVEL (PXB) will not use it across SYS"), "{}", r.verdict.line);
    }

    #[test]
    fn soft_roce_names_the_provider() {
        let p = Fake { nics: vec![("rxe0", DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP)))], gpus: vec![("0000:00:04.0", true)] };
        let r = run(&machine("vm-soft-roce"), &p, &Options::default());
        assert!(!r.verdict.available);
        assert!(r.verdict.line.contains("rxe0: ibv_reg_dmabuf_mr(fd = -1) probe answered EOPNOTSUPP"), "{}", r.verdict.line);
    }

    #[test]
    fn no_rdma_or_no_cuda_are_named() {
        struct None_;
        impl Probes for None_ {
            fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
                Err("no RDMA subsystem in this kernel".into())
            }
            fn gpus(&self, _: &SysRoot) -> Result<Vec<GpuFacts>, String> {
                Err("CUDA is not available".into())
            }
        }
        let r = run(&machine("container-no-ib"), &None_, &Options::default());
        assert_eq!(r.verdict.line, "GPUDirect RDMA: not available: no RDMA device can be used (no RDMA subsystem in this kernel)");
        assert!(r.to_string().starts_with("GPUDirect RDMA: not available"));
    }
}
