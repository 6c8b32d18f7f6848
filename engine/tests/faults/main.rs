//! Fault tests between two RDMA hosts: a peer that dies mid-transfer, a
//! lossy and reordering link, a misbehaving remote, and the locked-memory
//! limit. They need two hosts joined by RoCE, so they run in the two-guest
//! test bed:
//!
//! ```text
//! testbed/faults [SCENARIO...]     # peer-death lossy-link remote-misuse memlock engine-peer-death
//! ```
//!
//! Elsewhere (`cargo test`) this binary reports its scenarios as not run and
//! exits 0; it has no libtest harness, so `--list` shows nothing and the
//! one-guest device-test step of `testbed/test-all` leaves it alone.
//!
//! In the bed both guests run it with the same arguments. `GPUDIRECT_ROLE`
//! (`a` or `b`) and `GPUDIRECT_PEER` say which side each is: A drives every
//! scenario and asserts; B serves memory, obeys control messages sent over
//! TCP, and reports what its side saw. Each result is printed as one
//! `FIGURE {json}` line, which docs/reliability.md quotes.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use gpudirect::bootstrap::{Handshake, OobChannel};
use testkit::{device, open_fds, pattern, Role};
use gpudirect::{
    AccessFlags, CompletionQueue, Context, Error, MemoryRegion, ProtectionDomain, QpConfig, QpState, QueuePair,
    RemoteBuffer, SendWr, WcStatus, WorkCompletion,
};
use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, EngineError, Op as EngineOp, Registration, RemoteMemory, TransferRequest};
use serde_json::{json, Value};

use engine_peer_death::{engine_peer_death, engine_victim};
use lossy_link::lossy_link;
use memlock::{memlock, memlock_child};
use peer_death::{peer_death, victim};
use remote_misuse::remote_misuse;

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+).into());
        }
    };
}

// After the macro: the scenario modules use it.
mod engine_peer_death;
mod lossy_link;
mod memlock;
mod peer_death;
mod remote_misuse;

const SCENARIOS: [&str; 5] = ["peer-death", "lossy-link", "remote-misuse", "memlock", "engine-peer-death"];
/// Control ports: each scenario (and each reconnection) gets its own, so a
/// side that failed one scenario cannot be paired with the wrong step.
const PORT_BASE: u16 = 18600;
/// Bound on each control message. A side may wait for the other through a
/// whole lossy phase, which takes minutes with GPUDIRECT_FAULTS_LOSSY_MIB
/// raised; hangs of the RDMA path itself are caught by [`HANG`].
const CTL_TIMEOUT: Duration = Duration::from_secs(600);
/// Longest wait for any one completion before calling it a hang.
const HANG: Duration = Duration::from_secs(60);
const CHUNK: usize = 64 * 1024;


fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("memlock-child") => return report("memlock-child", memlock_child()),
        Some("engine-victim") => return report("engine-victim", engine_victim(args.get(1).map(String::as_str).unwrap_or_default())),
        Some("victim") => {
            let spec = std::env::var("GPUDIRECT_FAULTS_VICTIM").unwrap_or_default();
            return report("victim", victim(&spec));
        }
        _ => {}
    }
    testkit::run_two_host("faults", &SCENARIOS, &args, |role, i, name| {
        let port = PORT_BASE + 20 * i as u16;
        match name {
            "peer-death" => peer_death(role, port),
            "lossy-link" => lossy_link(role, port),
            "remote-misuse" => remote_misuse(role, port),
            "engine-peer-death" => engine_peer_death(role, port),
            _ => memlock(role, port),
        }
    })
}

fn report(what: &str, r: R<()>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            println!("FAIL {what}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn figure(v: Value) {
    println!("FIGURE {v}");
}

// ---------------------------------------------------------------- plumbing --


fn peer() -> R<String> {
    Ok(std::env::var("GPUDIRECT_PEER").map_err(|_| "GPUDIRECT_PEER is not set (testbed/run --two sets it)")?)
}

/// A's side listens, B's connects (retrying until A listens).
fn control(role: Role, port: u16) -> R<OobChannel> {
    Ok(match role {
        Role::A => OobChannel::accept(&TcpListener::bind(("0.0.0.0", port))?, CTL_TIMEOUT)?,
        Role::B => OobChannel::connect(format!("{}:{port}", peer()?), CTL_TIMEOUT)?,
    })
}

/// Both sides send a message and get the other's.
fn say(ctl: &mut OobChannel, msg: &str) -> R<String> {
    let got = ctl.exchange(&Handshake { app: msg.as_bytes().to_vec(), ..Default::default() })?;
    Ok(String::from_utf8(got.app)?)
}

/// Both sides say the same step name; a mismatch means they lost step.
fn step(ctl: &mut OobChannel, name: &str) -> R<()> {
    let got = say(ctl, name)?;
    ensure!(got == name, "peer is at step {got:?}, this side at {name:?}");
    Ok(())
}

/// A: tells B that `what` is finished and returns B's report on it.
fn ask(ctl: &mut OobChannel, what: &str) -> R<Value> {
    let got = say(ctl, what)?;
    ensure!(got == "waiting", "peer is at {got:?}, expected it waiting for {what:?}");
    Ok(serde_json::from_str(&say(ctl, "")?)?)
}

/// B: waits until A says `what` is finished, then sends `report()`.
fn answer(ctl: &mut OobChannel, what: &str, report: impl FnOnce() -> R<Value>) -> R<()> {
    let got = say(ctl, "waiting")?;
    ensure!(got == what, "peer says {got:?}, expected {what:?}");
    let v = report()?;
    say(ctl, &v.to_string())?;
    Ok(())
}

struct Host {
    // Field order is drop order: queue users first, the context last.
    cq: CompletionQueue,
    pd: ProtectionDomain,
    #[allow(dead_code)]
    ctx: Context,
}

impl Host {
    fn open() -> R<Host> {
        let ctx = Context::open(Some(&device()))?;
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, 1024)?;
        Ok(Host { cq, pd, ctx })
    }

    /// A fresh RC queue pair connected to the peer's, swapping buffers.
    fn connect(&self, ctl: &mut OobChannel, cfg: &QpConfig, buffers: Vec<RemoteBuffer>) -> R<(QueuePair, Vec<RemoteBuffer>)> {
        let prepared = QueuePair::create(&self.pd, &self.cq, &self.cq, cfg)?;
        let peer = ctl.exchange(&Handshake { endpoint: Some(prepared.endpoint()), buffers, app: vec![] })?;
        let ep = peer.endpoint.ok_or("the peer sent no queue pair endpoint")?;
        let qp = prepared.connect(&ep)?;
        // Neither side sends before both are ready to receive.
        ctl.barrier()?;
        Ok((qp, peer.buffers))
    }

    /// Waits for completions, calling anything longer than [`HANG`] a hang.
    fn wait(&self, wcs: &mut [WorkCompletion]) -> R<usize> {
        match self.cq.wait(wcs, Some(HANG)) {
            Err(Error::Timeout(_)) => Err(Box::new(Hung)),
            r => Ok(r?),
        }
    }
}

/// No completion within [`HANG`]: the initiator hung.
#[derive(Debug)]
struct Hung;

impl std::fmt::Display for Hung {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "no completion within {HANG:?}: the initiator hung")
    }
}

impl std::error::Error for Hung {}

fn fnv64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}


fn run(cmd: &str, args: &[&str]) -> R<String> {
    let out = Command::new(cmd).args(args).stdin(Stdio::null()).output()?;
    ensure!(out.status.success(), "{cmd} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn hw_counter(name: &str) -> u64 {
    let p = format!("/sys/class/infiniband/{}/ports/1/hw_counters/{name}", device());
    std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

/// Packets netem dropped on eth0 (`tc -s qdisc show`: "(dropped N,").
fn netem_dropped() -> u64 {
    run("tc", &["-s", "qdisc", "show", "dev", "eth0"])
        .ok()
        .and_then(|s| s.split("(dropped ").nth(1).and_then(|t| t.split(',').next()).and_then(|n| n.trim().parse().ok()))
        .unwrap_or(0)
}

fn set_netem(spec: Option<&str>) -> R<()> {
    // Removing a qdisc that is not there fails harmlessly.
    let _ = run("tc", &["qdisc", "del", "dev", "eth0", "root"]);
    if let Some(spec) = spec {
        let mut args = vec!["qdisc", "add", "dev", "eth0", "root", "netem"];
        args.extend(spec.split_whitespace());
        run("tc", &args)?;
    }
    Ok(())
}

/// Copies all of `local` as `chunk`-sized writes (or reads) to (from) the
/// same offsets of `remote`, keeping up to `depth` outstanding, and returns
/// how long it took. Any failed completion is an error.
fn stream(h: &Host, qp: &QueuePair, write: bool, local: &MemoryRegion, remote: &RemoteBuffer, depth: usize, chunk: usize) -> R<Duration> {
    let t = Instant::now();
    match stream_from(h, qp, write, local, remote, depth, chunk, 0, None)? {
        Streamed::Done => Ok(t.elapsed()),
        Streamed::Failed(_, e) => Err(e.into()),
        Streamed::Stopped(at) => Err(format!("stopped at chunk {at} with no time limit").into()),
    }
}

/// How [`stream_from`] ended.
enum Streamed {
    /// Every chunk arrived.
    Done,
    /// A request failed: the first chunk that did not arrive, and why.
    /// Completions come in order, so every chunk before it did.
    Failed(usize, gpudirect::WcError),
    /// The time limit passed: nothing more was posted and every posted
    /// chunk completed; the first chunk not sent.
    Stopped(usize),
}

/// [`stream`] from chunk `first` on, posting nothing new once `until` has
/// passed. When a request fails, waits for every outstanding one (the rest
/// are flushed).
#[allow(clippy::too_many_arguments)]
fn stream_from(
    h: &Host,
    qp: &QueuePair,
    write: bool,
    local: &MemoryRegion,
    remote: &RemoteBuffer,
    depth: usize,
    chunk: usize,
    first: usize,
    until: Option<Instant>,
) -> R<Streamed> {
    let n = local.len() / chunk;
    let (mut posted, mut done) = (first, first);
    let mut failed = None;
    let mut stopped = false;
    let mut wcs = [WorkCompletion::default(); 32];
    while done < posted || (failed.is_none() && !stopped && done < n) {
        stopped = stopped || until.is_some_and(|u| Instant::now() >= u);
        while failed.is_none() && !stopped && posted < n && posted - done < depth {
            let off = posted * chunk;
            let s = local.slice(off..off + chunk)?;
            let wr = if write { SendWr::write(s, remote, off as u64)? } else { SendWr::read(s, remote, off as u64)? };
            qp.post_send(&[wr.wr_id(posted as u64)])?;
            posted += 1;
        }
        if done == posted {
            break;
        }
        let k = h.wait(&mut wcs)?;
        for wc in &wcs[..k] {
            ensure!(wc.wr_id == done as u64, "completion {} arrived out of order (expected {done})", wc.wr_id);
            done += 1;
            if let (Err(e), None) = (wc.ok(), &failed) {
                failed = Some((wc.wr_id as usize, e));
            }
        }
    }
    Ok(match failed {
        Some((at, e)) => Streamed::Failed(at, e),
        None if done < n => Streamed::Stopped(done),
        None => Streamed::Done,
    })
}
