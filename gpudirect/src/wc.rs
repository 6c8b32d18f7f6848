//! Work completions (`struct ibv_wc`): what a completion queue reports,
//! as plain data. A leaf: the error type, completion queues and work
//! requests all name these.

use std::fmt;

use gpudirect_sys as sys;

/// The status of a work completion (`enum ibv_wc_status`), named as in the
/// verbs man page without the `IBV_WC_` prefix and `_ERR` suffix spelled out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success,
    /// `IBV_WC_LOC_LEN_ERR`.
    LocalLengthError,
    /// `IBV_WC_LOC_QP_OP_ERR`.
    LocalQpOperationError,
    /// `IBV_WC_LOC_EEC_OP_ERR`.
    LocalEecOperationError,
    /// `IBV_WC_LOC_PROT_ERR`.
    LocalProtectionError,
    /// `IBV_WC_WR_FLUSH_ERR`.
    WrFlushError,
    /// `IBV_WC_MW_BIND_ERR`.
    MwBindError,
    /// `IBV_WC_BAD_RESP_ERR`.
    BadResponseError,
    /// `IBV_WC_LOC_ACCESS_ERR`.
    LocalAccessError,
    /// `IBV_WC_REM_INV_REQ_ERR`.
    RemoteInvalidRequestError,
    /// `IBV_WC_REM_ACCESS_ERR`.
    RemoteAccessError,
    /// `IBV_WC_REM_OP_ERR`.
    RemoteOperationError,
    /// `IBV_WC_RETRY_EXC_ERR`.
    RetryExceeded,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`.
    RnrRetryExceeded,
    /// `IBV_WC_LOC_RDD_VIOL_ERR`.
    LocalRddViolationError,
    /// `IBV_WC_REM_INV_RD_REQ_ERR`.
    RemoteInvalidRdRequestError,
    /// `IBV_WC_REM_ABORT_ERR`.
    RemoteAbortError,
    /// `IBV_WC_INV_EECN_ERR`.
    InvalidEecnError,
    /// `IBV_WC_INV_EEC_STATE_ERR`.
    InvalidEecStateError,
    /// `IBV_WC_FATAL_ERR`.
    FatalError,
    /// `IBV_WC_RESP_TIMEOUT_ERR`.
    ResponseTimeoutError,
    /// `IBV_WC_GENERAL_ERR`.
    GeneralError,
    /// Not a verbs status: the NIC completed a receive or RDMA read into a
    /// host-staged GPU region ([`RegistrationPath::HostStaged`](crate::RegistrationPath::HostStaged)),
    /// but copying the bytes from the host mirror to the GPU failed, so
    /// the GPU memory does not hold them (the CUDA error is logged). Also
    /// reported on a later signaled completion when the copy of an earlier
    /// unsignaled RDMA read failed.
    StageInError,
    /// A status this library does not know.
    Other(u32),
}

impl WcStatus {
    /// From `enum ibv_wc_status`.
    pub fn from_raw(s: u32) -> WcStatus {
        use WcStatus::*;
        match s {
            sys::IBV_WC_SUCCESS => Success,
            sys::IBV_WC_LOC_LEN_ERR => LocalLengthError,
            sys::IBV_WC_LOC_QP_OP_ERR => LocalQpOperationError,
            sys::IBV_WC_LOC_EEC_OP_ERR => LocalEecOperationError,
            sys::IBV_WC_LOC_PROT_ERR => LocalProtectionError,
            sys::IBV_WC_WR_FLUSH_ERR => WrFlushError,
            sys::IBV_WC_MW_BIND_ERR => MwBindError,
            sys::IBV_WC_BAD_RESP_ERR => BadResponseError,
            sys::IBV_WC_LOC_ACCESS_ERR => LocalAccessError,
            sys::IBV_WC_REM_INV_REQ_ERR => RemoteInvalidRequestError,
            sys::IBV_WC_REM_ACCESS_ERR => RemoteAccessError,
            sys::IBV_WC_REM_OP_ERR => RemoteOperationError,
            sys::IBV_WC_RETRY_EXC_ERR => RetryExceeded,
            sys::IBV_WC_RNR_RETRY_EXC_ERR => RnrRetryExceeded,
            sys::IBV_WC_LOC_RDD_VIOL_ERR => LocalRddViolationError,
            sys::IBV_WC_REM_INV_RD_REQ_ERR => RemoteInvalidRdRequestError,
            sys::IBV_WC_REM_ABORT_ERR => RemoteAbortError,
            sys::IBV_WC_INV_EECN_ERR => InvalidEecnError,
            sys::IBV_WC_INV_EEC_STATE_ERR => InvalidEecStateError,
            sys::IBV_WC_FATAL_ERR => FatalError,
            sys::IBV_WC_RESP_TIMEOUT_ERR => ResponseTimeoutError,
            sys::IBV_WC_GENERAL_ERR => GeneralError,
            other => Other(other),
        }
    }

    /// The C name, as `ibv_wc_status_str` and the man pages spell it.
    pub fn verbs_name(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "IBV_WC_SUCCESS",
            LocalLengthError => "IBV_WC_LOC_LEN_ERR",
            LocalQpOperationError => "IBV_WC_LOC_QP_OP_ERR",
            LocalEecOperationError => "IBV_WC_LOC_EEC_OP_ERR",
            LocalProtectionError => "IBV_WC_LOC_PROT_ERR",
            WrFlushError => "IBV_WC_WR_FLUSH_ERR",
            MwBindError => "IBV_WC_MW_BIND_ERR",
            BadResponseError => "IBV_WC_BAD_RESP_ERR",
            LocalAccessError => "IBV_WC_LOC_ACCESS_ERR",
            RemoteInvalidRequestError => "IBV_WC_REM_INV_REQ_ERR",
            RemoteAccessError => "IBV_WC_REM_ACCESS_ERR",
            RemoteOperationError => "IBV_WC_REM_OP_ERR",
            RetryExceeded => "IBV_WC_RETRY_EXC_ERR",
            RnrRetryExceeded => "IBV_WC_RNR_RETRY_EXC_ERR",
            LocalRddViolationError => "IBV_WC_LOC_RDD_VIOL_ERR",
            RemoteInvalidRdRequestError => "IBV_WC_REM_INV_RD_REQ_ERR",
            RemoteAbortError => "IBV_WC_REM_ABORT_ERR",
            InvalidEecnError => "IBV_WC_INV_EECN_ERR",
            InvalidEecStateError => "IBV_WC_INV_EEC_STATE_ERR",
            FatalError => "IBV_WC_FATAL_ERR",
            ResponseTimeoutError => "IBV_WC_RESP_TIMEOUT_ERR",
            GeneralError => "IBV_WC_GENERAL_ERR",
            StageInError => "stage-in error (gpudirect)",
            Other(_) => "unknown status",
        }
    }

    /// One line on what usually causes this status and what to check.
    pub fn hint(self) -> &'static str {
        use WcStatus::*;
        match self {
            Success => "completed successfully",
            LocalLengthError => "the message is longer than the receive buffer posted for it",
            LocalQpOperationError => "the work request was malformed for this queue pair (e.g. too many SGEs, inline too long)",
            LocalProtectionError => "the local buffer is not inside a region of this protection domain, or the lkey is wrong; with GPU memory, PCIe ACS or the IOMMU may be blocking peer-to-peer DMA",
            WrFlushError => "flushed: the queue pair was already in the error state because of an earlier failed request",
            LocalAccessError => "the local region lacks LOCAL_WRITE for an operation that writes it",
            RemoteInvalidRequestError => "the peer rejected the request: the operation is not enabled on its queue pair, or the message exceeds its limits",
            RemoteAccessError => "the peer refused access: wrong rkey, an address outside its region, or the region lacks REMOTE_WRITE/REMOTE_READ (or was deregistered)",
            RemoteOperationError => "the peer could not complete the operation (e.g. its receive queue is broken)",
            RetryExceeded => "the peer did not acknowledge within timeout x retry count: it is gone, unreachable (check GID index, MTU, routing), or its queue pair is not connected; on Soft-RoCE (rxe) with rnr_retry 7 also a send that found no receive posted (measured: RETRY_EXC after 0.7 s, where rnr_retry 6 gives RNR_RETRY_EXC after 0.3 s)",
            RnrRetryExceeded => "the peer had no receive posted each time a send arrived (receiver not ready): post receives before the sender sends, or raise rnr_retry / min_rnr_timer",
            BadResponseError => "the peer answered with an unexpected transport opcode",
            RemoteInvalidRdRequestError => "the peer refused the RDMA read or atomic: too many outstanding reads for its max_dest_rd_atomic",
            RemoteAbortError => "the peer aborted the operation",
            FatalError => "the device reported a fatal error",
            ResponseTimeoutError => "the peer's response timed out",
            GeneralError => "the device reported a general error",
            StageInError => "the NIC delivered the bytes to the host mirror, but copying them to the GPU failed (the CUDA error is in the log): the GPU memory does not hold them",
            MwBindError | LocalEecOperationError | LocalRddViolationError | InvalidEecnError | InvalidEecStateError => "an error of a feature this library does not use",
            Other(_) => "a status this version of the library does not know; see ibv_wc_status_str",
        }
    }
}

impl fmt::Display for WcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WcStatus::Other(s) => write!(f, "status {s}"),
            s => write!(f, "{} ({s:?})", s.verbs_name()),
        }
    }
}

/// The operation a work completion reports (`enum ibv_wc_opcode`).
///
/// For failed completions the verbs leave the opcode undefined; the library
/// reports the operation that was posted instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    /// A send (or send with immediate) finished.
    Send,
    /// An RDMA write (or write with immediate) finished.
    RdmaWrite,
    /// An RDMA read finished.
    RdmaRead,
    /// An atomic compare-and-swap finished (the original word is in its
    /// result slice).
    CompareSwap,
    /// An atomic fetch-and-add finished (the original word is in its
    /// result slice).
    FetchAdd,
    /// A receive took an incoming send.
    Recv,
    /// A receive was consumed by an incoming RDMA write with immediate.
    RecvRdmaWithImm,
    /// A memory window's bind finished.
    BindWindow,
    /// A local invalidation (of a memory window's key) finished.
    LocalInvalidate,
    /// Another opcode.
    Other(u32),
}

impl WcOpcode {
    pub(crate) fn from_raw(op: u32) -> WcOpcode {
        match op {
            sys::IBV_WC_SEND => WcOpcode::Send,
            sys::IBV_WC_RDMA_WRITE => WcOpcode::RdmaWrite,
            sys::IBV_WC_RDMA_READ => WcOpcode::RdmaRead,
            sys::IBV_WC_COMP_SWAP => WcOpcode::CompareSwap,
            sys::IBV_WC_FETCH_ADD => WcOpcode::FetchAdd,
            sys::IBV_WC_RECV => WcOpcode::Recv,
            sys::IBV_WC_RECV_RDMA_WITH_IMM => WcOpcode::RecvRdmaWithImm,
            sys::IBV_WC_BIND_MW => WcOpcode::BindWindow,
            sys::IBV_WC_LOCAL_INV => WcOpcode::LocalInvalidate,
            other => WcOpcode::Other(other),
        }
    }
}

/// A work completion (`struct ibv_wc`), translated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The id given to the work request.
    pub wr_id: u64,
    /// Success or why not.
    pub status: WcStatus,
    /// What completed.
    pub opcode: WcOpcode,
    /// Bytes received (receives) or transferred (RDMA reads).
    pub byte_len: u32,
    /// Immediate data of a send or write with immediate, in host order.
    pub imm: Option<u32>,
    /// The local queue pair (for a shared receive queue's receive, the
    /// one the message arrived on).
    pub qp_num: u32,
    /// The sending queue pair, for a UD receive (0 otherwise).
    pub src_qp: u32,
    /// Provider-specific error detail.
    pub vendor_err: u32,
}

impl Default for WorkCompletion {
    fn default() -> Self {
        WorkCompletion {
            wr_id: 0,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            imm: None,
            qp_num: 0,
            src_qp: 0,
            vendor_err: 0,
        }
    }
}

impl WorkCompletion {
    /// `Ok(self)` on success, otherwise the failure as a [`WcError`].
    ///
    /// # Errors
    /// [`WcError`] naming the status and its likely cause.
    pub fn ok(self) -> Result<WorkCompletion, WcError> {
        if self.status == WcStatus::Success {
            Ok(self)
        } else {
            Err(WcError { status: self.status, opcode: self.opcode, wr_id: self.wr_id, qp_num: self.qp_num, vendor_err: self.vendor_err })
        }
    }
}

/// A work request that completed with an error status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("work request {wr_id} ({opcode:?}) on QP {qp_num:#x} failed: {status}: {}; vendor error {vendor_err:#x}", status.hint())]
pub struct WcError {
    /// The status, by name.
    pub status: WcStatus,
    /// The operation that was posted.
    pub opcode: WcOpcode,
    /// The work request's id.
    pub wr_id: u64,
    /// The local queue pair.
    pub qp_num: u32,
    /// Provider-specific detail.
    pub vendor_err: u32,
}
