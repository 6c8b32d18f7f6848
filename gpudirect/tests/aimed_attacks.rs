//! Attacks on the aimed post built straight from its template
//! (`QueuePair::post_aimed` on an extended queue pair): each test tries
//! to make that path differ from the general one (`post_send`) in
//! what it holds, enters, refuses or releases. Each runs the same steps
//! on an extended queue pair (the new path) and on a plain one (the
//! general path), and against `post_send` on the same queue pair. Ignored
//! by default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test aimed_attacks -- --ignored
//! ```

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{loopback, wait_one, Loopback, Shared};
use testkit::pattern;

use gpudirect::{
    AccessFlags, Error, LocalSlice, MemoryRegion, QpConfig, QueuePair, RecvWr, SendTemplate, SendWr, WcOpcode, WcStatus,
    WorkCompletion,
};

/// Posts one write of `local` either way: the template's aimed post, or
/// the same request through `post_send`.
fn post(qp: &QueuePair, aimed: bool, t: &SendTemplate, local: LocalSlice<'_>, dst: &MemoryRegion, to: u64, wr_id: u64) -> gpudirect::Result<()> {
    post_key(qp, aimed, t, local, dst, to, wr_id, 0)
}

/// As [`post`], its key XORed with `spoil`.
#[allow(clippy::too_many_arguments)]
fn post_key(qp: &QueuePair, aimed: bool, t: &SendTemplate, local: LocalSlice<'_>, dst: &MemoryRegion, to: u64, wr_id: u64, spoil: u32) -> gpudirect::Result<()> {
    let mut r = dst.remote();
    r.rkey ^= spoil;
    if aimed {
        return qp.post_aimed(t, local, r.addr + to, r.rkey, 0, wr_id);
    }
    let mut wr = SendWr::write(local, &r, to).unwrap().wr_id(wr_id);
    if *t == SendTemplate::write().unsignaled() {
        wr = wr.unsignaled();
    }
    qp.post_send(&[wr])
}

fn busy(r: gpudirect::Result<()>) -> bool {
    matches!(r, Err(Error::Busy { .. }))
}

fn setup(extended: bool, depth: u32) -> (Loopback, MemoryRegion, MemoryRegion) {
    let config = QpConfig { extended_posting: extended, max_send_wr: depth, ..QpConfig::default() };
    let lb = loopback(&config);
    assert_eq!(lb.a.qp.extended_posting(), extended, "Soft-RoCE has the extended API");
    let src = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
    src.write_at(0, &pattern(8192, 9)).unwrap();
    (lb, src, dst)
}

/// Lost hold: an unsignaled aimed post's source must be the NIC's (CPU
/// writes refused, CPU reads allowed) until a later signaled completion
/// is reaped, exactly as post_send holds it; bytes outside the slice stay
/// the CPU's (a release alone, which tests/posting.rs checks, a post
/// that never held anything would pass too).
#[test]
#[ignore = "needs an RDMA device"]
fn attack_aimed_unsignaled_source_is_held_until_reaped() {
    for extended in [true, false] {
        let (lb, src, dst) = setup(extended, 16);
        let quiet = SendTemplate::write().unsignaled();
        let mut seen = Vec::new();
        for aimed in [true, false] {
            post(&lb.a.qp, aimed, &quiet, src.slice(0..100).unwrap(), &dst, 0, 1).unwrap();
            post(&lb.a.qp, aimed, &quiet, src.slice(1000..1100).unwrap(), &dst, 1000, 2).unwrap();
            let held = (busy(src.write_at(10, &[1; 4])), busy(src.write_at(1050, &[1; 4])));
            let read = src.read_at(10, &mut [0; 4]).is_ok();
            let outside = src.write_at(500, &[7; 4]).is_ok();
            post(&lb.a.qp, aimed, &SendTemplate::write(), src.slice(2000..2100).unwrap(), &dst, 2000, 3).unwrap();
            // Posted, not reaped: still held, whatever the NIC has done.
            let still = (busy(src.write_at(10, &[1; 4])), busy(src.write_at(2050, &[1; 4])));
            let wc = wait_one(&lb.a.cq).ok().unwrap();
            assert_eq!((wc.wr_id, wc.opcode), (3, WcOpcode::RdmaWrite));
            let freed = [10, 1050, 2050].map(|at| src.write_at(at, &pattern(4, at as u64)).is_ok());
            seen.push((held, read, outside, still, freed));
            src.write_at(0, &pattern(8192, 9)).unwrap();
        }
        let want = ((true, true), true, true, (true, true), [true; 3]);
        assert_eq!(seen, [want, want], "aimed then post_send, extended_posting {extended}");
    }
}

/// Refusals must not leak: a post refused for a full queue, or for a
/// foreign region, leaves no hold on its slice and no entry or sequence
/// number behind (the completions that follow are still matched, and the
/// queue's room is whole again once they are reaped).
#[test]
#[ignore = "needs an RDMA device"]
fn attack_aimed_refusals_hold_nothing() {
    for extended in [true, false] {
        let (lb, src, dst) = setup(extended, 4);
        let w = SendTemplate::write();
        for id in 0..4 {
            lb.a.qp.post_aimed(&w, src.slice(0..64).unwrap(), dst.remote().addr, dst.remote().rkey, 0, id).unwrap();
        }
        let full = lb.a.qp.post_aimed(&w, src.slice(4000..4064).unwrap(), dst.remote().addr, dst.remote().rkey, 0, 99);
        assert!(matches!(full, Err(Error::QueueFull { .. })), "{full:?}");
        src.write_at(4000, &[5; 64]).expect("a refused post holds nothing of its slice");
        for id in 0..4 {
            let wc = wait_one(&lb.a.cq).ok().unwrap();
            assert_eq!((wc.wr_id, wc.opcode), (id, WcOpcode::RdmaWrite), "extended_posting {extended}");
        }
        // The whole depth again, then one more refused, then all reaped.
        for id in 10..14 {
            lb.a.qp.post_aimed(&w, src.slice(64..128).unwrap(), dst.remote().addr + 64, dst.remote().rkey, 0, id).unwrap();
        }
        for id in 10..14 {
            assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, id, "extended_posting {extended}");
        }
        let mut none = [WorkCompletion::default(); 4];
        assert_eq!(lb.a.cq.poll(&mut none).unwrap(), 0, "no stray completion, extended_posting {extended}");
        src.write_at(0, &[0; 8192]).expect("every hold released");
    }
}

/// A failed request's completion, and flushed ones after the queue pair
/// moved to the error state, report the posted id and operation and
/// release the memory of aimed posts, signaled or not, as they do
/// post_send's.
#[test]
#[ignore = "needs an RDMA device"]
fn attack_aimed_failed_and_flushed_posts_release_their_memory() {
    for extended in [true, false] {
        let mut seen = Vec::new();
        for aimed in [true, false] {
            let (lb, src, dst) = setup(extended, 16);
            let quiet = SendTemplate::write().unsignaled();
            // A bad key: the request fails (its own completion, though
            // unsignaled), the queue pair errs, the next ones flush.
            post_key(&lb.a.qp, aimed, &quiet, src.slice(0..64).unwrap(), &dst, 0, 1, 0x5a5a00).unwrap();
            post(&lb.a.qp, aimed, &quiet, src.slice(100..164).unwrap(), &dst, 100, 2).unwrap();
            post(&lb.a.qp, aimed, &SendTemplate::write(), src.slice(200..264).unwrap(), &dst, 200, 3).unwrap();
            let mut got = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(20);
            while got.len() < 3 && Instant::now() < deadline {
                let mut wcs = [WorkCompletion::default(); 4];
                let n = lb.a.cq.wait(&mut wcs, Some(Duration::from_millis(200))).or_else(|e| if matches!(e, Error::Timeout(_)) { Ok(0) } else { Err(e) }).unwrap();
                got.extend(wcs[..n].iter().map(|w| (w.wr_id, w.opcode, w.status == WcStatus::Success)));
            }
            let freed = [10, 110, 210].map(|at| src.write_at(at, &[1; 4]).is_ok());
            lb.a.qp.move_to_error().unwrap();
            seen.push((got, freed));
        }
        eprintln!("extended_posting {extended}: aimed {:?}, post_send {:?}", seen[0], seen[1]);
        assert_eq!(seen[0].0.len(), 3, "every request completes, extended_posting {extended}: {seen:?}");
        assert_eq!(seen[0], seen[1], "aimed vs post_send, extended_posting {extended}");
        assert_eq!(seen[0].1, [true; 3], "extended_posting {extended}: {seen:?}");
    }
}

/// Two threads posting on one queue pair at once, one through the aimed
/// path and one through post_send (or both aimed), both reaping the one completion queue:
/// every signaled id completes once with its own operation, the queue
/// never overfills, every byte lands, and all memory is free at the end.
/// A lock not held from ibv_wr_start to ibv_wr_complete, or an entry whose
/// sequence another post also took, shows as a lost, doubled or foreign
/// completion or a wrong byte.
#[test]
#[ignore = "needs an RDMA device"]
fn attack_aimed_and_general_posts_race_on_one_queue_pair() {
    const PER: u64 = 3000;
    for (extended, mixed) in [(true, true), (true, false), (false, true)] {
        let (lb, src, dst) = setup(extended, 32);
        let reaped: Shared<BTreeMap<u64, (WcOpcode, u32)>> = Shared::new(BTreeMap::new());
        let stray = AtomicBool::new(false);
        let reap = |lb: &Loopback| {
            let mut wcs = [WorkCompletion::default(); 16];
            let n = lb.a.cq.poll(&mut wcs).unwrap();
            reaped.with(|m| {
                for w in &wcs[..n] {
                    let e = m.entry(w.wr_id).or_insert((w.opcode, 0));
                    e.1 += 1;
                    if w.status != WcStatus::Success || w.opcode != WcOpcode::RdmaWrite {
                        stray.store(true, Ordering::Relaxed);
                    }
                }
            });
        };
        std::thread::scope(|s| {
            for who in 0..2u64 {
                let (lb, src, dst, reap) = (&lb, &src, &dst, &reap);
                s.spawn(move || {
                    let quiet = SendTemplate::write().unsignaled();
                    let loud = SendTemplate::write();
                    let deadline = Instant::now() + Duration::from_secs(120);
                    for i in 0..PER {
                        // Thread 0 writes src[0..4096) to dst[0..4096), thread 1
                        // the upper halves; signaled every 4th and the last.
                        let at = (who * 4096 + (i % 64) * 64) as usize;
                        let t = if i % 4 == 3 || i + 1 == PER { &loud } else { &quiet };
                        let id = (who << 32) | i;
                        loop {
                            match post(&lb.a.qp, who == 0 || !mixed, t, src.slice(at..at + 64).unwrap(), dst, at as u64, id) {
                                Ok(()) => break,
                                Err(Error::QueueFull { .. }) => reap(lb),
                                Err(e) => panic!("thread {who} post {i}: {e}"),
                            }
                            assert!(Instant::now() < deadline, "thread {who} stuck at {i}");
                        }
                        if i % 8 == 0 {
                            reap(lb);
                        }
                    }
                });
            }
        });
        let want: usize = (0..2).map(|_| (0..PER).filter(|i| i % 4 == 3 || i + 1 == PER).count()).sum();
        let deadline = Instant::now() + Duration::from_secs(30);
        while reaped.with(|m| m.len()) < want && Instant::now() < deadline {
            reap(&lb);
        }
        let m = reaped.into_inner();
        let doubled: Vec<_> = m.iter().filter(|(_, v)| v.1 != 1).collect();
        let unknown: Vec<_> = m.keys().filter(|id| { let i = *id & 0xffff_ffff; !(*id >> 32 < 2 && i < PER && (i % 4 == 3 || i + 1 == PER)) }).collect();
        assert!(!stray.load(Ordering::Relaxed), "extended_posting {extended}: a failed or mislabelled completion");
        assert!(doubled.is_empty() && unknown.is_empty(), "extended_posting {extended}: doubled {doubled:?}, unknown {unknown:?}");
        assert_eq!(m.len(), want, "extended_posting {extended}: lost completions");
        eprintln!("extended_posting {extended} mixed {mixed}: {} signaled completions of {} posts", m.len(), 2 * PER);
        let mut got = vec![0; 8192];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, pattern(8192, 9), "extended_posting {extended}");
        src.write_at(0, &[0; 8192]).expect("every hold released");
    }
}

/// A queue pair dropped with aimed posts still held (unsignaled, never
/// followed by a signaled one) lets their memory go, as post_send's.
#[test]
#[ignore = "needs an RDMA device"]
fn attack_aimed_posts_pending_at_drop_are_released() {
    for extended in [true, false] {
        for aimed in [true, false] {
            let (lb, src, dst) = setup(extended, 8);
            lb.b.qp.post_recv(&[RecvWr::empty()]).unwrap();
            post(&lb.a.qp, aimed, &SendTemplate::write().unsignaled(), src.slice(0..64).unwrap(), &dst, 0, 1).unwrap();
            assert!(busy(src.write_at(0, &[1; 4])), "held, extended_posting {extended} aimed {aimed}");
            let Loopback { pd: _pd, a, b } = lb;
            drop(a.qp);
            src.write_at(0, &[1; 4]).expect("released with its queue pair");
            drop(b);
            drop(a.cq);
        }
    }
}
