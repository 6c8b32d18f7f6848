//! Failure injection for the library's own tests (feature
//! `fault-injection`, which only the test builds of this workspace turn
//! on): makes a verb that cannot be made to fail on demand report a
//! failure, so the path that handles it runs for real. Not for production.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

static DEREG_MR_FAILURES: AtomicU32 = AtomicU32::new(0);

/// The next `n` deregistrations of memory regions (`ibv_dereg_mr`, when a
/// region's last handle goes) are not performed and report `EBUSY`, as a
/// provider may when the region is still in use. The region then stays
/// registered, as after a real failure.
pub fn fail_next_dereg_mr(n: u32) {
    DEREG_MR_FAILURES.store(n, Ordering::SeqCst);
}

/// Whether this deregistration is to fail (and counts it).
pub(crate) fn take_dereg_mr_failure() -> bool {
    DEREG_MR_FAILURES.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

static PURGE_ON_DESTROY: AtomicBool = AtomicBool::new(false);
static SRQ_POST_FAILURES: AtomicU32 = AtomicU32::new(0);

/// While `on`, destroying a queue pair also removes its completions not
/// yet polled from its completion queues, as mlx5 does (rxe keeps them):
/// what a destroyed queue pair had received and nobody had reaped is gone.
pub fn purge_on_destroy(on: bool) {
    PURGE_ON_DESTROY.store(on, Ordering::SeqCst);
}

pub(crate) fn purging() -> bool {
    PURGE_ON_DESTROY.load(Ordering::SeqCst)
}

/// The next `n` receive posts to shared receive queues fail with `ENOMEM`
/// before reaching the device, as `ibv_post_srq_recv` may.
pub fn fail_next_srq_post(n: u32) {
    SRQ_POST_FAILURES.store(n, Ordering::SeqCst);
}

pub(crate) fn take_srq_post_failure() -> bool {
    SRQ_POST_FAILURES.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)).is_ok()
}

static SEND_REAP_DELAY_US: AtomicU32 = AtomicU32::new(0);

/// While not zero, each engine reap that took send completions off a CQ
/// sleeps this long before finishing their requests: a thread that reaps
/// what another waits for then holds it across the other's whole look,
/// the window in which a wakeup can be lost.
pub fn delay_send_reaps(d: std::time::Duration) {
    SEND_REAP_DELAY_US.store(d.as_micros().min(u32::MAX as u128) as u32, Ordering::SeqCst);
}

/// The sleep [`delay_send_reaps`] set, where a reaper calls it.
pub fn send_reap_delay() {
    let us = SEND_REAP_DELAY_US.load(Ordering::SeqCst);
    if us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(us.into()));
    }
}

static LANE_DELAY: AtomicU32 = AtomicU32::new(0);

/// While `delay` is not zero, an engine post sleeps `delay` before it
/// posts the part of a request that goes on queue pair index `qp` of a
/// rail: the other queue pairs' parts are on the wire and may complete
/// first, as when one queue pair of a rail is slower than its siblings.
pub fn delay_lane_posts(qp: u8, delay: std::time::Duration) {
    let ms = delay.as_millis().min(0x00ff_ffff) as u32;
    LANE_DELAY.store(ms << 8 | u32::from(qp), Ordering::SeqCst);
}

/// The sleep [`delay_lane_posts`] set for queue pair `qp`, where a post
/// calls it.
pub fn lane_post_delay(qp: usize) {
    let v = LANE_DELAY.load(Ordering::SeqCst);
    if v >> 8 > 0 && (v & 0xff) as usize == qp {
        std::thread::sleep(std::time::Duration::from_millis((v >> 8).into()));
    }
}
