//! Setup shared by the one-host device tests (`rxe`, `rcache`): the device
//! under test and a process talking to itself over a connected queue pair.
//! Each test binary uses part of it (`rcache` never reads side `b`, which
//! only keeps the twin connected).
#![allow(dead_code)]

use std::time::Duration;

use gpudirect::{CompletionQueue, Context, ProtectionDomain, QpConfig, QueuePair, WorkCompletion};

/// Longest wait for one completion before the test fails.
pub const TIMEOUT: Duration = Duration::from_secs(60);

/// The RDMA device named by `GPUDIRECT_TEST_DEVICE` (testbed/run sets it).
pub fn device() -> String {
    std::env::var("GPUDIRECT_TEST_DEVICE")
        .expect("set GPUDIRECT_TEST_DEVICE to the RDMA device to test (e.g. rxe0); testbed/run sets it")
}

/// One side of a loopback connection.
pub struct Side {
    pub cq: CompletionQueue,
    pub qp: QueuePair,
}

/// Two queue pairs of one process connected to each other, so work posted
/// on `a` reaches this process's own regions through the NIC, by rkey,
/// exactly as a peer's would.
pub struct Loopback {
    pub pd: ProtectionDomain,
    pub a: Side,
    pub b: Side,
}

pub fn loopback(config: &QpConfig) -> Loopback {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq_a = CompletionQueue::new(&ctx, 256).unwrap();
    let cq_b = CompletionQueue::new(&ctx, 256).unwrap();
    let qa = QueuePair::create(&pd, &cq_a, &cq_a, config).unwrap();
    let qb = QueuePair::create(&pd, &cq_b, &cq_b, config).unwrap();
    let (ea, eb) = (qa.endpoint(), qb.endpoint());
    Loopback {
        pd,
        a: Side { cq: cq_a, qp: qa.connect(&eb).unwrap() },
        b: Side { cq: cq_b, qp: qb.connect(&ea).unwrap() },
    }
}

/// Waits for exactly one completion.
pub fn wait_one(cq: &CompletionQueue) -> WorkCompletion {
    let mut wc = [WorkCompletion::default(); 1];
    let n = cq.wait(&mut wc, Some(TIMEOUT)).unwrap();
    assert_eq!(n, 1);
    wc[0]
}
