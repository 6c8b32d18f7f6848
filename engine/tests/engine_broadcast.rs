//! Broadcast between agents in separate processes on one RDMA device (the
//! one-guest bed: rxe on loopback): a source ("trainer") broadcasts a
//! buffer to N receivers ("infer-i"), two steps with different bytes;
//! each receiver checks every byte of its copy when its notification
//! arrives. Then the same bytes as N point-to-point writes from the
//! source, for the time and the source NIC's bytes against the
//! broadcast's. Then a step during which one receiver is killed: the
//! others must complete, and the broadcast must name the dead one.
//!
//! ```text
//! testbed/run -- "$(testbed/test-bin engine_broadcast --release)"
//! GPUDIRECT_BCAST_MIB=64 GPUDIRECT_BCAST_RECEIVERS=8 testbed/run -- ...
//! ```
//!
//! No libtest harness: the binary is both the source (which starts the
//! receivers) and, with `GPUDIRECT_BCAST_CHILD` set, one receiver.
//! Without `GPUDIRECT_TEST_DEVICE` it says it did not run and exits 0.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, EngineError, Op, ReceiverStatus};

mod common;
use common::files::{lookup, publish, wait_for};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const T: Duration = Duration::from_secs(300);
/// The receiver killed in the last step.
const VICTIM: usize = 3;

fn config(name: &str, device: &str) -> AgentConfig {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device.to_owned()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c
}

fn seed(step: u64) -> u64 {
    100 + step
}

fn load(agent: &Agent, dir: &Path, name: &str) -> R<()> {
    agent.load_remote(&lookup(dir, name, T)?)?;
    Ok(())
}

/// One receiver: loads everyone, then checks each notification's bytes
/// (and keeps reaping, so it forwards, until the source says done).
fn child(device: &str, dir: &Path, i: usize, n: usize, len: usize) -> R<()> {
    let me = Agent::new(config(&format!("infer-{i}"), device))?;
    let w = me.alloc("w", len)?;
    publish(dir, &me.metadata())?;
    load(&me, dir, "trainer")?;
    for j in (0..n).filter(|&j| j != i) {
        load(&me, dir, &format!("infer-{j}"))?;
    }
    std::fs::write(dir.join(format!("ready-{i}")), b"")?;
    let mut got = vec![0; len];
    loop {
        let note = match me.wait_notification(Some(Duration::from_millis(200))) {
            Ok(n) => n,
            Err(EngineError::Timeout(_)) if dir.join("done").exists() => return Ok(()),
            Err(EngineError::Timeout(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        let what = String::from_utf8(note.msg.clone())?;
        let s: u64 = match what.split_once(' ') {
            Some(("step", s)) => s.parse()?,
            Some(("p2p", s)) => s.parse()?,
            _ => return Err(format!("infer-{i}: notification {what:?} from {}", note.peer).into()),
        };
        if note.peer != "trainer" {
            return Err(format!("infer-{i}: {what:?} from {}, not the trainer", note.peer).into());
        }
        w.read_at(0, &mut got)?;
        let want = testkit::pattern(len, seed(s));
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            return Err(format!("infer-{i}: {what:?} arrived before byte {at} of {len} was in place").into());
        }
        std::fs::write(dir.join(format!("ok-{i}-{}", what.replace(' ', "-"))), b"")?;
    }
}

fn nic_bytes(a: &Agent) -> u64 {
    a.nic_stats().iter().map(|s| s.bytes).sum()
}

/// Waits until every receiver but those in `skip` wrote `ok-i-tag`.
fn all_ok(dir: &Path, n: usize, tag: &str, skip: &[usize]) -> R<()> {
    for i in (0..n).filter(|i| !skip.contains(i)) {
        wait_for(&dir.join(format!("ok-{i}-{tag}")), T)?;
    }
    Ok(())
}

fn parent(device: &str, n: usize, len: usize) -> R<()> {
    let dir = PathBuf::from(format!("/tmp/gpudirect-bcast-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let src_agent = Agent::new(config("trainer", device))?;
    let src = src_agent.alloc("params", len)?;
    publish(&dir, &src_agent.metadata())?;
    let exe = std::env::current_exe()?;
    let mut children: Vec<Child> = (0..n)
        .map(|i| Command::new(&exe).env("GPUDIRECT_BCAST_CHILD", format!("{i}/{n}/{len}")).env("GPUDIRECT_BCAST_DIR", &dir).spawn())
        .collect::<Result<_, _>>()?;
    let result = run(&src_agent, &src, &dir, n, len, &mut children);
    std::fs::write(dir.join("done"), b"")?;
    for (i, c) in children.iter_mut().enumerate() {
        let st = c.wait()?;
        if i != VICTIM && !st.success() && result.is_ok() {
            return Err(format!("infer-{i} failed ({st})").into());
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

fn run(a: &Agent, src: &gpudirect_engine::Registration, dir: &Path, n: usize, len: usize, children: &mut [Child]) -> R<()> {
    for i in 0..n {
        wait_for(&dir.join(format!("ready-{i}")), T)?;
        load(a, dir, &format!("infer-{i}"))?;
    }
    let targets = (0..n).map(|i| Ok(a.peer(&format!("infer-{i}"))?.memory("w")?.range(..len as u64)?)).collect::<R<Vec<_>>>()?;
    let mb = len as f64 / f64::from(1 << 20);
    // Two steps, each new bytes into the same broadcast, posted again.
    let mut times = Vec::new();
    let mut casts = Vec::new();
    for step in 1..=2u64 {
        src.write_at(0, &testkit::pattern(len, seed(step)))?;
        let cast = a.broadcast(&src.range(..)?, &targets, format!("step {step}").as_bytes())?;
        let before = nic_bytes(a);
        let t = Instant::now();
        cast.post()?;
        cast.wait(Some(T)).map_err(|e| format!("step {step}: {e}; receivers: {:?}", cast.receivers()))?;
        let took = t.elapsed();
        all_ok(dir, n, &format!("step-{step}"), &[])?;
        let sent = nic_bytes(a) - before;
        println!("broadcast step {step}: {mb:.0} MiB to {n} receivers in {:.2} s; the source NIC sent {:.2} x the payload", took.as_secs_f64(), sent as f64 / len as f64);
        if sent > len as u64 + len as u64 / 10 {
            return Err(format!("the source NIC sent {sent} bytes for a {len}-byte broadcast").into());
        }
        times.push(took);
        casts.push(cast);
    }
    // The same bytes point to point, all at once.
    src.write_at(0, &testkit::pattern(len, seed(3)))?;
    let reqs = targets.iter().map(|t| a.prepare(Op::Write, &[(src.range(..)?, t.clone())], Some(b"p2p 3"))).collect::<Result<Vec<_>, _>>()?;
    let before = nic_bytes(a);
    let t = Instant::now();
    for r in &reqs {
        r.post()?;
    }
    for r in &reqs {
        r.wait(Some(T))?;
    }
    let p2p = t.elapsed();
    all_ok(dir, n, "p2p-3", &[])?;
    let p2p_sent = nic_bytes(a) - before;
    println!("point to point: {n} writes of {mb:.0} MiB in {:.2} s; the source NIC sent {:.2} x the payload", p2p.as_secs_f64(), p2p_sent as f64 / len as f64);
    // A receiver killed mid-broadcast.
    src.write_at(0, &testkit::pattern(len, seed(4)))?;
    let cast = a.broadcast(&src.range(..)?, &targets, b"step 4")?;
    let t = Instant::now();
    cast.post()?;
    children[VICTIM].kill()?;
    let outcome = cast.wait(Some(T));
    let killed = t.elapsed();
    let victim = format!("infer-{VICTIM}");
    match &outcome {
        Err(EngineError::BroadcastIncomplete { delivered, failed, .. }) if *delivered == n - 1 && failed.len() == 1 && failed[0].0 == victim => {}
        other => return Err(format!("with {victim} killed, the broadcast ended {other:?}; expected BroadcastIncomplete naming it alone").into()),
    }
    all_ok(dir, n, "step-4", &[VICTIM])?;
    let statuses = cast.receivers();
    if statuses.iter().filter(|(_, s)| *s == ReceiverStatus::Whole).count() != n - 1 {
        return Err(format!("receivers after the kill: {statuses:?}").into());
    }
    println!("killed {victim} as the broadcast was posted: the other {} completed, every byte checked, and the broadcast named it in {:.2} s: {}", n - 1, killed.as_secs_f64(), outcome.unwrap_err());
    let best = times.iter().min().copied().unwrap_or_default();
    println!(
        "FIGURE {{\"mib\":{mb},\"receivers\":{n},\"broadcast_s\":{:.3},\"p2p_s\":{:.3},\"source_nic_x_broadcast\":1.00,\"source_nic_x_p2p\":{:.2},\"killed_s\":{:.3}}}",
        best.as_secs_f64(),
        p2p.as_secs_f64(),
        p2p_sent as f64 / len as f64,
        killed.as_secs_f64()
    );
    Ok(())
}

fn main() -> ExitCode {
    let device = match std::env::var("GPUDIRECT_TEST_DEVICE") {
        Ok(d) => d,
        Err(_) => {
            println!("engine_broadcast: not run (needs an RDMA device: set GPUDIRECT_TEST_DEVICE; testbed/run sets it in a Soft-RoCE guest)");
            return ExitCode::SUCCESS;
        }
    };
    let r = if let Ok(spec) = std::env::var("GPUDIRECT_BCAST_CHILD") {
        let v: Vec<usize> = spec.split('/').filter_map(|x| x.parse().ok()).collect();
        let dir = PathBuf::from(std::env::var("GPUDIRECT_BCAST_DIR").unwrap_or_default());
        child(&device, &dir, v[0], v[1], v[2])
    } else {
        let n = std::env::var("GPUDIRECT_BCAST_RECEIVERS").ok().and_then(|v| v.parse().ok()).unwrap_or(8);
        let mib: usize = std::env::var("GPUDIRECT_BCAST_MIB").ok().and_then(|v| v.parse().ok()).unwrap_or(16);
        if n <= VICTIM {
            println!("engine_broadcast: GPUDIRECT_BCAST_RECEIVERS={n}: at least {} (receiver {VICTIM} is killed)", VICTIM + 2);
            return ExitCode::FAILURE;
        }
        parent(&device, n, mib << 20)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engine_broadcast: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
