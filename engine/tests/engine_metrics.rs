//! Traffic with the metrics endpoint on, for a real scraper to read (the
//! bed's Prometheus: `testbed/metrics-bed`), and the cost a hostile
//! scraper puts on a transfer.
//!
//! Default mode: agent `metrics-src` (endpoint at `GPUDIRECT_METRICS`)
//! writes `GPUDIRECT_METRICS_MIB` MiB (64) of host memory to agent
//! `metrics-dst` (once the file `GPUDIRECT_METRICS_GO` exists, when
//! set) and reads 1 MiB back, prints one line
//! `MOVED {"out_host": N, "in_host": M}` and keeps both agents (and the
//! endpoint) up until the file `GPUDIRECT_METRICS_STOP` exists (or 120 s).
//!
//! Between two guests (`testbed/run --two`), a hostile scraper's cost:
//! `GPUDIRECT_METRICS_HOSTILE=serve` in guest A times 1 MiB writes
//! between its two agents in rounds, each without then with a hostile
//! scraper against its endpoint (on `$GPUDIRECT_SELF:9464`);
//! `GPUDIRECT_METRICS_HOSTILE=attack` in guest B is that scraper (1,000
//! silent connections, slow readers, 64 KiB request heads), switched
//! on and off by A over port 9465. A prints `HOSTILE {"quiet_mbs": Q,
//! "hostile_mbs": H, "slowdown": S, ...}` (medians over the rounds, and
//! the endpoint thread's share of a CPU under attack), and fails if the
//! median of the rounds' slowdowns passes
//! `GPUDIRECT_METRICS_MAX_SLOWDOWN` (0.01) or, where wider, half the
//! quiet rounds' own spread. The scraper has a machine of its own, as it
//! would: what is measured is what serving it costs the agent's host.
//!
//! Without `GPUDIRECT_TEST_DEVICE` it says it did not run and exits 0.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, Op, TransferRequest};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

const T: Option<Duration> = Some(Duration::from_secs(60));

fn agent(name: &str, device: &str, metrics: Option<SocketAddr>) -> R<Agent> {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device.to_owned()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.metrics = metrics;
    Ok(Agent::new(c)?)
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The hostile scraper: until `stop`, each of its threads does one thing
/// against the endpoint over and over.
fn hostile(addr: SocketAddr, stop: Arc<AtomicBool>) -> Vec<std::thread::JoinHandle<()>> {
    let mut threads = Vec::new();
    // 1,000 connections that never say anything, reopened as closed.
    let s = stop.clone();
    threads.push(std::thread::spawn(move || {
        let mut held: Vec<TcpStream> = Vec::new();
        while !s.load(Ordering::Relaxed) {
            held.retain(|c| c.peer_addr().is_ok());
            while held.len() < 1000 {
                match TcpStream::connect(addr) {
                    Ok(c) => held.push(c),
                    Err(_) => break,
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }));
    // Slow readers: a whole request, then one byte of the answer a second.
    for _ in 0..2 {
        let s = stop.clone();
        threads.push(std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let Ok(mut c) = TcpStream::connect(addr) else { continue };
                let _ = c.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
                let mut b = [0u8; 1];
                while !s.load(Ordering::Relaxed) && c.read(&mut b).is_ok_and(|n| n == 1) {
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }));
    }
    // Huge request heads, one connection after another.
    let s = stop.clone();
    threads.push(std::thread::spawn(move || {
        let head = [b"GET /metrics HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 64 << 10], b"\r\n\r\n"].concat();
        while !s.load(Ordering::Relaxed) {
            let Ok(mut c) = TcpStream::connect(addr) else { continue };
            let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = c.set_write_timeout(Some(Duration::from_secs(2)));
            let _ = c.write_all(&head);
            let _ = c.read_to_end(&mut Vec::new());
        }
    }));
    threads
}

/// CPU time (user and system) of this process's threads whose name
/// starts with `prefix`, from /proc.
fn thread_cpu(prefix: &str) -> Duration {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut ticks = 0u64;
    for task in std::fs::read_dir("/proc/self/task").into_iter().flatten().flatten() {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else { continue };
        if !stat[open + 1..close].starts_with(prefix) {
            continue;
        }
        let f: Vec<&str> = stat[close + 2..].split(' ').collect();
        // Fields 14 and 15 of stat(5): utime, stime (here from field 3).
        ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    }
    Duration::from_secs_f64(ticks as f64 / tick)
}

/// MB/s of `req` posted and waited for over about `secs` seconds.
fn rate(req: &TransferRequest, bytes: u64, secs: f64) -> R<f64> {
    let t = Instant::now();
    let mut n = 0u64;
    while t.elapsed().as_secs_f64() < secs {
        req.post()?;
        req.wait(T)?;
        n += 1;
    }
    Ok((n * bytes) as f64 / t.elapsed().as_secs_f64() / 1e6)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Guest B: the hostile scraper, on while guest A says so.
fn attack() -> R<()> {
    let peer: std::net::IpAddr = std::env::var("GPUDIRECT_PEER")?.parse()?;
    let t = Instant::now();
    let control = loop {
        match TcpStream::connect((peer, 9465)) {
            Ok(c) => break c,
            Err(_) if t.elapsed() < Duration::from_secs(300) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(e.into()),
        }
    };
    let target = SocketAddr::new(peer, 9464);
    let mut on: Option<(Arc<AtomicBool>, Vec<std::thread::JoinHandle<()>>)> = None;
    for line in BufReader::new(control).lines() {
        match line?.as_str() {
            "on" => on = Some({ let stop = Arc::new(AtomicBool::new(false)); (stop.clone(), hostile(target, stop)) }),
            "off" | "end" => {
                if let Some((stop, threads)) = on.take() {
                    stop.store(true, Ordering::Relaxed);
                    for th in threads {
                        let _ = th.join();
                    }
                }
            }
            other => return Err(format!("unexpected {other:?} from guest A").into()),
        }
    }
    Ok(())
}

/// Guest A: 1 MiB writes timed without and with guest B's hostile
/// scraper against this agent's endpoint.
fn serve(device: &str) -> R<()> {
    let me: std::net::IpAddr = std::env::var("GPUDIRECT_SELF")?.parse()?;
    let src = agent("metrics-src", device, Some(SocketAddr::new(me, 9464)))?;
    let dst = agent("metrics-dst", device, None)?;
    let buf = src.alloc("src", 1 << 20)?;
    dst.alloc("t", 1 << 20)?;
    let t = src.load_remote(&dst.metadata())?.memory("t")?;
    let write = src.prepare(Op::Write, &[(buf.range(..)?, t.range(..)?)], None)?;
    let (mut control, _) = TcpListener::bind((me, 9465))?.accept()?;
    let rounds: usize = env_or("GPUDIRECT_METRICS_ROUNDS", 7);
    let secs: f64 = env_or("GPUDIRECT_METRICS_SECS", 3.0);
    rate(&write, 1 << 20, 1.0)?;
    let (mut quiet, mut loud) = (Vec::new(), Vec::new());
    let (mut endpoint_cpu, mut hostile_time) = (Duration::ZERO, Duration::ZERO);
    for round in 0..rounds {
        let q = rate(&write, 1 << 20, secs)?;
        control.write_all(b"on\n")?;
        std::thread::sleep(Duration::from_millis(500));
        let (cpu, t) = (thread_cpu("gpudirect-metri"), Instant::now());
        let h = rate(&write, 1 << 20, secs)?;
        endpoint_cpu += thread_cpu("gpudirect-metri") - cpu;
        hostile_time += t.elapsed();
        control.write_all(b"off\n")?;
        std::thread::sleep(Duration::from_millis(500));
        eprintln!("engine_metrics: round {round}: {q:.1} MB/s quiet, {h:.1} MB/s with the hostile scraper");
        quiet.push(q);
        loud.push(h);
    }
    control.write_all(b"end\n")?;
    let served = src.stats();
    let (q, h) = (median(quiet.clone()), median(loud.clone()));
    // Each round's pair compared (drift between rounds cancels), the
    // median of those; the bound is 1%, or half the spread of the quiet
    // rounds among themselves where the bed's own noise is wider (a
    // single-vCPU emulated guest beside another one).
    let slowdown = median(quiet.iter().zip(&loud).map(|(q, h)| (q - h) / q).collect());
    let noise = (quiet.iter().copied().fold(f64::MIN, f64::max) - quiet.iter().copied().fold(f64::MAX, f64::min)) / q / 2.0;
    let share = endpoint_cpu.as_secs_f64() / hostile_time.as_secs_f64();
    println!(
        "HOSTILE {{\"quiet_mbs\":{q:.1},\"hostile_mbs\":{h:.1},\"slowdown\":{slowdown:.4},\"quiet_noise\":{noise:.4},\"endpoint_cpu\":{share:.4},\"rounds\":{rounds},\"writes\":{}}}",
        served.ops[0].requests.completed
    );
    let max = env_or("GPUDIRECT_METRICS_MAX_SLOWDOWN", 0.01f64).max(noise);
    if slowdown > max {
        return Err(format!("the hostile scraper slowed 1 MiB writes by {:.1}% (at most {:.1}%: 1%, or the quiet rounds' own noise)", slowdown * 100.0, max * 100.0).into());
    }
    Ok(())
}

fn run(device: &str) -> R<()> {
    match std::env::var("GPUDIRECT_METRICS_HOSTILE").as_deref() {
        Ok("serve") => return serve(device),
        Ok("attack") => return attack(),
        _ => {}
    }
    let metrics = gpudirect_engine::metrics_addr()?.or(Some(SocketAddr::from(([127, 0, 0, 1], 0))));
    let src = agent("metrics-src", device, metrics)?;
    let dst = agent("metrics-dst", device, None)?;
    let mib: usize = env_or("GPUDIRECT_METRICS_MIB", 64);
    let chunk = 4 << 20;
    let buf = src.alloc("src", chunk)?;
    dst.alloc("t", chunk)?;
    let t = src.load_remote(&dst.metadata())?.memory("t")?;
    let write = src.prepare(Op::Write, &[(buf.range(..)?, t.range(..)?)], None)?;
    let addr = src.metrics_addr().ok_or("no metrics endpoint")?;
    eprintln!("engine_metrics: metrics at http://{addr}/metrics");
    // The scraper may want to see the endpoint first.
    if let Ok(go) = std::env::var("GPUDIRECT_METRICS_GO") {
        let t = Instant::now();
        while !std::path::Path::new(&go).exists() {
            if t.elapsed() > Duration::from_secs(120) {
                return Err(format!("{go} never appeared").into());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    for _ in 0..mib.div_ceil(4) {
        write.post()?;
        write.wait(T)?;
    }
    let read = src.prepare(Op::Read, &[(buf.range(..1 << 20)?, t.range(..1 << 20)?)], None)?;
    read.post()?;
    read.wait(T)?;
    println!("MOVED {{\"out_host\":{},\"in_host\":{}}}", mib.div_ceil(4) * chunk, 1 << 20);
    let stop = std::env::var("GPUDIRECT_METRICS_STOP").unwrap_or_else(|_| "/tmp/engine-metrics-stop".into());
    let t = Instant::now();
    while !std::path::Path::new(&stop).exists() && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

fn main() -> ExitCode {
    let Ok(device) = std::env::var("GPUDIRECT_TEST_DEVICE") else {
        println!("engine_metrics: not run (needs an RDMA device: set GPUDIRECT_TEST_DEVICE; testbed/run sets it in a Soft-RoCE guest)");
        return ExitCode::SUCCESS;
    };
    match run(&device) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("engine_metrics: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
