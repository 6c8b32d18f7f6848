//! The transfer engine on a real RDMA device (Soft-RoCE in the test bed),
//! two or more agents in one process. Ignored by default; run with
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=rxe0 cargo test -p gpudirect-engine --test engine -- --ignored
//! ```
//! Between two hosts: `examples/kv_transfer.rs` (testbed/test-all runs it).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, EngineError, Op, RendezvousServer, TcpRendezvous, TransferStats, TransferStatus, MAX_NOTIFICATION};
use testkit::{device, pattern};

const T: Option<Duration> = Some(Duration::from_secs(20));

/// Sets its flag when dropped: a test's helper threads stop also when an
/// assertion panics (their scope would otherwise wait for them forever).
struct StopOnDrop<'a>(&'a std::sync::atomic::AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

fn agent(name: &str) -> Agent {
    let mut c = AgentConfig::named(name);
    c.devices = vec![device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    Agent::new(c).unwrap()
}

/// Metadata as a peer gets it: through its binary form.
fn md(a: &Agent) -> AgentMetadata {
    AgentMetadata::decode(&a.metadata().encode().unwrap()).unwrap()
}

/// A prefill agent writes 8 layers of 16 blocks into a decode agent's
/// table with one notification per layer, reposting the same prepared
/// requests for 10 steps. The decode side checks every byte of a layer
/// the moment that layer's notification arrives: the notification never
/// comes before its data.
#[test]
#[ignore = "needs an RDMA device"]
fn layer_writes_with_notifications_arrive_after_their_data() {
    const LAYERS: usize = 8;
    const BLOCKS: usize = 16;
    const BLOCK: usize = 64 * 1024;
    const LAYER: usize = BLOCKS * BLOCK;
    let prefill = agent("prefill-0");
    let decode = agent("decode-0");
    let kv = prefill.alloc("kv", LAYERS * LAYER).unwrap();
    let table = decode.alloc("kv-table", LAYERS * LAYER).unwrap();
    assert_eq!(kv.paths(), vec![(device(), gpudirect::Location::Host)]);
    let peer = prefill.load_remote(&md(&decode)).unwrap();
    let remote = peer.memory("kv-table").unwrap();
    // Blocks land in reverse order in the table, as a block table maps them.
    let reqs: Vec<_> = (0..LAYERS)
        .map(|l| {
            let entries: Vec<_> = (0..BLOCKS)
                .map(|b| {
                    let src = l * LAYER + b * BLOCK;
                    let dst = (l * LAYER + (BLOCKS - 1 - b) * BLOCK) as u64;
                    (kv.range(src..src + BLOCK).unwrap(), remote.range(dst..dst + BLOCK as u64).unwrap())
                })
                .collect();
            prefill.prepare(Op::Write, &entries, Some(format!("layer {l}").as_bytes())).unwrap()
        })
        .collect();
    assert_eq!(prefill.connections(), 0, "connections are made on first use");
    let started = Instant::now();
    for step in 0..10u64 {
        let data = pattern(LAYERS * LAYER, step);
        kv.write_at(0, &data).unwrap();
        for r in &reqs {
            r.post().unwrap();
        }
        let mut seen = [false; LAYERS];
        for _ in 0..LAYERS {
            let n = decode.wait_notification(T).unwrap();
            assert_eq!(n.peer, "prefill-0");
            let l: usize = std::str::from_utf8(&n.msg).unwrap().strip_prefix("layer ").unwrap().parse().unwrap();
            assert!(!seen[l], "layer {l} notified twice");
            seen[l] = true;
            let mut got = vec![0; LAYER];
            table.read_at(l * LAYER, &mut got).unwrap();
            for b in 0..BLOCKS {
                let want = &data[l * LAYER + b * BLOCK..][..BLOCK];
                let at = (BLOCKS - 1 - b) * BLOCK;
                assert!(got[at..at + BLOCK] == *want, "step {step} layer {l} block {b}: notification before its data");
            }
        }
        for r in &reqs {
            r.wait(T).unwrap();
            assert_eq!(r.status().unwrap(), TransferStatus::Done);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!("10 steps of {} MiB: {:.1} MB/s", (LAYERS * LAYER) >> 20, 10.0 * (LAYERS * LAYER) as f64 / secs / 1e6);
    assert!(decode.notifications().unwrap().is_empty(), "no notification beyond one per layer per step");
    assert_eq!((prefill.connections(), decode.connections()), (1, 1));
    let layer = TransferStats { posts: 10, bytes: 10 * LAYER as u64, completed: 10, failed: 0, refused: 0, connects: 0 };
    assert_eq!(reqs[1].stats(), layer, "a layer's request: 10 posts, no connection of its own");
    assert_eq!(reqs[0].stats().connects, 1, "the first post made the connection");
    let all = TransferStats { posts: 80, bytes: 80 * LAYER as u64, completed: 80, failed: 0, refused: 0, connects: 1 };
    assert_eq!(prefill.peer_stats("decode-0"), Some(all));
    assert_eq!(prefill.peer_stats("nobody"), None);
}

/// Reads pull a peer's memory; a transfer longer than the send queue
/// (300 entries on 128-deep queues) goes out whole.
#[test]
#[ignore = "needs an RDMA device"]
fn reads_and_long_lists() {
    let a = agent("a");
    let b = agent("b");
    let theirs = b.alloc("src", 300 * 4096).unwrap();
    let data = pattern(300 * 4096, 7);
    theirs.write_at(0, &data).unwrap();
    let mine = a.alloc("dst", 300 * 4096).unwrap();
    let remote = a.load_remote(&md(&b)).unwrap().memory("src").unwrap();
    let entries: Vec<_> = (0..300)
        .map(|i| (mine.range(i * 4096..(i + 1) * 4096).unwrap(), remote.range(i as u64 * 4096..(i as u64 + 1) * 4096).unwrap()))
        .collect();
    let read = a.prepare(Op::Read, &entries, None).unwrap();
    assert_eq!(read.status().unwrap(), TransferStatus::Idle);
    read.post().unwrap();
    read.wait(T).unwrap();
    let mut got = vec![0; data.len()];
    mine.read_at(0, &mut got).unwrap();
    assert!(got == data, "read data differs");
    // The same entries as writes, the other way round, with a notification.
    mine.fill(.., 0x5a).unwrap();
    let write = a.prepare(Op::Write, &entries, Some(b"all 300")).unwrap();
    write.post().unwrap();
    assert_eq!(b.wait_notification(T).unwrap().msg, b"all 300");
    theirs.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0x5a));
    write.wait(T).unwrap();
}

/// A read with a notification: the target gets the notification only
/// once the initiator has every byte it read (the initiator sends it after
/// reaping the read's completion), so the target may reuse its memory the
/// moment it arrives.
#[test]
#[ignore = "needs an RDMA device"]
fn a_read_notifies_the_target_after_the_initiator_has_the_bytes() {
    const LEN: usize = 4 << 20;
    let (a, b) = (agent("reader"), agent("owner"));
    let mine = a.alloc("into", LEN).unwrap();
    let theirs = b.alloc("from", LEN).unwrap();
    let remote = a.load_remote(&md(&b)).unwrap().memory("from").unwrap();
    // Eight entries, the last two cut elsewhere than they land.
    let entries: Vec<_> = (0..8)
        .map(|i| {
            let at = i * (LEN / 8);
            (mine.range(at..at + LEN / 8).unwrap(), remote.range(at as u64..(at + LEN / 8) as u64).unwrap())
        })
        .collect();
    let req = a.prepare(Op::Read, &entries, Some(b"read it")).unwrap();
    for step in 0..4u64 {
        let data = pattern(LEN, step);
        theirs.write_at(0, &data).unwrap();
        req.post().unwrap();
        std::thread::scope(|s| {
            let owner = s.spawn(|| {
                let n = b.wait_notification(T).unwrap();
                assert_eq!((n.peer.as_str(), &n.msg[..]), ("reader", &b"read it"[..]));
                // The reader has the bytes already; the owner overwrites its own.
                let mut got = vec![0; LEN];
                mine.read_at(0, &mut got).unwrap();
                assert!(got == data, "step {step}: the notification came before the read's bytes");
                theirs.fill(.., 0xee).unwrap();
            });
            req.wait(T).unwrap();
            owner.join().unwrap();
        });
    }
}

/// Bad requests are typed errors before anything is sent.
#[test]
#[ignore = "needs an RDMA device"]
fn bad_requests_are_typed_errors() {
    let a = agent("a");
    let b = agent("b");
    let c = agent("c");
    let mine = a.alloc("m", 8192).unwrap();
    assert!(matches!(a.alloc("m", 10), Err(EngineError::DuplicateName(n)) if n == "m"));
    b.alloc("t", 4096).unwrap();
    c.alloc("t", 4096).unwrap();
    let pb = a.load_remote(&md(&b)).unwrap();
    let pc = a.load_remote(&md(&c)).unwrap();
    assert!(matches!(pb.memory("nope"), Err(EngineError::UnknownMemory { .. })));
    assert!(matches!(a.peer("zz"), Err(EngineError::UnknownPeer(_))));
    assert!(matches!(a.load_remote(&a.metadata()), Err(EngineError::Config(_))));
    let tb = pb.memory("t").unwrap();
    let tc = pc.memory("t").unwrap();
    assert!(matches!(mine.range(0..8193), Err(gpudirect::Error::OutOfBounds { .. })));
    assert!(matches!(tb.range(4000..4097), Err(gpudirect::Error::OutOfBounds { .. })));
    assert!(matches!(a.prepare(Op::Write, &[], None), Err(EngineError::EmptyRequest)));
    let (l, r) = (mine.range(0..100).unwrap(), tb.range(0..99).unwrap());
    assert!(matches!(a.prepare(Op::Write, &[(l.clone(), r)], None), Err(EngineError::LengthMismatch { index: 0, local: 100, remote: 99 })));
    let both = [(l.clone(), tb.range(0..100).unwrap()), (l.clone(), tc.range(0..100).unwrap())];
    assert!(matches!(a.prepare(Op::Write, &both, None), Err(EngineError::MixedPeers { index: 1, .. })));
    let one = [(l, tb.range(0..100).unwrap())];
    let long = vec![0; MAX_NOTIFICATION + 1];
    assert!(matches!(a.prepare(Op::Write, &one, Some(&long)), Err(EngineError::NotificationTooLong { .. })));
    // A request posted twice before it finished.
    let req = a.prepare(Op::Write, &one, Some(&long[..MAX_NOTIFICATION])).unwrap();
    req.post().unwrap();
    match req.post() {
        Err(EngineError::InFlight) => req.wait(T).unwrap(),
        Ok(()) => panic!("a second post while the first is in flight was accepted"),
        Err(e) => panic!("{e}"),
    }
    req.wait(T).unwrap();
    assert_eq!(b.wait_notification(T).unwrap().msg.len(), MAX_NOTIFICATION);
    let s = req.stats();
    assert_eq!((s.posts, s.completed, s.refused), (1, 1, 1), "the refused repost is counted: {s:?}");
}

/// Control connections that open and say nothing (a peer stuck mid-setup,
/// a port scan) do not hold up the agents behind them: each request is
/// served on its own thread, so a connection set up behind three silent
/// ones takes milliseconds, not their 10 s bound each.
#[test]
#[ignore = "needs an RDMA device"]
fn silent_control_connections_do_not_hold_up_other_peers() {
    let target = agent("stall-target");
    let a = agent("stall-a");
    target.alloc("dst", 4096).unwrap();
    let src = a.alloc("src", 4096).unwrap();
    src.write_at(0, &pattern(4096, 5)).unwrap();
    let silent: Vec<std::net::TcpStream> = (0..3).map(|_| std::net::TcpStream::connect(target.control_addr()).unwrap()).collect();
    // Let the listener take them first.
    std::thread::sleep(Duration::from_millis(200));
    let peer = a.load_remote(&md(&target)).unwrap();
    let req = a.prepare(Op::Write, &[(src.range(..).unwrap(), peer.memory("dst").unwrap().range(..).unwrap())], Some(b"through")).unwrap();
    let started = Instant::now();
    req.post().unwrap();
    req.wait(T).unwrap();
    let took = started.elapsed();
    println!("connection and write behind 3 silent control connections: {took:?}");
    assert!(took < Duration::from_secs(5), "the setup waited behind the silent connections: {took:?}");
    assert_eq!(target.wait_notification(T).unwrap().msg, b"through");
    assert_eq!(a.peer_stats("stall-target").unwrap().connects, 1);
    drop(silent);
}

/// A peer that goes away fails the transfers to it with PeerLost within
/// the queue pair's retry bound, and only those; a peer of the same name
/// started again is reached by the next transfer (a new connection).
#[test]
#[ignore = "needs an RDMA device"]
fn a_dead_peer_fails_only_its_transfers_and_a_restarted_one_is_reconnected() {
    let a = agent("a");
    let mine = a.alloc("m", 1 << 20).unwrap();
    let alive = agent("alive");
    alive.alloc("t", 1 << 20).unwrap();
    let to_alive = a.load_remote(&md(&alive)).unwrap().memory("t").unwrap();
    let ok = a.prepare(Op::Write, &[(mine.range(..).unwrap(), to_alive.range(..).unwrap())], Some(b"ok")).unwrap();
    let doomed = agent("doomed");
    doomed.alloc("t", 1 << 20).unwrap();
    let to_doomed = a.load_remote(&md(&doomed)).unwrap().memory("t").unwrap();
    let lost = a.prepare(Op::Write, &[(mine.range(..).unwrap(), to_doomed.range(..).unwrap())], None).unwrap();
    lost.post().unwrap();
    lost.wait(T).unwrap();
    ok.post().unwrap();
    ok.wait(T).unwrap();
    drop(doomed);
    let started = Instant::now();
    lost.post().unwrap();
    ok.post().unwrap();
    match lost.wait(T) {
        Err(EngineError::PeerLost { peer, completion }) => {
            assert_eq!(peer, "doomed");
            println!("dead peer reported after {:?}: {completion}", started.elapsed());
        }
        r => panic!("a write to a dead peer gave {r:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    assert!(matches!(lost.status(), Err(EngineError::PeerLost { .. })), "the failure is reported until the next post");
    let (events, dropped) = a.peer_events();
    assert!(matches!(&events[..], [gpudirect_engine::PeerEvent::Lost { peer, .. }] if peer == "doomed"), "{events:?}");
    assert_eq!(dropped, 0);
    let s = lost.stats();
    assert_eq!((s.posts, s.completed, s.failed, s.connects), (2, 1, 1, 1), "{s:?}");
    ok.wait(T).unwrap();
    assert_eq!(alive.wait_notification(T).unwrap().msg, b"ok");
    assert_eq!(alive.wait_notification(T).unwrap().msg, b"ok");
    // Started again under the same name, at a new address: reloading its
    // metadata is all it takes.
    let again = agent("doomed");
    let t = again.alloc("t", 1 << 20).unwrap();
    let to_again = a.load_remote(&md(&again)).unwrap().memory("t").unwrap();
    mine.fill(.., 0xc3).unwrap();
    let req = a.prepare(Op::Write, &[(mine.range(..).unwrap(), to_again.range(..).unwrap())], Some(b"back")).unwrap();
    req.post().unwrap();
    assert_eq!(again.wait_notification(T).unwrap().msg, b"back");
    req.wait(T).unwrap();
    let s = a.peer_stats("doomed").unwrap();
    assert_eq!((s.posts, s.completed, s.failed, s.connects), (3, 2, 1, 2), "the reconnect is counted: {s:?}");
    assert_eq!(s.bytes, 3 << 20);
    assert!(t.range(..).is_ok());
    let mut got = vec![0; 1 << 20];
    t.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 0xc3));
}

/// Four threads post their own requests to one target at once, 50 times
/// each (8 under valgrind); the target gets every notification exactly once.
#[test]
#[ignore = "needs an RDMA device"]
fn threads_post_at_once_and_no_notification_is_lost() {
    const THREADS: usize = 4;
    // Fewer under valgrind (testbed/sanitize --threads sets it).
    let rounds: usize = if std::env::var_os("GPUDIRECT_SOUNDNESS_QUICK").is_some() { 8 } else { 50 };
    let a = agent("a");
    let b = agent("b");
    let src = a.alloc("src", THREADS * 65536).unwrap();
    b.alloc("dst", THREADS * 65536).unwrap();
    let dst = a.load_remote(&md(&b)).unwrap().memory("dst").unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..THREADS)
            .map(|t| {
                let (a, src, dst) = (&a, &src, &dst);
                s.spawn(move || {
                    let off = t * 65536;
                    let entry = [(src.range(off..off + 65536).unwrap(), dst.range(off as u64..off as u64 + 65536).unwrap())];
                    let mut reqs = Vec::new();
                    for r in 0..rounds {
                        let req = a.prepare(Op::Write, &entry, Some(format!("{t}/{r}").as_bytes())).unwrap();
                        req.post().unwrap();
                        req.wait(T).unwrap();
                        reqs.push(req);
                    }
                })
            })
            .collect();
        let mut seen = std::collections::HashSet::new();
        while seen.len() < THREADS * rounds {
            let n = b.wait_notification(T).unwrap();
            assert!(seen.insert(n.msg.clone()), "notification {:?} twice", String::from_utf8_lossy(&n.msg));
        }
        for h in hs {
            h.join().unwrap();
        }
    });
    assert!(b.notifications().unwrap().is_empty());
}

/// A target with 4 notification slots takes 3 rounds of 8 notifications
/// from 8 requests posted at once: receives are reposted as they are
/// reaped, and a burst larger than the slots waits (receiver not ready,
/// retried) instead of failing.
#[test]
#[ignore = "needs an RDMA device"]
fn a_small_receive_queue_takes_bursts_larger_than_itself() {
    let a = agent("a");
    let mut c = AgentConfig::named("small");
    c.devices = vec![device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.srq_depth = 4;
    let b = Agent::new(c).unwrap();
    let src = a.alloc("src", 4096).unwrap();
    b.alloc("dst", 8 * 4096).unwrap();
    let dst = a.load_remote(&md(&b)).unwrap().memory("dst").unwrap();
    let reqs: Vec<_> = (0..8u64)
        .map(|i| a.prepare(Op::Write, &[(src.range(..).unwrap(), dst.range(i * 4096..(i + 1) * 4096).unwrap())], Some(&[i as u8])).unwrap())
        .collect();
    for round in 0..3 {
        for r in &reqs {
            r.post().unwrap();
        }
        let mut seen = [false; 8];
        for _ in 0..8 {
            let n = b.wait_notification(T).unwrap();
            assert!(!std::mem::replace(&mut seen[n.msg[0] as usize], true), "round {round}: {:?} twice", n.msg);
        }
        for r in &reqs {
            r.wait(T).unwrap();
        }
    }
}

/// At its connection limit an agent evicts the least recently used idle
/// connection (its peer closes its end too) and never one a post still
/// holds; notifications that arrived on a connection closed since still
/// name their sender.
#[test]
#[ignore = "needs an RDMA device"]
fn idle_connections_are_evicted_at_the_limit_and_busy_ones_kept() {
    let mut c = AgentConfig::named("hub");
    c.devices = vec![device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.max_connections = 2;
    let hub = Agent::new(c).unwrap();
    let src = hub.alloc("src", 4096).unwrap();
    let peers: Vec<Agent> = (0..3).map(|i| agent(&format!("p{i}"))).collect();
    let reqs: Vec<_> = peers
        .iter()
        .enumerate()
        .map(|(i, p)| {
            p.alloc("t", 4096).unwrap();
            let t = hub.load_remote(&md(p)).unwrap().memory("t").unwrap();
            hub.prepare(Op::Write, &[(src.range(..).unwrap(), t.range(..).unwrap())], Some(format!("to p{i}").as_bytes())).unwrap()
        })
        .collect();
    let round = |i: usize| {
        reqs[i].post().unwrap();
        reqs[i].wait(T).unwrap();
    };
    round(0);
    round(1);
    assert_eq!((hub.connections(), peers[0].connections(), peers[1].connections()), (2, 1, 1));
    // A third peer: p0's connection is the least recently used.
    round(2);
    assert_eq!(hub.connections(), 2);
    assert_eq!(peers.iter().map(Agent::connections).collect::<Vec<_>>(), vec![0, 1, 1], "p0 closed its end when asked");
    // Both connections held by posts not yet reaped: none is evicted.
    reqs[1].post().unwrap();
    reqs[2].post().unwrap();
    match reqs[0].post() {
        Err(EngineError::TooManyConnections { max: 2 }) => {}
        r => panic!("a post needing a third connection while both are busy gave {r:?}"),
    }
    assert_eq!(reqs[0].status().unwrap(), TransferStatus::Done, "the refused post left the last one's state");
    reqs[1].wait(T).unwrap();
    reqs[2].wait(T).unwrap();
    // Now p1's is the least recently used, and idle.
    round(0);
    assert_eq!(peers.iter().map(Agent::connections).collect::<Vec<_>>(), vec![1, 0, 1]);
    for (i, p) in peers.iter().enumerate() {
        for _ in 0..2 {
            let n = p.wait_notification(T).unwrap();
            assert_eq!((n.peer.as_str(), n.msg), ("hub", format!("to p{i}").into_bytes()));
        }
        assert!(p.notifications().unwrap().is_empty());
    }
}

/// Agents find each other by name through the embedded rendezvous. With
/// the server gone, transfers over existing connections go on, peers
/// loaded stay known, and a new lookup fails with a typed error; once it
/// is back (same address), lookups work again.
#[test]
#[ignore = "needs an RDMA device"]
fn agents_meet_through_the_rendezvous_and_outlive_its_outage() {
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr();
    let rdv = TcpRendezvous::new(addr, Duration::from_secs(2)).unwrap();
    let (a, b, c) = (agent("a"), agent("b"), agent("c"));
    let src = a.alloc("src", 1 << 16).unwrap();
    b.alloc("t", 1 << 16).unwrap();
    c.alloc("t", 1 << 16).unwrap();
    b.publish(&rdv).unwrap();
    let to_b = a.lookup("b", &rdv, Duration::from_secs(5)).unwrap().memory("t").unwrap();
    let req = a.prepare(Op::Write, &[(src.range(..).unwrap(), to_b.range(..).unwrap())], Some(b"via rendezvous")).unwrap();
    req.post().unwrap();
    req.wait(T).unwrap();
    assert_eq!(b.wait_notification(T).unwrap().msg, b"via rendezvous");
    c.publish(&rdv).unwrap();
    drop(server);
    req.post().unwrap();
    req.wait(T).unwrap();
    assert_eq!(b.wait_notification(T).unwrap().msg, b"via rendezvous", "the outage does not touch connections");
    assert!(a.peer("b").is_ok(), "peers loaded stay known");
    match a.lookup("c", &rdv, Duration::from_secs(1)) {
        Err(EngineError::Rendezvous { server, .. }) => assert_eq!(server, addr.to_string()),
        r => panic!("a lookup during the outage gave {r:?}"),
    }
    let _back = RendezvousServer::bind(addr).unwrap();
    // A fresh server knows nobody until they publish again.
    assert!(matches!(a.lookup("c", &rdv, Duration::from_millis(100)), Err(EngineError::NotPublished { .. })));
    c.publish(&rdv).unwrap();
    let to_c = a.lookup("c", &rdv, Duration::from_secs(5)).unwrap().memory("t").unwrap();
    let req = a.prepare(Op::Write, &[(src.range(..).unwrap(), to_c.range(..).unwrap())], Some(b"after")).unwrap();
    req.post().unwrap();
    req.wait(T).unwrap();
    assert_eq!(c.wait_notification(T).unwrap().msg, b"after");
}

/// What the async tests share: a prefill agent with `blocks` blocks of
/// `block` bytes, a decode agent with a table as large, one prepared
/// write of block `b` into the table's block `b` with notification `"b"`
/// per block, and an 8-byte write without one (for a thread to reap the
/// prefill's send CQ through its `status`).
struct BlockWrites {
    prefill: Agent,
    decode: Agent,
    src: gpudirect_engine::Registration,
    table: gpudirect_engine::Registration,
    reqs: Vec<std::sync::Arc<gpudirect_engine::TransferRequest>>,
    idle: gpudirect_engine::TransferRequest,
}

fn block_writes(prefix: &str, blocks: usize, block: usize) -> BlockWrites {
    let prefill = agent(&format!("{prefix}prefill"));
    let decode = agent(&format!("{prefix}decode"));
    let src = prefill.alloc("src", blocks * block).unwrap();
    let table = decode.alloc("t", blocks * block).unwrap();
    let remote = prefill.load_remote(&md(&decode)).unwrap().memory("t").unwrap();
    let reqs = (0..blocks)
        .map(|b| {
            let (s, e) = (b * block, (b + 1) * block);
            let entry = (src.range(s..e).unwrap(), remote.range(s as u64..e as u64).unwrap());
            std::sync::Arc::new(prefill.prepare(Op::Write, &[entry], Some(format!("{b}").as_bytes())).unwrap())
        })
        .collect();
    let idle = prefill.prepare(Op::Write, &[(src.range(..8).unwrap(), remote.range(..8).unwrap())], None).unwrap();
    BlockWrites { prefill, decode, src, table, reqs, idle }
}

/// Requests and notifications awaited under tokio (feature `tokio`):
/// eight tasks post and await a request each while the target awaits
/// their notifications and checks each block as its notification
/// arrives, for four rounds: two woken by the completion channels alone,
/// two with a blocking thread reaping the same completion queue all along
/// (a task whose completion another thread reaps still wakes). A notification future dropped by a timeout takes
/// nothing; awaiting from a second runtime is a typed error.
#[test]
#[ignore = "needs an RDMA device"]
fn transfers_and_notifications_can_be_awaited() {
    use std::sync::atomic::{AtomicBool, Ordering};
    const BLOCKS: usize = 8;
    const BLOCK: usize = 64 * 1024;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let BlockWrites { prefill: _prefill, decode, src, table, reqs, idle } = block_writes("", BLOCKS, BLOCK);
    let (stop, reaping) = (AtomicBool::new(false), AtomicBool::new(false));
    std::thread::scope(|s| {
        // Reaps the prefill NIC's send CQ the blocking way, from round 2.
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                if reaping.load(Ordering::Relaxed) {
                    idle.status().unwrap();
                }
                std::thread::yield_now();
            }
        });
        let _stopper = StopOnDrop(&stop);
        rt.block_on(async {
            let nothing = tokio::time::timeout(Duration::from_millis(50), decode.notification()).await;
            assert!(nothing.is_err(), "no notification yet: {nothing:?}");
            for round in 0..4u64 {
                reaping.store(round >= 2, Ordering::Relaxed);
                for b in 0..BLOCKS {
                    src.write_at(b * BLOCK, &pattern(BLOCK, round * 100 + b as u64)).unwrap();
                }
                let tasks: Vec<_> = reqs
                    .iter()
                    .map(|r| {
                        let r = r.clone();
                        tokio::spawn(async move {
                            r.post()?;
                            r.completed().await
                        })
                    })
                    .collect();
                let mut seen = [false; BLOCKS];
                for _ in 0..BLOCKS {
                    let n = tokio::time::timeout(T.unwrap(), decode.notification()).await.expect("a notification in time").unwrap();
                    let b: usize = std::str::from_utf8(&n.msg).unwrap().parse().unwrap();
                    assert!(!std::mem::replace(&mut seen[b], true), "block {b} notified twice");
                    let mut got = vec![0; BLOCK];
                    table.read_at(b * BLOCK, &mut got).unwrap();
                    assert!(got == pattern(BLOCK, round * 100 + b as u64), "round {round} block {b}: bytes not in place at its notification");
                }
                for t in tasks {
                    t.await.unwrap().unwrap();
                }
                assert!(reqs.iter().all(|r| matches!(r.status(), Ok(TransferStatus::Done))));
            }
        });
    });
    assert!(decode.notifications().unwrap().is_empty(), "nothing left over");
    let other = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    match other.block_on(decode.notification()) {
        Err(EngineError::Config(why)) => assert!(why.contains("runtime"), "{why}"),
        r => panic!("awaiting from a second runtime gave {r:?}"),
    }
}

/// The async waits under stress: 40 rounds of 8 writes with
/// notifications, each request's task either awaiting its completion
/// outright or through short timeouts that drop the future (cancel
/// safety), while a blocking thread on each side reaps the same CQs (the
/// prefill's send CQ through another request's `status`, the decode's
/// notifications through `notifications`). Every notification is taken
/// exactly once, by the awaiting task or the blocking thread, with its
/// bytes in place; an outright completion await that lost its wakeup
/// would hang its round past the 20 s bound (rounds take milliseconds).
/// It found the first awaits of two tasks at once racing to register the
/// completion channels (EEXIST from the reactor).
#[test]
#[ignore = "needs an RDMA device"]
fn awaits_under_cancellation_and_blocking_reapers_lose_nothing() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Mutex;
    const ROUNDS: u64 = 40;
    const BLOCKS: usize = 8;
    const BLOCK: usize = 16 * 1024;
    const BOUND: Duration = Duration::from_secs(20);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let BlockWrites { prefill: _prefill, decode, src, table, reqs, idle } = block_writes("stress-", BLOCKS, BLOCK);
    // Notifications taken by either consumer: (round, block).
    let taken: Mutex<Vec<(u64, usize)>> = Mutex::new(Vec::new());
    let round_now = std::sync::atomic::AtomicU64::new(0);
    let check = |n: gpudirect_engine::Notification| {
        let b: usize = std::str::from_utf8(&n.msg).unwrap().parse().unwrap();
        let round = round_now.load(Ordering::SeqCst);
        let mut got = vec![0; BLOCK];
        table.read_at(b * BLOCK, &mut got).unwrap();
        assert!(got == pattern(BLOCK, round * 100 + b as u64), "round {round} block {b}: bytes not in place at its notification");
        taken.lock().unwrap().push((round, b));
    };
    let stop = AtomicBool::new(false);
    let (mut by_task, mut by_thread) = (0usize, 0usize);
    std::thread::scope(|s| {
        let send_reaper = s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                idle.status().unwrap();
                std::thread::yield_now();
            }
        });
        let recv_reaper = s.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                for note in decode.notifications().unwrap() {
                    check(note);
                    n += 1;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            n
        });
        let stopper = StopOnDrop(&stop);
        rt.block_on(async {
            let mut rng = testkit::Rng(15);
            for round in 0..ROUNDS {
                round_now.store(round, Ordering::SeqCst);
                for b in 0..BLOCKS {
                    src.write_at(b * BLOCK, &pattern(BLOCK, round * 100 + b as u64)).unwrap();
                }
                let started = std::time::Instant::now();
                let tasks: Vec<_> = reqs
                    .iter()
                    .map(|r| {
                        let r = r.clone();
                        // Some tasks await outright, the others through
                        // timeouts of 0 to 2 ms that drop the future.
                        let slices = if rng.chance(2) { None } else { Some(Duration::from_micros(rng.below(2000))) };
                        tokio::spawn(async move {
                            r.post()?;
                            match slices {
                                None => tokio::time::timeout(BOUND, r.completed()).await.expect("an outright await hung"),
                                Some(d) => loop {
                                    if let Ok(done) = tokio::time::timeout(d, r.completed()).await {
                                        break done;
                                    }
                                },
                            }
                        })
                    })
                    .collect();
                for t in tasks {
                    t.await.unwrap().unwrap();
                }
                // The rest of the round's notifications, awaited here (or
                // taken meanwhile by the blocking thread).
                loop {
                    let have = taken.lock().unwrap().iter().filter(|(r, _)| *r == round).count();
                    if have == BLOCKS {
                        break;
                    }
                    assert!(started.elapsed() < BOUND, "round {round}: {have} of {BLOCKS} notifications after {BOUND:?}");
                    let wait = if rng.chance(2) { Duration::from_millis(50) } else { Duration::from_micros(rng.below(1000)) };
                    if let Ok(n) = tokio::time::timeout(wait, decode.notification()).await {
                        check(n.unwrap());
                        by_task += 1;
                    }
                }
                assert!(reqs.iter().all(|r| matches!(r.status(), Ok(TransferStatus::Done))), "round {round}");
            }
        });
        drop(stopper);
        send_reaper.join().unwrap();
        by_thread = recv_reaper.join().unwrap();
    });
    let mut all = taken.into_inner().unwrap();
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!((n, all.len()), (ROUNDS as usize * BLOCKS, ROUNDS as usize * BLOCKS), "every notification once");
    assert!(decode.notifications().unwrap().is_empty(), "nothing left over");
    println!("{} notifications: {by_task} awaited, {by_thread} taken by the blocking thread", n);
    assert_eq!(by_task + by_thread, n);
}

/// A broadcast awaited on tokio, in 64 KiB chunks, to four receivers of
/// which one is gone before the post (its agent dropped): the other three
/// get every byte, their own chunks and the dead one's (the source writes
/// those itself), and the broadcast names the dead one alone. Posted
/// twice, new bytes each time.
#[test]
#[ignore = "needs an RDMA device"]
fn a_broadcast_reaches_the_living_receivers_and_names_the_dead_one() {
    const LEN: usize = 1 << 20;
    let source = {
        let mut c = AgentConfig::named("trainer");
        c.devices = vec![device()];
        c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        c.broadcast_chunk = 64 << 10;
        Agent::new(c).unwrap()
    };
    let params = source.alloc("params", LEN).unwrap();
    let mut receivers: Vec<Option<Agent>> = (0..4).map(|i| Some(agent(&format!("infer-{i}")))).collect();
    let weights: Vec<_> = receivers.iter().map(|r| r.as_ref().unwrap().alloc("w", LEN).unwrap()).collect();
    let mut all: Vec<&Agent> = receivers.iter().map(|r| r.as_ref().unwrap()).collect();
    all.push(&source);
    for a in &all {
        for b in &all {
            if a.name() != b.name() {
                a.load_remote(&md(b)).unwrap();
            }
        }
    }
    drop(all);
    let targets: Vec<_> = (0..4).map(|i| source.peer(&format!("infer-{i}")).unwrap().memory("w").unwrap().range(..).unwrap()).collect();
    let cast = source.broadcast(&params.range(..).unwrap(), &targets, b"weights").unwrap();
    receivers[3] = None; // gone before the post
    let living: Vec<std::sync::Arc<Agent>> = receivers.into_iter().flatten().map(std::sync::Arc::new).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for step in 1..=2u64 {
        params.write_at(0, &pattern(LEN, step)).unwrap();
        let before: u64 = source.nic_stats().iter().map(|s| s.bytes).sum();
        let outcome = rt.block_on(async {
            // Each receiver awaits on a task of its own: awaiting is also
            // what forwards its chunks to the others.
            let waits: Vec<_> = living
                .iter()
                .map(|r| {
                    let r = r.clone();
                    tokio::spawn(async move { tokio::time::timeout(Duration::from_secs(60), r.notification()).await })
                })
                .collect();
            cast.post().unwrap();
            let outcome = match tokio::time::timeout(Duration::from_secs(60), cast.completed()).await {
                Ok(o) => o,
                Err(_) => panic!("step {step}: the broadcast did not settle in 60 s: {:?}", cast.receivers()),
            };
            for w in waits {
                let n = w.await.unwrap().expect("a receiver's notification in time").unwrap();
                assert_eq!((n.peer.as_str(), &n.msg[..]), ("trainer", &b"weights"[..]));
            }
            outcome
        });
        match outcome {
            Err(EngineError::BroadcastIncomplete { delivered: 3, total: 4, failed }) => {
                assert_eq!(failed.len(), 1);
                assert_eq!(failed[0].0, "infer-3", "{failed:?}");
            }
            other => panic!("step {step}: {other:?}"),
        }
        for (i, w) in weights.iter().take(3).enumerate() {
            let mut got = vec![0; LEN];
            w.read_at(0, &mut got).unwrap();
            assert!(got == pattern(LEN, step), "step {step}: infer-{i}'s copy differs");
        }
        // Each living owner's chunks once, the dead one's once per living
        // receiver: 12 + 4 x 3 chunks of 16.
        let sent: u64 = source.nic_stats().iter().map(|s| s.bytes).sum::<u64>() - before;
        assert_eq!(sent, (LEN / 16 * 24) as u64, "step {step}");
    }
}
