//! The live probes (verbs and CUDA) behind one trait, so the file-based
//! checks run on machines with neither and tests can inject answers.

use serde::{Deserialize, Serialize};

use gpudirect::gdr::{DmaBufProbe, GpuFacts, HostFacts};
use gpudirect::sysroot::SysRoot;
use gpudirect::{Context, GidEntry, PortAttr, ProtectionDomain};

/// What the verbs say about one RDMA device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RdmaDevice {
    /// Kernel name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Firmware version.
    pub fw_ver: String,
    /// Each port's attributes, from port 1.
    pub ports: Vec<PortAttr>,
    /// Port 1's valid GID entries.
    pub gids: Vec<GidEntry>,
    /// The GID a connection on port 1 would use, or why none.
    pub chosen_gid: Result<ChosenGid, String>,
    /// The dma-buf probe's answer, or why it could not run.
    pub dma_buf: Result<DmaBufProbe, String>,
}

/// The GID a connection would use, and why (the library's
/// [`GidChoice`](gpudirect::GidChoice), owned so a capture can hold it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChosenGid {
    /// The entry.
    pub entry: GidEntry,
    /// Why that one.
    pub reason: String,
}

impl std::fmt::Display for ChosenGid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} [{}]", self.entry, self.reason)
    }
}

/// Live answers the doctor needs.
pub trait Probes {
    /// The RDMA devices, or why they cannot be listed.
    fn rdma(&self) -> Result<Vec<RdmaDevice>, String>;
    /// CUDA's view of every GPU, or why CUDA cannot be used.
    fn gpus(&self, root: &SysRoot) -> Result<Vec<GpuFacts>, String>;
    /// The host's facts (kernel, peer-memory client), read under `root`.
    fn host(&self, root: &SysRoot) -> HostFacts {
        HostFacts::read(root)
    }
    /// What `ip -d link show` prints (the kind of each interface), or why
    /// it could not run.
    fn ip_link(&self) -> Result<String, String> {
        Err("not asked".into())
    }
}

/// The real machine, through `gpudirect`.
pub struct LiveProbes;

impl Probes for LiveProbes {
    fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
        let list = gpudirect::devices().map_err(|e| e.to_string())?;
        Ok(list
            .into_iter()
            .map(|d| match Context::open(Some(&d.name)) {
                Err(e) => RdmaDevice {
                    name: d.name,
                    fw_ver: String::new(),
                    ports: vec![],
                    gids: vec![],
                    chosen_gid: Err(e.to_string()),
                    dma_buf: Err(e.to_string()),
                },
                Ok(ctx) => {
                    let ports = (1..=ctx.attr().phys_port_cnt).filter_map(|p| ctx.query_port(p).ok()).collect();
                    let dma_buf = ProtectionDomain::new(&ctx)
                        .map(|pd| gpudirect::gdr::GdrFacts::gather_nic(&pd).dma_buf)
                        .map_err(|e| e.to_string());
                    RdmaDevice {
                        name: d.name,
                        fw_ver: ctx.attr().fw_ver.clone(),
                        ports,
                        gids: ctx.gid_table(1).unwrap_or_default(),
                        chosen_gid: ctx
                            .choose_gid(1, None)
                            .map(|c| ChosenGid { entry: c.entry, reason: c.reason.to_owned() })
                            .map_err(|e| e.to_string()),
                        dma_buf,
                    }
                }
            })
            .collect())
    }

    fn gpus(&self, root: &SysRoot) -> Result<Vec<GpuFacts>, String> {
        let n = gpudirect::gpu_count().map_err(|e| e.to_string())?;
        Ok((0..n).map(|i| GpuFacts::gather(i, root)).collect())
    }

    fn ip_link(&self) -> Result<String, String> {
        let out = std::process::Command::new("ip").args(["-d", "link", "show"]).output().map_err(|e| format!("`ip -d link show` could not run ({e}): install iproute2"))?;
        if !out.status.success() {
            return Err(format!("`ip -d link show` failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}
