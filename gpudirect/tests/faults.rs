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
use gpudirect::engine::{Agent, AgentConfig, AgentMetadata, EngineError, Op as EngineOp, Registration, RemoteMemory, TransferRequest};
use serde_json::{json, Value};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+).into());
        }
    };
}

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
    match stream_from(h, qp, write, local, remote, depth, chunk, 0)? {
        None => Ok(t.elapsed()),
        Some((_, e)) => Err(e.into()),
    }
}

/// [`stream`] from chunk `first` on. When a request fails, waits for every
/// outstanding one (the rest are flushed) and returns the index of the
/// first chunk that did not arrive with the error; completions come in
/// order, so every chunk before it did.
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
) -> R<Option<(usize, gpudirect::WcError)>> {
    let n = local.len() / chunk;
    let (mut posted, mut done) = (first, first);
    let mut failed = None;
    let mut wcs = [WorkCompletion::default(); 32];
    while done < posted || (failed.is_none() && done < n) {
        while failed.is_none() && posted < n && posted - done < depth {
            let off = posted * chunk;
            let s = local.slice(off..off + chunk)?;
            let wr = if write { SendWr::write(s, remote, off as u64)? } else { SendWr::read(s, remote, off as u64)? };
            qp.post_send(&[wr.wr_id(posted as u64)])?;
            posted += 1;
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
    Ok(failed)
}

/// Most queue pair rebuilds one lossy stream may need before the test
/// calls it stuck.
const MAX_REBUILDS: usize = 100;

/// Most rxe stalls one lossy phase may see before the test fails.
const MAX_STALLS: usize = 2;

/// [`stream`] that survives a queue pair failing on the lossy link (rxe
/// gives up on a request after `retry_cnt` retransmissions of it): it
/// rebuilds the connection with the peer and resumes at the first chunk
/// that did not arrive. Writes and reads of the same bytes are idempotent,
/// so resending is safe. Returns the time and the number of rebuilds.
///
/// rxe (Debian's 6.1 kernel) now and then stops retransmitting under loss:
/// no completion comes and the queue pair stays in RTS. After [`HANG`]
/// that is counted in `stalls` and handled as a failure with no known
/// resume point (the attempt starts over); more than [`MAX_STALLS`] in one
/// stream fails the test.
#[allow(clippy::too_many_arguments)]
fn stream_recovering(
    h: &Host,
    qp: &mut QueuePair,
    ctl: &mut OobChannel,
    cfg: &QpConfig,
    write: bool,
    local: &MemoryRegion,
    remote: &RemoteBuffer,
    statuses: &mut BTreeMap<&'static str, usize>,
) -> R<(Duration, usize)> {
    let t = Instant::now();
    let mut first = 0;
    for rebuilds in 0..=MAX_REBUILDS {
        match stream_from(h, qp, write, local, remote, LOSSY_DEPTH, LOSSY_CHUNK, first) {
            Err(e) if e.downcast_ref::<Hung>().is_some() => {
                let stalls = statuses.entry("rxe stall (no completion, QP still RTS)").or_default();
                *stalls += 1;
                ensure!(*stalls <= MAX_STALLS, "{e} ({} times in this phase)", *stalls);
                println!("rxe stalled: {e}; rebuilding the queue pair and starting the attempt over at request {first}");
                let got = say(ctl, "rebuild")?;
                ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                *qp = h.connect(ctl, cfg, vec![])?.0;
            }
            Err(e) => return Err(e),
            Ok(None) => return Ok((t.elapsed(), rebuilds)),
            Ok(Some((at, e))) => {
                *statuses.entry(e.status.verbs_name()).or_default() += 1;
                ensure!(e.status == WcStatus::RetryExceeded, "request {at} failed with {e}, not a retry exhaustion");
                ensure!(qp.state()? == QpState::Error, "the queue pair is not in the error state after {e}");
                let got = say(ctl, "rebuild")?;
                ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                *qp = h.connect(ctl, cfg, vec![])?.0;
                first = at;
            }
        }
    }
    Err(format!("still failing after {MAX_REBUILDS} rebuilds").into())
}

// -------------------------------------------------------------- peer death --

/// Outstanding requests kept in flight against the peer that will die.
const DEATH_DEPTH: usize = 32;

/// The longest a survivor may wait for its outstanding requests to fail:
/// each of the `retry_cnt + 1` tries waits for the local ACK timeout,
/// 4.096 µs × 2^timeout, which the InfiniBand spec lets an HCA stretch to
/// four times that; plus one second for scheduling in the emulated guests.
fn death_bound(cfg: &QpConfig) -> Duration {
    let per_try = Duration::from_nanos(4096 << cfg.timeout);
    per_try * 4 * (cfg.retry_cnt as u32 + 1) + Duration::from_secs(1)
}

#[derive(Clone, Copy, Debug)]
enum Death {
    /// The peer's process is killed (SIGKILL): its kernel destroys the queue
    /// pair and silently drops what arrives for it.
    ProcessKilled,
    /// Everything the peer sends is dropped (netem `loss 100%` on its
    /// link), as when its host hangs or its cable is cut: its queue pair
    /// stays alive but no acknowledgement or read response comes back.
    Unreachable,
}

fn death_cases() -> Vec<(Death, QpConfig)> {
    let default = QpConfig::default();
    let longer = QpConfig { timeout: 16, retry_cnt: 3, ..QpConfig::default() };
    vec![(Death::ProcessKilled, default.clone()), (Death::ProcessKilled, longer), (Death::Unreachable, default)]
}

fn peer_death(role: Role, port: u16) -> R<()> {
    for (i, (death, cfg)) in death_cases().into_iter().enumerate() {
        let port = port + 3 * i as u16;
        match role {
            Role::A => survivor(death, &cfg, port)?,
            Role::B => victim_host(death, &cfg, port)?,
        }
    }
    let port = port + 3 * death_cases().len() as u16;
    match role {
        Role::A => passive_survivor(port),
        Role::B => passive_victim_host(port),
    }
}

/// How long the passive survivor waits to show that nothing arrives.
const SILENCE: Duration = Duration::from_secs(3);

/// A: a side that only has a receive posted learns nothing when its peer
/// dies (RC has no timer on the receive side), so the wait must have a
/// timeout; one small RDMA write to the peer, a heartbeat, then reports the
/// death within the retry bound and flushes the receive.
fn passive_survivor(port: u16) -> R<()> {
    let mut ctl = control(Role::A, port)?;
    let h = Host::open()?;
    let cfg = QpConfig::default();
    let inbox = MemoryRegion::alloc(&h.pd, 4096, AccessFlags::LOCAL_WRITE)?;
    let beat = MemoryRegion::alloc(&h.pd, 8, AccessFlags::default())?;
    let (qp, bufs) = h.connect(&mut OobChannel::accept(&TcpListener::bind(("0.0.0.0", port + 1))?, CTL_TIMEOUT)?, &cfg, vec![])?;
    let remote = *bufs.first().ok_or("the victim sent no buffer")?;
    qp.post_recv(&[gpudirect::RecvWr::new(inbox.slice(..)?).wr_id(1)])?;
    let got = say(&mut ctl, "die")?;
    ensure!(got == "ready to die", "victim side answered {got:?}");
    let got = say(&mut ctl, "dead?")?;
    ensure!(got == "dead", "victim side answered {got:?}");

    let mut wcs = [WorkCompletion::default(); 4];
    let silent = match h.cq.wait(&mut wcs, Some(SILENCE)) {
        Err(Error::Timeout(_)) => true,
        Ok(n) => return Err(format!("a completion arrived from a dead peer: {:?}", &wcs[..n]).into()),
        Err(e) => return Err(e.into()),
    };
    let t = Instant::now();
    qp.post_send(&[SendWr::write(beat.slice(..)?, &remote, 0)?.wr_id(2)])?;
    let mut got: BTreeMap<u64, WcStatus> = BTreeMap::new();
    while got.len() < 2 {
        let k = h.wait(&mut wcs)?;
        for wc in &wcs[..k] {
            got.insert(wc.wr_id, wc.status);
        }
    }
    let detected = t.elapsed();
    let bound = death_bound(&cfg);
    figure(json!({
        "scenario": "peer-death", "death": "ProcessKilled, survivor only receiving",
        "receive_wait_s": SILENCE.as_secs(), "receive_completed_while_waiting": !silent,
        "heartbeat": "8-byte RDMA write", "heartbeat_status": got[&2].verbs_name(),
        "receive_status_after_heartbeat": got[&1].verbs_name(),
        "detected_ms": detected.as_millis() as u64, "bound_ms": bound.as_millis() as u64,
    }));
    ensure!(got[&2] == WcStatus::RetryExceeded, "heartbeat completed with {}", got[&2]);
    ensure!(got[&1] == WcStatus::WrFlushError, "the posted receive completed with {}", got[&1]);
    ensure!(detected <= bound, "the heartbeat took {detected:?} to fail, over the {bound:?} bound");
    step(&mut ctl, "passive done")
}

/// B: runs a victim for [`passive_survivor`] and kills it on request.
fn passive_victim_host(port: u16) -> R<()> {
    let mut ctl = control(Role::B, port)?;
    run_victim_until_told(&mut ctl, &QpConfig::default(), port)?;
    say(&mut ctl, "dead")?;
    step(&mut ctl, "passive done")
}

/// A: streams writes and reads at the peer, has it die, and checks that
/// every outstanding request fails with a typed status within the bound,
/// that everything tears down, and that a rebuilt connection works.
fn survivor(death: Death, cfg: &QpConfig, port: u16) -> R<()> {
    let mut ctl = control(Role::A, port)?;
    let fds_before = open_fds();
    let h = Host::open()?;
    let len = CHUNK * DEATH_DEPTH;
    let src = MemoryRegion::alloc(&h.pd, len, AccessFlags::default())?;
    let dst = MemoryRegion::alloc(&h.pd, len, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &pattern(len, 7))?;
    let (qp, bufs) = match death {
        // The victim is a child process of B's side, with its own channel.
        Death::ProcessKilled => h.connect(&mut OobChannel::accept(&TcpListener::bind(("0.0.0.0", port + 1))?, CTL_TIMEOUT)?, cfg, vec![])?,
        Death::Unreachable => h.connect(&mut ctl, cfg, vec![])?,
    };
    let remote = *bufs.first().ok_or("the victim sent no buffer")?;

    let (mut posted, mut done, mut ok) = (0usize, 0usize, 0usize);
    let mut statuses: BTreeMap<&str, usize> = BTreeMap::new();
    let mut first_error: Option<(WcStatus, Duration)> = None;
    let mut trigger: Option<Instant> = None;
    let mut wcs = [WorkCompletion::default(); 64];
    loop {
        while first_error.is_none() && posted - done < DEATH_DEPTH {
            let off = (posted % DEATH_DEPTH) * CHUNK;
            let wr = if posted % 2 == 0 {
                SendWr::write(src.slice(off..off + CHUNK)?, &remote, off as u64)?
            } else {
                SendWr::read(dst.slice(off..off + CHUNK)?, &remote, off as u64)?
            };
            qp.post_send(&[wr.wr_id(posted as u64)])?;
            posted += 1;
        }
        if first_error.is_some() && done == posted {
            break;
        }
        let k = h.wait(&mut wcs).map_err(|e| {
            let since = trigger.map(|t| format!("{:?} after the peer was told to die", t.elapsed())).unwrap_or_default();
            format!("{e} ({posted} posted, {done} completed, {ok} ok, first error {first_error:?}) {since}")
        })?;
        for wc in &wcs[..k] {
            done += 1;
            if wc.status == WcStatus::Success {
                ok += 1;
                continue;
            }
            *statuses.entry(wc.status.verbs_name()).or_default() += 1;
            if first_error.is_none() {
                let since = trigger.map(|t| t.elapsed()).ok_or_else(|| format!("{} before the peer died", wc.status))?;
                first_error = Some((wc.status, since));
            }
        }
        // A stream is running: now the peer dies (B acts on this message
        // at once; this side keeps posting and polling meanwhile).
        if trigger.is_none() && ok >= 64 {
            trigger = Some(Instant::now());
            let got = say(&mut ctl, "die")?;
            ensure!(got == "ready to die", "victim side answered {got:?}");
        }
    }
    let trigger = trigger.ok_or("the peer never got the signal to die")?;
    let drained = trigger.elapsed();
    let (first_status, detected) = first_error.ok_or("no request failed")?;
    let state = qp.state()?;

    let t = Instant::now();
    drop((qp, src, dst, h));
    let teardown = t.elapsed();
    let fds_after = open_fds();

    let bound = death_bound(cfg);
    figure(json!({
        "scenario": "peer-death", "death": format!("{death:?}"),
        "timeout": cfg.timeout, "retry_cnt": cfg.retry_cnt,
        "per_try_ms": (4096u64 << cfg.timeout) as f64 / 1e6, "bound_ms": bound.as_millis() as u64,
        "requests_ok_before_death": ok, "outstanding_at_failure": posted - ok,
        "first_error": first_status.verbs_name(), "statuses": statuses,
        "detected_ms": detected.as_millis() as u64, "all_completed_ms": drained.as_millis() as u64,
        "qp_state": format!("{state:?}"), "teardown_ms": teardown.as_millis() as u64,
        "fds_before": fds_before, "fds_after": fds_after,
    }));
    ensure!(first_status == WcStatus::RetryExceeded, "first failure was {first_status}, expected IBV_WC_RETRY_EXC_ERR");
    ensure!(
        statuses.keys().all(|s| *s == "IBV_WC_RETRY_EXC_ERR" || *s == "IBV_WC_WR_FLUSH_ERR"),
        "unexpected failure statuses {statuses:?}"
    );
    ensure!(done == posted, "{} requests never completed", posted - done);
    ensure!(drained <= bound, "outstanding requests took {drained:?} to fail, over the {bound:?} bound");
    ensure!(state == QpState::Error, "queue pair is {state:?} after the failure, expected Error");
    ensure!(fds_after == fds_before, "{fds_before} descriptors open before, {fds_after} after teardown");
    ensure!(teardown < Duration::from_secs(5), "teardown took {teardown:?}");

    // Rebuild: a new connection to the (new) peer works end to end.
    step(&mut ctl, "rebuild")?;
    let h = Host::open()?;
    let (qp, bufs) = h.connect(&mut ctl, cfg, vec![])?;
    let remote = *bufs.first().ok_or("the rebuilt peer sent no buffer")?;
    let src = MemoryRegion::alloc(&h.pd, CHUNK, AccessFlags::default())?;
    let back = MemoryRegion::alloc(&h.pd, CHUNK, AccessFlags::LOCAL_WRITE)?;
    src.write_at(0, &pattern(CHUNK, 99))?;
    stream(&h, &qp, true, &src, &remote, 1, CHUNK)?;
    stream(&h, &qp, false, &back, &remote, 1, CHUNK)?;
    ensure!(back.to_vec()? == pattern(CHUNK, 99), "data read back after the rebuild differs");
    step(&mut ctl, "rebuilt")?;
    Ok(())
}

/// B: hosts the victim (a child process, or this process behind a link it
/// takes down), then serves a rebuilt connection.
fn victim_host(death: Death, cfg: &QpConfig, port: u16) -> R<()> {
    let mut ctl = control(Role::B, port)?;
    let mut ctl = match death {
        Death::ProcessKilled => {
            run_victim_until_told(&mut ctl, cfg, port)?;
            ctl
        }
        Death::Unreachable => {
            let h = Host::open()?;
            let target = MemoryRegion::alloc(&h.pd, CHUNK * DEATH_DEPTH, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
            let (qp, _) = h.connect(&mut ctl, cfg, vec![target.remote()])?;
            let got = say(&mut ctl, "ready to die")?;
            ensure!(got == "die", "survivor sent {got:?}");
            set_netem(Some("loss 100%"))?;
            // Past the survivor's bound; the control connection's TCP
            // retransmits once the link works again.
            std::thread::sleep(death_bound(cfg) + Duration::from_secs(3));
            set_netem(None)?;
            drop((qp, target, h));
            ctl
        }
    };
    step(&mut ctl, "rebuild")?;
    let h = Host::open()?;
    let target = MemoryRegion::alloc(&h.pd, CHUNK, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
    let (_qp, _) = h.connect(&mut ctl, cfg, vec![target.remote()])?;
    step(&mut ctl, "rebuilt")?;
    ensure!(target.to_vec()? == pattern(CHUNK, 99), "the rebuilt connection's write did not arrive intact");
    Ok(())
}

/// B: starts a [`victim`] child process, waits until A says "die", and
/// SIGKILLs it.
fn run_victim_until_told(ctl: &mut OobChannel, cfg: &QpConfig, port: u16) -> R<()> {
    let mut child = Command::new(std::env::current_exe()?)
        .arg("victim")
        .env("GPUDIRECT_FAULTS_VICTIM", format!("{port} {} {}", cfg.timeout, cfg.retry_cnt))
        .stdin(Stdio::null())
        .spawn()?;
    let got = say(ctl, "ready to die");
    // Whatever happened, the child does not outlive this step.
    let killed = child.kill().and_then(|()| child.wait());
    ensure!(got? == "die", "survivor did not ask the victim to die");
    let st = killed?;
    ensure!(st.code().is_none(), "the victim exited by itself ({st}) instead of being killed");
    Ok(())
}

/// The child process B kills: connects a queue pair to A's survivor,
/// exposes a buffer, then waits to be killed.
fn victim(spec: &str) -> R<()> {
    let v: Vec<u64> = spec.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
    let [port, timeout, retry_cnt] = v[..] else { return Err(format!("bad victim spec {spec:?}").into()) };
    let cfg = QpConfig { timeout: timeout as u8, retry_cnt: retry_cnt as u8, ..QpConfig::default() };
    let mut ch = OobChannel::connect(format!("{}:{}", peer()?, port + 1), CTL_TIMEOUT)?;
    let h = Host::open()?;
    let target = MemoryRegion::alloc(&h.pd, CHUNK * DEATH_DEPTH, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
    let (_qp, _) = h.connect(&mut ch, &cfg, vec![target.remote()])?;
    // Killed from outside; the sleep only bounds a victim nobody kills.
    std::thread::sleep(Duration::from_secs(600));
    Err("the victim was never killed".into())
}

// -------------------------------------------------------------- lossy link --

const LOSSY_REGION: usize = 4 << 20;
/// Message size on the lossy link: 16 packets at the link's 1024-byte RoCE
/// MTU. rxe counts retries per work request and resets the count only when
/// one completes, so under 5 % loss a 64 KiB message (64 packets) can use
/// up `retry_cnt` before it gets through; see docs/reliability.md.
const LOSSY_CHUNK: usize = 16 * 1024;
const LOSSY_DEPTH: usize = 32;

/// (name, netem settings, retry_cnt override). The last phase lowers the
/// retry count so that requests do run out of retries and the rebuild
/// path below is exercised on every run, not only when loss is unlucky.
fn lossy_phases() -> Vec<(&'static str, Option<&'static str>, Option<u8>)> {
    vec![
        ("clean", None, None),
        ("loss 1%", Some("loss 1%"), None),
        ("loss 5%", Some("loss 5%"), None),
        ("loss 5% + reordering", Some("delay 2ms reorder 25% 50% loss 5%"), None),
        ("loss 5%, retry_cnt 1", Some("loss 5%"), Some(1)),
    ]
}

fn lossy_rounds() -> usize {
    let mib: usize = std::env::var("GPUDIRECT_FAULTS_LOSSY_MIB").ok().and_then(|s| s.parse().ok()).unwrap_or(8);
    (mib << 20).div_ceil(LOSSY_REGION).max(1)
}

fn lossy_link(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    let h = Host::open()?;
    let cfg = QpConfig::default();
    let rounds = lossy_rounds();
    match role {
        Role::A => {
            let src = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::default())?;
            let dst = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::LOCAL_WRITE)?;
            let (mut qp, bufs) = h.connect(&mut ctl, &cfg, vec![])?;
            let remote = *bufs.first().ok_or("peer sent no buffer")?;
            for (i, (name, spec, retry_cnt)) in lossy_phases().into_iter().enumerate() {
                step(&mut ctl, name)?;
                set_netem(spec)?;
                step(&mut ctl, "netem set")?;
                let cfg = QpConfig { retry_cnt: retry_cnt.unwrap_or(cfg.retry_cnt), ..cfg.clone() };
                if retry_cnt.is_some() {
                    let got = say(&mut ctl, "rebuild")?;
                    ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                    qp = h.connect(&mut ctl, &cfg, vec![])?.0;
                }
                // rxe counters on this side: retry sequences the requester started
                // (timeouts and NAKs) and out-of-sequence packets received.
                let (retries0, naks0) = (hw_counter("completer_retry_err"), hw_counter("rcvd_seq_err"));
                let (mut wt, mut rt, mut rebuilds) = (Duration::ZERO, Duration::ZERO, 0);
                let mut failures = BTreeMap::new();
                let mut expected = Vec::new();
                for r in 0..rounds {
                    expected = pattern(LOSSY_REGION, (i * 1000 + r) as u64);
                    src.write_at(0, &expected)?;
                    dst.fill(.., 0)?;
                    let (t, k) = stream_recovering(&h, &mut qp, &mut ctl, &cfg, true, &src, &remote, &mut failures)
                        .map_err(|e| format!("{name}, round {r}, writes: {e}"))?;
                    (wt, rebuilds) = (wt + t, rebuilds + k);
                    let (t, k) = stream_recovering(&h, &mut qp, &mut ctl, &cfg, false, &dst, &remote, &mut failures)
                        .map_err(|e| format!("{name}, round {r}, reads: {e}"))?;
                    (rt, rebuilds) = (rt + t, rebuilds + k);
                    ensure!(dst.to_vec()? == expected, "{name}, round {r}: data read back differs from what was written");
                }
                let dropped_here = netem_dropped();
                let (retries, naks) = (hw_counter("completer_retry_err") - retries0, hw_counter("rcvd_seq_err") - naks0);
                // B answers with its own view: checksum of the target and its drops.
                let peer = ask(&mut ctl, "phase done")?;
                let want = format!("{:016x}", fnv64(&expected));
                ensure!(peer["fnv64"] == want.as_str(), "{name}: target memory checksum {} != {want}", peer["fnv64"]);
                let dropped = dropped_here + peer["dropped"].as_u64().unwrap_or(0);
                let bytes = (rounds * LOSSY_REGION) as f64;
                figure(json!({
                    "scenario": "lossy-link", "phase": name, "netem": spec, "bytes_each_way": bytes as u64,
                    "write_mb_s": bytes / wt.as_secs_f64() / 1e6, "read_mb_s": bytes / rt.as_secs_f64() / 1e6,
                    "packets_dropped": dropped, "retry_sequences": retries, "out_of_sequence": naks,
                    "retry_cnt": cfg.retry_cnt, "qp_rebuilds": rebuilds, "failed_requests": failures,
                    "verified": "every byte read back and the target's checksum",
                }));
                ensure!(spec.is_none() || dropped > 0, "{name}: netem dropped no packet, so the phase tested nothing");
                ensure!(retry_cnt.is_none() || rebuilds > 0, "{name}: no request ran out of retries, so no rebuild was tested");
                set_netem(None)?;
            }
            step(&mut ctl, "end")?;
        }
        Role::B => {
            let target = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
            // Held only to keep B's end connected; replaced on each rebuild.
            let (mut _qp, _) = h.connect(&mut ctl, &cfg, vec![target.remote()])?;
            for (name, spec, _) in lossy_phases() {
                step(&mut ctl, name)?;
                set_netem(spec)?;
                step(&mut ctl, "netem set")?;
                // Rebuild the queue pair as often as A asks, until A is done.
                loop {
                    match say(&mut ctl, "waiting")?.as_str() {
                        "rebuild" => _qp = h.connect(&mut ctl, &cfg, vec![target.remote()])?.0,
                        "phase done" => break,
                        other => return Err(format!("unexpected request {other:?}").into()),
                    }
                }
                let sum = format!("{:016x}", fnv64(&target.to_vec()?));
                say(&mut ctl, &json!({ "fnv64": sum, "dropped": netem_dropped() }).to_string())?;
                set_netem(None)?;
            }
            step(&mut ctl, "end")?;
        }
    }
    Ok(())
}

// ----------------------------------------------------------- remote misuse --

/// B's regions: (name, access). `gone` is deregistered right after its
/// description is sent; `fresh` is registered after that, likely reusing
/// its slot, and must not be reachable through the old key.
const REGIONS: [(&str, AccessFlags); 5] = [
    ("rw", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
    ("ro", AccessFlags::REMOTE_READ),
    ("wo", AccessFlags::REMOTE_WRITE),
    ("gone", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
    ("fresh", AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ)),
];
const MISUSE_LEN: usize = 64 * 1024;

#[derive(Clone, Copy)]
enum Misuse {
    WrongRkey,
    PastTheEnd,
    WriteToReadOnly,
    ReadFromWriteOnly,
    WriteAfterDereg,
    ReadAfterDereg,
}

const MISUSES: [(&str, Misuse); 6] = [
    ("write with a wrong rkey", Misuse::WrongRkey),
    ("write past the end of the region (the peer lied about its length)", Misuse::PastTheEnd),
    ("write to a region without REMOTE_WRITE", Misuse::WriteToReadOnly),
    ("read from a region without REMOTE_READ", Misuse::ReadFromWriteOnly),
    ("write after the peer deregistered the region", Misuse::WriteAfterDereg),
    ("read after the peer deregistered the region", Misuse::ReadAfterDereg),
];

fn remote_misuse(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    let h = Host::open()?;
    let cfg = QpConfig::default();
    match role {
        Role::A => misuse_initiator(&h, &cfg, &mut ctl),
        Role::B => misuse_target(&h, &cfg, &mut ctl),
    }
}

fn misuse_initiator(h: &Host, cfg: &QpConfig, ctl: &mut OobChannel) -> R<()> {
    let src = MemoryRegion::alloc(&h.pd, 2 * MISUSE_LEN, AccessFlags::default())?;
    src.write_at(0, &pattern(2 * MISUSE_LEN, 42))?;
    let dst = MemoryRegion::alloc(&h.pd, 2 * MISUSE_LEN, AccessFlags::LOCAL_WRITE)?;
    let mut bufs = Vec::new();
    for (case, misuse) in MISUSES {
        step(ctl, case)?;
        let (qp, b) = h.connect(ctl, cfg, vec![])?;
        if bufs.is_empty() {
            bufs = b;
        }
        ensure!(bufs.len() == 4, "target described {} regions, expected rw ro wo gone", bufs.len());
        let (rw, ro, wo, gone) = (bufs[0], bufs[1], bufs[2], bufs[3]);
        let wr = match misuse {
            Misuse::WrongRkey => SendWr::write(src.slice(..4096)?, &RemoteBuffer { rkey: rw.rkey ^ 0x5a_5a00, ..rw }, 0)?,
            Misuse::PastTheEnd => {
                let liar = RemoteBuffer { len: rw.len * 2, ..rw };
                SendWr::write(src.slice(..8192)?, &liar, rw.len - 4096)?
            }
            Misuse::WriteToReadOnly => SendWr::write(src.slice(..4096)?, &ro, 0)?,
            Misuse::ReadFromWriteOnly => SendWr::read(dst.slice(..4096)?, &wo, 0)?,
            Misuse::WriteAfterDereg => SendWr::write(src.slice(..4096)?, &gone, 0)?,
            Misuse::ReadAfterDereg => SendWr::read(dst.slice(..4096)?, &gone, 0)?,
        };
        qp.post_send(&[wr.wr_id(1)])?;
        let mut wc = [WorkCompletion::default(); 1];
        h.wait(&mut wc)?;
        let state = qp.state()?;
        let local_untouched = dst.to_vec()?.iter().all(|&b| b == 0);
        let peer = ask(ctl, "completed")?;
        figure(json!({
            "scenario": "remote-misuse", "case": case, "initiator_status": wc[0].status.verbs_name(),
            "initiator_qp": format!("{state:?}"), "target_qp": peer["qp_state"],
            "target_memory_untouched": peer["untouched"], "recovery": "rebuild both queue pairs",
        }));
        ensure!(wc[0].status == WcStatus::RemoteAccessError, "{case}: got {}, expected IBV_WC_REM_ACCESS_ERR", wc[0].status);
        ensure!(state == QpState::Error, "{case}: initiator queue pair is {state:?}, expected Error");
        ensure!(peer["untouched"] == true, "{case}: the target's memory changed: {peer}");
        ensure!(local_untouched, "{case}: the failed read wrote local memory");
    }

    // The library's own bounds check refuses before posting; the queue
    // pair stays usable, so the same queue pair then does a valid write.
    step(ctl, "bounds check, then valid traffic")?;
    let (qp, _) = h.connect(ctl, cfg, vec![])?;
    let rw = bufs[0];
    let refused = SendWr::write(src.slice(..4096)?, &rw, rw.len - 100);
    ensure!(matches!(refused, Err(Error::OutOfBounds { .. })), "an out-of-bounds write was not refused locally");
    ensure!(qp.state()? == QpState::Rts, "the queue pair left RTS after a local refusal");
    let one = MemoryRegion::alloc(&h.pd, MISUSE_LEN, AccessFlags::default())?;
    let back = MemoryRegion::alloc(&h.pd, MISUSE_LEN, AccessFlags::LOCAL_WRITE)?;
    one.write_at(0, &pattern(MISUSE_LEN, 77))?;
    stream(h, &qp, true, &one, &rw, 1, CHUNK)?;
    stream(h, &qp, false, &back, &rw, 1, CHUNK)?;
    ensure!(back.to_vec()? == pattern(MISUSE_LEN, 77), "valid traffic after the rebuilds read back wrong data");
    let peer = ask(ctl, "valid traffic done")?;
    figure(json!({ "scenario": "remote-misuse", "case": "local bounds check, then valid traffic on the same queue pair",
                   "refused_locally": true, "qp_state_after_refusal": "Rts", "target": peer }));
    ensure!(peer["rw_written"] == true && peer["others_untouched"] == true, "target after valid traffic: {peer}");
    Ok(())
}

fn misuse_target(h: &Host, cfg: &QpConfig, ctl: &mut OobChannel) -> R<()> {
    let canary = |i: usize| pattern(MISUSE_LEN, 100 + i as u64);
    let mut regions: Vec<Option<MemoryRegion>> = Vec::new();
    for (i, (_, access)) in REGIONS.iter().take(4).enumerate() {
        let mr = MemoryRegion::alloc(&h.pd, MISUSE_LEN, *access)?;
        mr.write_at(0, &canary(i))?;
        regions.push(Some(mr));
    }
    let described: Vec<RemoteBuffer> = regions.iter().flatten().map(MemoryRegion::remote).collect();
    let mut first = true;
    for (case, _) in MISUSES {
        step(ctl, case)?;
        let (qp, _) = h.connect(ctl, cfg, if first { described.clone() } else { vec![] })?;
        if first {
            first = false;
            // Deregister `gone`, then register `fresh`, which may take its slot.
            regions[3] = None;
            let fresh = MemoryRegion::alloc(&h.pd, MISUSE_LEN, REGIONS[4].1)?;
            fresh.write_at(0, &canary(4))?;
            regions.push(Some(fresh));
        }
        answer(ctl, "completed", || {
            let untouched =
                regions.iter().enumerate().all(|(i, r)| r.as_ref().is_none_or(|mr| mr.to_vec().is_ok_and(|v| v == canary(i))));
            Ok(json!({ "untouched": untouched, "qp_state": format!("{:?}", qp.state()?) }))
        })?;
    }
    step(ctl, "bounds check, then valid traffic")?;
    let (_qp, _) = h.connect(ctl, cfg, vec![])?;
    answer(ctl, "valid traffic done", || {
        let rw = regions[0].as_ref().ok_or("rw region missing")?;
        let rw_written = rw.to_vec()? == pattern(MISUSE_LEN, 77);
        let others_untouched =
            regions.iter().enumerate().skip(1).all(|(i, r)| r.as_ref().is_none_or(|mr| mr.to_vec().is_ok_and(|v| v == canary(i))));
        Ok(json!({ "rw_written": rw_written, "others_untouched": others_untouched }))
    })
}

// ----------------------------------------------------------------- memlock --

/// Locked-memory limit the unprivileged child runs under.
const MEMLOCK_LIMIT: u64 = 1 << 20;

/// A: runs `memlock-child` as an unprivileged user under a 1 MiB
/// `RLIMIT_MEMLOCK` (root has CAP_IPC_LOCK and is never limited).
fn memlock(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    if role == Role::A {
        let exe = std::env::current_exe()?;
        let limit = MEMLOCK_LIMIT.to_string();
        let out = Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--"])
            .args(["prlimit", &format!("--memlock={limit}:{limit}"), "--"])
            .arg(&exe)
            .arg("memlock-child")
            .stdin(Stdio::null())
            .output()?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        ensure!(out.status.success(), "memlock child failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    step(&mut ctl, "memlock done")
}

fn memlock_child() -> R<()> {
    // SAFETY: geteuid has no preconditions.
    ensure!(unsafe { libc::geteuid() } != 0, "memlock-child must run unprivileged");
    let ctx = Context::open(Some(&device()))?;
    let pd = ProtectionDomain::new(&ctx)?;
    let small = MemoryRegion::alloc(&pd, 256 << 10, AccessFlags::default())?;
    let t = Instant::now();
    let err = match MemoryRegion::alloc(&pd, 2 << 20, AccessFlags::default()) {
        Ok(_) => return Err("registering 2 MiB under a 1 MiB locked-memory limit succeeded".into()),
        Err(e) => e,
    };
    let took = t.elapsed();
    let text = err.to_string();
    figure(json!({ "scenario": "memlock", "limit": MEMLOCK_LIMIT, "requested": 2 << 20, "error": text, "took_ms": took.as_millis() as u64 }));
    ensure!(
        matches!(err, Error::LockedMemoryLimit { limit: MEMLOCK_LIMIT, requested, pinned: Some(p), .. }
            if requested == 2 << 20 && p >= 256 << 10),
        "expected Error::LockedMemoryLimit naming the 1 MiB limit, got {err:?}"
    );
    ensure!(text.contains("ulimit -l"), "the error does not say how to raise the limit: {text}");
    ensure!(took < Duration::from_secs(2), "the refusal took {took:?}");
    // Deregistering returns the pages to the budget.
    drop(small);
    let again = MemoryRegion::alloc(&pd, 768 << 10, AccessFlags::default());
    ensure!(again.is_ok(), "768 KiB after freeing 256 KiB under a 1 MiB limit failed: {:?}", again.err());
    Ok(())
}

// ------------------------------------------------------- engine-peer-death --

/// Bytes each engine transfer of the scenario moves: long enough on
/// Soft-RoCE (about half a second) that the kill lands mid-transfer.
const ENGINE_LEN: usize = 8 << 20;

fn engine_agent(name: &str) -> R<Agent> {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device()];
    Ok(Agent::new(c)?)
}

fn send_blob(ch: &mut OobChannel, md: &AgentMetadata) -> R<()> {
    ch.exchange(&Handshake { app: md.encode()?, ..Default::default() })?;
    Ok(())
}

fn recv_blob(ch: &mut OobChannel) -> R<AgentMetadata> {
    Ok(AgentMetadata::decode(&ch.exchange(&Handshake::default())?.app)?)
}

/// A write of all of `src` to `dst`, in 64 KiB entries, with a notification.
fn engine_write(a: &Agent, src: &Registration, dst: &RemoteMemory, note: &str) -> R<TransferRequest> {
    let entries = (0..ENGINE_LEN / CHUNK)
        .map(|i| Ok((src.range(i * CHUNK..(i + 1) * CHUNK)?, dst.range((i * CHUNK) as u64..((i + 1) * CHUNK) as u64)?)))
        .collect::<R<Vec<_>>>()?;
    Ok(a.prepare(EngineOp::Write, &entries, Some(note.as_bytes()))?)
}

/// The transfer engine when a peer's process is killed mid-transfer: A's
/// agent writes to two agents of B's, "steady" (B's own process) and
/// "victim" (a child B SIGKILLs while A's write to it is in flight). The
/// victim's transfer fails with `PeerLost` within the queue pair's retry
/// bound, the steady one completes and is notified, and a victim started
/// again under the same name is reached by the next transfer, its bytes
/// checked by it.
fn engine_peer_death(role: Role, port: u16) -> R<()> {
    match role {
        Role::A => engine_driver(port),
        Role::B => engine_victim_host(port),
    }
}

fn engine_driver(port: u16) -> R<()> {
    let mut ctl = control(Role::A, port)?;
    let me = engine_agent("driver")?;
    let src = me.alloc("src", ENGINE_LEN)?;
    src.write_at(0, &pattern(ENGINE_LEN, 41))?;
    let steady = me.load_remote(&recv_blob(&mut ctl)?)?.memory("t")?;
    let victim_md = recv_blob(&mut OobChannel::accept(&TcpListener::bind(("0.0.0.0", port + 1))?, CTL_TIMEOUT)?)?;
    let victim = me.load_remote(&victim_md)?.memory("t")?;
    let to_steady = engine_write(&me, &src, &steady, "steady")?;
    let to_victim = engine_write(&me, &src, &victim, "victim")?;
    // Connected and working, both.
    for r in [&to_steady, &to_victim] {
        r.post()?;
        r.wait(Some(HANG))?;
    }
    step(&mut ctl, "connected")?;
    to_victim.post()?;
    let got = say(&mut ctl, "die")?;
    ensure!(got == "killed", "victim host answered {got:?}");
    let killed = Instant::now();
    to_steady.post()?;
    let (mid_transfer, lost) = match to_victim.wait(Some(HANG)) {
        Err(e) => (true, e),
        // It finished before the kill: the next one meets the dead peer.
        Ok(()) => {
            to_victim.post()?;
            (false, to_victim.wait(Some(HANG)).err().ok_or("a write to a killed peer completed")?)
        }
    };
    let detected = killed.elapsed();
    let bound = death_bound(&QpConfig::default());
    let completion = match &lost {
        EngineError::PeerLost { peer, completion } if peer == "victim" => completion.to_string(),
        e => return Err(format!("the transfer to the killed peer failed with {e}, not PeerLost naming it").into()),
    };
    to_steady.wait(Some(HANG))?;
    let steady_ok = say(&mut ctl, "steady?")?;
    ensure!(steady_ok == "steady notified twice", "steady side answered {steady_ok:?}");
    // The victim again, same name, a new process and address.
    let again = me.load_remote(&recv_blob(&mut OobChannel::accept(&TcpListener::bind(("0.0.0.0", port + 2))?, CTL_TIMEOUT)?)?)?.memory("t")?;
    let reconnect = Instant::now();
    let to_again = engine_write(&me, &src, &again, "again")?;
    to_again.post()?;
    to_again.wait(Some(HANG))?;
    let reconnect_ms = reconnect.elapsed().as_millis() as u64;
    let verdict = say(&mut ctl, "again?")?;
    figure(json!({
        "scenario": "engine-peer-death", "transfer_bytes": ENGINE_LEN, "killed_mid_transfer": mid_transfer,
        "error": "PeerLost", "completion": completion, "detected_ms": detected.as_millis() as u64,
        "bound_ms": bound.as_millis() as u64, "other_peer": steady_ok, "restarted_peer": verdict,
        "reconnect_and_write_ms": reconnect_ms,
    }));
    ensure!(detected <= bound, "the dead peer took {detected:?} to be reported, over the {bound:?} bound");
    ensure!(verdict == "verified", "the restarted victim said {verdict:?}");
    step(&mut ctl, "engine done")
}

fn engine_victim_host(port: u16) -> R<()> {
    let mut ctl = control(Role::B, port)?;
    let steady = engine_agent("steady")?;
    steady.alloc("t", ENGINE_LEN)?;
    send_blob(&mut ctl, &steady.metadata())?;
    let spawn = |round: u16| {
        Command::new(std::env::current_exe()?).args(["engine-victim", &format!("{} {round}", port + 1 + round)]).stdin(Stdio::null()).spawn()
    };
    let mut child = spawn(0)?;
    let got = step(&mut ctl, "connected").and_then(|()| say(&mut ctl, "killed"));
    let killed = child.kill().and_then(|()| child.wait());
    ensure!(got? == "die", "driver did not ask the victim to die");
    ensure!(killed?.code().is_none(), "the victim exited by itself instead of being killed");
    let notes = [steady.wait_notification(Some(HANG))?, steady.wait_notification(Some(HANG))?];
    let ok = notes.iter().all(|n| n.peer == "driver" && n.msg == b"steady");
    ctl.exchange(&Handshake { app: if ok { b"steady notified twice".to_vec() } else { format!("{notes:?}").into_bytes() }, ..Default::default() })?;
    let mut again = spawn(1)?;
    let status = again.wait()?;
    say(&mut ctl, if status.success() { "verified" } else { "the restarted victim failed" })?;
    step(&mut ctl, "engine done")
}

/// The victim agent, a child of B's side: `PORT ROUND`. Publishes its
/// metadata to A on PORT; round 0 then waits to be killed, round 1 checks
/// the bytes of A's write when its notification arrives, and exits.
fn engine_victim(spec: &str) -> R<()> {
    let v: Vec<u16> = spec.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
    let [port, round] = v[..] else { return Err(format!("bad engine victim spec {spec:?}").into()) };
    let me = engine_agent("victim")?;
    let t = me.alloc("t", ENGINE_LEN)?;
    send_blob(&mut OobChannel::connect(format!("{}:{port}", peer()?), CTL_TIMEOUT)?, &me.metadata())?;
    if round == 0 {
        loop {
            // Takes the driver's notifications; the kill comes in here.
            me.notifications()?;
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let n = me.wait_notification(Some(HANG))?;
    ensure!(n.msg == b"again" && n.peer == "driver", "got {n:?}");
    ensure!(t.range(..).is_ok() && { let mut b = vec![0; ENGINE_LEN]; t.read_at(0, &mut b)?; b == pattern(ENGINE_LEN, 41) }, "the bytes after the notification are wrong");
    Ok(())
}
