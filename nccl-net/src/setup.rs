//! Connection setup: `listen` makes a handle NCCL carries to the peer,
//! `connect` and `accept` exchange queue pair endpoints over TCP. Neither
//! blocks: each call advances a state machine and returns no comm until it
//! is done, as NCCL expects.
//!
//! # Who may connect
//! The handle holds 16 random bytes, and it travels only through NCCL's
//! own bootstrap, to the ranks of the communicator. A connection that does
//! not present them first is closed before anything is created for it, so
//! whoever else reaches the port learns nothing and gets no queue pair and
//! no rkey. At most [`MAX_PENDING`] unproven connections are held, each for
//! at most [`HELLO_WITHIN`]; a slow or silent one is dropped and does not
//! hold up the others. Setup as a whole fails after [`SETUP_WITHIN`].

use std::collections::HashSet;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpudirect::{current_gpu, Endpoint, Gid, Mtu, RemoteBuffer};

use crate::abi::HANDLE_MAXSIZE;
use crate::comm::{Comm, Parts};
use crate::error::{NetError, Result};
use crate::log;
use crate::site::Site;
use crate::verdict::Side;

/// Unproven connections a listener holds at once.
pub const MAX_PENDING: usize = 16;
/// How long a connection may take to prove itself.
pub const HELLO_WITHIN: Duration = Duration::from_secs(10);
/// How long `connect` or one `accept` may take in all.
pub const SETUP_WITHIN: Duration = Duration::from_secs(120);

const MAGIC: [u8; 8] = *b"GDRNCCL\x01";
const HELLO: [u8; 8] = *b"GDNCHELO";
const REPLY: [u8; 8] = *b"GDNCRPLY";
const READY: [u8; 8] = *b"GDNCRDY!";
const HELLO_LEN: usize = 8 + 16 + ENDPOINT_LEN + 12;
const REPLY_LEN: usize = 8 + ENDPOINT_LEN + 12;
const ENDPOINT_LEN: usize = 4 + 4 + 2 + 1 + 16;
/// Where `connect` keeps its state in NCCL's copy of the handle.
const STAGE_AT: usize = 48;

/// The handle's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Where the listener listens.
    pub addr: SocketAddr,
    /// What a connection must present.
    pub token: [u8; 16],
}

impl Handle {
    /// Writes the handle into NCCL's `NCCL_NET_HANDLE_MAXSIZE` bytes.
    pub fn write(&self, out: &mut [u8; HANDLE_MAXSIZE]) {
        *out = [0; HANDLE_MAXSIZE];
        out[..8].copy_from_slice(&MAGIC);
        let (family, ip): (u16, [u8; 16]) = match self.addr.ip() {
            IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6, v6.octets()),
        };
        out[8..10].copy_from_slice(&family.to_le_bytes());
        out[10..12].copy_from_slice(&self.addr.port().to_be_bytes());
        out[12..28].copy_from_slice(&ip);
        out[28..44].copy_from_slice(&self.token);
    }

    /// Reads a handle.
    ///
    /// # Errors
    /// [`NetError::Invalid`] for bytes that are not a handle `listen` made.
    pub fn read(bytes: &[u8; HANDLE_MAXSIZE]) -> Result<Handle> {
        let bad = |why: &str| NetError::Invalid(format!("not a GPUDirect handle ({why}): NCCL passed bytes another plugin or a corrupted exchange wrote"));
        if bytes[..8] != MAGIC {
            return Err(bad("wrong magic"));
        }
        let family = u16::from_le_bytes([bytes[8], bytes[9]]);
        let port = u16::from_be_bytes([bytes[10], bytes[11]]);
        let ip: [u8; 16] = bytes[12..28].try_into().expect("16 bytes");
        let ip = match family {
            4 => IpAddr::V4(Ipv6Addr::from(ip).to_ipv4_mapped().ok_or_else(|| bad("an IPv4 handle without an IPv4 address"))?),
            6 => IpAddr::V6(Ipv6Addr::from(ip)),
            _ => return Err(bad("unknown address family")),
        };
        if port == 0 || ip.is_unspecified() {
            return Err(bad("no address"));
        }
        if bytes[STAGE_AT + 8..].iter().any(|&b| b != 0) || bytes[44..STAGE_AT].iter().any(|&b| b != 0) {
            return Err(bad("bytes set where a handle has none"));
        }
        Ok(Handle { addr: SocketAddr::new(ip, port), token: bytes[28..44].try_into().expect("16 bytes") })
    }
}

/// 16 bytes from the kernel's random source.
fn random_token() -> Result<[u8; 16]> {
    let mut t = [0u8; 16];
    // SAFETY: writes at most 16 bytes into `t`.
    let n = unsafe { libc::getrandom(t.as_mut_ptr().cast(), t.len(), 0) };
    if n != 16 {
        return Err(NetError::Io(format!("getrandom: {}", std::io::Error::last_os_error())));
    }
    Ok(t)
}

/// A listening comm.
#[derive(Debug)]
pub struct Listen {
    site: &'static Site,
    nic: usize,
    listener: TcpListener,
    token: [u8; 16],
    traffic_class: Option<u8>,
    pending: Vec<Pending>,
}

#[derive(Debug)]
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
    /// Proven, with its comm's parts and the reply being written.
    proven: Option<(Parts, Endpoint, RemoteBuffer, Option<usize>, usize)>,
}

impl Listen {
    /// Listens on `nic`'s address; returns the comm and its handle.
    ///
    /// # Errors
    /// [`NetError::Io`] from the socket calls.
    pub fn new(site: &'static Site, nic: usize, traffic_class: Option<u8>) -> Result<(Box<Listen>, Handle)> {
        let n = &site.nics[nic];
        let listener = TcpListener::bind(SocketAddr::new(n.addr, 0)).map_err(|e| NetError::Io(format!("listening on {} for {}: {e}", n.addr, n.label())))?;
        listener.set_nonblocking(true)?;
        let handle = Handle { addr: listener.local_addr()?, token: random_token()? };
        Ok((Box::new(Listen { site, nic, listener, token: handle.token, traffic_class, pending: Vec::new() }), handle))
    }

    /// One step of `accept`: the comm once a member connected.
    ///
    /// # Errors
    /// [`NetError::Library`] creating the queue pair; a connection that
    /// fails after proving itself fails the accept.
    pub fn accept(&mut self) -> Result<Option<Box<Comm>>> {
        while self.pending.len() < MAX_PENDING {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    stream.set_nonblocking(true)?;
                    let _ = stream.set_nodelay(true);
                    self.pending.push(Pending { stream, peer, since: Instant::now(), buf: Vec::new(), proven: None });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => return Err(NetError::Io(format!("accept: {e}"))),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            match self.step(i) {
                Ok(Some(comm)) => {
                    self.pending.swap_remove(i);
                    return Ok(Some(comm));
                }
                Ok(None) => i += 1,
                Err(Refusal::Quietly(why)) => {
                    let p = self.pending.swap_remove(i);
                    log::warn(&format!("{}: closed a connection from {}: {why}", self.site.nics[self.nic].label(), p.peer));
                }
                Err(Refusal::Fail(e)) => {
                    self.pending.swap_remove(i);
                    return Err(e);
                }
            }
        }
        Ok(None)
    }

    fn step(&mut self, i: usize) -> std::result::Result<Option<Box<Comm>>, Refusal> {
        let (site, nic, token, tc) = (self.site, self.nic, self.token, self.traffic_class);
        let p = &mut self.pending[i];
        if p.proven.is_none() {
            if p.since.elapsed() > HELLO_WITHIN {
                return Err(Refusal::Quietly(format!("it did not identify itself within {HELLO_WITHIN:?}")));
            }
            if !fill(&mut p.stream, &mut p.buf, HELLO_LEN).map_err(|e| Refusal::Quietly(e.to_string()))? {
                return Ok(None);
            }
            let b = &p.buf;
            let presented: [u8; 16] = b[8..24].try_into().expect("16 bytes");
            if b[..8] != HELLO || !same(&presented, &token) {
                return Err(Refusal::Quietly("it did not present this listener's token: not a rank of this communicator".into()));
            }
            let peer_ep = decode_endpoint(&b[24..24 + ENDPOINT_LEN]).map_err(|e| Refusal::Quietly(e.to_string()))?;
            let fifo = decode_remote(&b[24 + ENDPOINT_LEN..], (crate::comm::MAX_REQUESTS * 256) as u64);
            let n = &site.nics[nic];
            let parts = Parts::new(site, n, Side::Recv, tc).map_err(Refusal::Fail)?;
            let mut reply = Vec::with_capacity(REPLY_LEN);
            reply.extend_from_slice(&REPLY);
            reply.extend_from_slice(&encode_endpoint(&parts.qp.endpoint()));
            reply.extend_from_slice(&encode_remote(parts.ctrl.addr(), parts.ctrl.rkey()));
            let gpu = current_gpu().ok().flatten();
            p.proven = Some((parts, peer_ep, fifo, gpu, 0));
            p.buf = reply;
        }
        let Some((_, _, _, _, written)) = p.proven.as_mut() else { unreachable!() };
        if p.since.elapsed() > SETUP_WITHIN {
            return Err(Refusal::Fail(NetError::Remote(format!("connection from {} did not complete within {SETUP_WITHIN:?}", p.peer))));
        }
        if *written < REPLY_LEN {
            match p.stream.write(&p.buf[*written..]) {
                Ok(k) => *written += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(Refusal::Fail(NetError::Remote(format!("{}: {e}", p.peer)))),
            }
            if *written < REPLY_LEN {
                return Ok(None);
            }
            p.buf = Vec::new();
        }
        if !fill(&mut p.stream, &mut p.buf, READY.len()).map_err(|e| Refusal::Fail(NetError::Remote(format!("{}: {e}", p.peer))))? {
            return Ok(None);
        }
        if p.buf[..] != READY {
            return Err(Refusal::Fail(NetError::Remote(format!("{}: a malformed ready message", p.peer))));
        }
        let (parts, peer_ep, fifo, gpu, _) = p.proven.take().expect("proven");
        Comm::new(site, nic, Side::Recv, gpu, parts, &peer_ep, fifo).map(Some).map_err(Refusal::Fail)
    }
}

/// What to do with a pending connection that cannot go on.
enum Refusal {
    /// It never proved itself: close it, keep listening.
    Quietly(String),
    /// A member's connection failed: the accept fails.
    Fail(NetError),
}

/// Constant-time comparison: how many bytes matched must not show in the time.
fn same(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Reads until `buf` holds `want` bytes: true when it does, false when
/// the socket has nothing more now.
fn fill(stream: &mut TcpStream, buf: &mut Vec<u8>, want: usize) -> std::io::Result<bool> {
    while buf.len() < want {
        let mut chunk = [0u8; 128];
        let room = (want - buf.len()).min(chunk.len());
        match stream.read(&mut chunk[..room]) {
            Ok(0) => return Err(std::io::Error::new(ErrorKind::UnexpectedEof, "the peer closed the connection during setup")),
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

fn encode_endpoint(e: &Endpoint) -> [u8; ENDPOINT_LEN] {
    let mut b = [0u8; ENDPOINT_LEN];
    b[0..4].copy_from_slice(&e.qp_num.to_le_bytes());
    b[4..8].copy_from_slice(&e.psn.to_le_bytes());
    b[8..10].copy_from_slice(&e.lid.to_le_bytes());
    b[10] = e.mtu.to_raw() as u8;
    b[11..27].copy_from_slice(&e.gid.0);
    b
}

fn decode_endpoint(b: &[u8]) -> Result<Endpoint> {
    let mtu = Mtu::from_raw(u32::from(b[10])).ok_or_else(|| NetError::Invalid(format!("the peer sent MTU code {}", b[10])))?;
    Ok(Endpoint {
        qp_num: u32::from_le_bytes(b[0..4].try_into().expect("4")),
        psn: u32::from_le_bytes(b[4..8].try_into().expect("4")),
        lid: u16::from_le_bytes([b[8], b[9]]),
        mtu,
        gid: Gid(b[11..27].try_into().expect("16")),
    })
}

fn encode_remote(addr: u64, rkey: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&addr.to_le_bytes());
    b[8..].copy_from_slice(&rkey.to_le_bytes());
    b
}

fn decode_remote(b: &[u8], len: u64) -> RemoteBuffer {
    RemoteBuffer { addr: u64::from_le_bytes(b[..8].try_into().expect("8")), len, rkey: u32::from_le_bytes(b[8..12].try_into().expect("4")) }
}

/// `connect`'s state between NCCL's calls.
#[derive(Debug)]
pub struct Connecting {
    stream: TcpStream,
    since: Instant,
    parts: Option<Parts>,
    out: Vec<u8>,
    written: usize,
    buf: Vec<u8>,
    replied: Option<(Endpoint, RemoteBuffer)>,
    gpu: Option<usize>,
}

/// The live `Connecting` states, by address: a handle's stage pointer is
/// followed only when it is one of these, so a corrupted handle is
/// refused, never dereferenced.
static CONNECTING: Mutex<Option<HashSet<usize>>> = Mutex::new(None);

/// One step of `connect` with NCCL's copy of the handle (where the state
/// is kept between calls).
///
/// # Errors
/// [`NetError::Invalid`] for a malformed handle; [`NetError::Io`] or
/// [`NetError::Remote`] when the listener cannot be reached, closes the
/// connection (a wrong token) or does not answer within [`SETUP_WITHIN`].
pub fn connect(site: &'static Site, nic: usize, handle: &mut [u8; HANDLE_MAXSIZE], traffic_class: Option<u8>) -> Result<Option<Box<Comm>>> {
    let stage = u64::from_le_bytes(handle[STAGE_AT..STAGE_AT + 8].try_into().expect("8")) as usize;
    let mut live = CONNECTING.lock().unwrap_or_else(|e| e.into_inner());
    let live = live.get_or_insert_with(HashSet::new);
    let mut state = if stage == 0 {
        let h = Handle::read(handle)?;
        Box::new(start_connect(site, nic, &h, traffic_class)?)
    } else if live.remove(&stage) {
        // SAFETY: the address is one this function leaked below and has not
        // taken back since (it was in the live set).
        unsafe { Box::from_raw(stage as *mut Connecting) }
    } else {
        return Err(NetError::Invalid("the handle's connection state is not one this plugin made: a corrupted handle".into()));
    };
    handle[STAGE_AT..STAGE_AT + 8].copy_from_slice(&[0; 8]);
    match step_connect(site, nic, &mut state) {
        Ok(Some(comm)) => Ok(Some(comm)),
        Ok(None) => {
            let at = Box::into_raw(state) as usize;
            live.insert(at);
            handle[STAGE_AT..STAGE_AT + 8].copy_from_slice(&(at as u64).to_le_bytes());
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

fn start_connect(site: &Site, nic: usize, h: &Handle, tc: Option<u8>) -> Result<Connecting> {
    let stream = nonblocking_connect(h.addr)?;
    let parts = Parts::new(site, &site.nics[nic], Side::Send, tc)?;
    let mut out = Vec::with_capacity(HELLO_LEN);
    out.extend_from_slice(&HELLO);
    out.extend_from_slice(&h.token);
    out.extend_from_slice(&encode_endpoint(&parts.qp.endpoint()));
    out.extend_from_slice(&encode_remote(parts.ctrl.addr(), parts.ctrl.rkey()));
    let gpu = current_gpu().ok().flatten();
    Ok(Connecting { stream, since: Instant::now(), parts: Some(parts), out, written: 0, buf: Vec::new(), replied: None, gpu })
}

fn step_connect(site: &'static Site, nic: usize, s: &mut Connecting) -> Result<Option<Box<Comm>>> {
    let to = |e: std::io::Error| NetError::Remote(format!("connecting to the listener: {e} (a wrong or stale handle is closed without an answer)"));
    if s.since.elapsed() > SETUP_WITHIN {
        return Err(NetError::Remote(format!("the listener did not complete setup within {SETUP_WITHIN:?}")));
    }
    while s.written < s.out.len() {
        match s.stream.write(&s.out[s.written..]) {
            Ok(k) => s.written += k,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::NotConnected) => return Ok(None),
            Err(e) => return Err(to(e)),
        }
    }
    if s.replied.is_none() {
        if !fill(&mut s.stream, &mut s.buf, REPLY_LEN).map_err(to)? {
            return Ok(None);
        }
        if s.buf[..8] != REPLY {
            return Err(NetError::Remote("the listener answered with a malformed reply".into()));
        }
        let ep = decode_endpoint(&s.buf[8..8 + ENDPOINT_LEN])?;
        let sizes = decode_remote(&s.buf[8 + ENDPOINT_LEN..], (crate::comm::MAX_REQUESTS * 32) as u64);
        s.replied = Some((ep, sizes));
        s.out = READY.to_vec();
        s.written = 0;
        // The queue pair goes to RTS before READY is sent, so the
        // receiver's first fifo write finds it ready.
        return step_connect(site, nic, s);
    }
    let (ep, sizes) = s.replied.expect("replied");
    let parts = s.parts.take().ok_or_else(|| NetError::Invalid("connect called again after it returned a comm".into()))?;
    Comm::new(site, nic, Side::Send, s.gpu, parts, &ep, sizes).map(Some)
}

/// A TCP connection started without waiting for it to complete.
fn nonblocking_connect(addr: SocketAddr) -> Result<TcpStream> {
    let (family, sa, len) = sockaddr(addr);
    // SAFETY: plain socket(2); the descriptor is owned by the TcpStream below.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(NetError::Io(format!("socket: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: `fd` is a fresh socket this function owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: `sa` holds a sockaddr of `len` bytes for `family`.
    let rc = unsafe { libc::connect(fd, sa.as_ptr().cast(), len) };
    let err = std::io::Error::last_os_error();
    if rc != 0 && err.raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(NetError::Remote(format!("connecting to {addr}: {err}")));
    }
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn sockaddr(addr: SocketAddr) -> (i32, Vec<u8>, libc::socklen_t) {
    match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr { s_addr: u32::from(*a.ip()).to_be() },
                sin_zero: [0; 8],
            };
            // SAFETY: reading a plain-data struct's bytes.
            let bytes = unsafe { std::slice::from_raw_parts((&sin as *const libc::sockaddr_in).cast::<u8>(), std::mem::size_of_val(&sin)) }.to_vec();
            (libc::AF_INET, bytes, std::mem::size_of_val(&sin) as libc::socklen_t)
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr { s6_addr: a.ip().octets() },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: reading a plain-data struct's bytes.
            let bytes = unsafe { std::slice::from_raw_parts((&sin6 as *const libc::sockaddr_in6).cast::<u8>(), std::mem::size_of_val(&sin6)) }.to_vec();
            (libc::AF_INET6, bytes, std::mem::size_of_val(&sin6) as libc::socklen_t)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_garbage_is_refused() {
        let h = Handle { addr: "192.0.2.1:4791".parse().unwrap(), token: [7; 16] };
        let mut b = [0u8; HANDLE_MAXSIZE];
        h.write(&mut b);
        assert_eq!(Handle::read(&b).unwrap(), h);
        let h6 = Handle { addr: "[fd00::1]:9".parse().unwrap(), token: [1; 16] };
        h6.write(&mut b);
        assert_eq!(Handle::read(&b).unwrap(), h6);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut g = [0u8; HANDLE_MAXSIZE];
            for x in g.iter_mut() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *x = rng as u8;
            }
            assert!(Handle::read(&g).is_err());
            g[..8].copy_from_slice(&MAGIC);
            let _ = Handle::read(&g); // never panics
        }
        h.write(&mut b);
        b[100] = 1;
        assert!(Handle::read(&b).unwrap_err().to_string().contains("bytes set where a handle has none"));
        h.write(&mut b);
        b[10..12].copy_from_slice(&[0, 0]);
        assert!(Handle::read(&b).is_err(), "port 0");
    }

    #[test]
    fn tokens_compare_in_full() {
        assert!(same(&[3; 16], &[3; 16]));
        let mut other = [3; 16];
        other[15] = 4;
        assert!(!same(&[3; 16], &other));
    }
}
