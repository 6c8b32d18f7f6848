//! The plugin against a hostile peer, in one process on one device: a
//! member that holds the handle (so it passes the token), speaks the
//! plugin's setup from `nccl_net_gpudirect::wire`, and then does with raw
//! verbs whatever its keys let it; and strangers that hold sockets open
//! against a rank's listener. Each attack states what must hold and fails
//! the run when it does not.

use std::ffi::c_int;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpudirect::{AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, RemoteBuffer, SendWr, WcStatus, WorkCompletion};
use nccl_net_gpudirect::abi::{Ptr, HANDLE_MAXSIZE};
use nccl_net_gpudirect::wire::{self, Entry, Handle, REPLY_LEN, SIZES, SLOT, STAGE_AT};

use crate::phases::within;
use crate::plugin::{logged, Plugin};

const W: Duration = Duration::from_secs(30);
/// What the claimed-size attack says arrived in a 16-byte receive.
pub const HUGE: u32 = 2_147_418_112;

pub fn e(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// The attacker's verbs objects: its own protection domain, every access.
pub struct Verbs {
    pub ctx: Context,
    pub pd: ProtectionDomain,
}

impl Verbs {
    /// `device` opened, with a protection domain of the attacker's own.
    pub fn open(device: &str) -> Result<Verbs, String> {
        let ctx = Context::open(Some(device)).map_err(e)?;
        let pd = ProtectionDomain::new(&ctx).map_err(e)?;
        Ok(Verbs { ctx, pd })
    }
}

/// One connection of the attacker to a victim's listener.
pub struct Peer {
    pub cq: CompletionQueue,
    pub qp: QueuePair,
    pub fifo: MemoryRegion,
    pub local: MemoryRegion,
    /// The victim's sizes slots.
    pub sizes: RemoteBuffer,
    _stream: TcpStream,
    pub entries: u64,
}

impl Peer {
    /// Connects to a new listener of the plugin as a member would; returns
    /// the peer and the victim's receive comm.
    pub fn connect(p: &Plugin, v: &Verbs) -> Result<(Peer, Ptr), String> {
        let (h, l) = p.listen(0)?;
        let handle = Handle::read(&h).map_err(e)?;
        let cq = CompletionQueue::new(&v.ctx, 256).map_err(e)?;
        let all = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ;
        let config = QpConfig { access: all, max_inline_data: SLOT as u32, ..QpConfig::default() };
        let prepared = QueuePair::create(&v.pd, &cq, &cq, &config).map_err(e)?;
        let fifo = MemoryRegion::alloc(&v.pd, wire::fifo_len(), AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).map_err(e)?;
        let local = MemoryRegion::alloc(&v.pd, 1 << 16, AccessFlags::LOCAL_WRITE).map_err(e)?;
        let mut s = TcpStream::connect(handle.addr).map_err(e)?;
        s.write_all(&wire::hello(&handle.token, &prepared.endpoint(), fifo.addr(), fifo.rkey())).map_err(e)?;
        s.set_nonblocking(true).map_err(e)?;
        let (mut buf, mut prepared, mut connected) = (Vec::new(), Some(prepared), None);
        let t = Instant::now();
        let comm = loop {
            let c = p.accept_once(l)?;
            if connected.is_none() {
                let mut chunk = [0u8; REPLY_LEN];
                match s.read(&mut chunk[..REPLY_LEN - buf.len()]) {
                    Ok(0) => return Err("the listener closed a member's connection".into()),
                    Ok(k) => buf.extend_from_slice(&chunk[..k]),
                    Err(x) if x.kind() == ErrorKind::WouldBlock => {}
                    Err(x) => return Err(e(x)),
                }
                if buf.len() == REPLY_LEN {
                    let (ep, sizes) = wire::read_reply(buf[..].try_into().expect("REPLY_LEN")).map_err(e)?;
                    connected = Some((prepared.take().expect("once").connect(&ep).map_err(e)?, sizes));
                    s.write_all(&wire::READY).map_err(e)?;
                }
            }
            if !c.is_null() {
                break c;
            }
            if t.elapsed() > W {
                return Err("the victim accepted no comm".into());
            }
        };
        p.close_listen(l)?;
        let (qp, sizes) = connected.ok_or("the victim's comm came before its reply")?;
        Ok((Peer { cq, qp, fifo, local, sizes, _stream: s, entries: 0 }, comm))
    }

    /// Entry `r` of the next group the victim posted, once it is there.
    pub fn entry(&mut self, r: usize) -> Result<Entry, String> {
        let slot = (self.entries % 32) as usize;
        let t = Instant::now();
        loop {
            let mut b = [0u8; wire::ENTRY];
            self.fifo.read_at(slot * SLOT + r * wire::ENTRY, &mut b).map_err(e)?;
            let entry = Entry::from_bytes(&b);
            if entry.seq == self.entries + 1 {
                return Ok(entry);
            }
            if t.elapsed() > W {
                return Err("the victim's receive never reached the attacker's fifo".into());
            }
        }
    }

    /// Moves on to the victim's next group.
    pub fn consumed(&mut self) {
        self.entries += 1;
    }

    /// Posts `wr` and returns the status of its completion.
    pub fn run(&self, wr: SendWr<'_>) -> Result<WcStatus, String> {
        self.qp.post_send(&[wr]).map_err(e)?;
        let mut wc = [WorkCompletion::default(); 1];
        let t = Instant::now();
        loop {
            if self.cq.poll(&mut wc).map_err(e)? == 1 {
                return Ok(wc[0].status);
            }
            if t.elapsed() > W {
                return Err("the attacker's request never completed".into());
            }
        }
    }

    pub fn remote(entry: &Entry, offset: i64, len: u64) -> RemoteBuffer {
        RemoteBuffer { addr: entry.addr.wrapping_add_signed(offset), len, rkey: entry.rkey }
    }
}

/// Victim memory: 64 KiB registered on one comm, receives at 4 KiB.
pub struct Victim {
    pub mem: Vec<u8>,
    pub mh: Ptr,
    pub comm: Ptr,
}

impl Victim {
    pub fn new(p: &Plugin, comm: Ptr) -> Result<Victim, String> {
        Self::with_len(p, comm, 1 << 16)
    }

    pub fn with_len(p: &Plugin, comm: Ptr, len: usize) -> Result<Victim, String> {
        let mut mem = vec![0u8; len];
        let mh = p.reg(comm, &mut mem)?;
        Ok(Victim { mem, mh, comm })
    }

    pub fn irecv(&mut self, p: &Plugin, sizes: &[usize]) -> Result<Ptr, String> {
        let mut bufs: Vec<_> = sizes.iter().enumerate().map(|(i, &s)| (self.mem[4096 + i * 256..].as_mut_ptr(), s, 5 as c_int, self.mh)).collect();
        within(W, "irecv got no request", || p.irecv(self.comm, &mut bufs))
    }

    pub fn close(self, p: &Plugin) -> Result<(), String> {
        p.dereg(self.comm, self.mh)?;
        p.close_recv(self.comm)
    }
}

fn must_fail(what: &str, status: WcStatus) -> Result<(), String> {
    if status == WcStatus::Success {
        return Err(format!("{what}: it succeeded"));
    }
    println!("hostile: {what}: refused by the NIC ({})", status.verbs_name());
    Ok(())
}

/// One attack: `Err` says what got through.
pub type Attack<'a> = dyn Fn() -> Result<(), String> + 'a;

/// Every attack, in order.
pub fn run(p: &Plugin, device: &str) -> Result<(), String> {
    let v = Verbs::open(device)?;
    let attacks: [(&str, &Attack<'_>); 7] = [
        ("reads", &|| reads(p, &v)),
        ("writes outside the receive", &|| writes_outside(p, &v)),
        ("another comm's key", &|| other_comm(p, &v)),
        ("claimed sizes and slots", &|| claims(p, &v)),
        ("stale handles", &|| stale_handles(p)),
        ("strangers against setup", &|| strangers(p)),
        ("a member's setups left unfinished", &|| unfinished(p)),
    ];
    run_all("hostile", &attacks)
}

/// Runs every attack, so that one report shows each that got through;
/// `<WHO>_ONLY=word` (`HOSTILE_ONLY`, `REVIEW_ONLY`) runs only those whose
/// name contains it.
pub fn run_all(who: &str, attacks: &[(&str, &Attack<'_>)]) -> Result<(), String> {
    let only = std::env::var(format!("{}_ONLY", who.to_uppercase())).unwrap_or_default();
    let mut failed = Vec::new();
    for (name, attack) in attacks.iter().filter(|(name, _)| name.contains(only.as_str())) {
        println!("{who}: -- {name}");
        match attack() {
            Ok(()) => println!("{who}: HELD: {name}"),
            Err(why) => {
                println!("{who}: GOT THROUGH: {name}: {why}");
                failed.push(format!("{name}: {why}"));
            }
        }
    }
    if !failed.is_empty() {
        return Err(format!("{} of {} attacks got through:\n  {}", failed.len(), attacks.len(), failed.join("\n  ")));
    }
    println!("{who}: every attack refused");
    Ok(())
}

/// A read of a receive, and of the victim's control memory: the
/// protocol only writes.
fn reads(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    victim.mem[4096..4112].copy_from_slice(b"victim's secret!");
    let _r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    let read = SendWr::read(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0).map_err(e)?;
    must_fail("an RDMA read of the 16-byte receive with its own key", peer.run(read)?)?;
    victim.close(p)?;
    let (peer, comm) = Peer::connect(p, v)?;
    let read = SendWr::read(peer.local.slice(0..SIZES).map_err(e)?, &peer.sizes, 0).map_err(e)?;
    must_fail("an RDMA read of the victim's sizes slots with their key", peer.run(read)?)?;
    p.close_recv(comm)
}

/// What the init line says a receive's key opens on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Keys {
    /// Memory windows; `range`: the device bounds a window's range.
    Windows { range: bool },
    PerComm,
}

fn keys() -> Result<Keys, String> {
    let said = |s: &str| !logged(s).is_empty();
    match (said("keys per receive ("), said("keys per receive lifetime"), said("keys per comm")) {
        (true, false, false) => Ok(Keys::Windows { range: true }),
        (false, true, false) => Ok(Keys::Windows { range: false }),
        (false, false, true) => Ok(Keys::PerComm),
        other => Err(format!("the init lines say no one key mode for the device: {other:?}")),
    }
}

/// Writes past the receive: within its registration (what the device's
/// key mode allows is said at init), past the registration, and with the
/// receive's key after it completed.
fn writes_outside(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let keys = keys()?;
    println!("hostile: the init line says {keys:?}");
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    let _r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    let inside = SendWr::write(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 8192, 16), 0).map_err(e)?;
    let status = peer.run(inside)?;
    if keys == (Keys::Windows { range: true }) {
        must_fail("a write 8 KiB past the 16-byte receive", status)?;
    } else if status == WcStatus::Success {
        println!("hostile: a write 8 KiB past the 16-byte receive, inside its registration: reached ({keys:?}: the init line says so)");
    } else {
        return Err(format!("a write inside the receive's registration failed ({}) where the init line says {keys:?}", status.verbs_name()));
    }
    victim.close(p)?;
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    let _r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    let past = SendWr::write(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 1 << 20, 16), 0).map_err(e)?;
    must_fail("a write 1 MiB past the receive, outside its registration", peer.run(past)?)?;
    victim.close(p)?;
    // The receive's key once `test` said it completed.
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    let r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    peer.consumed();
    let honest = SendWr::write_with_imm(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0, 16).map_err(e)?;
    if peer.run(honest)? != WcStatus::Success {
        return Err("the receive's own write failed".into());
    }
    p.wait(r, W)?;
    victim.mem[4096..4112].copy_from_slice(&[0x11; 16]);
    let late = SendWr::write(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0).map_err(e)?;
    let status = peer.run(late)?;
    match keys {
        Keys::Windows { .. } => {
            must_fail("a write with a receive's key after test said it completed", status)?;
            if victim.mem[4096..4112] != [0x11; 16] {
                return Err("the late write's bytes landed".into());
            }
        }
        Keys::PerComm if status == WcStatus::Success => println!("hostile: a write with a receive's key after it completed: reached (keys per comm: the init line says so)"),
        Keys::PerComm => return Err(format!("a write with a completed receive's key failed ({}) where keys are per comm", status.verbs_name())),
    }
    victim.close(p)
}

/// A key of one comm used through another: two comms of the same
/// victim, the write through the first with the second's key.
fn other_comm(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (peer_a, comm_a) = Peer::connect(p, v)?;
    let (mut peer_b, comm_b) = Peer::connect(p, v)?;
    let mut victim_a = Victim::new(p, comm_a)?;
    let mut victim_b = Victim::new(p, comm_b)?;
    // NCCL's side of the same rule: a registration of comm A on comm B.
    match p.irecv(comm_b, &mut [(victim_a.mem[4096..].as_mut_ptr(), 16, 5, victim_a.mh)]) {
        Err(x) if !logged("registered through another comm").is_empty() => println!("hostile: comm A's registration on comm B refused: {x}"),
        Err(x) => return Err(format!("comm A's registration on comm B: refused without saying why: {x}")),
        Ok(_) => return Err("an irecv on comm B with comm A's registration was granted".into()),
    }
    let _r = victim_b.irecv(p, &[16])?;
    let entry = peer_b.entry(0)?;
    let write = SendWr::write(peer_a.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0).map_err(e)?;
    must_fail("a write through comm A with comm B's key for its receive", peer_a.run(write)?)?;
    victim_a.close(p)?;
    victim_b.close(p)
}

/// Sizes and slots a sender claims: refused for that request only.
fn claims(p: &Plugin, v: &Verbs) -> Result<(), String> {
    let (mut peer, comm) = Peer::connect(p, v)?;
    let mut victim = Victim::new(p, comm)?;
    peer.local.write_at(0, &[0xab; 64]).map_err(e)?;
    // One receive of 16 bytes, told that 2 GiB arrived.
    let r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    peer.consumed();
    let lie = SendWr::write_with_imm(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0, HUGE).map_err(e)?;
    if peer.run(lie)? != WcStatus::Success {
        return Err("the attacker's own write failed".into());
    }
    match p.wait(r, W) {
        Ok(sizes) => return Err(format!("test reported {} bytes for a 16-byte receive", sizes[0])),
        Err(x) if x.contains("within") => return Err(x),
        Err(_) => {}
    }
    let warned = logged(&format!("claims {HUGE} bytes arrived"));
    if warned.is_empty() {
        return Err("no WARN line naming the claim".into());
    }
    println!("hostile: a claimed size of {HUGE} in a 16-byte receive: that request failed: {}", warned[0]);
    // The comm goes on: the next receive is whole.
    let r = victim.irecv(p, &[16])?;
    let entry = peer.entry(0)?;
    peer.consumed();
    let honest = SendWr::write_with_imm(peer.local.slice(0..16).map_err(e)?, &Peer::remote(&entry, 0, 16), 0, 16).map_err(e)?;
    peer.run(honest)?;
    let got = p.wait(r, W)?;
    if got[0] != 16 || victim.mem[4096..4112] != [0xab; 16] {
        return Err(format!("the receive after the refused claim reports {} bytes", got[0]));
    }
    println!("hostile: the next receive on that comm completed whole (16 bytes)");
    // A group of two: a size past the second receive, then another slot.
    for (sizes, imm_off, want) in [([16u32, 4096], 0, "claims 4096 bytes arrived in receive 1"), ([16, 32], 1, "sizes are in slot")] {
        let slot = (peer.entries % 32) as u32;
        let r = victim.irecv(p, &[16, 32])?;
        peer.entry(1)?;
        peer.consumed();
        let bytes: Vec<u8> = sizes.iter().flat_map(|s| s.to_le_bytes()).collect();
        peer.local.write_at(0, &bytes).map_err(e)?;
        let wr = SendWr::write_with_imm(peer.local.slice(0..8).map_err(e)?, &peer.sizes, u64::from(slot) * SIZES as u64, slot + imm_off).map_err(e)?;
        peer.run(wr)?;
        match p.wait(r, W) {
            Ok(s) => return Err(format!("a group's claim ({sizes:?}, slot {}) was taken: {:?}", slot + imm_off, &s[..2])),
            Err(x) if x.contains("within") => return Err(x),
            Err(_) if !logged(want).is_empty() => println!("hostile: a group's claim refused: {}", logged(want)[0]),
            Err(x) => return Err(format!("a group's claim refused without naming it ({want}): {x}")),
        }
    }
    victim.close(p)
}

/// How many stale-handle WARN lines were seen so far (`bump`: one more).
fn seen_stale(bump: bool) -> usize {
    static SEEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    if bump {
        SEEN.fetch_add(1, Ordering::Relaxed);
    }
    SEEN.load(Ordering::Relaxed)
}

/// One connect call.
fn connect_once(p: &Plugin, h: &mut [u8; HANDLE_MAXSIZE]) -> Result<Ptr, String> {
    p.connect(0, h, Duration::ZERO).or_else(|x| if x.contains("within") { Ok(std::ptr::null_mut()) } else { Err(x) })
}

/// Drives `connect` with `h` and `accept` on `l` until both give a comm.
pub fn pair(p: &Plugin, h: &mut [u8; HANDLE_MAXSIZE], l: Ptr) -> Result<(Ptr, Ptr), String> {
    let (mut s, mut r): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
    let t = Instant::now();
    while s.is_null() || r.is_null() {
        if s.is_null() {
            s = connect_once(p, h)?;
        }
        if r.is_null() {
            r = p.accept_once(l)?;
        }
        if t.elapsed() > Duration::from_secs(150) {
            return Err("setup did not complete".into());
        }
    }
    Ok((s, r))
}

/// A copied handle, and a stale one whose state's slot was reused.
fn stale_handles(p: &Plugin) -> Result<(), String> {
    let stale = |what: &str, r: Result<Ptr, String>| {
        let said = logged("connection state is stale");
        match r {
            Err(_) if said.len() > seen_stale(false) => {
                println!("hostile: {what}: refused: {}", said[said.len() - 1]);
                seen_stale(true);
                Ok(())
            }
            Err(x) => Err(format!("{what}: refused without saying it is stale: {x}")),
            Ok(_) => Err(format!("{what}: accepted")),
        }
    };
    let (h, l) = p.listen(0)?;
    let mut live = h;
    connect_once(p, &mut live)?;
    if live[STAGE_AT..STAGE_AT + 16].iter().all(|&b| b == 0) {
        return Err("the first connect call completed at once: no state to copy".into());
    }
    let mut copy = live;
    connect_once(p, &mut live)?;
    stale("a copy of a handle whose connect moved on", connect_once(p, &mut copy))?;
    let (s, r) = pair(p, &mut live, l)?;
    p.close_send(s)?;
    p.close_recv(r)?;
    // A stale copy whose state was freed, its slot then taken by another
    // connection: it must not take that connection over.
    let mut old = h;
    connect_once(p, &mut old)?;
    let mut stale_copy = old;
    let (s, r) = pair(p, &mut old, l)?;
    let mut next = h;
    connect_once(p, &mut next)?;
    if next[STAGE_AT..STAGE_AT + 8] != stale_copy[STAGE_AT..STAGE_AT + 8] {
        return Err("the next connection's state is not in the freed slot: the test proves nothing".into());
    }
    stale("a stale handle naming a slot another connection now holds", connect_once(p, &mut stale_copy))?;
    let (s2, r2) = pair(p, &mut next, l)?;
    for c in [s, s2] {
        p.close_send(c)?;
    }
    for c in [r, r2] {
        p.close_recv(c)?;
    }
    p.close_listen(l)
}

/// A TCP connection to `to` from `from` (another loopback address: a
/// stranger, not the rank's own address).
pub fn connect_from(from: std::net::Ipv4Addr, to: SocketAddr) -> Result<TcpStream, String> {
    let SocketAddr::V4(to) = to else { return Err("the listener is not IPv4".into()) };
    let sin = |ip: std::net::Ipv4Addr, port: u16| libc::sockaddr_in { sin_family: libc::AF_INET as libc::sa_family_t, sin_port: port.to_be(), sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() }, sin_zero: [0; 8] };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket(2); the descriptor is owned by the TcpStream below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(e(std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` is a fresh socket this function owns.
    let stream = unsafe { TcpStream::from_raw_fd(fd) };
    let (a, b) = (sin(from, 0), sin(*to.ip(), to.port()));
    // SAFETY: `a` and `b` are sockaddr_in of `len` bytes.
    if unsafe { libc::bind(fd, (&a as *const libc::sockaddr_in).cast(), len) } != 0 || unsafe { libc::connect(fd, (&b as *const libc::sockaddr_in).cast(), len) } != 0 {
        return Err(e(std::io::Error::last_os_error()));
    }
    Ok(stream)
}

/// The setup time of one connection, with whatever else is going on.
fn setup_time(p: &Plugin) -> Result<(Duration, Ptr, Ptr, Ptr), String> {
    let (mut h, l) = p.listen(0)?;
    let t = Instant::now();
    let (s, r) = pair(p, &mut h, l)?;
    Ok((t.elapsed(), s, r, l))
}

fn close_all(p: &Plugin, (s, r, l): (Ptr, Ptr, Ptr)) -> Result<(), String> {
    p.close_send(s)?;
    p.close_recv(r)?;
    p.close_listen(l)
}

/// 48 silent connections held open, and a client that keeps
/// reconnecting, against a rank's listener: its setup takes at most a
/// second more than without them.
fn strangers(p: &Plugin) -> Result<(), String> {
    let stranger = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let mut base = Duration::ZERO;
    for _ in 0..3 {
        let (t, s, r, l) = setup_time(p)?;
        base = base.max(t);
        close_all(p, (s, r, l))?;
    }
    println!("hostile: setup without strangers: {:.0} ms (the slowest of 3)", base.as_secs_f64() * 1e3);
    let bound = base + Duration::from_secs(1);
    // 48 silent connections opened against the listener before the rank connects.
    let (mut h, l) = p.listen(0)?;
    let addr = Handle::read(&h).map_err(e)?.addr;
    let silent: Vec<TcpStream> = (0..48).map(|_| connect_from(stranger, addr)).collect::<Result<_, _>>()?;
    let t = Instant::now();
    let (s, r) = pair(p, &mut h, l)?;
    let took = t.elapsed();
    drop(silent);
    close_all(p, (s, r, l))?;
    if took > bound {
        return Err(format!("with 48 silent connections held open, setup took {took:?} (without: {base:?})"));
    }
    println!("hostile: with 48 silent connections held open: {:.0} ms", took.as_secs_f64() * 1e3);
    // A client that keeps reconnecting, sending part of a hello each time.
    let stop = AtomicBool::new(false);
    let mut worst = Duration::ZERO;
    std::thread::scope(|sc| -> Result<(), String> {
        let (h0, l) = p.listen(0)?;
        let addr = Handle::read(&h0).map_err(e)?.addr;
        let stop = &stop;
        let flood = sc.spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if let Ok(mut c) = connect_from(stranger, addr) {
                    let _ = c.write_all(&wire::HELLO[..7]);
                    n += 1;
                }
                std::thread::sleep(Duration::from_micros(500));
            }
            n
        });
        let result = (|| {
            for _ in 0..3 {
                let mut h = h0;
                let t = Instant::now();
                let (s, r) = pair(p, &mut h, l)?;
                worst = worst.max(t.elapsed());
                p.close_send(s)?;
                p.close_recv(r)?;
            }
            Ok(())
        })();
        stop.store(true, Ordering::Relaxed);
        let n = flood.join().map_err(|_| "the reconnecting client panicked".to_string())?;
        p.close_listen(l)?;
        println!("hostile: a client reconnected {n} times meanwhile");
        result
    })?;
    if worst > bound {
        return Err(format!("with a client reconnecting, setup took {worst:?} (without: {base:?})"));
    }
    println!("hostile: with a client reconnecting: {:.0} ms at worst of 3", worst.as_secs_f64() * 1e3);
    Ok(())
}

/// The token's holder opens 12 connections that prove themselves and never
/// finish setup: the listener makes queue pairs for at most
/// `MAX_PROVEN` of them and closes the rest, saying why.
fn unfinished(p: &Plugin) -> Result<(), String> {
    let (h, l) = p.listen(0)?;
    let handle = Handle::read(&h).map_err(e)?;
    let ep = gpudirect::Endpoint { qp_num: 1, psn: 0, lid: 0, mtu: gpudirect::Mtu::from_raw(3).ok_or("MTU code 3")?, gid: gpudirect::Gid([0; 16]) };
    let before = logged("have not finished setup").len();
    let mut held = Vec::new();
    for _ in 0..12 {
        let mut s = TcpStream::connect(handle.addr).map_err(e)?;
        s.write_all(&wire::hello(&handle.token, &ep, 0, 0)).map_err(e)?;
        held.push(s);
    }
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(2) {
        if !p.accept_once(l)?.is_null() {
            return Err("a connection that never sent READY became a comm".into());
        }
    }
    let closed = logged("have not finished setup").len() - before;
    let cap = nccl_net_gpudirect::MAX_PROVEN;
    if closed != 12 - cap {
        return Err(format!("12 connections proved themselves and stalled: {closed} closed, {} expected (the listener keeps {cap})", 12 - cap));
    }
    println!("hostile: 12 proven connections left unfinished: {cap} kept, {closed} closed, saying why");
    // The held ones failing now fails this listener's accept (a member's
    // connection that proved itself): close it without another call.
    drop(held);
    p.close_listen(l)
}
