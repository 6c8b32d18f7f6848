//! Checks of the RDMA and CUDA stacks: devices, ports, GIDs, uverbs nodes,
//! the CUDA driver and GPU attributes, the NVIDIA module flavour, peer
//! memory and dma-buf support.

use gpudirect::gdr::{DmaBufProbe, GpuFacts, HostFacts, ModuleFlavour, PEER_MEMORY_FILES};
use gpudirect::sysroot::SysRoot;
use gpudirect::{GidType, LinkLayer, Mtu, PortState};

use super::probes::RdmaDevice;
use super::{Finding, Status};

/// RDMA devices, their ports, GIDs and netdevs, and the uverbs nodes.
pub fn rdma(root: &SysRoot, devices: &Result<Vec<RdmaDevice>, String>) -> Vec<Finding> {
    let mut out = Vec::new();
    let sys_devs = list_dir(root, "/sys/class/infiniband");
    let uverbs: Vec<String> = list_dir(root, "/dev/infiniband").into_iter().filter(|n| n.starts_with("uverbs")).collect();
    match devices {
        Err(why) => out.push(
            Finding::new("rdma.devices", Status::Fail, "the RDMA devices cannot be listed")
                .evidence(why.clone())
                .fix("install rdma-core and the NIC's kernel driver (mlx5_ib, efa, irdma, bnxt_re), or for tests `rdma link add rxe0 type rxe netdev <if>`"),
        ),
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
            .evidence(format!("/sys/class/infiniband: {}", sys_devs.join(", ")))
            .evidence("/dev/infiniband/uverbs*: none")
            .fix("pass the nodes into the container (`--device /dev/infiniband/uverbs0 ...`, the Kubernetes RDMA device plugin) or run with host networking")
    } else if uverbs.is_empty() {
        Finding::new("rdma.uverbs", Status::Skipped, "no RDMA devices, so no uverbs nodes to check")
    } else {
        Finding::new("rdma.uverbs", Status::Ok, format!("uverbs nodes present: {}", uverbs.join(", ")))
    };
    out.push(f);
    for d in devices.as_ref().map(|v| v.as_slice()).unwrap_or_default() {
        out.extend(device(root, d));
    }
    out
}

fn device(root: &SysRoot, d: &RdmaDevice) -> Vec<Finding> {
    let mut out = Vec::new();
    let id = |what: &str| format!("rdma.{what}.{}", d.name);
    let netdevs = list_dir(root, &format!("/sys/class/infiniband/{}/device/net", d.name));
    out.push(
        Finding::new(
            id("netdev"),
            Status::Ok,
            format!("{} sits on {}", d.name, if netdevs.is_empty() { "no network interface (InfiniBand or virtual)".into() } else { netdevs.join(", ") }),
        )
        .evidence(format!("/sys/class/infiniband/{}/device/net", d.name)),
    );
    let Some(p) = d.ports.first() else {
        out.push(Finding::new(id("port"), Status::Fail, format!("{}: the device could not be opened or queried", d.name)).evidence(
            d.chosen_gid.as_ref().err().cloned().unwrap_or_default(),
        ));
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
        f = f.fix("bring the link up (cable, switch port, `ip link set <if> up`; on InfiniBand a running subnet manager)");
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
            Err(e) => Finding::new(id("gid"), Status::Fail, format!("{}: no usable GID", d.name)).evidence(e.clone()).fix("bring the interface up and give it an IP address"),
        };
        out.push(d.gids.iter().fold(f.evidence(format!("{} RoCE v2 entries of {}", v2, d.gids.len())), |f, g| f.evidence(g.to_string())));
    }
    out.push(match &d.dma_buf {
        Ok(DmaBufProbe::Supported(errno)) => Finding::new(id("dmabuf"), Status::Ok, format!("{} can register dma-buf memory", d.name))
            .evidence(format!("ibv_reg_dmabuf_mr(fd = -1) answered {errno}")),
        Ok(DmaBufProbe::Unsupported(errno)) => Finding::new(id("dmabuf"), Status::Fail, format!("{} cannot register dma-buf memory", d.name))
            .evidence(format!("ibv_reg_dmabuf_mr(fd = -1) answered {errno}"))
            .fix("use a provider with dma-buf support (mlx5, efa, bnxt_re, irdma; rdma-core 34+); Soft-RoCE never has it"),
        Err(e) => Finding::new(id("dmabuf"), Status::Skipped, format!("{}: the dma-buf probe could not run", d.name)).evidence(e.clone()),
    });
    out
}

/// The CUDA driver, each GPU's GPUDirect attributes and the module flavour.
pub fn cuda(root: &SysRoot, gpus: &Result<Vec<GpuFacts>, String>) -> Vec<Finding> {
    let mut out = Vec::new();
    let module = ModuleFlavour::read(root);
    let version = root.read("/proc/driver/nvidia/version").ok().and_then(|t| t.lines().next().map(str::to_owned));
    match gpus {
        Err(why) => {
            out.push(
                Finding::new("cuda.driver", Status::Fail, "CUDA cannot be used")
                    .evidence(why.clone())
                    .fix("install the NVIDIA driver; in a container use the NVIDIA container toolkit (--gpus)"),
            );
        }
        Ok(list) if list.is_empty() => out.push(Finding::new("cuda.driver", Status::Fail, "the CUDA driver sees no GPU").fix("check CUDA_VISIBLE_DEVICES and `nvidia-smi`")),
        Ok(list) => {
            let v = list.iter().find_map(|g| g.driver_version).map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)).unwrap_or_else(|| "unknown".into());
            let mut f = Finding::new("cuda.driver", Status::Ok, format!("CUDA driver {v}, {} GPU(s)", list.len()));
            for g in list {
                f = f.evidence(g.label.clone());
            }
            out.push(f);
            for g in list {
                out.push(match g.gdr_supported {
                    Some(true) => Finding::new(format!("cuda.gdr.gpu{}", g.ordinal), Status::Ok, format!("{} supports GPUDirect RDMA", g.label))
                        .evidence("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 1"),
                    Some(false) => Finding::new(format!("cuda.gdr.gpu{}", g.ordinal), Status::Fail, format!("{} does not support GPUDirect RDMA", g.label))
                        .evidence("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED (116) = 0")
                        .fix("GeForce and some cloud SKUs cannot: use a data-center GPU"),
                    None => Finding::new(format!("cuda.gdr.gpu{}", g.ordinal), Status::Skipped, format!("{}: attribute 116 unreadable", g.label))
                        .evidence(g.cuda_unavailable.clone().unwrap_or_default()),
                });
                out.push(match g.dma_buf_supported {
                    Some(true) => Finding::new(format!("cuda.dmabuf.gpu{}", g.ordinal), Status::Ok, format!("{} can export dma-buf", g.label))
                        .evidence("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 1"),
                    Some(false) => Finding::new(format!("cuda.dmabuf.gpu{}", g.ordinal), Status::Warn, format!("{} cannot export dma-buf: only peer memory is left", g.label))
                        .evidence("CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (124) = 0")
                        .evidence(format!("kernel module: {module:?}"))
                        .fix("use the open kernel module flavour (nvidia-open, default from driver 560), CUDA 11.7+ and a Turing or newer GPU"),
                    None => Finding::new(format!("cuda.dmabuf.gpu{}", g.ordinal), Status::Skipped, format!("{}: attribute 124 unreadable", g.label)),
                });
            }
        }
    }
    let f = match &module {
        ModuleFlavour::Open => Finding::new("cuda.module", Status::Ok, "the open NVIDIA kernel module is loaded (dma-buf capable)"),
        ModuleFlavour::Proprietary => Finding::new("cuda.module", Status::Warn, "the proprietary NVIDIA kernel module is loaded: no dma-buf export")
            .fix("install the open flavour (nvidia-open / `nvidia-driver-XXX-open`), the default from driver 560"),
        ModuleFlavour::NotLoaded => Finding::new("cuda.module", Status::Fail, "no NVIDIA kernel module is loaded").fix("install and load the NVIDIA driver"),
        ModuleFlavour::Unknown(l) => Finding::new("cuda.module", Status::Warn, format!("unrecognised NVIDIA module version line: {l}")),
    };
    out.push(match version {
        Some(v) => f.evidence(format!("/proc/driver/nvidia/version: {v}")),
        None => f.evidence("/proc/driver/nvidia/version: missing"),
    });
    out
}

/// Peer-memory client and kernel dma-buf support.
pub fn host(host: &HostFacts) -> Vec<Finding> {
    let mut out = Vec::new();
    let api = match host.peer_memory_api {
        Some(true) => "/proc/kallsyms: ib_register_peer_memory_client present (MLNX/DOCA OFED ib_core)",
        Some(false) => "/proc/kallsyms: no ib_register_peer_memory_client (inbox ib_core)",
        None => "/proc/kallsyms: unreadable",
    };
    let f = if host.peer_memory_found.is_empty() {
        Finding::new("peermem.client", Status::Warn, "no peer-memory client is loaded: GPU memory can only be registered through dma-buf")
            .evidence(format!("none of {} exists", PEER_MEMORY_FILES.join(", ")))
            .evidence(api)
            .fix(if host.peer_memory_api == Some(true) { "`modprobe nvidia-peermem` if dma-buf is unavailable" } else { "dma-buf is the supported path on inbox kernels; peer memory needs MLNX/DOCA OFED plus nvidia-peermem" })
    } else {
        Finding::new("peermem.client", Status::Ok, format!("peer-memory client loaded: {}", host.peer_memory_found.join(", "))).evidence(api)
    };
    out.push(f);
    let release = host.kernel_release.clone().unwrap_or_else(|| "unknown".into());
    out.push(match host.kernel_version() {
        Some(v) if v >= (5, 12) => Finding::new("dmabuf.kernel", Status::Ok, format!("kernel {release} supports dma-buf memory regions (5.12+)")),
        Some(_) => Finding::new("dmabuf.kernel", Status::Fail, format!("kernel {release} predates dma-buf memory regions (5.12)")).fix("upgrade to kernel 5.12 or newer, or use peer memory"),
        None => Finding::new("dmabuf.kernel", Status::Skipped, "kernel release unreadable (/proc/sys/kernel/osrelease)"),
    });
    out
}

fn list_dir(root: &SysRoot, dir: &str) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root.path(dir))
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
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
