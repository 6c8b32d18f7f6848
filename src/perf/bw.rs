//! `gpudirect bw`: bandwidth as perftest's `ib_*_bw` measures it: bytes ×
//! iterations over the time from the first post to the last completion,
//! with `tx_depth` requests in flight and one completion every `cq_mod`.

use std::time::Instant;

use clap::Args;
use serde::{Deserialize, Serialize};

use gpudirect::{RecvWr, SendList, SendWr, WcOpcode, WorkCompletion};

use super::{connect, progress, share_report, sizes, Common, Compare, Link, Op, Params, Res};

/// `gpudirect bw` options.
#[derive(Args, Clone, Debug)]
pub struct BwArgs {
    #[command(flatten)]
    pub common: Common,
    /// Operation.
    #[arg(long, value_enum, default_value = "write")]
    pub op: Op,
    /// Work requests in flight (perftest's -t).
    #[arg(long, short = 't', default_value_t = 128)]
    pub tx_depth: u32,
    /// One signaled completion every this many requests (perftest's --cq-mod).
    #[arg(long, short = 'Q', default_value_t = 100)]
    pub cq_mod: u32,
    /// Requests posted per call, one doorbell each (perftest's --post_list).
    #[arg(long, short = 'l', default_value_t = 16)]
    pub post_list: u32,
    /// Sleep on completion events instead of busy polling (perftest's -e).
    #[arg(long = "events", short = 'e')]
    pub use_events: bool,
    /// With --gpu (client): measure host memory too, on the same NIC pair
    /// in the same run, and compare: GPU memory at about host-memory speed
    /// is GPUDirect RDMA at work; at about half, the copy path. Without a
    /// usable GPU the host half is measured and the GPU half is named as
    /// not measurable (exit status 1).
    #[arg(long, requires = "gpu")]
    pub compare_host: bool,
}

/// What `bw` printed: one run, or a comparison.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BwOutput {
    /// One run on each side's memory.
    Single(BwReport),
    /// Host memory, then GPU memory (`--compare-host`).
    Compared(CompareReport),
}

impl BwOutput {
    /// Whether everything asked for was measured.
    pub fn complete(&self) -> bool {
        match self {
            BwOutput::Single(_) => true,
            BwOutput::Compared(c) => c.gpu.is_some(),
        }
    }
}

impl std::fmt::Display for BwOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BwOutput::Single(r) => r.fmt(f),
            BwOutput::Compared(c) => c.fmt(f),
        }
    }
}

/// One half of a comparison: the memories and the results.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Half {
    /// The client's buffer.
    pub client_memory: String,
    /// The server's buffer.
    pub server_memory: String,
    /// Per size.
    pub results: Vec<BwResult>,
}

/// `bw --compare-host`: host memory and GPU memory on the same NIC pair.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareReport {
    /// `"gpudirect bw --compare-host"`.
    pub tool: String,
    /// The operation.
    pub op: Op,
    /// Host memory on both sides.
    pub host: Half,
    /// Each side's own memory (GPU memory where it has `--gpu`); `None`
    /// when it could not be measured ([`gpu_error`](Self::gpu_error)).
    pub gpu: Option<Half>,
    /// Why the GPU half could not be measured.
    pub gpu_error: Option<String>,
    /// GPU over host average bandwidth at the largest size.
    pub ratio: Option<f64>,
    /// What the ratio says.
    pub verdict: String,
}

/// What the ratio of GPU-memory to host-memory bandwidth says.
pub fn judge_ratio(ratio: f64, gpu_memory: &str) -> String {
    if gpu_memory.contains("staged") {
        return format!("{ratio:.2}: the GPU buffer is staged through host memory by its policy ({gpu_memory}): not GPUDirect RDMA");
    }
    if ratio >= 0.85 {
        format!("{ratio:.2}, about 1: GPU memory moves at host-memory speed: GPUDirect RDMA carries it directly")
    } else if ratio <= 0.65 {
        format!("{ratio:.2}, about half or less: the GPU side goes through host memory (the copy path) or a slower PCIe path: run `gpudirect doctor` on both nodes")
    } else {
        format!("{ratio:.2}: GPU memory is slower than host memory on this pair: check the GPU's PCIe link and its path to the NIC (`gpudirect doctor --verbose`, bandwidth.path)")
    }
}

impl CompareReport {
    fn new(op: Op, host: Half, gpu: Result<Half, String>) -> CompareReport {
        let avg = |h: &Half| h.results.iter().max_by_key(|r| r.bytes).map(|r| r.bw_avg_mb_s);
        let (gpu, gpu_error) = match gpu {
            Ok(g) => (Some(g), None),
            Err(e) => (None, Some(e)),
        };
        let ratio = match (avg(&host), gpu.as_ref().and_then(avg)) {
            (Some(h), Some(g)) if h > 0.0 => Some(g / h),
            _ => None,
        };
        let verdict = match (&ratio, &gpu, &gpu_error) {
            (Some(r), Some(g), _) => judge_ratio(*r, &g.client_memory),
            (_, _, Some(e)) => format!("the GPU half cannot be measured here: {e}"),
            _ => "no result to compare".to_owned(),
        };
        CompareReport { tool: "gpudirect bw --compare-host".into(), op, host, gpu, gpu_error, ratio, verdict }
    }
}

impl std::fmt::Display for CompareReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let line = |f: &mut std::fmt::Formatter<'_>, what: &str, h: &Half| -> std::fmt::Result {
            writeln!(f, " {what} (client: {}; server: {})", h.client_memory, h.server_memory)?;
            for r in &h.results {
                writeln!(f, "   {:<10} bytes  BW average {:>10.2} MB/s  peak {:>10.2} MB/s", r.bytes, r.bw_avg_mb_s, r.bw_peak_mb_s)?;
            }
            Ok(())
        };
        line(f, "host memory", &self.host)?;
        match (&self.gpu, &self.gpu_error) {
            (Some(g), _) => line(f, "GPU memory", g)?,
            (None, Some(e)) => writeln!(f, " GPU memory: not measured: {e}")?,
            (None, None) => {}
        }
        writeln!(f, " GPU / host: {}", self.verdict)
    }
}

/// One size's result, perftest's columns.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BwResult {
    /// Message size.
    pub bytes: usize,
    /// Messages.
    pub iterations: u32,
    /// Best rate between two successive signaled completions, MB/s (2^20).
    pub bw_peak_mb_s: f64,
    /// bytes × iterations / elapsed, MB/s (2^20).
    pub bw_avg_mb_s: f64,
    /// Millions of messages per second.
    pub msg_rate_mpps: f64,
}

/// The client's report (the server prints it too).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BwReport {
    /// `"gpudirect bw"`.
    pub tool: String,
    /// The operation.
    pub op: Op,
    /// Work requests in flight.
    pub tx_depth: u32,
    /// The client's buffer (`host memory`, `GPU0 memory, path: dma-buf`).
    pub client_memory: String,
    /// The server's buffer.
    pub server_memory: String,
    /// Per size.
    pub results: Vec<BwResult>,
}

impl std::fmt::Display for BwReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]")?;
        for r in &self.results {
            writeln!(f, " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}", r.bytes, r.iterations, r.bw_peak_mb_s, r.bw_avg_mb_s, r.msg_rate_mpps)?;
        }
        Ok(())
    }
}

/// Runs either side; both return the client's report. A comparison
/// (`--compare-host` on the client; the server learns it from the
/// client's parameters) measures host memory, then each side's own.
pub fn run(a: &BwArgs) -> Res<BwOutput> {
    // A comparing client finds out first whether its GPU can be used: when
    // not, the host half is still measured, and the report says why the
    // GPU half is not.
    let mut gpu_error = None;
    let compare = match (a.compare_host, a.common.gpu) {
        (true, Some(n)) => match gpudirect::Gpu::open(n) {
            Ok(_) => Compare::Both,
            Err(e) => {
                gpu_error = Some(e.to_string());
                Compare::HostOnly
            }
        },
        _ => Compare::No,
    };
    let params = Params { op: a.op, sizes: sizes(&a.common, 65536), iters: a.common.iters.unwrap_or(5000), tx_depth: a.tx_depth, compare };
    let mut link = connect(&a.common, params, 0, 1)?;
    if !a.common.json {
        let extra = format!("  cq_mod {}  post_list {}", a.cq_mod, a.post_list);
        eprintln!("{}", super::banner("gpudirect bw", &link, link.params.tx_depth, &extra));
    }
    let first = measure(&mut link, a)?;
    let half = |link: &Link, results| Half { client_memory: link.memory.clone(), server_memory: link.peer_memory.clone(), results };
    if link.params.compare == Compare::No {
        link.oob.barrier()?;
        let report = (!link.is_server).then(|| BwReport {
            tool: "gpudirect bw".into(),
            op: link.params.op,
            tx_depth: link.params.tx_depth,
            client_memory: link.memory.clone(),
            server_memory: link.peer_memory.clone(),
            results: first,
        });
        return Ok(BwOutput::Single(share_report(&mut link, report)?));
    }
    let host = half(&link, first);
    let gpu = if link.use_second() {
        if !a.common.json {
            eprintln!("gpudirect bw: now {} (peer: {})", link.memory, link.peer_memory);
        }
        let results = measure(&mut link, a)?;
        Ok(half(&link, results))
    } else {
        Err(gpu_error.unwrap_or_else(|| "the client's GPU cannot be used".into()))
    };
    link.oob.barrier()?;
    let report = (!link.is_server).then(|| CompareReport::new(link.params.op, host, gpu));
    Ok(BwOutput::Compared(share_report(&mut link, report)?))
}

/// Every size once, on the link's current memories: the client's results
/// (none on the server).
fn measure(link: &mut Link, a: &BwArgs) -> Res<Vec<BwResult>> {
    let mut results = Vec::new();
    for (i, size) in link.params.sizes.clone().into_iter().enumerate() {
        progress("gpudirect bw", link, i, size);
        let r = if link.is_server { serve(link, size)? } else { Some(drive(link, size, a.cq_mod, a.post_list, a.use_events)?) };
        results.extend(r);
    }
    Ok(results)
}

/// Server side of one size: passive for RDMA; for sends, keeps receives posted.
fn serve(link: &mut Link, size: usize) -> Res<Option<BwResult>> {
    if link.params.op != Op::Send {
        link.oob.barrier()?;
        link.oob.barrier()?;
        return Ok(None);
    }
    let iters = u64::from(link.params.iters);
    let depth = u64::from(link.rx_depth);
    let local = link.mr.slice(0..size)?;
    let mut posted = 0u64;
    let mut wrs = Vec::with_capacity(depth as usize);
    while posted < depth.min(iters) {
        wrs.push(RecvWr::new(local).wr_id(posted));
        posted += 1;
    }
    link.qp.post_recv(&wrs)?;
    link.oob.barrier()?;
    let mut got = 0u64;
    let mut wcs = [WorkCompletion::default(); 64];
    while got < iters {
        let n = link.cq.poll(&mut wcs)?;
        wrs.clear();
        for wc in &wcs[..n] {
            let wc = wc.ok()?;
            if wc.opcode == WcOpcode::Recv {
                got += 1;
                if posted < iters {
                    wrs.push(RecvWr::new(local).wr_id(posted));
                    posted += 1;
                }
            }
        }
        link.qp.post_recv(&wrs)?;
    }
    link.oob.barrier()?;
    Ok(None)
}

/// The offsets, in a batch of `n` requests starting at request `posted`,
/// of those that ask for a completion: every `cq_mod`-th request of the run
/// (perftest's `--cq-mod`) and its last one.
fn signaled(posted: u64, n: u64, cq_mod: u64, iters: u64) -> impl Iterator<Item = usize> {
    let last = (posted + n == iters && !(posted + n).is_multiple_of(cq_mod)).then_some(n - 1);
    ((cq_mod - 1 - posted % cq_mod)..n).step_by(cq_mod as usize).chain(last).map(|j| j as usize)
}

/// Client side of one size.
fn drive(link: &mut Link, size: usize, cq_mod: u32, post_list: u32, use_events: bool) -> Res<BwResult> {
    let p = link.params.clone();
    let iters = u64::from(p.iters);
    let depth = u64::from(p.tx_depth);
    let cq_mod = u64::from(cq_mod.clamp(1, p.tx_depth));
    let batch = u64::from(post_list.max(1));
    let local = link.mr.slice(0..size)?;
    let base = match p.op {
        Op::Write => SendWr::write(local, &link.peer, 0)?,
        Op::Read => SendWr::read(local, &link.peer, 0)?,
        Op::Send => SendWr::send(local),
    };
    // The server has its receives posted (or nothing to do) once past this.
    link.oob.barrier()?;
    let mut wrs = vec![base; batch as usize];
    // Full batches repost one prepared list, as perftest reposts its own;
    // only the requests whose signaling changes are touched per post.
    let mut list = SendList::new(&vec![base.unsignaled(); batch as usize])?;
    let mut marked: Vec<usize> = Vec::new();
    let mut wcs = [WorkCompletion::default(); 64];
    let (mut posted, mut done) = (0u64, 0u64);
    let mut marks: Vec<(u64, Instant)> = Vec::with_capacity((iters / cq_mod + 2) as usize);
    let start = Instant::now();
    marks.push((0, start));
    while done < iters {
        while posted < iters && posted - done < depth {
            let n = batch.min(depth - (posted - done)).min(iters - posted);
            if n == batch {
                for &j in &marked {
                    list.set_signaled(j, false)?;
                }
                marked.clear();
                marked.extend(signaled(posted, n, cq_mod, iters));
                for &j in &marked {
                    list.set_signaled(j, true)?;
                    list.set_wr_id(j, posted + j as u64)?;
                }
                link.qp.post_list(&mut list)?;
            } else {
                for (w, i) in wrs.iter_mut().zip(posted..posted + n) {
                    *w = base.wr_id(i).unsignaled();
                }
                for j in signaled(posted, n, cq_mod, iters) {
                    wrs[j] = base.wr_id(posted + j as u64);
                }
                link.qp.post_send(&wrs[..n as usize])?;
            }
            posted += n;
        }
        let n = if use_events { link.cq.wait(&mut wcs, Some(std::time::Duration::from_secs(60)))? } else { link.cq.poll(&mut wcs)? };
        for wc in &wcs[..n] {
            let wc = wc.ok()?;
            // A signaled completion means every request up to it is done (RC order).
            done = done.max(wc.wr_id + 1);
            marks.push((done, Instant::now()));
        }
    }
    let elapsed = marks.last().map(|m| m.1).unwrap_or(start).duration_since(start).as_secs_f64();
    link.oob.barrier()?;
    let mb = (1u64 << 20) as f64;
    let peak = marks
        .windows(2)
        .filter_map(|w| {
            let dt = w[1].1.duration_since(w[0].1).as_secs_f64();
            (dt > 0.0).then(|| (w[1].0 - w[0].0) as f64 * size as f64 / dt / mb)
        })
        .fold(0.0, f64::max);
    Ok(BwResult {
        bytes: size,
        iterations: p.iters,
        bw_peak_mb_s: peak,
        bw_avg_mb_s: iters as f64 * size as f64 / elapsed / mb,
        msg_rate_mpps: iters as f64 / elapsed / 1e6,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ratio_says_direct_copy_path_or_in_between() {
        assert!(judge_ratio(0.97, "GPU0 memory, path: dma-buf").contains("about 1: GPU memory moves at host-memory speed"));
        assert!(judge_ratio(0.48, "GPU0 memory, path: dma-buf").contains("about half or less: the GPU side goes through host memory"));
        assert!(judge_ratio(0.75, "GPU0 memory, path: peer memory").contains("slower than host memory"));
        assert!(judge_ratio(0.99, "GPU0 memory, host-staged").contains("staged through host memory by its policy"));
        let r = |avg| BwResult { bytes: 65536, iterations: 10, bw_peak_mb_s: avg, bw_avg_mb_s: avg, msg_rate_mpps: 0.0 };
        let half = |m: &str, avg| Half { client_memory: m.into(), server_memory: "host memory".into(), results: vec![r(avg)] };
        let c = CompareReport::new(Op::Write, half("host memory", 10000.0), Ok(half("GPU0 memory, path: dma-buf", 5100.0)));
        assert_eq!(c.ratio, Some(0.51));
        assert!(c.to_string().contains(" GPU / host: 0.51, about half"), "{c}");
        let c = CompareReport::new(Op::Write, half("host memory", 10000.0), Err("CUDA is not available".into()));
        assert!(!BwOutput::Compared(c.clone()).complete() && c.ratio.is_none());
        assert!(c.to_string().contains(" GPU memory: not measured: CUDA is not available"), "{c}");
    }

    /// The batches' signaled requests are exactly the run's every
    /// `cq_mod`-th and last request, whatever the batch boundaries.
    #[test]
    fn signaled_requests_follow_cq_mod_across_batches() {
        for (iters, cq_mod, batch) in [(1000u64, 100u64, 16u64), (37, 5, 4), (10, 1, 3), (7, 10, 7), (64, 8, 8), (5, 2, 1)] {
            let mut got = Vec::new();
            let mut posted = 0;
            while posted < iters {
                let n = batch.min(iters - posted);
                got.extend(signaled(posted, n, cq_mod, iters).map(|j| posted + j as u64));
                posted += n;
            }
            let want: Vec<u64> = (0..iters).filter(|i| (i + 1) % cq_mod == 0 || i + 1 == iters).collect();
            assert_eq!(got, want, "iters {iters} cq_mod {cq_mod} batch {batch}");
        }
    }
}
