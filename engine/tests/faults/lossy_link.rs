//! A lossy and reordering link (netem): transfers complete with every byte
//! right, retries counted, and an rxe stall rebuilt a bounded number of
//! times.

use super::*;

const LOSSY_REGION: usize = 4 << 20;
/// Message size on the lossy link: 16 packets at the link's 1024-byte RoCE
/// MTU. rxe counts retries per work request and resets the count only when
/// one completes, so under 5 % loss a 64 KiB message (64 packets) can use
/// up `retry_cnt` before it gets through; see docs/reliability.md.
const LOSSY_CHUNK: usize = 16 * 1024;
const LOSSY_DEPTH: usize = 32;

/// (name, netem settings, retry_cnt override). The last phase lowers the
/// retry count so that requests do run out of retries and the rebuild
/// path below is exercised on every run, not only when loss is unlucky.
fn lossy_phases() -> Vec<(&'static str, Option<&'static str>, Option<u8>)> {
    vec![
        ("clean", None, None),
        ("loss 1%", Some("loss 1%"), None),
        ("loss 5%", Some("loss 5%"), None),
        ("loss 5% + reordering", Some("delay 2ms reorder 25% 50% loss 5%"), None),
        ("loss 5%, retry_cnt 1", Some("loss 5%"), Some(1)),
    ]
}

fn lossy_mib() -> usize {
    std::env::var("GPUDIRECT_FAULTS_LOSSY_MIB").ok().and_then(|s| s.parse().ok()).unwrap_or(8)
}

fn lossy_rounds() -> usize {
    (lossy_mib() << 20).div_ceil(LOSSY_REGION).max(1)
}

/// How long one lossy phase may run before A stops posting and reports how
/// far it got. rxe now and then crawls under reordering (completions keep
/// coming, far too slowly for [`HANG`]); without a bound the phase ran
/// into B's [`CTL_TIMEOUT`] and both sides failed with a control-channel
/// timeout that said nothing of the link. The default leaves B a minute
/// of its control timeout; `GPUDIRECT_FAULTS_PHASE_S` overrides it.
fn phase_budget() -> Duration {
    let default = Duration::from_secs(240).max(Duration::from_secs(30) * lossy_mib() as u32);
    let asked = std::env::var("GPUDIRECT_FAULTS_PHASE_S").ok().and_then(|s| s.parse().ok()).map(Duration::from_secs);
    asked.unwrap_or(default).min(CTL_TIMEOUT - Duration::from_secs(60))
}

pub(super) fn lossy_link(role: Role, port: u16) -> R<()> {
    let mut ctl = control(role, port)?;
    let h = Host::open()?;
    let cfg = QpConfig::default();
    let rounds = lossy_rounds();
    match role {
        Role::A => {
            let src = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::default())?;
            let dst = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::LOCAL_WRITE)?;
            let (mut qp, bufs) = h.connect(&mut ctl, &cfg, vec![])?;
            let remote = *bufs.first().ok_or("peer sent no buffer")?;
            let budget = phase_budget();
            for (i, (name, spec, retry_cnt)) in lossy_phases().into_iter().enumerate() {
                step(&mut ctl, name)?;
                set_netem(spec)?;
                step(&mut ctl, "netem set")?;
                let cfg = QpConfig { retry_cnt: retry_cnt.unwrap_or(cfg.retry_cnt), ..cfg.clone() };
                if retry_cnt.is_some() {
                    let got = say(&mut ctl, "rebuild")?;
                    ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                    qp = h.connect(&mut ctl, &cfg, vec![])?.0;
                }
                // rxe counters on this side: retry sequences the requester started
                // (timeouts and NAKs) and out-of-sequence packets received.
                let (retries0, naks0) = (hw_counter("completer_retry_err"), hw_counter("rcvd_seq_err"));
                let (mut wt, mut rt, mut rebuilds) = (Duration::ZERO, Duration::ZERO, 0);
                let (mut written, mut read) = (0, 0);
                let mut failures = BTreeMap::new();
                let mut cut_short = None;
                // The last round's bytes, and how many of them B must hold:
                // past a cut the rest of B's memory is unknown (a request
                // that failed before the cut may have landed anyway).
                let (mut expected, mut landed) = (Vec::new(), LOSSY_REGION);
                let until = Instant::now() + budget;
                for r in 0..rounds {
                    expected = pattern(LOSSY_REGION, (i * 1000 + r) as u64);
                    src.write_at(0, &expected)?;
                    dst.fill(.., 0)?;
                    let (t, k, stop) = stream_recovering(&h, &mut qp, &mut ctl, &cfg, true, &src, &remote, &mut failures, until)
                        .map_err(|e| format!("{name}, round {r}, writes: {e}"))?;
                    (wt, rebuilds) = (wt + t, rebuilds + k);
                    let sent = stop.map_or(LOSSY_REGION, |at| at * LOSSY_CHUNK);
                    (written, landed) = (written + sent, sent);
                    if let Some(at) = stop {
                        cut_short = Some(format!("round {r} of {rounds}, writes, at request {at}"));
                        break;
                    }
                    let (t, k, stop) = stream_recovering(&h, &mut qp, &mut ctl, &cfg, false, &dst, &remote, &mut failures, until)
                        .map_err(|e| format!("{name}, round {r}, reads: {e}"))?;
                    (rt, rebuilds) = (rt + t, rebuilds + k);
                    let got = stop.map_or(LOSSY_REGION, |at| at * LOSSY_CHUNK);
                    ensure!(dst.to_vec()?[..got] == expected[..got], "{name}, round {r}: data read back differs from what was written");
                    read += got;
                    if let Some(at) = stop {
                        cut_short = Some(format!("round {r} of {rounds}, reads, at request {at}"));
                        break;
                    }
                }
                let dropped_here = netem_dropped();
                let (retries, naks) = (hw_counter("completer_retry_err") - retries0, hw_counter("rcvd_seq_err") - naks0);
                // B answers with its own view: checksum of the target's first
                // `landed` bytes and its drops.
                let peer = ask(&mut ctl, &format!("phase done {landed}"))?;
                let want = format!("{:016x}", fnv64(&expected[..landed]));
                ensure!(peer["fnv64"] == want.as_str(), "{name}: target memory checksum {} != {want}", peer["fnv64"]);
                let dropped = dropped_here + peer["dropped"].as_u64().unwrap_or(0);
                let per_s = |bytes: usize, t: Duration| if bytes == 0 { 0.0 } else { bytes as f64 / t.as_secs_f64() / 1e6 };
                figure(json!({
                    "scenario": "lossy-link", "phase": name, "netem": spec, "bytes_written": written,
                    "bytes_read": read, "write_mb_s": per_s(written, wt), "read_mb_s": per_s(read, rt),
                    "packets_dropped": dropped, "retry_sequences": retries, "out_of_sequence": naks,
                    "retry_cnt": cfg.retry_cnt, "qp_rebuilds": rebuilds, "failed_requests": failures,
                    "cut_short": cut_short.as_ref().map(|at| json!({ "after_s": budget.as_secs(), "at": at })),
                    "verified": if cut_short.is_some() {
                        "up to the cut: every byte read back and the target's checksum of the bytes written"
                    } else {
                        "every byte read back and the target's checksum"
                    },
                }));
                if let Some(at) = &cut_short {
                    // A crawl on a lossy link is rxe's, and measured above;
                    // on a clean link, or with nothing moved, it is a failure.
                    ensure!(spec.is_some(), "{name}: the clean link was still running after {budget:?} ({at})");
                    ensure!(written > 0, "{name}: nothing was written within {budget:?}, so the phase tested nothing");
                    println!("lossy-link {name}: cut short after {budget:?} at {at}: {written} bytes written, {read} read back, all verified");
                }
                ensure!(spec.is_none() || dropped > 0, "{name}: netem dropped no packet, so the phase tested nothing");
                ensure!(retry_cnt.is_none() || rebuilds > 0, "{name}: no request ran out of retries, so no rebuild was tested");
                set_netem(None)?;
            }
            step(&mut ctl, "end")?;
        }
        Role::B => {
            let target = MemoryRegion::alloc(&h.pd, LOSSY_REGION, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ)?;
            // Held only to keep B's end connected; replaced on each rebuild.
            let (mut _qp, _) = h.connect(&mut ctl, &cfg, vec![target.remote()])?;
            for (name, spec, _) in lossy_phases() {
                step(&mut ctl, name)?;
                set_netem(spec)?;
                step(&mut ctl, "netem set")?;
                // Rebuild the queue pair as often as A asks, until A is done.
                let landed = loop {
                    match say(&mut ctl, "waiting")?.as_str() {
                        "rebuild" => _qp = h.connect(&mut ctl, &cfg, vec![target.remote()])?.0,
                        other => match other.strip_prefix("phase done ").map(str::parse::<usize>) {
                            Some(Ok(n)) if n <= LOSSY_REGION => break n,
                            _ => return Err(format!("unexpected request {other:?}").into()),
                        },
                    }
                };
                let sum = format!("{:016x}", fnv64(&target.to_vec()?[..landed]));
                say(&mut ctl, &json!({ "fnv64": sum, "dropped": netem_dropped() }).to_string())?;
                set_netem(None)?;
            }
            step(&mut ctl, "end")?;
        }
    }
    Ok(())
}

/// Most queue pair rebuilds one lossy stream may need before the test
/// calls it stuck.
const MAX_REBUILDS: usize = 100;

/// Most rxe stalls one lossy phase may see before the test fails.
const MAX_STALLS: usize = 2;

/// [`stream`] that survives a queue pair failing on the lossy link (rxe
/// gives up on a request after `retry_cnt` retransmissions of it): it
/// rebuilds the connection with the peer and resumes at the first chunk
/// that did not arrive. Writes and reads of the same bytes are idempotent,
/// so resending is safe. Posts nothing new once `until` has passed. Returns
/// the time, the number of rebuilds, and where it stopped when `until` cut
/// it short (every chunk before that arrived).
///
/// rxe (Debian's 6.1 kernel) now and then stops retransmitting under loss:
/// no completion comes and the queue pair stays in RTS. After [`HANG`]
/// that is counted in `stalls` and handled as a failure with no known
/// resume point (the attempt starts over); more than [`MAX_STALLS`] in one
/// stream fails the test.
#[allow(clippy::too_many_arguments)]
fn stream_recovering(
    h: &Host,
    qp: &mut QueuePair,
    ctl: &mut OobChannel,
    cfg: &QpConfig,
    write: bool,
    local: &MemoryRegion,
    remote: &RemoteBuffer,
    statuses: &mut BTreeMap<&'static str, usize>,
    until: Instant,
) -> R<(Duration, usize, Option<usize>)> {
    let t = Instant::now();
    let mut first = 0;
    for rebuilds in 0..=MAX_REBUILDS {
        match stream_from(h, qp, write, local, remote, LOSSY_DEPTH, LOSSY_CHUNK, first, Some(until)) {
            Err(e) if e.downcast_ref::<Hung>().is_some() => {
                let stalls = statuses.entry("rxe stall (no completion, QP still RTS)").or_default();
                *stalls += 1;
                ensure!(*stalls <= MAX_STALLS, "{e} ({} times in this phase)", *stalls);
                println!("rxe stalled: {e}; rebuilding the queue pair and starting the attempt over at request {first}");
                let got = say(ctl, "rebuild")?;
                ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                *qp = h.connect(ctl, cfg, vec![])?.0;
            }
            Err(e) => return Err(e),
            Ok(Streamed::Done) => return Ok((t.elapsed(), rebuilds, None)),
            Ok(Streamed::Stopped(at)) => return Ok((t.elapsed(), rebuilds, Some(at))),
            Ok(Streamed::Failed(at, e)) => {
                *statuses.entry(e.status.verbs_name()).or_default() += 1;
                ensure!(e.status == WcStatus::RetryExceeded, "request {at} failed with {e}, not a retry exhaustion");
                ensure!(qp.state()? == QpState::Error, "the queue pair is not in the error state after {e}");
                let got = say(ctl, "rebuild")?;
                ensure!(got == "waiting", "peer is at {got:?}, not waiting to rebuild");
                *qp = h.connect(ctl, cfg, vec![])?.0;
                first = at;
            }
        }
    }
    Err(format!("still failing after {MAX_REBUILDS} rebuilds").into())
}
