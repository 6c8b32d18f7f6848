//! Reliable-connected queue pairs (`ibv_create_qp`, `ibv_modify_qp`,
//! `ibv_post_send`, `ibv_post_recv`).

use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::port::{LinkLayer, Mtu, PortAttr};
use crate::cq::{CompletionQueue, Reservation};
use crate::wc::WcOpcode;
use crate::error::{check, Error, Result};
use crate::gid::GidChoice;
use crate::mr::{AccessFlags, InFlight, LocalSlice};
use crate::pd::ProtectionDomain;
use crate::tracker::{finish_post, holder, Pending, Tracker, WorkQueue, RECV_BIT, SEQ_MASK};
use crate::wire::Endpoint;
use crate::wr::{RecvWr, SendList, SendOp, SendWr};

/// Queue pair settings. The defaults suit a LAN and never wait forever:
/// perftest's timeout, retry counts of 6 for both lost packets and a
/// receiver without a receive posted (see [`retry_cnt`](Self::retry_cnt)
/// and [`rnr_retry`](Self::rnr_retry)), 128-deep queues, and remote write
/// and read allowed at the queue-pair level (each memory region still
/// grants its own access).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpConfig {
    /// Port number (from 1).
    pub port: u8,
    /// GID index override; `None` chooses by [`crate::choose_gid`].
    pub gid_index: Option<u32>,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Largest inline payload ([`SendWr::inline`]); 0 disables inline.
    pub max_inline_data: u32,
    /// Remote operations the queue pair accepts (`qp_access_flags`).
    pub access: AccessFlags,
    /// Local ACK timeout: 4.096 µs × 2^timeout per try (14 ≈ 67 ms).
    pub timeout: u8,
    /// Retransmissions before [`RetryExceeded`](crate::WcStatus::RetryExceeded) (0..=7).
    ///
    /// The default is 6, one less than perftest's and NCCL's 7: Soft-RoCE
    /// (rxe) treats 7 as "retry forever", so a peer that died would never
    /// fail its survivor's requests. With 6, every provider reports a dead
    /// peer within about `(retry_cnt + 1) × 4.096 µs × 2^timeout`
    /// (0.5 s with the default timeout; measured in docs/reliability.md).
    pub retry_cnt: u8,
    /// Receiver-not-ready retries (0..=7; 7 means forever): how often a
    /// send is tried again when the peer has no receive posted for it,
    /// before it fails with
    /// [`RnrRetryExceeded`](crate::WcStatus::RnrRetryExceeded).
    ///
    /// The default is 6, where NCCL and perftest use 7 (forever): both
    /// never run out of receives by their own flow control, while with 7 a
    /// peer that stops posting receives (a protocol bug, a stuck process)
    /// stalls the sender silently. With 6 and the default
    /// [`min_rnr_timer`](Self::min_rnr_timer) the sender fails after the
    /// peer posted nothing for about 7 × 41 ms ≈ 0.3 s (measured on
    /// Soft-RoCE: 318 ms, `a_send_without_a_posted_receive_fails_within_a_bound`). The cost: each RNR
    /// NAK pauses the sending queue pair for at least the peer's timer, so
    /// a protocol that lets receives run short should keep them posted
    /// ahead (or choose 7 and a short timer, as NCCL does).
    pub rnr_retry: u8,
    /// Minimum RNR NAK timer this side asks a sender to wait when it has no
    /// receive posted (encoded as in the IB spec: 12 ≈ 0.64 ms, 24 ≈ 41 ms,
    /// 0 = 655 ms). The default 24 makes [`rnr_retry`](Self::rnr_retry)'s
    /// bound a fraction of a second rather than milliseconds.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA reads per direction (capped by the device).
    pub max_rd_atomic: u8,
    /// Upper bound on the path MTU; `None` uses the port's active MTU.
    pub mtu: Option<Mtu>,
    /// Service level.
    pub service_level: u8,
    /// IP traffic class (RoCE) / GRH traffic class.
    pub traffic_class: u8,
    /// Hop limit (RoCE TTL).
    pub hop_limit: u8,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            port: 1,
            gid_index: None,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_inline_data: 0,
            access: AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
            timeout: 14,
            retry_cnt: 6,
            rnr_retry: 6,
            min_rnr_timer: 24,
            max_rd_atomic: 16,
            mtu: None,
            service_level: 0,
            traffic_class: 0,
            hop_limit: 64,
        }
    }
}

/// Queue pair state (`enum ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpState {
    /// Reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every outstanding and new work request completes flushed.
    Error,
    /// Unknown.
    Other(u32),
}

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
    matches!(w.op, SendOp::Write | SendOp::WriteWithImm(_)) && w.local.len > STAGE_CHUNK && w.local.mr.is_host_staged()
}

struct QpInner {
    qp: NonNull<sys::ibv_qp>,
    qp_num: u32,
    psn: u32,
    pd: ProtectionDomain,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    tracker: Arc<Tracker>,
    gid: GidChoice,
    port: PortAttr,
    config: QpConfig,
    max_inline: u32,
    /// Room in the send and receive CQs; see the Drop body.
    room: [Option<Reservation>; 2],
}

// SAFETY: posting and modifying are thread-safe verbs; Rust-side state
// lives behind the tracker's mutexes.
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: the QP came from ibv_create_qp and is destroyed once.
        // After this returns the NIC no longer touches memory on its behalf,
        // so the holds of its outstanding work requests may be released.
        let ret = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        self.send_cq.unregister(self.qp_num, &self.tracker);
        self.recv_cq.unregister(self.qp_num, &self.tracker);
        if ret != 0 {
            tracing::warn!("{}", Error::returned("ibv_destroy_qp", ret));
            // Leak the held memory rather than free what the NIC may still
            // use, and keep the CQ room: the QP may still complete into it.
            std::mem::forget(self.tracker.clone());
            std::mem::forget(self.room.each_mut().map(Option::take));
            return;
        }
        // Work left unreaped may have left completions in the CQ (rxe keeps
        // a destroyed QP's; mlx5 removes them): that room stays owed until
        // the CQ has been seen empty.
        for (left, room) in self.tracker.clear().into_iter().zip(&mut self.room) {
            if let (true, Some(r)) = (left, room.take()) {
                r.into_debt();
            }
        }
        self.pd.inner.holders.remove(&holder(&self.tracker));
    }
}

impl fmt::Debug for QpInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("device", &self.pd.context().name())
            .field("qp_num", &format_args!("{:#x}", self.qp_num))
            .field("port", &self.config.port)
            .field("gid", &format_args!("{}", self.gid))
            .field("active_mtu", &self.port.active_mtu)
            .finish()
    }
}

impl QpInner {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            qp_num: self.qp_num,
            psn: self.psn,
            lid: self.port.lid,
            gid: self.gid.entry.gid,
            mtu: self.port.active_mtu.unwrap_or(Mtu::Mtu1024),
        }
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
        // SAFETY: valid QP and attribute struct; the mask names fields set.
        check("ibv_modify_qp", unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as i32) })
    }

    fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        for wr in wrs {
            self.check_local(&wr.local)?;
        }
        let mut q = self.tracker.recv.lock();
        let q = &mut *q;
        q.room_for(wrs.len(), "receive")?;
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        q.scratch.sges.clear();
        q.scratch.recv.clear();
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            q.enter(kept, claim(&wr.local, true), |hold| Pending { seq, wr_id: wr.wr_id, opcode: WcOpcode::Recv, signaled: true, hold })?;
            q.scratch.sges.push(wr.local.sge());
            q.scratch.recv.push(sys::ibv_recv_wr { wr_id: RECV_BIT | self.tracker.tag | seq, ..Default::default() });
        }
        let s = &mut q.scratch;
        link_recv(&mut s.recv, &mut s.sges, wrs.iter().map(|w| !w.local.is_empty()));
        let mut bad = std::ptr::null_mut();
        // SAFETY: `recv` is a valid, NUL-terminated chain whose SGEs name
        // registered memory held alive (and claimed) by the pending entries.
        let ret = unsafe { sys::ibv_post_recv(self.qp.as_ptr(), s.recv.as_mut_ptr(), &mut bad) };
        let posted = posted_count(ret, bad, &s.recv);
        finish_post(q, wrs.len(), posted, "ibv_post_recv", ret)
    }

    /// Checks what can be checked of a batch before the queue is locked;
    /// says whether any request's source must be staged first.
    fn check_send(&self, wrs: &[SendWr<'_>]) -> Result<bool> {
        let mut staged = false;
        for wr in wrs {
            if !wr.local.mr.pd().same_as(&self.pd) {
                return Err(Error::ForeignMemoryRegion);
            }
            wr.check()?;
            staged |= wr.stages_out();
            if wr.inline {
                self.check_inline_len(wr.local.len)?;
            }
            if wr.op.is_atomic() {
                self.check_atomics()?;
            }
        }
        Ok(staged)
    }

    #[cold]
    fn check_atomics(&self) -> Result<()> {
        let ctx = self.pd.context();
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
        if len > self.max_inline as usize {
            return Err(Error::InvalidArgument(format!(
                "an inline payload of {len} bytes: the queue pair allows inline writes and sends of at most {} bytes (QpConfig::max_inline_data)",
                self.max_inline
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
        mut claim: impl FnMut(&SendWr<'_>) -> Result<Option<InFlight>>,
    ) -> Result<()> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        q.room_for(n, "send")?;
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        let s = &mut q.scratch;
        // Slots are rewritten in place, field by field: every field a
        // provider reads for an RC send, write or read is set below, and
        // the rest stay zero from the resize.
        s.fit_send(n);
        let (chain, sges) = (s.send.as_mut_ptr(), s.sges.as_mut_ptr());
        let mut any_inline = false;
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            // Inline payloads are copied during the post, by the CPU: that
            // copy is a read like any send's, so it is held the same way.
            q.enter(kept, claim(wr), |hold| Pending { seq, wr_id: wr.wr_id, opcode: wr.op.wc_opcode(), signaled: wr.signaled, hold })?;
            // SAFETY: fit_send made room for `n` slots of each; `i < n`,
            // and `i + 1` is at most one past the end, never dereferenced
            // (the last request's link is set to NULL after the loop).
            let (raw, sg) = unsafe { (&mut *chain.add(i), &mut *sges.add(i)) };
            // SAFETY: as above.
            raw.next = unsafe { chain.add(i + 1) };
            raw.wr_id = self.tracker.tag | seq;
            wr.write_raw(raw, sg);
            any_inline |= wr.inline;
        }
        let s = &mut q.scratch;
        s.send[n - 1].next = std::ptr::null_mut();
        let chain = s.send.as_mut_ptr();
        // SAFETY: `chain` is a valid, NULL-terminated chain of `n` requests
        // whose SGEs name registered memory held alive (and claimed) by the
        // pending entries; remote addresses were bounds-checked against the
        // peer's buffer.
        unsafe { self.post_chain(q, chain, wrs, kept, any_inline) }
    }

    /// Posts a prepared list with the send queue locked: as
    /// [`post_send_locked`](Self::post_send_locked), but the requests were
    /// checked and written when the list was made, so each is only held,
    /// entered and numbered.
    fn post_list_locked(&self, q: &mut WorkQueue, list: &mut SendList<'_>) -> Result<()> {
        let (wrs, chain) = list.parts();
        let n = wrs.len();
        q.room_for(n, "send")?;
        let first_seq = q.next_seq;
        let kept = q.pending.len();
        let mut any_inline = false;
        for (i, (wr, raw)) in wrs.iter().zip(chain.iter_mut()).enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            let hold = claim(&wr.local, wr.op.nic_writes_local());
            q.enter(kept, hold, |hold| Pending { seq, wr_id: wr.wr_id, opcode: wr.op.wc_opcode(), signaled: wr.signaled, hold })?;
            raw.wr_id = self.tracker.tag | seq;
            any_inline |= wr.inline;
        }
        // SAFETY: the list's chain is NULL-terminated, of `n` requests
        // written from `wrs` (SendList::new) whose SGEs name registered
        // memory the list borrows and the pending entries now hold.
        unsafe { self.post_chain(q, chain.as_mut_ptr(), wrs, kept, any_inline) }
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
        let ret = unsafe { sys::ibv_post_send(self.qp.as_ptr(), chain, &mut bad) };
        // SAFETY: the chain is `n` contiguous requests (the caller's contract),
        // and nothing writes them while this slice is read.
        let posted = posted_count(ret, bad, unsafe { std::slice::from_raw_parts(chain, n) });
        let r = finish_post(q, n, posted, "ibv_post_send", ret);
        // Inline requests need nothing once posted: the provider copied them.
        if ret == 0 && any_inline {
            for (p, wr) in q.pending.iter_mut().skip(kept).zip(wrs) {
                if wr.inline {
                    p.hold = None;
                }
            }
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
            staging.push(if w.stages_out() { Some(w.local.mr.claim_for_staging(w.local.offset, w.local.len)?) } else { None });
        }
        let mut q = self.tracker.send.lock();
        let chunks: usize = wrs.iter().map(|w| if splits_for_staging(w) { w.local.len.div_ceil(STAGE_CHUNK) } else { 1 }).sum();
        q.room_for(chunks, "send")?;
        for (wr, staging) in wrs.iter().zip(&mut staging) {
            let Some(staging) = staging else {
                self.post_send_locked(&mut q, std::slice::from_ref(wr), |w| claim(&w.local, w.op.nic_writes_local()))?;
                continue;
            };
            if !splits_for_staging(wr) {
                self.post_send_locked(&mut q, std::slice::from_ref(wr), |w| staging.stage_next(w.local.len).map(Some))?;
                continue;
            }
            let n = wr.local.len.div_ceil(STAGE_CHUNK);
            for k in 0..n {
                let off = k * STAGE_CHUNK;
                let len = STAGE_CHUNK.min(wr.local.len - off);
                let last = k + 1 == n;
                let chunk = SendWr {
                    local: LocalSlice { mr: wr.local.mr, offset: wr.local.offset + off, len },
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
                self.post_send_locked(&mut q, &[chunk], |_| staging.stage_next(len).map(Some))?;
            }
        }
        Ok(())
    }

    #[inline]
    fn check_local(&self, l: &LocalSlice<'_>) -> Result<()> {
        if !l.mr.pd().same_as(&self.pd) {
            return Err(Error::ForeignMemoryRegion);
        }
        if l.len > u32::MAX as usize {
            return Err(Error::TooLong(l.len as u64));
        }
        Ok(())
    }
}

/// Claims a work request's local memory until its completion is reaped
/// (nothing for an empty slice).
#[inline(always)]
fn claim(l: &LocalSlice<'_>, nic_writes: bool) -> Result<Option<InFlight>> {
    if l.is_empty() {
        return Ok(None);
    }
    l.mr.claim_for_nic(l.offset, l.len, nic_writes).map(Some)
}

/// Chains receive requests (`next`) and points each at its SGE; done
/// after the vectors stopped growing so the pointers stay valid. (Sends
/// are chained in place as they are written, see `post_send_locked`.)
fn link_recv(wrs: &mut [sys::ibv_recv_wr], sges: &mut [sys::ibv_sge], has_data: impl Iterator<Item = bool>) {
    let base = wrs.as_mut_ptr();
    let n = wrs.len();
    for ((i, wr), data) in wrs.iter_mut().enumerate().zip(has_data) {
        // SAFETY: i + 1 <= n, one-past-the-end is not dereferenced.
        wr.next = if i + 1 < n { unsafe { base.add(i + 1) } } else { std::ptr::null_mut() };
        (wr.sg_list, wr.num_sge) = if data { (&mut sges[i] as *mut _, 1) } else { (std::ptr::null_mut(), 0) };
    }
}

/// How many requests of a chain the provider accepted: all on success,
/// those before `bad` on failure (ibv_post_send(3)). A failure whose `bad`
/// is NULL or outside the chain says nothing of what was posted, so every
/// request counts as posted: its memory then stays held until a completion
/// or the queue pair's destruction releases it, where counting it as
/// refused could free memory the NIC is still using.
#[inline]
fn posted_count<W>(ret: i32, bad: *mut W, chain: &[W]) -> usize {
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

/// A queue pair in the `INIT` state: give its [`endpoint`](Self::endpoint)
/// to the peer, post receives, then [`connect`](Self::connect).
///
/// A queue pair is created by [`QueuePair::create`] in the `INIT` state as a
/// [`PreparedQueuePair`]: it has an [`Endpoint`] to give the peer and can
/// already take receives. [`PreparedQueuePair::connect`] drives it through
/// `RTR` and `RTS` with the peer's endpoint and yields a [`QueuePair`], the
/// only type that can post sends:
///
/// ```compile_fail
/// # fn f(qp: gpudirect::PreparedQueuePair, wr: gpudirect::SendWr<'_>) {
/// qp.post_send(&[wr]); // not connected yet: no such method
/// # }
/// ```
///
/// Connecting consumes the prepared queue pair, so it cannot be connected twice:
///
/// ```compile_fail
/// # fn f(qp: gpudirect::PreparedQueuePair, peer: gpudirect::Endpoint) -> gpudirect::Result<()> {
/// let a = qp.connect(&peer)?;
/// let b = qp.connect(&peer)?; // use of moved value
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct PreparedQueuePair {
    inner: QpInner,
}

/// A connected reliable-connected queue pair (`RTS`).
///
/// # Thread safety
/// `Send + Sync`: several threads may post on one queue pair. Each call's
/// batch is checked, claimed, staged and posted under the queue's lock,
/// so the room it was checked against is the room it uses, and batches
/// from different threads never interleave.
#[derive(Debug)]
pub struct QueuePair {
    inner: QpInner,
    remote: Endpoint,
}

impl QueuePair {
    /// Creates an RC queue pair in `pd`, completing sends on `send_cq` and
    /// receives on `recv_cq` (which may be the same queue), and moves it to
    /// `INIT`. The GID it will use is chosen (and logged) here.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the completion queues belong to
    /// another device; [`Error::CqTooSmall`] when they could not hold a
    /// completion for every work request of their queue pairs together
    /// (`max_send_wr` on the send CQ, `max_recv_wr` on the receive CQ);
    /// [`Error::Gid`] / [`Error::InvalidPort`] for the
    /// port and GID; [`Error::Verb`] from `ibv_create_qp` (`EINVAL`: a
    /// depth or `max_inline_data` the device does not support) or
    /// `ibv_modify_qp`.
    pub fn create(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        config: &QpConfig,
    ) -> Result<PreparedQueuePair> {
        let ctx = pd.context();
        for cq in [send_cq, recv_cq] {
            if !Arc::ptr_eq(&cq.context().inner, &ctx.inner) {
                return Err(Error::InvalidArgument(format!(
                    "completion queue of device {} used with a protection domain of {}",
                    cq.context().name(),
                    ctx.name()
                )));
            }
        }
        let port = ctx.query_port(config.port)?;
        let gid = ctx.choose_gid_on(&port, config.gid_index)?;
        // Every send may be signaled and every receive completes: the CQs
        // must hold them all, or they overrun.
        let room = [Some(send_cq.reserve(config.max_send_wr)?), Some(recv_cq.reserve(config.max_recv_wr)?)];
        let mut init = sys::ibv_qp_init_attr {
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            cap: sys::ibv_qp_cap {
                max_send_wr: config.max_send_wr,
                max_recv_wr: config.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: config.max_inline_data,
            },
            qp_type: sys::IBV_QPT_RC,
            sq_sig_all: 0,
            ..Default::default()
        };
        // SAFETY: valid PD and CQs of the same device; `init` is fully set.
        let qp = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::last("ibv_create_qp"))?;
        // SAFETY: a created QP is readable.
        let qp_num = unsafe { (*qp.as_ptr()).qp_num };
        // The provider may round the depths up; ours stay as requested so
        // QueueFull fires before the provider's ENOMEM would.
        let tracker = Arc::new(Tracker::new(config.max_send_wr, config.max_recv_wr));
        // Registered before any post, so no completion can go unmatched.
        send_cq.register(qp_num, tracker.clone());
        recv_cq.register(qp_num, tracker.clone());
        pd.inner.holders.add(holder(&tracker));
        let inner = QpInner {
            qp,
            qp_num,
            psn: random_psn(),
            pd: pd.clone(),
            send_cq: send_cq.clone(),
            recv_cq: recv_cq.clone(),
            tracker,
            gid,
            port,
            config: config.clone(),
            max_inline: init.cap.max_inline_data,
            room,
        };
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: config.port,
            qp_access_flags: config.access.bits(),
            ..Default::default()
        };
        inner.modify(&mut attr, sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_ACCESS_FLAGS)?;
        tracing::debug!(qp = ?inner, "created queue pair");
        Ok(PreparedQueuePair { inner })
    }

    /// This side's endpoint.
    pub fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }

    /// The peer's endpoint this queue pair is connected to.
    pub fn remote(&self) -> &Endpoint {
        &self.remote
    }

    /// The GID this queue pair sends from, and why it was chosen.
    pub fn gid(&self) -> &GidChoice {
        &self.inner.gid
    }

    /// The largest payload [`SendWr::inline`] accepts here.
    pub fn max_inline_data(&self) -> u32 {
        self.inner.max_inline
    }

    /// Posts a batch of send-queue work requests with one call (one
    /// doorbell). The memory they name stays held, and refused to local
    /// writes (and, for RDMA reads, reads), until each request's completion
    /// is reaped from the send completion queue.
    ///
    /// A source in a host-staged GPU region is copied to the NIC's host
    /// mirror first (under the same lock); writes over 1 MiB from one are
    /// posted as 1 MiB chunks so the copy of one overlaps the transfer of
    /// the one before. Such a range can be the source of one outstanding
    /// request at a time (staging rewrites the mirror).
    ///
    /// # Errors
    /// Nothing is posted when the batch would overfill the queue
    /// ([`Error::QueueFull`]), names a region of another protection domain
    /// ([`Error::ForeignMemoryRegion`]) or an inline payload that is too
    /// long, or when a local range is in use in a conflicting way
    /// ([`Error::Busy`]: a CPU copy running on another thread, or, for a
    /// host-staged source, any outstanding request on it). Two posted
    /// requests over the same bytes are not refused: what the NIC does to
    /// memory is the protocol's business, and no Rust access.
    /// [`Error::Verb`] from `ibv_post_send`, or [`Error::Cuda`] staging a
    /// chunk: the requests (chunks) before the failing one were posted and
    /// will complete. When the provider fails without naming the first
    /// refused request, every request of the batch is treated as posted:
    /// its memory stays held until a completion or the queue pair's drop.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let inner = &self.inner;
        if inner.check_send(wrs)? {
            return inner.post_send_staged(wrs);
        }
        let mut q = inner.tracker.send.lock();
        inner.post_send_locked(&mut q, wrs, |wr| claim(&wr.local, wr.op.nic_writes_local()))
    }

    /// Posts a [`SendList`]: its requests, checked and written out when the
    /// list was made, are held, tracked and posted as
    /// [`post_send`](Self::post_send) would post them, with one call. The
    /// list may be posted again as soon as this returns (each post's
    /// requests complete on their own), and on any queue pair of the
    /// protection domain it names.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send): nothing is posted on
    /// [`Error::QueueFull`], [`Error::Busy`], [`Error::ForeignMemoryRegion`]
    /// (the list's regions are of another protection domain) or
    /// [`Error::InvalidArgument`] (an inline request longer than this queue
    /// pair's [`max_inline_data`](Self::max_inline_data)).
    pub fn post_list(&self, list: &mut SendList<'_>) -> Result<()> {
        let inner = &self.inner;
        let Some(pd) = list.pd() else { return Ok(()) };
        if !pd.same_as(&inner.pd) {
            return Err(Error::ForeignMemoryRegion);
        }
        if list.longest_inline() > 0 {
            inner.check_inline_len(list.longest_inline())?;
        }
        if list.has_atomics() {
            inner.check_atomics()?;
        }
        if list.stages() {
            return inner.post_send_staged(list.requests());
        }
        let mut q = inner.tracker.send.lock();
        inner.post_list_locked(&mut q, list)
    }

    /// Posts a batch of receives with one call. See
    /// [`PreparedQueuePair::post_recv`].
    ///
    /// # Errors
    /// As [`PreparedQueuePair::post_recv`].
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }

    /// The current state (`ibv_query_qp`); [`QpState::Error`] after a
    /// failed work request.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_query_qp`.
    pub fn state(&self) -> Result<QpState> {
        let mut attr = MaybeUninit::<sys::ibv_qp_attr>::zeroed();
        let mut init = MaybeUninit::<sys::ibv_qp_init_attr>::zeroed();
        // SAFETY: valid QP and out-pointers.
        check("ibv_query_qp", unsafe {
            sys::ibv_query_qp(self.inner.qp.as_ptr(), attr.as_mut_ptr(), sys::IBV_QP_STATE as i32, init.as_mut_ptr())
        })?;
        // SAFETY: qp_state was written (and everything was zeroed).
        Ok(match unsafe { attr.assume_init() }.qp_state {
            sys::IBV_QPS_RESET => QpState::Reset,
            sys::IBV_QPS_INIT => QpState::Init,
            sys::IBV_QPS_RTR => QpState::Rtr,
            sys::IBV_QPS_RTS => QpState::Rts,
            sys::IBV_QPS_SQD => QpState::Sqd,
            sys::IBV_QPS_SQE => QpState::Sqe,
            sys::IBV_QPS_ERR => QpState::Error,
            s => QpState::Other(s),
        })
    }
}

impl PreparedQueuePair {
    /// This side's endpoint, for the peer.
    pub fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }

    /// The GID this queue pair sends from, and why it was chosen.
    pub fn gid(&self) -> &GidChoice {
        &self.inner.gid
    }

    /// Posts a batch of receives with one call. Post them before the peer
    /// can send, or its sends wait for receiver-not-ready retries. The
    /// memory stays held, and refused to local access, until each receive's
    /// completion is reaped from the receive completion queue.
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::ForeignMemoryRegion`], or
    /// [`Error::Busy`] while a copy on another thread uses a destination
    /// range (nothing posted); [`Error::Verb`] from `ibv_post_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }

    /// Connects to the peer: `INIT` → `RTR` → `RTS`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an endpoint that cannot be valid (a
    /// QP number or PSN over 24 bits, no LID on an InfiniBand port), and
    /// [`Error::Verb`] from `ibv_modify_qp`.
    pub fn connect(self, remote: &Endpoint) -> Result<QueuePair> {
        let inner = self.inner;
        if remote.qp_num > 0xff_ffff || remote.psn > 0xff_ffff {
            return Err(Error::InvalidArgument(format!("peer endpoint out of range: {remote}")));
        }
        let ethernet = inner.port.link_layer == LinkLayer::Ethernet;
        if !ethernet && remote.lid == 0 {
            return Err(Error::InvalidArgument(format!("peer endpoint has no LID on an InfiniBand port: {remote}")));
        }
        let c = &inner.config;
        let dev = inner.pd.context().attr();
        let local_mtu = inner.port.active_mtu.unwrap_or(Mtu::Mtu1024);
        let mtu = [Some(local_mtu), Some(remote.mtu), c.mtu].into_iter().flatten().min().unwrap_or(local_mtu);
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTR,
            path_mtu: mtu.to_raw(),
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            max_dest_rd_atomic: c.max_rd_atomic.min(dev.max_qp_rd_atom.min(255) as u8).max(1),
            min_rnr_timer: c.min_rnr_timer,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = c.service_level;
        attr.ah_attr.port_num = c.port;
        if ethernet {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid.0;
            attr.ah_attr.grh.sgid_index = inner.gid.entry.index as u8;
            attr.ah_attr.grh.hop_limit = c.hop_limit;
            attr.ah_attr.grh.traffic_class = c.traffic_class;
        }
        inner.modify(
            &mut attr,
            sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER,
        )?;
        if c.retry_cnt >= 7 && dev.vendor_id == RXE_VENDOR_ID {
            tracing::warn!(
                retry_cnt = c.retry_cnt,
                "Soft-RoCE retries forever with retry_cnt 7: requests to a peer that died will never fail; use 6 or less"
            );
        }
        let mut attr = sys::ibv_qp_attr {
            qp_state: sys::IBV_QPS_RTS,
            timeout: c.timeout,
            retry_cnt: c.retry_cnt.min(7),
            rnr_retry: c.rnr_retry.min(7),
            sq_psn: inner.psn,
            max_rd_atomic: c.max_rd_atomic.min(dev.max_qp_init_rd_atom.min(255) as u8).max(1),
            ..Default::default()
        };
        inner.modify(
            &mut attr,
            sys::IBV_QP_STATE
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_MAX_QP_RD_ATOMIC,
        )?;
        tracing::info!(local = %inner.endpoint(), remote = %remote, %mtu, gid = %inner.gid, "queue pair connected");
        Ok(QueuePair { inner, remote: *remote })
    }
}

/// The vendor id Soft-RoCE (rxe) reports.
const RXE_VENDOR_ID: u32 = 0xff_ffff;

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    (h.finish() & 0xff_ffff) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_post_keeps_only_accepted_requests() {
        let mut q = WorkQueue::new(8);
        for s in 0..3 {
            q.pending.push_back(Pending { seq: s, wr_id: s, opcode: WcOpcode::Send, signaled: true, hold: None });
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

    #[test]
    fn psn_fits_24_bits() {
        assert!(random_psn() <= 0xff_ffff);
    }
}
