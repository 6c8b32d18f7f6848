//! The transfer engine's bandwidth per block size, next to the raw verbs
//! `write_bw` of `benches/rdma.rs`: two agents of one process on one
//! device, connected through their control listeners on 127.0.0.1. Host
//! memory.
//!
//! ```text
//! GPUDIRECT_BENCH_DEVICE=mlx5_0 cargo bench --bench engine
//! GPUDIRECT_BENCH_SIZES=64K,1M cargo bench --bench engine     # the default sizes
//! ```
//!
//! Groups (one benchmark per block size in bytes):
//!
//! - `engine_write_bw`: one iteration posts one prepared request of as
//!   many blocks as `write_bw` puts in a window (up to 64, at most 16 MiB),
//!   all from and to the same ranges, and waits for it by spinning on
//!   [`TransferRequest::status`](gpudirect_engine::TransferRequest::status)
//!   (busy polling, as `write_bw` does by default).
//! - `engine_write_notify_bw`: the same with a notification after the
//!   blocks, and the target's wait for it timed too.
//!
//! Without a device the binary says so on one line and exits 0.
//!
//! With `GPUDIRECT_INSNS_LOOP=N` it measures nothing itself: it posts N
//! requests of 16 writes of 64 bytes, through the engine
//! (`GPUDIRECT_INSNS_PATH=engine`) or the raw verbs (`raw`: a `SendWr`
//! batch built afresh on a queue pair, the last signaled,
//! `CompletionQueue::wait`; `raw-list`: the same batch prepared once as a
//! `SendList` and reposted, as the engine reposts a prepared request),
//! waiting for each, and exits: `testbed/engine-insns` counts the
//! user-space instructions of N and 2N under callgrind.

mod common;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::OrDie;
use criterion::{BenchmarkId, Criterion, SamplingMode, Throughput};
use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, Op, TransferRequest, TransferStatus};

/// Most blocks in one request, as `write_bw`'s window.
const TX_DEPTH: usize = 64;
/// Bytes one iteration moves at most.
const WINDOW_BYTES: usize = 16 << 20;

fn window(size: usize) -> usize {
    (WINDOW_BYTES / size).clamp(2, TX_DEPTH)
}

fn agent(device: &str, name: &str) -> Agent {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device.to_owned()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    Agent::new(c).or_die(&format!("starting agent {name}"))
}

fn spin(req: &TransferRequest, what: &str) {
    let started = Instant::now();
    loop {
        match req.status() {
            Ok(TransferStatus::Done) => return,
            Ok(_) if started.elapsed() > common::COMPLETION_TIMEOUT => panic!("{what}: no completion within {:?}", common::COMPLETION_TIMEOUT),
            Ok(_) => std::hint::spin_loop(),
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Descriptors per request in the instruction-count loop.
const LOOP_ENTRIES: usize = 16;
const LOOP_SIZE: usize = 64;

/// `GPUDIRECT_INSNS_LOOP`: `n` requests of [`LOOP_ENTRIES`] writes.
fn insns_loop(device: &str, n: u64, path: &str) {
    use gpudirect::{AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, SendWr, WorkCompletion};
    match path {
        "engine" => {
            let src = agent(device, "loop-src");
            let dst = agent(device, "loop-dst");
            let local = src.alloc("src", LOOP_SIZE).or_die("registering");
            dst.alloc("dst", LOOP_SIZE).or_die("registering");
            let md = AgentMetadata::decode(&dst.metadata().encode().or_die("encoding")).or_die("decoding");
            let remote = src.load_remote(&md).or_die("loading").memory("dst").or_die("memory");
            let entry = (local.range(..).or_die("range"), remote.range(..).or_die("range"));
            let req = src.prepare(Op::Write, &vec![entry; LOOP_ENTRIES], None).or_die("preparing");
            for _ in 0..n {
                req.post().or_die("posting");
                req.wait(Some(common::COMPLETION_TIMEOUT)).or_die("waiting");
            }
        }
        "raw" | "raw-list" => {
            let ctx = Context::open(Some(device)).or_die("opening the device");
            let pd = ProtectionDomain::new(&ctx).or_die("pd");
            let cq = CompletionQueue::new(&ctx, 1024).or_die("cq");
            let config = QpConfig::default();
            let a = QueuePair::create(&pd, &cq, &cq, &config).or_die("qp");
            let b = QueuePair::create(&pd, &cq, &cq, &config).or_die("qp");
            let (ea, eb) = (a.endpoint(), b.endpoint());
            let a = a.connect(&eb).or_die("connect");
            let _b = b.connect(&ea).or_die("connect");
            let access = AccessFlags::REMOTE_WRITE;
            let src = MemoryRegion::alloc(&pd, LOOP_SIZE, access).or_die("mr");
            let dst = MemoryRegion::alloc(&pd, LOOP_SIZE, access).or_die("mr");
            let remote = dst.remote();
            let mut wc = [WorkCompletion::default(); 1];
            let batch = || -> Vec<SendWr<'_>> {
                (0..LOOP_ENTRIES)
                    .map(|i| {
                        let wr = SendWr::write(src.slice(..).or_die("slice"), &remote, 0).or_die("write");
                        if i + 1 == LOOP_ENTRIES { wr } else { wr.unsignaled() }
                    })
                    .collect()
            };
            let mut list = (path == "raw-list").then(|| gpudirect::SendList::new(&batch()).or_die("preparing the list"));
            for round in 0..n {
                match &mut list {
                    Some(list) => {
                        list.set_wr_id(LOOP_ENTRIES - 1, round).or_die("numbering");
                        a.post_list(list).or_die("posting");
                    }
                    // Built afresh each time, as hand-written verbs code does.
                    None => a.post_send(&batch()).or_die("posting"),
                }
                cq.wait(&mut wc, Some(common::COMPLETION_TIMEOUT)).or_die("waiting");
                wc[0].ok().or_die("completion");
            }
        }
        other => common::usage_error(&format!("GPUDIRECT_INSNS_PATH={other}: expected engine, raw or raw-list")),
    }
}

fn main() {
    if let Ok(n) = std::env::var("GPUDIRECT_INSNS_LOOP") {
        let n: u64 = n.parse().unwrap_or_else(|_| common::usage_error("GPUDIRECT_INSNS_LOOP: a count"));
        let path = std::env::var("GPUDIRECT_INSNS_PATH").unwrap_or_else(|_| "engine".into());
        let Some(ctx) = common::open_device("engine") else { return };
        let device = ctx.name().to_owned();
        drop(ctx);
        insns_loop(&device, n, &path);
        return;
    }
    let sizes = common::sizes("GPUDIRECT_BENCH_SIZES", &[64 << 10, 1 << 20]);
    let Some(ctx) = common::open_device("engine") else { return };
    let device = ctx.name().to_owned();
    drop(ctx);
    let mut c: Criterion = common::criterion();
    let max = sizes.iter().copied().max().expect("at least one size");
    let src = agent(&device, "bench-src");
    let dst = agent(&device, "bench-dst");
    let local = src.alloc("src", max).or_die("registering the source");
    let target = dst.alloc("dst", max).or_die("registering the target");
    let md = AgentMetadata::decode(&dst.metadata().encode().or_die("encoding metadata")).or_die("decoding metadata");
    let remote = src.load_remote(&md).or_die("loading the target's metadata").memory("dst").or_die("finding the target");
    // One checked transfer first: the numbers are of transfers that move data.
    let want: Vec<u8> = (0..max).map(|i| (i as u8).wrapping_mul(31).wrapping_add(7)).collect();
    local.write_at(0, &want).or_die("filling the source");
    let check = src
        .prepare(Op::Write, &[(local.range(..).or_die("range"), remote.range(..).or_die("range"))], Some(b"check"))
        .or_die("preparing the check");
    check.post().or_die("posting the check");
    spin(&check, "the check");
    dst.wait_notification(Some(Duration::from_secs(60))).or_die("waiting for the check's notification");
    let mut got = vec![0; max];
    target.read_at(0, &mut got).or_die("reading the target");
    assert!(got == want, "the bytes that arrived differ from those sent");
    println!(
        "engine: {device} (busy polling), agent {} -> agent {} over 127.0.0.1, host memory, sizes {}",
        src.name(),
        dst.name(),
        sizes.iter().map(|&s| common::human(s)).collect::<Vec<_>>().join(", ")
    );
    for notify in [false, true] {
        let mut g = c.benchmark_group(if notify { "engine_write_notify_bw" } else { "engine_write_bw" });
        g.sampling_mode(SamplingMode::Flat);
        for &size in &sizes {
            let n = window(size);
            let entry = (local.range(0..size).or_die("range"), remote.range(0..size as u64).or_die("range"));
            let entries = vec![entry; n];
            let req = src.prepare(Op::Write, &entries, notify.then_some(&b"step"[..])).or_die("preparing the request");
            let what = format!("engine write {} x {n}", common::human(size));
            g.throughput(Throughput::Bytes((n * size) as u64));
            g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
                b.iter_custom(|iters| {
                    let start = Instant::now();
                    for _ in 0..iters {
                        req.post().or_die(&what);
                        spin(&req, &what);
                        if notify {
                            dst.wait_notification(Some(common::COMPLETION_TIMEOUT)).or_die(&what);
                        }
                    }
                    start.elapsed()
                })
            });
        }
        g.finish();
    }
    c.final_summary();
}
