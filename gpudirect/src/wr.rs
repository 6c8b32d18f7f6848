//! Work requests: what [`QueuePair::post_send`](crate::QueuePair::post_send)
//! and [`post_recv`](crate::QueuePair::post_recv) carry, and the
//! [`SendList`] that [`QueuePair::post_list`](crate::QueuePair::post_list)
//! posts again and again.

use gpudirect_sys as sys;

use crate::wc::WcOpcode;
use crate::error::{Error, Result};
use crate::mr::{LocalSlice, SgList};
use crate::wire::RemoteBuffer;
use crate::pd::ProtectionDomain;
use crate::mr::AccessFlags;
use crate::mw::MemoryWindow;


/// The builder methods every send request has, connected ([`SendWr`])
/// or datagram ([`UdSendWr`](crate::UdSendWr)), written once: each type
/// has the fields `wr_id`, `signaled` and `inline`.
macro_rules! send_options {
    () => {
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

        /// Requests a completion for this work request (the default;
        /// undoes [`unsignaled`](Self::unsignaled)).
        pub fn signaled(mut self) -> Self {
            self.signaled = true;
            self
        }

        /// Copies the payload into the work request at post time
        /// (`IBV_SEND_INLINE`): lower latency for small messages, and the
        /// buffer is free again as soon as the post returns. The length
        /// must not exceed the queue pair's `max_inline_data`. Not for
        /// RDMA reads.
        pub fn inline(mut self) -> Self {
            self.inline = true;
            self
        }
    };
}
pub(crate) use send_options;

/// The operation of a send-queue work request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SendOp {
    Send,
    SendWithImm(u32),
    Write,
    WriteWithImm(u32),
    Read,
    CompareSwap { compare: u64, swap: u64 },
    FetchAdd(u64),
    /// A type-2 window's bind to the request's one local slice, giving
    /// the window `rkey` with `access` (verbs' `mw_access_flags`).
    BindWindow { rkey: u32, access: u32 },
    /// A local invalidation of a window's key.
    Invalidate(u32),
}

impl SendOp {
    #[inline]
    pub(crate) fn wc_opcode(self) -> WcOpcode {
        match self {
            SendOp::Send | SendOp::SendWithImm(_) => WcOpcode::Send,
            SendOp::Write | SendOp::WriteWithImm(_) => WcOpcode::RdmaWrite,
            SendOp::Read => WcOpcode::RdmaRead,
            SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
            SendOp::FetchAdd(_) => WcOpcode::FetchAdd,
            SendOp::BindWindow { .. } => WcOpcode::BindWindow,
            SendOp::Invalidate(_) => WcOpcode::LocalInvalidate,
        }
    }

    /// Whether the request binds or invalidates a memory window.
    #[inline]
    pub(crate) fn is_window(self) -> bool {
        matches!(self, SendOp::BindWindow { .. } | SendOp::Invalidate(_))
    }

    /// Whether the NIC writes the local buffer (so local reads must wait):
    /// reads land there, atomics return the original word there.
    #[inline]
    pub(crate) fn nic_writes_local(self) -> bool {
        matches!(self, SendOp::Read | SendOp::CompareSwap { .. } | SendOp::FetchAdd(_))
    }

    #[inline]
    pub(crate) fn is_atomic(self) -> bool {
        matches!(self, SendOp::CompareSwap { .. } | SendOp::FetchAdd(_))
    }

    /// Records the operation on an extended queue pair (its `ibv_wr_*`
    /// builder), `rkey` and `addr` the remote side where it has one: the
    /// one place an operation meets the extended API, for requests and
    /// templates alike.
    ///
    /// # Safety
    /// `qpx` is a live extended queue pair inside `ibv_wr_start` on this
    /// thread, created with this opcode among its `send_ops_flags`; the
    /// operation is not a bind (`SendWr::write_ex` binds).
    #[inline]
    unsafe fn write_ex(self, qpx: *mut sys::ibv_qp_ex, rkey: u32, addr: u64) {
        // SAFETY: the caller's contract; the builders only record the
        // request until ibv_wr_complete.
        unsafe {
            match self {
                SendOp::Send => sys::ibv_wr_send(qpx),
                SendOp::SendWithImm(imm) => sys::ibv_wr_send_imm(qpx, imm.to_be()),
                SendOp::Write => sys::ibv_wr_rdma_write(qpx, rkey, addr),
                SendOp::WriteWithImm(imm) => sys::ibv_wr_rdma_write_imm(qpx, rkey, addr, imm.to_be()),
                SendOp::Read => sys::ibv_wr_rdma_read(qpx, rkey, addr),
                SendOp::CompareSwap { compare, swap } => sys::ibv_wr_atomic_cmp_swp(qpx, rkey, addr, compare, swap),
                SendOp::FetchAdd(add) => sys::ibv_wr_atomic_fetch_add(qpx, rkey, addr, add),
                SendOp::Invalidate(key) => sys::ibv_wr_local_inv(qpx, key),
                SendOp::BindWindow { .. } => unreachable!("a bind names its window"),
            }
        }
    }

    /// The verbs opcode and the immediate data (zero when none).
    #[inline]
    fn raw(self) -> (sys::ibv_wr_opcode, u32) {
        match self {
            SendOp::Send => (sys::IBV_WR_SEND, 0),
            SendOp::SendWithImm(imm) => (sys::IBV_WR_SEND_WITH_IMM, imm),
            SendOp::Write => (sys::IBV_WR_RDMA_WRITE, 0),
            SendOp::WriteWithImm(imm) => (sys::IBV_WR_RDMA_WRITE_WITH_IMM, imm),
            SendOp::Read => (sys::IBV_WR_RDMA_READ, 0),
            SendOp::CompareSwap { .. } => (sys::IBV_WR_ATOMIC_CMP_AND_SWP, 0),
            SendOp::FetchAdd(_) => (sys::IBV_WR_ATOMIC_FETCH_AND_ADD, 0),
            SendOp::BindWindow { .. } => (sys::IBV_WR_BIND_MW, 0),
            SendOp::Invalidate(_) => (sys::IBV_WR_LOCAL_INV, 0),
        }
    }
}

/// Bytes an atomic operation works on: one 64-bit word, 8-byte aligned.
pub const ATOMIC_WORD: usize = 8;

/// A send-queue work request: send, RDMA write (with or without
/// immediate data), RDMA read, atomic (fetch-and-add, compare-and-swap),
/// or a memory window's bind or invalidation.
/// Sends, writes and reads take their local memory as anything that
/// converts into an [`SgList`]: one [`LocalSlice`], or several (the NIC
/// gathers or scatters them as one message).
///
/// Requests are signaled by default (a completion is generated). Mark
/// most of a stream [`unsignaled`](Self::unsignaled) for speed: an
/// unsignaled request is known complete when a later signaled one on the
/// same queue pair completes, and its memory stays held until then.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) op: SendOp,
    pub(crate) local: SgList<'a>,
    pub(crate) remote_addr: u64,
    pub(crate) rkey: u32,
    pub(crate) signaled: bool,
    pub(crate) inline: bool,
    /// The window a bind names.
    pub(crate) window: Option<&'a MemoryWindow>,
}

impl<'a> SendWr<'a> {
    fn new(op: SendOp, local: SgList<'a>) -> Self {
        SendWr { wr_id: 0, op, local, remote_addr: 0, rkey: 0, signaled: true, inline: false, window: None }
    }

    fn rdma(op: SendOp, local: SgList<'a>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        let remote_addr = remote.addr_of(offset, local.len() as u64)?;
        Ok(SendWr { remote_addr, rkey: remote.rkey, ..Self::new(op, local) })
    }

    /// A send: the peer's next posted receive gets `local`'s bytes.
    pub fn send(local: impl Into<SgList<'a>>) -> Self {
        Self::new(SendOp::Send, local.into())
    }

    /// A send carrying 32 bits of immediate data, delivered in the peer's
    /// receive completion.
    pub fn send_with_imm(local: impl Into<SgList<'a>>, imm: u32) -> Self {
        Self::new(SendOp::SendWithImm(imm), local.into())
    }

    /// An RDMA write of `local` into `remote` at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range
    /// falls outside `remote`: it is refused before anything is posted.
    pub fn write(local: impl Into<SgList<'a>>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        Self::rdma(SendOp::Write, local.into(), remote, offset)
    }

    /// An RDMA write that also consumes one of the peer's posted receives
    /// and hands it `imm`: the peer learns, by a completion, that the data
    /// has landed. For a notification that carries no data, see
    /// [`immediate`](Self::immediate).
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn write_with_imm(local: impl Into<SgList<'a>>, remote: &RemoteBuffer, offset: u64, imm: u32) -> Result<Self> {
        Self::rdma(SendOp::WriteWithImm(imm), local.into(), remote, offset)
    }

    /// A zero-length RDMA write with immediate data: moves no bytes and
    /// names no memory on either side (a zero-byte RDMA operation needs no
    /// address or rkey, InfiniBand spec C9-88), and hands `imm` to the
    /// peer in the completion of one of its posted receives, which may be
    /// [`RecvWr::empty`]. The cheapest "your data is there" after
    /// unsignaled writes, since RC delivers in order.
    pub fn immediate(imm: u32) -> Self {
        Self::new(SendOp::WriteWithImm(imm), SgList::empty())
    }

    /// An RDMA read of `local.len()` bytes from `remote` at `offset` into
    /// `local` (scattered over its slices in order).
    ///
    /// # Errors
    /// As [`write`](Self::write).
    pub fn read(local: impl Into<SgList<'a>>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        Self::rdma(SendOp::Read, local.into(), remote, offset)
    }

    /// An atomic fetch-and-add: adds `add` to the 64-bit word of `remote`
    /// at `offset`, as one indivisible step at the peer's NIC, and returns
    /// the word as it was into `result` (8 bytes; read it with
    /// `u64::from_ne_bytes` after the completion). The words are in host
    /// byte order wherever the device says it does atomics
    /// ([`DeviceAttr::atomics`](crate::DeviceAttr::atomics)).
    ///
    /// The peer's region must grant
    /// [`REMOTE_ATOMIC`](crate::AccessFlags::REMOTE_ATOMIC) and its queue
    /// pair accept it ([`QpConfig::access`](crate::QpConfig::access)): asked
    /// for explicitly, like every remote access.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `result` is not 8 bytes or the
    /// remote word is not 8-byte aligned, [`Error::OutOfBounds`] when it
    /// lies outside `remote`: refused before anything is posted.
    pub fn fetch_add(result: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64, add: u64) -> Result<Self> {
        Self::atomic(SendOp::FetchAdd(add), result, remote, offset)
    }

    /// An atomic compare-and-swap: when the 64-bit word of `remote` at
    /// `offset` equals `compare`, replaces it with `swap`; either way
    /// returns the word as it was into `result` (so the swap happened
    /// exactly when the returned word equals `compare`). Byte order, access
    /// and errors as for [`fetch_add`](Self::fetch_add).
    ///
    /// # Errors
    /// As [`fetch_add`](Self::fetch_add).
    pub fn compare_swap(result: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64, compare: u64, swap: u64) -> Result<Self> {
        Self::atomic(SendOp::CompareSwap { compare, swap }, result, remote, offset)
    }

    fn atomic(op: SendOp, result: LocalSlice<'a>, remote: &RemoteBuffer, offset: u64) -> Result<Self> {
        if result.len() != ATOMIC_WORD {
            return Err(Error::InvalidArgument(format!(
                "an atomic returns one 8-byte word: its result slice has {} bytes",
                result.len()
            )));
        }
        let wr = Self::rdma(op, result.into(), remote, offset)?;
        if wr.remote_addr % ATOMIC_WORD as u64 != 0 {
            return Err(Error::InvalidArgument(format!(
                "an atomic needs an 8-byte aligned remote word: {:#x} (offset {offset} into {remote}) is not",
                wr.remote_addr
            )));
        }
        Ok(wr)
    }

    /// A bind of type-2 `window` to `range` (a slice of a region
    /// registered with [`AccessFlags::MW_BIND`]), granting `access`
    /// (any of [`REMOTE_WRITE`](AccessFlags::REMOTE_WRITE),
    /// [`REMOTE_READ`](AccessFlags::REMOTE_READ),
    /// [`REMOTE_ATOMIC`](AccessFlags::REMOTE_ATOMIC)) under the key
    /// `rkey`, which must be [`next_rkey`](crate::next_rkey) of the
    /// window's last key ([`MemoryWindow::last_rkey`]). From when the bind executes, the peer of the
    /// queue pair it is posted on (and no other) reaches exactly `range`
    /// with that key, until an [`invalidate`](Self::invalidate) of it
    /// posted on the same queue pair executes. Requests after the bind on
    /// the same queue pair (the message that hands the key over) execute
    /// after it. Posting it needs a device with type-2 windows
    /// ([`DeviceAttr::mem_windows`](crate::DeviceAttr::mem_windows)).
    ///
    /// The range stays held until the bind's completion, as a send's
    /// source does; the region must outlive the binding (a region with a
    /// window bound to it cannot be deregistered on some providers:
    /// invalidate first).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for access other than remote
    /// write/read/atomic, a region without `MW_BIND`, an empty range, a
    /// host-staged GPU region (no NIC-visible memory of its own), a
    /// window of another protection domain than the region's, or a key
    /// other than the window's next.
    pub fn bind_window(window: &'a MemoryWindow, range: LocalSlice<'a>, access: AccessFlags, rkey: u32) -> Result<Self> {
        let remote = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        let why = if !remote.contains(access) || access.is_empty() {
            Some(format!("a window grants remote write, read or atomic access, not {access:?}"))
        } else if !range.mr.access().contains(AccessFlags::MW_BIND) {
            Some("a window binds only to a region registered with AccessFlags::MW_BIND".to_owned())
        } else if range.is_empty() {
            Some("a window bound to no bytes".to_owned())
        } else if range.mr.is_host_staged() {
            Some("a window cannot open a host-staged GPU region: the NIC reaches only its host mirror".to_owned())
        } else if !window.pd().same_as(range.mr.pd()) {
            Some("the window and the region are of different protection domains".to_owned())
        } else if rkey != crate::mw::next_rkey(window.last_rkey()) {
            // An old key reused would open the new binding to whoever kept it.
            Some(format!("a bind under key {rkey:#x}: the window's next key is {:#x} (next_rkey of its last, {:#x})", crate::mw::next_rkey(window.last_rkey()), window.last_rkey()))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::InvalidArgument(why));
        }
        Ok(SendWr { window: Some(window), ..Self::new(SendOp::BindWindow { rkey, access: access.bits() }, range.into()) })
    }

    /// A local invalidation of `rkey`, a key a window bound on this queue
    /// pair gave: once it executes, the key opens nothing. Requests after
    /// it on the same queue pair execute after it.
    pub fn invalidate(rkey: u32) -> Self {
        Self::new(SendOp::Invalidate(rkey), SgList::empty())
    }

    send_options!();

    /// Whether the NIC reads the request's source from a host-staged GPU
    /// region's mirror, which must be staged first.
    /// (Only single slices are: lists of several may not name one.)
    #[inline]
    pub(crate) fn stages_out(&self) -> bool {
        !self.op.nic_writes_local() && self.local.one().is_some_and(|s| !s.is_empty() && s.mr.is_host_staged())
    }

    /// What can be checked of the request for a queue pair of `pd` without
    /// the queue pair: its memory ([`SgList::check`]), and whether it may
    /// be inline at all.
    #[inline]
    pub(crate) fn check(&self, pd: &ProtectionDomain) -> Result<()> {
        self.local.check(pd)?;
        if self.window.is_some_and(|w| !w.pd().same_as(pd)) {
            return Err(Error::ForeignMemoryRegion);
        }
        if self.inline {
            self.check_inline()?;
        }
        Ok(())
    }

    #[cold]
    fn check_inline(&self) -> Result<()> {
        if !self.local.cpu_addressable() {
            return Err(Error::InvalidArgument(
                "inline sends copy the payload with the CPU, which cannot read GPU memory registered for GPUDirect RDMA".into(),
            ));
        }
        if self.op.nic_writes_local() {
            return Err(Error::InvalidArgument(
                "an RDMA read or atomic cannot be inline: the NIC writes its local buffer".into(),
            ));
        }
        Ok(())
    }

    #[inline]
    fn send_flags(&self) -> u32 {
        (if self.signaled { sys::IBV_SEND_SIGNALED } else { 0 }) | if self.inline { sys::IBV_SEND_INLINE } else { 0 }
    }

    /// Writes the request into a chain slot, with `sg` as its own SGE and
    /// `gather` the space for a list of several ([`SgList::write_sges`]):
    /// every field a provider reads for an RC send, write, read or atomic
    /// except `wr_id` and `next`, which the poster sets. The slot's other
    /// fields are left as they are (zero in a fresh slot).
    #[inline]
    pub(crate) fn write_raw(&self, raw: &mut sys::ibv_send_wr, sg: &mut sys::ibv_sge, gather: &mut &mut [sys::ibv_sge]) {
        let (opcode, imm) = self.op.raw();
        raw.opcode = opcode;
        raw.__bindgen_anon_1.imm_data = imm.to_be();
        if let Some(window) = self.window {
            self.write_raw_bind(raw, window);
            return;
        }
        if let SendOp::Invalidate(rkey) = self.op {
            raw.__bindgen_anon_1.invalidate_rkey = rkey;
            raw.send_flags = self.send_flags();
            (raw.sg_list, raw.num_sge) = (std::ptr::null_mut(), 0);
            return;
        }
        let atomic = match self.op {
            SendOp::CompareSwap { compare, swap } => Some((compare, swap)),
            SendOp::FetchAdd(add) => Some((add, 0)),
            _ => None,
        };
        match atomic {
            Some((compare_add, swap)) => {
                raw.wr.atomic = sys::ibv_send_wr__bindgen_ty_2__bindgen_ty_2 { remote_addr: self.remote_addr, compare_add, swap, rkey: self.rkey };
            }
            None => {
                // Sends carry zeros here (SendWr::send sets none).
                raw.wr.rdma.remote_addr = self.remote_addr;
                raw.wr.rdma.rkey = self.rkey;
            }
        }
        raw.send_flags = self.send_flags();
        (raw.sg_list, raw.num_sge) = self.local.write_sges(sg, gather);
    }
}

impl SendWr<'_> {
    /// What a bind names: the window, its new key and the range.
    fn bind_parts(&self, window: &MemoryWindow) -> (*mut sys::ibv_mw, u32, sys::ibv_mw_bind_info) {
        let SendOp::BindWindow { rkey, access } = self.op else { unreachable!("only binds name a window") };
        let s = self.local.one().expect("a bind names one slice (SendWr::bind_window)");
        let e = s.sge();
        (window.as_ptr(), rkey, sys::ibv_mw_bind_info { mr: s.mr.as_ptr(), addr: e.addr, length: s.len as u64, mw_access_flags: access })
    }

    #[cold]
    fn write_raw_bind(&self, raw: &mut sys::ibv_send_wr, window: &MemoryWindow) {
        let (mw, rkey, bind_info) = self.bind_parts(window);
        raw.__bindgen_anon_2.bind_mw = sys::ibv_send_wr__bindgen_ty_4__bindgen_ty_1 { mw, rkey, bind_info };
        raw.send_flags = self.send_flags();
        (raw.sg_list, raw.num_sge) = (std::ptr::null_mut(), 0);
    }

    /// Builds the request on an extended queue pair with the `ibv_wr_*`
    /// builders: what [`write_raw`](Self::write_raw) writes into a chain
    /// slot, `wr_id` included.
    ///
    /// # Safety
    /// `qpx` is a live extended queue pair inside `ibv_wr_start` on this
    /// thread, created with this request's opcode among its
    /// `send_ops_flags`; the request is not a list of several slices
    /// (`SgList::gather_sges` is 0); the memory named is registered and
    /// held until the request's completion.
    #[inline]
    pub(crate) unsafe fn write_ex(&self, qpx: *mut sys::ibv_qp_ex, wr_id: u64) {
        let (rkey, addr) = (self.rkey, self.remote_addr);
        // SAFETY: the caller's contract; the builders only record the
        // request until ibv_wr_complete.
        unsafe {
            (*qpx).wr_id = wr_id;
            // IBV_SEND_INLINE too, though ibv_wr_post(3) lists no such
            // flag: Soft-RoCE's kernel side goes by it (without it an
            // inline write fails with a local QP operation error), others
            // ignore it.
            (*qpx).wr_flags = self.send_flags();
            if let Some(window) = self.window {
                let (mw, rkey, info) = self.bind_parts(window);
                sys::ibv_wr_bind_mw(qpx, mw, rkey, &info);
                // The provider has read the key the bind replaces.
                window.posted_bind(rkey, self.local.one().expect("a bind names one slice").mr);
                return;
            }
            self.op.write_ex(qpx, rkey, addr);
            if matches!(self.op, SendOp::Invalidate(_)) {
                // An invalidation names no memory.
                return;
            }
            match self.local.one() {
                Some(s) if self.inline => {
                    let e = s.sge();
                    sys::ibv_wr_set_inline_data(qpx, e.addr as *mut std::ffi::c_void, s.len());
                }
                Some(s) if !s.is_empty() => {
                    let e = s.sge();
                    sys::ibv_wr_set_sge(qpx, e.lkey, e.addr, e.length);
                }
                // No bytes (an immediate alone, an empty slice).
                _ => sys::ibv_wr_set_sge_list(qpx, 0, std::ptr::null()),
            }
        }
    }
}

/// A one-request send list prepared once and aimed anew at each post
/// ([`QueuePair::post_aimed`](crate::QueuePair::post_aimed)): the
/// operation and its signaling are fixed when it is made; the local range,
/// the remote address and key, the immediate data and the id are given per
/// post. For a loop that sends one message at a time to addresses a peer
/// hands out (a fifo of receives, a ring of slots), it skips what
/// [`post_send`](crate::QueuePair::post_send) checks of a batch in general:
/// what is left is the region's domain and length, and the memory is held
/// until the completion exactly as `post_send` holds it.
///
/// ```
/// # fn f(qp: &gpudirect::QueuePair, src: &gpudirect::MemoryRegion, addr: u64, rkey: u32) -> gpudirect::Result<()> {
/// use gpudirect::SendTemplate;
/// let write = SendTemplate::write_with_imm();
/// for i in 0..4u32 {
///     // 64 bytes to the peer's address `addr + 64 i`, the immediate saying which.
///     qp.post_aimed(&write, src.slice(0..64)?, addr + 64 * u64::from(i), rkey, i, u64::from(i))?;
///     // ... reap its completion
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SendTemplate {
    op: TemplateOp,
    signaled: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TemplateOp {
    Write,
    WriteWithImm,
    Send,
    SendWithImm,
}

impl SendTemplate {
    /// RDMA writes (the immediate given per post is ignored).
    pub const fn write() -> Self {
        SendTemplate { op: TemplateOp::Write, signaled: true }
    }

    /// RDMA writes with immediate data, each consuming one of the peer's
    /// posted receives.
    pub const fn write_with_imm() -> Self {
        SendTemplate { op: TemplateOp::WriteWithImm, signaled: true }
    }

    /// Sends (the remote address and key given per post are ignored).
    pub const fn send() -> Self {
        SendTemplate { op: TemplateOp::Send, signaled: true }
    }

    /// Sends with immediate data.
    pub const fn send_with_imm() -> Self {
        SendTemplate { op: TemplateOp::SendWithImm, signaled: true }
    }

    /// Posts generate no completion (see [`SendWr::unsignaled`]).
    pub const fn unsignaled(self) -> Self {
        SendTemplate { signaled: false, ..self }
    }

    /// The operation of one post, `imm` its immediate data where it has one.
    #[inline]
    fn op(&self, imm: u32) -> SendOp {
        match self.op {
            TemplateOp::Write => SendOp::Write,
            TemplateOp::WriteWithImm => SendOp::WriteWithImm(imm),
            TemplateOp::Send => SendOp::Send,
            TemplateOp::SendWithImm => SendOp::SendWithImm(imm),
        }
    }

    /// Whether its posts name the peer's memory.
    #[inline]
    fn is_write(&self) -> bool {
        matches!(self.op, TemplateOp::Write | TemplateOp::WriteWithImm)
    }

    /// The request of one post.
    #[inline]
    pub(crate) fn aim<'a>(&self, local: LocalSlice<'a>, remote_addr: u64, rkey: u32, imm: u32, wr_id: u64) -> SendWr<'a> {
        let (remote_addr, rkey) = if self.is_write() { (remote_addr, rkey) } else { (0, 0) };
        SendWr { wr_id, op: self.op(imm), local: local.into(), remote_addr, rkey, signaled: self.signaled, inline: false, window: None }
    }

    /// What a completion of its posts reports as the operation.
    #[inline]
    pub(crate) fn wc_opcode(&self) -> WcOpcode {
        self.op(0).wc_opcode()
    }

    /// Whether its posts produce a completion when they succeed.
    #[inline]
    pub(crate) fn signaled(&self) -> bool {
        self.signaled
    }

    /// Builds one post of it on an extended queue pair, its bytes `sge`:
    /// what [`SendWr::write_ex`] builds for the request [`aim`](Self::aim)
    /// makes, without making it (the queue pair's aimed post, whose cost
    /// per message is the point of a template).
    ///
    /// # Safety
    /// As [`SendWr::write_ex`]: `qpx` is a live extended queue pair inside
    /// `ibv_wr_start` on this thread, created with this template's opcode
    /// among its `send_ops_flags`; `sge` names registered memory (at least
    /// one byte) held until the request's completion.
    #[inline]
    pub(crate) unsafe fn write_ex(&self, qpx: *mut sys::ibv_qp_ex, wr_id: u64, sge: sys::ibv_sge, remote_addr: u64, rkey: u32, imm: u32) {
        // SAFETY: the caller's contract (a template's operation is never a
        // bind); the builders only record the request until
        // ibv_wr_complete.
        unsafe {
            (*qpx).wr_id = wr_id;
            (*qpx).wr_flags = if self.signaled { sys::IBV_SEND_SIGNALED } else { 0 };
            self.op(imm).write_ex(qpx, rkey, remote_addr);
            sys::ibv_wr_set_sge(qpx, sge.lkey, sge.addr, sge.length);
        }
    }
}

/// Reused between posts so posting allocates nothing.
#[derive(Default)]
pub(crate) struct Scratch {
    /// One SGE per request, for a request of one slice.
    pub(crate) sges: Vec<sys::ibv_sge>,
    /// The SGEs of requests with several slices, in request order.
    pub(crate) gather: Vec<sys::ibv_sge>,
    pub(crate) send: Vec<sys::ibv_send_wr>,
    pub(crate) recv: Vec<sys::ibv_recv_wr>,
}

// SAFETY: the vectors' raw pointers only point into themselves while the
// owning queue's mutex is held during one post, and are never read after.
unsafe impl Send for Scratch {}

impl Scratch {
    /// Makes room for a chain of `n` send requests whose lists of several
    /// slices have `gather` entries in all.
    #[inline]
    pub(crate) fn fit_send(&mut self, n: usize, gather: usize) {
        if self.send.len() < n {
            self.send.resize(n, sys::ibv_send_wr::default());
            self.sges.resize(n, sys::ibv_sge::default());
        }
        self.fit_gather(gather);
    }

    /// As [`fit_send`](Self::fit_send), for receive requests.
    #[inline]
    pub(crate) fn fit_recv(&mut self, n: usize, gather: usize) {
        if self.recv.len() < n {
            self.recv.resize(n, sys::ibv_recv_wr::default());
            self.sges.resize(n, sys::ibv_sge::default());
        }
        self.fit_gather(gather);
    }

    #[inline]
    fn fit_gather(&mut self, gather: usize) {
        if self.gather.len() < gather {
            self.gather.resize(gather, sys::ibv_sge::default());
        }
    }
}

/// Send-queue work requests checked and written out once, then posted any
/// number of times by [`QueuePair::post_list`](crate::QueuePair::post_list):
/// perftest's way of reposting one prepared chain, for loops that send the
/// same requests over and over (benchmarks, fixed ring slots). Each post
/// still holds the memory and tracks every request exactly as
/// [`post_send`](crate::QueuePair::post_send) does; what it saves is
/// checking and rewriting requests that have not changed.
///
/// Between posts, [`set_wr_id`](Self::set_wr_id) and
/// [`set_signaled`](Self::set_signaled) change what the next post reports;
/// they take effect on the next post (a posted request is not touched).
///
/// ```
/// # fn f(qp: &gpudirect::QueuePair, src: &gpudirect::MemoryRegion, dst: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
/// use gpudirect::{SendList, SendWr};
/// let wrs = [
///     SendWr::write(src.slice(0..4096)?, dst, 0)?.unsignaled(),
///     SendWr::write(src.slice(4096..8192)?, dst, 4096)?.wr_id(7),
/// ];
/// let mut list = SendList::new(&wrs)?;
/// for round in 0..3 {
///     list.set_wr_id(1, round)?;
///     qp.post_list(&mut list)?;
///     // ... reap the completion of `round` before the next post
/// }
/// # Ok(()) }
/// ```
///
/// The list borrows the regions it names, so none can be dropped while it
/// exists (see the `compile_fail` catalogue in the crate's source).
pub struct SendList<'a> {
    wrs: Box<[SendWr<'a>]>,
    /// The requests as the provider reads them, chained (`next`) in order;
    /// each post writes only their `wr_id`s.
    chain: Vec<sys::ibv_send_wr>,
    /// One SGE per request of one slice, and the SGEs of those of several:
    /// `chain` points into them (they are only read through it, except
    /// that an empty second one says no request is a list of several).
    sges: (Vec<sys::ibv_sge>, Vec<sys::ibv_sge>),
    /// The protection domain of every region named (none when no request names memory).
    pd: Option<ProtectionDomain>,
    longest_inline: usize,
    /// The most SGEs of one request, and of one RDMA read.
    most_sges: (usize, usize),
    stages: bool,
    atomics: bool,
}

// SAFETY: the raw pointers in `chain` point only into the list's own heap
// buffers, which move with it; the requests (`SendWr`) are `Send`.
unsafe impl Send for SendList<'_> {}

impl<'a> SendList<'a> {
    /// Checks `wrs` and writes them out as one chain.
    ///
    /// # Errors
    /// [`Error::ForeignMemoryRegion`] when the regions are not all of one
    /// protection domain; [`Error::TooLong`] for a request over 4 GiB;
    /// [`Error::InvalidArgument`] for an inline RDMA read, an inline
    /// request from GPU memory, or a list of several slices naming a
    /// host-staged GPU region. Whether the queue pair allows an inline
    /// request's length and a request's number of slices is checked when
    /// the list is posted.
    pub fn new(wrs: &[SendWr<'a>]) -> Result<Self> {
        if wrs.iter().any(|w| w.op.is_window()) {
            return Err(Error::InvalidArgument(
                "a prepared list cannot hold a window's bind or invalidation: each bind gives a new key, so it is posted once (QueuePair::post_send)".into(),
            ));
        }
        let pd = wrs.iter().find_map(|w| w.local.first_region()).map(|mr| mr.pd().clone());
        for w in wrs {
            match &pd {
                Some(pd) => w.check(pd)?,
                // No request names memory: only inline-ness is left to judge.
                None if w.inline => w.check_inline()?,
                None => {}
            }
        }
        let n = wrs.len();
        let mut chain = vec![sys::ibv_send_wr::default(); n];
        let mut sges = vec![sys::ibv_sge::default(); n];
        let mut gather = vec![sys::ibv_sge::default(); wrs.iter().map(|w| w.local.gather_sges()).sum()];
        let mut free = &mut gather[..];
        for (i, (w, sg)) in wrs.iter().zip(&mut sges).enumerate() {
            w.write_raw(&mut chain[i], sg, &mut free);
        }
        let base = chain.as_mut_ptr();
        for i in 0..n.saturating_sub(1) {
            // SAFETY: `i + 1 < n`: both slots are in the vector, which never
            // grows, so the links stay valid for the list's life (as do the
            // SGE pointers, into vectors that never grow either).
            unsafe { (*base.add(i)).next = base.add(i + 1) };
        }
        let most = |reads: bool| wrs.iter().filter(|w| !reads || w.op == SendOp::Read).map(|w| w.local.num_sge()).max().unwrap_or(0);
        Ok(SendList {
            wrs: wrs.into(),
            chain,
            sges: (sges, gather),
            pd,
            longest_inline: wrs.iter().filter(|w| w.inline).map(|w| w.local.len()).max().unwrap_or(0),
            most_sges: (most(false), most(true)),
            stages: wrs.iter().any(|w| w.stages_out()),
            atomics: wrs.iter().any(|w| w.op.is_atomic()),
        })
    }

    /// Number of requests.
    pub fn len(&self) -> usize {
        self.wrs.len()
    }

    /// Whether the list has no request.
    pub fn is_empty(&self) -> bool {
        self.wrs.is_empty()
    }

    /// Sets the id that request `index` reports from the next post on.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when there is no such request.
    pub fn set_wr_id(&mut self, index: usize, wr_id: u64) -> Result<()> {
        self.request(index)?.wr_id = wr_id;
        Ok(())
    }

    /// Sets whether request `index` generates a completion from the next
    /// post on (see [`SendWr::unsignaled`]).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when there is no such request.
    pub fn set_signaled(&mut self, index: usize, signaled: bool) -> Result<()> {
        self.request(index)?.signaled = signaled;
        self.chain[index].send_flags = self.wrs[index].send_flags();
        Ok(())
    }

    /// Sets every request's id to `each`, the last one's to `last` (the
    /// engine numbers a prepared list this way at each post).
    pub fn set_wr_ids(&mut self, each: u64, last: u64) {
        if let Some((end, rest)) = self.wrs.split_last_mut() {
            for w in rest {
                w.wr_id = each;
            }
            end.wr_id = last;
        }
    }

    fn request(&mut self, index: usize) -> Result<&mut SendWr<'a>> {
        let n = self.wrs.len();
        self.wrs
            .get_mut(index)
            .ok_or_else(|| Error::InvalidArgument(format!("request {index} of a send list of {n}")))
    }

    /// The requests, as they will next be posted.
    pub fn requests(&self) -> &[SendWr<'a>] {
        &self.wrs
    }

    /// The protection domain of the regions named (`None` when no request names memory).
    pub(crate) fn pd(&self) -> Option<&ProtectionDomain> {
        self.pd.as_ref()
    }

    /// The longest inline payload, 0 when no request is inline.
    pub(crate) fn longest_inline(&self) -> usize {
        self.longest_inline
    }

    /// The most SGEs of one request, and of one RDMA read (the queue pair
    /// and the device must allow them).
    pub(crate) fn most_sges(&self) -> (usize, usize) {
        self.most_sges
    }

    /// Whether no request is a list of several slices (they have SGEs in
    /// the shared gather space).
    pub(crate) fn gathers_none(&self) -> bool {
        self.sges.1.is_empty()
    }

    /// Whether a request is an atomic (the queue pair's device must do them).
    pub(crate) fn has_atomics(&self) -> bool {
        self.atomics
    }

    /// Whether a request's source is a host-staged GPU region (these are
    /// posted one by one, staged, as `post_send` posts them).
    pub(crate) fn stages(&self) -> bool {
        self.stages
    }

    /// The chain, to post, with the requests it was written from.
    pub(crate) fn parts(&mut self) -> (&[SendWr<'a>], &mut Vec<sys::ibv_send_wr>) {
        (&self.wrs, &mut self.chain)
    }
}

impl std::fmt::Debug for SendList<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendList").field("requests", &self.wrs).finish()
    }
}

/// A receive-queue work request: where the next incoming send (or the
/// notification of a write with immediate) lands.
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    pub(crate) wr_id: u64,
    pub(crate) local: SgList<'a>,
}

impl<'a> RecvWr<'a> {
    /// A receive into `local`: one [`LocalSlice`], or several that an
    /// incoming message fills in order (see [`SgList`]).
    pub fn new(local: impl Into<SgList<'a>>) -> Self {
        RecvWr { wr_id: 0, local: local.into() }
    }

    /// A receive of no bytes, naming no memory: for the notification of a
    /// write with immediate data ([`SendWr::immediate`],
    /// [`SendWr::write_with_imm`], whose bytes land where the write says),
    /// or a zero-length send. A send with data into it fails (at both
    /// ends) with a length error.
    pub fn empty() -> Self {
        RecvWr { wr_id: 0, local: SgList::empty() }
    }

    /// Sets the id reported in this request's completion.
    pub fn wr_id(mut self, id: u64) -> Self {
        self.wr_id = id;
        self
    }

    /// Checks a batch for a receive queue of `pd` taking at most `max_sge`
    /// entries per receive (the limit is `field` in errors); returns the
    /// SGEs of its lists of several slices, together.
    pub(crate) fn check_batch(wrs: &[RecvWr<'_>], pd: &ProtectionDomain, max_sge: u32, field: &str) -> Result<usize> {
        let mut gather = 0;
        for wr in wrs {
            wr.local.check(pd)?;
            let g = wr.local.gather_sges();
            if g > max_sge as usize {
                return Err(Error::InvalidArgument(format!(
                    "a receive of {g} scatter/gather entries: the queue allows {max_sge} ({field})"
                )));
            }
            gather += g;
        }
        Ok(gather)
    }
}
