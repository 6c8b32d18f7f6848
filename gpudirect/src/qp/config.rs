//! Queue pair settings and states: plain data, read by `qp` and by users.

use crate::mr::AccessFlags;
use crate::port::Mtu;

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
    /// Largest inline payload ([`SendWr::inline`](crate::SendWr::inline)); 0 disables inline.
    pub max_inline_data: u32,
    /// Most scatter/gather entries (non-empty slices of an [`SgList`](crate::SgList)) in
    /// one send-queue request; 1 to the device's
    /// [`max_sge`](crate::DeviceAttr::max_sge). RDMA reads are further
    /// bounded by [`max_sge_rd`](crate::DeviceAttr::max_sge_rd).
    pub max_send_sge: u32,
    /// Most scatter/gather entries in one receive; 1 to the device's
    /// [`max_sge`](crate::DeviceAttr::max_sge).
    pub max_recv_sge: u32,
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
    /// Post sends through the extended API (`ibv_create_qp_ex`, then
    /// `ibv_wr_start` / `ibv_wr_*` / `ibv_wr_complete`) where the provider
    /// has it, instead of `ibv_post_send`. On by default: it costs fewer
    /// user-space instructions per message (on Soft-RoCE, see
    /// docs/performance.md). A provider without it gets `ibv_post_send`
    /// either way; so do a batch with a request of several slices and a
    /// prepared [`SendList`](crate::SendList) of more than four requests
    /// (reposting its written chain is cheaper there).
    pub extended_posting: bool,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            port: 1,
            gid_index: None,
            max_send_wr: 128,
            max_recv_wr: 128,
            max_inline_data: 0,
            max_send_sge: 1,
            max_recv_sge: 1,
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
            extended_posting: true,
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
