//! `gpudirect bw` and `gpudirect lat`: perftest's method and columns, on
//! this library, so results read side by side with `ib_write_bw`,
//! `ib_read_bw`, `ib_send_bw` and `ib_write_lat`.
//!
//! Two processes (or nodes): `--server` waits, `--connect HOST:PORT` drives
//! and prints the results. The client's parameters travel to the server in
//! the bootstrap handshake.

pub mod bw;
pub mod lat;
mod sizes;

use std::net::TcpListener;
use std::time::Duration;

use clap::{Args, ValueEnum};
use gpudirect::bootstrap::{with_port, Handshake, OobChannel, DEFAULT_PORT};
use gpudirect::{
    AccessFlags, CompletionQueue, Context, Endpoint, Gpu, GpuBuffer, GpuPolicy, MemoryRegion, ProtectionDomain, QpConfig,
    QueuePair, RemoteBuffer,
};

/// The operation measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA write.
    Write,
    /// RDMA read.
    Read,
    /// Send/receive.
    Send,
}

/// Options shared by both tools, spelled as perftest spells them: no
/// server address makes this side the server, `-p` is the TCP port (18515
/// by default) and the same short flags mean the same on `bw`, `lat`,
/// the pingpong example and `doctor` (`-d` device, `-i` port, `-x` GID
/// index, `-s` size, `-n` iterations).
#[derive(Args, Clone, Debug)]
pub struct Common {
    /// The server to connect to (HOST or HOST:PORT); without it this side
    /// is the server, as with perftest.
    #[arg(value_name = "SERVER", conflicts_with_all = ["connect", "server"])]
    pub host: Option<String>,
    /// Connect to a server (HOST or HOST:PORT), as the positional SERVER.
    #[arg(long, value_name = "HOST[:PORT]", conflicts_with = "server")]
    pub connect: Option<String>,
    /// Be the server (the default without a SERVER).
    #[arg(long)]
    pub server: bool,
    /// TCP port of the bootstrap exchange (perftest's -p).
    #[arg(long, short = 'p', default_value_t = DEFAULT_PORT)]
    pub port: u16,
    /// Server: address to listen on (ADDR, or ADDR:PORT overriding -p).
    #[arg(long, default_value = "0.0.0.0", value_name = "ADDR[:PORT]")]
    pub listen: String,
    /// RDMA device (default: the first).
    #[arg(long, short = 'd')]
    pub device: Option<String>,
    /// Port of the device.
    #[arg(long, short = 'i', default_value_t = 1)]
    pub ib_port: u8,
    /// GID index (default: the RoCE v2 IPv4-mapped entry).
    #[arg(long, short = 'x')]
    pub gid_index: Option<u32>,
    /// Message size in bytes (client; the server follows the client).
    #[arg(long, short = 's', conflicts_with = "all")]
    pub size: Option<usize>,
    /// Sweep sizes 2 B to 8 MiB (client), with a progress line per size on
    /// stderr.
    #[arg(long, short = 'a')]
    pub all: bool,
    /// Iterations per size (client; the server follows the client).
    #[arg(long, short = 'n')]
    pub iters: Option<u32>,
    /// Machine-readable output, on both sides (the server prints the
    /// client's results).
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for the peer.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Use memory of this CUDA GPU on this side (perftest's --use_cuda);
    /// the registration path is printed per side.
    #[arg(long, value_name = "N")]
    pub gpu: Option<usize>,
    /// With --gpu: require GPUDirect RDMA, prefer it (falling back to host
    /// staging), or stage through host memory.
    #[arg(long, default_value = "require", value_name = "require|prefer|host-staged", requires = "gpu")]
    pub gpu_policy: GpuPolicy,
    /// Post with ibv_post_send instead of the extended API (ibv_wr_*),
    /// which the library uses where the provider has it: to measure both.
    #[arg(long)]
    pub post_send: bool,
}

/// Which side this process is, and the address it listens on or connects to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Waits for a client on this address.
    Server(String),
    /// Connects to a server at this address.
    Client(String),
}

impl Common {
    /// The side and its address, the port from `-p` unless one was given.
    pub fn role(&self) -> Role {
        match self.host.as_ref().or(self.connect.as_ref()) {
            Some(h) => Role::Client(with_port(h, self.port)),
            None => Role::Server(with_port(&self.listen, self.port)),
        }
    }
}

/// What the client tells the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    pub op: Op,
    pub sizes: Vec<usize>,
    pub iters: u32,
    pub tx_depth: u32,
    /// `bw --compare-host`: which memories both sides register.
    pub compare: Compare,
}

/// The memories of a run that compares host memory with GPU memory on
/// the same NIC pair (`bw --compare-host`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compare {
    /// One run on each side's own memory.
    No,
    /// Host memory, then each side's own (GPU where it has `--gpu`).
    Both,
    /// Host memory only: the client's GPU cannot be used, and says why.
    HostOnly,
}

impl Params {
    fn encode(&self) -> Vec<u8> {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        let op = self.op.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
        let cmp = match self.compare {
            Compare::No => 0,
            Compare::Both => 1,
            Compare::HostOnly => 2,
        };
        format!("op={op};iters={};tx={};cmp={cmp};sizes={}", self.iters, self.tx_depth, sizes.join(",")).into_bytes()
    }

    fn decode(b: &[u8]) -> Result<Params, String> {
        let s = std::str::from_utf8(b).map_err(|_| "peer parameters are not UTF-8")?;
        let (mut op, mut iters, mut tx, mut sizes, mut compare) = (None, None, None, None, Compare::No);
        for kv in s.split(';') {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("malformed peer parameter {kv:?}"))?;
            match k {
                "op" => op = Some(Op::from_str(v, false).map_err(|_| format!("unknown peer op {v:?}"))?),
                "iters" => iters = Some(v.parse::<u32>().map_err(|_| format!("bad iters {v:?}"))?),
                "tx" => tx = Some(v.parse::<u32>().map_err(|_| format!("bad tx depth {v:?}"))?),
                "cmp" => {
                    compare = match v {
                        "0" => Compare::No,
                        "1" => Compare::Both,
                        "2" => Compare::HostOnly,
                        _ => return Err(format!("bad compare mode {v:?}")),
                    }
                }
                "sizes" => sizes = Some(v.split(',').map(str::parse).collect::<Result<Vec<usize>, _>>().map_err(|_| format!("bad sizes {v:?}"))?),
                _ => return Err(format!("unknown peer parameter {k:?}")),
            }
        }
        let p = Params {
            op: op.ok_or("no op")?,
            sizes: sizes.ok_or("no sizes")?,
            iters: iters.ok_or("no iters")?,
            tx_depth: tx.ok_or("no tx depth")?,
            compare,
        };
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), String> {
        if self.sizes.is_empty() || self.sizes.iter().any(|&s| s == 0 || s > (1 << 30)) {
            return Err(format!("sizes must be 1 B to 1 GiB: {:?}", self.sizes));
        }
        if self.iters == 0 || self.tx_depth == 0 || self.tx_depth > 8192 {
            return Err("iterations must be >= 1 and tx depth 1..=8192".into());
        }
        Ok(())
    }
}

/// A connected queue pair with its buffer and the peer's.
pub struct Link {
    pub params: Params,
    pub is_server: bool,
    /// What this side's buffer is (`host memory`, `GPU0 memory, path: dma-buf`).
    pub memory: String,
    /// What the peer said its buffer is.
    pub peer_memory: String,
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    pub peer: RemoteBuffer,
    pub oob: OobChannel,
    pub local: Endpoint,
    /// Receive queue depth.
    pub rx_depth: u32,
    /// In a comparison (`bw --compare-host`): the second memory of each
    /// side, measured after the first ([`Link::use_second`]).
    pub second: Option<Second>,
}

/// The memories of a comparison's second half.
pub struct Second {
    pub mr: MemoryRegion,
    pub peer: RemoteBuffer,
    pub memory: String,
    pub peer_memory: String,
}

impl Link {
    /// Measures on the second memories from now on; `false` when there
    /// are none.
    pub fn use_second(&mut self) -> bool {
        let Some(s) = self.second.take() else { return false };
        self.mr = s.mr;
        self.peer = s.peer;
        self.memory = s.memory;
        self.peer_memory = s.peer_memory;
        true
    }
}

/// Minimum receive queue depth, as perftest's default `--rx-depth`.
const RX_DEPTH: u32 = 512;

pub type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Sets up both sides: device, queue pair sized for `params.tx_depth`,
/// a buffer of `areas` times the largest size, the bootstrap exchange and
/// the connection.
pub fn connect(c: &Common, client_params: Params, max_inline: u32, areas: usize) -> Res<Link> {
    client_params.validate()?;
    let timeout = Duration::from_secs(c.timeout);
    let role = c.role();
    let is_server = matches!(role, Role::Server(_));
    // Before any peer waits on us: a GPU that cannot be used fails here,
    // on each side that asked for one (a comparing client found out
    // already, and measures host memory alone).
    let gpu = if !is_server && client_params.compare == Compare::HostOnly { None } else { c.gpu.map(Gpu::open).transpose()? };
    let ctx = Context::open(c.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    if is_server && (c.size.is_some() || c.all || c.iters.is_some()) {
        eprintln!("note: on the server the client's sizes and iterations apply; -s/-a/-n given here are not used");
    }
    let mut oob = match &role {
        Role::Server(addr) => {
            let l = TcpListener::bind(addr).map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            OobChannel::accept(&l, timeout)?
        }
        Role::Client(addr) => OobChannel::connect(addr.as_str(), timeout)?,
    };
    let params = if is_server {
        Params::decode(&oob.exchange(&Handshake::default())?.app)?
    } else {
        oob.exchange(&Handshake { app: client_params.encode(), ..Default::default() })?;
        client_params
    };
    let depth = params.tx_depth;
    // Receives are kept deeper than sends (perftest's rx depth is 512): a
    // sender that finds no receive waits out a receiver-not-ready timer.
    let rx_depth = depth.max(RX_DEPTH).min(ctx.attr().max_qp_wr);
    let cq = CompletionQueue::new(&ctx, (depth + rx_depth + 16).min(ctx.attr().max_cqe))?;
    let config = QpConfig {
        port: c.ib_port,
        gid_index: c.gid_index,
        max_send_wr: depth,
        max_recv_wr: rx_depth,
        max_inline_data: max_inline,
        // perftest's receiver-not-ready settings, so the send test compares
        // like with like; its own receives are posted deep ahead (RX_DEPTH).
        rnr_retry: 7,
        min_rnr_timer: 12,
        extended_posting: !c.post_send,
        ..QpConfig::default()
    };
    let qp = QueuePair::create(&pd, &cq, &cq, &config)?;
    let max = *params.sizes.iter().max().unwrap_or(&1) * areas;
    let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
    let own = || -> Res<MemoryRegion> {
        Ok(match &gpu {
            None => MemoryRegion::alloc(&pd, max, access)?,
            Some(g) => MemoryRegion::register_gpu(&pd, GpuBuffer::alloc(g, max)?, access, c.gpu_policy)?,
        })
    };
    // A comparison measures host memory first, then each side's own.
    let (mr, second) = match params.compare {
        Compare::No => (own()?, None),
        Compare::HostOnly => (MemoryRegion::alloc(&pd, max, access)?, None),
        Compare::Both => (MemoryRegion::alloc(&pd, max, access)?, Some(own()?)),
    };
    let memory = mr.location().to_string();
    let second_memory = second.as_ref().map(|m| m.location().to_string()).unwrap_or_default();
    let local = qp.endpoint();
    let mut buffers = vec![mr.remote()];
    buffers.extend(second.as_ref().map(MemoryRegion::remote));
    // The peer's two memories travel as `first\nsecond`.
    let app = if second.is_some() { format!("{memory}\n{second_memory}") } else { memory.clone() };
    let peer = oob.exchange(&Handshake { endpoint: Some(local), buffers, app: app.into_bytes() })?;
    let peer_app = String::from_utf8_lossy(&peer.app).into_owned();
    let (peer_memory, peer_second_memory) = match peer_app.split_once('\n') {
        Some((a, b)) => (a.to_owned(), b.to_owned()),
        None => (peer_app, String::new()),
    };
    let peer_ep = peer.endpoint.ok_or("the peer sent no endpoint")?;
    let peer_buf = *peer.buffers.first().ok_or("the peer sent no buffer")?;
    for b in &peer.buffers {
        if b.len < max as u64 {
            return Err(format!("the peer's buffer ({b}) is smaller than {max} bytes").into());
        }
    }
    let second = match second {
        None => None,
        Some(mr) => {
            let peer = *peer.buffers.get(1).ok_or("the peer sent no second buffer for the comparison")?;
            Some(Second { mr, peer, memory: second_memory, peer_memory: peer_second_memory })
        }
    };
    let qp = qp.connect(&peer_ep)?;
    Ok(Link { params, is_server, memory, peer_memory, qp, cq, mr, peer: peer_buf, oob, local, rx_depth, second })
}

/// The sizes the options ask for.
pub fn sizes(c: &Common, default: usize) -> Vec<usize> {
    if c.all {
        sizes::perftest_all_sizes()
    } else {
        vec![c.size.unwrap_or(default)]
    }
}

/// The banner perftest prints, abridged, so logs show what ran: `tx_depth`
/// is the one the measurement has in flight (1 for a latency ping-pong,
/// as ib_write_lat prints).
pub fn banner(tool: &str, link: &Link, tx_depth: u32, extra: &str) -> String {
    let p = &link.params;
    let rule = "---------------------------------------------------------------------------------------";
    format!(
        "{rule}\n {tool}  op {:?}  iterations {}  tx depth {tx_depth}{extra}\n \
         local  {}\n memory {}  (peer: {})\n{rule}",
        p.op, p.iters, link.local, link.memory, link.peer_memory
    )
}

/// One line on stderr per size of a sweep, so a long `-a` run shows where
/// it is; stdout (and `--json`) carries only the report.
pub fn progress(tool: &str, link: &Link, index: usize, size: usize) {
    let n = link.params.sizes.len();
    if n > 1 && !link.is_server {
        eprintln!("{tool}: {size} B ({}/{n})", index + 1);
    }
}

/// The end of a run: the client sends its report to the server, which
/// prints it too (perftest's servers print the results as well), so both
/// sides return it.
pub fn share_report<R: serde::Serialize + serde::de::DeserializeOwned>(link: &mut Link, report: Option<R>) -> Res<R> {
    match report {
        Some(r) => {
            let json = serde_json::to_vec(&r)?;
            link.oob.exchange(&Handshake { app: json, ..Default::default() })?;
            Ok(r)
        }
        None => {
            let got = link.oob.exchange(&Handshake::default())?;
            Ok(serde_json::from_slice(&got.app).map_err(|e| format!("the client's report is not readable: {e}"))?)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        common: Common,
    }

    fn role(args: &[&str]) -> Result<Role, clap::Error> {
        Cli::try_parse_from(std::iter::once("t").chain(args.iter().copied())).map(|c| c.common.role())
    }

    /// perftest's conventions: no address is a server on 18515, a bare
    /// host is a client on -p's port, an explicit port wins.
    #[test]
    fn roles_and_ports_follow_perftest() {
        assert_eq!(role(&[]).unwrap(), Role::Server("0.0.0.0:18515".into()));
        assert_eq!(role(&["--server", "-p", "9000"]).unwrap(), Role::Server("0.0.0.0:9000".into()));
        assert_eq!(role(&["--listen", "127.0.0.1:18520"]).unwrap(), Role::Server("127.0.0.1:18520".into()));
        assert_eq!(role(&["nodeA"]).unwrap(), Role::Client("nodeA:18515".into()));
        assert_eq!(role(&["nodeA", "-p", "7000"]).unwrap(), Role::Client("nodeA:7000".into()));
        assert_eq!(role(&["--connect", "10.0.0.2:18520"]).unwrap(), Role::Client("10.0.0.2:18520".into()));
        assert_eq!(role(&["--connect", "10.0.0.2"]).unwrap(), Role::Client("10.0.0.2:18515".into()));
        assert_eq!(role(&["fe80::1"]).unwrap(), Role::Client("[fe80::1]:18515".into()));
        assert_eq!(role(&["[::1]:5"]).unwrap(), Role::Client("[::1]:5".into()));
        for clash in [&["nodeA", "--server"][..], &["nodeA", "--connect", "b"], &["--connect", "a", "--server"]] {
            assert!(role(clash).is_err(), "{clash:?}");
        }
        // --gpu-policy only means something with --gpu.
        assert!(role(&["--gpu-policy", "prefer"]).is_err());
        assert!(role(&["--gpu", "0", "--gpu-policy", "host-staged"]).is_ok());
    }
}
