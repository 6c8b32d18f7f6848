//! Memory regions (`ibv_reg_mr`): memory the NIC may read and write.

use std::any::Any;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use bitflags::bitflags;
use gpudirect_sys as sys;

use crate::error::{Errno, Error, Result};
use crate::policy::RegistrationPath;
use crate::sysroot::page_size;
use crate::gpu::GpuBuffer;
use crate::pd::ProtectionDomain;
use crate::claims::{RegionClaims, Use};
use crate::sync::Mutex;
use crate::wire::RemoteBuffer;

mod gpu;
mod host;
mod inflight;
mod slice;

pub use host::{HostBuffer, Registerable};
pub(crate) use inflight::{Hold, InFlight};
pub use slice::{LocalSlice, SgList};

bitflags! {
    /// Who may access a memory region, and how (`enum ibv_access_flags`).
    ///
    /// The default is least privilege: [`LOCAL_WRITE`](Self::LOCAL_WRITE)
    /// only, so the region can be a send source or receive destination and
    /// no peer can touch it. Remote access is granted only when asked for.
    /// (Verbs require `LOCAL_WRITE` whenever `REMOTE_WRITE` or
    /// `REMOTE_ATOMIC` is set; [`MemoryRegion::register`] adds it.)
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct AccessFlags: u32 {
        /// The local NIC may write (receives, RDMA read destinations).
        const LOCAL_WRITE = sys::IBV_ACCESS_LOCAL_WRITE;
        /// Peers may RDMA-write into the region.
        const REMOTE_WRITE = sys::IBV_ACCESS_REMOTE_WRITE;
        /// Peers may RDMA-read from the region.
        const REMOTE_READ = sys::IBV_ACCESS_REMOTE_READ;
        /// Peers may perform atomics on the region.
        const REMOTE_ATOMIC = sys::IBV_ACCESS_REMOTE_ATOMIC;
        /// Memory windows may be bound to the region
        /// ([`SendWr::bind_window`](crate::SendWr::bind_window)): with no
        /// remote access of its own, the region is then reachable only
        /// through the windows bound to it.
        const MW_BIND = sys::IBV_ACCESS_MW_BIND;
        /// Allow the NIC to relax PCIe ordering (faster on some systems;
        /// ignored where unsupported).
        const RELAXED_ORDERING = sys::IBV_ACCESS_RELAXED_ORDERING;
    }
}

impl Default for AccessFlags {
    fn default() -> Self {
        AccessFlags::LOCAL_WRITE
    }
}

pub(crate) struct MrInner {
    mr: NonNull<sys::ibv_mr>,
    addr: *mut u8,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: AccessFlags,
    /// Shared with every registration of the same bytes ([`MemoryRegion::register_in`]).
    pub(crate) claims: Arc<SharedClaims>,
    pd: ProtectionDomain,
    /// GPU memory behind the region, if any.
    gpu: ManuallyDrop<Option<GpuMemory>>,
    /// Freed by the Drop body after deregistration, and only if it succeeded.
    backing: ManuallyDrop<Box<dyn Any + Send + Sync>>,
}

/// Who uses a region's bytes, shared by every registration of them (one
/// per protection domain, [`MemoryRegion::register_in`]): a copy through
/// one registration must see what a request posted through another holds.
#[derive(Default)]
pub(crate) struct SharedClaims {
    record: RegionClaims,
    /// The domain of each registration: where a copy looks up what posted
    /// requests hold (only a domain's queue pairs can post its regions).
    domains: Mutex<Vec<ProtectionDomain>>,
}

impl std::ops::Deref for SharedClaims {
    type Target = RegionClaims;
    #[inline(always)]
    fn deref(&self) -> &RegionClaims {
        &self.record
    }
}

impl SharedClaims {
    fn conflict(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
        self.domains.lock().iter().any(|pd| pd.inner.holders.conflict(region, start, end, use_))
    }
}

/// The GPU side of a GPU memory region. Its bytes are the region's bytes
/// as the program sees them; for [`RegistrationPath::HostStaged`] the NIC
/// works on a pinned host mirror at the region's address instead.
struct GpuMemory {
    buf: GpuBuffer,
    path: RegistrationPath,
}

/// Where a region's bytes live and how the NIC reaches them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host memory.
    Host,
    /// GPU memory.
    Gpu {
        /// CUDA ordinal.
        ordinal: usize,
        /// How it was registered.
        path: RegistrationPath,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Host => f.write_str("host memory"),
            Location::Gpu { ordinal, path } => write!(f, "GPU{ordinal} memory, path: {path}"),
        }
    }
}

// SAFETY: the raw pointers address memory owned by `_backing` or `gpu`
// (Send+Sync) or promised valid by the caller of `register_raw`; every
// access goes through copies guarded by `busy`.
unsafe impl Send for MrInner {}
// SAFETY: as above; shared access never creates references to the bytes.
unsafe impl Sync for MrInner {}

/// Whether a test asked this deregistration to fail ([`crate::fault`]).
#[inline]
fn injected_dereg_failure() -> bool {
    #[cfg(feature = "fault-injection")]
    return crate::fault::take_dereg_mr_failure();
    #[cfg(not(feature = "fault-injection"))]
    false
}

impl Drop for MrInner {
    fn drop(&mut self) {
        let ret = if injected_dereg_failure() {
            libc::EBUSY
        } else {
            // SAFETY: the last handle is gone, so no work request references
            // the region; deregister before the backing memory is freed.
            unsafe { sys::ibv_dereg_mr(self.mr.as_ptr()) }
        };
        if ret != 0 {
            // The MR, and a peer's rkey to it, may still be valid: leak the
            // memory rather than free pages the NIC can still reach.
            tracing::warn!(
                "{}; leaking the region's {} bytes so the NIC cannot reach freed memory",
                Error::returned("ibv_dereg_mr", ret),
                self.len
            );
            return;
        }
        // SAFETY: deregistered, so nothing reaches the memory any more; each
        // field is dropped once, here, and never used again.
        unsafe {
            ManuallyDrop::drop(&mut self.backing);
            ManuallyDrop::drop(&mut self.gpu);
        }
    }
}

/// A registered memory region. Cheap to clone (a reference-counted
/// handle); deregistered when the last handle and the last work request
/// using it are gone.
///
/// # Thread safety
/// `Send + Sync`. Copies and posts from any number of threads are checked
/// against one record of who uses which bytes; an access that conflicts
/// with one in progress (a CPU copy on another thread, or a posted request
/// not yet reaped) fails with [`Error::Busy`] naming which, and never
/// waits. Overlapping reads are allowed; anything that writes excludes
/// every other CPU access of its bytes. Should `ibv_dereg_mr` fail, the
/// memory is leaked rather than freed while the NIC may still reach it.
///
/// ```compile_fail,E0133
/// # fn f(mr: &gpudirect::MemoryRegion) {
/// // Zero-copy views are unsafe: the NIC or a peer may change the bytes.
/// let bytes: Option<&[u8]> = mr.as_slice();
/// # }
/// ```
///
/// # Why there is no `&[u8]` into a registered buffer
/// Once registered, memory can change under the program's feet: the local
/// NIC writes it for receives and RDMA reads, and a peer holding the rkey
/// writes it whenever it likes. A Rust reference promises the opposite, so
/// [`MemoryRegion`] never hands one out in safe code. Bytes move in and out
/// by copy ([`write_at`](MemoryRegion::write_at),
/// [`read_at`](MemoryRegion::read_at)), and those copies refuse ranges that
/// a posted, not yet completed work request is using (so a send's source is
/// not overwritten mid-flight and a receive's destination is not read
/// half-written). Zero-copy access is available as an `unsafe` escape hatch.
///
/// # Lifetimes
/// A [`MemoryRegion`] is a cheap, clonable handle. The region is
/// deregistered, and its memory freed, only when the last handle is gone,
/// and every posted work request holds a handle until its completion is
/// reaped: memory the NIC may still touch is never freed.
#[derive(Clone)]
pub struct MemoryRegion {
    pub(crate) inner: Arc<MrInner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", i.addr as usize))
            .field("len", &i.len)
            .field("lkey", &format_args!("{:#x}", i.lkey))
            .field("rkey", &format_args!("{:#x}", i.rkey))
            .field("access", &i.access)
            .field("location", &self.location())
            .finish()
    }
}

impl MemoryRegion {
    /// Allocates a zeroed, page-aligned [`HostBuffer`] of `len` bytes and
    /// registers it.
    ///
    /// # Errors
    /// See [`register`](Self::register).
    pub fn alloc(pd: &ProtectionDomain, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        Self::register(pd, HostBuffer::new(len)?, access)
    }

    /// Registers caller-owned memory, taking ownership of it for the
    /// region's lifetime.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty buffer;
    /// [`Error::LockedMemoryLimit`] when the pages would exceed the
    /// process's locked-memory limit (`ulimit -l`), naming the limit;
    /// [`Error::Verb`] from `ibv_reg_mr` otherwise, e.g. `EINVAL` for an
    /// access combination the device refuses.
    pub fn register<B: Registerable>(pd: &ProtectionDomain, mut buf: B, access: AccessFlags) -> Result<MemoryRegion> {
        let ptr = buf.as_mut_ptr();
        let len = buf.len();
        // SAFETY: `Registerable` promises `ptr..ptr+len` stays valid and
        // unaliased while `buf` lives, and the region owns `buf`.
        let (mr, access) = unsafe { reg_mr(pd, ptr, len, access)? };
        Ok(Self::finish(pd, mr, ptr, len, access, Box::new(buf), None, None))
    }

    /// Registers this region's bytes again, in protection domain `pd`
    /// (another NIC's, say), as transfer engines register one buffer on
    /// every NIC they use. The new region has its own keys and access
    /// `access` and the same bytes; the two share one record of who uses
    /// them, so a copy through either is refused
    /// ([`Error::Busy`]) while a request posted through either uses the
    /// range. The memory is freed once every registration of it is gone.
    ///
    /// ```no_run
    /// # fn f(a: &gpudirect::ProtectionDomain, b: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
    /// use gpudirect::{AccessFlags, MemoryRegion};
    /// let on_a = MemoryRegion::alloc(a, 1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE)?;
    /// let on_b = on_a.register_in(b, on_a.access())?;
    /// on_b.write_at(0, b"seen through both")?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for GPU memory (each NIC's path to a GPU
    /// is judged on its own: use
    /// [`register_gpu_in`](Self::register_gpu_in)); as
    /// [`register`](Self::register) otherwise.
    pub fn register_in(&self, pd: &ProtectionDomain, access: AccessFlags) -> Result<MemoryRegion> {
        if self.inner.gpu.is_some() {
            return Err(Error::InvalidArgument(format!(
                "{}: GPU memory is registered per NIC, each NIC's path judged on its own (MemoryRegion::register_gpu_in), not copied from another registration",
                self.location()
            )));
        }
        let (addr, len) = (self.inner.addr, self.inner.len);
        // SAFETY: the bytes stay allocated while the new region lives: it
        // keeps this region (which owns or was promised them) as its
        // backing, dropped only after its own deregistration.
        let (mr, access) = unsafe { reg_mr(pd, addr, len, access)? };
        let region = Self::finish(pd, mr, addr, len, access, Box::new(self.clone()), None, Some(self));
        Ok(region)
    }

    /// Registers memory the caller keeps owning, such as a mapping made
    /// with `mmap` or another framework's allocation.
    ///
    /// # Safety
    /// The caller promises that `addr..addr + len` is mapped, readable and
    /// writable memory that stays allocated at that address until the
    /// region and every clone of its handle have been dropped, and that
    /// nothing else creates Rust references to those bytes meanwhile (the
    /// NIC and peers may write them at any time).
    ///
    /// # Errors
    /// As [`register`](Self::register).
    pub unsafe fn register_raw(pd: &ProtectionDomain, addr: *mut u8, len: usize, access: AccessFlags) -> Result<MemoryRegion> {
        // SAFETY: forwarded to our caller.
        let (mr, access) = unsafe { reg_mr(pd, addr, len, access)? };
        Ok(Self::finish(pd, mr, addr, len, access, Box::new(()), None, None))
    }

    /// Asks the NIC's provider whether it can register dma-buf memory, the
    /// way NCCL and UCX do: `ibv_reg_dmabuf_mr` with `fd = -1`, returning
    /// the errno (`EBADF` from a capable provider, `EOPNOTSUPP` or
    /// `EPROTONOSUPPORT` from one that is not).
    pub(crate) fn probe_dmabuf(pd: &ProtectionDomain) -> Errno {
        // SAFETY: an invalid descriptor makes the verb fail before it maps
        // anything; should a provider accept it anyway, the region is
        // deregistered at once.
        match unsafe { reg_dmabuf_mr(pd, 0, 4096, 0, -1, AccessFlags::LOCAL_WRITE) } {
            Err(e) => e.errno().unwrap_or(Errno(0)),
            Ok((mr, _)) => {
                // SAFETY: just registered, unused.
                unsafe { sys::ibv_dereg_mr(mr.as_ptr()) };
                Errno(libc::EBADF)
            }
        }
    }

    /// The region of a registration `mr` of `len` bytes at `addr`,
    /// keeping `backing` (what owns the memory) until it goes. `shares`:
    /// another region of the same memory whose record of users this one
    /// joins (the same bytes registered in another protection domain).
    #[allow(clippy::too_many_arguments)]
    fn finish(
        pd: &ProtectionDomain,
        mr: NonNull<sys::ibv_mr>,
        addr: *mut u8,
        len: usize,
        access: AccessFlags,
        backing: Box<dyn Any + Send + Sync>,
        gpu: Option<GpuMemory>,
        shares: Option<&MemoryRegion>,
    ) -> MemoryRegion {
        let claims: Arc<SharedClaims> = shares.map(|o| o.inner.claims.clone()).unwrap_or_default();
        claims.domains.lock().push(pd.clone());
        // SAFETY: a successfully registered MR is readable.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        let region = MemoryRegion {
            inner: Arc::new(MrInner {
                mr,
                addr,
                len,
                lkey,
                rkey,
                access,
                claims,
                pd: pd.clone(),
                gpu: ManuallyDrop::new(gpu),
                backing: ManuallyDrop::new(backing),
            }),
        };
        match region.location() {
            Location::Host => tracing::trace!(?region, "registered memory region"),
            Location::Gpu { ordinal, path } => tracing::info!(gpu = ordinal, %path, ?region, "registered GPU memory region"),
        }
        region
    }

    /// Where the region's bytes live; for GPU memory, which path
    /// registered it ([`RegistrationPath`]).
    pub fn location(&self) -> Location {
        match &*self.inner.gpu {
            None => Location::Host,
            Some(g) => Location::Gpu { ordinal: g.buf.gpu().ordinal(), path: g.path },
        }
    }

    /// Whether the region's address is host memory the CPU can read (host
    /// regions and the mirrors of host-staged GPU regions).
    #[inline]
    pub(crate) fn cpu_addressable(&self) -> bool {
        self.inner.gpu.as_ref().is_none_or(|g| g.path == RegistrationPath::HostStaged)
    }

    /// Whether this is a GPU region registered by host staging.
    #[inline]
    pub fn is_host_staged(&self) -> bool {
        self.staged().is_some()
    }

    #[inline]
    fn staged(&self) -> Option<&GpuBuffer> {
        self.inner.gpu.as_ref().filter(|g| g.path == RegistrationPath::HostStaged).map(|g| &g.buf)
    }

    /// Holds `offset..offset + len` for a work request about to be posted
    /// (`nic_writes`: a receive or an RDMA read into it), refused while a
    /// CPU copy conflicts. The caller holds its queue's lock and enters
    /// the hold in the queue's pending list before releasing it, which is
    /// where copies look it up. Sends from host-staged regions are claimed
    /// by [`claim_for_staging`](Self::claim_for_staging) instead.
    #[inline(always)]
    pub(crate) fn claim_for_nic(&self, offset: usize, len: usize, nic_writes: bool) -> Result<InFlight> {
        debug_assert!(nic_writes || !self.is_host_staged(), "a host-staged source must be staged (claim_for_staging)");
        let use_ = if nic_writes { Use::NicWrites } else { Use::NicReads };
        self.inner.claims.hold_for_nic(offset, offset + len, use_)?;
        Ok(InFlight { mr: self.clone(), offset, len, nic_writes })
    }

    /// The identity of this region's bytes in the claims record: one for
    /// every registration of them.
    #[inline]
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner.claims) as usize
    }

    /// For sends from a host-staged region: claims the whole source as a
    /// CPU writer (staging writes the mirror, so this is refused while the
    /// NIC writes or reads the range, or a copy runs), to be staged and
    /// handed to the NIC front to back by [`StagingClaim::stage_next`].
    pub(crate) fn claim_for_staging(&self, offset: usize, len: usize) -> Result<StagingClaim<'_>> {
        let claim = self.claim_cpu(offset, len, Use::CpuWrites)?;
        Ok(StagingClaim { claim, next: offset, end: offset + len })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Start address as the NIC sees it (the virtual address registered).
    #[inline]
    pub fn addr(&self) -> u64 {
        self.inner.addr as u64
    }

    /// Local key, used in this side's scatter/gather entries.
    #[inline]
    pub fn lkey(&self) -> u32 {
        self.inner.lkey
    }

    /// Remote key: what a peer needs (with the address) to access the region.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey
    }

    /// The verbs object, for work requests that name the region itself
    /// (a window's bind).
    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mr {
        self.inner.mr.as_ptr()
    }

    /// The access flags the region was registered with.
    pub fn access(&self) -> AccessFlags {
        self.inner.access
    }

    /// The protection domain the region lives in.
    #[inline]
    pub fn pd(&self) -> &ProtectionDomain {
        &self.inner.pd
    }

    /// The descriptor of the whole region that a peer needs to RDMA-write
    /// or RDMA-read it. Only meaningful if the region was registered with
    /// [`AccessFlags::REMOTE_WRITE`] / [`AccessFlags::REMOTE_READ`]; without
    /// them the peer's accesses fail with a remote access error.
    pub fn remote(&self) -> RemoteBuffer {
        RemoteBuffer { addr: self.addr(), len: self.len() as u64, rkey: self.rkey() }
    }

    /// A sub-range of the region, to name in a work request.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] when the range exceeds the region.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<LocalSlice<'_>> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        self.check(start, end.saturating_sub(start))?;
        if end < start {
            return Err(self.oob(start, 0));
        }
        Ok(LocalSlice { mr: self, offset: start, len: end - start })
    }

    /// Copies `src` into the region at `offset`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or [`Error::Busy`] when a posted work
    /// request still uses any byte of the range, or a copy on another
    /// thread does.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        let _claim = self.claim_cpu(offset, src.len(), Use::CpuWrites)?;
        if let Some(g) = &*self.inner.gpu {
            return g.buf.copy_from_host(offset, src);
        }
        // SAFETY: in bounds (checked); no Rust reference to the region's
        // bytes exists (the type hands none out), so `src` cannot overlap
        // them; the claim excludes every other CPU access and posted work
        // request touching the range until the copy is done.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner.addr.add(offset), src.len()) };
        // Make the bytes visible before a later post rings the doorbell.
        fence(Ordering::Release);
        Ok(())
    }

    /// Copies bytes from the region at `offset` into `dst`.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], or [`Error::Busy`] when a posted receive or
    /// RDMA read into the range has not completed, or a copy into it runs
    /// on another thread.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        let _claim = self.claim_cpu(offset, dst.len(), Use::CpuReads)?;
        // Order the copy after the completion (or flag) that announced the data.
        fence(Ordering::Acquire);
        if let Some(g) = &*self.inner.gpu {
            return g.buf.copy_to_host(offset, dst);
        }
        // SAFETY: in bounds; the claim keeps CPU writers and receives or
        // RDMA reads off the range until the copy is done.
        unsafe { std::ptr::copy_nonoverlapping(self.inner.addr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// [`read_at`](Self::read_at) of host memory without the claim: for a
    /// caller that owns the range by its own bookkeeping (the engine's
    /// receive slots, read once their receive completed and before they
    /// are posted again), where the claim's look at every posted work
    /// request naming the region cost more than the message it guards.
    ///
    /// # Safety
    /// No work request posted on the range may be outstanding (a receive
    /// or RDMA read into it completed and was reaped), and no other thread
    /// may write the range until this returns.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::InvalidArgument`] for GPU memory.
    pub unsafe fn read_owned_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        if self.inner.gpu.is_some() {
            return Err(Error::InvalidArgument("read_owned_at reads host memory only".into()));
        }
        // Order the copy after the completion that announced the data.
        fence(Ordering::Acquire);
        // SAFETY: in bounds (checked), host memory; the caller guarantees
        // that neither the NIC nor another thread writes the range now.
        unsafe { std::ptr::copy_nonoverlapping(self.inner.addr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// [`write_at`](Self::write_at) of host memory without the claim, for
    /// a caller that owns the range by its own bookkeeping (the engine's
    /// message slots, written when no send of them is out).
    ///
    /// # Safety
    /// No work request posted on the range may be outstanding, and no
    /// other thread may read or write the range until this returns.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::InvalidArgument`] for GPU memory.
    pub unsafe fn write_owned_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        if self.inner.gpu.is_some() {
            return Err(Error::InvalidArgument("write_owned_at writes host memory only".into()));
        }
        // SAFETY: in bounds (checked), host memory; the caller guarantees
        // that neither the NIC nor another thread touches the range now.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.inner.addr.add(offset), src.len()) };
        // Make the bytes visible before a later post rings the doorbell.
        fence(Ordering::Release);
        Ok(())
    }

    /// Copies the whole region into a new vector.
    ///
    /// # Errors
    /// As [`read_at`](Self::read_at).
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// Sets every byte of `range` to `byte`.
    ///
    /// # Errors
    /// As [`write_at`](Self::write_at).
    pub fn fill(&self, range: impl RangeBounds<usize>, byte: u8) -> Result<()> {
        let s = self.slice(range)?;
        let _claim = self.claim_cpu(s.offset, s.len, Use::CpuWrites)?;
        if let Some(g) = &*self.inner.gpu {
            return g.buf.copy_from_host(s.offset, &vec![byte; s.len]);
        }
        // SAFETY: in bounds (slice checked it); no references exist; the
        // claim excludes other users of the range.
        unsafe { std::ptr::write_bytes(self.inner.addr.add(s.offset), byte, s.len) };
        fence(Ordering::Release);
        Ok(())
    }

    /// Reads one byte with a volatile load: for polling a flag a peer
    /// writes with RDMA (the compiler may not cache it across iterations).
    /// It is not checked against posted work requests: a flag is expected
    /// to change under the reader. It waits for no one either: while a
    /// copy into the byte runs on another thread it answers
    /// [`Error::Busy`], as a CPU load racing a CPU store would be a data race.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]; [`Error::InvalidArgument`] for GPU memory,
    /// which the CPU cannot poll (use writes with immediate data instead);
    /// [`Error::Busy`] as above.
    pub fn read_volatile(&self, offset: usize) -> Result<u8> {
        self.check(offset, 1)?;
        if self.inner.gpu.is_some() {
            return Err(Error::InvalidArgument(
                "GPU memory cannot be polled by the CPU: signal arrival with a write with immediate data".into(),
            ));
        }
        let _claim = self.claim_cpu(offset, 1, Use::CpuPolls)?;
        // SAFETY: in bounds; a byte load cannot tear; no CPU store to the
        // byte runs meanwhile (the claim).
        let b = unsafe { std::ptr::read_volatile(self.inner.addr.add(offset)) };
        fence(Ordering::Acquire);
        Ok(b)
    }

    /// The region's bytes as a slice, without copying; `None` for GPU
    /// memory, which the CPU cannot address.
    ///
    /// # Safety
    /// While the returned slice lives, nothing may write the region: no
    /// posted receive or RDMA read into it may be outstanding, no peer may
    /// RDMA-write it (e.g. it has no `REMOTE_WRITE` access or the
    /// application protocol rules it out), and no `write_at`/`fill` or
    /// `as_mut_slice` may run on any handle of it.
    pub unsafe fn as_slice(&self) -> Option<&[u8]> {
        if self.inner.gpu.is_some() {
            return None;
        }
        // SAFETY: host memory; the caller promises no writer exists meanwhile.
        Some(unsafe { std::slice::from_raw_parts(self.inner.addr, self.inner.len) })
    }

    /// The region's bytes as a mutable slice, without copying; `None` for
    /// GPU memory.
    ///
    /// # Safety
    /// While the returned slice lives, nothing else may read or write the
    /// region: no posted work request may use it, no peer may access it
    /// remotely, and no other handle's accessors or slices may be used.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn as_mut_slice(&self) -> Option<&mut [u8]> {
        if self.inner.gpu.is_some() {
            return None;
        }
        // SAFETY: host memory; the caller promises exclusive access meanwhile.
        Some(unsafe { std::slice::from_raw_parts_mut(self.inner.addr, self.inner.len) })
    }

    fn oob(&self, offset: usize, requested: usize) -> Error {
        Error::OutOfBounds {
            what: "local memory region",
            offset: offset as u64,
            requested: requested as u64,
            len: self.len() as u64,
        }
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len() => Ok(()),
            _ => Err(self.oob(offset, len)),
        }
    }

    /// Claims a range for a CPU copy until the returned guard drops.
    fn claim_cpu(&self, offset: usize, len: usize, use_: Use) -> Result<CpuClaim<'_>> {
        let token = if len == 0 {
            0
        } else {
            let claims = &self.inner.claims;
            claims.claim_cpu(&|r, s, e, u| claims.conflict(r, s, e, u), self.id(), offset, offset + len, use_)?
        };
        Ok(CpuClaim { mr: self, token })
    }
}

/// A send source of a host-staged region, staged into the mirror and
/// handed to the NIC piece by piece (chunked posts overlap the copy of one
/// chunk with the transfer of the one before).
pub(crate) struct StagingClaim<'a> {
    claim: CpuClaim<'a>,
    next: usize,
    end: usize,
}

impl StagingClaim<'_> {
    /// Stages the next `len` bytes and returns the NIC's hold on them. The
    /// caller holds the queue's lock and enters the hold before releasing it.
    pub(crate) fn stage_next(&mut self, len: usize) -> Result<InFlight> {
        let mr = self.claim.mr;
        let (offset, upto) = (self.next, (self.next + len).min(self.end));
        if let Some(buf) = mr.staged() {
            // SAFETY: the mirror range is inside the region (callers pass
            // slices of it), no Rust reference to it exists, and this CPU
            // claim keeps the NIC and other copies off it.
            unsafe { buf.copy_to_raw(offset, mr.inner.addr.add(offset), upto - offset) }?;
        }
        mr.inner.claims.hold_claimed();
        if mr.inner.claims.hand_prefix_to_nic(self.claim.token, upto) {
            self.claim.token = 0; // fully handed over: nothing left to release
        }
        self.next = upto;
        Ok(InFlight { mr: mr.clone(), offset, len: upto - offset, nic_writes: false })
    }
}

/// A CPU copy's claim on a range (token 0: an empty range, nothing held).
struct CpuClaim<'a> {
    mr: &'a MemoryRegion,
    token: u64,
}

impl Drop for CpuClaim<'_> {
    fn drop(&mut self) {
        if self.token != 0 {
            self.mr.inner.claims.release_cpu(self.token);
        }
    }
}

/// `ibv_reg_mr`, with `LOCAL_WRITE` added where verbs require it. Returns
/// the MR and the access actually registered.
///
/// # Safety
/// `addr..addr+len` must stay registrable (mapped, or claimed by a
/// peer-memory client) until the MR is deregistered.
unsafe fn reg_mr(pd: &ProtectionDomain, addr: *mut u8, len: usize, access: AccessFlags) -> Result<(NonNull<sys::ibv_mr>, AccessFlags)> {
    let access = checked_access(len, access)?;
    // SAFETY: valid PD; the range per our contract. `__ibv_reg_mr` is the
    // inline `ibv_reg_mr` expands to (it handles optional access flags).
    let mr = unsafe { sys::__ibv_reg_mr(pd.as_ptr(), addr.cast(), len, access.bits(), 0) };
    match NonNull::new(mr) {
        Some(mr) => Ok((mr, access)),
        None => Err(reg_mr_error(Error::last("ibv_reg_mr"), addr as usize, len)),
    }
}

/// Tells a locked-memory limit apart from other `ENOMEM`s: the kernel pins
/// registered pages and refuses once the process's pinned total would pass
/// `RLIMIT_MEMLOCK`, unless it holds `CAP_IPC_LOCK`.
fn reg_mr_error(err: Error, addr: usize, len: usize) -> Error {
    if err.errno() != Some(Errno(libc::ENOMEM)) {
        return err;
    }
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return err };
    let Some(limit) = memlock_limit(&status) else { return err };
    // The kernel pins whole pages.
    let page = page_size();
    let requested = ((addr + len).next_multiple_of(page) - addr / page * page) as u64;
    let pinned = status_kib(&status, "VmPin:").map(|k| k * 1024);
    if pinned.unwrap_or(0).saturating_add(requested) <= limit {
        return err; // within the limit: some other shortage
    }
    Error::LockedMemoryLimit { verb: "ibv_reg_mr", requested, limit, pinned }
}

/// The soft `RLIMIT_MEMLOCK` in bytes, or `None` when it does not apply
/// (unlimited, or the process holds `CAP_IPC_LOCK` per `status`, the text
/// of /proc/self/status).
fn memlock_limit(status: &str) -> Option<u64> {
    let mut rl = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) } != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).map(str::trim)?;
    let caps = u64::from_str_radix(cap_eff, 16).ok()?;
    const CAP_IPC_LOCK: u32 = 14;
    (caps & (1 << CAP_IPC_LOCK) == 0).then_some(rl.rlim_cur)
}

/// A `kB` field of /proc/self/status, e.g. `VmPin:       8 kB`.
fn status_kib(status: &str, field: &str) -> Option<u64> {
    status.lines().find_map(|l| l.strip_prefix(field))?.split_whitespace().next()?.parse().ok()
}

/// `ibv_reg_dmabuf_mr`.
///
/// # Safety
/// `fd` must be a dma-buf (or invalid, which fails) whose exporter keeps the
/// memory alive until the MR is deregistered.
unsafe fn reg_dmabuf_mr(
    pd: &ProtectionDomain,
    offset: u64,
    len: usize,
    iova: u64,
    fd: i32,
    access: AccessFlags,
) -> Result<(NonNull<sys::ibv_mr>, AccessFlags)> {
    let access = checked_access(len, access)?;
    // SAFETY: valid PD; the dma-buf per our contract.
    let mr = unsafe { sys::ibv_reg_dmabuf_mr(pd.as_ptr(), offset, len, iova, fd, access.bits() as i32) };
    Ok((NonNull::new(mr).ok_or_else(|| Error::last("ibv_reg_dmabuf_mr"))?, access))
}

fn checked_access(len: usize, mut access: AccessFlags) -> Result<AccessFlags> {
    if len == 0 {
        return Err(Error::InvalidArgument(
            "a memory region cannot be empty; a zero-length work request can name an empty slice of any region".into(),
        ));
    }
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC) {
        // ibv_reg_mr(3): "If IBV_ACCESS_REMOTE_WRITE or
        // IBV_ACCESS_REMOTE_ATOMIC is set, then IBV_ACCESS_LOCAL_WRITE
        // must be set too."
        access |= AccessFlags::LOCAL_WRITE;
    }
    Ok(access)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffer_is_page_aligned_and_zeroed() {
        let mut b = HostBuffer::new(10_000).unwrap();
        let p = b.as_mut_ptr();
        assert_eq!(p as usize % page_size(), 0);
        assert_eq!(Registerable::len(&b), 10_000);
        // SAFETY: 10_000 bytes were allocated zeroed.
        let s = unsafe { std::slice::from_raw_parts(p, 10_000) };
        assert!(s.iter().all(|&x| x == 0));
        assert!(HostBuffer::new(usize::MAX).is_err());
    }

    #[test]
    fn pinned_kib_is_read_from_proc_status() {
        let s = "Name:\tx\nVmLck:\t       0 kB\nVmPin:\t     132 kB\nCapEff:\t0000000000000000\n";
        assert_eq!(status_kib(s, "VmPin:"), Some(132));
        assert_eq!(status_kib(s, "VmHWM:"), None);
        assert_eq!(status_kib("VmPin: lots kB", "VmPin:"), None);
        // Any other errno passes through untouched.
        let e = reg_mr_error(Error::Verb { verb: "ibv_reg_mr", errno: Errno(libc::EFAULT) }, 0, 4096);
        assert!(matches!(e, Error::Verb { errno: Errno(libc::EFAULT), .. }));
    }

    #[test]
    fn remote_buffer_bounds() {
        let r = RemoteBuffer { addr: 0x1000, len: 4096, rkey: 7 };
        assert_eq!(r.addr_of(0, 4096).unwrap(), 0x1000);
        assert_eq!(r.addr_of(4000, 96).unwrap(), 0x1000 + 4000);
        assert!(matches!(r.addr_of(4000, 97), Err(Error::OutOfBounds { offset: 4000, requested: 97, len: 4096, .. })));
        assert!(r.addr_of(u64::MAX, 2).is_err());
        // A range that would wrap the address space is refused, not wrapped.
        let w = RemoteBuffer { addr: u64::MAX - 10, len: 100, rkey: 7 };
        assert!(w.addr_of(0, 10).is_ok());
        assert!(matches!(w.addr_of(0, 11), Err(Error::OutOfBounds { .. })));
        assert!(w.addr_of(50, 1).is_err());
    }

    #[test]
    fn default_access_is_local_write_only() {
        assert_eq!(AccessFlags::default(), AccessFlags::LOCAL_WRITE);
    }
}
