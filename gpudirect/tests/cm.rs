//! rdma_cm between two RDMA hosts: connections set up by IP address, the
//! peers' buffers in private data, refusals and timeouts as typed errors,
//! and rdma_cm connections next to TCP-bootstrapped ones in one process.
//! rdma_cm cannot route over Soft-RoCE on loopback, so this runs in the
//! two-guest test bed (`testbed/test-all` does):
//!
//! ```text
//! testbed/run --two --a "$BIN" --b "$BIN"      # BIN: cargo test --test cm --no-run
//! ```
//!
//! Elsewhere this binary says its scenarios were not run and exits 0 (no
//! libtest harness, like `faults`). `GPUDIRECT_ROLE` says which side each
//! guest is: A connects and asserts, B listens; they keep step over a TCP
//! control channel (the library's bootstrap).

use std::net::{SocketAddr, TcpListener};
use std::process::ExitCode;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use gpudirect::bootstrap::{Handshake, OobChannel};
use gpudirect::cm::{CmConnection, CmError, CmListener, Route, MAX_CONNECT_PRIVATE_DATA};
use gpudirect::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RecvWr, RemoteBuffer,
    SendWr, WcOpcode, WorkCompletion,
};
use testkit::{device, pattern, Role};

type R<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+).into());
        }
    };
}

const SCENARIOS: [&str; 3] = ["connect", "refusals", "concurrent"];
const CTL_PORT: u16 = 18700;
const CM_PORT: u16 = 7471;
/// A port nobody listens on.
const DEAD_PORT: u16 = 7479;
const T: Duration = Duration::from_secs(60);
const LEN: usize = 64 * 1024;
const THREADS: usize = 4;


fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    testkit::run_two_host("cm", &SCENARIOS, &args, |role, i, name| {
        let mut ctl = control(role, CTL_PORT + 10 * i as u16)?;
        match name {
            "connect" => connect(role, &mut ctl),
            "refusals" => refusals(role, &mut ctl),
            _ => concurrent(role, &mut ctl),
        }
    })
}

fn peer_ip() -> R<String> {
    Ok(std::env::var("GPUDIRECT_PEER").map_err(|_| "GPUDIRECT_PEER is not set (testbed/run --two sets it)")?)
}

fn cm_addr(port: u16) -> R<SocketAddr> {
    Ok(format!("{}:{port}", peer_ip()?).parse()?)
}

/// B listens for control, A connects: B must be up before A's rdma_cm
/// connects, which this ordering gives for free.
fn control(role: Role, port: u16) -> R<OobChannel> {
    Ok(match role {
        Role::B => OobChannel::accept(&TcpListener::bind(("0.0.0.0", port))?, T)?,
        Role::A => OobChannel::connect(format!("{}:{port}", peer_ip()?), T)?,
    })
}

fn say(ctl: &mut OobChannel, msg: &str) -> R<String> {
    let got = ctl.exchange(&Handshake { app: msg.as_bytes().to_vec(), ..Default::default() })?;
    Ok(String::from_utf8(got.app)?)
}

struct Host {
    cq: CompletionQueue,
    pd: ProtectionDomain,
    ctx: Context,
}

impl Host {
    fn open(name: &str) -> R<Host> {
        let ctx = Context::open(Some(name))?;
        let pd = ProtectionDomain::new(&ctx)?;
        let cq = CompletionQueue::new(&ctx, 256)?;
        Ok(Host { cq, pd, ctx })
    }

    fn qp(&self) -> R<gpudirect::PreparedQueuePair> {
        let cfg = QpConfig { max_send_wr: 16, max_recv_wr: 16, ..QpConfig::default() };
        Ok(QueuePair::create(&self.pd, &self.cq, &self.cq, &cfg)?)
    }

    fn region(&self) -> R<MemoryRegion> {
        Ok(MemoryRegion::alloc(&self.pd, 2 * LEN, AccessFlags::REMOTE_WRITE)?)
    }

    /// The next completion of `qp_num` (others' are for their own waits:
    /// every wait here is for one queue pair at a time).
    fn complete(&self, qp_num: u32) -> R<WorkCompletion> {
        let mut wcs = [WorkCompletion::default(); 1];
        let deadline = Instant::now() + T;
        loop {
            ensure!(Instant::now() < deadline, "no completion of QP {qp_num:#x} within {T:?}");
            if self.cq.wait(&mut wcs, Some(T))? == 1 {
                let wc = wcs[0].ok()?;
                ensure!(wc.qp_num == qp_num, "completion of QP {:#x} while waiting for {qp_num:#x}", wc.qp_num);
                return Ok(wc);
            }
        }
    }
}

/// One round trip on a connected queue pair, every byte checked: A writes
/// `seed`'s pattern from the first half of its region into B's with an
/// immediate; B checks it and sends it back into A's receive, posted on the
/// second half.
fn round_trip(role: Role, h: &Host, qp: &QueuePair, mr: &MemoryRegion, peer: &RemoteBuffer, seed: u64) -> R<()> {
    let data = pattern(LEN, seed);
    match role {
        Role::A => {
            mr.write_at(0, &data)?;
            qp.post_send(&[SendWr::write_with_imm(mr.slice(..LEN)?, peer, 0, seed as u32)?])?;
            ensure!(h.complete(qp.endpoint().qp_num)?.opcode == WcOpcode::RdmaWrite, "write completion expected");
            let wc = h.complete(qp.endpoint().qp_num)?;
            ensure!(wc.opcode == WcOpcode::Recv && wc.byte_len as usize == LEN, "receive of {LEN} bytes expected, got {wc:?}");
            let mut back = vec![0; LEN];
            mr.read_at(LEN, &mut back)?;
            ensure!(back == data, "the bytes sent back differ (seed {seed})");
        }
        Role::B => {
            let wc = h.complete(qp.endpoint().qp_num)?;
            ensure!(wc.opcode == WcOpcode::RecvRdmaWithImm && wc.imm == Some(seed as u32), "write-with-imm {seed} expected, got {wc:?}");
            ensure!(mr.to_vec()?[..LEN] == data, "the written bytes differ (seed {seed})");
            qp.post_send(&[SendWr::send(mr.slice(..LEN)?)])?;
            ensure!(h.complete(qp.endpoint().qp_num)?.opcode == WcOpcode::Send, "send completion expected");
        }
    }
    Ok(())
}

/// A zero-length receive for the write-with-imm (B) or the region for the
/// send back (A), posted before connecting.
fn arm(role: Role, qp: &gpudirect::PreparedQueuePair, mr: &MemoryRegion) -> R<()> {
    match role {
        Role::A => qp.post_recv(&[RecvWr::new(mr.slice(LEN..)?)])?,
        Role::B => qp.post_recv(&[RecvWr::empty()])?,
    }
    Ok(())
}

/// An rdma_cm connection and a TCP-bootstrapped one, on one protection
/// domain and completion queue, used in turn; each side's buffer crosses in
/// private data (rdma_cm) or the handshake (TCP). B sees A's disconnect.
fn connect(role: Role, ctl: &mut OobChannel) -> R<()> {
    let h = Host::open(&device())?;
    let (cm_mr, tcp_mr) = (h.region()?, h.region()?);
    let cm_qp = h.qp()?;
    arm(role, &cm_qp, &cm_mr)?;
    let conn = match role {
        Role::B => {
            let listener = CmListener::bind(format!("0.0.0.0:{CM_PORT}").parse()?)?;
            say(ctl, "listening")?;
            let mut req = listener.get_request(Some(T))?;
            ensure!(req.device() == h.ctx.name(), "request arrived on {}, expected {}", req.device(), h.ctx.name());
            let peer_buf = RemoteBuffer::from_bytes(req.private_data())?;
            ensure!(peer_buf.len == 2 * LEN as u64, "A's buffer in the request is {peer_buf:?}");
            req.accept(cm_qp, &cm_mr.remote().to_bytes(), T)?
        }
        Role::A => {
            ensure!(say(ctl, "connecting")? == "listening", "B is not listening");
            let route = Route::resolve(cm_addr(CM_PORT)?, T)?;
            ensure!(route.device() == h.ctx.name() && route.port() == 1, "route through {} port {}", route.device(), route.port());
            let conn = route.connect(cm_qp, &cm_mr.remote().to_bytes(), T)?;
            ensure!(conn.peer_addr() == cm_addr(CM_PORT)?, "peer address {}", conn.peer_addr());
            conn
        }
    };
    let cm_peer = RemoteBuffer::from_bytes(conn.peer_private_data())?;
    let remote = conn.qp().remote();
    println!("rdma_cm connected: local {} remote {remote}, gid {}", conn.qp().endpoint(), conn.qp().gid());
    ensure!(remote.qp_num != 0 && remote.mtu >= gpudirect::Mtu::Mtu256, "remote endpoint {remote}");

    // The TCP bootstrap in the same process, same PD and CQ.
    let tcp_prepared = h.qp()?;
    arm(role, &tcp_prepared, &tcp_mr)?;
    let peer = ctl.exchange(&Handshake { endpoint: Some(tcp_prepared.endpoint()), buffers: vec![tcp_mr.remote()], app: vec![] })?;
    let tcp_qp = tcp_prepared.connect(&peer.endpoint.ok_or("no endpoint from the peer")?)?;
    let tcp_peer = *peer.buffers.first().ok_or("no buffer from the peer")?;
    ctl.barrier()?;

    round_trip(role, &h, conn.qp(), &cm_mr, &cm_peer, 1)?;
    // The TCP queue pair's receive (posted before connecting) is still
    // there; the rdma_cm one's takes a new one for round three.
    match role {
        Role::A => conn.qp().post_recv(&[RecvWr::new(cm_mr.slice(LEN..)?)])?,
        Role::B => conn.qp().post_recv(&[RecvWr::empty()])?,
    }
    ctl.barrier()?;
    round_trip(role, &h, &tcp_qp, &tcp_mr, &tcp_peer, 2)?;
    round_trip(role, &h, conn.qp(), &cm_mr, &cm_peer, 3)?;
    ctl.barrier()?;
    match role {
        Role::A => drop(conn),
        Role::B => {
            let t0 = Instant::now();
            conn.wait_disconnected(Some(T))?;
            println!("disconnect seen after {:.2} s", t0.elapsed().as_secs_f64());
        }
    }
    say(ctl, "done")?;
    println!("rdma_cm and TCP-bootstrapped queue pairs: 3 round trips of {LEN} bytes, every byte checked");
    Ok(())
}

/// What goes wrong comes back typed and in time: nobody listening, a
/// refusal with the server's reason, private data too long, an address no
/// device reaches, a listener nobody connects to.
fn refusals(role: Role, ctl: &mut OobChannel) -> R<()> {
    let h = Host::open(&device())?;
    match role {
        Role::A => {
            ensure!(say(ctl, "go")? == "listening", "B is not listening");
            let t0 = Instant::now();
            match CmConnection::connect(h.qp()?, cm_addr(DEAD_PORT)?, b"", T) {
                // The InfiniBand CM's "invalid service ID".
                Err(e @ CmError::Rejected { reason: 8, .. }) => {
                    println!("no listener: {e} (after {:.2} s)", t0.elapsed().as_secs_f64())
                }
                other => return Err(format!("connecting to a port nobody listens on gave {other:?}").into()),
            }
            match CmConnection::connect(h.qp()?, cm_addr(CM_PORT)?, b"let me in", T) {
                // Reason 28: consumer defined, the application's refusal.
                Err(CmError::Rejected { reason: reason @ 28, private_data, .. }) => {
                    ensure!(private_data == b"busy: try later", "the refusal's private data arrived as {private_data:?}");
                    println!("refused with reason {reason} and {:?}", String::from_utf8_lossy(&private_data));
                }
                other => return Err(format!("a refused request gave {other:?}").into()),
            }
            let long = [0u8; MAX_CONNECT_PRIVATE_DATA + 1];
            let route = Route::resolve(cm_addr(CM_PORT)?, T)?;
            match route.connect(h.qp()?, &long, T) {
                Err(CmError::PrivateDataTooLong { len: 56, max: 55, .. }) => {}
                other => return Err(format!("56 bytes of private data gave {other:?}").into()),
            }
            // No RDMA device has a route to TEST-NET-3.
            let t0 = Instant::now();
            let bound = Duration::from_secs(3);
            match Route::resolve("203.0.113.7:7471".parse()?, bound) {
                Err(e @ CmError::Address { .. }) => {
                    ensure!(t0.elapsed() < bound + Duration::from_secs(2), "took {:?} for a {bound:?} timeout", t0.elapsed());
                    println!("unroutable address: {e} (after {:.2} s)", t0.elapsed().as_secs_f64());
                }
                other => return Err(format!("resolving an unroutable address gave {other:?}").into()),
            }
            say(ctl, "done")?;
        }
        Role::B => {
            let listener = CmListener::bind(format!("0.0.0.0:{CM_PORT}").parse()?)?;
            say(ctl, "listening")?;
            let req = listener.get_request(Some(T))?;
            ensure!(req.private_data() == b"let me in", "request's private data {:?}", req.private_data());
            req.reject(b"busy: try later")?;
            say(ctl, "done")?;
            let t0 = Instant::now();
            match listener.get_request(Some(Duration::from_millis(500))) {
                Err(CmError::Timeout { .. }) => {
                    ensure!(t0.elapsed() < Duration::from_secs(2), "a 500 ms wait took {:?}", t0.elapsed())
                }
                other => return Err(format!("waiting for a request nobody sends gave {other:?}").into()),
            }
        }
    }
    Ok(())
}

/// A connects from several threads at once to one listener; B accepts them
/// all on one thread. Each connection's bytes are its own.
fn concurrent(role: Role, ctl: &mut OobChannel) -> R<()> {
    let h = Arc::new(Host::open(&device())?);
    match role {
        Role::B => {
            let listener = CmListener::bind(format!("0.0.0.0:{CM_PORT}").parse()?)?;
            say(ctl, "listening")?;
            let mut conns = Vec::new();
            for _ in 0..THREADS {
                let mut req = listener.get_request(Some(T))?;
                let seed = u64::from(*req.private_data().first().ok_or("a request without its seed")?);
                let mr = h.region()?;
                let qp = h.qp()?;
                qp.post_recv(&[RecvWr::empty()])?;
                conns.push((req.accept(qp, &mr.remote().to_bytes(), T)?, mr, seed));
            }
            say(ctl, "accepted")?;
            // A's writes come in any order; each QP's own completion says
            // which connection (and seed) it was.
            let mut wcs = [WorkCompletion::default(); 1];
            for _ in 0..THREADS {
                ensure!(h.cq.wait(&mut wcs, Some(T))? == 1, "no write-with-imm within {T:?}");
                let wc = wcs[0].ok()?;
                let (_, mr, seed) = conns.iter().find(|c| c.0.qp().endpoint().qp_num == wc.qp_num).ok_or("a completion of no connection")?;
                ensure!(wc.imm == Some(*seed as u32), "connection of seed {seed} got immediate {:?}", wc.imm);
                ensure!(mr.to_vec()?[..LEN] == pattern(LEN, *seed), "connection of seed {seed}: bytes differ");
            }
            say(ctl, "verified")?;
            println!("{THREADS} connections accepted on one listener, each one's bytes checked");
        }
        Role::A => {
            ensure!(say(ctl, "go")? == "listening", "B is not listening");
            let start = Arc::new(Barrier::new(THREADS));
            let threads: Vec<_> = (0..THREADS as u64)
                .map(|seed| {
                    let (h, start) = (h.clone(), start.clone());
                    std::thread::spawn(move || -> R<(CmConnection, MemoryRegion)> {
                        let mr = h.region()?;
                        mr.write_at(0, &pattern(LEN, 10 + seed))?;
                        let qp = h.qp()?;
                        start.wait();
                        Ok((CmConnection::connect(qp, cm_addr(CM_PORT)?, &[10 + seed as u8], T)?, mr))
                    })
                })
                .collect();
            let mut conns = Vec::new();
            for t in threads {
                conns.push(t.join().map_err(|_| "a connecting thread panicked")??);
            }
            ensure!(say(ctl, "connected")? == "accepted", "B did not accept all");
            for (i, (conn, mr)) in conns.iter().enumerate() {
                let peer = RemoteBuffer::from_bytes(conn.peer_private_data())?;
                conn.qp().post_send(&[SendWr::write_with_imm(mr.slice(..LEN)?, &peer, 0, 10 + i as u32)?])?;
                h.complete(conn.qp().endpoint().qp_num)?;
            }
            ensure!(say(ctl, "written")? == "verified", "B did not verify");
        }
    }
    Ok(())
}
