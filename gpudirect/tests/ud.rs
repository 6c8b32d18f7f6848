//! Unreliable-datagram queue pairs against a real RDMA device (Soft-RoCE
//! in the test bed). Ignored by default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test ud -- --ignored
//! ```

mod common;

use std::time::Duration;

use common::{device, wait_one};
use testkit::pattern;

use gpudirect::{
    AccessFlags, AddressHandle, CompletionQueue, Context, Error, MemoryRegion, ProtectionDomain, RecvWr, UdConfig,
    UdQueuePair, UdSendWr, WcOpcode, WorkCompletion,
};

/// Datagrams of 1 byte to the path MTU land whole in a receive that names
/// only room for the message: the GRH is the library's, `byte_len` is the
/// message's, `src_qp` the sender's. Receives cycle through every GRH slot
/// three times. Longer than the MTU is refused before posting; a datagram
/// with the wrong Q_Key is dropped by the receiver, as UD does.
#[test]
#[ignore = "needs an RDMA device"]
fn datagrams_land_whole_with_the_grh_stripped() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let (cq_a, cq_b) = (CompletionQueue::new(&ctx, 64).unwrap(), CompletionQueue::new(&ctx, 64).unwrap());
    let config = UdConfig { max_send_wr: 8, max_recv_wr: 4, max_inline_data: 64, ..UdConfig::default() };
    let a = UdQueuePair::create(&pd, &cq_a, &cq_a, &config).unwrap();
    let b = UdQueuePair::create(&pd, &cq_b, &cq_b, &config).unwrap();
    let to_b = AddressHandle::new(&a, &b.endpoint(), config.qkey).unwrap();
    let mtu = to_b.max_message();
    assert!(mtu >= 256, "path MTU {mtu}");
    let src = MemoryRegion::alloc(&pd, 2 * mtu, AccessFlags::default()).unwrap();
    let inbox = MemoryRegion::alloc(&pd, 4 * mtu, AccessFlags::default()).unwrap();
    let slot = |k: usize| inbox.slice(k * mtu..(k + 1) * mtu).unwrap();
    b.post_recv(&(0..4).map(|k| RecvWr::new(slot(k)).wr_id(k as u64)).collect::<Vec<_>>()).unwrap();
    let sizes = [1, 100, mtu, 10, 64, mtu - 1, 7, mtu, 33, 2, mtu, 1];
    for (round, chunk) in sizes.chunks(4).enumerate() {
        for (i, &len) in chunk.iter().enumerate() {
            let seed = (round * 4 + i) as u64;
            src.write_at(0, &pattern(len, seed)).unwrap();
            let wr = match i {
                3 => UdSendWr::send_with_imm(&to_b, src.slice(0..len).unwrap(), 0xabc0 + round as u32),
                1 if len <= 64 => UdSendWr::send(&to_b, src.slice(0..len).unwrap()).inline(),
                _ => UdSendWr::send(&to_b, src.slice(0..len).unwrap()),
            };
            a.post_send(&[wr.wr_id(seed)]).unwrap();
            assert_eq!(wait_one(&cq_a).ok().unwrap().wr_id, seed);
            let wc = wait_one(&cq_b).ok().unwrap();
            let k = wc.wr_id as usize;
            assert_eq!(k, i, "receives are taken in order");
            assert_eq!((wc.opcode, wc.byte_len as usize, wc.src_qp), (WcOpcode::Recv, len, a.endpoint().qp_num));
            assert_eq!(wc.imm, (i == 3).then_some(0xabc0 + round as u32));
            let mut got = vec![0; len];
            inbox.read_at(k * mtu, &mut got).unwrap();
            assert_eq!(got, pattern(len, seed), "round {round}, datagram {i}");
            b.post_recv(&[RecvWr::new(slot(k)).wr_id(k as u64)]).unwrap();
        }
    }
    // Refused before posting.
    let e = a.post_send(&[UdSendWr::send(&to_b, src.slice(0..mtu + 1).unwrap())]).unwrap_err();
    assert!(matches!(e, Error::TooLong(n) if n == mtu as u64 + 1), "{e}");
    let parts = [src.slice(0..8).unwrap(), src.slice(16..24).unwrap()];
    assert!(matches!(a.post_send(&[UdSendWr::send(&to_b, &parts)]), Err(Error::InvalidArgument(_))));
    assert!(matches!(b.post_recv(&[RecvWr::new(&parts)]), Err(Error::InvalidArgument(_))));
    let e = a.post_send(&[UdSendWr::send(&to_b, src.slice(0..65).unwrap()).inline()]).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(ref m) if m.contains("max_inline_data")), "{e}");
    // A wrong Q_Key: sent, but the receiver drops it.
    let wrong = AddressHandle::new(&a, &b.endpoint(), config.qkey ^ 1).unwrap();
    a.post_send(&[UdSendWr::send(&wrong, src.slice(0..8).unwrap()).wr_id(99)]).unwrap();
    assert_eq!(wait_one(&cq_a).ok().unwrap().wr_id, 99);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(cq_b.poll(&mut [WorkCompletion::default(); 4]).unwrap(), 0, "dropped, not delivered");
    // The address handle may go before its sends complete: the queue pair keeps it.
    let once = AddressHandle::new(&a, &b.endpoint(), config.qkey).unwrap();
    a.post_send(&[UdSendWr::send(&once, src.slice(0..8).unwrap()).wr_id(100)]).unwrap();
    drop(once);
    assert_eq!(wait_one(&cq_a).ok().unwrap().wr_id, 100);
    assert_eq!(wait_one(&cq_b).ok().unwrap().byte_len, 8);
}
