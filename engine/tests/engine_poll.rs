//! Waiting for the engine from an event loop that is not tokio: the
//! agent's [`Readiness`] descriptor with `poll_completed` and
//! `poll_notification`, as Python's asyncio uses them. Ignored by default;
//! run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect-engine --test engine_poll -- --ignored
//! ```

mod common;

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use common::{agent, metadata as md};
use gpudirect_engine::{Op, Readiness};

const T: Duration = Duration::from_secs(20);

/// Sleeps until `r` is readable or `T` passed; whether it was.
fn sleep_on(r: &Readiness) -> bool {
    let mut p = libc::pollfd { fd: r.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut p, 1, T.as_millis() as i32) };
    assert!(n >= 0, "poll: {}", std::io::Error::last_os_error());
    n == 1
}

/// A loop's wait: poll, and sleep on the descriptor while nothing is
/// ready. Returns how many times it slept (a spinning loop would sleep 0
/// times and poll thousands).
fn until<T>(r: &Readiness, mut poll: impl FnMut() -> Option<T>) -> (T, usize) {
    let start = Instant::now();
    let mut slept = 0;
    loop {
        if let Some(v) = poll() {
            return (v, slept);
        }
        assert!(sleep_on(r), "the readiness descriptor did not turn readable within {T:?}: a lost wakeup");
        r.clear().unwrap();
        slept += 1;
        assert!(start.elapsed() < T, "nothing after {slept} wakeups");
    }
}

/// Writes with notifications, each awaited on the descriptor alone: every
/// byte arrives, every notification is handed out once, and the loop
/// sleeps instead of spinning (a few wakeups per transfer, not hundreds).
#[test]
#[ignore = "needs an RDMA device"]
fn a_loop_on_the_readiness_descriptor_sees_every_completion_and_notification() {
    let prefill = agent("prefill-0");
    let decode = agent("decode-0");
    let kv = prefill.alloc("kv", 1 << 20).unwrap();
    let table = decode.alloc("t", 1 << 20).unwrap();
    let remote = prefill.load_remote(&md(&decode)).unwrap().memory("t").unwrap();
    let (pr, dr) = (prefill.readiness().unwrap(), decode.readiness().unwrap());
    // Nothing pending: the descriptor stays quiet.
    assert!(decode.poll_notification().unwrap().is_none());
    let mut p = libc::pollfd { fd: dr.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    assert_eq!(unsafe { libc::poll(&mut p, 1, 50) }, 0, "readable with nothing to see");
    let mut wakeups = 0;
    for step in 0..32u8 {
        kv.fill(.., step).unwrap();
        let req = prefill.prepare(Op::Write, &[(kv.range(..).unwrap(), remote.range(..).unwrap())], Some(&[step])).unwrap();
        req.post().unwrap();
        let ((), a) = until(pr, || req.poll_completed().unwrap().then_some(()));
        let (n, b) = until(dr, || decode.poll_notification().unwrap());
        assert_eq!((n.peer.as_str(), n.msg.as_slice()), ("prefill-0", &[step][..]));
        let mut got = vec![0; 1 << 20];
        table.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == step), "step {step}: a notification before its data");
        wakeups += a + b;
    }
    assert!(wakeups <= 32 * 8, "{wakeups} wakeups for 32 transfers: the loop spins");
    assert!(decode.poll_notification().unwrap().is_none(), "a notification handed out twice");
}

/// Another thread reaps what the loop waits for (a blocking `wait`, a
/// blocking `wait_notification`), so the channel event that would wake
/// the loop is taken or never raised: the descriptor still turns readable.
/// The other thread's reap is slowed (fault injection) so that it holds a
/// completion it took off the CQ across the loop's whole look: without
/// the word a reap sends through the eventfd, the loop sleeps forever.
#[test]
#[ignore = "needs an RDMA device"]
fn completions_reaped_by_another_thread_still_wake_the_loop() {
    let prefill = agent("prefill-0");
    let decode = agent("decode-0");
    let kv = prefill.alloc("kv", 64 << 10).unwrap();
    decode.alloc("t", 64 << 10).unwrap();
    let remote = prefill.load_remote(&md(&decode)).unwrap().memory("t").unwrap();
    let req = prefill.prepare(Op::Write, &[(kv.range(..).unwrap(), remote.range(..).unwrap())], Some(b"n")).unwrap();
    let (pr, dr) = (prefill.readiness().unwrap(), decode.readiness().unwrap());
    gpudirect::fault::delay_send_reaps(Duration::from_millis(20));
    for _ in 0..50 {
        req.post().unwrap();
        // Handles joined by name (pthread_join), not by the scope's end,
        // whose wait helgrind and drd cannot see as synchronization.
        std::thread::scope(|s| {
            let w = s.spawn(|| req.wait(Some(T)).unwrap());
            // Let the blocking wait take the completion first.
            std::thread::sleep(Duration::from_millis(5));
            let n = s.spawn(|| {
                let n = decode.wait_notification(Some(T)).unwrap();
                assert_eq!(n.msg, b"n");
            });
            until(pr, || req.poll_completed().unwrap().then_some(()));
            w.join().unwrap();
            n.join().unwrap();
        });
        // The blocking thread took the notification; the next one is the
        // loop's, even if the other thread reaps it first.
        req.post().unwrap();
        std::thread::scope(|s| {
            let w = s.spawn(|| req.wait(Some(T)).unwrap());
            let (n, _) = until(dr, || decode.poll_notification().unwrap());
            assert_eq!(n.msg, b"n");
            w.join().unwrap();
        });
    }
    gpudirect::fault::delay_send_reaps(Duration::ZERO);
}
