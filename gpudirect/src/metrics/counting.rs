//! What the agent counts as bytes move, by the path they took: plain
//! atomics the post and completion paths bump (relaxed adds, no lock),
//! and the plain data they are read into, shared by the engine and the
//! NCCL plugin.
//!
//! The path of a byte is never inferred: it is the registration path of
//! the local memory region, on the NIC that moved it, that the work
//! request named ([`DataPath::of`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::mr::Location;
use crate::policy::RegistrationPath;

/// The path bytes took between a NIC and the memory they came from or
/// went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum DataPath {
    /// GPUDirect RDMA: GPU memory registered by dma-buf or peer memory on
    /// the NIC that moved it; the NIC reads and writes the GPU itself.
    Gdr,
    /// Host memory, by the caller's choice.
    Host,
    /// A GPU's bytes through host memory: GPU memory registered by host
    /// staging (the NIC moves a pinned host mirror and the CPU copies),
    /// as a staging policy allowed.
    Staged,
}

impl DataPath {
    /// Every path, in the order of [`as_str`](Self::as_str)'s labels.
    pub const ALL: [DataPath; 3] = [DataPath::Gdr, DataPath::Host, DataPath::Staged];

    /// The path of bytes moved by a NIC from or into a region at
    /// `location` (as [`MemoryRegion::location`](crate::MemoryRegion::location)
    /// reports it).
    pub fn of(location: Location) -> DataPath {
        match location {
            Location::Host => DataPath::Host,
            Location::Gpu { path, .. } => DataPath::of_gpu(path),
        }
    }

    /// The path of bytes moved from or into GPU memory registered by
    /// `path`: `staged` through a host mirror, else `gdr`.
    pub fn of_gpu(path: RegistrationPath) -> DataPath {
        // Every path named: a new one is judged here before it is counted.
        match path {
            RegistrationPath::HostStaged => DataPath::Staged,
            RegistrationPath::DmaBuf | RegistrationPath::PeerMemory => DataPath::Gdr,
        }
    }

    /// Its label: `gdr`, `host` or `staged`.
    pub fn as_str(self) -> &'static str {
        match self {
            DataPath::Gdr => "gdr",
            DataPath::Host => "host",
            DataPath::Staged => "staged",
        }
    }
}

impl std::fmt::Display for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which way bytes went through a NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Direction {
    /// Out of local memory: an agent's writes (and broadcast chunks it
    /// sends or forwards), the NCCL plugin's sends.
    Out,
    /// Into local memory: an agent's reads, the NCCL plugin's receives.
    In,
}

impl Direction {
    /// Both, in the order of [`as_str`](Self::as_str)'s labels.
    pub const ALL: [Direction; 2] = [Direction::Out, Direction::In];

    /// Its label: `out` or `in`.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Out => "out",
            Direction::In => "in",
        }
    }
}

/// Bytes one post of a lane moves, by [`DataPath`] (indexed as
/// [`DataPath::ALL`]); worked out once, when the request is prepared.
pub type PathBytes = [u64; 3];

/// The bytes and posts a NIC moved, by direction and path.
#[derive(Default, Debug)]
pub struct PathCounters {
    bytes: [[AtomicU64; 3]; 2],
    posts: [[AtomicU64; 3]; 2],
}

impl PathCounters {
    /// Counts one post of `bytes` going `dir`.
    #[inline]
    pub fn count(&self, dir: Direction, bytes: &PathBytes) {
        for (&path, &b) in DataPath::ALL.iter().zip(bytes) {
            self.add(dir, path, b);
        }
    }

    /// Counts one post of `bytes` going `dir`, all on `path`; a post of
    /// no bytes counts nothing (posts are those that carried bytes).
    #[inline]
    pub fn add(&self, dir: Direction, path: DataPath, bytes: u64) {
        if bytes == 0 {
            return;
        }
        self.bytes[dir as usize][path as usize].fetch_add(bytes, Relaxed);
        self.posts[dir as usize][path as usize].fetch_add(1, Relaxed);
    }

    /// Every (direction, path) pair, zeros included, so that a scraper
    /// sees each series from the start.
    pub fn read(&self) -> Vec<PathTraffic> {
        let mut v = Vec::with_capacity(6);
        for direction in Direction::ALL {
            for path in DataPath::ALL {
                let (d, p) = (direction as usize, path as usize);
                v.push(PathTraffic { direction, path, bytes: self.bytes[d][p].load(Relaxed), posts: self.posts[d][p].load(Relaxed) });
            }
        }
        v
    }
}

/// What one NIC moved one way on one path.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct PathTraffic {
    /// Which way.
    pub direction: Direction,
    /// Which path.
    pub path: DataPath,
    /// Bytes (written or read; notifications not counted).
    pub bytes: u64,
    /// Posts (or slices of one) that carried bytes of this path.
    pub posts: u64,
}

/// Upper bounds of [`Histogram`]'s buckets, in seconds; a last bucket
/// takes what is above.
pub const LATENCY_BOUNDS: [f64; 14] = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0, 10.0];

/// [`LATENCY_BOUNDS`] in nanoseconds, for the completion path.
const BOUNDS_NS: [u64; 14] = [10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000, 50_000_000, 100_000_000, 1_000_000_000, 10_000_000_000];

/// Request latencies, from post to the completion that finished the
/// post (done or failed), of one post in [`LATENCY_SAMPLE`].
#[derive(Default, Debug)]
pub struct LatencyCounters {
    /// One per bound, and the last for what is above.
    buckets: [AtomicU64; 15],
    sum_ns: AtomicU64,
}

impl LatencyCounters {
    /// Counts one observation of `took_ns` nanoseconds.
    pub fn record(&self, took_ns: u64) {
        let at = BOUNDS_NS.iter().position(|&b| took_ns <= b).unwrap_or(BOUNDS_NS.len());
        self.buckets[at].fetch_add(1, Relaxed);
        self.sum_ns.fetch_add(took_ns, Relaxed);
    }

    /// What was counted so far.
    pub fn read(&self) -> Histogram {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        Histogram { count: counts.iter().sum(), sum_seconds: self.sum_ns.load(Relaxed) as f64 * 1e-9, counts }
    }
}

/// A latency histogram (of a sample of the posts: one in
/// [`LATENCY_SAMPLE`] per posting thread).
#[derive(Clone, Debug, Default, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Histogram {
    /// Observations per bucket (not cumulative): index `i` those at most
    /// [`LATENCY_BOUNDS`]`[i]` seconds and above the bound before, the
    /// last those above every bound.
    pub counts: Vec<u64>,
    /// Observations in all.
    pub count: u64,
    /// Their sum, in seconds.
    pub sum_seconds: f64,
}

/// One post in this many, per posting thread, has its latency taken:
/// reading the clock at the post and at its completion cost 4% more
/// user-space instructions per descriptor when every post did
/// (`testbed/engine-insns`), against the 2% counting may cost.
pub const LATENCY_SAMPLE: u32 = 8;
const _: () = assert!(LATENCY_SAMPLE.is_power_of_two());

/// Nanoseconds on the monotonic clock (never 0): a post's start, kept
/// in an atomic so the request's state needs no lock for it. Read
/// directly, not as an `Instant` since a lazily set epoch: helgrind and
/// drd do not see a `OnceLock`'s hand-over and report its first read.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out-pointer; CLOCK_MONOTONIC exists on every Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).wrapping_mul(1_000_000_000).wrapping_add(ts.tv_nsec as u64).max(1)
}

/// A post's start for its latency, when this post is one of the sample
/// ([`LATENCY_SAMPLE`]); else 0.
#[inline]
pub fn sample_start() -> u64 {
    thread_local! {
        static POSTS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    }
    let n = POSTS.with(|c| {
        let n = c.get();
        c.set(n.wrapping_add(1));
        n
    });
    // A power of two: a mask, not a division.
    if n & (LATENCY_SAMPLE - 1) == 0 {
        now_ns()
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The path comes from the registration alone: a host-staged GPU
    /// region is staged, never gdr, whatever else is true of it.
    #[test]
    fn a_staged_byte_is_never_counted_as_gdr() {
        let gpu = |path| Location::Gpu { ordinal: 0, path };
        assert_eq!(DataPath::of(Location::Host), DataPath::Host);
        assert_eq!(DataPath::of(gpu(RegistrationPath::HostStaged)), DataPath::Staged);
        assert_eq!(DataPath::of(gpu(RegistrationPath::DmaBuf)), DataPath::Gdr);
        assert_eq!(DataPath::of(gpu(RegistrationPath::PeerMemory)), DataPath::Gdr);
        let c = PathCounters::default();
        c.count(Direction::Out, &[0, 0, 4096]);
        c.count(Direction::In, &[100, 28, 0]);
        let got = c.read();
        let find = |d, p| got.iter().find(|t| t.direction == d && t.path == p).copied().unwrap();
        assert_eq!((find(Direction::Out, DataPath::Staged).bytes, find(Direction::Out, DataPath::Gdr).bytes), (4096, 0));
        assert_eq!((find(Direction::In, DataPath::Gdr).posts, find(Direction::In, DataPath::Host).posts, find(Direction::In, DataPath::Staged).posts), (1, 1, 0));
        assert_eq!(got.len(), 6);
    }

    /// Attack (review): `gpudirect_posts_total` counts "posts that
    /// carried bytes". The NCCL plugin counts each send of a group with
    /// `add`, zero-size ones included (comm.rs `post_group`), and a
    /// zero-size send's path is `host` whatever the connection: a staged
    /// connection's empty sends show as host posts. A post of no bytes
    /// counts nothing, as `count` does.
    #[test]
    fn a_post_of_no_bytes_counts_no_post() {
        let c = PathCounters::default();
        c.add(Direction::Out, DataPath::Host, 0);
        c.count(Direction::Out, &[0, 0, 0]);
        let posts: u64 = c.read().iter().map(|t| t.posts).sum();
        assert_eq!(posts, 0, "a post of 0 bytes was counted as one that carried bytes");
    }

    #[test]
    fn latencies_land_in_their_buckets() {
        let l = LatencyCounters::default();
        l.record(10_000);
        l.record(11_000);
        l.record(20_000_000_000);
        let h = l.read();
        assert_eq!((h.counts[0], h.counts[1], h.counts[14], h.count), (1, 1, 1, 3));
        assert!((h.sum_seconds - 20.000021).abs() < 1e-9);
    }
}
