//! The devices the plugin offers NCCL: every active port of every RDMA
//! device that `NCCL_IB_HCA` selects (NCCL's IB transport counts the same
//! way), each with what the library's judge says about each GPU with it
//! and its byte counters. Comms and their registrations each get a
//! protection domain of their own (see `comm`).

use std::ffi::{c_int, CString};
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;

use gpudirect::gdr::GdrFacts;
use gpudirect::metrics::{DataPath, Direction, PathCounters};
use gpudirect::nccl::PluginLine;
use gpudirect::sysroot::SysRoot;
use gpudirect::topology::discover;
use gpudirect::{devices, gpu_count, probe_window_range, AccessFlags, Context, LinkLayer, PortState, ProtectionDomain, QpConfig, WindowRange};

use crate::config::{Config, KeysChoice};
use crate::error::{NetError, Result};
use crate::stats::{CacheTotals, NicStats, PluginStats, Refusals};
use crate::verdict::{levels, ptr_support, PairJudgement};

/// What the key a receive hands its peer opens, on one device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Keys {
    /// A type-2 memory window per receive, bound when the receive is
    /// posted and invalidated before `test` reports it done; `range` is
    /// what the device was seen to do with a write past a window's range.
    Windows {
        /// Whether the device bounds a window's range.
        range: WindowRange,
    },
    /// The comm's registrations: a receive's key opens the registration
    /// it lies in, while it is registered. Why windows are not used.
    PerComm(String),
}

impl Keys {
    /// The access of NCCL's registrations: with windows the region itself
    /// grants no remote access at all.
    pub fn registration_access(&self) -> AccessFlags {
        match self {
            Keys::Windows { .. } => AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
            Keys::PerComm(_) => AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
        }
    }

    /// As the init line says it.
    pub fn describe(&self) -> String {
        match self {
            Keys::Windows { range: WindowRange::Enforced } => "keys per receive (type-2 memory windows: a receive's key opens its bytes until it completes)".into(),
            Keys::Windows { range: WindowRange::NotEnforced } => "keys per receive lifetime (type-2 memory windows: a receive's key opens its registration until it completes; \
                 this device let a write past a window's range land)"
                .into(),
            Keys::PerComm(why) => format!("keys per comm (a receive's key opens its registration while registered; {why})"),
        }
    }

    /// Chooses for a device: windows where it has them and `choice` allows,
    /// with what it does past a window's range seen by a probe on `pd`.
    fn choose(choice: KeysChoice, pd: &ProtectionDomain, qp: &QpConfig) -> Keys {
        if choice == KeysChoice::PerComm {
            return Keys::PerComm(format!("{}=per-comm", KeysChoice::VAR));
        }
        if !pd.context().attr().mem_windows {
            return Keys::PerComm("the device has no type-2 memory windows".into());
        }
        match probe_window_range(pd, qp, std::time::Duration::from_secs(2)) {
            Ok(range) => Keys::Windows { range },
            Err(e) => Keys::PerComm(format!("the memory-window probe failed: {e}")),
        }
    }
}

/// One port NCCL sees as a network device.
#[derive(Debug)]
pub struct Nic {
    /// Verbs device name (`mlx5_0`).
    pub name: String,
    /// Port number.
    pub port: u8,
    /// InfiniBand or Ethernet (RoCE).
    pub link_layer: LinkLayer,
    /// The protection domain the judge's probes ran in (no comm's memory
    /// lives in it).
    pub pd: ProtectionDomain,
    /// Node GUID.
    pub guid: u64,
    /// `name` for NCCL.
    pub c_name: CString,
    /// The device's sysfs path (what NCCL places in its topology).
    pub c_pci_path: CString,
    /// Port speed in Mb/s.
    pub speed_mbps: c_int,
    /// The library's judgement of each GPU with this NIC.
    pub pairs: Vec<PairJudgement>,
    /// What `getProperties` advertises.
    pub ptr_support: c_int,
    /// What a receive's key opens.
    pub keys: Keys,
    /// The address connection setup listens on.
    pub addr: IpAddr,
    /// Bytes moved, by direction and path.
    pub traffic: PathCounters,
    /// Its comms' registration caches.
    pub caches: CacheTotals,
    /// Comms open on this port.
    pub open_comms: AtomicUsize,
}

impl Nic {
    /// `mlx5_0:1`.
    pub fn label(&self) -> String {
        format!("{}:{}", self.name, self.port)
    }

    /// The judgement for GPU `ordinal` with this NIC.
    pub fn pair(&self, ordinal: usize) -> Option<&PairJudgement> {
        self.pairs.iter().find(|p| p.ordinal == ordinal)
    }

    /// The INFO line `init` writes for this NIC.
    pub fn describe(&self) -> String {
        let layer = if self.link_layer == LinkLayer::Ethernet { "RoCE" } else { "IB" };
        let gpus: Vec<String> = self
            .pairs
            .iter()
            .map(|p| {
                let short = format!("GPU{}", p.ordinal);
                let level = p.nccl_level.map_or("distance unknown".to_owned(), |l| l.to_string());
                match p.plan.try_paths.first() {
                    Some(path) => format!("{short} {path} ({level})"),
                    None => format!("{short} none ({level}): {}", p.plan.causes.iter().map(|c| c.checked(&p.facts)).collect::<Vec<_>>().join("; ")),
                }
            })
            .collect();
        let gpus = if gpus.is_empty() { "no GPU visible, host memory only".to_owned() } else { gpus.join(", ") };
        format!("{}/{layer} speed {} Mb/s, GPUDirect RDMA: {gpus}; {}", self.label(), self.speed_mbps, self.keys.describe())
    }

    /// The counters as the finalize line shows them: GPU memory is the
    /// `gdr` path, host memory the `host` and `staged` paths (staged bytes
    /// live in host memory).
    pub fn traffic_line(&self) -> String {
        let t = self.traffic.read();
        let sum = |dir: Direction, gpu: bool| t.iter().filter(|x| x.direction == dir && (x.path == DataPath::Gdr) == gpu).map(|x| x.bytes).sum();
        PluginLine::Traffic { nic: self.label(), sent_gpu: sum(Direction::Out, true), sent_host: sum(Direction::Out, false), recv_gpu: sum(Direction::In, true), recv_host: sum(Direction::In, false) }.to_string()
    }
}

/// Every device the plugin offers, and the environment it read.
#[derive(Debug)]
pub struct Site {
    /// The devices, in NCCL's index order.
    pub nics: Vec<Nic>,
    /// The environment.
    pub config: Config,
    /// Ports left out, with why, for the init lines.
    pub skipped: Vec<String>,
    /// What was refused, by reason.
    pub refusals: Refusals,
    /// When it opened (the snapshot's uptime).
    pub started: Instant,
}

impl Site {
    /// Finds the devices and judges them.
    ///
    /// # Errors
    /// [`NetError::Config`] when no device is usable, naming why each was
    /// not (or that the machine has none) and the fix.
    pub fn open(config: Config) -> Result<Site> {
        let list = devices().map_err(|e| {
            NetError::Config(format!(
                "no RDMA device on this machine ({e}): the plugin carries NCCL's traffic over RDMA only. In a container, \
                 expose the host's RDMA devices (/dev/infiniband/uverbs*, the RDMA device plugin or SR-IOV network); \
                 `gpudirect doctor` says what is missing"
            ))
        })?;
        if list.is_empty() {
            return Err(NetError::Config(
                "no RDMA device on this machine (ibv_get_device_list found none): the plugin carries NCCL's traffic over RDMA \
                 only. Load the NIC's driver and its rdma-core provider, or in a container expose the host's RDMA devices; \
                 `gpudirect doctor` says what is missing"
                    .into(),
            ));
        }
        let root = SysRoot::live();
        let topo = discover(&root);
        let gpus = gpu_count().unwrap_or(0);
        let mut nics = Vec::new();
        let mut skipped = Vec::new();
        for dev in list {
            let ctx = match Context::open(Some(&dev.name)) {
                Ok(c) => c,
                Err(e) => {
                    skipped.push(format!("{}: cannot be opened: {e}", dev.name));
                    continue;
                }
            };
            for port in 1..=ctx.attr().phys_port_cnt {
                match Self::port(&ctx, port, &config, &root, &topo, gpus) {
                    Ok(nic) => nics.push(nic),
                    Err(why) => skipped.push(format!("{}:{port}: {why}", dev.name)),
                }
            }
        }
        if nics.is_empty() {
            let hca = config.hca.as_ref().map_or(String::new(), |(v, _)| format!(" NCCL_IB_HCA={v:?} is set."));
            return Err(NetError::Config(format!(
                "no usable RDMA port: {}.{hca} The plugin needs an active port (`ibv_devinfo` shows PORT_ACTIVE)",
                skipped.join("; ")
            )));
        }
        Ok(Site { nics, config, skipped, refusals: Refusals::default(), started: Instant::now() })
    }

    fn port(ctx: &Context, port: u8, config: &Config, root: &SysRoot, topo: &gpudirect::topology::PciTopology, gpus: usize) -> std::result::Result<Nic, String> {
        let name = ctx.name().to_owned();
        let attr = ctx.query_port(port).map_err(|e| e.to_string())?;
        if attr.state != PortState::Active {
            return Err(format!("port is {:?}, not active", attr.state));
        }
        if !config.selects(&name, port) {
            return Err("left out by NCCL_IB_HCA".into());
        }
        let gid = ctx.choose_gid(port, config.gid_index).map_err(|e| e.to_string())?;
        let addr = match gid.entry.gid.to_ipv6().to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None if attr.link_layer == LinkLayer::Ethernet => IpAddr::V6(gid.entry.gid.to_ipv6()),
            None => first_interface_address().ok_or("an InfiniBand port with no IP interface on this machine to set up connections over")?,
        };
        let pd = ProtectionDomain::new(ctx).map_err(|e| e.to_string())?;
        let pairs: Vec<PairJudgement> = (0..gpus)
            .map(|ordinal| {
                let facts = GdrFacts::gather(&pd, ordinal, root);
                let levels = facts.gpu.pci_bus_id.as_deref().and_then(|bus| levels(root, topo, bus, &name));
                PairJudgement::new(ordinal, facts, levels.map(|(nccl, _)| nccl)).shown_as(levels.map(|(_, shown)| shown))
            })
            .collect();
        let sysfs = format!("/sys/class/infiniband/{name}");
        let pci_path = std::fs::canonicalize(format!("{sysfs}/device")).or_else(|_| std::fs::canonicalize(&sysfs)).map_or(sysfs.clone(), |p| p.display().to_string());
        let probe = QpConfig { port, gid_index: config.gid_index, ..QpConfig::default() };
        let keys = Keys::choose(config.keys, &pd, &probe);
        let speed_mbps = std::fs::read_to_string(format!("{sysfs}/ports/{port}/rate")).ok().and_then(|r| rate_mbps(&r)).unwrap_or(10_000);
        Ok(Nic {
            c_name: CString::new(name.clone()).unwrap_or_default(),
            c_pci_path: CString::new(pci_path).unwrap_or_default(),
            name,
            port,
            link_layer: attr.link_layer,
            guid: ctx.attr().node_guid.0,
            speed_mbps,
            ptr_support: ptr_support(&pairs),
            keys,
            pairs,
            addr,
            pd,
            traffic: PathCounters::default(),
            caches: CacheTotals::default(),
            open_comms: AtomicUsize::new(0),
        })
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PluginStats {
        PluginStats {
            uptime: self.started.elapsed(),
            nics: self
                .nics
                .iter()
                .map(|n| NicStats { nic: n.label(), traffic: n.traffic.read(), comms: n.open_comms.load(Relaxed), rcache: n.caches.read() })
                .collect(),
            refused_staged: self.refusals.staged.load(Relaxed),
            refused_peer_claims: self.refusals.peer_claims.load(Relaxed),
            refused_setup_closed: self.refusals.setup_closed.load(Relaxed),
        }
    }

    /// Device `dev`, or the error NCCL gets for an index past the last.
    ///
    /// # Errors
    /// [`NetError::Invalid`].
    pub fn nic(&self, dev: c_int) -> Result<&Nic> {
        usize::try_from(dev).ok().and_then(|d| self.nics.get(d)).ok_or_else(|| NetError::Invalid(format!("device {dev}: the plugin has {} device(s)", self.nics.len())))
    }
}

/// `100 Gb/sec (4X EDR)` -> 100000.
fn rate_mbps(rate: &str) -> Option<c_int> {
    let gbps: f64 = rate.split_whitespace().next()?.parse().ok()?;
    Some((gbps * 1000.0) as c_int)
}

/// The first IPv4 address of an interface that is up and not loopback.
fn first_interface_address() -> Option<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = list;
    while !at.is_null() && found.is_none() {
        // SAFETY: `at` walks the list getifaddrs returned, entry by entry.
        let entry = unsafe { &*at };
        let up = entry.ifa_flags & libc::IFF_UP as u32 != 0 && entry.ifa_flags & libc::IFF_LOOPBACK as u32 == 0;
        // SAFETY: ifa_addr is NULL or a sockaddr whose family says its type.
        if up && !entry.ifa_addr.is_null() && i32::from(unsafe { (*entry.ifa_addr).sa_family }) == libc::AF_INET {
            // SAFETY: the family is AF_INET, so the address is a sockaddr_in.
            let sin = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))));
        }
        at = entry.ifa_next;
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(list) };
    found
}

#[cfg(test)]
mod tests {
    #[test]
    fn rates_read_as_sysfs_writes_them() {
        assert_eq!(super::rate_mbps("100 Gb/sec (4X EDR)\n"), Some(100_000));
        assert_eq!(super::rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(super::rate_mbps("fast"), None);
    }
}
