//! Integration tests against a real RDMA device (Soft-RoCE in the test
//! bed, or any NIC). They are ignored by default; run them with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test rxe -- --ignored
//! ```
//!
//! or let `testbed/run` boot a guest with rxe and run them inside.

mod common;

use std::time::Duration;

use common::{loopback, wait_one};
use testkit::{device, open_fds, pattern};

use gpudirect::{
    AccessFlags, CompletionQueue, Context, Error, GidType, LinkLayer, MemoryRegion, PortState, ProtectionDomain,
    QpConfig, QpState, QueuePair, RecvWr, SendList, SendWr, WcOpcode, WcStatus, WorkCompletion,
};


#[test]
#[ignore = "needs an RDMA device"]
fn open_and_query_device_port_and_gid() {
    let name = device();
    let listed = gpudirect::devices().unwrap();
    assert!(listed.iter().any(|d| d.name == name), "{name} not in {listed:?}");
    let ctx = Context::open(Some(&name)).unwrap();
    assert_eq!(ctx.name(), name);
    assert!(ctx.attr().phys_port_cnt >= 1);
    assert!(ctx.attr().max_qp_wr > 0 && ctx.attr().max_cqe > 0);
    let port = ctx.query_port(1).unwrap();
    assert_eq!(port.state, PortState::Active, "{port:?}");
    assert!(port.active_mtu.is_some());
    let table = ctx.gid_table(1).unwrap();
    assert!(!table.is_empty());
    let choice = ctx.choose_gid(1, None).unwrap();
    assert!(table.contains(&choice.entry));
    if port.link_layer == LinkLayer::Ethernet {
        assert_eq!(choice.entry.gid_type, GidType::RoceV2, "{choice}");
        if table.iter().any(|e| e.gid_type == GidType::RoceV2 && e.gid.is_ipv4_mapped()) {
            assert!(choice.entry.gid.is_ipv4_mapped(), "{choice}");
        }
    }
    eprintln!("{name}: {port:?}; chose {choice}");
    // An override outside the table is refused, naming the table.
    let e = ctx.choose_gid(1, Some(250)).unwrap_err();
    assert!(e.to_string().contains("GID index 250 is not a valid entry"), "{e}");
    assert!(matches!(ctx.query_port(9), Err(Error::InvalidPort { port: 9, .. })));
    match Context::open(Some("no_such_dev")) {
        Err(Error::DeviceNotFound { available, .. }) => assert!(available.contains(&name)),
        other => panic!("expected DeviceNotFound, got {other:?}"),
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn register_and_deregister_memory_regions() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let mut keys = Vec::new();
    for len in [1, 4096, 65536, 1 << 20, 16 << 20] {
        let mr = MemoryRegion::alloc(&pd, len, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
        assert_eq!(mr.len(), len);
        assert_eq!(mr.addr() % 4096, 0);
        assert!(mr.access().contains(AccessFlags::LOCAL_WRITE), "LOCAL_WRITE is implied by REMOTE_WRITE");
        mr.write_at(len - 1, &[7]).unwrap();
        let mut b = [0];
        mr.read_at(len - 1, &mut b).unwrap();
        assert_eq!(b, [7]);
        keys.push(mr.lkey());
    }
    // Caller-owned memory: a Vec is moved in and kept for the region's life.
    let v = pattern(10_000, 3);
    let mr = MemoryRegion::register(&pd, v.clone(), AccessFlags::default()).unwrap();
    assert_eq!(mr.to_vec().unwrap(), v);
    assert_eq!(mr.access(), AccessFlags::LOCAL_WRITE);
    // Memory the caller maps itself.
    let len = 8192;
    // SAFETY: anonymous private mapping; unmapped below after the region is gone.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    // SAFETY: the mapping outlives the region (dropped before munmap) and
    // is only accessed through it.
    let raw = unsafe { MemoryRegion::register_raw(&pd, p.cast(), len, AccessFlags::default()) }.unwrap();
    raw.write_at(0, b"mapped").unwrap();
    drop(raw);
    // SAFETY: mapping made above, no region refers to it any more.
    unsafe { libc::munmap(p, len) };
    // Out-of-range access is an error, not a panic.
    assert!(matches!(mr.write_at(9_999, &[1, 2]), Err(Error::OutOfBounds { .. })));
    assert!(matches!(mr.slice(0..10_001), Err(Error::OutOfBounds { .. })));
}

#[test]
#[ignore = "needs an RDMA device"]
fn rdma_write_then_read_back() {
    let lb = loopback(&QpConfig::default());
    let src = MemoryRegion::alloc(&lb.pd, 65536, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 65536, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let back = MemoryRegion::alloc(&lb.pd, 65536, AccessFlags::LOCAL_WRITE).unwrap();
    let data = pattern(65536, 1);
    src.write_at(0, &data).unwrap();
    let remote = dst.remote();

    lb.a.qp.post_send(&[SendWr::write(src.slice(..).unwrap(), &remote, 0).unwrap().wr_id(11)]).unwrap();
    let wc = wait_one(&lb.a.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.opcode), (11, WcOpcode::RdmaWrite));
    assert_eq!(dst.to_vec().unwrap(), data);

    // Read the middle back into another region at an offset.
    lb.a.qp.post_send(&[SendWr::read(back.slice(100..4196).unwrap(), &remote, 1000).unwrap().wr_id(12)]).unwrap();
    // Until its completion is reaped, the destination may not be read.
    assert!(matches!(back.read_at(100, &mut [0; 8]), Err(Error::Busy { .. })));
    let wc = wait_one(&lb.a.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.opcode, wc.byte_len), (12, WcOpcode::RdmaRead, 4096));
    let mut got = vec![0; 4096];
    back.read_at(100, &mut got).unwrap();
    assert_eq!(got, &data[1000..5096]);

    // A range outside the peer's buffer is refused before posting.
    let e = SendWr::write(src.slice(0..4096).unwrap(), &remote, 65536 - 100).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { what: "remote buffer", .. }), "{e}");
}

#[test]
#[ignore = "needs an RDMA device"]
fn write_with_immediate_notifies_the_receiver() {
    let lb = loopback(&QpConfig::default());
    let src = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::REMOTE_WRITE).unwrap();
    // Registering nothing is refused with a clear error, not EINVAL.
    let e = MemoryRegion::alloc(&lb.pd, 0, AccessFlags::default()).unwrap_err();
    assert!(e.to_string().contains("cannot be empty"), "{e}");
    let data = pattern(5000, 9);
    src.write_at(0, &data).unwrap();
    // A write with immediate consumes a receive but puts no bytes in it.
    lb.b.qp.post_recv(&[RecvWr::new(dst.slice(0..0).unwrap()).wr_id(77)]).unwrap();
    lb.a.qp
        .post_send(&[SendWr::write_with_imm(src.slice(0..5000).unwrap(), &dst.remote(), 3000, 0xdead_beef).unwrap()])
        .unwrap();
    let wc = wait_one(&lb.b.cq).ok().unwrap();
    assert_eq!(wc.wr_id, 77);
    assert_eq!(wc.opcode, WcOpcode::RecvRdmaWithImm);
    assert_eq!(wc.imm, Some(0xdead_beef));
    assert_eq!(wc.byte_len, 5000);
    let mut got = vec![0; 5000];
    dst.read_at(3000, &mut got).unwrap();
    assert_eq!(got, data);
    wait_one(&lb.a.cq).ok().unwrap();
}

#[test]
#[ignore = "needs an RDMA device"]
fn send_and_receive_with_and_without_immediate() {
    let lb = loopback(&QpConfig { max_inline_data: 64, ..QpConfig::default() });
    let src = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::default()).unwrap();
    lb.b.qp
        .post_recv(&[RecvWr::new(dst.slice(0..4096).unwrap()).wr_id(1), RecvWr::new(dst.slice(4096..).unwrap()).wr_id(2)])
        .unwrap();
    // The receive buffers are the NIC's until their completions are reaped.
    assert!(matches!(dst.read_at(0, &mut [0; 4]), Err(Error::Busy { .. })));
    let msg = pattern(3000, 5);
    src.write_at(0, &msg).unwrap();
    lb.a.qp.post_send(&[SendWr::send(src.slice(0..3000).unwrap()).wr_id(10)]).unwrap();
    // The send's source may be read but not overwritten while in flight.
    let mut peek = [0; 4];
    src.read_at(0, &mut peek).unwrap();
    assert!(matches!(src.write_at(0, &[0; 4]), Err(Error::Busy { .. })));
    let wc = wait_one(&lb.b.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.opcode, wc.byte_len, wc.imm), (1, WcOpcode::Recv, 3000, None));
    let mut got = vec![0; 3000];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, msg);
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().opcode, WcOpcode::Send);
    src.write_at(0, &[0; 4]).unwrap();

    // Inline small send with immediate: the source is free right after posting.
    src.write_at(0, b"hello, inline").unwrap();
    lb.a.qp.post_send(&[SendWr::send_with_imm(src.slice(0..13).unwrap(), 42).inline().wr_id(11)]).unwrap();
    src.write_at(0, b"overwritten!!").unwrap();
    let wc = wait_one(&lb.b.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.byte_len, wc.imm), (2, 13, Some(42)));
    let mut got = [0; 13];
    dst.read_at(4096, &mut got).unwrap();
    assert_eq!(&got, b"hello, inline");
    wait_one(&lb.a.cq).ok().unwrap();
    // Inline beyond the queue pair's limit is refused before posting.
    let e = lb.a.qp.post_send(&[SendWr::send(src.slice(0..4096).unwrap()).inline()]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
}

/// Atomics on a remote word: fetch-and-add returns the word before each
/// add (in order on one queue pair) and the sum is exact; compare-and-swap
/// swaps only on a match; misaligned words, results that are not 8 bytes,
/// out-of-bounds words and a region without REMOTE_ATOMIC are refused
/// (the first three before posting, the last by the peer).
#[test]
#[ignore = "needs an RDMA device"]
fn atomics_fetch_add_and_compare_swap_are_exact() {
    let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
    let lb = loopback(&QpConfig { access, ..QpConfig::default() });
    assert!(lb.pd.context().attr().atomics, "{} does no atomics", lb.pd.context().name());
    let target = MemoryRegion::alloc(&lb.pd, 64, AccessFlags::REMOTE_ATOMIC).unwrap();
    let results = MemoryRegion::alloc(&lb.pd, 8 * 128, AccessFlags::default()).unwrap();
    target.write_at(8, &1000u64.to_ne_bytes()).unwrap();
    let remote = target.remote();
    // 100 adds of 3, unsignaled but the last; each result in its own slot.
    let wrs: Vec<SendWr> = (0..100)
        .map(|i| {
            let wr = SendWr::fetch_add(results.slice(8 * i..8 * i + 8).unwrap(), &remote, 8, 3).unwrap().wr_id(i as u64);
            if i == 99 { wr } else { wr.unsignaled() }
        })
        .collect();
    lb.a.qp.post_send(&wrs).unwrap();
    let wc = wait_one(&lb.a.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.opcode), (99, WcOpcode::FetchAdd));
    let mut word = [0u8; 8];
    for i in 0..100 {
        results.read_at(8 * i, &mut word).unwrap();
        assert_eq!(u64::from_ne_bytes(word), 1000 + 3 * i as u64, "result {i}");
    }
    target.read_at(8, &mut word).unwrap();
    assert_eq!(u64::from_ne_bytes(word), 1300);
    // Compare-and-swap: a match swaps, a mismatch leaves the word.
    let r = results.slice(800..808).unwrap();
    for (compare, swap, before, after) in [(1300, 7, 1300, 7), (1300, 9, 7, 7), (7, u64::MAX, 7, u64::MAX)] {
        lb.a.qp.post_send(&[SendWr::compare_swap(r, &remote, 8, compare, swap).unwrap()]).unwrap();
        assert_eq!(wait_one(&lb.a.cq).ok().unwrap().opcode, WcOpcode::CompareSwap);
        results.read_at(800, &mut word).unwrap();
        assert_eq!(u64::from_ne_bytes(word), before);
        target.read_at(8, &mut word).unwrap();
        assert_eq!(u64::from_ne_bytes(word), after);
    }
    // Refused before posting.
    let bad = [
        SendWr::fetch_add(r, &remote, 4, 1).err(),
        SendWr::fetch_add(results.slice(0..4).unwrap(), &remote, 8, 1).err(),
        SendWr::compare_swap(r, &remote, 64, 0, 1).err(),
    ];
    assert!(matches!(bad[0], Some(Error::InvalidArgument(ref m)) if m.contains("aligned")), "{bad:?}");
    assert!(matches!(bad[1], Some(Error::InvalidArgument(ref m)) if m.contains("8-byte word")), "{bad:?}");
    assert!(matches!(bad[2], Some(Error::OutOfBounds { .. })), "{bad:?}");
    let inline = lb.a.qp.post_send(&[SendWr::fetch_add(r, &remote, 8, 1).unwrap().inline()]);
    assert!(matches!(inline, Err(Error::InvalidArgument(ref m)) if m.contains("cannot be inline")), "{inline:?}");
    // A region without REMOTE_ATOMIC: the peer refuses.
    let plain = MemoryRegion::alloc(&lb.pd, 64, AccessFlags::REMOTE_WRITE).unwrap();
    lb.a.qp.post_send(&[SendWr::fetch_add(r, &plain.remote(), 0, 1).unwrap()]).unwrap();
    let e = wait_one(&lb.a.cq).ok().unwrap_err();
    assert!(matches!(e.status, WcStatus::RemoteAccessError | WcStatus::RemoteInvalidRequestError), "{e}");
}

/// A send to a peer that never posts a receive fails within a bound under
/// the default `QpConfig` (rnr_retry 6, never "forever"), and the error
/// names the missing receive. Measured on rxe: RNR_RETRY_EXC after 318 ms;
/// with rnr_retry 7 rxe ends such a send in RETRY_EXC instead (680 ms),
/// whose hint names the missing receive too.
#[test]
#[ignore = "needs an RDMA device"]
fn a_send_without_a_posted_receive_fails_within_a_bound() {
    let lb = loopback(&QpConfig::default());
    let src = MemoryRegion::alloc(&lb.pd, 64, AccessFlags::default()).unwrap();
    let start = std::time::Instant::now();
    lb.a.qp.post_send(&[SendWr::send(src.slice(0..64).unwrap()).wr_id(7)]).unwrap();
    let e = wait_one(&lb.a.cq).ok().unwrap_err();
    let elapsed = start.elapsed();
    println!("{} after {elapsed:?}: {e}", e.status);
    assert!(matches!(e.status, WcStatus::RnrRetryExceeded | WcStatus::RetryExceeded), "{e}");
    assert_eq!(e.wr_id, 7);
    assert!(e.to_string().contains("no receive posted"), "{e}");
    assert!(elapsed < std::time::Duration::from_secs(10), "took {elapsed:?}");
}

#[test]
#[ignore = "needs an RDMA device"]
fn batch_of_unsignaled_writes_with_one_signaled() {
    let lb = loopback(&QpConfig { max_send_wr: 32, ..QpConfig::default() });
    let chunk = 1024;
    let n = 16;
    let src = MemoryRegion::alloc(&lb.pd, chunk * n, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, chunk * n, AccessFlags::REMOTE_WRITE).unwrap();
    let data = pattern(chunk * n, 77);
    src.write_at(0, &data).unwrap();
    let remote = dst.remote();
    let wrs: Vec<_> = (0..n)
        .map(|i| {
            let wr = SendWr::write(src.slice(i * chunk..(i + 1) * chunk).unwrap(), &remote, (i * chunk) as u64)
                .unwrap()
                .wr_id(i as u64);
            if i + 1 == n { wr } else { wr.unsignaled() }
        })
        .collect();
    lb.a.qp.post_send(&wrs).unwrap();
    // Every chunk, unsignaled ones included, stays held until the signaled
    // completion is reaped.
    assert!(matches!(src.write_at(0, &[1]), Err(Error::Busy { .. })));
    let wc = wait_one(&lb.a.cq).ok().unwrap();
    assert_eq!(wc.wr_id, (n - 1) as u64);
    let mut more = [WorkCompletion::default(); 4];
    assert_eq!(lb.a.cq.poll(&mut more).unwrap(), 0, "unsignaled writes must not complete");
    src.write_at(0, &[1]).unwrap();
    assert_eq!(dst.to_vec().unwrap(), data);

    // More outstanding requests than the queue holds are refused up front.
    let small = src.slice(0..8).unwrap();
    let many: Vec<_> = (0..33).map(|_| SendWr::write(small, &remote, 0).unwrap().unsignaled()).collect();
    assert!(matches!(lb.a.qp.post_send(&many), Err(Error::QueueFull { queue: "send", depth: 32 })));
}

#[test]
#[ignore = "needs an RDMA device"]
fn wait_times_out_when_nothing_completes() {
    let lb = loopback(&QpConfig::default());
    let mut wc = [WorkCompletion::default(); 1];
    let start = std::time::Instant::now();
    assert!(matches!(lb.a.cq.wait(&mut wc, Some(Duration::from_millis(200))), Err(Error::Timeout(_))));
    assert!(start.elapsed() >= Duration::from_millis(200));
}

fn expect_remote_access_error(target_access: AccessFlags, wrong_rkey: bool) {
    let lb = loopback(&QpConfig::default());
    let src = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 4096, target_access).unwrap();
    src.write_at(0, &pattern(4096, 1)).unwrap();
    let mut remote = dst.remote();
    if wrong_rkey {
        remote.rkey ^= 0x5a5a00;
    }
    lb.a.qp.post_send(&[SendWr::write(src.slice(..).unwrap(), &remote, 0).unwrap().wr_id(5)]).unwrap();
    let wc = wait_one(&lb.a.cq);
    let err = wc.ok().unwrap_err();
    assert_eq!(err.status, WcStatus::RemoteAccessError, "{err}");
    assert_eq!((err.wr_id, err.opcode), (5, WcOpcode::RdmaWrite));
    assert!(err.to_string().contains("IBV_WC_REM_ACCESS_ERR (RemoteAccessError)"), "{err}");
    // The target's memory is untouched and the initiator's QP is in error.
    assert_eq!(dst.to_vec().unwrap(), vec![0; 4096]);
    assert_eq!(lb.a.qp.state().unwrap(), QpState::Error);
}

#[test]
#[ignore = "needs an RDMA device"]
fn write_without_remote_write_permission_is_a_remote_access_error() {
    expect_remote_access_error(AccessFlags::REMOTE_READ, false);
}

#[test]
#[ignore = "needs an RDMA device"]
fn write_with_wrong_rkey_is_a_remote_access_error() {
    expect_remote_access_error(AccessFlags::REMOTE_WRITE, true);
}

/// Kernel objects of `device()` as `rdma resource show` counts them
/// (every process's; the guest runs only this test).
fn kernel_objects() -> std::collections::BTreeMap<String, u64> {
    let out = ["rdma", "/usr/bin/rdma", "/sbin/rdma", "/usr/sbin/rdma"]
        .iter()
        .find_map(|bin| std::process::Command::new(bin).args(["-j", "resource", "show"]).output().ok())
        .expect("iproute2's `rdma` tool is needed to count kernel objects");
    assert!(out.status.success(), "rdma resource show: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let dev = v
        .as_array()
        .and_then(|a| a.iter().find(|d| d["ifname"] == device().as_str()))
        .unwrap_or_else(|| panic!("{} not in `rdma resource show`: {v}", device()));
    let counts: std::collections::BTreeMap<String, u64> = ["pd", "cq", "qp", "mr", "ctx"]
        .iter()
        .filter_map(|k| dev[*k].as_u64().map(|n| (k.to_string(), n)))
        .collect();
    assert!(counts.contains_key("pd") && counts.contains_key("qp"), "no counts in {dev}");
    counts
}


/// All permutations of `0..n` (Heap's algorithm).
fn permutations(n: usize) -> Vec<Vec<usize>> {
    fn heap(k: usize, a: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if k <= 1 {
            out.push(a.clone());
            return;
        }
        for i in 0..k - 1 {
            heap(k - 1, a, out);
            let j = if k.is_multiple_of(2) { i } else { 0 };
            a.swap(j, k - 1);
        }
        heap(k - 1, a, out);
    }
    let mut out = Vec::new();
    heap(n, &mut (0..n).collect(), &mut out);
    out
}

/// Every order of dropping {context, protection domain, completion queue,
/// queue pair, memory region}, idle and with work requests in flight (a
/// posted receive that never completes, and an RDMA write whose completion
/// is never reaped): nothing crashes, and after the last handle goes the
/// kernel objects (`rdma resource show`: pd, cq, qp, mr, ctx) and this
/// process's open file descriptors are back to where they started.
///
/// `GPUDIRECT_DROP_ORDER_STRIDE=k` runs every k-th order only (for slow
/// runs under valgrind, see `testbed/sanitize`); the default is all 120.
#[test]
#[ignore = "needs an RDMA device"]
fn objects_drop_in_any_order_without_leaks() {
    const NAMES: [&str; 5] = ["context", "pd", "cq", "qp", "mr"];
    let orders = permutations(NAMES.len());
    assert_eq!(orders.len(), 120);
    let stride: usize = std::env::var("GPUDIRECT_DROP_ORDER_STRIDE").map_or(1, |s| s.parse().expect("GPUDIRECT_DROP_ORDER_STRIDE: a number"));
    let base_objects = kernel_objects();
    let base_fds = open_fds();
    let mut runs = 0;
    for in_flight in [false, true] {
        for order in orders.iter().step_by(stride.max(1)) {
            let ctx = Context::open(Some(&device())).unwrap();
            let pd = ProtectionDomain::new(&ctx).unwrap();
            let cq = CompletionQueue::new(&ctx, 256).unwrap();
            let mr = MemoryRegion::alloc(&pd, 8192, AccessFlags::REMOTE_WRITE).unwrap();
            let prepared = QueuePair::create(&pd, &cq, &cq, &QpConfig::default()).unwrap();
            // Connected to itself: a write lands in our own region.
            let ep = prepared.endpoint();
            let qp = prepared.connect(&ep).unwrap();
            let mut during = kernel_objects();
            for k in ["pd", "cq", "qp", "mr", "ctx"] {
                if let (Some(d), Some(b)) = (during.remove(k), base_objects.get(k)) {
                    assert!(d > *b, "{k}: {d} while alive, {b} at the start: the count does not see our objects");
                }
            }
            if in_flight {
                qp.post_recv(&[RecvWr::new(mr.slice(0..4096).unwrap()).wr_id(1)]).unwrap();
                qp.post_send(&[SendWr::write(mr.slice(4096..8192).unwrap(), &mr.remote(), 0).unwrap().wr_id(2)]).unwrap();
                // The write's range is held until its completion is reaped:
                // the region refuses a local write there meanwhile (or the
                // write already completed, and only the receive holds).
                assert!(matches!(mr.write_at(0, &[1]), Err(Error::Busy { .. })), "the posted receive does not hold its range");
            }
            let mut slots = (Some(ctx), Some(pd), Some(cq), Some(qp), Some(mr));
            for &i in order {
                match i {
                    0 => drop(slots.0.take()),
                    1 => drop(slots.1.take()),
                    2 => drop(slots.2.take()),
                    3 => drop(slots.3.take()),
                    _ => drop(slots.4.take()),
                }
            }
            let after = kernel_objects();
            let order_names: Vec<_> = order.iter().map(|&i| NAMES[i]).collect();
            assert_eq!(after, base_objects, "kernel objects leaked after dropping in order {order_names:?} (in flight: {in_flight})");
            assert_eq!(open_fds(), base_fds, "file descriptors leaked after dropping in order {order_names:?} (in flight: {in_flight})");
            runs += 1;
        }
    }
    assert_eq!(runs, 2 * orders.len().div_ceil(stride.max(1)));
    eprintln!(
        "drop orders: {runs} runs ({} of the 120 orders, idle and in flight); kernel objects back to {base_objects:?}, {base_fds} fds",
        runs / 2
    );
}

#[test]
#[ignore = "needs an RDMA device"]
fn gpudirect_facts_name_the_provider_without_dma_buf() {
    use gpudirect::gdr::{plan, Cause, DmaBufProbe, GdrError, GdrFacts};
    use gpudirect::sysroot::SysRoot;
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let facts = GdrFacts::gather(&pd, 0, &SysRoot::live());
    eprintln!("{facts:#?}");
    if device().starts_with("rxe") {
        // The real probe: Soft-RoCE cannot register dma-buf memory.
        assert_eq!(facts.nic.dma_buf, DmaBufProbe::Unsupported(gpudirect::Errno(libc::EOPNOTSUPP)));
        let p = plan(&facts);
        assert!(!p.try_paths.contains(&gpudirect::RegistrationPath::DmaBuf));
        assert!(p.causes.contains(&Cause::NicWithoutDmaBuf(gpudirect::Errno(libc::EOPNOTSUPP))));
        let e = GdrError { facts, causes: p.causes };
        let s = e.to_string();
        eprintln!("{s}");
        assert!(s.contains("rxe0: ibv_reg_dmabuf_mr(fd = -1) probe answered EOPNOTSUPP (Operation not supported)"), "{s}");
    } else {
        // A real NIC answers the probe one way or the other; either is a fact.
        assert!(matches!(facts.nic.dma_buf, DmaBufProbe::Supported(_) | DmaBufProbe::Unsupported(_)));
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn completion_queue_too_small_for_its_queue_pairs_is_refused() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let config = QpConfig { max_send_wr: 32, max_recv_wr: 32, ..QpConfig::default() };
    let first = QueuePair::create(&pd, &cq, &cq, &config).unwrap();
    // A second queue pair would need 128 entries of a 64-entry queue.
    let e = QueuePair::create(&pd, &cq, &cq, &config).unwrap_err();
    assert!(matches!(e, Error::CqTooSmall { depth: 64, needed: 96 }), "{e:?}");
    assert!(e.to_string().contains("create it with at least 96 entries"), "{e}");
    // Destroying the first gives its room back.
    drop(first);
    QueuePair::create(&pd, &cq, &cq, &config).unwrap();
}

#[test]
#[ignore = "needs an RDMA device"]
fn send_list_is_posted_again_and_again() {
    let lb = loopback(&QpConfig { max_send_wr: 32, max_inline_data: 64, ..QpConfig::default() });
    let chunk = 1024;
    let src = MemoryRegion::alloc(&lb.pd, 4 * chunk, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 4 * chunk, AccessFlags::REMOTE_WRITE).unwrap();
    let remote = dst.remote();
    let wrs: Vec<_> = (0..4)
        .map(|i| {
            let wr = SendWr::write(src.slice(i * chunk..(i + 1) * chunk).unwrap(), &remote, (i * chunk) as u64).unwrap();
            if i == 3 { wr } else { wr.unsignaled() }
        })
        .collect();
    let mut list = SendList::new(&wrs).unwrap();
    assert_eq!(list.len(), 4);
    for round in 0..5u64 {
        let data = pattern(4 * chunk, round);
        // Free again: the previous post's completion was reaped.
        src.write_at(0, &data).unwrap();
        list.set_wr_id(3, 100 + round).unwrap();
        lb.a.qp.post_list(&mut list).unwrap();
        // Every request's source is held, unsignaled ones included.
        assert!(matches!(src.write_at(0, &[0; 4]), Err(Error::Busy { .. })));
        let wc = wait_one(&lb.a.cq).ok().unwrap();
        assert_eq!((wc.wr_id, wc.opcode), (100 + round, WcOpcode::RdmaWrite));
        let mut got = vec![0; 4 * chunk];
        dst.read_at(0, &mut got).unwrap();
        assert_eq!(got, data, "round {round}");
    }

    // Posted again before the first post completed: each post's requests
    // complete on their own, in order; a second signaled request reports too.
    list.set_signaled(1, true).unwrap();
    list.set_wr_id(1, 7).unwrap();
    list.set_wr_id(3, 8).unwrap();
    lb.a.qp.post_list(&mut list).unwrap();
    list.set_wr_id(3, 9).unwrap();
    lb.a.qp.post_list(&mut list).unwrap();
    let ids: Vec<u64> = (0..4).map(|_| wait_one(&lb.a.cq).ok().unwrap().wr_id).collect();
    assert_eq!(ids, [7, 8, 7, 9]);
    src.write_at(0, &[0; 4]).unwrap();

    // The queue's room is checked for the whole list: 8 posts fill 32.
    for _ in 0..8 {
        lb.a.qp.post_list(&mut list).unwrap();
    }
    assert!(matches!(lb.a.qp.post_list(&mut list), Err(Error::QueueFull { queue: "send", depth: 32 })));
    for _ in 0..16 {
        wait_one(&lb.a.cq).ok().unwrap();
    }
    assert!(matches!(list.set_wr_id(4, 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(list.set_signaled(9, true), Err(Error::InvalidArgument(_))));

}

#[test]
#[ignore = "needs an RDMA device"]
fn send_list_refuses_what_post_send_refuses() {
    let lb = loopback(&QpConfig { max_inline_data: 64, ..QpConfig::default() });
    let src = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::REMOTE_WRITE).unwrap();
    let remote = dst.remote();
    let other_pd = ProtectionDomain::new(lb.pd.context()).unwrap();
    let foreign = MemoryRegion::alloc(&other_pd, 4096, AccessFlags::LOCAL_WRITE).unwrap();

    // Regions of two protection domains in one list.
    let mixed = [SendWr::send(src.slice(0..8).unwrap()), SendWr::send(foreign.slice(0..8).unwrap())];
    assert!(matches!(SendList::new(&mixed), Err(Error::ForeignMemoryRegion)));
    // A list of another domain's regions, posted here.
    let mut elsewhere = SendList::new(&[SendWr::write(foreign.slice(0..8).unwrap(), &remote, 0).unwrap()]).unwrap();
    assert!(matches!(lb.a.qp.post_list(&mut elsewhere), Err(Error::ForeignMemoryRegion)));
    // An inline RDMA read cannot be made; an inline payload over this queue
    // pair's limit is refused when posted.
    let read = SendWr::read(src.slice(0..8).unwrap(), &remote, 0).unwrap().inline();
    assert!(matches!(SendList::new(&[read]), Err(Error::InvalidArgument(_))));
    let mut long = SendList::new(&[SendWr::write(src.slice(0..100).unwrap(), &remote, 0).unwrap().inline()]).unwrap();
    assert!(matches!(lb.a.qp.post_list(&mut long), Err(Error::InvalidArgument(_))));
    // Within the limit, an inline list frees its source as soon as it is posted.
    src.write_at(0, b"inline list").unwrap();
    let mut short = SendList::new(&[SendWr::write(src.slice(0..11).unwrap(), &remote, 0).unwrap().inline().wr_id(3)]).unwrap();
    lb.a.qp.post_list(&mut short).unwrap();
    src.write_at(0, b"overwritten").unwrap();
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, 3);
    let mut got = [0; 11];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(&got, b"inline list");
    // An empty list posts nothing, anywhere.
    lb.a.qp.post_list(&mut SendList::new(&[]).unwrap()).unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(lb.a.cq.poll(&mut wc).unwrap(), 0);
}

/// Finding 7 of issue #11: when `ibv_dereg_mr` fails the region (and a
/// peer's rkey to it) may stay valid, so the memory behind it must not be
/// freed. The failure is injected (`gpudirect::fault`); the backing value's
/// `Drop` tells whether it was freed.
#[test]
#[ignore = "needs an RDMA device"]
fn a_failed_deregistration_leaks_the_memory_instead_of_freeing_it() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    struct Watched {
        bytes: Vec<u8>,
        freed: Arc<AtomicBool>,
    }
    impl Drop for Watched {
        fn drop(&mut self) {
            self.freed.store(true, Ordering::SeqCst);
        }
    }
    // SAFETY: the Vec's heap buffer stays put when the value moves, and
    // nothing but the region touches it.
    unsafe impl gpudirect::Registerable for Watched {
        fn as_mut_ptr(&mut self) -> *mut u8 {
            self.bytes.as_mut_ptr()
        }
        fn len(&self) -> usize {
            self.bytes.len()
        }
    }
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let register = |freed: &Arc<AtomicBool>| {
        MemoryRegion::register(&pd, Watched { bytes: vec![7; 8192], freed: freed.clone() }, AccessFlags::LOCAL_WRITE).unwrap()
    };
    // Control: a deregistration that succeeds frees the memory.
    let freed = Arc::new(AtomicBool::new(false));
    drop(register(&freed));
    assert!(freed.load(Ordering::SeqCst), "a deregistered region's memory is freed");
    // A deregistration that fails leaks it.
    let freed = Arc::new(AtomicBool::new(false));
    let mr = register(&freed);
    gpudirect::fault::fail_next_dereg_mr(1);
    drop(mr);
    assert!(!freed.load(Ordering::SeqCst), "memory the NIC may still reach was freed after a failed ibv_dereg_mr");
}
