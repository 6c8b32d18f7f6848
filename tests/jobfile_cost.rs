//! The job-file reading's cost on adversarial files of 1 MB: nesting of
//! `${...:-...}`, `$( )`, here-documents fed to shells and subshells, and
//! long lines of assignments and expansions. Each is read in time and
//! heap linear in its size (under 1 s in a release build and 64 MB at its
//! peak), and a deciding name in text the reading did not follow is
//! seen, not read. Alone in its binary: the allocator below counts every
//! allocation of the process.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use gpudirect_tools::doctor::jobfile::read;

struct Counting;

static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded to the system allocator unchanged; the
// counters are only read.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let now = NOW.fetch_add(l.size(), Ordering::Relaxed) + l.size();
        PEAK.fetch_max(now, Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        NOW.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: `p` came from `alloc` with this layout.
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

const MB: usize = 1 << 20;

/// `open` repeated, then `middle`, then `close` repeated, to `size` bytes.
fn nested(open: &str, middle: &str, close: &str, size: usize) -> String {
    let n = size.saturating_sub(middle.len()) / (open.len() + close.len());
    [open.repeat(n), middle.to_owned(), close.repeat(n)].concat()
}

fn repeated(piece: &str, size: usize) -> String {
    piece.repeat(size / piece.len())
}

/// The adversarial files of about `size` bytes, by name.
fn adversarial(size: usize) -> Vec<(&'static str, String)> {
    vec![
        ("nested ${A:-...}", format!("#!/bin/bash\nexport NCCL_IB_HCA={}\npython x.py\n", nested("${A:-", "NCCL_IB_DISABLE=1", "}", size))),
        ("nested $( )", format!("#!/bin/bash\nX={}\npython x.py\n", nested("$(", "export NCCL_IB_DISABLE=1", ")", size))),
        ("nested \"$( )\" in quotes", format!("#!/bin/bash\nX={}\npython x.py\n", nested("\"$(echo ", "NCCL_NET=Socket", ")\"", size))),
        ("nested backquotes", format!("#!/bin/bash\nX={}\npython x.py\n", nested("`echo \\", "NCCL_NET=Socket", "`", size))),
        ("nested subshells", format!("#!/bin/bash\n{}\npython x.py\n", nested("( ", "export NCCL_IB_DISABLE=1", " )", size))),
        ("nested bash here-documents", format!("#!/bin/bash\n{}python x.py\n", nested("bash <<E\n", "export NCCL_IB_DISABLE=1\n", "E\n", size))),
        ("nested if blocks", format!("#!/bin/bash\n{}\npython x.py\n", nested("if true; then ", "export NCCL_IB_DISABLE=1;", " fi;", size))),
        ("a line of A=$B;", format!("#!/bin/bash\n{}\npython x.py\n", repeated("A=$B;B=$A;", size))),
        ("distinct names", format!("#!/bin/bash\n{}\npython x.py\n", (0..size / 12).map(|i| format!("V{i:06}=$B;")).collect::<String>())),
        ("distinct NCCL_ names", format!("#!/bin/bash\n{}\npython x.py\n", (0..size / 20).map(|i| format!("export NCCL_{i:06}=1;")).collect::<String>())),
        ("a line of NCCL_ assignments", format!("#!/bin/bash\n{}\npython x.py\n", repeated("export NCCL_X=$NCCL_Y;", size))),
        ("a line of launches and changes", format!("#!/bin/bash\n{}\n", repeated("export NCCL_A$RANDOM=1;python x.py;", size))),
        ("lines of expansions", repeated("export NCCL_IB_HCA=${NCCL_IB_HCA:-${X:-mlx5_0}}\n", size)),
        ("YAML env entries", format!("env:\n{}", repeated("- name: NCCL_IB_HCA\n  value: \"$(NCCL_IB_HCA)x\"\n", size))),
        ("names in prose", repeated("NCCL_IB_DISABLE NCCL_NET UCX_TLS ", size)),
    ]
}

/// One test at a time: the counters are the process's, and another
/// test's allocations would count.
fn alone() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Seconds and peak heap bytes of reading `text`.
fn cost(text: &str) -> (f64, usize, gpudirect_tools::doctor::jobfile::JobFile) {
    let base = NOW.load(Ordering::Relaxed);
    PEAK.store(base, Ordering::Relaxed);
    let t = std::time::Instant::now();
    let f = read(text);
    (t.elapsed().as_secs_f64(), PEAK.load(Ordering::Relaxed).saturating_sub(base), f)
}

#[test]
fn adversarial_job_files_cost_linear_time_and_memory() {
    let _alone = alone();
    // Debug builds are several times slower than release; the bound is
    // the release build's 1 s, scaled.
    let bound = if cfg!(debug_assertions) { 20.0 } else { 1.0 };
    for (what, text) in adversarial(MB) {
        let (s, peak, f) = cost(&text);
        assert!(s < bound, "{what}: {s:.2} s for {} bytes", text.len());
        assert!(peak < 64 * MB, "{what}: {} MB at the peak", peak / MB);
        for deciding in ["NCCL_IB_DISABLE", "NCCL_NET"] {
            if text.contains(deciding) {
                // Read (whether or not it reaches the launch), printed by
                // `echo`, or seen.
                let accounted = f.last(deciding).is_some() || f.printed.iter().any(|(n, _)| n == deciding) || f.seen.iter().any(|s| s.name == deciding);
                assert!(accounted, "{what}: {deciding} neither read nor seen");
            }
        }
    }
}

/// The figures of docs/performance.md:
/// `cargo test --release --test jobfile_cost -- --ignored --nocapture`.
#[test]
#[ignore = "prints figures; run in a release build"]
fn figures() {
    let _alone = alone();
    for size in [MB / 4, MB] {
        for (what, text) in adversarial(size) {
            let (s, peak, _) = cost(&text);
            println!("{:>8} bytes  {what:<32} {:>7.1} ms  {:>6.1} MB peak", text.len(), s * 1e3, peak as f64 / MB as f64);
        }
    }
}

