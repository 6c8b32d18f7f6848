//! Agents in two hosts find each other through a real etcd server in host
//! A (`engine::EtcdRendezvous`), and outlive its outage: once connections
//! exist, the server is stopped; transfers over them go on, a new lookup
//! fails with a typed error within its bound, and after a restart lookups
//! work again (old names, kept by etcd, and a name published after).
//! Needs two RDMA hosts and the `etcd` binary (Debian: etcd-server) in A:
//!
//! ```text
//! bin=$(testbed/test-bin engine_etcd)
//! testbed/run --two --a "$bin" --b "$bin"
//! ```
//!
//! The two sides pace each other with the engine's own notifications; each
//! block is checked against its pattern when its notification arrives.
//! Elsewhere (`cargo test`) it reports its scenario as not run and exits 0.

use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, EngineError, EtcdRendezvous, Notification, Op, Peer, Registration, Rendezvous};
use testkit::{pattern, Etcd, Role, ScenarioResult};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const SCENARIOS: [&str; 1] = ["etcd-outage"];
const CLIENT_PORT: u16 = 2379;
const PEER_PORT: u16 = 2380;
const LEN: usize = 1 << 20;
/// Bound on each step: the other side may still be booting or building
/// its agent in an emulated guest.
const STEP: Duration = Duration::from_secs(180);
/// Bound on each etcd request.
const RPC: Duration = Duration::from_secs(2);

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    testkit::run_two_host("engine_etcd", &SCENARIOS, &args, |role, _, _| match role {
        Role::A => host_a(),
        Role::B => host_b(),
    })
}

fn agent(name: &str) -> R<Agent> {
    let mut c = AgentConfig::named(name);
    c.devices = vec![std::env::var("GPUDIRECT_TEST_DEVICE").unwrap_or_else(|_| "rxe0".into())];
    c.secret = Some(gpudirect_engine::ClusterSecret::new(testkit::SECRET.to_vec())?);
    Ok(Agent::new(c)?)
}

/// Waits for the notification `msg` from `from`, then checks `mem`
/// against the pattern of `seed`.
fn expect(agent: &Agent, from: &str, msg: &str, mem: Option<(&Registration, u64)>) -> R<Notification> {
    let n = agent.wait_notification(Some(STEP))?;
    if n.peer != from || n.msg != msg.as_bytes() {
        return Err(format!("expected {msg:?} from {from}, got {:?} from {}", String::from_utf8_lossy(&n.msg), n.peer).into());
    }
    if let Some((mem, seed)) = mem {
        let mut got = vec![0; LEN];
        mem.read_at(0, &mut got)?;
        if got != pattern(LEN, seed) {
            return Err(format!("{msg:?} arrived, but its bytes are not the pattern of seed {seed}").into());
        }
    }
    Ok(n)
}

/// Writes the pattern of `seed` (or nothing, `seed` 0: a bare message)
/// into `peer`'s memory `t`, notifying `msg`, and waits for it.
fn send(agent: &Agent, src: &Registration, peer: &Peer, seed: u64, msg: &str) -> R<()> {
    let len = if seed == 0 { 8 } else { LEN };
    if seed != 0 {
        src.write_at(0, &pattern(LEN, seed))?;
    }
    let dst = peer.memory("t")?;
    let req = agent.prepare(Op::Write, &[(src.range(..len)?, dst.range(..len as u64)?)], Some(msg.as_bytes()))?;
    req.post()?;
    req.wait(Some(STEP))?;
    Ok(())
}

/// A: hosts etcd and agents `a` (published before the outage) and `a2`
/// (published after the restart).
fn host_a() -> ScenarioResult {
    let me = std::env::var("GPUDIRECT_SELF")?;
    let mut etcd = Etcd::start(&me, &me, CLIENT_PORT, PEER_PORT);
    let rdv = EtcdRendezvous::connect(&[etcd.url()], RPC)?;
    let a = agent("a")?;
    let t = a.alloc("t", LEN)?;
    let src = a.alloc("src", LEN)?;
    a.publish(&rdv)?;
    expect(&a, "b", "first", Some((&t, 1)))?;
    let b = a.lookup("b", &rdv, RPC)?;
    etcd.stop();
    send(&a, &src, &b, 0, "etcd stopped")?;
    expect(&a, "b", "during the outage", Some((&t, 2)))?;
    expect(&a, "b", "lookups failed", None)?;
    let restarted = Instant::now();
    etcd.restart();
    let a2 = agent("a2")?;
    let t2 = a2.alloc("t", LEN)?;
    a2.publish(&rdv)?;
    let restart_ms = restarted.elapsed().as_millis();
    send(&a, &src, &b, 0, "etcd back")?;
    expect(&a2, "b", "to a2", Some((&t2, 3)))?;
    expect(&a, "b", "a found again", Some((&t, 4)))?;
    println!("FIGURE {{\"scenario\":\"etcd-outage\",\"etcd_restart_and_publish_ms\":{restart_ms}}}");
    Ok(())
}

/// B: finds `a` through etcd, writes to it before, during and after the
/// outage, and checks what lookups say meanwhile.
fn host_b() -> ScenarioResult {
    let url = format!("http://{}:{CLIENT_PORT}", std::env::var("GPUDIRECT_PEER")?);
    let b = agent("b")?;
    let _t = b.alloc("t", LEN)?; // where A's bare messages land
    let src = b.alloc("src", LEN)?;
    // A may still be starting etcd: the first contact is retried.
    let started = Instant::now();
    let rdv = loop {
        match EtcdRendezvous::connect(&[url.as_str()], RPC).and_then(|r| r.publish(&b.metadata()).map(|()| r)) {
            Ok(r) => break r,
            Err(e) if started.elapsed() < STEP => {
                eprintln!("etcd at {url} not there yet: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let a = b.lookup("a", &rdv, STEP)?;
    send(&b, &src, &a, 1, "first")?;
    expect(&b, "a", "etcd stopped", None)?;
    send(&b, &src, &a, 2, "during the outage")?;
    let asked = Instant::now();
    let outage_lookup = b.lookup("a2", &rdv, Duration::from_secs(1));
    let failed_in = asked.elapsed();
    match &outage_lookup {
        Err(EngineError::Rendezvous { server, .. }) if *server == url => {}
        r => return Err(format!("a lookup while etcd is stopped gave {r:?}, not a Rendezvous error naming {url}").into()),
    }
    if failed_in > Duration::from_secs(1) + RPC + Duration::from_secs(1) {
        return Err(format!("the lookup during the outage took {failed_in:?}").into());
    }
    if !matches!(rdv.publish(&b.metadata()), Err(EngineError::Rendezvous { .. })) {
        return Err("a publish while etcd is stopped did not fail".into());
    }
    send(&b, &src, &a, 0, "lookups failed")?;
    expect(&b, "a", "etcd back", None)?;
    // The client reconnects on its own, with a backoff: until it has, a
    // lookup fails fast, as during the outage.
    let back = Instant::now();
    let a2 = loop {
        match b.lookup("a2", &rdv, STEP) {
            Err(EngineError::Rendezvous { reason, .. }) if back.elapsed() < Duration::from_secs(30) => {
                eprintln!("etcd not reachable again yet: {reason}");
                std::thread::sleep(Duration::from_millis(200));
            }
            r => break r?,
        }
    };
    let reconnect_ms = back.elapsed().as_millis();
    send(&b, &src, &a2, 3, "to a2")?;
    // `a` was published before the outage: etcd kept it on disk.
    let a_again = b.lookup("a", &rdv, Duration::ZERO)?;
    send(&b, &src, &a_again, 4, "a found again")?;
    println!(
        "FIGURE {{\"scenario\":\"etcd-outage\",\"outage_lookup_failed_ms\":{},\"lookup_after_restart_ms\":{reconnect_ms}}}",
        failed_in.as_millis()
    );
    Ok(())
}
