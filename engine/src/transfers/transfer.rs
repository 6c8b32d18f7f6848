//! Transfer requests: a list of (local range, remote range) entries, read
//! or write, to one peer, optionally followed by a notification. Prepared
//! once, posted as often as needed (one post in flight at a time). A
//! request goes over one queue pair of one rail (this agent's NIC `i` to
//! the peer's NIC `i`) or, sliced, over several (every queue pair of
//! every rail): each part is one batch on its queue pair, one doorbell
//! while the send queue has room, its last request the only one that
//! finishes it.

use std::sync::Arc;
use std::time::Duration;

use gpudirect::Result;
use gpudirect::{SendList, SendWr};

use crate::transfers::core::{Conns, Core, Deferred, Failure, Phase, ReqState, MAX_LANES};
use crate::wire::desc::AgentMetadata;
use crate::error::EngineError;
use crate::transfers::memory::LocalRange;
use crate::nics::msgbuf::MsgBuf;
use crate::peers::peer::RemoteRange;
use gpudirect::metrics::{DataPath, Direction, PathBytes};
use crate::transfers::stats::{Counters, TransferStats};

/// What a transfer does to the remote memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Op {
    /// RDMA write: local ranges into the peer's.
    Write,
    /// RDMA read: the peer's ranges into local ones.
    Read,
}

impl Op {
    /// Which way its bytes go through this agent's NICs.
    #[inline]
    pub(crate) fn direction(self) -> Direction {
        match self {
            Op::Write => Direction::Out,
            Op::Read => Direction::In,
        }
    }
}

/// Where a transfer request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferStatus {
    /// Never posted.
    Idle,
    /// Posted; not every byte is in place yet.
    InFlight,
    /// Every byte of the last post is in place (and its notification, if
    /// any, delivered to the peer's NIC).
    Done,
}

/// The part of a request one queue pair carries: pieces of its entries.
pub(crate) struct Lane {
    /// This agent's NIC, and the peer's.
    pub(crate) nic: usize,
    pub(crate) remote_nic: usize,
    /// Which of the rail's queue pairs.
    pub(crate) qp: usize,
    /// (entry index, offset into the entry, length).
    pub(crate) pieces: Vec<(usize, u64, u64)>,
    pub(crate) bytes: u64,
    /// Whether the pieces are the request's entries, whole and in order.
    pub(crate) whole: bool,
    /// Its bytes by the path each piece's local region takes on `nic`
    /// (set when the request is made).
    pub(crate) paths: PathBytes,
}

impl Lane {
    /// All of `entries`, whole, on queue pair `qp` of `rail`.
    pub(crate) fn whole((rail, qp): (usize, usize), entries: &[(LocalRange, RemoteRange)]) -> Lane {
        let pieces: Vec<_> = entries.iter().enumerate().map(|(i, (_, r))| (i, 0, r.len)).collect();
        Lane { nic: rail, remote_nic: rail, qp, bytes: pieces.iter().map(|p| p.2).sum(), pieces, whole: true, paths: [0; 3] }
    }
}

/// A request's notification: its wire form in a region of the NIC of
/// lane `lane`, and whether it waits for every lane's completions (after
/// a read, or a request sliced over several rails) or follows its lane's
/// writes on their queue pair.
pub(crate) struct Notify {
    pub(crate) buf: Arc<MsgBuf>,
    pub(crate) lane: usize,
    pub(crate) after_completions: bool,
}

/// The rails on which every entry's memory is registered at both ends.
pub(crate) fn rails(nics: usize, peer: &AgentMetadata, entries: &[(LocalRange, RemoteRange)]) -> Result<Vec<usize>, EngineError> {
    let usable = |rail: usize| entries.iter().all(|(l, r)| l.reg.inner.on(rail).is_some() && r.mem.desc().on_nic(rail).is_some());
    let found: Vec<usize> = (0..nics.min(peer.nics.len()).min(MAX_LANES)).filter(|&r| usable(r)).collect();
    if !found.is_empty() {
        return Ok(found);
    }
    let (l, r) = &entries[0];
    Err(EngineError::NoRail {
        peer: peer.name.clone(),
        why: format!(
            "this agent has {nics} NIC(s), {:?} has {}; local {:?} is registered on NICs {:?} of ours, remote {:?} on NICs {:?} of theirs",
            peer.name,
            peer.nics.len(),
            l.reg.name(),
            (0..nics).filter(|&i| l.reg.inner.on(i).is_some()).collect::<Vec<_>>(),
            r.mem.name(),
            r.mem.desc().keys.iter().map(|k| k.0).collect::<Vec<_>>()
        ),
    })
}

/// Every (rail, queue pair index) of `rails`, rail by rail, `qps(rail)`
/// queue pairs each.
pub(crate) fn queue_pairs(rails: &[usize], qps: impl Fn(usize) -> usize) -> Vec<(usize, usize)> {
    rails.iter().flat_map(|&r| (0..qps(r)).map(move |q| (r, q))).collect()
}

/// Entries of lengths `lens` cut into one lane per (rail, queue pair) of
/// `paths`, each `bytes / n` long, rounded up (the last takes what is
/// left), entries split where a lane ends.
pub(crate) fn slice(lens: impl IntoIterator<Item = u64>, paths: &[(usize, usize)], bytes: u64) -> Vec<Lane> {
    let share = bytes.div_ceil(paths.len() as u64);
    let mut lanes: Vec<Lane> =
        paths.iter().map(|&(r, qp)| Lane { nic: r, remote_nic: r, qp, pieces: Vec::new(), bytes: 0, whole: false, paths: [0; 3] }).collect();
    let mut lane = 0;
    for (i, len) in lens.into_iter().enumerate() {
        let mut at = 0;
        loop {
            let room = if lane + 1 == lanes.len() { u64::MAX } else { share - lanes[lane].bytes };
            let n = (len - at).min(room);
            if n > 0 || len == 0 {
                lanes[lane].pieces.push((i, at, n));
                lanes[lane].bytes += n;
            }
            at += n;
            if share > 0 && lanes[lane].bytes == share && lane + 1 < lanes.len() {
                lane += 1;
            }
            if at == len {
                break;
            }
        }
    }
    lanes.retain(|l| !l.pieces.is_empty());
    lanes
}

/// A transfer of `entries` (checked here) followed, if given, by the
/// notification or engine message `wire` (already encoded), planned over
/// the rails and queue pairs as [`Agent::prepare`](crate::Agent::prepare)
/// documents.
pub(crate) fn prepare(core: &Arc<Core>, op: Op, entries: &[(LocalRange, RemoteRange)], wire: Option<Vec<u8>>) -> Result<TransferRequest, EngineError> {
    let first = entries.first().ok_or(EngineError::EmptyRequest)?;
    let peer = first.1.mem.md.clone();
    let mut bytes = 0u64;
    for (index, (l, r)) in entries.iter().enumerate() {
        if r.mem.md.name != peer.name {
            return Err(EngineError::MixedPeers { index, first: peer.name.clone(), got: r.mem.md.name.clone() });
        }
        if l.len as u64 != r.len {
            return Err(EngineError::LengthMismatch { index, local: l.len as u64, remote: r.len });
        }
        bytes += r.len;
    }
    let nics = &core.pool.nics;
    let rails = rails(nics.len(), &peer, entries)?;
    let paths = queue_pairs(&rails, |r| nics[r].qps);
    let lanes = if bytes >= core.slice_threshold && paths.len() > 1 {
        slice(entries.iter().map(|e| e.1.len), &paths, bytes)
    } else {
        vec![Lane::whole(paths[core.next_path(paths.len())], entries)]
    };
    // One queue pair's writes are ordered before a send behind them;
    // reads and other queue pairs' writes are not.
    let after_completions = op == Op::Read || lanes.len() > 1;
    let notify = wire.map(|w| notification(core, &lanes, w, after_completions)).transpose()?;
    TransferRequest::new(core.clone(), op, peer, entries.to_vec(), lanes, notify, bytes)
}

/// A request that moves no bytes and only sends `wire` (an engine
/// message) to `peer`, on its first rail's first queue pair.
pub(crate) fn message(core: &Arc<Core>, peer: Arc<AgentMetadata>, wire: Vec<u8>) -> Result<TransferRequest, EngineError> {
    let lanes = vec![Lane::whole((0, 0), &[])];
    let notify = notification(core, &lanes, wire, false)?;
    TransferRequest::new(core.clone(), Op::Write, peer, Vec::new(), lanes, Some(notify), 0)
}

/// `wire` in a region of the NIC of the last of `lanes`.
fn notification(core: &Core, lanes: &[Lane], wire: Vec<u8>, after_completions: bool) -> Result<Notify, EngineError> {
    let lane = lanes.len() - 1;
    let nic = &core.pool.nics[lanes[lane].nic];
    let buf = Arc::new(nic.msgs.put(&nic.pd, &wire)?);
    Ok(Notify { buf, lane, after_completions })
}

/// A prepared transfer: made by [`Agent::prepare`](crate::Agent::prepare),
/// posted by [`post`](Self::post), followed by [`status`](Self::status) or
/// [`wait`](Self::wait). It holds its local memory registered, so a posted
/// request can never outlive the memory it names.
pub struct TransferRequest {
    /// Each lane's work requests, checked and written out once, when the
    /// request is made: a post only numbers them (building and checking
    /// them per post cost ~200 instructions per descriptor, callgrind).
    /// They borrow the regions of `entries` and `notify`, which live in
    /// `Arc`s this request holds and never changes: declared first, so
    /// dropped before them.
    lists: gpudirect::sync::Mutex<Vec<SendList<'static>>>,
    core: Arc<Core>,
    op: Op,
    peer: Arc<AgentMetadata>,
    entries: Vec<(LocalRange, RemoteRange)>,
    lanes: Vec<Lane>,
    notify: Option<Notify>,
    state: Arc<ReqState>,
    bytes: u64,
    /// The NICs its lanes use, each once: where its completions arrive.
    nics: Vec<usize>,
    /// The path of its bytes (`gdr`, `host`, `staged`; `mixed`, or
    /// `none` for a notification alone), for its span.
    path: &'static str,
}

impl std::fmt::Debug for TransferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferRequest")
            .field("op", &self.op)
            .field("peer", &self.peer.name)
            .field("entries", &self.entries.len())
            .field("bytes", &self.bytes)
            .field("rails", &self.lanes.iter().map(|l| (l.nic, l.qp, l.bytes)).collect::<Vec<_>>())
            .field("notify", &self.notify.is_some())
            .finish()
    }
}

impl Drop for TransferRequest {
    /// A message a send may still read (the request is dropped in flight,
    /// or its post failed part way) must not be reused as clean.
    fn drop(&mut self) {
        if let Some(n) = &self.notify {
            if !matches!(&*self.state.phase.lock(), crate::transfers::core::Phase::Idle | crate::transfers::core::Phase::Done) {
                n.buf.suspect();
            }
        }
    }
}

impl TransferRequest {
    pub(crate) fn new(
        core: Arc<Core>,
        op: Op,
        peer: Arc<AgentMetadata>,
        entries: Vec<(LocalRange, RemoteRange)>,
        mut lanes: Vec<Lane>,
        notify: Option<Notify>,
        bytes: u64,
    ) -> Result<TransferRequest, EngineError> {
        // The path of each byte from the region that moves it: never
        // inferred (a region without one on the lane's NIC counts none).
        for lane in &mut lanes {
            for &(i, _, n) in &lane.pieces {
                if let Some(r) = entries[i].0.reg.inner.on(lane.nic) {
                    lane.paths[DataPath::of(r.location()) as usize] += n;
                }
            }
        }
        let mut nics: Vec<usize> = lanes.iter().map(|l| l.nic).collect();
        nics.sort_unstable();
        nics.dedup();
        let every = (core.pool.qp.max_send_wr / 2).max(1) as usize;
        let mut lists = Vec::with_capacity(lanes.len());
        for lane in 0..lanes.len() {
            let list = SendList::new(&requests(op, &entries, &lanes, notify.as_ref(), lane, every)?)?;
            // SAFETY: the list borrows regions owned by `entries`' and
            // `notify`'s `Arc`s, which the request keeps unchanged for its
            // whole life and drops only after `lists` (declared first);
            // moving the request moves the `Arc`s, not the regions.
            lists.push(unsafe { std::mem::transmute::<SendList<'_>, SendList<'static>>(list) });
        }
        let state = Arc::new(core.req_state(&peer.name, op.direction()));
        let mut used = DataPath::ALL.into_iter().filter(|&p| lanes.iter().any(|l| l.paths[p as usize] > 0));
        let path = match (used.next(), used.next()) {
            (None, _) => "none",
            (Some(p), None) => p.as_str(),
            (Some(_), Some(_)) => "mixed",
        };
        Ok(TransferRequest { lists: gpudirect::sync::Mutex::new(lists), core, op, peer, entries, lanes, notify, state, bytes, nics, path })
    }

    /// What its posts did so far; the same counters summed over every
    /// request to its peer: [`Agent::peer_stats`](crate::Agent::peer_stats).
    pub fn stats(&self) -> TransferStats {
        self.state.own.read()
    }

    /// The peer agent it targets.
    pub fn peer(&self) -> &str {
        &self.peer.name
    }

    /// Bytes it moves per post.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes each rail carries per post: (this agent's NIC index,
    /// bytes), in slice order, one entry per queue pair of the rail that
    /// carries a slice ([`queue_pairs`](Self::queue_pairs) says which).
    pub fn rails(&self) -> Vec<(usize, u64)> {
        self.lanes.iter().map(|l| (l.nic, l.bytes)).collect()
    }

    /// The bytes each queue pair carries per post: (this agent's NIC
    /// index, the rail's queue pair index, bytes), in slice order.
    pub fn queue_pairs(&self) -> Vec<(usize, usize, u64)> {
        self.lanes.iter().map(|l| (l.nic, l.qp, l.bytes)).collect()
    }

    /// Posts it: connects to the peer first on each queue pair this agent
    /// has no connection on yet, then posts every part (and the
    /// notification behind one part's writes) as one batch per queue
    /// pair.
    ///
    /// # Errors
    /// [`EngineError::InFlight`] while the previous post is still in
    /// flight; a connection error ([`EngineError::Control`],
    /// [`EngineError::Refused`], [`EngineError::WrongPeer`],
    /// [`EngineError::TooManyConnections`]); [`EngineError::Verbs`] from
    /// posting (when nothing went out the request is idle again and may be
    /// posted again; when part went out it is failed).
    pub fn post(&self) -> Result<(), EngineError> {
        self.post_on(true).map(|_| ())
    }

    /// Posts it only if every connection it needs is set up already
    /// (never dialing, for a thread that must not wait); whether it went.
    pub(crate) fn post_connected(&self) -> Result<bool, EngineError> {
        self.post_on(false)
    }

    // Inlined into both: `post` (the hot path) then has no branch on
    // `dial` left (callgrind: ~70 instructions per request otherwise).
    #[inline(always)]
    fn post_on(&self, dial: bool) -> Result<bool, EngineError> {
        // With no subscriber at debug, the span costs a level check.
        let _span = tracing::debug_span!("transfer", peer = %self.peer.name, op = ?self.op, bytes = self.bytes, lanes = self.lanes.len(), path = self.path).entered();
        let conns = match &self.lanes[..] {
            [one] => match self.conn(one, dial).map_err(|e| self.refused(e))? {
                Some(c) => Conns::One(c),
                None => return Ok(false),
            },
            lanes => match lanes.iter().map(|l| self.conn(l, dial)).collect::<Result<Option<_>, _>>().map_err(|e| self.refused(e))? {
                Some(v) => Conns::Many(v),
                None => return Ok(false),
            },
        };
        let deferred = match &self.notify {
            Some(nt) if nt.after_completions => {
                Some(Deferred { conn: conns.as_slice()[nt.lane].clone(), buf: nt.buf.clone() })
            }
            _ => None,
        };
        // The outstanding entry holds the connections too, until finished.
        let id = self.core.begin(&self.state, conns.clone(), deferred).map_err(|e| self.refused(e))?;
        let mut total = 0;
        let mut reaped = false;
        for (i, lane) in self.lanes.iter().enumerate() {
            let conn = &conns.as_slice()[i];
            let qp = &conn.qp;
            let mut lists = self.lists.lock();
            let list = &mut lists[i];
            list.set_wr_ids(id << 1, id << 1 | 1);
            let core = &self.core;
            let nic = lane.nic;
            #[cfg(feature = "fault-injection")]
            gpudirect::fault::lane_post_delay(lane.qp);
            // One batch when the send queue has room (nothing is posted when
            // it has not); else as room frees, reaping meanwhile, one
            // request at a time per connection: a batch always ends
            // signaled, but pieces of two threads' requests side by side
            // could fill the queue with unsignaled ones that no completion
            // would ever free.
            let posted = match qp.post_list(list) {
                Err(gpudirect::Error::QueueFull { .. }) => {
                    let _turn = conn.posting.lock();
                    qp.post_send_all(list.requests(), Some(core.pool.timeout), |wc| {
                        core.on_send(nic, &wc);
                        reaped = true;
                        Ok(())
                    })
                }
                r => r.map_err(|error| gpudirect::PartialPost { posted: 0, error }),
            };
            match posted {
                Ok(()) => {
                    self.core.pool.nics[nic].count(lane.qp, lane.bytes, self.op.direction(), &lane.paths);
                    total += list.len();
                }
                Err(p) if p.posted == 0 && i == 0 => {
                    self.core.abandon(id);
                    return Err(self.refused(p.error.into()));
                }
                Err(p) => return Err(self.partly(id, total + p.posted, total + list.len(), p.error.to_string(), p.error)),
            }
        }
        if reaped {
            self.core.reaped();
        }
        self.counted_post();
        Ok(true)
    }

    /// The connection of one lane, set up if there is none (and counted)
    /// when `dial`, else `None` then.
    #[inline(always)]
    fn conn(&self, lane: &Lane, dial: bool) -> Result<Option<Arc<crate::peers::conn::Conn>>, EngineError> {
        let path = (lane.nic, lane.remote_nic, lane.qp);
        if !dial {
            return Ok(self.core.pool.sending_on(&self.peer.name, path));
        }
        let (conn, new) = self.core.pool.get(&self.peer, path)?;
        if new {
            self.state.count(Counters::connected);
        }
        Ok(Some(conn))
    }

    /// Counts a post that went out, all or part of it.
    fn counted_post(&self) {
        self.state.count(|c| c.posted(self.bytes));
    }

    /// Counts a post refused before anything went out.
    #[cold]
    fn refused(&self, e: EngineError) -> EngineError {
        self.state.count(Counters::refused);
        tracing::debug!("post refused: {e}");
        e
    }

    /// Fails post `id` of which `posted` of `total` requests went out.
    fn partly(&self, id: u64, posted: usize, total: usize, reason: String, error: gpudirect::Error) -> EngineError {
        tracing::warn!(peer = %self.peer.name, posted, of = total, "transfer partly posted: {reason}");
        self.counted_post();
        self.core.fail(id, Failure::Partial { peer: self.peer.name.clone(), posted, total, reason });
        error.into()
    }

    /// Where the last post stands, reaping what completed.
    ///
    /// # Errors
    /// [`EngineError::PeerLost`] when it failed (the peer died, its memory
    /// went away); repeated until the request is posted again.
    pub fn status(&self) -> Result<TransferStatus, EngineError> {
        for &nic in &self.nics {
            self.core.progress_send(nic, None)?;
        }
        self.phase()
    }

    /// Where the last post stands as of the last reap (for those that
    /// follow many requests: one reap per NIC, then a look at each).
    pub(crate) fn phase(&self) -> Result<TransferStatus, EngineError> {
        match &*self.state.phase.lock() {
            Phase::Idle => Ok(TransferStatus::Idle),
            Phase::Posted => Ok(TransferStatus::InFlight),
            Phase::Done => Ok(TransferStatus::Done),
            Phase::Failed(f) => Err(f.to_error()),
        }
    }

    /// Waits until the last post finished, up to `timeout` (`None`: no
    /// limit; a dead peer still fails it within the queue pair's retry
    /// bound, about half a second with the default settings). A post not
    /// to be waited for any longer is given up with [`abort`](Self::abort).
    ///
    /// # Errors
    /// As [`status`](Self::status); [`EngineError::Timeout`].
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), EngineError> {
        self.core.wait(&self.state, &self.nics, timeout)
    }

    /// Gives up on the last post while it is in flight: the post fails
    /// with [`EngineError::Aborted`] (from this call on, for every waiter
    /// and [`status`](Self::status)), the queue pairs it used are moved to
    /// the error state and their connections retired; the next post of
    /// any request to the peer sets up new ones. What to do when a
    /// [`wait`](Self::wait) timed out and the request is not to be waited
    /// for any longer: RDMA cannot take back one work request, so the
    /// connection goes with it. Other posts outstanding on those
    /// connections fail with [`EngineError::PeerLost`] (their work
    /// requests complete flushed, `IBV_WC_WR_FLUSH_ERR`). Bytes the post
    /// moved before may or may not have landed; its notification, if it
    /// has one, never reaches the peer unless it was already on the wire
    /// (then after all the data, as always). After `true` the request may
    /// be posted again.
    ///
    /// Returns whether a post was in flight (`false`: it had finished or
    /// none was made, and its outcome stands).
    ///
    /// # Errors
    /// [`EngineError::Verbs`] when `ibv_modify_qp` refused to move a queue
    /// pair to the error state; the post is aborted and its connections
    /// retired all the same.
    pub fn abort(&self) -> Result<bool, EngineError> {
        self.core.abort(&self.state, &self.peer.name)
    }

    /// Whether the last post finished, never waiting (an idle request
    /// counts as finished). `false` arms the agent's
    /// [`Readiness`](crate::Readiness): it turns readable when the post may
    /// have finished; then [`Readiness::clear`](crate::Readiness::clear)
    /// and poll again. How an event loop other than tokio waits.
    ///
    /// # Errors
    /// As [`status`](Self::status); as
    /// [`Agent::readiness`](crate::Agent::readiness).
    pub fn poll_completed(&self) -> Result<bool, EngineError> {
        self.core.poll_completed(&self.state, &self.nics)
    }

    /// Until the last post finished, awaited (feature `tokio`): as
    /// [`wait`](Self::wait) without blocking a thread. Cancel-safe:
    /// dropping the future (`tokio::time::timeout`, `select!`) leaves the
    /// post as it is, to be awaited, waited for or polled again. The
    /// agent's completion channels are registered with the runtime of its
    /// first await ([`Agent::notification`](crate::Agent::notification)).
    ///
    /// ```no_run
    /// # async fn f(req: &gpudirect_engine::TransferRequest) -> Result<(), gpudirect_engine::EngineError> {
    /// req.post()?;
    /// req.completed().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`status`](Self::status); as
    /// [`Agent::notification`](crate::Agent::notification) for the runtime.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn completed(&self) -> Result<(), EngineError> {
        self.core.completed(&self.state, &self.nics).await
    }
}

/// The work requests of lane `lane`: every piece unsignaled but one in
/// each `every` (half the send queue, so a long list keeps the queue
/// draining), the last (the notification when it follows this lane's
/// writes) signaled. Their ids are set at each post.
fn requests<'a>(
    op: Op,
    entries: &'a [(LocalRange, RemoteRange)],
    lanes: &[Lane],
    notify: Option<&'a Notify>,
    lane: usize,
    every: usize,
) -> Result<Vec<SendWr<'a>>, EngineError> {
    let l = &lanes[lane];
    let mut wrs = Vec::with_capacity(l.pieces.len() + 1);
    let wr = |local: &'a LocalRange, remote: &'a RemoteRange, at: u64, len: u64| -> gpudirect::Result<SendWr<'a>> {
        let start = local.offset + at as usize;
        let slice = local.reg.inner.on_rail(l.nic).slice(start..start + len as usize)?;
        let rb = remote.mem.desc().on_nic(l.remote_nic).expect("prepare checked the key exists");
        match op {
            Op::Write => SendWr::write(slice, rb, remote.offset + at),
            Op::Read => SendWr::read(slice, rb, remote.offset + at),
        }
    };
    let signal = |i: usize, wr: SendWr<'a>| if i % every == every - 1 { wr } else { wr.unsignaled() };
    if l.whole {
        // The common case, one rail: the entries as they are.
        for (i, (local, remote)) in entries.iter().enumerate() {
            wrs.push(signal(i, wr(local, remote, 0, remote.len)?));
        }
    } else {
        for (i, &(entry, at, len)) in l.pieces.iter().enumerate() {
            let (local, remote) = &entries[entry];
            wrs.push(signal(i, wr(local, remote, at, len)?));
        }
    }
    if let Some(n) = notify.filter(|n| n.lane == lane && !n.after_completions) {
        wrs.push(SendWr::send(n.buf.slice()?).unsignaled());
    }
    let last = wrs.pop().expect("a lane has a piece");
    wrs.push(last.signaled());
    Ok(wrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sliced(lens: &[u64], rails: &[usize]) -> Vec<Lane> {
        let lanes = slice(lens.iter().copied(), &queue_pairs(rails, |_| 1), lens.iter().sum());
        // Every byte of every entry is in exactly one piece, in order.
        let mut next = vec![0u64; lens.len()];
        for l in &lanes {
            assert_eq!(l.bytes, l.pieces.iter().map(|p| p.2).sum::<u64>());
            for &(e, at, n) in &l.pieces {
                assert_eq!(at, next[e], "entry {e} is cut in order");
                next[e] += n;
            }
        }
        assert_eq!(next, lens);
        lanes
    }

    #[test]
    fn slices_are_even_and_cover_every_byte_once() {
        let lanes = sliced(&[65536; 16], &[0, 1]);
        assert_eq!(lanes.iter().map(|l| (l.nic, l.bytes, l.pieces.len())).collect::<Vec<_>>(), vec![(0, 1 << 19, 8), (1, 1 << 19, 8)]);
        // One entry, three rails: cut inside it.
        let lanes = sliced(&[1000], &[0, 2, 5]);
        assert_eq!(lanes.iter().map(|l| (l.nic, l.bytes)).collect::<Vec<_>>(), vec![(0, 334), (2, 334), (5, 332)]);
        // Uneven entries, and empty ones, which go with their neighbours.
        let lanes = sliced(&[10, 0, 300, 7, 0, 83], &[0, 1]);
        assert_eq!(lanes.iter().map(|l| l.bytes).collect::<Vec<_>>(), vec![200, 200]);
        assert_eq!(lanes[0].pieces, vec![(0, 0, 10), (1, 0, 0), (2, 0, 190)]);
        // Fewer bytes than rails: no empty lane.
        let lanes = sliced(&[1], &[0, 1, 2]);
        assert_eq!(lanes.len(), 1);
        assert_eq!(sliced(&[0, 0], &[0, 1]).len(), 1, "nothing to move still makes one lane");
    }

    #[test]
    fn queue_pairs_of_each_rail_take_even_slices() {
        let paths = queue_pairs(&[0, 1], |r| r + 2);
        assert_eq!(paths, vec![(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]);
        let lanes = slice([1000, 4000], &paths, 5000);
        assert_eq!(lanes.iter().map(|l| (l.nic, l.qp, l.bytes)).collect::<Vec<_>>(), vec![(0, 0, 1000), (0, 1, 1000), (1, 0, 1000), (1, 1, 1000), (1, 2, 1000)]);
        assert!(lanes.iter().all(|l| l.nic == l.remote_nic && !l.whole));
    }
}
