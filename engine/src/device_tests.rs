//! Engine tests on a real device (Soft-RoCE in the bed) that need the
//! crate's insides: hostile clients of the control port speaking the real
//! protocol with keys and claims of their choosing (no secret, another
//! secret, a replayed handshake, the secret but a name whose loaded
//! metadata says otherwise: each refused before any queue pair is
//! created, the legitimate peer beside them going on), and the word a
//! post's own reaping owes the tasks that sleep.

use std::net::SocketAddr;
use std::time::Duration;

use gpudirect::bootstrap::{Handshake, OobChannel};
use gpudirect::Endpoint;

use crate::wire::auth::{AuthError, ClusterSecret, Key, Label, TAG};
use crate::peers::control::{self, Answer, Ask, Identity, Request};
use super::{Agent, AgentConfig, EngineError, Op};

const T: Option<Duration> = Some(Duration::from_secs(20));

fn secret(b: u8) -> ClusterSecret {
    ClusterSecret::new(vec![b; 32]).unwrap()
}

fn agent(name: &str, s: Option<ClusterSecret>) -> Agent {
    let mut c = AgentConfig::named(name);
    c.devices = vec![testkit::device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.secret = s;
    Agent::new(c).unwrap()
}

/// An endpoint on the target's device, as a real client would send.
fn endpoint(of: &Agent) -> Endpoint {
    let n = &of.core.pool.nics[0];
    Endpoint { qp_num: 0x42, psn: 1, lid: n.desc.lid, gid: n.desc.gid, mtu: n.desc.mtu }
}

/// A client of `target`'s control port proving with `key`, claiming
/// `claim` at `control`; what came of it.
fn ask(target: &Agent, key: &Key, claim: Identity, control: SocketAddr, ep: Endpoint) -> Result<Answer, EngineError> {
    let mut oob = OobChannel::connect(target.control_addr(), Duration::from_secs(5)).unwrap();
    let expect = Identity { name: target.name().into(), instance: target.core.pool.instance };
    let req = Request { from: claim, control, theirs: 0, ours: 0, qp: 0, ask: Ask::Connect };
    control::initiate(&mut oob, key, &expect, &req, Some(ep))
}

#[test]
#[ignore = "needs an RDMA device"]
fn hostile_clients_are_refused_before_any_queue_pair_and_the_legitimate_peer_goes_on() {
    let s = secret(1);
    let decode = agent("decode-0", Some(s.clone()));
    let prefill = agent("prefill-0", Some(s.clone()));
    let table = decode.alloc("t", 1 << 20).unwrap();
    let src = prefill.alloc("s", 1 << 20).unwrap();
    // The decode side knows its legitimate peer: its name is bound to it.
    decode.load_remote(&prefill.metadata()).unwrap();
    let remote = prefill.load_remote(&decode.metadata()).unwrap().memory("t").unwrap();
    let req = prefill.prepare(Op::Write, &[(src.range(..).unwrap(), remote.range(..).unwrap())], Some(b"legit")).unwrap();
    let write = |fill: u8| {
        src.fill(.., fill).unwrap();
        req.post().unwrap();
        req.wait(T).unwrap();
        let n = decode.wait_notification(T).unwrap();
        assert_eq!((n.peer.as_str(), n.msg.as_slice()), ("prefill-0", &b"legit"[..]));
        let mut got = vec![0; 1 << 20];
        table.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == fill));
    };
    write(1);
    let pool = &decode.core.pool;
    let (qps, conns) = (pool.qps_created(), decode.connections());
    let me = Identity { name: "prefill-0".into(), instance: prefill.core.pool.instance };
    let at = prefill.control_addr();
    let ep = endpoint(&decode);

    // 1. No secret, and 2. another secret: the client does not even get
    // the target's proof to verify, and the target refuses its request.
    for key in [Key::of(None), Key::of(Some(secret(2)))] {
        match ask(&decode, &key, me.clone(), at, ep) {
            Err(EngineError::Auth { source: AuthError::BadProof { .. }, .. }) => {}
            r => panic!("a client without the secret got {:?}", r.map(|_| ())),
        }
    }
    // 3. A replayed request: proven with the secret, but for nonces of an
    // earlier connection.
    let mut oob = OobChannel::connect(decode.control_addr(), Duration::from_secs(5)).unwrap();
    let mut hello = vec![control::VERSION];
    hello.extend_from_slice(&[7; TAG]);
    let first = oob.exchange(&Handshake { app: hello, ..Default::default() }).unwrap();
    let identity = first.app[1 + TAG..].to_vec();
    let req3 = Request { from: me.clone(), control: at, theirs: 0, ours: 0, qp: 0, ask: Ask::Connect };
    let mut recorded = Handshake { endpoint: Some(ep), buffers: vec![], app: req3.bytes() };
    let key = Key::of(Some(s.clone()));
    let old_nonce = [9; TAG];
    let tag = key.tag(Label::Initiator, &[&[7; TAG], &old_nonce, &identity, &recorded.encode().unwrap()]);
    recorded.app.extend_from_slice(&tag);
    oob.exchange(&recorded).unwrap();
    let answer = oob.exchange(&Handshake::default()).unwrap();
    assert_eq!(answer.app[0], 1, "a replay is refused");
    assert!(String::from_utf8_lossy(&answer.app[1..]).contains("did not verify"));
    // 4. The secret, but not the agent loaded under the name it claims:
    // another instance, another control address, another GID.
    let other_run = Identity { name: "prefill-0".into(), instance: me.instance ^ 1 };
    let mut other_gid = ep;
    other_gid.gid.0[15] ^= 0xff;
    let cases = [
        (other_run, at, ep, "instance"),
        (me.clone(), SocketAddr::from(([127, 0, 0, 9], at.port())), ep, "control address"),
        (me.clone(), at, other_gid, "GID"),
        (Identity { name: "decode-0".into(), instance: 5 }, at, ep, "own name"),
    ];
    for (claim, control, ep, what) in cases {
        match ask(&decode, &key, claim, control, ep) {
            Ok(Answer::Refused(reason)) => assert!(reason.contains(what) && reason.contains("does not match"), "{what}: {reason}"),
            r => panic!("{what}: {:?}", r.map(|_| ())),
        }
    }
    assert_eq!(pool.qps_created(), qps, "no queue pair was created for any of them");
    assert_eq!(decode.connections(), conns);
    // The first two end on the client's side first: let their server
    // threads finish counting.
    let counted = std::time::Instant::now();
    while decode.refused_requests() < 7 && counted.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(decode.refused_requests(), 7);
    // The legitimate peer beside them: writes and notifications as before,
    // and nothing else was delivered.
    write(2);
    assert!(decode.notifications().unwrap().is_empty());
    // Metadata sealed with another secret (or changed after sealing) is
    // not loaded; a peer without the secret cannot load ours.
    let stranger = agent("stranger", Some(secret(3)));
    match stranger.load_remote(&decode.metadata()) {
        Err(EngineError::Auth { source: AuthError::BadProof { what }, .. }) => assert!(what.contains("seal"), "{what}"),
        r => panic!("{r:?}"),
    }
    let mut md = decode.metadata();
    md.control = SocketAddr::from(([192, 0, 2, 66], 1));
    assert!(matches!(prefill.load_remote(&md), Err(EngineError::Auth { .. })), "a redirected control address");
}

/// A post that falls back to posting as room frees reaps completions
/// (some may finish requests that tasks await, and its channel waits take
/// the events that would wake them): it must tell the sleeping tasks, as
/// every other reap does. Checked directly: a task's registered wake-up
/// is ready after such a post. (Before, it was not: a task could sleep on
/// a done request.)
#[cfg(feature = "tokio")]
#[test]
#[ignore = "needs an RDMA device"]
fn a_posts_fallback_reaping_tells_the_sleeping_tasks() {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};
    let mut c = AgentConfig::named("prefill");
    c.devices = vec![testkit::device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.send_depth = 8;
    let prefill = Agent::new(c).unwrap();
    let decode = agent("decode", None);
    let src = prefill.alloc("src", 64 * 4096).unwrap();
    decode.alloc("t", 64 * 4096).unwrap();
    let t = prefill.load_remote(&decode.metadata()).unwrap().memory("t").unwrap();
    let entries: Vec<_> = (0..64u64).map(|i| (src.range(i as usize * 4096..(i as usize + 1) * 4096).unwrap(), t.range(i * 4096..(i + 1) * 4096).unwrap())).collect();
    let long = prefill.prepare(Op::Write, &entries, None).unwrap();
    long.post().unwrap();
    long.wait(T).unwrap();
    let progress = &prefill.core.progress;
    for round in 0..5 {
        // A task between its look and its sleep, as `completed` has it.
        let _waiting = crate::nics::wake::Waiting::new(progress);
        let notified = progress.notify.notified();
        let mut notified = std::pin::pin!(notified);
        notified.as_mut().enable();
        let mut cx = Context::from_waker(Waker::noop());
        assert!(notified.as_mut().poll(&mut cx).is_pending());
        // 64 requests into an 8-deep queue: posted as room frees.
        long.post().unwrap();
        assert_eq!(notified.as_mut().poll(&mut cx), Poll::Ready(()), "round {round}: the post reaped and told nobody");
        long.wait(T).unwrap();
    }
}

/// Raises this process's open-file limit to `n` (or its hard limit).
fn allow_files(n: u64) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit on a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 {
            r.rlim_cur = n.min(r.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}

/// 1,000 silent connections and 32 clients that trickle a handshake
/// (each reconnecting when cut off), all from this address, against an
/// agent's control port: the legitimate peer's first connection (with a
/// 3 s setup timeout) and its transfers go through meanwhile, and none of
/// them got a queue pair.
#[test]
#[ignore = "needs an RDMA device"]
fn silent_and_trickling_clients_keep_no_peer_off_the_control_port() {
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, Ordering};
    allow_files(4096);
    let s = secret(1);
    let decode = agent("decode-0", Some(s.clone()));
    let prefill = {
        let mut c = AgentConfig::named("prefill-0");
        c.devices = vec![testkit::device()];
        c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        c.secret = Some(s);
        c.timeout = Duration::from_secs(3);
        Agent::new(c).unwrap()
    };
    let table = decode.alloc("t", 1 << 16).unwrap();
    let src = prefill.alloc("s", 1 << 16).unwrap();
    decode.load_remote(&prefill.metadata()).unwrap();
    let remote = prefill.load_remote(&decode.metadata()).unwrap().memory("t").unwrap();
    let addr = decode.control_addr();
    let qps = decode.core.pool.qps_created();
    let stop = AtomicBool::new(false);
    std::thread::scope(|sc| {
        for _ in 0..32 {
            sc.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let Ok(mut c) = std::net::TcpStream::connect(addr) else { continue };
                    // A handshake header, a byte every 200 ms.
                    for b in [b'G', b'D', b'B', b'S'].iter().cycle() {
                        if stop.load(Ordering::Relaxed) || c.write_all(&[*b]).is_err() {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(200));
                    }
                }
            });
        }
        let silent: Vec<std::net::TcpStream> = (0..1000).filter_map(|_| std::net::TcpStream::connect(addr).ok()).collect();
        println!("{} silent connections open", silent.len());
        std::thread::sleep(Duration::from_millis(500));
        let t = std::time::Instant::now();
        let req = prefill.prepare(Op::Write, &[(src.range(..).unwrap(), remote.range(..).unwrap())], Some(b"legit")).unwrap();
        for fill in 1..=3u8 {
            src.fill(.., fill).unwrap();
            req.post().unwrap();
            req.wait(T).unwrap();
            let n = decode.wait_notification(T).unwrap();
            assert_eq!(n.msg, b"legit");
            let mut got = vec![0; 1 << 16];
            table.read_at(0, &mut got).unwrap();
            assert!(got.iter().all(|&b| b == fill));
        }
        println!("the legitimate peer connected and wrote 3 times in {:?} beside 1000 silent and 32 trickling clients", t.elapsed());
        stop.store(true, Ordering::Relaxed);
        drop(silent);
    });
    assert_eq!(decode.core.pool.qps_created() - qps, 1, "only the legitimate peer got a queue pair");
}

/// Without a secret, the default listener binds loopback (one host works
/// out of the box) and peers on this host connect to it; a network
/// address without a secret is still refused, naming the fix.
#[test]
#[ignore = "needs an RDMA device"]
fn without_a_secret_the_default_listener_is_loopback_and_a_network_address_is_refused() {
    for var in [crate::wire::auth::SECRET_FILE_ENV, "GPUDIRECT_SECRET"] {
        assert!(std::env::var_os(var).is_none(), "{var} is set: this test checks an agent without a secret");
    }
    let config = |name: &str| {
        let mut c = AgentConfig::named(name);
        c.devices = vec![testkit::device()];
        c
    };
    let a = Agent::new(config("a")).unwrap();
    let b = Agent::new(config("b")).unwrap();
    assert!(a.control_addr().ip().is_loopback(), "{}", a.control_addr());
    let ta = a.alloc("t", 4096).unwrap();
    let sb = b.alloc("s", 4096).unwrap();
    a.load_remote(&b.metadata()).unwrap();
    let remote = b.load_remote(&a.metadata()).unwrap().memory("t").unwrap();
    sb.fill(.., 7).unwrap();
    let req = b.prepare(Op::Write, &[(sb.range(..).unwrap(), remote.range(..).unwrap())], Some(b"hi")).unwrap();
    req.post().unwrap();
    req.wait(T).unwrap();
    assert_eq!(a.wait_notification(T).unwrap().msg, b"hi");
    let mut got = [0u8; 4096];
    ta.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|&x| x == 7));
    let mut net = config("c");
    net.listen = SocketAddr::from(([0, 0, 0, 0], 18999));
    match Agent::new(net) {
        Err(EngineError::Auth { source: AuthError::Unprotected { .. }, .. }) => {}
        other => panic!("a network address without a secret: {other:?}"),
    }
}

/// A member holding the secret that claims a peer's name (with its real
/// run) before the target loaded that peer keeps nothing once the peer's
/// metadata is loaded: connections from another control address, or from
/// a GID that is not the named NIC's, are retired and reported
/// (`PeerEvent::Impostor`), and the target's writes to that name reach
/// the real peer.
#[test]
#[ignore = "needs an RDMA device"]
fn a_name_claimed_before_its_metadata_was_loaded_is_retired_at_the_load() {
    let s = secret(1);
    let key = Key::of(Some(s.clone()));
    let mut other_gid = None;
    for case in ["control address", "GID"] {
        let target = agent("target", Some(s.clone()));
        let real = agent("real", Some(s.clone()));
        let me = Identity { name: "real".into(), instance: real.core.pool.instance };
        let mut ep = endpoint(&target);
        let control = if case == "GID" {
            ep.gid.0[15] ^= 0xff;
            other_gid = Some(ep.gid);
            real.control_addr()
        } else {
            SocketAddr::from(([127, 0, 0, 9], 7))
        };
        // Nothing loaded under the name yet: a member's claim is taken.
        assert!(matches!(ask(&target, &key, me.clone(), control, ep), Ok(Answer::Accepted(Some(_)))), "{case}");
        assert_eq!(target.connections(), 1, "{case}");
        let mem = real.alloc("m", 4096).unwrap();
        let remote = target.load_remote(&real.metadata()).unwrap().memory("m").unwrap();
        assert_eq!(target.connections(), 0, "{case}: the claimant's connection is retired at the load");
        let (events, _) = target.peer_events();
        match events.as_slice() {
            [super::PeerEvent::Impostor { peer, control: c, gid }] => {
                assert_eq!((peer.as_str(), *c, *gid), ("real", control, ep.gid), "{case}");
            }
            other => panic!("{case}: {other:?}"),
        }
        // The target's writes to the name go to the agent its metadata
        // describes.
        let src = target.alloc("s", 4096).unwrap();
        src.fill(.., 0x5a).unwrap();
        let req = target.prepare(Op::Write, &[(src.range(..).unwrap(), remote.range(..).unwrap())], Some(b"to the real one")).unwrap();
        req.post().unwrap();
        req.wait(T).unwrap();
        let n = real.wait_notification(T).unwrap();
        assert_eq!((n.peer.as_str(), n.msg.as_slice()), ("target", &b"to the real one"[..]));
        let mut got = [0; 4096];
        mem.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|&b| b == 0x5a), "{case}");
    }
    assert!(other_gid.is_some());
}

/// The side that sets a connection up may be sent to as soon as its peer
/// answered, before the connection is listed as live here: a message
/// reaped then (another thread waiting for notifications) must still
/// name its sender, not be dropped as from an unknown connection. A
/// broadcast's chunk message lost so left its receiver waiting for good.
#[test]
#[ignore = "needs an RDMA device"]
fn a_message_on_a_connection_being_set_up_here_is_delivered() {
    use std::sync::atomic::Ordering;
    let a = agent("a", None);
    let b = agent("b", None);
    let (at_a, at_b) = (a.alloc("m", 4096).unwrap(), b.alloc("m", 4096).unwrap());
    let to_b = a.load_remote(&b.metadata()).unwrap().memory("m").unwrap();
    let to_a = b.load_remote(&a.metadata()).unwrap().memory("m").unwrap();
    let a_to_b = a.prepare(Op::Write, &[(at_a.range(..).unwrap(), to_b.range(..).unwrap())], Some(b"from a")).unwrap();
    let b_to_a = b.prepare(Op::Write, &[(at_b.range(..).unwrap(), to_a.range(..).unwrap())], Some(b"from b")).unwrap();
    a.core.pool.opening_pause_ms.swap(1500, Ordering::Relaxed);
    std::thread::scope(|s| {
        let reaper = s.spawn(|| a.wait_notification(Some(Duration::from_secs(10))));
        // `a` sets the connection up and pauses with it ready to receive.
        let poster = s.spawn(|| {
            a_to_b.post().unwrap();
            a_to_b.wait(T).unwrap();
        });
        let t = std::time::Instant::now();
        while b.core.pool.sending_on("a", (0, 0, 0)).is_none() {
            assert!(t.elapsed() < Duration::from_secs(10), "b never accepted a's connection");
            std::thread::sleep(Duration::from_millis(1));
        }
        // `b` sends on the connection it accepted, while `a` pauses.
        assert_eq!(a.connections(), 0, "the pause should hold a's side unlisted");
        b_to_a.post().unwrap();
        b_to_a.wait(T).unwrap();
        let note = reaper.join().unwrap().expect("b's notification reached a");
        assert_eq!((note.peer.as_str(), note.msg.as_slice()), ("b", &b"from b"[..]));
        a.core.pool.opening_pause_ms.swap(0, Ordering::Relaxed);
        poster.join().unwrap();
    });
    assert_eq!(b.wait_notification(T).unwrap().msg, b"from a");
    assert_eq!(a.connections(), b.connections(), "the connections a set up, used both ways");
}

/// Host memory moved both ways shows as `host` bytes on the NIC that
/// moved it, the right way, in the snapshot and at the endpoint; none
/// shows as `gdr` or `staged`; the latencies count every post.
#[test]
#[ignore = "needs an RDMA device"]
fn the_snapshot_and_the_endpoint_count_host_bytes_by_direction() {
    use std::io::{Read, Write};
    use gpudirect::metrics::{DataPath, Direction};
    let mut c = AgentConfig::named("scraped");
    c.devices = vec![testkit::device()];
    c.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    c.metrics = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let a = Agent::new(c).unwrap();
    let b = agent("peer", None);
    let src = a.alloc("src", 1 << 20).unwrap();
    b.alloc("t", 1 << 20).unwrap();
    let t = a.load_remote(&b.metadata()).unwrap().memory("t").unwrap();
    let write = a.prepare(Op::Write, &[(src.range(..).unwrap(), t.range(..).unwrap())], None).unwrap();
    let read = a.prepare(Op::Read, &[(src.range(..4096).unwrap(), t.range(..4096).unwrap())], None).unwrap();
    for _ in 0..3 {
        write.post().unwrap();
        write.wait(T).unwrap();
    }
    read.post().unwrap();
    read.wait(T).unwrap();
    let s = a.stats();
    let nic = &s.nics[0];
    assert_eq!((nic.bytes(Direction::Out, DataPath::Host), nic.bytes(Direction::In, DataPath::Host)), (3 << 20, 4096));
    assert_eq!(nic.traffic.iter().filter(|t| t.path != DataPath::Host).map(|t| t.bytes).sum::<u64>(), 0);
    // One post in LATENCY_SAMPLE per thread is timed: of this fresh
    // thread's four, the first.
    assert_eq!((s.ops[0].latency.count, s.ops[1].latency.count), (1, 0));
    assert_eq!((s.ops[0].requests.completed, s.peers[0].name.as_str(), s.peers[0].requests.bytes), (3, "peer", (3 << 20) + 4096));
    let mut http = std::net::TcpStream::connect(a.metrics_addr().unwrap()).unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut text = String::new();
    http.read_to_string(&mut text).unwrap();
    let dev = &nic.device;
    for (dir, path, n) in [("out", "host", 3u64 << 20), ("in", "host", 4096), ("out", "gdr", 0), ("out", "staged", 0)] {
        let line = format!("gpudirect_bytes_total{{agent=\"scraped\",nic=\"{dev}\",direction=\"{dir}\",path=\"{path}\"}} {n}\n");
        assert!(text.contains(&line), "{line} not in:\n{text}");
    }
    assert!(text.contains("gpudirect_request_seconds_count{agent=\"scraped\",op=\"write\"} 1\n"));
}

/// Metadata whose seal does not verify (another cluster's, or altered
/// on the way) is refused and counted as `metadata_seal`, in the
/// snapshot and at the endpoint's text.
#[test]
#[ignore = "needs an RDMA device"]
fn metadata_with_a_bad_seal_is_refused_and_counted() {
    let a = agent("sealed-a", Some(secret(1)));
    let stranger = agent("sealed-b", Some(secret(2)));
    assert!(matches!(a.load_remote(&stranger.metadata()), Err(EngineError::Auth { .. })));
    let member = agent("sealed-c", Some(secret(1)));
    let mut md = member.metadata();
    md.seal[0] ^= 1;
    assert!(matches!(a.load_remote(&md), Err(EngineError::Auth { .. })));
    md.seal[0] ^= 1;
    a.load_remote(&md).unwrap();
    assert_eq!(a.stats().refusals.metadata_seal, 2);
    let text = crate::prometheus_text(&a.stats());
    assert!(text.contains("gpudirect_refusals_total{agent=\"sealed-a\",reason=\"metadata_seal\"} 2\n"), "{text}");
}
