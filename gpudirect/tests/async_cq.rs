//! Awaitable completions and async events (feature `tokio`) against a
//! real RDMA device (Soft-RoCE in the test bed), under a multi-threaded
//! tokio runtime. Ignored by default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect --test async_cq -- --ignored
//! ```
//!
//! Every wait is bounded: a lost wakeup fails the test instead of hanging it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{connect_pair, device};
use testkit::pattern;

use gpudirect::{
    AccessFlags, AsyncCompletionQueue, AsyncEvent, AsyncEvents, CompletionQueue, Context, Error, MemoryRegion,
    ProtectionDomain, QpConfig, QueuePair, RecvWr, SendWr, SharedReceiveQueue, SrqConfig, WcOpcode, WorkCompletion,
};

const BOUND: Duration = Duration::from_secs(60);

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build().unwrap()
}

/// Queue pairs connected to each other, every one completing on `cq`.
fn pairs(pd: &ProtectionDomain, cq: &CompletionQueue, n: usize) -> Vec<(QueuePair, QueuePair)> {
    (0..n)
        .map(|_| {
            let config = QpConfig { max_send_wr: 64, max_recv_wr: 8, ..QpConfig::default() };
            connect_pair(QueuePair::create(pd, cq, cq, &config).unwrap(), QueuePair::create(pd, cq, cq, &config).unwrap())
        })
        .collect()
}

/// Four tasks on four worker threads each post 2,000 writes (batches of
/// eight, the last signaled) on their own queue pair and await each
/// batch's completion by id, all through one completion queue: 1,000
/// awaited completions, each usually a sleep on the channel and a wakeup,
/// none lost, every byte where it was written.
#[test]
#[ignore = "needs an RDMA device"]
fn thousands_of_requests_from_several_tasks() {
    const TASKS: usize = 4;
    const BATCHES: usize = 250;
    const BATCH: usize = 8;
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 1024).unwrap();
    let qps = pairs(&pd, &cq, TASKS);
    let rt = runtime();
    let acq = Arc::new(rt.block_on(async { AsyncCompletionQueue::new(&cq) }).unwrap());
    let mut handles: Vec<tokio::task::JoinHandle<gpudirect::Result<()>>> = Vec::new();
    for (t, (qp, peer)) in qps.into_iter().enumerate() {
        let (pd, acq) = (pd.clone(), acq.clone());
        handles.push(rt.spawn(async move {
            let src = MemoryRegion::alloc(&pd, BATCH * 64, AccessFlags::default())?;
            let dst = MemoryRegion::alloc(&pd, BATCHES * BATCH * 64, AccessFlags::REMOTE_WRITE)?;
            for b in 0..BATCHES {
                src.write_at(0, &pattern(BATCH * 64, (t * BATCHES + b) as u64))?;
                let wrs = (0..BATCH)
                    .map(|k| {
                        let wr = SendWr::write(src.slice(k * 64..k * 64 + 64)?, &dst.remote(), ((b * BATCH + k) * 64) as u64)?;
                        Ok(if k + 1 == BATCH { wr.wr_id((t * BATCHES + b) as u64) } else { wr.unsignaled() })
                    })
                    .collect::<gpudirect::Result<Vec<_>>>()?;
                qp.post_send(&wrs)?;
                let wc = tokio::time::timeout(BOUND, acq.completion((t * BATCHES + b) as u64))
                    .await
                    .map_err(|_| Error::Timeout(BOUND))??;
                assert_eq!(wc.ok()?.opcode, WcOpcode::RdmaWrite);
            }
            for b in 0..BATCHES {
                let mut got = vec![0; BATCH * 64];
                dst.read_at(b * BATCH * 64, &mut got)?;
                assert_eq!(got, pattern(BATCH * 64, (t * BATCHES + b) as u64), "task {t} batch {b}");
            }
            drop(peer);
            Ok(())
        }));
    }
    rt.block_on(async {
        for h in handles {
            h.await.unwrap().unwrap();
        }
    });
}

/// One task polls while another posts: `poll` hands every completion out
/// once, in order, waking as they come.
#[test]
#[ignore = "needs an RDMA device"]
fn a_polling_task_sees_every_completion_once() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 256).unwrap();
    let (qp, _peer) = pairs(&pd, &cq, 1).pop().unwrap();
    let rt = runtime();
    let acq = Arc::new(rt.block_on(async { AsyncCompletionQueue::new(&cq) }).unwrap());
    let src = MemoryRegion::alloc(&pd, 64, AccessFlags::default()).unwrap();
    let dst = MemoryRegion::alloc(&pd, 64, AccessFlags::REMOTE_WRITE).unwrap();
    const N: u64 = 2000;
    let poller = {
        let acq = acq.clone();
        rt.spawn(async move {
            let mut seen = Vec::new();
            let mut wc = [WorkCompletion::default(); 16];
            while seen.len() < N as usize {
                let n = tokio::time::timeout(BOUND, acq.poll(&mut wc)).await.expect("a lost wakeup").unwrap();
                seen.extend(wc[..n].iter().map(|c| c.wr_id));
            }
            seen
        })
    };
    let post_all = async {
        for i in 0..N {
            // Room is bounded by the queue, and freed by the poller's reaping.
            loop {
                match qp.post_send(&[SendWr::write(src.slice(..).unwrap(), &dst.remote(), 0).unwrap().wr_id(i)]) {
                    Err(Error::QueueFull { .. }) => tokio::time::sleep(Duration::from_micros(100)).await,
                    r => break r.unwrap(),
                }
            }
            if i % 100 == 0 {
                tokio::task::yield_now().await;
            }
        }
    };
    rt.block_on(async { tokio::time::timeout(BOUND, post_all).await }).expect("the poller stopped reaping: a lost wakeup");
    let seen = rt.block_on(poller).unwrap();
    assert_eq!(seen, (0..N).collect::<Vec<_>>());
}

/// A waiting future dropped before its completion (a timeout here) is
/// harmless: the receive stays posted and its memory held until the
/// completion is reaped, and a later wait gets that completion.
#[test]
#[ignore = "needs an RDMA device"]
fn a_cancelled_wait_keeps_the_memory_held() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 256).unwrap();
    let (a, b) = pairs(&pd, &cq, 1).pop().unwrap();
    let rt = runtime();
    let acq = rt.block_on(async { AsyncCompletionQueue::new(&cq) }).unwrap();
    let inbox = MemoryRegion::alloc(&pd, 64, AccessFlags::default()).unwrap();
    b.post_recv(&[RecvWr::new(inbox.slice(..).unwrap()).wr_id(5)]).unwrap();
    let early = rt.block_on(async { tokio::time::timeout(Duration::from_millis(100), acq.completion(5)).await });
    assert!(early.is_err(), "nothing was sent yet");
    assert!(matches!(inbox.read_at(0, &mut [0; 4]), Err(Error::Busy { .. })), "still the NIC's");
    let src = MemoryRegion::alloc(&pd, 64, AccessFlags::default()).unwrap();
    src.write_at(0, &pattern(64, 3)).unwrap();
    a.post_send(&[SendWr::send(src.slice(..).unwrap()).wr_id(6)]).unwrap();
    let wc = rt.block_on(async { tokio::time::timeout(BOUND, acq.completion(5)).await }).unwrap().unwrap();
    assert_eq!((wc.opcode, wc.byte_len), (WcOpcode::Recv, 64));
    let mut got = vec![0; 64];
    inbox.read_at(0, &mut got).unwrap();
    assert_eq!(got, pattern(64, 3));
    // The send's completion was reaped along the way and waits its turn.
    let wc = rt.block_on(async { tokio::time::timeout(BOUND, acq.completion(6)).await }).unwrap().unwrap();
    assert_eq!(wc.opcode, WcOpcode::Send);
}

/// The shared receive queue's limit event arrives through `AsyncEvents`;
/// outside a runtime, watching is refused with an error, not a panic.
#[test]
#[ignore = "needs an RDMA device"]
fn async_events_deliver_the_srq_limit() {
    let ctx = Context::open(Some(&device())).unwrap();
    let pd = ProtectionDomain::new(&ctx).unwrap();
    let cq = CompletionQueue::new(&ctx, 256).unwrap();
    assert!(matches!(AsyncCompletionQueue::new(&cq), Err(Error::InvalidArgument(ref m)) if m.contains("tokio runtime")));
    assert!(matches!(AsyncEvents::new(&ctx), Err(Error::InvalidArgument(_))));
    let srq = SharedReceiveQueue::new(&pd, &SrqConfig { max_wr: 8, max_sge: 1 }).unwrap();
    let config = QpConfig { max_send_wr: 8, max_recv_wr: 8, ..QpConfig::default() };
    let (a, _b) = connect_pair(
        QueuePair::create(&pd, &cq, &cq, &config).unwrap(),
        QueuePair::create_with_srq(&pd, &cq, &cq, &srq, &config).unwrap(),
    );
    let inbox = MemoryRegion::alloc(&pd, 8 * 64, AccessFlags::default()).unwrap();
    let recvs: Vec<RecvWr> = (0..8).map(|k| RecvWr::new(inbox.slice(k * 64..k * 64 + 64).unwrap())).collect();
    srq.post_recv(&recvs).unwrap();
    srq.arm_limit(6).unwrap();
    let rt = runtime();
    rt.block_on(async {
        let events = AsyncEvents::new(&ctx).unwrap();
        let acq = AsyncCompletionQueue::new(&cq).unwrap();
        let waiter = tokio::spawn(async move { tokio::time::timeout(BOUND, events.recv()).await });
        let src = MemoryRegion::alloc(&pd, 64, AccessFlags::default()).unwrap();
        for i in 0..3 {
            a.post_send(&[SendWr::send(src.slice(..).unwrap()).wr_id(100 + i)]).unwrap();
            tokio::time::timeout(BOUND, acq.completion(100 + i)).await.unwrap().unwrap().ok().unwrap();
        }
        let event = waiter.await.unwrap().expect("the limit event").unwrap();
        assert_eq!(event, AsyncEvent::SrqLimitReached(srq.id()));
    });
}
