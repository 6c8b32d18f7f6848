//! Weight sync for RL: a trainer broadcasts its parameter buffer to N
//! inference agents after every step ([`Agent::broadcast`]); the
//! trainer's NIC sends the parameters once, the inference agents forward
//! chunks to each other as they land. Each inference agent checks every
//! byte of the new weights when the step's notification arrives, then
//! tells the trainer it is done with them (a small write with a
//! notification), and the trainer starts the next step only once all
//! are: new weights never land under an engine still reading old ones.
//!
//! ```text
//! # all on this host: a rendezvous, the trainer, and 4 inference processes
//! cargo run --release --example weight_sync -- --inference-agents 4 -d rxe0
//! # or over hosts: the trainer hosts the rendezvous
//! trainer:  GPUDIRECT_SECRET_FILE=secret cargo run --release --example weight_sync -- --trainer --inference-agents 2 --rendezvous 0.0.0.0:18700
//! each i:   GPUDIRECT_SECRET_FILE=secret cargo run --release --example weight_sync -- --inference I --inference-agents 2 --rendezvous trainerhost:18700
//! ```
//!
//! Every agent loads every other's metadata (inference agents write to
//! each other). Any error, wrong byte or missing receiver exits non-zero.

use std::net::{SocketAddr, ToSocketAddrs};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Parser;
use gpudirect_engine::{Agent, AgentConfig, Op, Rendezvous, RendezvousServer, TcpRendezvous};

#[derive(Parser, Debug, Clone)]
#[command(about = "A trainer broadcasting its parameters to inference agents every step, verified")]
struct Args {
    /// Be the trainer (and host the rendezvous at --rendezvous).
    #[arg(long, conflicts_with = "inference")]
    trainer: bool,
    /// Be inference agent I (from 0).
    #[arg(long, value_name = "I")]
    inference: Option<usize>,
    /// How many inference agents there are.
    #[arg(long, default_value_t = 4)]
    inference_agents: usize,
    /// The rendezvous server's address (the trainer binds it). Without a
    /// role: a free loopback port, everything started here.
    #[arg(long, value_name = "HOST:PORT")]
    rendezvous: Option<String>,
    /// RDMA devices, in rail order (comma-separated).
    #[arg(short = 'd', long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Parameter bytes, in MiB.
    #[arg(long, default_value_t = 16)]
    mib: usize,
    /// Training steps, each followed by a broadcast.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Bound on each wait, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
    /// Listen on loopback only (the processes of a run on one host).
    #[arg(long, hide = true)]
    loopback: bool,
}

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// The parameters after step `step`: a cheap stream every side can make.
fn params(len: usize, step: u64) -> Vec<u8> {
    let mut x = step.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn agent(args: &Args, name: &str, loopback: bool) -> R<Agent> {
    let mut c = AgentConfig::named(name);
    c.devices = args.devices.clone();
    if loopback {
        c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    }
    Ok(Agent::new(c)?)
}

/// Looks up and loads `name`, waiting for it to be published.
fn find(a: &Agent, rdv: &dyn Rendezvous, name: &str, t: Duration) -> R<()> {
    a.lookup(name, rdv, t)?;
    Ok(())
}

fn inference(args: &Args, i: usize, rdv_addr: &str, loopback: bool) -> R<()> {
    let t = Duration::from_secs(args.timeout);
    let len = args.mib << 20;
    let me = agent(args, &format!("infer-{i}"), loopback)?;
    let weights = me.alloc("weights", len)?;
    let done = me.alloc("done", 8)?;
    let rdv = TcpRendezvous::new(rdv_addr, t)?;
    me.publish(&rdv)?;
    find(&me, &rdv, "trainer", t)?;
    for j in (0..args.inference_agents).filter(|&j| j != i) {
        find(&me, &rdv, &format!("infer-{j}"), t)?;
    }
    let trainer = me.peer("trainer")?;
    let slot = trainer.memory("done")?.range(i as u64 * 8..i as u64 * 8 + 8)?;
    // Announce readiness once every peer is loaded.
    let ready = me.prepare(Op::Write, &[(done.range(..)?, slot.clone())], Some(b"ready"))?;
    ready.post()?;
    ready.wait(Some(t))?;
    let mut got = vec![0; len];
    for step in 1..=args.steps {
        // Waiting here is also what forwards this agent's chunks.
        let n = me.wait_notification(Some(t))?;
        let want = format!("step {step}");
        if n.peer != "trainer" || n.msg != want.as_bytes() {
            return Err(format!("infer-{i}: expected {want:?} from the trainer, got {:?} from {}", String::from_utf8_lossy(&n.msg), n.peer).into());
        }
        weights.read_at(0, &mut got)?;
        if got != params(len, step) {
            return Err(format!("infer-{i}: step {step}'s weights were not all in place when its notification came").into());
        }
        let verified = me.prepare(Op::Write, &[(done.range(..)?, slot.clone())], Some(want.as_bytes()))?;
        verified.post()?;
        verified.wait(Some(t))?;
    }
    // Keep forwarding until the trainer is done with everyone.
    let n = me.wait_notification(Some(t))?;
    if n.msg != b"bye" {
        return Err(format!("infer-{i}: unexpected {:?} from {}", String::from_utf8_lossy(&n.msg), n.peer).into());
    }
    Ok(())
}

/// Waits for one notification `msg` from each inference agent.
fn gather(a: &Agent, n: usize, msg: &[u8], t: Duration) -> R<()> {
    let mut seen = vec![false; n];
    while seen.contains(&false) {
        let note = a.wait_notification(Some(t))?;
        let i = note.peer.strip_prefix("infer-").and_then(|s| s.parse::<usize>().ok()).filter(|&i| i < n);
        match i {
            Some(i) if note.msg == msg && !seen[i] => seen[i] = true,
            _ => return Err(format!("trainer: unexpected {:?} from {}", String::from_utf8_lossy(&note.msg), note.peer).into()),
        }
    }
    Ok(())
}

fn trainer(args: &Args, rdv_addr: &str, loopback: bool) -> R<()> {
    let t = Duration::from_secs(args.timeout);
    let (len, n) = (args.mib << 20, args.inference_agents);
    let me = agent(args, "trainer", loopback)?;
    let params_buf = me.alloc("params", len)?;
    let _done = me.alloc("done", 8 * n)?;
    let rdv = TcpRendezvous::new(rdv_addr, t)?;
    me.publish(&rdv)?;
    let mut weights = Vec::with_capacity(n);
    for i in 0..n {
        let name = format!("infer-{i}");
        find(&me, &rdv, &name, t)?;
        weights.push(me.peer(&name)?.memory("weights")?);
    }
    let targets = weights.iter().map(|w| w.range(..len as u64)).collect::<Result<Vec<_>, _>>()?;
    gather(&me, n, b"ready", t)?;
    for step in 1..=args.steps {
        params_buf.write_at(0, &params(len, step))?; // the optimizer step
        let sent = me.nic_stats().iter().map(|s| s.bytes).sum::<u64>();
        let started = Instant::now();
        let cast = me.broadcast(&params_buf.range(..)?, &targets, format!("step {step}").as_bytes())?;
        cast.post()?;
        cast.wait(Some(t))?;
        let took = started.elapsed();
        let nic = me.nic_stats().iter().map(|s| s.bytes).sum::<u64>() - sent;
        gather(&me, n, format!("step {step}").as_bytes(), t)?;
        println!(
            "step {step}: {} MiB to {n} inference agents in {:.2} s ({:.0} MB/s per receiver), the trainer's NIC sent {:.2} x the parameters; every byte verified",
            args.mib,
            took.as_secs_f64(),
            len as f64 / took.as_secs_f64() / 1e6,
            nic as f64 / len as f64
        );
    }
    for w in &weights {
        let bye = me.prepare(Op::Write, &[(params_buf.range(..8)?, w.range(..8)?)], Some(b"bye"))?;
        bye.post()?;
        bye.wait(Some(t))?;
    }
    Ok(())
}

fn main() -> ExitCode {
    tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_writer(std::io::stderr).init();
    let args = Args::parse();
    let r = match (args.trainer, args.inference, &args.rendezvous) {
        (true, _, Some(addr)) => {
            let bound = addr.to_socket_addrs().ok().and_then(|mut a| a.next());
            match bound.map(RendezvousServer::bind).transpose() {
                Ok(server) => {
                    let at = server.as_ref().map(|s| s.addr().to_string()).unwrap_or_else(|| addr.clone());
                    trainer(&args, &at, false)
                }
                Err(e) => Err(e.into()),
            }
        }
        (false, Some(i), Some(addr)) => inference(&args, i, addr, args.loopback),
        (false, None, None) => launch(&args),
        _ => Err("give --trainer or --inference I with --rendezvous, or neither for a run on this host".into()),
    };
    match r {
        Ok(()) => {
            println!("weight_sync: done");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("weight_sync: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Everything on this host: a loopback rendezvous, the trainer here, each
/// inference agent a process of its own.
fn launch(args: &Args) -> R<()> {
    let server = RendezvousServer::bind("127.0.0.1:0")?;
    let addr = server.addr().to_string();
    let exe = std::env::current_exe()?;
    let mut children = Vec::new();
    for i in 0..args.inference_agents {
        let mut c = Command::new(&exe);
        c.args(["--inference", &i.to_string(), "--rendezvous", &addr, "--loopback"]);
        c.args(["--inference-agents", &args.inference_agents.to_string(), "--mib", &args.mib.to_string()]);
        c.args(["--steps", &args.steps.to_string(), "--timeout", &args.timeout.to_string()]);
        if !args.devices.is_empty() {
            c.args(["-d", &args.devices.join(",")]);
        }
        children.push(c.spawn()?);
    }
    let r = trainer(args, &addr, true);
    for (i, mut c) in children.into_iter().enumerate() {
        let st = c.wait()?;
        if !st.success() && r.is_ok() {
            return Err(format!("inference agent {i} failed ({st})").into());
        }
    }
    r
}
