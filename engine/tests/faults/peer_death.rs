//! A peer that dies mid-transfer, in every way a process or host can: the
//! survivor's requests fail within the queue pair's retry bound, its memory
//! and descriptors are released, and it reconnects.

use super::*;

/// Outstanding requests kept in flight against the peer that will die.
const DEATH_DEPTH: usize = 32;

/// The longest a survivor may wait for its outstanding requests to fail:
/// each of the `retry_cnt + 1` tries waits for the local ACK timeout,
/// 4.096 µs × 2^timeout, which the InfiniBand spec lets an HCA stretch to
/// four times that; plus one second for scheduling in the emulated guests.
pub(super) fn death_bound(cfg: &QpConfig) -> Duration {
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

pub(super) fn peer_death(role: Role, port: u16) -> R<()> {
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
pub(super) fn victim(spec: &str) -> R<()> {
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
