//! One NIC of an agent: its device context, protection domain, the send
//! completion queue its connections share, and the shared receive queue
//! (with its receive CQ and slot memory) that takes every peer's
//! notifications, so receive memory does not grow with the peer count.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use gpudirect::Context;
use gpudirect::CompletionQueue;
use gpudirect::Result;
use gpudirect::GidChoice;
use gpudirect::{AccessFlags, MemoryRegion};
use gpudirect::ProtectionDomain;
use gpudirect::{Mtu, PortAttr};
use gpudirect::{SharedReceiveQueue, SrqConfig};
use gpudirect::RecvWr;
use gpudirect::sync::Mutex;

use gpudirect::metrics::{Direction, PathBytes, PathCounters};
use crate::wire::desc::NicDesc;
use crate::nics::msgbuf::MsgPool;
use crate::wire::notify::SLOT;

/// What [`Nic::open`] needs from the agent's configuration.
pub(crate) struct NicSetup {
    pub(crate) port: u8,
    pub(crate) gid_index: Option<u32>,
    /// Send queue depth of each connection.
    pub(crate) send_depth: u32,
    pub(crate) max_connections: usize,
    /// Notification receives kept posted.
    pub(crate) srq_depth: u32,
    /// Queue pairs per rail; `None`: by the kind of NIC.
    pub(crate) qps_per_rail: Option<u8>,
}

/// What one of an agent's NICs carried, from
/// [`Agent::nic_stats`](crate::Agent::nic_stats).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NicStats {
    /// The RDMA device.
    pub device: String,
    /// Bytes of transfers posted on it (written or read; notifications
    /// not counted).
    pub bytes: u64,
    /// Transfer posts (or slices of one) that went out on it.
    pub posts: u64,
    /// Bytes each of its queue pairs per rail carried (index `i`: the
    /// rail's queue pair `i` to every peer, summed); as many as it uses
    /// ([`AgentConfig::qps_per_rail`](crate::AgentConfig::qps_per_rail)).
    pub qp_bytes: Vec<u64>,
}

pub(crate) struct Nic {
    pub(crate) pd: ProtectionDomain,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) srq: SharedReceiveQueue,
    /// `srq_depth` receive slots of [`SLOT`] bytes.
    pub(crate) slots: MemoryRegion,
    /// The engine messages it sends, in reused slots.
    pub(crate) msgs: Arc<MsgPool>,
    /// Slots whose repost failed, to be posted again at the next reap.
    held: Mutex<Vec<usize>>,
    pub(crate) desc: NicDesc,
    pub(crate) gid: GidChoice,
    pub(crate) max_connections: usize,
    /// Queue pairs each rail of it carries to a peer.
    pub(crate) qps: usize,
    /// [`NicStats::posts`].
    pub(crate) posts: AtomicU64,
    /// Bytes and posts by direction and path; [`NicStats::bytes`] their sum.
    pub(crate) paths: PathCounters,
    /// [`NicStats::qp_bytes`], one per queue pair index.
    qp_bytes: Box<[AtomicU64]>,
}

/// Whether RDMA device `name` is a software one (rxe, siw): it has no
/// device behind it in sysfs, only a network interface (`parent`).
fn is_software(name: &str) -> bool {
    !std::path::Path::new(&format!("/sys/class/infiniband/{name}/device")).exists()
}

impl Nic {
    pub(crate) fn open(device: Option<&str>, s: &NicSetup) -> Result<Nic> {
        let ctx = Context::open(device)?;
        let port: PortAttr = ctx.query_port(s.port)?;
        let gid = ctx.choose_gid(s.port, s.gid_index)?;
        let pd = ProtectionDomain::new(&ctx)?;
        // Every connection's whole send queue may be signaled: the shared
        // CQ holds them all (the queue pairs reserve it), or it overruns.
        let max_cqe = ctx.attr().max_cqe;
        let fit = (max_cqe / s.send_depth) as usize;
        let max_connections = fit.min(s.max_connections);
        if max_connections < s.max_connections {
            tracing::warn!(
                device = ctx.name(),
                max_cqe,
                "the send CQ holds {max_cqe} entries: at most {max_connections} connections of depth {} instead of {}",
                s.send_depth,
                s.max_connections
            );
        }
        let send_cq = CompletionQueue::new(&ctx, (max_connections as u32).max(1) * s.send_depth)?;
        let recv_cq = CompletionQueue::new(&ctx, s.srq_depth)?;
        let srq = SharedReceiveQueue::new(&pd, &SrqConfig { max_wr: s.srq_depth, max_sge: 1 })?;
        let slots = MemoryRegion::alloc(&pd, SLOT * s.srq_depth as usize, AccessFlags::LOCAL_WRITE)?;
        let desc = NicDesc {
            device: ctx.name().to_owned(),
            port: s.port,
            lid: port.lid,
            gid: gid.entry.gid,
            mtu: port.active_mtu.unwrap_or(Mtu::Mtu1024),
        };
        let qps = match s.qps_per_rail {
            Some(n) => n as usize,
            None if is_software(ctx.name()) => 1,
            None => 2,
        };
        let nic = Nic {
            pd,
            send_cq,
            recv_cq,
            srq,
            slots,
            msgs: Arc::default(),
            held: Mutex::default(),
            desc,
            gid,
            max_connections,
            qps,
            posts: AtomicU64::new(0),
            paths: PathCounters::default(),
            qp_bytes: (0..qps).map(|_| AtomicU64::new(0)).collect(),
        };
        // The receives go in only once the receive CQ is attached, which
        // the first queue pair does; posting into an SRQ before is fine.
        let wrs = (0..s.srq_depth as usize)
            .map(|i| Ok(RecvWr::new(nic.slots.slice(i * SLOT..(i + 1) * SLOT)?).wr_id(i as u64)))
            .collect::<Result<Vec<_>>>()?;
        nic.srq.post_recv(&wrs)?;
        tracing::info!(device = %nic.desc.device, gid = %nic.gid, srq_depth = s.srq_depth, qps_per_rail = qps, "engine NIC ready");
        Ok(nic)
    }

    /// Counts a post of `bytes` going `dir` on its queue pair index
    /// `qp`, `paths` of them by path.
    #[inline]
    pub(crate) fn count(&self, qp: usize, bytes: u64, dir: Direction, paths: &PathBytes) {
        self.paths.count(dir, paths);
        self.posts.fetch_add(1, Ordering::Relaxed);
        if let Some(q) = self.qp_bytes.get(qp) {
            q.fetch_add(bytes, Ordering::Relaxed);
        }
    }

    pub(crate) fn stats(&self) -> NicStats {
        NicStats {
            device: self.desc.device.clone(),
            bytes: self.paths.read().iter().map(|t| t.bytes).sum(),
            posts: self.posts.load(Ordering::Relaxed),
            qp_bytes: self.qp_bytes.iter().map(|q| q.load(Ordering::Relaxed)).collect(),
        }
    }

    /// Gives receive slot `slot` back to the shared receive queue.
    /// Posts receive slot `slot` again; one that fails is kept for
    /// [`repost_held`](Self::repost_held), so no slot is lost to a failure.
    pub(crate) fn repost(&self, slot: usize) -> Result<()> {
        let r = self.post_slot(slot);
        if r.is_err() {
            self.held.lock().push(slot);
        }
        r
    }

    /// Posts again the slots whose repost failed before.
    pub(crate) fn repost_held(&self) -> Result<()> {
        let held = std::mem::take(&mut *self.held.lock());
        let mut first = Ok(());
        for slot in held {
            if let Err(e) = self.repost(slot) {
                first = first.and(Err(e));
            }
        }
        first
    }

    fn post_slot(&self, slot: usize) -> Result<()> {
        self.srq.post_recv(&[RecvWr::new(self.slots.slice(slot * SLOT..(slot + 1) * SLOT)?).wr_id(slot as u64)])
    }
}
