//! The registration cache against a real RDMA device (Soft-RoCE in the
//! test bed). Ignored by default; run them with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test rcache -- --ignored --test-threads 1
//! ```
//!
//! or in a guest: `cargo test -p gpudirect --test rcache --no-run`, then
//! `testbed/run -- target/debug/deps/rcache-XXXX --ignored --test-threads 1`.

mod common;

use std::time::{Duration, Instant};

use common::{loopback, wait_one, Loopback};

use gpudirect::rcache::{CacheConfig, RegistrationCache};
use gpudirect::{AccessFlags, MemoryRegion, QpConfig, RemoteBuffer, SendWr, WcStatus};

/// RDMA-reads `len` bytes of `remote` into a fresh region over `lb.a` and
/// returns them, or the completion's status when the NIC refused.
fn read(lb: &Loopback, remote: &RemoteBuffer, len: usize) -> Result<Vec<u8>, WcStatus> {
    let dst = MemoryRegion::alloc(&lb.pd, len, AccessFlags::LOCAL_WRITE).unwrap();
    lb.a.qp.post_send(&[SendWr::read(dst.slice(..).unwrap(), remote, 0).unwrap().wr_id(1)]).unwrap();
    let wc = wait_one(&lb.a.cq);
    match wc.status {
        WcStatus::Success => Ok(dst.to_vec().unwrap()),
        s => Err(s),
    }
}

/// An anonymous private mapping of `len` bytes, filled with `byte`; at
/// `at` exactly when given (failing rather than replacing a mapping there).
fn map(at: Option<*mut u8>, len: usize, byte: u8) -> *mut u8 {
    let (addr, fixed) = match at {
        Some(p) => (p.cast(), libc::MAP_FIXED_NOREPLACE),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a new anonymous mapping; with MAP_FIXED_NOREPLACE the kernel
    // refuses (EEXIST) rather than replace anything mapped there.
    let p = unsafe { libc::mmap(addr, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | fixed, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    if let Some(want) = at {
        assert_eq!(p.cast::<u8>(), want, "the kernel placed the mapping elsewhere");
    }
    // SAFETY: `len` bytes just mapped writable, no references to them exist.
    unsafe { std::ptr::write_bytes(p.cast::<u8>(), byte, len) };
    p.cast()
}

fn unmap(p: *mut u8, len: usize) {
    // SAFETY: a mapping made by `map` with this length; callers drop the
    // handles that name it first (except where a test says otherwise).
    assert_eq!(unsafe { libc::munmap(p.cast(), len) }, 0);
}

#[test]
#[ignore = "needs an RDMA device"]
fn hit_returns_the_same_region_and_is_much_cheaper_than_a_miss() {
    let lb = loopback(&QpConfig::default());
    let cache = RegistrationCache::new(&lb.pd, CacheConfig::default());
    let len = 1 << 20;
    let p = map(None, len, 0x11);
    let access = AccessFlags::REMOTE_READ;

    // SAFETY (every `get` of `p` below): the mapping stays, untouched by
    // Rust references, until the `invalidate` before `unmap` at the end;
    // no handle outlives it.
    let first = unsafe { cache.get(p, len, access) }.unwrap();
    let again = unsafe { cache.get(p, len, access) }.unwrap();
    assert_eq!((again.mr().rkey(), again.mr().lkey(), again.offset()), (first.mr().rkey(), first.mr().lkey(), 0));
    let inner = unsafe { cache.get(p.wrapping_add(4096), 100, access) }.unwrap();
    assert_eq!((inner.mr().rkey(), inner.offset(), inner.len()), (first.mr().rkey(), 4096, 100));
    assert_eq!(inner.remote(), RemoteBuffer { addr: p as u64 + 4096, len: 100, rkey: first.mr().rkey() });
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.entries, s.bytes), (2, 1, 1, len as u64));
    // What a hit serves is the memory, through the NIC.
    assert_eq!(read(&lb, &inner.remote(), 100).unwrap(), vec![0x11; 100]);
    drop((first, again, inner));

    // Miss: invalidate (untimed, it deregisters the cached region), then
    // look up again: ibv_reg_mr and the bookkeeping.
    let misses = 20;
    let mut miss = Duration::ZERO;
    for _ in 0..misses {
        assert_eq!(cache.invalidate(p as u64, len), 1);
        let t = Instant::now();
        let r = unsafe { cache.get(p, len, access) }.unwrap();
        miss += t.elapsed();
        drop(r);
    }
    let hits = 2000;
    let t = Instant::now();
    for _ in 0..hits {
        drop(unsafe { cache.get(p, len, access) }.unwrap());
    }
    let hit = t.elapsed();
    let (miss_us, hit_us) = (miss.as_secs_f64() * 1e6 / misses as f64, hit.as_secs_f64() * 1e6 / hits as f64);
    eprintln!("1 MiB: miss (ibv_reg_mr) {miss_us:.1} us, hit {hit_us:.2} us, {:.0}x", miss_us / hit_us);
    // A debug build under an emulator gives about 13x for 1 MiB; an
    // optimised one far more (docs/performance.md). 5x leaves room for noise.
    assert!(hit_us * 5.0 < miss_us, "a hit ({hit_us:.2} us) should cost far less than a miss ({miss_us:.1} us)");
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.invalidations), (2 + hits, 1 + misses, misses));

    assert_eq!(cache.invalidate(p as u64, len), 1);
    unmap(p, len);
}

/// The case the cache exists to get right: memory unmapped and mapped
/// again at the same address with other contents.
#[test]
#[ignore = "needs an RDMA device"]
fn remapped_memory_is_registered_afresh_and_reads_the_new_pages() {
    let lb = loopback(&QpConfig::default());
    let cache = RegistrationCache::new(&lb.pd, CacheConfig::default());
    let len = 64 << 10;
    let p = map(None, len, 0xaa);
    // SAFETY: the mapping stays until `invalidate` below; the handle `old`
    // outlives it on purpose (see there) and is only used by the NIC.
    let old = unsafe { cache.get(p, len, AccessFlags::REMOTE_READ) }.unwrap();
    assert_eq!(read(&lb, &old.remote(), len).unwrap(), vec![0xaa; len]);

    // The owner frees the memory: it tells the cache first, then unmaps,
    // and the address is mapped again with new contents.
    assert_eq!(cache.invalidate(p as u64, len), 1);
    unmap(p, len);
    let q = map(Some(p), len, 0x55);
    assert_eq!(q, p);

    // SAFETY: the new mapping stays until the `invalidate` at the end.
    let new = unsafe { cache.get(p, len, AccessFlags::REMOTE_READ) }.unwrap();
    let s = cache.stats();
    assert_eq!((s.hits, s.misses, s.invalidations, s.entries), (0, 2, 1, 1), "a fresh registration, not a hit");
    assert_ne!(new.mr().rkey(), old.mr().rkey());
    assert_eq!(new.mr().addr(), old.mr().addr(), "same virtual address");
    assert_eq!(read(&lb, &new.remote(), len).unwrap(), vec![0x55; len], "the NIC reads the new pages");

    // Why serving the old region would be wrong. A region pins the
    // physical pages mapped when it was registered; munmap does not unpin
    // them and mmap at the same address gets other pages, so the old
    // region still reads the old bytes through the NIC. Had the cache not
    // been told (or had it ignored the invalidation) it would have served
    // this region for the same address, length and access, and the peer
    // would have read stale data with no error anywhere. (Keeping `old`
    // past the unmap breaks `get`'s contract; the test does it on purpose
    // and never touches `old`'s bytes from the CPU.)
    assert_eq!(read(&lb, &old.remote(), len).unwrap(), vec![0xaa; len], "the old region still names the old pages");
    drop(old);

    drop(new);
    assert_eq!(cache.invalidate(p as u64, len), 1);
    unmap(p, len);
}

#[test]
#[ignore = "needs an RDMA device"]
fn more_access_means_a_new_registration() {
    let lb = loopback(&QpConfig::default());
    let cache = RegistrationCache::new(&lb.pd, CacheConfig::default());
    let len = 8192;
    let p = map(None, len, 0x3c);
    // SAFETY (every `get`): the mapping stays until the `invalidate` at the
    // end, and no handle outlives it.
    let local = unsafe { cache.get(p, len, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert_eq!(local.mr().access(), AccessFlags::LOCAL_WRITE);
    let remote = unsafe { cache.get(p, len, AccessFlags::REMOTE_READ) }.unwrap();
    assert_ne!(remote.mr().rkey(), local.mr().rkey());
    // The new region grants what the old one did as well, and replaces it.
    assert_eq!(remote.mr().access(), AccessFlags::REMOTE_READ | AccessFlags::LOCAL_WRITE);
    let s = cache.stats();
    assert_eq!((s.misses, s.hits, s.entries), (2, 0, 1));
    let back = unsafe { cache.get(p, len, AccessFlags::LOCAL_WRITE) }.unwrap();
    assert_eq!(back.mr().rkey(), remote.mr().rkey());
    assert_eq!(read(&lb, &remote.remote(), len).unwrap(), vec![0x3c; len]);
    // Serving the LOCAL_WRITE region to the REMOTE_READ request would have
    // handed the peer an rkey the NIC refuses. (This breaks the queue pair:
    // it comes last.)
    assert_eq!(read(&lb, &local.remote(), len), Err(WcStatus::RemoteAccessError));
    drop((local, remote, back));
    assert_eq!(cache.invalidate(p as u64, len), 1);
    unmap(p, len);
}

/// Eviction drops only the cache's handle: a work request in flight keeps
/// its region registered until it completes.
#[test]
#[ignore = "needs an RDMA device"]
fn evicted_regions_stay_registered_while_in_use() {
    let lb = loopback(&QpConfig::default());
    let cache = RegistrationCache::new(&lb.pd, CacheConfig { max_entries: 1, ..CacheConfig::default() });
    let len = 16 << 10;
    let bufs: Vec<*mut u8> = (0..3).map(|i| map(None, len, 0x40 + i)).collect();
    // SAFETY (every `get`): the mappings stay until the `invalidate` at the
    // end, and no handle outlives them.
    let a = unsafe { cache.get(bufs[0], len, AccessFlags::LOCAL_WRITE) }.unwrap();
    let target = MemoryRegion::alloc(&lb.pd, len, AccessFlags::REMOTE_READ).unwrap();
    target.fill(.., 0x99).unwrap();
    // An RDMA read into `a`, posted; then `a` is evicted and dropped.
    lb.a.qp.post_send(&[SendWr::read(a.slice(), &target.remote(), 0).unwrap().wr_id(5)]).unwrap();
    let keep = a.mr().clone(); // only to read the result back afterwards
    drop(a);
    for &b in &bufs[1..] {
        drop(unsafe { cache.get(b, len, AccessFlags::LOCAL_WRITE) }.unwrap());
    }
    let s = cache.stats();
    assert_eq!((s.entries, s.evictions, s.misses), (1, 2, 3));
    let wc = wait_one(&lb.a.cq);
    assert_eq!((wc.wr_id, wc.status), (5, WcStatus::Success));
    assert_eq!(keep.to_vec().unwrap(), vec![0x99; len]);
    // Looked up again: registered again.
    drop(unsafe { cache.get(bufs[0], len, AccessFlags::LOCAL_WRITE) }.unwrap());
    assert_eq!(cache.stats().misses, 4);
    drop(keep);
    for &b in &bufs {
        cache.invalidate(b as u64, len);
        unmap(b, len);
    }
    assert_eq!(cache.stats().entries, 0);
}
