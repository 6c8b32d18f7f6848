//! A connection's data path: one RC queue pair per comm, NCCL's
//! receiver-driven protocol, and the judgement of its first transfer.
//!
//! # Protocol
//! The receiver drives. `irecv` posts one receive (for the notification)
//! and writes, into the sender's *fifo* slot `seq % 32`, one 32-byte entry
//! per grouped receive: address, rkey, size, tag, group size and the
//! sequence number `seq + 1` (last, so an entry is whole once it reads
//! right; every entry of a group is checked). `isend` reads its next slot;
//! while it is not there, or no entry of it carries the send's tag, it
//! returns no request and NCCL calls again. Once every receive of the group
//! has its send, the sender writes each payload into its receive and ends
//! with one RDMA write with immediate: for a group of one, the write of the
//! payload itself, its immediate the size; for larger groups, a write of
//! the sizes into the receiver's *sizes* slot. RC delivers in order, so
//! the receive completion means every byte of the group is there, and the
//! k-th receive completion is the k-th group. A send larger than its
//! receive is cut to the receive's size and the receiver's size says so,
//! as NCCL's IB transport does.
//!
//! # What a peer can reach
//! Each comm has its own protection domain: its queue pair, its control
//! memory and every registration NCCL makes through it live there, so a
//! key a peer of one comm holds opens nothing of another comm
//! (`regIsGlobal` is 0: NCCL registers per comm). The queue pair and the
//! control memory grant remote write only, never remote read (the
//! protocol only writes; the flush is local). What a receive's key opens
//! is the device's [`Keys`]: where it has type-2 memory windows, NCCL's
//! registrations grant no remote access at all, and each receive gets a
//! window bound to its bytes when it is posted (before the fifo entry that
//! hands the key over, on the same queue pair) and invalidated when it
//! arrives, before `test` reports it done; the window's key works on this
//! comm's queue pair only. Otherwise a receive's key opens the
//! registration it lies in.
//!
//! # A peer's claims
//! Every size, slot and count a peer writes is checked against what was
//! posted before it is used: a receive whose sender claims more bytes than
//! were posted, or a group's sizes in another slot than the group's,
//! fails that request (`test` returns the error, with a WARN line naming
//! the comm and the claim) and touches no other. A fifo entry whose group
//! size disagrees with its group's fails the comm.
//!
//! # Bounds
//! At most [`MAX_REQUESTS`] requests per comm (NCCL's own limit; past it,
//! `isend`/`irecv` answer "not now"), [`MAX_RECVS`] receives per group,
//! [`MAX_BYTES`] per message. A peer that dies is found by the queue
//! pair's retry bound: after a second with nothing completed and a request
//! waiting, a zero-byte write probes the peer, and its failure fails the
//! comm, so `test` and `isend` return an error instead of waiting forever.

use std::ffi::c_void;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpudirect::metrics::{DataPath, Direction};
use gpudirect::rcache::{CacheConfig, RegistrationCache};
use gpudirect::sync::{Guard, Mutex};
use gpudirect::{
    next_rkey, AccessFlags, CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain, QpConfig, QueuePair, RecvWr, RemoteBuffer, SendTemplate, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

use crate::error::{NetError, Result};
use crate::log;
use crate::reg::Reg;
use crate::site::{Keys, Nic, Site};
use crate::verdict::{data_path, decide, judge, Action, ConnPath, Seen, Side};
use crate::wire::{Entry, ENTRY, SIZES, SLOT};

pub use crate::abi::MAX_REQUESTS;
pub use crate::wire::MAX_RECVS;

/// The largest message (`maxP2pBytes`, `maxCollBytes`): NCCL splits larger ones.
pub const MAX_BYTES: usize = 1 << 30;
/// Work request ids above the slots.
const WR_FIFO: u64 = 1 << 32;
const WR_PROBE: u64 = 2 << 32;
/// A receive's windows' binds (unsignaled: seen only when one fails).
const WR_BIND: u64 = 3 << 32;
/// The last invalidation of a group's windows, plus its slot.
const WR_INV: u64 = 4 << 32;
// `progress` takes any id below WR_FIFO for a send's slot: every tagged
// id must stay above it.
const _: () = assert!(WR_PROBE >= WR_FIFO && WR_BIND >= WR_FIFO && WR_INV >= WR_FIFO);
/// Nothing completed for this long with a request waiting: probe the peer.
const PROBE_AFTER: Duration = Duration::from_secs(1);

/// What NCCL holds as a request: a stable address naming the comm and slot.
#[derive(Debug)]
pub struct ReqHandle {
    comm: *const Comm,
    slot: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Free,
    Pending,
    /// Arrived; its windows are being invalidated, then it is `after`.
    Closing,
    Done,
    /// The peer's claim about it was refused.
    Refused(Claim),
}

/// A peer's claim that was not what was posted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Claim {
    /// Receive `recv` of the group got `claimed` bytes, `posted` were posted.
    Size { recv: usize, claimed: u32, posted: u32 },
    /// A group's sizes were written into slot `claimed`, not `slot`.
    Slot { claimed: u32, slot: usize },
    /// The peer consumed the receive with a message, not a write with
    /// immediate (the protocol's only receive traffic).
    NotAWrite,
}

impl std::fmt::Display for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            Claim::Size { recv, claimed, posted } => write!(f, "the peer claims {claimed} bytes arrived in receive {recv} of a request, which was posted for {posted}"),
            Claim::Slot { claimed, slot } => write!(f, "the peer claims its sizes are in slot {claimed}, the request's slot is {slot}"),
            Claim::NotAWrite => write!(f, "the peer consumed the receive with a message, not the write with immediate the protocol sends"),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Req {
    state: State,
    n: usize,
    sizes: [i32; MAX_RECVS],
    /// A receive's posted sizes: the most its sender may claim.
    posted: [u32; MAX_RECVS],
    /// What a `Closing` receive becomes once its windows are invalidated.
    after: Outcome,
    /// Each send's or receive's path (a send uses the first).
    paths: [DataPath; MAX_RECVS],
}

/// How a receive ended, as `test` will report it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Done,
    Refused(Claim),
}

impl Outcome {
    fn state(self) -> State {
        match self {
            Outcome::Done => State::Done,
            Outcome::Refused(c) => State::Refused(c),
        }
    }
}

const FREE: Req = Req { state: State::Free, n: 0, sizes: [0; MAX_RECVS], posted: [0; MAX_RECVS], after: Outcome::Done, paths: [DataPath::Host; MAX_RECVS] };

/// A receive's memory window (its key: the last bind's, `last_rkey`).
#[derive(Debug)]
struct Window {
    mw: MemoryWindow,
    bound: bool,
    /// The registration of its last bind (NCCL's handle, by address).
    region: Option<usize>,
}

/// One matched send of the group being assembled.
#[derive(Clone, Copy, Debug)]
struct Matched {
    req: usize,
    addr: u64,
    size: usize,
    reg: *const Reg,
}

/// The queue pair and memory a comm is made of, before the peer is known.
#[derive(Debug)]
pub struct Parts {
    /// The queue pair, not yet connected.
    pub qp: gpudirect::PreparedQueuePair,
    cq: CompletionQueue,
    /// Sender: the fifo the receiver writes. Receiver: the sizes slots.
    pub ctrl: MemoryRegion,
    /// Bytes staged for inline writes (the receiver's entries, the sender's sizes).
    scratch: MemoryRegion,
    /// The comm's registrations, in its own protection domain.
    cache: Arc<RegistrationCache>,
}

impl Parts {
    /// Creates the queue pair and control memory of a comm on `nic`.
    ///
    /// # Errors
    /// [`NetError::Library`] from the verbs.
    pub fn new(site: &Site, nic: &Nic, side: Side, traffic_class: Option<u8>) -> Result<Parts> {
        let c = &site.config;
        // A receive's group posts its fifo write, and with windows a bind
        // and an invalidation per receive.
        let (send_wr, recv_wr) = match side {
            Side::Send => ((MAX_REQUESTS * (MAX_RECVS + 1) + 8) as u32, 1),
            Side::Recv => ((MAX_REQUESTS * (2 * MAX_RECVS + 2) + 8) as u32, MAX_REQUESTS as u32),
        };
        let defaults = QpConfig::default();
        let config = QpConfig {
            port: nic.port,
            gid_index: c.gid_index,
            max_send_wr: send_wr,
            max_recv_wr: recv_wr,
            max_inline_data: SLOT as u32,
            traffic_class: traffic_class.or(c.traffic_class).unwrap_or(0),
            service_level: c.service_level.unwrap_or(0),
            timeout: c.timeout.unwrap_or(defaults.timeout),
            retry_cnt: c.retry_cnt.unwrap_or(defaults.retry_cnt),
            ..defaults
        };
        let ctx = nic.pd.context();
        // A protection domain per comm: a key one peer holds opens nothing
        // of another comm.
        let pd = ProtectionDomain::new(ctx)?;
        let cq = CompletionQueue::new(ctx, send_wr + recv_wr)?;
        // The protocol only writes: no remote read, no atomics.
        let config = QpConfig { access: REMOTE_ACCESS, ..config };
        let qp = QueuePair::create(&pd, &cq, &cq, &config)?;
        let ctrl_len = match side {
            Side::Send => crate::wire::fifo_len(),
            Side::Recv => crate::wire::sizes_len(),
        };
        let ctrl = MemoryRegion::alloc(&pd, ctrl_len, REMOTE_ACCESS)?;
        let scratch = MemoryRegion::alloc(&pd, SLOT, AccessFlags::LOCAL_WRITE)?;
        let cache = Arc::new(RegistrationCache::new(&pd, CacheConfig::default()));
        nic.caches.add(&cache);
        Ok(Parts { qp, cq, ctrl, scratch, cache })
    }
}

/// The sender's request for a group of one: a write with immediate.
const WRITE_WITH_IMM: SendTemplate = SendTemplate::write_with_imm();

/// What the plugin's memory grants a peer: writes, nothing else.
pub const REMOTE_ACCESS: AccessFlags = AccessFlags::LOCAL_WRITE.union(AccessFlags::REMOTE_WRITE);

/// A send or receive comm.
#[derive(Debug)]
pub struct Comm {
    side: Side,
    site: &'static Site,
    nic: usize,
    /// The peer's address, as setup saw it (names the comm in errors).
    peer: SocketAddr,
    /// The comm's registrations, in its own protection domain.
    cache: Arc<RegistrationCache>,
    /// The GPU current on the thread that set the comm up, if any.
    gpu: Option<usize>,
    /// A receive comm on a device with memory windows: one per receive.
    windows: bool,
    handles: Box<[ReqHandle]>,
    inner: Mutex<Inner>,
}

#[derive(Debug)]
struct Inner {
    qp: QueuePair,
    cq: CompletionQueue,
    ctrl: MemoryRegion,
    scratch: MemoryRegion,
    /// The peer's fifo (receiver) or sizes slots (sender).
    remote: RemoteBuffer,
    seq: u64,
    reqs: [Req; MAX_REQUESTS],
    free: Vec<usize>,
    /// Per slot: the receive's request, or the group's sends.
    groups: [[usize; MAX_RECVS]; MAX_REQUESTS],
    /// Per slot: how many of `groups[slot]` belong to the slot's group.
    group_n: [usize; MAX_REQUESTS],
    matched: [Option<Matched>; MAX_RECVS],
    /// The size of the group being matched, while part of it is (0: none).
    partial: usize,
    /// Receive side with windows: slot `s`'s receive `r` at `s * MAX_RECVS + r`, made on first use.
    windows: Vec<Option<Window>>,
    seen: Seen,
    judged: bool,
    /// Judged staged: its host memory carries a GPU's traffic.
    staged: bool,
    failed: Option<Failed>,
    idle: u32,
    /// A completion arrived since the idle check last looked.
    progressed: bool,
    last_progress: Instant,
    probing: bool,
    wcs: [WorkCompletion; 16],
}

/// Why a comm stopped; every later call answers with the same error.
#[derive(Debug)]
enum Failed {
    /// Refused under `require` at its first transfer.
    Refused(String),
    /// The peer failed, or a work request did.
    Remote(String),
}

impl Failed {
    fn error(&self) -> NetError {
        match self {
            Failed::Refused(t) => NetError::Refused(t.clone()),
            Failed::Remote(t) => NetError::Remote(t.clone()),
        }
    }
}

// SAFETY: the raw pointers (`ReqHandle::comm`, `Matched::reg`) name
// objects NCCL keeps alive while the comm uses them (the comm itself, and
// registrations NCCL deregisters only after their transfers); all state is
// behind the mutex.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Comm {
    /// Connects `parts` to the peer and makes the comm. Boxed, so the
    /// request handles' back pointers stay valid.
    ///
    /// # Errors
    /// [`NetError::Library`] moving the queue pair to RTS.
    #[allow(clippy::too_many_arguments)]
    pub fn new(site: &'static Site, nic: usize, side: Side, gpu: Option<usize>, parts: Parts, peer_ep: &gpudirect::Endpoint, remote: RemoteBuffer, peer: SocketAddr) -> Result<Box<Comm>> {
        let qp = parts.qp.connect(peer_ep)?;
        let inner = Inner {
            qp,
            cq: parts.cq,
            ctrl: parts.ctrl,
            scratch: parts.scratch,
            remote,
            seq: 0,
            reqs: [FREE; MAX_REQUESTS],
            free: (0..MAX_REQUESTS).rev().collect(),
            groups: [[0; MAX_RECVS]; MAX_REQUESTS],
            group_n: [0; MAX_REQUESTS],
            matched: [None; MAX_RECVS],
            partial: 0,
            windows: Vec::new(),
            seen: Seen::default(),
            judged: false,
            staged: false,
            failed: None,
            idle: 0,
            progressed: false,
            last_progress: Instant::now(),
            probing: false,
            wcs: [WorkCompletion::default(); 16],
        };
        let windows = side == Side::Recv && matches!(site.nics[nic].keys, Keys::Windows { .. });
        let mut comm = Box::new(Comm { side, site, nic, peer, cache: parts.cache, gpu, windows, handles: Box::new([]), inner: Mutex::new(inner) });
        if windows {
            comm.lock().windows = (0..MAX_REQUESTS * MAX_RECVS).map(|_| None).collect();
        }
        let me: *const Comm = &*comm;
        comm.handles = (0..MAX_REQUESTS).map(|slot| ReqHandle { comm: me, slot }).collect();
        site.nics[nic].open_comms.fetch_add(1, Ordering::Relaxed);
        Ok(comm)
    }

    /// The comm's NIC.
    pub fn nic(&self) -> &'static Nic {
        &self.site.nics[self.nic]
    }

    /// Where NCCL's registrations through this comm go.
    pub fn cache(&self) -> &Arc<RegistrationCache> {
        &self.cache
    }

    /// `send comm on rxe0:1 with 192.0.2.2:41000`: the comm, as errors name it.
    fn name(&self) -> String {
        format!("{} comm on {} with {}", if self.side == Side::Send { "send" } else { "receive" }, self.nic().label(), self.peer)
    }

    fn lock(&self) -> Guard<'_, Inner> {
        self.inner.lock()
    }

    /// Notes a registration made through this comm (what the first
    /// transfer's judgement reads).
    pub fn saw(&self, reg: &Reg) {
        let mut g = self.lock();
        match reg.gpu {
            Some(path) => g.seen.gpu = g.seen.gpu.or(Some(path)),
            None => g.seen.host = true,
        }
    }

    /// The first transfer: which path, logged; refused under `require`
    /// when a GPU's traffic would be staged.
    fn first_transfer(&self, g: &mut Inner) -> Result<()> {
        g.judged = true;
        let nic = self.nic();
        let pair = self.gpu.and_then(|o| nic.pair(o));
        let label = nic.label();
        let path = judge(self.side, g.seen, pair, &label, &self.site.config.nccl_env);
        g.staged = matches!(path, ConnPath::Staged { .. });
        let (line, action) = decide(self.site.config.policy, self.side, &path, self.gpu, &label);
        match action {
            Action::Proceed => log::info(&line.to_string()),
            Action::Warn => log::warn(&line.to_string()),
            Action::Refuse(refusal) => {
                self.site.refusals.staged.fetch_add(1, Ordering::Relaxed);
                log::info(&line.to_string());
                let text = refusal.to_string();
                g.failed = Some(Failed::Refused(text.clone()));
                return Err(NetError::Refused(text));
            }
        }
        Ok(())
    }

    fn start(&self, g: &mut Inner) -> Result<()> {
        if let Some(f) = &g.failed {
            return Err(f.error());
        }
        if !g.judged {
            self.first_transfer(g)?;
        }
        Ok(())
    }

    fn handle(&self, req: usize) -> *mut c_void {
        &self.handles[req] as *const ReqHandle as *mut c_void
    }

    /// `isend`: the request, or null when the receiver has not asked for
    /// this send yet (NCCL calls again).
    ///
    /// # Errors
    /// [`NetError::Refused`] at the first transfer under `require`;
    /// [`NetError::Invalid`] for a size past [`MAX_BYTES`] or memory
    /// outside `reg`; [`NetError::Remote`] once the peer failed.
    #[inline]
    pub fn isend(&self, data: u64, size: usize, tag: i32, reg: *const Reg) -> Result<*mut c_void> {
        let mut guard = self.lock();
        let g = &mut *guard;
        if g.failed.is_some() || !g.judged {
            self.start(g)?;
        }
        if size > MAX_BYTES {
            return Err(NetError::Invalid(format!("isend of {size} bytes: the plugin carries at most {MAX_BYTES} per message")));
        }
        let slot = (g.seq % MAX_REQUESTS as u64) as usize;
        let want = g.seq + 1;
        let first = g.entry(slot, 0);
        if first.seq != want {
            return self.not_now(g);
        }
        if first.nreqs == 1 && size > 0 && g.partial == 0 {
            return self.isend_one(g, slot, first, data, size, tag, reg);
        }
        let n = first.nreqs as usize;
        if g.partial != 0 && n != g.partial {
            // Sends are matched to this group's receives already: the peer
            // rewrote a group it had posted.
            return Err(self.fail(g, format!("the peer rewrote its receive slot {slot} from a group of {} to a group of {n} after sends were matched to it", g.partial)));
        }
        if n == 0 || n > MAX_RECVS {
            return Err(self.fail(g, format!("the peer's receive slot {slot} names {n} receives (at most {MAX_RECVS})")));
        }
        let (r, e) = if n == 1 {
            if first.tag != tag {
                return self.not_now(g);
            }
            (0, first)
        } else {
            let mut at = None;
            for r in 0..n {
                let e = if r == 0 { first } else { g.entry(slot, r) };
                if e.seq != want {
                    return self.not_now(g);
                }
                if e.nreqs as usize != n {
                    return Err(self.fail(g, format!("the peer's receive slot {slot} names a group of {n} in its first entry and of {} in entry {r}", e.nreqs)));
                }
                if at.is_none() && g.matched[r].is_none() && e.tag == tag {
                    at = Some((r, e));
                }
            }
            match at {
                Some(found) => found,
                None => return self.not_now(g),
            }
        };
        let size = size.min(e.size as usize);
        // SAFETY: NCCL passes a handle regMr returned and has not deregistered it.
        let path = if size > 0 { data_path(unsafe { &*reg }.check(data, size)?.gpu, g.staged) } else { DataPath::Host };
        let Some(req) = g.free.pop() else { return Ok(std::ptr::null_mut()) };
        g.reqs[req] = Req { sizes: [size as i32, 0, 0, 0, 0, 0, 0, 0], state: State::Pending, n: 1, paths: [path; MAX_RECVS], ..FREE };
        g.idle = 0;
        let m = Matched { req, addr: data, size, reg };
        if n == 1 {
            if let Err(err) = self.post_empty(g, slot, req) {
                g.reqs[req] = FREE;
                g.free.push(req);
                return Err(err);
            }
            g.seq += 1;
        } else {
            g.matched[r] = Some(m);
            g.partial = n;
            if g.matched[..n].iter().all(Option::is_some) {
                g.partial = 0;
                self.post_group(g, slot, n)?;
                g.seq += 1;
            }
        }
        Ok(self.handle(req))
    }

    /// A group of one with bytes, the common case: one write with immediate
    /// (its immediate the size) through the comm's prepared request, aimed
    /// at the receive the peer offered.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn isend_one(&self, g: &mut Inner, slot: usize, e: Entry, data: u64, size: usize, tag: i32, reg: *const Reg) -> Result<*mut c_void> {
        if e.tag != tag {
            return self.not_now(g);
        }
        let size = size.min(e.size as usize);
        let Some(&req) = g.free.last() else { return Ok(std::ptr::null_mut()) };
        // SAFETY: NCCL passes a handle regMr returned and has not deregistered it.
        let reg = unsafe { &*reg };
        g.qp.post_aimed(&WRITE_WITH_IMM, reg.slice(data, size)?, e.addr, e.rkey, size as u32, slot as u64)?;
        g.free.pop();
        let path = data_path(reg.gpu, g.staged);
        let r = &mut g.reqs[req];
        (r.state, r.n, r.sizes[0], r.paths[0]) = (State::Pending, 1, size as i32, path);
        g.groups[slot][0] = req;
        g.group_n[slot] = 1;
        self.nic().traffic.add(Direction::Out, path, size as u64);
        g.seq += 1;
        g.idle = 0;
        Ok(self.handle(req))
    }

    /// A group of one without bytes (`isend_one` takes those with bytes):
    /// a bare immediate, 0 the size.
    fn post_empty(&self, g: &mut Inner, slot: usize, req: usize) -> Result<()> {
        g.qp.post_send(&[SendWr::immediate(0).wr_id(slot as u64)])?;
        g.groups[slot][0] = req;
        g.group_n[slot] = 1;
        Ok(())
    }

    fn post_group(&self, g: &mut Inner, slot: usize, n: usize) -> Result<()> {
        let nic = self.nic();
        let mut sizes = [0u32; MAX_RECVS];
        let mut wrs: Vec<SendWr<'_>> = Vec::new();
        let matched: Vec<Matched> = g.matched[..n].iter_mut().map(|m| m.take().expect("every receive matched")).collect();
        let entries: Vec<Entry> = (0..n).map(|r| g.entry(slot, r)).collect();
        let Inner { qp, scratch, remote, groups, group_n, reqs, .. } = g;
        for (r, m) in matched.iter().enumerate() {
            groups[slot][r] = m.req;
            sizes[r] = m.size as u32;
            nic.traffic.add(Direction::Out, reqs[m.req].paths[0], m.size as u64);
        }
        group_n[slot] = n;
        for (m, e) in matched.iter().zip(&entries).filter(|(m, _)| m.size > 0) {
            let dst = RemoteBuffer { addr: e.addr, len: m.size as u64, rkey: e.rkey };
            // SAFETY: as in isend.
            wrs.push(SendWr::write(unsafe { &*m.reg }.slice(m.addr, m.size)?, &dst, 0)?.unsignaled());
        }
        let bytes: Vec<u8> = sizes[..n].iter().flat_map(|s| s.to_le_bytes()).collect();
        scratch.write_at(0, &bytes)?;
        wrs.push(SendWr::write_with_imm(scratch.slice(0..bytes.len())?, remote, (slot * SIZES) as u64, slot as u32)?.inline().wr_id(slot as u64));
        qp.post_send(&wrs)?;
        Ok(())
    }

    /// `irecv` of a group of `n` receives: the request, or null when
    /// [`MAX_REQUESTS`] are in flight.
    ///
    /// # Errors
    /// As [`isend`](Self::isend).
    pub fn irecv(&self, bufs: &[(u64, usize, i32, *const Reg)]) -> Result<*mut c_void> {
        let mut guard = self.lock();
        let g = &mut *guard;
        self.start(g)?;
        let n = bufs.len();
        if n == 0 || n > MAX_RECVS {
            return Err(NetError::Invalid(format!("irecv of {n} receives: the plugin groups 1 to {MAX_RECVS}")));
        }
        let mut entries = [0u8; SLOT];
        let mut posted = [0u32; MAX_RECVS];
        // With windows: each receive's bound range and its window's new key.
        let mut binds: [Option<(&Reg, u64, usize, u32)>; MAX_RECVS] = [None; MAX_RECVS];
        let mut paths = [DataPath::Host; MAX_RECVS];
        let slot = (g.seq % MAX_REQUESTS as u64) as usize;
        for (i, &(addr, size, tag, reg)) in bufs.iter().enumerate() {
            if size > MAX_BYTES {
                return Err(NetError::Invalid(format!("irecv of {size} bytes: the plugin carries at most {MAX_BYTES} per message")));
            }
            let rkey = if size == 0 || reg.is_null() {
                0
            } else {
                // SAFETY: NCCL passes handles regMr returned, not yet deregistered.
                let reg = unsafe { &*reg }.check(addr, size)?;
                if !reg.mr().pd().same_as(self.cache.pd()) {
                    return Err(NetError::Invalid(format!(
                        "irecv on the {} with memory registered through another comm: this plugin's registrations are per comm \
                         (regIsGlobal 0), so that a peer reaches no other comm's memory",
                        self.name()
                    )));
                }
                paths[i] = data_path(reg.gpu, g.staged);
                if self.windows {
                    let w = g.window(slot * MAX_RECVS + i, self.cache.pd())?;
                    if w.bound {
                        // Its receive's request is still open (NCCL reposted
                        // a slot before testing the request there).
                        return Ok(std::ptr::null_mut());
                    }
                    let rkey = next_rkey(w.mw.last_rkey());
                    binds[i] = Some((reg, addr, size, rkey));
                    rkey
                } else {
                    reg.rkey()
                }
            };
            posted[i] = size as u32;
            let e = Entry { addr, rkey, size: size as u32, tag, nreqs: n as u32, seq: g.seq + 1 };
            entries[i * ENTRY..(i + 1) * ENTRY].copy_from_slice(&e.to_bytes());
        }
        let Some(req) = g.free.pop() else { return Ok(std::ptr::null_mut()) };
        let signal = g.seq % 8 == 7;
        let Inner { qp, scratch, remote, windows, .. } = g;
        let sent = (|| -> Result<()> {
            qp.post_recv(&[RecvWr::empty().wr_id(slot as u64)])?;
            scratch.write_at(0, &entries[..n * ENTRY])?;
            let fifo = SendWr::write(scratch.slice(0..n * ENTRY)?, remote, (slot * SLOT) as u64)?.inline().wr_id(WR_FIFO);
            let fifo = if signal { fifo } else { fifo.unsignaled() };
            if !binds.iter().any(Option::is_some) {
                return Ok(qp.post_send(&[fifo])?);
            }
            // The binds go first on the same queue pair: the key the fifo
            // entry hands over opens its bytes by the time the peer has it.
            let mut wrs = Vec::with_capacity(n + 1);
            for (i, bind) in binds.iter().enumerate() {
                if let Some((reg, addr, size, rkey)) = *bind {
                    let w = windows[slot * MAX_RECVS + i].as_ref().expect("made above");
                    wrs.push(SendWr::bind_window(&w.mw, reg.slice(addr, size)?, AccessFlags::REMOTE_WRITE, rkey)?.unsignaled().wr_id(WR_BIND));
                }
            }
            wrs.push(fifo);
            Ok(qp.post_send(&wrs)?)
        })();
        if let Err(e) = sent {
            g.free.push(req);
            return Err(self.fail(g, format!("posting a receive: {e}")));
        }
        for (i, bind) in binds.iter().enumerate() {
            if let Some((reg, ..)) = *bind {
                let w = g.windows[slot * MAX_RECVS + i].as_mut().expect("made above");
                (w.bound, w.region) = (true, Some(reg as *const Reg as usize));
            }
        }
        g.groups[slot][0] = req;
        g.reqs[req] = Req { state: State::Pending, n, posted, paths, ..FREE };
        g.seq += 1;
        g.idle = 0;
        Ok(self.handle(req))
    }

    /// `test`: once request `slot` is done, its sizes in `sizes` and how
    /// many there are (the request is then free again); `None` while not.
    ///
    /// # Errors
    /// [`NetError::Remote`] once the comm failed (a work request failed,
    /// or the peer stopped answering within the retry bound).
    #[inline]
    pub fn test(&self, slot: usize, sizes: &mut [i32; MAX_RECVS]) -> Result<Option<usize>> {
        let mut guard = self.lock();
        let g = &mut *guard;
        let Some(mut state) = g.reqs.get(slot).map(|r| r.state) else {
            return Err(NetError::Invalid(format!("test of a request that is not in flight (slot {slot})")));
        };
        if matches!(state, State::Pending | State::Closing) {
            self.progress(g)?;
            state = g.reqs[slot].state;
        }
        match state {
            State::Done => {
                let r = &mut g.reqs[slot];
                let n = r.n;
                // One size, a send's or a lone receive's, without a call
                // to memcpy (most tests; docs/performance.md).
                if n == 1 {
                    sizes[0] = r.sizes[0];
                } else {
                    sizes[..n].copy_from_slice(&r.sizes[..n]);
                }
                // The fields a request reads are set when it is made again.
                r.state = State::Free;
                g.free.push(slot);
                Ok(Some(n))
            }
            State::Refused(claim) => {
                self.site.refusals.peer_claims.fetch_add(1, Ordering::Relaxed);
                g.reqs[slot].state = State::Free;
                g.free.push(slot);
                Err(NetError::Remote(format!("{}: {claim}: this request fails, its bytes are not to be trusted", self.name())))
            }
            State::Free => Err(NetError::Invalid(format!("test of a request that is not in flight (slot {slot})"))),
            State::Pending | State::Closing => {
                if let Some(f) = &g.failed {
                    return Err(f.error());
                }
                self.idle(g)?;
                Ok(None)
            }
        }
    }

    #[inline]
    fn progress(&self, g: &mut Inner) -> Result<()> {
        loop {
            let got = g.cq.poll(&mut g.wcs)?;
            for i in 0..got {
                let wc = g.wcs[i];
                // A send's write completing, the common case, without
                // a call: its group's requests are done.
                if self.side == Side::Send && wc.wr_id < WR_FIFO && wc.status == WcStatus::Success {
                    g.progressed = true;
                    g.sent(wc.wr_id as usize % MAX_REQUESTS);
                    continue;
                }
                self.complete(g, &wc)?;
            }
            if got < g.wcs.len() {
                return Ok(());
            }
        }
    }

    fn complete(&self, g: &mut Inner, wc: &WorkCompletion) -> Result<()> {
        if wc.status != WcStatus::Success {
            let what = match wc.wr_id >> 32 {
                2 => "a probe of the peer",
                3 => "binding a receive's memory window",
                4 => "invalidating a receive's memory window",
                _ => "a transfer",
            };
            return Err(self.fail(g, format!("{what} failed: {} ({}): the peer died, closed the connection or is unreachable", wc.status.verbs_name(), wc.status.hint())));
        }
        g.progressed = true;
        if wc.wr_id == WR_PROBE {
            g.probing = false;
            return Ok(());
        }
        if wc.wr_id & !0xffff == WR_INV {
            // Only this comm's own ids complete here (the tracker drops any
            // other), but the slot is bounded all the same, as `groups` is.
            let slot = (wc.wr_id as usize & 0xffff) % MAX_REQUESTS;
            let req = g.groups[slot][0];
            for w in g.windows.get_mut(slot * MAX_RECVS..(slot + 1) * MAX_RECVS).into_iter().flatten().flatten() {
                w.bound = false;
            }
            let r = &mut g.reqs[req];
            r.state = r.after.state();
            return Ok(());
        }
        if wc.wr_id >= WR_FIFO {
            return Ok(());
        }
        let slot = wc.wr_id as usize % MAX_REQUESTS;
        match (self.side, wc.opcode) {
            (Side::Recv, WcOpcode::RecvRdmaWithImm) => {
                let req = g.groups[slot][0];
                let outcome = self.arrived(g, slot, req, wc.imm.unwrap_or(0));
                self.close_windows(g, slot, req, outcome)?;
            }
            (Side::Send, _) => g.sent(slot),
            (Side::Recv, WcOpcode::Recv) => {
                let req = g.groups[slot][0];
                self.close_windows(g, slot, req, Outcome::Refused(Claim::NotAWrite))?;
            }
            (Side::Recv, _) => {}
        }
        Ok(())
    }

    /// A receive's group arrived with `imm`: its sizes, each checked
    /// against what was posted (the peer's claim), and counted.
    fn arrived(&self, g: &mut Inner, slot: usize, req: usize, imm: u32) -> Outcome {
        let ctrl = g.ctrl.addr() as usize;
        let r = &mut g.reqs[req];
        let mut claimed = [0u32; MAX_RECVS];
        if r.n == 1 {
            claimed[0] = imm;
        } else if imm as usize != slot {
            return Outcome::Refused(Claim::Slot { claimed: imm, slot });
        } else {
            for (i, c) in claimed.iter_mut().enumerate().take(r.n) {
                // SAFETY: the sizes slots are `ctrl`, host memory this
                // comm owns; the peer's write of them completed before
                // this receive completion (RC order). Read volatile: the
                // NIC, not Rust, wrote them.
                *c = u32::from_le(unsafe { std::ptr::read_volatile((ctrl + slot * SIZES + 4 * i) as *const u32) });
            }
        }
        if let Some(recv) = (0..r.n).find(|&i| claimed[i] > r.posted[i]) {
            return Outcome::Refused(Claim::Size { recv, claimed: claimed[recv], posted: r.posted[recv] });
        }
        for (size, &c) in r.sizes.iter_mut().zip(&claimed).take(r.n) {
            // At most the posted size, itself at most MAX_BYTES: fits.
            *size = c as i32;
        }
        let traffic = &self.nic().traffic;
        for (&size, &path) in r.sizes[..r.n].iter().zip(&r.paths) {
            traffic.add(Direction::In, path, size as u64);
        }
        Outcome::Done
    }

    /// Ends an arrived receive: with windows bound for it, invalidates
    /// them first (the receive is `Closing` until the last invalidation
    /// completes, so no key of it opens anything once `test` says done).
    fn close_windows(&self, g: &mut Inner, slot: usize, req: usize, outcome: Outcome) -> Result<()> {
        let bound = |w: &Option<Window>| w.as_ref().filter(|w| w.bound).map(|w| w.mw.last_rkey());
        let keys: Vec<u32> = if self.windows { g.windows[slot * MAX_RECVS..(slot + 1) * MAX_RECVS].iter().filter_map(bound).collect() } else { Vec::new() };
        let Some((&last, rest)) = keys.split_last() else {
            g.reqs[req].state = outcome.state();
            return Ok(());
        };
        let mut wrs: Vec<SendWr<'_>> = rest.iter().map(|&k| SendWr::invalidate(k).unsignaled()).collect();
        wrs.push(SendWr::invalidate(last).wr_id(WR_INV | slot as u64));
        if let Err(e) = g.qp.post_send(&wrs) {
            return Err(self.fail(g, format!("invalidating a receive's memory windows: {e}")));
        }
        let r = &mut g.reqs[req];
        (r.state, r.after) = (State::Closing, outcome);
        Ok(())
    }

    fn not_now(&self, g: &mut Inner) -> Result<*mut c_void> {
        self.idle(g)?;
        Ok(std::ptr::null_mut())
    }

    /// Called while NCCL waits: reaps what completed (a probe among it)
    /// and, after [`PROBE_AFTER`] without progress, probes the peer.
    fn idle(&self, g: &mut Inner) -> Result<()> {
        g.idle = g.idle.wrapping_add(1);
        if !g.idle.is_multiple_of(64) {
            return Ok(());
        }
        self.progress(g)?;
        if std::mem::take(&mut g.progressed) {
            // Read the clock only here, every 64th idle call, never per completion.
            g.last_progress = Instant::now();
            return Ok(());
        }
        if g.probing || g.last_progress.elapsed() < PROBE_AFTER {
            return Ok(());
        }
        let Inner { qp, scratch, remote, .. } = &mut *g;
        let probe = SendWr::write(scratch.slice(0..0)?, remote, 0)?.wr_id(WR_PROBE);
        if let Err(e) = qp.post_send(&[probe]) {
            return Err(self.fail(g, format!("probing the peer: {e}")));
        }
        g.probing = true;
        g.last_progress = Instant::now();
        Ok(())
    }

    fn fail(&self, g: &mut Inner, why: String) -> NetError {
        let text = format!("{}: {why}", self.name());
        if g.failed.is_none() {
            g.failed = Some(Failed::Remote(text.clone()));
        }
        NetError::Remote(text)
    }

    /// Before NCCL deregisters `reg`: the windows last bound to it (still
    /// bound where NCCL gave up on a receive) are deallocated, which closes
    /// their keys and lets go of the region (a window keeps its last
    /// region registered), so its pinned memory goes with NCCL's handle.
    pub fn forget_windows(&self, reg: &Reg) {
        if !self.windows {
            return;
        }
        let handle = reg as *const Reg as usize;
        let mut g = self.lock();
        for w in g.windows.iter_mut() {
            if w.as_ref().is_some_and(|w| w.region == Some(handle)) {
                *w = None;
            }
        }
    }

    /// `iflush`: makes the NIC's writes of the last non-empty receive
    /// visible to the GPU before NCCL's kernel reads them (free on GPUs that
    /// order them; `cuFlushGPUDirectRDMAWrites` on others). Done before it
    /// returns: NCCL gets no request to test.
    ///
    /// # Errors
    /// [`NetError::Library`] from CUDA.
    pub fn iflush(&self, regs: &[(usize, *const Reg)]) -> Result<()> {
        if let Some(&(_, reg)) = regs.iter().rev().find(|(size, reg)| *size > 0 && !reg.is_null()) {
            // SAFETY: NCCL passes handles regMr returned, not yet deregistered.
            let reg = unsafe { &*reg };
            if reg.gpu.is_some() {
                reg.mr().flush_gpu_writes()?;
            }
        }
        Ok(())
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Windows before the queue pair they were bound through: one still
        // bound would hold the queue pair's destruction (gpudirect's
        // MemoryWindow, "Lifetimes").
        self.lock().windows.clear();
        let nic = self.nic();
        nic.caches.retire(&self.cache);
        if nic.open_comms.fetch_sub(1, Ordering::Relaxed) == 1 {
            log::info(&nic.traffic_line());
        }
    }
}

/// A request handle NCCL passed back: its comm and slot.
///
/// # Safety
/// `req` is a pointer `isend`/`irecv` returned whose comm is still open.
pub unsafe fn request(req: *mut c_void) -> Result<(&'static Comm, usize)> {
    if req.is_null() {
        return Err(NetError::Invalid("test of a null request".into()));
    }
    // SAFETY: the caller's promise: a live ReqHandle in a live comm.
    let h = unsafe { &*(req as *const ReqHandle) };
    // SAFETY: as above.
    Ok((unsafe { &*h.comm }, h.slot))
}

impl Inner {
    /// Slot `slot`'s group was written: its sends are done.
    #[inline]
    fn sent(&mut self, slot: usize) {
        for i in 0..self.group_n[slot] {
            let req = self.groups[slot][i];
            self.reqs[req].state = State::Done;
        }
    }

    /// Window `at` (slot times MAX_RECVS plus receive), made on first use.
    fn window(&mut self, at: usize, pd: &ProtectionDomain) -> Result<&Window> {
        if self.windows[at].is_none() {
            self.windows[at] = Some(Window { mw: MemoryWindow::alloc(pd)?, bound: false, region: None });
        }
        Ok(self.windows[at].as_ref().expect("made"))
    }

    /// Entry `r` of fifo slot `slot`, read as the NIC left it.
    #[inline]
    fn entry(&self, slot: usize, r: usize) -> Entry {
        let at = self.ctrl.addr() as usize + slot * SLOT + r * ENTRY;
        // SAFETY: `ctrl` is this comm's fifo, host memory of MAX_REQUESTS
        // slots that lives as long as the comm, its entries 8-byte aligned
        // (wire::Entry's layout); the peer's NIC writes it, so it is read
        // volatile, the sequence number first and the rest after an
        // acquire fence (a torn entry reads a stale sequence number and is
        // read again on the next call).
        unsafe {
            let seq = std::ptr::read_volatile((at + 24) as *const u64);
            std::sync::atomic::fence(Ordering::Acquire);
            let word = |at: usize| u64::from_le(std::ptr::read_volatile(at as *const u64));
            let (w1, w2) = (word(at + 8), word(at + 16));
            Entry { addr: word(at), rkey: w1 as u32, size: (w1 >> 32) as u32, tag: w2 as u32 as i32, nreqs: (w2 >> 32) as u32, seq: u64::from_le(seq) }
        }
    }
}
