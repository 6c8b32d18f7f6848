//! The building blocks gpudirect makes public for services over it
//! (watch_fd, deadline::Bounded, decode::Reader), as an outside review
//! attacked them from safe code. No RDMA device needed.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use gpudirect::deadline::{Bounded, Deadline};
use gpudirect::decode::Reader;

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
    // SAFETY: pipe2 succeeded: both are open and ours alone.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

fn write_byte(fd: &OwnedFd) {
    // SAFETY: one byte from a valid buffer to an open pipe.
    assert_eq!(unsafe { libc::write(fd.as_raw_fd(), b"x".as_ptr().cast(), 1) }, 1);
}

/// watch_fd's documented error: "InvalidArgument outside a tokio runtime
/// with I/O enabled". In a runtime built without `enable_io` it must
/// return that error, not panic (tokio's registration panics there).
#[test]
fn watch_fd_in_a_runtime_without_io_is_an_error_not_a_panic() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    let (r, _w) = pipe();
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(async { gpudirect::watch_fd(r.as_fd()).map(drop) })));
    match got {
        Ok(Err(gpudirect::Error::InvalidArgument(_))) => {}
        Ok(other) => panic!("expected InvalidArgument, got {other:?}"),
        Err(p) => {
            let msg = p.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| p.downcast_ref::<String>().cloned()).unwrap_or_default();
            panic!("watch_fd panicked instead of returning its documented error: {msg}");
        }
    }
}

/// Two watches made by `watch_fd` each keep their own registration
/// (dropping one leaves the other waking): the swap through tokio's
/// `get_mut` that once broke this no longer compiles (a compile_fail
/// doctest in `compile_fail.rs`).
#[test]
fn two_watches_keep_their_own_registrations() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build().unwrap();
    rt.block_on(async {
        let (r1, _w1) = pipe();
        let (r2, w2) = pipe();
        let a = gpudirect::watch_fd(r1.as_fd()).unwrap();
        let b = gpudirect::watch_fd(r2.as_fd()).unwrap();
        drop(a);
        write_byte(&w2);
        let woke = tokio::time::timeout(Duration::from_secs(2), b.readable()).await;
        assert!(woke.is_ok(), "the second watch lost its registration when the first was dropped");
    });
}

/// Bounded: a silent peer's read ends by the deadline, as `TimedOut`
/// (what `Bounded::left` reports once the deadline has passed).
#[test]
fn bounded_a_silent_peer_ends_by_the_deadline_with_timed_out() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let _peer = std::thread::spawn(move || {
        let s = std::net::TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_secs(3));
        drop(s);
    });
    let (s, _) = l.accept().unwrap();
    let start = Instant::now();
    let mut b = Bounded::new(&s, Deadline::after(Duration::from_millis(200)));
    let mut buf = [0u8; 4];
    let e = b.read_exact(&mut buf).unwrap_err();
    assert!(start.elapsed() < Duration::from_secs(2), "read outlived its deadline");
    assert_eq!(e.kind(), std::io::ErrorKind::TimedOut, "{e}");
}

/// Bounded leaves its last socket timeouts on the caller's stream: a
/// plain read after the bounded exchange (no deadline asked for) fails
/// after the leftover of the old deadline instead of blocking.
#[test]
fn bounded_leaves_its_timeout_on_the_stream_after_it_is_gone() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let peer = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(b"a").unwrap();
        std::thread::sleep(Duration::from_millis(800));
        s.write_all(b"b").unwrap();
        std::thread::sleep(Duration::from_millis(200));
    });
    let (s, _) = l.accept().unwrap();
    let before = s.read_timeout().unwrap();
    {
        let mut b = Bounded::new(&s, Deadline::after(Duration::from_millis(300)));
        let mut one = [0u8; 1];
        b.read_exact(&mut one).unwrap();
    }
    assert_eq!(s.read_timeout().unwrap(), before, "Bounded changed the stream's read timeout for good");
    let mut one = [0u8; 1];
    (&s).read_exact(&mut one).expect("a plain blocking read after the bounded exchange");
    peer.join().unwrap();
}

/// Reader never reads past its bytes, whatever the lengths asked (held).
#[test]
fn reader_refuses_every_length_past_the_end() {
    let bytes = [1u8, 2, 3];
    let mut r = Reader(&bytes);
    assert!(r.take("x", usize::MAX).is_err());
    assert!(r.u32("x").is_err());
    assert_eq!(r.rest(), 3, "a refused field consumed nothing");
    assert_eq!(r.u16("x").unwrap(), 0x0102);
    assert!(r.u16("x").is_err());
    assert_eq!(r.u8("x").unwrap(), 3);
    assert!(r.array::<1>("x").is_err());
}
