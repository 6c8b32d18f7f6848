//! Connections on demand: one RC queue pair per (peer, local NIC, remote
//! NIC) in use, set up on first use through the peer agent's control
//! listener and kept until it fails. Every queue pair takes its receives
//! (notifications) from its NIC's shared receive queue, so a connection
//! costs a send queue and no receive memory.
//!
//! The setup, over the library's bootstrap exchange (bounded, versioned):
//! the initiator creates its queue pair and sends its endpoint with a
//! request (its agent name, both NIC indices); the target answers with its
//! agent name; the target creates and connects its queue pair and answers
//! with its endpoint (or a refusal with the reason); the initiator
//! connects. The target is ready to receive before the initiator can send.
//!
//! A NIC holds at most `max_connections`; making one more evicts the
//! least recently used idle one (no post holds it: posts keep their
//! connections until their completions are reaped) after a goodbye over
//! the peer's control listener, which closes its end only if idle on its
//! side too. Notifications already received on a closed connection still
//! name their peer (`gone`).

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::{serve_each, Server, WhenFull};
use crate::bootstrap::{BootstrapError, Handshake, OobChannel};
use crate::qp::{QpConfig, QueuePair};
use crate::sync::Mutex;
use crate::wire::Reader;

use super::desc::{AgentMetadata, MAX_NAME};
use super::error::EngineError;
use super::nic::Nic;

const REQUEST_VERSION: u8 = 2;
/// Longest control address text in a request (`[v6]:port`).
const MAX_ADDR: usize = 64;
/// Bound on serving one connection request: a peer that connects and
/// stalls holds one of the listener's [`MAX_SERVING`] slots this long at
/// most.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// One connected queue pair to a peer agent.
pub(crate) struct Conn {
    pub(crate) qp: QueuePair,
    pub(crate) peer: Arc<str>,
    /// The peer's control listener, for the goodbye.
    control: SocketAddr,
    pub(crate) nic: usize,
    remote_nic: usize,
    /// The pool's use count at its last use: the least recent is evicted.
    used: AtomicU64,
}

impl Conn {
    fn new(qp: QueuePair, peer: &str, control: SocketAddr, nic: usize, remote_nic: usize) -> Conn {
        Conn { qp, peer: peer.into(), control, nic, remote_nic, used: AtomicU64::new(0) }
    }
}

/// What a control request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Ask {
    /// A new connection (the initiator's endpoint is in the handshake).
    Connect,
    /// Close the connection from the initiator's queue pair `from` to the
    /// target's `to`.
    Close { from: u32, to: u32 },
}

/// A parsed control request.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Request {
    name: String,
    /// The initiator's control listener.
    control: SocketAddr,
    theirs: usize,
    ours: usize,
    ask: Ask,
}

type Key = (Arc<str>, usize, usize);

/// FNV-1a over a peer's name: a post looks its connection up by name, and
/// SipHash cost it more than the rest of the lookup. Not keyed, so names
/// chosen to collide would slow lookups, but only among the connections
/// alive (empty entries are removed), a bounded number.
#[derive(Default)]
struct NameHasher(u64);

impl std::hash::Hasher for NameHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 { 0xcbf2_9ce4_8422_2325 } else { self.0 };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

type ByName<V> = HashMap<Arc<str>, V, std::hash::BuildHasherDefault<NameHasher>>;
/// A peer's connections to send on, by (local NIC, remote NIC).
type PeerConns = Vec<((usize, usize), Arc<Conn>)>;

/// The agent's NICs and its connections.
pub(crate) struct ConnPool {
    pub(crate) name: Arc<str>,
    /// This agent's control listener, as peers reach it.
    control: SocketAddr,
    pub(crate) nics: Vec<Nic>,
    pub(crate) qp: QpConfig,
    pub(crate) timeout: Duration,
    /// The connection each (peer, local NIC, remote NIC) sends on, by
    /// peer: a post looks its peer up by name without allocating a key.
    sending: Mutex<ByName<PeerConns>>,
    /// Every live connection, by (local NIC, queue pair number): how a
    /// completion finds its peer. Owns them: a connection the peer set up
    /// while ours was being set up too stays alive here for its sends.
    live: Mutex<HashMap<(usize, u32), Arc<Conn>>>,
    /// One setup at a time per key from this side, so concurrent first
    /// posts to one peer make one connection, and an unreachable peer
    /// delays only posts to it. (The target side takes none of these, so
    /// two agents connecting to each other cannot deadlock.) A key's lock
    /// stays for the pool's life: one small lock per peer ever connected,
    /// and never one destroyed while another thread may still hold it.
    connecting: Mutex<HashMap<Key, Arc<Mutex<()>>>>,
    /// The peers of connections closed or retired, by (local NIC, queue
    /// pair number), until the number is reused: completions of them
    /// still in a completion queue (a notification not yet polled) keep
    /// their sender.
    gone: Mutex<HashMap<(usize, u32), Arc<str>>>,
    /// Counts uses, for [`Conn::used`].
    uses: AtomicU64,
}

/// Takes `conn` out of the connections to send on, and its peer's entry
/// when that was its last.
fn unlist(sending: &mut ByName<PeerConns>, conn: &Arc<Conn>) {
    if let Some(v) = sending.get_mut(&conn.peer) {
        v.retain(|(_, c)| !Arc::ptr_eq(c, conn));
        if v.is_empty() {
            sending.remove(&conn.peer);
        }
    }
}

fn control_err(peer: &str) -> impl FnOnce(BootstrapError) -> EngineError + '_ {
    move |source| EngineError::Control { peer: peer.to_owned(), source }
}

fn request(name: &str, control: SocketAddr, nic: usize, remote_nic: usize, ask: &Ask) -> Vec<u8> {
    let addr = control.to_string();
    let mut v = vec![REQUEST_VERSION, name.len() as u8];
    v.extend_from_slice(name.as_bytes());
    v.push(addr.len() as u8);
    v.extend_from_slice(addr.as_bytes());
    v.extend_from_slice(&[nic as u8, remote_nic as u8]);
    if let Ask::Close { from, to } = ask {
        v.push(1);
        v.extend_from_slice(&from.to_be_bytes());
        v.extend_from_slice(&to.to_be_bytes());
    } else {
        v.push(0);
    }
    v
}

/// A request from its bytes.
fn parse_request(b: &[u8]) -> Result<Request, String> {
    let mut r = Reader(b);
    let bad = |t: crate::wire::Truncated| format!("request truncated in {}", t.field);
    let v = r.u8("version").map_err(bad)?;
    if v != REQUEST_VERSION {
        return Err(format!("connection request version {v}, this agent speaks {REQUEST_VERSION}"));
    }
    let n = r.u8("name length").map_err(bad)? as usize;
    let name = std::str::from_utf8(r.take("name", n).map_err(bad)?).map_err(|_| "agent name is not UTF-8".to_string())?;
    if name.is_empty() || name.len() > MAX_NAME {
        return Err("empty agent name".into());
    }
    let n = r.u8("address length").map_err(bad)? as usize;
    if n > MAX_ADDR {
        return Err(format!("control address of {n} bytes (at most {MAX_ADDR})"));
    }
    let text = std::str::from_utf8(r.take("control address", n).map_err(bad)?).map_err(|_| "control address is not UTF-8".to_string())?;
    let control: SocketAddr = text.parse().map_err(|_| format!("control address {text:?} is not IP:port"))?;
    let theirs = r.u8("initiator NIC").map_err(bad)? as usize;
    let ours = r.u8("target NIC").map_err(bad)? as usize;
    let ask = match r.u8("kind").map_err(bad)? {
        0 => Ask::Connect,
        1 => Ask::Close { from: r.u32("initiator queue pair").map_err(bad)?, to: r.u32("target queue pair").map_err(bad)? },
        k => return Err(format!("request kind {k} (0: connect, 1: close)")),
    };
    if r.rest() != 0 {
        return Err(format!("{} trailing bytes after the request", r.rest()));
    }
    Ok(Request { name: name.to_owned(), control, theirs, ours, ask })
}

impl ConnPool {
    pub(crate) fn new(name: Arc<str>, control: SocketAddr, nics: Vec<Nic>, qp: QpConfig, timeout: Duration) -> ConnPool {
        ConnPool {
            name,
            control,
            nics,
            qp,
            timeout,
            sending: Mutex::default(),
            live: Mutex::default(),
            connecting: Mutex::default(),
            gone: Mutex::default(),
            uses: AtomicU64::new(0),
        }
    }

    /// The connection to `peer` from local NIC `nic` to its NIC
    /// `remote_nic`, set up now when there is none (then `true`).
    pub(crate) fn get(&self, peer: &AgentMetadata, nic: usize, remote_nic: usize) -> Result<(Arc<Conn>, bool), EngineError> {
        if let Some(c) = self.sending_on(&peer.name, nic, remote_nic) {
            return Ok((c, false));
        }
        let key: Key = (peer.name.as_str().into(), nic, remote_nic);
        let turn = self.connecting.lock().entry(key.clone()).or_default().clone();
        let _one = turn.lock();
        if let Some(c) = self.sending_on(&peer.name, nic, remote_nic) {
            return Ok((c, false));
        }
        let conn = Arc::new(self.connect(peer, nic, remote_nic)?);
        self.add_live(nic, conn.clone());
        self.send_on(key.0, (nic, remote_nic), conn.clone(), true);
        Ok((conn, true))
    }

    fn sending_on(&self, peer: &str, nic: usize, remote_nic: usize) -> Option<Arc<Conn>> {
        let sending = self.sending.lock();
        let c = sending.get(peer)?.iter().find(|(k, _)| *k == (nic, remote_nic)).map(|(_, c)| c.clone())?;
        self.touch(&c);
        Some(c)
    }

    /// Marks `conn` used now.
    #[inline]
    fn touch(&self, conn: &Conn) {
        // A locked update: a plain store would race, for drd, with
        // eviction's read.
        conn.used.swap(self.uses.fetch_add(1, Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Makes `conn` the one to send to `peer` on `nics`: always when
    /// `replace`, else only if there is none.
    fn send_on(&self, peer: Arc<str>, nics: (usize, usize), conn: Arc<Conn>, replace: bool) {
        let mut sending = self.sending.lock();
        let v = sending.entry(peer).or_default();
        match v.iter_mut().find(|(k, _)| *k == nics) {
            Some(slot) if replace => slot.1 = conn,
            Some(_) => {}
            None => v.push((nics, conn)),
        }
    }

    fn add_live(&self, nic: usize, conn: Arc<Conn>) {
        let qpn = conn.qp.endpoint().qp_num;
        self.touch(&conn);
        self.gone.lock().remove(&(nic, qpn));
        self.live.lock().insert((nic, qpn), conn);
    }

    /// A queue pair on NIC `nic`, evicting an idle connection first when
    /// the NIC has its maximum.
    fn create_qp(&self, nic: usize) -> Result<crate::qp::PreparedQueuePair, EngineError> {
        let n = &self.nics[nic];
        let live = self.live.lock().keys().filter(|(i, _)| *i == nic).count();
        if live >= n.max_connections {
            self.evict_one(nic)?;
        }
        Ok(QueuePair::create_with_srq(&n.pd, &n.send_cq, &n.recv_cq, &n.srq, &self.qp)?)
    }

    /// Takes `conn` out of the pool if nothing but the pool holds it (no
    /// post is using it or will: posts get theirs from `sending`, locked
    /// here). Returns whether it was idle; it was in `sending` if so.
    fn take_if_idle(&self, conn: &Arc<Conn>) -> Option<bool> {
        let mut sending = self.sending.lock();
        let mut live = self.live.lock();
        let key = (conn.nic, conn.qp.endpoint().qp_num);
        let listed = sending.get(&conn.peer).is_some_and(|v| v.iter().any(|(_, c)| Arc::ptr_eq(c, conn)));
        // The pool's references (live, maybe sending) and the caller's.
        if Arc::strong_count(conn) != 2 + usize::from(listed) || !live.contains_key(&key) {
            return None;
        }
        live.remove(&key);
        unlist(&mut sending, conn);
        self.gone.lock().insert(key, conn.peer.clone());
        Some(listed)
    }

    /// Closes the least recently used idle connection of NIC `nic`, after
    /// its peer agreed (or is gone).
    fn evict_one(&self, nic: usize) -> Result<(), EngineError> {
        let mut candidates: Vec<Arc<Conn>> = self.live.lock().iter().filter(|((i, _), _)| *i == nic).map(|(_, c)| c.clone()).collect();
        candidates.sort_by_key(|c| c.used.fetch_add(0, Ordering::Relaxed));
        for c in candidates {
            let Some(listed) = self.take_if_idle(&c) else { continue };
            match self.goodbye(&c) {
                Ok(()) => {
                    tracing::info!(peer = %c.peer, nic, qp = c.qp.endpoint().qp_num, "engine connection evicted (least recently used, idle)");
                    return Ok(());
                }
                Err(why) => {
                    tracing::info!(peer = %c.peer, nic, "engine connection kept: its peer did not close it ({why})");
                    self.add_live(nic, c.clone());
                    if listed {
                        self.send_on(c.peer.clone(), (nic, c.remote_nic), c, false);
                    }
                }
            }
        }
        Err(EngineError::TooManyConnections { max: self.nics[nic].max_connections })
    }

    /// Asks `conn`'s peer to close its end. A peer that is gone (refuses
    /// the control connection) counts as closed.
    fn goodbye(&self, conn: &Conn) -> Result<(), String> {
        let mut oob = match OobChannel::connect(conn.control, self.timeout.min(ACCEPT_TIMEOUT)) {
            Ok(o) => o,
            Err(BootstrapError::Io { source, .. }) if source.kind() == io::ErrorKind::ConnectionRefused => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let ask = Ask::Close { from: conn.qp.endpoint().qp_num, to: conn.qp.remote().qp_num };
        let app = request(&self.name, self.control, conn.nic, conn.remote_nic, &ask);
        let talk = |oob: &mut OobChannel| -> Result<Vec<u8>, BootstrapError> {
            oob.exchange(&Handshake { app, ..Default::default() })?;
            Ok(oob.exchange(&Handshake::default())?.app)
        };
        match talk(&mut oob).map_err(|e| e.to_string())?.split_first() {
            Some((0, _)) => Ok(()),
            Some((_, reason)) => Err(String::from_utf8_lossy(reason).into_owned()),
            None => Err("an empty answer".into()),
        }
    }

    fn connect(&self, peer: &AgentMetadata, nic: usize, remote_nic: usize) -> Result<Conn, EngineError> {
        let started = std::time::Instant::now();
        let prepared = self.create_qp(nic)?;
        let mut oob = OobChannel::connect(peer.control, self.timeout).map_err(control_err(&peer.name))?;
        let app = request(&self.name, self.control, nic, remote_nic, &Ask::Connect);
        let hello = oob.exchange(&Handshake { endpoint: Some(prepared.endpoint()), buffers: vec![], app }).map_err(control_err(&peer.name))?;
        let got = String::from_utf8_lossy(&hello.app).into_owned();
        if got != peer.name {
            return Err(EngineError::WrongPeer { expected: peer.name.clone(), got });
        }
        let answer = oob.exchange(&Handshake::default()).map_err(control_err(&peer.name))?;
        let remote = match (answer.endpoint, answer.app.split_first()) {
            (Some(ep), Some((0, _))) => ep,
            (_, Some((_, reason))) => {
                return Err(EngineError::Refused { peer: peer.name.clone(), reason: String::from_utf8_lossy(reason).into_owned() })
            }
            _ => return Err(EngineError::Refused { peer: peer.name.clone(), reason: "an empty answer".into() }),
        };
        let qp = prepared.connect(&remote)?;
        tracing::info!(peer = %peer.name, nic, remote_nic, qp = qp.endpoint().qp_num, setup_us = started.elapsed().as_micros() as u64, "engine connected");
        Ok(Conn::new(qp, &peer.name, peer.control, nic, remote_nic))
    }

    /// Serves one control request on an accepted control stream.
    fn accept(&self, stream: TcpStream) -> Result<(), EngineError> {
        let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let mut oob = OobChannel::from_stream(stream, self.timeout.min(ACCEPT_TIMEOUT)).map_err(control_err(&from))?;
        let hello = oob.exchange(&Handshake { app: self.name.as_bytes().to_vec(), ..Default::default() }).map_err(control_err(&from))?;
        let refuse = |oob: &mut OobChannel, reason: String| -> Result<(), EngineError> {
            let mut app = vec![1];
            app.extend_from_slice(reason.as_bytes());
            oob.exchange(&Handshake { app, ..Default::default() }).map_err(control_err(&from))?;
            Err(EngineError::Refused { peer: from.clone(), reason })
        };
        let req = match parse_request(&hello.app) {
            Ok(r) if r.ours >= self.nics.len() => return refuse(&mut oob, format!("this agent has {} NIC(s), NIC {} was asked for", self.nics.len(), r.ours)),
            Ok(r) => r,
            Err(reason) => return refuse(&mut oob, reason),
        };
        if let Ask::Close { from: theirs_qpn, to } = req.ask {
            return match self.close(&req, theirs_qpn, to) {
                Ok(()) => oob.exchange(&Handshake { app: vec![0], ..Default::default() }).map(|_| ()).map_err(control_err(&req.name)),
                Err(reason) => refuse(&mut oob, reason),
            };
        }
        let Some(ep) = hello.endpoint else { return refuse(&mut oob, "the request carries no endpoint".into()) };
        let qp = match self.create_qp(req.ours).and_then(|p| Ok(p.connect(&ep)?)) {
            Ok(qp) => qp,
            Err(e) => return refuse(&mut oob, e.to_string()),
        };
        let endpoint = qp.endpoint();
        let conn = Arc::new(Conn::new(qp, &req.name, req.control, req.ours, req.theirs));
        self.add_live(req.ours, conn.clone());
        // Sends to that peer use it unless we set one up ourselves.
        self.send_on(req.name.as_str().into(), (req.ours, req.theirs), conn, false);
        oob.exchange(&Handshake { endpoint: Some(endpoint), app: vec![0], ..Default::default() }).map_err(control_err(&req.name))?;
        tracing::info!(peer = %req.name, nic = req.ours, remote_nic = req.theirs, qp = endpoint.qp_num, "engine accepted a connection");
        Ok(())
    }

    /// A peer evicts its connection from its queue pair `theirs` to our
    /// `ours`: closes our end if it is idle here too.
    fn close(&self, req: &Request, theirs: u32, ours: u32) -> Result<(), String> {
        let conn = self.live.lock().get(&(req.ours, ours)).cloned();
        let Some(conn) = conn.filter(|c| *c.peer == *req.name && c.qp.remote().qp_num == theirs) else {
            // Already retired here (it failed, or a close was answered
            // before): nothing to keep.
            return Ok(());
        };
        match self.take_if_idle(&conn) {
            Some(_) => {
                tracing::info!(peer = %req.name, nic = req.ours, qp = ours, "engine connection closed at the peer's request");
                Ok(())
            }
            None => Err(format!("connection {ours:#x} has transfers in flight here")),
        }
    }

    /// The peer a completion on local NIC `nic`, queue pair `qpn`, is from
    /// (also of a connection closed since).
    pub(crate) fn peer_of(&self, nic: usize, qpn: u32) -> Option<Arc<str>> {
        if let Some(c) = self.live.lock().get(&(nic, qpn)) {
            return Some(c.peer.clone());
        }
        self.gone.lock().get(&(nic, qpn)).cloned()
    }

    /// Drops a failed connection; the next transfer to its peer sets up a
    /// new one. The caller has failed the requests outstanding on it.
    pub(crate) fn retire(&self, nic: usize, qpn: u32) {
        let Some(conn) = self.live.lock().remove(&(nic, qpn)) else { return };
        self.gone.lock().insert((nic, qpn), conn.peer.clone());
        unlist(&mut self.sending.lock(), &conn);
        tracing::warn!(peer = %conn.peer, nic, qp = qpn, "engine connection failed; retired (the next transfer reconnects)");
    }

    /// Connections alive now.
    pub(crate) fn connections(&self) -> usize {
        self.live.lock().len()
    }
}

/// Connection requests served at once; more wait in the listen backlog
/// until one is done.
const MAX_SERVING: usize = 16;

/// The control listener, until `stop`: each connection request served on
/// a thread of its own, at most [`MAX_SERVING`] at once, each bounded by
/// [`ACCEPT_TIMEOUT`] (a peer that connects and stalls, or a port scan,
/// holds one slot, never the agents behind it). Returns once the requests
/// in progress are done.
pub(crate) fn serve(pool: Arc<ConnPool>, listener: TcpListener, stop: Arc<Mutex<bool>>) {
    let name = format!("gpudirect-engine-{}", pool.name);
    let server = Server { name: &name, max: MAX_SERVING, when_full: WhenFull::Wait };
    serve_each(&listener, &stop, &server, |s, from| {
        if let Err(e) = pool.accept(s) {
            tracing::warn!(%from, "engine connection request not served: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused_with_a_reason() {
        let at: SocketAddr = "192.0.2.7:4791".parse().unwrap();
        let close = Ask::Close { from: 0x11, to: 0x2_0000 };
        for ask in [Ask::Connect, close.clone()] {
            let want = Request { name: "prefill-0".into(), control: at, theirs: 1, ours: 0, ask: ask.clone() };
            assert_eq!(parse_request(&request("prefill-0", at, 1, 0, &ask)).unwrap(), want);
        }
        let v6: SocketAddr = "[2001:db8::1]:9".parse().unwrap();
        assert_eq!(parse_request(&request("p", v6, 0, 0, &Ask::Connect)).unwrap().control, v6);
        for good in [request("p", at, 0, 0, &Ask::Connect), request("p", at, 0, 0, &close)] {
            for n in 0..good.len() {
                assert!(parse_request(&good[..n]).is_err(), "{n} bytes");
            }
            let mut v = good.clone();
            v[0] = 1;
            assert!(parse_request(&v).unwrap_err().contains("version 1"));
            v = good.clone();
            v.push(1);
            assert!(parse_request(&v).unwrap_err().contains("trailing"));
        }
        assert!(parse_request(&[2, 0, 0, 0]).unwrap_err().contains("empty"));
        let mut v = request("p", at, 0, 0, &Ask::Connect);
        *v.last_mut().unwrap() = 7;
        assert!(parse_request(&v).unwrap_err().contains("kind 7"));
        let mut v = vec![2, 1, b'p', 9];
        v.extend_from_slice(b"localhost");
        v.extend_from_slice(&[0, 0, 0]);
        assert!(parse_request(&v).unwrap_err().contains("not IP:port"));
        let mut v = vec![2, 1, b'p', 200];
        v.extend_from_slice(&[b'1'; 200]);
        assert!(parse_request(&v).unwrap_err().contains("at most 64"));
    }
}
