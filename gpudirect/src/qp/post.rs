//! Posting work requests on a queue pair (`ibv_post_send`,
//! `ibv_post_recv`): the checks, the holds on local memory, host staging,
//! and the doorbell, under one lock per queue.

use std::time::Duration;

use gpudirect_sys as sys;

use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::wc::WorkCompletion;
use crate::mr::{Hold, LocalSlice, SgList};
use crate::tracker::{finish_post, posted_count, Pending, WorkQueue, SEQ_MASK};
use crate::wr::{RecvWr, SendList, SendOp, SendTemplate, SendWr};

use super::QpInner;

// ---------------------------------------------------------------------------
// In-flight tracking.
//
// The wr_id handed to the NIC is the library's own: bit 63 says which queue
// (send or receive, since failed completions leave the opcode undefined),
// bits 40..63 a per-queue-pair generation (so a stale completion of a
// destroyed queue pair never releases work of a new one with the same
// number), bits 0..40 a sequence number. Completions arrive in posting order
// on each queue of an RC queue pair, so releasing is popping from the front.

/// Writes from host-staged GPU regions longer than this are posted in
/// chunks of this size, so GPU-to-host copies overlap the NIC's transfer.
const STAGE_CHUNK: usize = 1 << 20;

fn splits_for_staging(w: &SendWr<'_>) -> bool {
    matches!(w.op, SendOp::Write | SendOp::WriteWithImm(_))
        && w.local.one().is_some_and(|s| s.len > STAGE_CHUNK && s.mr.is_host_staged())
}

/// The longest prepared list posted through the extended API; longer ones
/// repost their written chain with `ibv_post_send`. Measured on Soft-RoCE
/// (docs/performance.md): for one request the extended API costs 34
/// instructions less per message, for a list of 16 it costs 8 more (the
/// chain is already written, and one `ibv_post_send` call is shared by
/// all); the two meet near four.
const EX_LIST_MAX: usize = 4;

/// What posting a checked batch of send requests needs to know.
struct Checked {
    /// Whether a request's source must be staged first.
    staged: bool,
    /// The SGEs of the requests with several slices, together.
    gather: usize,
}

impl QpInner {
    /// [`QueuePair::post_send`](super::QueuePair::post_send).
    #[inline]
    pub(super) fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let inner = self;
        let checked = inner.check_send(wrs)?;
        if checked.staged {
            return inner.post_send_staged(wrs);
        }
        let mut q = inner.core.tracker.send.lock();
        inner.post_send_locked(&mut q, wrs, checked.gather, ClaimLocal)
    }

    /// [`QueuePair::post_aimed`](super::QueuePair::post_aimed): one request
    /// of one slice, not inline, not atomic, not a read, so what is left of
    /// `check_send` is the slice's domain and length. The common case (an
    /// extended queue pair, bytes the NIC reads where they are) is built
    /// straight from the template: held, entered and posted as
    /// [`post_ex`](Self::post_ex) does one request, without a [`SendWr`]
    /// or the loop over a batch (docs/performance.md: the plugin's send).
    #[inline]
    pub(super) fn post_aimed(&self, t: &SendTemplate, local: LocalSlice<'_>, remote_addr: u64, rkey: u32, imm: u32, wr_id: u64) -> Result<()> {
        let Some(qpx) = self.qpx.filter(|_| !local.is_empty() && !local.mr.is_host_staged()) else {
            return self.post_aimed_wr(t.aim(local, remote_addr, rkey, imm, wr_id));
        };
        let list = SgList::from(local);
        list.check(&self.core.pd)?;
        let mut q = self.core.tracker.send.lock();
        q.room_for(1, "send")?;
        // The NIC reads it: held as ClaimLocal holds a request's memory.
        let hold = list.claim(false)?;
        let seq = q.next_seq;
        q.pending.push_back(Pending { seq, wr_id, opcode: t.wc_opcode(), signaled: t.signaled(), hold });
        let qpx = qpx.as_ptr();
        // SAFETY: this queue pair's extended view, its send queue locked
        // (`q`) from start to complete; the template's opcodes are among
        // those every extended queue pair is created with; the slice is
        // of this domain, at most u32::MAX bytes (checked), not empty, and
        // held by the entry just made until its completion is reaped.
        let ret = unsafe {
            sys::ibv_wr_start(qpx);
            t.write_ex(qpx, self.core.tracker.tag | seq, local.sge(), remote_addr, rkey, imm);
            sys::ibv_wr_complete(qpx)
        };
        finish_post(&mut q, 1, usize::from(ret == 0), "ibv_wr_complete", ret)
    }

    /// `post_aimed` without an extended queue pair, or of a slice that is
    /// empty or host-staged: the request made, and posted as `post_send`
    /// posts one.
    #[cold]
    fn post_aimed_wr(&self, wr: SendWr<'_>) -> Result<()> {
        wr.local.check(&self.core.pd)?;
        if wr.stages_out() {
            return self.post_send_staged(std::slice::from_ref(&wr));
        }
        let mut q = self.core.tracker.send.lock();
        self.post_send_locked(&mut q, std::slice::from_ref(&wr), 0, ClaimLocal)
    }

    /// [`QueuePair::post_list`](super::QueuePair::post_list).
    pub(super) fn post_list(&self, list: &mut SendList<'_>) -> Result<()> {
        let inner = self;
        if list.is_empty() {
            return Ok(());
        }
        // A list that names no memory (notifications only) has no domain.
        if list.pd().is_some_and(|pd| !pd.same_as(&inner.core.pd)) {
            return Err(Error::ForeignMemoryRegion);
        }
        if list.longest_inline() > 0 {
            inner.check_inline_len(list.longest_inline())?;
        }
        if list.has_atomics() {
            inner.check_atomics()?;
        }
        let (most, most_read) = list.most_sges();
        if most > 1 {
            inner.check_sges(most, false)?;
            inner.check_sges(most_read, true)?;
        }
        if list.stages() {
            return inner.post_send_staged(list.requests());
        }
        let mut q = inner.core.tracker.send.lock();
        inner.post_list_locked(&mut q, list)
    }

    pub(super) fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        if self.srq.is_some() {
            return Err(Error::InvalidArgument(
                "this queue pair takes its receives from a shared receive queue: post them there (SharedReceiveQueue::post_recv)".into(),
            ));
        }
        let gather = RecvWr::check_batch(wrs, &self.core.pd, self.max_sge[1], "QpConfig::max_recv_sge")?;
        let qp = self.core.qp.as_ptr();
        // SAFETY: `qp` is this queue pair's, valid while `self` is.
        self.core.tracker.post_recvs(wrs, gather, "ibv_post_recv", |chain, bad| unsafe { sys::ibv_post_recv(qp, chain, bad) })
    }

    /// Whether the extended view may post `wrs`: it was created with the
    /// window opcodes, or no request is a window's.
    #[inline]
    fn ex_windows_or_none(&self, wrs: &[SendWr<'_>]) -> bool {
        self.ex_windows || !wrs.iter().any(|w| w.op.is_window())
    }

    /// Checks what can be checked of a batch before the queue is locked.
    fn check_send(&self, wrs: &[SendWr<'_>]) -> Result<Checked> {
        let mut c = Checked { staged: false, gather: 0 };
        for wr in wrs {
            wr.check(&self.core.pd)?;
            c.staged |= wr.stages_out();
            if wr.inline {
                self.check_inline_len(wr.local.len())?;
            }
            if wr.op.is_atomic() {
                self.check_atomics()?;
            }
            let g = wr.local.gather_sges();
            if g > 0 {
                self.check_sges(g, wr.op == SendOp::Read)?;
                c.gather += g;
            }
        }
        Ok(c)
    }

    /// Refuses a send-queue request of `n` SGEs that the queue pair or,
    /// for an RDMA read, the device does not allow, before the provider
    /// would (with a bare `EINVAL`, or not at all).
    #[cold]
    fn check_sges(&self, n: usize, read: bool) -> Result<()> {
        let max = self.max_sge[0] as usize;
        if n > max {
            return Err(Error::InvalidArgument(format!(
                "a work request of {n} scatter/gather entries: the queue pair allows {max} (QpConfig::max_send_sge)"
            )));
        }
        let ctx = self.core.pd.context();
        let rd = ctx.attr().max_sge_rd as usize;
        if read && n > rd {
            return Err(Error::InvalidArgument(format!(
                "an RDMA read of {n} scatter/gather entries: {} allows {rd} (ibv_query_device max_sge_rd)",
                ctx.name()
            )));
        }
        Ok(())
    }

    #[cold]
    fn check_atomics(&self) -> Result<()> {
        let ctx = self.core.pd.context();
        if ctx.attr().atomics {
            return Ok(());
        }
        Err(Error::InvalidArgument(format!(
            "{} does not do atomic operations (ibv_query_device: atomic_cap IBV_ATOMIC_NONE; mlx5 says so when its \
             firmware does not use host byte order for them)",
            ctx.name()
        )))
    }

    #[inline]
    fn check_inline_len(&self, len: usize) -> Result<()> {
        if len > self.core.max_inline as usize {
            return Err(Error::InvalidArgument(format!(
                "an inline payload of {len} bytes: the queue pair allows inline writes and sends of at most {} bytes (QpConfig::max_inline_data)",
                self.core.max_inline
            )));
        }
        Ok(())
    }

    /// Posts a checked batch with the send queue locked: the room check,
    /// the holds on local memory (and the staging of host-staged sources
    /// they do) and the post happen as one step. One pass per request:
    /// each is held, entered and written into its (reused) chain slot.
    fn post_send_locked(
        &self,
        q: &mut WorkQueue,
        wrs: &[SendWr<'_>],
        gather: usize,
        mut claim: impl Claim,
    ) -> Result<()> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        q.room_for(n, "send")?;
        // `gather` is 0 when no request is a list of several slices.
        if let Some(qpx) = self.qpx.filter(|_| gather == 0 && self.ex_windows_or_none(wrs)) {
            // SAFETY: the extended view of this queue pair, whose send
            // queue `q` is locked; no request is a list of several.
            return unsafe { self.post_ex(q, qpx.as_ptr(), wrs, claim) };
        }
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        let s = &mut q.scratch;
        // Slots are rewritten in place, field by field: every field a
        // provider reads for an RC send, write or read is set below, and
        // the rest stay zero from the resize.
        s.fit_send(n, gather);
        let (chain, sges) = (s.send.as_mut_ptr(), s.sges.as_mut_ptr());
        // SAFETY: fit_send made the vector at least `gather` long, and
        // nothing else touches it until the post.
        let mut free = unsafe { std::slice::from_raw_parts_mut(s.gather.as_mut_ptr(), gather) };
        let (mut any_inline, mut any_window) = (false, false);
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            // Inline payloads are copied during the post, by the CPU: that
            // copy is a read like any send's, so it is held the same way.
            q.enter(kept, claim.claim(wr), |hold| Pending { seq, wr_id: wr.wr_id, opcode: wr.op.wc_opcode(), signaled: wr.signaled, hold })?;
            // SAFETY: fit_send made room for `n` slots of each; `i < n`,
            // and `i + 1` is at most one past the end, never dereferenced
            // (the last request's link is set to NULL after the loop).
            let (raw, sg) = unsafe { (&mut *chain.add(i), &mut *sges.add(i)) };
            // SAFETY: as above.
            raw.next = unsafe { chain.add(i + 1) };
            raw.wr_id = self.core.tracker.tag | seq;
            wr.write_raw(raw, sg, &mut free);
            any_inline |= wr.inline;
            any_window |= wr.window.is_some();
        }
        let s = &mut q.scratch;
        s.send[n - 1].next = std::ptr::null_mut();
        let chain = s.send.as_mut_ptr();
        // SAFETY: `chain` is a valid, NULL-terminated chain of `n` requests
        // whose SGEs name registered memory held alive (and claimed) by the
        // pending entries; remote addresses were bounds-checked against the
        // peer's buffer.
        let posted = unsafe { self.post_chain(q, chain, wrs, kept, any_inline) };
        if posted.is_ok() && any_window {
            note_binds(wrs);
        }
        posted
    }

    /// Posts a prepared list with the send queue locked: as
    /// [`post_send_locked`](Self::post_send_locked), but the requests were
    /// checked and written when the list was made, so each is only held,
    /// entered and numbered.
    fn post_list_locked(&self, q: &mut WorkQueue, list: &mut SendList<'_>) -> Result<()> {
        let gathers_none = list.gathers_none();
        let (wrs, chain) = list.parts();
        let n = wrs.len();
        q.room_for(n, "send")?;
        if let Some(qpx) = self.qpx.filter(|_| n <= EX_LIST_MAX && gathers_none) {
            // SAFETY: as in post_send_locked; the list's requests were
            // checked when it was made.
            return unsafe { self.post_ex(q, qpx.as_ptr(), wrs, ClaimLocal) };
        }
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        let mut any_inline = false;
        for (i, (wr, raw)) in wrs.iter().zip(chain.iter_mut()).enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            let hold = wr.local.claim(wr.op.nic_writes_local());
            q.enter(kept, hold, |hold| Pending { seq, wr_id: wr.wr_id, opcode: wr.op.wc_opcode(), signaled: wr.signaled, hold })?;
            raw.wr_id = self.core.tracker.tag | seq;
            any_inline |= wr.inline;
        }
        // SAFETY: the list's chain is NULL-terminated, of `n` requests
        // written from `wrs` (SendList::new) whose SGEs name registered
        // memory the list borrows and the pending entries now hold.
        unsafe { self.post_chain(q, chain.as_mut_ptr(), wrs, kept, any_inline) }
    }

    /// Posts a checked batch through the extended API (only batches with
    /// no list of several slices: Soft-RoCE's `ibv_wr_set_sge_list`,
    /// rdma-core 44, miscounts a list's length, a 1600-byte send gathered
    /// from three slices arriving as 300 bytes; tests/posting.rs): each request is
    /// held, entered and built (`ibv_wr_*`) in one pass between
    /// `ibv_wr_start` and `ibv_wr_complete`, which posts all of them or,
    /// failing, none (ibv_wr_post(3): nothing is executed until it
    /// succeeds), so a failure releases every request of the batch.
    ///
    /// # Safety
    /// `qpx` is this queue pair's extended view, `q` its locked send queue
    /// with room for `wrs`; no request is a list of several slices, and
    /// every one passed the checks of `post_send`.
    // Inlined into each caller, so that its `claim` is inlined into the
    // loop (measured: a call per request otherwise, ~20 instructions).
    #[inline(always)]
    unsafe fn post_ex(
        &self,
        q: &mut WorkQueue,
        qpx: *mut sys::ibv_qp_ex,
        wrs: &[SendWr<'_>],
        mut claim: impl Claim,
    ) -> Result<()> {
        let n = wrs.len();
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        // SAFETY: the caller's contract: a live extended QP, its queue locked.
        unsafe { sys::ibv_wr_start(qpx) };
        let mut any_inline = false;
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            let entered =
                q.enter(kept, claim.claim(wr), |hold| Pending { seq, wr_id: wr.wr_id, opcode: wr.op.wc_opcode(), signaled: wr.signaled, hold });
            if let Err(e) = entered {
                // SAFETY: inside this thread's ibv_wr_start.
                unsafe { sys::ibv_wr_abort(qpx) };
                return Err(e);
            }
            // SAFETY: the caller's contract; the entry just made holds the
            // request's memory.
            unsafe { wr.write_ex(qpx, self.core.tracker.tag | seq) };
            any_inline |= wr.inline;
        }
        // SAFETY: ends this thread's ibv_wr_start section.
        let ret = unsafe { sys::ibv_wr_complete(qpx) };
        let r = finish_post(q, n, if ret == 0 { n } else { 0 }, "ibv_wr_complete", ret);
        if ret == 0 && any_inline {
            release_inline(q, wrs, kept);
        }
        r
    }

    /// Posts a chain written from `wrs`, whose pending entries follow the
    /// first `kept`, and keeps the entries of the requests the provider
    /// accepted.
    ///
    /// # Safety
    /// `chain` is a valid, NULL-terminated chain of `wrs.len()` requests
    /// (contiguous, as `posted_count` reads it) that name only registered
    /// memory the entries after `kept` hold.
    #[inline]
    unsafe fn post_chain(
        &self,
        q: &mut WorkQueue,
        chain: *mut sys::ibv_send_wr,
        wrs: &[SendWr<'_>],
        kept: usize,
        any_inline: bool,
    ) -> Result<()> {
        let n = wrs.len();
        let mut bad = std::ptr::null_mut();
        // SAFETY: the caller's contract.
        let ret = unsafe { sys::ibv_post_send(self.core.qp.as_ptr(), chain, &mut bad) };
        // SAFETY: the chain is `n` contiguous requests (the caller's contract),
        // and nothing writes them while this slice is read.
        let posted = posted_count(ret, bad, unsafe { std::slice::from_raw_parts(chain, n) });
        let r = finish_post(q, n, posted, "ibv_post_send", ret);
        if ret == 0 && any_inline {
            release_inline(q, wrs, kept);
        }
        r
    }

    /// Posts a batch with host-staged GPU sources, one request at a time.
    /// Staging writes the mirror, a CPU copy, so each such source is
    /// claimed before the queue is locked (a copy looks up what the queue
    /// holds, under its lock); each is then staged and handed to the NIC
    /// under the lock. Large writes go as chunks, copying chunk k+1 from
    /// the GPU while the NIC sends chunk k, instead of copying the whole
    /// message before the NIC may start. The queue stays locked
    /// throughout, so the room checked is the room used.
    fn post_send_staged(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        let mut staging = Vec::with_capacity(wrs.len());
        for w in wrs {
            staging.push(match w.local.one() {
                Some(s) if w.stages_out() => Some(s.mr.claim_for_staging(s.offset, s.len)?),
                _ => None,
            });
        }
        let mut q = self.core.tracker.send.lock();
        let chunks: usize = wrs.iter().map(|w| if splits_for_staging(w) { w.local.len().div_ceil(STAGE_CHUNK) } else { 1 }).sum();
        q.room_for(chunks, "send")?;
        for (wr, staging) in wrs.iter().zip(&mut staging) {
            let one = std::slice::from_ref(wr);
            let (Some(staging), Some(src)) = (staging, wr.local.one()) else {
                self.post_send_locked(&mut q, one, wr.local.gather_sges(), ClaimLocal)?;
                continue;
            };
            if !splits_for_staging(wr) {
                self.post_send_locked(&mut q, one, 0, claim_with(|_| staging.stage_next(src.len).map(Hold::One)))?;
                continue;
            }
            let n = src.len.div_ceil(STAGE_CHUNK);
            for k in 0..n {
                let off = k * STAGE_CHUNK;
                let len = STAGE_CHUNK.min(src.len - off);
                let last = k + 1 == n;
                let chunk = SendWr {
                    local: SgList::from(LocalSlice { mr: src.mr, offset: src.offset + off, len }),
                    // Cannot overflow: `remote_addr + len` was checked when
                    // the request was built (RemoteBuffer::addr_of).
                    remote_addr: wr.remote_addr.wrapping_add(off as u64),
                    // Only the last chunk carries the immediate, the id and
                    // the caller's signaling; RC ordering completes the rest first.
                    op: if last { wr.op } else { SendOp::Write },
                    signaled: last && wr.signaled,
                    wr_id: wr.wr_id,
                    ..*wr
                };
                self.post_send_locked(&mut q, &[chunk], 0, claim_with(|_| staging.stage_next(len).map(Hold::One)))?;
            }
        }
        Ok(())
    }

}

/// Records the keys of the binds just posted with `ibv_post_send` (the
/// provider read each window's key as the one its bind replaces).
#[cold]
fn note_binds(wrs: &[SendWr<'_>]) {
    for w in wrs {
        if let (Some(window), SendOp::BindWindow { rkey, .. }, Some(s)) = (w.window, w.op, w.local.one()) {
            window.posted_bind(rkey, s.mr);
        }
    }
}

/// How a posting loop holds each request's local memory for the NIC.
/// A trait rather than `FnMut` so that the plain claim, [`ClaimLocal`],
/// is inlined into the loop: passed as a function or closure the
/// compiler called it per request (measured, ~18 instructions each).
trait Claim {
    fn claim(&mut self, wr: &SendWr<'_>) -> Result<Hold>;
}

/// The claim of every plain post: the request's own slices.
struct ClaimLocal;

impl Claim for ClaimLocal {
    #[inline(always)]
    fn claim(&mut self, wr: &SendWr<'_>) -> Result<Hold> {
        wr.local.claim(wr.op.nic_writes_local())
    }
}

/// A closure as a [`Claim`] (the bound makes it take any request's lifetime).
fn claim_with<F: FnMut(&SendWr<'_>) -> Result<Hold>>(f: F) -> F {
    f
}

impl<F: FnMut(&SendWr<'_>) -> Result<Hold>> Claim for F {
    #[inline(always)]
    fn claim(&mut self, wr: &SendWr<'_>) -> Result<Hold> {
        self(wr)
    }
}

/// Inline requests need nothing once posted: the provider copied them.
/// `wrs` were all posted, their entries the ones after the first `kept`.
fn release_inline(q: &mut WorkQueue, wrs: &[SendWr<'_>], kept: usize) {
    for (p, wr) in q.pending.iter_mut().skip(kept).zip(wrs) {
        if wr.inline {
            p.hold = Hold::None;
        }
    }
}

/// How far [`QueuePair::post_send_all`](super::QueuePair::post_send_all)
/// got before it stopped: the requests before `wrs[posted]` were posted
/// (and complete as usual); the rest were not, except that after an
/// [`Error::Verb`] from the provider the first requests of the batch it
/// refused may have been (see [`post_send`](super::QueuePair::post_send)).
#[derive(Debug, thiserror::Error)]
#[error("posted the first {posted} work requests, then: {error}")]
pub struct PartialPost {
    /// How many requests, from the front, were posted.
    pub posted: usize,
    /// Why posting stopped.
    pub error: Error,
}

impl From<PartialPost> for Error {
    fn from(p: PartialPost) -> Error {
        p.error
    }
}

/// Longest sleep on the CQ between looks at the send queue's room, which
/// another thread reaping the same CQ may free without this one seeing a
/// completion.
const ROOM_RECHECK: Duration = Duration::from_millis(10);

impl QpInner {
    /// [`QueuePair::post_send_all`](super::QueuePair::post_send_all).
    pub(super) fn post_send_all(
        &self,
        wrs: &[SendWr<'_>],
        timeout: Option<Duration>,
        mut on_completion: impl FnMut(WorkCompletion) -> Result<()>,
    ) -> std::result::Result<(), PartialPost> {
        let mut posted = 0;
        let mut one_by_one = false;
        let mut deadline = timeout.map_or(Deadline::never(), Deadline::after);
        let mut wcs = [WorkCompletion::default(); 16];
        while posted < wrs.len() {
            let fail = |error| PartialPost { posted, error };
            let (room, signaled_pending) = {
                let q = self.core.tracker.send.lock();
                (q.depth as usize - q.pending.len(), q.pending.iter().any(|p| p.signaled))
            };
            if room > 0 {
                let k = if one_by_one { 1 } else { room.min(wrs.len() - posted) };
                match self.post_send(&wrs[posted..posted + k]) {
                    Ok(()) => {
                        posted += k;
                        deadline = timeout.map_or(Deadline::never(), Deadline::after);
                        continue;
                    }
                    // A host-staged write posts as several chunks, or another
                    // thread took the room: go one by one, waiting for room.
                    Err(Error::QueueFull { .. }) if k > 1 => {
                        one_by_one = true;
                        continue;
                    }
                    // One request that does not fit an empty queue never will.
                    Err(Error::QueueFull { .. }) if room < self.config.max_send_wr as usize => {}
                    Err(e) => return Err(fail(e)),
                }
            }
            if !signaled_pending {
                return Err(fail(Error::InvalidArgument(format!(
                    "the send queue ({} deep) is full of unsignaled requests, and only a signaled request's completion frees their room: signal at least one request in every {}",
                    self.config.max_send_wr, self.config.max_send_wr
                ))));
            }
            let wait = match deadline.left() {
                Some(left) if left.is_zero() => return Err(fail(Error::Timeout(timeout.unwrap_or_default()))),
                left => left.unwrap_or(ROOM_RECHECK).min(ROOM_RECHECK),
            };
            let n = match self.core.send_cq.wait(&mut wcs, Some(wait)) {
                Ok(n) => n,
                Err(Error::Timeout(_)) => 0,
                Err(e) => return Err(fail(e)),
            };
            for (i, wc) in wcs[..n].iter().enumerate() {
                if let Err(e) = on_completion(*wc) {
                    self.core.send_cq.unread(&wcs[i + 1..n]);
                    return Err(fail(e));
                }
            }
        }
        Ok(())
    }
}



#[cfg(test)]
mod tests {
    use super::*;
    use crate::wc::WcOpcode;

    #[test]
    fn partial_post_keeps_only_accepted_requests() {
        let mut q = WorkQueue::new(8);
        for s in 0..3 {
            q.pending.push_back(Pending { seq: s, wr_id: s, opcode: WcOpcode::Send, signaled: true, hold: Hold::None });
        }
        let chain = [0u64; 3];
        let bad = &chain[1] as *const u64 as *mut u64;
        assert_eq!(posted_count(libc::ENOMEM, bad, &chain), 1);
        let r = finish_post(&mut q, 3, 1, "ibv_post_send", libc::ENOMEM);
        assert!(matches!(r, Err(Error::Verb { verb: "ibv_post_send", .. })));
        assert_eq!(q.pending.len(), 1);
        assert_eq!(q.next_seq, 1);
    }

    /// A failed post that names no refused request (bad_wr NULL, or
    /// outside the chain) may have posted any of them: all stay held.
    #[test]
    fn a_failed_post_without_bad_wr_holds_every_request() {
        let chain = [0u64; 3];
        assert_eq!(posted_count(libc::EINVAL, std::ptr::null_mut::<u64>(), &chain), 3);
        let outside = chain.as_ptr().wrapping_add(3) as *mut u64;
        assert_eq!(posted_count(libc::EINVAL, outside, &chain), 3);
        let first = chain.as_ptr() as *mut u64;
        assert_eq!(posted_count(libc::EINVAL, first, &chain), 0);
        assert_eq!(posted_count(0, std::ptr::null_mut::<u64>(), &chain), 3);
    }
}
