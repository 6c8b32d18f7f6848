//! One scrape of a metrics endpoint: a minimal HTTP/1.1 client over a
//! plain [`TcpStream`], for `GET /metrics` and nothing else. The whole
//! scrape (connecting, sending, reading the answer) is bounded by one
//! timeout; the answer's head by [`MAX_HEAD`] bytes and its body by
//! [`MAX_BODY`]; anything but `200` with a whole UTF-8 body is a typed
//! [`ScrapeError`]. The agent's endpoint answers with a `Content-Length`
//! and closes; a chunked answer is refused rather than read.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

use gpudirect::deadline::Deadline;

use super::expo::shown;

/// The most bytes of a body read: an agent's exposition is a few KiB.
pub const MAX_BODY: usize = 4 << 20;
/// The most bytes of an answer's status line and headers.
pub const MAX_HEAD: usize = 64 << 10;

/// Where an endpoint listens: `HOST:PORT`, `[V6]:PORT`, or `PORT` for
/// 127.0.0.1.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    host: String,
    port: u16,
}

impl Target {
    /// Reads `addr`: `HOST:PORT`, `[IPV6]:PORT` or `PORT` (127.0.0.1).
    ///
    /// # Errors
    /// [`ScrapeError::BadAddress`]: no port, port 0 or past 65535, a host
    /// with characters no host name or address has.
    pub fn parse(addr: &str) -> Result<Target, ScrapeError> {
        let bad = |why| ScrapeError::BadAddress { addr: shown(addr), why };
        let (host, port) = if addr.bytes().all(|b| b.is_ascii_digit()) {
            ("127.0.0.1", addr)
        } else if let Some(rest) = addr.strip_prefix('[') {
            let (h, p) = rest.split_once("]:").ok_or_else(|| bad("an IPv6 address is written [ADDR]:PORT"))?;
            if h.is_empty() || !h.bytes().all(|b| b.is_ascii_hexdigit() || matches!(b, b':' | b'.')) {
                return Err(bad("not an IPv6 address between the brackets"));
            }
            (h, p)
        } else {
            let (h, p) = addr.rsplit_once(':').ok_or_else(|| bad("give HOST:PORT, or PORT for 127.0.0.1"))?;
            if h.is_empty() || !h.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')) {
                return Err(bad("not a host name or IPv4 address before the port (an IPv6 address goes in brackets)"));
            }
            (h, p)
        };
        let port = port.parse::<u16>().ok().filter(|&p| p != 0).ok_or_else(|| bad("the port is not a number from 1 to 65535"))?;
        Ok(Target { host: host.to_owned(), port })
    }

    /// The endpoint's address for messages and for the `Host` header.
    fn host_port(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.host_port())
    }
}

/// Why a scrape brought no exposition back.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ScrapeError {
    /// The address given is not one.
    #[error("{addr} is not an endpoint's address: {why}")]
    BadAddress {
        /// The address as given (escaped).
        addr: String,
        /// What is wrong with it.
        why: &'static str,
    },
    /// The host name did not resolve.
    #[error("cannot resolve {target}: {source}")]
    Resolve {
        /// The endpoint.
        target: String,
        /// The resolver's error.
        source: io::Error,
    },
    /// Nothing accepted the connection.
    #[error("cannot connect to {target}: {source} (is an agent serving its metrics there? AgentConfig::metrics or GPUDIRECT_METRICS)")]
    Connect {
        /// The endpoint.
        target: String,
        /// The last address's error.
        source: io::Error,
    },
    /// The scrape took longer than its bound.
    #[error("{target} did not answer within {timeout:?} (waiting for {waiting})")]
    Timeout {
        /// The endpoint.
        target: String,
        /// The bound on the whole scrape.
        timeout: Duration,
        /// What it was waiting for.
        waiting: &'static str,
    },
    /// The connection failed midway.
    #[error("scraping {target}: {source}")]
    Io {
        /// The endpoint.
        target: String,
        /// The error.
        source: io::Error,
    },
    /// The answer is not HTTP/1.
    #[error("{target} did not answer in HTTP/1 ({why})")]
    NotHttp {
        /// The endpoint.
        target: String,
        /// What was wrong.
        why: &'static str,
    },
    /// An answer other than `200`.
    #[error("{target} answered {code} {reason} to GET /metrics")]
    Status {
        /// The endpoint.
        target: String,
        /// The status code.
        code: u16,
        /// Its reason phrase (escaped).
        reason: String,
    },
    /// An answer this client does not read (chunked, two lengths).
    #[error("{target}'s answer is not one this client reads: {why}")]
    Unsupported {
        /// The endpoint.
        target: String,
        /// What it was.
        why: &'static str,
    },
    /// A head or body past its bound.
    #[error("{target}'s answer has a {what} over {max} bytes: not an agent's metrics")]
    TooLarge {
        /// The endpoint.
        target: String,
        /// `head` or `body`.
        what: &'static str,
        /// The bound.
        max: usize,
    },
    /// The connection closed before the body it announced.
    #[error("{target} closed the connection after {got} of {expected} bytes")]
    Truncated {
        /// The endpoint.
        target: String,
        /// Bytes read.
        got: usize,
        /// Bytes announced.
        expected: usize,
    },
    /// The body is not UTF-8 text.
    #[error("{target}'s answer is not UTF-8 text")]
    NotUtf8 {
        /// The endpoint.
        target: String,
    },
}

/// An open scrape: the stream, its deadline, what it is for messages.
struct Conn<'a> {
    stream: TcpStream,
    deadline: Deadline,
    target: &'a Target,
    timeout: Duration,
}

impl Conn<'_> {
    fn io(&self, source: io::Error, waiting: &'static str) -> ScrapeError {
        if matches!(source.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
            ScrapeError::Timeout { target: self.target.to_string(), timeout: self.timeout, waiting }
        } else {
            ScrapeError::Io { target: self.target.to_string(), source }
        }
    }

    /// The time left, or a timeout waiting for `waiting`.
    fn left(&self, waiting: &'static str) -> Result<Duration, ScrapeError> {
        self.deadline.left().filter(|l| !l.is_zero()).ok_or_else(|| ScrapeError::Timeout { target: self.target.to_string(), timeout: self.timeout, waiting })
    }

    /// Reads more into `buf`, up to `cap` bytes in all; 0 at the end.
    fn fill(&mut self, buf: &mut Vec<u8>, cap: usize, waiting: &'static str) -> Result<usize, ScrapeError> {
        let left = self.left(waiting)?;
        self.stream.set_read_timeout(Some(left)).map_err(|e| self.io(e, waiting))?;
        let mut chunk = [0u8; 16 << 10];
        let want = chunk.len().min(cap.saturating_sub(buf.len()).max(1));
        loop {
            match self.stream.read(&mut chunk[..want]) {
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io(e, waiting)),
            }
        }
    }
}

/// Connects to the first of the target's addresses that accepts.
fn connect(target: &Target, deadline: &Deadline, timeout: Duration) -> Result<TcpStream, ScrapeError> {
    let addrs: Vec<SocketAddr> =
        (target.host.as_str(), target.port).to_socket_addrs().map_err(|source| ScrapeError::Resolve { target: target.to_string(), source })?.collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "the name resolved to no address");
    for a in addrs {
        let Some(left) = deadline.left().filter(|l| !l.is_zero()) else { break };
        match TcpStream::connect_timeout(&a, left) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    if matches!(last.kind(), io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock) || deadline.passed() {
        return Err(ScrapeError::Timeout { target: target.to_string(), timeout, waiting: "the connection" });
    }
    Err(ScrapeError::Connect { target: target.to_string(), source: last })
}

/// GETs `/metrics` from `target` within `timeout`, and returns the body.
///
/// # Errors
/// A [`ScrapeError`]: no connection, no whole answer in time, a status
/// other than 200, a head or body past its bound, a body not UTF-8.
pub fn scrape(target: &Target, timeout: Duration) -> Result<String, ScrapeError> {
    let deadline = Deadline::after(timeout);
    let stream = connect(target, &deadline, timeout)?;
    let mut c = Conn { stream, deadline, target, timeout };
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {}\r\nUser-Agent: gpudirect-stats\r\nAccept: text/plain\r\nConnection: close\r\n\r\n", target.host_port());
    let left = c.left("the request to be taken")?;
    c.stream.set_write_timeout(Some(left)).map_err(|e| c.io(e, "the request to be taken"))?;
    c.stream.write_all(request.as_bytes()).map_err(|e| c.io(e, "the request to be taken"))?;

    let mut buf = Vec::with_capacity(8 << 10);
    let head_end = loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break end;
        }
        if buf.len() > MAX_HEAD {
            return Err(ScrapeError::TooLarge { target: target.to_string(), what: "head", max: MAX_HEAD });
        }
        if c.fill(&mut buf, MAX_HEAD + 4, "an answer")? == 0 {
            return Err(ScrapeError::NotHttp { target: target.to_string(), why: if buf.is_empty() { "closed without an answer" } else { "closed inside the head" } });
        }
    };
    let length = head(target, &buf[..head_end])?;
    let mut body = buf.split_off(head_end + 4);
    let cap = length.unwrap_or(MAX_BODY + 1);
    while body.len() < cap {
        if c.fill(&mut body, cap, "the body")? == 0 {
            break;
        }
    }
    match length {
        Some(expected) if body.len() < expected => return Err(ScrapeError::Truncated { target: target.to_string(), got: body.len(), expected }),
        Some(expected) => body.truncate(expected),
        None if body.len() > MAX_BODY => return Err(ScrapeError::TooLarge { target: target.to_string(), what: "body", max: MAX_BODY }),
        None => {}
    }
    String::from_utf8(body).map_err(|_| ScrapeError::NotUtf8 { target: target.to_string() })
}

/// Checks an answer's head: HTTP/1, 200, no transfer coding; the body's
/// length when given.
fn head(target: &Target, head: &[u8]) -> Result<Option<usize>, ScrapeError> {
    let not_http = |why| ScrapeError::NotHttp { target: target.to_string(), why };
    let text = std::str::from_utf8(head).map_err(|_| not_http("a head that is not text"))?;
    let mut lines = text.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let mut words = status.splitn(3, ' ');
    let (Some(version), Some(code)) = (words.next(), words.next()) else { return Err(not_http("no status line")) };
    if !version.starts_with("HTTP/1.") {
        return Err(not_http("no HTTP/1 status line"));
    }
    let code: u16 = code.parse().map_err(|_| not_http("a status that is not a number"))?;
    if code != 200 {
        return Err(ScrapeError::Status { target: target.to_string(), code, reason: shown(words.next().unwrap_or_default()) });
    }
    let mut length: Option<usize> = None;
    for line in lines {
        let (name, value) = line.split_once(':').ok_or_else(|| not_http("a header line without a colon"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") && !value.eq_ignore_ascii_case("identity") {
            return Err(ScrapeError::Unsupported { target: target.to_string(), why: "a transfer coding (chunked)" });
        }
        if name.eq_ignore_ascii_case("content-encoding") && !value.eq_ignore_ascii_case("identity") {
            return Err(ScrapeError::Unsupported { target: target.to_string(), why: "a compressed body" });
        }
        if name.eq_ignore_ascii_case("content-length") {
            let n: usize = value.parse().map_err(|_| not_http("a Content-Length that is not a number"))?;
            if length.is_some_and(|l| l != n) {
                return Err(ScrapeError::Unsupported { target: target.to_string(), why: "two different Content-Lengths" });
            }
            if n > MAX_BODY {
                return Err(ScrapeError::TooLarge { target: target.to_string(), what: "body", max: MAX_BODY });
            }
            length = Some(n);
        }
    }
    Ok(length)
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::time::Instant;

    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(Target::parse("9400").unwrap().to_string(), "127.0.0.1:9400");
        assert_eq!(Target::parse("node-7.cluster:9400").unwrap().to_string(), "node-7.cluster:9400");
        assert_eq!(Target::parse("[::1]:80").unwrap().to_string(), "[::1]:80");
        for bad in ["", "0", "70000", "host", "host:", ":80", "::1:80", "a b:80", "h\r\nX: y:80", "[]:80", "[::1]80", "http://h:80"] {
            assert!(matches!(Target::parse(bad), Err(ScrapeError::BadAddress { .. })), "{bad:?}");
        }
    }

    /// Serves each connection `answer` (after reading the request).
    fn serve(answer: Vec<u8>) -> Target {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for s in l.incoming() {
                let Ok(mut s) = s else { return };
                let mut req = [0u8; 4096];
                let _ = s.read(&mut req);
                let _ = s.write_all(&answer);
            }
        });
        Target::parse(&port.to_string()).unwrap()
    }

    fn get(answer: &[u8]) -> Result<String, ScrapeError> {
        scrape(&serve(answer.to_vec()), Duration::from_secs(5))
    }

    #[test]
    fn answers() {
        assert_eq!(get(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nx 1\nMORE").unwrap(), "x 1\n");
        assert_eq!(get(b"HTTP/1.0 200 OK\r\n\r\nx 1\n").unwrap(), "x 1\n");
        assert!(matches!(get(b"HTTP/1.1 404 Not Found\r\n\r\n"), Err(ScrapeError::Status { code: 404, .. })));
        assert!(matches!(get(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nx"), Err(ScrapeError::Truncated { got: 1, expected: 10, .. })));
        assert!(matches!(get(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n"), Err(ScrapeError::Unsupported { .. })));
        assert!(matches!(get(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999\r\n\r\n"), Err(ScrapeError::TooLarge { what: "body", .. })));
        assert!(matches!(get(b"SSH-2.0-OpenSSH_9.2\r\n\r\n"), Err(ScrapeError::NotHttp { .. })));
        assert!(matches!(get(b""), Err(ScrapeError::NotHttp { .. })));
        assert!(matches!(get(b"HTTP/1.1 200 OK\r\n\r\n\xff\xfe"), Err(ScrapeError::NotUtf8 { .. })));
        let huge_head = [b"HTTP/1.1 200 OK\r\nX: ".as_slice(), &vec![b'a'; MAX_HEAD + 10]].concat();
        assert!(matches!(get(&huge_head), Err(ScrapeError::TooLarge { what: "head", .. })));
        let huge_body = [b"HTTP/1.1 200 OK\r\n\r\n".as_slice(), &vec![b'a'; MAX_BODY + 10]].concat();
        assert!(matches!(get(&huge_body), Err(ScrapeError::TooLarge { what: "body", .. })));
    }

    #[test]
    fn silence_times_out_and_nothing_listening_is_named() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let target = Target::parse(&l.local_addr().unwrap().port().to_string()).unwrap();
        let t = Instant::now();
        let e = scrape(&target, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, ScrapeError::Timeout { waiting: "an answer", .. }), "{e}");
        assert!(t.elapsed() < Duration::from_secs(3));
        drop(l);
        let e = scrape(&target, Duration::from_secs(2)).unwrap_err();
        assert!(matches!(e, ScrapeError::Connect { .. }), "{e}");
        assert!(e.to_string().contains("is an agent serving its metrics there"), "{e}");
    }
}
