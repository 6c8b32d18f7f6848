//! Type-2 memory windows on a real device: a window opens the range it
//! was bound to, to the peer of the queue pair the bind was posted on,
//! until it is invalidated; the region's own key and every other queue
//! pair get nothing; and whether the device bounds a window's range is
//! what `probe_window_range` says (Soft-RoCE in Linux 6.1 does not). Run
//! in the Soft-RoCE guest (rxe has type-2 windows).

mod common;

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
    lb.a.qp.post_send(&[SendWr::write(src.slice(0..16).unwrap(), &remote, 0).unwrap()]).unwrap();
    wait_one(&lb.a.cq).status
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
