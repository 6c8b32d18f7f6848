//! Where GPUs and RDMA NICs sit in the PCIe tree, and how far apart each
//! GPU–NIC pair is, in nvidia-smi's and NCCL's vocabulary (PIX, PXB, PHB,
//! NODE, SYS): so transport code can choose the NIC nearest each GPU
//! ([`PciTopology::nearest_nics`]), and `gpudirect doctor` can say why
//! NCCL will or will not use GPUDirect RDMA for a pair.
//!
//! Everything is read from sysfs through a [`SysRoot`], so it runs
//! unchanged against fixture trees. [`acs`] reads the bridges on a pair's
//! path and judges whether ACS redirects its peer-to-peer traffic;
//! [`PciTopology::gpu_by_bus_id`] finds a CUDA device in the tree.
//!
//! # Classification
//!
//! Two views are computed for every GPU–NIC pair, because they can differ
//! and the second one is what decides GPUDirect RDMA:
//!
//! * [`Pair::level`], nvidia-smi's words, from the real sysfs device paths
//!   (`/sys/devices/pci0000:00/0000:00:01.0/.../0000:03:00.0`): different host
//!   bridges (`pciDDDD:BB`) are NODE when both devices report the same
//!   `numa_node`, SYS when they report different ones; under one host bridge
//!   with no common bridge ancestor the traffic turns around in the CPU's root
//!   complex (PHB); otherwise it turns around at the deepest common bridge,
//!   and the pair is PIX when it crosses at most three bridges (downstream
//!   port, upstream port, downstream port: one switch) and PXB when it crosses
//!   more (several switch levels).
//! * [`Pair::nccl_level`], NCCL's own model (`src/graph/xml.cc`): NCCL walks
//!   up sysfs two directories at a time (a switch shows up as an upstream and
//!   a downstream port), creates a CPU node per `numa_node` value as soon as
//!   the parent directory is not a bus id, and calls a path PIX when GPU and
//!   NIC hang off the same node, PXB when the common node is further up, PHB
//!   through one CPU node and SYS between CPU nodes. It has no NODE level:
//!   host bridges on one NUMA node are one CPU node, so nvidia-smi's NODE is
//!   NCCL's PHB.
//!
//! NCCL allows GPUDirect RDMA for a pair when its path type is at most the
//! `NCCL_NET_GDR_LEVEL` limit, PXB by default (since 2.26 formally P2C, one
//! step above PXB, which only Grace C2C systems produce). Not modelled here:
//! NCCL's AMD Rome exception (default PHB when GPU and NIC share a root
//! complex; needs the CPU model), and its merging of Broadcom PEX Gen4/Gen5
//! two-level switches into one (it may call PIX what sysfs shows as PXB;
//! both allow GDR). How NCCL reads `NCCL_NET_GDR_LEVEL` is the library's
//! [`crate::nccl::gdr_level`], shared by `gpudirect doctor` and `nccl-log`.

use std::fmt;


use crate::nccl::{gdr_level, PathType as NcclPathType};
use crate::sysroot::SysRoot;

pub mod acs;
mod classify;
mod discover;

pub use classify::{all_pairs, pairs, placement, Placement, Unplaced};
pub use discover::{discover, is_bdf, natural_key};

/// Where PCI functions are listed.
pub const PCI_DEVICES: &str = "/sys/bus/pci/devices";
/// Where RDMA devices are listed.
pub const IB_CLASS: &str = "/sys/class/infiniband";

/// GPUs and RDMA NICs found in sysfs, with where they sit in the PCIe tree.
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PciTopology {
    /// NVIDIA display/3D controllers, in PCI bus order (nvidia-smi's numbering).
    pub gpus: Vec<GpuDev>,
    /// RDMA devices backed by a PCI function.
    pub nics: Vec<NicDev>,
    /// RDMA devices without a PCI function (software RDMA such as rxe or siw):
    /// they can't reach GPU memory.
    pub other_rdma: Vec<OtherRdma>,
    /// What could not be read during discovery.
    pub notes: Vec<String>,
}

/// One NVIDIA GPU.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct GpuDev {
    /// Position in PCI bus order, as nvidia-smi numbers GPUs (CUDA's order can
    /// differ unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`).
    pub index: usize,
    /// PCI bus id, `0000:18:00.0`.
    pub bdf: String,
    /// `vendor:device`, e.g. `10de:2330`.
    pub pci_id: String,
    /// The class code as sysfs shows it, e.g. `0x030200`.
    pub class: String,
    /// The resolved sysfs device directory (`/sys/devices/pci.../<bdf>`).
    pub sysfs_path: String,
    /// `numa_node`; `None` when the kernel reports -1.
    pub numa_node: Option<i32>,
}

impl GpuDev {
    /// `GPU0`.
    pub fn label(&self) -> String {
        format!("GPU{}", self.index)
    }
}

/// One RDMA NIC (an entry of `/sys/class/infiniband` with a PCI function).
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct NicDev {
    /// Verbs device name, e.g. `mlx5_0`.
    pub name: String,
    /// PCI bus id of its function.
    pub bdf: String,
    /// `vendor:device`, e.g. `15b3:1021`.
    pub pci_id: String,
    /// The resolved sysfs device directory.
    pub sysfs_path: String,
    /// `numa_node`; `None` when the kernel reports -1.
    pub numa_node: Option<i32>,
    /// Network interfaces of the same PCI function (`device/net/*`).
    pub netdevs: Vec<String>,
    /// Ports from `ports/*`.
    pub ports: Vec<IbPort>,
}

impl NicDev {
    /// The rate the NIC can push per direction, in Gb/s: the fastest active
    /// port, or the fastest port when none is active (so a cabled-but-down
    /// link still gets its arithmetic).
    pub fn rate_gbps(&self) -> Option<f64> {
        let best = |active: bool| {
            self.ports
                .iter()
                .filter(|p| !active || p.is_active())
                .filter_map(|p| p.rate_gbps)
                .fold(None, |acc: Option<f64>, r| Some(acc.map_or(r, |a| a.max(r))))
        };
        best(true).or_else(|| best(false))
    }
}

/// One port of an RDMA NIC.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct IbPort {
    /// Port number (1-based, as verbs counts).
    pub port: u32,
    /// `rate` as the kernel writes it, e.g. `400 Gb/sec (4X NDR)`.
    pub rate: Option<String>,
    /// The number of Gb/s in `rate`.
    pub rate_gbps: Option<f64>,
    /// `InfiniBand` or `Ethernet` (RoCE).
    pub link_layer: Option<String>,
    /// e.g. `4: ACTIVE`.
    pub state: Option<String>,
}

impl IbPort {
    /// Whether the port's state is ACTIVE.
    pub fn is_active(&self) -> bool {
        self.state.as_deref().is_some_and(|s| s.contains("ACTIVE"))
    }
}

/// An RDMA device that is not a PCI function.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct OtherRdma {
    /// Verbs device name, e.g. `rxe0`.
    pub name: String,
    /// Why it was not taken as a NIC.
    pub reason: String,
}

/// How far apart a GPU and a NIC sit, in nvidia-smi's (and NCCL's) words.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "UPPERCASE"))]
pub enum PathLevel {
    /// At most one PCIe switch between them (one bridge per side).
    Pix,
    /// Several bridges or switch levels, without the host bridge.
    Pxb,
    /// Through the host bridge: the CPU's root complex.
    Phb,
    /// Across host bridges within one NUMA node (nvidia-smi only; NCCL says PHB).
    Node,
    /// Across NUMA nodes: the inter-socket link.
    Sys,
}

impl PathLevel {
    /// Whether peer-to-peer traffic on such a path turns around in a PCIe
    /// switch, below the root complex: only there can a bridge's ACS
    /// redirect it (PHB and farther paths cross the root complex anyway).
    pub fn turns_in_a_switch(self) -> bool {
        matches!(self, PathLevel::Pix | PathLevel::Pxb)
    }
}

impl fmt::Display for PathLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PathLevel::Pix => "PIX",
            PathLevel::Pxb => "PXB",
            PathLevel::Phb => "PHB",
            PathLevel::Node => "NODE",
            PathLevel::Sys => "SYS",
        })
    }
}

impl std::str::FromStr for PathLevel {
    type Err = String;
    /// `PIX`, `PXB`, `PHB`, `NODE` or `SYS`, in either case.
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_uppercase().as_str() {
            "PIX" => Ok(PathLevel::Pix),
            "PXB" => Ok(PathLevel::Pxb),
            "PHB" => Ok(PathLevel::Phb),
            "NODE" => Ok(PathLevel::Node),
            "SYS" => Ok(PathLevel::Sys),
            _ => Err(format!("unknown PCIe path level {s:?}: expected PIX, PXB, PHB, NODE or SYS")),
        }
    }
}

/// What a PCIe path of `level` is to NCCL.
pub fn nccl_path_type(level: PathLevel) -> NcclPathType {
    match level {
        PathLevel::Pix => NcclPathType::Pix,
        PathLevel::Pxb => NcclPathType::Pxb,
        PathLevel::Phb | PathLevel::Node => NcclPathType::Phb,
        PathLevel::Sys => NcclPathType::Sys,
    }
}

/// The limit NCCL applies to GPU–NIC distance before turning GDR off.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct GdrLimit {
    /// Pairs whose NCCL path type is at most this get GPUDirect RDMA.
    pub limit: NcclPathType,
    /// The raw `NCCL_NET_GDR_LEVEL`, when set.
    pub env_value: Option<String>,
    /// Whether NCCL takes the value (false: it ignores it and keeps PXB).
    pub env_used: bool,
    /// How the limit came about, in words.
    pub explanation: String,
}

impl GdrLimit {
    /// e.g. `NCCL_NET_GDR_LEVEL=3 (= PHB)` or `NCCL's default limit PXB`.
    pub fn describe(&self) -> String {
        match (&self.env_value, self.env_used) {
            (Some(v), true) if v == self.limit.name() => format!("NCCL_NET_GDR_LEVEL={v}"),
            (Some(v), true) => format!("NCCL_NET_GDR_LEVEL={v} (= {})", self.limit),
            _ => format!("NCCL's default limit {}", self.limit),
        }
    }

    /// The limit `level` set by hand (as `NCCL_NET_GDR_LEVEL=<level>` would).
    pub fn at(level: PathLevel) -> GdrLimit {
        GdrLimit {
            limit: nccl_path_type(level),
            env_value: None,
            env_used: false,
            explanation: format!("paths up to {level} get GPUDirect RDMA"),
        }
    }

    /// Whether NCCL would use GPUDirect RDMA on a path it classifies as `nccl_level`.
    pub fn allows(&self, nccl_level: PathLevel) -> bool {
        nccl_path_type(nccl_level) <= self.limit
    }
}

/// The GDR distance limit NCCL would apply with this environment.
pub fn gdr_limit(env: &[(String, String)]) -> GdrLimit {
    let value = env.iter().rev().find(|(k, _)| k == "NCCL_NET_GDR_LEVEL").map(|(_, v)| v.clone());
    let default = |env_value: Option<String>, why: String| GdrLimit {
        limit: NcclPathType::Pxb,
        env_value,
        env_used: false,
        explanation: why,
    };
    match value {
        None => default(None, "NCCL's default: PIX and PXB pairs get GPUDirect RDMA, PHB and SYS don't".to_owned()),
        Some(v) => match gdr_level(&v) {
            Some((limit, how)) => GdrLimit { limit, env_value: Some(v), env_used: true, explanation: how },
            None => default(
                Some(v.clone()),
                format!(
                    "NCCL_NET_GDR_LEVEL={v:?} is ignored by NCCL (not an exact, upper-case path name and not a \
                     number), so the default PXB applies"
                ),
            ),
        },
    }
}

/// One GPU–NIC pair and how NCCL sees it.
#[derive(Clone, Debug, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Pair {
    /// GPU bus id.
    pub gpu: String,
    /// GPU number in PCI order (`GPU0`).
    pub gpu_index: usize,
    /// NIC verbs name.
    pub nic: String,
    /// NIC bus id.
    pub nic_bdf: String,
    /// nvidia-smi's classification from the sysfs paths.
    pub level: PathLevel,
    /// NCCL's classification (never NODE); this one decides GDR.
    pub nccl_level: PathLevel,
    /// The bridge where GPU↔NIC traffic turns around, when it stays below the
    /// root complex (PIX, PXB).
    pub turnaround: Option<String>,
    /// Bridges the peer-to-peer traffic crosses, GPU side first (PIX, PXB).
    pub bridges: Vec<String>,
    /// Host bridge above the GPU (`pci0000:15`).
    pub gpu_host_bridge: String,
    /// Host bridge above the NIC.
    pub nic_host_bridge: String,
    /// GPU `numa_node`.
    pub gpu_numa: Option<i32>,
    /// NIC `numa_node`.
    pub nic_numa: Option<i32>,
    /// Whether NCCL's default limit (PXB) allows GPUDirect RDMA here.
    pub gdr_by_default: bool,
}

impl Pair {
    /// `GPU0 <-> mlx5_0 (PIX)`, the doctor's verdict-line form.
    pub fn label(&self) -> String {
        format!("GPU{} <-> {} ({})", self.gpu_index, self.nic, self.level)
    }
}

/// `DDDD:BB:DD.F` as numbers, so CUDA's `0000:3A:00.0`, sysfs's
/// `0000:3a:00.0` and NVML's `00000000:3a:00.0` compare equal.
fn bdf_key(s: &str) -> Option<(u32, u8, u8, u8)> {
    let (head, dev_fn) = s.trim().rsplit_once(':')?;
    let (dom, bus) = head.rsplit_once(':')?;
    let (dev, func) = dev_fn.split_once('.')?;
    Some((
        u32::from_str_radix(dom, 16).ok()?,
        u8::from_str_radix(bus, 16).ok()?,
        u8::from_str_radix(dev, 16).ok()?,
        u8::from_str_radix(func, 16).ok()?,
    ))
}

/// Whether two PCI bus ids name the same function, however each tool
/// spells it (case, domain width, surrounding whitespace).
pub fn same_bus_id(a: &str, b: &str) -> bool {
    matches!((bdf_key(a), bdf_key(b)), (Some(x), Some(y)) if x == y)
}

impl PciTopology {
    /// The GPU at PCI address `bus_id`, as CUDA's `cuDeviceGetPCIBusId`
    /// (or [`Gpu::pci_bus_id`](crate::Gpu::pci_bus_id), NVML, sysfs)
    /// spells it: how a CUDA ordinal finds its place in the tree (CUDA's
    /// order need not be PCI order).
    pub fn gpu_by_bus_id(&self, bus_id: &str) -> Option<&GpuDev> {
        self.gpus.iter().find(|g| same_bus_id(&g.bdf, bus_id))
    }

    /// The RDMA NICs nearest GPU `gpu_index` (PCI order, as nvidia-smi
    /// numbers GPUs), best first: by NCCL's view of the path (which decides
    /// whether NCCL uses GPUDirect RDMA), then nvidia-smi's, then NIC name.
    /// Pairs that cannot be placed in the PCIe tree are left out.
    pub fn nearest_nics(&self, root: &SysRoot, gpu_index: usize) -> Vec<Pair> {
        let mut out: Vec<Pair> = pairs(root, self).into_iter().filter(|p| p.gpu_index == gpu_index).collect();
        out.sort_by_key(|p| (p.nccl_level, p.level, natural_key(&p.nic)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_compare_as_numbers() {
        assert!(same_bus_id("0000:3a:00.0", "0000:3A:00.0"));
        assert!(same_bus_id("00000000:3a:00.0", " 0000:3a:00.0\n"));
        assert_eq!(bdf_key("10000:01:00.1"), Some((0x10000, 1, 0, 1)));
        assert!(!same_bus_id("0000:3a:00.0", "0000:3a:00.1"));
        for bad in ["", "3a:00.0", "0000:3a:00", "0000:zz:00.0", "0000:3a:00.0.1", ":::."] {
            assert_eq!(bdf_key(bad), None, "{bad:?}");
            assert!(!same_bus_id(bad, bad), "{bad:?} names nothing");
        }
    }
}
