//! What registering host memory costs, per region size (4 KiB .. 64 MiB in
//! powers of four by default; `GPUDIRECT_BENCH_REG_SIZES` to choose).
//!
//! ```text
//! GPUDIRECT_BENCH_DEVICE=mlx5_0 cargo bench --bench registration
//! ```
//!
//! One group, `registration`, with six benchmarks per size:
//!
//! - `alloc/<size>`: `MemoryRegion::alloc` and dropping the region: the
//!   whole life of a fresh region (zeroed page-aligned allocation,
//!   `ibv_reg_mr`, `ibv_dereg_mr`, free).
//! - `register/<size>`: `MemoryRegion::register` of a [`HostBuffer`]
//!   allocated (and so already faulted in: it is zeroed) before the clock
//!   starts: `ibv_reg_mr` and the library's bookkeeping. Dropping the region
//!   frees the buffer as well, so it is left out of the timing.
//! - `register_raw/<size>`: `MemoryRegion::register_raw` of one buffer
//!   reused for every iteration, dropped untimed: `ibv_reg_mr` of memory
//!   the process registered (and deregistered) before.
//! - `deregister/<size>`: dropping a region made by `register_raw`, whose
//!   memory the caller keeps: `ibv_dereg_mr` alone.
//! - `cache_miss/<size>`: a [`RegistrationCache`] lookup of that reused
//!   buffer right after invalidating it (untimed, with the deregistration
//!   it causes): `ibv_reg_mr` plus the cache's bookkeeping, what the first
//!   use of a buffer costs with the cache.
//! - `cache_hit/<size>`: a lookup of the same buffer while it is cached,
//!   and dropping the returned handle: what every later use costs.
//!
//! Without a device the binary says so on one line and exits 0.

mod common;

use std::time::{Duration, Instant};

use common::OrDie;
use criterion::{BenchmarkId, SamplingMode};
use gpudirect::rcache::{CacheConfig, RegistrationCache};
use gpudirect::{AccessFlags, HostBuffer, MemoryRegion, ProtectionDomain, Registerable};

/// Regions are registered for remote access, as the RDMA benchmarks' are.
const ACCESS: AccessFlags = AccessFlags::REMOTE_WRITE.union(AccessFlags::REMOTE_READ);

fn main() {
    let sizes = common::reg_sizes();
    let Some(ctx) = common::open_device("registration") else { return };
    let mut c = common::criterion();
    let pd = ProtectionDomain::new(&ctx).or_die("creating a protection domain");
    println!(
        "registration: {}, host memory, sizes {}",
        ctx.name(),
        sizes.iter().map(|&s| common::human(s)).collect::<Vec<_>>().join(", ")
    );

    let mut g = c.benchmark_group("registration");
    g.sampling_mode(SamplingMode::Flat);
    for &size in &sizes {
        let what = format!("registering {}", common::human(size));

        g.bench_with_input(BenchmarkId::new("alloc", size), &size, |b, &size| {
            b.iter(|| drop(MemoryRegion::alloc(&pd, size, ACCESS).or_die(&what)))
        });

        g.bench_with_input(BenchmarkId::new("register", size), &size, |b, &size| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let buf = HostBuffer::new(size).or_die(&what);
                    let start = Instant::now();
                    let mr = MemoryRegion::register(&pd, buf, ACCESS).or_die(&what);
                    total += start.elapsed();
                    drop(mr);
                }
                total
            })
        });

        let mut buf = HostBuffer::new(size).or_die(&what);
        let ptr = buf.as_mut_ptr();
        // SAFETY (both uses below): `buf` is mapped, writable and owned by
        // this function; it outlives every region made of it (each is
        // dropped inside its iteration), and nothing else touches it.
        let register_raw = || unsafe { MemoryRegion::register_raw(&pd, ptr, size, ACCESS) }.or_die(&what);

        g.bench_with_input(BenchmarkId::new("register_raw", size), &size, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let start = Instant::now();
                    let mr = register_raw();
                    total += start.elapsed();
                    drop(mr);
                }
                total
            })
        });

        g.bench_with_input(BenchmarkId::new("deregister", size), &size, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let mr = register_raw();
                    let start = Instant::now();
                    drop(mr);
                    total += start.elapsed();
                }
                total
            })
        });
        let cache = RegistrationCache::new(&pd, CacheConfig::default());
        // SAFETY (both lookups below): as for `register_raw`; and the cache
        // is told before `buf` goes (the `invalidate` after the benchmarks)
        // and dropped with it.
        let lookup = || unsafe { cache.get(ptr, size, ACCESS) }.or_die(&what);

        g.bench_with_input(BenchmarkId::new("cache_miss", size), &size, |b, _| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    cache.invalidate(ptr as u64, size);
                    let start = Instant::now();
                    let r = lookup();
                    total += start.elapsed();
                    drop(r);
                }
                total
            })
        });

        g.bench_with_input(BenchmarkId::new("cache_hit", size), &size, |b, _| {
            drop(lookup());
            b.iter(lookup)
        });
        cache.invalidate(ptr as u64, size);
        drop(cache);
        drop(buf);
    }
    g.finish();
    c.final_summary();
}
