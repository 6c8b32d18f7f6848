//! Out-of-band bootstrap: swapping endpoints and buffer descriptors with a
//! peer over TCP before RDMA can start (perftest's "Data ex. method:
//! Ethernet").
//!
//! Every message is a 12-byte header, `"GDRX"`, the protocol version
//! (u16), the message kind (u8), a reserved zero byte and the payload length
//! (u32, at most [`MAX_PAYLOAD`]), then the payload; integers are
//! big-endian. A handshake payload is the [`Endpoint`] (QP number, PSN,
//! LID, MTU code, GID), a count-prefixed list of [`RemoteBuffer`]s and a
//! length-prefixed application blob. Bytes from the peer are untrusted:
//! anything truncated, oversized, of another version or malformed is a
//! [`BootstrapError`], and nothing larger than `MAX_PAYLOAD` is allocated.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::deadline::Deadline;

use crate::gid::Gid;
use crate::port::Mtu;
use crate::decode::{Reader, Truncated};
use crate::wire::{Endpoint, RemoteBuffer};

/// Magic bytes opening every message.
pub const MAGIC: [u8; 4] = *b"GDRX";
/// The protocol version this library speaks.
pub const VERSION: u16 = 1;
/// Largest payload accepted from a peer, in bytes.
pub const MAX_PAYLOAD: u32 = 64 * 1024;
/// Most remote buffers in one handshake.
pub const MAX_BUFFERS: usize = 1024;

pub use crate::error::bootstrap::BootstrapError;

impl From<Truncated> for BootstrapError {
    fn from(t: Truncated) -> Self {
        BootstrapError::Truncated { field: t.field, need: t.need, have: t.have }
    }
}

const HEADER_LEN: usize = 12;
const KIND_HANDSHAKE: u8 = 1;
const KIND_BARRIER: u8 = 2;

/// What the two sides swap: the queue pair endpoint, the buffers the peer
/// may access, and an application blob (e.g. agreed test parameters).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Handshake {
    /// This side's queue pair endpoint.
    pub endpoint: Option<Endpoint>,
    /// Buffers the peer may access with RDMA.
    pub buffers: Vec<RemoteBuffer>,
    /// Application data, opaque to the library.
    pub app: Vec<u8>,
}

impl Handshake {
    /// Encodes the payload (without the message header).
    ///
    /// # Errors
    /// [`BootstrapError::TooLarge`] when there are more than
    /// [`MAX_BUFFERS`] buffers or the payload exceeds [`MAX_PAYLOAD`].
    pub fn encode(&self) -> Result<Vec<u8>, BootstrapError> {
        if self.buffers.len() > MAX_BUFFERS {
            return Err(BootstrapError::TooLarge { len: self.buffers.len() as u64, max: MAX_BUFFERS as u64 });
        }
        let mut out = Vec::with_capacity(64 + self.buffers.len() * 20 + self.app.len());
        match &self.endpoint {
            None => out.push(0),
            Some(e) => {
                out.push(1);
                out.extend_from_slice(&e.qp_num.to_be_bytes());
                out.extend_from_slice(&e.psn.to_be_bytes());
                out.extend_from_slice(&e.lid.to_be_bytes());
                out.push(e.mtu.to_raw() as u8);
                out.extend_from_slice(&e.gid.0);
            }
        }
        out.extend_from_slice(&(self.buffers.len() as u16).to_be_bytes());
        for b in &self.buffers {
            out.extend_from_slice(&b.to_bytes());
        }
        out.extend_from_slice(&(self.app.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.app);
        if out.len() > MAX_PAYLOAD as usize {
            return Err(BootstrapError::TooLarge { len: out.len() as u64, max: MAX_PAYLOAD.into() });
        }
        Ok(out)
    }

    /// Decodes a payload, checking every length and value.
    ///
    /// # Errors
    /// [`BootstrapError::Truncated`], [`BootstrapError::TrailingBytes`],
    /// [`BootstrapError::InvalidField`] or [`BootstrapError::TooLarge`].
    pub fn decode(payload: &[u8]) -> Result<Handshake, BootstrapError> {
        if payload.len() > MAX_PAYLOAD as usize {
            return Err(BootstrapError::TooLarge { len: payload.len() as u64, max: MAX_PAYLOAD.into() });
        }
        let mut r = Reader(payload);
        let endpoint = match r.u8("endpoint flag")? {
            0 => None,
            1 => {
                let qp_num = r.u32("qp_num")?;
                let psn = r.u32("psn")?;
                let lid = r.u16("lid")?;
                let mtu_raw = r.u8("mtu")?;
                let gid = Gid(r.array("gid")?);
                if qp_num > 0xff_ffff {
                    return Err(BootstrapError::InvalidField { field: "qp_num", value: qp_num.into() });
                }
                if psn > 0xff_ffff {
                    return Err(BootstrapError::InvalidField { field: "psn", value: psn.into() });
                }
                let mtu = Mtu::from_raw(mtu_raw.into())
                    .ok_or(BootstrapError::InvalidField { field: "mtu", value: mtu_raw.into() })?;
                Some(Endpoint { qp_num, psn, lid, gid, mtu })
            }
            v => return Err(BootstrapError::InvalidField { field: "endpoint flag", value: v.into() }),
        };
        let n = r.u16("buffer count")? as usize;
        if n > MAX_BUFFERS {
            return Err(BootstrapError::TooLarge { len: n as u64, max: MAX_BUFFERS as u64 });
        }
        // Each buffer needs 20 bytes: check before allocating for them.
        r.need("buffers", n * RemoteBuffer::WIRE_LEN)?;
        let mut buffers = Vec::with_capacity(n);
        for _ in 0..n {
            let bytes = r.take("buffer", RemoteBuffer::WIRE_LEN)?;
            let b = RemoteBuffer::parse(bytes).ok_or_else(|| BootstrapError::InvalidField {
                field: "buffer len",
                value: u64::from_be_bytes(bytes[8..16].try_into().unwrap_or_default()),
            })?;
            buffers.push(b);
        }
        let app_len = r.u32("app length")? as usize;
        let app = r.take("app", app_len)?.to_vec();
        if !r.0.is_empty() {
            return Err(BootstrapError::TrailingBytes(r.0.len()));
        }
        Ok(Handshake { endpoint, buffers, app })
    }
}

/// Parses a message header; returns the kind and payload length.
///
/// # Errors
/// [`BootstrapError::BadMagic`], [`BootstrapError::Version`] or
/// [`BootstrapError::TooLarge`].
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<(u8, u32), BootstrapError> {
    let magic = [h[0], h[1], h[2], h[3]];
    if magic != MAGIC {
        return Err(BootstrapError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([h[4], h[5]]);
    if version != VERSION {
        return Err(BootstrapError::Version { peer: version, ours: VERSION });
    }
    let len = u32::from_be_bytes([h[8], h[9], h[10], h[11]]);
    if len > MAX_PAYLOAD {
        return Err(BootstrapError::TooLarge { len: len.into(), max: MAX_PAYLOAD.into() });
    }
    Ok((h[6], len))
}

fn header(kind: u8, len: usize) -> [u8; HEADER_LEN] {
    let mut h = [0; HEADER_LEN];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_be_bytes());
    h[6] = kind;
    h[8..].copy_from_slice(&(len as u32).to_be_bytes());
    h
}

/// A TCP connection to the peer for the bootstrap exchange. Every write,
/// and every incoming message as a whole, is bounded by the timeout
/// (default 60 s): a peer that sends nothing, or trickles its bytes, gets
/// [`BootstrapError::Timeout`].
#[derive(Debug)]
pub struct OobChannel {
    stream: TcpStream,
    timeout: Duration,
    /// The whole exchange's end, when one is set ([`within`](Self::within)).
    whole: Deadline,
}

/// Default bound on every bootstrap write, incoming message and connect attempt.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// perftest's TCP port for the exchange, used by this crate's tools too.
pub const DEFAULT_PORT: u16 = 18515;

/// `addr` with `port` appended unless it names one, for command lines that
/// take `HOST` or `HOST:PORT`: `node1`, `10.0.0.1` and a bare IPv6 address
/// (`fe80::1`, bracketed on the way) get `port`; `node1:7`, `10.0.0.1:7`
/// and `[::1]:7` keep theirs.
///
/// ```
/// use gpudirect::bootstrap::with_port;
/// assert_eq!(with_port("node1", 18515), "node1:18515");
/// assert_eq!(with_port("node1:7000", 18515), "node1:7000");
/// assert_eq!(with_port("fe80::1", 18515), "[fe80::1]:18515");
/// ```
pub fn with_port(addr: &str, port: u16) -> String {
    if addr.parse::<std::net::SocketAddr>().is_ok() {
        return addr.to_string();
    }
    match addr.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && !h.contains(':') && p.parse::<u16>().is_ok() => addr.to_string(),
        _ if addr.contains(':') && !addr.starts_with('[') => format!("[{addr}]:{port}"),
        _ => format!("{}:{port}", addr.trim_end_matches(':')),
    }
}

fn io_err(op: impl Into<String>, source: io::Error, timeout: Duration) -> BootstrapError {
    match source.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => BootstrapError::Timeout(timeout),
        _ => BootstrapError::Io { op: op.into(), source },
    }
}

impl OobChannel {
    /// Waits for one peer on `listener`.
    ///
    /// # Errors
    /// [`BootstrapError::Timeout`] when nobody connects in time, or
    /// [`BootstrapError::Io`].
    pub fn accept(listener: &TcpListener, timeout: Duration) -> Result<OobChannel, BootstrapError> {
        let deadline = Deadline::after(timeout);
        listener.set_nonblocking(true).map_err(|e| io_err("listen", e, timeout))?;
        let stream = loop {
            match listener.accept() {
                Ok((s, _)) => break s,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if deadline.passed() {
                        return Err(BootstrapError::Timeout(timeout));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("accept", e, timeout)),
            }
        };
        Self::from_stream(stream, timeout)
    }

    /// Connects to a listening peer, retrying until `timeout` (the peer may
    /// start later).
    ///
    /// # Errors
    /// [`BootstrapError::Timeout`] or [`BootstrapError::Io`] (e.g. an
    /// address that does not resolve).
    pub fn connect(addr: impl ToSocketAddrs + std::fmt::Display, timeout: Duration) -> Result<OobChannel, BootstrapError> {
        let deadline = Deadline::after(timeout);
        let op = format!("connect to {addr}");
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| io_err(op.clone(), e, timeout))?.collect();
        loop {
            let mut last = None;
            for a in &addrs {
                let left = deadline.left().unwrap_or(Duration::MAX).max(Duration::from_millis(1));
                match TcpStream::connect_timeout(a, left.min(Duration::from_secs(5))) {
                    Ok(s) => return Self::from_stream(s, timeout),
                    Err(e) => last = Some(e),
                }
            }
            if deadline.passed() {
                return Err(match last {
                    Some(e) => io_err(op, e, timeout),
                    None => BootstrapError::Io { op, source: io::Error::new(io::ErrorKind::NotFound, "no address") },
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Wraps an established stream.
    ///
    /// # Errors
    /// [`BootstrapError::Io`] when the socket options cannot be set.
    pub fn from_stream(stream: TcpStream, timeout: Duration) -> Result<OobChannel, BootstrapError> {
        let setup = |s: &TcpStream| -> io::Result<()> {
            s.set_nonblocking(false)?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(timeout))?;
            s.set_write_timeout(Some(timeout))
        };
        setup(&stream).map_err(|e| io_err("socket setup", e, timeout))?;
        Ok(OobChannel { stream, timeout, whole: Deadline::never() })
    }

    /// The peer's address: where to reach it by other means too (rdma_cm
    /// on RoCE, say, when the bootstrap runs over the RDMA NIC's network).
    ///
    /// # Errors
    /// [`BootstrapError::Io`] when the socket is no longer connected.
    pub fn peer_addr(&self) -> Result<std::net::SocketAddr, BootstrapError> {
        self.stream.peer_addr().map_err(|e| io_err("getpeername", e, self.timeout))
    }

    /// Bounds the rest of the exchange as a whole to `whole` from now, on
    /// top of each message's own bound: a peer that answers each message
    /// just in time cannot stretch a handshake of several.
    pub fn within(&mut self, whole: Duration) {
        self.whole = Deadline::after(whole);
    }

    fn send(&mut self, kind: u8, payload: &[u8]) -> Result<(), BootstrapError> {
        if let Some(left) = self.whole.left() {
            if left.is_zero() {
                return Err(BootstrapError::Timeout(self.timeout));
            }
            self.stream.set_write_timeout(Some(left.min(self.timeout))).map_err(|e| io_err("socket setup", e, self.timeout))?;
        }
        let mut msg = Vec::with_capacity(HEADER_LEN + payload.len());
        msg.extend_from_slice(&header(kind, payload.len()));
        msg.extend_from_slice(payload);
        self.stream.write_all(&msg).map_err(|e| io_err("write", e, self.timeout))
    }

    /// Fills `buf` before `deadline`: each read waits at most for what is
    /// left, so a peer that trickles bytes cannot stretch a message beyond
    /// the timeout.
    fn read_exact(&mut self, buf: &mut [u8], deadline: Deadline) -> Result<(), BootstrapError> {
        let mut got = 0;
        while got < buf.len() {
            let left = deadline.left();
            if left.is_some_and(|l| l.is_zero()) {
                return Err(BootstrapError::Timeout(self.timeout));
            }
            // No deadline (a timeout too long to represent): block.
            self.stream.set_read_timeout(left).map_err(|e| io_err("socket setup", e, self.timeout))?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(BootstrapError::Closed { expected: buf.len(), got }),
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err("read", e, self.timeout)),
            }
        }
        Ok(())
    }

    /// Reads one message; the whole of it must arrive within the timeout.
    fn recv(&mut self, expected: u8) -> Result<Vec<u8>, BootstrapError> {
        let deadline = Deadline::after(self.timeout).earlier(self.whole);
        let mut h = [0; HEADER_LEN];
        self.read_exact(&mut h, deadline)?;
        let (kind, len) = decode_header(&h)?;
        if kind != expected {
            return Err(BootstrapError::UnexpectedKind { expected, got: kind });
        }
        let mut payload = vec![0; len as usize];
        self.read_exact(&mut payload, deadline)?;
        Ok(payload)
    }

    /// Sends our handshake and returns the peer's. Both sides call it; the
    /// messages are small enough that neither write can block the other.
    ///
    /// # Errors
    /// Any [`BootstrapError`].
    pub fn exchange(&mut self, local: &Handshake) -> Result<Handshake, BootstrapError> {
        self.send(KIND_HANDSHAKE, &local.encode()?)?;
        Handshake::decode(&self.recv(KIND_HANDSHAKE)?)
    }

    /// Returns once the peer has called `barrier` too.
    ///
    /// # Errors
    /// Any [`BootstrapError`], e.g. [`BootstrapError::Closed`] when the
    /// peer exited instead.
    pub fn barrier(&mut self) -> Result<(), BootstrapError> {
        self.send(KIND_BARRIER, &[])?;
        let p = self.recv(KIND_BARRIER)?;
        if !p.is_empty() {
            return Err(BootstrapError::TrailingBytes(p.len()));
        }
        Ok(())
    }
}

/// Wakes a thread sleeping in poll(2) on a listener bound at `bound`
/// (unspecified: through loopback) by connecting to it; a thread that
/// stops must not wait out its next look (the engine's control server,
/// the metrics endpoint). Best effort, bounded to 100 ms.
pub fn wake_listener(bound: SocketAddr) {
    let to = match bound.ip() {
        IpAddr::V4(a) if a.is_unspecified() => SocketAddr::from(([127, 0, 0, 1], bound.port())),
        IpAddr::V6(a) if a.is_unspecified() => SocketAddr::from((Ipv6Addr::LOCALHOST, bound.port())),
        _ => bound,
    };
    let _ = TcpStream::connect_timeout(&to, Duration::from_millis(100));
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// `Duration::MAX` means "no limit" at every entry point; it used to
    /// panic computing `Instant::now() + timeout`.
    #[test]
    fn every_timeout_accepts_duration_max() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = OobChannel::connect(addr, Duration::MAX).unwrap();
            c.exchange(&sample()).unwrap()
        });
        let mut s = OobChannel::accept(&l, Duration::MAX).unwrap();
        assert_eq!(s.exchange(&sample()).unwrap(), sample());
        assert_eq!(t.join().unwrap(), sample());
    }

    fn sample() -> Handshake {
        Handshake {
            endpoint: Some(Endpoint {
                qp_num: 0x11,
                psn: 0xabcdef,
                lid: 0,
                gid: Gid("::ffff:192.0.2.1".parse::<std::net::Ipv6Addr>().unwrap().octets()),
                mtu: Mtu::Mtu4096,
            }),
            buffers: vec![RemoteBuffer { addr: 0x7f00_0000_1000, len: 65536, rkey: 0x1234 }],
            app: b"size=64".to_vec(),
        }
    }

    #[test]
    fn round_trip() {
        let h = sample();
        assert_eq!(Handshake::decode(&h.encode().unwrap()).unwrap(), h);
        assert_eq!(Handshake::decode(&Handshake::default().encode().unwrap()).unwrap(), Handshake::default());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let bytes = sample().encode().unwrap();
        for n in 0..bytes.len() {
            assert!(Handshake::decode(&bytes[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        let mut long = bytes.clone();
        long.push(0);
        assert!(matches!(Handshake::decode(&long), Err(BootstrapError::TrailingBytes(1))));
    }

    #[test]
    fn invalid_fields_are_named() {
        let mut b = sample().encode().unwrap();
        b[11] = 9; // MTU code: flag(1) + qpn(4) + psn(4) + lid(2)
        assert!(matches!(Handshake::decode(&b), Err(BootstrapError::InvalidField { field: "mtu", value: 9 })));
        let mut b = sample().encode().unwrap();
        b[1] = 0xff; // QP number over 24 bits
        assert!(matches!(Handshake::decode(&b), Err(BootstrapError::InvalidField { field: "qp_num", .. })));
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        // 1000 buffers announced, none present.
        let b = [0u8, 0x03, 0xe8];
        assert!(matches!(Handshake::decode(&b), Err(BootstrapError::Truncated { field: "buffers", need: 20000, have: 0 })));
        // An app blob of 4 GiB announced.
        let b = [0u8, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(matches!(Handshake::decode(&b), Err(BootstrapError::Truncated { field: "app", .. })));
    }

    #[test]
    fn headers_are_checked() {
        assert!(matches!(decode_header(b"HTTP/1.1 200"), Err(BootstrapError::BadMagic(_))));
        let mut h = header(KIND_HANDSHAKE, 10);
        h[5] = 2;
        assert!(matches!(decode_header(&h), Err(BootstrapError::Version { peer: 2, ours: 1 })));
        let h = header(KIND_HANDSHAKE, MAX_PAYLOAD as usize + 1);
        assert!(matches!(decode_header(&h), Err(BootstrapError::TooLarge { .. })));
    }

    #[test]
    fn random_and_mutated_bytes_never_panic() {
        let good = sample().encode().unwrap();
        let mut rng = testkit::Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..200_000 {
            let r = rng.next();
            let mut b = if r & 1 == 0 {
                let len = (r >> 8) as usize % 128;
                rng.bytes(len)
            } else {
                let mut b = good.clone();
                let i = (r >> 8) as usize % b.len();
                b[i] ^= (r >> 32) as u8 | 1;
                b
            };
            if r & 2 != 0 {
                b.truncate((r >> 40) as usize % (b.len() + 1));
            }
            let _ = Handshake::decode(&b);
            let mut h = [0u8; HEADER_LEN];
            for (d, x) in h.iter_mut().zip(b.iter()) {
                *d = *x;
            }
            let _ = decode_header(&h);
        }
    }

    #[test]
    fn exchange_and_barrier_over_tcp() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let mut c = OobChannel::accept(&l, Duration::from_secs(10)).unwrap();
            let peer = c.exchange(&Handshake { app: b"server".to_vec(), ..Default::default() }).unwrap();
            c.barrier().unwrap();
            peer
        });
        let mut c = OobChannel::connect(addr, Duration::from_secs(10)).unwrap();
        let peer = c.exchange(&sample()).unwrap();
        c.barrier().unwrap();
        assert_eq!(peer.app, b"server");
        assert_eq!(t.join().unwrap(), sample());
    }

    #[test]
    fn garbage_peer_gives_typed_errors() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
            let (mut s2, _) = l.accept().unwrap();
            s2.write_all(&header(KIND_HANDSHAKE, 100)).unwrap(); // then hang up mid-payload
        });
        let mut c = OobChannel::connect(addr, Duration::from_secs(10)).unwrap();
        assert!(matches!(c.exchange(&sample()), Err(BootstrapError::BadMagic(m)) if &m == b"GET "));
        let mut c = OobChannel::connect(addr, Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        assert!(matches!(c.exchange(&sample()), Err(BootstrapError::Closed { expected: 100, .. })));
    }

    #[test]
    fn silent_peer_times_out() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut c = OobChannel::connect(addr, Duration::from_millis(300)).unwrap();
        let start = Instant::now();
        assert!(matches!(c.exchange(&sample()), Err(BootstrapError::Timeout(_))));
        assert!(start.elapsed() < Duration::from_secs(5));
        drop(l);
    }
}

