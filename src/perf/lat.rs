//! `gpudirect lat`: latency as perftest's `ib_write_lat` / `ib_send_lat`
//! measure it: a ping-pong, each side answering the other's message, with
//! the one-way latency taken as half of each round trip.
//!
//! For writes each side spins on the last byte of its receive area (the
//! marker changes every iteration); for sends it waits for the receive
//! completion. Messages up to the inline limit are posted inline and
//! mostly unsignaled, as perftest does.

use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use gpudirect::{RecvWr, SendWr, WcOpcode, WorkCompletion};

use super::{connect, progress, share_report, sizes, Common, Link, Op, Params, Res};

/// Inline limit requested from the queue pair (perftest's default for RC).
const MAX_INLINE: u32 = 220;
/// Unsignaled inline messages get a signaled one this often, so the send
/// queue drains.
const SIGNAL_EVERY: u32 = 32;

/// `gpudirect lat` options.
#[derive(Args, Clone, Debug)]
pub struct LatArgs {
    #[command(flatten)]
    pub common: Common,
    /// Operation.
    #[arg(long, value_enum, default_value = "write")]
    pub op: LatOp,
}

/// What `lat` measures: ib_write_lat's and ib_send_lat's operations (an
/// RDMA read has no one-way latency to halve).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LatOp {
    /// RDMA write, each side polling the last byte of its buffer.
    Write,
    /// Send/receive.
    Send,
}

impl From<LatOp> for Op {
    fn from(op: LatOp) -> Op {
        match op {
            LatOp::Write => Op::Write,
            LatOp::Send => Op::Send,
        }
    }
}

/// One size's result, perftest's columns (microseconds, one way).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LatResult {
    /// Message size.
    pub bytes: usize,
    /// Round trips.
    pub iterations: u32,
    /// Smallest.
    pub t_min_us: f64,
    /// Largest.
    pub t_max_us: f64,
    /// Median (perftest's "typical").
    pub t_typical_us: f64,
    /// Mean.
    pub t_avg_us: f64,
    /// Standard deviation.
    pub t_stdev_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// 99.9th percentile.
    pub p999_us: f64,
}

/// The client's report (the server prints it too).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LatReport {
    /// `"gpudirect lat"`.
    pub tool: String,
    /// The operation.
    pub op: Op,
    /// The client's buffer (`host memory`, `GPU0 memory, path: dma-buf`).
    pub client_memory: String,
    /// The server's buffer.
    pub server_memory: String,
    /// Per size.
    pub results: Vec<LatResult>,
}

impl std::fmt::Display for LatReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]")?;
        for r in &self.results {
            writeln!(
                f,
                " {:<7} {:<11} {:<14.2} {:<12.2} {:<16.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
                r.bytes, r.iterations, r.t_min_us, r.t_max_us, r.t_typical_us, r.t_avg_us, r.t_stdev_us, r.p99_us, r.p999_us
            )?;
        }
        Ok(())
    }
}

/// Runs either side; both return the client's report.
pub fn run(a: &LatArgs) -> Res<LatReport> {
    // The client knows its operation now; a server learns it from the client (checked below).
    if a.common.gpu.is_some() && a.op == LatOp::Write && matches!(a.common.role(), super::Role::Client(_)) {
        return Err("with --gpu, latency is measured with --op send: a write's arrival is seen by polling the \
                    buffer's last byte, and the CPU cannot poll GPU memory"
            .into());
    }
    // Room for the unsignaled inline sends between two signaled ones, twice.
    let params = Params { op: a.op.into(), sizes: sizes(&a.common, 2), iters: a.common.iters.unwrap_or(1000), tx_depth: 4 * SIGNAL_EVERY, compare: super::Compare::No };
    // The buffer holds a receive area and a send area of the largest size.
    let mut link = connect(&a.common, params, MAX_INLINE, 2)?;
    if link.params.op == Op::Read {
        return Err("the client asked for read latency, which lat does not measure".into());
    }
    if link.mr.location() != gpudirect::Location::Host && link.params.op == Op::Write {
        return Err("the client asked for write latency, which needs host memory on both sides (the CPU polls the \
                    buffer's last byte): use --op send with --gpu"
            .into());
    }
    if !a.common.json {
        // One message in flight per direction, as ib_write_lat prints.
        eprintln!("{}", super::banner("gpudirect lat", &link, 1, ""));
    }
    let timeout = Duration::from_secs(a.common.timeout);
    let mut results = Vec::new();
    for (index, size) in link.params.sizes.clone().into_iter().enumerate() {
        progress("gpudirect lat", &link, index, size);
        let mut pp = PingPong::new(&link, size, timeout)?;
        link.oob.barrier()?;
        let mut rtts = Vec::with_capacity(link.params.iters as usize);
        for i in 0..link.params.iters {
            let rearm = i + 1 < link.params.iters;
            if link.is_server {
                pp.wait(&link, i, rearm)?;
                pp.send(&link, i)?;
            } else {
                let t0 = Instant::now();
                pp.send(&link, i)?;
                pp.wait(&link, i, rearm)?;
                rtts.push(t0.elapsed());
            }
        }
        pp.drain(&link)?;
        link.oob.barrier()?;
        if !link.is_server {
            results.push(stats(size, link.params.iters, rtts));
        }
    }
    link.oob.barrier()?;
    let report = (!link.is_server).then(|| LatReport {
        tool: "gpudirect lat".into(),
        op: link.params.op,
        client_memory: link.memory.clone(),
        server_memory: link.peer_memory.clone(),
        results,
    });
    share_report(&mut link, report)
}

/// One size's ping-pong state. Receive area: bytes [0, size); send area:
/// [size, 2 size) of the link's region.
struct PingPong {
    size: usize,
    inline: bool,
    unreaped: u32,
    timeout: Duration,
    wcs: [WorkCompletion; 8],
}

impl PingPong {
    fn new(link: &Link, size: usize, timeout: Duration) -> Res<PingPong> {
        link.mr.fill(0..2 * size, 0)?;
        let pp = PingPong { size, inline: size <= link.qp.max_inline_data() as usize, unreaped: 0, timeout, wcs: [WorkCompletion::default(); 8] };
        if link.params.op == Op::Send {
            link.qp.post_recv(&[RecvWr::new(link.mr.slice(0..size)?)])?;
        }
        Ok(pp)
    }

    fn marker(i: u32) -> u8 {
        (i % 255) as u8 + 1
    }

    /// Reaps completions; returns whether a receive completed.
    fn reap(&mut self, link: &Link) -> Res<bool> {
        let n = link.cq.poll(&mut self.wcs)?;
        let mut recv = false;
        for wc in &self.wcs[..n] {
            let wc = wc.ok()?;
            if wc.opcode == WcOpcode::Recv {
                recv = true;
            } else {
                self.unreaped = 0;
            }
        }
        Ok(recv)
    }

    fn send(&mut self, link: &Link, i: u32) -> Res<()> {
        let size = self.size;
        // Non-inline sources stay held until their completion is reaped;
        // the marker byte can be rewritten only after that.
        let deadline = Instant::now() + self.timeout;
        while !self.inline && self.unreaped > 0 {
            if self.reap(link)? {
                return Err("a message arrived before this side sent".into());
            }
            if Instant::now() > deadline {
                return Err("send completion did not arrive".into());
            }
        }
        link.mr.write_at(2 * size - 1, &[Self::marker(i)])?;
        let local = link.mr.slice(size..2 * size)?;
        let wr = match link.params.op {
            Op::Send => SendWr::send(local),
            _ => SendWr::write(local, &link.peer, 0)?,
        };
        let signaled = !self.inline || (i + 1).is_multiple_of(SIGNAL_EVERY);
        let wr = if self.inline { wr.inline() } else { wr };
        link.qp.post_send(&[if signaled { wr } else { wr.unsignaled() }])?;
        if signaled {
            self.unreaped = 1;
        }
        Ok(())
    }

    fn wait(&mut self, link: &Link, i: u32, rearm: bool) -> Res<()> {
        let size = self.size;
        let deadline = Instant::now() + self.timeout;
        loop {
            let recv = self.reap(link)?;
            let arrived = match link.params.op {
                Op::Send => recv,
                _ => link.mr.read_volatile(size - 1)? == Self::marker(i),
            };
            if arrived {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("message {i} of {size} bytes did not arrive within {:?}", self.timeout).into());
            }
        }
        if link.params.op == Op::Send && rearm {
            link.qp.post_recv(&[RecvWr::new(link.mr.slice(0..size)?)])?;
        }
        Ok(())
    }

    fn drain(&mut self, link: &Link) -> Res<()> {
        let deadline = Instant::now() + self.timeout;
        // Unsignaled inline sends leave pending entries until a signaled
        // one; post nothing more, just wait for what was signaled.
        while self.unreaped > 0 {
            self.reap(link)?;
            if Instant::now() > deadline {
                return Err("send completions did not arrive".into());
            }
        }
        Ok(())
    }
}

fn stats(size: usize, iters: u32, rtts: Vec<Duration>) -> LatResult {
    // perftest reports half the round trip.
    let mut v: Vec<f64> = rtts.iter().map(|d| d.as_secs_f64() * 1e6 / 2.0).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len().max(1) as f64;
    let avg = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - avg) * (x - avg)).sum::<f64>() / n;
    let pct = |p: f64| v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0);
    LatResult {
        bytes: size,
        iterations: iters,
        t_min_us: v.first().copied().unwrap_or(0.0),
        t_max_us: v.last().copied().unwrap_or(0.0),
        t_typical_us: pct(0.5),
        t_avg_us: avg,
        t_stdev_us: var.sqrt(),
        p99_us: pct(0.99),
        p999_us: pct(0.999),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_are_half_round_trips() {
        let rtts = (1..=1000).map(|us| Duration::from_micros(2 * us)).collect();
        let r = stats(8, 1000, rtts);
        assert_eq!((r.t_min_us, r.t_max_us), (1.0, 1000.0));
        // Nearest-rank on 0-based indices: round(999 p).
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert!(close(r.t_typical_us, 501.0), "{r:?}");
        assert!(close(r.t_avg_us, 500.5), "{r:?}");
        assert!(close(r.p99_us, 990.0) && close(r.p999_us, 999.0), "{r:?}");
    }
}
