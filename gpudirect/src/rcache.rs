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

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use crate::error::{Errno, Error, Result};
use crate::policy::{GpuPolicy, RegistrationPath};
use crate::gpu::{Gpu, GpuAllocation, GpuBuffer};
use crate::mr::{AccessFlags, LocalSlice, Location, MemoryRegion};
use crate::wire::RemoteBuffer;
use crate::pd::ProtectionDomain;

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

/// Where an entry's memory lives, and for GPU memory which allocation it
/// was: part of the key, so a GPU entry serves only its own allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Space {
    Host,
    Gpu { ordinal: usize, buffer_id: u64 },
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

/// The access a request needs, as registration would record it: verbs add
/// `LOCAL_WRITE` to remote write and atomic access.
fn normalized(access: AccessFlags) -> AccessFlags {
    if access.intersects(AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_ATOMIC) {
        access | AccessFlags::LOCAL_WRITE
    } else {
        access
    }
}

/// Whether a region registered with `have` may serve a request for
/// `want`: every permission asked for, and the same PCIe ordering. Relaxed
/// ordering is not "more" access: code that polls a flag written last
/// relies on strict ordering, so it must match exactly.
fn serves(have: AccessFlags, want: AccessFlags) -> bool {
    let want = normalized(want);
    let relaxed = AccessFlags::RELAXED_ORDERING;
    have.contains(want - relaxed) && have.contains(relaxed) == want.contains(relaxed)
}

struct Entry<R> {
    space: Space,
    start: u64,
    len: u64,
    access: AccessFlags,
    region: R,
    /// Last use, for LRU: the key of this entry in `Core::lru`.
    tick: u64,
}

impl<R> Entry<R> {
    fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// Entries are keyed by (start address, serial number): several may start
/// at one address (different access, different lengths).
type Key = (u64, u64);

/// The cache proper, independent of what a region is so that the unit
/// tests can drive it with fakes. Every method runs under the cache's lock
/// and none registers or deregisters: regions it gives back are dropped by
/// the caller after unlocking, so a deregistration (tens of microseconds)
/// never blocks other lookups.
struct Core<R> {
    config: CacheConfig,
    entries: BTreeMap<Key, Entry<R>>,
    lru: BTreeMap<u64, Key>,
    next_serial: u64,
    next_tick: u64,
    /// Longest entry ever cached: an entry containing or overlapping an
    /// address starts at most this far below it, which bounds the part of
    /// `entries` a lookup scans.
    max_len: u64,
    /// Bumped by every invalidation: a registration that started before
    /// one is not cached (its memory may be gone).
    epoch: u64,
    stats: CacheStats,
}

impl<R: Clone> Core<R> {
    fn new(config: CacheConfig) -> Core<R> {
        Core {
            config,
            entries: BTreeMap::new(),
            lru: BTreeMap::new(),
            next_serial: 0,
            next_tick: 0,
            max_len: 0,
            epoch: 0,
            stats: CacheStats::default(),
        }
    }

    /// Entries that may overlap `start..end` (a superset; callers filter).
    fn candidates(&self, start: u64, end: u64) -> impl Iterator<Item = (&Key, &Entry<R>)> {
        let lo = start.saturating_sub(self.max_len);
        self.entries.range((lo, 0)..(end, 0))
    }

    fn touch(&mut self, key: Key) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, key);
        }
    }

    /// A cached region serving the request, marked most recently used.
    fn find(&mut self, space: Space, start: u64, len: u64, want: AccessFlags, accept: &dyn Fn(&R) -> bool) -> Option<(R, u64)> {
        let end = start + len;
        let key = self
            .candidates(start, end)
            .find(|(_, e)| e.space == space && e.start <= start && end <= e.end() && serves(e.access, want) && accept(&e.region))
            .map(|(k, _)| *k)?;
        self.touch(key);
        self.stats.hits += 1;
        let e = &self.entries[&key];
        Some((e.region.clone(), start - e.start))
    }

    fn remove(&mut self, key: Key) -> Option<R> {
        let e = self.entries.remove(&key)?;
        self.lru.remove(&e.tick);
        self.stats.bytes -= e.len;
        Some(e.region)
    }

    /// Removes the entries overlapping `start..end` that `stale` picks.
    fn remove_overlapping(&mut self, start: u64, end: u64, stale: impl Fn(&Entry<R>) -> bool) -> Vec<R> {
        let keys: Vec<Key> = self
            .candidates(start, end)
            .filter(|(_, e)| e.start < end && start < e.end() && stale(e))
            .map(|(k, _)| *k)
            .collect();
        let gone: Vec<R> = keys.into_iter().filter_map(|k| self.remove(k)).collect();
        self.stats.invalidations += gone.len() as u64;
        gone
    }

    fn invalidate(&mut self, start: u64, end: u64) -> Vec<R> {
        self.epoch += 1;
        self.remove_overlapping(start, end, |_| true)
    }

    fn clear(&mut self) -> Vec<R> {
        self.epoch += 1;
        self.stats.invalidations += self.entries.len() as u64;
        self.take_all()
    }

    /// Evicts everything (to free pinned memory): unlike `clear`, the
    /// memory has not changed, so registrations under way may be cached.
    fn evict_all(&mut self) -> Vec<R> {
        self.stats.evictions += self.entries.len() as u64;
        self.take_all()
    }

    fn take_all(&mut self) -> Vec<R> {
        self.lru.clear();
        self.stats.bytes = 0;
        std::mem::take(&mut self.entries).into_values().map(|e| e.region).collect()
    }

    /// GPU memory at `a` now belongs to allocation `a.buffer_id`: any entry
    /// overlapping it that was made for something else (an earlier
    /// allocation there, or host memory mapped there before CUDA took the
    /// addresses) names pages that are gone.
    fn remove_stale_gpu(&mut self, a: &GpuAllocation) -> Vec<R> {
        let current = Space::Gpu { ordinal: a.ordinal, buffer_id: a.buffer_id };
        self.remove_overlapping(a.base, a.end(), |e| e.space != current)
    }

    /// The access of entries for exactly this range: a registration that
    /// replaces them grants it too, so requests alternating between two
    /// access sets do not register again and again.
    fn same_range_access(&self, space: Space, start: u64, len: u64, want: AccessFlags) -> AccessFlags {
        let relaxed = want & AccessFlags::RELAXED_ORDERING;
        self.candidates(start, start + len)
            .filter(|(_, e)| e.space == space && e.start == start && e.len == len)
            .map(|(_, e)| e.access)
            .filter(|a| *a & AccessFlags::RELAXED_ORDERING == relaxed)
            .fold(AccessFlags::empty(), |acc, a| acc | a)
    }

    /// Caches a region registered for a miss that started at `epoch`.
    /// Returns the regions that no longer fit (replaced or evicted).
    fn insert(&mut self, space: Space, start: u64, len: u64, access: AccessFlags, region: R, epoch: u64) -> Vec<R> {
        let mut gone = Vec::new();
        if epoch != self.epoch || self.config.max_entries == 0 || len > self.config.max_bytes {
            // Invalidated while registering: the memory may already be
            // gone, so the region serves this lookup (whose caller vouched
            // for the memory) and is not kept.
            return gone;
        }
        // Same range with less access: superseded by this one.
        let replaced: Vec<Key> = self
            .candidates(start, start + len)
            .filter(|(_, e)| e.space == space && e.start == start && e.len == len && serves(access, e.access))
            .map(|(k, _)| *k)
            .collect();
        gone.extend(replaced.into_iter().filter_map(|k| self.remove(k)));
        let key = (start, self.next_serial);
        self.next_serial += 1;
        let tick = self.next_tick;
        self.next_tick += 1;
        self.entries.insert(key, Entry { space, start, len, access, region, tick });
        self.lru.insert(tick, key);
        self.max_len = self.max_len.max(len);
        self.stats.bytes += len;
        // The new entry is the most recent and fits on its own, so this
        // stops before reaching it.
        while self.entries.len() > self.config.max_entries || self.stats.bytes > self.config.max_bytes {
            let Some((_, &oldest)) = self.lru.first_key_value() else { break };
            gone.extend(self.remove(oldest));
            self.stats.evictions += 1;
        }
        gone
    }

    fn stats(&self) -> CacheStats {
        CacheStats { entries: self.entries.len(), ..self.stats }
    }
}

fn lock<R>(core: &Mutex<Core<R>>) -> MutexGuard<'_, Core<R>> {
    // No Core method leaves it half-updated on a panic (none panics), so
    // the state behind a poisoned lock is consistent.
    core.lock().unwrap_or_else(|p| p.into_inner())
}

/// `start..start + len` as addresses, refusing empty and wrapping ranges.
fn range(start: u64, len: usize) -> Result<(u64, u64)> {
    let len = len as u64;
    if len == 0 {
        return Err(Error::InvalidArgument("a registration cache lookup needs a non-empty range".into()));
    }
    start
        .checked_add(len)
        .map(|_| (start, len))
        .ok_or_else(|| Error::InvalidArgument(format!("the range {start:#x} + {len} bytes wraps around the address space")))
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
    let stale = lock(core).remove_stale_gpu(&a);
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
    /// Every call asks the driver which allocation `ptr` lies in
    /// ([`Gpu::allocation_of`]); regions registered for an allocation that
    /// has since been freed are never served, so the caller need not
    /// invalidate GPU memory it frees.
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
mod tests {
    use std::cell::{Cell, RefCell};
    use std::collections::HashMap;

    use super::*;

    const LW: AccessFlags = AccessFlags::LOCAL_WRITE;
    const RR: AccessFlags = AccessFlags::REMOTE_READ;
    const RW: AccessFlags = AccessFlags::REMOTE_WRITE;

    /// A registration: its serial number, access and (for GPU tests) path.
    #[derive(Clone, Debug, PartialEq)]
    struct Fake {
        id: u32,
        access: AccessFlags,
        path: Option<RegistrationPath>,
    }

    /// Counts registrations and hands out fakes.
    #[derive(Default)]
    struct Registrar {
        count: Cell<u32>,
        path: Cell<Option<RegistrationPath>>,
    }

    impl Registrar {
        fn reg(&self, grant: AccessFlags) -> Result<(Fake, AccessFlags)> {
            self.count.set(self.count.get() + 1);
            Ok((Fake { id: self.count.get(), access: grant, path: self.path.get() }, grant))
        }
    }

    struct Cache {
        core: Mutex<Core<Fake>>,
        reg: Registrar,
    }

    impl Cache {
        fn new(max_entries: usize, max_bytes: u64) -> Cache {
            Cache { core: Mutex::new(Core::new(CacheConfig { max_entries, max_bytes })), reg: Registrar::default() }
        }
        fn get(&self, start: u64, len: usize, want: AccessFlags) -> Result<(Fake, u64)> {
            let (start, len) = range(start, len)?;
            lookup(&self.core, Space::Host, start, len, want, &|_| true, |g| self.reg.reg(g))
        }
        fn stats(&self) -> CacheStats {
            lock(&self.core).stats()
        }
        fn invalidate(&self, start: u64, len: u64) -> usize {
            lock(&self.core).invalidate(start, start.saturating_add(len)).len()
        }
    }

    #[test]
    fn hit_needs_containment() {
        let c = Cache::new(16, 1 << 30);
        let (a, off) = c.get(0x10000, 0x4000, LW).unwrap();
        assert_eq!((a.id, off), (1, 0));
        // Same range, and ranges inside it (ending exactly at its end): hits
        // with their offsets.
        assert_eq!(c.get(0x10000, 0x4000, LW).unwrap(), (a.clone(), 0));
        assert_eq!(c.get(0x11000, 0x100, LW).unwrap(), (a.clone(), 0x1000));
        assert_eq!(c.get(0x13fff, 1, LW).unwrap(), (a.clone(), 0x3fff));
        // Overlapping but not contained, and adjacent: misses.
        assert_eq!(c.get(0x13000, 0x2000, LW).unwrap().0.id, 2);
        assert_eq!(c.get(0xffff, 2, LW).unwrap().0.id, 3);
        assert_eq!(c.get(0x15000, 0x10, LW).unwrap().0.id, 4);
        // A range spanning two cached ones is not served by either.
        assert_eq!(c.get(0x10000, 0x5000, LW).unwrap().0.id, 5);
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.entries), (3, 5, 5));
        assert_eq!(s.bytes, 0x4000 + 0x2000 + 2 + 0x10 + 0x5000);
    }

    #[test]
    fn access_must_be_a_superset() {
        let c = Cache::new(16, 1 << 30);
        let (a, _) = c.get(0x1000, 4096, RR | LW).unwrap();
        assert_eq!(c.get(0x1000, 4096, LW).unwrap().0, a);
        assert_eq!(c.get(0x1000, 4096, RR).unwrap().0, a);
        assert_eq!(c.get(0x1000, 4096, AccessFlags::empty()).unwrap().0, a);
        // More access: a new registration, granting the old access too, which
        // replaces the old entry for that range.
        let (b, _) = c.get(0x1000, 4096, RW).unwrap();
        assert_eq!(b.id, 2);
        assert_eq!(b.access, RW | RR | LW);
        assert_eq!(c.stats().entries, 1);
        assert_eq!(c.get(0x1000, 4096, RR).unwrap().0, b);
        // REMOTE_WRITE implies LOCAL_WRITE: a REMOTE_WRITE region serves it,
        // a REMOTE_READ-only one does not.
        let (d, _) = c.get(0x9000, 64, RR).unwrap();
        assert_eq!(d.access, RR);
        let (e, _) = c.get(0x9000, 64, RW).unwrap();
        assert_eq!(e.access, RR | RW | LW);
        // Relaxed ordering must match both ways.
        let relaxed = AccessFlags::RELAXED_ORDERING;
        let (f, _) = c.get(0x1000, 4096, LW | relaxed).unwrap();
        assert_eq!(f.access, LW | relaxed, "a relaxed request does not inherit strict entries' access");
        assert_eq!(c.get(0x1000, 4096, LW).unwrap().0, b);
        assert_eq!(c.get(0x1000, 4096, relaxed).unwrap().0, f);
        assert!(serves(RW | LW, RW));
        assert!(!serves(RW, RW), "registration always records LOCAL_WRITE with REMOTE_WRITE");
        assert!(serves(AccessFlags::REMOTE_ATOMIC | LW, AccessFlags::REMOTE_ATOMIC));
    }

    #[test]
    fn lru_eviction_by_entries() {
        let c = Cache::new(2, 1 << 30);
        c.get(0x1000, 10, LW).unwrap(); // A
        c.get(0x2000, 10, LW).unwrap(); // B
        c.get(0x1000, 10, LW).unwrap(); // touch A
        c.get(0x3000, 10, LW).unwrap(); // C evicts B
        let s = c.stats();
        assert_eq!((s.entries, s.evictions, s.bytes), (2, 1, 20));
        assert_eq!(c.get(0x1000, 10, LW).unwrap().0.id, 1, "A survived");
        assert_eq!(c.get(0x2000, 10, LW).unwrap().0.id, 4, "B was evicted");
        // Inserting B evicted C (A was used after C).
        assert_eq!(c.get(0x3000, 10, LW).unwrap().0.id, 5);
    }

    #[test]
    fn lru_eviction_by_bytes_and_oversized_regions() {
        let c = Cache::new(100, 10_000);
        c.get(0x10000, 4000, LW).unwrap();
        c.get(0x20000, 4000, LW).unwrap();
        c.get(0x30000, 4000, LW).unwrap(); // 12 000 bytes: evicts the first
        let s = c.stats();
        assert_eq!((s.entries, s.bytes, s.evictions), (2, 8000, 1));
        // Larger than the whole budget: registered, returned, not cached,
        // and nothing evicted for it.
        let (big, _) = c.get(0x100000, 20_000, LW).unwrap();
        assert_eq!(big.id, 4);
        assert_eq!(c.get(0x100000, 20_000, LW).unwrap().0.id, 5);
        let s = c.stats();
        assert_eq!((s.entries, s.bytes, s.evictions, s.misses), (2, 8000, 1, 5));
        // A cache that holds nothing still works.
        let c = Cache::new(0, 1 << 30);
        c.get(0x1000, 1, LW).unwrap();
        assert_eq!(c.get(0x1000, 1, LW).unwrap().0.id, 2);
        assert_eq!(c.stats().entries, 0);
    }

    #[test]
    fn invalidate_drops_exactly_the_overlapping_entries() {
        let c = Cache::new(100, u64::MAX);
        c.get(0x1000, 0x1000, LW).unwrap(); // [0x1000, 0x2000)
        c.get(0x2000, 0x1000, LW).unwrap(); // [0x2000, 0x3000)
        c.get(0x5000, 0x4000, LW).unwrap(); // [0x5000, 0x9000)
        c.get(0x5000, 0x100, RR).unwrap(); // [0x5000, 0x5100), other access
        // A huge entry starting far below: found through max_len.
        c.get(0x1_0000_0000, 1 << 30, LW).unwrap();
        assert_eq!(c.invalidate(0x3000, 0x2000), 0, "[0x3000, 0x5000) touches nothing");
        assert_eq!(c.invalidate(0x1fff, 1), 1);
        assert_eq!(c.get(0x2000, 0x1000, LW).unwrap().0.id, 2, "the neighbour survived");
        assert_eq!(c.invalidate(0x8fff, 0x10), 1);
        assert_eq!(c.get(0x5000, 0x100, RR).unwrap().0.id, 4, "the small entry survived");
        assert_eq!(c.invalidate(0x1_0000_0000 + (1 << 29), 1), 1);
        assert_eq!(c.invalidate(0, u64::MAX), 2);
        let s = c.stats();
        assert_eq!((s.entries, s.bytes, s.invalidations), (0, 0, 5));
        // Everything registers afresh after invalidation.
        assert_eq!(c.get(0x1000, 0x1000, LW).unwrap().0.id, 6);
        assert_eq!(c.invalidate(0x1000, 0), 0, "an empty range overlaps nothing");
    }

    #[test]
    fn invalidation_during_a_miss_is_not_cached_over() {
        let c = Cache::new(16, 1 << 30);
        let (start, len) = range(0x1000, 4096).unwrap();
        let (r, _) = lookup(&c.core, Space::Host, start, len, LW, &|_| true, |g| {
            // Another thread invalidates (and may free) the memory while
            // this one is in ibv_reg_mr.
            lock(&c.core).invalidate(0x1000, 0x2000);
            c.reg.reg(g)
        })
        .unwrap();
        assert_eq!(r.id, 1);
        assert_eq!(c.stats().entries, 0);
        assert_eq!(c.get(0x1000, 4096, LW).unwrap().0.id, 2);
        assert_eq!(c.get(0x1000, 4096, LW).unwrap().0.id, 2);
    }

    #[test]
    fn bad_ranges_and_failed_registrations_are_errors() {
        let c = Cache::new(16, 1 << 30);
        assert!(matches!(c.get(0x1000, 0, LW), Err(Error::InvalidArgument(m)) if m.contains("non-empty")));
        assert!(matches!(c.get(u64::MAX - 10, 11, LW), Err(Error::InvalidArgument(m)) if m.contains("wraps")));
        assert!(c.get(u64::MAX - 10, 10, LW).is_ok());
        let (start, len) = range(0x1000, 10).unwrap();
        let e = lookup::<Fake>(&c.core, Space::Host, start, len, LW, &|_| true, |_| {
            Err(Error::Verb { verb: "ibv_reg_mr", errno: crate::Errno(libc::EFAULT) })
        })
        .unwrap_err();
        assert_eq!(e.errno(), Some(crate::Errno(libc::EFAULT)));
        let s = c.stats();
        assert_eq!((s.entries, s.misses, s.hits), (1, 2, 0));
        assert!(c.get(0x1000, 10, LW).is_ok());
        assert_eq!(c.stats().misses, 3);
    }

    #[test]
    fn enomem_evicts_everything_and_retries_once() {
        let c = Cache::new(16, 1 << 30);
        c.get(0x1000, 10, LW).unwrap();
        c.get(0x2000, 10, LW).unwrap();
        let enomem = || Error::Verb { verb: "ibv_reg_mr", errno: crate::Errno(libc::ENOMEM) };
        let (start, len) = range(0x3000, 10).unwrap();
        let mut tries = 0;
        let (r, _) = lookup(&c.core, Space::Host, start, len, LW, &|_| true, |g| {
            tries += 1;
            if tries == 1 {
                Err(enomem())
            } else {
                c.reg.reg(g)
            }
        })
        .unwrap();
        assert_eq!((tries, r.id), (2, 3));
        let s = c.stats();
        assert_eq!((s.entries, s.evictions, s.invalidations, s.misses), (1, 2, 0, 3), "the retried region is cached");
        // Still failing with the cache empty: the error, after one retry.
        c.invalidate(0, u64::MAX);
        let (start, len) = range(0x4000, 10).unwrap();
        let mut tries = 0;
        let e = lookup::<Fake>(&c.core, Space::Host, start, len, LW, &|_| true, |_| {
            tries += 1;
            Err(enomem())
        })
        .unwrap_err();
        assert_eq!((tries, e.errno()), (1, Some(crate::Errno(libc::ENOMEM))), "nothing to evict: no retry");
        c.get(0x1000, 10, LW).unwrap();
        let mut tries = 0;
        assert!(lookup::<Fake>(&c.core, Space::Host, start, len, LW, &|_| true, |_| {
            tries += 1;
            Err(enomem())
        })
        .is_err());
        assert_eq!(tries, 2);
    }

    /// Threads each owning a range remap it over and over (invalidate, new
    /// generation of memory, look up) while the others do the same to
    /// theirs and share a small cache: no lookup ever gets a region made
    /// for an earlier generation, and the books balance.
    #[test]
    fn concurrent_lookups_and_invalidations_never_serve_stale_regions() {
        use std::sync::atomic::{AtomicU64, Ordering};
        const THREADS: u64 = 4;
        let core: Mutex<Core<(u64, u64)>> = Mutex::new(Core::new(CacheConfig { max_entries: 6, max_bytes: 1 << 30 }));
        let generation: Vec<AtomicU64> = (0..THREADS).map(|_| AtomicU64::new(0)).collect();
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (core, generation) = (&core, &generation);
                scope.spawn(move || {
                    let start = 0x10_0000 * (t + 1);
                    for round in 0..300u64 {
                        if round % 3 == 0 {
                            drop(lock(core).invalidate(start, start + 0x1000));
                            generation[t as usize].fetch_add(1, Ordering::SeqCst);
                        }
                        let now = generation[t as usize].load(Ordering::SeqCst);
                        let sub = (round % 2) * 0x100;
                        let ((gen, owner), off) = lookup(core, Space::Host, start + sub, 0x100, LW, &|_| true, |g| {
                            Ok(((generation[t as usize].load(Ordering::SeqCst), start), g))
                        })
                        .unwrap();
                        assert_eq!((gen, owner), (now, start), "thread {t} round {round}: a stale or foreign region");
                        assert_eq!(off, 0);
                    }
                });
            }
        });
        let c = lock(&core);
        let s = c.stats();
        assert!(s.entries <= 6, "{s:?}");
        assert_eq!(s.bytes, c.entries.values().map(|e| e.len).sum::<u64>());
        assert_eq!(c.lru.len(), c.entries.len());
        assert_eq!(s.hits + s.misses, THREADS * 300);
        assert!(s.hits > 0 && s.evictions > 0, "{s:?}");
    }

    #[test]
    fn clear_drops_everything() {
        let c = Cache::new(16, 1 << 30);
        c.get(0x1000, 10, LW).unwrap();
        c.get(0x2000, 10, LW).unwrap();
        let gone = lock(&c.core).clear();
        assert_eq!(gone.len(), 2);
        let s = c.stats();
        assert_eq!((s.entries, s.bytes, s.invalidations), (0, 0, 2));
        assert_eq!(c.get(0x1000, 10, LW).unwrap().0.id, 3);
    }

    /// Allocations by base address, as the driver would report them.
    #[derive(Default)]
    struct Ids(RefCell<HashMap<u64, GpuAllocation>>);

    impl Ids {
        fn alloc(&self, ordinal: usize, base: u64, size: u64, buffer_id: u64) {
            self.0.borrow_mut().insert(base, GpuAllocation { ordinal, buffer_id, base, size });
        }
    }

    impl GpuIdentity for Ids {
        fn identify(&self, ptr: u64) -> Result<GpuAllocation> {
            self.0
                .borrow()
                .values()
                .find(|a| a.base <= ptr && ptr < a.end())
                .copied()
                .ok_or_else(|| Error::InvalidArgument(format!("{ptr:#x} is not device memory")))
        }
    }

    fn gpu_get(c: &Cache, ids: &Ids, ptr: u64, len: usize, policy: GpuPolicy) -> Result<(Fake, u64)> {
        let accept = |f: &Fake| f.path.is_some_and(|p| path_allowed(policy, p));
        lookup_gpu(&c.core, ids, ptr, len, LW, &accept, |a, g| {
            assert!(a.base <= ptr && ptr < a.end());
            c.reg.reg(g)
        })
    }

    #[test]
    fn gpu_entries_are_keyed_by_allocation_identity() {
        let c = Cache::new(16, 1 << 40);
        c.reg.path.set(Some(RegistrationPath::DmaBuf));
        let ids = Ids::default();
        let base = 0x7f00_0000_0000;
        ids.alloc(0, base, 1 << 20, 41);
        let req = GpuPolicy::Require;
        assert_eq!(gpu_get(&c, &ids, base, 1 << 20, req).unwrap(), (Fake { id: 1, access: LW, path: Some(RegistrationPath::DmaBuf) }, 0));
        assert_eq!(gpu_get(&c, &ids, base + 4096, 4096, req).unwrap().1, 4096);
        assert_eq!(c.stats().hits, 1);
        // Freed and allocated again at the same address: a new identity,
        // so a miss, and the old entry is dropped as stale.
        ids.alloc(0, base, 1 << 20, 42);
        assert_eq!(gpu_get(&c, &ids, base + 4096, 4096, req).unwrap().0.id, 2);
        let s = c.stats();
        assert_eq!((s.invalidations, s.entries, s.misses), (1, 1, 2));
        // A smaller allocation at the same base, then a neighbour: entries
        // overlapping the new allocation with another identity go.
        ids.alloc(0, base, 8192, 43);
        assert_eq!(gpu_get(&c, &ids, base, 8192, req).unwrap().0.id, 3);
        assert_eq!(c.stats().invalidations, 2);
        ids.alloc(0, base + (1 << 21), 1 << 16, 44);
        assert_eq!(gpu_get(&c, &ids, base + (1 << 21), 100, req).unwrap().0.id, 4);
        assert_eq!(gpu_get(&c, &ids, base, 8192, req).unwrap().0.id, 3, "the neighbour did not disturb it");
        // Another GPU's allocation with the same id number is another key.
        ids.0.borrow_mut().clear();
        ids.alloc(1, base, 8192, 43);
        assert_eq!(gpu_get(&c, &ids, base, 8192, req).unwrap().0.id, 5);
    }

    #[test]
    fn gpu_lookups_check_the_allocation_and_the_policy() {
        let c = Cache::new(16, 1 << 40);
        let ids = Ids::default();
        ids.alloc(0, 0x10_0000, 0x10000, 7);
        let e = gpu_get(&c, &ids, 0x10_0000 + 0xff00, 0x200, GpuPolicy::Prefer).unwrap_err();
        assert!(e.to_string().contains("extends past its allocation (0x100000 + 65536 bytes)"), "{e}");
        let e = gpu_get(&c, &ids, 0x40_0000, 16, GpuPolicy::Prefer).unwrap_err();
        assert!(e.to_string().contains("is not device memory"), "{e}");
        assert!(gpu_get(&c, &ids, 0x10_0000, 0, GpuPolicy::Prefer).is_err());
        assert_eq!(c.stats().misses, 0);
        // A host-staged registration (Prefer fell back) does not serve
        // Require, which needs zero-copy, but does serve Prefer.
        c.reg.path.set(Some(RegistrationPath::HostStaged));
        assert_eq!(gpu_get(&c, &ids, 0x10_0000, 4096, GpuPolicy::Prefer).unwrap().0.id, 1);
        assert_eq!(gpu_get(&c, &ids, 0x10_0000, 4096, GpuPolicy::Prefer).unwrap().0.id, 1);
        assert_eq!(gpu_get(&c, &ids, 0x10_0000, 4096, GpuPolicy::HostStaged).unwrap().0.id, 1);
        c.reg.path.set(Some(RegistrationPath::PeerMemory));
        assert_eq!(gpu_get(&c, &ids, 0x10_0000, 4096, GpuPolicy::Require).unwrap().0.id, 2);
        assert_eq!(gpu_get(&c, &ids, 0x10_0000, 4096, GpuPolicy::Require).unwrap().0.id, 2);
        assert!(path_allowed(GpuPolicy::Prefer, RegistrationPath::HostStaged));
        assert!(!path_allowed(GpuPolicy::HostStaged, RegistrationPath::DmaBuf));
    }

    #[test]
    fn host_and_gpu_entries_do_not_serve_each_other() {
        let c = Cache::new(16, 1 << 40);
        c.reg.path.set(Some(RegistrationPath::DmaBuf));
        let ids = Ids::default();
        // Host memory once mapped where CUDA now has an allocation.
        assert_eq!(c.get(0x20_0000, 4096, LW).unwrap().0.id, 1);
        ids.alloc(0, 0x20_0000, 0x10000, 9);
        assert_eq!(gpu_get(&c, &ids, 0x20_0000, 4096, GpuPolicy::Require).unwrap().0.id, 2);
        assert_eq!(c.stats().invalidations, 1, "the host entry under the allocation is stale");
        // And the GPU entry does not serve a host lookup of that address.
        assert_eq!(c.get(0x20_0000, 4096, LW).unwrap().0.id, 3);
        // invalidate() covers both kinds.
        assert_eq!(c.invalidate(0x20_0000, 1), 2);
    }
}
