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
//! no rkey.
//!
//! # Unproven connections cannot delay a rank
//! Every `accept` call takes every connection the kernel has queued (up to
//! [`ACCEPTS_PER_CALL`]) and reads what each has sent, so a rank's
//! connection, which sends its token at once, is proven on the call that
//! takes it. Connections that have not proven themselves get a budget of
//! their own: [`UNPROVEN_PER_ADDRESS`] per source address and
//! [`MAX_UNPROVEN`] in all, each for at most [`HELLO_WITHIN`]; past a
//! budget the oldest unproven one is closed. Silent, trickling or
//! reconnecting clients therefore hold nothing a rank's connection waits
//! for. The closings are logged, the first few and then at powers of two.
//! A member (it holds the token) gets at most [`MAX_PROVEN`] connections
//! that proved themselves and did not finish setup, queue pairs and all.
//! Setup as a whole fails after [`SETUP_WITHIN`].
//!
//! # Connection state in the handle
//! `connect` keeps its state between NCCL's calls in NCCL's copy of the
//! handle, named by an index into a table and a random 64-bit generation
//! renewed at every call. A copy of a handle whose connect moved on,
//! finished or failed, or any other bytes there, is refused: never a
//! state found by its address.

use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use gpudirect::{current_gpu, Endpoint, RemoteBuffer};

use crate::abi::HANDLE_MAXSIZE;
use crate::comm::{Comm, Parts};
use crate::config::GdrPolicy;
use crate::error::{NetError, Result};
use crate::log;
use crate::site::Site;
use crate::verdict::Side;
use crate::wire::{self, Handle, HELLO_LEN, READY, REPLY_LEN, STAGE_AT};

/// Unproven connections one source address may hold at once.
pub const UNPROVEN_PER_ADDRESS: usize = 4;
/// Unproven connections a listener holds at once, from all addresses.
pub const MAX_UNPROVEN: usize = 64;
/// Connections a listener holds that proved themselves but have not
/// finished setup: each has a queue pair and memory. NCCL connects once
/// per listen comm, so more is a member misbehaving.
pub const MAX_PROVEN: usize = 8;
/// Connections taken from the kernel's queue per `accept` call.
pub const ACCEPTS_PER_CALL: usize = 256;
/// How long a connection may take to prove itself (a rank sends its token
/// as soon as its connection is up).
pub const HELLO_WITHIN: Duration = Duration::from_secs(2);
/// How long `connect` or one `accept` may take in all.
pub const SETUP_WITHIN: Duration = Duration::from_secs(120);
/// Connections being set up at once by `connect`, in the whole process.
pub const MAX_CONNECTING: usize = 1 << 16;
/// Closed unproven connections logged one by one; later ones at powers of two.
const LOGGED_CLOSINGS: u64 = 8;

/// `n` bytes from the kernel's random source.
fn random<const N: usize>() -> Result<[u8; N]> {
    let mut t = [0u8; N];
    // SAFETY: writes at most N bytes into `t`.
    let got = unsafe { libc::getrandom(t.as_mut_ptr().cast(), N, 0) };
    if got != N as isize {
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
    /// Unproven connections closed so far.
    closed: u64,
}

#[derive(Debug)]
struct Pending {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    buf: Vec<u8>,
    /// Proven, with its comm's parts and the reply being written.
    proven: Option<Proven>,
}

#[derive(Debug)]
struct Proven {
    parts: Parts,
    peer_ep: Endpoint,
    fifo: RemoteBuffer,
    gpu: Option<usize>,
    written: usize,
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
        let handle = Handle { addr: listener.local_addr()?, token: random()? };
        Ok((Box::new(Listen { site, nic, listener, token: handle.token, traffic_class, pending: Vec::new(), closed: 0 }), handle))
    }

    /// One step of `accept`: the comm once a member connected.
    ///
    /// # Errors
    /// [`NetError::Library`] creating the queue pair; a connection that
    /// fails after proving itself fails the accept.
    pub fn accept(&mut self) -> Result<Option<Box<Comm>>> {
        for _ in 0..ACCEPTS_PER_CALL {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    stream.set_nonblocking(true)?;
                    let _ = stream.set_nodelay(true);
                    self.admit(Pending { stream, peer, since: Instant::now(), buf: Vec::new(), proven: None })?;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                // A connection reset before it was taken: nothing to do.
                Err(e) if matches!(e.kind(), ErrorKind::ConnectionAborted | ErrorKind::Interrupted) => {}
                Err(e) => return Err(NetError::Io(format!("accept: {e}"))),
            }
        }
        let mut i = 0;
        while i < self.pending.len() {
            if self.pending[i].proven.is_none() {
                match self.prove(i) {
                    Ok(_) => {}
                    Err(Refusal::Quietly(why)) => {
                        self.close(i, &why);
                        continue;
                    }
                    Err(Refusal::Fail(e)) => {
                        self.pending.swap_remove(i);
                        return Err(e);
                    }
                }
                if self.pending[i].proven.is_none() {
                    i += 1;
                    continue;
                }
            }
            match self.finish(i) {
                Ok(Some(comm)) => {
                    self.pending.swap_remove(i);
                    return Ok(Some(comm));
                }
                Ok(None) => i += 1,
                Err(e) => {
                    self.pending.swap_remove(i);
                    return Err(e);
                }
            }
        }
        Ok(None)
    }

    /// Takes a new connection in: reads what it sent, and keeps the
    /// unproven within their budgets by closing the oldest past them.
    fn admit(&mut self, p: Pending) -> Result<()> {
        let ip = p.peer.ip();
        self.pending.push(p);
        let last = self.pending.len() - 1;
        match self.prove(last) {
            Ok(true) => return Ok(()),
            Ok(false) => {}
            Err(Refusal::Quietly(why)) => {
                self.close(last, &why);
                return Ok(());
            }
            Err(Refusal::Fail(e)) => {
                self.pending.swap_remove(last);
                return Err(e);
            }
        }
        self.trim(ip, UNPROVEN_PER_ADDRESS, "its address holds too many unproven connections");
        while self.pending.iter().filter(|p| p.proven.is_none()).count() > MAX_UNPROVEN {
            // Past the listener's budget, the address holding the most pays:
            // a rank's one slow connection is never the one closed while
            // others hold more.
            let busiest = self.pending.iter().filter(|p| p.proven.is_none()).map(|p| p.peer.ip()).max_by_key(|ip| self.unproven_of(*ip));
            let Some(busiest) = busiest else { break };
            let held = self.unproven_of(busiest);
            self.trim(busiest, held - 1, "the listener holds too many unproven connections");
        }
        Ok(())
    }

    fn unproven_of(&self, ip: IpAddr) -> usize {
        self.pending.iter().filter(|p| p.proven.is_none() && p.peer.ip() == ip).count()
    }

    /// Closes the oldest unproven connections of `ip` until at most `most`
    /// are left, reading each first (one that proves itself stays).
    fn trim(&mut self, ip: IpAddr, most: usize, why: &str) {
        while self.unproven_of(ip) > most {
            let oldest = self.pending.iter().enumerate().filter(|(_, p)| p.proven.is_none() && p.peer.ip() == ip).min_by_key(|(_, p)| p.since).map(|(i, _)| i);
            let Some(i) = oldest else { return };
            match self.prove(i) {
                Ok(true) => {}
                Ok(false) => self.close(i, why),
                Err(Refusal::Quietly(why)) => self.close(i, &why),
                // Making a proven connection's comm failed: it goes; the
                // accept's caller learns of it from the next proven one.
                Err(Refusal::Fail(e)) => self.close(i, &e.to_string()),
            }
        }
    }

    fn close(&mut self, i: usize, why: &str) {
        let p = self.pending.swap_remove(i);
        self.closed += 1;
        self.site.refusals.setup_closed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.closed <= LOGGED_CLOSINGS || self.closed.is_power_of_two() {
            let label = self.site.nics[self.nic].label();
            log::warn(&format!("{label}: closed a connection from {}: {why} ({} unproven connection(s) closed by this listener)", p.peer, self.closed));
        }
    }

    /// Reads an unproven connection's setup message: true once it
    /// presented this listener's token (its comm's parts are then made and
    /// its reply is ready to write).
    fn prove(&mut self, i: usize) -> std::result::Result<bool, Refusal> {
        let (site, nic, token, tc) = (self.site, self.nic, self.token, self.traffic_class);
        let p = &mut self.pending[i];
        // What arrived is read first: a hello sent in time counts even when
        // NCCL calls accept late.
        if !fill(&mut p.stream, &mut p.buf, HELLO_LEN).map_err(|e| Refusal::Quietly(e.to_string()))? {
            if p.since.elapsed() > HELLO_WITHIN {
                return Err(Refusal::Quietly(format!("it did not identify itself within {HELLO_WITHIN:?}")));
            }
            return Ok(false);
        }
        let hello: &[u8; HELLO_LEN] = p.buf[..].try_into().expect("HELLO_LEN bytes");
        let (presented, peer_ep, fifo) = wire::read_hello(hello).map_err(|e| Refusal::Quietly(e.to_string()))?;
        if !same(&presented, &token) {
            return Err(Refusal::Quietly("it did not present this listener's token: not a rank of this communicator".into()));
        }
        if self.pending.iter().filter(|p| p.proven.is_some()).count() >= MAX_PROVEN {
            // A member holding connections open after proving itself gets
            // no more queue pairs; the rank it stalls is its own.
            return Err(Refusal::Quietly(format!("the listener holds {MAX_PROVEN} connections that proved themselves and have not finished setup")));
        }
        let p = &mut self.pending[i];
        let parts = Parts::new(site, &site.nics[nic], Side::Recv, tc).map_err(Refusal::Fail)?;
        p.buf = wire::reply(&parts.qp.endpoint(), parts.ctrl.addr(), parts.ctrl.rkey()).to_vec();
        let gpu = proxy_gpu(site).map_err(Refusal::Fail)?;
        p.proven = Some(Proven { parts, peer_ep, fifo, gpu, written: 0 });
        Ok(true)
    }

    /// Writes a proven connection's reply and reads its ready message.
    fn finish(&mut self, i: usize) -> Result<Option<Box<Comm>>> {
        let (site, nic) = (self.site, self.nic);
        let p = &mut self.pending[i];
        let peer = p.peer;
        let Some(proven) = p.proven.as_mut() else { return Ok(None) };
        if p.since.elapsed() > SETUP_WITHIN {
            return Err(NetError::Remote(format!("connection from {peer} did not complete within {SETUP_WITHIN:?}")));
        }
        if proven.written < REPLY_LEN {
            match p.stream.write(&p.buf[proven.written..]) {
                Ok(k) => proven.written += k,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(None),
                Err(e) => return Err(NetError::Remote(format!("{peer}: {e}"))),
            }
            if proven.written < REPLY_LEN {
                return Ok(None);
            }
            p.buf = Vec::new();
        }
        if !fill(&mut p.stream, &mut p.buf, READY.len()).map_err(|e| NetError::Remote(format!("{peer}: {e}")))? {
            return Ok(None);
        }
        if p.buf[..] != READY {
            return Err(NetError::Remote(format!("{peer}: a malformed ready message")));
        }
        let Proven { parts, peer_ep, fifo, gpu, .. } = p.proven.take().expect("proven");
        Comm::new(site, nic, Side::Recv, gpu, parts, &peer_ep, fifo, peer).map(Some)
    }
}

/// What to do with an unproven connection that cannot go on.
enum Refusal {
    /// It never proved itself: close it, keep listening.
    Quietly(String),
    /// Making a proven connection's comm failed: the accept fails.
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

/// `connect`'s state between NCCL's calls.
#[derive(Debug)]
pub struct Connecting {
    stream: TcpStream,
    peer: SocketAddr,
    since: Instant,
    parts: Option<Parts>,
    out: Vec<u8>,
    written: usize,
    buf: Vec<u8>,
    replied: Option<(Endpoint, RemoteBuffer)>,
    gpu: Option<usize>,
}

/// The connections `connect` is setting up, each with its generation.
struct Staged {
    slots: Vec<Option<(u64, Box<Connecting>)>>,
    free: Vec<usize>,
}

static CONNECTING: Mutex<Staged> = Mutex::new(Staged { slots: Vec::new(), free: Vec::new() });

impl Staged {
    /// Takes the state the handle names, if its generation is current.
    fn take(&mut self, index: u64, generation: u64) -> Option<Box<Connecting>> {
        let i = usize::try_from(index.checked_sub(1)?).ok()?;
        match self.slots.get_mut(i)? {
            Some((g, _)) if *g == generation => {
                let (_, state) = self.slots[i].take().expect("present");
                self.free.push(i);
                Some(state)
            }
            _ => None,
        }
    }

    /// Keeps `state`; returns its index (from 1) and its new generation.
    fn keep(&mut self, state: Box<Connecting>) -> Result<(u64, u64)> {
        let generation = u64::from_le_bytes(random()?);
        let i = match self.free.pop() {
            Some(i) => i,
            None if self.slots.len() < MAX_CONNECTING => {
                self.slots.push(None);
                self.slots.len() - 1
            }
            None => return Err(NetError::Invalid(format!("{MAX_CONNECTING} connections are being set up at once: NCCL abandoned connects without finishing them"))),
        };
        self.slots[i] = Some((generation, state));
        Ok((i as u64 + 1, generation))
    }
}

fn staged() -> std::sync::MutexGuard<'static, Staged> {
    CONNECTING.lock().unwrap_or_else(|e| e.into_inner())
}

/// One step of `connect` with NCCL's copy of the handle (where the state
/// is named between calls).
///
/// # Errors
/// [`NetError::Invalid`] for a malformed handle, or one whose connection
/// state is stale (a copy of a handle whose connect moved on, finished or
/// failed); [`NetError::Io`] or [`NetError::Remote`] when the listener
/// cannot be reached, closes the connection (a wrong token) or does not
/// answer within [`SETUP_WITHIN`].
pub fn connect(site: &'static Site, nic: usize, handle: &mut [u8; HANDLE_MAXSIZE], traffic_class: Option<u8>) -> Result<Option<Box<Comm>>> {
    let word = |at: usize| u64::from_le_bytes(handle[at..at + 8].try_into().expect("8"));
    let (index, generation) = (word(STAGE_AT), word(STAGE_AT + 8));
    let mut state = if index == 0 && generation == 0 {
        let h = Handle::read(handle)?;
        Box::new(start_connect(site, nic, &h, traffic_class)?)
    } else {
        staged().take(index, generation).ok_or_else(|| {
            NetError::Invalid(
                "the handle's connection state is stale or not one this plugin made (a copy of a handle whose connect moved on, \
                 finished or failed, or corrupted bytes): refused"
                    .into(),
            )
        })?
    };
    handle[STAGE_AT..STAGE_AT + 16].copy_from_slice(&[0; 16]);
    match step_connect(site, nic, &mut state)? {
        Some(comm) => Ok(Some(comm)),
        None => {
            let (index, generation) = staged().keep(state)?;
            handle[STAGE_AT..STAGE_AT + 8].copy_from_slice(&index.to_le_bytes());
            handle[STAGE_AT + 8..STAGE_AT + 16].copy_from_slice(&generation.to_le_bytes());
            Ok(None)
        }
    }
}

/// The GPU current on the calling thread (NCCL's proxy thread), which the
/// connection's judgement reads: `None` where there is none, or no CUDA
/// driver at all. A driver that fails to say is not taken as "no GPU"
/// (that would judge a GPU's staged traffic as plain host memory): under
/// `require` the connection is refused naming it; under `prefer` and
/// `off` it runs judged without a GPU, said at WARN.
fn proxy_gpu(site: &Site) -> Result<Option<usize>> {
    match current_gpu() {
        Ok(gpu) => Ok(gpu),
        Err(gpudirect::Error::CudaUnavailable(_)) => Ok(None),
        Err(e) if site.config.policy == GdrPolicy::Require => Err(NetError::Refused(format!(
            "cannot tell which GPU is current on NCCL's proxy thread ({e}), so whether this connection would stage a GPU's traffic \
             through host memory cannot be judged ({}=require refuses what it cannot judge; prefer runs it, said here)",
            GdrPolicy::VAR
        ))),
        Err(e) => {
            log::warn(&format!("cannot tell which GPU is current on NCCL's proxy thread ({e}): this connection is judged as having none, its host bytes counted as host"));
            Ok(None)
        }
    }
}

fn start_connect(site: &Site, nic: usize, h: &Handle, tc: Option<u8>) -> Result<Connecting> {
    let stream = nonblocking_connect(h.addr)?;
    let parts = Parts::new(site, &site.nics[nic], Side::Send, tc)?;
    let out = wire::hello(&h.token, &parts.qp.endpoint(), parts.ctrl.addr(), parts.ctrl.rkey()).to_vec();
    let gpu = proxy_gpu(site)?;
    Ok(Connecting { stream, peer: h.addr, since: Instant::now(), parts: Some(parts), out, written: 0, buf: Vec::new(), replied: None, gpu })
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
        let reply: &[u8; REPLY_LEN] = s.buf[..].try_into().expect("REPLY_LEN bytes");
        s.replied = Some(wire::read_reply(reply)?);
        s.out = READY.to_vec();
        s.written = 0;
        // The queue pair goes to RTS before READY is sent, so the
        // receiver's first fifo write finds it ready.
        return step_connect(site, nic, s);
    }
    let (ep, sizes) = s.replied.expect("replied");
    let parts = s.parts.take().ok_or_else(|| NetError::Invalid("connect called again after it returned a comm".into()))?;
    Comm::new(site, nic, Side::Send, s.gpu, parts, &ep, sizes, s.peer).map(Some)
}

/// A TCP connection started without waiting for it to complete.
fn nonblocking_connect(addr: SocketAddr) -> Result<TcpStream> {
    let (sa, len) = gpudirect::sockaddr::to_storage(addr);
    // SAFETY: plain socket(2); the descriptor is owned by the TcpStream below.
    let fd = unsafe { libc::socket(i32::from(sa.ss_family), libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(NetError::Io(format!("socket: {}", std::io::Error::last_os_error())));
    }
    // SAFETY: `fd` is a fresh socket this function owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    // SAFETY: `sa` holds a sockaddr of `len` bytes of its family.
    let rc = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_storage).cast(), len) };
    let err = std::io::Error::last_os_error();
    if rc != 0 && err.raw_os_error() != Some(libc::EINPROGRESS) {
        return Err(NetError::Remote(format!("connecting to {addr}: {err}")));
    }
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_in_full() {
        assert!(same(&[3; 16], &[3; 16]));
        let mut other = [3; 16];
        other[15] = 4;
        assert!(!same(&[3; 16], &other));
    }
}
