//! Shared receive queues and async events against a real RDMA device
//! (Soft-RoCE in the test bed). Ignored by default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test srq -- --ignored
//! ```

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{connect_pair, device, wait_one};
use testkit::pattern;

use gpudirect::{
    AccessFlags, AsyncEvent, CompletionQueue, Context, Error, MemoryRegion, ProtectionDomain, QpConfig, QueuePair,
    RecvWr, SendWr, SharedReceiveQueue, SrqConfig, WcOpcode,
};

const PEERS: usize = 64;
const SLOTS: usize = 128;
const MSG: usize = 64;

/// 64 client queue pairs send to 64 server queue pairs that share one
/// receive queue of 128 receives: the server's receive memory and its
/// receive CQ are sized by the shared queue, not by the number of peers.
/// Every message lands whole in some receive, its completion names the
/// server queue pair it arrived on, and three rounds (receives reposted
/// as they complete) deliver every byte exactly. The limit event fires
/// once the posted receives drop below the armed limit.
#[test]
#[ignore = "needs an RDMA device"]
fn many_queue_pairs_share_one_receive_queue() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let config = QpConfig { max_send_wr: 4, max_recv_wr: 1, ..QpConfig::default() };
    let srq = SharedReceiveQueue::new(&pd, &SrqConfig { max_wr: SLOTS as u32, max_sge: 1 }).unwrap();
    let client_cq = CompletionQueue::new(&ctx, (PEERS * 5) as u32).unwrap();
    let server_send_cq = CompletionQueue::new(&ctx, (PEERS * 4) as u32).unwrap();
    // Room for the shared queue's receives once, for all 64 queue pairs.
    let server_recv_cq = CompletionQueue::new(&ctx, SLOTS as u32).unwrap();
    let mut clients = Vec::new();
    let mut by_qpn = HashMap::new();
    for i in 0..PEERS {
        let c = QueuePair::create(&pd, &client_cq, &client_cq, &config).unwrap();
        let s = QueuePair::create_with_srq(&pd, &server_send_cq, &server_recv_cq, &srq, &config).unwrap();
        let (c, s) = connect_pair(c, s);
        by_qpn.insert(s.endpoint().qp_num, (i, s));
        clients.push(c);
    }
    let (_, any) = by_qpn.values().next().unwrap();
    let e = any.post_recv(&[RecvWr::empty()]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("shared receive queue")), "{e}");

    let slots = MemoryRegion::alloc(&pd, SLOTS * MSG, AccessFlags::default()).unwrap();
    let src = MemoryRegion::alloc(&pd, PEERS * MSG, AccessFlags::default()).unwrap();
    let recvs: Vec<RecvWr> = (0..SLOTS).map(|k| RecvWr::new(slots.slice(k * MSG..(k + 1) * MSG).unwrap()).wr_id(k as u64)).collect();
    srq.post_recv(&recvs).unwrap();
    assert_eq!(srq.outstanding(), SLOTS);
    let e = srq.post_recv(&recvs[..1]).unwrap_err();
    assert!(matches!(e, Error::QueueFull { depth: 128, .. }), "{e}");
    srq.arm_limit(100).unwrap();

    for round in 0..3u64 {
        for i in 0..PEERS {
            src.write_at(i * MSG, &pattern(MSG, round * 1000 + i as u64)).unwrap();
        }
        for (i, c) in clients.iter().enumerate() {
            c.post_send(&[SendWr::send(src.slice(i * MSG..(i + 1) * MSG).unwrap()).wr_id(i as u64)]).unwrap();
        }
        let mut from = [false; PEERS];
        let mut refill = Vec::new();
        for _ in 0..PEERS {
            let wc = wait_one(&server_recv_cq).ok().unwrap();
            assert_eq!((wc.opcode, wc.byte_len as usize), (WcOpcode::Recv, MSG));
            let (i, _) = by_qpn[&wc.qp_num];
            assert!(!from[i], "round {round}: two messages from peer {i}");
            from[i] = true;
            let slot = wc.wr_id as usize;
            let mut got = vec![0; MSG];
            slots.read_at(slot * MSG, &mut got).unwrap();
            assert_eq!(got, pattern(MSG, round * 1000 + i as u64), "round {round}, peer {i}, slot {slot}");
            refill.push(recvs[slot]);
        }
        for _ in 0..PEERS {
            wait_one(&client_cq).ok().unwrap();
        }
        if round == 0 {
            assert_eq!(srq.outstanding(), SLOTS - PEERS);
            assert_eq!(ctx.async_event(Some(Duration::from_secs(10))).unwrap(), AsyncEvent::SrqLimitReached(srq.id()));
        }
        srq.post_recv(&refill).unwrap();
    }
    // The limit disarmed itself when it fired: no second event.
    assert!(matches!(ctx.async_event(Some(Duration::from_millis(200))), Err(Error::Timeout(_))));
}

/// What a shared receive queue cannot take is refused before posting.
#[test]
#[ignore = "needs an RDMA device"]
fn shared_receive_queue_limits_are_checked() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let a = ctx.attr();
    assert!(a.max_srq > 0, "{} has no SRQs", ctx.name());
    for config in [
        SrqConfig { max_wr: 0, max_sge: 1 },
        SrqConfig { max_wr: a.max_srq_wr + 1, max_sge: 1 },
        SrqConfig { max_wr: 16, max_sge: 0 },
        SrqConfig { max_wr: 16, max_sge: a.max_srq_sge + 1 },
    ] {
        let e = SharedReceiveQueue::new(&pd, &config).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)), "{config:?}: {e}");
    }
    let srq = SharedReceiveQueue::new(&pd, &SrqConfig { max_wr: 16, max_sge: 2 }).unwrap();
    let mr = MemoryRegion::alloc(&pd, 64, AccessFlags::default()).unwrap();
    let three = [mr.slice(0..8).unwrap(), mr.slice(16..24).unwrap(), mr.slice(32..40).unwrap()];
    let e = srq.post_recv(&[RecvWr::new(&three)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("SrqConfig::max_sge")), "{e}");
    srq.post_recv(&[RecvWr::new(&three[..2])]).unwrap();
    assert!(matches!(mr.write_at(0, &[1]), Err(Error::Busy { .. })), "a posted shared receive holds its memory");
    assert!(matches!(srq.arm_limit(0), Err(Error::InvalidArgument(_))));
    assert!(matches!(srq.arm_limit(17), Err(Error::InvalidArgument(_))));
    let other = ProtectionDomain::new(&ctx).unwrap();
    let foreign = MemoryRegion::alloc(&other, 64, AccessFlags::default()).unwrap();
    assert!(matches!(srq.post_recv(&[RecvWr::new(foreign.slice(0..8).unwrap())]), Err(Error::ForeignMemoryRegion)));
    let cq = CompletionQueue::new(&ctx, 64).unwrap();
    let e = QueuePair::create_with_srq(&other, &cq, &cq, &srq, &QpConfig::default()).unwrap_err();
    assert!(matches!(e, Error::ForeignMemoryRegion), "{e}");
    // Dropping the queue with a receive outstanding releases its memory.
    drop(srq);
    mr.write_at(0, &[1]).unwrap();
}
