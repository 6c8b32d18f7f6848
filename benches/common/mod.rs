//! What the benchmark binaries share: choosing the device (or saying why
//! there is none), the criterion configuration, the size lists, and
//! reaping completions.
//!
//! Environment:
//!
//! | variable | meaning |
//! |---|---|
//! | `GPUDIRECT_BENCH_DEVICE` | RDMA device to measure (falls back to `GPUDIRECT_TEST_DEVICE`) |
//! | `GPUDIRECT_BENCH_SIZES` | message sizes for `rdma`: `all` (default: 2 B .. 8 MiB, powers of two) or a list such as `2,4096,64K,1M` |
//! | `GPUDIRECT_BENCH_REG_SIZES` | region sizes for `registration`: `all` (default: 4 KiB .. 64 MiB, powers of four) or a list |
//! | `GPUDIRECT_BENCH_QUICK=1` | an even shorter configuration (0.1 s warm-up, 0.3 s measurement) |
//! | `GPUDIRECT_BENCH_POLL` | `busy` (default: spin on `ibv_poll_cq`) or `event` (sleep on the completion channel) |

// Each bench binary uses a different part of this module.
#![allow(dead_code)]

/// perftest's `-a` sweep, from its one definition in the tools.
#[path = "../../src/perf/sizes.rs"]
mod perftest;

use std::time::{Duration, Instant};

use criterion::Criterion;
use gpudirect::{CompletionQueue, Context, WorkCompletion};

/// 4 KiB .. 64 MiB in powers of four: 8 sizes.
pub const REG_SIZES: [usize; 8] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20];

/// How long a completion may take before the benchmark gives up: far
/// beyond any transfer here, even in an emulated guest.
pub const COMPLETION_TIMEOUT: Duration = Duration::from_secs(60);

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
}

fn env_flag(name: &str) -> bool {
    env(name).is_some_and(|v| !matches!(v.to_ascii_lowercase().as_str(), "0" | "false" | "no" | "off"))
}

/// A usage error in the environment: said on one line, exit status 2,
/// before any benchmark is set up.
pub fn usage_error(msg: &str) -> ! {
    eprintln!("error: {msg}");
    std::process::exit(2)
}

/// Opens the device named by `GPUDIRECT_BENCH_DEVICE` (or
/// `GPUDIRECT_TEST_DEVICE`). When there is none, or it cannot be opened,
/// prints one line saying why and returns `None`: the caller then
/// registers no benchmark at all.
pub fn open_device(bench: &str) -> Option<Context> {
    let Some((var, name)) = ["GPUDIRECT_BENCH_DEVICE", "GPUDIRECT_TEST_DEVICE"]
        .into_iter()
        .find_map(|var| env(var).map(|name| (var, name)))
    else {
        println!(
            "{bench}: no benchmarks run: no RDMA device given; set GPUDIRECT_BENCH_DEVICE (or GPUDIRECT_TEST_DEVICE) to one, e.g. mlx5_0 or rxe0"
        );
        return None;
    };
    match Context::open(Some(&name)) {
        Ok(ctx) => Some(ctx),
        Err(e) => {
            println!("{bench}: no benchmarks run: cannot open RDMA device {name} (from {var}): {e}");
            None
        }
    }
}

/// Parses `1048576`, `64K`, `4KiB`, `1M`, `8MiB`.
fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let n: usize = num.parse().ok()?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => return None,
    };
    n.checked_mul(1 << shift).filter(|&n| n > 0)
}

/// The sizes listed in `var`, or `default` when it is unset or `all`.
pub fn sizes(var: &str, default: &[usize]) -> Vec<usize> {
    let Some(v) = env(var) else { return default.to_vec() };
    if v.eq_ignore_ascii_case("all") {
        return default.to_vec();
    }
    let mut out = Vec::new();
    for item in v.split(',').filter(|i| !i.trim().is_empty()) {
        match parse_size(item) {
            Some(n) if !out.contains(&n) => out.push(n),
            Some(_) => {}
            None => usage_error(&format!("{var}: {item:?} is not a size (bytes, or with K/KiB/M/MiB/G/GiB; more than 0)")),
        }
    }
    if out.is_empty() {
        usage_error(&format!("{var} lists no sizes (use `all`, or e.g. 2,4096,1M)"));
    }
    out
}

pub fn rdma_sizes() -> Vec<usize> {
    sizes("GPUDIRECT_BENCH_SIZES", &perftest::perftest_all_sizes())
}

pub fn reg_sizes() -> Vec<usize> {
    sizes("GPUDIRECT_BENCH_REG_SIZES", &REG_SIZES)
}

/// `1.5 KiB`-style label for messages.
pub fn human(n: usize) -> String {
    match n {
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

/// Criterion set up for slow, emulated devices as much as for real ones:
/// 10 samples, short warm-up and measurement, no plots. Command-line
/// flags (`--sample-size`, `--measurement-time`, ...) still override.
pub fn criterion() -> Criterion {
    // In the Soft-RoCE test bed the host root (and so target/) is
    // read-only: keep criterion's reports on the guest's tmpfs. Set before
    // criterion first reads it.
    if env("GPUDIRECT_TESTBED").is_some() && std::env::var_os("CRITERION_HOME").is_none() {
        std::env::set_var("CRITERION_HOME", "/tmp/criterion");
    }
    let quick = env_flag("GPUDIRECT_BENCH_QUICK");
    let (warm_up, measurement) = if quick {
        (Duration::from_millis(100), Duration::from_millis(300))
    } else {
        (Duration::from_millis(500), Duration::from_millis(1500))
    };
    Criterion::default()
        .sample_size(10)
        .warm_up_time(warm_up)
        .measurement_time(measurement)
        // The bootstrap is all CPU: criterion's 100 000 resamples per
        // benchmark add up in an emulated guest; with 10 samples a few
        // thousand give the same confidence interval.
        .nresamples(2000)
        .without_plots()
        .configure_from_args()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Poll {
    /// Spin on `ibv_poll_cq`: what perftest does, the lowest latency.
    Busy,
    /// Sleep on the completion channel between completions.
    Event,
}

pub fn poll_mode() -> Poll {
    match env("GPUDIRECT_BENCH_POLL").as_deref() {
        None | Some("busy") => Poll::Busy,
        Some("event") => Poll::Event,
        Some(other) => usage_error(&format!("GPUDIRECT_BENCH_POLL={other}: expected `busy` or `event`")),
    }
}

/// Reaps exactly `n` completions from `cq` (never more, so completions of
/// a later step stay queued), panicking on a failed one or after
/// [`COMPLETION_TIMEOUT`] without progress.
pub fn reap(cq: &CompletionQueue, mut n: usize, mode: Poll, what: &str) {
    let mut wcs = [WorkCompletion::default(); 16];
    let mut last_progress = Instant::now();
    let mut empty = 0u32;
    while n > 0 {
        let want = n.min(wcs.len());
        let got = match mode {
            Poll::Busy => cq.poll(&mut wcs[..want]),
            Poll::Event => cq.wait(&mut wcs[..want], Some(COMPLETION_TIMEOUT)),
        }
        .unwrap_or_else(|e| panic!("{what}: reaping completions failed: {e}"));
        for wc in &wcs[..got] {
            if let Err(e) = wc.ok() {
                panic!("{what}: {e}");
            }
        }
        n -= got;
        if got > 0 {
            empty = 0;
            last_progress = Instant::now();
        } else {
            empty += 1;
            if empty.is_multiple_of(4096) && last_progress.elapsed() > COMPLETION_TIMEOUT {
                panic!("{what}: no completion for {COMPLETION_TIMEOUT:?} with {n} still expected");
            }
            std::hint::spin_loop();
        }
    }
}

/// `result.unwrap()` with the step named, for setup errors.
pub trait OrDie<T> {
    fn or_die(self, what: &str) -> T;
}

impl<T, E: std::fmt::Display> OrDie<T> for Result<T, E> {
    fn or_die(self, what: &str) -> T {
        self.unwrap_or_else(|e| panic!("{what}: {e}"))
    }
}
