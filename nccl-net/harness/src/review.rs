//! An outside review's attacks on the plugin (run by the `hostile` mode
//! after its own), in one process on one device: a member playing
//! the sender (against the plugin's receive comm) or the receiver
//! (against the plugin's send comm) with raw verbs, and strangers on
//! several loopback addresses against a listener. Each attack states what
//! must hold; `Err` says what got through.

use std::ffi::c_int;
use std::io::{ErrorKind, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use gpudirect::{AccessFlags, CompletionQueue, MemoryRegion, QpConfig, QueuePair, RecvWr, RemoteBuffer, SendWr, WcOpcode, WcStatus, WorkCompletion};
use nccl_net_gpudirect::abi::{Ptr, HANDLE_MAXSIZE};
use nccl_net_gpudirect::wire::{self, Entry, Handle, HELLO_LEN, REPLY_LEN, SLOT};

use crate::hostile::{connect_from, e, run_all, Attack, Peer, Verbs, Victim, HUGE};
use crate::phases::within;
use crate::plugin::{logged, Plugin};

const W: Duration = Duration::from_secs(20);

fn member_qp(v: &Verbs) -> Result<(CompletionQueue, gpudirect::PreparedQueuePair), String> {
    let cq = CompletionQueue::new(&v.ctx, 256).map_err(e)?;
    let config = QpConfig { max_inline_data: SLOT as u32, ..QpConfig::default() };
    let qp = QueuePair::create(&v.pd, &cq, &cq, &config).map_err(e)?;
    Ok((cq, qp))
}

fn poll_one(cq: &CompletionQueue, within: Duration) -> Result<Option<WorkCompletion>, String> {
    let mut wc = [WorkCompletion::default(); 1];
    let t = Instant::now();
    loop {
        if cq.poll(&mut wc).map_err(e)? == 1 {
            return Ok(Some(wc[0]));
        }
        if t.elapsed() > within {
            return Ok(None);
        }
        std::thread::yield_now();
    }
}

/// The member as a receiver: the plugin's `connect` reached a listener
/// the member made (the plugin's send comm is the victim).
struct Receiver {
    cq: CompletionQueue,
    qp: QueuePair,
    /// The member's receive memory (the fifo entries point into it).
    mem: MemoryRegion,
    /// Bytes staged for the fifo writes.
    local: MemoryRegion,
    /// The victim's fifo.
    fifo: RemoteBuffer,
    _stream: TcpStream,
}

impl Receiver {
    fn connect(p: &Plugin, v: &Verbs) -> Result<(Receiver, Ptr), String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(e)?;
        listener.set_nonblocking(true).map_err(e)?;
        let token = [0x42u8; 16];
        let mut h = [0u8; HANDLE_MAXSIZE];
        Handle { addr: listener.local_addr().map_err(e)?, token }.write(&mut h);
        let (cq, prepared) = member_qp(v)?;
        for i in 0..64 {
            prepared.post_recv(&[RecvWr::empty().wr_id(i)]).map_err(e)?;
        }
        let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
        let sizes = MemoryRegion::alloc(&v.pd, wire::sizes_len(), access).map_err(e)?;
        let mem = MemoryRegion::alloc(&v.pd, 1 << 16, access).map_err(e)?;
        let local = MemoryRegion::alloc(&v.pd, 4096, AccessFlags::LOCAL_WRITE).map_err(e)?;
        let (mut stream, mut buf, mut prepared, mut connected) = (None::<TcpStream>, Vec::new(), Some(prepared), None);
        let t = Instant::now();
        let comm = loop {
            let c = match p.connect(0, &mut h, Duration::ZERO) {
                Ok(c) => c,
                Err(x) if x.contains("within") => std::ptr::null_mut(),
                Err(x) => return Err(x),
            };
            if stream.is_none() {
                match listener.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(true).map_err(e)?;
                        stream = Some(s);
                    }
                    Err(x) if x.kind() == ErrorKind::WouldBlock => {}
                    Err(x) => return Err(e(x)),
                }
            }
            if let (Some(s), None) = (stream.as_mut(), connected.as_ref()) {
                let mut chunk = [0u8; HELLO_LEN];
                match s.read(&mut chunk[..HELLO_LEN - buf.len()]) {
                    Ok(0) => return Err("the victim's connect closed its connection".into()),
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    Err(x) if x.kind() == ErrorKind::WouldBlock => {}
                    Err(x) => return Err(e(x)),
                }
                if buf.len() == HELLO_LEN {
                    let (presented, ep, fifo) = wire::read_hello(buf[..].try_into().expect("HELLO_LEN")).map_err(e)?;
                    if presented != token {
                        return Err("the victim presented another token".into());
                    }
                    let qp = prepared.take().expect("once").connect(&ep).map_err(e)?;
                    s.write_all(&wire::reply(&qp.endpoint(), sizes.addr(), sizes.rkey())).map_err(e)?;
                    connected = Some((qp, fifo));
                }
            }
            if !c.is_null() {
                break c;
            }
            if t.elapsed() > W {
                return Err("the victim's connect gave no comm".into());
            }
            std::thread::sleep(Duration::from_micros(200));
        };
        let (qp, fifo) = connected.ok_or("the victim's comm came before the member's reply")?;
        std::mem::forget(sizes); // the victim may write into it until the end of the process
        Ok((Receiver { cq, qp, mem, local, fifo, _stream: stream.expect("connected") }, comm))
    }

    /// Writes `entries` into fifo slot `slot` of the victim (one RDMA write).
    fn post_group(&self, slot: usize, entries: &[Entry]) -> Result<(), String> {
        let bytes: Vec<u8> = entries.iter().flat_map(|x| x.to_bytes()).collect();
        self.local.write_at(0, &bytes).map_err(e)?;
        let wr = SendWr::write(self.local.slice(0..bytes.len()).map_err(e)?, &self.fifo, (slot * SLOT) as u64).map_err(e)?.wr_id(1 << 40);
        self.qp.post_send(&[wr]).map_err(e)?;
        let t = Instant::now();
        loop {
            match poll_one(&self.cq, W)? {
                Some(wc) if wc.wr_id == 1 << 40 => {
                    return if wc.status == WcStatus::Success { Ok(()) } else { Err(format!("the member's fifo write failed: {}", wc.status.verbs_name())) };
                }
                Some(wc) => return Err(format!("an unexpected completion while writing the fifo: {wc:?}")),
                None if t.elapsed() > W => return Err("the member's fifo write never completed".into()),
                None => {}
            }
        }
    }

    fn entry(&self, at: usize, size: u32, tag: i32, nreqs: u32, seq: u64) -> Entry {
        Entry { addr: self.mem.addr() + at as u64, rkey: self.mem.rkey(), size, tag, nreqs, seq }
    }
}

/// One isend until it gives a request (the entry is there), or fails.
fn isend(p: &Plugin, comm: Ptr, data: *mut u8, size: usize, tag: c_int, mh: Ptr) -> Result<Ptr, String> {
    within(W, "isend got no request", || p.isend(comm, data, size, tag, mh))
}

/// Every attack, in order.
pub fn run(p: &Plugin, device: &str) -> Result<(), String> {
    let v = &Verbs::open(device)?;
    let attacks: [(&str, &Attack<'_>); 6] = [
        ("a SEND where the protocol writes", &|| send_not_write(p, v)),
        ("a group that shrinks under a matched send", &|| group_shrinks(p, v)),
        ("strangers from 17 addresses against a rank's late hello", &|| distributed_strangers(p, v)),
        ("a hello sent in time, read late", &|| late_look(p, v)),
        ("a refused receive's key", &|| refused_key(p, v)),
        ("a pending receive at teardown", &|| teardown_pins(p, v)),
    ];
    run_all("review", &attacks)
}

/// The protocol's only receive-queue traffic is an RDMA write with
/// immediate. A member sends a zero-byte SEND instead: it consumes the
/// receive work request of the first posted receive. That must fail the
/// request (or the comm), not leave it pending forever while the next
/// receive is reported done ahead of it.
fn send_not_write(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    let r0 = victim.irecv(p, &[16])?;
    peer.entry(0)?;
    peer.consumed();
    let r1 = victim.irecv(p, &[16])?;
    let e1 = peer.entry(0)?;
    peer.consumed();
    let status = peer.run(SendWr::send(peer.local.slice(0..0).map_err(e)?))?;
    println!("review: the member's zero-byte SEND: {}", status.verbs_name());
    peer.local.write_at(0, &[0x77; 16]).map_err(e)?;
    let honest = SendWr::write_with_imm(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&e1, 0, 16), 0, 16).map_err(e)?;
    println!("review: the member's honest write for receive 1: {}", peer.run(honest)?.verbs_name());
    let t = Instant::now();
    let (mut d0, mut d1) = (None, None);
    let verdict = loop {
        if d0.is_none() {
            match p.test(r0) {
                Ok(Some(s)) => d0 = Some(format!("done, {} bytes", s[0])),
                Ok(None) => {}
                Err(x) => break Ok(format!("receive 0 failed: {x}")),
            }
        }
        if d1.is_none() {
            match p.test(r1) {
                Ok(Some(s)) => d1 = Some(format!("done, {} bytes", s[0])),
                Ok(None) => {}
                Err(x) => break Ok(format!("receive 1 failed: {x}")),
            }
        }
        if let Some(d0) = &d0 {
            break Err(format!("receive 0, whose receive request the SEND consumed, was reported {d0} (receive 1: {d1:?})"));
        }
        if t.elapsed() > Duration::from_secs(5) {
            break Err(format!(
                "the SEND's completion was dropped: receive 0 is still pending after 5 s with the peer alive and no error, \
                 while receive 1 is {}",
                d1.as_deref().unwrap_or("pending too")
            ));
        }
    };
    let _ = victim.close(p);
    verdict.map(|ok| println!("review: {ok}"))
}

/// A member receiver writes a group of two (tags 10 and 11) into the
/// plugin's fifo; the plugin's isend of tag 10 matches receive 0 and
/// returns a request A. The member then rewrites that slot as a group of
/// one (tag 11): the isend of tag 11 goes out alone, and A's match is
/// left behind. The next group of two (tags 12 and 13) must not complete
/// on an isend of tag 13 alone, carrying A's bytes as tag 12's.
fn group_shrinks(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (rx, comm) = Receiver::connect(p, v)?;
    let mut mem = vec![0u8; 1 << 16];
    mem[0..16].copy_from_slice(&[0xaa; 16]);
    mem[256..272].copy_from_slice(&[0xbb; 16]);
    mem[512..528].copy_from_slice(&[0xcc; 16]);
    let mh = p.reg(comm, &mut mem)?;
    let base = mem.as_mut_ptr();
    let result = (|| {
        rx.post_group(0, &[rx.entry(0, 16, 10, 2, 1), rx.entry(256, 16, 11, 2, 1)])?;
        let a = isend(p, comm, base, 16, 10, mh)?;
        rx.post_group(0, &[rx.entry(1024, 16, 11, 1, 1)])?;
        let _b = match isend(p, comm, base.wrapping_add(256), 16, 11, mh) {
            Ok(b) => b,
            Err(x) => {
                println!("review: the rewritten slot was refused: {x}");
                return Ok(());
            }
        };
        match poll_one(&rx.cq, W)? {
            Some(wc) if wc.opcode == WcOpcode::RecvRdmaWithImm => println!("review: the rewritten group of one arrived ({} bytes)", wc.imm.unwrap_or(0)),
            other => return Err(format!("the rewritten group of one did not arrive: {other:?}")),
        }
        rx.post_group(1, &[rx.entry(2048, 16, 12, 2, 2), rx.entry(2304, 16, 13, 2, 2)])?;
        if let Err(x) = isend(p, comm, base.wrapping_add(512), 16, 13, mh) {
            println!("review: the next group refused: {x}");
            return Ok(());
        }
        match poll_one(&rx.cq, Duration::from_secs(2))? {
            Some(wc) if wc.opcode == WcOpcode::RecvRdmaWithImm => {
                let mut got = [0u8; 16];
                rx.mem.read_at(2048, &mut got).map_err(e)?;
                let a_done = p.test(a).map(|d| d.is_some()).unwrap_or(false);
                Err(format!(
                    "a group of two completed (imm {:?}) though only tag 13 was sent: its receive 0 (tag 12) holds {:02x?}, \
                     request A (tag 10, of the old group) reported done: {a_done}",
                    wc.imm,
                    &got[..4]
                ))
            }
            Some(wc) => Err(format!("an unexpected completion: {wc:?}")),
            None => Ok(()),
        }
    })();
    let _ = p.close_send(comm);
    let _ = p.dereg(comm, mh);
    drop(mem);
    std::mem::forget(rx); // its QP may still be written by the closed comm's last requests
    result
}


/// A rank's connection whose hello goes out `delay` after its TCP
/// connection is up (its proxy thread was busy), with `between` run after
/// the listener first took the connection; then drives accept until the
/// rank is answered (Ok) or its connection is closed (Err).
fn rank_with_late_hello(p: &Plugin, v: &Verbs, delay: Duration, between: &dyn Fn(SocketAddr, Ptr) -> Result<Vec<TcpStream>, String>, call_accept_meanwhile: bool) -> Result<(), String> {
    let (h, l) = p.listen(0)?;
    let handle = Handle::read(&h).map_err(e)?;
    let (_cq, prepared) = member_qp(v)?;
    let fifo = MemoryRegion::alloc(&v.pd, wire::fifo_len(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).map_err(e)?;
    let mut rank = TcpStream::connect(handle.addr).map_err(e)?;
    let t0 = Instant::now();
    // The listener takes the rank's connection before its hello is there.
    let c = p.accept_once(l)?;
    if !c.is_null() {
        return Err("accept gave a comm before any hello".into());
    }
    let held = between(handle.addr, l)?;
    while t0.elapsed() < delay {
        if call_accept_meanwhile {
            let _ = p.accept_once(l)?;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    rank.write_all(&wire::hello(&handle.token, &prepared.endpoint(), fifo.addr(), fifo.rkey())).map_err(e)?;
    println!("review: the rank's hello went out {:.0} ms after its connection", t0.elapsed().as_secs_f64() * 1e3);
    let verdict = await_reply(p, l, &mut rank, Duration::from_secs(5))?;
    drop(held);
    let closings = logged("closed a connection from");
    let last = closings.last().cloned().unwrap_or_default();
    let _ = p.close_listen(l);
    verdict.map_err(|x| format!("{x}, {:.0} ms after it connected (the plugin's last closing line: {last:?})", t0.elapsed().as_secs_f64() * 1e3))
}

/// Calls accept until the rank's connection gets the listener's reply
/// (`Ok(Ok)`), is closed, or `within` passes (`Ok(Err)`, saying which).
fn await_reply(p: &Plugin, l: Ptr, rank: &mut TcpStream, within: Duration) -> Result<Result<(), String>, String> {
    rank.set_nonblocking(true).map_err(e)?;
    let mut buf = Vec::new();
    let t = Instant::now();
    loop {
        let _ = p.accept_once(l)?;
        let mut chunk = [0u8; REPLY_LEN];
        match rank.read(&mut chunk[..REPLY_LEN - buf.len()]) {
            Ok(0) => return Ok(Err("the listener closed the rank's connection".to_string())),
            Ok(k) => buf.extend_from_slice(&chunk[..k]),
            Err(x) if x.kind() == ErrorKind::WouldBlock => {}
            Err(x) => return Ok(Err(format!("the rank's connection: {x}"))),
        }
        if buf.len() == REPLY_LEN {
            return Ok(Ok(()));
        }
        if t.elapsed() > within {
            return Ok(Err(format!("the rank got no reply within {within:?}")));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// 17 stranger addresses (127.0.0.2 to 127.0.0.18), 4 silent connections
/// each: within every per-address budget, past the global one. A rank
/// whose hello comes 200 ms after its connection (inside the 2 s the
/// module allows for a hello) must still be answered.
fn distributed_strangers(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let flood = |addr: SocketAddr, l: Ptr| -> Result<Vec<TcpStream>, String> {
        let mut held = Vec::new();
        for i in 2..=18u8 {
            for _ in 0..4 {
                held.push(connect_from(Ipv4Addr::new(127, 0, 0, i), addr)?);
            }
        }
        let _ = p.accept_once(l)?;
        println!("review: {} silent connections from 17 addresses opened", held.len());
        Ok(held)
    };
    rank_with_late_hello(p, v, Duration::from_millis(200), &flood, true)
}

/// No strangers at all: the rank's hello arrives 50 ms after its
/// connection, but NCCL's proxy calls accept again only 2.5 s later. The
/// hello was sent in time; the connection must not be closed for it.
fn late_look(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (h, l) = p.listen(0)?;
    let handle = Handle::read(&h).map_err(e)?;
    let (_cq, prepared) = member_qp(v)?;
    let fifo = MemoryRegion::alloc(&v.pd, wire::fifo_len(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).map_err(e)?;
    let mut rank = TcpStream::connect(handle.addr).map_err(e)?;
    let _ = p.accept_once(l)?;
    std::thread::sleep(Duration::from_millis(50));
    rank.write_all(&wire::hello(&handle.token, &prepared.endpoint(), fifo.addr(), fifo.rkey())).map_err(e)?;
    std::thread::sleep(Duration::from_millis(2500));
    let verdict = await_reply(p, l, &mut rank, Duration::from_secs(5))?;
    let last = logged("closed a connection from").last().cloned().unwrap_or_default();
    let _ = p.close_listen(l);
    verdict.map_err(|x| format!("{x} though its hello was in the socket 50 ms after it connected (the plugin's line: {last:?})"))
}

/// A receive whose sender's claim was refused: once `test` returned the
/// error, its key opens nothing (with windows), as a completed one's.
fn refused_key(p: &Plugin, v: &Verbs) -> Result<(), String> {
    if logged("keys per receive").is_empty() {
        println!("review: keys per comm on this device: a refused receive's key opens its registration by design; skipped");
        return Ok(());
    }
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    let r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    peer.consumed();
    let lie = SendWr::write_with_imm(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0, HUGE).map_err(e)?;
    peer.run(lie)?;
    match p.wait(r, W) {
        Ok(s) => return Err(format!("the lie was taken: {} bytes", s[0])),
        Err(x) if x.contains("within") => return Err(x),
        Err(_) => {}
    }
    victim.mem[4096..4112].copy_from_slice(&[0x11; 16]);
    peer.local.write_at(0, &[0x99; 16]).map_err(e)?;
    let late = SendWr::write(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0).map_err(e)?;
    let status = peer.run(late)?;
    let landed = victim.mem[4096..4112] != [0x11; 16];
    let _ = victim.close(p);
    if status == WcStatus::Success || landed {
        return Err(format!("a write with the refused receive's key after test returned its error: {} (bytes landed: {landed})", status.verbs_name()));
    }
    println!("review: the refused receive's key after test: {}", status.verbs_name());
    Ok(())
}

fn vm_pin_kib() -> Result<u64, String> {
    let s = std::fs::read_to_string("/proc/self/status").map_err(e)?;
    s.lines().find_map(|l| l.strip_prefix("VmPin:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok()).ok_or_else(|| "no VmPin in /proc/self/status".into())
}

/// NCCL tears a receive comm down with a receive still posted (its peer
/// died, or an abort): deregMr, then closeRecv, as NCCL's proxy does.
/// Repeated 3 times with 1 MiB registrations: each closeRecv must return
/// promptly (no wait without bound), and the pinned memory must not grow
/// by the registrations' size.
fn teardown_pins(p: &Plugin, v: &Verbs) -> Result<(), String> {
    const N: usize = 3;
    const LEN: usize = 1 << 20;
    let before = vm_pin_kib()?;
    let mut slowest = Duration::ZERO;
    for i in 0..N {
        let (mut peer, comm) = Peer::connect(p, v)?;
        let mut victim = Victim::with_len(p, comm, LEN)?;
        let _r = victim.irecv(p, &[16])?;
        peer.entry(0)?;
        peer.consumed();
        let Victim { mem, mh, comm } = victim;
        p.dereg(comm, mh)?;
        let t = Instant::now();
        p.close_recv(comm)?;
        let took = t.elapsed();
        slowest = slowest.max(took);
        println!("review: teardown {i}: closeRecv took {:.1} s; VmPin {} kB", took.as_secs_f64(), vm_pin_kib()?);
        drop(mem);
        drop(peer);
    }
    let after = vm_pin_kib()?;
    let grown = after.saturating_sub(before);
    println!("review: VmPin {before} kB before, {after} kB after {N} teardowns with a receive posted; the slowest closeRecv {slowest:?}");
    let mut why = Vec::new();
    if grown >= (N * LEN / 1024 / 2) as u64 {
        why.push(format!("pinned memory grew by {grown} kB over {N} teardowns of 1 MiB registrations with a receive posted: each deregMr left its region registered (pinned) for good"));
    }
    if slowest > Duration::from_secs(5) {
        why.push(format!("a closeRecv with a receive posted took {slowest:?}"));
    }
    if why.is_empty() { Ok(()) } else { Err(why.join("; ")) }
}
