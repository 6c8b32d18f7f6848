//! What the NIC holds: each queue pair's outstanding work requests, in
//! posting order, with the memory each holds, until its completion is
//! matched ([`Tracker::complete`]). One home for in-flight tracking: queue
//! pairs enter requests as they post, completion queues release them as
//! they reap, and CPU copies look here (through [`HoldsNic`]) for
//! conflicting holds.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use crate::claims::{HoldsNic, Use};
use crate::error::{Error, Result};
use crate::mr::Hold;
use crate::sync::Mutex;
use crate::wc::WcOpcode;
use gpudirect_sys as sys;

use crate::wr::{RecvWr, Scratch};

/// Marks a receive-queue request's raw `wr_id`.
pub(crate) const RECV_BIT: u64 = 1 << 63;
const GEN_SHIFT: u32 = 40;
/// The request-number bits of a raw `wr_id`.
pub(crate) const SEQ_MASK: u64 = (1 << GEN_SHIFT) - 1;

/// The tag of the tracker a raw `wr_id` was posted through.
#[inline]
pub(crate) fn tag_of(raw: u64) -> u64 {
    raw & !RECV_BIT & !SEQ_MASK
}
static GENERATION: AtomicU32 = AtomicU32::new(1);

pub(crate) struct Pending {
    pub(crate) seq: u64,
    pub(crate) wr_id: u64,
    pub(crate) opcode: WcOpcode,
    /// Whether the request produces a completion of its own even when it
    /// succeeds (every receive does).
    pub(crate) signaled: bool,
    pub(crate) hold: Hold,
}

/// A completed work request, released by [`Tracker::complete`].
pub(crate) struct Done {
    pub(crate) wr_id: u64,
    /// The operation that was posted.
    pub(crate) opcode: WcOpcode,
    /// Whether the bytes the NIC wrote for it, and for the unsignaled RDMA
    /// reads completed with it, are where the program reads them (false
    /// when staging them into a host-staged GPU region failed; logged).
    pub(crate) landed: bool,
}

pub(crate) struct WorkQueue {
    pub(crate) depth: u32,
    pub(crate) next_seq: u64,
    pub(crate) pending: VecDeque<Pending>,
    pub(crate) scratch: Scratch,
}

impl WorkQueue {
    pub(crate) fn new(depth: u32) -> Self {
        WorkQueue { depth, next_seq: 0, pending: VecDeque::with_capacity(depth as usize), scratch: Scratch::default() }
    }

    /// Refuses a batch of `n` requests that would overfill the queue (named
    /// `queue` in the error), before anything of it is held or posted.
    #[inline]
    pub(crate) fn room_for(&self, n: usize, queue: &'static str) -> Result<()> {
        if self.pending.len() + n > self.depth as usize {
            return Err(Error::QueueFull { queue, depth: self.depth });
        }
        Ok(())
    }

    /// Enters one request of a batch with the hold its claim returned. A
    /// failed claim releases the holds of the whole batch (the entries
    /// after the first `kept`), so nothing of it stays held.
    #[inline(always)]
    pub(crate) fn enter(&mut self, kept: usize, hold: Result<Hold>, entry: impl FnOnce(Hold) -> Pending) -> Result<()> {
        match hold {
            Ok(hold) => {
                self.pending.push_back(entry(hold));
                Ok(())
            }
            Err(e) => {
                self.pending.truncate(kept);
                Err(e)
            }
        }
    }
}

pub(crate) struct Tracker {
    pub(crate) tag: u64,
    /// The protection domain's: whether any of its regions is host-staged,
    /// so that a completion may have bytes to stage in. Until one is,
    /// completing skips the landing pass over the entries it releases.
    stages_in: Arc<AtomicBool>,
    /// Bytes the library receives in front of each message on the receive
    /// queue (a UD queue pair's GRH), left out of the completion's length.
    pub(crate) recv_prefix: u32,
    pub(crate) send: Mutex<WorkQueue>,
    pub(crate) recv: Mutex<WorkQueue>,
}

impl Tracker {
    /// Releases the work request a completion's raw wr_id names, and on the
    /// send queue the unsignaled ones posted before it: they completed
    /// too, successfully, whatever this completion's status (an RC queue
    /// completes in order, and a request that fails always reports its own
    /// completion). A signaled request posted earlier and not yet reaped
    /// is left alone, so whichever completion arrives first, none is ever
    /// dropped. `None` for a completion of no request of this queue pair.
    ///
    /// Bytes the NIC wrote are staged into host-staged GPU regions here,
    /// `byte_len` of them for a receive (only if `ok`: the completion
    /// succeeded), while the holds are still listed under the queue's
    /// lock, so no CPU copy can touch them half-staged.
    pub(crate) fn complete(&self, raw: u64, ok: bool, byte_len: u32) -> Option<Done> {
        if tag_of(raw) != self.tag {
            return None;
        }
        let q = if raw & RECV_BIT != 0 { &self.recv } else { &self.send };
        let seq = raw & SEQ_MASK;
        let mut q = q.lock();
        // Requests sit in posting order with consecutive numbers unless a
        // completion was matched out of order: look there first.
        let front = q.pending.front()?.seq;
        let guess = (seq.wrapping_sub(front) & SEQ_MASK) as usize;
        let pos = match q.pending.get(guess) {
            Some(p) if p.seq == seq => guess,
            _ => q.pending.iter().position(|p| p.seq == seq)?,
        };
        // A signaled request before it has its own completion still to
        // come (only when completions are matched out of order).
        let signaled_before = q.pending.range(..pos).any(|p| p.signaled);
        // Relaxed suffices: the flag was set before the region existed, so
        // before the post, which this queue's lock orders before us.
        let lands = self.stages_in.load(Ordering::Relaxed);
        let mut landed = true;
        let mut land = |p: &Pending, written: usize| {
            if lands {
                landed &= p.hold.landed(written);
            }
        };
        let done = &q.pending[pos];
        if ok {
            let written = if done.opcode == WcOpcode::Recv { byte_len as usize } else { usize::MAX };
            land(done, written);
        }
        let (wr_id, opcode) = (done.wr_id, done.opcode);
        if pos == 0 {
            // The common case, one signaled request at the front: a pop
            // costs a fraction of a drain's setup and guard.
            q.pending.pop_front();
        } else if !signaled_before {
            // Landed in place, then dropped in place: no entry is moved.
            if lands {
                q.pending.range(..pos).for_each(|p| land(p, usize::MAX));
            }
            q.pending.drain(..=pos);
        } else {
            let mut released = 0;
            while released < pos && !q.pending[0].signaled {
                land(&q.pending.pop_front().expect("pos is within the queue"), usize::MAX);
                released += 1;
            }
            q.pending.remove(pos - released);
        }
        Some(Done { wr_id, opcode, landed })
    }

    #[cfg(test)]
    pub(crate) fn for_test(generation: u64) -> Tracker {
        let stages_in = Arc::default();
        Tracker { tag: generation << GEN_SHIFT, stages_in, recv_prefix: 0, send: Mutex::new(WorkQueue::new(8)), recv: Mutex::new(WorkQueue::new(8)) }
    }

    /// Forgets every pending request (after the queue pair is destroyed);
    /// says, for the send and receive queue, whether any was left.
    pub(crate) fn clear(&self) -> [bool; 2] {
        [&self.send, &self.recv].map(|q| {
            let mut q = q.lock();
            let left = !q.pending.is_empty();
            q.pending.clear();
            left
        })
    }
}

impl HoldsNic for Tracker {
    fn holds_conflicting(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
        [&self.send, &self.recv]
            .iter()
            .any(|q| q.lock().pending.iter().any(|p| p.hold.conflicts(region, start, end, use_)))
    }
}

impl Tracker {
    /// A tracker for a new queue pair, numbered apart from every earlier
    /// one (a stale completion of a destroyed queue pair whose number the
    /// provider reused names another generation).
    pub(crate) fn new(send_depth: u32, recv_depth: u32, stages_in: Arc<AtomicBool>) -> Tracker {
        let tag = u64::from(GENERATION.fetch_add(1, Ordering::Relaxed) & 0x7f_ffff) << GEN_SHIFT;
        Tracker { tag, stages_in, recv_prefix: 0, send: Mutex::new(WorkQueue::new(send_depth)), recv: Mutex::new(WorkQueue::new(recv_depth)) }
    }

    /// As made for a queue whose receives get `prefix` bytes first.
    pub(crate) fn with_recv_prefix(mut self, prefix: u32) -> Tracker {
        self.recv_prefix = prefix;
        self
    }
}

impl Tracker {
    /// Posts a checked batch of receives on this tracker's receive queue
    /// (a queue pair's or a shared receive queue's) through `post`, which
    /// rings `verb`: the room check, the holds on their memory and the post
    /// happen under the queue's lock. `gather` is the batch's SGEs in lists
    /// of several slices.
    ///
    /// `post` is handed a valid, NULL-terminated chain whose SGEs name
    /// registered memory held alive (and claimed) by the pending entries,
    /// and where to say which request it refused.
    pub(crate) fn post_recvs(
        &self,
        wrs: &[RecvWr<'_>],
        gather: usize,
        verb: &'static str,
        post: impl FnOnce(*mut sys::ibv_recv_wr, &mut *mut sys::ibv_recv_wr) -> i32,
    ) -> Result<()> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        let mut q = self.recv.lock();
        let q = &mut *q;
        q.room_for(n, "receive")?;
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        // Slots are rewritten in place: every field a provider reads of a
        // receive is set below.
        q.scratch.fit_recv(n, gather);
        let s = &mut q.scratch;
        let (chain, sges) = (s.recv.as_mut_ptr(), s.sges.as_mut_ptr());
        // SAFETY: fit_recv made the vector at least `gather` long, and
        // nothing else touches it until the post below.
        let mut free = unsafe { std::slice::from_raw_parts_mut(s.gather.as_mut_ptr(), gather) };
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            q.enter(kept, wr.local.claim(true), |hold| Pending { seq, wr_id: wr.wr_id, opcode: WcOpcode::Recv, signaled: true, hold })?;
            // SAFETY: fit_recv made room for `n` slots of each; `i < n`,
            // and `i + 1` is at most one past the end, never dereferenced
            // (the last request's link is set to NULL after the loop).
            let (raw, sg) = unsafe { (&mut *chain.add(i), &mut *sges.add(i)) };
            // SAFETY: as above.
            raw.next = unsafe { chain.add(i + 1) };
            raw.wr_id = RECV_BIT | self.tag | seq;
            (raw.sg_list, raw.num_sge) = wr.local.write_sges(sg, &mut free);
        }
        let chain = &mut q.scratch.recv[..n];
        chain[n - 1].next = std::ptr::null_mut();
        let mut bad = std::ptr::null_mut();
        let ret = post(chain.as_mut_ptr(), &mut bad);
        let posted = posted_count(ret, bad, chain);
        finish_post(q, n, posted, verb, ret)
    }
}

/// How many requests of a chain the provider accepted: all on success,
/// those before `bad` on failure (ibv_post_send(3)). A failure whose `bad`
/// is NULL or outside the chain says nothing of what was posted, so every
/// request counts as posted: its memory then stays held until a completion
/// or the queue pair's destruction releases it, where counting it as
/// refused could free memory the NIC is still using.
#[inline]
pub(crate) fn posted_count<W>(ret: i32, bad: *mut W, chain: &[W]) -> usize {
    if ret == 0 {
        return chain.len();
    }
    let base = chain.as_ptr() as usize;
    let b = bad as usize;
    let end = base + std::mem::size_of_val(chain);
    if bad.is_null() || b < base || b >= end {
        tracing::warn!(ret, "a post failed without naming the first refused work request; holding the memory of all {} as posted", chain.len());
        return chain.len();
    }
    (b - base) / std::mem::size_of::<W>()
}

/// Keeps the pending entries of posted requests and drops the holds of the
/// ones the provider refused.
#[inline]
pub(crate) fn finish_post(q: &mut WorkQueue, n: usize, posted: usize, verb: &'static str, ret: i32) -> Result<()> {
    for _ in posted..n {
        q.pending.pop_back();
    }
    q.next_seq = (q.next_seq + posted as u64) & SEQ_MASK;
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::returned(verb, ret))
    }
}

/// The tracker as the protection domain lists it.
pub(crate) fn holder(t: &Arc<Tracker>) -> Weak<dyn HoldsNic> {
    Arc::downgrade(t) as Weak<dyn HoldsNic>
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tracker(generation: u64) -> Tracker {
        Tracker::for_test(generation)
    }

    fn push(t: &Tracker, recv: bool, seq: u64, wr_id: u64, signaled: bool) {
        let q = if recv { &t.recv } else { &t.send };
        q.lock().pending.push_back(Pending { seq, wr_id, opcode: WcOpcode::Send, signaled, hold: Hold::None });
    }

    fn ids(t: &Tracker) -> Vec<u64> {
        t.send.lock().pending.iter().map(|p| p.wr_id).collect()
    }

    #[test]
    fn signaled_completion_releases_earlier_unsignaled() {
        let t = tracker(5);
        for s in 0..4 {
            push(&t, false, s, 100 + s, s == 2);
        }
        let d = t.complete((5 << GEN_SHIFT) | 2, true, 0).unwrap();
        assert_eq!((d.wr_id, d.opcode), (102, WcOpcode::Send));
        assert!(d.landed);
        assert_eq!(ids(&t), [103]);
    }

    /// Two pollers can take one queue pair's completions k and k+1 and
    /// match them in either order: a later completion must never release
    /// an earlier *signaled* request, whose own completion is still coming
    /// (it used to be drained as "earlier" and its completion dropped).
    #[test]
    fn a_later_completion_never_swallows_an_earlier_signaled_one() {
        let t = tracker(5);
        push(&t, false, 0, 10, false);
        push(&t, false, 1, 11, true); // completion k
        push(&t, false, 2, 12, false);
        push(&t, false, 3, 13, true); // completion k+1, matched first
        let late = t.complete((5 << GEN_SHIFT) | 3, true, 0).unwrap();
        assert_eq!(late.wr_id, 13);
        assert_eq!(ids(&t), [11, 12], "the unsignaled request before the signaled one went with it");
        let early = t.complete((5 << GEN_SHIFT) | 1, true, 0).unwrap();
        assert_eq!(early.wr_id, 11);
        assert_eq!(ids(&t), [12], "still complete; released by the next completion");
        push(&t, false, 4, 14, true);
        assert_eq!(t.complete((5 << GEN_SHIFT) | 4, true, 0).unwrap().wr_id, 14);
        assert!(ids(&t).is_empty());
    }

    #[test]
    fn queues_and_generations_are_kept_apart() {
        let t = tracker(5);
        push(&t, false, 0, 1, true);
        push(&t, true, 0, 2, true);
        assert_eq!(t.complete(RECV_BIT | (5 << GEN_SHIFT), true, 0).map(|c| c.wr_id), Some(2));
        // A stale completion from another generation releases nothing.
        assert!(t.complete(6 << GEN_SHIFT, true, 0).is_none());
        assert_eq!(t.send.lock().pending.len(), 1);
        // Unknown sequence numbers release nothing either.
        assert!(t.complete((5 << GEN_SHIFT) | 7, true, 0).is_none());
        assert_eq!(t.complete(5 << GEN_SHIFT, true, 0).map(|c| c.wr_id), Some(1));
        assert_eq!(t.clear(), [false, false]);
        push(&t, true, 1, 3, true);
        assert_eq!(t.clear(), [false, true]);
    }
}
