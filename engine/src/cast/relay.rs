//! The receiving side of broadcasts: each receiver takes a broadcast's
//! plan from its source (`Start`), keeps which chunks are in place in its
//! range, writes the chunks the source asks it to forward on to the other
//! receivers, and tells the source when its copy is whole (`Ack`) or when
//! it could not forward a chunk to a receiver (`Miss`). The application
//! sees one notification per broadcast, once its copy is whole.
//!
//! What a member holding the cluster's secret can make a receiver do is
//! what an honest source or receiver could, no more:
//! - a plan is taken only from the agent it names as its source, over
//!   that agent's own connection, and only if the receiver's part of it
//!   names memory this agent published (listed in metadata it made, so
//!   never host-staged GPU memory nor memory registered since) and lies
//!   inside it, and every other receiver's range lies inside the memory
//!   that receiver published, as loaded here (sums checked, so an offset
//!   near the integer limit is refused, never wrapped); every later
//!   message of the broadcast is read against that plan;
//! - a chunk counts only from the source or from the receiver that owns
//!   it in the plan, and only the source asks for forwards; a forward
//!   reads the chunk's bytes from the broadcast's own range here and
//!   writes them to the plan's receivers (whose metadata was loaded here,
//!   checked at the start);
//! - anything else is refused, counted by reason
//!   ([`Agent::broadcast_refusals`](crate::Agent::broadcast_refusals))
//!   and logged, never acted on.
//!
//! It runs in two places. A message is taken by whichever thread reaps it
//! (any wait or poll for notifications): that only updates state and
//! queues work, so a poll documented as never waiting never waits. The
//! work (forwards, answers to the source: posts that may set up a
//! connection first) is done by the relay's own thread, started on demand
//! and gone when idle; the requests it posted are followed at each later
//! reap.
//!
//! Bounds on what peers can make it hold: [`MAX_COPIES`] broadcasts in
//! progress ([`MAX_COPIES_PER_SOURCE`] from one source), at most
//! [`MAX_TRACKED_CHUNKS`] chunks among them; a start past a bound is
//! refused (the source names this receiver failed, with the reason),
//! after copies idle for [`STALE`] made room if they can. Forwards and
//! answers queued or in flight: [`MAX_SENT`].

use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpudirect::sync::Mutex;

use crate::wire::castmsg::{Msg, Plan};
use crate::transfers::core::{Core, Relay};
use crate::error::EngineError;
use crate::transfers::memory::LocalRange;
use crate::wire::notify::Notification;
use crate::transfers::stats::Refusal;
use crate::transfers::transfer::{self, Op, TransferRequest, TransferStatus};

/// Broadcasts one agent receives at once, from every source.
pub(crate) const MAX_COPIES: usize = 1024;
/// Broadcasts one agent receives at once from one source: a member that
/// starts broadcasts and never finishes them fills its own share only.
pub(crate) const MAX_COPIES_PER_SOURCE: usize = 512;
/// Chunks tracked at once over every copy (two bits each: 4 MiB).
pub(crate) const MAX_TRACKED_CHUNKS: u64 = 1 << 24;
/// A copy that saw no message for this long gives its room to a new
/// start that would otherwise be refused (its source went away).
pub(crate) const STALE: Duration = Duration::from_secs(30);
/// Finished broadcasts remembered, so a late duplicate chunk is ignored
/// quietly rather than counted as unknown.
const REMEMBERED: usize = 4096;
/// Forwards and answers queued or in flight here at once; a forward past
/// this is reported to the source as missed (which then writes it itself).
pub(crate) const MAX_SENT: usize = 4096;
/// How long the relay's thread waits for work before it ends.
const IDLE: Duration = Duration::from_secs(1);

/// One broadcast being received here.
struct Copy {
    id: u64,
    plan: Arc<Plan>,
    /// This agent's index among the receivers.
    me: usize,
    /// Where the copy lands here: the published registration the plan
    /// names, held for the copy's life.
    range: LocalRange,
    /// One bit per chunk in place.
    have: Vec<u64>,
    count: u64,
    /// Chunks this agent was asked to forward and did.
    forwarded: Vec<u64>,
    /// Receivers a forward to failed to be posted (no connection): later
    /// chunks for them go straight to the source as missed, so a dead
    /// receiver costs one failed setup per broadcast, not one per chunk.
    unreachable: Vec<bool>,
    last: Instant,
}

fn has(bits: &[u64], i: u64) -> bool {
    bits[(i / 64) as usize] & (1 << (i % 64)) != 0
}

fn set(bits: &mut [u64], i: u64) {
    bits[(i / 64) as usize] |= 1 << (i % 64);
}

/// Work for the relay's thread.
enum Job {
    /// Write chunk `index` of copy `id` from `range` to each receiver `to`.
    Forward { id: u64, index: u32, plan: Arc<Plan>, range: LocalRange, to: Vec<usize> },
    /// Send `msg` about broadcast `id` to agent `to`.
    Answer { to: String, id: u64, msg: Msg },
}

impl Job {
    /// Requests it will post.
    fn posts(&self) -> usize {
        match self {
            Job::Forward { to, .. } => to.len(),
            Job::Answer { .. } => 1,
        }
    }
}

/// A request this side posted: a forward of `index` to receiver
/// `target` of broadcast `id` from `source`, or an answer.
struct Sent {
    req: TransferRequest,
    source: String,
    id: u64,
    /// `Some((index, target))` for a forward.
    forward: Option<(u32, u8)>,
}

#[derive(Default)]
struct State {
    copies: Vec<Copy>,
    /// Chunks the copies track.
    tracked: u64,
    finished: VecDeque<u64>,
    finished_set: HashSet<u64>,
    jobs: VecDeque<Job>,
    /// Jobs that need a connection set up first: the relay's thread's.
    dial: VecDeque<Job>,
    /// Requests the queued jobs (both kinds) will post.
    queued: usize,
    sent: Vec<Sent>,
    /// The relay's thread, while it runs.
    worker: Option<std::thread::Thread>,
}

impl State {

    fn room(&self) -> usize {
        MAX_SENT.saturating_sub(self.queued + self.sent.len())
    }

    /// Queues `job` if there is room (an answer always has some: one per
    /// start, chunk asked for or forward failed, each bounded), for the
    /// next reaping thread or, with `dial`, for the relay's thread.
    fn queue(&mut self, job: Job, dial: bool) {
        if self.queued + self.sent.len() >= 2 * MAX_SENT {
            tracing::warn!("a broadcast message was not sent: {} requests queued or in flight here", 2 * MAX_SENT);
            return;
        }
        self.queued += job.posts();
        if dial {
            self.dial.push_back(job);
        } else {
            self.jobs.push_back(job);
        }
    }

    fn finish(&mut self, at: usize) {
        let done = self.copies.swap_remove(at);
        self.tracked -= done.plan.chunks();
        if self.finished.len() >= REMEMBERED {
            if let Some(old) = self.finished.pop_front() {
                self.finished_set.remove(&old);
            }
        }
        self.finished.push_back(done.id);
        self.finished_set.insert(done.id);
    }
}

/// The relay of one agent.
#[derive(Default)]
pub(crate) struct Relaying {
    state: Mutex<State>,
    /// Copies, jobs and requests in flight: none, and `progress` costs a load.
    busy: AtomicUsize,
}

impl Relaying {
    fn recount(&self, st: &State) {
        // Locked read-modify-writes, not plain loads and stores: the
        // valgrind build's helgrind and drd see only those (as `touch`).
        self.busy.swap(st.copies.len() + st.jobs.len() + st.dial.len() + st.sent.len(), Ordering::Relaxed);
    }

    /// Wakes the relay's thread, starting it if it is not running.
    fn kick(&self, core: &Core, st: &mut State) {
        if st.dial.is_empty() {
            return;
        }
        if let Some(t) = &st.worker {
            t.unpark();
            return;
        }
        let me = core.me.clone();
        let spawned = std::thread::Builder::new().name("gpudirect-relay".into()).spawn(move || loop {
            let did = match me.upgrade() {
                Some(core) => core.relay.get().is_some_and(|r| r.work(&core)),
                None => return,
            };
            if !did {
                std::thread::park_timeout(IDLE);
                match me.upgrade() {
                    Some(core) if !core.relay.get().is_none_or(|r| r.retire_worker()) => {}
                    _ => return,
                }
            }
        });
        match spawned {
            Ok(h) => st.worker = Some(h.thread().clone()),
            Err(e) => tracing::warn!("the broadcast relay's thread could not start: {e}"),
        }
    }

    /// Takes a broadcast's plan from `from`, or refuses it (counted, and
    /// told to `from`).
    fn start(&self, core: &Core, st: &mut State, from: &str, id: u64, me: usize, plan: Plan) {
        let refuse = |st: &mut State, why: Refusal, text: String| {
            core.cast_refusals.count(why);
            tracing::warn!(peer = from, id, "refused a broadcast: {text}");
            st.queue(Job::Answer { to: from.to_owned(), id, msg: Msg::Refuse { id, why: text } }, false);
        };
        if plan.source != from {
            return refuse(st, Refusal::Forged, format!("started by {from:?}, while its plan names {:?} as the source", plan.source));
        }
        let mine = &plan.targets[me];
        if mine.agent != *core.pool.name {
            return refuse(st, Refusal::Forged, format!("receiver {me} of the plan is {:?}, not this agent", mine.agent));
        }
        if st.finished_set.contains(&id) || st.copies.iter().any(|c| c.id == id) {
            return refuse(st, Refusal::Forged, format!("broadcast id {id:#x} is already in use here"));
        }
        let published = core.registry.published(&mine.memory);
        let range = match published {
            None => return refuse(st, Refusal::Unpublished, format!("{:?} names memory {:?}, which it did not publish", core.pool.name, mine.memory)),
            Some(reg) => match usize::try_from(mine.offset).ok().zip(usize::try_from(plan.len).ok()).and_then(|(o, l)| reg.range(o..o.checked_add(l)?).ok()) {
                Some(r) => r,
                None => {
                    return refuse(st, Refusal::Unpublished, format!("{} bytes at offset {} are past the end of {:?} ({} bytes) here", plan.len, mine.offset, mine.memory, reg.len()))
                }
            },
        };
        let others = plan.targets.iter().map(|t| &t.agent).filter(|a| **a != *core.pool.name).chain([&plan.source]);
        let missing: Vec<&str> = others.filter(|a| core.peer(a).is_err()).map(String::as_str).collect();
        if !missing.is_empty() {
            return refuse(
                st,
                Refusal::UnknownPeers,
                format!(
                    "{:?} has not loaded the metadata of {}: every receiver of a broadcast loads every other's and the source's (load_remote or lookup) before the source posts",
                    core.pool.name,
                    missing.join(", ")
                ),
            );
        }
        // A forward writes chunk bytes at each receiver's offset: every
        // receiver's range must lie inside what it published, as loaded
        // here (its end computed checked: a member's offset near the
        // integer limit must not wrap to another place in that memory).
        for (t, target) in plan.targets.iter().enumerate().filter(|&(t, _)| t != me) {
            let published = if target.agent == *core.pool.name {
                core.registry.published(&target.memory).map(|reg| reg.len() as u64)
            } else {
                core.peer(&target.agent).ok().and_then(|p| p.memory(&target.memory).ok()).map(|m| m.len())
            };
            let end = target.offset.checked_add(plan.len);
            if !matches!((published, end), (Some(len), Some(end)) if end <= len) {
                let held = published.map_or_else(|| "memory it did not publish".to_owned(), |len| format!("a {len}-byte memory"));
                return refuse(
                    st,
                    Refusal::Unpublished,
                    format!("receiver {t} of the plan, {:?}, is given {} bytes at offset {} of {:?}, {held}", target.agent, plan.len, target.offset, target.memory),
                );
            }
        }
        let chunks = plan.chunks();
        let full = |st: &State| {
            let theirs = st.copies.iter().filter(|c| c.plan.source == from).count();
            st.copies.len() >= MAX_COPIES || theirs >= MAX_COPIES_PER_SOURCE || st.tracked + chunks > MAX_TRACKED_CHUNKS
        };
        if full(st) {
            let now = Instant::now();
            while let Some(at) = st.copies.iter().position(|c| now.duration_since(c.last) >= STALE) {
                let c = &st.copies[at];
                tracing::warn!(source = %c.plan.source, id = c.id, "an incomplete broadcast idle for {STALE:?} is dropped to make room");
                st.finish(at);
            }
            if full(st) {
                return refuse(
                    st,
                    Refusal::Busy,
                    format!(
                        "{:?} has {} broadcasts in progress ({} from {from:?}, {} chunks): at most {MAX_COPIES}, {MAX_COPIES_PER_SOURCE} from one source, {MAX_TRACKED_CHUNKS} chunks",
                        core.pool.name,
                        st.copies.len(),
                        st.copies.iter().filter(|c| c.plan.source == from).count(),
                        st.tracked
                    ),
                );
            }
        }
        let words = chunks.div_ceil(64) as usize;
        let n = plan.targets.len();
        st.tracked += chunks;
        st.copies.push(Copy {
            id,
            plan: Arc::new(plan),
            me,
            range,
            have: vec![0; words],
            count: 0,
            forwarded: vec![0; words],
            unreachable: vec![false; n],
            last: Instant::now(),
        });
        st.queue(Job::Answer { to: from.to_owned(), id, msg: Msg::Ready { id } }, false);
    }

    /// Chunk `index` of broadcast `id` is in place, says `from`, asking
    /// with `forward` (the receivers to skip) to write it on; the
    /// notification if that made the copy whole.
    fn chunk(&self, core: &Core, st: &mut State, from: &str, id: u64, index: u32, forward: Option<u64>) -> Option<Notification> {
        let refuse = |why: Refusal, text: String| {
            core.cast_refusals.count(why);
            tracing::warn!(peer = from, id, chunk = index, "refused a broadcast chunk: {text}");
        };
        let Some(at) = st.copies.iter().position(|c| c.id == id) else {
            if !st.finished_set.contains(&id) {
                refuse(Refusal::Unknown, "no source started that broadcast here".into());
            }
            return None;
        };
        let room = st.room();
        let c = &mut st.copies[at];
        let i = u64::from(index);
        if i >= c.plan.chunks() {
            refuse(Refusal::NotOwner, format!("the plan has {} chunks", c.plan.chunks()));
            return None;
        }
        let from_source = from == c.plan.source;
        if !from_source && (forward.is_some() || c.plan.targets[c.plan.owner(i)].agent != from) {
            refuse(Refusal::NotOwner, format!("{from:?} is neither the source nor the owner of the chunk, {:?}", c.plan.targets[c.plan.owner(i)].agent));
            return None;
        }
        c.last = Instant::now();
        if !has(&c.have, i) {
            set(&mut c.have, i);
            c.count += 1;
        }
        let mut jobs = Vec::new();
        if let Some(skip) = forward.filter(|_| !has(&c.forwarded, i)) {
            set(&mut c.forwarded, i);
            let skipped = |t: usize| t < 64 && skip & (1 << t) != 0;
            let (mut to, mut missed) = (Vec::new(), Vec::new());
            for t in (0..c.plan.targets.len()).filter(|&t| t != c.me && !skipped(t)) {
                if c.unreachable[t] || to.len() >= room {
                    missed.push(t);
                } else {
                    to.push(t);
                }
            }
            if !to.is_empty() {
                jobs.push(Job::Forward { id, index, plan: c.plan.clone(), range: c.range.clone(), to });
            }
            if !missed.is_empty() {
                tracing::debug!(source = %c.plan.source, id, chunk = index, "broadcast chunk not forwarded to {} receivers (unreachable, or {MAX_SENT} requests here)", missed.len());
            }
            for t in missed {
                jobs.push(Job::Answer { to: c.plan.source.clone(), id, msg: Msg::Miss { id, index, target: t as u8 } });
            }
        }
        let mut note = None;
        if c.count == c.plan.chunks() {
            note = Some(Notification { peer: c.plan.source.clone(), msg: c.plan.msg.clone() });
            jobs.push(Job::Answer { to: c.plan.source.clone(), id, msg: Msg::Ack { id } });
            st.finish(at);
        }
        for j in jobs {
            st.queue(j, false);
        }
        note
    }

    /// Runs `job`: its requests, posted; with `dial` false (a reaping
    /// thread, which must not wait) only those whose connections are set
    /// up, the rest returned as a job for the relay's thread.
    fn run(&self, core: &Arc<Core>, job: Job, dial: bool, sent: &mut Vec<Sent>) -> Option<Job> {
        match job {
            Job::Answer { to, id, msg } => match answer(core, &to, &msg, dial) {
                Ok(Some(req)) => sent.push(Sent { req, source: to, id, forward: None }),
                Ok(None) => return Some(Job::Answer { to, id, msg }),
                Err(e) => tracing::warn!(peer = %to, id, "a broadcast message was not sent: {e}"),
            },
            Job::Forward { id, index, plan, range, to } => {
                let mut later = Vec::new();
                for t in to {
                    match forward(core, &plan, &range, id, index, t, dial) {
                        Ok(Some(req)) => sent.push(Sent { req, source: plan.source.clone(), id, forward: Some((index, t as u8)) }),
                        Ok(None) => later.push(t),
                        Err(e) => {
                            tracing::warn!(source = %plan.source, id, chunk = index, to = %plan.targets[t].agent, "broadcast chunk not forwarded: {e}");
                            if let Some(c) = self.state.lock().copies.iter_mut().find(|c| c.id == id) {
                                c.unreachable[t] = true;
                            }
                            let miss = Job::Answer { to: plan.source.clone(), id, msg: Msg::Miss { id, index, target: t as u8 } };
                            if let Some(job) = self.run(core, miss, dial, sent) {
                                self.state.lock().queue(job, true);
                            }
                        }
                    }
                }
                if !later.is_empty() {
                    return Some(Job::Forward { id, index, plan, range, to: later });
                }
            }
        }
        None
    }

    /// Runs on this (reaping) thread the queued jobs that need no
    /// connection set up; the rest go to the relay's thread.
    fn run_here(&self, core: &Core) {
        let jobs = {
            let mut st = self.state.lock();
            let jobs = std::mem::take(&mut st.jobs);
            st.queued -= jobs.iter().map(Job::posts).sum::<usize>();
            jobs
        };
        if jobs.is_empty() {
            return;
        }
        let Some(core) = core.me.upgrade() else { return };
        let mut sent = Vec::new();
        let later: Vec<Job> = jobs.into_iter().filter_map(|j| self.run(&core, j, false, &mut sent)).collect();
        let mut st = self.state.lock();
        st.sent.extend(sent);
        for j in later {
            st.queue(j, true);
        }
        self.kick(&core, &mut st);
        self.recount(&st);
    }
}

/// Sends `msg` to agent `to` (a loaded peer); the request, to follow
/// (`None`: not posted, it needs a connection set up and `dial` is false).
fn answer(core: &Arc<Core>, to: &str, msg: &Msg, dial: bool) -> Result<Option<TransferRequest>, EngineError> {
    let req = transfer::message(core, core.peer(to)?.md, msg.encode())?;
    posted(req, dial)
}

/// Writes chunk `index` of `plan` from this agent's copy `range` to
/// receiver `to`'s, followed by the chunk message that tells it (`None`
/// as for [`answer`]).
fn forward(core: &Arc<Core>, plan: &Plan, range: &LocalRange, id: u64, index: u32, to: usize, dial: bool) -> Result<Option<TransferRequest>, EngineError> {
    let (at, len) = plan.span(u64::from(index));
    let (at, len) = (at as usize, len as usize);
    // The start checked this copy's range (offset plus the plan's length
    // inside the registration) and every receiver's, so neither sum wraps;
    // the remote one is still computed checked, as a peer's numbers are.
    let local = range.reg.range(range.offset + at..range.offset + at + len)?;
    let theirs = &plan.targets[to];
    let remote = core.peer(&theirs.agent)?.memory(&theirs.memory)?.span(theirs.offset, at as u64, len as u64)?;
    let wire = Msg::Chunk { id, index, forward: false, skip: 0 }.encode();
    let req = transfer::prepare(core, Op::Write, &[(local, remote)], Some(wire))?;
    posted(req, dial)
}

/// Posts `req`: always with `dial`, else only over connections set up.
fn posted(req: TransferRequest, dial: bool) -> Result<Option<TransferRequest>, EngineError> {
    if dial {
        req.post()?;
        return Ok(Some(req));
    }
    Ok(req.post_connected()?.then_some(req))
}

impl Relay for Relaying {
    fn on_message(&self, core: &Core, from: &str, msg: Msg) -> Option<Notification> {
        let mut st = self.state.lock();
        let note = match msg {
            Msg::Start { id, me, plan } => {
                self.start(core, &mut st, from, id, me as usize, plan);
                None
            }
            Msg::Chunk { id, index, forward, skip } => self.chunk(core, &mut st, from, id, index, forward.then_some(skip)),
            // A probe asks nothing: its completion at the source is the answer.
            _ => None,
        };
        self.recount(&st);
        drop(st);
        self.run_here(core);
        note
    }

    fn busy(&self) -> bool {
        self.busy.fetch_add(0, Ordering::Relaxed) > 0
    }

    fn progress(&self, core: &Core) {
        if self.busy.fetch_add(0, Ordering::Relaxed) == 0 {
            return;
        }
        // One reap, then a look at each request (a status call each
        // would reap once per request).
        if let Err(e) = core.reap_sends(0..core.pool.nics.len()) {
            tracing::warn!("the broadcast relay could not reap: {e}");
        }
        let mut st = self.state.lock();
        let mut misses = Vec::new();
        st.sent.retain(|s| match s.req.phase() {
            Ok(TransferStatus::InFlight) => true,
            Ok(_) => false,
            Err(e) => {
                match s.forward {
                    Some((index, target)) => {
                        tracing::warn!(source = %s.source, id = s.id, chunk = index, target, "broadcast forward failed: {e}");
                        misses.push(Job::Answer { to: s.source.clone(), id: s.id, msg: Msg::Miss { id: s.id, index, target } });
                    }
                    None => tracing::warn!(peer = %s.source, id = s.id, "a broadcast message failed: {e}"),
                }
                false
            }
        });
        for m in misses {
            st.queue(m, false);
        }
        self.recount(&st);
        drop(st);
        self.run_here(core);
    }

    fn work(&self, core: &Arc<Core>) -> bool {
        let job = {
            let mut st = self.state.lock();
            let Some(job) = st.dial.pop_front() else { return false };
            st.queued -= job.posts();
            job
        };
        let mut sent = Vec::new();
        // Dialing allowed: every job runs to its end here.
        let _ = self.run(core, job, true, &mut sent);
        let mut st = self.state.lock();
        st.sent.extend(sent);
        self.recount(&st);
        true
    }

    fn retire_worker(&self) -> bool {
        let mut st = self.state.lock();
        if st.dial.is_empty() {
            st.worker = None;
            true
        } else {
            false
        }
    }
}

/// A fresh relay, shared as the agent's.
pub(crate) fn new() -> Box<dyn Relay> {
    Box::new(Relaying::default())
}
