//! The test phases, each in a receiving and a sending half.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::time::{Duration, Instant};

use nccl_net_gpudirect::abi::{Ptr, HANDLE_MAXSIZE};

use crate::plugin::{logged, Plugin};
use crate::Ctl;

const W: Duration = Duration::from_secs(120);
const SIZES: [usize; 9] = [0, 1, 7, 4096, 65_535, 65_536, 1 << 20, 8 << 20, 64 << 20];
/// Requests the harness keeps in flight per comm (the plugin grants 32).
const DEPTH: usize = 64;
const DEPTH_MSGS: usize = 256;
const DEPTH_SIZE: usize = 64 << 10;
const COMMS: usize = 16;

fn byte(msg: u64, i: usize) -> u8 {
    (msg.wrapping_mul(131) as usize).wrapping_add(i * 7).wrapping_add(i >> 9) as u8
}

fn fill(msg: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = byte(msg, i);
    }
}

fn check(msg: u64, buf: &[u8]) -> Result<(), String> {
    match buf.iter().enumerate().find(|(i, b)| **b != byte(msg, *i)) {
        None => Ok(()),
        Some((i, b)) => Err(format!("message {msg}: byte {i} of {} is {b:#x}, sent {:#x}", buf.len(), byte(msg, i))),
    }
}

fn isend(p: &Plugin, c: Ptr, data: *mut u8, size: usize, tag: c_int, m: Ptr) -> Result<Ptr, String> {
    within(W, &format!("isend of tag {tag} found no receive"), || p.isend(c, data, size, tag, m))
}

fn irecv(p: &Plugin, c: Ptr, bufs: &mut [(*mut u8, usize, c_int, Ptr)]) -> Result<Ptr, String> {
    within(W, "irecv got no request", || p.irecv(c, bufs))
}

/// Calls `f` until it returns a non-null pointer.
fn wait_for(f: impl FnMut() -> Result<Ptr, String>) -> Result<Ptr, String> {
    within(W, "nothing", f)
}

/// Calls `f` (NCCL's way: a null pointer means "not now") until it returns
/// a request or comm, or fails saying `what` once `bound` passed.
pub fn within(bound: Duration, what: &str, mut f: impl FnMut() -> Result<Ptr, String>) -> Result<Ptr, String> {
    let t = Instant::now();
    loop {
        let r = f()?;
        if !r.is_null() {
            return Ok(r);
        }
        if t.elapsed() > bound {
            return Err(format!("{what} within {bound:?}"));
        }
    }
}

/// A registered buffer.
struct Buf {
    mem: Vec<u8>,
    mh: Ptr,
}

impl Buf {
    fn new(p: &Plugin, comm: Ptr, len: usize) -> Result<Buf, String> {
        let mut mem = vec![0u8; len];
        let mh = p.reg(comm, &mut mem)?;
        Ok(Buf { mem, mh })
    }

    fn at(&mut self, off: usize) -> *mut u8 {
        self.mem[off..].as_mut_ptr()
    }
}

fn one_comm_recv(p: &Plugin, ctl: &mut Ctl) -> Result<Ptr, String> {
    let (h, l) = p.listen(0)?;
    ctl.send(&h);
    let c = p.accept(l, W)?;
    p.close_listen(l)?;
    Ok(c)
}

fn one_comm_send(p: &Plugin, ctl: &mut Ctl) -> Result<Ptr, String> {
    let mut h = ctl.recv::<HANDLE_MAXSIZE>();
    p.connect(0, &mut h, W)
}

/// The receiving side of every phase.
pub fn run_recv(p: &Plugin, ctl: &mut Ctl, _die: Option<usize>) -> Result<(), String> {
    let c = one_comm_recv(p, ctl)?;
    let mut buf = Buf::new(p, c, 64 << 20)?;
    // Sizes 0 B to 64 MiB.
    for (i, &size) in SIZES.iter().enumerate() {
        let r = irecv(p, c, &mut [(buf.at(0), size, i as c_int, buf.mh)])?;
        let got = p.wait(r, W)?;
        if got[0] as usize != size {
            return Err(format!("a {size}-byte message arrived as {} bytes", got[0]));
        }
        check(i as u64, &buf.mem[..size])?;
    }
    println!("serve: sizes 0 B to 64 MiB: every byte checked");
    // Grouped receives, 1 to 8, sent in reverse order of their tags.
    for n in 1..=8usize {
        let mut bufs: Vec<_> = (0..n).map(|j| (buf.at(j << 16), 4096 * (j + 1), (1000 + n * 10 + j) as c_int, buf.mh)).collect();
        let r = irecv(p, c, &mut bufs)?;
        let got = p.wait(r, W)?;
        for (j, &size) in got.iter().enumerate().take(n) {
            let want = 1000 * (j + 1) + n;
            if size as usize != want {
                return Err(format!("group of {n}: receive {j} reports {size} bytes, {want} were sent"));
            }
            check((n * 100 + j) as u64, &buf.mem[j << 16..(j << 16) + want])?;
        }
    }
    // A send larger than its receive is cut to it, and the size says so.
    let r = irecv(p, c, &mut [(buf.at(0), 100, 77, buf.mh)])?;
    let got = p.wait(r, W)?;
    if got[0] != 100 {
        return Err(format!("a 200-byte send into a 100-byte receive reports {}", got[0]));
    }
    check(77, &buf.mem[..100])?;
    println!("serve: grouped receives 1 to 8 matched by tag, sizes reported, truncation reported");
    // Requests in flight.
    let mut big = Buf::new(p, c, DEPTH_MSGS * DEPTH_SIZE)?;
    let (mut next, mut done, mut most) = (0usize, 0usize, 0usize);
    let mut pend: VecDeque<(usize, Ptr)> = VecDeque::new();
    let t = Instant::now();
    while done < DEPTH_MSGS {
        if next < DEPTH_MSGS && pend.len() < DEPTH {
            let r = p.irecv(c, &mut [(big.at(next * DEPTH_SIZE), DEPTH_SIZE, (next % 5) as c_int, big.mh)])?;
            if !r.is_null() {
                pend.push_back((next, r));
                next += 1;
                most = most.max(pend.len());
            }
        }
        let mut still = VecDeque::new();
        for (k, r) in pend.drain(..) {
            match p.test(r)? {
                Some(s) if s[0] as usize == DEPTH_SIZE => {
                    check(k as u64, &big.mem[k * DEPTH_SIZE..(k + 1) * DEPTH_SIZE])?;
                    done += 1;
                }
                Some(s) => return Err(format!("message {k} reports {} bytes", s[0])),
                None => still.push_back((k, r)),
            }
        }
        pend = still;
        if t.elapsed() > W {
            return Err("requests in flight did not complete".into());
        }
    }
    if most > 32 {
        return Err(format!("the plugin granted {most} receives in flight, NCCL's limit is 32"));
    }
    println!("serve: {DEPTH_MSGS} receives with up to {DEPTH} asked and {most} granted in flight: every byte checked");
    p.dereg(c, big.mh)?;
    p.dereg(c, buf.mh)?;
    ctl.sync();
    // 16 comms at once.
    let mut listens = Vec::new();
    for _ in 0..COMMS {
        let (h, l) = p.listen(0)?;
        ctl.send(&h);
        listens.push(l);
    }
    let mut comms: Vec<Ptr> = vec![std::ptr::null_mut(); COMMS];
    let t = Instant::now();
    while comms.iter().any(|c| c.is_null()) {
        for (i, l) in listens.iter().enumerate() {
            if comms[i].is_null() {
                comms[i] = p.accept_once(*l)?;
            }
        }
        if t.elapsed() > W {
            return Err("16 comms were not all accepted".into());
        }
    }
    // Registrations are per comm (regIsGlobal 0): the same memory, one
    // registration on each comm.
    let mut shared = vec![0u8; COMMS * 16384];
    let mhs: Vec<Ptr> = comms.iter().map(|&c| p.reg(c, &mut shared)).collect::<Result<_, _>>()?;
    for round in 0..8u64 {
        let reqs: Vec<Ptr> = (0..COMMS).map(|i| irecv(p, comms[i], &mut [(shared[i * 16384..].as_mut_ptr(), 16384, round as c_int, mhs[i])])).collect::<Result<_, _>>()?;
        for (i, r) in reqs.into_iter().enumerate() {
            p.wait(r, W)?;
            check(round * 1000 + i as u64, &shared[i * 16384..(i + 1) * 16384])?;
        }
    }
    for (&c, &m) in comms.iter().zip(&mhs) {
        p.dereg(c, m)?;
    }
    for (c, l) in comms.into_iter().zip(listens) {
        p.close_recv(c)?;
        p.close_listen(l)?;
    }
    println!("serve: {COMMS} comms at once, 8 rounds each, the same memory registered on each: every byte checked");
    ctl.sync();
    // A connection without this listener's token is closed, unanswered.
    let (h, l) = p.listen(0)?;
    ctl.send(&h);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if !p.accept_once(l)?.is_null() {
            return Err("a connection with a wrong token was accepted".into());
        }
    }
    ctl.sync();
    if logged("did not present this listener's token").is_empty() {
        return Err("no WARN line about the refused connection".into());
    }
    p.close_listen(l)?;
    println!("serve: a connection with a forged handle was closed unanswered and logged");
    // The v8 table: int sizes, no context.
    let (h, l) = p.listen_v8()?;
    ctl.send(&h);
    let c8 = wait_for(|| p.connect_or_accept_v8(None, l))?;
    let mut b8 = Buf::new(p, c8, 1 << 20)?;
    for (i, size) in [0usize, 5000, 1 << 20].into_iter().enumerate() {
        let r = wait_for(|| p.post_v8(c8, b8.at(0), size as c_int, i as c_int, b8.mh, true))?;
        let got = p.wait(r, W)?;
        if got[0] as usize != size {
            return Err(format!("v8: a {size}-byte message arrived as {}", got[0]));
        }
        check(900 + i as u64, &b8.mem[..size])?;
    }
    p.dereg(c8, b8.mh)?;
    p.close_recv(c8)?;
    p.close_listen(l)?;
    println!("serve: the v8 table (int sizes): 0 B, 5000 B, 1 MiB checked");
    p.close_recv(c)?;
    if logged("B from GPU memory").is_empty() {
        return Err("no traffic line when the last comm closed".into());
    }
    Ok(())
}

/// The sending side of every phase.
pub fn run_send(p: &Plugin, ctl: &mut Ctl) -> Result<(), String> {
    let c = one_comm_send(p, ctl)?;
    let mut buf = Buf::new(p, c, 64 << 20)?;
    for (i, &size) in SIZES.iter().enumerate() {
        fill(i as u64, &mut buf.mem[..size]);
        let r = isend(p, c, buf.at(0), size, i as c_int, buf.mh)?;
        let got = p.wait(r, W)?;
        if got[0] as usize != size {
            return Err(format!("a {size}-byte send reports {}", got[0]));
        }
    }
    for n in 1..=8usize {
        for j in (0..n).rev() {
            let size = 1000 * (j + 1) + n;
            fill((n * 100 + j) as u64, &mut buf.mem[j << 16..(j << 16) + size]);
        }
        let reqs: Vec<Ptr> = (0..n).rev().map(|j| isend(p, c, buf.at(j << 16), 1000 * (j + 1) + n, (1000 + n * 10 + j) as c_int, buf.mh)).collect::<Result<_, _>>()?;
        for r in reqs {
            p.wait(r, W)?;
        }
    }
    fill(77, &mut buf.mem[..200]);
    let r = isend(p, c, buf.at(0), 200, 77, buf.mh)?;
    p.wait(r, W)?;
    let mut big = Buf::new(p, c, DEPTH_MSGS * DEPTH_SIZE)?;
    for k in 0..DEPTH_MSGS {
        fill(k as u64, &mut big.mem[k * DEPTH_SIZE..(k + 1) * DEPTH_SIZE]);
    }
    let (mut next, mut done, mut most) = (0usize, 0usize, 0usize);
    let mut pend: VecDeque<Ptr> = VecDeque::new();
    let t = Instant::now();
    while done < DEPTH_MSGS {
        if next < DEPTH_MSGS && pend.len() < DEPTH {
            let r = p.isend(c, big.at(next * DEPTH_SIZE), DEPTH_SIZE, (next % 5) as c_int, big.mh)?;
            if !r.is_null() {
                pend.push_back(r);
                next += 1;
                most = most.max(pend.len());
            }
        }
        let mut still = VecDeque::new();
        for r in pend.drain(..) {
            if p.test(r)?.is_some() {
                done += 1;
            } else {
                still.push_back(r);
            }
        }
        pend = still;
        if t.elapsed() > W {
            return Err("sends in flight did not complete".into());
        }
    }
    println!("drive: {DEPTH_MSGS} sends, up to {most} in flight");
    p.dereg(c, big.mh)?;
    p.dereg(c, buf.mh)?;
    ctl.sync();
    let mut handles: Vec<[u8; HANDLE_MAXSIZE]> = (0..COMMS).map(|_| ctl.recv::<HANDLE_MAXSIZE>()).collect();
    let mut comms: Vec<Ptr> = vec![std::ptr::null_mut(); COMMS];
    let t = Instant::now();
    while comms.iter().any(|c| c.is_null()) {
        for (i, h) in handles.iter_mut().enumerate() {
            if comms[i].is_null() {
                comms[i] = p.connect(0, h, Duration::ZERO).or_else(|e| if e.contains("within") { Ok(std::ptr::null_mut()) } else { Err(e) })?;
            }
        }
        if t.elapsed() > W {
            return Err("16 comms were not all connected".into());
        }
    }
    let mut shared = vec![0u8; COMMS * 16384];
    let mhs: Vec<Ptr> = comms.iter().map(|&c| p.reg(c, &mut shared)).collect::<Result<_, _>>()?;
    for round in 0..8u64 {
        for i in 0..COMMS {
            fill(round * 1000 + i as u64, &mut shared[i * 16384..(i + 1) * 16384]);
        }
        let reqs: Vec<Ptr> = (0..COMMS).map(|i| isend(p, comms[i], shared[i * 16384..].as_mut_ptr(), 16384, round as c_int, mhs[i])).collect::<Result<_, _>>()?;
        for r in reqs {
            p.wait(r, W)?;
        }
    }
    for (&c, &m) in comms.iter().zip(&mhs) {
        p.dereg(c, m)?;
    }
    for c in comms {
        p.close_send(c)?;
    }
    println!("drive: {COMMS} comms at once");
    ctl.sync();
    let h = ctl.recv::<HANDLE_MAXSIZE>();
    // Random bytes.
    let mut junk = [0u8; HANDLE_MAXSIZE];
    for (i, b) in junk.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(37) ^ 0xa5;
    }
    // No connection state named: the bytes themselves are judged.
    junk[48..64].copy_from_slice(&[0; 16]);
    if p.connect(0, &mut junk, Duration::from_secs(1)).is_ok() || logged("not a GPUDirect handle (wrong magic)").is_empty() {
        return Err("connect accepted random bytes as a handle".into());
    }
    // A handle naming connection state the plugin never made.
    let mut staged = h;
    staged[48..56].copy_from_slice(&0xdead_beef_u64.to_le_bytes());
    if p.connect(0, &mut staged, Duration::from_secs(1)).is_ok() || logged("not one this plugin made").is_empty() {
        return Err("connect followed a forged state pointer".into());
    }
    // The right address, a wrong token.
    let mut forged = h;
    forged[30] ^= 0xff;
    let t = Instant::now();
    match p.connect(0, &mut forged, Duration::from_secs(15)) {
        Ok(_) => return Err("a forged token was accepted".into()),
        Err(e) if e.contains("within") => return Err(format!("a forged token got no answer and no error: {e}")),
        Err(_) => {}
    }
    println!("drive: garbage handles refused; a forged token closed in {:.2} s", t.elapsed().as_secs_f64());
    ctl.sync();
    let mut h = ctl.recv::<HANDLE_MAXSIZE>();
    let c8 = wait_for(|| p.connect_or_accept_v8(Some(&mut h), std::ptr::null_mut()))?;
    let mut b8 = Buf::new(p, c8, 1 << 20)?;
    for (i, size) in [0usize, 5000, 1 << 20].into_iter().enumerate() {
        fill(900 + i as u64, &mut b8.mem[..size]);
        let r = wait_for(|| p.post_v8(c8, b8.at(0), size as c_int, i as c_int, b8.mh, false))?;
        p.wait(r, W)?;
    }
    p.dereg(c8, b8.mh)?;
    p.close_send(c8)?;
    p.close_send(c)?;
    Ok(())
}

/// Receives 1 MiB messages until `die` of them arrived (then exits without
/// closing anything, as a killed process would) or, with no `die`, until
/// the sending peer dies: that must be an error within the bound.
pub fn death_recv(p: &Plugin, ctl: &mut Ctl, die: Option<usize>) -> Result<(), String> {
    let c = one_comm_recv(p, ctl)?;
    let mut buf = Buf::new(p, c, 1 << 20)?;
    let mut last = Instant::now();
    for k in 0.. {
        let r = match irecv(p, c, &mut [(buf.at(0), 1 << 20, 0, buf.mh)]) {
            Ok(r) => r,
            Err(e) => return detected(last, &e),
        };
        match p.wait(r, Duration::from_secs(60)) {
            Ok(_) => {
                check(k, &buf.mem)?;
                last = Instant::now();
            }
            Err(e) if e.contains("within") => return Err(format!("the receiver hung after its peer died: {e}")),
            Err(e) => return detected(last, &e),
        }
        if die == Some(k as usize + 1) {
            println!("serve: exiting abruptly after {} messages", k + 1);
            std::process::exit(0);
        }
    }
    unreachable!()
}

/// The sending half of the death phase.
pub fn death_send(p: &Plugin, ctl: &mut Ctl, die: Option<usize>) -> Result<(), String> {
    let c = one_comm_send(p, ctl)?;
    let mut buf = Buf::new(p, c, 1 << 20)?;
    let mut last = Instant::now();
    for k in 0.. {
        fill(k, &mut buf.mem);
        let r = match isend(p, c, buf.at(0), 1 << 20, 0, buf.mh) {
            Ok(r) => r,
            Err(e) if e.contains("within") => return Err(format!("the sender hung after its peer died: {e}")),
            Err(e) => return detected(last, &e),
        };
        match p.wait(r, Duration::from_secs(60)) {
            Ok(_) => last = Instant::now(),
            Err(e) if e.contains("within") => return Err(format!("the sender hung after its peer died: {e}")),
            Err(e) => return detected(last, &e),
        }
        if die == Some(k as usize + 1) {
            println!("drive: exiting abruptly after {} messages", k + 1);
            std::process::exit(0);
        }
    }
    unreachable!()
}

fn detected(last: Instant, e: &str) -> Result<(), String> {
    let after = last.elapsed();
    let why = logged("the peer died").pop().or_else(|| logged("comm on").pop()).unwrap_or_default();
    if after > Duration::from_secs(30) {
        return Err(format!("the peer's death was reported only after {after:?}: {e}"));
    }
    println!("peer death reported {:.1} s after the last completion: {e}; the log says: {why}", after.as_secs_f64());
    Ok(())
}

/// Bandwidth: `iters` messages of `size`, up to 32 in flight.
pub fn bench_recv(p: &Plugin, ctl: &mut Ctl, size: usize, iters: usize) -> Result<(), String> {
    let c = one_comm_recv(p, ctl)?;
    let mut buf = Buf::new(p, c, size.max(1) * 32)?;
    let (mut next, mut done) = (0, 0);
    let mut pend = VecDeque::new();
    while done < iters {
        while next < iters && pend.len() < 32 {
            let r = p.irecv(c, &mut [(buf.at((next % 32) * size), size, 0, buf.mh)])?;
            if r.is_null() {
                break;
            }
            pend.push_back(r);
            next += 1;
        }
        let mut progressed = false;
        if let Some(&r) = pend.front() {
            if p.test(r)?.is_some() {
                pend.pop_front();
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            // Nothing progressed: yield, as NCCL's proxy thread does.
            std::thread::yield_now();
        }
    }
    ctl.sync();
    Ok(())
}

/// One message in flight: isend until taken, then test until done, the
/// shape of `raw`'s post and poll loop, so that the instructions counted
/// against it differ by the calls, not by the loops around them. Returns
/// the test calls and the empty isend calls.
fn send_one_at_a_time(p: &Plugin, c: Ptr, buf: &mut Buf, size: usize, iters: usize) -> Result<(u64, u64), String> {
    let (mut tests, mut nulls) = (0u64, 0u64);
    for i in 0..iters {
        let r = loop {
            let r = p.isend(c, buf.at((i % 32) * size), size, 0, buf.mh)?;
            if !r.is_null() {
                break r;
            }
            nulls += 1;
            std::thread::yield_now();
        };
        loop {
            tests += 1;
            if p.test(r)?.is_some() {
                break;
            }
            std::thread::yield_now();
        }
    }
    Ok((tests, nulls))
}

/// The sending half of the bandwidth run, `window` messages in flight:
/// prints MB/s and the test calls per message.
pub fn bench_send(p: &Plugin, ctl: &mut Ctl, size: usize, iters: usize, window: usize) -> Result<(), String> {
    let c = one_comm_send(p, ctl)?;
    let mut buf = Buf::new(p, c, size.max(1) * 32)?;
    let (mut next, mut done, mut tests, mut nulls) = (0, 0, 0u64, 0u64);
    let mut pend = VecDeque::new();
    let t = Instant::now();
    if window == 1 {
        (tests, nulls) = send_one_at_a_time(p, c, &mut buf, size, iters)?;
        done = iters;
    }
    while done < iters {
        while next < iters && pend.len() < window {
            let r = p.isend(c, buf.at((next % 32) * size), size, 0, buf.mh)?;
            if r.is_null() {
                nulls += 1;
                break;
            }
            pend.push_back(r);
            next += 1;
        }
        let mut progressed = false;
        if let Some(&r) = pend.front() {
            tests += 1;
            if p.test(r)?.is_some() {
                pend.pop_front();
                done += 1;
                progressed = true;
            }
        }
        if !progressed {
            // Nothing progressed: yield, as NCCL's proxy thread does.
            std::thread::yield_now();
        }
    }
    let secs = t.elapsed().as_secs_f64();
    ctl.sync();
    println!(
        "bench: {size} bytes x {iters}: {:.2} MB/s ({:.1} us per message; {:.2} test and {:.2} empty isend calls per message)",
        (size * iters) as f64 / secs / 1e6,
        secs * 1e6 / iters as f64,
        tests as f64 / iters as f64,
        nulls as f64 / iters as f64
    );
    Ok(())
}

/// The raw verbs baseline: `iters` signaled 64-byte RDMA writes, each
/// posted through the library's queue pair and its completion polled, on
/// a loopback pair in this process. Prints the polls per message.
pub fn raw(device: &str, iters: usize) -> Result<(), String> {
    use gpudirect::{AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpConfig, QueuePair, SendWr, WorkCompletion};
    let e = |e: gpudirect::Error| e.to_string();
    let ctx = Context::open(Some(device)).map_err(e)?;
    let pd = ProtectionDomain::new(&ctx).map_err(e)?;
    let cq = CompletionQueue::new(&ctx, 1024).map_err(e)?;
    let config = QpConfig::default();
    let a = QueuePair::create(&pd, &cq, &cq, &config).map_err(e)?;
    let b = QueuePair::create(&pd, &cq, &cq, &config).map_err(e)?;
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let a = a.connect(&eb).map_err(e)?;
    let _b = b.connect(&ea).map_err(e)?;
    let src = MemoryRegion::alloc(&pd, 64, AccessFlags::LOCAL_WRITE).map_err(e)?;
    let dst = MemoryRegion::alloc(&pd, 64, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE).map_err(e)?;
    let remote = dst.remote();
    let mut wc = [WorkCompletion::default(); 1];
    let mut polls = 0u64;
    for i in 0..iters {
        a.post_send(&[SendWr::write(src.slice(..).map_err(e)?, &remote, 0).map_err(e)?.wr_id(i as u64)]).map_err(e)?;
        loop {
            polls += 1;
            if cq.poll(&mut wc).map_err(e)? == 1 {
                wc[0].ok().map_err(|x| x.to_string())?;
                break;
            }
        }
    }
    println!("raw: {iters} writes of 64 bytes, {:.2} polls per message", polls as f64 / iters as f64);
    Ok(())
}
