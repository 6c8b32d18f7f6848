//! Bandwidth and latency of RDMA write, RDMA read and send, per message
//! size, over a loopback reliable-connected connection: two queue pairs of
//! one process, on one device, connected to each other. Host memory.
//!
//! ```text
//! GPUDIRECT_BENCH_DEVICE=mlx5_0 cargo bench --bench rdma
//! GPUDIRECT_BENCH_SIZES=2,4096,1M cargo bench --bench rdma -- write_bw
//! ```
//!
//! Groups, named after perftest's tools (one benchmark per size in bytes,
//! e.g. `write_bw/65536`):
//!
//! - `write_bw`, `read_bw`, `send_bw`: one iteration posts a window of
//!   requests of one size with one doorbell (up to [`TX_DEPTH`], fewer for
//!   large messages so an iteration moves at most [`WINDOW_BYTES`]; at least
//!   2), every [`SIGNAL_EVERY`]th and the last signaled, all from and to the
//!   same registered buffers, and waits for the last completion. The
//!   throughput is the bytes the window moved. For sends the receiver's
//!   window of receives is posted before the clock starts, and reaping their
//!   completions is timed.
//! - `write_lat`, `read_lat`, `send_lat`: one signaled request, timed from
//!   posting it to reaping its completion (for sends, the receive's too; the
//!   receive is reposted, untimed, before each send). That is a full round
//!   trip (the request and its acknowledgement or response), where perftest's
//!   `ib_*_lat` report half a ping-pong round trip.
//!
//! Setup (device, connection, registration) is outside the timing. Before
//! measuring, one transfer per operation is checked byte for byte.
//!
//! Without a device (`GPUDIRECT_BENCH_DEVICE` / `GPUDIRECT_TEST_DEVICE`
//! unset or not openable) the binary says so on one line and exits 0
//! without running anything. See `common/mod.rs` for the other settings.

mod common;

use std::time::{Duration, Instant};

use common::{reap, OrDie, Poll};
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use gpudirect::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, PortState, ProtectionDomain, QpConfig, QueuePair, RecvWr,
    RemoteBuffer, SendWr,
};

/// Most requests in flight in a bandwidth window.
const TX_DEPTH: usize = 64;
/// One request in this many is signaled (and the last).
const SIGNAL_EVERY: usize = 16;
/// Bytes one bandwidth iteration moves at most (so that 8 MiB messages at
/// emulated speeds still take well under a second per iteration).
const WINDOW_BYTES: usize = 16 << 20;

fn window(size: usize) -> usize {
    (WINDOW_BYTES / size).clamp(2, TX_DEPTH)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Write,
    Read,
    Send,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Read => "read",
            Op::Send => "send",
        }
    }
}

struct Side {
    cq: CompletionQueue,
    qp: QueuePair,
}

/// A connects to B. A posts every request; B's buffer is the remote
/// buffer of writes and reads and the destination of sends.
struct Loopback {
    a: Side,
    b: Side,
    a_buf: MemoryRegion,
    b_buf: MemoryRegion,
    b_remote: RemoteBuffer,
    poll: Poll,
}

impl Loopback {
    fn new(ctx: &Context, max_size: usize, poll: Poll) -> Loopback {
        let port = ctx.query_port(1).or_die("querying port 1");
        if port.state != PortState::Active {
            panic!("{} port 1 is {:?}, not active: nothing can be measured", ctx.name(), port.state);
        }
        let pd = ProtectionDomain::new(ctx).or_die("creating a protection domain");
        let config = QpConfig { max_send_wr: 2 * TX_DEPTH as u32, max_recv_wr: 2 * TX_DEPTH as u32, ..QpConfig::default() };
        let side = || {
            let cq = CompletionQueue::new(ctx, 4 * TX_DEPTH as u32).or_die("creating a completion queue");
            let qp = QueuePair::create(&pd, &cq, &cq, &config).or_die("creating a queue pair");
            (cq, qp)
        };
        let (cq_a, qa) = side();
        let (cq_b, qb) = side();
        let (ea, eb) = (qa.endpoint(), qb.endpoint());
        let a = Side { cq: cq_a, qp: qa.connect(&eb).or_die("connecting queue pair A to B") };
        let b = Side { cq: cq_b, qp: qb.connect(&ea).or_die("connecting queue pair B to A") };
        let access = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let a_buf = MemoryRegion::alloc(&pd, max_size, access).or_die("registering A's buffer");
        let b_buf = MemoryRegion::alloc(&pd, max_size, access).or_die("registering B's buffer");
        let b_remote = b_buf.remote();
        Loopback { a, b, a_buf, b_buf, b_remote, poll }
    }

    /// A's request of `size` bytes (signaled).
    fn wr(&self, op: Op, size: usize) -> SendWr<'_> {
        let local = self.a_buf.slice(0..size).or_die("slicing A's buffer");
        match op {
            Op::Write => SendWr::write(local, &self.b_remote, 0).or_die("building a write"),
            Op::Read => SendWr::read(local, &self.b_remote, 0).or_die("building a read"),
            Op::Send => SendWr::send(local),
        }
    }

    fn recv(&self, size: usize) -> RecvWr<'_> {
        RecvWr::new(self.b_buf.slice(0..size).or_die("slicing B's buffer"))
    }

    /// One transfer per operation, its bytes compared: the numbers below
    /// are of transfers that really move data.
    fn check(&self, size: usize) {
        let pattern = |seed: u8| (0..size).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<u8>>();
        let mut got = vec![0; size];
        for op in [Op::Write, Op::Read, Op::Send] {
            let what = format!("checking one {} of {}", op.name(), common::human(size));
            let want = pattern(op as u8 + 1);
            // Reads carry B's bytes to A; writes and sends A's to B.
            let (src, dst) = if op == Op::Read { (&self.b_buf, &self.a_buf) } else { (&self.a_buf, &self.b_buf) };
            dst.fill(.., 0).or_die(&what);
            src.write_at(0, &want).or_die(&what);
            if op == Op::Send {
                self.b.qp.post_recv(&[self.recv(size)]).or_die(&what);
            }
            self.a.qp.post_send(&[self.wr(op, size)]).or_die(&what);
            if op == Op::Send {
                reap(&self.b.cq, 1, self.poll, &what);
            }
            reap(&self.a.cq, 1, self.poll, &what);
            dst.read_at(0, &mut got).or_die(&what);
            assert!(got == want, "{what}: the bytes that arrived differ from those sent");
        }
    }

    /// `iters` windows of `window(size)` requests; the time they took.
    fn bandwidth(&self, op: Op, size: usize, iters: u64) -> Duration {
        let what = format!("{}_bw {}", op.name(), common::human(size));
        let n = window(size);
        let wrs: Vec<SendWr<'_>> = (0..n)
            .map(|i| {
                let wr = self.wr(op, size).wr_id(i as u64);
                if (i + 1) % SIGNAL_EVERY == 0 || i + 1 == n {
                    wr
                } else {
                    wr.unsignaled()
                }
            })
            .collect();
        let signaled = n.div_ceil(SIGNAL_EVERY);
        let recvs: Vec<RecvWr<'_>> = if op == Op::Send { (0..n).map(|_| self.recv(size)).collect() } else { Vec::new() };
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            self.b.qp.post_recv(&recvs).or_die(&what);
            let start = Instant::now();
            self.a.qp.post_send(&wrs).or_die(&what);
            reap(&self.a.cq, signaled, self.poll, &what);
            reap(&self.b.cq, recvs.len(), self.poll, &what);
            total += start.elapsed();
        }
        total
    }

    /// `iters` single requests, each waited for; the time they took.
    fn latency(&self, op: Op, size: usize, iters: u64) -> Duration {
        let what = format!("{}_lat {}", op.name(), common::human(size));
        let wr = [self.wr(op, size)];
        let recv = [self.recv(size)];
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            if op == Op::Send {
                self.b.qp.post_recv(&recv).or_die(&what);
            }
            let start = Instant::now();
            self.a.qp.post_send(&wr).or_die(&what);
            if op == Op::Send {
                reap(&self.b.cq, 1, self.poll, &what);
            }
            reap(&self.a.cq, 1, self.poll, &what);
            total += start.elapsed();
        }
        total
    }
}

fn bench(c: &mut Criterion, lb: &Loopback, sizes: &[usize]) {
    for op in [Op::Write, Op::Read, Op::Send] {
        let mut g = c.benchmark_group(format!("{}_bw", op.name()));
        g.sampling_mode(SamplingMode::Flat);
        for &size in sizes {
            g.throughput(Throughput::Bytes((window(size) * size) as u64));
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
                b.iter_custom(|iters| lb.bandwidth(op, size, iters))
            });
        }
        g.finish();

        let mut g = c.benchmark_group(format!("{}_lat", op.name()));
        g.sampling_mode(SamplingMode::Flat);
        for &size in sizes {
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &size| {
                b.iter_custom(|iters| lb.latency(op, size, iters))
            });
        }
        g.finish();
    }
}

fn main() {
    let sizes = common::rdma_sizes();
    let poll = common::poll_mode();
    let Some(ctx) = common::open_device("rdma") else { return };
    let mut c = common::criterion();
    let max = sizes.iter().copied().max().expect("at least one size");
    let lb = Loopback::new(&ctx, max, poll);
    lb.check(max.min(64 << 10));
    println!(
        "rdma: {} ({:?} polling), loopback RC QP {:#x} -> {:#x}, host memory, sizes {}",
        ctx.name(),
        poll,
        lb.a.qp.endpoint().qp_num,
        lb.b.qp.endpoint().qp_num,
        sizes.iter().map(|&s| common::human(s)).collect::<Vec<_>>().join(", ")
    );
    bench(&mut c, &lb, &sizes);
    c.final_summary();
}
