//! A registration cache: keeps memory regions of memory the program does
//! not own (another framework's tensors, caller-owned buffers) registered
//! between transfers, so registering the same memory again costs a lookup
//! instead of an `ibv_reg_mr` (tens of microseconds to milliseconds; see
//! `docs/performance.md`).
//!
//! One [`RegistrationCache`] per [`ProtectionDomain`]. A lookup of
//! `(address, length, access)` is a **hit** when a cached region of the same
//! kind of memory contains the whole range with at least the requested
//! access; it returns that region's handle and the offset of the range in
//! it ([`CachedRegion`]). Otherwise it is a **miss**: the range is
//! registered, cached and returned. The cache is bounded
//! ([`CacheConfig`]: entries and bytes) and evicts the least recently used
//! entry. Evicting or invalidating an entry only drops the cache's handle:
//! regions are reference counted, so handles the caller holds and posted
//! work requests keep theirs registered until they are done.
//!
//! # Correctness: a stale region is never served
//! A region pins the physical pages that were mapped when it was
//! registered, and the NIC keeps using those pages whatever happens to the
//! virtual address afterwards. If memory is unmapped and the address is
//! mapped again (by `munmap` + `mmap`, `free` + `malloc` of a large block,
//! `mremap`, `madvise(MADV_DONTNEED)`, `cudaFree` + `cudaMalloc`), a
//! cached region for that address still names the old pages: serving it
//! would make the NIC send the old bytes and land received bytes where the
//! program never looks, silently. So:
//!
//! - **GPU memory** ([`RegistrationCache::get_gpu`]) is invalidated
//!   automatically. Entries are keyed by the allocation's identity
//!   ([`GpuAllocation::buffer_id`], `CU_POINTER_ATTRIBUTE_BUFFER_ID`, which
//!   CUDA never reuses within a process), asked of the driver on every
//!   lookup, as UCX and NCCL do. A region made for an earlier allocation at
//!   the same address is not a hit, and is dropped on sight.
//! - **Host memory** ([`RegistrationCache::get`]) cannot be: Rust sees
//!   neither `free` nor `munmap`. The lookup is therefore `unsafe`, and its
//!   contract is that the caller calls [`RegistrationCache::invalidate`]
//!   before the memory is freed, unmapped or remapped (the hook an
//!   allocator or framework calls from its free path, as with UCX's
//!   `ucp_mem_unmap` or libfabric's `fi_mr_cache` notifiers).
//!
//! An automatic host monitor was considered and left out. libfabric's
//! `userfaultfd` monitor (non-cooperative `UFFD_EVENT_UNMAP`, `REMOVE`,
//! `REMAP`) needs every cached range registered with `UFFDIO_REGISTER`,
//! which fails with `EBUSY` where the application or a runtime already uses
//! userfaultfd on it; unprivileged processes only get `UFFD_USER_MODE_ONLY`
//! (Debian 12 sets `vm.unprivileged_userfaultfd = 0`); and those events are
//! synchronous: the thread calling `munmap` or `madvise` blocks until a
//! monitor thread has read the event, so a monitor that stalls or dies
//! hangs the process, and faults on missing pages of a registered range
//! (after `MADV_DONTNEED`, say) must be served by that thread. It also
//! does not see `free` of heap memory that stays mapped, which is harmless
//! (the pages do not change) but means the cache must still be told about
//! anything an allocator hands out again. Memory interception (UCX's
//! `mmap`/`munmap` hooks) cannot be done soundly from a library either. The
//! explicit contract is the one that cannot hang, and it is what the
//! caller's allocator knows anyway.
//!
//! Memory the program owns needs no cache: keep its [`MemoryRegion`]
//! (e.g. from [`MemoryRegion::alloc`]), which is registered exactly as long
//! as the memory lives.
//!
//! # Exact ranges, not page-aligned spans
//! UCX and NCCL register the page-aligned span around a buffer so that
//! neighbours on the same pages hit too. This cache registers exactly the
//! range asked for. The kernel pins whole pages either way (the cost is the
//! same), but the NIC checks remote accesses against the region's byte
//! bounds: an aligned span would let any peer holding the rkey write bytes
//! next to the buffer that belong to something else, and the region's safe
//! accessors ([`MemoryRegion::write_at`]) would reach bytes the caller made
//! no promise about.
//!
//! # Example
//! ```no_run
//! use gpudirect::rcache::{CacheConfig, RegistrationCache};
//! use gpudirect::{AccessFlags, Context, ProtectionDomain};
//!
//! # fn main() -> gpudirect::Result<()> {
//! let ctx = Context::open(None)?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cache = RegistrationCache::new(&pd, CacheConfig::default());
//! let mut tensor = vec![0u8; 1 << 20]; // owned by "the framework"
//! let (ptr, len) = (tensor.as_mut_ptr(), tensor.len());
//! for _ in 0..3 {
//!     // SAFETY: `tensor` stays allocated, untouched through Rust
//!     // references, until `invalidate` below.
//!     let r = unsafe { cache.get(ptr, len, AccessFlags::REMOTE_READ)? };
//!     let _descriptor = r.remote(); // send to the peer, post, reap ...
//! }
//! assert_eq!((cache.stats().misses, cache.stats().hits), (1, 2));
//! cache.invalidate(ptr as u64, len); // the framework frees the tensor
//! drop(tensor);
//! # Ok(()) }
//! ```

use std::fmt;
use std::sync::Mutex;

use crate::error::{Errno, Error, Result};
use crate::policy::{GpuPolicy, RegistrationPath};
use crate::gpu::{Gpu, GpuAllocation, GpuBuffer};
use crate::mr::{AccessFlags, LocalSlice, Location, MemoryRegion};
use crate::wire::RemoteBuffer;
use crate::pd::ProtectionDomain;

mod index;

use index::{lock, normalized, range, Core, Space};

/// How much a [`RegistrationCache`] keeps registered.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheConfig {
    /// At most this many cached regions (0: cache nothing).
    pub max_entries: usize,
    /// At most this many bytes in cached regions: they are pinned memory,
    /// counted against `ulimit -l` and, for GPU memory, the BAR1 window. A
    /// region larger than this on its own is registered and returned but
    /// not cached.
    pub max_bytes: u64,
}

impl Default for CacheConfig {
    /// 1024 regions, 4 GiB.
    fn default() -> Self {
        CacheConfig { max_entries: 1024, max_bytes: 4 << 30 }
    }
}

/// What a [`RegistrationCache`] has done so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CacheStats {
    /// Lookups served by a cached region.
    pub hits: u64,
    /// Lookups that registered memory (successfully or not).
    pub misses: u64,
    /// Entries dropped to stay within [`CacheConfig`], or all at once when
    /// a registration failed with `ENOMEM` (then retried).
    pub evictions: u64,
    /// Entries dropped because their memory changed: by
    /// [`RegistrationCache::invalidate`] and [`RegistrationCache::clear`],
    /// and GPU entries found stale (their allocation was freed).
    pub invalidations: u64,
    /// Lookups registered but not cached: GPU ranges across several
    /// `cuMemMap` mappings, each with an identity of its own (see
    /// [`RegistrationCache::get_gpu`]).
    pub uncached: u64,
    /// Regions cached now.
    pub entries: usize,
    /// Bytes in the regions cached now.
    pub bytes: u64,
}

/// The result of a lookup: a registered region containing the requested
/// range, and where the range lies in it.
///
/// The region may be larger than the range (a hit on a region registered
/// for a larger lookup); [`slice`](Self::slice) and [`remote`](Self::remote)
/// name exactly the requested range.
#[derive(Clone)]
pub struct CachedRegion {
    mr: MemoryRegion,
    offset: usize,
    len: usize,
}

impl fmt::Debug for CachedRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachedRegion").field("mr", &self.mr).field("offset", &self.offset).field("len", &self.len).finish()
    }
}

impl CachedRegion {
    /// The region (a handle: it stays registered while this or any clone,
    /// or a posted work request using it, lives, even if the cache drops
    /// its entry meanwhile).
    pub fn mr(&self) -> &MemoryRegion {
        &self.mr
    }

    /// Offset of the requested range within [`mr`](Self::mr).
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Length of the requested range.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the requested range is empty (never: lookups refuse empty
    /// ranges).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The requested range as a slice of the region, to name in a work request.
    pub fn slice(&self) -> LocalSlice<'_> {
        // The lookup checked offset + len <= region length.
        LocalSlice { mr: &self.mr, offset: self.offset, len: self.len }
    }

    /// The descriptor of exactly the requested range, for a peer.
    pub fn remote(&self) -> RemoteBuffer {
        RemoteBuffer { addr: self.mr.addr() + self.offset as u64, len: self.len as u64, rkey: self.mr.rkey() }
    }

    /// The region handle, dropping the range information.
    pub fn into_mr(self) -> MemoryRegion {
        self.mr
    }
}

/// Where an allocation's identity comes from: the CUDA driver in
/// production ([`Gpu`]), a script in the unit tests.
pub(crate) trait GpuIdentity {
    fn identify(&self, ptr: u64) -> Result<GpuAllocation>;
}

impl GpuIdentity for Gpu {
    fn identify(&self, ptr: u64) -> Result<GpuAllocation> {
        self.allocation_of(ptr)
    }
}

/// A lookup of one kind of memory: a hit, or `register` (called with the
/// access to grant, outside the lock) and insert. Returns the region and
/// the range's offset in it.
///
/// When registering fails with `ENOMEM` (the locked-memory limit, which
/// cached regions count against) the cache evicts everything and tries
/// once more, as a cache that is in the way should.
fn lookup<R: Clone>(
    core: &Mutex<Core<R>>,
    space: Space,
    start: u64,
    len: u64,
    want: AccessFlags,
    accept: &dyn Fn(&R) -> bool,
    mut register: impl FnMut(AccessFlags) -> Result<(R, AccessFlags)>,
) -> Result<(R, u64)> {
    let (epoch, grant) = {
        let mut c = lock(core);
        if let Some(hit) = c.find(space, start, len, want, accept) {
            return Ok(hit);
        }
        c.stats.misses += 1;
        (c.epoch, normalized(want) | c.same_range_access(space, start, len, want))
    };
    let (region, granted) = match register(grant) {
        Err(e) if e.errno() == Some(Errno(libc::ENOMEM)) => {
            let evicted = lock(core).evict_all();
            if evicted.is_empty() {
                return Err(e);
            }
            tracing::debug!(regions = evicted.len(), "registration failed with ENOMEM: evicted the registration cache, retrying");
            // Deregisters the regions nobody else holds, unpinning their memory.
            drop(evicted);
            register(grant)?
        }
        other => other?,
    };
    let gone = lock(core).insert(space, start, len, granted, region.clone(), epoch);
    drop(gone);
    Ok((region, 0))
}

/// A GPU lookup: identifies the allocation, drops entries it makes stale,
/// then [`lookup`] keyed by that allocation.
fn lookup_gpu<R: Clone>(
    core: &Mutex<Core<R>>,
    ids: &dyn GpuIdentity,
    ptr: u64,
    len: usize,
    want: AccessFlags,
    accept: &dyn Fn(&R) -> bool,
    mut register: impl FnMut(&GpuAllocation, AccessFlags) -> Result<(R, AccessFlags)>,
) -> Result<(R, u64)> {
    let (start, len) = range(ptr, len)?;
    let a = ids.identify(ptr)?;
    if start < a.base || start + len > a.end() {
        return Err(Error::InvalidArgument(format!(
            "device range {ptr:#x} + {len} bytes extends past its allocation ({:#x} + {} bytes)",
            a.base, a.size
        )));
    }
    // Memory mapped with cuMemMap (PyTorch's expandable segments): the
    // range attributes give the whole reservation, and each mapping has a
    // buffer id of its own (an H200 with driver 580 answered so, granule by
    // granule). A range whose ends lie in different mappings has no one
    // identity that says all of it is unchanged at the next lookup (a
    // mapping in the middle or at the end may be replaced), so it is
    // registered and handed out, not cached.
    let last = ids.identify(start + len - 1)?;
    if (last.ordinal, last.buffer_id) != (a.ordinal, a.buffer_id) {
        {
            let mut c = lock(core);
            c.stats.misses += 1;
            c.stats.uncached += 1;
        }
        let (region, _) = register(&a, normalized(want))?;
        return Ok((region, 0));
    }
    // What was cached for other memory at these addresses is stale. Only
    // the range itself is certain to be this allocation's: the rest of a
    // reservation may be other mappings, cached under their own ids.
    let stale = lock(core).remove_stale_gpu(&a, start, start + len);
    drop(stale);
    let space = Space::Gpu { ordinal: a.ordinal, buffer_id: a.buffer_id };
    lookup(core, space, start, len, want, accept, |grant| register(&a, grant))
}

/// Whether a GPU region registered by `path` satisfies `policy`.
fn path_allowed(policy: GpuPolicy, path: RegistrationPath) -> bool {
    match policy {
        GpuPolicy::Require => path != RegistrationPath::HostStaged,
        GpuPolicy::Prefer => true,
        GpuPolicy::HostStaged => path == RegistrationPath::HostStaged,
    }
}

/// Keeps regions of memory the program does not own registered between
/// uses; see the [module documentation](self) for what it guarantees and
/// what the caller must do.
///
/// Thread-safe: lookups from several threads share the cache (a miss
/// registers without holding the lock, so two threads missing on the same
/// range at once may both register it; one region wins the entry).
pub struct RegistrationCache {
    pd: ProtectionDomain,
    core: Mutex<Core<MemoryRegion>>,
}

impl fmt::Debug for RegistrationCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegistrationCache").field("pd", &self.pd).field("config", &self.config()).field("stats", &self.stats()).finish()
    }
}

impl RegistrationCache {
    /// An empty cache registering in `pd`.
    pub fn new(pd: &ProtectionDomain, config: CacheConfig) -> RegistrationCache {
        RegistrationCache { pd: pd.clone(), core: Mutex::new(Core::new(config)) }
    }

    /// The protection domain regions are registered in.
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    /// The limits the cache keeps to.
    pub fn config(&self) -> CacheConfig {
        lock(&self.core).config
    }

    /// Counters and current size.
    pub fn stats(&self) -> CacheStats {
        lock(&self.core).stats()
    }

    /// A region of host memory covering `addr..addr + len` with at least
    /// `access` (`LOCAL_WRITE` is added where verbs require it): a cached
    /// one, or a new registration of exactly that range, which is cached.
    ///
    /// # Safety
    /// As for [`MemoryRegion::register_raw`], for longer: from this call
    /// until [`invalidate`](Self::invalidate) (or [`clear`](Self::clear))
    /// has been called for a range covering it,
    /// - `addr..addr + len` is mapped, readable and writable memory and
    ///   stays mapped at that address to the same memory: call
    ///   `invalidate` **before** `free`, `munmap`, `mremap`, `mmap` with
    ///   `MAP_FIXED` over it, `madvise(MADV_DONTNEED | MADV_FREE |
    ///   MADV_REMOVE)`, or handing it to an allocator that may do any of
    ///   these;
    /// - nothing creates Rust references to those bytes (the NIC, peers and
    ///   the region's accessors may write them at any time);
    ///
    /// and the memory is not unmapped while a handle obtained from the
    /// cache for it is used or a work request using one is outstanding
    /// (invalidation drops the cache's handle, not the caller's).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty or wrapping range; on a miss,
    /// the errors of [`MemoryRegion::register_raw`]. `ENOMEM` (the
    /// locked-memory limit, which cached regions count against) is
    /// returned only if it persists after the whole cache was evicted:
    /// regions the caller still holds stay pinned.
    pub unsafe fn get(&self, addr: *mut u8, len: usize, access: AccessFlags) -> Result<CachedRegion> {
        let (start, len64) = range(addr as u64, len)?;
        let (mr, offset) = lookup(&self.core, Space::Host, start, len64, access, &|_| true, |grant| {
            // SAFETY: our caller vouches for the range until it invalidates
            // it; the cache's own handle is never used to touch the bytes
            // and is dropped by that invalidation.
            let mr = unsafe { MemoryRegion::register_raw(&self.pd, addr, len, grant)? };
            let granted = mr.access();
            Ok((mr, granted))
        })?;
        Ok(CachedRegion { mr, offset: offset as usize, len })
    }

    /// A region of GPU memory covering `ptr..ptr + len` on `gpu`, with at
    /// least `access`, registered by a path `policy` allows (a cached
    /// host-staged region does not serve [`GpuPolicy::Require`], nor a
    /// zero-copy one [`GpuPolicy::HostStaged`]). On a miss the range is
    /// registered with [`MemoryRegion::register_gpu`].
    ///
    /// Every call asks the driver which allocation `ptr` and the range's
    /// last byte lie in ([`Gpu::allocation_of`]); regions registered for an
    /// allocation that has since been freed are never served, so the
    /// caller need not invalidate GPU memory it frees. A range across
    /// several `cuMemMap` mappings (each its own allocation to the driver)
    /// is registered on every call and not cached
    /// ([`CacheStats::uncached`]): no one identity covers it.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be device memory of `gpu` that stays allocated
    /// for as long as the returned handle (or a clone, or a work request
    /// using it) is used. The cache's own handle may outlive the
    /// allocation, as in UCX's and NCCL's caches: it is never served or
    /// used again once the allocation is gone, only deregistered. What the
    /// NIC's mapping of the freed memory does meanwhile is the driver's
    /// business (a dma-buf holds its own reference to the memory;
    /// `nvidia-peermem` revokes a registration whose memory is freed); a
    /// host-staged region's GPU side is never copied to again.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for an empty range, one that is not
    /// device memory of `gpu`, or one extending past its allocation;
    /// [`Error::Cuda`]; on a miss, the errors of
    /// [`MemoryRegion::register_gpu`].
    pub unsafe fn get_gpu(&self, gpu: &Gpu, ptr: u64, len: usize, access: AccessFlags, policy: GpuPolicy) -> Result<CachedRegion> {
        let accept = |mr: &MemoryRegion| match mr.location() {
            Location::Gpu { path, .. } => path_allowed(policy, path),
            Location::Host => false,
        };
        let (mr, offset) = lookup_gpu(&self.core, gpu, ptr, len, access, &accept, |_, grant| {
            // SAFETY: our caller keeps the memory allocated while the
            // region is used; see the contract above for the cache's handle.
            let buf = unsafe { GpuBuffer::from_raw(gpu, ptr, len)? };
            let mr = MemoryRegion::register_gpu(&self.pd, buf, grant, policy)?;
            let granted = mr.access();
            Ok((mr, granted))
        })?;
        Ok(CachedRegion { mr, offset: offset as usize, len })
    }

    /// Drops every cached region overlapping `addr..addr + len` (host or
    /// GPU addresses), returning how many. Call it before the memory is
    /// freed, unmapped or remapped. Handles already returned stay
    /// registered (to the old pages) until dropped. A lookup that was
    /// registering when this ran returns its region but does not cache it.
    pub fn invalidate(&self, addr: u64, len: usize) -> usize {
        let end = addr.saturating_add(len as u64);
        let gone = lock(&self.core).invalidate(addr, end);
        let n = gone.len();
        if n > 0 {
            tracing::trace!(addr = format_args!("{addr:#x}"), len, regions = n, "registration cache invalidated");
        }
        n
    }

    /// Drops every cached region (e.g. to release pinned memory), returning
    /// how many.
    pub fn clear(&self) -> usize {
        let gone = lock(&self.core).clear();
        gone.len()
    }
}

#[cfg(test)]
mod tests;
