//! The PCIe checks on fixture machines and synthetic trees.

use super::*;
use gpudirect::nccl::PathType as NcclPathType;
use gpudirect::topology::{discover, pairs};

use testkit::bridge_config;
use testkit::Tree;

fn machine(name: &str) -> SysRoot {
    SysRoot::at(testkit::machine(name))
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn run(name: &str, vars: &[(&str, &str)]) -> (PciTopology, Vec<Pair>, Vec<Finding>) {
    let root = machine(name);
    let topo = discover(&root);
    let pairs = pairs(&root, &topo);
    let findings = check(&root, &topo, &env(vars)).0;
    assert!(!findings.is_empty(), "{name}: no findings at all");
    (topo, pairs, findings)
}

/// `area.check` of an `area.check[.object]` id.
fn base(id: &str) -> String {
    id.splitn(3, '.').take(2).collect::<Vec<_>>().join(".")
}

fn with<'a>(findings: &'a [Finding], check: &str) -> Vec<&'a Finding> {
    findings.iter().filter(|f| base(&f.check) == check).collect()
}

fn one<'a>(findings: &'a [Finding], check: &str, needle: &str) -> &'a Finding {
    let hits: Vec<&Finding> = with(findings, check).into_iter().filter(|f| f.summary.contains(needle)).collect();
    assert_eq!(hits.len(), 1, "expected one {check} finding containing {needle:?}, got {hits:#?}");
    hits[0]
}

fn pair<'a>(pairs: &'a [Pair], gpu: usize, nic: &str) -> &'a Pair {
    pairs.iter().find(|p| p.gpu_index == gpu && p.nic == nic).expect("pair")
}

/// The library's answer to "which NIC for GPU N": best first, on every
/// fixture machine, and the switch-local NIC on the DGX layout.
#[test]
fn nearest_nics_come_best_first() {
    let root = machine("dgx-pix");
    let topo = discover(&root);
    for gpu in 0..2 {
        let near = topo.nearest_nics(&root, gpu);
        assert_eq!(near.len(), topo.nics.len(), "GPU{gpu}: {near:#?}");
        assert_eq!((near[0].nic.as_str(), near[0].level), (["mlx5_0", "mlx5_1"][gpu], PathLevel::Pix), "GPU{gpu}");
    }
    for name in ["two-socket-sys", "phb-root-complex", "acs-redirect", "iommu-dma", "nonroot-config64"] {
        let root = machine(name);
        let topo = discover(&root);
        for g in &topo.gpus {
            let near = topo.nearest_nics(&root, g.index);
            assert!(near.iter().all(|p| p.gpu_index == g.index), "{name}");
            assert!(near.windows(2).all(|w| (w[0].nccl_level, w[0].level) <= (w[1].nccl_level, w[1].level)), "{name}: {near:#?}");
        }
    }
    assert!(topo_of("container-no-ib").nearest_nics(&machine("container-no-ib"), 0).is_empty());
}

fn topo_of(name: &str) -> PciTopology {
    discover(&machine(name))
}

#[test]
fn dgx_pix_discovery_excludes_nvswitch_and_nvme() {
    let (topo, _, _) = run("dgx-pix", &[]);
    let gpus: Vec<&str> = topo.gpus.iter().map(|g| g.bdf.as_str()).collect();
    assert_eq!(gpus, ["0000:18:00.0", "0000:3a:00.0"]);
    assert_eq!(topo.gpus[0].pci_id, "10de:2330");
    assert_eq!(topo.gpus[0].numa_node, Some(0));
    let nics: Vec<(&str, &str)> = topo.nics.iter().map(|n| (n.name.as_str(), n.bdf.as_str())).collect();
    assert_eq!(nics, [("mlx5_0", "0000:19:00.0"), ("mlx5_1", "0000:3b:00.0")]);
    assert_eq!(topo.nics[0].netdevs, ["ibp25s0"]);
    assert_eq!(topo.nics[0].ports[0].rate.as_deref(), Some("400 Gb/sec (4X NDR)"));
    assert_eq!(topo.nics[0].rate_gbps(), Some(400.0));
    assert_eq!(topo.nics[0].ports[0].link_layer.as_deref(), Some("InfiniBand"));
    assert!(topo.other_rdma.is_empty() && topo.notes.is_empty());
    assert_eq!(
        topo.nics[0].sysfs_path,
        "/sys/devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:19:00.0"
    );
}

#[test]
fn dgx_pix_classifies_and_passes() {
    let (_, pairs, f) = run("dgx-pix", &[]);
    assert_eq!(pairs.len(), 4);
    let p = pair(&pairs, 0, "mlx5_0");
    assert_eq!((p.level, p.nccl_level), (PathLevel::Pix, PathLevel::Pix));
    assert_eq!(p.turnaround.as_deref(), Some("0000:16:00.0"));
    assert_eq!(p.bridges, ["0000:17:00.0", "0000:16:00.0", "0000:17:01.0"]);
    assert!(p.gdr_by_default);
    assert_eq!(p.label(), "GPU0 <-> mlx5_0 (PIX)");
    let cross = pair(&pairs, 0, "mlx5_1");
    assert_eq!((cross.level, cross.nccl_level), (PathLevel::Node, PathLevel::Phb));
    assert!(!cross.gdr_by_default);
    let topo_f = with(&f, "topology.path");
    assert_eq!(topo_f.len(), 4);
    assert!(topo_f.iter().all(|f| f.status == Status::Ok), "{topo_f:#?}");
    let x = one(&f, "topology.path", "GPU0 0000:18:00.0 <-> mlx5_1");
    assert!(x.summary.contains("keeps it through mlx5_0 (PIX)"), "{}", x.summary);
    assert!(x.evidence.iter().any(|e| e.contains("no NODE level")));
    assert_eq!(x.check, "topology.path.gpu0-mlx5_1");
    // ACS: only the switch ports on the PIX paths, not the root ports; all clean.
    let acs = with(&f, "acs.bridge");
    let bdfs: Vec<&str> = acs.iter().map(|f| &f.summary[..12]).collect();
    assert_eq!(
        bdfs,
        ["0000:16:00.0", "0000:17:00.0", "0000:17:01.0", "0000:38:00.0", "0000:39:00.0", "0000:39:01.0"]
    );
    assert!(acs.iter().all(|f| f.status == Status::Ok), "{acs:#?}");
    assert!(one(&f, "acs.bridge", "0000:16:00.0").summary.contains("no ACS capability"));
    assert_eq!(one(&f, "iommu.mode", "").status, Status::Ok);
    let bw = with(&f, "bandwidth.path");
    assert_eq!(bw.len(), 2);
    let b = one(&f, "bandwidth.path", "GPU0 <-> mlx5_0 (PIX)");
    assert_eq!(b.status, Status::Ok);
    assert!(b.summary.contains("50.0 GB/s") && b.summary.contains("Gen5 x16 = 63.0 GB/s"), "{}", b.summary);
    assert!(b.summary.contains("31.5 GB/s per direction when sending and receiving"), "{}", b.summary);
    assert!(b.evidence.iter().any(|e| e.contains("NCCL's model: 48.0 GB/s")));
}

#[test]
fn two_socket_is_sys_and_fails() {
    let (topo, pairs, f) = run("two-socket-sys", &[]);
    assert_eq!(topo.gpus.len(), 1);
    assert_eq!(topo.nics.len(), 2);
    for nic in ["mlx5_0", "mlx5_1"] {
        let p = pair(&pairs, 0, nic);
        assert_eq!((p.level, p.nccl_level), (PathLevel::Sys, PathLevel::Sys));
        assert!(!p.gdr_by_default);
        let t = one(&f, "topology.path", &format!("<-> {nic}"));
        assert_eq!(t.status, Status::Fail);
        let fix = t.fix.as_deref().unwrap();
        assert!(fix.contains("NUMA node 0") && fix.contains("NCCL_NET_GDR_LEVEL=SYS"), "{fix}");
        assert!(t.evidence.iter().any(|e| e.contains("pci0000:d7") && e.contains("NUMA node 1")));
    }
    let acs = one(&f, "acs.path", "");
    assert_eq!(acs.status, Status::Ok);
    assert!(with(&f, "acs.bridge").is_empty());
    let io = one(&f, "iommu.mode", "");
    assert_eq!(io.status, Status::Ok);
    assert!(io.summary.contains("no IOMMU groups"));
    // Both NIC functions tie for closest, both get the arithmetic; the A100 at
    // Gen3 behind a Gen3 root port is not a degraded link.
    let bw = with(&f, "bandwidth.path");
    assert_eq!(bw.len(), 2);
    for b in bw {
        assert_eq!(b.status, Status::Ok, "{b:#?}");
        assert!(b.summary.contains("Gen3 x16 = 15.8 GB/s") && b.summary.contains("12.5 GB/s"), "{}", b.summary);
        assert!(b.summary.contains("saves the host-memory copy"), "{}", b.summary);
    }
}

#[test]
fn two_socket_forced_sys_warns() {
    let (_, _, f) = run("two-socket-sys", &[("NCCL_NET_GDR_LEVEL", "SYS")]);
    let t = one(&f, "topology.path", "<-> mlx5_0");
    assert_eq!(t.status, Status::Warn);
    assert!(t.summary.contains("NCCL_NET_GDR_LEVEL=SYS"), "{}", t.summary);
    assert!(t.fix.as_deref().unwrap().contains("unset NCCL_NET_GDR_LEVEL"));
}

#[test]
fn acs_redirect_fails_on_the_redirecting_port_only() {
    let (_, pairs, f) = run("acs-redirect", &[]);
    let p = pair(&pairs, 0, "mlx5_0");
    assert_eq!((p.level, p.nccl_level), (PathLevel::Pix, PathLevel::Pix));
    assert_eq!(one(&f, "topology.path", "GPU0").status, Status::Ok);
    let bad = one(&f, "acs.bridge", "0000:02:00.0");
    assert_eq!(bad.status, Status::Fail);
    assert_eq!(bad.check, "acs.bridge.0000:02:00.0");
    assert!(bad.summary.contains("switch downstream port") && bad.summary.contains("ReqRedir+ CmpltRedir+"));
    assert!(bad
        .evidence
        .iter()
        .any(|e| e
            .contains("ACSCtl: SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-")));
    let fix = bad.fix.as_deref().unwrap();
    assert!(fix.contains("setpci -s 0000:02:00.0 ECAP_ACS+6.w=0000"), "{fix}");
    assert!(fix.contains("0x14e.w=0000") && fix.contains("pci=disable_acs_redir=0000:02:00.0"), "{fix}");
    let sv_only = one(&f, "acs.bridge", "0000:02:01.0");
    assert_eq!(sv_only.status, Status::Ok);
    assert!(sv_only.summary.contains("SrcValid alone"));
    assert_eq!(one(&f, "acs.bridge", "0000:01:00.0").status, Status::Ok);
    assert_eq!(one(&f, "acs.bridge", "0000:02:02.0").status, Status::Fail);
    assert!(with(&f, "acs.bridge").iter().all(|f| !f.summary.starts_with("0000:00:01.1")));
    let b = one(&f, "bandwidth.path", "GPU0");
    assert_eq!(b.status, Status::Ok);
    assert!(b.summary.contains("25.0 GB/s") && b.summary.contains("15.8 GB/s per direction when sending"));
}

#[test]
fn iommu_dma_warns_and_pxb_is_allowed() {
    let (_, pairs, f) = run("iommu-dma", &[]);
    let p = pair(&pairs, 0, "mlx5_0");
    assert_eq!((p.level, p.nccl_level), (PathLevel::Pxb, PathLevel::Pxb));
    assert_eq!(p.bridges.len(), 7);
    assert_eq!(one(&f, "topology.path", "GPU0").status, Status::Ok);
    let io = one(&f, "iommu.mode", "");
    assert_eq!(io.status, Status::Warn);
    assert!(io.fix.as_deref().unwrap().contains("intel_iommu=on iommu=pt"));
    assert!(io.evidence.iter().any(|e| e.contains("GPU0 0000:05:00.0: group 14, type DMA-FQ")));
    assert_eq!(with(&f, "acs.bridge").len(), 7);
    assert!(with(&f, "acs.bridge").iter().all(|f| f.status == Status::Ok));
    assert_eq!(one(&f, "bandwidth.path", "GPU0").status, Status::Ok);
}

#[test]
fn phb_root_complex_fails_by_default_and_follows_the_env() {
    let (topo, pairs, f) = run("phb-root-complex", &[]);
    assert_eq!(topo.gpus.len(), 1, "the HDMI audio function is not a GPU");
    let p = pair(&pairs, 0, "mlx5_0");
    assert_eq!((p.level, p.nccl_level), (PathLevel::Phb, PathLevel::Phb));
    let t = one(&f, "topology.path", "<-> mlx5_0");
    assert_eq!(t.status, Status::Fail);
    assert!(t.fix.as_deref().unwrap().contains("NCCL_NET_GDR_LEVEL=PHB"));
    assert!(t.evidence.iter().any(|e| e.contains("AMD Rome")));
    for (value, status) in [("PHB", Status::Warn), ("3", Status::Warn), ("2", Status::Fail), ("phb", Status::Fail)]
    {
        let (_, _, f) = run("phb-root-complex", &[("NCCL_NET_GDR_LEVEL", value)]);
        let t = one(&f, "topology.path", "<-> mlx5_0");
        assert_eq!(t.status, status, "NCCL_NET_GDR_LEVEL={value}: {t:#?}");
        if value == "phb" {
            assert!(t.evidence.iter().any(|e| e.contains("ignored by NCCL")));
        }
    }
    let (_, _, f) = run("phb-root-complex", &[("NCCL_NET_GDR_LEVEL", "0")]);
    let t = one(&f, "topology.path", "<-> mlx5_0");
    assert!(t.evidence.iter().any(|e| e.starts_with("NCCL_NET_GDR_LEVEL=0 (= LOC) turns GPUDirect RDMA off on every pair")), "{t:#?}");
    assert_eq!(one(&f, "acs.path", "").status, Status::Ok);
    let io = one(&f, "iommu.mode", "");
    assert_eq!(io.status, Status::Ok);
    assert!(io.summary.contains("inferred"));
    let b = one(&f, "bandwidth.path", "GPU0 <-> mlx5_0");
    assert_eq!(b.status, Status::Warn);
    assert!(b.summary.contains("7.9 GB/s") && b.summary.contains("12.5 GB/s"), "{}", b.summary);
    assert!(b.fix.as_deref().unwrap().contains("trained at x8 although both ends support x16"));
    assert!(b.evidence.iter().any(|e| e.contains("GPUs lower the link speed when idle")));
}

/// A limit below every PCIe path is one finding (env.nccl_net_gdr_level,
/// and the verdict), not a failure per pair: each pair is judged as
/// with the variable unset, and says so; none claims a GPU has no
/// closer NIC beside a PIX one, none sends the user to move cards.
#[test]
fn a_limit_below_every_pcie_path_is_not_blamed_on_each_pair() {
    for machine_name in ["acs-redirect", "dgx-pix"] {
        for value in ["LOC", "0", "NVL"] {
            let (_, _, with) = run(machine_name, &[("NCCL_NET_GDR_LEVEL", value)]);
            let (_, _, without) = run(machine_name, &[]);
            let paths = |f: &[Finding]| f.iter().filter(|x| x.check.starts_with("topology.path.")).map(|x| (x.check.clone(), x.status, x.summary.clone())).collect::<Vec<_>>();
            assert_eq!(paths(&with), paths(&without), "{machine_name}, {value}: each pair judged as with the variable unset");
            for x in with.iter().filter(|x| x.check.starts_with("topology.path.")) {
                assert!(x.evidence.iter().any(|e| e.contains("turns GPUDirect RDMA off on every pair")), "{x:#?}");
                assert!(!x.summary.contains("no closer NIC"), "{x:#?}");
            }
        }
    }
}

#[test]
fn container_without_infiniband_says_so() {
    let (topo, pairs, f) = run("container-no-ib", &[]);
    assert_eq!(topo.gpus.len(), 1);
    assert!(topo.nics.is_empty() && pairs.is_empty());
    assert!(topo.notes.iter().any(|n| n.contains("/sys/class/infiniband does not exist")));
    let n = one(&f, "topology.nics", "no RDMA NIC");
    assert_eq!(n.status, Status::Fail);
    assert!(n.fix.as_deref().unwrap().contains("/dev/infiniband"));
    assert_eq!(one(&f, "acs.path", "").status, Status::Skipped);
    assert!(with(&f, "topology.path").is_empty() && with(&f, "bandwidth.path").is_empty());
    assert_eq!(one(&f, "iommu.mode", "").status, Status::Ok);
}

/// A machine with neither: each finding shows the discovery notes on
/// its own subject (the NIC note used to be shown as the GPUs' evidence).
#[test]
fn discovery_notes_go_to_their_own_finding() {
    let t = Tree::new("empty-machine");
    t.dir("/sys/bus/pci/devices");
    let root = SysRoot::at(t.path());
    let f = check(&root, &discover(&root), &[]).0;
    let gpus = one(&f, "topology.gpus", "no NVIDIA GPU");
    assert!(gpus.evidence.iter().all(|e| !e.contains("infiniband")), "{gpus:#?}");
    let nics = one(&f, "topology.nics", "no RDMA NIC");
    assert!(nics.evidence.iter().any(|e| e.contains("/sys/class/infiniband does not exist")), "{nics:#?}");
}

#[test]
fn truncated_config_space_needs_root() {
    let (_, pairs, f) = run("nonroot-config64", &[]);
    assert_eq!(pair(&pairs, 0, "mlx5_0").level, PathLevel::Pix);
    let acs = with(&f, "acs.bridge");
    assert_eq!(acs.len(), 4, "{acs:#?}");
    for a in acs {
        assert_eq!(a.status, Status::Skipped);
        assert!(a.summary.contains("needs root") && a.summary.contains("64 bytes"), "{}", a.summary);
        assert!(a.fix.as_deref().unwrap().contains("as root"));
    }
}

#[test]
fn soft_roce_is_not_a_nic() {
    let (topo, _, f) = run("vm-soft-roce", &[]);
    assert_eq!(topo.gpus.len(), 1);
    assert_eq!(topo.gpus[0].numa_node, None);
    assert!(topo.nics.is_empty());
    assert_eq!(topo.other_rdma.len(), 1);
    assert!(topo.other_rdma[0].reason.contains("eth0"));
    let n = one(&f, "topology.nics", "rxe0");
    assert_eq!(n.status, Status::Fail);
    assert!(n.summary.contains("software RDMA"));
}

/// Every check against every fixture: the statuses each machine must
/// produce, so a change in any check shows up as a named difference.
#[test]
fn every_fixture_every_check() {
    use Status::*;
    let expect: [(&str, &[(&str, Status)]); 8] = [
        (
            "dgx-pix",
            &[
                ("topology.devices", Ok),
                ("topology.path", Ok),
                ("acs.bridge", Ok),
                ("iommu.mode", Ok),
                ("bandwidth.path", Ok),
            ],
        ),
        (
            "two-socket-sys",
            &[
                ("topology.devices", Ok),
                ("topology.path", Fail),
                ("acs.path", Ok),
                ("iommu.mode", Ok),
                ("bandwidth.path", Ok),
            ],
        ),
        (
            "acs-redirect",
            &[
                ("topology.devices", Ok),
                ("topology.path", Ok),
                ("acs.bridge", Ok),
                ("acs.bridge", Fail),
                ("iommu.mode", Ok),
                ("bandwidth.path", Ok),
            ],
        ),
        (
            "iommu-dma",
            &[
                ("topology.devices", Ok),
                ("topology.path", Ok),
                ("acs.bridge", Ok),
                ("iommu.mode", Warn),
                ("bandwidth.path", Ok),
            ],
        ),
        (
            "phb-root-complex",
            &[
                ("topology.devices", Ok),
                ("topology.path", Fail),
                ("acs.path", Ok),
                ("iommu.mode", Ok),
                ("bandwidth.path", Warn),
            ],
        ),
        ("container-no-ib", &[("topology.nics", Fail), ("acs.path", Skipped), ("iommu.mode", Ok)]),
        (
            "nonroot-config64",
            &[
                ("topology.devices", Ok),
                ("topology.path", Ok),
                ("acs.bridge", Skipped),
                ("iommu.mode", Ok),
                ("bandwidth.path", Ok),
            ],
        ),
        ("vm-soft-roce", &[("topology.nics", Fail), ("acs.path", Skipped), ("iommu.mode", Ok)]),
    ];
    let dirs = std::fs::read_dir(format!("{}/tests/data/machines", env!("CARGO_MANIFEST_DIR")))
        .unwrap()
        .filter(|e| e.as_ref().is_ok_and(|e| e.path().is_dir()))
        .count();
    assert_eq!(dirs, expect.len(), "a fixture without expectations");
    for (name, want) in expect {
        let (_, _, f) = run(name, &[]);
        let mut got: Vec<(String, Status)> = f.iter().map(|f| (base(&f.check), f.status)).collect();
        got.sort();
        got.dedup();
        let mut want: Vec<(String, Status)> = want.iter().map(|(c, s)| (c.to_string(), *s)).collect();
        want.sort();
        assert_eq!(got, want, "{name}: {f:#?}");
        let mut ids: Vec<&str> = f.iter().map(|f| f.check.as_str()).collect();
        ids.sort_unstable();
        let n = ids.len();
        ids.dedup();
        assert_eq!(ids.len(), n, "{name}: check ids must be unique per run: {ids:?}");
        for finding in &f {
            if matches!(finding.status, Warn | Fail) {
                assert!(finding.fix.is_some(), "{name}: {finding:#?} has no fix");
            }
            assert!(!finding.evidence.is_empty() || finding.check == "acs.path", "{name}: {finding:#?}");
        }
    }
}

#[test]
fn serializes() {
    let root = machine("dgx-pix");
    let topo = discover(&root);
    let json = serde_json::to_string(&topo).unwrap();
    assert!(json.contains("\"bdf\":\"0000:18:00.0\"") && json.contains("400 Gb/sec (4X NDR)"));
    let p = serde_json::to_string(&pairs(&root, &topo)[0]).unwrap();
    assert!(p.contains("\"level\":\"PIX\"") && p.contains("\"nccl_level\":\"PIX\""), "{p}");
    assert_eq!(PathLevel::Node.to_string(), "NODE");
    assert_eq!(serde_json::to_string(&PathLevel::Sys).unwrap(), "\"SYS\"");
}

/// How each value form is read is the library's (gpudirect::nccl's
/// tests); here, how the doctor applies it.
#[test]
fn gdr_limit_follows_nccl() {
    use NcclPathType::*;
    let l = gdr_limit(&env(&[("NCCL_NET_GDR_LEVEL", "1"), ("NCCL_NET_GDR_LEVEL", "3")]));
    assert_eq!(l.limit, Phb, "the last assignment wins");
    assert!(l.allows(PathLevel::Phb) && l.allows(PathLevel::Node) && !l.allows(PathLevel::Sys));
    let d = gdr_limit(&[]);
    assert_eq!(d.limit, Pxb);
    assert!(d.allows(PathLevel::Pxb) && !d.allows(PathLevel::Phb));
    assert!(!gdr_limit(&env(&[("NCCL_NET_GDR_LEVEL", "pxb")])).env_used);
}

#[test]
fn symlinks_never_leave_the_root() {
    let s = Tree::new("escape");
    s.link("/sys/class/infiniband/evil/device", "../../../../../../../../../../etc");
    s.link("/sys/class/infiniband/abs/device", "/etc");
    s.link("/sys/class/infiniband/loop/device", "loop2");
    s.link("/sys/class/infiniband/loop/loop2", "device");
    s.link("/sys/bus/pci/devices/0000:01:00.0", "/proc/self");
    let root = SysRoot::at(s.path());
    assert_eq!(root.resolve("/sys/class/infiniband/evil/device").as_deref(), Some("/etc"));
    assert_eq!(root.resolve("/sys/class/infiniband/abs/device").as_deref(), Some("/etc"));
    assert_eq!(root.resolve("/sys/class/infiniband/loop/device"), None);
    let topo = discover(&root);
    assert!(topo.nics.is_empty() && topo.gpus.is_empty());
    assert_eq!(topo.other_rdma.len(), 3);
    let f = check(&root, &topo, &[]).0;
    assert!(with(&f, "topology.nics").iter().all(|f| f.status == Status::Fail));
}

use testkit::Rng;

const TEXT_GARBAGE: [&[u8]; 14] = [
    b"",
    b"\n",
    b"0x",
    b"0xzzzz\n",
    b"-1\n",
    b"99999999999999999999\n",
    b"NaN GT/s\n",
    b"inf GT/s PCIe\n",
    b"-16.0 GT/s\n",
    b"\xff\xfe\x00garbage",
    b"400 Gb/sec",
    b"1e308 Gb/sec (4X NDR)\n",
    b"Unknown\n",
    b"4: ACTIVE\n",
];

/// Random fixture trees: real layout, random file contents and sizes, some
/// files missing, some symlinks broken. Every check must survive them.
#[test]
fn garbage_trees_never_panic() {
    let mut rng = Rng(42);
    let mut classified = 0;
    for round in 0..120 {
        let s = Tree::new("fuzz");
        let hb = "pci0000:00";
        let chains: [&[&str]; 3] = [
            &["0000:00:01.0", "0000:01:00.0", "0000:02:00.0", "0000:03:00.0"],
            &["0000:00:01.0", "0000:01:00.0", "0000:02:01.0", "0000:04:00.0"],
            &["0000:00:03.0", "0000:05:00.0"],
        ];
        for chain in chains {
            for depth in 0..chain.len() {
                let dir = format!("/sys/devices/{hb}/{}", chain[..=depth].join("/"));
                let bdf = chain[depth];
                let is_gpu = depth + 1 == chain.len() && bdf != "0000:04:00.0";
                let pick = |rng: &mut Rng, good: &[u8]| -> Vec<u8> {
                    if rng.index(3) == 0 {
                        TEXT_GARBAGE[rng.index(TEXT_GARBAGE.len())].to_vec()
                    } else {
                        good.to_vec()
                    }
                };
                for (name, good) in [
                    ("vendor", if is_gpu { &b"0x10de\n"[..] } else { &b"0x15b3\n"[..] }),
                    ("class", if is_gpu { &b"0x030200\n"[..] } else { &b"0x060400\n"[..] }),
                    ("numa_node", &b"0\n"[..]),
                    ("current_link_speed", &b"16.0 GT/s PCIe\n"[..]),
                    ("current_link_width", &b"16\n"[..]),
                    ("max_link_speed", &b"32.0 GT/s PCIe\n"[..]),
                    ("max_link_width", &b"16\n"[..]),
                ] {
                    if rng.index(8) != 0 {
                        let data = pick(&mut rng, good);
                        s.file(&format!("{dir}/{name}"), &data);
                    }
                }
                let cfg_len = [0, 64, 256, 4096, rng.index(4200)][rng.index(5)];
                let cfg = if rng.index(2) == 0 { rng.bytes(cfg_len) } else { bridge_config(Some(0x1d)) };
                s.file(&format!("{dir}/config"), &cfg[..cfg_len.min(cfg.len())]);
                let target = format!("../../../devices/{hb}/{}", chain[..=depth].join("/"));
                s.link(
                    &format!("/sys/bus/pci/devices/{bdf}"),
                    if rng.index(10) == 0 { "../nowhere" } else { &target },
                );
                if rng.index(2) == 0 {
                    s.link(
                        &format!("{dir}/iommu_group"),
                        &format!("{}kernel/iommu_groups/{round}", "../".repeat(depth + 3)),
                    );
                }
            }
        }
        let nic_dir = format!("/sys/devices/{hb}/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0");
        s.link(&format!("{nic_dir}/infiniband/mlx5_0/device"), "../../../0000:04:00.0");
        s.link(
            "/sys/class/infiniband/mlx5_0",
            &format!("../../devices/{hb}/0000:00:01.0/0000:01:00.0/0000:02:01.0/0000:04:00.0/infiniband/mlx5_0"),
        );
        for name in ["rate", "link_layer", "state"] {
            let data = TEXT_GARBAGE[rng.index(TEXT_GARBAGE.len())];
            s.file(&format!("{nic_dir}/infiniband/mlx5_0/ports/1/{name}"), data);
        }
        s.file(&format!("{nic_dir}/infiniband/mlx5_0/ports/x/rate"), b"1 Gb/sec");
        s.file(&format!("/sys/kernel/iommu_groups/{round}/type"), TEXT_GARBAGE[rng.index(TEXT_GARBAGE.len())]);
        s.file("/proc/cmdline", TEXT_GARBAGE[rng.index(TEXT_GARBAGE.len())]);
        let root = SysRoot::at(s.path());
        let topo = discover(&root);
        let ps = pairs(&root, &topo);
        classified += ps.len();
        let f = check(&root, &topo, &env(&[("NCCL_NET_GDR_LEVEL", ["PHB", "x", "7", ""][round % 4])])).0;
        assert!(!f.is_empty());
        let _ = serde_json::to_string(&topo).unwrap();
    }
    assert!(classified > 0, "no fuzz round produced a GPU–NIC pair");
}
