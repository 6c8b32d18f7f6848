//! Posting beyond one slice and one queue's depth: scatter/gather lists,
//! requests that name no memory, and lists longer than the send queue,
//! against a real RDMA device (Soft-RoCE in the test bed). Ignored by
//! default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test posting -- --ignored
//! ```

mod common;

use std::time::Duration;

use common::{loopback, wait_one};
use testkit::pattern;

use gpudirect::{
    AccessFlags, CompletionQueue, Error, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RecvWr, SendList,
    SendTemplate, SendWr, SgList, WcOpcode,
};

fn sg_config(n: u32) -> QpConfig {
    QpConfig { max_send_sge: n, max_recv_sge: n, ..QpConfig::default() }
}

/// Concatenates what `parts` name, read back by copy.
fn gathered(parts: &[(&MemoryRegion, std::ops::Range<usize>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (mr, r) in parts {
        let mut b = vec![0; r.len()];
        mr.read_at(r.start, &mut b).unwrap();
        out.extend_from_slice(&b);
    }
    out
}

/// A send gathered from three slices of two regions (and an empty one,
/// left out) lands in a receive scattered over two slices cut elsewhere,
/// byte for byte in list order; each receive slice is held until its
/// completion, the gap between them is not.
#[test]
#[ignore = "needs an RDMA device"]
fn a_gathered_send_lands_in_a_scattered_receive() {
    let lb = loopback(&sg_config(4));
    let a = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
    let b = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
    let c = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
    a.write_at(0, &pattern(4096, 1)).unwrap();
    b.write_at(0, &pattern(4096, 2)).unwrap();
    let recv = [c.slice(0..700).unwrap(), c.slice(1000..1900).unwrap()];
    lb.b.qp.post_recv(&[RecvWr::new(&recv).wr_id(3)]).unwrap();
    assert!(matches!(c.read_at(1500, &mut [0; 4]), Err(Error::Busy { .. })), "the second slice is the NIC's");
    c.read_at(800, &mut [0; 4]).unwrap();
    let send = [a.slice(0..100).unwrap(), b.slice(10..1010).unwrap(), a.slice(7..7).unwrap(), a.slice(2000..2500).unwrap()];
    let list = SgList::from(&send);
    assert_eq!((list.len(), list.num_sge(), list.slices().count()), (1600, 3, 3));
    lb.a.qp.post_send(&[SendWr::send(list).wr_id(4)]).unwrap();
    let wc = wait_one(&lb.b.cq).ok().unwrap();
    assert_eq!((wc.wr_id, wc.opcode, wc.byte_len), (3, WcOpcode::Recv, 1600));
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, 4);
    let sent = gathered(&[(&a, 0..100), (&b, 10..1010), (&a, 2000..2500)]);
    assert_eq!(gathered(&[(&c, 0..700), (&c, 1000..1900)]), sent);
    c.write_at(1500, &[0; 4]).unwrap();
}

/// RDMA writes gather and RDMA reads scatter, posted one by one and as a
/// prepared list reposted with new contents each round.
#[test]
#[ignore = "needs an RDMA device"]
fn writes_gather_and_reads_scatter() {
    let lb = loopback(&sg_config(3));
    let src = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::default()).unwrap();
    let remote = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ).unwrap();
    let back = MemoryRegion::alloc(&lb.pd, 8192, AccessFlags::default()).unwrap();
    src.write_at(0, &pattern(8192, 3)).unwrap();
    let parts = [src.slice(0..64).unwrap(), src.slice(4096..4160).unwrap(), src.slice(100..228).unwrap()];
    lb.a.qp.post_send(&[SendWr::write(&parts, &remote.remote(), 100).unwrap()]).unwrap();
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().opcode, WcOpcode::RdmaWrite);
    let expect = gathered(&[(&src, 0..64), (&src, 4096..4160), (&src, 100..228)]);
    assert_eq!(gathered(&[(&remote, 100..356)]), expect);

    let into = [back.slice(0..28).unwrap(), back.slice(500..600).unwrap(), back.slice(8000..8128).unwrap()];
    lb.a.qp.post_send(&[SendWr::read(&into, &remote.remote(), 100).unwrap()]).unwrap();
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().opcode, WcOpcode::RdmaRead);
    assert_eq!(gathered(&[(&back, 0..28), (&back, 500..600), (&back, 8000..8128)]), expect);

    // A prepared list of two gathered writes, reposted over new bytes.
    let first = [src.slice(0..10).unwrap(), src.slice(20..30).unwrap()];
    let second = [src.slice(40..50).unwrap(), src.slice(60..70).unwrap(), src.slice(80..90).unwrap()];
    let wrs = [
        SendWr::write(&first, &remote.remote(), 5000).unwrap().unsignaled(),
        SendWr::write(&second, &remote.remote(), 6000).unwrap(),
    ];
    let mut list = SendList::new(&wrs).unwrap();
    for round in 0..3u8 {
        src.write_at(0, &pattern(100, 10 + u64::from(round))).unwrap();
        list.set_wr_id(1, u64::from(round)).unwrap();
        lb.a.qp.post_list(&mut list).unwrap();
        assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, u64::from(round));
        assert_eq!(gathered(&[(&remote, 5000..5020)]), gathered(&[(&src, 0..10), (&src, 20..30)]));
        assert_eq!(gathered(&[(&remote, 6000..6030)]), gathered(&[(&src, 40..50), (&src, 60..70), (&src, 80..90)]));
    }
}

/// Lists longer than the queue pair allows, limits beyond the device's,
/// regions of another protection domain and remote ranges too short for
/// the whole list are refused before anything is posted.
#[test]
#[ignore = "needs an RDMA device"]
fn lists_beyond_the_limits_are_refused_before_posting() {
    let lb = loopback(&sg_config(2));
    let mr = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::REMOTE_WRITE).unwrap();
    let three = [mr.slice(0..8).unwrap(), mr.slice(16..24).unwrap(), mr.slice(32..40).unwrap()];
    let e = lb.a.qp.post_send(&[SendWr::send(&three)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("max_send_sge")), "{e}");
    let e = lb.b.qp.post_recv(&[RecvWr::new(&three)]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("max_recv_sge")), "{e}");
    let mut list = SendList::new(&[SendWr::write(&three, &mr.remote(), 0).unwrap()]).unwrap();
    let e = lb.a.qp.post_list(&mut list).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("max_send_sge")), "{e}");
    // Nothing was held: the bytes are free for copies.
    mr.write_at(0, &[1; 64]).unwrap();
    // Empty slices do not count.
    let sparse = [mr.slice(0..8).unwrap(), mr.slice(9..9).unwrap(), mr.slice(16..24).unwrap()];
    assert_eq!(SgList::from(&sparse).num_sge(), 2);
    lb.b.qp.post_recv(&[RecvWr::new(&sparse)]).unwrap();

    let e = SendWr::write(&three, &mr.remote(), 4096 - 23).unwrap_err();
    assert!(matches!(e, Error::OutOfBounds { requested: 24, .. }), "{e}");

    let other_pd = ProtectionDomain::new(lb.pd.context()).unwrap();
    let foreign = MemoryRegion::alloc(&other_pd, 64, AccessFlags::default()).unwrap();
    let mixed = [mr.slice(0..8).unwrap(), foreign.slice(0..8).unwrap()];
    assert!(matches!(lb.a.qp.post_send(&[SendWr::send(&mixed)]), Err(Error::ForeignMemoryRegion)));
    assert!(matches!(SendList::new(&[SendWr::send(&mixed)]), Err(Error::ForeignMemoryRegion)));

    let max = lb.pd.context().attr().max_sge;
    let cq = CompletionQueue::new(lb.pd.context(), 256).unwrap();
    for config in [sg_config(0), sg_config(max + 1), QpConfig { max_recv_sge: max + 1, ..QpConfig::default() }] {
        let e = QueuePair::create(&lb.pd, &cq, &cq, &config).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("scatter/gather entries")), "{e}");
    }
    QueuePair::create(&lb.pd, &cq, &cq, &sg_config(max)).unwrap();
}

/// A zero-length write with immediate data names no memory on either
/// side, and an empty receive takes its notification; a send with data
/// into an empty receive fails rather than landing anywhere.
#[test]
#[ignore = "needs an RDMA device"]
fn an_immediate_into_an_empty_receive_moves_no_bytes() {
    let lb = loopback(&QpConfig::default());
    lb.b.qp.post_recv(&[RecvWr::empty().wr_id(8), RecvWr::empty().wr_id(9)]).unwrap();
    lb.a.qp.post_send(&[SendWr::immediate(0x1234_5678).wr_id(1), SendWr::immediate(7).wr_id(2)]).unwrap();
    for (id, imm) in [(8, 0x1234_5678), (9, 7)] {
        let wc = wait_one(&lb.b.cq).ok().unwrap();
        assert_eq!((wc.wr_id, wc.opcode, wc.byte_len, wc.imm), (id, WcOpcode::RecvRdmaWithImm, 0, Some(imm)));
    }
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, 1);
    assert_eq!(wait_one(&lb.a.cq).ok().unwrap().wr_id, 2);
    // A prepared list of notifications only (no region, so no domain).
    let mut list = SendList::new(&[SendWr::immediate(3)]).unwrap();
    lb.b.qp.post_recv(&[RecvWr::empty().wr_id(10)]).unwrap();
    lb.a.qp.post_list(&mut list).unwrap();
    assert_eq!(wait_one(&lb.b.cq).ok().unwrap().imm, Some(3));
    wait_one(&lb.a.cq).ok().unwrap();

    let src = MemoryRegion::alloc(&lb.pd, 64, AccessFlags::default()).unwrap();
    lb.b.qp.post_recv(&[RecvWr::empty().wr_id(11)]).unwrap();
    lb.a.qp.post_send(&[SendWr::send(src.slice(0..16).unwrap()).wr_id(5)]).unwrap();
    let wc = wait_one(&lb.b.cq);
    assert_eq!(wc.wr_id, 11);
    let e = wc.ok().unwrap_err();
    eprintln!("send into an empty receive: {e}");
    assert!(wait_one(&lb.a.cq).ok().is_err(), "the sender learns of it too");
}

/// A list ten times longer than a 16-deep send queue is posted whole as
/// room frees, every completion reaped on the way handed over exactly
/// once, and the bytes of every write land; a queue left full of
/// unsignaled requests is an error, not a hang.
#[test]
#[ignore = "needs an RDMA device"]
fn a_list_longer_than_the_queue_is_posted_as_room_frees() {
    let lb = loopback(&QpConfig { max_send_wr: 16, ..QpConfig::default() });
    let src = MemoryRegion::alloc(&lb.pd, 160 * 64, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&lb.pd, 160 * 64, AccessFlags::REMOTE_WRITE).unwrap();
    let data = pattern(160 * 64, 21);
    src.write_at(0, &data).unwrap();
    let wrs: Vec<SendWr> = (0..160)
        .map(|i| {
            let wr = SendWr::write(src.slice(64 * i..64 * i + 64).unwrap(), &dst.remote(), 64 * i as u64).unwrap().wr_id(i as u64);
            if i % 4 == 3 { wr } else { wr.unsignaled() }
        })
        .collect();
    assert!(matches!(lb.a.qp.post_send(&wrs), Err(Error::QueueFull { depth: 16, .. })));
    let mut seen = Vec::new();
    lb.a.qp
        .post_send_all(&wrs, Some(Duration::from_secs(30)), |wc| {
            seen.push(wc.ok()?.wr_id);
            Ok(())
        })
        .unwrap();
    assert!(seen.len() >= (160 - 16) / 4, "room for the last {} came from {} completions", 160 - 16, seen.len());
    while seen.len() < 40 {
        seen.push(wait_one(&lb.a.cq).ok().unwrap().wr_id);
    }
    assert_eq!(seen, (0..40).map(|k| 4 * k + 3).collect::<Vec<u64>>(), "each signaled completion once, in order");
    let mut got = vec![0; data.len()];
    dst.read_at(0, &mut got).unwrap();
    assert_eq!(got, data);

    // What on_completion returns stops the posting, and says how far it got.
    let fail = lb.a.qp.post_send_all(&wrs, None, |_| Err(Error::InvalidArgument("stop".into()))).unwrap_err();
    assert_eq!(fail.posted, 16);
    assert!(matches!(fail.error, Error::InvalidArgument(ref m) if m == "stop"), "{fail}");
    for _ in 0..3 {
        wait_one(&lb.a.cq).ok().unwrap();
    }
    // Sixteen unsignaled requests fill the queue for good: refused at once.
    let quiet: Vec<SendWr> = wrs.iter().map(|w| w.unsignaled()).collect();
    let fail = lb.a.qp.post_send_all(&quiet[..17], Some(Duration::from_secs(30)), |_| Ok(())).unwrap_err();
    assert_eq!(fail.posted, 16);
    assert!(matches!(fail.error, Error::InvalidArgument(ref m) if m.contains("unsignaled")), "{fail}");
}

/// Every opcode the library posts, through both posting APIs: the
/// extended one (`ibv_wr_*`, the default where the provider has it) and
/// `ibv_post_send`; one slice, inline, a prepared list, the atomics, and
/// lists of several slices (which go by `ibv_post_send` either way). The
/// same bytes and values land either way.
#[test]
#[ignore = "needs an RDMA device"]
fn both_posting_apis_move_the_same_bytes() {
    for extended in [true, false] {
        let config = QpConfig {
            extended_posting: extended,
            max_inline_data: 64,
            access: QpConfig::default().access | AccessFlags::REMOTE_ATOMIC,
            ..sg_config(2)
        };
        let lb = loopback(&config);
        assert_eq!(lb.a.qp.extended_posting(), extended, "Soft-RoCE has the extended API");
        let all = AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_ATOMIC;
        let src = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
        let dst = MemoryRegion::alloc(&lb.pd, 4096, all).unwrap();
        let back = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
        let data = pattern(4096, 40 + u64::from(extended));
        src.write_at(0, &data).unwrap();
        let r = dst.remote();
        let done = |cq: &CompletionQueue, op: WcOpcode| {
            let wc = wait_one(cq).ok().unwrap();
            assert_eq!(wc.opcode, op, "extended_posting {extended}");
            wc
        };
        // Write, one slice; write with immediate from two slices.
        lb.a.qp.post_send(&[SendWr::write(src.slice(0..1000).unwrap(), &r, 0).unwrap()]).unwrap();
        done(&lb.a.cq, WcOpcode::RdmaWrite);
        lb.b.qp.post_recv(&[RecvWr::empty()]).unwrap();
        let two = [src.slice(1000..1100).unwrap(), src.slice(2000..2100).unwrap()];
        lb.a.qp.post_send(&[SendWr::write_with_imm(&two, &r, 1000, 77).unwrap()]).unwrap();
        done(&lb.a.cq, WcOpcode::RdmaWrite);
        assert_eq!(done(&lb.b.cq, WcOpcode::RecvRdmaWithImm).imm, Some(77));
        let mut expect = data[..1100].to_vec();
        expect.extend_from_slice(&data[2000..2100]);
        assert_eq!(gathered(&[(&dst, 0..1200)]), expect, "extended_posting {extended}");
        // Sends: inline one slice, inline two slices, with immediate.
        let inline_two = [src.slice(3000..3010).unwrap(), src.slice(3500..3520).unwrap()];
        lb.b.qp.post_recv(&[RecvWr::new(back.slice(0..64).unwrap()).wr_id(1)]).unwrap();
        lb.b.qp.post_recv(&[RecvWr::new(back.slice(64..128).unwrap()).wr_id(2)]).unwrap();
        lb.b.qp.post_recv(&[RecvWr::new(back.slice(128..1128).unwrap()).wr_id(3)]).unwrap();
        // Separate batches: one with a list of several goes by ibv_post_send.
        lb.a.qp.post_send(&[SendWr::send(src.slice(2500..2564).unwrap()).inline()]).unwrap();
        lb.a.qp.post_send(&[SendWr::send(&inline_two).inline()]).unwrap();
        lb.a.qp.post_send(&[SendWr::send_with_imm(src.slice(0..1000).unwrap(), 5)]).unwrap();
        for _ in 0..3 {
            done(&lb.a.cq, WcOpcode::Send);
        }
        assert_eq!(done(&lb.b.cq, WcOpcode::Recv).byte_len, 64);
        assert_eq!(done(&lb.b.cq, WcOpcode::Recv).byte_len, 30);
        assert_eq!(done(&lb.b.cq, WcOpcode::Recv).imm, Some(5));
        let mut expect = data[2500..2564].to_vec();
        expect.extend_from_slice(&data[3000..3010]);
        expect.extend_from_slice(&data[3500..3520]);
        assert_eq!(gathered(&[(&back, 0..94)]), expect, "inline sends, extended_posting {extended}");
        assert_eq!(gathered(&[(&back, 128..1128)]), data[..1000].to_vec());
        // Read back, scattered over two slices; then a prepared list.
        let into = [back.slice(2000..2600).unwrap(), back.slice(3000..3400).unwrap()];
        lb.a.qp.post_send(&[SendWr::read(&into, &r, 0).unwrap()]).unwrap();
        done(&lb.a.cq, WcOpcode::RdmaRead);
        assert_eq!(gathered(&[(&back, 2000..2600), (&back, 3000..3400)]), data[..1000].to_vec());
        let mut list = SendList::new(&[SendWr::write(src.slice(0..4096).unwrap(), &r, 0).unwrap()]).unwrap();
        lb.a.qp.post_list(&mut list).unwrap();
        done(&lb.a.cq, WcOpcode::RdmaWrite);
        assert_eq!(dst.to_vec().unwrap(), data, "a prepared list, extended_posting {extended}");
        // Atomics on an 8-byte word.
        dst.write_at(0, &5u64.to_ne_bytes()).unwrap();
        lb.a.qp.post_send(&[SendWr::fetch_add(back.slice(0..8).unwrap(), &r, 0, 3).unwrap()]).unwrap();
        done(&lb.a.cq, WcOpcode::FetchAdd);
        lb.a.qp.post_send(&[SendWr::compare_swap(back.slice(8..16).unwrap(), &r, 0, 8, 100).unwrap()]).unwrap();
        done(&lb.a.cq, WcOpcode::CompareSwap);
        let mut words = [0u8; 16];
        back.read_at(0, &mut words).unwrap();
        assert_eq!((u64::from_ne_bytes(words[..8].try_into().unwrap()), u64::from_ne_bytes(words[8..].try_into().unwrap())), (5, 8));
        let mut word = [0u8; 8];
        dst.read_at(0, &mut word).unwrap();
        assert_eq!(u64::from_ne_bytes(word), 100, "fetch-add then compare-swap, extended_posting {extended}");
    }
}

/// Aimed posts (`post_aimed`, built straight from the template on an
/// extended queue pair) through both posting APIs: each template's bytes,
/// immediate and id land as `post_send` lands them; an empty slice (the
/// general path) carries the immediate alone; unsignaled posts complete
/// with the next signaled one and release their memory with it; a slice
/// of another domain and a post past the queue's depth are refused before
/// anything is posted, and the queue posts again once its completion is
/// reaped.
#[test]
#[ignore = "needs an RDMA device"]
fn aimed_posts_land_as_post_send_lands_them() {
    for extended in [true, false] {
        let config = QpConfig { extended_posting: extended, max_send_wr: 4, ..QpConfig::default() };
        let lb = loopback(&config);
        assert_eq!(lb.a.qp.extended_posting(), extended, "Soft-RoCE has the extended API");
        let src = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
        let dst = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).unwrap();
        let back = MemoryRegion::alloc(&lb.pd, 4096, AccessFlags::default()).unwrap();
        let data = pattern(4096, 60 + u64::from(extended));
        src.write_at(0, &data).unwrap();
        let r = dst.remote();
        let sent = |id: u64| {
            let wc = wait_one(&lb.a.cq).ok().unwrap();
            assert_eq!((wc.wr_id, wc.opcode), (id, WcOpcode::RdmaWrite), "extended_posting {extended}");
        };
        let write_imm = SendTemplate::write_with_imm();
        for (i, (from, to)) in [(0usize, 512u64), (100, 2048), (3000, 0)].into_iter().enumerate() {
            lb.b.qp.post_recv(&[RecvWr::empty().wr_id(10 + i as u64)]).unwrap();
            lb.a.qp.post_aimed(&write_imm, src.slice(from..from + 256).unwrap(), r.addr + to, r.rkey, 70 + i as u32, i as u64).unwrap();
            sent(i as u64);
            let wc = wait_one(&lb.b.cq).ok().unwrap();
            assert_eq!((wc.wr_id, wc.opcode, wc.imm), (10 + i as u64, WcOpcode::RecvRdmaWithImm, Some(70 + i as u32)));
            let mut got = vec![0; 256];
            dst.read_at(to as usize, &mut got).unwrap();
            assert_eq!(got, data[from..from + 256], "write with immediate {i}, extended_posting {extended}");
        }
        // No bytes: the immediate alone, by the general path.
        lb.b.qp.post_recv(&[RecvWr::empty().wr_id(20)]).unwrap();
        lb.a.qp.post_aimed(&write_imm, src.slice(0..0).unwrap(), r.addr, r.rkey, 99, 5).unwrap();
        sent(5);
        let wc = wait_one(&lb.b.cq).ok().unwrap();
        assert_eq!((wc.wr_id, wc.byte_len, wc.imm), (20, 0, Some(99)));
        // A plain write, two unsignaled before it: one completion, and the
        // memory of all three is free once it is reaped.
        let quiet = SendTemplate::write().unsignaled();
        lb.a.qp.post_aimed(&quiet, src.slice(0..100).unwrap(), r.addr + 3500, r.rkey, 0, 6).unwrap();
        lb.a.qp.post_aimed(&quiet, src.slice(100..200).unwrap(), r.addr + 3600, r.rkey, 0, 7).unwrap();
        lb.a.qp.post_aimed(&SendTemplate::write(), src.slice(200..300).unwrap(), r.addr + 3700, r.rkey, 0, 8).unwrap();
        sent(8);
        src.write_at(0, &data[..300]).unwrap();
        let mut got = vec![0; 300];
        dst.read_at(3500, &mut got).unwrap();
        assert_eq!(got, data[..300], "unsignaled writes, extended_posting {extended}");
        // Sends, with and without immediate, into posted receives.
        lb.b.qp.post_recv(&[RecvWr::new(back.slice(0..1000).unwrap()).wr_id(30)]).unwrap();
        lb.b.qp.post_recv(&[RecvWr::new(back.slice(1000..2000).unwrap()).wr_id(31)]).unwrap();
        lb.a.qp.post_aimed(&SendTemplate::send(), src.slice(500..600).unwrap(), 0, 0, 0, 9).unwrap();
        lb.a.qp.post_aimed(&SendTemplate::send_with_imm(), src.slice(600..900).unwrap(), 0, 0, 41, 10).unwrap();
        for id in [9, 10] {
            let wc = wait_one(&lb.a.cq).ok().unwrap();
            assert_eq!((wc.wr_id, wc.opcode), (id, WcOpcode::Send));
        }
        let wc = wait_one(&lb.b.cq).ok().unwrap();
        assert_eq!((wc.wr_id, wc.opcode, wc.byte_len, wc.imm), (30, WcOpcode::Recv, 100, None));
        let wc = wait_one(&lb.b.cq).ok().unwrap();
        assert_eq!((wc.wr_id, wc.byte_len, wc.imm), (31, 300, Some(41)));
        assert_eq!(gathered(&[(&back, 0..100), (&back, 1000..1300)]), data[500..900], "sends, extended_posting {extended}");
        // Refused before posting: another domain's memory, then a fifth
        // post on a queue of four whose completions are not reaped.
        let other = ProtectionDomain::new(lb.pd.context()).unwrap();
        let foreign = MemoryRegion::alloc(&other, 64, AccessFlags::default()).unwrap();
        let refused = lb.a.qp.post_aimed(&SendTemplate::write(), foreign.slice(0..64).unwrap(), r.addr, r.rkey, 0, 11);
        assert!(matches!(refused, Err(Error::ForeignMemoryRegion)), "{refused:?}");
        for id in 12..16 {
            lb.a.qp.post_aimed(&SendTemplate::write(), src.slice(0..64).unwrap(), r.addr, r.rkey, 0, id).unwrap();
        }
        let full = lb.a.qp.post_aimed(&SendTemplate::write(), src.slice(0..64).unwrap(), r.addr, r.rkey, 0, 16);
        assert!(matches!(full, Err(Error::QueueFull { .. })), "{full:?}");
        sent(12);
        lb.a.qp.post_aimed(&SendTemplate::write(), src.slice(0..64).unwrap(), r.addr, r.rkey, 0, 16).unwrap();
        for id in 13..17 {
            sent(id);
        }
    }
}
