//! The transfer engine with a peer killed mid-transfer: only the transfers
//! to it fail, within the bound; the others complete and a restarted peer
//! is reconnected.

use super::peer_death::death_bound;
use super::*;

/// Bytes each engine transfer of the scenario moves: long enough on
/// Soft-RoCE (about half a second) that the kill lands mid-transfer.
const ENGINE_LEN: usize = 8 << 20;

fn engine_agent(name: &str) -> R<Agent> {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device()];
    c.secret = Some(gpudirect_engine::ClusterSecret::new(testkit::SECRET.to_vec())?);
    Ok(Agent::new(c)?)
}

fn send_blob(ch: &mut OobChannel, md: &AgentMetadata) -> R<()> {
    ch.exchange(&Handshake { app: md.encode()?, ..Default::default() })?;
    Ok(())
}

fn recv_blob(ch: &mut OobChannel) -> R<AgentMetadata> {
    Ok(AgentMetadata::decode(&ch.exchange(&Handshake::default())?.app)?)
}

/// Waits for a transfer to a peer that is alive. rxe now and then stops
/// retransmitting a queue pair's requests with no completion at all (see
/// docs/reliability.md); a transport's answer is the engine's: give the
/// post up ([`TransferRequest::abort`]) and post it again, which
/// reconnects. Once per scenario is the bed's; a second time fails it.
fn wait_alive(req: &TransferRequest, stalls: &mut u32) -> R<()> {
    loop {
        match req.wait(Some(HANG)) {
            Err(EngineError::Timeout(_)) if *stalls == 0 => {
                *stalls += 1;
                ensure!(req.abort()?, "the timed-out post was no longer in flight");
                println!("rxe stall: no completion within {HANG:?} from a live peer; post aborted and posted again");
                req.post()?;
            }
            r => return Ok(r?),
        }
    }
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
pub(super) fn engine_peer_death(role: Role, port: u16) -> R<()> {
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
    let mut stalls = 0;
    // Connected and working, both.
    for r in [&to_steady, &to_victim] {
        r.post()?;
        wait_alive(r, &mut stalls)?;
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
    wait_alive(&to_steady, &mut stalls)?;
    let steady_ok = say(&mut ctl, "steady?")?;
    ensure!(steady_ok == "steady notified twice", "steady side answered {steady_ok:?}");
    // The victim again, same name, a new process and address.
    let again = me.load_remote(&recv_blob(&mut OobChannel::accept(&TcpListener::bind(("0.0.0.0", port + 2))?, CTL_TIMEOUT)?)?)?.memory("t")?;
    let reconnect = Instant::now();
    let to_again = engine_write(&me, &src, &again, "again")?;
    to_again.post()?;
    wait_alive(&to_again, &mut stalls)?;
    let reconnect_ms = reconnect.elapsed().as_millis() as u64;
    let verdict = say(&mut ctl, "again?")?;
    figure(json!({
        "scenario": "engine-peer-death", "transfer_bytes": ENGINE_LEN, "killed_mid_transfer": mid_transfer,
        "error": "PeerLost", "completion": completion, "detected_ms": detected.as_millis() as u64,
        "bound_ms": bound.as_millis() as u64, "other_peer": steady_ok, "restarted_peer": verdict,
        "reconnect_and_write_ms": reconnect_ms, "rxe_stalls": stalls,
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
    // Long enough for the driver to ride out one rxe stall (`wait_alive`).
    let notes = [steady.wait_notification(Some(3 * HANG))?, steady.wait_notification(Some(3 * HANG))?];
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
pub(super) fn engine_victim(spec: &str) -> R<()> {
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
    let n = me.wait_notification(Some(3 * HANG))?;
    ensure!(n.msg == b"again" && n.peer == "driver", "got {n:?}");
    ensure!(t.range(..).is_ok() && { let mut b = vec![0; ENGINE_LEN]; t.read_at(0, &mut b)?; b == pattern(ENGINE_LEN, 41) }, "the bytes after the notification are wrong");
    Ok(())
}
