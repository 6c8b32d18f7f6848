//! Completion queues (`ibv_create_cq`, `ibv_poll_cq`) and the work
//! completions they report.

use std::collections::VecDeque;
use std::fmt;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use gpudirect_sys as sys;

use crate::context::Context;
use crate::deadline::{set_nonblocking, Deadline};
use crate::error::{check, Error, Errno, Result};
use crate::hash::NumberMap;
use crate::tracker::{tag_of, Tracker};
use crate::sync::Mutex;
use crate::wc::{WcOpcode, WcStatus, WorkCompletion};

struct Channel(NonNull<sys::ibv_comp_channel>);

/// Trackers by a number the provider or this library assigned.
type ByNumber<K> = NumberMap<K, Arc<Tracker>>;

/// What polling needs, under one lock that is held from `ibv_poll_cq`
/// until every completion it returned is matched to its work request: two
/// pollers can then never reap one queue pair's completions out of order,
/// which is what let a later completion release an earlier one's request
/// and drop it.
#[derive(Default)]
struct PollState {
    /// Queue pairs using this CQ, by number: how a completion finds the
    /// work request (and memory) it releases.
    trackers: ByNumber<u32>,
    /// Shared receive queues whose receives complete here, by their
    /// trackers' tags (a receive's completion names the queue pair it
    /// arrived on, but its wr_id names the shared queue's tracker).
    shared: ByNumber<u64>,
    /// Completions reaped from the CQ but not yet handed to a caller
    /// (taken while paying a debt, or left over when polling failed).
    backlog: VecDeque<WorkCompletion>,
    /// Room of destroyed queue pairs that left work unreaped. Some
    /// providers (rxe) leave a destroyed QP's completions in the CQ, where
    /// they still take entries: the room is owed until the CQ has been
    /// seen empty once after the destruction, which proves they are gone.
    debt: u64,
}

impl PollState {
    /// Forgets queue pair `qpn`, if `t` is still the one registered under
    /// that number: a provider may already have given the number to a new
    /// queue pair, whose tracker must stay.
    fn unregister(&mut self, qpn: u32, t: &Arc<Tracker>) {
        if self.trackers.get(&qpn).is_some_and(|cur| Arc::ptr_eq(cur, t)) {
            self.trackers.remove(&qpn);
        }
    }
}

pub(crate) struct CqInner {
    cq: NonNull<sys::ibv_cq>,
    channel: Channel,
    depth: u32,
    state: Mutex<PollState>,
    /// Serialises arming and consuming completion events.
    waiter: Mutex<()>,
    /// Work-queue entries of the queue pairs completing here (locked after
    /// `state` when both are needed): a CQ smaller than that can overrun, which verbs report only as an asynchronous
    /// event while the queue pairs stall.
    committed: Mutex<u64>,
    ctx: Context,
}

// SAFETY: CQ and channel are kernel/provider objects whose verbs are
// thread-safe; Rust-side state is behind mutexes.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: every QP using this CQ holds an Arc to it, so none remain;
        // every event taken from the channel was acknowledged in `wait`.
        unsafe {
            let ret = sys::ibv_destroy_cq(self.cq.as_ptr());
            if ret != 0 {
                tracing::warn!("{}", Error::returned("ibv_destroy_cq", ret));
            }
            let ret = sys::ibv_destroy_comp_channel(self.channel.0.as_ptr());
            if ret != 0 {
                tracing::warn!("{}", Error::returned("ibv_destroy_comp_channel", ret));
            }
        }
    }
}

/// A completion queue with its own completion channel, so it can be
/// busy-polled ([`poll`](Self::poll)) or waited on ([`wait`](Self::wait)).
/// Cheap to clone; queue pairs using it keep it alive.
///
/// # Thread safety
/// `Send + Sync`. Any number of threads may poll and wait at once; every
/// completion is reported exactly once, to one of them. Waiters take
/// turns sleeping on the channel; pollers do not wait for them.
///
/// A completion is also the moment the library lets go of the memory the
/// work request used: reaping it through [`CompletionQueue::poll`] or
/// [`CompletionQueue::wait`] releases the request's hold on its memory
/// region (and, for the send queue, that of the unsignaled requests posted
/// before it).
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

/// The completion channel's file descriptor, non-blocking: readable when
/// an event waits (see [`CompletionQueue::req_notify`]), for epoll, mio or
/// tokio's `AsyncFd`. It stays open as long as the queue.
impl AsFd for CompletionQueue {
    fn as_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel, and so its fd, lives as long as `self`.
        unsafe { BorrowedFd::borrow_raw((*self.inner.channel.0.as_ptr()).fd) }
    }
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue").field("device", &self.inner.ctx.name()).field("depth", &self.inner.depth).finish()
    }
}

/// How many completions one `ibv_poll_cq` call asks for.
const POLL_BATCH: usize = 32;

impl CompletionQueue {
    /// Creates a completion queue of at least `depth` entries.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0 or above the device's
    /// `max_cqe`; [`Error::Verb`] from `ibv_create_comp_channel` or
    /// `ibv_create_cq`.
    pub fn new(ctx: &Context, depth: u32) -> Result<CompletionQueue> {
        let max = ctx.attr().max_cqe;
        if depth == 0 || depth > max {
            return Err(Error::InvalidArgument(format!("completion queue depth {depth} is outside 1..={max} for {}", ctx.name())));
        }
        // SAFETY: valid context.
        let ch = unsafe { sys::ibv_create_comp_channel(ctx.as_ptr()) };
        let ch = Channel(NonNull::new(ch).ok_or_else(|| Error::last("ibv_create_comp_channel"))?);
        // Non-blocking, so `wait` can bound its wait with poll(2).
        // SAFETY: the channel is open; `fd` is its descriptor.
        if let Err(errno) = set_nonblocking(unsafe { (*ch.0.as_ptr()).fd }) {
            tracing::warn!("making the completion channel's fd non-blocking failed: {errno}");
        }
        // SAFETY: valid context and channel; no cq_context is used.
        let cq = unsafe { sys::ibv_create_cq(ctx.as_ptr(), depth as i32, std::ptr::null_mut(), ch.0.as_ptr(), 0) };
        let Some(cq) = NonNull::new(cq) else {
            let e = Error::last("ibv_create_cq");
            // SAFETY: the channel has no CQ attached.
            unsafe { sys::ibv_destroy_comp_channel(ch.0.as_ptr()) };
            return Err(e);
        };
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                cq,
                channel: ch,
                depth,
                state: Mutex::default(),
                waiter: Mutex::new(()),
                committed: Mutex::new(0),
                ctx: ctx.clone(),
            }),
        })
    }

    /// The device context the queue belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    /// The number of entries requested at creation.
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// Polls without blocking; fills `out` from the front and returns how
    /// many completions were written (0 when none is ready). Failed work
    /// requests are reported as completions with a non-success
    /// [`WcStatus`]; use [`WorkCompletion::ok`] to turn them into errors.
    ///
    /// Any number of threads may poll one queue: each completion is
    /// reported exactly once, to one of them.
    ///
    /// # Errors
    /// [`Error::Verb`] when `ibv_poll_cq` itself fails (after the
    /// completions already reaped in this call have been returned).
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut st = self.inner.state.lock();
        self.poll_locked(&mut st, out)
    }

    fn poll_locked(&self, st: &mut PollState, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut written = 0;
        while written < out.len() {
            let Some(c) = st.backlog.pop_front() else { break };
            out[written] = c;
            written += 1;
        }
        if written == out.len() {
            return Ok(written);
        }
        match self.reap(st, &mut out[written..]) {
            Ok(n) => Ok(written + n),
            // Report what the backlog gave; the error recurs on the next call.
            Err(_) if written > 0 => Ok(written),
            Err(e) => Err(e),
        }
    }

    /// Polls the CQ itself into `out`, matching each completion under the
    /// caller's lock.
    fn reap(&self, st: &mut PollState, out: &mut [WorkCompletion]) -> Result<usize> {
        let mut written = 0;
        while written < out.len() {
            let want = (out.len() - written).min(POLL_BATCH);
            let mut wcs = [MaybeUninit::<sys::ibv_wc>::uninit(); POLL_BATCH];
            // SAFETY: valid CQ; `wcs` has room for `want` entries.
            let n = unsafe { sys::ibv_poll_cq(self.inner.cq.as_ptr(), want as i32, wcs.as_mut_ptr().cast()) };
            if n < 0 {
                if written > 0 {
                    break; // report what was reaped; the error recurs on the next call
                }
                return Err(Error::Verb { verb: "ibv_poll_cq", errno: Errno(-n) });
            }
            let n = n as usize;
            for wc in &wcs[..n] {
                // SAFETY: ibv_poll_cq initialised the first `n` entries.
                let wc = unsafe { wc.assume_init_ref() };
                if let Some(c) = translate(wc, &st.trackers, &st.shared) {
                    out[written] = c;
                    written += 1;
                }
            }
            if n < want {
                // Seen empty: no destroyed queue pair's completion is left.
                self.forgive_debt(st);
                break;
            }
        }
        Ok(written)
    }

    fn forgive_debt(&self, st: &mut PollState) {
        if st.debt > 0 {
            let mut c = self.inner.committed.lock();
            *c = c.saturating_sub(st.debt);
            st.debt = 0;
        }
    }

    /// Reaps everything in the CQ into the backlog, so the room destroyed
    /// queue pairs owe is free; the completions are handed out by later polls.
    fn settle_debt(&self) -> Result<()> {
        let mut st = self.inner.state.lock();
        let mut batch = [WorkCompletion::default(); POLL_BATCH];
        while st.debt > 0 {
            let n = self.reap(&mut st, &mut batch)?;
            st.backlog.extend(&batch[..n]);
        }
        Ok(())
    }

    /// Waits until at least one completion is available, sleeping on the
    /// completion channel instead of spinning, then behaves as
    /// [`poll`](Self::poll). `None` waits without limit, as does a timeout
    /// too long to represent (`Duration::MAX`).
    ///
    /// # Errors
    /// [`Error::Timeout`] when `timeout` passes with no completion;
    /// [`Error::Verb`] from `ibv_req_notify_cq`, `ibv_get_cq_event` or poll(2).
    pub fn wait(&self, out: &mut [WorkCompletion], timeout: Option<Duration>) -> Result<usize> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        let _w = self.inner.waiter.lock();
        loop {
            let n = self.poll(out)?;
            if n > 0 || out.is_empty() {
                return Ok(n);
            }
            // Arm, then poll again: a completion that arrived before
            // arming raises no event.
            self.req_notify()?;
            let n = self.poll(out)?;
            if n > 0 {
                return Ok(n);
            }
            match deadline.wait_readable(self.as_fd().as_raw_fd()) {
                Ok(true) => {}
                Ok(false) => return Err(Error::Timeout(timeout.unwrap_or_default())),
                Err(errno) => return Err(Error::Verb { verb: "poll", errno }),
            }
            self.ack_events()?;
        }
    }

    /// Asks the completion channel for an event at the next completion
    /// (`ibv_req_notify_cq`, any completion). Waiting from an event loop
    /// goes: arm, [`poll`](Self::poll) until empty (a completion that came
    /// before the arm raises no event), wait until [`as_fd`](AsFd::as_fd)
    /// is readable, [`ack_events`](Self::ack_events), and again. An armed
    /// CQ raises one event, then must be armed again.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_req_notify_cq`.
    pub fn req_notify(&self) -> Result<()> {
        // SAFETY: valid CQ.
        check("ibv_req_notify_cq", unsafe { sys::ibv_req_notify_cq(self.inner.cq.as_ptr(), 0) })
    }

    /// Takes every event waiting on the completion channel without
    /// blocking (`ibv_get_cq_event`) and acknowledges them
    /// (`ibv_ack_cq_events`); returns how many there were. The events only
    /// say "poll now": the completions themselves are in the CQ.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_get_cq_event` (other than "none left").
    pub fn ack_events(&self) -> Result<usize> {
        let mut n = 0;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: valid channel and out-pointers; non-blocking fd.
            let got = unsafe { sys::ibv_get_cq_event(self.inner.channel.0.as_ptr(), &mut cq, &mut ctx) };
            if got != 0 {
                let errno = Errno::last();
                if errno.0 == libc::EAGAIN {
                    return Ok(n);
                }
                return Err(Error::Verb { verb: "ibv_get_cq_event", errno });
            }
            // SAFETY: one event was taken for `cq` (ours: one CQ per channel).
            unsafe { sys::ibv_ack_cq_events(cq, 1) };
            n += 1;
        }
    }

    /// Puts reaped completions back, ahead of everything not yet handed
    /// out, for the next polls: what a reaper that stopped part-way did not
    /// hand to anyone is not lost.
    /// Drops every completion of queue pair `qp_num` still in the device's
    /// queue (the fault hook's emulation of a provider that purges them at
    /// destroy; what this side already took stays).
    #[cfg(feature = "fault-injection")]
    pub(crate) fn purge(&self, qp_num: u32) {
        let mut st = self.inner.state.lock();
        let mut wcs = [WorkCompletion::default(); 64];
        while let Ok(n) = self.reap(&mut st, &mut wcs) {
            if n == 0 {
                break;
            }
            let kept: Vec<_> = wcs[..n].iter().filter(|wc| wc.qp_num != qp_num).copied().collect();
            st.backlog.extend(kept);
        }
    }

    /// Takes every completion in the device's queue into this side's
    /// backlog, where the next polls find them in order: what a queue pair
    /// about to be destroyed completed survives a provider that purges a
    /// destroyed queue pair's completions.
    pub fn stash_all(&self) {
        let mut st = self.inner.state.lock();
        let mut wcs = [WorkCompletion::default(); 64];
        while let Ok(n) = self.reap(&mut st, &mut wcs) {
            if n == 0 {
                break;
            }
            st.backlog.extend(wcs[..n].iter().copied());
        }
    }

    pub(crate) fn unread(&self, wcs: &[WorkCompletion]) {
        let mut st = self.inner.state.lock();
        for wc in wcs.iter().rev() {
            st.backlog.push_front(*wc);
        }
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_cq {
        self.inner.cq.as_ptr()
    }

    /// Reserves room for `n` more outstanding work requests; the returned
    /// guard gives it back. Room that destroyed queue pairs still owe is
    /// settled first when it is what stands in the way.
    pub(crate) fn reserve(&self, n: u32) -> Result<Reservation> {
        for settled in [false, true] {
            let needed = {
                let mut c = self.inner.committed.lock();
                let needed = *c + u64::from(n);
                if needed <= u64::from(self.inner.depth) {
                    *c = needed;
                    return Ok(Reservation { cq: self.clone(), n });
                }
                needed
            };
            // Not under `committed`: the poll lock is always taken first
            // (a poll that sees the CQ empty forgives the debt under it).
            if settled || self.inner.state.lock().debt == 0 {
                return Err(Error::CqTooSmall { depth: self.inner.depth, needed });
            }
            self.settle_debt()?;
        }
        unreachable!("the second round returns")
    }

    pub(crate) fn register(&self, qpn: u32, t: Arc<Tracker>) {
        self.inner.state.lock().trackers.insert(qpn, t);
    }

    pub(crate) fn unregister(&self, qpn: u32, t: &Arc<Tracker>) {
        self.inner.state.lock().unregister(qpn, t);
    }

    /// Lets completions here find a shared receive queue's receives.
    pub(crate) fn register_shared(&self, t: Arc<Tracker>) {
        self.inner.state.lock().shared.insert(t.tag, t);
    }

    pub(crate) fn unregister_shared(&self, t: &Arc<Tracker>) {
        self.inner.state.lock().shared.remove(&t.tag);
    }

    /// Whether both handles name one completion queue.
    pub(crate) fn same_as(&self, other: &CompletionQueue) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// Room a queue pair holds in a completion queue.
pub(crate) struct Reservation {
    cq: CompletionQueue,
    n: u32,
}

impl Reservation {
    /// For a destroyed queue pair that left work unreaped: keeps the room
    /// committed until the CQ is seen empty.
    pub(crate) fn into_debt(mut self) {
        self.cq.inner.state.lock().debt += u64::from(self.n);
        self.n = 0;
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut c = self.cq.inner.committed.lock();
        *c = c.saturating_sub(u64::from(self.n));
    }
}

/// Matches a raw completion to its posted work request, releasing what the
/// request held. `None` for completions of queue pairs already destroyed.
/// A failed stage-in becomes the completion's status instead of an error,
/// so the rest of the batch is still matched and reported.
fn translate(wc: &sys::ibv_wc, trackers: &ByNumber<u32>, shared: &ByNumber<u64>) -> Option<WorkCompletion> {
    let tag = tag_of(wc.wr_id);
    let tracker = match trackers.get(&wc.qp_num) {
        Some(t) if t.tag == tag => t,
        _ => shared.get(&tag)?,
    };
    let mut status = WcStatus::from_raw(wc.status);
    let ok = status == WcStatus::Success;
    let done = tracker.complete(wc.wr_id, ok, wc.byte_len)?;
    if ok && !done.landed {
        status = WcStatus::StageInError;
    }
    let ok = ok && status == WcStatus::Success;
    let (wr_id, posted) = (done.wr_id, done.opcode);
    let has_imm = ok && wc.wc_flags & sys::IBV_WC_WITH_IMM != 0;
    Some(WorkCompletion {
        wr_id,
        status,
        opcode: if ok { WcOpcode::from_raw(wc.opcode) } else { posted },
        byte_len: if posted == WcOpcode::Recv { wc.byte_len.saturating_sub(tracker.recv_prefix) } else { wc.byte_len },
        // SAFETY: imm_data is the active member when IBV_WC_WITH_IMM is set.
        imm: has_imm.then(|| u32::from_be(unsafe { wc.__bindgen_anon_1.imm_data })),
        qp_num: wc.qp_num,
        src_qp: wc.src_qp,
        vendor_err: wc.vendor_err,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wc::WcError;

    #[test]
    fn statuses_round_trip_with_names_and_hints() {
        for raw in 0..=21 {
            let s = WcStatus::from_raw(raw);
            assert!(!matches!(s, WcStatus::Other(_)), "status {raw} unmapped");
            assert!(s.verbs_name().starts_with("IBV_WC_"));
            assert!(!s.hint().is_empty());
        }
        assert_eq!(WcStatus::from_raw(999), WcStatus::Other(999));
    }

    /// A queue pair being dropped after the provider gave its number to a
    /// new one must not unregister the new one (whose completions would
    /// all be discarded).
    #[test]
    fn unregister_removes_only_the_same_tracker() {
        let (old, new) = (Arc::new(Tracker::for_test(1)), Arc::new(Tracker::for_test(2)));
        let mut st = PollState::default();
        st.trackers.insert(7, old.clone());
        st.trackers.insert(7, new.clone()); // number 7 reused
        st.unregister(7, &old);
        assert!(Arc::ptr_eq(&st.trackers[&7], &new));
        st.unregister(7, &new);
        assert!(st.trackers.is_empty());
    }

    /// The trackers' table under its cheap hash: numbers a provider hands
    /// out (consecutive, or equal but in the high bits) each find their
    /// own tracker, and a number never registered finds none.
    #[test]
    fn every_queue_pair_number_finds_its_own_tracker() {
        let mut st = PollState::default();
        let numbers: Vec<u32> = (0..2000).chain((1..200).map(|i| i << 20)).collect();
        for &n in &numbers {
            st.trackers.insert(n, Arc::new(Tracker::for_test(u64::from(n % 1000 + 1))));
        }
        for &n in &numbers {
            assert_eq!(st.trackers[&n].tag, Tracker::for_test(u64::from(n % 1000 + 1)).tag, "queue pair {n}");
        }
        assert!(!st.trackers.contains_key(&2000));
        assert!(!st.trackers.contains_key(&u32::MAX));
    }

    #[test]
    fn error_completion_names_status_and_hint() {
        let wc = WorkCompletion { wr_id: 9, status: WcStatus::RemoteAccessError, opcode: WcOpcode::RdmaWrite, qp_num: 0x11, ..Default::default() };
        let e = wc.ok().unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("work request 9 (RdmaWrite) on QP 0x11 failed: IBV_WC_REM_ACCESS_ERR (RemoteAccessError): the peer refused access: wrong rkey"), "{s}");
        let e = Error::from(e);
        assert!(matches!(e, Error::WorkCompletion(WcError { status: WcStatus::RemoteAccessError, .. })));
        assert_eq!(WcStatus::RetryExceeded.to_string(), "IBV_WC_RETRY_EXC_ERR (RetryExceeded)");
    }
}
