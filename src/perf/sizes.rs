//! perftest's `-a` sweep, defined once: `gpudirect bw|lat -a`, the `rdma`
//! bench's default sizes (`benches/common` includes this file) and
//! `testbed/compare-perftest --sizes all` (`testbed/perf_results.py` reads
//! the range below from this file) all measure these sizes. A leaf: it
//! imports nothing.

/// The powers of two perftest's `-a` sweeps: 2^1 (2 B) to 2^23 (8 MiB).
pub const PERFTEST_ALL_EXPONENTS: std::ops::RangeInclusive<u32> = 1..=23;

/// The sizes of `-a`, smallest first.
pub fn perftest_all_sizes() -> Vec<usize> {
    PERFTEST_ALL_EXPONENTS.map(|p| 1usize << p).collect()
}
