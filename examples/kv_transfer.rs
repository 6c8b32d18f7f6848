//! A KV-cache move through the transfer engine: a prefill agent writes
//! `--layers` layers of `--blocks` blocks into a decode agent's block
//! table, one notification per layer, for `--steps` steps, reposting the
//! same prepared requests each step. The decode side checks every block
//! of a layer the moment that layer's notification arrives, so a
//! notification that came before its data fails the run; then it releases
//! the table for the next step (a barrier on the metadata connection, as a
//! decode engine frees its blocks).
//!
//! ```text
//! head -c 32 /dev/urandom > secret   # once; the same file on both hosts
//! decode:   GPUDIRECT_SECRET_FILE=secret cargo run --release --example kv_transfer -- --decode -d mlx5_0,mlx5_1
//! prefill:  GPUDIRECT_SECRET_FILE=secret cargo run --release --example kv_transfer -- --prefill --connect decodehost -d mlx5_0,mlx5_1
//! ```
//!
//! The agents listen on every address, so they need the cluster's secret
//! (`GPUDIRECT_SECRET_FILE`, or `--secret-file`): without it the decode
//! side's memory port would be open to anyone who reaches it.
//!
//! With several devices each layer's request (1 MiB by default) is
//! sliced across them (`AgentConfig::slice_threshold`); the prefill side
//! prints the bytes each NIC carried.
//!
//! The agents swap metadata blobs ([`AgentMetadata::encode`]) over a TCP
//! exchange on `--port` (the engine's "direct" metadata path); the
//! prefill side's parameters travel with it. With `--gpu N` both sides'
//! memory is GPU memory registered per `--gpu-policy` (`require` by
//! default: zero-copy or an error naming why not). Each side prints the
//! registration path of its memory per NIC and the throughput; any error
//! or wrong byte exits non-zero.

use std::net::TcpListener;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use gpudirect::bootstrap::{with_port, Handshake, OobChannel};
use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, ClusterSecret, Op, Registration};
use gpudirect::topology::PathLevel;
use gpudirect::{Gpu, GpuBuffer, GpuPolicy};

#[derive(Parser, Debug)]
#[command(about = "KV-cache blocks from a prefill agent into a decode agent's block table, verified")]
struct Args {
    /// Be the decode side: register the block table, verify what arrives.
    #[arg(long, conflicts_with = "prefill", required_unless_present = "prefill")]
    decode: bool,
    /// Be the prefill side: write the KV cache into the decode side's table.
    #[arg(long, requires = "connect")]
    prefill: bool,
    /// The decode side's host (HOST or HOST:PORT), for the metadata exchange.
    #[arg(long, value_name = "HOST[:PORT]")]
    connect: Option<String>,
    /// The file holding the cluster's secret (default: the file named by
    /// GPUDIRECT_SECRET_FILE).
    #[arg(long, value_name = "PATH")]
    secret_file: Option<std::path::PathBuf>,
    /// TCP port of the metadata exchange.
    #[arg(long, default_value_t = 18600)]
    port: u16,
    /// RDMA devices, comma-separated, in rail order: both sides list the
    /// NICs of one network at the same place (default: the first device).
    #[arg(long = "device", short = 'd', value_delimiter = ',')]
    devices: Vec<String>,
    /// Fail unless every NIC carried within PCT percent of an even share
    /// of the prefill side's bytes (a check of the slicing).
    #[arg(long, value_name = "PCT")]
    balance: Option<f64>,
    /// Layers per step (one notification each).
    #[arg(long, default_value_t = 8)]
    layers: usize,
    /// Blocks per layer.
    #[arg(long, default_value_t = 16)]
    blocks: usize,
    /// Bytes per block.
    #[arg(long, default_value_t = 64 * 1024)]
    block_size: usize,
    /// Steps (each moves every layer once).
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// Put the memory on CUDA GPU N.
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    /// With --gpu: require GPUDirect RDMA, prefer it, or stage through host memory.
    #[arg(long, default_value = "require", value_name = "require|prefer|host-staged", requires = "gpu")]
    gpu_policy: GpuPolicy,
    /// With --gpu: the farthest PCIe path between the GPU and a NIC that
    /// carries its memory.
    #[arg(long, default_value = "PXB", value_name = "PIX|PXB|PHB|NODE|SYS", requires = "gpu")]
    gpu_path_limit: PathLevel,
    /// Bound, in seconds, on each wait.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
}

type R<T> = Result<T, Box<dyn std::error::Error>>;

/// What the prefill side tells the decode side.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Shape {
    layers: usize,
    blocks: usize,
    block: usize,
    steps: usize,
}

impl Shape {
    fn layer_bytes(&self) -> usize {
        self.blocks * self.block
    }
    fn bytes(&self) -> usize {
        self.layers * self.layer_bytes()
    }
    /// Where block `b` of layer `l` goes in the decode side's table: a
    /// fixed permutation, as a paged KV cache's block table scatters them.
    fn slot(&self, l: usize, b: usize) -> usize {
        let n = self.layers * self.blocks;
        (l * self.blocks + b) * 7919 % n
    }
    /// The bytes of block `b` of layer `l` at `step`.
    fn block_data(&self, step: usize, l: usize, b: usize) -> Vec<u8> {
        let seed = ((step * self.layers + l) * self.blocks + b) as u64;
        testkit::pattern(self.block, seed)
    }
    fn encode(&self) -> Vec<u8> {
        format!("{} {} {} {}", self.layers, self.blocks, self.block, self.steps).into_bytes()
    }
    fn decode(b: &[u8]) -> R<Shape> {
        let v: Vec<usize> = std::str::from_utf8(b)?.split(' ').map(str::parse).collect::<Result<_, _>>()?;
        match v[..] {
            [layers, blocks, block, steps] if layers * blocks > 0 && block > 0 => Ok(Shape { layers, blocks, block, steps }),
            _ => Err(format!("bad shape {:?}", String::from_utf8_lossy(b)).into()),
        }
    }
}

fn memory(agent: &Agent, args: &Args, name: &str, len: usize) -> R<Registration> {
    let reg = match args.gpu {
        None => agent.alloc(name, len)?,
        Some(n) => agent.register_gpu(name, GpuBuffer::alloc(&Gpu::open(n)?, len)?, args.gpu_policy)?,
    };
    for (nic, loc) in reg.paths() {
        println!("{name}: {} bytes, {nic}: {loc}", reg.len());
    }
    for (nic, why) in reg.skipped() {
        println!("{name}: not on {nic}: {why}");
    }
    Ok(reg)
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let args = Args::parse();
    match if args.decode { decode(&args) } else { prefill(&args) } {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn config(args: &Args, name: &str) -> R<AgentConfig> {
    let mut c = AgentConfig::named(name);
    c.devices = args.devices.clone();
    c.gpu_path_limit = args.gpu_path_limit;
    // None: the agent reads GPUDIRECT_SECRET_FILE itself.
    c.secret = args.secret_file.as_ref().map(ClusterSecret::from_file).transpose()?;
    // GPUDIRECT_METRICS=PORT (or IP:PORT) serves this agent's metrics.
    c.metrics = gpudirect_engine::metrics_addr()?;
    Ok(c)
}

fn decode(args: &Args) -> R<()> {
    let timeout = Duration::from_secs(args.timeout);
    let agent = Agent::new(config(args, "decode-0")?)?;
    println!("decode agent at {}; metadata exchange on port {}", agent.control_addr(), args.port);
    let listener = TcpListener::bind(("0.0.0.0", args.port))?;
    let mut oob = OobChannel::accept(&listener, timeout)?;
    // The table's size comes from the prefill side: swap shapes first.
    let shape = Shape::decode(&oob.exchange(&Handshake::default())?.app)?;
    let table = memory(&agent, args, "kv-table", shape.bytes())?;
    let theirs = AgentMetadata::decode(&oob.exchange(&Handshake { app: agent.metadata().encode()?, ..Default::default() })?.app)?;
    println!("peer: {theirs}");
    let started = Instant::now();
    let mut got = vec![0; shape.block];
    for step in 0..shape.steps {
        for _ in 0..shape.layers {
            let n = agent.wait_notification(Some(timeout))?;
            let text = String::from_utf8_lossy(&n.msg).into_owned();
            let l: usize = text.strip_prefix("layer ").ok_or(format!("notification {text:?}"))?.parse()?;
            if l >= shape.layers || n.peer != theirs.name {
                return Err(format!("notification {text:?} from {} during step {step}", n.peer).into());
            }
            for b in 0..shape.blocks {
                table.read_at(shape.slot(l, b) * shape.block, &mut got)?;
                if got != shape.block_data(step, l, b) {
                    return Err(format!("step {step} layer {l} block {b}: wrong bytes when its notification arrived").into());
                }
            }
        }
        oob.barrier()?;
    }
    let secs = started.elapsed().as_secs_f64();
    if let Some(n) = agent.notifications()?.first() {
        return Err(format!("an extra notification {:?} from {}", String::from_utf8_lossy(&n.msg), n.peer).into());
    }
    println!(
        "decode: {} steps x {} layers x {} blocks of {} bytes verified at each notification; {:.1} MB/s with the checks",
        shape.steps,
        shape.layers,
        shape.blocks,
        shape.block,
        (shape.steps * shape.bytes()) as f64 / secs / 1e6
    );
    Ok(())
}

fn prefill(args: &Args) -> R<()> {
    let timeout = Duration::from_secs(args.timeout);
    let shape = Shape { layers: args.layers, blocks: args.blocks, block: args.block_size, steps: args.steps };
    let agent = Agent::new(config(args, "prefill-0")?)?;
    let kv = memory(&agent, args, "kv", shape.bytes())?;
    let addr = with_port(args.connect.as_deref().unwrap_or_default(), args.port);
    let mut oob = OobChannel::connect(addr.as_str(), timeout)?;
    oob.exchange(&Handshake { app: shape.encode(), ..Default::default() })?;
    let md = AgentMetadata::decode(&oob.exchange(&Handshake { app: agent.metadata().encode()?, ..Default::default() })?.app)?;
    println!("peer: {md}");
    let peer = agent.load_remote(&md)?;
    let table = peer.memory("kv-table")?;
    let b = shape.block;
    // One request per layer, prepared once and posted every step.
    let reqs = (0..shape.layers)
        .map(|l| {
            let entries = (0..shape.blocks)
                .map(|blk| {
                    let src = (l * shape.blocks + blk) * b;
                    let dst = (shape.slot(l, blk) * b) as u64;
                    Ok((kv.range(src..src + b)?, table.range(dst..dst + b as u64)?))
                })
                .collect::<R<Vec<_>>>()?;
            Ok(agent.prepare(Op::Write, &entries, Some(format!("layer {l}").as_bytes()))?)
        })
        .collect::<R<Vec<_>>>()?;
    let mut bytes_moved = 0u64;
    let mut on_the_wire = Duration::ZERO;
    for step in 0..shape.steps {
        for l in 0..shape.layers {
            for blk in 0..shape.blocks {
                kv.write_at((l * shape.blocks + blk) * b, &shape.block_data(step, l, blk))?;
            }
        }
        let started = Instant::now();
        for r in &reqs {
            r.post()?;
        }
        for r in &reqs {
            r.wait(Some(timeout))?;
            bytes_moved += r.bytes();
        }
        on_the_wire += started.elapsed();
        // The decode side has checked this step and frees its table.
        oob.barrier()?;
    }
    let secs = on_the_wire.as_secs_f64();
    let stats = agent.nic_stats();
    let even = bytes_moved as f64 / stats.len() as f64;
    for s in &stats {
        let off = (s.bytes as f64 - even) / even * 100.0;
        println!("prefill: {} carried {} bytes in {} posts ({off:+.1}% of an even share)", s.device, s.bytes, s.posts);
        if let Some(pct) = args.balance.filter(|&p| off.abs() > p) {
            return Err(format!("{} carried {off:+.1}% of an even share, more than --balance {pct}", s.device).into());
        }
    }
    println!(
        "prefill: {} steps x {} layers x {} blocks of {} bytes to {}: {:.1} MB/s (post to last completion)",
        shape.steps,
        shape.layers,
        shape.blocks,
        b,
        md.name,
        bytes_moved as f64 / secs / 1e6
    );
    Ok(())
}
