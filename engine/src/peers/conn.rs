//! Connections on demand: one RC queue pair per (peer, local NIC, remote
//! NIC, queue pair index) in use (a rail may carry several), set up on first use through the peer agent's control
//! listener and kept until it fails. Every queue pair takes its receives
//! (notifications) from its NIC's shared receive queue, so a connection
//! costs a send queue and no receive memory.
//!
//! The setup is the control protocol (`control`): both sides prove they
//! hold the cluster's secret over fresh nonces before the target creates
//! a queue pair, and the target checks the initiator is the agent (and
//! run of it) whose metadata it loaded, if it loaded any. Loading a name's
//! metadata later retires the connections made under that name that do
//! not match it (another run, control address or GID). The target is
//! ready to receive before the initiator can send.
//!
//! A NIC holds at most `max_connections` queue pairs (counted from
//! before one is created until it is destroyed: being set up, live,
//! being evicted, or retired and still held by a post); making one more
//! evicts the least recently used idle one (no post holds it: posts keep
//! their connections until their completions are reaped), with its idle
//! siblings on the same rail to the same peer (the rail's queue pairs are
//! one connection), after a goodbye over the peer's control listener,
//! which closes its end only if idle on its side too. A peer that does
//! not answer the goodbye in time (crashed, partitioned) has its
//! connection closed here anyway. In time: within the agent's timeout
//! for a connection this agent sets up (eviction takes one timeout at
//! most in all); within half of what is left of the exchange's bound
//! for one a peer asks for, so that the answer still reaches the peer
//! before its own timeout. Both ways a dead peer's slot goes to a live
//! one. Notifications already received on a closed connection still
//! name their peer (`gone`).

use std::collections::HashMap;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::serve::{serve_each, Server, Slot, WhenFull};
use gpudirect::bootstrap::{BootstrapError, OobChannel};
use gpudirect::deadline::Deadline;
use gpudirect::{QpConfig, QueuePair};
use gpudirect::sync::Mutex;
use gpudirect::Endpoint;

use crate::wire::auth::{AuthError, Key};
use crate::config::MAX_QPS_PER_RAIL;
use crate::peers::control::{self, Answer, Ask, Identity, NotProven, Request};
use crate::wire::desc::AgentMetadata;
use crate::error::EngineError;
use crate::peers::events::{Events, PeerEvent};
use crate::nics::nic::Nic;
/// Bound on serving one connection request: a peer that connects and
/// stalls holds one of the listener's [`MAX_SERVING`] slots this long at
/// most.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// One connected queue pair to a peer agent.
pub(crate) struct Conn {
    pub(crate) qp: QueuePair,
    pub(crate) peer: Arc<str>,
    /// Which run of the peer it connects to.
    instance: u64,
    /// The peer's control listener, for the goodbye.
    control: SocketAddr,
    pub(crate) nic: usize,
    remote_nic: usize,
    /// Which of the rail's queue pairs it is.
    pub(crate) index: usize,
    /// The pool's use count at its last use: the least recent is evicted.
    used: AtomicU64,
    /// Its NIC's receive queue's completions, kept at its end.
    recv_cq: gpudirect::CompletionQueue,
    /// Held by a post that goes out in pieces as room frees.
    pub(crate) posting: Mutex<()>,
    /// Its NIC's slot; last, so it is given back once the queue pair
    /// (the first field) is destroyed.
    _slot: QpSlot,
}

/// One of a NIC's `max_connections` queue pairs, taken before the queue
/// pair is created and given back when it is destroyed (the connection
/// holding it dropped) or never made. So queue pairs being set up, being
/// evicted, or retired but still held by a post count against the bound,
/// as they do against the NIC's completion queues; the live connections
/// alone do not tell.
struct QpSlot(Arc<AtomicUsize>);

impl Drop for QpSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Conn {
    /// Its receives come from the NIC's shared receive queue: what it
    /// received and nobody reaped yet (a notification, and the slot to
    /// post again) must outlive it, and a provider may remove a destroyed
    /// queue pair's completions (mlx5 does). So it stops receiving (error
    /// state), and what completed is taken into the queue's backlog before
    /// the queue pair is destroyed; the next reap hands it out.
    fn drop(&mut self) {
        if let Err(e) = self.qp.move_to_error() {
            tracing::debug!(peer = %self.peer, qp = self.qp.endpoint().qp_num, "engine connection to the error state: {e}");
        }
        self.recv_cq.stash_all();
    }
}

impl Conn {
    fn new(qp: QueuePair, slot: QpSlot, peer: &Identity, control: SocketAddr, nic: (usize, &Nic), path: Path) -> Conn {
        let recv_cq = nic.1.recv_cq.clone();
        let (_, remote_nic, index) = path;
        Conn {
            qp,
            peer: peer.name.as_str().into(),
            instance: peer.instance,
            control,
            nic: nic.0,
            remote_nic,
            index,
            used: AtomicU64::new(0),
            recv_cq,
            posting: Mutex::new(()),
            _slot: slot,
        }
    }

    fn path(&self) -> Path {
        (self.nic, self.remote_nic, self.index)
    }

    /// Whether `other` is another queue pair of its rail to the same run
    /// of the same peer.
    fn sibling(&self, other: &Conn) -> bool {
        self.peer == other.peer && self.instance == other.instance && (self.nic, self.remote_nic) == (other.nic, other.remote_nic)
    }

    fn peer_identity(&self) -> Identity {
        Identity { name: self.peer.to_string(), instance: self.instance }
    }
}

/// Where a connection goes: (local NIC, remote NIC, queue pair index).
pub(crate) type Path = (usize, usize, usize);

type ConnKey = (Arc<str>, Path);

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
/// A peer's connections to send on, by path.
type PeerConns = Vec<(Path, Arc<Conn>)>;

/// The agent's NICs and its connections.
pub(crate) struct ConnPool {
    pub(crate) name: Arc<str>,
    /// This run of the agent (its metadata's instance).
    pub(crate) instance: u64,
    /// What proofs are made with: the cluster's secret, or none.
    pub(crate) key: Key,
    /// The peers' metadata loaded here, by name: a connection request
    /// claiming one of these names must match it.
    pub(crate) loaded: Mutex<HashMap<String, Arc<AgentMetadata>>>,
    /// Control requests refused (unproven, not as loaded, malformed).
    refused: AtomicU64,
    /// Queue pairs created so far (connection setups, either side).
    created: AtomicU64,
    /// What happened to peers, for `Agent::peer_events`.
    pub(crate) events: Mutex<Events>,
    /// This agent's control listener, as peers reach it.
    control: SocketAddr,
    pub(crate) nics: Vec<Nic>,
    pub(crate) qp: QpConfig,
    pub(crate) timeout: Duration,
    /// The connection each (peer, path) sends on, by
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
    connecting: Mutex<HashMap<ConnKey, Arc<Mutex<()>>>>,
    /// The peers of connections closed or retired, by (local NIC, queue
    /// pair number), until the number is reused or [`MAX_GONE`] newer ones
    /// push it out: completions of them still in a completion queue (a
    /// notification not yet polled) keep their sender.
    gone: Mutex<Gone>,
    /// The peers of queue pairs this side is connecting, by (local NIC,
    /// queue pair number), from before each can receive until it is in
    /// `live`: the peer may send as soon as it answered, and a message
    /// reaped meanwhile must still name its sender.
    opening: Mutex<HashMap<(usize, u32), Arc<str>>>,
    /// A pause between a queue pair turning ready to receive and its
    /// listing as live, in milliseconds: the window a test probes.
    #[cfg(test)]
    pub(crate) opening_pause_ms: AtomicU64,
    /// Counts uses, for [`Conn::used`].
    uses: AtomicU64,
    /// Per NIC, the queue pairs that exist or are being made ([`QpSlot`]).
    slots: Vec<Arc<AtomicUsize>>,
    /// Held by an evicting thread while it picks its connection.
    picking: Mutex<()>,
}

/// Most closed connections whose peer [`Gone`] remembers. A closed
/// connection's completions are taken from its queue when it is destroyed
/// and handed out at the next reap, so an entry is needed only until
/// then; this many closings later, an unpolled notification of it reads
/// as from a connection no longer known (logged, not delivered).
pub(crate) const MAX_GONE: usize = 65_536;

/// The peers of closed connections, oldest dropped first past [`MAX_GONE`].
#[derive(Default)]
struct Gone {
    peers: HashMap<(usize, u32), (Arc<str>, u64)>,
    /// Keys in the order they were closed, each with the closing's number
    /// (a key closed again has a newer one in `peers`).
    order: std::collections::VecDeque<((usize, u32), u64)>,
    closed: u64,
}

impl Gone {
    fn insert(&mut self, key: (usize, u32), peer: Arc<str>) {
        self.closed += 1;
        self.peers.insert(key, (peer, self.closed));
        self.order.push_back((key, self.closed));
        while self.peers.len() > MAX_GONE || self.order.len() > 2 * MAX_GONE {
            let Some((old, n)) = self.order.pop_front() else { break };
            if self.peers.get(&old).is_some_and(|(_, at)| *at == n) {
                self.peers.remove(&old);
            }
        }
    }

    fn remove(&mut self, key: &(usize, u32)) {
        self.peers.remove(key);
    }

    fn get(&self, key: &(usize, u32)) -> Option<&Arc<str>> {
        self.peers.get(key).map(|(p, _)| p)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.peers.len()
    }
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

/// A control connection to a peer's listener, tried once. The listener
/// exists before the peer's metadata is published, so a refusal means the
/// peer is gone: retrying until the timeout (as a bootstrap does for a
/// peer that may start later) would only hold the caller, often a thread
/// that reaps completions, that long.
fn dial(addr: SocketAddr, timeout: Duration) -> Result<OobChannel, BootstrapError> {
    let s = TcpStream::connect_timeout(&addr, timeout).map_err(|source| BootstrapError::Io { op: format!("connect to {addr}"), source })?;
    OobChannel::from_stream(s, timeout)
}

fn control_err(peer: &str) -> impl FnOnce(BootstrapError) -> EngineError + '_ {
    move |source| EngineError::Control { peer: peer.to_owned(), source }
}

impl ConnPool {
    pub(crate) fn new(me: Identity, key: Key, control: SocketAddr, nics: Vec<Nic>, qp: QpConfig, timeout: Duration) -> ConnPool {
        let nics_len = nics.len();
        ConnPool {
            name: me.name.as_str().into(),
            instance: me.instance,
            key,
            loaded: Mutex::default(),
            refused: AtomicU64::new(0),
            created: AtomicU64::new(0),
            events: Mutex::default(),
            control,
            nics,
            qp,
            timeout,
            sending: Mutex::default(),
            live: Mutex::default(),
            connecting: Mutex::default(),
            gone: Mutex::default(),
            opening: Mutex::default(),
            #[cfg(test)]
            opening_pause_ms: AtomicU64::new(0),
            uses: AtomicU64::new(0),
            slots: (0..nics_len).map(|_| Arc::default()).collect(),
            picking: Mutex::default(),
        }
    }

    /// The connection to `peer` on `path` (from local NIC to its NIC, the
    /// rail's queue pair of that index), set up now when there is none
    /// (then `true`).
    pub(crate) fn get(&self, peer: &AgentMetadata, path: Path) -> Result<(Arc<Conn>, bool), EngineError> {
        if let Some(c) = self.sending_on(&peer.name, path) {
            return Ok((c, false));
        }
        let key: ConnKey = (peer.name.as_str().into(), path);
        let turn = self.connecting.lock().entry(key.clone()).or_default().clone();
        let _one = turn.lock();
        if let Some(c) = self.sending_on(&peer.name, path) {
            return Ok((c, false));
        }
        let conn = self.connect(peer, path)?;
        self.send_on(key.0, path, conn.clone(), true);
        Ok((conn, true))
    }

    /// The connection to `peer` on `path`, if there is one (never set up).
    pub(crate) fn sending_on(&self, peer: &str, path: Path) -> Option<Arc<Conn>> {
        let sending = self.sending.lock();
        let c = sending.get(peer)?.iter().find(|(k, _)| *k == path).map(|(_, c)| c.clone())?;
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
    fn send_on(&self, peer: Arc<str>, nics: Path, conn: Arc<Conn>, replace: bool) {
        let mut sending = self.sending.lock();
        let v = sending.entry(peer).or_default();
        match v.iter_mut().find(|(k, _)| *k == nics) {
            Some(slot) if replace => slot.1 = conn,
            Some(_) => {}
            None => v.push((nics, conn)),
        }
    }

    /// Makes `conn` live. Under the `live` lock, so that
    /// [`peer_of`](Self::peer_of) finds it in `opening` or in `live`.
    fn add_live(&self, nic: usize, conn: Arc<Conn>) {
        let key = (nic, conn.qp.endpoint().qp_num);
        self.touch(&conn);
        let mut live = self.live.lock();
        self.gone.lock().remove(&key);
        live.insert(key, conn);
        self.opening.lock().remove(&key);
    }

    /// A queue pair on NIC `nic` and its slot: while every slot is held,
    /// the least recently used idle connection is evicted first (its
    /// queue pair destroyed, its slot free), the evictions bounded by
    /// `evict_within` in all. Threads evicting at once each take another
    /// connection; one that finds its freed slot taken by another thread
    /// evicts again, while idle connections and time are left.
    fn create_qp(&self, nic: usize, evict_within: Duration) -> Result<(gpudirect::PreparedQueuePair, QpSlot), EngineError> {
        let n = &self.nics[nic];
        let held = &self.slots[nic];
        let deadline = Deadline::after(evict_within);
        let slot = loop {
            // A locked read (valgrind's helgrind and drd see only those).
            let now = held.fetch_add(0, Ordering::Acquire);
            if now < n.max_connections {
                if held.compare_exchange(now, now + 1, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                    break QpSlot(held.clone());
                }
                continue;
            }
            if deadline.passed() {
                return Err(EngineError::TooManyConnections { max: n.max_connections });
            }
            self.evict_one(nic, &deadline)?;
        };
        self.created.fetch_add(1, Ordering::Relaxed);
        Ok((QueuePair::create_with_srq(&n.pd, &n.send_cq, &n.recv_cq, &n.srq, &self.qp)?, slot))
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

    /// Closes the least recently used idle connection of NIC `nic`, and
    /// its idle siblings (the other queue pairs of its rail to that
    /// peer), after its peer agreed, or did not answer within what is
    /// left of `deadline` (then it is closed here alone). Only a peer that
    /// answers that the connection is busy on its side keeps it. Returns
    /// once the evicted queue pairs are destroyed.
    fn evict_one(&self, nic: usize, deadline: &Deadline) -> Result<(), EngineError> {
        let mut kept = Vec::new();
        while let Some((c, listed)) = self.pick(nic, &kept, |_| true) {
            if !self.evict(&c, listed, deadline) {
                kept.push(c.qp.endpoint().qp_num);
                continue;
            }
            while let Some((s, listed)) = self.pick(nic, &kept, |s| s.sibling(&c)) {
                if !self.evict(&s, listed, deadline) {
                    kept.push(s.qp.endpoint().qp_num);
                }
            }
            return Ok(());
        }
        Err(EngineError::TooManyConnections { max: self.nics[nic].max_connections })
    }

    /// Takes out of the pool the least recently used idle connection of
    /// NIC `nic` for which `which` holds, but none of `kept` (queue pair
    /// numbers whose peers kept them): it and whether it was in `sending`.
    /// Evicting threads pick one at a time: idle is read from the
    /// connection's reference count, and another evictor's copy of a
    /// candidate would make it look busy.
    fn pick(&self, nic: usize, kept: &[u32], which: impl Fn(&Conn) -> bool) -> Option<(Arc<Conn>, bool)> {
        let _one = self.picking.lock();
        let mut order: Vec<((usize, u32), u64)> = self
            .live
            .lock()
            .iter()
            .filter(|((i, qpn), c)| *i == nic && !kept.contains(qpn) && which(c))
            .map(|(k, c)| (*k, c.used.fetch_add(0, Ordering::Relaxed)))
            .collect();
        order.sort_by_key(|&(_, used)| used);
        order.into_iter().find_map(|(key, _)| {
            let c = self.live.lock().get(&key).cloned()?;
            let listed = self.take_if_idle(&c)?;
            Some((c, listed))
        })
    }

    /// Closes `c`, taken out of the pool idle (`listed`: it was in
    /// `sending`), unless its peer keeps it (then it goes back); whether
    /// it closed.
    fn evict(&self, c: &Arc<Conn>, listed: bool, deadline: &Deadline) -> bool {
        let left = deadline.left().unwrap_or(Duration::ZERO);
        let (nic, qp) = (c.nic, c.qp.endpoint().qp_num);
        match self.goodbye(c, left) {
            Goodbye::Closed => {
                tracing::info!(peer = %c.peer, nic, qp, "engine connection evicted (least recently used, idle)");
                true
            }
            Goodbye::Silent(why) => {
                tracing::warn!(peer = %c.peer, nic, qp, "engine connection evicted without its peer's goodbye ({why}): closed here");
                true
            }
            Goodbye::Busy(why) => {
                tracing::info!(peer = %c.peer, nic, "engine connection kept: its peer did not close it ({why})");
                self.add_live(nic, c.clone());
                if listed {
                    self.send_on(c.peer.clone(), c.path(), c.clone(), false);
                }
                false
            }
        }
    }

    /// Asks `conn`'s peer to close its end, within `within`.
    fn goodbye(&self, conn: &Conn, within: Duration) -> Goodbye {
        if within.is_zero() {
            return Goodbye::Silent("no time left of the eviction's timeout".into());
        }
        let bound = within.min(ACCEPT_TIMEOUT);
        let mut oob = match dial(conn.control, bound) {
            Ok(o) => o,
            Err(BootstrapError::Io { source, .. }) if source.kind() == io::ErrorKind::ConnectionRefused => {
                return Goodbye::Closed;
            }
            Err(e) => return Goodbye::Silent(e.to_string()),
        };
        let req = self.request(conn.path(), Ask::Close { from: conn.qp.endpoint().qp_num, to: conn.qp.remote().qp_num });
        match control::initiate(&mut oob, &self.key, &conn.peer_identity(), &req, None) {
            Ok(Answer::Accepted(_)) => Goodbye::Closed,
            Ok(Answer::Refused(reason)) => Goodbye::Busy(reason),
            // Another run of the peer (or another agent) holds its address
            // now: the one this connection went to is gone.
            Err(EngineError::WrongPeer { .. }) => Goodbye::Closed,
            Err(e) => Goodbye::Silent(e.to_string()),
        }
    }

    fn request(&self, (nic, remote_nic, qp): Path, ask: Ask) -> Request {
        Request { from: Identity { name: self.name.to_string(), instance: self.instance }, control: self.control, theirs: nic, ours: remote_nic, qp, ask }
    }

    fn connect(&self, peer: &AgentMetadata, path: Path) -> Result<Arc<Conn>, EngineError> {
        let started = std::time::Instant::now();
        let nic = path.0;
        // Nobody waits on our answer yet: the eviction may take a timeout.
        let (prepared, slot) = self.create_qp(nic, self.timeout)?;
        let key = (nic, prepared.endpoint().qp_num);
        self.opening.lock().insert(key, peer.name.as_str().into());
        let conn = self.open(peer, path, prepared, slot, started);
        // Live on success (add_live took it out of `opening` already).
        self.opening.lock().remove(&key);
        conn
    }

    /// The rest of [`connect`](Self::connect), with the queue pair listed
    /// in `opening`.
    fn open(&self, peer: &AgentMetadata, path: Path, prepared: gpudirect::PreparedQueuePair, slot: QpSlot, started: std::time::Instant) -> Result<Arc<Conn>, EngineError> {
        let (nic, remote_nic, index) = path;
        let mut oob = dial(peer.control, self.timeout).map_err(control_err(&peer.name))?;
        let them = Identity { name: peer.name.clone(), instance: peer.instance };
        let req = self.request(path, Ask::Connect);
        let remote = match control::initiate(&mut oob, &self.key, &them, &req, Some(prepared.endpoint()))? {
            Answer::Accepted(Some(ep)) => ep,
            Answer::Accepted(None) => return Err(EngineError::Refused { peer: peer.name.clone(), reason: "an answer without an endpoint".into() }),
            Answer::Refused(reason) => return Err(EngineError::Refused { peer: peer.name.clone(), reason }),
        };
        let qp = prepared.connect(&remote)?;
        #[cfg(test)]
        std::thread::sleep(Duration::from_millis(self.opening_pause_ms.load(Ordering::Relaxed)));
        tracing::info!(peer = %peer.name, nic, remote_nic, index, qp = qp.endpoint().qp_num, setup_us = started.elapsed().as_micros() as u64, "engine connected");
        let conn = Arc::new(Conn::new(qp, slot, &them, peer.control, (nic, &self.nics[nic]), path));
        self.add_live(nic, conn.clone());
        Ok(conn)
    }

    /// Whether `req` (with `endpoint`) is the agent loaded here under its
    /// name, when one is: the same run, control address and, for a
    /// connect, the GID of the NIC it names. A name never loaded is any
    /// member's to use: holding the secret is what the target checks.
    fn as_loaded(&self, req: &Request, endpoint: Option<&Endpoint>) -> Result<(), AuthError> {
        let name = &req.from.name;
        let mismatch = |m: String| Err(AuthError::NotAsLoaded { name: name.clone(), mismatch: m });
        if **name == *self.name {
            return mismatch("it claims this agent's own name".into());
        }
        let Some(md) = self.loaded.lock().get(name).cloned() else { return Ok(()) };
        if md.instance != req.from.instance {
            return mismatch(format!("instance {:016x}, loaded {:016x}", req.from.instance, md.instance));
        }
        if md.control != req.control {
            return mismatch(format!("control address {}, loaded {}", req.control, md.control));
        }
        if let Some(ep) = endpoint {
            match md.nics.get(req.theirs) {
                Some(n) if n.gid == ep.gid => {}
                Some(n) => return mismatch(format!("its NIC {} sends from GID {}, loaded {} ({})", req.theirs, ep.gid, n.gid, n.device)),
                None => return mismatch(format!("NIC {} asked for, its loaded metadata has {}", req.theirs, md.nics.len())),
            }
        }
        Ok(())
    }

    /// Serves one control request on an accepted control stream.
    fn accept(&self, stream: TcpStream, slot: &Slot<'_>) -> Result<(), EngineError> {
        let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let bound = Deadline::after(self.timeout.min(ACCEPT_TIMEOUT));
        let mut oob = OobChannel::from_stream(stream, self.timeout.min(ACCEPT_TIMEOUT)).map_err(control_err(&from))?;
        oob.within(self.timeout.min(ACCEPT_TIMEOUT));
        let me = Identity { name: self.name.to_string(), instance: self.instance };
        let proven = match control::receive(&mut oob, &self.key, &me) {
            Ok(p) => {
                // It holds the secret: no newcomer may take its slot now.
                slot.proven();
                p
            }
            Err(NotProven::Failed(e)) => return Err(control_err(&from)(e)),
            Err(NotProven::Refuse { session, reason, auth }) => {
                self.refused.fetch_add(1, Ordering::Relaxed);
                let _ = control::answer(&mut oob, &self.key, &session, Err(&reason));
                return Err(match auth {
                    Some(source) => EngineError::Auth { peer: from, source },
                    None => EngineError::Refused { peer: from, reason },
                });
            }
        };
        let refuse = |oob: &mut OobChannel, err: EngineError| -> Result<(), EngineError> {
            self.refused.fetch_add(1, Ordering::Relaxed);
            let _ = control::answer(oob, &self.key, proven.session(), Err(&err.to_string()));
            Err(err)
        };
        let req = &proven.req;
        if req.ours >= self.nics.len() {
            let reason = format!("this agent has {} NIC(s), NIC {} was asked for", self.nics.len(), req.ours);
            return refuse(&mut oob, EngineError::Refused { peer: req.from.name.clone(), reason });
        }
        if req.qp >= MAX_QPS_PER_RAIL {
            let reason = format!("queue pair {} of a rail asked for, at most {MAX_QPS_PER_RAIL} per rail", req.qp);
            return refuse(&mut oob, EngineError::Refused { peer: req.from.name.clone(), reason });
        }
        if let Err(source) = self.as_loaded(req, proven.endpoint.as_ref()) {
            return refuse(&mut oob, EngineError::Auth { peer: req.from.name.clone(), source });
        }
        if let Ask::Close { from: theirs_qpn, to } = req.ask {
            let r = self.close(req, theirs_qpn, to);
            return control::answer(&mut oob, &self.key, proven.session(), r.as_ref().map(|()| None).map_err(String::as_str)).map_err(control_err(&req.from.name));
        }
        let Some(ep) = proven.endpoint else {
            return refuse(&mut oob, EngineError::Refused { peer: req.from.name.clone(), reason: "the request carries no endpoint".into() });
        };
        // Connections to an earlier run of this peer go nowhere now.
        if let Some(old) = self.retire_other_runs(&req.from) {
            self.replaced(&req.from.name, old, req.from.instance);
        }
        // The initiator waits for our answer within its timeout (as a rule
        // the cluster's, ours) and this exchange is bounded by ours: an
        // eviction gets half of what is left of it, so a goodbye to a peer
        // that stopped answering (its host gone) cannot use up the time
        // the answer needs, and the incoming connection takes the slot as
        // an outgoing post would.
        let evict_within = bound.left().unwrap_or(Duration::ZERO) / 2;
        let (qp, slot) = match self.create_qp(req.ours, evict_within).and_then(|(p, slot)| Ok((p.connect(&ep)?, slot))) {
            Ok(made) => made,
            Err(e) => return refuse(&mut oob, e),
        };
        let endpoint = qp.endpoint();
        let path = (req.ours, req.theirs, req.qp);
        let conn = Arc::new(Conn::new(qp, slot, &req.from, req.control, (req.ours, &self.nics[req.ours]), path));
        self.add_live(req.ours, conn.clone());
        // Sends to that peer use it unless we set one up ourselves.
        self.send_on(req.from.name.as_str().into(), path, conn, false);
        control::answer(&mut oob, &self.key, proven.session(), Ok(Some(endpoint))).map_err(control_err(&req.from.name))?;
        tracing::info!(peer = %req.from.name, nic = req.ours, remote_nic = req.theirs, index = req.qp, qp = endpoint.qp_num, "engine accepted a connection");
        Ok(())
    }

    /// A peer evicts its connection from its queue pair `theirs` to our
    /// `ours`: closes our end if it is idle here too.
    fn close(&self, req: &Request, theirs: u32, ours: u32) -> Result<(), String> {
        let conn = self.live.lock().get(&(req.ours, ours)).cloned();
        let Some(conn) = conn.filter(|c| *c.peer == *req.from.name && c.instance == req.from.instance && c.qp.remote().qp_num == theirs) else {
            // Already retired here (it failed, or a close was answered
            // before): nothing to keep.
            return Ok(());
        };
        match self.take_if_idle(&conn) {
            Some(_) => {
                tracing::info!(peer = %req.from.name, nic = req.ours, qp = ours, "engine connection closed at the peer's request");
                Ok(())
            }
            None => Err(format!("connection {ours:#x} has transfers in flight here")),
        }
    }

    /// Control requests this agent refused so far.
    pub(crate) fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Queue pairs this agent created so far.
    #[cfg(test)]
    pub(crate) fn qps_created(&self) -> u64 {
        self.created.load(Ordering::Relaxed)
    }

    /// Retires every connection to `peer`'s name that goes to another run
    /// of it: that process is gone (it restarted). Posts still holding
    /// one fail on their own.
    /// Returns the earlier run's instance when there were any.
    pub(crate) fn retire_other_runs(&self, peer: &Identity) -> Option<u64> {
        let mut old = None;
        for conn in self.retire_where(&peer.name, |c| c.instance != peer.instance) {
            tracing::info!(peer = %peer.name, nic = conn.nic, qp = conn.qp.endpoint().qp_num, old = %format!("{:016x}", conn.instance), new = %format!("{:016x}", peer.instance), "engine connection to an earlier run of the peer retired");
            old = Some(conn.instance);
        }
        old
    }

    /// Retires every connection under `md`'s name that does not go to the
    /// agent `md` describes: another run of it (returned, as by
    /// [`retire_other_runs`](Self::retire_other_runs)), or a member that
    /// claimed the name before it was loaded here, with another control
    /// address or from a GID that is not the named NIC's.
    pub(crate) fn retire_unlike(&self, md: &AgentMetadata) -> Option<u64> {
        let unlike = |c: &Conn| {
            let gid_ok = md.nics.get(c.remote_nic).is_some_and(|n| n.gid == c.qp.remote().gid);
            c.instance != md.instance || c.control != md.control || !gid_ok
        };
        let (mut old, mut impostor) = (None, None);
        for conn in self.retire_where(&md.name, unlike) {
            let qp = conn.qp.endpoint().qp_num;
            if conn.instance != md.instance {
                tracing::info!(peer = %md.name, nic = conn.nic, qp, old = %format!("{:016x}", conn.instance), new = %format!("{:016x}", md.instance), "engine connection to an earlier run of the peer retired");
                old = Some(conn.instance);
            } else {
                let (control, gid) = (conn.control, conn.qp.remote().gid);
                tracing::warn!(peer = %md.name, nic = conn.nic, qp, %control, %gid, "engine connection made under this peer's name before its metadata was loaded, from another control address or GID than the metadata's: retired");
                impostor.get_or_insert(PeerEvent::Impostor { peer: md.name.clone(), control, gid });
            }
        }
        if let Some(e) = impostor {
            self.events.lock().push(e);
        }
        old
    }

    /// Takes the live connections named `peer` for which `stale` holds out
    /// of the pool, remembering their peer for completions still queued.
    fn retire_where(&self, peer: &str, stale: impl Fn(&Conn) -> bool) -> Vec<Arc<Conn>> {
        let keys: Vec<(usize, u32)> = self.live.lock().iter().filter(|(_, c)| *c.peer == *peer && stale(c)).map(|(k, _)| *k).collect();
        keys.into_iter().filter_map(|key| self.take(key)).collect()
    }

    /// Takes connection `key` (local NIC, queue pair number) out of the
    /// pool, remembering its peer for completions still queued.
    fn take(&self, key: (usize, u32)) -> Option<Arc<Conn>> {
        // From `live` to `gone` under the `live` lock (as `peer_of`
        // looks), and out of it before `sending` is taken (the order
        // elsewhere is sending, then live).
        let conn = {
            let mut live = self.live.lock();
            let conn = live.remove(&key)?;
            self.gone.lock().insert(key, conn.peer.clone());
            conn
        };
        unlist(&mut self.sending.lock(), &conn);
        Some(conn)
    }

    /// Records that `peer` is now run `new`, replacing run `old`.
    pub(crate) fn replaced(&self, peer: &str, old: u64, new: u64) {
        self.events.lock().push(PeerEvent::Replaced { peer: peer.to_owned(), old, new });
    }

    /// The peer a completion on local NIC `nic`, queue pair `qpn`, is from
    /// (also of a connection being set up, or closed since). Every look
    /// under the `live` lock: a connection moves from `opening` to `live`
    /// and from `live` to `gone` under it, so it is never between two.
    pub(crate) fn peer_of(&self, nic: usize, qpn: u32) -> Option<Arc<str>> {
        let live = self.live.lock();
        if let Some(c) = live.get(&(nic, qpn)) {
            return Some(c.peer.clone());
        }
        if let Some(p) = self.opening.lock().get(&(nic, qpn)) {
            return Some(p.clone());
        }
        self.gone.lock().get(&(nic, qpn)).cloned()
    }

    /// Drops a failed connection; the next transfer to its peer sets up a
    /// new one. The caller has failed the requests outstanding on it.
    pub(crate) fn retire(&self, nic: usize, qpn: u32, completion: gpudirect::WcError) {
        let Some(conn) = self.take((nic, qpn)) else { return };
        self.events.lock().push(PeerEvent::Lost { peer: conn.peer.to_string(), completion });
        tracing::warn!(peer = %conn.peer, nic, qp = qpn, "engine connection failed; retired (the next transfer reconnects)");
    }

    /// Drops a connection whose queue pair a caller flushed
    /// ([`TransferRequest::abort`](crate::TransferRequest::abort));
    /// no [`PeerEvent::Lost`]: the peer did nothing. Its flushed
    /// completions still find the peer's name.
    pub(crate) fn retire_aborted(&self, conn: &Conn) {
        self.take((conn.nic, conn.qp.endpoint().qp_num));
    }

    /// Connections alive now to each peer (queue pairs).
    pub(crate) fn connections_by_peer(&self) -> HashMap<Arc<str>, usize> {
        let mut by = HashMap::new();
        for c in self.live.lock().values() {
            *by.entry(c.peer.clone()).or_insert(0) += 1;
        }
        by
    }

    /// Connections alive now.
    pub(crate) fn connections(&self) -> usize {
        self.live.lock().len()
    }
}

/// How a goodbye went.
enum Goodbye {
    /// The peer closed its end, or is gone.
    Closed,
    /// The peer keeps it (transfers in flight on its side).
    Busy(String),
    /// No answer in time, or a failed exchange: close it here alone.
    Silent(String),
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
    // The client speaks first (both sides send their hello at once).
    serve_each(&listener, &stop, &server, |_| Ok(()), |s, from, (), slot| {
        if let Err(e) = pool.accept(s, slot) {
            tracing::warn!(%from, "engine connection request not served: {e}");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Closed connections' peers are remembered up to a bound, oldest out
    /// first, a key closed again counting as new, and the order kept no
    /// longer than twice the bound however keys are reused.
    #[test]
    fn closed_connections_are_remembered_up_to_a_bound() {
        let mut g = Gone::default();
        let peer: Arc<str> = "p".into();
        for qpn in 0..MAX_GONE as u32 + 10 {
            g.insert((0, qpn), peer.clone());
        }
        assert_eq!(g.len(), MAX_GONE);
        assert!(g.get(&(0, 9)).is_none() && g.get(&(0, 10)).is_some());
        // Closed again: newest now, so it outlives the ones after it.
        g.insert((0, 10), "q".into());
        for qpn in 0..5 {
            g.insert((1, qpn), peer.clone());
        }
        assert_eq!(g.get(&(0, 10)).map(|p| &**p), Some("q"));
        assert!(g.get(&(0, 11)).is_none());
        // Reused numbers (taken out when a connection gets them again)
        // never let the order grow without bound.
        for _ in 0..3 * MAX_GONE {
            g.insert((2, 1), peer.clone());
            g.remove(&(2, 1));
        }
        assert!(g.order.len() <= 2 * MAX_GONE, "{}", g.order.len());
        assert!(g.len() <= MAX_GONE);
    }
}
