//! The verdict on fixture machines and probe answers.

use super::*;
use crate::doctor::probes::RdmaDevice;
use gpudirect::gdr::{DmaBufProbe, HostFacts, ModuleFlavour};
use gpudirect::sysroot::SysRoot;
use gpudirect::Errno;

struct Fake {
    nics: Vec<(&'static str, DmaBufProbe)>,
    gpus: Vec<(&'static str, bool)>,
    /// Replaces the machine's host facts when set.
    host: Option<HostFacts>,
}

/// An active InfiniBand NIC answering the dma-buf probe with `probe`.
fn device(name: &str, probe: DmaBufProbe) -> RdmaDevice {
    RdmaDevice {
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
        dma_buf: Ok(probe),
    }
}

impl Probes for Fake {
    fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
        Ok(self.nics.iter().map(|(name, probe)| device(name, *probe)).collect())
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
    fn host(&self, root: &SysRoot) -> HostFacts {
        self.host.clone().unwrap_or_else(|| HostFacts::read(root))
    }
}

fn machine(name: &str) -> Machine {
    Machine::new(SysRoot::at(testkit::machine(name)), vec![])
}

const CAPABLE: DmaBufProbe = DmaBufProbe::Supported(Errno(libc::EBADF));

#[test]
fn dgx_pix_is_available_via_dma_buf() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE), ("mlx5_1", CAPABLE)], gpus: vec![("0000:18:00.0", true), ("0000:3a:00.0", true)], host: None };
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

/// The first line is what NCCL will do in the job's environment: the
/// hardware of dgx-pix allows dma-buf GPUDirect RDMA on both GPUs'
/// own NICs, and each form of environment either leaves it on or
/// says which variable stops it and how to undo it (exit 1).
#[test]
fn the_verdict_is_what_nccl_does_in_the_jobs_environment() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE), ("mlx5_1", CAPABLE)], gpus: vec![("0000:18:00.0", true), ("0000:3a:00.0", true)], host: None };
    let gpu0 = "GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0";
    let stopped = |why: &str| format!("GPUDirect RDMA: the hardware allows it for {gpu0} (dma-buf, PIX), but NCCL with this environment will not use it: {why}");
    // (environment, Ok(first line) when NCCL keeps it, Err(first line) when not)
    type Case<'a> = (Vec<(&'a str, &'a str)>, Result<String, String>);
    let cases: Vec<Case> = vec![
        (vec![], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_IB_DISABLE", "1")], Err(stopped("NCCL_IB_DISABLE=1 turns NCCL's InfiniBand/RoCE transport off"))),
        (vec![("NCCL_IB_DISABLE", "yes")], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_IB_DISABLE", "1"), ("NCCL_IB_DISABLE", "0")], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_NET", "Socket")], Err(stopped("NCCL_NET=Socket selects a TCP socket transport"))),
        (vec![("NCCL_NET", "IB")], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_NET_GDR_LEVEL", "LOC")], Err(stopped("NCCL_NET_GDR_LEVEL=LOC allows GPUDirect RDMA only up to LOC, and this pair is PIX"))),
        (vec![("NCCL_NET_GDR_LEVEL", "0")], Err(stopped("NCCL_NET_GDR_LEVEL=0 (= LOC) allows GPUDirect RDMA only up to LOC"))),
        (vec![("NCCL_NET_GDR_LEVEL", "PIX")], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_IB_HCA", "=mlx5_1:1")], Ok(
            "GPUDirect RDMA: available via dma-buf for GPU1 (NVIDIA H100, 0000:3a:00.0) <-> mlx5_1 (PIX); not on the nearer GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0: NCCL_IB_HCA==mlx5_1:1 leaves out mlx5_0".into(),
        )),
        (vec![("NCCL_IB_HCA", "mlx5")], Ok(format!("GPUDirect RDMA: available via dma-buf for {gpu0} (PIX)"))),
        (vec![("NCCL_IB_HCA", "^mlx5")], Err(stopped("NCCL_IB_HCA=^mlx5 leaves out mlx5_0"))),
        (vec![("NCCL_IB_HCA", "mlx5_0:2,mlx5_1:2")], Err(stopped("NCCL_IB_HCA=mlx5_0:2,mlx5_1:2 leaves out mlx5_0"))),
    ];
    for (vars, want) in cases {
        let m = Machine::new(SysRoot::at(testkit::machine("dgx-pix")), vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        let r = run(&m, &p, &Options::default());
        let v = &r.verdict;
        println!("{vars:?}: {}", v.line);
        match &want {
            Ok(line) => {
                assert!(v.available && v.hardware_allows && v.environment.is_none(), "{vars:?}: {}", v.line);
                assert!(v.line.starts_with(line.as_str()), "{vars:?}:\n got {}\nwant {line}", v.line);
            }
            Err(line) => {
                assert!(!v.available && v.hardware_allows, "{vars:?}: {}", v.line);
                assert!(v.line.starts_with(line.as_str()), "{vars:?}:\n got {}\nwant {line}", v.line);
                assert!(v.environment.as_deref().is_some_and(|e| v.line.ends_with(e)), "{vars:?}");
                assert!(v.line.contains("unset") || v.line.contains("set NCCL_IB_HCA"), "the fix is named: {}", v.line);
            }
        }
    }
}

/// Per GPU, the NIC NCCL will use and the one it should: on dgx-pix each
/// GPU has its own PIX NIC; `NCCL_IB_HCA` naming one of them sends the
/// other GPU across the host bridges (warn, with the value that gives
/// each its own); a GDR level below PIX keeps the NIC but not GPUDirect
/// RDMA (fail); with the transport off there is no NIC to name.
#[test]
fn each_gpu_gets_the_nic_nccl_will_use_and_the_one_it_should() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE), ("mlx5_1", CAPABLE)], gpus: vec![("0000:18:00.0", true), ("0000:3a:00.0", true)], host: None };
    let judge = |vars: &[(&str, &str)]| {
        let m = Machine::new(SysRoot::at(testkit::machine("dgx-pix")), vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect());
        let r = run(&m, &p, &Options::default());
        let get = |g: usize| r.findings.iter().find(|f| f.check == format!("nccl.nic.gpu{g}")).cloned().unwrap_or_else(|| panic!("no nccl.nic.gpu{g}: {r}"));
        (get(0), get(1))
    };
    let (g0, g1) = judge(&[]);
    assert_eq!((g0.status, g1.status), (Status::Ok, Status::Ok));
    assert_eq!(g0.summary, "GPU0 (NVIDIA H100, 0000:18:00.0): NCCL will use mlx5_0 (PIX), the nearest NIC, with GPUDirect RDMA");
    let (g0, g1) = judge(&[("NCCL_IB_HCA", "=mlx5_1:1")]);
    assert_eq!(g0.status, Status::Warn, "{g0:?}");
    assert!(g0.summary.contains("NCCL will use mlx5_1 (NODE), not the nearest mlx5_0 (PIX)"), "{}", g0.summary);
    assert_eq!(g0.fix.as_deref(), Some("set NCCL_IB_HCA==mlx5_0:1,mlx5_1:1: every GPU's nearest NIC"));
    assert_eq!(g1.status, Status::Ok);
    let (g0, _) = judge(&[("NCCL_NET_GDR_LEVEL", "LOC")]);
    assert_eq!(g0.status, Status::Fail);
    assert!(g0.summary.contains("NCCL will use mlx5_0 (PIX) without GPUDirect RDMA: NCCL_NET_GDR_LEVEL=LOC"), "{}", g0.summary);
    let (g0, _) = judge(&[("NCCL_IB_DISABLE", "1")]);
    assert_eq!(g0.status, Status::Skipped);
    let (g0, _) = judge(&[("NCCL_IB_HCA", "^mlx5")]);
    assert_eq!((g0.status, g0.fix.as_deref()), (Status::Fail, Some("set NCCL_IB_HCA==mlx5_0:1,mlx5_1:1")));
}

/// With dma-buf the only path (no nvidia-peermem), NCCL_DMABUF_ENABLE=0
/// stops NCCL; with nvidia-peermem loaded as well, NCCL falls back to
/// peer memory and keeps GPUDirect RDMA.
#[test]
fn dmabuf_enable_0_stops_nccl_only_where_dma_buf_is_the_only_path() {
    let host = |peermem: bool| HostFacts {
        kernel_release: Some("6.8.0-45-generic".into()),
        peer_memory_found: if peermem { vec!["/sys/module/nvidia_peermem/version".into()] } else { vec![] },
        peer_memory_api: Some(peermem),
    };
    let env = vec![("NCCL_DMABUF_ENABLE".to_string(), "0".to_string())];
    let m = Machine::new(SysRoot::at(testkit::machine("dgx-pix")), env);
    let only = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:18:00.0", true)], host: Some(host(false)) };
    let r = run(&m, &only, &Options::default());
    assert!(!r.verdict.available && r.verdict.hardware_allows, "{}", r.verdict.line);
    assert!(r.verdict.line.ends_with("NCCL_DMABUF_ENABLE=0 turns dma-buf off, the only registration path here (nvidia-peermem is not loaded): unset it"), "{}", r.verdict.line);
    let both = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:18:00.0", true)], host: Some(host(true)) };
    let r = run(&m, &both, &Options::default());
    assert!(r.verdict.available, "{}", r.verdict.line);
    // ... and the line names the path NCCL will take.
    assert!(r.verdict.line.starts_with("GPUDirect RDMA: available via peer memory for GPU0"), "{}", r.verdict.line);
    assert_eq!(r.verdict.path.as_deref(), Some("peer memory"));
}

/// The default text: the verdict, the problems with their fixes, and
/// a count of the rest; `--verbose` (Display) keeps everything.
#[test]
fn the_brief_output_shows_the_verdict_and_only_the_problems() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE), ("mlx5_1", CAPABLE)], gpus: vec![("0000:18:00.0", true), ("0000:3a:00.0", true)], host: None };
    let env = vec![("NCCL_IB_DISABLE".to_string(), "1".to_string())];
    let r = run(&Machine::new(SysRoot::at(testkit::machine("dgx-pix")), env), &p, &Options::default());
    let brief = Brief(&r).to_string();
    let lines: Vec<&str> = brief.lines().collect();
    assert_eq!(lines[0], r.verdict.line);
    assert!(lines.iter().any(|l| l.starts_with("[fail   ] env.nccl_ib_disable")), "{brief}");
    assert!(!brief.contains("evidence:") && !brief.contains("[ok     ]"), "{brief}");
    let problems = r.findings.iter().filter(|x| matches!(x.status, Status::Fail | Status::Warn)).count();
    assert!(lines.last().unwrap().starts_with(&format!("({} other checks", r.findings.len() - problems)), "{brief}");
    let full = r.to_string();
    assert!(full.lines().count() > brief.lines().count() && full.contains("evidence:"));
}

#[test]
fn without_gpu_dma_buf_peer_memory_is_needed() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:18:00.0", false)], host: None };
    let r = run(&machine("dgx-pix"), &p, &Options::default());
    assert!(!r.verdict.available);
    assert!(r.verdict.line.contains("reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0"), "{}", r.verdict.line);
}

/// The classic ConnectX deployment (MLNX/DOCA OFED with an rdma-core
/// whose provider cannot register dma-buf, nvidia-peermem loaded): the
/// library registers through peer memory, and the doctor says so. It
/// used to answer "not available: mlx5_0 cannot register dma-buf
/// memory", judging the NIC's dma-buf fact a second time.
#[test]
fn peer_memory_serves_a_nic_without_dma_buf() {
    let no_dmabuf = DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP));
    let host = HostFacts {
        kernel_release: Some("5.15.0-105-generic".into()),
        peer_memory_found: vec!["/sys/module/nvidia_peermem/version".into()],
        peer_memory_api: Some(true),
    };
    let p = Fake { nics: vec![("mlx5_0", no_dmabuf), ("mlx5_1", no_dmabuf)], gpus: vec![("0000:18:00.0", true)], host: Some(host) };
    let r = run(&machine("dgx-pix"), &p, &Options::default());
    assert_eq!(r.verdict.line, "GPUDirect RDMA: available via peer memory for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (PIX)", "{r}");
    assert_eq!(r.verdict.path.as_deref(), Some("peer memory"));
    let nic = r.findings.iter().find(|f| f.check == "rdma.dmabuf.mlx5_0").unwrap();
    assert_eq!((nic.status, nic.summary.as_str()), (Status::Warn, "mlx5_0 cannot register dma-buf memory: rules out dma-buf; peer memory is still possible"));
    let peer = r.findings.iter().find(|f| f.check == "peermem.client").unwrap();
    assert_eq!(peer.status, Status::Ok);
}

/// Every fixture machine under every combination of probe answers: the
/// doctor's verdict for each GPU and NIC is the decision a `Require`
/// registration would take on the same facts (`plan`: its first path,
/// or the error naming its first cause), unless something registration
/// cannot see (port, GID, device nodes, ACS) blocks the pair, which the
/// verdict then names instead.
#[test]
fn the_verdict_is_the_registration_decision_on_every_fixture_and_probe() {
    let dir = testkit::machine("");
    let mut machines: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    machines.sort();
    assert!(machines.len() >= 8, "{machines:?}");
    let (mut checked, mut available, mut blocked, mut by_default, mut unseen) = (0, 0, 0, 0, 0);
    for name in &machines {
        let m = machine(name);
        let topo = topology::discover(&m.root);
        // Machines without a GPU or a PCI NIC get one of each, unplaced.
        let gpu_bdfs: Vec<String> = if topo.gpus.is_empty() { vec!["0000:00:00.0".into()] } else { topo.gpus.iter().map(|g| g.bdf.clone()).collect() };
        let nic_names: Vec<String> = if topo.nics.is_empty() { vec!["mlx5_0".into()] } else { topo.nics.iter().map(|n| n.name.clone()).collect() };
        for bits in 0..64u32 {
            let on = |k: u32| bits & (1 << k) != 0;
            let probe = if on(0) { CAPABLE } else { DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP)) };
            let host = HostFacts {
                kernel_release: Some(if on(1) { "6.8.0-45-generic" } else { "5.4.0-150-generic" }.into()),
                peer_memory_found: if on(2) { vec!["/sys/module/nvidia_peermem/version".into()] } else { vec![] },
                peer_memory_api: Some(on(2)),
            };
            let gpu = |i: usize, bdf: &str| GpuFacts {
                ordinal: i,
                label: format!("GPU{i} (NVIDIA H100, {bdf})"),
                pci_bus_id: Some(bdf.to_string()),
                cuda_unavailable: None,
                driver_version: Some(12080),
                gdr_supported: Some(on(3)),
                dma_buf_supported: Some(on(4)),
                module: if on(5) { ModuleFlavour::Open } else { ModuleFlavour::Proprietary },
            };
            let gpus: Vec<GpuFacts> = gpu_bdfs.iter().enumerate().map(|(i, b)| gpu(i, b)).collect();
            struct Answers<'a>(&'a [GpuFacts], &'a [String], DmaBufProbe, &'a HostFacts);
            impl Probes for Answers<'_> {
                fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
                    Ok(self.1.iter().map(|n| device(n, self.2)).collect())
                }
                fn gpus(&self, _: &SysRoot) -> Result<Vec<GpuFacts>, String> {
                    Ok(self.0.to_vec())
                }
                fn host(&self, _: &SysRoot) -> HostFacts {
                    self.3.clone()
                }
            }
            let answers = Answers(&gpus, &nic_names, probe, &host);
            for g in &gpus {
                for nic in &nic_names {
                    let r = run(&m, &answers, &Options { gpu: Some(g.ordinal), device: Some(nic.clone()) });
                    let facts = GdrFacts { gpu: g.clone(), nic: NicFacts { device: nic.clone(), dma_buf: probe }, host: host.clone() };
                    let decision = plan(&facts);
                    let what = format!("{name}, probes {bits:06b}, {} <-> {nic}: {}", g.label, r.verdict.line);
                    checked += 1;
                    match decision.try_paths.first() {
                        None => {
                            assert!(!r.verdict.available, "{what}");
                            let first = decision.causes[0].checked(&facts);
                            assert!(r.verdict.line.ends_with(&first), "{what}\nexpected the first cause: {first}");
                        }
                        // The machine's sysfs does not show the pair:
                        // never "available", open naming the path.
                        Some(path) if r.verdict.topology.is_none() && r.verdict.hardware_allows && r.verdict.environment.is_none() => {
                            unseen += 1;
                            assert!(!r.verdict.available && r.exit_status() == 3, "{what}");
                            assert_eq!(r.verdict.path.as_deref(), Some(path.to_string().as_str()), "{what}");
                            assert!(r.verdict.open.iter().any(|u| u.to_string().starts_with("the PCIe path between")), "{what}");
                        }
                        Some(path) if r.verdict.available => {
                            available += 1;
                            assert_eq!(r.verdict.path.as_deref(), Some(path.to_string().as_str()), "{what}");
                        }
                        // The pair works but NCCL's default distance
                        // keeps it staged: the hardware's path, then why.
                        Some(path) if r.verdict.hardware_allows => {
                            by_default += 1;
                            assert_eq!(r.verdict.path.as_deref(), Some(path.to_string().as_str()), "{what}");
                            assert!(r.verdict.environment.as_deref().is_some_and(|e| e.starts_with("NCCL's default NCCL_NET_GDR_LEVEL (PXB)")), "{what}");
                        }
                        Some(_) => {
                            blocked += 1;
                            let by = r
                                .findings
                                .iter()
                                .filter(|f| f.status == Status::Fail)
                                .find(|f| r.verdict.line.ends_with(&f.summary))
                                .unwrap_or_else(|| panic!("{what}: not available although registration would succeed, and no blocking finding named"));
                            assert!(by.blocks.as_ref().is_some_and(|b| b.blocks(nic, &[])) || matches!(by.blocks, Some(super::super::Blocker::AcsBridge(_))), "{what}: blocked by {} ({:?})", by.check, by.blocks);
                        }
                    }
                }
            }
        }
    }
    assert!(available > 0 && blocked > 0 && by_default > 0 && unseen > 0, "{available} available, {blocked} blocked, {by_default} staged by NCCL's default, {unseen} open of {checked}");
    println!(
        "{checked} verdicts of {} machines x 64 probe answers: {available} available, {by_default} staged by NCCL's default distance, {blocked} blocked by the path, the rest as the registration would fail",
        machines.len()
    );
}

#[test]
fn acs_redirect_blocks_the_pair() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:03:00.0", true)], host: None };
    let r = run(&machine("acs-redirect"), &p, &Options::default());
    assert!(!r.verdict.available, "{r}");
    assert!(r.verdict.line.starts_with("GPUDirect RDMA: not available for GPU0 (NVIDIA H100, 0000:03:00.0) <-> mlx5_0: "), "{}", r.verdict.line);
    assert!(r.verdict.line.to_lowercase().contains("acs"), "{}", r.verdict.line);
}

#[test]
fn cross_socket_pair_works_but_nccl_will_not_use_it() {
    let p = Fake { nics: vec![("mlx5_0", CAPABLE)], gpus: vec![("0000:3b:00.0", true)], host: None };
    let r = run(&machine("two-socket-sys"), &p, &Options::default());
    assert!(!r.verdict.available && r.verdict.hardware_allows, "{r}");
    assert!(
        r.verdict.line.starts_with(
            "GPUDirect RDMA: the hardware allows it for GPU0 (NVIDIA H100, 0000:3b:00.0) <-> mlx5_0 (dma-buf, SYS), but NCCL with this environment will not use it: NCCL's default NCCL_NET_GDR_LEVEL (PXB) stops short of this SYS path"
        ),
        "{}",
        r.verdict.line
    );
    // Raised to the pair's distance, NCCL uses it.
    let m = Machine::new(SysRoot::at(testkit::machine("two-socket-sys")), vec![("NCCL_NET_GDR_LEVEL".into(), "SYS".into())]);
    assert!(run(&m, &p, &Options::default()).verdict.available);
}

#[test]
fn soft_roce_names_the_provider() {
    let p = Fake { nics: vec![("rxe0", DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP)))], gpus: vec![("0000:00:04.0", true)], host: None };
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

/// Parity over every fixture machine: for each GPU-NIC pair the machine
/// allows and a table of job environments, the doctor's verdict on the
/// pair names the library's rule-table stop for that pair (NCCL's
/// distance, the registration path), and the NCCL plugin, judging a
/// staged connection on the same pair, names the same variable wherever
/// the stop concerns registration. (`crate::nccl_agreement` adds nccl-log.)
#[test]
fn the_doctor_and_the_plugin_agree_on_every_fixture_pair() {
    use gpudirect::nccl::{registration_stops, stops, Pair};
    use nccl_net_gpudirect::{judge, ConnPath, PairJudgement, Seen, Side};
    let envs: &[&[(&str, &str)]] = &[
        &[],
        &[("NCCL_NET_GDR_LEVEL", "PIX")],
        &[("NCCL_NET_GDR_LEVEL", "PXB")],
        &[("NCCL_NET_GDR_LEVEL", "PHB")],
        &[("NCCL_NET_GDR_LEVEL", "SYS")],
        &[("NCCL_NET_GDR_LEVEL", "1")],
        &[("NCCL_NET_GDR_READ", "0")],
        &[("NCCL_DMABUF_ENABLE", "0")],
        &[("NCCL_IB_DISABLE", "1")],
        &[("NCCL_IB_HCA", "^mlx5")],
    ];
    let dir = testkit::machine("");
    let mut machines: Vec<String> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).filter(|e| e.path().is_dir()).map(|e| e.file_name().to_string_lossy().into_owned()).collect();
    machines.sort();
    let (mut pairs_checked, mut stopped) = (0, 0);
    for name in &machines {
        let root = SysRoot::at(testkit::machine(name));
        let topo = topology::discover(&root);
        let placed = topology::pairs(&root, &topo);
        let gpus: Vec<(&'static str, bool)> = topo.gpus.iter().map(|g| (&*Box::leak(g.bdf.clone().into_boxed_str()), true)).collect();
        let nics: Vec<(&'static str, DmaBufProbe)> = topo.nics.iter().map(|n| (&*Box::leak(n.name.clone().into_boxed_str()), CAPABLE)).collect();
        let host = HostFacts { kernel_release: Some("6.8.0-45-generic".into()), peer_memory_found: vec![], peer_memory_api: Some(false) };
        let probes = Fake { nics, gpus, host: Some(host.clone()) };
        for (ordinal, g) in topo.gpus.iter().enumerate() {
            for p in placed.iter().filter(|p| p.gpu == g.bdf) {
                for env in envs {
                    let vars: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
                    let m = Machine::new(root.clone(), vars.clone());
                    let r = run(&m, &probes, &Options { gpu: Some(ordinal), device: Some(p.nic.clone()) });
                    if !r.verdict.hardware_allows {
                        continue;
                    }
                    pairs_checked += 1;
                    let facts = GdrFacts { gpu: probes.gpus(&root).unwrap()[ordinal].clone(), nic: NicFacts { device: p.nic.clone(), dma_buf: CAPABLE }, host: host.clone() };
                    let plugin_pair = PairJudgement::new(ordinal, facts, Some(p.nccl_level)).shown_as(Some(p.level));
                    let dma_buf_only = plugin_pair.plan.try_paths == [RegistrationPath::DmaBuf];
                    let pair = Pair { nic: Some(&p.nic), level: Some(p.nccl_level), shown: Some(p.level), dma_buf_only, plugin_missing: None, sends: true };
                    let stop = stops(&vars, &pair);
                    let what = format!("{name} GPU{ordinal} <-> {} {env:?}: {}", p.nic, r.verdict.line);
                    assert_eq!(r.verdict.environment, stop.as_ref().map(ToString::to_string), "{what}");
                    stopped += usize::from(stop.is_some());
                    for side in [Side::Send, Side::Recv] {
                        let ConnPath::Staged { cause, .. } = judge(side, Seen { host: true, gpu: None }, Some(&plugin_pair), &p.nic, &vars) else { panic!("{what}") };
                        let own = registration_stops(&vars, &Pair { dma_buf_only: false, sends: side == Side::Send, ..pair });
                        if let Some(s) = stop.as_ref().filter(|s| matches!(s.variable(), "NCCL_NET_GDR_LEVEL") || (side == Side::Send && s.sends_only())) {
                            assert_eq!(own.as_ref().map(|o| o.variable()), Some(s.variable()), "{what} {side:?}");
                            assert!(cause.contains(&s.cause()), "{what} {side:?}: the plugin says {cause}");
                        }
                    }
                }
            }
        }
    }
    assert!(pairs_checked > 50 && stopped > 10, "{pairs_checked} pairs x environments, {stopped} stopped");
}
