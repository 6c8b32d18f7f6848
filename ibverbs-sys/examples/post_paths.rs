//! Posts RDMA writes on a loopback RC pair through one of the two posting
//! APIs, so callgrind can count what each costs per message on a provider:
//!
//! ```text
//! post_paths post N     # ibv_post_send with an ibv_send_wr
//! post_paths ex N       # ibv_wr_start / ibv_wr_rdma_write / ibv_wr_set_sge / ibv_wr_complete
//! ```
//!
//! Each message is one signaled 64-byte write, polled to completion before
//! the next, on a queue pair made by `ibv_create_qp_ex` (so both modes post
//! on the same kind of queue pair). `RDMA_DEVICE` picks the device (default:
//! the first), `GID_INDEX` the GID (default 1, the IPv4-mapped RoCE v2
//! entry on Soft-RoCE). `testbed/insns-per-message --post-paths` runs it with
//! N and 2N under callgrind; the difference cancels set-up and teardown.
//! Raw verbs on purpose: this measures the provider's two paths, not the
//! safe library.

use std::ffi::CStr;
use std::ptr::null_mut;

use gpudirect_sys as sys;

const SIZE: usize = 64;

fn die(what: &str) -> ! {
    eprintln!("post_paths: {what} failed: {}", std::io::Error::last_os_error());
    std::process::exit(1);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (ex, n) = match (args.first().map(String::as_str), args.get(1).and_then(|n| n.parse::<u64>().ok())) {
        (Some("post"), Some(n)) => (false, n),
        (Some("ex"), Some(n)) => (true, n),
        _ => {
            eprintln!("usage: post_paths post|ex N");
            std::process::exit(2);
        }
    };
    let gid_index: u8 = std::env::var("GID_INDEX").ok().and_then(|g| g.parse().ok()).unwrap_or(1);
    // SAFETY: every pointer below comes from the verb that created it and
    // is checked for NULL before use; the process exits without tearing
    // down (the kernel releases everything), which is what the N/2N
    // difference is meant to cancel anyway.
    unsafe { run(ex, n, gid_index) }
}

/// # Safety
/// Calls raw verbs; see `main`.
unsafe fn run(ex: bool, n: u64, gid_index: u8) {
    // SAFETY: (for every block of this function) arguments are the live
    // objects made above them, out-pointers point to locals.
    unsafe {
        let want = std::env::var("RDMA_DEVICE").ok();
        let mut num = 0;
        let list = sys::ibv_get_device_list(&mut num);
        if list.is_null() || num == 0 {
            die("ibv_get_device_list");
        }
        let devs = std::slice::from_raw_parts(list, num as usize);
        let dev = devs
            .iter()
            .copied()
            .find(|d| want.as_deref().is_none_or(|w| CStr::from_ptr(sys::ibv_get_device_name(*d)).to_str() == Ok(w)))
            .unwrap_or_else(|| die("finding the device"));
        let ctx = sys::ibv_open_device(dev);
        if ctx.is_null() {
            die("ibv_open_device");
        }
        let pd = sys::ibv_alloc_pd(ctx);
        if pd.is_null() {
            die("ibv_alloc_pd");
        }
        let mut buf = vec![0u8; 2 * SIZE];
        let access = sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_REMOTE_WRITE;
        let mr = sys::ibv_reg_mr(pd, buf.as_mut_ptr().cast(), buf.len(), access as i32);
        if mr.is_null() {
            die("ibv_reg_mr");
        }
        let cq = sys::ibv_create_cq(ctx, 64, null_mut(), null_mut(), 0);
        if cq.is_null() {
            die("ibv_create_cq");
        }
        let mut gid = sys::ibv_gid::default();
        if sys::ibv_query_gid(ctx, 1, gid_index.into(), &mut gid) != 0 {
            die("ibv_query_gid");
        }
        let make = || {
            let mut init = sys::ibv_qp_init_attr_ex {
                send_cq: cq,
                recv_cq: cq,
                cap: sys::ibv_qp_cap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 },
                qp_type: sys::IBV_QPT_RC,
                comp_mask: sys::IBV_QP_INIT_ATTR_PD | sys::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
                pd,
                send_ops_flags: u64::from(sys::IBV_QP_EX_WITH_RDMA_WRITE),
                ..Default::default()
            };
            let qp = sys::ibv_create_qp_ex(ctx, &mut init);
            if qp.is_null() {
                die("ibv_create_qp_ex");
            }
            let mut a = sys::ibv_qp_attr { qp_state: sys::IBV_QPS_INIT, port_num: 1, qp_access_flags: access, ..Default::default() };
            let mask = sys::IBV_QP_STATE | sys::IBV_QP_PKEY_INDEX | sys::IBV_QP_PORT | sys::IBV_QP_ACCESS_FLAGS;
            if sys::ibv_modify_qp(qp, &mut a, mask as i32) != 0 {
                die("ibv_modify_qp INIT");
            }
            qp
        };
        let (a, b) = (make(), make());
        for (qp, peer) in [(a, b), (b, a)] {
            let mut r = sys::ibv_qp_attr {
                qp_state: sys::IBV_QPS_RTR,
                path_mtu: sys::IBV_MTU_1024,
                dest_qp_num: (*peer).qp_num,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                ..Default::default()
            };
            r.ah_attr.is_global = 1;
            r.ah_attr.port_num = 1;
            r.ah_attr.grh.dgid = gid;
            r.ah_attr.grh.sgid_index = gid_index;
            r.ah_attr.grh.hop_limit = 64;
            let mask = sys::IBV_QP_STATE
                | sys::IBV_QP_AV
                | sys::IBV_QP_PATH_MTU
                | sys::IBV_QP_DEST_QPN
                | sys::IBV_QP_RQ_PSN
                | sys::IBV_QP_MAX_DEST_RD_ATOMIC
                | sys::IBV_QP_MIN_RNR_TIMER;
            if sys::ibv_modify_qp(qp, &mut r, mask as i32) != 0 {
                die("ibv_modify_qp RTR");
            }
            let mut s = sys::ibv_qp_attr { qp_state: sys::IBV_QPS_RTS, timeout: 14, retry_cnt: 6, rnr_retry: 6, max_rd_atomic: 1, ..Default::default() };
            let mask = sys::IBV_QP_STATE
                | sys::IBV_QP_TIMEOUT
                | sys::IBV_QP_RETRY_CNT
                | sys::IBV_QP_RNR_RETRY
                | sys::IBV_QP_SQ_PSN
                | sys::IBV_QP_MAX_QP_RD_ATOMIC;
            if sys::ibv_modify_qp(qp, &mut s, mask as i32) != 0 {
                die("ibv_modify_qp RTS");
            }
        }
        let qpx = sys::ibv_qp_to_qp_ex(a);
        if qpx.is_null() {
            die("ibv_qp_to_qp_ex");
        }
        let (laddr, lkey, rkey) = (buf.as_ptr() as u64, (*mr).lkey, (*mr).rkey);
        let raddr = laddr + SIZE as u64;
        let mut wc = [sys::ibv_wc::default(); 1];
        for i in 0..n {
            if ex {
                sys::ibv_wr_start(qpx);
                (*qpx).wr_id = i;
                (*qpx).wr_flags = sys::IBV_SEND_SIGNALED;
                sys::ibv_wr_rdma_write(qpx, rkey, raddr);
                sys::ibv_wr_set_sge(qpx, lkey, laddr, SIZE as u32);
                if sys::ibv_wr_complete(qpx) != 0 {
                    die("ibv_wr_complete");
                }
            } else {
                let mut sge = sys::ibv_sge { addr: laddr, length: SIZE as u32, lkey };
                let mut wr = sys::ibv_send_wr {
                    wr_id: i,
                    sg_list: &mut sge,
                    num_sge: 1,
                    opcode: sys::IBV_WR_RDMA_WRITE,
                    send_flags: sys::IBV_SEND_SIGNALED,
                    ..Default::default()
                };
                wr.wr.rdma.remote_addr = raddr;
                wr.wr.rdma.rkey = rkey;
                let mut bad = null_mut();
                if sys::ibv_post_send(a, &mut wr, &mut bad) != 0 {
                    die("ibv_post_send");
                }
            }
            loop {
                let got = sys::ibv_poll_cq(cq, 1, wc.as_mut_ptr());
                if got < 0 {
                    die("ibv_poll_cq");
                }
                if got == 1 {
                    if wc[0].status != sys::IBV_WC_SUCCESS {
                        eprintln!("post_paths: write {i} completed with status {}", wc[0].status);
                        std::process::exit(1);
                    }
                    break;
                }
            }
        }
        println!("post_paths: {} {n} writes of {SIZE} bytes completed", if ex { "ex" } else { "post" });
    }
}
