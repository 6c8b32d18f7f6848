//! Classifying a GPU–NIC pair: nvidia-smi's view from the sysfs paths,
//! and NCCL's own (see the module docs of [`super`]).

use std::fmt;

use super::discover::nccl_is_bdf;
use super::{is_bdf, nccl_path_type, GpuDev, NcclPathType, NicDev, Pair, PathLevel, PciTopology};
use crate::sysroot::SysRoot;

/// Where a device sits: its host bridge and the bus ids from the root port
/// down to itself.
pub struct Placement<'a> {
    /// The host bridge directory (`pci0000:15`).
    pub host_bridge: &'a str,
    /// Bus ids from the root port down to the device.
    pub chain: Vec<&'a str>,
}

impl Placement<'_> {
    /// The sysfs directory of `chain[upto]`.
    pub fn dir(&self, upto: usize) -> String {
        format!("/sys/devices/{}/{}", self.host_bridge, self.chain[..=upto].join("/"))
    }

    /// The bridges above the device, root port first.
    pub fn ancestors(&self) -> &[&str] {
        &self.chain[..self.chain.len() - 1]
    }
}

/// Where the device at a resolved sysfs path (`/sys/devices/pci.../...`)
/// sits; `None` for a path that is not a chain of PCI bus ids.
pub fn placement(path: &str) -> Option<Placement<'_>> {
    let rest = path.strip_prefix("/sys/devices/")?;
    let mut comps = rest.split('/');
    let host_bridge = comps.next()?;
    if !host_bridge.starts_with("pci") {
        return None;
    }
    let chain: Vec<&str> = comps.collect();
    (!chain.is_empty() && chain.iter().all(|c| is_bdf(c))).then_some(Placement { host_bridge, chain })
}

/// A node of NCCL's topology graph, as far as this module needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum NcclNode {
    /// A PCI switch, named by bus id.
    Pci(String),
    /// A CPU, named by the `numa_node` text NCCL read.
    Cpu(String),
}

/// NCCL's parent of the device at `path` (`ncclTopoGetXmlFromSys`): rewind
/// two directories, but stop at a CPU as soon as a parent directory is not a
/// bus id. The CPU is keyed by the device's own `numa_node` text.
fn nccl_parent(root: &SysRoot, path: &str) -> (NcclNode, Option<String>) {
    let numa = root.read(&format!("{path}/numa_node")).ok().unwrap_or_default();
    let mut p = path.to_owned();
    let mut slashes = 0;
    while let Some(idx) = p.rfind('/') {
        if idx == 0 {
            break;
        }
        p.truncate(idx);
        slashes += 1;
        let last = p.rsplit('/').next().unwrap_or_default().to_owned();
        if !nccl_is_bdf(&last) {
            return (NcclNode::Cpu(numa), None);
        }
        if slashes == 2 {
            return (NcclNode::Pci(last), Some(p));
        }
    }
    (NcclNode::Cpu(numa), None)
}

fn nccl_ancestors(root: &SysRoot, path: &str) -> Vec<NcclNode> {
    let mut out = Vec::new();
    let mut here = path.to_owned();
    for _ in 0..64 {
        let (node, next) = nccl_parent(root, &here);
        out.push(node);
        match next {
            Some(n) => here = n,
            None => break,
        }
    }
    out
}

fn nccl_view(root: &SysRoot, gpu_path: &str, nic_path: &str) -> PathLevel {
    let g = nccl_ancestors(root, gpu_path);
    let n = nccl_ancestors(root, nic_path);
    for (gi, node) in g.iter().enumerate() {
        if matches!(node, NcclNode::Pci(_)) {
            if let Some(ni) = n.iter().position(|m| m == node) {
                return if gi == 0 && ni == 0 { PathLevel::Pix } else { PathLevel::Pxb };
            }
        }
    }
    if g.last() == n.last() {
        PathLevel::Phb
    } else {
        PathLevel::Sys
    }
}

fn classify(root: &SysRoot, gpu: &GpuDev, nic: &NicDev) -> Result<Pair, String> {
    let g = placement(&gpu.sysfs_path)
        .ok_or_else(|| format!("{} resolves to {}, not a PCI device path", gpu.bdf, gpu.sysfs_path))?;
    let n = placement(&nic.sysfs_path)
        .ok_or_else(|| format!("{} resolves to {}, not a PCI device path", nic.bdf, nic.sysfs_path))?;
    let mut turnaround = None;
    let mut bridges = Vec::new();
    let level = if g.host_bridge != n.host_bridge {
        match (gpu.numa_node, nic.numa_node) {
            (Some(a), Some(b)) if a != b => PathLevel::Sys,
            _ => PathLevel::Node,
        }
    } else {
        let (ga, na) = (g.ancestors(), n.ancestors());
        let common = ga.iter().zip(na).take_while(|(a, b)| a == b).count();
        if common == 0 {
            PathLevel::Phb
        } else {
            let d = ga[common - 1];
            bridges.extend(ga[common..].iter().rev().map(|s| s.to_string()));
            bridges.push(d.to_owned());
            bridges.extend(na[common..].iter().map(|s| s.to_string()));
            turnaround = Some(d.to_owned());
            if bridges.len() <= 3 {
                PathLevel::Pix
            } else {
                PathLevel::Pxb
            }
        }
    };
    let nccl_level = nccl_view(root, &gpu.sysfs_path, &nic.sysfs_path);
    Ok(Pair {
        gpu: gpu.bdf.clone(),
        gpu_index: gpu.index,
        nic: nic.name.clone(),
        nic_bdf: nic.bdf.clone(),
        level,
        nccl_level,
        turnaround,
        bridges,
        gpu_host_bridge: g.host_bridge.to_owned(),
        nic_host_bridge: n.host_bridge.to_owned(),
        gpu_numa: gpu.numa_node,
        nic_numa: nic.numa_node,
        gdr_by_default: nccl_path_type(nccl_level) <= NcclPathType::Pxb,
    })
}

/// Every GPU–NIC pair whose sysfs paths could be placed in the PCIe tree,
/// GPU by GPU.
pub fn pairs(root: &SysRoot, topo: &PciTopology) -> Vec<Pair> {
    all_pairs(root, topo).into_iter().filter_map(Result::ok).collect()
}

/// A GPU–NIC pair whose distance is unknown: one of the two devices does not
/// resolve to a path of PCI bus ids under `/sys/devices` (a virtual function
/// passed through oddly, a broken sysfs, a fixture missing a link).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unplaced {
    /// The GPU's [`GpuDev::index`].
    pub gpu_index: usize,
    /// The NIC's verbs name, `mlx5_0`.
    pub nic: String,
    /// Which device could not be placed, and where its sysfs path led.
    pub why: String,
}

impl fmt::Display for Unplaced {
    /// `GPU0 <-> mlx5_0: 0000:18:00.0 resolves to ..., not a PCI device path`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GPU{} <-> {}: {}", self.gpu_index, self.nic, self.why)
    }
}

impl std::error::Error for Unplaced {}

/// Every GPU–NIC pair, GPU by GPU, or why it could not be placed.
pub fn all_pairs(root: &SysRoot, topo: &PciTopology) -> Vec<Result<Pair, Unplaced>> {
    let mut out = Vec::new();
    for gpu in &topo.gpus {
        for nic in &topo.nics {
            out.push(classify(root, gpu, nic).map_err(|why| Unplaced { gpu_index: gpu.index, nic: nic.name.clone(), why }));
        }
    }
    out
}
