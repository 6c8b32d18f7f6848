//! One side of gpudirect's Rust engine in `testbed/compare-peers`, which
//! runs the same workloads through Mooncake's Transfer Engine and NIXL
//! (`testbed/peer_workloads.py`, whose docstring defines the line protocol
//! on stdin/stdout, the workloads and the bytes; this file follows it).
//!
//! ```text
//! cargo run --release --example peer_workloads -- target|initiator
//! ```
//!
//! The device is `$PEERS_DEVICE` (default rxe0); the control port listens
//! on `$PEERS_HOST` (default 127.0.0.1), where no secret is needed;
//! `$PEERS_QPS_PER_RAIL` overrides the engine's queue pairs per rail.

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, EngineError, Op, Peer, Registration, TransferRequest};

const BUF: usize = 16 << 20;
const POISON: u8 = 0xEE;
const WARMUP: usize = 4;
const WAIT: Duration = Duration::from_secs(30);
/// name, op, block bytes, blocks per request, distinct requests: as WORKLOADS there.
const WORKLOADS: [(&str, Op, usize, usize, usize); 6] = [
    ("write-1m", Op::Write, 1 << 20, 1, 8),
    ("write-64x64k", Op::Write, 64 << 10, 64, 2),
    ("write-64x4k", Op::Write, 4 << 10, 64, 2),
    ("read-1m", Op::Read, 1 << 20, 1, 8),
    ("read-64x64k", Op::Read, 64 << 10, 64, 2),
    ("read-64x4k", Op::Read, 4 << 10, 64, 2),
];

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

struct Plan {
    wid: usize,
    op: Op,
    block: usize,
    per_req: usize,
    nreqs: usize,
    local: Vec<usize>,
    remote: Vec<usize>,
}

impl Plan {
    fn new(name: &str) -> R<Plan> {
        let wid = WORKLOADS.iter().position(|w| w.0 == name).ok_or_else(|| format!("unknown workload {name:?}"))?;
        let (_, op, block, per_req, nreqs) = WORKLOADS[wid];
        let slots = BUF / block;
        let n = per_req * nreqs;
        let local = (0..n).map(|g| (5 * g + 1) % slots * block).collect();
        let remote = (0..n).map(|g| (7 * g + 3) % slots * block).collect();
        Ok(Plan { wid, op, block, per_req, nreqs, local, remote })
    }

    fn notify(&self) -> bool {
        self.op == Op::Write && self.per_req > 1
    }

    fn data(&self, g: usize) -> Vec<u8> {
        let base = ((self.wid as u64 + 1) << 56) | ((g as u64) << 32);
        (0..self.block as u64 / 8).flat_map(|i| (base | i).to_le_bytes()).collect()
    }

    fn fill(&self, reg: &Registration, offsets: &[usize]) -> R<()> {
        for (g, &off) in offsets.iter().enumerate() {
            reg.write_at(off, &self.data(g))?;
        }
        Ok(())
    }

    fn poison(&self, reg: &Registration, offsets: &[usize]) -> R<()> {
        let junk = vec![POISON; self.block];
        for &off in offsets {
            reg.write_at(off, &junk)?;
        }
        Ok(())
    }

    fn check(&self, reg: &Registration, offsets: &[usize]) -> R<()> {
        let mut got = vec![0; self.block];
        for (g, &off) in offsets.iter().enumerate() {
            reg.read_at(off, &mut got)?;
            let want = self.data(g);
            if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
                return Err(format!("block {g} at offset {off}: byte {i} is {:#x}, not {:#x}", got[i], want[i]).into());
            }
        }
        Ok(())
    }

    fn requests(&self, agent: &Agent, buf: &Registration, peer: &Peer) -> R<Vec<TransferRequest>> {
        let remote = peer.memory("buf")?;
        let note: Option<&[u8]> = if self.notify() { Some(b"batch") } else { None };
        (0..self.nreqs)
            .map(|r| {
                let entries = (r * self.per_req..(r + 1) * self.per_req)
                    .map(|g| {
                        let (lo, ro) = (self.local[g], self.remote[g] as u64);
                        Ok((buf.range(lo..lo + self.block)?, remote.range(ro..ro + self.block as u64)?))
                    })
                    .collect::<R<Vec<_>>>()?;
                Ok(agent.prepare(self.op, &entries, note)?)
            })
            .collect()
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    // A driver that went away ends this side at its next read of stdin.
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// (user + system, user) seconds of this process, every thread.
fn cpu_seconds() -> (f64, f64) {
    // SAFETY: getrusage writes only into the struct it is given.
    let ru = unsafe {
        let mut ru = std::mem::zeroed::<libc::rusage>();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    (secs(ru.ru_utime) + secs(ru.ru_stime), secs(ru.ru_utime))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> R<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    (0..s.len()).step_by(2).map(|i| Ok(u8::from_str_radix(&s[i..i + 2], 16)?)).collect()
}

fn initiator_run(agent: &Agent, buf: &Registration, peer: &Peer, name: &str, n: usize) -> R<()> {
    let plan = Plan::new(name)?;
    if plan.op == Op::Write {
        plan.fill(buf, &plan.local)?;
    } else {
        plan.poison(buf, &plan.local)?;
    }
    let reqs = plan.requests(agent, buf, peer)?;
    let run = |i: usize| -> R<()> {
        let r = &reqs[i % reqs.len()];
        r.post()?;
        Ok(r.wait(Some(WAIT))?)
    };
    (0..WARMUP).try_for_each(run)?;
    let ((cpu0, user0), t0) = (cpu_seconds(), Instant::now());
    (0..n).try_for_each(run)?;
    let (secs, (cpu, user)) = (t0.elapsed().as_secs_f64(), cpu_seconds());
    let (cpu, user) = (cpu - cpu0, user - user0);
    if plan.op == Op::Read {
        plan.check(buf, &plan.local).map_err(|e| format!("{name}: read back wrong: {e}"))?;
    }
    let notes = if plan.notify() { n + WARMUP } else { 0 };
    say(&format!("RESULT {secs:.6} {cpu:.6} {user:.6} {n} {} {notes}", n * plan.per_req * plan.block));
    Ok(())
}

fn target_cmd(buf: &Registration, count: &Mutex<usize>, words: &[&str]) -> R<()> {
    let plan = Plan::new(words.get(1).ok_or("no workload")?)?;
    if words[0] == "PREP" {
        return if plan.op == Op::Write { plan.poison(buf, &plan.remote) } else { plan.fill(buf, &plan.remote) };
    }
    let want: usize = words.get(2).ok_or("no count")?.parse()?;
    let deadline = Instant::now() + WAIT;
    let got = loop {
        let mut c = count.lock().map_err(|_| "the notification thread panicked")?;
        if *c >= want || Instant::now() > deadline {
            break std::mem::take(&mut *c);
        }
        drop(c);
        std::thread::sleep(Duration::from_millis(10));
    };
    if got != want {
        return Err(format!("{}: {got} notifications arrived, {want} were sent", words[1]).into());
    }
    if plan.op == Op::Write {
        plan.check(buf, &plan.remote).map_err(|e| format!("{}: wrong bytes at the target: {e}", words[1]))?;
    }
    Ok(())
}

fn side(role: &str) -> R<()> {
    let mut config = AgentConfig::named(format!("peers-{role}"));
    config.devices = vec![std::env::var("PEERS_DEVICE").unwrap_or_else(|_| "rxe0".into())];
    config.listen = format!("{}:0", std::env::var("PEERS_HOST").unwrap_or_else(|_| "127.0.0.1".into())).parse()?;
    if let Ok(q) = std::env::var("PEERS_QPS_PER_RAIL") {
        config.qps_per_rail = Some(q.parse()?);
    }
    let agent = Agent::new(config)?;
    let buf = agent.alloc("buf", BUF)?;
    buf.write_at(0, &vec![POISON; BUF])?;
    say(&format!("READY {}", hex(&agent.metadata().encode()?)));
    let count = Mutex::new(0usize);
    let stop = AtomicBool::new(false);
    let failed = AtomicUsize::new(0);
    std::thread::scope(|s| -> R<()> {
        let mut peer = None;
        let result = (|| -> R<()> {
            for line in std::io::stdin().lock().lines() {
                let line = line?;
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.first().copied() {
                    None => continue,
                    Some("QUIT") => break,
                    Some("PEER") => {
                        let md = AgentMetadata::decode(&unhex(words.get(1).ok_or("no blob")?)?)?;
                        peer = Some(agent.load_remote(&md)?);
                        if role == "target" {
                            s.spawn(|| {
                                while !stop.load(Ordering::Relaxed) {
                                    match agent.wait_notification(Some(Duration::from_millis(200))) {
                                        Ok(_) => *count.lock().expect("not poisoned") += 1,
                                        Err(EngineError::Timeout(_)) => {}
                                        Err(e) => {
                                            eprintln!("peer_workloads: notifications: {e}");
                                            failed.store(1, Ordering::Relaxed);
                                            return;
                                        }
                                    }
                                }
                            });
                        }
                        say("OK");
                    }
                    Some("RUN") => {
                        let p = peer.as_ref().ok_or("RUN before PEER")?;
                        initiator_run(&agent, &buf, p, words.get(1).ok_or("no workload")?, words.get(2).ok_or("no count")?.parse()?)?;
                    }
                    Some("PREP" | "CHECK") => {
                        if failed.load(Ordering::Relaxed) != 0 {
                            return Err("the notification thread failed".into());
                        }
                        target_cmd(&buf, &count, &words)?;
                        say("OK");
                    }
                    Some(other) => return Err(format!("unknown command {other:?}").into()),
                }
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        result
    })
}

fn main() -> ExitCode {
    let role = std::env::args().nth(1).unwrap_or_default();
    if role != "target" && role != "initiator" {
        eprintln!("usage: peer_workloads target|initiator");
        return ExitCode::from(2);
    }
    match side(&role) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            say(&format!("ERR {}", e.to_string().replace('\n', " ")));
            ExitCode::FAILURE
        }
    }
}
