//! The metrics endpoint: an HTTP/1.1 server of one resource, the text
//! exposition of a fresh snapshot, on threads of its own (the accept
//! loop of `serve.rs`), so a slow or hostile scraper never touches the
//! data path: it holds at most one of [`MAX_SCRAPES`] serving threads for
//! at most [`SCRAPE_TIMEOUT`], and a connection that says nothing holds
//! no thread at all. GET (and HEAD) of `/metrics` or `/`; any other
//! method is answered 405, any other path 404, a request head longer
//! than [`MAX_REQUEST`] or not HTTP 400, all without a snapshot taken.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use gpudirect::deadline::Deadline;
use gpudirect::sync::Mutex;

use crate::metrics::text::PROMETHEUS_CONTENT_TYPE;
use crate::serve::{serve_each, wake_listener, Server, WhenFull};

/// Scrapes served at once; a connection that speaks while all are taken
/// takes the slot of one older than the accept loop's minimum age, else
/// it is closed (a scraper retries at its next interval).
pub const MAX_SCRAPES: usize = 4;
/// The most a request head (request line and headers) may take.
pub const MAX_REQUEST: usize = 8192;
/// The most one scrape may take, reading the request and writing the
/// answer together.
pub const SCRAPE_TIMEOUT: Duration = Duration::from_secs(5);

/// What the endpoint serves: a fresh exposition per scrape.
pub(crate) type Render = Arc<dyn Fn() -> String + Send + Sync>;

/// A running endpoint; stopped (its threads joined) when dropped.
pub(crate) struct Endpoint {
    addr: SocketAddr,
    stop: Arc<Mutex<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl Endpoint {
    /// Binds `addr` and serves `render`'s output there.
    pub(crate) fn start(addr: SocketAddr, name: &str, render: Render) -> io::Result<Endpoint> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(Mutex::new(false));
        let thread = {
            let stop = stop.clone();
            let name = format!("gpudirect-metrics-{name}");
            std::thread::Builder::new().name(name.clone()).spawn(move || {
                let server = Server { name: &name, max: MAX_SCRAPES, when_full: WhenFull::Close };
                serve_each(&listener, &stop, &server, |_| Ok(()), |s, from, (), _slot| {
                    if let Err(e) = scrape(s, &render) {
                        tracing::debug!(%from, "metrics request not served: {e}");
                    }
                });
            })?
        };
        tracing::info!(%addr, "metrics served at http://{addr}/metrics");
        Ok(Endpoint { addr, stop, thread: Some(thread) })
    }

    /// Where it listens.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        *self.stop.lock() = true;
        wake_listener(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Reads a request head, within the deadline and [`MAX_REQUEST`].
fn read_head(s: &mut TcpStream, deadline: &Deadline) -> io::Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.left().filter(|l| !l.is_zero()).ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "request not read in time"))?;
        s.set_read_timeout(Some(left))?;
        let n = s.read(&mut buf)?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "closed before a whole request"));
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(end) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            head.truncate(end);
            return Ok(Some(head));
        }
        if head.len() > MAX_REQUEST {
            return Ok(None);
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

/// Serves one connection: one request, one answer, closed.
fn scrape(mut s: TcpStream, render: &Render) -> io::Result<()> {
    let deadline = Deadline::after(SCRAPE_TIMEOUT);
    let head = read_head(&mut s, &deadline)?;
    let (status, ctype, body, send_body) = match decide(head.as_deref()) {
        Ask::Metrics { body } => ("200 OK", PROMETHEUS_CONTENT_TYPE, render(), body),
        Ask::Refuse(status, msg) => (status, "text/plain; charset=utf-8", msg.to_owned(), true),
    };
    let mut answer = format!("HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n", body.len());
    if status.starts_with("405") {
        answer.push_str("Allow: GET, HEAD\r\n");
    }
    answer.push_str("\r\n");
    let mut bytes = answer.into_bytes();
    if send_body {
        bytes.extend_from_slice(body.as_bytes());
    }
    // A scraper that does not read holds its thread until the deadline.
    for chunk in bytes.chunks(16 << 10) {
        let left = deadline.left().filter(|l| !l.is_zero()).ok_or_else(|| io::Error::new(io::ErrorKind::TimedOut, "answer not taken in time"))?;
        s.set_write_timeout(Some(left))?;
        s.write_all(chunk)?;
    }
    s.flush()
}

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
        let ep = Endpoint::start(SocketAddr::from(([127, 0, 0, 1], 0)), "test", Arc::new(|| "gpudirect_x 1\n".repeat(200_000))).unwrap();
        let addr = ep.addr();
        let ok = |r: &str| r.starts_with("HTTP/1.1 200") && r.contains("gpudirect_x 1");
        assert!(ok(&get(addr, b"GET /metrics HTTP/1.1\r\n\r\n")));
        // 200 silent connections and MAX_SCRAPES that never read a
        // 2.8 MB answer.
        let silent: Vec<TcpStream> = (0..200).map(|_| TcpStream::connect(addr).unwrap()).collect();
        let stuck: Vec<TcpStream> = (0..MAX_SCRAPES)
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
