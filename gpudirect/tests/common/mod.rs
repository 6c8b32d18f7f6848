//! Setup shared by the one-host device tests (`rxe`, `rcache`, ...):
//! the device under test, a process talking to itself over
//! a connected queue pair.
//! Each test binary uses part of it (`rcache` never reads side `b`, which
//! only keeps the twin connected).
#![allow(dead_code)]

use std::time::Duration;

use gpudirect::{CompletionQueue, Context, PreparedQueuePair, ProtectionDomain, QpConfig, QueuePair, WorkCompletion};

/// Longest wait for one completion before the test fails.
pub const TIMEOUT: Duration = Duration::from_secs(60);

pub use testkit::device;

/// One side of a loopback connection.
pub struct Side {
    pub cq: CompletionQueue,
    pub qp: QueuePair,
}

/// Two queue pairs of one process connected to each other, so work posted
/// on `a` reaches this process's own regions through the NIC, by rkey,
/// exactly as a peer's would.
pub struct Loopback {
    pub pd: ProtectionDomain,
    pub a: Side,
    pub b: Side,
}

pub fn loopback(config: &QpConfig) -> Loopback {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq_a = CompletionQueue::new(&ctx, 256).unwrap();
    let cq_b = CompletionQueue::new(&ctx, 256).unwrap();
    let (qa, qb) = connect_pair(
        QueuePair::create(&pd, &cq_a, &cq_a, config).unwrap(),
        QueuePair::create(&pd, &cq_b, &cq_b, config).unwrap(),
    );
    Loopback { pd, a: Side { cq: cq_a, qp: qa }, b: Side { cq: cq_b, qp: qb } }
}

/// Connects two queue pairs of this process to each other.
pub fn connect_pair(a: PreparedQueuePair, b: PreparedQueuePair) -> (QueuePair, QueuePair) {
    let (ea, eb) = (a.endpoint(), b.endpoint());
    (a.connect(&eb).unwrap(), b.connect(&ea).unwrap())
}

/// Waits for exactly one completion.
pub fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    let n = cq.wait(&mut wc, Some(TIMEOUT)).unwrap();
    assert_eq!(n, 1);
    wc[0]
}

/// Test bookkeeping shared between threads (counters, flags, what was
/// seen), behind a pthread mutex. The standard library's `Mutex` (futexes)
/// and atomics (plain moves on x86) are invisible to helgrind and drd,
/// which would report the tests' own counters as races; testbed/sanitize
/// runs these tests under both tools to check the library, so the tests
/// synchronise in the one way the tools see.
pub struct Shared<T> {
    raw: Box<std::cell::UnsafeCell<libc::pthread_mutex_t>>,
    value: std::cell::UnsafeCell<T>,
}

// SAFETY: `value` is only reached with the mutex held.
unsafe impl<T: Send> Sync for Shared<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Send for Shared<T> {}

impl<T> Shared<T> {
    pub fn new(value: T) -> Self {
        Shared { raw: Box::new(std::cell::UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER)), value: std::cell::UnsafeCell::new(value) }
    }

    /// Runs `f` on the value with the mutex held.
    pub fn with<R>(&self, f: impl FnOnce(&mut T) -> R) -> R {
        // SAFETY: an initialised mutex that never moves (boxed).
        unsafe { libc::pthread_mutex_lock(self.raw.get()) };
        // SAFETY: the lock is held, so this is the only reference.
        let r = f(unsafe { &mut *self.value.get() });
        // SAFETY: locked above by this thread.
        unsafe { libc::pthread_mutex_unlock(self.raw.get()) };
        r
    }

    pub fn into_inner(self) -> T {
        self.value.into_inner()
    }
}

impl<T: Copy> Shared<T> {
    pub fn get(&self) -> T {
        self.with(|v| *v)
    }
}
