//! PCIe checks between GPUs and RDMA NICs: what the devices are, how far
//! apart, and (through [`super::acs`], [`super::iommu`] and
//! [`super::bandwidth`]) whether the path lets peer-to-peer traffic through
//! at full speed. Discovery and classification are the library's
//! ([`gpudirect::topology`]); the doctor judges what they found.
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

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::{all_pairs, gdr_limit, GdrLimit, Pair, PathLevel, PciTopology, IB_CLASS, PCI_DEVICES};

use super::acs::acs_findings;
use super::bandwidth::{bandwidth_findings, Estimate};
use super::iommu::iommu_finding;
use super::{Finding, Status};

// ---------------------------------------------------------------------------
// Checks

/// Topology, ACS, IOMMU and bandwidth findings for the discovered devices.
/// `env` is searched for `NCCL_NET_GDR_LEVEL` only; [`super::env`] judges the
/// rest of the environment.
/// With them, what each GPU's nearest pairs' links allow (for the
/// measurement plan).
pub fn check(root: &SysRoot, topo: &PciTopology, env: &[(String, String)]) -> (Vec<Finding>, Vec<Estimate>) {
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
        return (out, Vec::new());
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
    // A limit below every PCIe path (LOC) is one mistake, not one per
    // pair: env.nccl_net_gdr_level and the verdict name it with its fix.
    // Each pair is judged at NCCL's default instead, so that it says what
    // the hardware gives once the variable is gone, and nothing false
    // ("no closer NIC" beside a PIX one).
    if limit.env_used && limit.limit.forbids_every_nic() {
        let at_default = gdr_limit(&[]);
        let note = format!(
            "{} turns GPUDirect RDMA off on every pair (see env.nccl_net_gdr_level); this pair is judged at {}, as it \
             would be with the variable unset",
            limit.describe(),
            at_default.describe()
        );
        out.extend(topology_findings(topo, &placed, &at_default).into_iter().map(|f| f.evidence(note.clone())));
    } else {
        out.extend(topology_findings(topo, &placed, &limit));
    }
    out.extend(acs_findings(root, &placed));
    out.push(iommu_finding(root, topo));
    let (bandwidth, estimates) = bandwidth_findings(root, topo, &placed, &limit);
    out.extend(bandwidth);
    (out, estimates)
}

fn numa_text(n: Option<i32>) -> String {
    n.map_or_else(|| "unknown (-1)".to_owned(), |n| n.to_string())
}

fn device_findings(topo: &PciTopology) -> Vec<Finding> {
    let mut out = Vec::new();
    // Each finding shows the discovery notes about what it is about: a GPU
    // finding the notes on PCI_DEVICES, a NIC finding those on IB_CLASS.
    let notes = |mut f: Finding, about: &[&str]| {
        for n in topo.notes.iter().filter(|n| about.iter().any(|a| n.contains(a))) {
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
            &[PCI_DEVICES],
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
        let mut f = notes(Finding::new("topology.nics", Status::Fail, summary), &[IB_CLASS]);
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
        out.push(notes(f, &[PCI_DEVICES, IB_CLASS]));
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

#[cfg(test)]
mod tests;
