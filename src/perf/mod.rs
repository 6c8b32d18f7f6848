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
use gpudirect::bootstrap::{Handshake, OobChannel};
use gpudirect::{
    AccessFlags, CompletionQueue, Context, Endpoint, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RemoteBuffer,
};


/// The operation measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// RDMA write.
    Write,
    /// RDMA read.
    Read,
    /// Send/receive.
    Send,
}

/// Options shared by both tools.
#[derive(Args, Clone, Debug)]
pub struct Common {
    /// Wait for a client.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    pub server: bool,
    /// Connect to a server at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    pub connect: Option<String>,
    /// Server: address and port to listen on.
    #[arg(long, default_value = "0.0.0.0:18515", value_name = "ADDR:PORT")]
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
    /// Message size in bytes.
    #[arg(long, short = 's', conflicts_with = "all")]
    pub size: Option<usize>,
    /// Sweep sizes 2 B to 8 MiB.
    #[arg(long, short = 'a')]
    pub all: bool,
    /// Iterations per size.
    #[arg(long, short = 'n')]
    pub iters: Option<u32>,
    /// Machine-readable output.
    #[arg(long)]
    pub json: bool,
    /// Seconds to wait for the peer.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

/// What the client tells the server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Params {
    pub op: Op,
    pub sizes: Vec<usize>,
    pub iters: u32,
    pub tx_depth: u32,
}

impl Params {
    fn encode(&self) -> Vec<u8> {
        let sizes: Vec<String> = self.sizes.iter().map(|s| s.to_string()).collect();
        let op = self.op.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
        format!("op={op};iters={};tx={};sizes={}", self.iters, self.tx_depth, sizes.join(",")).into_bytes()
    }

    fn decode(b: &[u8]) -> Result<Params, String> {
        let s = std::str::from_utf8(b).map_err(|_| "peer parameters are not UTF-8")?;
        let (mut op, mut iters, mut tx, mut sizes) = (None, None, None, None);
        for kv in s.split(';') {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("malformed peer parameter {kv:?}"))?;
            match k {
                "op" => op = Some(Op::from_str(v, false).map_err(|_| format!("unknown peer op {v:?}"))?),
                "iters" => iters = Some(v.parse::<u32>().map_err(|_| format!("bad iters {v:?}"))?),
                "tx" => tx = Some(v.parse::<u32>().map_err(|_| format!("bad tx depth {v:?}"))?),
                "sizes" => sizes = Some(v.split(',').map(str::parse).collect::<Result<Vec<usize>, _>>().map_err(|_| format!("bad sizes {v:?}"))?),
                _ => return Err(format!("unknown peer parameter {k:?}")),
            }
        }
        let p = Params { op: op.ok_or("no op")?, sizes: sizes.ok_or("no sizes")?, iters: iters.ok_or("no iters")?, tx_depth: tx.ok_or("no tx depth")? };
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
    pub qp: QueuePair,
    pub cq: CompletionQueue,
    pub mr: MemoryRegion,
    pub peer: RemoteBuffer,
    pub oob: OobChannel,
    pub local: Endpoint,
    /// Receive queue depth.
    pub rx_depth: u32,
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
    let ctx = Context::open(c.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let mut oob = if c.server {
        let l = TcpListener::bind(&c.listen).map_err(|e| format!("cannot listen on {}: {e}", c.listen))?;
        OobChannel::accept(&l, timeout)?
    } else {
        OobChannel::connect(c.connect.as_deref().unwrap_or_default(), timeout)?
    };
    let params = if c.server {
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
        ..QpConfig::default()
    };
    let qp = QueuePair::create(&pd, &cq, &cq, &config)?;
    let max = *params.sizes.iter().max().unwrap_or(&1) * areas;
    let mr = MemoryRegion::alloc(&pd, max, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
    let local = qp.endpoint();
    let peer = oob.exchange(&Handshake { endpoint: Some(local), buffers: vec![mr.remote()], app: vec![] })?;
    let peer_ep = peer.endpoint.ok_or("the peer sent no endpoint")?;
    let peer_buf = *peer.buffers.first().ok_or("the peer sent no buffer")?;
    if peer_buf.len < max as u64 {
        return Err(format!("the peer's buffer ({peer_buf}) is smaller than {max} bytes").into());
    }
    let qp = qp.connect(&peer_ep)?;
    Ok(Link { params, is_server: c.server, qp, cq, mr, peer: peer_buf, oob, local, rx_depth })
}

/// The sizes the options ask for.
pub fn sizes(c: &Common, default: usize) -> Vec<usize> {
    if c.all {
        sizes::perftest_all_sizes()
    } else {
        vec![c.size.unwrap_or(default)]
    }
}

/// The banner perftest prints, abridged, so logs show what ran.
pub fn banner(tool: &str, link: &Link, extra: &str) -> String {
    let p = &link.params;
    format!(
        "---------------------------------------------------------------------------------------\n \
         {tool}  op {:?}  iterations {}  tx depth {}{extra}\n \
         local  {}\n{}",
        p.op,
        p.iters,
        p.tx_depth,
        link.local,
        "---------------------------------------------------------------------------------------"
    )
}
