//! The cache driven with fake regions and a scripted allocation identity.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;

use super::index::serves;
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
struct Ids(RefCell<HashMap<u64, GpuAllocation>>, RefCell<Vec<Reservation>>);

/// A `cuMemAddressReserve` reservation as the driver describes it (an
/// H200, driver 580): the range attributes give the whole reservation,
/// the buffer id is each granule's mapping's.
struct Reservation {
    base: u64,
    granule: u64,
    ids: Vec<u64>,
}

impl Ids {
    fn alloc(&self, ordinal: usize, base: u64, size: u64, buffer_id: u64) {
        self.0.borrow_mut().insert(base, GpuAllocation { ordinal, buffer_id, base, size });
    }

    /// Maps `ids` granule by granule into a reservation at `base`
    /// (replacing one that was there).
    fn reserve(&self, base: u64, granule: u64, ids: &[u64]) {
        let mut v = self.1.borrow_mut();
        v.retain(|r| r.base != base);
        v.push(Reservation { base, granule, ids: ids.to_vec() });
    }
}

impl GpuIdentity for Ids {
    fn identify(&self, ptr: u64) -> Result<GpuAllocation> {
        for r in self.1.borrow().iter() {
            let size = r.granule * r.ids.len() as u64;
            if r.base <= ptr && ptr < r.base + size {
                let buffer_id = r.ids[((ptr - r.base) / r.granule) as usize];
                return Ok(GpuAllocation { ordinal: 0, buffer_id, base: r.base, size });
            }
        }
        self.0
            .borrow()
            .values()
            .find(|a| a.base <= ptr && ptr < a.end())
            .copied()
            .ok_or_else(|| Error::InvalidArgument(format!("{ptr:#x} is not device memory")))
    }
}

/// Memory mapped with cuMemMap: each mapping is cached under its own id,
/// mappings of one reservation do not evict each other, a remapped one is
/// never served stale, and a range across two mappings is registered on
/// every lookup and never cached.
#[test]
fn vmm_mappings_are_cached_one_by_one_and_a_range_across_them_never() {
    const G: u64 = 2 << 20;
    let c = Cache::new(16, 1 << 40);
    c.reg.path.set(Some(RegistrationPath::DmaBuf));
    let ids = Ids::default();
    ids.reserve(0x7000_0000, G, &[6349, 6351, 6353]);
    let (first, _) = gpu_get(&c, &ids, 0x7000_0000, G as usize, GpuPolicy::Require).unwrap();
    let (second, _) = gpu_get(&c, &ids, 0x7000_0000 + G, 4096, GpuPolicy::Require).unwrap();
    assert_eq!(gpu_get(&c, &ids, 0x7000_0000 + 4096, 4096, GpuPolicy::Require).unwrap().0, first, "the other mapping's entry did not evict it");
    assert_eq!(gpu_get(&c, &ids, 0x7000_0000 + G, 4096, GpuPolicy::Require).unwrap().0, second);
    // The middle mapping replaced by another allocation: a fresh region.
    ids.reserve(0x7000_0000, G, &[6349, 7001, 6353]);
    let (again, _) = gpu_get(&c, &ids, 0x7000_0000 + G, 4096, GpuPolicy::Require).unwrap();
    assert_ne!(again, second, "a remapped mapping is never served its old region");
    // Across two mappings: registered each time, never cached.
    let before = c.stats();
    let (a, off) = gpu_get(&c, &ids, 0x7000_0000 + G - 4096, 8192, GpuPolicy::Require).unwrap();
    let (b, _) = gpu_get(&c, &ids, 0x7000_0000 + G - 4096, 8192, GpuPolicy::Require).unwrap();
    assert_ne!(a, b);
    assert_eq!(off, 0);
    let after = c.stats();
    assert_eq!((after.uncached - before.uncached, after.misses - before.misses, after.entries), (2, 2, before.entries));
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
