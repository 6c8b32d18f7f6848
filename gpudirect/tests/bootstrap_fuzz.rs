//! Hostile bootstrap input (point 4 of `docs/reliability.md`): the GDRX exchange is fed
//! truncated, oversized, wrong-magic, wrong-version, wrong-kind, random and
//! mutated bytes, both to the decoders ([`Handshake::decode`],
//! [`decode_header`]) and to the [`OobChannel`] read path over real TCP
//! sockets (peers that close mid-message or send nothing at all).
//!
//! For every input the test checks that:
//! - nothing panics;
//! - the result agrees with an independent reference decoder written from
//!   the wire format in `bootstrap.rs`'s module docs: every non-valid input
//!   is an error of the expected kind, every valid one decodes, and
//!   re-encoding it gives back the same bytes (round trip);
//! - the bytes allocated while decoding stay bounded: a counting global
//!   allocator (this binary's own) records the peak per input.
//!
//! Cases are drawn from a seeded generator, so a failure names a case that
//! reproduces. The default count keeps `cargo test` short; raise it with
//! `GPUDIRECT_FUZZ_CASES=10000000` (and `GPUDIRECT_FUZZ_SEED` to vary it).
//! The figures are in `docs/reliability/bootstrap-fuzz.md`.
//!
//! None of these tests is `#[ignore]`d: they need no device, so
//! `testbed/test-all` runs them on the host and never sends this binary to
//! the Soft-RoCE guest.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use gpudirect::bootstrap::{decode_header, BootstrapError, Handshake, OobChannel, MAGIC, MAX_BUFFERS, MAX_PAYLOAD, VERSION};
use gpudirect::{Endpoint, Gid, Mtu, RemoteBuffer};

// ---------------------------------------------------------------------------
// Counting allocator: per-thread live bytes and their peak.

/// Wraps the system allocator and counts live bytes per thread, so that
/// tests running in parallel threads do not disturb each other's figures.
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    // `try_with`: the allocator may be called while a thread's locals are
    // being torn down; those bytes are simply not counted.
    let _ = LIVE.try_with(|l| {
        let v = l.get() + delta;
        l.set(v);
        let _ = PEAK.try_with(|p| {
            if v > p.get() {
                p.set(v)
            }
        });
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are ours; the bookkeeping touches only
// `Cell<isize>` thread locals with const initialisers and no destructors,
// which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: our caller upholds `alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            note(layout.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: our caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        note(-(layout.size() as isize));
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: our caller upholds `realloc`'s contract.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // Count the moment both blocks may exist, then the old one's release.
            note(new_size as isize);
            note(-(layout.size() as isize));
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and returns its result with the peak number of bytes it held
/// allocated at once (on this thread, above what was live before; the
/// result's own allocations count).
fn peak_of<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    let peak = PEAK.with(Cell::get) - base;
    (r, peak.max(0) as usize)
}

/// Bound on what decoding one payload may allocate: the decoded buffers
/// (24 bytes in memory for 20 on the wire) and application blob, so at most
/// 6/5 of the payload, which is itself at most `MAX_PAYLOAD`; nothing for
/// anything longer. `SLACK` covers allocator rounding of tiny vectors.
const SLACK: usize = 64;
fn decode_bound(input_len: usize) -> usize {
    if input_len > MAX_PAYLOAD as usize {
        0
    } else {
        input_len * 6 / 5 + SLACK
    }
}
/// Bound on one `exchange` over the channel: our own encoded handshake and
/// message (small here), the peer's payload buffer (at most `MAX_PAYLOAD`)
/// and its decoded form (at most 6/5 of it), plus error strings.
const CHANNEL_BOUND: usize = (MAX_PAYLOAD as usize) * 11 / 5 + 4096;

// The seeded generator is the workspace test kit's (splitmix64).
use testkit::Rng;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(s) => s.replace('_', "").parse().unwrap_or_else(|_| panic!("{name}={s}: not a number")),
        Err(_) => default,
    }
}

/// Total decoder cases (`GPUDIRECT_FUZZ_CASES`, default 2,000,000).
fn cases() -> u64 {
    env_u64("GPUDIRECT_FUZZ_CASES", 2_000_000)
}

fn seed() -> u64 {
    env_u64("GPUDIRECT_FUZZ_SEED", 0x6764_7278_2023_0006)
}

// ---------------------------------------------------------------------------
// The reference decoder: the wire format, written independently of
// `bootstrap.rs` (index arithmetic, no shared helpers).

/// What decoding an input must give.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Want {
    Ok,
    TooLarge,
    Truncated(&'static str),
    Trailing(usize),
    Invalid(&'static str),
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0u64, |a, &x| (a << 8) | u64::from(x))
}

fn reference_payload(p: &[u8]) -> Want {
    if p.len() > MAX_PAYLOAD as usize {
        return Want::TooLarge;
    }
    // Field widths in order; a read past the end is a truncation of that field.
    let mut at = 0usize;
    macro_rules! field {
        ($name:expr, $n:expr) => {{
            let n: usize = $n;
            if p.len() - at < n {
                return Want::Truncated($name);
            }
            let v = &p[at..at + n];
            at += n;
            v
        }};
    }
    match field!("endpoint flag", 1)[0] {
        0 => {}
        1 => {
            let qpn = be(field!("qp_num", 4));
            let psn = be(field!("psn", 4));
            let _lid = field!("lid", 2);
            let mtu = field!("mtu", 1)[0];
            let _gid = field!("gid", 16);
            if qpn >= 1 << 24 {
                return Want::Invalid("qp_num");
            }
            if psn >= 1 << 24 {
                return Want::Invalid("psn");
            }
            if !(1..=5).contains(&mtu) {
                return Want::Invalid("mtu");
            }
        }
        _ => return Want::Invalid("endpoint flag"),
    }
    let n = be(field!("buffer count", 2)) as usize;
    if n > MAX_BUFFERS {
        return Want::TooLarge;
    }
    if p.len() - at < n * 20 {
        return Want::Truncated("buffers");
    }
    for _ in 0..n {
        let addr = be(&p[at..at + 8]);
        let len = be(&p[at + 8..at + 16]);
        at += 20;
        if addr.checked_add(len).is_none() {
            return Want::Invalid("buffer len");
        }
    }
    let app = be(field!("app length", 4)) as usize;
    let _ = field!("app", app);
    if at != p.len() {
        return Want::Trailing(p.len() - at);
    }
    Want::Ok
}

/// What a header must give: `Ok((kind, len))` or the error's name.
fn reference_header(h: &[u8; 12]) -> Result<(u8, u32), &'static str> {
    if h[..4] != MAGIC {
        return Err("BadMagic");
    }
    if be(&h[4..6]) != u64::from(VERSION) {
        return Err("Version");
    }
    let len = be(&h[8..12]);
    if len > u64::from(MAX_PAYLOAD) {
        return Err("TooLarge");
    }
    Ok((h[6], len as u32))
}

fn got_payload(r: &Result<Handshake, BootstrapError>) -> Want {
    match r {
        Ok(_) => Want::Ok,
        Err(BootstrapError::TooLarge { .. }) => Want::TooLarge,
        Err(BootstrapError::Truncated { field, .. }) => Want::Truncated(field),
        Err(BootstrapError::TrailingBytes(n)) => Want::Trailing(*n),
        Err(BootstrapError::InvalidField { field, .. }) => Want::Invalid(field),
        Err(e) => panic!("decode gave an error it never should: {e:?}"),
    }
}

fn header_name(r: &Result<(u8, u32), BootstrapError>) -> Result<(u8, u32), &'static str> {
    match r {
        Ok(x) => Ok(*x),
        Err(BootstrapError::BadMagic(_)) => Err("BadMagic"),
        Err(BootstrapError::Version { .. }) => Err("Version"),
        Err(BootstrapError::TooLarge { .. }) => Err("TooLarge"),
        Err(e) => panic!("decode_header gave an error it never should: {e:?}"),
    }
}

// ---------------------------------------------------------------------------
// Input generators.

fn random_handshake(rng: &mut Rng) -> Handshake {
    let endpoint = (!rng.chance(4)).then(|| Endpoint {
        qp_num: rng.below(1 << 24) as u32,
        psn: rng.below(1 << 24) as u32,
        lid: rng.next() as u16,
        gid: Gid(rng.bytes(16).try_into().unwrap()),
        mtu: Mtu::from_raw(1 + rng.below(5) as u32).unwrap(),
    });
    // Mostly small, sometimes up to the limits.
    let big = rng.chance(2000);
    let n = if big { rng.below(MAX_BUFFERS as u64 + 1) } else { rng.below(4) } as usize;
    let buffers = (0..n)
        .map(|_| {
            let addr = rng.next();
            let len = match (u64::MAX - addr).checked_add(1) {
                Some(room) => rng.below(room),
                None => rng.next(), // addr 0: any length fits
            };
            RemoteBuffer { addr, len, rkey: rng.next() as u32 }
        })
        .collect::<Vec<_>>();
    let room = MAX_PAYLOAD as usize - 64 - 20 * n;
    let app_len = if big { rng.below(room as u64 + 1) } else { rng.below(24) } as usize;
    Handshake { endpoint, buffers, app: rng.bytes(app_len) }
}

/// Offsets of the length-bearing fields of an encoding (buffer count and
/// app length), the most interesting places to corrupt.
fn length_fields(enc: &[u8]) -> (usize, usize) {
    let count_at = if enc[0] == 1 { 1 + 4 + 4 + 2 + 1 + 16 } else { 1 };
    let n = be(&enc[count_at..count_at + 2]) as usize;
    (count_at, count_at + 2 + 20 * n)
}

/// A payload: valid, mutated from valid, or random.
fn payload_case(rng: &mut Rng) -> Vec<u8> {
    let h = random_handshake(rng);
    let mut b = h.encode().expect("generated handshakes fit");
    match rng.below(12) {
        0 | 1 => b, // valid
        2 | 3 => {
            // Flip 1-4 bytes.
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(b.len() as u64) as usize;
                b[i] ^= 1 + rng.below(255) as u8;
            }
            b
        }
        4 => {
            b.truncate(rng.below(b.len() as u64) as usize);
            b
        }
        5 => {
            let k = 1 + rng.below(16) as usize;
            let extra = rng.bytes(k);
            b.extend_from_slice(&extra);
            b
        }
        6 => {
            // Corrupt a length field: count or app length, to small, huge or max.
            let (count_at, app_at) = length_fields(&b);
            let v = rng.next();
            if rng.chance(2) {
                let c = match rng.below(3) {
                    0 => v as u16,
                    1 => 0xffff,
                    _ => (MAX_BUFFERS as u16).wrapping_add(rng.below(3) as u16).wrapping_sub(1),
                };
                b[count_at..count_at + 2].copy_from_slice(&c.to_be_bytes());
            } else {
                let c = match rng.below(3) {
                    0 => v as u32,
                    1 => u32::MAX,
                    _ => (b.len() - app_at - 4) as u32 + rng.below(3) as u32,
                };
                b[app_at..app_at + 4].copy_from_slice(&c.to_be_bytes());
            }
            b
        }
        7 => {
            // Insert or delete a byte somewhere.
            let i = rng.below(b.len() as u64 + 1) as usize;
            if rng.chance(2) || i == b.len() {
                b.insert(i, rng.next() as u8);
            } else {
                b.remove(i);
            }
            b
        }
        8 => {
            // Endpoint fields out of range.
            if b[0] == 1 {
                match rng.below(4) {
                    0 => b[1] = 1 + rng.below(255) as u8,
                    1 => b[5] = 1 + rng.below(255) as u8,
                    2 => b[11] = [0, 6, 7, 255][rng.below(4) as usize],
                    _ => b[0] = 2 + rng.below(254) as u8,
                }
            } else {
                b[0] = 2 + rng.below(254) as u8;
            }
            b
        }
        9 => {
            // Oversized: beyond the limit (rarely: each one is 64 KiB of input).
            if rng.chance(100) {
                b.resize(MAX_PAYLOAD as usize + 1 + rng.below(4096) as usize, 0);
            }
            b
        }
        _ => {
            let len = if rng.chance(500) { rng.below(MAX_PAYLOAD as u64 + 2) } else { rng.below(96) };
            rng.bytes(len as usize)
        }
    }
}

fn header_bytes(kind: u8, len: u32) -> [u8; 12] {
    let mut h = [0u8; 12];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&VERSION.to_be_bytes());
    h[6] = kind;
    h[8..].copy_from_slice(&len.to_be_bytes());
    h
}

fn header_case(rng: &mut Rng) -> [u8; 12] {
    let mut h = header_bytes(1 + rng.below(2) as u8, rng.below(u64::from(MAX_PAYLOAD) + 1) as u32);
    match rng.below(6) {
        0 => h.copy_from_slice(&rng.bytes(12)),
        1 => {
            let i = rng.below(4) as usize;
            h[i] ^= 1 + rng.below(255) as u8;
        }
        2 => h[4..6].copy_from_slice(&(rng.next() as u16).to_be_bytes()),
        3 => h[8..].copy_from_slice(&(MAX_PAYLOAD + 1 + rng.below(u64::from(u32::MAX - MAX_PAYLOAD)) as u32).to_be_bytes()),
        4 => h[6] = rng.next() as u8,
        _ => {}
    }
    h
}

// ---------------------------------------------------------------------------
// Decoder fuzzing.

#[derive(Default, Debug)]
struct Tally {
    cases: u64,
    valid: u64,
    errors: u64,
    peak: usize,
    peak_input: usize,
}

fn check_payload(input: &[u8], t: &mut Tally) {
    let want = reference_payload(input);
    let (r, peak) = peak_of(|| Handshake::decode(input));
    let got = got_payload(&r);
    assert_eq!(got, want, "decode disagrees with the reference on {} bytes: {:02x?}", input.len(), &input[..input.len().min(96)]);
    let bound = decode_bound(input.len());
    assert!(peak <= bound, "decoding {} bytes allocated {peak} bytes at peak (bound {bound})", input.len());
    if peak > t.peak {
        t.peak = peak;
        t.peak_input = input.len();
    }
    t.cases += 1;
    match r {
        Ok(h) => {
            t.valid += 1;
            // Round trip: the encoding is canonical, so the bytes come back.
            assert_eq!(h.encode().expect("a decoded handshake re-encodes"), input);
        }
        Err(_) => t.errors += 1,
    }
}

/// The decoders under many seeded cases (`GPUDIRECT_FUZZ_CASES`, default
/// two million payloads plus as many headers).
#[test]
fn decoders_agree_with_the_reference_and_stay_bounded() {
    let n = cases();
    let mut rng = Rng(seed());
    let start = Instant::now();
    let mut t = Tally::default();
    let (mut headers, mut header_errors) = (0u64, 0u64);
    for _ in 0..n {
        let p = payload_case(&mut rng);
        check_payload(&p, &mut t);
        let h = header_case(&mut rng);
        let (r, peak) = peak_of(|| decode_header(&h));
        assert_eq!(header_name(&r), reference_header(&h), "header {h:02x?}");
        assert_eq!(peak, 0, "decode_header allocated");
        headers += 1;
        header_errors += u64::from(r.is_err());
    }
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "bootstrap fuzz (decoders): {} payloads ({} valid, {} errors) + {headers} headers ({header_errors} errors) in {secs:.1} s, \
         peak allocation {} bytes (for a {}-byte input; bound {} for that input, {} overall), seed {:#x}",
        t.cases,
        t.valid,
        t.errors,
        t.peak,
        t.peak_input,
        decode_bound(t.peak_input),
        decode_bound(MAX_PAYLOAD as usize),
        seed()
    );
    // Not vacuous: both outcomes were exercised in earnest.
    assert!(t.valid > n / 10 && t.errors > n / 2, "{t:?}");
    assert!(header_errors > headers / 2 && header_errors < headers, "{header_errors} of {headers}");
}

/// Every prefix and every single-byte change of a large valid payload
/// (1024 buffers, which is the most the format allows).
#[test]
fn every_prefix_and_byte_of_a_maximal_payload() {
    let mut rng = Rng(seed() ^ 1);
    let mut h = random_handshake(&mut rng);
    h.buffers = (0..MAX_BUFFERS).map(|i| RemoteBuffer { addr: i as u64 * 4096, len: 4096, rkey: i as u32 }).collect();
    h.app = rng.bytes(MAX_PAYLOAD as usize - 64 - 20 * MAX_BUFFERS);
    let b = h.encode().unwrap();
    let mut t = Tally::default();
    check_payload(&b, &mut t);
    assert_eq!(t.valid, 1);
    // Prefixes: every one around the fields' edges, a stride of 7 through
    // the buffer table (coprime with its 20-byte entries, so every offset
    // within an entry is cut), sparser through the application blob.
    let (_, app_at) = length_fields(&b);
    let prefixes: std::collections::BTreeSet<usize> = (0..64)
        .chain((64..app_at).step_by(7))
        .chain(app_at.saturating_sub(8)..app_at + 8)
        .chain((app_at..b.len()).step_by(997))
        .chain(b.len() - 8..b.len())
        .collect();
    for &n in &prefixes {
        check_payload(&b[..n], &mut t);
    }
    assert_eq!(t.errors, prefixes.len() as u64, "a strict prefix decoded: {t:?}");
    for i in 0..64 {
        let mut m = b.clone();
        m[i] ^= 0xff;
        check_payload(&m, &mut t);
    }
    let mut over = b.clone();
    over.resize(MAX_PAYLOAD as usize + 1, 0);
    check_payload(&over, &mut t);
    assert!(t.errors > prefixes.len() as u64 + 1, "{t:?}");
    eprintln!("maximal payload ({} bytes): {t:?}", b.len());
}

/// The allocator really counts (so the bounds above are not vacuous).
#[test]
fn counting_allocator_counts() {
    let (v, peak) = peak_of(|| vec![0u8; 100_000]);
    assert!(peak >= 100_000, "{peak}");
    drop(v);
    let big = Handshake { app: vec![7; 60_000], ..Default::default() }.encode().unwrap();
    let (r, peak) = peak_of(|| Handshake::decode(&big));
    assert!(r.is_ok() && peak >= 60_000, "{peak}");
}

// ---------------------------------------------------------------------------
// The channel's read path over real TCP sockets.

/// What the hostile peer does after writing its bytes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    /// Closes its sending side (the message may be incomplete).
    Close,
    /// Stays silent with the connection open.
    Hang,
}

/// What `exchange` (or `barrier`) must give when the peer sends `bytes`.
#[derive(Debug, PartialEq)]
enum WantChannel {
    Ok,
    Closed,
    Timeout,
    Header(&'static str),
    Kind,
    Payload(Want),
}

fn reference_channel(bytes: &[u8], then: Then, expected_kind: u8) -> WantChannel {
    let short = if then == Then::Close { WantChannel::Closed } else { WantChannel::Timeout };
    if bytes.len() < 12 {
        return short;
    }
    let (kind, len) = match reference_header(bytes[..12].try_into().unwrap()) {
        Ok(x) => x,
        Err(e) => return WantChannel::Header(e),
    };
    if kind != expected_kind {
        return WantChannel::Kind;
    }
    if bytes.len() - 12 < len as usize {
        return short;
    }
    let payload = &bytes[12..12 + len as usize];
    if expected_kind == 2 {
        return if payload.is_empty() { WantChannel::Ok } else { WantChannel::Payload(Want::Trailing(payload.len())) };
    }
    match reference_payload(payload) {
        Want::Ok => WantChannel::Ok,
        w => WantChannel::Payload(w),
    }
}

fn got_channel<T>(r: &Result<T, BootstrapError>) -> WantChannel {
    match r {
        Ok(_) => WantChannel::Ok,
        Err(BootstrapError::Closed { .. }) => WantChannel::Closed,
        Err(BootstrapError::Timeout(_)) => WantChannel::Timeout,
        Err(BootstrapError::BadMagic(_)) => WantChannel::Header("BadMagic"),
        Err(BootstrapError::Version { .. }) => WantChannel::Header("Version"),
        Err(BootstrapError::UnexpectedKind { .. }) => WantChannel::Kind,
        // The header's length check (limit MAX_PAYLOAD), not the payload's
        // buffer count (limit MAX_BUFFERS).
        Err(BootstrapError::TooLarge { max, .. }) if *max == u64::from(MAX_PAYLOAD) => WantChannel::Header("TooLarge"),
        Err(BootstrapError::Io { op, source }) => panic!("socket error on loopback: {op}: {source}"),
        Err(e) => WantChannel::Payload(match e {
            BootstrapError::TooLarge { .. } => Want::TooLarge,
            BootstrapError::Truncated { field, .. } => Want::Truncated(field),
            BootstrapError::TrailingBytes(n) => Want::Trailing(*n),
            BootstrapError::InvalidField { field, .. } => Want::Invalid(field),
            e => panic!("unexpected error {e:?}"),
        }),
    }
}

/// A whole message (header + payload) as a hostile peer might send it.
fn message_case(rng: &mut Rng) -> (Vec<u8>, Then) {
    let mut then = if rng.chance(400) { Then::Hang } else { Then::Close };
    let mut payload = payload_case(rng);
    if payload.len() > MAX_PAYLOAD as usize && !rng.chance(4) {
        payload.truncate(MAX_PAYLOAD as usize);
    }
    let kind = if rng.chance(8) { rng.next() as u8 } else { 1 };
    let len = if rng.chance(10) { rng.next() as u32 } else { payload.len() as u32 };
    let mut m = header_bytes(kind, len).to_vec();
    match rng.below(10) {
        0 => m[..4].copy_from_slice(&rng.bytes(4)),
        1 => m[4..6].copy_from_slice(&(rng.next() as u16).to_be_bytes()),
        _ => {}
    }
    m.extend_from_slice(&payload);
    match rng.below(8) {
        0 => {
            // Stops mid-message: closes, or (sometimes) goes silent.
            m.truncate(rng.below(m.len() as u64 + 1) as usize);
            if rng.chance(25) {
                then = Then::Hang;
            }
        }
        1 => {
            let k = rng.below(64) as usize;
            m = rng.bytes(k) // random bytes
        }
        _ => {}
    }
    (m, then)
}

/// One hostile peer: connects, sends `bytes`, then closes its sending side
/// or hangs; returns what our side's `exchange` (or `barrier`) gave.
fn against_peer(listener: &TcpListener, bytes: &[u8], then: Then, barrier: bool, timeout: Duration) -> (WantChannel, usize) {
    let addr = listener.local_addr().unwrap();
    std::thread::scope(|s| {
        let peer = s.spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            // Large messages exceed the socket buffers: write from this
            // thread while the other side reads.
            let _ = c.write_all(bytes);
            if then == Then::Close {
                let _ = c.shutdown(Shutdown::Write);
            }
            // Drain what our side sends until it hangs up, so that its
            // unread bytes never turn into a reset.
            let mut sink = [0u8; 4096];
            while matches!(c.read(&mut sink), Ok(n) if n > 0) {}
        });
        let (stream, _) = listener.accept().unwrap();
        let mut ch = OobChannel::from_stream(stream, timeout).unwrap();
        let ours = Handshake { app: b"ours".to_vec(), ..Default::default() };
        let (w, peak) = if barrier {
            let (r, peak) = peak_of(|| ch.barrier());
            (got_channel(&r), peak)
        } else {
            let (r, peak) = peak_of(|| ch.exchange(&ours));
            if let Ok(h) = &r {
                let len = u32::from_be_bytes(bytes[8..12].try_into().unwrap()) as usize;
                assert_eq!(h.encode().unwrap(), bytes[12..12 + len], "the peer's handshake did not round-trip");
            }
            (got_channel(&r), peak)
        };
        drop(ch);
        peer.join().unwrap();
        (w, peak)
    })
}

/// Hostile peers over loopback TCP: `cases() / 200` of them (10,000 by
/// default, at most 50,000), plus the named corner cases.
#[test]
fn channel_read_path_against_hostile_peers() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let hang = Duration::from_millis(150);
    let long = Duration::from_secs(20);

    // Named corner cases first.
    let valid = Handshake { app: b"peer".to_vec(), ..Default::default() }.encode().unwrap();
    let mut msg = header_bytes(1, valid.len() as u32).to_vec();
    msg.extend_from_slice(&valid);
    let maximal = Handshake {
        buffers: (0..MAX_BUFFERS as u64).map(|i| RemoteBuffer { addr: i << 20, len: 1 << 20, rkey: i as u32 }).collect(),
        app: vec![0x5a; MAX_PAYLOAD as usize - 64 - 20 * MAX_BUFFERS],
        ..Default::default()
    }
    .encode()
    .unwrap();
    let mut max_msg = header_bytes(1, maximal.len() as u32).to_vec();
    max_msg.extend_from_slice(&maximal);
    let corner: Vec<(&str, Vec<u8>, Then, bool, WantChannel)> = vec![
        ("valid handshake", msg.clone(), Then::Close, false, WantChannel::Ok),
        ("largest valid handshake", max_msg.clone(), Then::Hang, false, WantChannel::Ok),
        ("largest handshake cut short", max_msg[..max_msg.len() - 1].to_vec(), Then::Close, false, WantChannel::Closed),
        ("valid barrier", header_bytes(2, 0).to_vec(), Then::Close, true, WantChannel::Ok),
        ("nothing, then close", vec![], Then::Close, false, WantChannel::Closed),
        ("nothing, silent", vec![], Then::Hang, false, WantChannel::Timeout),
        ("half a header, silent", msg[..6].to_vec(), Then::Hang, false, WantChannel::Timeout),
        ("header only, silent", msg[..12].to_vec(), Then::Hang, false, WantChannel::Timeout),
        ("header only, close", msg[..12].to_vec(), Then::Close, false, WantChannel::Closed),
        ("payload cut short", msg[..msg.len() - 1].to_vec(), Then::Close, false, WantChannel::Closed),
        ("length 4 GiB", header_bytes(1, u32::MAX).to_vec(), Then::Hang, false, WantChannel::Header("TooLarge")),
        ("length MAX_PAYLOAD+1", header_bytes(1, MAX_PAYLOAD + 1).to_vec(), Then::Hang, false, WantChannel::Header("TooLarge")),
        ("HTTP", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(), Then::Close, false, WantChannel::Header("BadMagic")),
        ("TLS hello", vec![0x16, 3, 1, 0, 0xa5, 1, 0, 0, 0xa1, 3, 3, 0], Then::Close, false, WantChannel::Header("BadMagic")),
        ("version 2", { let mut m = msg.clone(); m[5] = 2; m }, Then::Close, false, WantChannel::Header("Version")),
        ("version 0", { let mut m = msg.clone(); m[5] = 0; m }, Then::Close, false, WantChannel::Header("Version")),
        ("barrier where a handshake is due", header_bytes(2, 0).to_vec(), Then::Close, false, WantChannel::Kind),
        ("handshake where a barrier is due", msg.clone(), Then::Close, true, WantChannel::Kind),
        ("barrier with a payload", { let mut m = header_bytes(2, 3).to_vec(); m.extend_from_slice(b"abc"); m }, Then::Close, true, WantChannel::Payload(Want::Trailing(3))),
        ("valid header, garbage payload", { let mut m = header_bytes(1, 40).to_vec(); m.extend_from_slice(&[0xee; 40]); m }, Then::Close, false, WantChannel::Payload(Want::Invalid("endpoint flag"))),
    ];
    let mut corner_peak = 0;
    for (name, bytes, then, barrier, want) in corner {
        // A short timeout only where the reply must be a timeout: a
        // complete message gets all the time a loaded machine may need.
        let timeout = if want == WantChannel::Timeout { hang } else { long };
        let start = Instant::now();
        let (got, peak) = against_peer(&listener, &bytes, then, barrier, timeout);
        assert_eq!(got, want, "{name}");
        assert_eq!(got, reference_channel(&bytes, then, if barrier { 2 } else { 1 }), "{name}: reference");
        assert!(peak <= CHANNEL_BOUND, "{name}: {peak} bytes");
        corner_peak = corner_peak.max(peak);
        if want == WantChannel::Timeout {
            // Timed out, promptly (not after the default 60 s).
            assert!(start.elapsed() < Duration::from_secs(5), "{name}: {:?}", start.elapsed());
        }
    }

    let n = (cases() / 200).clamp(100, 50_000);
    let mut rng = Rng(seed() ^ 2);
    let start = Instant::now();
    let (mut ok, mut err, mut peak_max, mut timeouts) = (0u64, 0u64, 0usize, 0u64);
    for i in 0..n {
        let (bytes, then) = message_case(&mut rng);
        let barrier = rng.chance(10);
        let want = reference_channel(&bytes, then, if barrier { 2 } else { 1 });
        let timeout = if want == WantChannel::Timeout { hang } else { long };
        let (got, peak) = against_peer(&listener, &bytes, then, barrier, timeout);
        assert_eq!(got, want, "case {i}: {} bytes, {then:?}, barrier {barrier}: {:02x?}", bytes.len(), &bytes[..bytes.len().min(64)]);
        assert!(peak <= CHANNEL_BOUND, "case {i}: {peak} bytes allocated (bound {CHANNEL_BOUND})");
        peak_max = peak_max.max(peak);
        if got == WantChannel::Ok {
            ok += 1
        } else {
            err += 1
        }
        timeouts += u64::from(got == WantChannel::Timeout);
    }
    eprintln!(
        "bootstrap fuzz (channel over TCP): {n} hostile peers ({ok} valid, {err} errors, {timeouts} timeouts) in {:.1} s, \
         peak allocation {peak_max} bytes (corner cases: {corner_peak}; bound {CHANNEL_BOUND})",
        start.elapsed().as_secs_f64()
    );
    assert!(ok > 0 && err > n / 2, "{ok} valid, {err} errors");
}

/// A peer that trickles a valid message a byte at a time, each byte well
/// within the timeout, cannot hold the exchange for longer than the
/// timeout: the whole message must arrive within it (otherwise a hostile
/// peer could stretch one exchange to `timeout` × 65,548 bytes).
#[test]
fn trickling_peer_times_out_as_a_whole() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let valid = Handshake { app: vec![1; 40], ..Default::default() }.encode().unwrap();
    let mut msg = header_bytes(1, valid.len() as u32).to_vec();
    msg.extend_from_slice(&valid);
    let timeout = Duration::from_millis(400);
    std::thread::scope(|s| {
        let msg = &msg;
        s.spawn(move || {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_nodelay(true).unwrap();
            // 59 bytes, one every 100 ms: about 6 s in all.
            for b in msg {
                if c.write_all(&[*b]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (stream, _) = listener.accept().unwrap();
        let mut ch = OobChannel::from_stream(stream, timeout).unwrap();
        let start = Instant::now();
        let r = ch.exchange(&Handshake::default());
        let took = start.elapsed();
        assert!(matches!(r, Err(BootstrapError::Timeout(_))), "{r:?} after {took:?}");
        // Well before the trickle could finish, even on a loaded machine.
        assert!(took < Duration::from_secs(3), "timed out only after {took:?}");
    });
}
