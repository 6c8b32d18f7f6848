//! Many transfer-engine agents, each in its own process, on one RDMA
//! device (the one-guest bed: rxe on loopback): every agent writes a block
//! to one target with a notification, and one to its neighbour around a
//! ring. The target and each ring member check the bytes when the
//! notification arrives; no notification may be lost or doubled. The
//! target's notification receive queue has fewer slots than there are
//! peers, so its receive memory is shown not to grow with them. Prints
//! the figures docs/performance.md quotes: connection setup time per peer
//! and the target's resident memory per connection.
//!
//! ```text
//! testbed/run -- "$(testbed/test-bin engine_scale)"            # 64 agents
//! GPUDIRECT_ENGINE_AGENTS=16 testbed/run -- ...                # fewer
//! ```
//!
//! No libtest harness: the binary is both the parent (the target, which
//! starts the agents) and, with `GPUDIRECT_ENGINE_CHILD` set, one agent.
//! Without `GPUDIRECT_TEST_DEVICE` it says it did not run and exits 0.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, Op};

mod common;
use common::files::{lookup, publish, wait_for};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const BLOCK: usize = 64 * 1024;
/// Notification slots of the target: fewer than the agents that notify it.
const TARGET_SLOTS: u32 = 32;
const T: Duration = Duration::from_secs(120);

fn config(name: &str, device: &str, slots: u32) -> AgentConfig {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device.to_owned()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.srq_depth = slots;
    c.send_depth = 16;
    c.max_connections = 128;
    c
}

fn block(seed: usize) -> Vec<u8> {
    testkit::pattern(BLOCK, seed as u64)
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()))
        .unwrap_or(0)
}

/// One ring member: writes its block to the target and to its neighbour,
/// checks what its other neighbour wrote when that notification comes.
fn child(device: &str, dir: &Path, i: usize, n: usize) -> R<()> {
    let me = Agent::new(config(&format!("agent-{i}"), device, 4))?;
    let ring = me.alloc("ring", BLOCK)?;
    let src = me.alloc("src", BLOCK)?;
    src.write_at(0, &block(i))?;
    publish(dir, &me.metadata())?;
    let target = me.load_remote(&lookup(dir, "target", T)?)?.memory("inbox")?;
    let next = me.load_remote(&lookup(dir, &format!("agent-{}", (i + 1) % n), T)?)?.memory("ring")?;
    let off = (i * BLOCK) as u64;
    let to_target_range = || -> R<_> { Ok((src.range(..)?, target.range(off..off + BLOCK as u64)?)) };
    // Set up both connections first, timing the target's: the first post
    // connects, the second is a plain post; their difference is the setup.
    let warm = me.prepare(Op::Write, &[to_target_range()?], None)?;
    let t = Instant::now();
    warm.post()?;
    let first = t.elapsed();
    warm.wait(Some(T))?;
    let t = Instant::now();
    warm.post()?;
    let again = t.elapsed();
    warm.wait(Some(T))?;
    let warm_next = me.prepare(Op::Write, &[(src.range(..)?, next.range(..)?)], None)?;
    warm_next.post()?;
    warm_next.wait(Some(T))?;
    std::fs::write(dir.join(format!("ready-{i}")), b"")?;
    // Then every agent notifies at once: a burst larger than the target's
    // receive queue.
    let to_target = me.prepare(Op::Write, &[to_target_range()?], Some(i.to_string().as_bytes()))?;
    let to_next = me.prepare(Op::Write, &[(src.range(..)?, next.range(..)?)], Some(i.to_string().as_bytes()))?;
    wait_for(&dir.join("go"), T)?;
    to_target.post()?;
    to_next.post()?;
    to_target.wait(Some(T))?;
    to_next.wait(Some(T))?;
    let prev = (i + n - 1) % n;
    let note = me.wait_notification(Some(T))?;
    if note.peer != format!("agent-{prev}") || note.msg != prev.to_string().as_bytes() {
        return Err(format!("agent-{i}: notification {:?} from {}", String::from_utf8_lossy(&note.msg), note.peer).into());
    }
    let mut got = vec![0; BLOCK];
    ring.read_at(0, &mut got)?;
    if got != block(prev) {
        return Err(format!("agent-{i}: agent-{prev}'s block was not in place when its notification came").into());
    }
    // Stay up until the target has checked everything: our queue pairs
    // must outlive the transfers that use them.
    wait_for(&dir.join("done"), T)?;
    println!("setup_us {}", first.saturating_sub(again).as_micros());
    Ok(())
}

fn parent(device: &str, n: usize) -> R<()> {
    if n < 2 {
        return Err(format!("GPUDIRECT_ENGINE_AGENTS={n}: a ring needs at least 2 agents").into());
    }
    let dir = PathBuf::from(format!("/tmp/gpudirect-engine-scale-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let target = Agent::new(config("target", device, TARGET_SLOTS))?;
    let inbox = target.alloc("inbox", n * BLOCK)?;
    publish(&dir, &target.metadata())?;
    let rss_before = rss_kib();
    let exe = std::env::current_exe()?;
    let started = Instant::now();
    let children = (0..n)
        .map(|i| {
            Command::new(&exe)
                .env("GPUDIRECT_ENGINE_CHILD", format!("{i}/{n}"))
                .env("GPUDIRECT_ENGINE_DIR", &dir)
                .stdout(std::process::Stdio::piped())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    for i in 0..n {
        wait_for(&dir.join(format!("ready-{i}")), T)?;
    }
    let connected = started.elapsed();
    let rss_after = rss_kib();
    let conns = target.connections();
    let burst = Instant::now();
    std::fs::write(dir.join("go"), b"")?;
    let mut seen = vec![false; n];
    let mut got = vec![0; BLOCK];
    for _ in 0..n {
        let note = target.wait_notification(Some(T))?;
        let i: usize = std::str::from_utf8(&note.msg)?.parse()?;
        if i >= n || note.peer != format!("agent-{i}") || seen[i] {
            return Err(format!("notification {:?} from {}", String::from_utf8_lossy(&note.msg), note.peer).into());
        }
        seen[i] = true;
        inbox.read_at(i * BLOCK, &mut got)?;
        if got != block(i) {
            return Err(format!("agent-{i}'s block was not in place when its notification came").into());
        }
    }
    let all_in = burst.elapsed();
    std::fs::write(dir.join("done"), b"")?;
    let mut setups = Vec::new();
    for (i, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!("agent-{i} failed ({}): {text}", out.status).into());
        }
        setups.extend(text.lines().filter_map(|l| l.strip_prefix("setup_us ")?.parse::<u64>().ok()));
    }
    let _ = std::fs::remove_dir_all(&dir);
    if !target.notifications()?.is_empty() {
        return Err("a notification beyond two per agent".into());
    }
    if conns != n {
        return Err(format!("the target holds {conns} connections for {n} agents").into());
    }
    setups.sort_unstable();
    let median = setups.get(setups.len() / 2).copied().unwrap_or(0);
    println!(
        "engine_scale: {n} agents in {n} processes, all connected after {:.1} s; then {n} notifications at once through {TARGET_SLOTS} receive slots ({TARGET_SLOTS} KiB of receive memory), every block checked on arrival, in {:.1} s",
        connected.as_secs_f64(),
        all_in.as_secs_f64()
    );
    println!(
        "engine_scale: connection setup per peer (first post minus a plain one): median {median} us, max {} us over {} agents",
        setups.last().copied().unwrap_or(0),
        setups.len()
    );
    println!(
        "engine_scale: target resident memory {rss_before} KiB before, {rss_after} KiB with {conns} connections: {:.1} KiB per connection",
        rss_after.saturating_sub(rss_before) as f64 / conns.max(1) as f64
    );
    Ok(())
}

fn main() -> ExitCode {
    let Ok(device) = std::env::var("GPUDIRECT_TEST_DEVICE") else {
        if !std::env::args().any(|a| a == "--list") {
            println!("engine_scale: not run: it needs an RDMA device (GPUDIRECT_TEST_DEVICE; testbed/run sets it)");
        }
        return ExitCode::SUCCESS;
    };
    let r = match std::env::var("GPUDIRECT_ENGINE_CHILD") {
        Ok(spec) => {
            let dir = PathBuf::from(std::env::var("GPUDIRECT_ENGINE_DIR").unwrap_or_default());
            match spec.split_once('/').map(|(i, n)| (i.parse::<usize>(), n.parse::<usize>())) {
                Some((Ok(i), Ok(n))) if i < n => child(&device, &dir, i, n),
                _ => Err(format!("bad GPUDIRECT_ENGINE_CHILD {spec:?}").into()),
            }
        }
        Err(_) => {
            let n = std::env::var("GPUDIRECT_ENGINE_AGENTS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
            parent(&device, n)
        }
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engine_scale: {e}");
            ExitCode::FAILURE
        }
    }
}
