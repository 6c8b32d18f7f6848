//! Traffic with the metrics endpoint on, for a real scraper to read (the
//! bed's Prometheus: `testbed/metrics-bed`), and the cost a hostile
//! scraper puts on a transfer.
//!
//! Default mode: agent `metrics-src` (endpoint at `GPUDIRECT_METRICS`)
//! writes `GPUDIRECT_METRICS_MIB` MiB (64) of host memory to agent
//! `metrics-dst` and reads 1 MiB back, prints one line
//! `MOVED {"out_host": N, "in_host": M}` and keeps both agents (and the
//! endpoint) up until the file `GPUDIRECT_METRICS_STOP` exists (or 120 s).
//!
//! `GPUDIRECT_METRICS_HOSTILE=1`: the same writes timed in rounds, each
//! round without then with a hostile scraper against the endpoint (1,000
//! silent connections, slow readers, 64 KiB request heads, a flood of
//! scrapes); prints `HOSTILE {"quiet_mbs": Q, "hostile_mbs": H,
//! "slowdown": S}` with medians over the rounds, and fails if the
//! slowdown passes `GPUDIRECT_METRICS_MAX_SLOWDOWN` (0.01).
//!
//! Without `GPUDIRECT_TEST_DEVICE` it says it did not run and exits 0.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
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
    // Huge request heads, and a flood of whole scrapes.
    for huge in [true, false] {
        let s = stop.clone();
        threads.push(std::thread::spawn(move || {
            let head = if huge { [b"GET /metrics HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 64 << 10], b"\r\n\r\n"].concat() } else { b"GET /metrics HTTP/1.1\r\n\r\n".to_vec() };
            while !s.load(Ordering::Relaxed) {
                let Ok(mut c) = TcpStream::connect(addr) else { continue };
                let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = c.write_all(&head);
                let _ = c.read_to_end(&mut Vec::new());
            }
        }));
    }
    threads
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

fn run(device: &str) -> R<()> {
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
    if std::env::var("GPUDIRECT_METRICS_HOSTILE").is_ok_and(|v| v == "1") {
        let small = src.prepare(Op::Write, &[(buf.range(..1 << 20)?, t.range(..1 << 20)?)], None)?;
        let rounds: usize = env_or("GPUDIRECT_METRICS_ROUNDS", 5);
        let secs: f64 = env_or("GPUDIRECT_METRICS_SECS", 3.0);
        rate(&small, 1 << 20, 1.0)?;
        let (mut quiet, mut loud) = (Vec::new(), Vec::new());
        for round in 0..rounds {
            let q = rate(&small, 1 << 20, secs)?;
            let stop = Arc::new(AtomicBool::new(false));
            let threads = hostile(addr, stop.clone());
            std::thread::sleep(Duration::from_millis(500));
            let h = rate(&small, 1 << 20, secs)?;
            stop.store(true, Ordering::Relaxed);
            for th in threads {
                let _ = th.join();
            }
            eprintln!("engine_metrics: round {round}: {q:.1} MB/s quiet, {h:.1} MB/s with the hostile scraper");
            quiet.push(q);
            loud.push(h);
        }
        let (q, h) = (median(quiet), median(loud));
        let slowdown = (q - h) / q;
        println!("HOSTILE {{\"quiet_mbs\":{q:.1},\"hostile_mbs\":{h:.1},\"slowdown\":{slowdown:.4}}}");
        let max: f64 = env_or("GPUDIRECT_METRICS_MAX_SLOWDOWN", 0.01);
        if slowdown > max {
            return Err(format!("the hostile scraper slowed 1 MiB writes by {:.1}% (at most {:.1}%)", slowdown * 100.0, max * 100.0).into());
        }
        return Ok(());
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
