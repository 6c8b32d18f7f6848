//! The receiving side of broadcasts: each receiver keeps which chunks of
//! a broadcast are in place in its range, writes the chunks the source
//! asks it to forward on to every other receiver, and tells the source
//! when its copy is whole (`Ack`) or when it could not forward a chunk to
//! a receiver (`Miss`). The application sees one notification per
//! broadcast, once its copy is whole.
//!
//! It runs inside the agent's progress: a chunk message is acted on by
//! whichever thread reaps it (any wait or poll for notifications), and
//! the forwards and answers it posted are followed at each later reap.
//! What a peer can make it hold is bounded: [`MAX_COPIES`] broadcasts in
//! progress, each of at most `castmsg::MAX_CHUNKS` chunks and
//! `MAX_BROADCAST_TARGETS` receivers.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::sync::Mutex;

use super::castmsg::{Msg, Plan};
use super::core::{Core, Relay};
use super::error::EngineError;
use super::notify::Notification;
use super::transfer::{self, Op, TransferRequest, TransferStatus};

/// Broadcasts one agent receives at once; a new one past this drops the
/// oldest (a broadcast whose source went away is never finished).
const MAX_COPIES: usize = 16;
/// Finished broadcasts remembered, so a late duplicate chunk is ignored.
const REMEMBERED: usize = 256;
/// Forwards and answers one agent follows at once; a forward past this is
/// reported to the source as missed (which then writes it itself).
const MAX_SENT: usize = 4096;

/// One broadcast being received here.
struct Copy {
    source: String,
    id: u64,
    plan: Plan,
    /// This agent's index among the receivers.
    me: usize,
    /// One bit per chunk in place.
    have: Vec<u64>,
    count: u64,
    /// Chunks this agent was asked to forward and did.
    forwarded: Vec<u64>,
    /// Receivers a forward to failed to be posted (no connection): later
    /// chunks for them go straight to the source as missed, so a dead
    /// receiver costs one failed setup per broadcast, not one per chunk.
    unreachable: Vec<bool>,
    whole: bool,
}

impl Copy {
    fn has(bits: &[u64], i: u64) -> bool {
        bits[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn set(bits: &mut [u64], i: u64) {
        bits[(i / 64) as usize] |= 1 << (i % 64);
    }
}

/// A request this side posted: a forward of `index` to receiver
/// `target` of broadcast (`source`, `id`), or an answer to the source.
struct Sent {
    req: TransferRequest,
    source: String,
    id: u64,
    /// `Some((index, target))` for a forward.
    forward: Option<(u32, u8)>,
}

#[derive(Default)]
struct State {
    copies: VecDeque<Copy>,
    finished: VecDeque<(String, u64)>,
    sent: Vec<Sent>,
}

/// The relay of one agent.
#[derive(Default)]
pub(crate) struct Relaying {
    state: Mutex<State>,
    /// Copies and requests in flight: none, and `progress` costs a load.
    busy: AtomicUsize,
}

impl Relaying {
    fn recount(&self, st: &State) {
        // Locked read-modify-writes, not plain loads and stores: the
        // valgrind build's helgrind and drd see only those (as `touch`).
        self.busy.swap(st.copies.len() + st.sent.len(), Ordering::Relaxed);
    }
}

/// Sends `msg` to the broadcast's source; the request, to follow.
fn answer(core: &Core, source: &str, msg: &Msg) -> Result<TransferRequest, EngineError> {
    let me = core.me.upgrade().ok_or_else(|| EngineError::Config("the agent is shutting down".into()))?;
    let req = transfer::message(&me, core.peer(source)?.md, msg.encode())?;
    req.post()?;
    Ok(req)
}

/// Writes chunk `index` of `plan` from this agent's range to receiver
/// `to`'s, followed by the chunk message that tells it.
fn forward(core: &Core, plan: &Plan, id: u64, index: u32, me: usize, to: usize) -> Result<TransferRequest, EngineError> {
    let core = core.me.upgrade().ok_or_else(|| EngineError::Config("the agent is shutting down".into()))?;
    let (at, len) = plan.span(u64::from(index));
    let mine = &plan.targets[me];
    let theirs = &plan.targets[to];
    let reg = core.registry.get(&mine.memory).ok_or_else(|| EngineError::UnknownMemory { peer: core.pool.name.to_string(), name: mine.memory.clone() })?;
    let local = reg.range((mine.offset + at) as usize..(mine.offset + at + len) as usize)?;
    let remote = core.peer(&theirs.agent)?.memory(&theirs.memory)?.range(theirs.offset + at..theirs.offset + at + len)?;
    let wire = Msg::Chunk { id, index, forward: false, me: to as u8, plan: plan.clone() }.encode();
    let req = transfer::prepare(&core, Op::Write, &[(local, remote)], Some(wire))?;
    req.post()?;
    Ok(req)
}

impl Relay for Relaying {
    fn on_message(&self, core: &Core, from: &str, msg: Msg) -> Option<Notification> {
        let Msg::Chunk { id, index, forward: asked, me, plan } = msg else { return None };
        let me = me as usize;
        if plan.targets[me].agent != *core.pool.name {
            tracing::warn!(peer = from, "dropped a broadcast chunk meant for receiver {:?}, not this agent", plan.targets[me].agent);
            return None;
        }
        let from_source = from == plan.source;
        if !from_source && !plan.targets.iter().any(|t| t.agent == from) {
            tracing::warn!(peer = from, source = %plan.source, "dropped a broadcast chunk from an agent neither its source nor a receiver");
            return None;
        }
        let mut st = self.state.lock();
        if st.finished.iter().any(|(s, i)| *s == plan.source && *i == id) {
            return None;
        }
        let at = match st.copies.iter().position(|c| c.source == plan.source && c.id == id) {
            Some(at) => at,
            None => {
                if st.copies.len() >= MAX_COPIES {
                    let old = st.copies.pop_front().expect("full");
                    tracing::warn!(source = %old.source, id = old.id, "a broadcast still incomplete is dropped: {MAX_COPIES} are in progress here");
                }
                let words = plan.chunks().div_ceil(64) as usize;
                st.copies.push_back(Copy {
                    source: plan.source.clone(),
                    id,
                    me,
                    have: vec![0; words],
                    count: 0,
                    forwarded: vec![0; words],
                    unreachable: vec![false; plan.targets.len()],
                    whole: false,
                    plan,
                });
                st.copies.len() - 1
            }
        };
        let i = u64::from(index);
        let room = MAX_SENT.saturating_sub(st.sent.len());
        let c = &mut st.copies[at];
        if !Copy::has(&c.have, i) {
            Copy::set(&mut c.have, i);
            c.count += 1;
        }
        let mut sent = Vec::new();
        // Only the source asks for forwards, once per chunk.
        if asked && from_source && !Copy::has(&c.forwarded, i) {
            Copy::set(&mut c.forwarded, i);
            for to in (0..c.plan.targets.len()).filter(|&t| t != c.me) {
                let source = c.source.clone();
                let tried = if c.unreachable[to] {
                    Err(EngineError::Refused { peer: c.plan.targets[to].agent.clone(), reason: "a forward to it failed before in this broadcast".into() })
                } else if sent.len() >= room {
                    Err(EngineError::Config(format!("{MAX_SENT} forwards in flight here")))
                } else {
                    forward(core, &c.plan, id, index, c.me, to)
                };
                match tried {
                    Ok(req) => sent.push(Sent { req, source, id, forward: Some((index, to as u8)) }),
                    Err(e) => {
                        if !c.unreachable[to] {
                            tracing::warn!(source = %c.source, id, chunk = index, to = %c.plan.targets[to].agent, "broadcast chunk not forwarded: {e}");
                        }
                        // Full here is not the receiver's fault.
                        c.unreachable[to] |= !matches!(e, EngineError::Config(_));
                        let miss = Msg::Miss { id, index, target: to as u8 };
                        if let Ok(req) = answer(core, &c.source, &miss) {
                            sent.push(Sent { req, source, id, forward: None });
                        }
                    }
                }
            }
        }
        let mut note = None;
        if c.count == c.plan.chunks() && !c.whole {
            c.whole = true;
            note = Some(Notification { peer: c.source.clone(), msg: c.plan.msg.clone() });
            match answer(core, &c.source, &Msg::Ack { id }) {
                Ok(req) => sent.push(Sent { req, source: c.source.clone(), id, forward: None }),
                Err(e) => tracing::warn!(source = %c.source, id, "broadcast copy whole, but the source was not told: {e}"),
            }
        }
        if c.whole {
            let done = st.copies.remove(at).expect("found above");
            if st.finished.len() >= REMEMBERED {
                st.finished.pop_front();
            }
            st.finished.push_back((done.source, done.id));
        }
        st.sent.extend(sent);
        self.recount(&st);
        note
    }

    fn busy(&self) -> bool {
        self.busy.fetch_add(0, Ordering::Relaxed) > 0
    }

    fn progress(&self, core: &Core) {
        if self.busy.fetch_add(0, Ordering::Relaxed) == 0 {
            return;
        }
        let mut st = self.state.lock();
        let mut misses = Vec::new();
        st.sent.retain(|s| match s.req.status() {
            Ok(TransferStatus::InFlight) => true,
            Ok(_) => false,
            Err(e) => {
                match s.forward {
                    Some((index, target)) => {
                        tracing::warn!(source = %s.source, id = s.id, chunk = index, target, "broadcast forward failed: {e}");
                        misses.push((s.source.clone(), s.id, index, target));
                    }
                    None => tracing::warn!(source = %s.source, id = s.id, "a message to a broadcast's source failed: {e}"),
                }
                false
            }
        });
        for (source, id, index, target) in misses {
            if let Ok(req) = answer(core, &source, &Msg::Miss { id, index, target }) {
                st.sent.push(Sent { req, source, id, forward: None });
            }
        }
        self.recount(&st);
    }
}

/// A fresh relay, shared as the agent's.
pub(crate) fn new() -> Box<dyn Relay> {
    Box::new(Relaying::default())
}
