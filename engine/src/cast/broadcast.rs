//! Broadcast: the same bytes from one range of this agent into a range
//! of each of N peers, with a notification at each receiver once its
//! copy is whole, the source's NIC sending each byte about once.
//!
//! How: the source first sends every receiver the plan (`Start`) and
//! waits for each to take it (`Ready`) or refuse it (`Refuse`: the memory
//! it names is not published there, the receiver has not loaded another
//! receiver's metadata, it is at its bound of broadcasts in progress); a
//! receiver that refused fails with its reason, and the others never
//! forward to it. Then the bytes are cut into chunks ([`AgentConfig::broadcast_chunk`](crate::AgentConfig::broadcast_chunk));
//! chunk `c` is written by the source to receiver `c mod N` only (its
//! owner), followed on the same queue pair by a message asking it to
//! forward; each owner, as each of its chunks lands, writes it on to
//! every other receiver, each write followed by its message (the relay,
//! `relay.rs`). The source's NIC carries the payload once; each
//! receiver's carries (N-1)/N of it; the chunks of all owners move at
//! once. Each receiver counts the chunks in place and, when it has all,
//! hands its application the notification and tells the source (`Ack`).
//!
//! Failures are the source's to mend, so that a receiver that dies fails
//! only itself:
//! - a write of the source's that fails names its receiver dead;
//! - a forward that fails is reported by its owner (`Miss`), and the
//!   source writes that chunk to that receiver itself, which names the
//!   receiver dead if it fails too;
//! - the chunks a dead receiver owned are written by the source to every
//!   receiver still waiting;
//! - a receiver that died before it took the plan, or after its chunks
//!   reached it but before it forwarded them, is found by a probe: while
//!   the source waits for receivers to take the plan, and once its own
//!   writes are done, every receiver it waits for gets a message each
//!   [`PROBE_EVERY`]; a probe that fails names it dead.
//!
//! The broadcast is settled when every receiver is whole or dead and
//! nothing the source posted is in flight (so the source range may be
//! reused); then [`Broadcast::wait`] says which receivers, if any, did
//! not get the data ([`EngineError::BroadcastIncomplete`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpudirect::deadline::Deadline;
use gpudirect::sync::Mutex;

use crate::wire::castmsg::{Msg, Plan, Target, MAX_BROADCAST_TARGETS, MAX_CHUNKS};
use crate::transfers::core::{Core, Inbox, Look, Posted};
use crate::error::EngineError;
use crate::transfers::memory::LocalRange;
use crate::wire::notify::SLOT;
use crate::peers::peer::RemoteRange;
use crate::transfers::transfer::{self, Op, TransferRequest, TransferStatus};

/// How often the source probes receivers not yet whole: while it waits
/// for them to take the plan, and once its own writes are done.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

/// Chunks one broadcast has in flight from the source at once: each is
/// one message at its owner and, forwarded, one at every other receiver,
/// so this bounds what a broadcast of thousands of chunks puts in each
/// receiver's receive queue at once (and the source's message slots).
const SCATTER_AHEAD: usize = 64;

/// How one receiver of a broadcast stands.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReceiverStatus {
    /// Not whole yet.
    Pending,
    /// Its copy is whole (and its notification handed to it).
    Whole,
    /// It did not get the data, and why (its queue pair failed, or it
    /// could not be written).
    Failed(String),
}

/// What the source posted and still follows.
enum Kind {
    /// The plan, to a receiver.
    Start,
    /// The first write of a chunk, to its owner.
    Scatter(u32),
    /// A chunk written by the source to a receiver whose forward failed.
    Repair(u32),
    Probe,
}

struct Flight {
    req: TransferRequest,
    target: usize,
    kind: Kind,
}

/// One post of a broadcast.
struct Run {
    id: u64,
    inbox: Arc<Inbox>,
    receivers: Vec<ReceiverStatus>,
    flights: Vec<Flight>,
    /// (chunk, receiver) the source wrote itself, each once.
    repaired: HashSet<(u32, usize)>,
    /// Receivers that took the plan.
    ready: Vec<bool>,
    /// Whether its turn came and the plan went out.
    started: bool,
    /// Whether the chunks go out (every receiver took the plan or failed).
    scattered: bool,
    /// The next chunk to write to its owner, and the receivers its
    /// owner skips.
    next: u32,
    skip: u64,
    probed: Instant,
}

/// A prepared broadcast, from [`Agent::broadcast`](crate::Agent::broadcast):
/// posted by [`post`](Self::post) (again for each new content of the
/// source range, once the last post settled), followed by
/// [`status`](Self::status), [`wait`](Self::wait) or, with the `tokio`
/// feature, `completed().await`.
///
/// Every receiver forwards chunks while any thread of its agent reaps its
/// notifications ([`Agent::wait_notification`](crate::Agent::wait_notification),
/// [`Agent::notifications`](crate::Agent::notifications), their async and
/// polling forms), as receivers do anyway to see their copy arrive; and
/// every agent of a broadcast must have loaded the metadata of every
/// other (the source and the receivers), since receivers write to each
/// other and answer the source: a receiver that has not refuses the
/// broadcast, naming the agents it lacks, and [`wait`](Self::wait) names
/// it among the receivers that did not get the data (the source never
/// writes their share for them in its place).
///
/// Posts wait their turn: an agent starts its broadcasts in post order,
/// as many at once as keep the messages each receiver may get in a burst
/// within half of [`AgentConfig::srq_depth`](crate::AgentConfig::srq_depth)
/// (one start and one message per chunk each; always at least one), and
/// the next when one settles. Any wait or poll of one of them moves all
/// of them on, so they settle in whatever order they are waited for.
pub struct Broadcast {
    cast: Arc<Cast>,
}

/// What a [`Broadcast`] is, shared with the agent's list of posted ones.
struct Cast {
    core: Arc<Core>,
    local: LocalRange,
    remote: Vec<RemoteRange>,
    plan: Plan,
    run: Mutex<Option<Run>>,
}

impl std::fmt::Debug for Broadcast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broadcast")
            .field("bytes", &self.cast.plan.len)
            .field("chunk", &self.cast.plan.chunk)
            .field("receivers", &self.cast.plan.targets.iter().map(|t| &t.agent).collect::<Vec<_>>())
            .finish()
    }
}

/// Checks a broadcast of `local` into `remote` and plans it.
pub(crate) fn prepare(core: &Arc<Core>, local: &LocalRange, remote: &[RemoteRange], notify: &[u8], chunk: u64) -> Result<Broadcast, EngineError> {
    if remote.is_empty() || local.len == 0 {
        return Err(EngineError::EmptyRequest);
    }
    if remote.len() > MAX_BROADCAST_TARGETS {
        return Err(EngineError::Config(format!("a broadcast to {} receivers: at most {MAX_BROADCAST_TARGETS}", remote.len())));
    }
    let len = local.len as u64;
    let mut targets = Vec::with_capacity(remote.len());
    for (index, r) in remote.iter().enumerate() {
        if r.len != len {
            return Err(EngineError::LengthMismatch { index, local: len, remote: r.len });
        }
        let agent = r.mem.md.name.clone();
        if agent == *core.pool.name || targets.iter().any(|t: &Target| t.agent == agent) {
            return Err(EngineError::Config(format!("receiver {index}, {agent:?}, is this agent or named twice: one range per receiver agent")));
        }
        targets.push(Target { agent, memory: r.mem.name().to_owned(), offset: r.offset });
    }
    if chunk == 0 || len.div_ceil(chunk) > MAX_CHUNKS {
        return Err(EngineError::Config(format!("{len} bytes in chunks of {chunk}: at most {MAX_CHUNKS} chunks")));
    }
    let plan = Plan { source: core.pool.name.to_string(), len, chunk, targets, msg: notify.to_vec() };
    let wire = Msg::Start { id: 0, me: 0, plan: plan.clone() }.encode().len();
    if wire > SLOT {
        return Err(EngineError::NotificationTooLong { len: wire, max: SLOT });
    }
    let cast = Cast { core: core.clone(), local: local.clone(), remote: remote.to_vec(), plan, run: Mutex::new(None) };
    Ok(Broadcast { cast: Arc::new(cast) })
}

/// Moves every posted broadcast of the agent of `core` on (one look,
/// never waiting) and starts the next ones waiting their turn when
/// their messages fit the budget.
fn drive(core: &Core) -> Result<(), EngineError> {
    core.reap_recvs()?;
    core.reap_sends(0..core.pool.nics.len())?;
    let (posted, listed) = {
        let list = core.posted.lock();
        (list.iter().filter_map(std::sync::Weak::upgrade).collect::<Vec<Arc<dyn Posted>>>(), list.len())
    };
    // Broadcasts dropped unsettled leave the list too.
    let dropped = posted.len() != listed;
    let budget = core.pool.nics.iter().map(|n| n.slots.len() / SLOT).min().unwrap_or(0) / 2;
    let (mut used, mut any) = (0, false);
    let mut settled = Vec::new();
    let mut waiting = Vec::new();
    for p in posted {
        match p.look() {
            Look::Settled => settled.push(p),
            Look::Started(cost) => (used, any) = (used + cost, true),
            Look::Waiting(cost) => waiting.push((p, cost)),
        }
    }
    for (p, cost) in waiting {
        if any && used + cost > budget {
            break;
        }
        p.start();
        (used, any) = (used + cost, true);
    }
    if !settled.is_empty() || dropped {
        core.posted.lock().retain(|w| w.strong_count() > 0 && !settled.iter().any(|s| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(s))));
    }
    Ok(())
}

impl Broadcast {
    /// The last post's id (tests that forge its messages).
    #[cfg(test)]
    pub(crate) fn id(&self) -> Option<u64> {
        self.cast.run.lock().as_ref().map(|r| r.id)
    }

    /// Bytes each receiver gets.
    pub fn bytes(&self) -> u64 {
        self.cast.plan.len
    }

    /// The receivers, in the order given, and how each stands in the last
    /// post (all [`ReceiverStatus::Pending`] before the first).
    pub fn receivers(&self) -> Vec<(String, ReceiverStatus)> {
        let run = self.cast.run.lock();
        self.cast
            .plan
            .targets
            .iter()
            .enumerate()
            .map(|(i, t)| (t.agent.clone(), run.as_ref().map_or(ReceiverStatus::Pending, |r| r.receivers[i].clone())))
            .collect()
    }

    /// Posts it: the plan to every receiver, then, once each took it,
    /// the source's writes of every chunk to its owner, each with its
    /// forward request (when its turn came: see above). A receiver that
    /// cannot be reached, or refuses, fails alone (see
    /// [`receivers`](Self::receivers)).
    ///
    /// # Errors
    /// [`EngineError::InFlight`] while the last post has not settled;
    /// [`EngineError::Verbs`] from reaping.
    pub fn post(&self) -> Result<(), EngineError> {
        let core = &self.cast.core;
        {
            let mut slot = self.cast.run.lock();
            if let Some(run) = slot.as_ref() {
                if !self.cast.settled(run) {
                    return Err(EngineError::InFlight);
                }
                core.sources.lock().remove(&run.id);
            }
            let id = u64::from_be_bytes(crate::wire::auth::random());
            let inbox = Arc::new(Inbox::default());
            core.sources.lock().insert(id, Arc::downgrade(&inbox));
            let n = self.cast.plan.targets.len();
            *slot = Some(Run {
                id,
                inbox,
                receivers: vec![ReceiverStatus::Pending; n],
                flights: Vec::new(),
                repaired: HashSet::new(),
                ready: vec![false; n],
                started: false,
                scattered: false,
                next: 0,
                skip: 0,
                probed: Instant::now(),
            });
        }
        let me: Arc<dyn Posted> = self.cast.clone();
        let mut posted = core.posted.lock();
        if !posted.iter().any(|w| std::ptr::addr_eq(w.as_ptr(), Arc::as_ptr(&me))) {
            posted.push(Arc::downgrade(&me));
        }
        drop(posted);
        drive(core)
    }
}

impl Posted for Cast {
    fn look(&self) -> Look {
        let mut slot = self.run.lock();
        let Some(run) = slot.as_mut() else { return Look::Settled };
        let cost = 1 + (self.plan.chunks() as usize).min(SCATTER_AHEAD);
        if !run.started {
            return Look::Waiting(cost);
        }
        if self.step(run) {
            Look::Settled
        } else {
            Look::Started(cost)
        }
    }

    fn start(&self) {
        let mut slot = self.run.lock();
        let Some(run) = slot.as_mut().filter(|r| !r.started) else { return };
        run.started = true;
        run.probed = Instant::now();
        // The plan first, to every receiver; the chunks once each took it
        // or failed (`step`), so no chunk message ever reaches a receiver
        // that does not hold the plan from the source itself.
        for (to, r) in self.remote.iter().enumerate() {
            let start = Msg::Start { id: run.id, me: to as u8, plan: self.plan.clone() }.encode();
            match transfer::message(&self.core, r.mem.md.clone(), start).and_then(|req| req.post().map(|()| req)) {
                Ok(req) => run.flights.push(Flight { req, target: to, kind: Kind::Start }),
                Err(e) => run.receivers[to] = ReceiverStatus::Failed(format!("the broadcast's start: {e}")),
            }
        }
        self.scatter(run);
    }
}

impl Cast {

    /// Once every receiver took the plan or failed: the failed owners'
    /// chunks to every receiver, and the others' chunks to their owners
    /// (`scatter_more`) with the request to forward them (to every
    /// receiver but those failed).
    fn scatter(&self, run: &mut Run) {
        let waiting = |k: usize| run.receivers[k] == ReceiverStatus::Pending && !run.ready[k];
        if run.scattered || (0..run.receivers.len()).any(waiting) {
            return;
        }
        run.scattered = true;
        let failed: Vec<usize> = (0..run.receivers.len()).filter(|&k| run.receivers[k] != ReceiverStatus::Pending).collect();
        run.skip = failed.iter().fold(0u64, |m, &k| m | 1 << k);
        for k in failed {
            self.mend(run, k);
        }
        self.scatter_more(run);
    }

    /// Writes the next chunks to their owners, up to [`SCATTER_AHEAD`] in
    /// flight (a failed owner's were mended instead).
    fn scatter_more(&self, run: &mut Run) {
        let chunks = self.plan.chunks() as u32;
        let mut ahead = run.flights.iter().filter(|f| matches!(f.kind, Kind::Scatter(_))).count();
        while run.scattered && run.next < chunks && ahead < SCATTER_AHEAD {
            let index = run.next;
            run.next += 1;
            let owner = self.plan.owner(u64::from(index));
            if run.receivers[owner] != ReceiverStatus::Pending {
                continue;
            }
            match self.write(run.id, index, owner, Some(run.skip)) {
                Ok(req) => {
                    run.flights.push(Flight { req, target: owner, kind: Kind::Scatter(index) });
                    ahead += 1;
                }
                Err(e) => self.fail(run, owner, e.to_string()),
            }
        }
    }

    /// Writes chunk `index` to receiver `to`, followed by its message:
    /// with `forward` (the mask of receivers to skip), asking it to write
    /// the chunk on to the others.
    fn write(&self, id: u64, index: u32, to: usize, forward: Option<u64>) -> Result<TransferRequest, EngineError> {
        let (at, len) = self.plan.span(u64::from(index));
        let local = self.local.reg.range(self.local.offset + at as usize..self.local.offset + (at + len) as usize)?;
        let r = &self.remote[to];
        let remote = r.mem.range(r.offset + at..r.offset + at + len)?;
        let wire = Msg::Chunk { id, index, forward: forward.is_some(), skip: forward.unwrap_or(0) }.encode();
        let req = transfer::prepare(&self.core, Op::Write, &[(local, remote)], Some(wire))?;
        req.post()?;
        Ok(req)
    }

    /// Receiver `dead` failed: the chunks it owned go from the source to
    /// every receiver still waiting.
    fn mend(&self, run: &mut Run, dead: usize) {
        let n = self.plan.targets.len();
        for index in (0..self.plan.chunks() as u32).filter(|&c| self.plan.owner(u64::from(c)) == dead) {
            for to in 0..n {
                self.repair(run, index, to);
            }
        }
    }

    /// Writes chunk `index` to receiver `to` from the source, once, if it
    /// is still waiting; a failure names it dead.
    fn repair(&self, run: &mut Run, index: u32, to: usize) {
        if run.receivers[to] != ReceiverStatus::Pending || !run.repaired.insert((index, to)) {
            return;
        }
        match self.write(run.id, index, to, None) {
            Ok(req) => run.flights.push(Flight { req, target: to, kind: Kind::Repair(index) }),
            Err(e) => self.fail(run, to, e.to_string()),
        }
    }

    /// Receiver `to` did not get the data; once the chunks went out, what
    /// it owned is mended (before, `scatter` does it).
    fn fail(&self, run: &mut Run, to: usize, why: String) {
        if run.receivers[to] == ReceiverStatus::Pending {
            tracing::warn!(receiver = %self.plan.targets[to].agent, "broadcast receiver failed: {why}");
            run.receivers[to] = ReceiverStatus::Failed(why);
            if run.scattered {
                self.mend(run, to);
            }
        }
    }

    fn settled(&self, run: &Run) -> bool {
        run.started && run.flights.is_empty() && !run.receivers.contains(&ReceiverStatus::Pending)
    }

    /// One look (after a reap): takes the receivers' answers, follows what
    /// the source posted, probes when due. Whether it settled.
    fn step(&self, run: &mut Run) -> bool {
        let answers = std::mem::take(&mut *run.inbox.lock());
        for (from, m) in answers {
            let Some(k) = self.plan.targets.iter().position(|t| t.agent == from) else { continue };
            let pending = run.receivers[k] == ReceiverStatus::Pending;
            match m {
                Msg::Ready { .. } if pending => run.ready[k] = true,
                Msg::Refuse { why, .. } if pending && !run.ready[k] => self.fail(run, k, format!("refused the broadcast: {why}")),
                Msg::Ack { .. } if pending && run.scattered => run.receivers[k] = ReceiverStatus::Whole,
                Msg::Miss { index, target, .. } if run.scattered && (target as usize) < run.receivers.len() && u64::from(index) < self.plan.chunks() => {
                    self.repair(run, index, target as usize);
                }
                _ => {}
            }
        }
        let mut failed = Vec::new();
        run.flights.retain(|f| match f.req.phase() {
            Ok(TransferStatus::InFlight) => true,
            Ok(_) => false,
            Err(e) => {
                let what = match f.kind {
                    Kind::Scatter(c) | Kind::Repair(c) => format!("writing chunk {c}: {e}"),
                    Kind::Probe => format!("probed: {e}"),
                    Kind::Start => format!("the broadcast's start: {e}"),
                };
                failed.push((f.target, what));
                false
            }
        });
        for (to, why) in failed {
            self.fail(run, to, why);
        }
        self.scatter(run);
        self.scatter_more(run);
        // Probes while receivers are to take the plan (one that died
        // then never answers) and once the source's own writes are done.
        let scattering = run.scattered && (run.next < self.plan.chunks() as u32 || run.flights.iter().any(|f| matches!(f.kind, Kind::Scatter(_))));
        if !scattering && run.probed.elapsed() >= PROBE_EVERY {
            run.probed = Instant::now();
            for to in 0..run.receivers.len() {
                let probing = run.flights.iter().any(|f| f.target == to && matches!(f.kind, Kind::Probe));
                if run.receivers[to] != ReceiverStatus::Pending || probing || (!run.scattered && run.ready[to]) {
                    continue;
                }
                let probe = transfer::message(&self.core, self.remote[to].mem.md.clone(), Msg::Probe { id: run.id }.encode());
                match probe.and_then(|req| req.post().map(|()| req)) {
                    Ok(req) => run.flights.push(Flight { req, target: to, kind: Kind::Probe }),
                    Err(e) => self.fail(run, to, format!("probed: {e}")),
                }
            }
        }
        self.settled(run)
    }

    /// The outcome of a settled post.
    fn outcome(&self, run: &Run) -> Result<(), EngineError> {
        let failed: Vec<(String, String)> = run
            .receivers
            .iter()
            .zip(&self.plan.targets)
            .filter_map(|(s, t)| match s {
                ReceiverStatus::Failed(why) => Some((t.agent.clone(), why.clone())),
                _ => None,
            })
            .collect();
        if failed.is_empty() {
            return Ok(());
        }
        Err(EngineError::BroadcastIncomplete { delivered: run.receivers.len() - failed.len(), total: run.receivers.len(), failed })
    }
}

impl Broadcast {

    /// Where the last post stands, moving it on (never waiting): `Done`
    /// once every receiver is whole.
    ///
    /// # Errors
    /// [`EngineError::BroadcastIncomplete`] once settled with receivers
    /// that did not get the data (the others did); [`EngineError::Verbs`]
    /// from reaping.
    pub fn status(&self) -> Result<TransferStatus, EngineError> {
        drive(&self.cast.core)?;
        let slot = self.cast.run.lock();
        let Some(run) = slot.as_ref() else { return Ok(TransferStatus::Idle) };
        if !self.cast.settled(run) {
            return Ok(TransferStatus::InFlight);
        }
        self.cast.outcome(run).map(|()| TransferStatus::Done)
    }

    /// Waits until the last post settled, up to `timeout` (`None`: no
    /// limit; a receiver that died is found within the queue pairs'
    /// retry bound after [`PROBE_EVERY`]).
    ///
    /// # Errors
    /// As [`status`](Self::status); [`EngineError::Timeout`] (then
    /// [`receivers`](Self::receivers) says which are still pending).
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), EngineError> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        let mut turn = 0;
        loop {
            match self.status()? {
                TransferStatus::InFlight => {}
                _ => return Ok(()),
            }
            let slice = match deadline.left() {
                Some(l) if l.is_zero() => return Err(EngineError::Timeout(timeout.unwrap_or_default())),
                Some(l) => l.min(Duration::from_millis(5)),
                None => Duration::from_millis(5),
            };
            // While the source has writes or messages out, their
            // completions are what moves it on (room for the next chunks):
            // it sleeps on its send queues, and answers that came
            // meanwhile are taken at the next look, which every completion
            // brings. With nothing out it waits for answers. Alternating
            // blindly slept a whole slice on answers that were not coming
            // while chunks waited for room (1 ms per 256-byte chunk).
            let core = &self.cast.core;
            let out = self.cast.run.lock().as_ref().is_some_and(|r| !r.flights.is_empty());
            turn = (turn + 1) % core.pool.nics.len();
            if out {
                core.progress_send(turn, Some(slice))?;
            } else {
                core.progress_recv(turn, Some(slice))?;
            }
        }
    }

    /// Whether the last post settled, never waiting (an error if it
    /// settled with receivers that did not get the data). `false` arms
    /// the agent's [`Readiness`](crate::Readiness), which turns readable
    /// on the next completion or receiver answer; call again within
    /// [`PROBE_EVERY`] even when it does not, since probes are due by
    /// time. How an event loop other than tokio waits.
    ///
    /// # Errors
    /// As [`status`](Self::status); as
    /// [`Agent::readiness`](crate::Agent::readiness).
    pub fn poll_completed(&self) -> Result<bool, EngineError> {
        let ready = self.cast.core.readiness()?;
        if self.status()? != TransferStatus::InFlight {
            return Ok(true);
        }
        for n in &self.cast.core.pool.nics {
            n.send_cq.req_notify()?;
            n.recv_cq.req_notify()?;
        }
        if self.status()? != TransferStatus::InFlight {
            return Ok(true);
        }
        // Armed: a completion or answer another thread reaps from here on
        // makes the descriptor readable; one reaped before, this look sees.
        ready.arm();
        Ok(self.status()? != TransferStatus::InFlight)
    }

    /// Until the last post settled, awaited (feature `tokio`): as
    /// [`wait`](Self::wait) without blocking a thread; cancel-safe.
    ///
    /// # Errors
    /// As [`status`](Self::status).
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn completed(&self) -> Result<(), EngineError> {
        self.cast.core.until(|| Ok(self.status()? != TransferStatus::InFlight), Duration::from_millis(100)).await
    }
}

impl Drop for Broadcast {
    fn drop(&mut self) {
        if let Some(run) = self.cast.run.lock().take() {
            self.cast.core.sources.lock().remove(&run.id);
        }
    }
}
