//! The static inline verbs are real, linkable functions here, and the
//! structs the safe crate fills have the layout of the headers.
//! (bindgen's generated compile-time assertions check every field offset
//! against clang's view of verbs.h; these tests check what those cannot:
//! that the C wrappers were compiled and linked.)

use gpudirect_sys::*;

#[test]
fn inline_verbs_link() {
    let fns: [(&str, usize); 8] = [
        ("ibv_post_send", std::hint::black_box(ibv_post_send as *const ()) as usize),
        ("ibv_post_recv", std::hint::black_box(ibv_post_recv as *const ()) as usize),
        ("ibv_poll_cq", std::hint::black_box(ibv_poll_cq as *const ()) as usize),
        ("ibv_req_notify_cq", std::hint::black_box(ibv_req_notify_cq as *const ()) as usize),
        ("___ibv_query_port", std::hint::black_box(___ibv_query_port as *const ()) as usize),
        ("__ibv_reg_mr", std::hint::black_box(__ibv_reg_mr as *const ()) as usize),
        ("ibv_query_gid_ex", std::hint::black_box(ibv_query_gid_ex as *const ()) as usize),
        ("ibv_query_gid_table", std::hint::black_box(ibv_query_gid_table as *const ()) as usize),
    ];
    // Taking their addresses makes the linker resolve every wrapper; a
    // missing one fails the build of this test.
    for (name, addr) in fns {
        assert_ne!(addr, 0, "{name} did not link");
    }
}

#[test]
fn abi_sizes_match_rdma_core() {
    // The stable verbs ABI: these sizes are fixed by rdma-core's ABI
    // guarantees on 64-bit Linux.
    assert_eq!(std::mem::size_of::<ibv_wc>(), 48);
    assert_eq!(std::mem::size_of::<ibv_sge>(), 16);
    assert_eq!(std::mem::size_of::<ibv_gid>(), 16);
    assert_eq!(std::mem::size_of::<ibv_recv_wr>(), 32);
}
