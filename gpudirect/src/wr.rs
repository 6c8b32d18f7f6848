//! Work requests: what [`QueuePair::post_send`](crate::QueuePair::post_send)
//! and [`post_recv`](crate::QueuePair::post_recv) carry.

use crate::cq::WcOpcode;
use crate::error::Result;
use crate::mr::{LocalSlice, RemoteBuffer};

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendOp {
    Send,
    SendWithImm(u32),
    Write,
    WriteWithImm(u32),
    Read,
}

impl SendOp {
    #[inline]
    pub(crate) fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::Write | SendOp::WriteWithImm(_) => WcOpcode::RdmaWrite,
            SendOp::Read => WcOpcode::RdmaRead,
        }
    }

    /// Whether the NIC writes the local buffer (so local reads must wait).
    #[inline]
    pub(crate) fn nic_writes_local(self) -> bool {
        matches!(self, SendOp::Read)
    }
}

/// A send-queue work request: send, RDMA write (with or without
/// immediate data) or RDMA read, over one local slice.
///
/// Requests are signaled by default (a completion is generated). Mark
/// most of a stream [`unsignaled`](Self::unsignaled) for speed: an
/// unsignaled request is known complete when a later signaled one on the
/// same queue pair completes, and its memory stays held until then.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) local: LocalSlice<'a>,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
    pub(crate) inline: bool,
}

impl<'a> SendWr<'a> {
    fn new(op: SendOp, local: LocalSlice<'a>) -> Self {
        SendWr { wr_id: 0, op, local, remote_addr: 0, rkey: 0, signaled: true, inline: false }
    }

    fn rdma(op: SendOp, local: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        let remote_addr = remote.addr_of(offset, local.len() as u64)?;
        Ok(SendWr { remote_addr, rkey: remote.rkey, ..Self::new(op, local) })
    }

    /// A send: the peer's next posted receive gets `local`'s bytes.
    pub fn send(local: LocalSlice<'a>) -> Self {
        Self::new(SendOp::Send, local)
    }

    /// A send carrying 32 bits of immediate data, delivered in the peer's
    /// receive completion.
    pub fn send_with_imm(local: LocalSlice<'a>, imm: u32) -> Self {
        Self::new(SendOp::SendWithImm(imm), local)
    }

    /// An RDMA write of `local` into `remote` at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](crate::Error::OutOfBounds) when the range
    /// falls outside `remote`: it is refused before anything is posted.
    pub fn write(local: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        Self::rdma(SendOp::Write, local, remote, offset)
    }

    /// An RDMA write that also consumes one of the peer's posted receives
    /// and hands it `imm`: the peer learns, by a completion, that the data
    /// has landed. `local` may be empty for a pure notification.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn write_with_imm(local: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64, imm: u32) -> Result<Self> {
        Self::rdma(SendOp::WriteWithImm(imm), local, remote, offset)
    }

    /// An RDMA read of `local.len()` bytes from `remote` at `offset` into `local`.
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn read(local: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        Self::rdma(SendOp::Read, local, remote, offset)
    }

    /// Sets the id reported in this request's completion.
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }

    /// Requests no completion for this work request.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// Copies the payload into the work request at post time
    /// (`IBV_SEND_INLINE`): lower latency for small messages, and the
    /// buffer is free again as soon as `post_send` returns. The length
    /// must not exceed the queue pair's `max_inline_data`. Not for RDMA reads.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }
}

/// A receive-queue work request: where the next incoming send (or the
/// notification of a write with immediate) lands.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) local: LocalSlice<'a>,
}

impl<'a> RecvWr<'a> {
    /// A receive into `local` (which may be empty when only writes with
    /// immediate data are expected).
    pub fn new(local: LocalSlice<'a>) -> Self {
        RecvWr { wr_id: 0, local }
    }

    /// Sets the id reported in this request's completion.
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }
}
