//! The facts the choice of registration path rests on: CUDA's answers for
//! the GPU, the NIC's dma-buf probe, the host's kernel and peer-memory
//! client. Plain data (and the host's files, read through a root); asking
//! CUDA and the NIC live is [`gather`](super::gather)'s.

use crate::errno::Errno;
use crate::sysroot::SysRoot;

/// Which NVIDIA kernel module is loaded (`/proc/driver/nvidia/version`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum ModuleFlavour {
    /// The open kernel module: can export dma-buf (Turing and newer).
    Open,
    /// The proprietary module: no dma-buf export.
    Proprietary,
    /// No NVIDIA module loaded (the file does not exist).
    NotLoaded,
    /// The file exists but says neither.
    Unknown(String),
}

impl ModuleFlavour {
    /// Reads `/proc/driver/nvidia/version` under `root`.
    pub fn read(root: &SysRoot) -> ModuleFlavour {
        match root.read("/proc/driver/nvidia/version") {
            Err(_) => ModuleFlavour::NotLoaded,
            Ok(text) => {
                let first = text.lines().next().unwrap_or_default().to_owned();
                if first.contains("Open Kernel Module") {
                    ModuleFlavour::Open
                } else if first.contains("Kernel Module") {
                    ModuleFlavour::Proprietary
                } else {
                    ModuleFlavour::Unknown(first)
                }
            }
        }
    }
}

impl std::fmt::Display for ModuleFlavour {
    /// `the open kernel module`, `the proprietary kernel module`, `no NVIDIA
    /// kernel module` or the unrecognised version line, quoted.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModuleFlavour::Open => f.write_str("the open kernel module"),
            ModuleFlavour::Proprietary => f.write_str("the proprietary kernel module"),
            ModuleFlavour::NotLoaded => f.write_str("no NVIDIA kernel module"),
            ModuleFlavour::Unknown(line) => write!(f, "an unrecognised kernel module ({line:?})"),
        }
    }
}

/// The answer of the NIC's dma-buf probe: `ibv_reg_dmabuf_mr` with
/// `fd = -1`, as NCCL and UCX do. A provider that can register dma-buf
/// rejects the bad descriptor (`EBADF`); one that cannot says
/// `EOPNOTSUPP` or `EPROTONOSUPPORT`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum DmaBufProbe {
    /// The provider can register dma-buf memory; the errno it gave.
    Supported(Errno),
    /// It cannot; the errno it gave.
    Unsupported(Errno),
}

impl DmaBufProbe {
    /// Classifies the errno of the `fd = -1` probe.
    pub fn from_errno(errno: Errno) -> DmaBufProbe {
        match errno.0 {
            libc::EOPNOTSUPP | libc::EPROTONOSUPPORT => DmaBufProbe::Unsupported(errno),
            _ => DmaBufProbe::Supported(errno),
        }
    }
}

/// The GPU side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GpuFacts {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// `GPU0 (NVIDIA H200, 0000:17:00.0)` or just `GPU0` when unknown.
    pub label: String,
    /// PCI address (`0000:17:00.0`) when CUDA could tell.
    pub pci_bus_id: Option<String>,
    /// Why CUDA could not be asked (no driver, no such GPU); `None` when it could.
    pub cuda_unavailable: Option<String>,
    /// CUDA driver version (12080 = 12.8).
    pub driver_version: Option<i32>,
    /// Attribute 116.
    pub gdr_supported: Option<bool>,
    /// Attribute 124.
    pub dma_buf_supported: Option<bool>,
    /// The NVIDIA kernel module flavour.
    pub module: ModuleFlavour,
}

/// The NIC side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicFacts {
    /// RDMA device name.
    pub device: String,
    /// The dma-buf probe's answer.
    pub dma_buf: DmaBufProbe,
}

/// The host side of the facts.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct HostFacts {
    /// Kernel release (`/proc/sys/kernel/osrelease`).
    pub kernel_release: Option<String>,
    /// Peer-memory files found (e.g. `/sys/module/nvidia_peermem/version`).
    pub peer_memory_found: Vec<String>,
    /// Whether `/proc/kallsyms` lists `ib_register_peer_memory_client`
    /// (`None`: unreadable).
    pub peer_memory_api: Option<bool>,
}

/// The files whose existence shows a loaded peer-memory client, as NCCL,
/// UCX and libfabric check them.
pub const PEER_MEMORY_FILES: [&str; 4] = [
    "/sys/kernel/mm/memory_peers/nv_mem/version",
    "/sys/kernel/mm/memory_peers/nv_mem_nc/version",
    "/sys/module/nvidia_peermem/version",
    "/sys/module/nv_peer_mem/version",
];

impl HostFacts {
    /// Reads the host facts under `root`.
    pub fn read(root: &SysRoot) -> HostFacts {
        HostFacts {
            kernel_release: root.read("/proc/sys/kernel/osrelease").ok(),
            peer_memory_found: PEER_MEMORY_FILES.iter().filter(|p| root.exists(p)).map(|p| p.to_string()).collect(),
            peer_memory_api: root
                .any_line("/proc/kallsyms", |l| l.split_whitespace().nth(2) == Some("ib_register_peer_memory_client"))
                .ok(),
        }
    }

    /// `(major, minor)` of the kernel release, e.g. `(6, 1)` for `6.1.0-27-amd64`.
    pub fn kernel_version(&self) -> Option<(u32, u32)> {
        let r = self.kernel_release.as_deref()?;
        let mut it = r.split(|c: char| !c.is_ascii_digit());
        Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
    }
}

/// Everything the path decision depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdrFacts {
    /// The GPU.
    pub gpu: GpuFacts,
    /// The NIC.
    pub nic: NicFacts,
    /// The host.
    pub host: HostFacts,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_facts_from_fixture_trees() {
        let tree = testkit::Tree::new("gdr-host-facts");
        let root = SysRoot::at(tree.path());
        let write = |p: &str, text: &str| {
            tree.file(p, text);
        };
        write("/proc/sys/kernel/osrelease", "6.1.0-27-amd64\n");
        write("/proc/kallsyms", "ffffffffc0a01230 T ib_register_peer_memory_client\t[ib_core]\nffffffffc0a01300 t other\n");
        write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  560.35.03  Release Build\nGCC version: gcc 12\n");
        let h = HostFacts::read(&root);
        assert_eq!(h.kernel_version(), Some((6, 1)));
        assert_eq!(h.peer_memory_api, Some(true));
        assert!(h.peer_memory_found.is_empty());
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::Open);
        write("/sys/module/nvidia_peermem/version", "1.0\n");
        write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n");
        let h = HostFacts::read(&root);
        assert_eq!(h.peer_memory_found, vec!["/sys/module/nvidia_peermem/version".to_string()]);
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::Proprietary);
        drop(tree);
        assert_eq!(ModuleFlavour::read(&root), ModuleFlavour::NotLoaded);
        assert_eq!(HostFacts::read(&root).peer_memory_api, None);
    }
}
