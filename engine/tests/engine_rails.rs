//! Several queue pairs per rail between two hosts: B writes sliced
//! requests into A over two queue pairs of one rail, the second queue
//! pair's part posted late on purpose (`fault::delay_lane_posts`) while
//! another thread of B reaps the first's completions. A checks every byte
//! when each notification arrives: a notification sent once the first
//! queue pair's part completed, without waiting for the second's, would
//! arrive before the late bytes. B checks the two queue pairs carried
//! even shares. Needs two RDMA hosts:
//!
//! ```text
//! bin=$(testbed/test-bin engine_rails)
//! testbed/run --two --a "$bin" --b "$bin"
//! ```
//!
//! Elsewhere (`cargo test`) it reports its scenario as not run and exits 0.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, ClusterSecret, Op, RendezvousConfig, RendezvousServer, TcpRendezvous};
use testkit::{pattern, Role, ScenarioResult};

const SCENARIOS: [&str; 1] = ["qps-per-rail"];
const RDV_PORT: u16 = 18600;
const LEN: usize = 4 << 20;
const ROUNDS: u64 = 4;
/// How late the second queue pair's part goes out.
const LATE: Duration = Duration::from_millis(400);
/// Bound on each step: the other side may still be booting.
const STEP: Duration = Duration::from_secs(180);

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    testkit::run_two_host("engine_rails", &SCENARIOS, &args, |role, _, _| match role {
        Role::A => host_a(),
        Role::B => host_b(),
    })
}

/// Where round `round` lands in A's memory: B does not wait for A's
/// checks, so no round overwrites another.
fn at(round: u64) -> usize {
    (round as usize - 1) * LEN
}

fn secret() -> ClusterSecret {
    ClusterSecret::new(testkit::SECRET.to_vec()).expect("the test secret is long enough")
}

fn agent(name: &str) -> Result<Agent, Box<dyn std::error::Error + Send + Sync>> {
    let mut c = AgentConfig::named(name);
    c.devices = vec![testkit::device()];
    c.secret = Some(secret());
    // rxe defaults to one; the scenario is about two.
    c.qps_per_rail = Some(2);
    Ok(Agent::new(c)?)
}

/// A: hosts the rendezvous and the target memory; checks every round's
/// bytes when its notification arrives.
fn host_a() -> ScenarioResult {
    let me = std::env::var("GPUDIRECT_SELF")?;
    let _server = RendezvousServer::bind_with((me.as_str(), RDV_PORT), RendezvousConfig { secret: Some(secret()), ..Default::default() })?;
    let rdv = TcpRendezvous::new((me.as_str(), RDV_PORT), STEP)?.with_secret(secret());
    let a = agent("a")?;
    let t = a.alloc("t", LEN * ROUNDS as usize)?;
    a.publish(&rdv)?;
    for round in 1..=ROUNDS {
        let n = a.wait_notification(Some(STEP))?;
        if n.peer != "b" || n.msg != format!("round {round}").as_bytes() {
            return Err(format!("expected round {round} from b, got {:?} from {}", String::from_utf8_lossy(&n.msg), n.peer).into());
        }
        let mut got = vec![0; LEN];
        t.read_at(at(round), &mut got)?;
        let want = pattern(LEN, round);
        if let Some(at) = got.iter().zip(&want).position(|(g, w)| g != w) {
            let last = got.iter().zip(&want).rposition(|(g, w)| g != w).unwrap_or(at);
            return Err(format!("round {round}: the notification arrived before bytes {at}..={last} of {LEN} were in place").into());
        }
        println!("round {round}: all {LEN} bytes in place when the notification arrived");
    }
    // B's connections: two queue pairs on the one rail.
    if a.connections() != 2 {
        return Err(format!("{} connections to b, expected 2 (two queue pairs on one rail)", a.connections()).into());
    }
    Ok(())
}

/// B: writes `ROUNDS` sliced requests, the second queue pair late.
fn host_b() -> ScenarioResult {
    let peer_ip = std::env::var("GPUDIRECT_PEER")?;
    let b = agent("b")?;
    let src = b.alloc("src", LEN)?;
    let rdv = TcpRendezvous::new((peer_ip.as_str(), RDV_PORT), STEP)?.with_secret(secret());
    let started = Instant::now();
    let a = loop {
        match b.lookup("a", &rdv, STEP) {
            Ok(p) => break p,
            Err(e) if started.elapsed() < STEP => {
                eprintln!("a not published yet: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let t = a.memory("t")?;
    gpudirect::fault::delay_lane_posts(1, LATE);
    for round in 1..=ROUNDS {
        src.write_at(0, &pattern(LEN, round))?;
        let dst = t.range(at(round) as u64..(at(round) + LEN) as u64)?;
        let req = b.prepare(Op::Write, &[(src.range(..)?, dst)], Some(format!("round {round}").as_bytes()))?;
        let qps = req.queue_pairs();
        if qps.iter().map(|q| (q.0, q.1)).collect::<Vec<_>>() != [(0, 0), (0, 1)] || qps[0].2 != qps[1].2 {
            return Err(format!("the request is cut as {qps:?}, not in two even slices on rail 0's two queue pairs").into());
        }
        // Another thread reaps while the post sleeps before the second
        // part: the first part's completion is taken then.
        let posting = AtomicBool::new(true);
        std::thread::scope(|s| -> ScenarioResult {
            let reaper = s.spawn(|| {
                let mut looks = 0u64;
                while posting.load(Ordering::Acquire) {
                    let _ = req.status();
                    looks += 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
                looks
            });
            let posted = req.post();
            posting.store(false, Ordering::Release);
            let looks = reaper.join().map_err(|_| "the reaping thread panicked")?;
            posted?;
            if looks < 10 {
                return Err(format!("the reaping thread looked {looks} times while the post slept").into());
            }
            Ok(())
        })?;
        req.wait(Some(STEP))?;
    }
    let stats = b.nic_stats();
    let per_qp = &stats[0].qp_bytes;
    let want = ROUNDS * LEN as u64 / 2;
    if per_qp.len() != 2 || per_qp.iter().any(|&q| q.abs_diff(want) > want / 10) {
        return Err(format!("bytes per queue pair {per_qp:?}, expected {want} each within 10 %").into());
    }
    println!("FIGURE {{\"scenario\":\"qps-per-rail\",\"qp_bytes\":{per_qp:?},\"late_ms\":{}}}", LATE.as_millis());
    Ok(())
}
