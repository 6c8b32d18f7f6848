//! A hostile or broken endpoint against `gpudirect stats`: each test is an
//! attack that fails while the defect it looks for is there. The library
//! modules (scrape, expo, view, render) directly, and the built binary
//! against stand-in servers on 127.0.0.1.
//!
//! The tests take one lock each: the memory test reads this binary's
//! allocation peak (a counting global allocator), which other tests'
//! allocations would disturb.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use gpudirect_tools::stats::expo::parse;
use gpudirect_tools::stats::render::{render, verdict, Style};
use gpudirect_tools::stats::scrape::{scrape, ScrapeError, Target};
use gpudirect_tools::stats::view::{Snapshot, Verdict, Watch};

struct Counting;
static NOW: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator, counting.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let now = NOW.fetch_add(l.size(), Ordering::Relaxed) + l.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) };
        NOW.fetch_sub(l.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = unsafe { System.realloc(p, l, new) };
        if !q.is_null() {
            if new >= l.size() {
                let now = NOW.fetch_add(new - l.size(), Ordering::Relaxed) + new - l.size();
                PEAK.fetch_max(now, Ordering::Relaxed);
            } else {
                NOW.fetch_sub(l.size() - new, Ordering::Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn lock() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

const TYPE: &str = "# TYPE gpudirect_bytes_total counter\n";

fn bytes(agent: &str, nic: &str, dir: &str, path: &str, v: u64) -> String {
    format!("gpudirect_bytes_total{{agent=\"{agent}\",nic=\"{nic}\",direction=\"{dir}\",path=\"{path}\"}} {v}\n")
}

/// Two expositions a second apart through the view.
fn frame(a: &str, b: &str) -> gpudirect_tools::stats::view::Frame {
    let t0 = Instant::now();
    let w0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let mut w = Watch::new();
    assert!(w.push(Snapshot::read(&parse(a).unwrap(), t0, w0).unwrap()).is_none());
    w.push(Snapshot::read(&parse(b).unwrap(), t0 + Duration::from_secs(1), w0 + Duration::from_secs(1)).unwrap()).unwrap()
}

/// Fail open on what was not read: an exposition that gives a NIC's gdr
/// bytes and no staged series for it (an endpoint of another version, a
/// relabelling proxy, a partial answer) says nothing of staging; the
/// view must not say "no GPU traffic staged" on a figure it never read.
#[test]
fn a_staged_series_not_served_is_not_read_as_none_staged() {
    let _g = lock();
    // Only the gdr series.
    let only_gdr = |v| format!("{TYPE}{}{}", bytes("a", "mlx5_0", "out", "gdr", v), bytes("a", "mlx5_0", "in", "gdr", 0));
    let f = frame(&only_gdr(0), &only_gdr(64 << 20));
    let nic = &f.agents[0].nics[0];
    let shown = render(&f, "127.0.0.1:1", Style::default());
    assert!(
        !matches!(nic.verdict, Verdict::NotStaged { .. }) && !shown.contains("no GPU traffic staged"),
        "no staged series was served, yet the view says {:?}: {}",
        verdict(nic),
        shown
    );
}

/// The same with the staged series served for one direction only: the
/// other direction's staged bytes were never seen.
#[test]
fn a_staged_series_missing_for_one_direction_is_not_read_as_none_staged() {
    let _g = lock();
    let t = |v| {
        let mut t = TYPE.to_owned();
        for p in ["gdr", "host", "staged"] {
            t += &bytes("a", "mlx5_0", "out", p, if p == "gdr" { v } else { 0 });
        }
        // In: gdr and host, no staged.
        t += &bytes("a", "mlx5_0", "in", "gdr", v);
        t += &bytes("a", "mlx5_0", "in", "host", 0);
        t
    };
    let f = frame(&t(0), &t(64 << 20));
    let nic = &f.agents[0].nics[0];
    assert!(!matches!(nic.verdict, Verdict::NotStaged { .. }), "the in direction's staged series was not served, yet: {:?}", verdict(nic));
}

/// Names from the endpoint reach the terminal: bidirectional overrides,
/// isolates, zero-width and line-separator characters (Unicode Cf, Zl,
/// Zp: not `char::is_control`) let an endpoint reorder or hide what a
/// line says (`"\u{202e}degats"` shows as "staged").
#[test]
fn names_cannot_reorder_or_hide_what_the_terminal_shows() {
    let _g = lock();
    let evil = ["\u{202e}", "\u{2066}", "\u{200b}", "\u{2028}", "\u{feff}", "\u{61c}"];
    let agent = format!("a{}b", evil.concat());
    let nic = format!("mlx5_0{}", evil.concat());
    let t = |v| format!("{TYPE}{}", ["gdr", "host", "staged"].iter().map(|p| bytes(&agent, &nic, "out", p, if *p == "host" { v } else { 0 })).collect::<String>());
    let f = frame(&t(0), &t(1 << 20));
    let shown = render(&f, "127.0.0.1:1", Style::default());
    let raw: Vec<String> = evil.iter().filter(|c| shown.contains(*c)).map(|c| format!("{:?}", c)).collect();
    assert!(raw.is_empty(), "{} reach the terminal raw: {shown:?}", raw.join(", "));
}

/// C1 controls (`\u{9b}` is CSI on 8-bit terminals) and ESC in every
/// place a name is shown.
#[test]
fn c1_controls_and_escapes_are_shown_escaped() {
    let _g = lock();
    let agent = "\u{9b}2J\u{1b}]0;x\u{7}";
    let t = |v| {
        format!(
            "{TYPE}{}# TYPE gpudirect_requests_total counter\ngpudirect_requests_total{{agent=\"{agent}\",op=\"\u{1b}[1m\",outcome=\"\u{9b}0m\"}} {v}\n# TYPE gpudirect_refusals_total counter\ngpudirect_refusals_total{{agent=\"{agent}\",reason=\"\u{1b}[2K\"}} {v}\n",
            bytes(agent, "\u{1b}[31m", "out", "staged", v)
        )
    };
    let f = frame(&t(0), &t(7));
    let shown = render(&f, "127.0.0.1:1", Style::default());
    assert!(!shown.contains(['\u{1b}', '\u{9b}', '\u{7}']), "{shown:?}");
}

/// A scrape of an endpoint that drips its body forever (no length) ends
/// within its timeout.
#[test]
fn a_dripping_body_ends_within_the_timeout() {
    let _g = lock();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.read(&mut [0u8; 4096]);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
        for _ in 0..2000 {
            if s.write_all(b"x").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    });
    let t = Instant::now();
    let r = scrape(&Target::parse(&port.to_string()).unwrap(), Duration::from_secs(1));
    assert!(t.elapsed() < Duration::from_millis(1800), "{:?}", t.elapsed());
    assert!(matches!(r, Err(ScrapeError::Timeout { .. })), "{r:?}");
}

/// The answer's head, one byte at a time, for the whole timeout: the
/// scrape ends within it.
#[test]
fn a_dripping_head_ends_within_the_timeout() {
    let _g = lock();
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let Ok((mut s, _)) = l.accept() else { return };
        let _ = s.set_nodelay(true);
        let _ = s.read(&mut [0u8; 4096]);
        let _ = s.write_all(b"HTTP/1.1 200 OK\r\nX: ");
        for _ in 0..4000 {
            if s.write_all(b"a").is_err() {
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    let t = Instant::now();
    let r = scrape(&Target::parse(&port.to_string()).unwrap(), Duration::from_secs(1));
    assert!(t.elapsed() < Duration::from_millis(1800), "{:?}", t.elapsed());
    assert!(matches!(r, Err(ScrapeError::Timeout { .. })), "{r:?}");
}

/// Answers that are not what the client reads: each refused, none read
/// as a body.
#[test]
fn odd_answers_are_refused() {
    let _g = lock();
    let get = |answer: &'static [u8]| {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = l.accept() {
                let _ = s.read(&mut [0u8; 4096]);
                let _ = s.write_all(answer);
            }
        });
        scrape(&Target::parse(&port.to_string()).unwrap(), Duration::from_secs(2))
    };
    for a in [
        b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\n\r\n\x1f\x8b".as_slice(),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nContent-Length: 18446744073709551616\r\n\r\nabc",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n\r\nx 1\n",
        b"HTTP/2 200\r\n\r\nx 1\n",
    ] {
        let r = get(a);
        assert!(r.is_err(), "{:?} read as {r:?}", String::from_utf8_lossy(a));
    }
}

/// Input cost: a body as large as the scrape takes (`MAX_BODY`) of
/// samples with 32 one-letter labels each, every series distinct: what
/// reading it holds is bounded (the samples and the duplicate check each
/// keep every label as its own String: about 19 times the body).
#[test]
fn a_body_of_many_labels_costs_memory_in_proportion() {
    let _g = lock();
    let names: Vec<String> = (0..32).map(|i| format!("{}{}", (b'a' + (i % 26) as u8) as char, if i >= 26 { "z" } else { "" })).collect();
    let max = gpudirect_tools::stats::scrape::MAX_BODY;
    let mut body = String::with_capacity(max);
    let mut i = 0u64;
    while body.len() < max - 512 {
        body += "x";
        body += &i.to_string();
        body += "{";
        for n in &names {
            body += n;
            body += "=\"\",";
        }
        body += "} 1\n";
        i += 1;
    }
    let before = NOW.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    let t = Instant::now();
    let e = parse(&body).unwrap();
    let took = t.elapsed();
    let peak = PEAK.load(Ordering::Relaxed) - before;
    let n = e.samples.len();
    drop(e);
    let ratio = peak as f64 / body.len() as f64;
    assert!(peak < 128 << 20, "reading {} MiB ({n} samples) took {} MiB at its peak ({ratio:.0}x) and {took:?}", body.len() >> 20, peak >> 20);
}

fn gpudirect() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    c.env_remove("NO_COLOR").stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    c
}

/// Serves `answer` to every connection after reading its request.
fn serve_forever(answer: Vec<u8>) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for s in l.incoming() {
            let Ok(mut s) = s else { return };
            let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
            let _ = s.read(&mut [0u8; 4096]);
            let _ = s.write_all(&answer);
        }
    });
    port
}

/// The binary's own output (frames and error messages) on a pipe: no
/// escape, C1 control or bidirectional override from the endpoint.
#[test]
fn the_command_prints_nothing_raw_from_the_endpoint() {
    let _g = lock();
    let bad = ['\u{1b}', '\u{9b}', '\u{7}', '\u{202e}', '\u{2066}'];
    let mut answers: Vec<Vec<u8>> = vec![
        b"HTTP/1.1 500 \x1b[2J\x1b]0;owned\x07\xe2\x80\xae\r\n\r\n".to_vec(),
        format!("HTTP/1.1 200 OK\r\n\r\n{TYPE}gpudirect_bytes_total{{agent=\"a\",nic=\"n\",direction=\"out\",path=\"\u{202e}\u{1b}[2J\"}} 1\n").into_bytes(),
        format!("HTTP/1.1 200 OK\r\n\r\n{TYPE}\u{1b}[2J\u{202e} 1\n").into_bytes(),
        format!("HTTP/1.1 200 OK\r\n\r\n{TYPE}# TYPE x \u{1b}[2J\u{202e}\n").into_bytes(),
    ];
    let frame = format!("{TYPE}{}", bytes("\u{202e}\u{1b}[2J", "\u{2066}n", "out", "host", 5));
    answers.push(format!("HTTP/1.1 200 OK\r\n\r\n{frame}").into_bytes());
    for a in answers {
        let port = serve_forever(a.clone());
        let out = gpudirect().args(["stats", &port.to_string(), "--once", "--interval", "0.1", "--timeout", "2"]).output().unwrap();
        let all = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(!all.contains(bad), "answer {:?} printed raw: {all:?}", String::from_utf8_lossy(&a));
    }
}
