//! The metrics endpoint: an HTTP/1.1 server of one resource, the text
//! exposition of a snapshot, on one thread of its own that never blocks
//! on a client (poll(2) over non-blocking sockets), so a slow or hostile
//! scraper never touches the data path and costs the host little:
//! - at most [`MAX_CONNECTIONS`] connections open; past that a newcomer
//!   takes the place of the oldest that has not sent a whole request and
//!   is older than [`MIN_SILENT_AGE`], else waits in the kernel's backlog;
//! - at most [`ACCEPTS_PER_SEC`] connections accepted a second (the rest
//!   wait in the backlog, costing this process nothing);
//! - a snapshot rendered at most once per [`RENDER_EVERY`] (scrapes in
//!   between get the same text), so a flood of scrapes costs the agent
//!   a few snapshots a second;
//! - each connection done within [`SCRAPE_TIMEOUT`] of its accept (a
//!   reader that stalls is closed then), request heads up to
//!   [`MAX_REQUEST`] bytes.
//!
//! GET (and HEAD) of `/metrics` or `/`; any other method is answered
//! 405, any other path 404, a head that is not HTTP/1 400, a longer one
//! 431, none with a snapshot taken.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::wake_listener;
use crate::metrics::exposition::PROMETHEUS_CONTENT_TYPE;
use crate::sync::Mutex;

/// Connections open at once.
pub const MAX_CONNECTIONS: usize = 64;
/// Connections accepted per second, at most, in bursts of up to
/// [`ACCEPT_BURST`]: a few scrapers need a few a second; past this a
/// flood waits in the kernel's backlog (its scrapes may time out there),
/// costing this process nothing.
pub const ACCEPTS_PER_SEC: u32 = 20;
/// Connections accepted at once, at most.
pub const ACCEPT_BURST: u32 = 8;
/// A connection without a whole request this old gives its place to a
/// newcomer when all are taken.
pub const MIN_SILENT_AGE: Duration = Duration::from_millis(200);
/// How long one rendered snapshot answers scrapes.
pub const RENDER_EVERY: Duration = Duration::from_millis(100);
/// The most a request head (request line and headers) may take.
pub const MAX_REQUEST: usize = 8192;
/// The most one connection may take, from its accept to the last byte
/// of the answer.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the endpoint serves: a fresh exposition per render (called on
/// the endpoint's thread, at most once per [`RENDER_EVERY`]; a panic in
/// it answers that scrape 500 and leaves the endpoint running).
pub type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running metrics endpoint; stopped (its thread joined) when dropped.
pub struct MetricsEndpoint {
    addr: SocketAddr,
    stop: Arc<Mutex<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsEndpoint {
    /// Binds `addr` and serves `render`'s output there, from a thread
    /// named `gpudirect-metrics-<name>`.
    ///
    /// # Errors
    /// Binding `addr` or starting the thread failed.
    pub fn start(addr: SocketAddr, name: &str, render: Render) -> io::Result<MetricsEndpoint> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(Mutex::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new().name(format!("gpudirect-metrics-{}", name.replace(|c: char| c.is_control(), "?"))).spawn(move || Server::new(render).run(&listener, &stop))?
        };
        tracing::info!(%addr, "metrics served at http://{addr}/metrics");
        Ok(MetricsEndpoint { addr, stop, thread: Some(thread) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for MetricsEndpoint {
    fn drop(&mut self) {
        *self.stop.lock() = true;
        wake_listener(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One client connection.
struct Client {
    stream: TcpStream,
    since: Instant,
    /// The request head read so far (reading while `out` is `None`).
    head: Vec<u8>,
    /// The answer and how much of it went out.
    out: Option<(Arc<Vec<u8>>, usize)>,
}

/// The endpoint's state, on its thread.
struct Server {
    render: Render,
    clients: Vec<Client>,
    /// Accepts allowed now (a token bucket).
    tokens: f64,
    refilled: Instant,
    /// The last rendered body and when.
    cached: Option<(Instant, Arc<String>)>,
    /// An accept failed for want of descriptors or memory: not before.
    accept_after: Option<Instant>,
}

impl Server {
    fn new(render: Render) -> Server {
        Server { render, clients: Vec::new(), tokens: f64::from(ACCEPT_BURST), refilled: Instant::now(), cached: None, accept_after: None }
    }

    fn refill(&mut self, now: Instant) {
        self.tokens = (self.tokens + now.duration_since(self.refilled).as_secs_f64() * f64::from(ACCEPTS_PER_SEC)).min(f64::from(ACCEPT_BURST));
        self.refilled = now;
    }

    /// The client that gives its place to a newcomer when all are taken:
    /// the oldest without a whole request, if past [`MIN_SILENT_AGE`].
    fn evictable(&self, now: Instant) -> Option<usize> {
        self.clients.iter().enumerate().filter(|(_, c)| c.out.is_none() && now.duration_since(c.since) >= MIN_SILENT_AGE).min_by_key(|(_, c)| c.since).map(|(i, _)| i)
    }

    /// Whether a newcomer could be taken now (tokens, descriptors, room),
    /// so the listener is polled only then: a readable listener that is
    /// not drained would wake the loop at once, forever.
    fn can_accept(&self, now: Instant) -> bool {
        self.tokens >= 1.0 && self.accept_after.is_none_or(|t| now >= t) && (self.clients.len() < MAX_CONNECTIONS || self.evictable(now).is_some())
    }

    /// Room for one more client: there is, or the oldest silent one past
    /// [`MIN_SILENT_AGE`] is closed for it.
    fn room(&mut self, now: Instant) -> bool {
        if self.clients.len() < MAX_CONNECTIONS {
            return true;
        }
        match self.evictable(now) {
            Some(i) => {
                self.clients.swap_remove(i);
                true
            }
            None => false,
        }
    }

    fn run(mut self, listener: &TcpListener, stop: &Mutex<bool>) {
        loop {
            if *stop.lock() {
                return;
            }
            let now = Instant::now();
            self.refill(now);
            while self.can_accept(now) && self.room(now) {
                match listener.accept() {
                    Ok((s, _)) => {
                        self.tokens -= 1.0;
                        if s.set_nonblocking(true).is_ok() {
                            self.clients.push(Client { stream: s, since: now, head: Vec::new(), out: None });
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        // Out of descriptors (EMFILE) or memory: the
                        // connection stays in the backlog; look again later.
                        tracing::debug!("metrics endpoint: accept: {e}");
                        self.accept_after = Some(now + Duration::from_millis(100));
                        break;
                    }
                }
            }
            if *stop.lock() {
                return;
            }
            self.clients.retain(|c| now.duration_since(c.since) < SCRAPE_TIMEOUT);
            // Listen for newcomers only while one could be taken.
            let accepting = self.can_accept(now);
            let mut fds: Vec<libc::pollfd> = Vec::with_capacity(self.clients.len() + 1);
            fds.push(libc::pollfd { fd: listener.as_raw_fd(), events: if accepting { libc::POLLIN } else { 0 }, revents: 0 });
            fds.extend(self.clients.iter().map(|c| libc::pollfd { fd: c.stream.as_raw_fd(), events: if c.out.is_some() { libc::POLLOUT } else { libc::POLLIN }, revents: 0 }));
            let next_deadline = self.clients.iter().map(|c| (c.since + SCRAPE_TIMEOUT).saturating_duration_since(now)).min();
            let next_token = (self.tokens < 1.0).then(|| Duration::from_secs_f64((1.0 - self.tokens) / f64::from(ACCEPTS_PER_SEC)));
            // A whole second at most: the stop flag is looked at then too.
            // When a silent client comes of age, or the accept pause ends.
            let next_age = self.clients.iter().filter(|c| c.out.is_none()).map(|c| (c.since + MIN_SILENT_AGE).saturating_duration_since(now)).min();
            let next_accept = self.accept_after.map(|t| t.saturating_duration_since(now));
            let wait = [next_deadline, next_token, next_age, next_accept, Some(Duration::from_secs(1))].into_iter().flatten().min().unwrap_or(Duration::from_secs(1));
            let ms = i32::try_from(wait.as_millis().max(1)).unwrap_or(1000);
            // SAFETY: `fds` is a valid array of pollfd of its length.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if n <= 0 {
                continue;
            }
            let mut done = Vec::new();
            for (i, fd) in fds.iter().enumerate().skip(1) {
                if fd.revents != 0 && !self.serve(i - 1) {
                    done.push(i - 1);
                }
            }
            for i in done.into_iter().rev() {
                self.clients.swap_remove(i);
            }
        }
    }

    /// The body to answer a scrape with: rendered at most once per
    /// [`RENDER_EVERY`].
    fn body(&mut self) -> Arc<String> {
        let now = Instant::now();
        match &self.cached {
            Some((at, body)) if now.duration_since(*at) < RENDER_EVERY => body.clone(),
            _ => {
                // A render that panics answers this scrape with nothing;
                // the endpoint goes on (the next render may work).
                let body = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (self.render)())) {
                    Ok(text) => text,
                    Err(_) => {
                        tracing::error!("metrics endpoint: rendering a snapshot panicked");
                        String::new()
                    }
                };
                let body = Arc::new(body);
                self.cached = Some((now, body.clone()));
                body
            }
        }
    }

    /// Moves client `i` on (it is ready); whether it stays open.
    fn serve(&mut self, i: usize) -> bool {
        if self.clients[i].out.is_none() {
            match read_more(&mut self.clients[i]) {
                Ok(None) => return true,
                Ok(Some(head)) => {
                    let answer = self.answer(head.as_deref());
                    self.clients[i].out = Some((Arc::new(answer), 0));
                }
                Err(_) => return false,
            }
        }
        let c = &mut self.clients[i];
        let Some((bytes, at)) = c.out.as_mut() else { return true };
        loop {
            match c.stream.write(&bytes[*at..]) {
                Ok(0) => return false,
                Ok(n) => {
                    *at += n;
                    if *at == bytes.len() {
                        return false;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }

    /// The whole answer to a request head (`None`: too long).
    fn answer(&mut self, head: Option<&[u8]>) -> Vec<u8> {
        let (status, ctype, body, send_body) = match decide(head) {
            Ask::Metrics { body } => ("200 OK", PROMETHEUS_CONTENT_TYPE, self.body(), body),
            Ask::Refuse(status, msg) => (status, "text/plain; charset=utf-8", Arc::new(msg.to_owned()), true),
        };
        let allow = if status.starts_with("405") { "Allow: GET, HEAD\r\n" } else { "" };
        let mut out = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n{allow}\r\n", body.len()).into_bytes();
        if send_body {
            out.extend_from_slice(body.as_bytes());
        }
        out
    }
}

/// Reads what client `c` sent: `Ok(None)` while its head is not whole,
/// `Ok(Some(head))` once it is (`Some(None)`: longer than
/// [`MAX_REQUEST`]), an error when it closed or failed.
fn read_more(c: &mut Client) -> io::Result<Option<Option<Vec<u8>>>> {
    let mut buf = [0u8; 2048];
    loop {
        match c.stream.read(&mut buf) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before a whole request")),
            Ok(n) => {
                // Only the new bytes (and three before them) are searched:
                // a head sent a byte at a time costs linear time.
                let from = c.head.len().saturating_sub(3);
                c.head.extend_from_slice(&buf[..n]);
                if let Some(end) = c.head[from..].windows(4).position(|w| w == b"\r\n\r\n").map(|i| from + i) {
                    c.head.truncate(end);
                    return Ok(Some(Some(std::mem::take(&mut c.head))));
                }
                if c.head.len() > MAX_REQUEST {
                    return Ok(Some(None));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Ask {
    /// The metrics (with the body unless HEAD).
    Metrics { body: bool },
    /// An answer without a snapshot: status line and message.
    Refuse(&'static str, &'static str),
}

fn decide(head: Option<&[u8]>) -> Ask {
    let Some(head) = head else { return Ask::Refuse("431 Request Header Fields Too Large", "request head too long\n") };
    let line = head.split(|&b| b == b'\r' || b == b'\n').next().unwrap_or_default();
    let mut words = line.split(|&b| b == b' ');
    let (method, target, version) = (words.next(), words.next(), words.next());
    let ok_version = matches!(version, Some(b"HTTP/1.0" | b"HTTP/1.1")) && words.next().is_none();
    let (Some(method), Some(target), true) = (method, target, ok_version) else { return Ask::Refuse("400 Bad Request", "not an HTTP/1 request\n") };
    let body = match method {
        b"GET" => true,
        b"HEAD" => false,
        _ => return Ask::Refuse("405 Method Not Allowed", "GET only\n"),
    };
    let path = target.split(|&b| b == b'?').next().unwrap_or_default();
    if path != b"/metrics" && path != b"/" {
        return Ask::Refuse("404 Not Found", "the metrics are at /metrics\n");
    }
    Ask::Metrics { body }
}

#[cfg(test)]
#[path = "endpoint_attacks.rs"]
mod attacks;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_get_of_the_metrics_is_served() {
        assert_eq!(decide(Some(b"GET /metrics HTTP/1.1\r\nHost: x")), Ask::Metrics { body: true });
        assert_eq!(decide(Some(b"GET /?x=1 HTTP/1.0")), Ask::Metrics { body: true });
        assert_eq!(decide(Some(b"HEAD /metrics HTTP/1.1")), Ask::Metrics { body: false });
        assert!(matches!(decide(Some(b"POST /metrics HTTP/1.1")), Ask::Refuse(s, _) if s.starts_with("405")));
        assert!(matches!(decide(Some(b"GET /debug HTTP/1.1")), Ask::Refuse(s, _) if s.starts_with("404")));
        assert!(matches!(decide(Some(b"GET /metrics")), Ask::Refuse(s, _) if s.starts_with("400")));
        assert!(matches!(decide(Some(b"\x16\x03\x01 tls")), Ask::Refuse(s, _) if s.starts_with("400")));
        assert!(matches!(decide(None), Ask::Refuse(s, _) if s.starts_with("431")));
    }

    fn get(addr: SocketAddr, req: &[u8]) -> String {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(req).unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    }

    /// Silent connections hold no serving thread, a huge request is
    /// refused unread past its bound, and a scraper that sends its
    /// request and never reads does not keep the others out.
    #[test]
    fn hostile_scrapers_keep_no_one_else_out() {
        let ep = MetricsEndpoint::start(SocketAddr::from(([127, 0, 0, 1], 0)), "test", Arc::new(|| "gpudirect_x 1\n".repeat(200_000))).unwrap();
        let addr = ep.addr();
        let ok = |r: &str| r.starts_with("HTTP/1.1 200") && r.contains("gpudirect_x 1");
        assert!(ok(&get(addr, b"GET /metrics HTTP/1.1\r\n\r\n")));
        // 1,000 silent connections and a dozen that never read a 2.8 MB
        // answer.
        let silent: Vec<TcpStream> = (0..1000).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let stuck: Vec<TcpStream> = (0..12)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
                s
            })
            .collect();
        std::thread::sleep(Duration::from_millis(400));
        let t = std::time::Instant::now();
        let mut served = false;
        while t.elapsed() < SCRAPE_TIMEOUT * 3 && !served {
            served = ok(&get(addr, b"GET /metrics HTTP/1.1\r\n\r\n"));
        }
        assert!(served, "a scraper was kept out for {:?}", t.elapsed());
        let huge = [b"GET /metrics HTTP/1.1\r\nX: ".as_slice(), &vec![b'a'; 64 << 10], b"\r\n\r\n"].concat();
        let mut s = TcpStream::connect(addr).unwrap();
        let _ = s.write_all(&huge);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 431"), "{}", &out[..out.len().min(80)]);
        assert!(get(addr, b"DELETE /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
        drop((silent, stuck));
    }
}
