//! Which of an agent's NICs carry a GPU's memory: the ones nearest the GPU
//! in the PCIe tree ([`gpudirect::topology`]), and only while that distance is
//! within the agent's limit ([`AgentConfig::gpu_path_limit`](crate::AgentConfig::gpu_path_limit)).
//! A NIC farther than the nearest ones would carry the GPU's bytes over
//! the CPU's root complex or the inter-socket link at a fraction of the
//! NIC's rate (why NCCL turns GPUDirect RDMA off for such pairs); a NIC
//! whose path a bridge's ACS redirects to the root complex is blocked
//! ([`gpudirect::topology::acs`]); a software NIC cannot reach GPU memory at
//! all. Every NIC left out gets a reason the registration reports
//! ([`Registration::skipped`](crate::Registration::skipped)).
//!
//! Pure over a [`SysRoot`], so fixture machines test it.

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::acs::redirecting_bridge;
use gpudirect::topology::{all_pairs, discover, GdrLimit, Pair, PathLevel, Unplaced};

/// What one NIC of the agent is to the GPU's memory.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Place {
    /// Register it here. The pair when the topology placed it; `None`
    /// when the distance is unknown (the registration itself still judges
    /// whether the NIC reaches the GPU).
    Use(Option<Pair>),
    /// Not here, and why.
    Skip(String),
}

/// Where a GPU's memory goes, NIC by NIC (in the agent's rail order).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Placement {
    pub(crate) places: Vec<Place>,
    /// The NIC a host-staged mirror goes on: the nearest placed one, else
    /// the first.
    pub(crate) stage_on: usize,
    /// What could not be judged (logged as warnings).
    pub(crate) notes: Vec<String>,
}

impl Placement {
    /// The NICs to register on.
    pub(crate) fn chosen(&self) -> Vec<usize> {
        self.places.iter().enumerate().filter(|(_, p)| matches!(p, Place::Use(_))).map(|(i, _)| i).collect()
    }

    /// Why no NIC was chosen: every skip reason.
    pub(crate) fn why_none(&self) -> String {
        let why: Vec<&str> = self.places.iter().filter_map(|p| if let Place::Skip(w) = p { Some(w.as_str()) } else { None }).collect();
        why.join("; ")
    }
}

/// Where the memory of the GPU at PCI address `gpu_bdf` (CUDA's
/// `cuDeviceGetPCIBusId`; `None` when CUDA gave none) goes among `nics`
/// (the agent's devices, in rail order), with `limit` the farthest path
/// GPUDirect RDMA may take, in NCCL's sense ([`GdrLimit::allows`]).
pub(crate) fn place(root: &SysRoot, gpu_bdf: Option<&str>, nics: &[&str], limit: PathLevel) -> Placement {
    let topo = discover(root);
    let unknown = |note: String| Placement { places: vec![Place::Use(None); nics.len()], stage_on: 0, notes: vec![note] };
    let Some(bdf) = gpu_bdf else {
        return unknown("CUDA gave no PCI address for the GPU: its distance to the NICs is unknown, every NIC is tried".into());
    };
    let Some(gpu) = topo.gpu_by_bus_id(bdf) else {
        return unknown(format!(
            "GPU {bdf} is not an NVIDIA GPU under /sys/bus/pci/devices: its distance to the NICs is unknown, every NIC is tried"
        ));
    };
    let label = format!("{} ({})", gpu.label(), gpu.bdf);
    let pairs: Vec<Result<Pair, Unplaced>> = all_pairs(root, &topo)
        .into_iter()
        .filter(|p| match p {
            Ok(p) => p.gpu_index == gpu.index,
            Err(u) => u.gpu_index == gpu.index,
        })
        .collect();
    let mut notes = Vec::new();
    // What the topology says of each NIC.
    let facts: Vec<Result<Option<Pair>, String>> = nics
        .iter()
        .map(|&nic| {
            if let Some(o) = topo.other_rdma.iter().find(|o| o.name == nic) {
                return Err(format!("{nic} cannot reach GPU memory: {}", o.reason));
            }
            match pairs.iter().find(|p| match p {
                Ok(p) => p.nic == nic,
                Err(u) => u.nic == nic,
            }) {
                Some(Ok(p)) => match redirecting_bridge(root, p) {
                    Some((bridge, ctrl)) => Err(format!(
                        "{nic} is {} from {label} but blocked: ACS on bridge {bridge} (ACSCtl {ctrl:#06x}) redirects their \
                         peer-to-peer traffic to the root complex, where GPUDirect RDMA slows down or fails; as root, \
                         `setpci -s {bridge} ECAP_ACS+6.w=0000` at every boot (`gpudirect doctor` shows every bridge)",
                        p.level
                    )),
                    None => Ok(Some(p.clone())),
                },
                Some(Err(why)) => {
                    notes.push(format!("{why}: its distance to {label} is unknown"));
                    Ok(None)
                }
                None => {
                    notes.push(format!("{nic} is not under /sys/class/infiniband: its distance to {label} is unknown"));
                    Ok(None)
                }
            }
        })
        .collect();
    let nearest = facts.iter().enumerate().filter_map(|(i, f)| f.as_ref().ok()?.as_ref().map(|p| (i, p))).min_by_key(|(_, p)| p.level);
    let stage_on = nearest.map_or(0, |(i, _)| i);
    let gdr = GdrLimit::at(limit);
    let places = facts
        .iter()
        .zip(nics)
        .map(|(f, nic)| match (f, nearest) {
            (Err(why), _) => Place::Skip(why.clone()),
            (Ok(None), None) => Place::Use(None),
            (Ok(None), Some((n, best))) => {
                Place::Skip(format!("{nic}'s distance to {label} is unknown, {} is {}: only the NICs nearest the GPU carry its memory", nics[n], best.level))
            }
            (Ok(Some(p)), Some((n, best))) if p.level > best.level => {
                Place::Skip(format!("{nic} is {} from {label}, {} is {}: only the NICs nearest the GPU carry its memory", p.level, nics[n], best.level))
            }
            // NCCL's level decides, so it is the one named; nvidia-smi's is
            // added where the two differ, or the refusal reads as a contradiction.
            (Ok(Some(p)), _) if !gdr.allows(p.nccl_level) => Place::Skip(format!(
                "{nic} is {}{} from {label}, beyond the agent's limit {limit} (AgentConfig::gpu_path_limit): GPUDirect RDMA over it \
                 would cross {}; use a NIC nearer the GPU (NUMA node {}), or raise the limit to accept that path",
                p.nccl_level,
                if p.nccl_level == p.level { String::new() } else { format!(" in NCCL's view ({} in nvidia-smi's)", p.level) },
                crossing(p.nccl_level),
                gpu.numa_node.map_or_else(|| "unknown".to_owned(), |n| n.to_string()),
            )),
            (Ok(Some(p)), _) => Place::Use(Some(p.clone())),
        })
        .collect();
    Placement { places, stage_on, notes }
}

/// What GPU-to-NIC traffic crosses on a path of `level`.
fn crossing(level: PathLevel) -> &'static str {
    match level {
        PathLevel::Pix => "one PCIe switch",
        PathLevel::Pxb => "several PCIe switches",
        PathLevel::Phb => "the CPU's root complex",
        PathLevel::Node => "the CPU, between its host bridges",
        PathLevel::Sys => "the link between CPU sockets",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(name: &str) -> SysRoot {
        SysRoot::at(testkit::machine(name))
    }

    fn first_gpu(root: &SysRoot) -> String {
        discover(root).gpus[0].bdf.clone()
    }

    fn levels(p: &Placement) -> Vec<Option<PathLevel>> {
        p.places.iter().map(|p| if let Place::Use(pair) = p { Some(pair.as_ref().map_or(PathLevel::Sys, |p| p.level)) } else { None }).collect()
    }

    fn skip(p: &Placement, i: usize) -> &str {
        match &p.places[i] {
            Place::Skip(why) => why,
            other => panic!("NIC {i} is {other:?}, not skipped"),
        }
    }

    /// Each GPU's memory goes on the NIC under its own switch, not on the
    /// other GPU's (NODE), whatever the rail order and however CUDA spells
    /// the bus id.
    #[test]
    fn the_nic_under_the_gpus_switch_carries_it_and_the_other_is_skipped() {
        let root = machine("dgx-pix");
        let nics = ["mlx5_0", "mlx5_1"];
        for bdf in ["0000:18:00.0", "00000000:18:00.0", " 0000:18:00.0\n"] {
            let p = place(&root, Some(bdf), &nics, PathLevel::Pxb);
            assert_eq!(levels(&p), [Some(PathLevel::Pix), None], "{bdf}: {p:#?}");
            assert_eq!(skip(&p, 1), "mlx5_1 is NODE from GPU0 (0000:18:00.0), mlx5_0 is PIX: only the NICs nearest the GPU carry its memory");
            assert_eq!((p.chosen(), p.stage_on), (vec![0], 0));
            assert!(p.notes.is_empty(), "{:?}", p.notes);
        }
        let p = place(&root, Some("0000:3A:00.0"), &nics, PathLevel::Pxb);
        assert_eq!(levels(&p), [None, Some(PathLevel::Pix)], "{p:#?}");
        assert_eq!(p.stage_on, 1);
        let p = place(&root, Some("0000:18:00.0"), &["mlx5_1", "mlx5_0"], PathLevel::Pxb);
        assert_eq!((p.chosen(), p.stage_on), (vec![1], 1), "rail order is the agent's: {p:#?}");
        // A limit as loose as SYS does not add the farther NIC: nearest only.
        let p = place(&root, Some("0000:18:00.0"), &nics, PathLevel::Sys);
        assert_eq!(p.chosen(), [0]);
    }

    #[test]
    fn a_gpu_one_socket_away_is_refused_by_default_and_named_with_the_fix() {
        let root = machine("two-socket-sys");
        let gpu = first_gpu(&root);
        let p = place(&root, Some(&gpu), &["mlx5_0", "mlx5_1"], PathLevel::Pxb);
        assert!(p.chosen().is_empty(), "{p:#?}");
        let why = p.why_none();
        for needle in ["mlx5_0 is SYS from GPU0", "mlx5_1 is SYS", "beyond the agent's limit PXB (AgentConfig::gpu_path_limit)", "the link between CPU sockets", "NUMA node 0", "raise the limit"] {
            assert!(why.contains(needle), "{needle:?} not in {why:?}");
        }
        assert_eq!(p.stage_on, 0, "staging, when allowed, goes through the nearest NIC");
        let p = place(&root, Some(&gpu), &["mlx5_0", "mlx5_1"], PathLevel::Sys);
        assert_eq!(levels(&p), [Some(PathLevel::Sys), Some(PathLevel::Sys)], "both ports at the same distance carry it");
    }

    #[test]
    fn the_limit_decides_a_root_complex_path_and_pxb_passes_by_default() {
        let root = machine("phb-root-complex");
        let gpu = first_gpu(&root);
        let nics: Vec<String> = discover(&root).nics.iter().map(|n| n.name.clone()).collect();
        let nics: Vec<&str> = nics.iter().map(String::as_str).collect();
        let p = place(&root, Some(&gpu), &nics, PathLevel::Pxb);
        assert!(p.chosen().is_empty(), "{p:#?}");
        assert!(p.why_none().contains("is PHB from GPU0") && p.why_none().contains("the CPU's root complex"), "{}", p.why_none());
        assert!(!place(&root, Some(&gpu), &nics, PathLevel::Phb).chosen().is_empty());
        assert!(!place(&root, Some(&gpu), &nics, PathLevel::Node).chosen().is_empty(), "NODE is PHB to NCCL");

        let root = machine("iommu-dma");
        let p = place(&root, Some(&first_gpu(&root)), &["mlx5_0"], PathLevel::Pxb);
        assert_eq!(levels(&p), [Some(PathLevel::Pxb)]);
        assert!(place(&root, Some(&first_gpu(&root)), &["mlx5_0"], PathLevel::Pix).chosen().is_empty());
    }

    /// The acs-redirect machine: GPU and NIC under one switch (PIX), but
    /// the downstream port above each GPU redirects peer-to-peer: blocked,
    /// with the bridge and the fix named. Read without root (64-byte
    /// config), ACS cannot be judged and the NIC is used.
    #[test]
    fn a_nic_behind_an_acs_redirecting_bridge_is_blocked_and_the_fix_named() {
        let root = machine("acs-redirect");
        let topo = discover(&root);
        for g in &topo.gpus {
            let p = place(&root, Some(&g.bdf), &["mlx5_0"], PathLevel::Sys);
            assert!(p.chosen().is_empty(), "{p:#?}");
            let why = skip(&p, 0);
            for needle in ["mlx5_0 is PIX from", "but blocked: ACS on bridge", "ECAP_ACS+6.w=0000"] {
                assert!(why.contains(needle), "{needle:?} not in {why:?}");
            }
        }
        let root = machine("nonroot-config64");
        let p = place(&root, Some(&first_gpu(&root)), &["mlx5_0"], PathLevel::Pxb);
        assert_eq!(p.chosen(), [0], "{p:#?}");
    }

    #[test]
    fn software_rdma_never_carries_gpu_memory() {
        let root = machine("vm-soft-roce");
        let p = place(&root, Some(&first_gpu(&root)), &["rxe0"], PathLevel::Sys);
        assert!(p.chosen().is_empty());
        assert!(skip(&p, 0).starts_with("rxe0 cannot reach GPU memory: "), "{p:#?}");
        assert_eq!(p.stage_on, 0, "a staged mirror is host memory, which rxe carries");
    }

    #[test]
    fn an_unplaced_gpu_or_nic_is_tried_and_said() {
        let root = machine("dgx-pix");
        for bdf in [None, Some("0000:99:00.0"), Some("not a bus id")] {
            let p = place(&root, bdf, &["mlx5_0", "mlx5_1"], PathLevel::Pxb);
            assert_eq!(p.places, [Place::Use(None), Place::Use(None)], "{bdf:?}");
            assert_eq!(p.notes.len(), 1, "{bdf:?}");
            assert!(p.notes[0].contains("unknown, every NIC is tried"), "{:?}", p.notes);
        }
        // A NIC sysfs does not list loses to one it places near the GPU...
        let p = place(&root, Some("0000:18:00.0"), &["mlx5_0", "mlx5_9"], PathLevel::Pxb);
        assert_eq!(p.chosen(), [0]);
        assert!(skip(&p, 1).contains("mlx5_9's distance to GPU0 (0000:18:00.0) is unknown, mlx5_0 is PIX"), "{p:#?}");
        assert!(p.notes[0].contains("mlx5_9 is not under /sys/class/infiniband"), "{:?}", p.notes);
        // ...and is tried when nothing is placed.
        let p = place(&root, Some("0000:18:00.0"), &["mlx5_9"], PathLevel::Pxb);
        assert_eq!(p.places, [Place::Use(None)]);
        // A machine without a tree at all.
        let empty = testkit::Tree::new("placement");
        let p = place(&SysRoot::at(empty.path()), Some("0000:18:00.0"), &["mlx5_0"], PathLevel::Pxb);
        assert_eq!(p.places, [Place::Use(None)]);
    }

    /// A NIC whose sysfs path is not a chain of bus ids (behind a VMBus or
    /// platform device) is unplaced for each GPU on its own: the GPU asked
    /// about gets its note, and no other GPU's pairs leak into its answer.
    #[test]
    fn an_unplaced_nic_is_said_for_the_gpu_asked_about() {
        let t = testkit::Tree::new("placement-unplaced");
        for (bdf, under) in [("0000:01:00.0", "0000:00:01.0"), ("0000:02:00.0", "0000:00:02.0")] {
            let dev = format!("/sys/devices/pci0000:00/{under}/{bdf}");
            t.file(&format!("{dev}/vendor"), "0x10de\n").file(&format!("{dev}/class"), "0x030200\n");
            t.link(&format!("/sys/bus/pci/devices/{bdf}"), &format!("../../..{}", &dev["/sys".len()..]));
        }
        t.dir("/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.1");
        t.link("/sys/class/infiniband/mlx5_0/device", "../../../devices/pci0000:00/0000:00:02.0/0000:02:00.1");
        t.dir("/sys/devices/pci0000:00/vmbus-0/0000:05:00.0");
        t.link("/sys/class/infiniband/mlx5_1/device", "../../../devices/pci0000:00/vmbus-0/0000:05:00.0");
        let root = SysRoot::at(t.path());
        let unplaced: Vec<Unplaced> = all_pairs(&root, &discover(&root)).into_iter().filter_map(Result::err).collect();
        assert_eq!(unplaced.iter().map(|u| (u.gpu_index, u.nic.as_str())).collect::<Vec<_>>(), [(0, "mlx5_1"), (1, "mlx5_1")]);
        assert!(unplaced[1].to_string().starts_with("GPU1 <-> mlx5_1: 0000:05:00.0 resolves to /sys/devices/pci0000:00/vmbus-0/"), "{}", unplaced[1]);

        // GPU1 and mlx5_0 are two functions under one root port: PIX to
        // nvidia-smi, PHB to NCCL, whose level is the one that decides.
        let p = place(&root, Some("0000:02:00.0"), &["mlx5_1", "mlx5_0"], PathLevel::Pxb);
        assert!(p.chosen().is_empty(), "{p:#?}");
        assert!(skip(&p, 1).starts_with("mlx5_0 is PHB in NCCL's view (PIX in nvidia-smi's) from GPU1 (0000:02:00.0), beyond the agent's limit PXB"), "{p:#?}");
        let p = place(&root, Some("0000:02:00.0"), &["mlx5_1", "mlx5_0"], PathLevel::Phb);
        assert_eq!(p.chosen(), [1], "{p:#?}");
        assert_eq!(p.notes.len(), 1, "{:?}", p.notes);
        assert!(p.notes[0].starts_with("GPU1 <-> mlx5_1: ") && p.notes[0].ends_with("its distance to GPU1 (0000:02:00.0) is unknown"), "{:?}", p.notes);
        assert!(skip(&p, 0).contains("mlx5_1's distance to GPU1 (0000:02:00.0) is unknown"), "{p:#?}");
        // Alone, it is tried, and said.
        let p = place(&root, Some("0000:01:00.0"), &["mlx5_1"], PathLevel::Pxb);
        assert_eq!(p.places, [Place::Use(None)]);
        assert!(p.notes[0].starts_with("GPU0 <-> mlx5_1: "), "{:?}", p.notes);
    }
}
