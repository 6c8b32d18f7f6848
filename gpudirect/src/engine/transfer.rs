//! Transfer requests: a list of (local range, remote range) entries, read
//! or write, to one peer, optionally followed by a notification. Prepared
//! once, posted as often as needed (one post in flight at a time): each
//! post is one batch on the peer's queue pair, one doorbell while the send
//! queue has room, its last request the only one signaled.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::mr::MemoryRegion;
use crate::wr::SendWr;

use super::core::{Core, Failure, Phase, ReqState};
use super::desc::AgentMetadata;
use super::error::EngineError;
use super::memory::LocalRange;
use super::peer::RemoteRange;

/// What a transfer does to the remote memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// RDMA write: local ranges into the peer's.
    Write,
    /// RDMA read: the peer's ranges into local ones.
    Read,
}

/// Where a transfer request stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferStatus {
    /// Never posted.
    Idle,
    /// Posted; not every byte is in place yet.
    InFlight,
    /// Every byte of the last post is in place (and its notification, if
    /// any, delivered to the peer's NIC).
    Done,
}

/// A prepared transfer: made by [`Agent::prepare`](super::Agent::prepare),
/// posted by [`post`](Self::post), followed by [`status`](Self::status) or
/// [`wait`](Self::wait). It holds its local memory registered, so a posted
/// request can never outlive the memory it names.
pub struct TransferRequest {
    pub(crate) core: Arc<Core>,
    pub(crate) op: Op,
    pub(crate) peer: Arc<AgentMetadata>,
    pub(crate) entries: Vec<(LocalRange, RemoteRange)>,
    /// The notification's wire form, in a region of NIC 0.
    pub(crate) notify: Option<MemoryRegion>,
    pub(crate) state: Arc<ReqState>,
    pub(crate) bytes: u64,
    pub(crate) nic: usize,
    pub(crate) remote_nic: usize,
}

impl std::fmt::Debug for TransferRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferRequest")
            .field("op", &self.op)
            .field("peer", &self.peer.name)
            .field("entries", &self.entries.len())
            .field("bytes", &self.bytes)
            .field("notify", &self.notify.is_some())
            .finish()
    }
}

impl TransferRequest {
    /// The peer agent it targets.
    pub fn peer(&self) -> &str {
        &self.peer.name
    }

    /// Bytes it moves per post.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Posts it: connects to the peer first if this agent has no
    /// connection to it yet, then posts every entry and the notification
    /// as one batch.
    ///
    /// # Errors
    /// [`EngineError::InFlight`] while the previous post is still in
    /// flight; a connection error ([`EngineError::Control`],
    /// [`EngineError::Refused`], [`EngineError::WrongPeer`],
    /// [`EngineError::TooManyConnections`]); [`EngineError::Verbs`] from
    /// posting (when nothing went out the request is idle again and may be
    /// posted again; when part went out it is failed).
    pub fn post(&self) -> Result<(), EngineError> {
        let conn = self.core.pool.get(&self.peer, self.nic, self.remote_nic)?;
        let qp = &conn.qp;
        let id = self.core.begin(&self.state, self.nic, qp.endpoint().qp_num)?;
        let wrs = match self.requests(id) {
            Ok(w) => w,
            Err(e) => {
                self.core.abandon(id);
                return Err(e.into());
            }
        };
        let core = &self.core;
        let nic = self.nic;
        // One batch when the send queue has room (nothing is posted when it
        // has not); else as room frees, reaping meanwhile.
        let posted = match qp.post_send(&wrs) {
            Err(crate::error::Error::QueueFull { .. }) => qp.post_send_all(&wrs, Some(core.pool.timeout), |wc| {
                core.on_send(nic, &wc);
                Ok(())
            }),
            r => r.map_err(|error| crate::qp::PartialPost { posted: 0, error }),
        };
        match posted {
            Ok(()) => Ok(()),
            Err(p) if p.posted == 0 => {
                self.core.abandon(id);
                Err(p.error.into())
            }
            Err(p) => {
                tracing::warn!(peer = %self.peer.name, posted = p.posted, of = wrs.len(), "transfer partly posted: {}", p.error);
                let failure = Failure::Partial { peer: self.peer.name.clone(), posted: p.posted, total: wrs.len(), reason: p.error.to_string() };
                self.core.fail(id, failure);
                Err(p.error.into())
            }
        }
    }

    /// The work requests of post `id`: every entry unsignaled but one in
    /// each half send queue (so a long list keeps the queue draining), the
    /// last (the notification when there is one) signaled and final.
    fn requests(&self, id: u64) -> Result<Vec<SendWr<'_>>> {
        let every = (self.core.pool.qp.max_send_wr / 2).max(1) as usize;
        let mut wrs = Vec::with_capacity(self.entries.len() + 1);
        for (i, (local, remote)) in self.entries.iter().enumerate() {
            let slice = local.reg.inner.regions[self.nic].slice(local.offset..local.offset + local.len)?;
            let rb = remote.mem.desc().on_nic(self.remote_nic).expect("prepare checked the key exists");
            let wr = match self.op {
                Op::Write => SendWr::write(slice, rb, remote.offset)?,
                Op::Read => SendWr::read(slice, rb, remote.offset)?,
            };
            let wr = wr.wr_id(id << 1);
            wrs.push(if i % every == every - 1 { wr } else { wr.unsignaled() });
        }
        if let Some(n) = &self.notify {
            wrs.push(SendWr::send(n.slice(..)?).wr_id(id << 1).unsignaled());
        }
        let last = wrs.pop().expect("a request has an entry");
        wrs.push(SendWr { signaled: true, ..last }.wr_id(id << 1 | 1));
        Ok(wrs)
    }

    /// Where the last post stands, reaping what completed.
    ///
    /// # Errors
    /// [`EngineError::PeerLost`] when it failed (the peer died, its memory
    /// went away); repeated until the request is posted again.
    pub fn status(&self) -> Result<TransferStatus, EngineError> {
        self.core.progress_send(self.nic, None)?;
        match &*self.state.0.lock() {
            Phase::Idle => Ok(TransferStatus::Idle),
            Phase::Posted => Ok(TransferStatus::InFlight),
            Phase::Done => Ok(TransferStatus::Done),
            Phase::Failed(f) => Err(f.to_error()),
        }
    }

    /// Waits until the last post finished, up to `timeout` (`None`: no
    /// limit; a dead peer still fails it within the queue pair's retry
    /// bound, about half a second with the default settings).
    ///
    /// # Errors
    /// As [`status`](Self::status); [`EngineError::Timeout`].
    pub fn wait(&self, timeout: Option<Duration>) -> Result<(), EngineError> {
        self.core.wait(&self.state, self.nic, timeout)
    }
}
