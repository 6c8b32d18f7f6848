//! PCIe topology, ACS, IOMMU and link bandwidth between GPUs and RDMA NICs.
//! Discovery and classification are the library's ([`gpudirect::topology`]);
//! this module judges what they found and reads the rest (config space,
//! IOMMU groups, link speeds).
//!
//! GPUDirect RDMA is PCIe peer-to-peer traffic between a NIC and GPU memory.
//! Whether NCCL even tries depends on how far apart the two devices sit in
//! the PCIe tree; whether the traffic then flows at full speed depends on ACS
//! redirection on the switch ports it crosses, on the IOMMU translating
//! addresses, and on the narrowest link. All of that is in sysfs, so every
//! check here reads files through a [`SysRoot`] (symlinks resolved inside the
//! root, never escaping it) and runs unchanged against the fixture trees
//! under `tests/data/machines/`.
//!

use std::collections::BTreeMap;

use serde::Serialize;

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::{
    all_pairs, gdr_limit, placement, GdrLimit, GpuDev, NicDev, Pair, PathLevel, PciTopology, Placement, IB_CLASS,
    PCI_DEVICES,
};

use super::{Finding, Status};

const IOMMU_GROUPS: &str = "/sys/kernel/iommu_groups";
/// PCIe configuration space is 4 KiB; nothing past it has meaning.
const CONFIG_LIMIT: u64 = 4096;

// ---------------------------------------------------------------------------
// Reading the machine: through gpudirect's SysRoot, which stays inside the
// root and reads bounded.

/// A sysfs text attribute, trimmed (the kernel ends them with a newline).
pub(super) fn read_text(root: &SysRoot, machine_path: &str) -> Option<String> {
    root.read(machine_path).ok()
}

// ---------------------------------------------------------------------------
// Config space

/// What a bridge's configuration space says about ACS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ConfigAcs {
    /// Only the 64-byte header came back: sysfs truncates config reads for
    /// readers without CAP_SYS_ADMIN.
    NeedsRoot {
        /// Bytes read.
        len: usize,
    },
    /// 256 bytes: no extended configuration space (conventional PCI, or a
    /// kernel/VM without access to it), so no ACS capability to read.
    NoExtendedSpace {
        /// Bytes read.
        len: usize,
    },
    /// The extended capability list has no ACS capability.
    Absent,
    /// The ACS extended capability.
    Present {
        /// Offset of its header.
        offset: usize,
        /// ACS Capability register (what the port supports).
        cap: u16,
        /// ACS Control register (what is enabled).
        ctrl: u16,
    },
    /// The bytes don't form a valid capability list.
    Broken(String),
}

/// ACS Control bits (PCIe base spec, ACS Extended Capability).
const ACS_BITS: [(u16, &str); 7] = [
    (0x01, "SrcValid"),
    (0x02, "TransBlk"),
    (0x04, "ReqRedir"),
    (0x08, "CmpltRedir"),
    (0x10, "UpstreamFwd"),
    (0x20, "EgressCtrl"),
    (0x40, "DirectTrans"),
];
const ACS_RR: u16 = 0x04;
const ACS_CR: u16 = 0x08;
const ACS_EC: u16 = 0x20;
const ACS_CAP_ID: u32 = 0x000d;
const PCIE_CAP_ID: u8 = 0x10;

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes([*b.get(at)?, *b.get(at + 1)?, *b.get(at + 2)?, *b.get(at + 3)?]))
}

/// Walks the extended capability list from 0x100 (header: id in bits 15:0,
/// version 19:16, next offset 31:20) to the ACS capability.
pub fn acs_from_config(cfg: &[u8]) -> ConfigAcs {
    let len = cfg.len();
    if len < 64 {
        return ConfigAcs::Broken(format!("only {len} bytes, shorter than the 64-byte header"));
    }
    if len < 256 {
        return ConfigAcs::NeedsRoot { len };
    }
    if len < 0x104 {
        return ConfigAcs::NoExtendedSpace { len };
    }
    let mut off = 0x100usize;
    // (4096 - 256) / 4 headers at most; more means a loop.
    for _ in 0..960 {
        let Some(header) = le32(cfg, off) else {
            return ConfigAcs::Broken(format!("capability at {off:#x} runs past the {len} bytes read"));
        };
        if header == 0 && off == 0x100 {
            return ConfigAcs::Absent;
        }
        if header == 0xffff_ffff {
            return ConfigAcs::Broken(format!("header at {off:#x} reads all ones (device not responding)"));
        }
        if header & 0xffff == ACS_CAP_ID {
            return match (le16(cfg, off + 4), le16(cfg, off + 6)) {
                (Some(cap), Some(ctrl)) => ConfigAcs::Present { offset: off, cap, ctrl },
                _ => ConfigAcs::Broken(format!("ACS capability at {off:#x} is cut off")),
            };
        }
        let next = ((header >> 20) & 0xffc) as usize;
        if next == 0 {
            return ConfigAcs::Absent;
        }
        if next < 0x100 {
            return ConfigAcs::Broken(format!("capability at {off:#x} points to {next:#x}, inside the header"));
        }
        off = next;
    }
    ConfigAcs::Broken("extended capability list loops".to_owned())
}

/// The PCIe Device/Port Type from the standard capability list, when the
/// bytes reach it (they don't in a 64-byte read).
fn pcie_port_type(cfg: &[u8]) -> Option<u8> {
    if le16(cfg, 6)? & 0x10 == 0 {
        return None;
    }
    let mut ptr = usize::from(*cfg.get(0x34)? & 0xfc);
    for _ in 0..48 {
        if ptr < 0x40 {
            return None;
        }
        if *cfg.get(ptr)? == PCIE_CAP_ID {
            return Some(((le16(cfg, ptr + 2)? >> 4) & 0xf) as u8);
        }
        ptr = usize::from(*cfg.get(ptr + 1)? & 0xfc);
    }
    None
}

fn port_role(port_type: Option<u8>) -> &'static str {
    match port_type {
        Some(4) => "root port",
        Some(5) => "switch upstream port",
        Some(6) => "switch downstream port",
        Some(7) => "PCIe-to-PCI bridge",
        Some(8) => "PCI-to-PCIe bridge",
        _ => "bridge",
    }
}

/// lspci's rendering, so the evidence reads like `lspci -vvv`.
fn acs_flags(v: u16) -> String {
    ACS_BITS
        .iter()
        .map(|(bit, name)| format!("{name}{}", if v & bit != 0 { '+' } else { '-' }))
        .collect::<Vec<_>>()
        .join(" ")
}

// ---------------------------------------------------------------------------
// Checks

/// Topology, ACS, IOMMU and bandwidth findings for the discovered devices.
/// `env` is searched for `NCCL_NET_GDR_LEVEL` only; [`super::env`] judges the
/// rest of the environment.
pub fn check(root: &SysRoot, topo: &PciTopology, env: &[(String, String)]) -> Vec<Finding> {
    let mut out = device_findings(topo);
    if topo.gpus.is_empty() || topo.nics.is_empty() {
        out.push(
            Finding::new("acs.path", Status::Skipped, "ACS not checked: there is no GPU–NIC pair").evidence(format!(
                "{} GPU(s), {} RDMA NIC(s)",
                topo.gpus.len(),
                topo.nics.len()
            )),
        );
        out.push(iommu_finding(root, topo));
        return out;
    }
    let limit = gdr_limit(env);
    let mut placed = Vec::new();
    for result in all_pairs(root, topo) {
        match result {
            Ok(p) => placed.push(p),
            Err(why) => out.push(
                Finding::new("topology.path", Status::Skipped, format!("cannot place {why}"))
                    .evidence("the device is not under /sys/devices/pci*, so its PCIe path is unknown"),
            ),
        }
    }
    out.extend(topology_findings(topo, &placed, &limit));
    out.extend(acs_findings(root, &placed));
    out.push(iommu_finding(root, topo));
    out.extend(bandwidth_findings(root, topo, &placed, &limit));
    out
}

fn numa_text(n: Option<i32>) -> String {
    n.map_or_else(|| "unknown (-1)".to_owned(), |n| n.to_string())
}

fn device_findings(topo: &PciTopology) -> Vec<Finding> {
    let mut out = Vec::new();
    let notes = |mut f: Finding| {
        for n in &topo.notes {
            f = f.evidence(n.clone());
        }
        f
    };
    if topo.gpus.is_empty() {
        out.push(notes(
            Finding::new(
                "topology.gpus",
                Status::Fail,
                format!("no NVIDIA GPU (vendor 0x10de, class 0x0300/0x0302) in {PCI_DEVICES}"),
            )
            .fix(
                "Check `lspci -d 10de:` on the host. A VM needs the GPU passed through; on bare metal, reseat it or \
                 check that it is enabled in the BIOS.",
            ),
        ));
    }
    if topo.nics.is_empty() {
        let summary = if topo.other_rdma.is_empty() {
            format!("no RDMA NIC: {IB_CLASS} lists no device, so there is nothing for GPUDirect RDMA to use")
        } else {
            let names: Vec<&str> = topo.other_rdma.iter().map(|o| o.name.as_str()).collect();
            format!(
                "no RDMA NIC with a PCI function: only {} (software RDMA moves data with the CPU and can't reach \
                 GPU memory)",
                names.join(", ")
            )
        };
        let mut f = notes(Finding::new("topology.nics", Status::Fail, summary));
        for o in &topo.other_rdma {
            f = f.evidence(format!("{}: {}", o.name, o.reason));
        }
        out.push(f.fix(
            "Bare metal: install the NIC's RDMA stack (rdma-core with mlx5_ib, or DOCA/MLNX-OFED) and check \
             `ibv_devices`. In a container: give it the host's RDMA devices (host networking, or an SR-IOV VF / \
             RDMA shared-device plugin in Kubernetes) and pass /dev/infiniband/uverbs* in \
             (`--device=/dev/infiniband`); NCCL then picks NICs with NCCL_IB_HCA.",
        ));
    }
    if !topo.gpus.is_empty() && !topo.nics.is_empty() {
        let mut f = Finding::new(
            "topology.devices",
            Status::Ok,
            format!("{} NVIDIA GPU(s) and {} RDMA NIC(s) found", topo.gpus.len(), topo.nics.len()),
        );
        for g in &topo.gpus {
            f = f.evidence(format!(
                "{} {} [{}] class {}, NUMA node {}",
                g.label(),
                g.bdf,
                g.pci_id,
                g.class,
                numa_text(g.numa_node)
            ));
        }
        for n in &topo.nics {
            let ports: Vec<String> = n
                .ports
                .iter()
                .map(|p| {
                    format!(
                        "port {}: {}, {}, {}",
                        p.port,
                        p.rate.as_deref().unwrap_or("rate unknown"),
                        p.link_layer.as_deref().unwrap_or("link layer unknown"),
                        p.state.as_deref().unwrap_or("state unknown")
                    )
                })
                .collect();
            f = f.evidence(format!(
                "{} {} [{}] NUMA node {}, netdevs [{}]; {}",
                n.name,
                n.bdf,
                n.pci_id,
                numa_text(n.numa_node),
                n.netdevs.join(", "),
                if ports.is_empty() { "no ports listed".to_owned() } else { ports.join("; ") }
            ));
        }
        for o in &topo.other_rdma {
            f = f.evidence(format!("{} not used: {}", o.name, o.reason));
        }
        out.push(notes(f));
    }
    out
}

fn route_text(p: &Pair) -> String {
    let gpu = format!("GPU{}", p.gpu_index);
    match p.level {
        PathLevel::Pix | PathLevel::Pxb => {
            let hops = p.bridges.join(" -> ");
            let shape =
                if p.level == PathLevel::Pix { "inside one switch" } else { "several bridge levels, no host bridge" };
            format!(
                "traffic turns around at {}: {gpu} -> {hops} -> {} ({} bridges, {shape})",
                p.turnaround.as_deref().unwrap_or("?"),
                p.nic,
                p.bridges.len()
            )
        }
        PathLevel::Phb => format!(
            "no common bridge below host bridge {}: {gpu} and {} sit under different root ports, so traffic turns \
             around in the CPU's root complex",
            p.gpu_host_bridge, p.nic
        ),
        PathLevel::Node => {
            let numa = if p.gpu_numa.is_none() || p.nic_numa.is_none() {
                format!(
                    "NUMA nodes {} and {}: with a -1 the kernel doesn't say, so this may really be SYS",
                    numa_text(p.gpu_numa),
                    numa_text(p.nic_numa)
                )
            } else {
                format!("both on NUMA node {}", numa_text(p.gpu_numa))
            };
            format!(
                "different host bridges {} ({gpu}) and {} ({}), {numa}: traffic crosses the CPU between them",
                p.gpu_host_bridge, p.nic_host_bridge, p.nic
            )
        }
        PathLevel::Sys => format!(
            "host bridges {} ({gpu}, NUMA node {}) and {} ({}, NUMA node {}): traffic crosses the inter-socket link",
            p.gpu_host_bridge,
            numa_text(p.gpu_numa),
            p.nic_host_bridge,
            p.nic,
            numa_text(p.nic_numa)
        ),
    }
}

fn topology_findings(topo: &PciTopology, pairs: &[Pair], limit: &GdrLimit) -> Vec<Finding> {
    let mut out = Vec::new();
    for p in pairs {
        let gpu = &topo.gpus[p.gpu_index];
        let nic = topo.nics.iter().find(|n| n.name == p.nic);
        let allowed = limit.allows(p.nccl_level);
        let closer: Vec<String> = pairs
            .iter()
            .filter(|q| q.gpu_index == p.gpu_index && q.nic != p.nic && limit.allows(q.nccl_level))
            .map(|q| format!("{} ({})", q.nic, q.level))
            .collect();
        let head = format!("{} {} <-> {} {}: {}", gpu.label(), p.gpu, p.nic, p.nic_bdf, p.level);
        let id = format!("topology.path.gpu{}-{}", p.gpu_index, p.nic);
        let mut f = if allowed && p.gdr_by_default {
            Finding::new(id.clone(), Status::Ok, format!("{head}, GPUDirect RDMA allowed under {}", limit.describe()))
        } else if allowed {
            Finding::new(
                id.clone(),
                Status::Warn,
                format!(
                    "{head}: GPUDirect RDMA allowed only because {} raises NCCL's limit past PXB; the traffic \
                     goes through the CPU",
                    limit.describe()
                ),
            )
            .fix(format!(
                "Measure this pair (ib_write_bw --use_cuda={} -d {} against a peer) with and without GDR: \
                 peer-to-peer through the root complex is slower than host staging on many CPUs. If it is, unset \
                 NCCL_NET_GDR_LEVEL.",
                gpu.index, p.nic
            ))
        } else if !closer.is_empty() {
            Finding::new(
                id.clone(),
                Status::Ok,
                format!(
                    "{head}: beyond {}, so no GPUDirect RDMA on this pair; {} keeps it through {}",
                    limit.describe(),
                    gpu.label(),
                    closer.join(", ")
                ),
            )
        } else {
            let fix = if p.gdr_by_default {
                format!(
                    "Unset NCCL_NET_GDR_LEVEL (now {}): NCCL's default PXB would allow GPUDirect RDMA on this {} pair.",
                    limit.env_value.as_deref().unwrap_or(""),
                    p.nccl_level
                )
            } else if p.level == PathLevel::Sys {
                format!(
                    "Use a NIC on the GPU's socket (NUMA node {}): move a NIC into a slot on that socket or pick one \
                     there with NCCL_IB_HCA. GPUDirect RDMA across the inter-socket link is usually slower than \
                     staging through host memory; NCCL_NET_GDR_LEVEL=SYS forces it, but measure first.",
                    numa_text(p.gpu_numa)
                )
            } else {
                format!(
                    "Put the GPU and the NIC under one PCIe switch (a slot behind the GPU's switch; see the board \
                     manual's slot map), or use a NIC that already is. If this CPU forwards peer-to-peer well \
                     (measure with ib_write_bw --use_cuda={} -d {}), NCCL_NET_GDR_LEVEL=PHB allows it.",
                    gpu.index, p.nic
                )
            };
            Finding::new(
                id.clone(),
                Status::Fail,
                format!(
                    "{head}: beyond {}, so NCCL turns GPUDirect RDMA off and {} has no closer NIC: traffic is \
                     staged through host memory",
                    limit.describe(),
                    gpu.label()
                ),
            )
            .fix(fix)
        };
        f = f
            .evidence(format!("{} {}: {} (NUMA node {})", gpu.label(), p.gpu, gpu.sysfs_path, numa_text(p.gpu_numa)))
            .evidence(format!(
                "{} {}: {} (NUMA node {})",
                p.nic,
                p.nic_bdf,
                nic.map_or("?", |n| n.sysfs_path.as_str()),
                numa_text(p.nic_numa)
            ))
            .evidence(route_text(p));
        f = f.evidence(if p.nccl_level == p.level {
            format!("NCCL's own model agrees: {}", p.nccl_level)
        } else if p.level == PathLevel::Node {
            "NCCL's own model says PHB: it has no NODE level, host bridges on one NUMA node are one CPU node to it"
                .to_owned()
        } else {
            format!(
                "NCCL's own model says {} (it walks sysfs two directories at a time), and that is what decides GDR",
                p.nccl_level
            )
        });
        f = f.evidence(format!("limit: {}; {}", limit.describe(), limit.explanation));
        if limit.env_used {
            f = f.evidence(format!(
                "with NCCL's default limit PXB this pair would {}get GPUDirect RDMA",
                if p.gdr_by_default { "" } else { "not " }
            ));
        }
        if !allowed && !p.gdr_by_default && matches!(p.nccl_level, PathLevel::Phb) {
            f = f.evidence(
                "not checked here: on AMD Rome CPUs NCCL's default also allows PHB when GPU and NIC share a root \
                 complex, and on Grace (C2C) systems it allows GDR through the CPU (NCCL_NET_GDR_C2C, 2.26+)",
            );
        }
        out.push(f);
    }
    out
}

fn acs_findings(root: &SysRoot, pairs: &[Pair]) -> Vec<Finding> {
    if pairs.is_empty() {
        return vec![Finding::new("acs.path", Status::Skipped, "ACS not checked: no GPU–NIC pair could be placed")];
    }
    let mut by_bridge: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for p in pairs.iter().filter(|p| matches!(p.level, PathLevel::Pix | PathLevel::Pxb)) {
        for b in &p.bridges {
            by_bridge.entry(b.as_str()).or_default().push(p.label());
        }
    }
    if by_bridge.is_empty() {
        let levels: Vec<String> = pairs.iter().map(Pair::label).collect();
        return vec![Finding::new(
            "acs.path",
            Status::Ok,
            "ACS redirection changes nothing here: no GPU–NIC pair shares a PCIe switch, so their traffic goes \
             through the root complex anyway",
        )
        .evidence(format!("pairs: {}", levels.join(", ")))];
    }
    by_bridge.into_iter().map(|(bdf, labels)| acs_bridge_finding(root, bdf, &labels)).collect()
}

fn acs_bridge_finding(root: &SysRoot, bdf: &str, labels: &[String]) -> Finding {
    let cfg_path = format!("{PCI_DEVICES}/{bdf}/config");
    let on_path = format!("on the path of {}", labels.join(", "));
    let bytes = match root.read_bytes(&cfg_path, CONFIG_LIMIT) {
        Ok(b) => b,
        Err(e) => {
            return Finding::new(
                format!("acs.bridge.{bdf}"),
                Status::Skipped,
                format!("{bdf}: cannot read {cfg_path}: {e}"),
            )
            .evidence(on_path)
        }
    };
    let role = port_role(pcie_port_type(&bytes));
    let read = format!("{cfg_path}: {} bytes", bytes.len());
    let id = format!("acs.bridge.{bdf}");
    let f = |status, summary: String| Finding::new(id.clone(), status, summary).evidence(read.clone());
    match acs_from_config(&bytes) {
        ConfigAcs::NeedsRoot { len } => f(
            Status::Skipped,
            format!(
                "{bdf}: ACS needs root to check: only {len} bytes of config space came back (sysfs gives readers \
                 without CAP_SYS_ADMIN the 64-byte header only)"
            ),
        )
        .evidence(on_path)
        .fix("Run the doctor as root (in a container, root of the host's user namespace) to read ACS."),
        ConfigAcs::NoExtendedSpace { len } => f(
            Status::Skipped,
            format!(
                "{bdf}: ACS not visible: {len} bytes of config space means no extended space (a conventional PCI \
                 bridge, or a VM without ECAM access)"
            ),
        )
        .evidence(on_path),
        ConfigAcs::Broken(why) => {
            f(Status::Skipped, format!("{bdf}: extended capabilities not judged: {why}")).evidence(on_path)
        }
        ConfigAcs::Absent => {
            f(Status::Ok, format!("{bdf} ({role}): no ACS capability, so it forwards peer-to-peer directly"))
                .evidence(on_path)
        }
        ConfigAcs::Present { offset, cap, ctrl } => {
            let regs = format!(
                "ACS capability at {offset:#x}: ACSCap: {}; ACSCtl: {} ({ctrl:#06x})",
                acs_flags(cap),
                acs_flags(ctrl)
            );
            if ctrl & (ACS_RR | ACS_CR) != 0 {
                f(
                    Status::Fail,
                    format!(
                        "{bdf} ({role}): ACS ReqRedir{} CmpltRedir{} sends GPU<->NIC peer-to-peer up to the root \
                         complex instead of across the switch: GPUDirect RDMA slows down or fails (NCCL: \
                         IBV_WC_LOC_PROT_ERR, vendor err 81)",
                        if ctrl & ACS_RR != 0 { '+' } else { '-' },
                        if ctrl & ACS_CR != 0 { '+' } else { '-' }
                    ),
                )
                .evidence(regs)
                .evidence(on_path)
                .fix(format!(
                    "Disable ACS redirection on {bdf}: as root, `setpci -s {bdf} ECAP_ACS+6.w=0000` (or \
                     `setpci -s {bdf} {:#x}.w=0000` with pciutils too old to know ECAP_ACS), run at every boot \
                     (e.g. a systemd unit before the GPU jobs start); or boot with `pci=disable_acs_redir={bdf}` \
                     (Linux 5.1+), or turn ACS off in the BIOS. The kernel turns ACS on when the IOMMU is enabled, \
                     even with iommu=pt. Turning it off merges IOMMU groups, so don't on hosts that pass devices to \
                     VMs.",
                    offset + 6
                ))
            } else if ctrl & ACS_EC != 0 {
                f(
                    Status::Warn,
                    format!(
                        "{bdf} ({role}): ACS P2P Egress Control is on: whether it blocks GPU<->NIC traffic depends \
                         on its egress control vector, not read here"
                    ),
                )
                .evidence(regs)
                .evidence(on_path)
                .fix(format!("Clear it with `setpci -s {bdf} ECAP_ACS+6.w=0000` (as root, at every boot)."))
            } else {
                let note = if ctrl & 0x01 != 0 { " (SrcValid alone doesn't reroute)" } else { "" };
                f(Status::Ok, format!("{bdf} ({role}): ACS does not redirect peer-to-peer{note}"))
                    .evidence(regs)
                    .evidence(on_path)
            }
        }
    }
}

/// How a device's IOMMU group handles DMA.
enum GroupMode {
    NoGroup,
    Identity,
    Translated(String),
    Other(String),
    NoTypeFile,
}

fn iommu_finding(root: &SysRoot, topo: &PciTopology) -> Finding {
    let cmdline = read_text(root, "/proc/cmdline");
    let params: Vec<&str> = cmdline.as_deref().map(|c| c.split_whitespace().collect()).unwrap_or_default();
    let has = |p: &str| params.contains(&p);
    let passthrough = has("iommu=pt")
        || params.iter().any(|p| matches!(*p, "iommu.passthrough=1" | "iommu.passthrough=on" | "iommu.passthrough=y"));
    let forced_translation = has("iommu=nopt")
        || params.iter().any(|p| matches!(*p, "iommu.passthrough=0" | "iommu.passthrough=off" | "iommu.passthrough=n"));
    let asked_on = params
        .iter()
        .any(|p| p.starts_with("intel_iommu=on") || (p.starts_with("amd_iommu=") && *p != "amd_iommu=off"));
    let cmdline_evidence = match &cmdline {
        Some(c) => format!("/proc/cmdline: {c}"),
        None => "/proc/cmdline: not readable".to_owned(),
    };
    let groups = root.list_dir(IOMMU_GROUPS).unwrap_or_default();
    if groups.is_empty() {
        let mut f = Finding::new(
            "iommu.mode",
            Status::Ok,
            format!("no IOMMU groups in {IOMMU_GROUPS}: the IOMMU is off, so DMA addresses are not translated"),
        )
        .evidence(cmdline_evidence);
        if asked_on {
            f = f.evidence(
                "the command line asks for the IOMMU but no groups exist: it is off in firmware (VT-d / AMD-Vi) or \
                 unsupported",
            );
        }
        return f;
    }

    let mut devices: Vec<(String, String, &str)> = Vec::new();
    for g in &topo.gpus {
        devices.push((g.label(), g.bdf.clone(), g.sysfs_path.as_str()));
    }
    for n in &topo.nics {
        devices.push((n.name.clone(), n.bdf.clone(), n.sysfs_path.as_str()));
    }
    let mut f_evidence = Vec::new();
    let (mut translated, mut other, mut no_type) = (Vec::new(), Vec::new(), Vec::new());
    for (label, bdf, path) in &devices {
        let group = root.resolve(&format!("{path}/iommu_group")).filter(|p| root.is_dir(p));
        let mode = match &group {
            None => GroupMode::NoGroup,
            Some(g) => match read_text(root, &format!("{g}/type")) {
                None => GroupMode::NoTypeFile,
                Some(t) if t == "identity" => GroupMode::Identity,
                Some(t) if t == "DMA" || t == "DMA-FQ" => GroupMode::Translated(t),
                Some(t) => GroupMode::Other(t),
            },
        };
        let group_name = group.as_deref().and_then(|g| g.rsplit('/').next()).unwrap_or("-").to_owned();
        let what = match &mode {
            GroupMode::NoGroup => "not in an IOMMU group (not translated)".to_owned(),
            GroupMode::Identity => format!("group {group_name}, type identity (pass-through)"),
            GroupMode::Translated(t) => format!("group {group_name}, type {t} (translated)"),
            GroupMode::Other(t) => format!("group {group_name}, type {t} (not judged here)"),
            GroupMode::NoTypeFile => format!("group {group_name}, no type file (kernel too old to say)"),
        };
        f_evidence.push(format!("{label} {bdf}: {what}"));
        match mode {
            GroupMode::Translated(_) => translated.push(label.clone()),
            GroupMode::Other(t) => other.push(format!("{label} ({t})")),
            GroupMode::NoTypeFile => no_type.push(label.clone()),
            GroupMode::NoGroup | GroupMode::Identity => {}
        }
    }
    let fix = "Boot with iommu=pt (Intel: intel_iommu=on iommu=pt; AMD: iommu=pt): add it to GRUB_CMDLINE_LINUX in \
               /etc/default/grub, run update-grub (or grub2-mkconfig -o /boot/grub2/grub.cfg) and reboot. Host \
               devices then bypass translation and VFIO passthrough keeps working. If translation must stay, \
               peer-to-peer needs ATS on the NIC and ACS Direct Translated P2P on the switch ports; otherwise every \
               GPU<->NIC transfer detours to the root complex for translation, or fails.";
    let mut f = if !translated.is_empty() {
        Finding::new(
            "iommu.mode",
            Status::Warn,
            format!(
                "the IOMMU translates DMA for {}: GPU<->NIC peer-to-peer then needs ATS or goes through the root \
                 complex (slower) or fails",
                translated.join(", ")
            ),
        )
        .fix(fix)
    } else if !other.is_empty() {
        Finding::new("iommu.mode", Status::Warn, format!("IOMMU group type not judged here for {}", other.join(", ")))
            .fix("Expected `identity` (pass-through); check whether the device is bound to VFIO or blocked.")
    } else if !no_type.is_empty() {
        if passthrough {
            Finding::new(
                "iommu.mode",
                Status::Ok,
                format!(
                    "IOMMU groups exist but the kernel doesn't show their type; the command line's pass-through \
                     setting means {} are not translated (inferred)",
                    no_type.join(", ")
                ),
            )
        } else if forced_translation || asked_on {
            Finding::new(
                "iommu.mode",
                Status::Warn,
                format!(
                    "IOMMU on without pass-through on the command line: {} are most likely translated (inferred; \
                     the kernel doesn't show group types)",
                    no_type.join(", ")
                ),
            )
            .fix(fix)
        } else {
            Finding::new(
                "iommu.mode",
                Status::Skipped,
                format!(
                    "IOMMU groups exist but neither their type nor the command line says whether {} are translated",
                    no_type.join(", ")
                ),
            )
        }
    } else {
        Finding::new(
            "iommu.mode",
            Status::Ok,
            "GPUs and NICs are in pass-through (identity) IOMMU groups or none: DMA is not translated",
        )
    };
    for e in f_evidence {
        f = f.evidence(e);
    }
    f.evidence(cmdline_evidence)
}

// ---------------------------------------------------------------------------
// Bandwidth

/// One link as sysfs reports it.
struct LinkFiles {
    cur_gts: Option<f64>,
    cur_width: Option<u32>,
    max_gts: Option<f64>,
    max_width: Option<u32>,
}

fn parse_gts(text: &str) -> Option<f64> {
    let mut words = text.split_whitespace();
    let v = words.next()?.parse::<f64>().ok()?;
    (words.next()?.starts_with("GT/s") && v.is_finite() && v > 0.0 && v <= 1024.0).then_some(v)
}

fn parse_width(text: &str) -> Option<u32> {
    text.trim().parse::<u32>().ok().filter(|w| (1..=32).contains(w))
}

fn read_link_files(root: &SysRoot, dir: &str) -> LinkFiles {
    let t = |name: &str| read_text(root, &format!("{dir}/{name}"));
    LinkFiles {
        cur_gts: t("current_link_speed").as_deref().and_then(parse_gts),
        cur_width: t("current_link_width").as_deref().and_then(parse_width),
        max_gts: t("max_link_speed").as_deref().and_then(parse_gts),
        max_width: t("max_link_width").as_deref().and_then(parse_width),
    }
}

/// Line-code efficiency: 8b/10b up to 5 GT/s, 128b/130b for 8–32 GT/s; at
/// 64 GT/s PCIe 6 uses 256-byte flits of which 236 carry TLP bytes.
fn encoding(gts: f64) -> (f64, &'static str) {
    if gts <= 5.0 {
        (0.8, "8b/10b")
    } else if gts <= 32.0 {
        (128.0 / 130.0, "128b/130b")
    } else {
        (236.0 / 256.0, "FLIT mode, 236 of 256 bytes")
    }
}

/// Usable bytes per second per direction after line encoding, in GB/s.
fn link_gbs(gts: f64, width: u32) -> f64 {
    gts * f64::from(width) * encoding(gts).0 / 8.0
}

fn gen_name(gts: f64) -> String {
    let gens = [(2.5, 1), (5.0, 2), (8.0, 3), (16.0, 4), (32.0, 5), (64.0, 6)];
    gens.iter().find(|(g, _)| (g - gts).abs() < 0.01).map_or_else(|| format!("{gts} GT/s"), |(_, n)| format!("Gen{n}"))
}

/// What NCCL's topology model counts for this link (`kvDictPciGen`, in GB/s),
/// quoted so the reader can compare our raw figure with NCCL's own estimate.
fn nccl_model_gbs(gts: f64, width: u32) -> f64 {
    let per_lane = [(2.5, 15.0), (5.0, 30.0), (8.0, 60.0), (16.0, 120.0), (32.0, 240.0), (64.0, 480.0)]
        .iter()
        .find(|(g, _)| (g - gts).abs() < 0.01)
        .map_or(60.0, |(_, v)| *v);
    f64::from(width) * per_lane / 80.0
}

/// A link with the speed and width used for the estimate.
struct UsedLink {
    who: String,
    gts: f64,
    width: u32,
}

impl UsedLink {
    fn gbs(&self) -> f64 {
        link_gbs(self.gts, self.width)
    }

    fn describe(&self) -> String {
        format!(
            "{}: {} x{} ({} GT/s, {}) = {:.1} GB/s per direction",
            self.who,
            gen_name(self.gts),
            self.width,
            self.gts,
            encoding(self.gts).1,
            self.gbs()
        )
    }
}

/// Reads the links of one side of a pair. The endpoint's own link is judged
/// against what both ends support, because a root port's `max_link_speed`
/// being higher than the device's is not a fault.
struct SideLinks {
    endpoint: Option<UsedLink>,
    /// Bridges above the endpoint's parent, bottom-up, with their index in
    /// the chain (their files describe real links; the parent's files
    /// describe the endpoint's link again).
    above: Vec<(usize, Option<UsedLink>)>,
    notes: Vec<String>,
    problems: Vec<String>,
}

fn side_links(root: &SysRoot, place: &Placement<'_>, label: &str, is_gpu: bool) -> SideLinks {
    let last = place.chain.len() - 1;
    let own = read_link_files(root, &place.dir(last));
    let parent = (last > 0).then(|| read_link_files(root, &place.dir(last - 1)));
    let mut notes = Vec::new();
    let mut problems = Vec::new();
    let cap_gts = [own.max_gts, parent.as_ref().and_then(|p| p.max_gts)].into_iter().flatten().reduce(f64::min);
    let cap_width = [own.max_width, parent.as_ref().and_then(|p| p.max_width)].into_iter().flatten().min();
    let endpoint = match (own.cur_gts, own.cur_width) {
        (Some(cur_gts), Some(cur_width)) => {
            let mut gts = cur_gts;
            if let Some(cap) = cap_gts {
                if cur_gts + 0.01 < cap {
                    if is_gpu {
                        notes.push(format!(
                            "{label} {} runs at {cur_gts} GT/s now but the link supports {cap} GT/s: GPUs lower the \
                             link speed when idle, so the estimate uses {cap} GT/s (read current_link_speed under \
                             load to confirm)",
                            place.chain[last]
                        ));
                        gts = cap;
                    } else {
                        problems.push(format!(
                            "{label} {} trained at {} although both ends support {}: a riser, slot or signal \
                             problem",
                            place.chain[last],
                            gen_name(cur_gts),
                            gen_name(cap)
                        ));
                    }
                }
            }
            if let Some(cap) = cap_width {
                if cur_width < cap {
                    problems.push(format!(
                        "{label} {} trained at x{cur_width} although both ends support x{cap}",
                        place.chain[last]
                    ));
                }
            }
            Some(UsedLink { who: format!("{} ({label}'s link)", place.chain[last]), gts, width: cur_width })
        }
        _ => None,
    };
    let above = (0..last.saturating_sub(1))
        .rev()
        .map(|i| {
            let l = read_link_files(root, &place.dir(i));
            let used = match (l.cur_gts, l.cur_width) {
                (Some(gts), Some(width)) => Some(UsedLink { who: place.chain[i].to_owned(), gts, width }),
                _ => None,
            };
            (i, used)
        })
        .collect();
    SideLinks { endpoint, above, notes, problems }
}

/// The known links among `side.above` whose chain index satisfies `pred`.
fn known(side: &SideLinks, pred: impl Fn(usize) -> bool) -> Vec<&UsedLink> {
    side.above.iter().filter(|(i, _)| pred(*i)).filter_map(|(_, l)| l.as_ref()).collect()
}

fn min_gbs<'a>(links: impl IntoIterator<Item = &'a UsedLink>) -> Option<(f64, &'a UsedLink)> {
    links.into_iter().map(|l| (l.gbs(), l)).min_by(|a, b| a.0.total_cmp(&b.0))
}

fn bandwidth_findings(root: &SysRoot, topo: &PciTopology, pairs: &[Pair], limit: &GdrLimit) -> Vec<Finding> {
    let mut out = Vec::new();
    for gpu in &topo.gpus {
        let mine: Vec<&Pair> = pairs.iter().filter(|p| p.gpu_index == gpu.index).collect();
        let Some(best) = mine.iter().map(|p| (p.nccl_level, p.level)).min() else { continue };
        for p in mine.into_iter().filter(|p| (p.nccl_level, p.level) == best) {
            if let Some(nic) = topo.nics.iter().find(|n| n.name == p.nic) {
                out.push(bandwidth_finding(root, gpu, nic, &topo.nics, p, limit));
            }
        }
    }
    out
}

fn bandwidth_finding(
    root: &SysRoot,
    gpu: &GpuDev,
    nic: &NicDev,
    all_nics: &[NicDev],
    p: &Pair,
    limit: &GdrLimit,
) -> Finding {
    let head = format!("{} <-> {} ({})", gpu.label(), nic.name, p.level);
    let id = format!("bandwidth.path.gpu{}-{}", gpu.index, nic.name);
    let (Some(gp), Some(np)) = (placement(&gpu.sysfs_path), placement(&nic.sysfs_path)) else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: PCIe path unknown"));
    };
    let gs = side_links(root, &gp, &gpu.label(), true);
    let ns = side_links(root, &np, &nic.name, false);
    let Some(rate) = nic.rate_gbps() else {
        return Finding::new(
            id.clone(),
            Status::Skipped,
            format!("{head}: {} reports no port rate, so there is nothing to compare the links with", nic.name),
        );
    };
    let need = rate / 8.0;
    let mut missing = Vec::new();
    if gs.endpoint.is_none() {
        missing.push(format!("{} {}", gpu.label(), gpu.bdf));
    }
    if ns.endpoint.is_none() {
        missing.push(format!("{} {}", nic.name, nic.bdf));
    }
    for (side, place) in [(&gs, &gp), (&ns, &np)] {
        for (i, l) in &side.above {
            if l.is_none() {
                missing.push(place.chain[*i].to_owned());
            }
        }
    }
    if !missing.is_empty() {
        return Finding::new(
            id.clone(),
            Status::Skipped,
            format!(
                "{head}: link speed/width not reported for {} (typical of VMs and emulated bridges), so no \
                 bandwidth estimate",
                missing.join(", ")
            ),
        );
    }
    // Every link is known from here on.
    let (Some(g_ep), Some(n_ep)) = (gs.endpoint.as_ref(), ns.endpoint.as_ref()) else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: link unknown"));
    };
    // Chain index of the turnaround bridge when traffic stays below the root complex.
    let common = p.turnaround.as_ref().and_then(|t| gp.chain.iter().position(|c| *c == t.as_str()));
    let (gdr_links, shared): (Vec<&UsedLink>, Vec<&UsedLink>) = match common {
        Some(k) => {
            let mut v = vec![g_ep, n_ep];
            v.extend(known(&gs, |i| i > k));
            v.extend(known(&ns, |i| i > k));
            (v, known(&gs, |i| i <= k))
        }
        None => {
            let mut v = vec![g_ep, n_ep];
            v.extend(known(&gs, |_| true));
            v.extend(known(&ns, |_| true));
            (v, Vec::new())
        }
    };
    let gpu_chain: Vec<&UsedLink> = std::iter::once(g_ep).chain(known(&gs, |_| true)).collect();
    let nic_chain: Vec<&UsedLink> = std::iter::once(n_ep).chain(known(&ns, |_| true)).collect();
    let (Some((gdr_min, gdr_narrow)), Some((gpu_min, _)), Some((nic_min, _))) =
        (min_gbs(gdr_links.iter().copied()), min_gbs(gpu_chain.iter().copied()), min_gbs(nic_chain.iter().copied()))
    else {
        return Finding::new(id.clone(), Status::Skipped, format!("{head}: no link to estimate"));
    };
    let shared_min = min_gbs(shared.iter().copied());
    let one_way =
        [Some(gpu_min), Some(nic_min), shared_min.map(|s| s.0)].into_iter().flatten().fold(f64::MAX, f64::min);
    let both_ways =
        [Some(gpu_min), Some(nic_min), shared_min.map(|s| s.0 / 2.0)].into_iter().flatten().fold(f64::MAX, f64::min);
    let gdr_on = limit.allows(p.nccl_level);

    let rate_text = nic.ports.iter().find_map(|p| p.rate.as_deref()).unwrap_or("rate");
    let mut evidence = vec![format!("{} {rate_text}: {rate} Gb/s = {need:.1} GB/s per direction", nic.name)];
    let mut seen = Vec::new();
    for l in gpu_chain.iter().chain(nic_chain.iter()) {
        if !seen.contains(&l.who) {
            seen.push(l.who.clone());
            evidence.push(format!("{} (NCCL's model: {:.1} GB/s)", l.describe(), nccl_model_gbs(l.gts, l.width)));
        }
    }
    evidence.extend(gs.notes.iter().cloned());
    evidence.extend(ns.problems.iter().cloned());
    evidence.extend(gs.problems.iter().cloned());
    evidence.extend(ns.notes.iter().cloned());
    // Functions of one card (a dual-port NIC) share its PCIe link.
    let slot = |bdf: &str| bdf.rsplit_once('.').map(|(s, _)| s.to_owned());
    for other in all_nics.iter().filter(|o| o.name != nic.name && slot(&o.bdf) == slot(&nic.bdf)) {
        evidence.push(format!(
            "{} ({}) is another function of the same card and shares this PCIe link",
            other.name, other.bdf
        ));
    }

    let gdr_path = match &p.turnaround {
        Some(t) => format!("GPU -> {t} -> NIC"),
        None => "GPU -> root complex -> NIC".to_owned(),
    };
    evidence.push(format!(
        "GPUDirect path ({gdr_path}): narrowest link {} {:.1} GB/s {} {:.1} GB/s needed{}",
        gdr_narrow.who,
        gdr_min,
        if gdr_min + 1e-9 >= need { ">=" } else { "<" },
        need,
        if gdr_on { "" } else { " (but NCCL keeps GDR off on this path, see topology.path)" }
    ));
    let mut host = format!(
        "host-staged path: every byte crosses PCIe twice (GPU -> host memory over {}'s links, narrowest {:.1} GB/s; \
         host memory -> NIC over {}'s links, narrowest {:.1} GB/s)",
        gpu.label(),
        gpu_min,
        nic.name,
        nic_min
    );
    if let Some((s, sl)) = shared_min {
        let verdict = |needed: f64| if needed <= s + 1e-9 { "fits" } else { "does not fit" };
        host.push_str(&format!(
            "; the uplink {} ({s:.1} GB/s per direction) carries both crossings: sending alone puts {need:.1} GB/s \
             up and {need:.1} GB/s down on it ({}), sending and receiving at once {:.1} GB/s each way ({})",
            sl.who,
            verdict(need),
            2.0 * need,
            verdict(2.0 * need)
        ));
    }
    host.push_str(&format!(
        "; ceiling {:.1} GB/s per direction one way, {:.1} GB/s when sending and receiving at once",
        one_way.min(need),
        both_ways.min(need)
    ));
    evidence.push(host);
    evidence.push(format!(
        "host memory: staging writes and reads each byte once, {:.1} GB/s of memory traffic at line rate one way, \
         {:.1} GB/s both ways, competing with everything else (not measured here)",
        2.0 * need,
        4.0 * need
    ));
    evidence.push(
        "estimates: raw link rate after line encoding only; TLP headers, flow control and payload size take roughly \
         another 10-20% (compare NCCL's model figures above); root-complex forwarding is not estimated"
            .to_owned(),
    );

    let problems: Vec<String> = gs.problems.iter().chain(ns.problems.iter()).cloned().collect();
    let gdr_buys = if common.is_some() {
        format!("GDR keeps traffic inside {} and off host memory", p.turnaround.as_deref().unwrap_or("the switch"))
    } else {
        "here GDR would cross the same links as staging, so it saves the host-memory copy and latency, not link \
         bandwidth"
            .to_owned()
    };
    let summary_tail = format!(
        "host staging tops out near {:.1} GB/s per direction when sending and receiving at once; {gdr_buys}",
        both_ways.min(need)
    );
    let mut f = if gdr_min + 1e-9 < need {
        Finding::new(
            id.clone(),
            Status::Warn,
            format!(
                "{head}: NIC {rate} Gb/s = {need:.1} GB/s per direction, but the narrowest link on the GPUDirect \
                 path ({}) carries only {gdr_min:.1} GB/s: not even GDR can run the NIC at line rate",
                gdr_narrow.who
            ),
        )
        .fix(if problems.is_empty() {
            format!(
                "Move the NIC or GPU to a faster slot (a {} x{} link is needed for {rate} Gb/s), or expect at most \
                 {gdr_min:.1} GB/s.",
                gen_name(gdr_narrow.gts),
                gdr_narrow.width
            )
        } else {
            format!(
                "Fix the degraded link ({}): reseat the card, try another slot or riser, check the BIOS slot \
                 bifurcation and `lspci -vv` LnkSta.",
                problems.join("; ")
            )
        })
    } else if !problems.is_empty() {
        Finding::new(
            id.clone(),
            Status::Warn,
            format!("{head}: a link runs below what both ends support ({})", problems.join("; ")),
        )
        .fix("Reseat the card, try another slot or riser, check the BIOS slot bifurcation and `lspci -vv` LnkSta.")
    } else {
        Finding::new(
            id.clone(),
            Status::Ok,
            format!(
                "{head}: NIC {rate} Gb/s = {need:.1} GB/s per direction; narrowest link on the GPUDirect path {} x{} \
                 = {gdr_min:.1} GB/s, enough for line rate; {summary_tail}",
                gen_name(gdr_narrow.gts),
                gdr_narrow.width
            ),
        )
    };
    for e in evidence {
        f = f.evidence(e);
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpudirect::nccl::PathType as NcclPathType;
    use gpudirect::topology::{discover, pairs};

    fn machine(name: &str) -> SysRoot {
        SysRoot::at(format!("{}/tests/data/machines/{name}", env!("CARGO_MANIFEST_DIR")))
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn run(name: &str, vars: &[(&str, &str)]) -> (PciTopology, Vec<Pair>, Vec<Finding>) {
        let root = machine(name);
        let topo = discover(&root);
        let pairs = pairs(&root, &topo);
        let findings = check(&root, &topo, &env(vars));
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
        assert!(one(&f, "topology.path", "<-> mlx5_0").summary.contains("NCCL_NET_GDR_LEVEL=0 (= LOC)"));
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

    #[test]
    fn env_limit_below_pix_is_blamed() {
        let (_, _, f) = run("acs-redirect", &[("NCCL_NET_GDR_LEVEL", "LOC")]);
        let t = one(&f, "topology.path", "GPU0");
        assert_eq!(t.status, Status::Fail);
        assert!(t.fix.as_deref().unwrap().contains("Unset NCCL_NET_GDR_LEVEL (now LOC)"));
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

    /// A 4096-byte bridge config space: AER at 0x100, then (optionally) ACS.
    fn bridge_config(acs_ctrl: Option<u16>) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[0..4].copy_from_slice(&[0xb5, 0x10, 0x47, 0x87]);
        b[0x06] = 0x10;
        b[0x0b] = 0x06;
        b[0x0a] = 0x04;
        b[0x0e] = 0x01;
        b[0x34] = 0x40;
        b[0x40] = 0x10;
        b[0x42] = 0x62; // PCIe v2, downstream port
        let next = if acs_ctrl.is_some() { 0x148u32 } else { 0 };
        b[0x100..0x104].copy_from_slice(&(0x0001 | (2 << 16) | (next << 20)).to_le_bytes());
        if let Some(ctrl) = acs_ctrl {
            b[0x148..0x14c].copy_from_slice(&(0x000d_u32 | (1 << 16)).to_le_bytes());
            b[0x14c..0x14e].copy_from_slice(&0x005f_u16.to_le_bytes());
            b[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
        }
        b
    }

    #[test]
    fn config_space_walk() {
        assert_eq!(
            acs_from_config(&bridge_config(Some(0x001d))),
            ConfigAcs::Present { offset: 0x148, cap: 0x005f, ctrl: 0x001d }
        );
        assert_eq!(acs_from_config(&bridge_config(None)), ConfigAcs::Absent);
        assert_eq!(acs_from_config(&bridge_config(Some(0))[..64]), ConfigAcs::NeedsRoot { len: 64 });
        assert_eq!(acs_from_config(&bridge_config(Some(0))[..256]), ConfigAcs::NoExtendedSpace { len: 256 });
        assert!(matches!(acs_from_config(&[0u8; 10]), ConfigAcs::Broken(_)));
        let mut looped = bridge_config(None);
        looped[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x100 << 20)).to_le_bytes());
        assert!(matches!(acs_from_config(&looped), ConfigAcs::Broken(ref w) if w.contains("loops")));
        let mut into_header = bridge_config(None);
        into_header[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x40 << 20)).to_le_bytes());
        assert!(matches!(acs_from_config(&into_header), ConfigAcs::Broken(_)));
        let mut cut = bridge_config(Some(0x1d));
        cut.truncate(0x14d);
        assert!(matches!(acs_from_config(&cut), ConfigAcs::Broken(_)));
        assert_eq!(pcie_port_type(&bridge_config(None)), Some(6));
        assert_eq!(pcie_port_type(&bridge_config(None)[..64]), None);
        assert_eq!(
            acs_flags(0x001d),
            "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"
        );
    }

    #[test]
    fn sysfs_value_parsers() {
        assert_eq!(parse_gts("16.0 GT/s PCIe"), Some(16.0));
        assert_eq!(parse_gts("8 GT/s"), Some(8.0));
        assert_eq!(parse_gts("2.5 GT/s PCIe"), Some(2.5));
        assert_eq!(parse_gts("Unknown"), None);
        assert_eq!(parse_gts("Unknown speed"), None);
        assert_eq!(parse_width("16"), Some(16));
        assert_eq!(parse_width("0"), None);
        assert!((link_gbs(16.0, 16) - 31.5077).abs() < 1e-3);
        assert!((link_gbs(5.0, 8) - 4.0).abs() < 1e-9);
        assert!((link_gbs(32.0, 16) - 63.0154).abs() < 1e-3);
    }

    /// A scratch tree under the system temp dir, removed on drop.
    struct Scratch(std::path::PathBuf);

    impl Scratch {
        fn new(tag: &str) -> Scratch {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let p = std::env::temp_dir().join(format!(
                "gpudirect-pci-{tag}-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }

        fn write(&self, machine_path: &str, data: &[u8]) {
            let p = self.0.join(machine_path.trim_start_matches('/'));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, data).unwrap();
        }

        fn link(&self, machine_path: &str, target: &str) {
            let p = self.0.join(machine_path.trim_start_matches('/'));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let _ = std::fs::remove_file(&p);
            std::os::unix::fs::symlink(target, p).unwrap();
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn symlinks_never_leave_the_root() {
        let s = Scratch::new("escape");
        s.link("/sys/class/infiniband/evil/device", "../../../../../../../../../../etc");
        s.link("/sys/class/infiniband/abs/device", "/etc");
        s.link("/sys/class/infiniband/loop/device", "loop2");
        s.link("/sys/class/infiniband/loop/loop2", "device");
        s.link("/sys/bus/pci/devices/0000:01:00.0", "/proc/self");
        let root = SysRoot::at(&s.0);
        assert_eq!(root.resolve("/sys/class/infiniband/evil/device").as_deref(), Some("/etc"));
        assert_eq!(root.resolve("/sys/class/infiniband/abs/device").as_deref(), Some("/etc"));
        assert_eq!(root.resolve("/sys/class/infiniband/loop/device"), None);
        let topo = discover(&root);
        assert!(topo.nics.is_empty() && topo.gpus.is_empty());
        assert_eq!(topo.other_rdma.len(), 3);
        let f = check(&root, &topo, &[]);
        assert!(with(&f, "topology.nics").iter().all(|f| f.status == Status::Fail));
    }

    use crate::test_rng::Rng;

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

    #[test]
    fn garbage_text_never_panics_the_parsers() {
        let mut rng = Rng(7);
        let alphabet: Vec<char> = "0123456789.x-+ GT/sPCIeGb/sec()NDRXunknown\n\t\u{e9}\u{1f600}".chars().collect();
        let mut parsed = 0;
        for _ in 0..5000 {
            // Half random strings, half real values with a few characters replaced.
            let mut t: Vec<char> = if rng.below(2) == 0 {
                (0..rng.below(24)).map(|_| alphabet[rng.below(alphabet.len())]).collect()
            } else {
                let seeds = ["16.0 GT/s PCIe", "8 GT/s", "400 Gb/sec (4X NDR)", "0x10de", "0000:3a:00.0", "PXB", "16"];
                seeds[rng.below(seeds.len())].chars().collect()
            };
            for _ in 0..rng.below(3) {
                if !t.is_empty() {
                    let at = rng.below(t.len());
                    t[at] = alphabet[rng.below(alphabet.len())];
                }
            }
            let t: String = t.into_iter().collect();
            // The library's sysfs parsers have their own exhaustive test (gpudirect::topology).
            parsed += usize::from(parse_gts(&t).is_some());
            let _ = (parse_width(&t), gpudirect::nccl::gdr_level(&t), placement(&t));
            if let Some(g) = parse_gts(&t) {
                assert!(link_gbs(g, 16).is_finite());
            }
        }
        assert!(parsed > 0, "the fuzz never produced a parsable value");
    }

    /// Random fixture trees: real layout, random file contents and sizes, some
    /// files missing, some symlinks broken. Every check must survive them.
    #[test]
    fn garbage_trees_never_panic() {
        let mut rng = Rng(42);
        let mut classified = 0;
        for round in 0..120 {
            let s = Scratch::new("fuzz");
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
                        if rng.below(3) == 0 {
                            TEXT_GARBAGE[rng.below(TEXT_GARBAGE.len())].to_vec()
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
                        if rng.below(8) != 0 {
                            let data = pick(&mut rng, good);
                            s.write(&format!("{dir}/{name}"), &data);
                        }
                    }
                    let cfg_len = [0, 64, 256, 4096, rng.below(4200)][rng.below(5)];
                    let cfg = if rng.below(2) == 0 { rng.bytes(cfg_len) } else { bridge_config(Some(0x1d)) };
                    s.write(&format!("{dir}/config"), &cfg[..cfg_len.min(cfg.len())]);
                    let target = format!("../../../devices/{hb}/{}", chain[..=depth].join("/"));
                    s.link(
                        &format!("/sys/bus/pci/devices/{bdf}"),
                        if rng.below(10) == 0 { "../nowhere" } else { &target },
                    );
                    if rng.below(2) == 0 {
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
                let data = TEXT_GARBAGE[rng.below(TEXT_GARBAGE.len())];
                s.write(&format!("{nic_dir}/infiniband/mlx5_0/ports/1/{name}"), data);
            }
            s.write(&format!("{nic_dir}/infiniband/mlx5_0/ports/x/rate"), b"1 Gb/sec");
            s.write(&format!("/sys/kernel/iommu_groups/{round}/type"), TEXT_GARBAGE[rng.below(TEXT_GARBAGE.len())]);
            s.write("/proc/cmdline", TEXT_GARBAGE[rng.below(TEXT_GARBAGE.len())]);
            let root = SysRoot::at(&s.0);
            let topo = discover(&root);
            let ps = pairs(&root, &topo);
            classified += ps.len();
            let f = check(&root, &topo, &env(&[("NCCL_NET_GDR_LEVEL", ["PHB", "x", "7", ""][round % 4])]));
            assert!(!f.is_empty());
            let _ = serde_json::to_string(&topo).unwrap();
        }
        assert!(classified > 0, "no fuzz round produced a GPU–NIC pair");
    }
}
