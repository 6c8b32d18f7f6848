//! The cache's index, independent of what a region is (the unit tests
//! drive it with fakes): entries by address, LRU order, bounds, and the
//! epoch that keeps a registration raced by an invalidation out of it.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::gpu::GpuAllocation;
use crate::mr::AccessFlags;

use super::{CacheConfig, CacheStats};

/// Where an entry's memory lives, and for GPU memory which allocation it
/// was: part of the key, so a GPU entry serves only its own allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Space {
    Host,
    Gpu { ordinal: usize, buffer_id: u64 },
}

/// The access a request needs, as registration would record it: verbs add
/// `LOCAL_WRITE` to remote write and atomic access.
pub(super) fn normalized(access: AccessFlags) -> AccessFlags {
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
pub(super) fn serves(have: AccessFlags, want: AccessFlags) -> bool {
    let want = normalized(want);
    let relaxed = AccessFlags::RELAXED_ORDERING;
    have.contains(want - relaxed) && have.contains(relaxed) == want.contains(relaxed)
}

pub(super) struct Entry<R> {
    space: Space,
    start: u64,
    pub(super) len: u64,
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
pub(super) type Key = (u64, u64);

/// The cache proper, independent of what a region is so that the unit
/// tests can drive it with fakes. Every method runs under the cache's lock
/// and none registers or deregisters: regions it gives back are dropped by
/// the caller after unlocking, so a deregistration (tens of microseconds)
/// never blocks other lookups.
pub(super) struct Core<R> {
    pub(super) config: CacheConfig,
    pub(super) entries: BTreeMap<Key, Entry<R>>,
    pub(super) lru: BTreeMap<u64, Key>,
    next_serial: u64,
    next_tick: u64,
    /// Longest entry ever cached: an entry containing or overlapping an
    /// address starts at most this far below it, which bounds the part of
    /// `entries` a lookup scans.
    max_len: u64,
    /// Bumped by every invalidation: a registration that started before
    /// one is not cached (its memory may be gone).
    pub(super) epoch: u64,
    pub(super) stats: CacheStats,
}

impl<R: Clone> Core<R> {
    pub(super) fn new(config: CacheConfig) -> Core<R> {
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
    pub(super) fn candidates(&self, start: u64, end: u64) -> impl Iterator<Item = (&Key, &Entry<R>)> {
        let lo = start.saturating_sub(self.max_len);
        self.entries.range((lo, 0)..(end, 0))
    }

    pub(super) fn touch(&mut self, key: Key) {
        let tick = self.next_tick;
        self.next_tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.tick);
            e.tick = tick;
            self.lru.insert(tick, key);
        }
    }

    /// A cached region serving the request, marked most recently used.
    pub(super) fn find(&mut self, space: Space, start: u64, len: u64, want: AccessFlags, accept: &dyn Fn(&R) -> bool) -> Option<(R, u64)> {
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

    pub(super) fn remove(&mut self, key: Key) -> Option<R> {
        let e = self.entries.remove(&key)?;
        self.lru.remove(&e.tick);
        self.stats.bytes -= e.len;
        Some(e.region)
    }

    /// Removes the entries overlapping `start..end` that `stale` picks.
    pub(super) fn remove_overlapping(&mut self, start: u64, end: u64, stale: impl Fn(&Entry<R>) -> bool) -> Vec<R> {
        let keys: Vec<Key> = self
            .candidates(start, end)
            .filter(|(_, e)| e.start < end && start < e.end() && stale(e))
            .map(|(k, _)| *k)
            .collect();
        let gone: Vec<R> = keys.into_iter().filter_map(|k| self.remove(k)).collect();
        self.stats.invalidations += gone.len() as u64;
        gone
    }

    pub(super) fn invalidate(&mut self, start: u64, end: u64) -> Vec<R> {
        self.epoch += 1;
        self.remove_overlapping(start, end, |_| true)
    }

    pub(super) fn clear(&mut self) -> Vec<R> {
        self.epoch += 1;
        self.stats.invalidations += self.entries.len() as u64;
        self.take_all()
    }

    /// Evicts everything (to free pinned memory): unlike `clear`, the
    /// memory has not changed, so registrations under way may be cached.
    pub(super) fn evict_all(&mut self) -> Vec<R> {
        self.stats.evictions += self.entries.len() as u64;
        self.take_all()
    }

    pub(super) fn take_all(&mut self) -> Vec<R> {
        self.lru.clear();
        self.stats.bytes = 0;
        std::mem::take(&mut self.entries).into_values().map(|e| e.region).collect()
    }

    /// GPU memory at `start..end` now belongs to allocation `a.buffer_id`:
    /// any entry overlapping it that was made for something else (an
    /// earlier allocation there, or host memory mapped there before CUDA
    /// took the addresses) names pages that are gone.
    pub(super) fn remove_stale_gpu(&mut self, a: &GpuAllocation, start: u64, end: u64) -> Vec<R> {
        let current = Space::Gpu { ordinal: a.ordinal, buffer_id: a.buffer_id };
        self.remove_overlapping(start, end, |e| e.space != current)
    }

    /// The access of entries for exactly this range: a registration that
    /// replaces them grants it too, so requests alternating between two
    /// access sets do not register again and again.
    pub(super) fn same_range_access(&self, space: Space, start: u64, len: u64, want: AccessFlags) -> AccessFlags {
        let relaxed = want & AccessFlags::RELAXED_ORDERING;
        self.candidates(start, start + len)
            .filter(|(_, e)| e.space == space && e.start == start && e.len == len)
            .map(|(_, e)| e.access)
            .filter(|a| *a & AccessFlags::RELAXED_ORDERING == relaxed)
            .fold(AccessFlags::empty(), |acc, a| acc | a)
    }

    /// Caches a region registered for a miss that started at `epoch`.
    /// Returns the regions that no longer fit (replaced or evicted).
    pub(super) fn insert(&mut self, space: Space, start: u64, len: u64, access: AccessFlags, region: R, epoch: u64) -> Vec<R> {
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

    pub(super) fn stats(&self) -> CacheStats {
        CacheStats { entries: self.entries.len(), ..self.stats }
    }
}

pub(super) fn lock<R>(core: &Mutex<Core<R>>) -> MutexGuard<'_, Core<R>> {
    // No Core method leaves it half-updated on a panic (none panics), so
    // the state behind a poisoned lock is consistent.
    core.lock().unwrap_or_else(|p| p.into_inner())
}

/// `start..start + len` as addresses, refusing empty and wrapping ranges.
pub(super) fn range(start: u64, len: usize) -> Result<(u64, u64)> {
    let len = len as u64;
    if len == 0 {
        return Err(Error::InvalidArgument("a registration cache lookup needs a non-empty range".into()));
    }
    start
        .checked_add(len)
        .map(|_| (start, len))
        .ok_or_else(|| Error::InvalidArgument(format!("the range {start:#x} + {len} bytes wraps around the address space")))
}

