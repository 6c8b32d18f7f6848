//! Checks of the RDMA and CUDA stacks: devices, ports, GIDs, uverbs nodes,
//! the CUDA driver; and the findings of the
//! facts GPUDirect RDMA rests on (GPU attributes, dma-buf on NIC and
//! kernel, peer memory), which the library judges
//! ([`gpudirect::gdr::Judgement`]) and this module only prints.

use gpudirect::gdr::{GpuFacts, HostFacts, Judgement, NicFacts};
use gpudirect::RegistrationPath;
use gpudirect::sysroot::SysRoot;
use gpudirect::{GidType, LinkLayer, Mtu, PortState};

use super::probes::RdmaDevice;
use super::{Blocker, Finding, Status};

/// Which GPUs and NICs are in a pair that still has a zero-copy path by the
/// library's [`plan`](gpudirect::gdr::plan): a fact that rules out one path
/// is a warning there, and a failure where nothing is left.
#[derive(Clone, Debug, Default)]
pub struct PathsLeft {
    /// CUDA ordinals.
    pub gpus: Vec<usize>,
    /// RDMA device names.
    pub nics: Vec<String>,
    /// There is no GPU–NIC pair at all (no RDMA device, or no GPU): a
    /// fact that rules out one path is then weighed against the host's
    /// facts alone (`host_allows`), not against pairs.
    pub no_pairs: bool,
    /// With no pair: whether the host's facts leave dma-buf and peer
    /// memory possible (the kernel's dma-buf support, the peer-memory
    /// client).
    pub host_allows: [bool; 2],
}

impl PathsLeft {
    /// Whether the path a fact `j` does not rule out remains where it
    /// applies (`here`, among pairs); with no pair, whether the host's
    /// facts leave it.
    fn at(&self, here: bool, j: &Judgement) -> Option<bool> {
        if !self.no_pairs {
            return Some(here);
        }
        match j.rules_out() {
            [RegistrationPath::DmaBuf] => Some(self.host_allows[1]),
            [RegistrationPath::PeerMemory] => Some(self.host_allows[0]),
            _ => None,
        }
    }

    /// The host facts' verdict on each path, for [`PathsLeft::host_allows`].
    pub fn host_paths(host: &HostFacts) -> [bool; 2] {
        let [kernel, peer] = host.judge();
        let keeps = |j: &Judgement, p: RegistrationPath| !j.known || !j.rules_out().contains(&p);
        [keeps(&kernel, RegistrationPath::DmaBuf), keeps(&peer, RegistrationPath::PeerMemory)]
    }
}

/// A judged fact as a finding: its status is what the fact rules out,
/// given whether `left` (a path remains where the fact applies; `None`
/// where there is no GPU–NIC pair, so only the fact's own path is known).
pub fn judged(check: String, j: &Judgement, left: Option<bool>) -> Finding {
    let (status, suffix) = match (j.known, j.rules_out()) {
        (false, _) => (Status::Skipped, String::new()),
        (true, []) => (Status::Ok, String::new()),
        // dma-buf is the path NVIDIA recommends and needs no peer-memory
        // module: losing peer memory where dma-buf remains is no problem.
        (true, [RegistrationPath::PeerMemory]) if left == Some(true) => (Status::Ok, ": not needed, dma-buf is possible".to_string()),
        (true, [p]) => {
            let other = if *p == RegistrationPath::DmaBuf { RegistrationPath::PeerMemory } else { RegistrationPath::DmaBuf };
            if left.unwrap_or(true) {
                (Status::Warn, format!(": rules out {p}; {other} is still possible"))
            } else {
                (Status::Fail, format!(": rules out {p}, and {other} is ruled out too"))
            }
        }
        (true, _) => (Status::Fail, ": rules out both zero-copy paths".to_string()),
    };
    let mut f = Finding::new(check, status, format!("{}{suffix}", j.summary));
    f.evidence = j.evidence.iter().filter(|e| !e.is_empty()).cloned().collect();
    f.fix = j.fix.clone();
    f
}

/// RDMA devices, their ports, GIDs and netdevs, the uverbs nodes, and each
/// NIC's dma-buf fact.
pub fn rdma(root: &SysRoot, devices: &Result<Vec<RdmaDevice>, String>, left: &PathsLeft) -> Vec<Finding> {
    let mut out = Vec::new();
    let sys_devs = list_dir(root, "/sys/class/infiniband");
    let uverbs: Vec<String> = list_dir(root, "/dev/infiniband").into_iter().filter(|n| n.starts_with("uverbs")).collect();
    match devices {
        Err(why) => out.push(
            Finding::new("rdma.devices", Status::Fail, "the RDMA devices cannot be listed")
                .evidence(why.clone())
                .fix("install rdma-core and the NIC's kernel driver (mlx5_ib, efa, irdma, bnxt_re), or for tests `rdma link add rxe0 type rxe netdev <if>`"),
        ),
        Ok(list) if list.is_empty() && !sys_devs.is_empty() => {
            // The kernel has them; libibverbs lists only devices it has a
            // user-space provider for.
            let drivers: Vec<String> = sys_devs.iter().map(|d| format!("{d}: {}", super::driver_name(root, &format!("/sys/class/infiniband/{d}/device")).unwrap_or_else(|| "unknown".to_owned()))).collect();
            out.push(
                Finding::new(
                    "rdma.devices",
                    Status::Fail,
                    format!("the kernel has RDMA device(s) {}, but libibverbs lists none: it has no user-space provider for their driver", sys_devs.join(", ")),
                )
                .evidence(format!("/sys/class/infiniband: {}", sys_devs.join(", ")))
                .evidence(format!("drivers: {}", drivers.join("; ")))
                .fix("install rdma-core's provider for that driver in this image or host (ibverbs-providers on Debian/Ubuntu, rdma-core on RHEL: libmlx5, libbnxt_re, libefa, libirdma); `ibv_devices` must list the device"),
            );
        }
        Ok(list) if list.is_empty() => out.push(
            Finding::new("rdma.devices", Status::Fail, "no RDMA device is visible to this process")
                .evidence(format!("/sys/class/infiniband: {}", none_or(&sys_devs)))
                .fix("load the NIC's RDMA driver; in a container, pass /dev/infiniband in (device plugin, --device, or host networking)"),
        ),
        Ok(list) => out.push(
            Finding::new("rdma.devices", Status::Ok, format!("{} RDMA device(s): {}", list.len(), names(list)))
                .evidence(format!("/sys/class/infiniband: {}", none_or(&sys_devs))),
        ),
    }
    // Containers: the kernel knows the devices but the process has no node to open.
    let f = if !sys_devs.is_empty() && uverbs.is_empty() {
        Finding::new("rdma.uverbs", Status::Fail, "RDMA devices exist but /dev/infiniband/uverbs* is missing (a container without the device nodes?)")
            .blocking(Blocker::DeviceNodes(Vec::new()))
            .evidence(format!("/sys/class/infiniband: {}", sys_devs.join(", ")))
            .evidence("/dev/infiniband/uverbs*: none")
            .fix("pass the nodes into the container (`--device /dev/infiniband/uverbs0 ...`, the Kubernetes RDMA device plugin) or run with host networking")
    } else if uverbs.is_empty() {
        Finding::new("rdma.uverbs", Status::Skipped, "no RDMA devices, so no uverbs nodes to check")
    } else {
        // Each device's node by its own number: a pod given some of the
        // nodes cannot open the others.
        let missing: Vec<(String, String)> = sys_devs
            .iter()
            .filter_map(|d| {
                let node = list_dir(root, &format!("/sys/class/infiniband/{d}/device/infiniband_verbs")).into_iter().find(|n| n.starts_with("uverbs"))?;
                (!uverbs.contains(&node)).then(|| (d.clone(), format!("{d} (/dev/infiniband/{node})")))
            })
            .collect();
        if missing.is_empty() {
            Finding::new("rdma.uverbs", Status::Ok, format!("uverbs nodes present: {}", uverbs.join(", ")))
        } else {
            let status = if missing.len() == sys_devs.len() { Status::Fail } else { Status::Warn };
            let shown: Vec<&str> = missing.iter().map(|(_, s)| s.as_str()).collect();
            Finding::new("rdma.uverbs", status, format!("{} of {} RDMA devices have no uverbs node here: {}", missing.len(), sys_devs.len(), shown.join(", ")))
                .blocking(Blocker::DeviceNodes(missing.iter().map(|(d, _)| d.clone()).collect()))
                .evidence(format!("/dev/infiniband: {}", uverbs.join(", ")))
                .fix("pass every device's node into the container (the RDMA device plugin's resource for each NIC, or `--device /dev/infiniband/uverbsN`), or leave the devices out of NCCL_IB_HCA")
        }
    };
    out.push(f);
    for d in devices.as_ref().map(|v| v.as_slice()).unwrap_or_default() {
        out.extend(device(root, d, left, left.nics.contains(&d.name)));
    }
    out
}

fn device(root: &SysRoot, d: &RdmaDevice, left: &PathsLeft, here: bool) -> Vec<Finding> {
    let mut out = Vec::new();
    let id = |what: &str| format!("rdma.{what}.{}", d.name);
    // Hardware NICs list their netdevs under the PCI function; software
    // RDMA (rxe, siw) has no PCI function and names its netdev in `parent`.
    let net_dir = format!("/sys/class/infiniband/{}/device/net", d.name);
    let parent = format!("/sys/class/infiniband/{}/parent", d.name);
    let netdevs = list_dir(root, &net_dir);
    let (on, source) = if !netdevs.is_empty() {
        (netdevs.join(", "), net_dir)
    } else if let Ok(p) = root.read(&parent) {
        (p, parent)
    } else {
        ("no network interface (an InfiniBand port)".to_string(), net_dir)
    };
    out.push(Finding::new(id("netdev"), Status::Ok, format!("{} sits on {on}", d.name)).evidence(source));
    let Some(p) = d.ports.first() else {
        out.push(
            Finding::new(id("port"), Status::Fail, format!("{}: the device could not be opened or queried", d.name))
                .evidence(d.chosen_gid.as_ref().err().cloned().unwrap_or_default())
                .blocking(Blocker::Port(d.name.clone())),
        );
        return out;
    };
    let mtu = p.active_mtu.map(|m| m.to_string()).unwrap_or_else(|| "unknown".into());
    let mut f = Finding::new(
        id("port"),
        if p.state == PortState::Active { Status::Ok } else { Status::Fail },
        format!("{} port 1: {:?}, link layer {:?}, active MTU {mtu}", d.name, p.state, p.link_layer),
    )
    .evidence(format!("ibv_query_port: state {:?}, link_layer {:?}, active_mtu {mtu}, max_mtu {:?}, lid {}", p.state, p.link_layer, p.max_mtu, p.lid))
    .evidence(format!("firmware {}", d.fw_ver));
    if p.state != PortState::Active {
        f = f.fix("bring the link up (cable, switch port, `ip link set <if> up`; on InfiniBand a running subnet manager)").blocking(Blocker::Port(d.name.clone()));
    } else if p.link_layer == LinkLayer::Ethernet && p.active_mtu.is_some_and(|m| m < Mtu::Mtu4096) {
        f.status = Status::Warn;
        f = f.fix("RoCE MTU follows the interface MTU: set it to 9000 (jumbo frames, end to end) for a 4096-byte RDMA MTU");
    }
    out.push(f);
    if p.link_layer == LinkLayer::Ethernet {
        let v2 = d.gids.iter().filter(|g| g.gid_type == GidType::RoceV2).count();
        let f = match &d.chosen_gid {
            Ok(c) if c.entry.gid_type == GidType::RoceV2 && c.entry.gid.is_ipv4_mapped() => {
                Finding::new(id("gid"), Status::Ok, format!("{}: would use {c}", d.name))
            }
            Ok(c) => Finding::new(id("gid"), Status::Warn, format!("{}: would use {c}", d.name))
                .fix("give the interface an IPv4 address so a RoCE v2 IPv4-mapped GID exists, and use the same GID index on every node (NCCL_IB_GID_INDEX)"),
            Err(e) => Finding::new(id("gid"), Status::Fail, format!("{}: no usable GID", d.name))
                .evidence(e.clone())
                .fix("bring the interface up and give it an IP address")
                .blocking(Blocker::Gid(d.name.clone())),
        };
        out.push(d.gids.iter().fold(f.evidence(format!("{} RoCE v2 entries of {}", v2, d.gids.len())), |f, g| f.evidence(g.to_string())));
    }
    out.push(match &d.dma_buf {
        Ok(probe) => {
            let j = NicFacts { device: d.name.clone(), dma_buf: *probe }.judge();
            judged(id("dmabuf"), &j, left.at(here, &j))
        }
        Err(e) => Finding::new(id("dmabuf"), Status::Skipped, format!("{}: the dma-buf probe could not run", d.name)).evidence(e.clone()),
    });
    out
}

/// The CUDA driver and each GPU's GPUDirect facts. The kernel module's
/// flavour is evidence for the GPU's dma-buf fact, which the library judges;
/// its version line is shown with the driver.
pub fn cuda(root: &SysRoot, gpus: &Result<Vec<GpuFacts>, String>, left: &PathsLeft) -> Vec<Finding> {
    let mut out = Vec::new();
    let version = match root.read("/proc/driver/nvidia/version") {
        Ok(t) => format!("/proc/driver/nvidia/version: {}", t.lines().next().unwrap_or_default()),
        Err(_) => "/proc/driver/nvidia/version: missing (no NVIDIA kernel module is loaded)".to_string(),
    };
    match gpus {
        Err(why) => {
            out.push(
                Finding::new("cuda.driver", Status::Fail, "CUDA cannot be used")
                    .evidence(why.clone())
                    .evidence(version)
                    .fix("install the NVIDIA driver; in a container use the NVIDIA container toolkit (--gpus)"),
            );
        }
        Ok(list) if list.is_empty() => out.push(
            Finding::new("cuda.driver", Status::Fail, "the CUDA driver sees no GPU").evidence(version).fix("check CUDA_VISIBLE_DEVICES and `nvidia-smi`"),
        ),
        Ok(list) => {
            let v = list.iter().find_map(|g| g.driver_version).map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)).unwrap_or_else(|| "unknown".into());
            let mut f = Finding::new("cuda.driver", Status::Ok, format!("CUDA driver {v}, {} GPU(s)", list.len()));
            for g in list {
                f = f.evidence(g.label.clone());
            }
            out.push(f.evidence(version));
            for g in list {
                let [gdr, dma_buf] = g.judge();
                let here = left.gpus.contains(&g.ordinal);
                out.push(judged(format!("cuda.gdr.gpu{}", g.ordinal), &gdr, left.at(here, &gdr)));
                out.push(judged(format!("cuda.dmabuf.gpu{}", g.ordinal), &dma_buf, left.at(here, &dma_buf)));
            }
        }
    }
    out
}

/// The host's facts: kernel dma-buf support and the peer-memory client.
pub fn host(host: &HostFacts, left: &PathsLeft) -> Vec<Finding> {
    let [kernel, peer] = host.judge();
    // With no pair, each host fact is weighed against the other alone (no
    // NIC rules dma-buf out here; a missing NIC is its own finding).
    let any = !left.gpus.is_empty();
    vec![judged("peermem.client".into(), &peer, left.at(any, &peer)), judged("dmabuf.kernel".into(), &kernel, left.at(any, &kernel))]
}

/// Entry names of a machine directory (none when it is missing).
fn list_dir(root: &SysRoot, dir: &str) -> Vec<String> {
    root.list_dir(dir).unwrap_or_default()
}

fn names(list: &[RdmaDevice]) -> String {
    list.iter().map(|d| d.name.as_str()).collect::<Vec<_>>().join(", ")
}

fn none_or(v: &[String]) -> String {
    if v.is_empty() {
        "none".into()
    } else {
        v.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpudirect::gdr::{DmaBufProbe, ModuleFlavour};
    use testkit::Tree;
    use gpudirect::{Errno, Gid, GidEntry, PortAttr};
    use super::super::probes::ChosenGid;

    /// A fixture tree, read as a machine root.
    fn root_of(t: &Tree) -> SysRoot {
        SysRoot::at(t.path())
    }

    fn rxe(mtu: Mtu, dma_buf: DmaBufProbe) -> RdmaDevice {
        let entry = GidEntry { index: 1, gid: Gid(std::net::Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0xc000, 0x0201]).octets()), gid_type: GidType::RoceV2, netdev: Some("eth0".into()) };
        RdmaDevice {
            name: "rxe0".into(),
            fw_ver: "0.0.0".into(),
            ports: vec![PortAttr { port: 1, state: PortState::Active, max_mtu: Some(Mtu::Mtu4096), active_mtu: Some(mtu), lid: 0, link_layer: LinkLayer::Ethernet, gid_table_len: 64 }],
            gids: vec![entry.clone()],
            chosen_gid: Ok(ChosenGid { entry, reason: "RoCE v2, IPv4-mapped".into() }),
            dma_buf: Ok(dma_buf),
        }
    }

    fn find<'a>(f: &'a [Finding], check: &str) -> &'a Finding {
        f.iter().find(|x| x.check == check).unwrap_or_else(|| panic!("no finding {check} in {f:#?}"))
    }

    #[test]
    fn soft_roce_host() {
        let t = Tree::new("rxe");
        t.file("/sys/class/infiniband/rxe0/device/net/eth0/address", "52:54:00:00:00:01\n").file("/dev/infiniband/uverbs0", "");
        let rxe0 = || Ok(vec![rxe(Mtu::Mtu1024, DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP)))]);
        let f = rdma(&root_of(&t), &rxe0(), &PathsLeft::default());
        assert_eq!(find(&f, "rdma.devices").status, Status::Ok);
        assert_eq!(find(&f, "rdma.uverbs").status, Status::Ok);
        assert_eq!(find(&f, "rdma.netdev.rxe0").summary, "rxe0 sits on eth0");
        let port = find(&f, "rdma.port.rxe0");
        assert_eq!(port.status, Status::Warn);
        assert!(port.fix.as_deref().unwrap().contains("9000"));
        assert_eq!(find(&f, "rdma.gid.rxe0").status, Status::Ok);
        let d = find(&f, "rdma.dmabuf.rxe0");
        assert_eq!(d.status, Status::Fail);
        assert_eq!(d.summary, "rxe0 cannot register dma-buf memory: rules out dma-buf, and peer memory is ruled out too");
        assert_eq!(d.evidence, vec!["ibv_reg_dmabuf_mr(fd = -1) answered EOPNOTSUPP (Operation not supported)".to_string()]);
        assert!(d.fix.as_deref().unwrap().contains("Soft-RoCE (rxe) never does"));
        // Where peer memory still gives the NIC a path, the same fact is a warning.
        let f = rdma(&root_of(&t), &rxe0(), &PathsLeft { gpus: vec![0], nics: vec!["rxe0".into()], no_pairs: false, host_allows: [true; 2] });
        let d = find(&f, "rdma.dmabuf.rxe0");
        assert_eq!((d.status, d.summary.as_str()), (Status::Warn, "rxe0 cannot register dma-buf memory: rules out dma-buf; peer memory is still possible"));
    }

    #[test]
    fn container_without_uverbs_nodes() {
        let t = Tree::new("container");
        t.file("/sys/class/infiniband/mlx5_0/ports/1/state", "4: ACTIVE\n");
        let f = rdma(&root_of(&t), &Ok(vec![]), &PathsLeft::default());
        assert_eq!(find(&f, "rdma.devices").status, Status::Fail);
        let u = find(&f, "rdma.uverbs");
        assert_eq!(u.status, Status::Fail);
        assert!(u.fix.as_deref().unwrap().contains("--device /dev/infiniband/uverbs0"));
    }

    /// bnxt_re devices with no user-space provider: the kernel lists them,
    /// libibverbs does not; the fix names the provider, not the driver.
    #[test]
    fn kernel_devices_without_a_provider_name_the_provider() {
        let t = Tree::new("noprovider");
        t.file("/sys/devices/pci0000:00/0000:41:00.0/infiniband/bnxt_re0/ports/1/state", "4: ACTIVE\n");
        t.dir("/sys/bus/pci/drivers/bnxt_en");
        t.link("/sys/devices/pci0000:00/0000:41:00.0/driver", "../../../bus/pci/drivers/bnxt_en");
        t.link("/sys/class/infiniband/bnxt_re0", "../../devices/pci0000:00/0000:41:00.0/infiniband/bnxt_re0");
        t.link("/sys/devices/pci0000:00/0000:41:00.0/infiniband/bnxt_re0/device", "../../../0000:41:00.0");
        t.file("/dev/infiniband/uverbs0", "");
        let f = rdma(&root_of(&t), &Ok(vec![]), &PathsLeft::default());
        let d = find(&f, "rdma.devices");
        assert_eq!(d.status, Status::Fail);
        assert!(d.summary.contains("the kernel has RDMA device(s) bnxt_re0, but libibverbs lists none"), "{d:#?}");
        assert!(d.evidence.iter().any(|e| e == "drivers: bnxt_re0: bnxt_en"), "{d:#?}");
        assert!(d.fix.as_deref().unwrap().contains("libbnxt_re"));
    }

    /// Two of four InfiniBand devices without their uverbs node in the pod.
    #[test]
    fn uverbs_nodes_are_checked_per_device() {
        let t = Tree::new("someuverbs");
        for (i, d) in ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"].iter().enumerate() {
            t.file(&format!("/sys/class/infiniband/{d}/device/infiniband_verbs/uverbs{i}/ibdev"), format!("{d}\n"));
        }
        t.file("/dev/infiniband/uverbs0", "").file("/dev/infiniband/uverbs1", "");
        let f = rdma(&root_of(&t), &Ok(vec![]), &PathsLeft::default());
        let u = find(&f, "rdma.uverbs");
        assert_eq!(u.status, Status::Warn, "{u:#?}");
        assert_eq!(u.summary, "2 of 4 RDMA devices have no uverbs node here: mlx5_2 (/dev/infiniband/uverbs2), mlx5_3 (/dev/infiniband/uverbs3)");
    }

    /// No GPU–NIC pair at all (a GPU machine without an RDMA device): the
    /// host facts are weighed against each other only; missing peer memory
    /// with a dma-buf kernel is not "dma-buf ruled out too".
    #[test]
    fn without_a_pair_the_host_facts_do_not_rule_out_the_other_path() {
        let h = HostFacts { kernel_release: Some("6.8.0".into()), peer_memory_found: vec![], peer_memory_api: Some(false) };
        let f = host(&h, &PathsLeft { no_pairs: true, host_allows: PathsLeft::host_paths(&h), ..PathsLeft::default() });
        let p = find(&f, "peermem.client");
        assert_eq!(p.status, Status::Ok, "{p:#?}");
        assert!(p.summary.ends_with("not needed, dma-buf is possible"), "{}", p.summary);
        let old = HostFacts { kernel_release: Some("5.4.0".into()), ..h };
        let p = find(&host(&old, &PathsLeft { no_pairs: true, host_allows: PathsLeft::host_paths(&old), ..PathsLeft::default() }), "peermem.client").clone();
        assert_eq!(p.status, Status::Fail, "a 5.4 kernel rules dma-buf out: {p:#?}");
    }

    /// Soft-RoCE in a guest with no GPU: no pair, the NIC rules dma-buf
    /// out and the host has no peer-memory client: nothing is left.
    #[test]
    fn without_a_pair_a_nic_fact_is_weighed_against_the_hosts() {
        let t = Tree::new("rxe-nogpu");
        let rxe0 = || Ok(vec![rxe(Mtu::Mtu4096, DmaBufProbe::Unsupported(Errno(libc::EOPNOTSUPP)))]);
        let host = HostFacts { kernel_release: Some("6.1.0".into()), peer_memory_found: vec![], peer_memory_api: Some(false) };
        let left = PathsLeft { no_pairs: true, host_allows: PathsLeft::host_paths(&host), ..PathsLeft::default() };
        let d = find(&rdma(&root_of(&t), &rxe0(), &left), "rdma.dmabuf.rxe0").clone();
        assert_eq!(d.status, Status::Fail, "{d:#?}");
        assert!(d.summary.ends_with("rules out dma-buf, and peer memory is ruled out too"), "{}", d.summary);
        let with_peer = PathsLeft { host_allows: [true, true], ..left };
        assert_eq!(find(&rdma(&root_of(&t), &rxe0(), &with_peer), "rdma.dmabuf.rxe0").status, Status::Warn);
    }

    #[test]
    fn no_rdma_subsystem() {
        let t = Tree::new("nordma");
        let f = rdma(&root_of(&t), &Err("no RDMA subsystem in this kernel".into()), &PathsLeft::default());
        let d = find(&f, "rdma.devices");
        assert_eq!((d.status, d.evidence[0].as_str()), (Status::Fail, "no RDMA subsystem in this kernel"));
        assert_eq!(find(&f, "rdma.uverbs").status, Status::Skipped);
    }

    fn gpu(gdr: bool, dmabuf: bool) -> GpuFacts {
        GpuFacts {
            ordinal: 0,
            label: "GPU0 (NVIDIA H200, 0000:17:00.0)".into(),
            pci_bus_id: Some("0000:17:00.0".into()),
            cuda_unavailable: None,
            driver_version: Some(12080),
            gdr_supported: Some(gdr),
            dma_buf_supported: Some(dmabuf),
            module: ModuleFlavour::Open,
        }
    }

    #[test]
    fn cuda_findings() {
        let t = Tree::new("cuda");
        t.file("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n");
        let gpu0 = PathsLeft { gpus: vec![0], nics: vec!["mlx5_0".into()], no_pairs: false, host_allows: [true; 2] };
        let f = cuda(&root_of(&t), &Ok(vec![gpu(true, false)]), &gpu0);
        assert_eq!(find(&f, "cuda.driver").summary, "CUDA driver 12.8, 1 GPU(s)");
        assert_eq!(find(&f, "cuda.gdr.gpu0").status, Status::Ok);
        assert_eq!(find(&f, "cuda.gdr.gpu0").evidence, ["CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 1"]);
        let d = find(&f, "cuda.dmabuf.gpu0");
        assert_eq!(d.status, Status::Warn);
        assert_eq!(d.summary, "GPU0 (NVIDIA H200, 0000:17:00.0) cannot export dma-buf: rules out dma-buf; peer memory is still possible");
        // With no path left for the GPU, the same fact fails.
        let f = cuda(&root_of(&t), &Ok(vec![gpu(true, false)]), &PathsLeft::default());
        assert_eq!(find(&f, "cuda.dmabuf.gpu0").status, Status::Fail);
        // The module flavour is evidence for the GPU's dma-buf fact, not a
        // finding of its own; its version line is shown with the driver.
        let proprietary = GpuFacts { module: ModuleFlavour::Proprietary, ..gpu(true, false) };
        let f = cuda(&root_of(&t), &Ok(vec![proprietary]), &gpu0);
        assert!(find(&f, "cuda.driver").evidence.iter().any(|e| e.contains("535.104.05")), "{f:#?}");
        let d = find(&f, "cuda.dmabuf.gpu0");
        assert_eq!(d.status, Status::Warn);
        assert!(d.evidence.iter().any(|e| e == "NVIDIA kernel module: the proprietary kernel module (/proc/driver/nvidia/version)"), "{d:#?}");
        assert!(d.fix.as_deref().unwrap().contains("open kernel module flavour"), "{d:#?}");
        assert!(!f.iter().any(|x| x.check == "cuda.module"));
        let f = cuda(&root_of(&t), &Ok(vec![gpu(false, true)]), &gpu0);
        assert_eq!(find(&f, "cuda.gdr.gpu0").status, Status::Fail);
        assert!(find(&f, "cuda.gdr.gpu0").fix.as_deref().unwrap().contains("data-center GPU"));
        let f = cuda(&root_of(&Tree::new("nodriver")), &Err("CUDA is not available: libcuda.so.1 cannot be loaded".into()), &gpu0);
        assert_eq!(find(&f, "cuda.driver").status, Status::Fail);
        assert!(find(&f, "cuda.driver").evidence.iter().any(|e| e.contains("no NVIDIA kernel module is loaded")));
    }

    #[test]
    fn peer_memory_and_kernel() {
        let h = HostFacts { kernel_release: Some("5.10.0-32-amd64".into()), peer_memory_found: vec![], peer_memory_api: Some(true) };
        // An old kernel and no peer memory: nothing is left.
        let f = host(&h, &PathsLeft::default());
        assert_eq!(find(&f, "peermem.client").status, Status::Fail);
        assert_eq!(find(&f, "peermem.client").fix.as_deref(), Some("`modprobe nvidia-peermem`"));
        assert_eq!(find(&f, "dmabuf.kernel").status, Status::Fail);
        // No peer memory where dma-buf works: nothing to fix.
        let h = HostFacts { kernel_release: Some("6.8.0-45-generic".into()), ..h };
        let f = host(&h, &PathsLeft { gpus: vec![0], nics: vec!["mlx5_0".into()], no_pairs: false, host_allows: [true; 2] });
        assert_eq!(find(&f, "peermem.client").status, Status::Ok);
        assert_eq!(find(&f, "peermem.client").summary, "no peer-memory client is loaded: not needed, dma-buf is possible");
        let h = HostFacts { kernel_release: Some("6.8.0-45-generic".into()), peer_memory_found: vec!["/sys/module/nvidia_peermem/version".into()], peer_memory_api: Some(true) };
        let f = host(&h, &PathsLeft::default());
        assert_eq!(find(&f, "peermem.client").status, Status::Ok);
        assert_eq!(find(&f, "dmabuf.kernel").status, Status::Ok);
    }
}
