//! Reliable-connected queue pairs (`ibv_create_qp`, `ibv_modify_qp`):
//! creation and connection here, posting (`ibv_post_send`,
//! `ibv_post_recv`) in `post`, settings in `config`.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::port::{LinkLayer, Mtu};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::gid::GidChoice;
use crate::pd::ProtectionDomain;
use crate::srq::SharedReceiveQueue;
use crate::tracker::Tracker;
use crate::wire::Endpoint;
use crate::wc::WorkCompletion;
use crate::mr::LocalSlice;
use crate::wr::{RecvWr, SendList, SendTemplate, SendWr};

mod config;
mod core;
mod post;

pub(crate) use self::core::QpCore;

pub use config::{QpConfig, QpState};
pub use post::PartialPost;

struct QpInner {
    /// The verbs object and what every queue pair holds; declared first,
    /// so the queue pair is destroyed before the shared receive queue
    /// below is let go.
    core: QpCore,
    /// The extended view, when sends are posted with `ibv_wr_*`.
    qpx: Option<NonNull<sys::ibv_qp_ex>>,
    /// Whether the extended view was created with the window opcodes
    /// (without them, batches with a window request go by `ibv_post_send`).
    ex_windows: bool,
    psn: u32,
    config: QpConfig,
    /// Most SGEs per send and per receive request, as configured.
    max_sge: [u32; 2],
    /// Where its receives come from instead of its own receive queue.
    srq: Option<SharedReceiveQueue>,
}

// SAFETY: the extended view is the queue pair's own, used only under its
// send queue's lock; the rest is `QpCore`'s, which is Send and Sync.
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

/// Creates an RC queue pair: with `extended`, by `ibv_create_qp_ex` asking
/// for every send opcode the library posts (a window's bind and
/// invalidation too where the device has type-2 windows, and, should the
/// provider refuse those, without them), so sends can go through
/// `ibv_wr_*`; where the provider refuses that (no extended API, or not
/// these opcodes), or without `extended`, by `ibv_create_qp`. Returns the
/// QP, its extended view when there is one, the inline size granted, and
/// whether the extended view posts window requests.
fn create_rc(
    pd: &ProtectionDomain,
    send_cq: &CompletionQueue,
    recv_cq: &CompletionQueue,
    srq: *mut sys::ibv_srq,
    cap: sys::ibv_qp_cap,
    extended: bool,
) -> Result<Created> {
    if extended {
        let attr = pd.context().attr();
        let atomics = if attr.atomics { sys::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | sys::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD } else { 0 };
        let windows = if attr.mem_windows { sys::IBV_QP_EX_WITH_BIND_MW | sys::IBV_QP_EX_WITH_LOCAL_INV } else { 0 };
        let mut why = String::new();
        let tries = [windows, 0];
        for extra in &tries[usize::from(windows == 0)..] {
            let mut init = sys::ibv_qp_init_attr_ex {
                send_cq: send_cq.as_ptr(),
                recv_cq: recv_cq.as_ptr(),
                srq,
                cap,
                qp_type: sys::IBV_QPT_RC,
                comp_mask: sys::IBV_QP_INIT_ATTR_PD | sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                pd: pd.as_ptr(),
                send_ops_flags: u64::from(
                    sys::IBV_QP_EX_WITH_RDMA_WRITE
                        | sys::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM
                        | sys::IBV_QP_EX_WITH_SEND
                        | sys::IBV_QP_EX_WITH_SEND_WITH_IMM
                        | sys::IBV_QP_EX_WITH_RDMA_READ
                        | atomics
                        | extra,
                ),
                ..Default::default()
            };
            // SAFETY: a valid context, PD and CQs of one device; `init` is
            // fully set for the fields comp_mask names.
            let qp = unsafe { sys::ibv_create_qp_ex(pd.context().as_ptr(), &mut init) };
            why = match NonNull::new(qp) {
                // Read before anything else can overwrite errno.
                None => Error::last("ibv_create_qp_ex").to_string(),
                Some(qp) => {
                    // SAFETY: a QP made by ibv_create_qp_ex with send_ops_flags.
                    if let Some(qpx) = NonNull::new(unsafe { sys::ibv_qp_to_qp_ex(qp.as_ptr()) }) {
                        return Ok(Created { qp, qpx: Some(qpx), max_inline: init.cap.max_inline_data, ex_windows: *extra != 0 });
                    }
                    // SAFETY: just created, not shared.
                    unsafe { sys::ibv_destroy_qp(qp.as_ptr()) };
                    "the provider gives no ibv_qp_ex view".to_string()
                }
            };
        }
        tracing::debug!("{}: no extended posting ({why}); using ibv_post_send", pd.context().name());
    }
    let mut init = sys::ibv_qp_init_attr {
        send_cq: send_cq.as_ptr(),
        recv_cq: recv_cq.as_ptr(),
        cap,
        qp_type: sys::IBV_QPT_RC,
        sq_sig_all: 0,
        srq,
        ..Default::default()
    };
    // SAFETY: valid PD and CQs of the same device; `init` is fully set.
    let qp = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
    let qp = NonNull::new(qp).ok_or_else(|| Error::last("ibv_create_qp"))?;
    Ok(Created { qp, qpx: None, max_inline: init.cap.max_inline_data, ex_windows: false })
}

/// What [`create_rc`] made.
struct Created {
    qp: NonNull<sys::ibv_qp>,
    qpx: Option<NonNull<sys::ibv_qp_ex>>,
    max_inline: u32,
    ex_windows: bool,
}

impl fmt::Debug for QpInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueuePair")
            .field("device", &self.core.pd.context().name())
            .field("qp_num", &format_args!("{:#x}", self.core.qp_num))
            .field("port", &self.config.port)
            .field("gid", &format_args!("{}", self.core.gid))
            .field("active_mtu", &self.core.port.active_mtu)
            .finish()
    }
}

impl QpInner {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            qp_num: self.core.qp_num,
            psn: self.psn,
            lid: self.core.port.lid,
            gid: self.core.gid.entry.gid,
            mtu: self.core.port.active_mtu.unwrap_or(Mtu::Mtu1024),
        }
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
        self.core.modify(attr, mask)
    }

    /// `INIT` → `RTR` with `attr` (the path, the peer's QP number and PSN,
    /// the fields `mask` names) and this side's own receive settings: the
    /// RNR timer and the reads it answers, `max_dest_rd_atomic` (at least 1).
    fn to_rtr(&self, mut attr: sys::ibv_qp_attr, mask: u32, max_dest_rd_atomic: u8) -> Result<()> {
        attr.qp_state = sys::IBV_QPS_RTR;
        attr.min_rnr_timer = self.config.min_rnr_timer;
        attr.max_dest_rd_atomic = max_dest_rd_atomic.max(1);
        self.modify(&mut attr, mask | sys::IBV_QP_STATE | sys::IBV_QP_MIN_RNR_TIMER | sys::IBV_QP_MAX_DEST_RD_ATOMIC)
    }

    /// `RTR` → `RTS` with `attr` (the send PSN, the fields `mask` names)
    /// and this side's own send settings: timeout, retry counts and the
    /// reads it may have outstanding, `max_rd_atomic` (at least 1).
    fn to_rts(&self, mut attr: sys::ibv_qp_attr, mask: u32, max_rd_atomic: u8) -> Result<()> {
        let c = &self.config;
        if c.retry_cnt >= 7 && self.core.pd.context().attr().vendor_id == RXE_VENDOR_ID {
            tracing::warn!(
                retry_cnt = c.retry_cnt,
                "Soft-RoCE retries forever with retry_cnt 7: requests to a peer that died will never fail; use 6 or less"
            );
        }
        attr.qp_state = sys::IBV_QPS_RTS;
        attr.timeout = c.timeout;
        attr.retry_cnt = c.retry_cnt.min(7);
        attr.rnr_retry = c.rnr_retry.min(7);
        attr.max_rd_atomic = max_rd_atomic.max(1);
        let own = sys::IBV_QP_TIMEOUT | sys::IBV_QP_RETRY_CNT | sys::IBV_QP_RNR_RETRY | sys::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, mask | sys::IBV_QP_STATE | own)
    }
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
        Self::create_on(pd, send_cq, recv_cq, None, config)
    }

    /// As [`create`](Self::create), for a queue pair that takes its
    /// receives from `srq` instead of a receive queue of its own (its
    /// [`post_recv`](Self::post_recv) is refused; `max_recv_wr` and
    /// `max_recv_sge` are ignored). Receive completions arrive on
    /// `recv_cq`, naming this queue pair in
    /// [`WorkCompletion::qp_num`](crate::WorkCompletion::qp_num); `recv_cq`
    /// holds room for all of `srq`'s receives once, however many of its
    /// queue pairs share both.
    ///
    /// # Errors
    /// As [`create`](Self::create); [`Error::ForeignMemoryRegion`] when
    /// `srq` is of another protection domain.
    pub fn create_with_srq(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: &SharedReceiveQueue,
        config: &QpConfig,
    ) -> Result<PreparedQueuePair> {
        if !srq.pd().same_as(pd) {
            return Err(Error::ForeignMemoryRegion);
        }
        Self::create_on(pd, send_cq, recv_cq, Some(srq), config)
    }

    fn create_on(
        pd: &ProtectionDomain,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        srq: Option<&SharedReceiveQueue>,
        config: &QpConfig,
    ) -> Result<PreparedQueuePair> {
        let ctx = pd.context();
        let max_sge = ctx.attr().max_sge;
        // A queue pair on a shared receive queue has no receive queue of its own.
        let (recv_wr, recv_sge) = if srq.is_some() { (0, 0) } else { (config.max_recv_wr, config.max_recv_sge) };
        for (field, n) in [("max_send_sge", config.max_send_sge), ("max_recv_sge", recv_sge)] {
            if (n == 0 && (field == "max_send_sge" || srq.is_none())) || n > max_sge {
                return Err(Error::InvalidArgument(format!(
                    "QpConfig::{field} {n}: {} allows 1 to {max_sge} scatter/gather entries per work request (ibv_query_device max_sge)",
                    ctx.name()
                )));
            }
        }
        let cqs = [send_cq, recv_cq];
        let prepared = QpCore::prepare(pd, cqs, config.port, config.gid_index, config.max_send_wr, srq.is_none().then_some(recv_wr))?;
        if let Some(srq) = srq {
            srq.attach_cq(recv_cq)?;
        }
        let cap = sys::ibv_qp_cap {
            max_send_wr: config.max_send_wr,
            max_recv_wr: recv_wr,
            max_send_sge: config.max_send_sge,
            max_recv_sge: recv_sge,
            max_inline_data: config.max_inline_data,
        };
        let srq_ptr = srq.map_or(std::ptr::null_mut(), SharedReceiveQueue::as_ptr);
        let Created { qp, qpx, max_inline, ex_windows } = create_rc(pd, send_cq, recv_cq, srq_ptr, cap, config.extended_posting)?;
        // The provider may round the depths up; ours stay as requested so
        // QueueFull fires before the provider's ENOMEM would.
        let tracker = Arc::new(Tracker::new(config.max_send_wr, recv_wr, pd.inner.stages_in.clone()));
        let inner = QpInner {
            core: QpCore::adopt(qp, pd, cqs, tracker, prepared, max_inline),
            qpx,
            ex_windows,
            psn: random_psn(),
            config: config.clone(),
            max_sge: [config.max_send_sge, recv_sge],
            srq: srq.cloned(),
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
        &self.inner.core.gid
    }

    /// The largest payload [`SendWr::inline`] accepts here.
    pub fn max_inline_data(&self) -> u32 {
        self.inner.core.max_inline
    }

    /// Whether sends are posted through the extended API (`ibv_wr_*`):
    /// asked for by [`QpConfig::extended_posting`] and granted by the
    /// provider. Batches with a request of several slices go by
    /// `ibv_post_send` regardless.
    pub fn extended_posting(&self) -> bool {
        self.inner.qpx.is_some()
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
        self.inner.post_send(wrs)
    }

    /// Posts `wrs` in order, as many at a time as the send queue has room
    /// for, where [`post_send`](Self::post_send) would refuse the whole
    /// list with [`Error::QueueFull`]: while the queue is full it reaps the
    /// send completion queue, handing every completion it reaps to
    /// `on_completion` (failed ones too, and those of other queue pairs
    /// that share the CQ), until a completion frees room. Each request's
    /// memory is held until its completion is reaped, as with `post_send`.
    ///
    /// Room frees only when a signaled request completes (an unsignaled
    /// one is released with the next signaled one), so signal at least one
    /// request in every [`max_send_wr`](QpConfig::max_send_wr); a queue
    /// full of unsignaled requests is an error, not a wait forever. The
    /// completions of the requests posted last are still to come when this
    /// returns: reap them as usual.
    ///
    /// ```
    /// # fn f(qp: &gpudirect::QueuePair, src: &gpudirect::MemoryRegion, dst: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
    /// use gpudirect::SendWr;
    /// // 10,000 writes of 64 bytes, every 32nd signaled, on a queue of any depth.
    /// let wrs = (0..10_000u64)
    ///     .map(|i| {
    ///         let wr = SendWr::write(src.slice(0..64)?, dst, 64 * (i % 64))?.wr_id(i);
    ///         Ok(if i % 32 == 31 { wr } else { wr.unsignaled() })
    ///     })
    ///     .collect::<gpudirect::Result<Vec<_>>>()?;
    /// let mut done = 0;
    /// qp.post_send_all(&wrs, Some(std::time::Duration::from_secs(5)), |wc| {
    ///     wc.ok()?;
    ///     done += 1;
    ///     Ok(())
    /// })?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// A [`PartialPost`] saying how many requests were posted and why it
    /// stopped: what [`post_send`](Self::post_send) returns for a batch,
    /// what `on_completion` returns, [`Error::Timeout`] when no room freed
    /// for `timeout` (`None`: no limit), [`Error::InvalidArgument`] for a
    /// queue full of unsignaled requests, or an error waiting on the CQ.
    pub fn post_send_all(
        &self,
        wrs: &[SendWr<'_>],
        timeout: Option<std::time::Duration>,
        on_completion: impl FnMut(WorkCompletion) -> Result<()>,
    ) -> std::result::Result<(), PartialPost> {
        self.inner.post_send_all(wrs, timeout, on_completion)
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
        self.inner.post_list(list)
    }

    /// Posts `template` aimed at `local` (one slice of a region of this
    /// queue pair's domain), the peer's `remote_addr` with `rkey` (as the
    /// peer handed them out: its NIC checks them against its keys), with
    /// immediate data `imm` (for the templates that carry it) and id
    /// `wr_id`. The memory is held as [`post_send`](Self::post_send) holds
    /// it; a host-staged GPU source is staged as `post_send` stages it.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send): [`Error::ForeignMemoryRegion`],
    /// [`Error::TooLong`] past 4 GiB, [`Error::QueueFull`], [`Error::Busy`],
    /// [`Error::Verb`].
    #[inline]
    pub fn post_aimed(&self, template: &SendTemplate, local: LocalSlice<'_>, remote_addr: u64, rkey: u32, imm: u32, wr_id: u64) -> Result<()> {
        self.inner.post_aimed(template, local, remote_addr, rkey, imm, wr_id)
    }

    /// Posts a batch of receives with one call. See
    /// [`PreparedQueuePair::post_recv`].
    ///
    /// # Errors
    /// As [`PreparedQueuePair::post_recv`].
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        self.inner.post_recv(wrs)
    }

    /// Moves the queue pair to the error state (`ibv_modify_qp` to
    /// `IBV_QPS_ERR`): it sends and receives nothing more, and its work
    /// requests not yet completed complete flushed. Before destroying a
    /// queue pair whose receives come from a shared receive queue, this,
    /// then reaping its completions, keeps what it received (a provider
    /// may drop a destroyed queue pair's completions not yet polled).
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_modify_qp`.
    pub fn move_to_error(&self) -> Result<()> {
        // SAFETY: an all-zero ibv_qp_attr is valid; only qp_state is read.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = sys::IBV_QPS_ERR;
        self.inner.core.modify(&mut attr, sys::IBV_QP_STATE)
    }

    /// The current state (`ibv_query_qp`); [`QpState::Error`] after a
    /// failed work request.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_query_qp`.
    pub fn state(&self) -> Result<QpState> {
        Ok(match self.inner.core.query(sys::IBV_QP_STATE)?.qp_state {
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
        &self.inner.core.gid
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

    /// The device, port and QP number rdma_cm must connect.
    #[cfg(feature = "rdmacm")]
    pub(crate) fn cm_target(&self) -> (&str, u8, u32) {
        (self.inner.core.pd.context().name(), self.inner.config.port, self.inner.core.qp_num)
    }

    /// The transport and RNR retry counts rdma_cm passes on.
    #[cfg(feature = "rdmacm")]
    pub(crate) fn retries(&self) -> (u8, u8) {
        (self.inner.config.retry_cnt, self.inner.config.rnr_retry)
    }

    /// The initiator depth (`max_rd_atomic`) and responder resources
    /// (`max_dest_rd_atomic`) this side offers: the configured value
    /// within the device's limits.
    pub(crate) fn rd_atomic(&self) -> (u8, u8) {
        let (c, dev) = (&self.inner.config, self.inner.core.pd.context().attr());
        (
            c.max_rd_atomic.min(dev.max_qp_init_rd_atom.min(255) as u8).max(1),
            c.max_rd_atomic.min(dev.max_qp_rd_atom.min(255) as u8).max(1),
        )
    }

    /// Connects with the attributes rdma_cm negotiated (`rdma_init_qp_attr`
    /// for `RTR` and `RTS`: the path, the peer's QP number, both PSNs),
    /// keeping this side's own settings (MTU cap, RNR timer, retries,
    /// timeout) and the read/atomic depths agreed in the exchange.
    #[cfg(feature = "rdmacm")]
    pub(crate) fn connect_negotiated(
        self,
        (mut rtr, rtr_mask): (sys::ibv_qp_attr, u32),
        (rts, rts_mask): (sys::ibv_qp_attr, u32),
        (max_rd_atomic, max_dest_rd_atomic): (u8, u8),
    ) -> Result<QueuePair> {
        let mut inner = self.inner;
        let cm_mtu = Mtu::from_raw(rtr.path_mtu).unwrap_or(Mtu::Mtu1024);
        let mtu = inner.config.mtu.map_or(cm_mtu, |m| m.min(cm_mtu));
        rtr.path_mtu = mtu.to_raw();
        inner.to_rtr(rtr, rtr_mask | sys::IBV_QP_PATH_MTU, max_dest_rd_atomic)?;
        inner.to_rts(rts, rts_mask, max_rd_atomic)?;
        inner.psn = rts.sq_psn;
        let ah = &rtr.ah_attr;
        if ah.is_global != 0 && u32::from(ah.grh.sgid_index) != inner.core.gid.entry.index {
            let index = u32::from(ah.grh.sgid_index);
            if let Some(entry) = inner.core.pd.context().gid_table(inner.config.port)?.into_iter().find(|e| e.index == index) {
                inner.core.gid = GidChoice { entry, reason: "chosen by rdma_cm for the route's source address" };
            }
        }
        // SAFETY: reading the GID union's byte view, valid for any value.
        let dgid = unsafe { ah.grh.dgid.raw };
        let remote = Endpoint { qp_num: rtr.dest_qp_num, psn: rtr.rq_psn, lid: ah.dlid, gid: crate::gid::Gid(dgid), mtu };
        tracing::info!(local = %inner.endpoint(), remote = %remote, %mtu, gid = %inner.core.gid, "queue pair connected by rdma_cm");
        Ok(QueuePair { inner, remote })
    }

    /// Connects to the peer: `INIT` → `RTR` → `RTS`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an endpoint that cannot be valid (a
    /// QP number or PSN over 24 bits, no LID on an InfiniBand port), and
    /// [`Error::Verb`] from `ibv_modify_qp`.
    pub fn connect(self, remote: &Endpoint) -> Result<QueuePair> {
        let (initiator, responder) = self.rd_atomic();
        let inner = self.inner;
        if remote.qp_num > 0xff_ffff || remote.psn > 0xff_ffff {
            return Err(Error::InvalidArgument(format!("peer endpoint out of range: {remote}")));
        }
        let ethernet = inner.core.port.link_layer == LinkLayer::Ethernet;
        if !ethernet && remote.lid == 0 {
            return Err(Error::InvalidArgument(format!("peer endpoint has no LID on an InfiniBand port: {remote}")));
        }
        let c = &inner.config;
        let local_mtu = inner.core.port.active_mtu.unwrap_or(Mtu::Mtu1024);
        let mtu = [Some(local_mtu), Some(remote.mtu), c.mtu].into_iter().flatten().min().unwrap_or(local_mtu);
        let mut attr = sys::ibv_qp_attr {
            path_mtu: mtu.to_raw(),
            dest_qp_num: remote.qp_num,
            rq_psn: remote.psn,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.sl = c.service_level;
        attr.ah_attr.port_num = c.port;
        if ethernet {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = remote.gid.0;
            attr.ah_attr.grh.sgid_index = inner.core.gid.entry.index as u8;
            attr.ah_attr.grh.hop_limit = c.hop_limit;
            attr.ah_attr.grh.traffic_class = c.traffic_class;
        }
        let path = sys::IBV_QP_AV | sys::IBV_QP_PATH_MTU | sys::IBV_QP_DEST_QPN | sys::IBV_QP_RQ_PSN;
        inner.to_rtr(attr, path, responder)?;
        let attr = sys::ibv_qp_attr { sq_psn: inner.psn, ..Default::default() };
        inner.to_rts(attr, sys::IBV_QP_SQ_PSN, initiator)?;
        tracing::info!(local = %inner.endpoint(), remote = %remote, %mtu, gid = %inner.core.gid, "queue pair connected");
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
    fn psn_fits_24_bits() {
        assert!(random_psn() <= 0xff_ffff);
    }
}
