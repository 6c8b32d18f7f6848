//! The engine's progress: reaping each NIC's completion queues and
//! handing what they say to the transfers in flight (done, or failed with
//! the peer named) and to the notification queue. Every poll and wait of
//! the agent goes through here, from whichever thread calls.
//!
//! A post's work requests carry `id << 1` in their `wr_id`, the last one
//! of each queue pair `id << 1 | 1`: that one is signaled, and its
//! completion finishes that queue pair's part (RC completes a queue
//! pair's requests in order); the post is done when every part is. A
//! notification that must wait for the data of several queue pairs (a
//! sliced request) or for a read is posted here, once the last part's
//! completion is reaped, and finishes the post in turn. A completion in
//! error fails every post outstanding on its queue pair and retires the
//! connection; each post has its own id, so a stale completion of an
//! earlier post never touches a later one.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use gpudirect::CompletionQueue;
use gpudirect::SendTemplate;
use gpudirect::deadline::Deadline;
use gpudirect::Error;
use gpudirect::hash::NumberMap;
use gpudirect::sync::Mutex;
use gpudirect::{WcError, WcStatus, WorkCompletion};

use crate::wire::castmsg::{self, Msg};
use crate::peers::conn::{Conn, ConnPool};
use crate::error::EngineError;
use crate::transfers::memory::Registry;
use crate::nics::msgbuf::MsgBuf;
use gpudirect::metrics::{now_ns, sample_start, Direction, LatencyCounters};
use crate::transfers::stats::{Counters, Refusal, RefusalCounters, TransferStats};
use crate::wire::notify::{self, Notification, SLOT};
use crate::nics::ready::Readiness;

/// A transfer's notification: one send after its data.
const NOTIFY: SendTemplate = SendTemplate::send();

/// How long one wait on a completion channel sleeps before looking again
/// (another thread may have reaped what this one waits for).
const WAIT_SLICE: Duration = Duration::from_millis(5);

/// Where a posted request stands.
#[derive(Clone, Debug)]
pub(crate) enum Phase {
    Idle,
    Posted,
    Done,
    Failed(Failure),
}

/// Why a post failed, kept to be reported by every later status call.
#[derive(Clone, Debug)]
pub(crate) enum Failure {
    Lost { peer: String, completion: WcError },
    Aborted { peer: String },
    Partial { peer: String, posted: usize, total: usize, reason: String },
}

impl Failure {
    pub(crate) fn to_error(&self) -> EngineError {
        match self {
            Failure::Lost { peer, completion } => EngineError::PeerLost { peer: peer.clone(), completion: *completion },
            Failure::Aborted { peer } => EngineError::Aborted { peer: peer.clone() },
            Failure::Partial { peer, posted, total, reason } => {
                EngineError::PartlyPosted { peer: peer.clone(), posted: *posted, total: *total, reason: reason.clone() }
            }
        }
    }
}

/// A request's state, shared with the progress that finishes it, and
/// its counters and its peer's.
pub(crate) struct ReqState {
    pub(crate) phase: Mutex<Phase>,
    pub(crate) own: Counters,
    /// The counters of every request of its op to its peer.
    pub(crate) peer: Arc<Counters>,
    /// When the post in progress began ([`now_ns`]), if its latency is
    /// taken; else 0.
    posted_ns: AtomicU64,
    /// The agent's latencies of its op.
    latency: Arc<LatencyCounters>,
}

impl ReqState {
    pub(crate) fn new(peer: Arc<Counters>, latency: Arc<LatencyCounters>) -> ReqState {
        ReqState { phase: Mutex::new(Phase::Idle), own: Counters::default(), peer, posted_ns: AtomicU64::new(0), latency }
    }

    /// Counts on this request's counters and on its peer's.
    #[inline]
    pub(crate) fn count(&self, bump: impl Fn(&Counters)) {
        bump(&self.own);
        bump(&self.peer);
    }

    /// Ends a post: done, or failed (counted as such).
    fn end(&self, phase: Phase) {
        match phase {
            Phase::Done => self.count(Counters::completed),
            Phase::Failed(_) => self.count(Counters::failed),
            Phase::Idle | Phase::Posted => {}
        }
        let start = self.posted_ns.load(Ordering::Relaxed);
        if start != 0 && matches!(phase, Phase::Done | Phase::Failed(_)) {
            self.latency.record(now_ns().saturating_sub(start));
        }
        *self.phase.lock() = phase;
    }
}

/// Most queue pairs (rails) one post uses.
pub(crate) const MAX_LANES: usize = 8;

/// The connections a post uses, one per lane: one without an array to
/// walk, the common case.
#[derive(Clone)]
pub(crate) enum Conns {
    One(Arc<Conn>),
    Many(Box<[Arc<Conn>]>),
}

impl Conns {
    pub(crate) fn as_slice(&self) -> &[Arc<Conn>] {
        match self {
            Conns::One(c) => std::slice::from_ref(c),
            Conns::Many(v) => v,
        }
    }
}

/// A notification to post once a post's other parts completed.
pub(crate) struct Deferred {
    pub(crate) conn: Arc<Conn>,
    pub(crate) buf: Arc<MsgBuf>,
}

struct Outstanding {
    state: Arc<ReqState>,
    /// The connection of each part: held until the post is finished, so
    /// the pool never evicts a connection a post still uses.
    conns: Conns,
    /// Final completions still to come (one per queue pair it used).
    finals: u32,
    /// Posted when `finals` reaches 0, which then waits for its completion.
    deferred: Option<Deferred>,
}

impl Outstanding {
    fn uses(&self, nic: usize, qpn: u32) -> bool {
        self.conns.as_slice().iter().any(|c| c.nic == nic && c.qp.endpoint().qp_num == qpn)
    }
}

/// The receiving side of broadcasts (`relay`), which the progress hands
/// the broadcast messages it receives: a trait here, so that this module
/// imports nothing of it (it makes transfer requests, which import this).
pub(crate) trait Relay: Send + Sync {
    /// A chunk landed (or a probe came) from `from`; the notification to
    /// hand out when it made a copy whole.
    fn on_message(&self, core: &Core, from: &str, msg: Msg) -> Option<Notification>;
    /// Follows what it started (forwards and messages in flight); cheap
    /// when there is none.
    fn progress(&self, core: &Core);
    /// Whether it has requests in flight: then a wait for notifications
    /// also wakes on send completions, so a forward that fails is told
    /// to the source while this agent waits.
    fn busy(&self) -> bool;
    /// Does one piece of queued work (posts that may set up a connection
    /// first), on the relay's own thread; whether there was any.
    fn work(&self, core: &Arc<Core>) -> bool;
    /// Whether the relay's thread may end (no work queued); if so, the
    /// next work starts a new one.
    fn retire_worker(&self) -> bool;
}

/// Where one of this agent's posted broadcasts stands, and what it costs
/// the window of broadcasts started at once: one message per receiver for
/// its start and one per chunk.
pub(crate) enum Look {
    /// Waiting its turn.
    Waiting(usize),
    /// Started, not settled.
    Started(usize),
    /// Settled (or not posted): it leaves the list.
    Settled,
}

/// A broadcast of this agent posted and not settled (`broadcast.rs`): a
/// trait here, so that this module imports nothing of it.
pub(crate) trait Posted: Send + Sync {
    /// One look (after a reap), never waiting: moves it on if started.
    fn look(&self) -> Look;
    /// Its turn came: sends its plan.
    fn start(&self);
}

/// What the receivers of one of this agent's broadcasts told it (acks,
/// misses), for the broadcast to act on at its next step.
pub(crate) type Inbox = Mutex<Vec<(String, Msg)>>;
/// Most messages one broadcast's inbox holds: more are dropped (a
/// receiver sends one ack and at most one miss per chunk and receiver).
const MAX_INBOX: usize = 1 << 16;

pub(crate) struct Core {
    /// Itself, for what needs an owning handle from `&self` (the
    /// broadcast relay makes transfer requests).
    pub(crate) me: std::sync::Weak<Core>,
    /// Requests of at least this many bytes are sliced.
    pub(crate) slice_threshold: u64,
    /// The queue pair the next unsliced request takes.
    next_path: std::sync::atomic::AtomicUsize,
    /// What an event loop waits on; made by the first poll that asks.
    pub(crate) event_loop: OnceLock<Readiness>,
    /// First: dropped while `pool`'s CQs are open (their descriptors).
    #[cfg(feature = "tokio")]
    pub(crate) channels: crate::nics::wake::Channels,
    #[cfg(feature = "tokio")]
    pub(crate) progress: crate::nics::wake::Progress,
    pub(crate) pool: Arc<ConnPool>,
    pub(crate) registry: Registry,
    /// By post id: distinct counters, hashed by one multiply.
    outstanding: Mutex<NumberMap<u64, Outstanding>>,
    notes: Mutex<VecDeque<Notification>>,
    /// Notifications received whose GPU flush failed: handed out only
    /// after a flush succeeds, before any received later.
    unflushed: Mutex<Vec<Notification>>,
    /// Notifications whose post's data is complete, to go out (by id).
    ready: Mutex<Vec<(u64, Deferred)>>,
    next_id: AtomicU64,
    /// Each peer's counters, shared by the requests to it: one per
    /// direction (so per op: writes out, reads in).
    peers: Mutex<HashMap<String, [Arc<Counters>; 2]>>,
    /// Request latencies, per direction (so per op).
    pub(crate) latency: [Arc<LatencyCounters>; 2],
    /// Messages dropped as from a connection no longer known.
    pub(crate) unknown_sender: AtomicU64,
    /// Peers' metadata refused: its seal did not verify (from a rendezvous
    /// or handed to `load_remote`).
    pub(crate) metadata_seal: AtomicU64,
    /// When the agent started.
    pub(crate) started: std::time::Instant,
    /// The broadcast receiving side, set once by the agent.
    pub(crate) relay: OnceLock<Box<dyn Relay>>,
    /// This agent's broadcasts in flight, by id: where their receivers'
    /// messages go.
    pub(crate) sources: Mutex<HashMap<u64, std::sync::Weak<Inbox>>>,
    /// This agent's broadcasts posted and not settled, in post order.
    pub(crate) posted: Mutex<Vec<std::sync::Weak<dyn Posted>>>,
    /// Broadcast messages refused, by reason.
    pub(crate) cast_refusals: RefusalCounters,
}

impl Core {
    pub(crate) fn new(pool: Arc<ConnPool>, me: std::sync::Weak<Core>, slice_threshold: u64) -> Core {
        Core {
            me,
            slice_threshold,
            next_path: Default::default(),
            event_loop: OnceLock::new(),
            #[cfg(feature = "tokio")]
            channels: Default::default(),
            #[cfg(feature = "tokio")]
            progress: Default::default(),
            pool,
            registry: Registry::default(),
            outstanding: Mutex::default(),
            notes: Mutex::default(),
            unflushed: Mutex::default(),
            ready: Mutex::default(),
            next_id: AtomicU64::new(1),
            peers: Mutex::default(),
            latency: Default::default(),
            unknown_sender: AtomicU64::new(0),
            metadata_seal: AtomicU64::new(0),
            started: std::time::Instant::now(),
            relay: OnceLock::new(),
            sources: Mutex::default(),
            posted: Mutex::default(),
            cast_refusals: RefusalCounters::default(),
        }
    }

    /// The index, below `n`, of the queue pair the next unsliced request
    /// takes: each in turn.
    pub(crate) fn next_path(&self, n: usize) -> usize {
        self.next_path.fetch_add(1, Ordering::Relaxed) % n
    }

    /// A peer loaded before, by name.
    pub(crate) fn peer(&self, name: &str) -> Result<crate::peers::peer::Peer, EngineError> {
        let md = self.pool.loaded.lock().get(name).cloned().ok_or_else(|| EngineError::UnknownPeer(name.to_owned()))?;
        Ok(crate::peers::peer::Peer { md })
    }

    /// The state of a new request to `peer` going `dir`: its peer's
    /// counters and the agent's latencies of that way.
    pub(crate) fn req_state(&self, peer: &str, dir: Direction) -> ReqState {
        let counters = self.peers.lock().entry(peer.to_owned()).or_default()[dir as usize].clone();
        ReqState::new(counters, self.latency[dir as usize].clone())
    }

    /// What the requests to `peer` did, if any was prepared.
    pub(crate) fn peer_stats(&self, peer: &str) -> Option<TransferStats> {
        self.peers.lock().get(peer).map(|[w, r]| w.read().plus(&r.read()))
    }

    /// What the requests to every peer did, per peer and per direction.
    pub(crate) fn every_peer(&self) -> Vec<(String, [TransferStats; 2])> {
        self.peers.lock().iter().map(|(p, [w, r])| (p.clone(), [w.read(), r.read()])).collect()
    }

    /// Lists a post of `state` on the connections `conns` before its
    /// requests go out, so no thread can reap a completion of it
    /// unmatched; returns its id.
    pub(crate) fn begin(&self, state: &Arc<ReqState>, conns: Conns, deferred: Option<Deferred>) -> Result<u64, EngineError> {
        let mut phase = state.phase.lock();
        if matches!(*phase, Phase::Posted) {
            return Err(EngineError::InFlight);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) & (u64::MAX >> 1);
        *phase = Phase::Posted;
        state.posted_ns.store(sample_start(), Ordering::Relaxed);
        drop(phase);
        let finals = conns.as_slice().len() as u32;
        self.outstanding.lock().insert(id, Outstanding { state: state.clone(), conns, finals, deferred });
        Ok(id)
    }

    /// Unlists a post none of whose requests went out.
    pub(crate) fn abandon(&self, id: u64) {
        if let Some(o) = self.outstanding.lock().remove(&id) {
            *o.state.phase.lock() = Phase::Idle;
        }
    }

    /// Marks a post of which only part went out as failed, leaving its
    /// posted requests' completions to be ignored.
    pub(crate) fn fail(&self, id: u64, failure: Failure) {
        if let Some(o) = self.outstanding.lock().remove(&id) {
            o.state.end(Phase::Failed(failure));
        }
    }

    /// Gives up on the post `state` is in: ends it as aborted, moves the
    /// queue pairs it used to the error state and retires their
    /// connections. Whether one was in flight (`false`: it had finished,
    /// or none was made).
    ///
    /// Ended, and its connections retired, before the flush: a flushed
    /// completion that another thread reaps meanwhile then neither ends it
    /// as lost nor reports the peer lost, and the next post reconnects
    /// rather than meeting the flushed queue pair. The flushed completions
    /// fail the other posts outstanding on those queue pairs when they are
    /// reaped ([`Self::lose`]).
    pub(crate) fn abort(&self, state: &Arc<ReqState>, peer: &str) -> Result<bool, EngineError> {
        let found = {
            let mut out = self.outstanding.lock();
            let id = out.iter().find(|(_, o)| Arc::ptr_eq(&o.state, state)).map(|(id, _)| *id);
            id.and_then(|id| out.remove(&id))
        };
        let Some(o) = found else { return Ok(false) };
        o.state.end(Phase::Failed(Failure::Aborted { peer: peer.to_owned() }));
        // Ended without a reap: its sleepers are told here, not left to a
        // flushed completion's channel event, which rxe may never raise.
        self.tell();
        let mut first_error = None;
        for c in o.conns.as_slice() {
            // Retired even when its flush fails: a queue pair that cannot
            // be moved to the error state is not one to post on again.
            self.pool.retire_aborted(c);
            if let Err(e) = c.qp.move_to_error() {
                first_error.get_or_insert(e);
            }
        }
        tracing::info!(peer, lanes = o.conns.as_slice().len(), "transfer aborted; its connections were flushed and retired");
        first_error.map_or(Ok(true), |e| Err(e.into()))
    }

    /// Handles one send-queue completion of NIC `nic`.
    pub(crate) fn on_send(&self, nic: usize, wc: &WorkCompletion) {
        if let Err(completion) = wc.ok() {
            self.lose(nic, wc.qp_num, completion);
            return;
        }
        if wc.wr_id & 1 == 0 {
            return;
        }
        let id = wc.wr_id >> 1;
        let finished = {
            let mut out = self.outstanding.lock();
            match out.get_mut(&id) {
                Some(o) if o.finals > 1 => {
                    o.finals -= 1;
                    None
                }
                Some(o) if o.deferred.is_some() => {
                    // The data is in place: the notification goes out now,
                    // and its completion finishes the post.
                    let d = o.deferred.take().expect("checked");
                    o.conns = Conns::One(d.conn.clone());
                    self.ready.lock().push((id, d));
                    None
                }
                Some(_) => out.remove(&id),
                None => None,
            }
        };
        if let Some(o) = finished {
            o.state.end(Phase::Done);
        }
    }

    /// Posts the notifications whose data completed; one whose send queue
    /// is full stays for the next progress.
    pub(crate) fn post_ready(&self) {
        let ready = {
            let mut r = self.ready.lock();
            if r.is_empty() {
                return;
            }
            std::mem::take(&mut *r)
        };
        for (id, d) in ready {
            // One send, its memory and id new each time: the prepared request, aimed.
            let posted = d.buf.slice().and_then(|s| d.conn.qp.post_aimed(&NOTIFY, s, 0, 0, 0, id << 1 | 1));
            match posted {
                Ok(()) => {}
                Err(Error::QueueFull { .. }) => self.ready.lock().push((id, d)),
                Err(e) => {
                    tracing::warn!(peer = %d.conn.peer, "a transfer's notification could not be posted: {e}");
                    self.fail(id, Failure::Partial { peer: d.conn.peer.to_string(), posted: 0, total: 1, reason: format!("the notification: {e}") });
                }
            }
        }
    }

    /// A queue pair failed: fails every post outstanding on it, naming
    /// the peer and the completion, and retires the connection.
    fn lose(&self, nic: usize, qpn: u32, completion: WcError) {
        let peer = self.pool.peer_of(nic, qpn).map(|p| p.to_string()).unwrap_or_else(|| "(unknown)".into());
        let failed: Vec<Outstanding> = {
            let mut out = self.outstanding.lock();
            let ids: Vec<u64> = out.iter().filter(|(_, o)| o.uses(nic, qpn)).map(|(id, _)| *id).collect();
            ids.iter().filter_map(|id| out.remove(id)).collect()
        };
        if !failed.is_empty() || completion.status != WcStatus::WrFlushError {
            tracing::warn!(peer = %peer, nic, qp = qpn, "engine transfer failed: {completion}");
        }
        for o in failed {
            o.state.end(Phase::Failed(Failure::Lost { peer: peer.clone(), completion }));
        }
        self.pool.retire(nic, qpn, completion);
    }

    /// Reaps NIC `nic`'s send completions: what is there (`wait` `None`),
    /// or waiting up to `wait` for one.
    pub(crate) fn progress_send(&self, nic: usize, wait: Option<Duration>) -> Result<usize, EngineError> {
        let n = &self.pool.nics[nic];
        // Few per post are signaled (the last of each rail, one per half
        // queue): a short array, whose zeroing every call otherwise cost
        // more than the post's bookkeeping (callgrind).
        let mut wcs = [WorkCompletion::default(); 4];
        let got = reap(&n.send_cq, &mut wcs, wait)?;
        #[cfg(feature = "fault-injection")]
        if got > 0 {
            gpudirect::fault::send_reap_delay();
        }
        for wc in &wcs[..got] {
            self.on_send(nic, wc);
        }
        if got > 0 {
            self.reaped();
        }
        Ok(got)
    }

    /// After send completions were reaped, by whichever path: the
    /// notifications they made ready go out (or the room one that found
    /// its queue full waits for is there), and the tasks that sleep on
    /// requests look again (a request they await may be done, and the
    /// channel event that would have woken them may be taken).
    pub(crate) fn reaped(&self) {
        self.post_ready();
        self.tell();
    }

    /// Wakes whoever sleeps on progress: tokio tasks, an event loop.
    fn tell(&self) {
        #[cfg(feature = "tokio")]
        self.progress.tell();
        if let Some(r) = self.event_loop.get() {
            r.tell();
        }
    }

    /// Reaps NIC `nic`'s notification receives into the queue, reposting
    /// each slot; GPU memory is flushed before any is handed out. A batch
    /// is finished whatever fails in it: every notification decoded is
    /// kept (queued, or held until a flush succeeds), every slot reposted
    /// or kept to be reposted at the next reap; then the first error is
    /// returned.
    pub(crate) fn progress_recv(&self, nic: usize, wait: Option<Duration>) -> Result<usize, EngineError> {
        let n = &self.pool.nics[nic];
        let mut first_err: Option<EngineError> = n.repost_held().err().map(EngineError::from);
        let mut wcs = [WorkCompletion::default(); 32];
        let got = reap(&n.recv_cq, &mut wcs, wait)?;
        let mut fresh = Vec::new();
        let mut casts = Vec::new();
        for wc in &wcs[..got] {
            let slot = wc.wr_id as usize;
            if wc.status == WcStatus::Success {
                let mut buf = vec![0; (wc.byte_len as usize).min(SLOT)];
                // SAFETY: the slot's receive completed (reaped just now)
                // and the slot is posted again only below, after this
                // read; only this thread handles this completion.
                let read = unsafe { n.slots.read_owned_at(slot * SLOT, &mut buf) }.map_err(|e| e.to_string());
                let peer = self.pool.peer_of(nic, wc.qp_num);
                if read.is_ok() && castmsg::is_broadcast(&buf) {
                    match (Msg::decode(&buf), peer) {
                        (Ok(m), Some(peer)) => casts.push((peer, m)),
                        (Err(why), peer) => {
                            self.cast_refusals.count(Refusal::Malformed);
                            tracing::warn!(peer = ?peer, nic, qp = wc.qp_num, "dropped a broadcast message: {why}");
                        }
                        (Ok(_), None) => {
                            self.unknown_sender.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(nic, qp = wc.qp_num, "dropped a broadcast message from a connection no longer known");
                        }
                    }
                    if let Err(e) = n.repost(slot) {
                        first_err.get_or_insert(e.into());
                    }
                    continue;
                }
                match (read.and_then(|()| notify::decode(&buf)), peer) {
                    (Ok(msg), Some(peer)) => fresh.push(Notification { peer: peer.to_string(), msg: msg.to_vec() }),
                    (Err(why), peer) => tracing::warn!(peer = ?peer, nic, qp = wc.qp_num, "dropped a message that is not a notification: {why}"),
                    (Ok(_), None) => {
                        self.unknown_sender.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(nic, qp = wc.qp_num, "dropped a notification from a connection no longer known");
                    }
                }
            } else if let Err(e) = wc.ok() {
                // A receive fails when its message does not fit a slot
                // (that queue pair is in error now), or is flushed from a
                // queue pair moved to error before it closed.
                self.lose(nic, wc.qp_num, e);
            }
            // The slot goes back to the queue whatever happened above.
            if let Err(e) = n.repost(slot) {
                first_err.get_or_insert(e.into());
            }
        }
        for (peer, m) in casts {
            fresh.extend(self.on_broadcast(&peer, m));
        }
        let held = !self.unflushed.lock().is_empty();
        if !fresh.is_empty() || held {
            match self.registry.flush_gpu_writes() {
                Ok(()) => {
                    let mut notes = self.notes.lock();
                    notes.extend(self.unflushed.lock().drain(..));
                    notes.extend(fresh);
                    drop(notes);
                    self.tell();
                }
                Err(e) => {
                    self.unflushed.lock().extend(fresh);
                    first_err.get_or_insert(e.into());
                }
            }
        }
        first_err.map_or(Ok(got), Err)
    }

    /// Reaps every NIC's notification receives; how many it found. The
    /// broadcasts this agent relays move on too.
    pub(crate) fn reap_recvs(&self) -> Result<usize, EngineError> {
        let got = (0..self.pool.nics.len()).try_fold(0, |got, nic| Ok::<_, EngineError>(got + self.progress_recv(nic, None)?))?;
        if let Some(r) = self.relay.get() {
            r.progress(self);
        }
        Ok(got)
    }

    /// Reaps the send completions of `nics` that are there, never
    /// waiting; how many.
    pub(crate) fn reap_sends(&self, nics: impl IntoIterator<Item = usize>) -> Result<usize, EngineError> {
        nics.into_iter().try_fold(0, |got, nic| Ok(got + self.progress_send(nic, None)?))
    }

    /// Whether the broadcast relay has requests in flight to follow.
    pub(crate) fn relaying(&self) -> bool {
        self.relay.get().is_some_and(|r| r.busy())
    }

    /// A broadcast message from `peer`: a receiver's answer goes to the
    /// broadcast of this agent it is about, a chunk to the relay.
    fn on_broadcast(&self, peer: &str, m: Msg) -> Option<Notification> {
        match m {
            Msg::Ack { id } | Msg::Miss { id, .. } | Msg::Ready { id } | Msg::Refuse { id, .. } => {
                let inbox = self.sources.lock().get(&id).and_then(std::sync::Weak::upgrade);
                match inbox {
                    Some(inbox) => {
                        let mut v = inbox.lock();
                        if v.len() < MAX_INBOX {
                            v.push((peer.to_owned(), m));
                        }
                        drop(v);
                        self.tell();
                    }
                    None => tracing::debug!(peer, id, "a receiver's answer to a broadcast no longer in flight"),
                }
                None
            }
            m => self.relay.get().and_then(|r| r.on_message(self, peer, m)),
        }
    }

    /// The oldest notification received and not yet handed out.
    pub(crate) fn next_note(&self) -> Option<Notification> {
        self.notes.lock().pop_front()
    }

    /// Every notification received so far.
    pub(crate) fn notifications(&self) -> Result<Vec<Notification>, EngineError> {
        while self.reap_recvs()? > 0 {}
        Ok(self.notes.lock().drain(..).collect())
    }

    /// The next notification, waiting up to `timeout` (`None`: no limit).
    pub(crate) fn wait_notification(&self, timeout: Option<Duration>) -> Result<Notification, EngineError> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        let mut turn = 0;
        loop {
            if let Some(n) = self.next_note() {
                return Ok(n);
            }
            self.reap_recvs()?;
            if !self.notes.lock().is_empty() {
                continue;
            }
            let slice = match deadline.left() {
                Some(l) if l.is_zero() => return Err(EngineError::Timeout(timeout.unwrap_or_default())),
                Some(l) => l.min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            turn = (turn + 1) % self.pool.nics.len();
            self.progress_recv(turn, Some(slice))?;
        }
    }

    /// Waits for the post `state` is in, up to `timeout`, reaping the
    /// send completions of `nics` (the NICs it uses).
    pub(crate) fn wait(&self, state: &ReqState, nics: &[usize], timeout: Option<Duration>) -> Result<(), EngineError> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        let mut turn = 0;
        loop {
            // Matched here, not through a helper returning the outcome:
            // that cost ~1 instruction per descriptor more (callgrind).
            match &*state.phase.lock() {
                Phase::Idle | Phase::Done => return Ok(()),
                Phase::Failed(f) => return Err(f.to_error()),
                Phase::Posted => {}
            }
            let slice = match deadline.left() {
                Some(l) if l.is_zero() => return Err(EngineError::Timeout(timeout.unwrap_or_default())),
                Some(l) => l.min(WAIT_SLICE),
                None => WAIT_SLICE,
            };
            if let [nic] = nics {
                self.progress_send(*nic, Some(slice))?;
                continue;
            }
            // Several NICs: what each has now, then a short wait on one in turn.
            let mut got = 0;
            for &nic in nics {
                got += self.progress_send(nic, None)?;
            }
            if got == 0 {
                turn = (turn + 1) % nics.len();
                self.progress_send(nics[turn], Some(slice / nics.len() as u32))?;
            }
        }
    }
}

/// Never blocking, for event loops (`ready.rs`): each poll looks, reaps,
/// arms the CQs it needs and the [`Readiness`], and looks again.
impl Core {
    /// The event loop's descriptor, made on first use.
    pub(crate) fn readiness(&self) -> Result<&Readiness, EngineError> {
        if let Some(r) = self.event_loop.get() {
            return Ok(r);
        }
        let cqs = self.pool.nics.iter().flat_map(|n| [n.send_cq.clone(), n.recv_cq.clone()]).collect();
        // Two first calls may both build one; the loser's is dropped.
        let _ = self.event_loop.set(Readiness::new(cqs)?);
        Ok(self.event_loop.get().expect("set above"))
    }

    /// Whether the post `state` is in has finished (an error if it failed).
    pub(crate) fn poll_completed(&self, state: &ReqState, nics: &[usize]) -> Result<bool, EngineError> {
        let ready = self.readiness()?;
        let settled = || match &*state.phase.lock() {
            Phase::Idle | Phase::Done => Ok(true),
            Phase::Failed(f) => Err(f.to_error()),
            Phase::Posted => Ok(false),
        };
        if settled()? {
            return Ok(true);
        }
        for &nic in nics {
            self.progress_send(nic, None)?;
        }
        if settled()? {
            return Ok(true);
        }
        for &nic in nics {
            self.pool.nics[nic].send_cq.req_notify()?;
        }
        for &nic in nics {
            self.progress_send(nic, None)?;
        }
        ready.arm();
        settled()
    }

    /// The next notification, if one is here.
    pub(crate) fn poll_note(&self) -> Result<Option<Notification>, EngineError> {
        let ready = self.readiness()?;
        if let Some(n) = self.next_note() {
            return Ok(Some(n));
        }
        if self.reap_recvs()? > 0 {
            if let Some(n) = self.next_note() {
                return Ok(Some(n));
            }
        }
        let relaying = self.relaying();
        for n in self.pool.nics.iter() {
            n.recv_cq.req_notify()?;
            if relaying {
                n.send_cq.req_notify()?;
            }
        }
        self.reap_recvs()?;
        ready.arm();
        Ok(self.next_note())
    }
}

/// Polls `cq` (or waits up to `wait` for it) into `wcs`; a wait that
/// times out reaps nothing.
fn reap(cq: &CompletionQueue, wcs: &mut [WorkCompletion], wait: Option<Duration>) -> Result<usize, EngineError> {
    match wait {
        None => Ok(cq.poll(wcs)?),
        Some(t) => match cq.wait(wcs, Some(t)) {
            Err(Error::Timeout(_)) => Ok(0),
            r => Ok(r?),
        },
    }
}
