//! Shared receive queues (`ibv_create_srq`, `ibv_post_srq_recv`,
//! `ibv_modify_srq`): one pool of receives for many queue pairs, so the
//! receive memory a server posts does not grow with its number of peers.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::cq::{CompletionQueue, Reservation};
use crate::error::{check, Error, Result};
use crate::pd::ProtectionDomain;
use crate::sync::Mutex;
use crate::tracker::Tracker;
use crate::wr::RecvWr;

/// Shared receive queue settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SrqConfig {
    /// Receives the queue holds (`max_wr`), for all its queue pairs together.
    pub max_wr: u32,
    /// Most scatter/gather entries in one receive; 1 to the device's
    /// [`max_sge`](crate::DeviceAttr::max_sge).
    pub max_sge: u32,
}

impl Default for SrqConfig {
    fn default() -> Self {
        SrqConfig { max_wr: 1024, max_sge: 1 }
    }
}

struct SrqInner {
    srq: NonNull<sys::ibv_srq>,
    pd: ProtectionDomain,
    tracker: Arc<Tracker>,
    config: SrqConfig,
    /// The receive CQs of the queue pairs attached, each with the room
    /// reserved there for every receive of the queue (once per CQ, however
    /// many of its queue pairs share the queue).
    cqs: Mutex<Vec<(CompletionQueue, Option<Reservation>)>>,
}

// SAFETY: posting and modifying are thread-safe verbs; Rust-side state is
// behind the tracker's and the CQ list's mutexes.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        // Every queue pair attached holds a handle, so none is left: after
        // the destroy the NIC takes no more receives from the queue.
        // SAFETY: the SRQ came from ibv_create_srq and is destroyed once.
        let ret = unsafe { sys::ibv_destroy_srq(self.srq.as_ptr()) };
        let cqs = std::mem::take(&mut *self.cqs.lock());
        for (cq, _) in &cqs {
            cq.unregister_shared(&self.tracker);
        }
        if ret != 0 {
            tracing::warn!("{}", Error::returned("ibv_destroy_srq", ret));
            // Leak the held memory rather than free what the NIC may still
            // write, and keep the CQ room it may still complete into.
            std::mem::forget(self.tracker.clone());
            std::mem::forget(cqs);
            return;
        }
        let [_, left] = self.tracker.clear();
        for (_, room) in cqs {
            // Receives whose completions may still sit in a CQ keep their
            // room owed until it is seen empty, as a queue pair's do.
            if let (true, Some(r)) = (left, room) {
                r.into_debt();
            }
        }
        self.pd.inner.holders.remove(&crate::tracker::holder(&self.tracker));
    }
}

/// A shared receive queue: receives posted once, taken by whichever
/// attached queue pair a message arrives on
/// ([`QueuePair::create_with_srq`](crate::QueuePair::create_with_srq)).
/// A receive's completion arrives on that queue pair's receive CQ and
/// names it ([`WorkCompletion::qp_num`](crate::WorkCompletion::qp_num)).
/// Cheap to clone; destroyed when the last handle and the last queue pair
/// attached are gone.
///
/// Memory is held exactly as for a queue pair's receives: until the
/// receive's completion is reaped.
///
/// # Thread safety
/// `Send + Sync`: several threads may post; each batch is posted whole.
#[derive(Clone)]
pub struct SharedReceiveQueue {
    inner: Arc<SrqInner>,
}

impl fmt::Debug for SharedReceiveQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SharedReceiveQueue")
            .field("device", &self.inner.pd.context().name())
            .field("max_wr", &self.inner.config.max_wr)
            .field("max_sge", &self.inner.config.max_sge)
            .finish()
    }
}

impl SharedReceiveQueue {
    /// Creates a shared receive queue in `pd` (`ibv_create_srq`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a depth of 0 or beyond the device's
    /// `max_srq_wr`, or an SGE count outside 1..=`max_srq_sge`;
    /// [`Error::Verb`] from `ibv_create_srq` (`EOPNOTSUPP`: the device has
    /// no shared receive queues).
    pub fn new(pd: &ProtectionDomain, config: &SrqConfig) -> Result<SharedReceiveQueue> {
        let ctx = pd.context();
        let a = ctx.attr();
        if a.max_srq == 0 {
            return Err(Error::InvalidArgument(format!("{} has no shared receive queues (ibv_query_device max_srq 0)", ctx.name())));
        }
        if config.max_wr == 0 || config.max_wr > a.max_srq_wr {
            return Err(Error::InvalidArgument(format!(
                "SrqConfig::max_wr {}: {} allows 1 to {} receives per shared receive queue (max_srq_wr)",
                config.max_wr,
                ctx.name(),
                a.max_srq_wr
            )));
        }
        if config.max_sge == 0 || config.max_sge > a.max_srq_sge {
            return Err(Error::InvalidArgument(format!(
                "SrqConfig::max_sge {}: {} allows 1 to {} scatter/gather entries per shared receive (max_srq_sge)",
                config.max_sge,
                ctx.name(),
                a.max_srq_sge
            )));
        }
        let mut init = sys::ibv_srq_init_attr {
            srq_context: std::ptr::null_mut(),
            attr: sys::ibv_srq_attr { max_wr: config.max_wr, max_sge: config.max_sge, srq_limit: 0 },
        };
        // SAFETY: valid PD; `init` is fully set.
        let srq = unsafe { sys::ibv_create_srq(pd.as_ptr(), &mut init) };
        let srq = NonNull::new(srq).ok_or_else(|| Error::last("ibv_create_srq"))?;
        // Depths stay as asked (the provider may round up), so QueueFull
        // fires before the provider's ENOMEM would.
        let tracker = Arc::new(Tracker::new(0, config.max_wr, pd.inner.stages_in.clone()));
        pd.inner.holders.add(crate::tracker::holder(&tracker));
        tracing::debug!(device = ctx.name(), max_wr = config.max_wr, "created shared receive queue");
        Ok(SharedReceiveQueue {
            inner: Arc::new(SrqInner { srq, pd: pd.clone(), tracker, config: config.clone(), cqs: Mutex::new(Vec::new()) }),
        })
    }

    /// Posts a batch of receives with one call (`ibv_post_srq_recv`). Each
    /// is taken by the next message that arrives on any attached queue
    /// pair, and its memory is held, and refused to local access, until
    /// its completion is reaped.
    ///
    /// # Errors
    /// [`Error::QueueFull`] beyond [`SrqConfig::max_wr`] outstanding,
    /// [`Error::ForeignMemoryRegion`], [`Error::InvalidArgument`] for a
    /// receive of more slices than [`SrqConfig::max_sge`], or
    /// [`Error::Busy`] while a copy uses a destination range (nothing
    /// posted); [`Error::Verb`] from `ibv_post_srq_recv` (the receives
    /// before the refused one were posted).
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        #[cfg(feature = "fault-injection")]
        if crate::fault::take_srq_post_failure() {
            return Err(Error::Verb { verb: "ibv_post_srq_recv", errno: crate::error::Errno(libc::ENOMEM) });
        }
        let inner = &self.inner;
        let gather = RecvWr::check_batch(wrs, &inner.pd, inner.config.max_sge, "SrqConfig::max_sge")?;
        let srq = inner.srq.as_ptr();
        // SAFETY: `srq` is this queue's, valid while `self` is.
        inner.tracker.post_recvs(wrs, gather, "ibv_post_srq_recv", |chain, bad| unsafe { sys::ibv_post_srq_recv(srq, chain, bad) })
    }

    /// Arms the limit event: once fewer than `limit` receives are posted,
    /// the device raises [`AsyncEvent::SrqLimitReached`](crate::AsyncEvent::SrqLimitReached)
    /// on the context ([`Context::async_event`](crate::Context::async_event))
    /// and disarms; arm it again after posting more. The signal to refill
    /// before senders meet receiver-not-ready.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 or a limit beyond
    /// [`SrqConfig::max_wr`]; [`Error::Verb`] from `ibv_modify_srq`.
    pub fn arm_limit(&self, limit: u32) -> Result<()> {
        if limit == 0 || limit > self.inner.config.max_wr {
            return Err(Error::InvalidArgument(format!(
                "a shared receive queue limit of {limit}: 1 to the queue's max_wr {}",
                self.inner.config.max_wr
            )));
        }
        let mut attr = sys::ibv_srq_attr { max_wr: 0, max_sge: 0, srq_limit: limit };
        // SAFETY: valid SRQ and attribute; the mask names the field set.
        check("ibv_modify_srq", unsafe { sys::ibv_modify_srq(self.inner.srq.as_ptr(), &mut attr, sys::IBV_SRQ_LIMIT as i32) })
    }

    /// The settings it was created with.
    pub fn config(&self) -> &SrqConfig {
        &self.inner.config
    }

    /// Receives posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.inner.tracker.recv.lock().pending.len()
    }

    /// The protection domain its receives' memory must belong to.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// This queue's identity in async events
    /// ([`AsyncEvent::SrqLimitReached`](crate::AsyncEvent::SrqLimitReached)).
    pub fn id(&self) -> SrqId {
        SrqId(self.inner.srq.as_ptr() as usize)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_srq {
        self.inner.srq.as_ptr()
    }

    /// Makes completions on `cq` find this queue's receives, reserving room
    /// there for all of them the first time `cq` is named.
    ///
    /// # Errors
    /// [`Error::CqTooSmall`] when `cq` cannot hold them besides what it
    /// already holds room for.
    pub(crate) fn attach_cq(&self, cq: &CompletionQueue) -> Result<()> {
        let mut cqs = self.inner.cqs.lock();
        if cqs.iter().any(|(c, _)| c.same_as(cq)) {
            return Ok(());
        }
        let room = cq.reserve(self.inner.config.max_wr)?;
        cq.register_shared(self.inner.tracker.clone());
        cqs.push((cq.clone(), Some(room)));
        Ok(())
    }
}

/// Which shared receive queue an async event is about: compare with
/// [`SharedReceiveQueue::id`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SrqId(pub(crate) usize);
