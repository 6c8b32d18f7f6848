//! Unreliable-datagram queue pairs (`IBV_QPT_UD`) and the address handles
//! (`ibv_create_ah`) their sends name: one queue pair talks to any number
//! of peers, one message of at most the path MTU at a time, with no
//! connection and no delivery guarantee.

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::gid::GidChoice;
use crate::mr::{AccessFlags, MemoryRegion, SgList};
use crate::pd::ProtectionDomain;
use crate::qp::QpCore;
use crate::sync::Mutex;
use crate::port::{LinkLayer, Mtu};
use crate::tracker::{finish_post, posted_count, Pending, Tracker, RECV_BIT, SEQ_MASK};
use crate::wc::WcOpcode;
use crate::wire::Endpoint;
use crate::wr::RecvWr;

/// Bytes of the Global Routing Header that a UD receive gets in front of
/// the message (always on RoCE). The library receives it into memory of its
/// own and reports only the message: `byte_len` excludes it.
pub const GRH_LEN: usize = 40;

/// UD queue pair settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UdConfig {
    /// Port number (from 1).
    pub port: u8,
    /// GID index override; `None` chooses by [`crate::choose_gid`].
    pub gid_index: Option<u32>,
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Largest inline payload ([`UdSendWr::inline`]); 0 disables inline.
    pub max_inline_data: u32,
    /// The Q_Key: a receiver takes only datagrams that carry its own, and
    /// this queue pair's sends carry the peer's (given to
    /// [`AddressHandle::new`]). The high bit marks privileged keys, which
    /// only the kernel may send.
    pub qkey: u32,
}

impl Default for UdConfig {
    fn default() -> Self {
        UdConfig { port: 1, gid_index: None, max_send_wr: 128, max_recv_wr: 128, max_inline_data: 0, qkey: 0x1111_1111 }
    }
}

struct AhInner {
    ah: NonNull<sys::ibv_ah>,
    pd: ProtectionDomain,
    qp_num: u32,
    qkey: u32,
    /// Largest message the path carries.
    max_message: usize,
}

// SAFETY: an address handle is immutable once created; verbs using it are thread-safe.
unsafe impl Send for AhInner {}
// SAFETY: as above.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: created by ibv_create_ah, destroyed once; no posted send
        // still names it (each holds a handle until its completion).
        let ret = unsafe { sys::ibv_destroy_ah(self.ah.as_ptr()) };
        if ret != 0 {
            tracing::warn!("{}", Error::returned("ibv_destroy_ah", ret));
        }
    }
}

/// Where a UD send goes: the path to a peer's port (GID, or LID on
/// InfiniBand) and its queue pair number and Q_Key. Cheap to clone.
#[derive(Clone)]
pub struct AddressHandle {
    inner: Arc<AhInner>,
}

impl fmt::Debug for AddressHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AddressHandle")
            .field("qp_num", &format_args!("{:#x}", self.inner.qp_num))
            .field("max_message", &self.inner.max_message)
            .finish()
    }
}

impl AddressHandle {
    /// An address handle from `qp`'s port to the peer `remote` (its UD
    /// queue pair's [`endpoint`](UdQueuePair::endpoint)), whose Q_Key is
    /// `qkey`. On RoCE the route is global (GID, hop limit 64, RoCE v2 when
    /// `qp`'s GID is); messages are bounded by the smaller of both ends'
    /// MTU.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a QP number over 24 bits or no LID on
    /// InfiniBand; [`Error::Verb`] from `ibv_create_ah`.
    pub fn new(qp: &UdQueuePair, remote: &Endpoint, qkey: u32) -> Result<AddressHandle> {
        let q = &qp.inner;
        if remote.qp_num > 0xff_ffff {
            return Err(Error::InvalidArgument(format!("peer endpoint out of range: {remote}")));
        }
        let ethernet = q.core.port.link_layer == LinkLayer::Ethernet;
        if !ethernet && remote.lid == 0 {
            return Err(Error::InvalidArgument(format!("peer endpoint has no LID on an InfiniBand port: {remote}")));
        }
        let mut attr = sys::ibv_ah_attr { dlid: remote.lid, port_num: q.config.port, ..Default::default() };
        if ethernet {
            attr.is_global = 1;
            attr.grh.dgid.raw = remote.gid.0;
            attr.grh.sgid_index = q.core.gid.entry.index as u8;
            attr.grh.hop_limit = 64;
        }
        // SAFETY: valid PD; `attr` is fully set.
        let ah = unsafe { sys::ibv_create_ah(q.core.pd.as_ptr(), &mut attr) };
        let ah = NonNull::new(ah).ok_or_else(|| Error::last("ibv_create_ah"))?;
        let mtu = q.mtu().min(remote.mtu);
        Ok(AddressHandle {
            inner: Arc::new(AhInner { ah, pd: q.core.pd.clone(), qp_num: remote.qp_num, qkey, max_message: mtu.bytes() as usize }),
        })
    }

    /// The largest message a send to this peer may carry (the path MTU).
    pub fn max_message(&self) -> usize {
        self.inner.max_message
    }
}

/// A UD send (with or without immediate data) to the peer an
/// [`AddressHandle`] names. There is no other way to make one, so a UD
/// send without an address cannot be written:
///
/// ```compile_fail,E0061
/// # fn f(qp: &gpudirect::UdQueuePair, mr: &gpudirect::MemoryRegion) -> gpudirect::Result<()> {
/// qp.post_send(&[gpudirect::UdSendWr::send(mr.slice(0..64)?)])?; // no address handle
/// # Ok(()) }
/// ```
///
/// nor can an RC request go to a UD queue pair (E0308, mismatched types):
///
/// ```compile_fail,E0308
/// # fn f(qp: &gpudirect::UdQueuePair, mr: &gpudirect::MemoryRegion) -> gpudirect::Result<()> {
/// qp.post_send(&[gpudirect::SendWr::send(mr.slice(0..64)?)])?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct UdSendWr<'a> {
    wr_id: u64,
    to: &'a AddressHandle,
    local: SgList<'a>,
    imm: Option<u32>,
    signaled: bool,
    inline: bool,
}

impl<'a> UdSendWr<'a> {
    /// A datagram of `local`'s bytes to `to`.
    pub fn send(to: &'a AddressHandle, local: impl Into<SgList<'a>>) -> Self {
        UdSendWr { wr_id: 0, to, local: local.into(), imm: None, signaled: true, inline: false }
    }

    /// A datagram carrying 32 bits of immediate data too.
    pub fn send_with_imm(to: &'a AddressHandle, local: impl Into<SgList<'a>>, imm: u32) -> Self {
        UdSendWr { imm: Some(imm), ..Self::send(to, local) }
    }

    crate::wr::send_options!();
}

struct UdInner {
    /// The verbs object and what every queue pair holds.
    core: QpCore,
    config: UdConfig,
    /// One GRH slot per receive-queue entry; receive `seq` uses slot
    /// `seq % max_recv_wr` (at most that many are outstanding, with
    /// consecutive numbers, so no two share one).
    grh: MemoryRegion,
    /// Every address handle a send named, by identity, destroyed only
    /// after the queue pair (so never under a send in flight).
    ahs: Mutex<HashMap<usize, AddressHandle>>,
}

impl Drop for UdInner {
    fn drop(&mut self) {
        // The queue pair goes first: the NIC writes the GRH slots and reads
        // the handles until it is destroyed.
        if !self.core.destroy() {
            // It may still do so.
            std::mem::forget(self.grh.clone());
            std::mem::forget(std::mem::take(&mut *self.ahs.lock()));
        }
    }
}

impl UdInner {
    fn mtu(&self) -> Mtu {
        self.core.port.active_mtu.unwrap_or(Mtu::Mtu1024)
    }
}

/// An unreliable-datagram queue pair, ready to send and receive once
/// created (`RTS`): no connection, one queue pair for any number of peers.
///
/// Each receive takes one datagram; the library receives the 40-byte GRH
/// in front of it into memory of its own, so a receive names only room
/// for the message and its completion's `byte_len` is the message's. A
/// receive completion's [`src_qp`](crate::WorkCompletion::src_qp) is the
/// sender's queue pair. Datagrams are not acknowledged: one to a peer
/// without a receive posted, or with another Q_Key, is dropped silently.
///
/// # Thread safety
/// As [`QueuePair`](crate::QueuePair): several threads may post; each
/// batch is posted whole.
pub struct UdQueuePair {
    inner: UdInner,
}

impl fmt::Debug for UdQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UdQueuePair")
            .field("device", &self.inner.core.pd.context().name())
            .field("qp_num", &format_args!("{:#x}", self.inner.core.qp_num))
            .field("gid", &format_args!("{}", self.inner.core.gid))
            .finish()
    }
}

impl UdQueuePair {
    /// Creates a UD queue pair in `pd` and brings it to `RTS`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for CQs of another device;
    /// [`Error::CqTooSmall`]; [`Error::Gid`] / [`Error::InvalidPort`];
    /// [`Error::Verb`] from `ibv_create_qp` or `ibv_modify_qp`.
    pub fn create(pd: &ProtectionDomain, send_cq: &CompletionQueue, recv_cq: &CompletionQueue, config: &UdConfig) -> Result<UdQueuePair> {
        if config.max_recv_wr == 0 {
            return Err(Error::InvalidArgument("UdConfig::max_recv_wr must be at least 1".into()));
        }
        let cqs = [send_cq, recv_cq];
        let prepared = QpCore::prepare(pd, cqs, config.port, config.gid_index, config.max_send_wr, Some(config.max_recv_wr))?;
        let grh = MemoryRegion::alloc(pd, config.max_recv_wr as usize * GRH_LEN, AccessFlags::LOCAL_WRITE)?;
        let mut init = sys::ibv_qp_init_attr {
            send_cq: send_cq.as_ptr(),
            recv_cq: recv_cq.as_ptr(),
            cap: sys::ibv_qp_cap {
                max_send_wr: config.max_send_wr,
                max_recv_wr: config.max_recv_wr,
                max_send_sge: 1,
                // The GRH slot, then the message's slice.
                max_recv_sge: 2,
                max_inline_data: config.max_inline_data,
            },
            qp_type: sys::IBV_QPT_UD,
            ..Default::default()
        };
        // SAFETY: valid PD and CQs of the same device; `init` is fully set.
        let qp = unsafe { sys::ibv_create_qp(pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| Error::last("ibv_create_qp"))?;
        let tracker = Arc::new(Tracker::new(config.max_send_wr, config.max_recv_wr, pd.inner.stages_in.clone()).with_recv_prefix(GRH_LEN as u32));
        let inner = UdInner {
            core: QpCore::adopt(qp, pd, cqs, tracker, prepared, init.cap.max_inline_data),
            config: config.clone(),
            grh,
            ahs: Mutex::new(HashMap::new()),
        };
        let mut attr = sys::ibv_qp_attr { qp_state: sys::IBV_QPS_INIT, port_num: config.port, qkey: config.qkey, ..Default::default() };
        inner.core.modify(&mut attr, sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_QKEY)?;
        inner.core.modify(&mut sys::ibv_qp_attr { qp_state: sys::IBV_QPS_RTR, ..Default::default() }, sys::IBV_QP_STATE)?;
        let mut attr = sys::ibv_qp_attr { qp_state: sys::IBV_QPS_RTS, sq_psn: 0, ..Default::default() };
        inner.core.modify(&mut attr, sys::IBV_QP_STATE | sys::IBV_QP_SQ_PSN)?;
        tracing::debug!(qp = ?inner.core.qp_num, gid = %inner.core.gid, "created UD queue pair");
        Ok(UdQueuePair { inner })
    }

    /// This queue pair's endpoint, for peers' [`AddressHandle`]s.
    pub fn endpoint(&self) -> Endpoint {
        let q = &self.inner;
        Endpoint { qp_num: q.core.qp_num, psn: 0, lid: q.core.port.lid, gid: q.core.gid.entry.gid, mtu: q.mtu() }
    }

    /// The GID this queue pair sends from, and why it was chosen.
    pub fn gid(&self) -> &GidChoice {
        &self.inner.core.gid
    }

    /// Posts a batch of datagrams with one call. Each one's memory is held
    /// until its completion is reaped (an inline one's only during the post).
    ///
    /// # Errors
    /// Nothing is posted when a message is longer than its path's MTU
    /// ([`Error::TooLong`]), an address handle or region is of another
    /// protection domain ([`Error::ForeignMemoryRegion`]), a request has
    /// several slices or is inline beyond `max_inline_data` or from GPU
    /// memory ([`Error::InvalidArgument`]), the queue is full
    /// ([`Error::QueueFull`]) or a range is busy ([`Error::Busy`]);
    /// [`Error::Verb`] from `ibv_post_send` (the requests before the
    /// refused one were posted).
    pub fn post_send(&self, wrs: &[UdSendWr<'_>]) -> Result<()> {
        let q = &self.inner;
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        for wr in wrs {
            if !wr.to.inner.pd.same_as(&q.core.pd) {
                return Err(Error::ForeignMemoryRegion);
            }
            wr.local.check(&q.core.pd)?;
            if wr.local.len() > wr.to.inner.max_message {
                return Err(Error::TooLong(wr.local.len() as u64));
            }
            if wr.local.gather_sges() > 0 {
                return Err(Error::InvalidArgument("a UD send carries one slice".into()));
            }
            if wr.inline && (wr.local.len() > q.core.max_inline as usize || !wr.local.cpu_addressable()) {
                return Err(Error::InvalidArgument(format!(
                    "an inline datagram is copied by the CPU, at most {} bytes (UdConfig::max_inline_data) of host memory",
                    q.core.max_inline
                )));
            }
        }
        let mut guard = q.core.tracker.send.lock();
        let wq = &mut *guard;
        wq.room_for(n, "send")?;
        let (first_seq, kept) = (wq.next_seq, wq.pending.len());
        wq.scratch.fit_send(n, 0);
        let (chain, sges) = (wq.scratch.send.as_mut_ptr(), wq.scratch.sges.as_mut_ptr());
        let mut none: &mut [sys::ibv_sge] = &mut [];
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            let opcode = WcOpcode::Send;
            wq.enter(kept, wr.local.claim(false), |hold| Pending { seq, wr_id: wr.wr_id, opcode, signaled: wr.signaled, hold })?;
            // SAFETY: fit_send made room for `n` slots of each; `i < n`;
            // `i + 1` is at most one past the end and never dereferenced
            // (the last link is set to NULL after the loop).
            let (raw, sg) = unsafe { (&mut *chain.add(i), &mut *sges.add(i)) };
            // SAFETY: as above.
            raw.next = unsafe { chain.add(i + 1) };
            raw.wr_id = q.core.tracker.tag | seq;
            (raw.opcode, raw.__bindgen_anon_1.imm_data) = match wr.imm {
                Some(imm) => (sys::IBV_WR_SEND_WITH_IMM, imm.to_be()),
                None => (sys::IBV_WR_SEND, 0),
            };
            raw.send_flags = (if wr.signaled { sys::IBV_SEND_SIGNALED } else { 0 }) | if wr.inline { sys::IBV_SEND_INLINE } else { 0 };
            raw.wr.ud = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_3 {
                ah: wr.to.inner.ah.as_ptr(),
                remote_qpn: wr.to.inner.qp_num,
                remote_qkey: wr.to.inner.qkey,
            };
            (raw.sg_list, raw.num_sge) = wr.local.write_sges(sg, &mut none);
        }
        let chain = &mut wq.scratch.send[..n];
        chain[n - 1].next = std::ptr::null_mut();
        let mut bad = std::ptr::null_mut();
        // SAFETY: a valid, NULL-terminated chain whose SGEs name registered
        // memory the pending entries hold, and address handles the requests
        // borrow (kept alive below until their completions).
        let ret = unsafe { sys::ibv_post_send(q.core.qp.as_ptr(), chain.as_mut_ptr(), &mut bad) };
        let posted = posted_count(ret, bad, chain);
        // Inline payloads were copied: nothing of theirs stays held.
        for (p, wr) in wq.pending.iter_mut().skip(kept).zip(wrs).take(posted) {
            if wr.inline {
                p.hold = crate::mr::Hold::None;
            }
        }
        // The handles must outlive the sends that name them: each one used
        // here is kept for the queue pair's life (one per peer).
        let mut ahs = q.ahs.lock();
        for wr in &wrs[..posted] {
            ahs.entry(Arc::as_ptr(&wr.to.inner) as usize).or_insert_with(|| wr.to.clone());
        }
        drop(ahs);
        finish_post(wq, n, posted, "ibv_post_send", ret)
    }

    /// Posts a batch of receives, each for one datagram of at most its
    /// slice's length (the GRH goes into the library's own memory).
    ///
    /// # Errors
    /// [`Error::QueueFull`], [`Error::ForeignMemoryRegion`],
    /// [`Error::InvalidArgument`] for a receive of several slices,
    /// [`Error::Busy`]; [`Error::Verb`] from `ibv_post_recv`.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        let q = &self.inner;
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        for wr in wrs {
            wr.local.check(&q.core.pd)?;
            if wr.local.gather_sges() > 0 {
                return Err(Error::InvalidArgument("a UD receive takes one slice (after the GRH the library receives)".into()));
            }
        }
        let depth = u64::from(q.config.max_recv_wr);
        let mut guard = q.core.tracker.recv.lock();
        let wq = &mut *guard;
        wq.room_for(n, "receive")?;
        let (first_seq, kept) = (wq.next_seq, wq.pending.len());
        // Two SGEs per receive, in the gather space: the GRH slot, then the message's.
        wq.scratch.fit_recv(n, 2 * n);
        let s = &mut wq.scratch;
        let (chain, sges) = (s.recv.as_mut_ptr(), s.gather.as_mut_ptr());
        for (i, wr) in wrs.iter().enumerate() {
            let seq = (first_seq + i as u64) & SEQ_MASK;
            wq.enter(kept, wr.local.claim(true), |hold| Pending { seq, wr_id: wr.wr_id, opcode: WcOpcode::Recv, signaled: true, hold })?;
            let slot = (seq % depth) as usize * GRH_LEN;
            // SAFETY: fit_recv made `n` chain slots and `2n` gather entries;
            // `i < n`, and `i + 1` is never dereferenced (see post_send).
            let (raw, pair) = unsafe { (&mut *chain.add(i), std::slice::from_raw_parts_mut(sges.add(2 * i), 2)) };
            // SAFETY: as above.
            raw.next = unsafe { chain.add(i + 1) };
            raw.wr_id = RECV_BIT | q.core.tracker.tag | seq;
            pair[0] = sys::ibv_sge { addr: q.grh.addr() + slot as u64, length: GRH_LEN as u32, lkey: q.grh.lkey() };
            let k = match wr.local.one().filter(|s| !s.is_empty()) {
                Some(s) => {
                    pair[1] = s.sge();
                    2
                }
                None => 1,
            };
            (raw.sg_list, raw.num_sge) = (pair.as_mut_ptr(), k);
        }
        let chain = &mut wq.scratch.recv[..n];
        chain[n - 1].next = std::ptr::null_mut();
        let mut bad = std::ptr::null_mut();
        // SAFETY: a valid, NULL-terminated chain whose SGEs name the GRH
        // slots (registered, owned by the queue pair) and memory the
        // pending entries hold.
        let ret = unsafe { sys::ibv_post_recv(q.core.qp.as_ptr(), chain.as_mut_ptr(), &mut bad) };
        let posted = posted_count(ret, bad, chain);
        finish_post(wq, n, posted, "ibv_post_recv", ret)
    }
}
