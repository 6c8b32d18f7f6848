//! Broadcast: the same bytes from one range of this agent into a range
//! of each of N peers, with a notification at each receiver once its
//! copy is whole, the source's NIC sending each byte about once.
//!
//! How: the bytes are cut into chunks ([`AgentConfig::broadcast_chunk`](super::AgentConfig::broadcast_chunk));
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
//! - a receiver that died after its chunks reached it but before it
//!   forwarded them is found by a probe: once the source's own writes are
//!   done, every receiver not yet whole gets a message each
//!   [`PROBE_EVERY`]; a probe that fails names it dead.
//!
//! The broadcast is settled when every receiver is whole or dead and
//! nothing the source posted is in flight (so the source range may be
//! reused); then [`Broadcast::wait`] says which receivers, if any, did
//! not get the data ([`EngineError::BroadcastIncomplete`]).

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deadline::Deadline;
use crate::sync::Mutex;

use super::castmsg::{Msg, Plan, Target, MAX_BROADCAST_TARGETS, MAX_CHUNKS};
use super::core::{Core, Inbox};
use super::error::EngineError;
use super::memory::LocalRange;
use super::notify::SLOT;
use super::peer::RemoteRange;
use super::transfer::{self, Op, TransferRequest, TransferStatus};

/// How often the source probes receivers not yet whole once its own
/// writes are done.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);

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
    probed: Instant,
}

/// A prepared broadcast, from [`Agent::broadcast`](super::Agent::broadcast):
/// posted by [`post`](Self::post) (again for each new content of the
/// source range, once the last post settled), followed by
/// [`status`](Self::status), [`wait`](Self::wait) or, with the `tokio`
/// feature, `completed().await`.
///
/// Every receiver forwards chunks while any thread of its agent reaps its
/// notifications ([`Agent::wait_notification`](super::Agent::wait_notification),
/// [`Agent::notifications`](super::Agent::notifications), their async and
/// polling forms), as receivers do anyway to see their copy arrive; and
/// every agent of a broadcast must have loaded the metadata of every
/// other (the source and the receivers), since receivers write to each
/// other and answer the source.
pub struct Broadcast {
    core: Arc<Core>,
    local: LocalRange,
    remote: Vec<RemoteRange>,
    plan: Plan,
    run: Mutex<Option<Run>>,
}

impl std::fmt::Debug for Broadcast {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broadcast")
            .field("bytes", &self.plan.len)
            .field("chunk", &self.plan.chunk)
            .field("receivers", &self.plan.targets.iter().map(|t| &t.agent).collect::<Vec<_>>())
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
    let wire = Msg::Chunk { id: 0, index: 0, forward: true, me: 0, plan: plan.clone() }.encode().len();
    if wire > SLOT {
        return Err(EngineError::NotificationTooLong { len: wire, max: SLOT });
    }
    Ok(Broadcast { core: core.clone(), local: local.clone(), remote: remote.to_vec(), plan, run: Mutex::new(None) })
}

impl Broadcast {
    /// Bytes each receiver gets.
    pub fn bytes(&self) -> u64 {
        self.plan.len
    }

    /// The receivers, in the order given, and how each stands in the last
    /// post (all [`ReceiverStatus::Pending`] before the first).
    pub fn receivers(&self) -> Vec<(String, ReceiverStatus)> {
        let run = self.run.lock();
        self.plan
            .targets
            .iter()
            .enumerate()
            .map(|(i, t)| (t.agent.clone(), run.as_ref().map_or(ReceiverStatus::Pending, |r| r.receivers[i].clone())))
            .collect()
    }

    /// Posts it: the source's writes of every chunk to its owner, each
    /// with its forward request. A receiver that cannot be reached now
    /// fails alone (see [`receivers`](Self::receivers)).
    ///
    /// # Errors
    /// [`EngineError::InFlight`] while the last post has not settled.
    pub fn post(&self) -> Result<(), EngineError> {
        let mut slot = self.run.lock();
        if let Some(run) = slot.as_ref() {
            if !self.settled(run) {
                return Err(EngineError::InFlight);
            }
            self.core.sources.lock().remove(&run.id);
        }
        let id = u64::from_be_bytes(super::auth::random());
        let inbox = Arc::new(Inbox::default());
        self.core.sources.lock().insert(id, Arc::downgrade(&inbox));
        let n = self.plan.targets.len();
        let mut run = Run { id, inbox, receivers: vec![ReceiverStatus::Pending; n], flights: Vec::new(), repaired: HashSet::new(), probed: Instant::now() };
        let mut dead = Vec::new();
        for index in 0..self.plan.chunks() as u32 {
            let owner = self.plan.owner(u64::from(index));
            if run.receivers[owner] != ReceiverStatus::Pending {
                continue;
            }
            match self.write(id, index, owner, true) {
                Ok(req) => run.flights.push(Flight { req, target: owner, kind: Kind::Scatter(index) }),
                Err(e) => {
                    run.receivers[owner] = ReceiverStatus::Failed(e.to_string());
                    dead.push(owner);
                }
            }
        }
        for k in dead {
            self.mend(&mut run, k);
        }
        *slot = Some(run);
        Ok(())
    }

    /// Writes chunk `index` to receiver `to`, followed by its message.
    fn write(&self, id: u64, index: u32, to: usize, forward: bool) -> Result<TransferRequest, EngineError> {
        let (at, len) = self.plan.span(u64::from(index));
        let local = self.local.reg.range(self.local.offset + at as usize..self.local.offset + (at + len) as usize)?;
        let r = &self.remote[to];
        let remote = r.mem.range(r.offset + at..r.offset + at + len)?;
        let wire = Msg::Chunk { id, index, forward, me: to as u8, plan: self.plan.clone() }.encode();
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
        match self.write(run.id, index, to, false) {
            Ok(req) => run.flights.push(Flight { req, target: to, kind: Kind::Repair(index) }),
            Err(e) => self.fail(run, to, e.to_string()),
        }
    }

    fn fail(&self, run: &mut Run, to: usize, why: String) {
        if run.receivers[to] == ReceiverStatus::Pending {
            tracing::warn!(receiver = %self.plan.targets[to].agent, "broadcast receiver failed: {why}");
            run.receivers[to] = ReceiverStatus::Failed(why);
            self.mend(run, to);
        }
    }

    fn settled(&self, run: &Run) -> bool {
        run.flights.is_empty() && !run.receivers.contains(&ReceiverStatus::Pending)
    }

    /// One look: reaps, takes the receivers' answers, follows what the
    /// source posted, probes when due. Whether it settled.
    fn step(&self, run: &mut Run) -> Result<bool, EngineError> {
        self.core.reap_recvs()?;
        let answers = std::mem::take(&mut *run.inbox.lock());
        for (from, m) in answers {
            let Some(k) = self.plan.targets.iter().position(|t| t.agent == from) else { continue };
            match m {
                Msg::Ack { .. } if run.receivers[k] == ReceiverStatus::Pending => run.receivers[k] = ReceiverStatus::Whole,
                Msg::Miss { index, target, .. } if (target as usize) < run.receivers.len() && u64::from(index) < self.plan.chunks() => {
                    self.repair(run, index, target as usize);
                }
                _ => {}
            }
        }
        let mut failed = Vec::new();
        run.flights.retain(|f| match f.req.status() {
            Ok(TransferStatus::InFlight) => true,
            Ok(_) => false,
            Err(e) => {
                let what = match f.kind {
                    Kind::Scatter(c) | Kind::Repair(c) => format!("writing chunk {c}: {e}"),
                    Kind::Probe => format!("probed: {e}"),
                };
                failed.push((f.target, what));
                false
            }
        });
        for (to, why) in failed {
            self.fail(run, to, why);
        }
        let scattering = run.flights.iter().any(|f| matches!(f.kind, Kind::Scatter(_)));
        if !scattering && run.probed.elapsed() >= PROBE_EVERY {
            run.probed = Instant::now();
            for to in 0..run.receivers.len() {
                let probing = run.flights.iter().any(|f| f.target == to && matches!(f.kind, Kind::Probe));
                if run.receivers[to] != ReceiverStatus::Pending || probing {
                    continue;
                }
                let probe = transfer::message(&self.core, self.remote[to].mem.md.clone(), Msg::Probe { id: run.id }.encode());
                match probe.and_then(|req| req.post().map(|()| req)) {
                    Ok(req) => run.flights.push(Flight { req, target: to, kind: Kind::Probe }),
                    Err(e) => self.fail(run, to, format!("probed: {e}")),
                }
            }
        }
        Ok(self.settled(run))
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

    /// Where the last post stands, moving it on (never waiting): `Done`
    /// once every receiver is whole.
    ///
    /// # Errors
    /// [`EngineError::BroadcastIncomplete`] once settled with receivers
    /// that did not get the data (the others did); [`EngineError::Verbs`]
    /// from reaping.
    pub fn status(&self) -> Result<TransferStatus, EngineError> {
        let mut slot = self.run.lock();
        let Some(run) = slot.as_mut() else { return Ok(TransferStatus::Idle) };
        if !self.step(run)? {
            return Ok(TransferStatus::InFlight);
        }
        self.outcome(run).map(|()| TransferStatus::Done)
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
            // Answers arrive as receives: sleep on one NIC's in turn.
            turn = (turn + 1) % self.core.pool.nics.len();
            self.core.progress_recv(turn, Some(slice))?;
        }
    }

    /// Whether the last post settled, never waiting (an error if it
    /// settled with receivers that did not get the data). `false` arms
    /// the agent's [`Readiness`](super::Readiness), which turns readable
    /// on the next completion or receiver answer; call again within
    /// [`PROBE_EVERY`] even when it does not, since probes are due by
    /// time. How an event loop other than tokio waits.
    ///
    /// # Errors
    /// As [`status`](Self::status); as
    /// [`Agent::readiness`](super::Agent::readiness).
    pub fn poll_completed(&self) -> Result<bool, EngineError> {
        let ready = self.core.readiness()?;
        if self.status()? != TransferStatus::InFlight {
            return Ok(true);
        }
        for n in &self.core.pool.nics {
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
        self.core.until(|| Ok(self.status()? != TransferStatus::InFlight), Duration::from_millis(100)).await
    }
}

impl Drop for Broadcast {
    fn drop(&mut self) {
        if let Some(run) = self.run.lock().take() {
            self.core.sources.lock().remove(&run.id);
        }
    }
}
