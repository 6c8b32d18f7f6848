//! A stranger on the network against the metrics endpoint: each test is
//! an attack that fails while the defect it looks for is there.
//!
//! The endpoint thread's own CPU time is read from
//! `/proc/self/task/TID/stat`, its TID learnt from inside the render
//! closure (which runs on that thread); the server side's open sockets
//! from `/proc/net/tcp*` (local port the endpoint's, not listening, owned).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn gettid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as i32 }
}

/// An endpoint serving `body`, the TID of its thread (once it rendered),
/// and how many renders it made.
struct Bed {
    ep: MetricsEndpoint,
    tid: Arc<AtomicI32>,
    renders: Arc<AtomicUsize>,
}

impl Bed {
    fn new(body: String) -> Bed {
        let tid = Arc::new(AtomicI32::new(0));
        let renders = Arc::new(AtomicUsize::new(0));
        let (t, r) = (tid.clone(), renders.clone());
        let body = Arc::new(body);
        let ep = MetricsEndpoint::start(
            loopback(),
            "attack",
            Arc::new(move || {
                t.store(gettid(), Ordering::SeqCst);
                r.fetch_add(1, Ordering::SeqCst);
                (*body).clone()
            }),
        )
        .unwrap();
        Bed { ep, tid, renders }
    }

    fn addr(&self) -> SocketAddr {
        self.ep.addr()
    }

    /// The endpoint thread's CPU time so far (it must have rendered once).
    fn cpu(&self) -> Duration {
        let tid = self.tid.load(Ordering::SeqCst);
        assert!(tid > 0, "the endpoint has not rendered yet");
        thread_cpu(tid)
    }
}

fn thread_cpu(tid: i32) -> Duration {
    cpu_of(&std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap())
}

/// A thread's CPU time from its stat(5) line.
fn cpu_of(stat: &str) -> Duration {
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let close = stat.rfind(')').unwrap();
    let f: Vec<&str> = stat[close + 2..].split(' ').collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_secs_f64(ticks as f64 / tick)
}

/// Sockets the endpoint accepted and has not closed: entries of
/// /proc/net/tcp{,6} whose local port is `port`, not listening, owned
/// by a process (inode not 0).
fn server_sockets(port: u16) -> usize {
    let mut n = 0;
    for f in ["/proc/net/tcp", "/proc/net/tcp6"] {
        for line in std::fs::read_to_string(f).unwrap_or_default().lines().skip(1) {
            let w: Vec<&str> = line.split_whitespace().collect();
            let local_port = w[1].rsplit(':').next().and_then(|p| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port) && w[3] != "0A" && w[9] != "0" {
                n += 1;
            }
        }
    }
    n
}

/// One scrape within `limit` (connecting, sending, reading to the end):
/// what came back, or `None` past the limit.
fn scrape_within(addr: SocketAddr, req: &[u8], limit: Duration) -> Option<Vec<u8>> {
    let t = Instant::now();
    let mut s = TcpStream::connect_timeout(&addr, limit).ok()?;
    s.set_write_timeout(Some(limit)).ok()?;
    s.write_all(req).ok()?;
    let mut out = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let left = limit.checked_sub(t.elapsed()).filter(|l| !l.is_zero())?;
        s.set_read_timeout(Some(left)).ok()?;
        match s.read(&mut buf) {
            Ok(0) => return Some(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return if out.is_empty() { None } else { Some(out) },
        }
    }
}

const GET: &[u8] = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";

fn is_ok(r: &Option<Vec<u8>>, body: &str) -> bool {
    r.as_ref().is_some_and(|r| r.starts_with(b"HTTP/1.1 200") && r.ends_with(body.as_bytes()))
}

/// A connection whose receive window is as small as the kernel allows
/// (SO_RCVBUF set before connecting), that sends a whole request and
/// never reads the answer.
fn stuck_reader(addr: SocketAddr) -> TcpStream {
    let SocketAddr::V4(v4) = addr else { panic!("v4 only") };
    // SAFETY: plain socket calls on a descriptor this function owns; the
    // sockaddr is a local of the right size.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let one: libc::c_int = 1;
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUF, (&one as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t);
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: v4.port().to_be(),
            sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() },
            sin_zero: [0; 8],
        };
        let rc = libc::connect(fd, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t);
        assert_eq!(rc, 0, "connect: {}", std::io::Error::last_os_error());
        let mut s = TcpStream::from_raw_fd(fd);
        s.write_all(GET).unwrap();
        s
    }
}

/// About what an agent with 8 NICs and 16 busy peers serves (each line
/// ~130 bytes): 32 KiB.
fn realistic_body() -> String {
    let mut b = String::new();
    let mut i = 0;
    while b.len() < 32 << 10 {
        b += &format!("gpudirect_bytes_total{{agent=\"prefill-0\",nic=\"mlx5_{}\",direction=\"out\",path=\"gdr\",pad=\"{i:08}\"}} 123456789\n", i % 8);
        i += 1;
    }
    b
}

/// Waits until `n` connections are accepted (the accept rate is
/// ACCEPTS_PER_SEC, with a burst of ACCEPT_BURST).
fn accept_time(n: usize) -> Duration {
    Duration::from_secs_f64(n.saturating_sub(ACCEPT_BURST as usize) as f64 / f64::from(ACCEPTS_PER_SEC)) + Duration::from_millis(400)
}

/// 64 connections that each send a request and never read a 32 KiB
/// answer (a realistic agent's) hold every slot, none evictable, for
/// SCRAPE_TIMEOUT: a scraper that comes then waits until they expire.
#[test]
fn unread_answers_do_not_keep_a_scraper_out() {
    let body = realistic_body();
    let bed = Bed::new(body.clone());
    let addr = bed.addr();
    assert!(is_ok(&scrape_within(addr, GET, Duration::from_secs(2)), &body));
    let t0 = Instant::now();
    let stuck: Vec<TcpStream> = (0..MAX_CONNECTIONS).map(|_| stuck_reader(addr)).collect();
    std::thread::sleep(accept_time(MAX_CONNECTIONS).saturating_sub(t0.elapsed()));
    let held = server_sockets(addr.port());
    let t = Instant::now();
    let r = scrape_within(addr, GET, Duration::from_secs(1));
    let took = t.elapsed();
    drop(stuck);
    assert!(is_ok(&r, &body), "{held} connections that never read their answers kept a scraper out for {took:?} (they are closed only {SCRAPE_TIMEOUT:?} after their accept)");
}

/// Slots full of unread answers but one, and newcomers waiting: the
/// thread must sleep, not spin on a listener it will not accept from.
#[test]
fn the_endpoint_does_not_spin_when_its_slots_are_full() {
    slots_of_unread_answers_do_not_spin(realistic_body(), Duration::from_secs(2));
}

/// Every slot but one held by a client that never reads its answer
/// (`body`, the first scrape of it given `first`), newcomers waiting
/// behind them: the endpoint thread's CPU over a window before the
/// first of them expires.
fn slots_of_unread_answers_do_not_spin(body: String, first: Duration) {
    let bed = Bed::new(body.clone());
    let addr = bed.addr();
    assert!(is_ok(&scrape_within(addr, GET, first), &body));
    let t0 = Instant::now();
    let stuck: Vec<TcpStream> = (0..MAX_CONNECTIONS - 1).map(|_| stuck_reader(addr)).collect();
    // Then newcomers that say nothing, queued behind them.
    let silent: Vec<TcpStream> = (0..40).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    std::thread::sleep(accept_time(MAX_CONNECTIONS).saturating_sub(t0.elapsed()));
    // Before the first of the stuck ones expires (SCRAPE_TIMEOUT after
    // its accept).
    let window = SCRAPE_TIMEOUT.saturating_sub(t0.elapsed()).saturating_sub(Duration::from_millis(300)).min(Duration::from_millis(1500));
    assert!(window >= Duration::from_millis(500), "the setup took too long: {:?}", t0.elapsed());
    let held = server_sockets(addr.port());
    let (cpu, t) = (bed.cpu(), Instant::now());
    std::thread::sleep(window);
    let (used, over) = (bed.cpu() - cpu, t.elapsed());
    drop((stuck, silent));
    let share = used.as_secs_f64() / over.as_secs_f64();
    assert!(share < 0.2, "the endpoint thread used {:.0}% of a CPU over {over:?} with {held} connections open ({} of them answers never read) and newcomers waiting", share * 100.0, MAX_CONNECTIONS - 1);
}

/// A request head dripped a byte at a time: each byte must cost about
/// the same, not a rescan of the whole head so far (`windows(4)` over
/// the head on every read makes 8 KiB cost ~33 million comparisons).
#[test]
fn a_dripped_head_costs_linear_time() {
    let l = std::net::TcpListener::bind(loopback()).unwrap();
    let mut tx = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    tx.set_nodelay(true).unwrap();
    let (rx, _) = l.accept().unwrap();
    rx.set_nonblocking(true).unwrap();
    let mut c = Client { stream: rx, since: Instant::now(), head: Vec::new(), out: None };
    let n = MAX_REQUEST - 1;
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        tx.write_all(b"a").unwrap();
        let before = c.head.len();
        let t = Instant::now();
        // Until the byte is in (loopback delivers it at once, nearly).
        while c.head.len() == before {
            assert!(matches!(read_more(&mut c), Ok(None)));
        }
        times.push(t.elapsed());
    }
    let first: Duration = times[..1024].iter().sum();
    let last: Duration = times[n - 1024..].iter().sum();
    let ratio = last.as_secs_f64() / first.as_secs_f64();
    eprintln!("dripped head: last 1024 bytes {last:?}, first 1024 {first:?}: {ratio:.1}x");
    assert!(ratio < 2.0, "the last 1024 bytes of an {n}-byte head took {ratio:.1}x the first 1024 ({last:?} against {first:?}): each read rescans the whole head");
}

/// Whatever way a client leaves (silent, half a head then gone, half
/// closed, reset, a huge head, an answer never read), the endpoint's
/// side of every connection is closed within SCRAPE_TIMEOUT.
#[test]
fn abandoned_connections_leave_no_socket_open() {
    let body = "gpudirect_x 1\n".repeat(300_000);
    let bed = Bed::new(body.clone());
    let addr = bed.addr();
    assert!(is_ok(&scrape_within(addr, GET, Duration::from_secs(5)), &body));
    let mut keep = Vec::new();
    for kind in 0..7 {
        for _ in 0..3 {
            let mut s = TcpStream::connect(addr).unwrap();
            match kind {
                0 => keep.push(s),
                1 => {
                    let _ = s.write_all(b"GET /metr");
                }
                2 => {
                    let _ = s.write_all(b"GET /metrics HTTP/1.1\r\n");
                    let _ = s.shutdown(Shutdown::Write);
                    keep.push(s);
                }
                3 => {
                    let _ = s.write_all(GET);
                    let _ = s.shutdown(Shutdown::Read);
                    keep.push(s);
                }
                4 => {
                    // SO_LINGER 0: a reset on close.
                    let lin = libc::linger { l_onoff: 1, l_linger: 0 };
                    // SAFETY: a valid socket and a local linger struct.
                    unsafe { libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&s), libc::SOL_SOCKET, libc::SO_LINGER, (&lin as *const libc::linger).cast(), std::mem::size_of::<libc::linger>() as libc::socklen_t) };
                    let _ = s.write_all(GET);
                }
                5 => {
                    let _ = s.write_all(&vec![b'a'; 32 << 10]);
                    keep.push(s);
                }
                _ => {
                    let _ = s.write_all(GET);
                    keep.push(s);
                }
            }
        }
    }
    std::thread::sleep(accept_time(22) + Duration::from_millis(200));
    let during = server_sockets(addr.port());
    std::thread::sleep(SCRAPE_TIMEOUT + Duration::from_millis(1200));
    let after = server_sockets(addr.port());
    drop(keep);
    assert!(during > 0, "no connection was held while its client was at it: the count sees nothing");
    assert_eq!(after, 0, "{after} of the endpoint's sockets still open {SCRAPE_TIMEOUT:?} after their clients' last act ({during} while they were at it)");
}

/// A client that sends its request and half-closes its side (`shutdown
/// (SHUT_WR)`, as `nc -N` does) still gets the answer.
#[test]
fn a_half_closed_client_gets_its_answer() {
    let bed = Bed::new("gpudirect_x 1\n".into());
    let mut s = TcpStream::connect(bed.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    s.write_all(GET).unwrap();
    s.shutdown(Shutdown::Write).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    assert!(out.starts_with(b"HTTP/1.1 200") && out.ends_with(b"gpudirect_x 1\n"), "{:?}", String::from_utf8_lossy(&out));
}

/// Two requests pipelined on one connection (HTTP/1.1 allows it): the
/// first is answered whole. Closing a socket with the second request
/// unread makes the kernel send a reset that throws away the part of
/// the answer not yet sent.
#[test]
fn a_pipelined_request_does_not_cut_the_answer() {
    let body = "gpudirect_x 1\n".repeat(300_000);
    let bed = Bed::new(body.clone());
    let mut s = TcpStream::connect(bed.addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(4))).unwrap();
    s.write_all(&[GET, GET].concat()).unwrap();
    // A scraper slower than the loopback: the answer is not all sent by
    // the time the endpoint has written its last byte into the kernel.
    std::thread::sleep(Duration::from_millis(300));
    let mut out = Vec::new();
    let e = s.read_to_end(&mut out).err();
    assert!(out.ends_with(body.as_bytes()), "the answer was cut at {} of {} bytes ({e:?})", out.len(), body.len());
}

/// A render that panics once (a bug anywhere in the snapshot) must not
/// stop the endpoint for good while the agent goes on: the next scrape
/// is served.
#[test]
fn a_panicking_render_does_not_stop_the_endpoint_for_good() {
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let ep = MetricsEndpoint::start(
        loopback(),
        "attack",
        Arc::new(move || {
            if c.fetch_add(1, Ordering::SeqCst) == 0 {
                panic!("a bug in the snapshot");
            }
            "gpudirect_x 1\n".to_owned()
        }),
    )
    .unwrap();
    let _ = scrape_within(ep.addr(), GET, Duration::from_secs(2));
    std::thread::sleep(RENDER_EVERY * 2);
    let r = scrape_within(ep.addr(), GET, Duration::from_secs(2));
    assert!(is_ok(&r, "gpudirect_x 1\n"), "after one render panicked the endpoint serves nothing: {:?}", r.map(|r| String::from_utf8_lossy(&r).into_owned()));
}

/// Dropping the endpoint (the agent's drop) is quick however many
/// hostile connections it holds and however many wait.
#[test]
fn stopping_under_attack_is_quick() {
    let body = realistic_body();
    let bed = Bed::new(body.clone());
    let addr = bed.addr();
    let stuck: Vec<TcpStream> = (0..20).map(|_| stuck_reader(addr)).collect();
    let silent: Vec<TcpStream> = (0..300).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    std::thread::sleep(Duration::from_millis(1200));
    let t = Instant::now();
    drop(bed);
    let took = t.elapsed();
    drop((stuck, silent));
    assert!(took < Duration::from_secs(2), "dropping the endpoint took {took:?}");
}

/// A flood of scrapes costs a render per RENDER_EVERY at most.
#[test]
fn a_scrape_flood_costs_few_renders() {
    let bed = Bed::new("gpudirect_x 1\n".into());
    let addr = bed.addr();
    let stop = Arc::new(AtomicBool::new(false));
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let s = stop.clone();
            std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    let _ = scrape_within(addr, GET, Duration::from_millis(500));
                }
            })
        })
        .collect();
    let t = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    stop.store(true, Ordering::Relaxed);
    for th in threads {
        th.join().unwrap();
    }
    let most = (t.elapsed().as_secs_f64() / RENDER_EVERY.as_secs_f64()).ceil() as usize + 2;
    let n = bed.renders.load(Ordering::SeqCst);
    assert!(n <= most, "{n} renders in {:?}", t.elapsed());
}

/// The same with an answer larger than the kernel's send buffer takes
/// (4 MiB, as the endpoint's own test serves: bodies of real agents are
/// tens of KiB, so this is latent): 63 slots hold unread answers, the
/// 64th a newcomer younger than MIN_SILENT_AGE, and more wait. `room`
/// refuses (no silent client old enough), yet the listener is polled
/// for input (`accepting` holds: one client is silent) and is readable:
/// poll returns at once, over and over, for MIN_SILENT_AGE each time.
#[test]
fn the_endpoint_does_not_spin_when_its_slots_hold_large_unread_answers() {
    slots_of_unread_answers_do_not_spin("gpudirect_x 1\n".repeat(300_000), Duration::from_secs(5));
}

/// Out of file descriptors (RLIMIT_NOFILE reached by the process, by
/// whatever part of it), a connection waiting in the backlog: accept
/// fails with EMFILE and leaves it there, so the listener stays readable
/// and a poll that watches it returns at once, over and over. Run in a
/// child process of this test binary (the limit is process-wide).
#[test]
fn out_of_descriptors_the_endpoint_does_not_spin() {
    const CHILD: &str = "GPUDIRECT_ATTACK_EMFILE_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return emfile_child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "metrics::endpoint::attacks::out_of_descriptors_the_endpoint_does_not_spin", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let line = said.lines().find(|l| l.contains("endpoint thread used")).unwrap_or(&said);
    assert!(out.status.success(), "{line}");
}

fn emfile_child() {
    let bed = Bed::new("gpudirect_x 1\n".into());
    let addr = bed.addr();
    assert!(is_ok(&scrape_within(addr, GET, Duration::from_secs(2)), "gpudirect_x 1\n"));
    std::thread::sleep(Duration::from_millis(300));
    // The client's socket first; then every descriptor left taken.
    let SocketAddr::V4(v4) = addr else { panic!() };
    // SAFETY: plain socket calls on descriptors this function owns.
    let client = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    assert!(client >= 0);
    // The thread's stat file stays open: reading it takes no descriptor.
    let mut stat = std::fs::File::open(format!("/proc/self/task/{}/stat", bed.tid.load(Ordering::SeqCst))).unwrap();
    let mut cpu_now = move || {
        use std::io::Seek;
        let mut s = String::new();
        stat.seek(std::io::SeekFrom::Start(0)).unwrap();
        stat.read_to_string(&mut s).unwrap();
        cpu_of(&s)
    };
    let lim = libc::rlimit { rlim_cur: 512, rlim_max: 512 };
    // SAFETY: lowering this process's own limit.
    unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    let mut taken = 0;
    // SAFETY: dup of stdin; the copies stay open until the process ends.
    while unsafe { libc::dup(0) } >= 0 {
        taken += 1;
    }
    let sa = libc::sockaddr_in { sin_family: libc::AF_INET as libc::sa_family_t, sin_port: v4.port().to_be(), sin_addr: libc::in_addr { s_addr: u32::from(*v4.ip()).to_be() }, sin_zero: [0; 8] };
    // SAFETY: a valid socket and sockaddr.
    let rc = unsafe { libc::connect(client, (&sa as *const libc::sockaddr_in).cast(), std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t) };
    assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    std::thread::sleep(Duration::from_millis(200));
    let (cpu, t) = (cpu_now(), Instant::now());
    std::thread::sleep(Duration::from_millis(1500));
    let (used, over) = (cpu_now() - cpu, t.elapsed());
    let share = used.as_secs_f64() / over.as_secs_f64();
    println!("the endpoint thread used {:.0}% of a CPU over {over:?} with the process out of descriptors ({taken} taken) and one connection waiting", share * 100.0);
    assert!(share < 0.2);
    std::process::exit(0);
}

/// An agent name is 1 to MAX_NAME bytes of anything (meta::check_name):
/// one with a NUL in it names the endpoint's thread, which std refuses
/// with a panic ("thread name may not contain interior null bytes"):
/// the start must be an error, not a panic. (Agent::new names its
/// control listener's thread the same way, before this.)
#[test]
fn an_agent_name_with_a_nul_is_an_error_not_a_panic() {
    let r = std::panic::catch_unwind(|| MetricsEndpoint::start(loopback(), "a\0b", Arc::new(String::new)).map(|e| e.addr()));
    assert!(r.is_ok(), "MetricsEndpoint::start panicked on the name \"a\\0b\"");
}
