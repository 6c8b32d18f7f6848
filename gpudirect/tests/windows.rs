//! Type-2 memory windows on a real device: a window opens the range it
//! was bound to, to the peer of the queue pair the bind was posted on,
//! until it is invalidated; the region's own key and every other queue
//! pair get nothing; and whether the device bounds a window's range is
//! what `probe_window_range` says (Soft-RoCE in Linux 6.1 does not); and
//! an outside review's attacks: another queue pair of the same domain, a
//! dropped window's key, a rebind under the last key, a region dropped
//! under a bound window, a queue pair dropped after its windows. Run in
//! the Soft-RoCE guest (rxe has type-2 windows), one test at a time (two
//! read the process's pinned memory).

mod common;

use std::time::{Duration, Instant};

use common::{connect_pair, loopback, wait_one, Loopback};
use gpudirect::{next_rkey, probe_window_range, AccessFlags, CompletionQueue, MemoryRegion, MemoryWindow, QpConfig, QueuePair, RemoteBuffer, SendWr, WcOpcode, WcStatus, WindowRange};

const TARGET: usize = 1 << 16;

fn target(lb: &Loopback) -> MemoryRegion {
    assert!(lb.pd.context().attr().mem_windows, "the device under test has no type-2 memory windows");
    MemoryRegion::alloc(&lb.pd, TARGET, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap()
}

/// Binds `w` on side b (whose peer is a) to `target[at..at + len]`.
fn bind(lb: &Loopback, w: &MemoryWindow, target: &MemoryRegion, at: usize, len: usize, rkey: u32) {
    lb.b.qp.post_send(&[SendWr::bind_window(w, target.slice(at..at + len).unwrap(), AccessFlags::REMOTE_WRITE, rkey).unwrap().wr_id(7)]).unwrap();
    let wc = wait_one(&lb.b.cq);
    assert_eq!((wc.status, wc.opcode, wc.wr_id), (WcStatus::Success, WcOpcode::BindWindow, 7), "{wc:?}");
}

/// Side a writes 16 bytes to `remote`; the completion's status.
fn write(lb: &Loopback, src: &MemoryRegion, remote: RemoteBuffer) -> WcStatus {
    write_from(&lb.a.qp, &lb.a.cq, src, remote)
}

/// 1 MiB, for the tests that read the process's pinned memory.
fn big_target(lb: &Loopback) -> MemoryRegion {
    assert!(lb.pd.context().attr().mem_windows, "the device under test has no type-2 memory windows");
    MemoryRegion::alloc(&lb.pd, 1 << 20, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND).unwrap()
}

fn write_from(qp: &QueuePair, cq: &CompletionQueue, src: &MemoryRegion, remote: RemoteBuffer) -> WcStatus {
    qp.post_send(&[SendWr::write(src.slice(0..16).unwrap(), &remote, 0).unwrap()]).unwrap();
    wait_one(cq).status
}

fn vm_pin_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    s.lines().find_map(|l| l.strip_prefix("VmPin:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).expect("VmPin")
}

fn source(lb: &Loopback) -> MemoryRegion {
    let src = MemoryRegion::alloc(&lb.pd, 64, AccessFlags::LOCAL_WRITE).unwrap();
    src.write_at(0, &[0x5a; 64]).unwrap();
    src
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_window_opens_its_range_until_invalidated() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (target(&lb), source(&lb));
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    assert_eq!(write(&lb, &src, RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key }), WcStatus::Success);
    let mut got = [0u8; 16];
    target.read_at(4096, &mut got).unwrap();
    assert_eq!(got, [0x5a; 16]);
    // Invalidated, then bound again elsewhere under the next key: the old
    // key opens nothing.
    lb.b.qp.post_send(&[SendWr::invalidate(key).wr_id(8)]).unwrap();
    let wc = wait_one(&lb.b.cq);
    assert_eq!((wc.status, wc.opcode), (WcStatus::Success, WcOpcode::LocalInvalidate), "{wc:?}");
    let key2 = next_rkey(key);
    bind(&lb, &w, &target, 8192, 16, key2);
    assert_eq!(write(&lb, &src, RemoteBuffer { addr: target.addr() + 8192, len: 16, rkey: key2 }), WcStatus::Success);
    assert_ne!(write(&lb, &src, RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key }), WcStatus::Success, "a stale key wrote");
}

/// What the probe says of the device is what a write past a window does.
#[test]
#[ignore = "needs an RDMA device"]
fn the_range_probe_says_what_the_device_does() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (target(&lb), source(&lb));
    let seen = probe_window_range(&lb.pd, &QpConfig::default(), std::time::Duration::from_secs(10)).unwrap();
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    let status = write(&lb, &src, RemoteBuffer { addr: target.addr() + 4096 + 8, len: 16, rkey: key });
    let mut past = [0u8; 8];
    target.read_at(4096 + 16, &mut past).unwrap();
    match seen {
        WindowRange::Enforced => assert!(status != WcStatus::Success && past == [0; 8], "the probe said enforced; the write past the window: {status:?}"),
        WindowRange::NotEnforced => assert!(status == WcStatus::Success && past == [0x5a; 8], "the probe said not enforced; the write past the window: {status:?}"),
    }
    println!("{}: a window's range is {seen:?}", lb.pd.context().name());
}

#[test]
#[ignore = "needs an RDMA device"]
fn the_regions_own_key_opens_nothing() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (target(&lb), source(&lb));
    assert_ne!(write(&lb, &src, RemoteBuffer { addr: target.addr(), len: 16, rkey: target.rkey() }), WcStatus::Success);
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_window_opens_nothing_to_another_queue_pair() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (target(&lb), source(&lb));
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    // A second connected pair in the same protection domain.
    let ctx = lb.pd.context();
    let (cq_c, cq_d) = (CompletionQueue::new(ctx, 256).unwrap(), CompletionQueue::new(ctx, 256).unwrap());
    let config = QpConfig::default();
    let (c, _d) = connect_pair(QueuePair::create(&lb.pd, &cq_c, &cq_c, &config).unwrap(), QueuePair::create(&lb.pd, &cq_d, &cq_d, &config).unwrap());
    c.post_send(&[SendWr::write(src.slice(0..16).unwrap(), &RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key }, 0).unwrap()]).unwrap();
    assert_ne!(wait_one(&cq_c).status, WcStatus::Success, "another queue pair used the window's key");
}

#[test]
#[ignore = "needs an RDMA device"]
fn binds_are_refused_before_posting() {
    let lb = loopback(&QpConfig::default());
    let target = target(&lb);
    let plain = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    let err = |r: gpudirect::Result<SendWr<'_>>| r.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err(SendWr::bind_window(&w, plain.slice(0..16).unwrap(), AccessFlags::REMOTE_WRITE, key)).contains("MW_BIND"));
    assert!(err(SendWr::bind_window(&w, target.slice(0..16).unwrap(), AccessFlags::LOCAL_WRITE, key)).contains("remote write, read or atomic"));
    assert!(err(SendWr::bind_window(&w, target.slice(0..0).unwrap(), AccessFlags::REMOTE_WRITE, key)).contains("no bytes"));
    let other = gpudirect::ProtectionDomain::new(ctx_of(&lb)).unwrap();
    let foreign = MemoryWindow::alloc(&other).unwrap();
    assert!(err(SendWr::bind_window(&foreign, target.slice(0..16).unwrap(), AccessFlags::REMOTE_WRITE, key)).contains("different protection domains"));
}

fn ctx_of(lb: &Loopback) -> &gpudirect::Context {
    lb.pd.context()
}

/// A type-2 window opens its range to the peer of the queue pair the bind
/// was posted on only: another connection of the same protection domain
/// (another comm's, were comms to share one) gets nothing with its key.
#[test]
#[ignore = "needs an RDMA device"]
fn a_window_key_through_another_qp_of_the_same_pd_opens_nothing() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (big_target(&lb), source(&lb));
    let ctx = lb.pd.context();
    let (cq_c, cq_d) = (CompletionQueue::new(ctx, 256).unwrap(), CompletionQueue::new(ctx, 256).unwrap());
    let (c, _d) = connect_pair(
        QueuePair::create(&lb.pd, &cq_c, &cq_c, &QpConfig::default()).unwrap(),
        QueuePair::create(&lb.pd, &cq_d, &cq_d, &QpConfig::default()).unwrap(),
    );
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    let status = write_from(&c, &cq_c, &src, RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key });
    let mut got = [0u8; 16];
    target.read_at(4096, &mut got).unwrap();
    assert!(status != WcStatus::Success && got == [0; 16], "a write through another queue pair of the same domain with the window's key: {status:?}, bytes {got:02x?}");
    // The window's own peer still reaches it.
    assert_eq!(write_from(&lb.a.qp, &lb.a.cq, &src, RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key }), WcStatus::Success);
}

/// Deallocating a bound window closes its key.
#[test]
#[ignore = "needs an RDMA device"]
fn a_dropped_window_key_opens_nothing() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (big_target(&lb), source(&lb));
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    drop(w);
    let status = write_from(&lb.a.qp, &lb.a.cq, &src, RemoteBuffer { addr: target.addr() + 4096, len: 16, rkey: key });
    assert_ne!(status, WcStatus::Success, "a write with a deallocated window's key");
}

/// `bind_window` says its key "must be next_rkey of the window's last
/// key" and "a key from an earlier bind opens nothing once the window is
/// bound again"; the library knows the window's last key (it records it
/// at each post). A rebind under the key the last bind gave must be
/// refused, or a holder of the old key opens the new range.
#[test]
#[ignore = "needs an RDMA device"]
fn a_rebind_under_the_last_key_is_refused() {
    let lb = loopback(&QpConfig::default());
    let (target, src) = (big_target(&lb), source(&lb));
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    let key = next_rkey(w.initial_rkey());
    bind(&lb, &w, &target, 4096, 16, key);
    lb.b.qp.post_send(&[SendWr::invalidate(key).wr_id(8)]).unwrap();
    assert_eq!(wait_one(&lb.b.cq).status, WcStatus::Success);
    // The same key again, for another range (another receive): refused
    // before anything is posted, so the old key's holder gets nothing.
    let err = SendWr::bind_window(&w, target.slice(8192..8208).unwrap(), AccessFlags::REMOTE_WRITE, key).expect_err("a rebind under the last key was accepted");
    assert!(err.to_string().contains("the window's next key"), "{err}");
    // Under the next key the rebind goes, and the old key opens nothing.
    bind(&lb, &w, &target, 8192, 16, next_rkey(key));
    assert_ne!(write_from(&lb.a.qp, &lb.a.cq, &src, RemoteBuffer { addr: target.addr() + 8192, len: 16, rkey: key }), WcStatus::Success);
}

/// A region dropped while a window is bound to it (what NCCL's deregMr
/// does to a receive still posted): the provider refuses the
/// deregistration and the library leaks the region. Once the window is
/// gone too, the region's pages must not stay pinned for good.
#[test]
#[ignore = "needs an RDMA device"]
fn a_region_dropped_under_a_bound_window_is_not_pinned_for_good() {
    let lb = loopback(&QpConfig::default());
    let before = vm_pin_kib();
    for _ in 0..4 {
        let target = big_target(&lb);
        let w = MemoryWindow::alloc(&lb.pd).unwrap();
        bind(&lb, &w, &target, 4096, 16, next_rkey(w.initial_rkey()));
        drop(target);
        drop(w);
    }
    let after = vm_pin_kib();
    assert!(after < before + 2048, "4 regions of 1 MiB dropped under bound windows, the windows then dropped: VmPin {before} kB -> {after} kB");
}

/// A queue pair whose windows were dropped first (the order the library
/// documents: a window still bound would hold the queue pair's
/// destruction) is destroyed at once.
#[test]
#[ignore = "needs an RDMA device"]
fn a_queue_pair_dropped_after_its_windows_returns_promptly() {
    let lb = loopback(&QpConfig::default());
    let target = big_target(&lb);
    let w = MemoryWindow::alloc(&lb.pd).unwrap();
    bind(&lb, &w, &target, 4096, 16, next_rkey(w.initial_rkey()));
    let Loopback { pd: _pd, a: _a, b } = lb;
    drop(w);
    let t = Instant::now();
    drop(b);
    let took = t.elapsed();
    assert!(took < Duration::from_secs(5), "dropping a queue pair after its window took {took:?}");
}
