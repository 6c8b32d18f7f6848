//! RDMA ping-pong between two processes or nodes, verifying every byte.
//!
//! ```text
//! node A:  cargo run --release --example pingpong -- --server --device mlx5_0
//! node B:  cargo run --release --example pingpong -- --connect nodeA:18515 --device mlx5_0 --op write-imm --size 8,4096,65536
//! ```
//!
//! With `--gpu N` both sides' buffers are GPU memory, registered for
//! GPUDirect RDMA (dma-buf, else peer memory) or, per `--gpu-policy`,
//! staged through host memory; each side prints the path it got
//! (`memory: GPU0 memory, path: dma-buf`) and the peer's.
//!
//! With `--cm` the queue pairs are connected by rdma_cm (the server listens
//! on the bootstrap port + 1, the client connects to the server's address
//! there) and the buffers cross in its private data; the TCP bootstrap
//! still carries the parameters and barriers, in the same process.
//!
//! The client's operation, sizes and iteration count are sent to the
//! server in the bootstrap handshake; a server given its own values refuses
//! a client whose values differ. Each side prints per-size round-trip
//! latency (min, median, p99) and bandwidth, and exits non-zero on any
//! error, including a byte that arrived wrong.

use std::net::TcpListener;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use gpudirect::bootstrap::{with_port, Handshake, OobChannel, DEFAULT_PORT};
use gpudirect::cm::{CmConnection, CmListener};
use gpudirect::{
    AccessFlags, AddressHandle, CompletionQueue, Context, Gpu, GpuBuffer, GpuPolicy, MemoryRegion, ProtectionDomain,
    QpConfig, QueuePair, RecvWr, RemoteBuffer, SendWr, UdConfig, UdQueuePair, UdSendWr, WcOpcode, WorkCompletion,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Op {
    /// RDMA write; the receiver polls the last byte of the buffer.
    Write,
    /// RDMA write with immediate; the receiver waits for its completion.
    WriteImm,
    /// Send/receive.
    Send,
    /// Atomic fetch-and-add: both hosts add 1 to one counter on the server,
    /// `--iters` times each, at once; checked exact (sizes do not apply).
    AtomicFadd,
    /// Datagrams over unreliable-datagram queue pairs (an address handle
    /// to the peer, the GRH stripped); sizes up to the path MTU.
    UdSend,
}

#[derive(Parser, Debug)]
#[command(about = "RDMA ping-pong with data verification")]
struct Args {
    /// Wait for a client.
    #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
    server: bool,
    /// Connect to a server at HOST or HOST:PORT.
    #[arg(long, value_name = "HOST[:PORT]")]
    connect: Option<String>,
    /// TCP port of the bootstrap exchange when --connect or --listen names none.
    #[arg(long, short = 'p', default_value_t = DEFAULT_PORT)]
    port: u16,
    /// Server: address to listen on (ADDR or ADDR:PORT).
    #[arg(long, default_value = "0.0.0.0", value_name = "ADDR[:PORT]")]
    listen: String,
    /// RDMA device (default: the first one).
    #[arg(long, short = 'd')]
    device: Option<String>,
    /// Port of the device.
    #[arg(long, short = 'i', default_value_t = 1)]
    ib_port: u8,
    /// GID index (default: the RoCE v2 IPv4-mapped entry; the choice is printed).
    #[arg(long, short = 'x')]
    gid_index: Option<u32>,
    /// Message sizes in bytes, comma-separated [default: 2,64,4096,65536].
    #[arg(long, short = 's', value_delimiter = ',')]
    size: Vec<usize>,
    /// Round trips per size [default: 1000].
    #[arg(long, short = 'n')]
    iters: Option<u32>,
    /// Operation [default: write].
    #[arg(long, value_enum)]
    op: Option<Op>,
    /// Connect the queue pairs with rdma_cm (on the bootstrap port + 1)
    /// instead of the endpoints in the bootstrap exchange.
    #[arg(long)]
    cm: bool,
    /// Seconds to wait for the peer (bootstrap and each message).
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// Local ACK timeout of the queue pair, as perftest's `-u`: each try
    /// waits 4.096 us x 2^N, and the peer counts as gone after 7 tries.
    /// Raise it on paths whose round trip nears the default's 67 ms (14),
    /// such as emulated guests. Not used with --cm (rdma_cm sets its own).
    #[arg(long, short = 'u', default_value_t = 14, value_parser = clap::value_parser!(u8).range(0..=31))]
    qp_timeout: u8,
    /// Use memory of this CUDA GPU instead of host memory.
    #[arg(long, value_name = "N")]
    gpu: Option<usize>,
    /// With --gpu: require GPUDirect RDMA, prefer it (falling back to host
    /// staging), or stage through host memory.
    #[arg(long, default_value = "require", value_name = "require|prefer|host-staged", requires = "gpu")]
    gpu_policy: GpuPolicy,
}

/// The parameters both sides must agree on.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Params {
    op: Op,
    sizes: Vec<usize>,
    iters: u32,
}

impl Params {
    fn encode(&self) -> Vec<u8> {
        let sizes: Vec<_> = self.sizes.iter().map(|s| s.to_string()).collect();
        let op = self.op.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default();
        format!("op={op};iters={};sizes={}", self.iters, sizes.join(",")).into_bytes()
    }

    fn decode(b: &[u8]) -> Result<Params, String> {
        let s = std::str::from_utf8(b).map_err(|_| "peer parameters are not UTF-8".to_string())?;
        let (mut op, mut iters, mut sizes) = (None, None, None);
        for kv in s.split(';') {
            let (k, v) = kv.split_once('=').ok_or_else(|| format!("malformed peer parameter {kv:?}"))?;
            match k {
                "op" => op = Some(Op::from_str(v, false).map_err(|_| format!("unknown peer op {v:?}"))?),
                "iters" => iters = Some(v.parse().map_err(|_| format!("bad peer iters {v:?}"))?),
                "sizes" => {
                    sizes = Some(
                        v.split(',').map(|x| x.parse::<usize>()).collect::<Result<Vec<_>, _>>().map_err(|_| format!("bad peer sizes {v:?}"))?,
                    )
                }
                _ => return Err(format!("unknown peer parameter {k:?}")),
            }
        }
        let p = Params {
            op: op.ok_or("peer sent no op")?,
            iters: iters.ok_or("peer sent no iters")?,
            sizes: sizes.ok_or("peer sent no sizes")?,
        };
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), String> {
        if self.sizes.is_empty() || self.sizes.iter().any(|&s| s == 0 || s > (1 << 30)) {
            return Err(format!("sizes must be 1 byte to 1 GiB, got {:?}", self.sizes));
        }
        if self.op == Op::AtomicFadd && self.iters > 8000 {
            // The client's returned words travel back in one bootstrap message.
            return Err(format!("atomic-fadd takes at most 8000 iterations, got {}", self.iters));
        }
        if self.iters == 0 {
            return Err("iters must be at least 1".into());
        }
        Ok(())
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// The bytes side `side` sends in iteration `iter`: different for every
/// iteration and side, with a last byte that is never 0 and never the
/// previous iteration's (the write receiver polls it).
fn payload(buf: &mut [u8], size: usize, iter: u32, side: u8) {
    let seed = (iter as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (size as u64) ^ (u64::from(side) << 56);
    let mut x = seed | 1;
    for b in buf[..size].iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    buf[size - 1] = marker(iter);
}

fn marker(iter: u32) -> u8 {
    (iter % 255) as u8 + 1
}

/// The connected queue pair; with `--cm`, inside the rdma_cm connection
/// that owns it.
enum Link {
    Bootstrap(QueuePair),
    Cm(CmConnection),
}

impl Link {
    fn qp(&self) -> &QueuePair {
        match self {
            Link::Bootstrap(qp) => qp,
            Link::Cm(conn) => conn.qp(),
        }
    }
}

struct Conn {
    link: Link,
    cq: CompletionQueue,
    mr: MemoryRegion,
    peer: RemoteBuffer,
    max: usize,
    timeout: Duration,
    /// Send completions still to reap before the send area is reused.
    unreaped_sends: u32,
    scratch: Vec<u8>,
    expect: Vec<u8>,
}

impl Conn {
    /// Receive area: [0, max); send area: [max, 2 max).
    fn post_recv(&self, op: Op, size: usize) -> Res<()> {
        let range = if op == Op::Send { 0..size } else { 0..0 };
        self.link.qp().post_recv(&[RecvWr::new(self.mr.slice(range)?).wr_id(1)])?;
        Ok(())
    }

    fn reap(&mut self, wcs: &mut [WorkCompletion]) -> Res<Option<WorkCompletion>> {
        let n = self.cq.poll(wcs)?;
        let mut recv = None;
        for wc in &wcs[..n] {
            let wc = wc.ok()?;
            match wc.opcode {
                WcOpcode::Recv | WcOpcode::RecvRdmaWithImm => recv = Some(wc),
                _ => self.unreaped_sends -= 1,
            }
        }
        Ok(recv)
    }

    fn send(&mut self, op: Op, size: usize, iter: u32, side: u8) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        let mut wcs = [WorkCompletion::default(); 4];
        while self.unreaped_sends > 0 {
            if self.reap(&mut wcs)?.is_some() {
                return Err("unexpected receive completion while waiting for a send to complete".into());
            }
            if Instant::now() > deadline {
                return Err(format!("send completion did not arrive within {:?}", self.timeout).into());
            }
        }
        payload(&mut self.scratch, size, iter, side);
        self.mr.write_at(self.max, &self.scratch[..size])?;
        let local = self.mr.slice(self.max..self.max + size)?;
        let wr = match op {
            Op::Write => SendWr::write(local, &self.peer, 0)?,
            Op::WriteImm => SendWr::write_with_imm(local, &self.peer, 0, iter)?,
            Op::Send => SendWr::send(local),
            Op::AtomicFadd | Op::UdSend => return Err(format!("{op:?} does not run on the RC connection").into()),
        };
        self.link.qp().post_send(&[wr])?;
        self.unreaped_sends += 1;
        Ok(())
    }

    /// Waits for the peer's message of iteration `iter` and checks every
    /// byte; re-arms the receive when another message of this size follows.
    fn receive(&mut self, op: Op, size: usize, iter: u32, peer_side: u8, rearm: bool) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        let mut wcs = [WorkCompletion::default(); 4];
        loop {
            let recv = self.reap(&mut wcs)?;
            let arrived = match op {
                Op::AtomicFadd | Op::UdSend => return Err(format!("{op:?} does not run on the RC connection").into()),
                Op::Write => self.mr.read_volatile(size - 1)? == marker(iter),
                Op::WriteImm | Op::Send => match recv {
                    None => false,
                    Some(wc) => {
                        if op == Op::WriteImm && wc.imm != Some(iter) {
                            return Err(format!("iteration {iter}: immediate data {:?}, expected {iter}", wc.imm).into());
                        }
                        if op == Op::Send && wc.byte_len as usize != size {
                            return Err(format!("iteration {iter}: received {} bytes, expected {size}", wc.byte_len).into());
                        }
                        true
                    }
                },
            };
            if arrived {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("iteration {iter} of {size} bytes: nothing arrived from the peer within {:?}", self.timeout).into());
            }
        }
        if op == Op::WriteImm {
            // A host-staged GPU region learns of a peer's write only here.
            self.mr.stage_in(0..size)?;
        }
        // GPU kernels would consume the data now; make the NIC's writes
        // visible to them (free on GPUs that order RDMA writes, a no-op
        // for host memory).
        self.mr.flush_gpu_writes()?;
        payload(&mut self.expect, size, iter, peer_side);
        self.mr.read_at(0, &mut self.scratch[..size])?;
        if self.scratch[..size] != self.expect[..size] {
            let at = self.scratch.iter().zip(&self.expect).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "data corruption: iteration {iter}, {size} bytes, first difference at byte {at}: got {:#04x}, expected {:#04x}",
                self.scratch[at], self.expect[at]
            )
            .into());
        }
        // Re-arm before answering, so the peer's next message finds a receive.
        if op != Op::Write && rearm {
            self.post_recv(op, size)?;
        }
        Ok(())
    }

    fn drain_sends(&mut self) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        let mut wcs = [WorkCompletion::default(); 4];
        while self.unreaped_sends > 0 {
            self.reap(&mut wcs)?;
            if Instant::now() > deadline {
                return Err("send completions did not arrive".into());
            }
        }
        Ok(())
    }
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn run(args: Args) -> Res<()> {
    let timeout = Duration::from_secs(args.timeout);
    let given = Params {
        op: args.op.unwrap_or(Op::Write),
        sizes: if args.size.is_empty() { vec![2, 64, 4096, 65536] } else { args.size.clone() },
        iters: args.iters.unwrap_or(1000),
    };
    given.validate()?;
    let is_server = args.server;

    let ctx = Context::open(args.device.as_deref())?;
    let pd = ProtectionDomain::new(&ctx)?;
    let cq = CompletionQueue::new(&ctx, 64)?;

    let mut oob = if is_server {
        let listen = with_port(&args.listen, args.port);
        let listener = TcpListener::bind(&listen).map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        println!("waiting for a client on {listen}");
        OobChannel::accept(&listener, timeout)?
    } else {
        OobChannel::connect(with_port(args.connect.as_deref().unwrap_or_default(), args.port), timeout)?
    };

    // The server sizes its buffer from the client's parameters, so the
    // parameters travel first, then the endpoint and buffer.
    let params = if is_server {
        let peer = Params::decode(&oob.exchange(&Handshake::default())?.app)?;
        // Values the server was given explicitly must match the client's.
        if args.op.is_some_and(|o| o != peer.op)
            || (!args.size.is_empty() && args.size != peer.sizes)
            || args.iters.is_some_and(|n| n != peer.iters)
        {
            return Err(format!("the client's parameters {peer:?} differ from this server's {given:?}").into());
        }
        peer
    } else {
        oob.exchange(&Handshake { app: given.encode(), ..Default::default() })?;
        given
    };
    if params.op == Op::UdSend {
        if args.gpu.is_some() {
            return Err("--op ud-send runs in host memory".into());
        }
        return ud_pingpong(&pd, &mut oob, &args, is_server, &params, timeout);
    }
    // Remote atomics only when asked for: the queue pair's access and the
    // server's region grant them for --op atomic-fadd alone.
    let atomic = params.op == Op::AtomicFadd;
    let atomic_access = if atomic { AccessFlags::REMOTE_ATOMIC } else { AccessFlags::empty() };
    let qp_access = QpConfig::default().access | atomic_access;
    let config = QpConfig {
        port: args.ib_port,
        gid_index: args.gid_index,
        max_send_wr: 16,
        max_recv_wr: 16,
        access: qp_access,
        timeout: args.qp_timeout,
        ..QpConfig::default()
    };
    let qp = QueuePair::create(&pd, &cq, &cq, &config)?;
    println!("device {} port {}: {}", ctx.name(), args.ib_port, qp.gid());
    if args.gpu.is_some() && atomic {
        return Err("--op atomic-fadd counts in host memory: the CPU checks the counter".into());
    }
    if args.gpu.is_some() && params.op == Op::Write {
        return Err("the CPU cannot poll GPU memory for a plain write's arrival: use --op write-imm or --op send with --gpu".into());
    }
    let max = (*params.sizes.iter().max().unwrap_or(&1)).max(if atomic { 8 } else { 1 });
    let region_access = AccessFlags::REMOTE_WRITE | atomic_access;
    let mr = match args.gpu {
        None => MemoryRegion::alloc(&pd, 2 * max, region_access)?,
        Some(n) => {
            let gpu = Gpu::open(n)?;
            MemoryRegion::register_gpu(&pd, GpuBuffer::alloc(&gpu, 2 * max)?, AccessFlags::REMOTE_WRITE, args.gpu_policy)?
        }
    };
    let location = mr.location().to_string();
    println!("memory: {location}");
    let (link, peer_buf) = if args.cm {
        cm_connect(&args, &mut oob, is_server, qp, &mr, timeout)?
    } else {
        let local_ep = qp.endpoint();
        let peer = oob.exchange(&Handshake { endpoint: Some(local_ep), buffers: vec![mr.remote()], app: location.into_bytes() })?;
        println!("peer memory: {}", String::from_utf8_lossy(&peer.app));
        let peer_ep = peer.endpoint.ok_or("the peer sent no endpoint")?;
        println!("local  {local_ep}\nremote {peer_ep}");
        (Link::Bootstrap(qp.connect(&peer_ep)?), *peer.buffers.first().ok_or("the peer sent no buffer")?)
    };
    if peer_buf.len < max as u64 {
        return Err(format!("the peer's buffer ({peer_buf}) is smaller than the largest message ({max} bytes)").into());
    }
    println!("op {:?}, {} iterations per size", params.op, params.iters);
    let mut conn = Conn {
        link,
        cq,
        mr,
        peer: peer_buf,
        max,
        timeout,
        unreaped_sends: 0,
        scratch: vec![0; max],
        expect: vec![0; max],
    };

    if atomic {
        return atomic_counter(&conn, &mut oob, &pd, &config, is_server, params.iters);
    }
    let (me, them) = if is_server { (1u8, 0u8) } else { (0u8, 1u8) };
    if is_server {
        println!("{:>10} {:>8} {:>10}", "#bytes", "#iters", "verified");
    } else {
        println!("{:>10} {:>8} {:>12} {:>12} {:>12} {:>12}", "#bytes", "#iters", "min[us]", "median[us]", "p99[us]", "MB/s");
    }
    for &size in &params.sizes {
        conn.mr.fill(0..max, 0)?;
        if params.op != Op::Write {
            conn.post_recv(params.op, size)?;
        }
        // Both sides are armed and zeroed before anything is sent.
        oob.barrier()?;
        let mut rtts = Vec::with_capacity(params.iters as usize);
        let start = Instant::now();
        for iter in 0..params.iters {
            let rearm = iter + 1 < params.iters;
            if is_server {
                conn.receive(params.op, size, iter, them, rearm)?;
                conn.send(params.op, size, iter, me)?;
            } else {
                let t0 = Instant::now();
                conn.send(params.op, size, iter, me)?;
                conn.receive(params.op, size, iter, them, rearm)?;
                rtts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let total = start.elapsed().as_secs_f64();
        conn.drain_sends()?;
        if is_server {
            println!("{size:>10} {:>8} {:>10}", params.iters, "ok");
        } else {
            rtts.sort_by(|a, b| a.total_cmp(b));
            let mbps = 2.0 * size as f64 * f64::from(params.iters) / total / 1e6;
            println!(
                "{size:>10} {:>8} {:>12.2} {:>12.2} {:>12.2} {:>12.4}",
                params.iters,
                rtts[0],
                percentile(&rtts, 0.5),
                percentile(&rtts, 0.99),
                mbps
            );
        }
        // Nothing of this size is in flight any more on either side.
        oob.barrier()?;
    }
    oob.barrier()?;
    println!("all data verified");
    Ok(())
}

/// `--cm`: the server listens with rdma_cm before the bootstrap exchange
/// that tells the client it may connect; the buffers travel as private data.
fn cm_connect(
    args: &Args,
    oob: &mut OobChannel,
    is_server: bool,
    qp: gpudirect::PreparedQueuePair,
    mr: &MemoryRegion,
    timeout: Duration,
) -> Res<(Link, RemoteBuffer)> {
    let location = mr.location().to_string().into_bytes();
    let conn = if is_server {
        let listen: std::net::SocketAddr = with_port(&args.listen, args.port).parse()?;
        let listener = CmListener::bind(std::net::SocketAddr::new(listen.ip(), args.port + 1))?;
        println!("rdma_cm listening on {}", listener.local_addr());
        let peer = oob.exchange(&Handshake { app: location, ..Default::default() })?;
        println!("peer memory: {}", String::from_utf8_lossy(&peer.app));
        let mut req = listener.get_request(Some(timeout))?;
        println!("rdma_cm request from {} on {} port {}", req.peer_addr(), req.device(), req.port());
        req.accept(qp, &mr.remote().to_bytes(), timeout)?
    } else {
        let peer = oob.exchange(&Handshake { app: location, ..Default::default() })?;
        println!("peer memory: {}", String::from_utf8_lossy(&peer.app));
        let server = oob.peer_addr()?;
        CmConnection::connect(qp, std::net::SocketAddr::new(server.ip(), args.port + 1), &mr.remote().to_bytes(), timeout)?
    };
    println!("rdma_cm connected to {}\nlocal  {}\nremote {}", conn.peer_addr(), conn.qp().endpoint(), conn.qp().remote());
    let peer_buf = RemoteBuffer::from_bytes(conn.peer_private_data())?;
    Ok((Link::Cm(conn), peer_buf))
}

/// `--op ud-send`: each side has one unreliable-datagram queue pair and an
/// address handle to the other's; a round trip is a datagram each way,
/// every byte checked. The receive for the next datagram is posted before
/// replying: UD drops a datagram that finds no receive.
fn ud_pingpong(pd: &ProtectionDomain, oob: &mut OobChannel, args: &Args, is_server: bool, params: &Params, timeout: Duration) -> Res<()> {
    let cq = CompletionQueue::new(pd.context(), 64)?;
    let config = UdConfig { port: args.ib_port, gid_index: args.gid_index, max_send_wr: 16, max_recv_wr: 16, ..UdConfig::default() };
    let qp = UdQueuePair::create(pd, &cq, &cq, &config)?;
    println!("device {} port {}: {}", pd.context().name(), args.ib_port, qp.gid());
    let local = qp.endpoint();
    let peer = oob.exchange(&Handshake { endpoint: Some(local), ..Default::default() })?;
    let peer_ep = peer.endpoint.ok_or("the peer sent no endpoint")?;
    let to = AddressHandle::new(&qp, &peer_ep, config.qkey)?;
    let max = *params.sizes.iter().max().unwrap_or(&1);
    if max > to.max_message() {
        return Err(format!("--op ud-send: a datagram carries at most the path MTU, {} bytes; got size {max}", to.max_message()).into());
    }
    println!("local  {local}\nremote {peer_ep}\nop UdSend, {} iterations per size, path MTU {} bytes", params.iters, to.max_message());
    let mr = MemoryRegion::alloc(pd, 2 * max, AccessFlags::default())?;
    let (me, them) = if is_server { (1u8, 0u8) } else { (0u8, 1u8) };
    let (mut out, mut expect, mut got) = (vec![0; max], vec![0; max], vec![0; max]);
    let mut wcs = [WorkCompletion::default(); 4];
    let mut sends_left = 0u32;
    for &size in &params.sizes {
        qp.post_recv(&[RecvWr::new(mr.slice(max..max + size)?)])?;
        oob.barrier()?;
        let mut rtts = Vec::with_capacity(params.iters as usize);
        let start = Instant::now();
        for iter in 0..params.iters {
            let mut send = || -> Res<()> {
                payload(&mut out, size, iter, me);
                mr.write_at(0, &out[..size])?;
                qp.post_send(&[UdSendWr::send(&to, mr.slice(0..size)?)])?;
                Ok(())
            };
            let t0 = Instant::now();
            if !is_server {
                send()?;
                sends_left += 1;
            }
            // Wait for the datagram (send completions come on the same CQ).
            let wc = loop {
                let n = cq.wait(&mut wcs, Some(timeout)).map_err(|e| format!("no datagram {iter} of {size} bytes ({e}): UD does not retransmit"))?;
                let mut recv = None;
                for wc in &wcs[..n] {
                    let wc = wc.ok()?;
                    match wc.opcode {
                        WcOpcode::Recv => recv = Some(wc),
                        _ => sends_left -= 1,
                    }
                }
                if let Some(r) = recv {
                    break r;
                }
            };
            if wc.byte_len as usize != size || wc.src_qp != peer_ep.qp_num {
                return Err(format!("datagram {iter}: {} bytes from QP {:#x}, expected {size} from {:#x}", wc.byte_len, wc.src_qp, peer_ep.qp_num).into());
            }
            mr.read_at(max, &mut got[..size])?;
            payload(&mut expect, size, iter, them);
            if got[..size] != expect[..size] {
                return Err(format!("datagram {iter} of {size} bytes arrived wrong").into());
            }
            if iter + 1 < params.iters {
                qp.post_recv(&[RecvWr::new(mr.slice(max..max + size)?)])?;
            }
            if is_server {
                send()?;
                sends_left += 1;
            } else {
                rtts.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
        let total = start.elapsed().as_secs_f64();
        while sends_left > 0 {
            let n = cq.wait(&mut wcs, Some(timeout))?;
            for wc in &wcs[..n] {
                wc.ok()?;
                sends_left -= 1;
            }
        }
        if is_server {
            println!("{size:>10} {:>8} {:>10}", params.iters, "ok");
        } else {
            rtts.sort_by(|a, b| a.total_cmp(b));
            let mbps = 2.0 * size as f64 * f64::from(params.iters) / total / 1e6;
            println!("{size:>10} {:>8} {:>12.2} {:>12.2} {:>12.2} {:>12.4}", params.iters, rtts[0], percentile(&rtts, 0.5), percentile(&rtts, 0.99), mbps);
        }
        oob.barrier()?;
    }
    oob.barrier()?;
    println!("all data verified");
    Ok(())
}

/// `--op atomic-fadd`: one counter, the word at offset 0 of the server's
/// buffer, incremented by both hosts at once, `iters` times each: the
/// client over the connection, the server through a queue pair its NIC
/// connects to itself. Exact means the counter ends at 2 x iters and the
/// words the adds returned, from both hosts, are 0 .. 2 x iters - 1, each
/// once (every add saw every earlier one).
fn atomic_counter(conn: &Conn, oob: &mut OobChannel, pd: &ProtectionDomain, config: &QpConfig, is_server: bool, iters: u32) -> Res<()> {
    let ctx = pd.context();
    let results = MemoryRegion::alloc(pd, 8, AccessFlags::default())?;
    // The server's adds take a loopback pair of its own.
    let (own_cq, loopback) = if is_server {
        let cq = CompletionQueue::new(ctx, 64)?;
        let (a, b) = (QueuePair::create(pd, &cq, &cq, config)?, QueuePair::create(pd, &cq, &cq, config)?);
        let (ea, eb) = (a.endpoint(), b.endpoint());
        (Some(cq), Some((a.connect(&eb)?, b.connect(&ea)?)))
    } else {
        (None, None)
    };
    let (qp, cq, target) = match (&loopback, &own_cq) {
        (Some((a, _)), Some(cq)) => (a, cq, conn.mr.remote()),
        _ => (conn.link.qp(), &conn.cq, conn.peer),
    };
    if is_server {
        conn.mr.fill(0..8, 0)?;
    }
    oob.barrier()?;
    let start = Instant::now();
    let mut seen = Vec::with_capacity(iters as usize);
    let mut wc = [WorkCompletion::default(); 1];
    let mut word = [0u8; 8];
    for i in 0..iters {
        qp.post_send(&[SendWr::fetch_add(results.slice(..)?, &target, 0, 1)?.wr_id(u64::from(i))])?;
        if cq.wait(&mut wc, Some(conn.timeout))? == 0 {
            return Err(format!("fetch-and-add {i} did not complete within {:?}", conn.timeout).into());
        }
        wc[0].ok()?;
        results.read_at(0, &mut word)?;
        seen.push(u64::from_ne_bytes(word));
    }
    let secs = start.elapsed().as_secs_f64();
    if seen.windows(2).any(|w| w[0] >= w[1]) {
        return Err("one host's fetch-and-adds returned words out of order".into());
    }
    oob.barrier()?;
    let total = 2 * u64::from(iters);
    let verdict = if is_server {
        let peer = oob.exchange(&Handshake::default())?;
        seen.extend(peer.app.chunks_exact(8).map(|c| u64::from_ne_bytes(c.try_into().expect("8 bytes"))));
        seen.sort_unstable();
        conn.mr.read_at(0, &mut word)?;
        let counter = u64::from_ne_bytes(word);
        let verdict = if counter != total {
            format!("counter {counter}, expected {total}")
        } else if !seen.iter().copied().eq(0..total) {
            format!("the returned words are not 0..{total} each once ({} words)", seen.len())
        } else {
            "ok".to_string()
        };
        oob.exchange(&Handshake { app: verdict.clone().into_bytes(), ..Default::default() })?;
        verdict
    } else {
        oob.exchange(&Handshake { app: seen.iter().flat_map(|v| v.to_ne_bytes()).collect(), ..Default::default() })?;
        String::from_utf8_lossy(&oob.exchange(&Handshake::default())?.app).into_owned()
    };
    if verdict != "ok" {
        return Err(format!("the counter is not exact: {verdict}").into());
    }
    println!(
        "atomic fetch-and-add: {iters} from this host in {:.1} us each; counter exact: {total} = 2 x {iters}, every word 0..{} returned once",
        secs * 1e6 / f64::from(iters),
        total - 1
    );
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let role = if args.server { "server" } else { "client" };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pingpong {role}: error: {e}");
            ExitCode::FAILURE
        }
    }
}
