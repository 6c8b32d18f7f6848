//! Deadlines that accept any timeout (a leaf module: it imports only the
//! errno type). Public for the services built over this crate (the
//! transfer engine's control plane and rendezvous).
//!
//! `Instant::now() + timeout` panics when the sum overflows, which
//! `Duration::MAX` ("wait forever") always does. A deadline past what an
//! `Instant` can represent is no deadline at all.
//!
//! Also the one poll(2) wait on a non-blocking descriptor (completion
//! channel, async-event fd, rdma_cm event channel) bounded by a deadline.

use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use crate::errno::Errno;

/// Makes `fd` non-blocking, so a read after [`Deadline::wait_readable`]
/// (or one with nothing queued) returns at once instead of waiting.
pub(crate) fn set_nonblocking(fd: RawFd) -> Result<(), Errno> {
    // SAFETY: fcntl on a descriptor the caller owns; F_GETFL/F_SETFL touch
    // only its status flags.
    let ok = unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        flags >= 0 && libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) >= 0
    };
    if ok {
        Ok(())
    } else {
        Err(Errno::last())
    }
}

/// When a timeout runs out, or never.
#[derive(Clone, Copy, Debug)]
pub struct Deadline(Option<Instant>);

impl Deadline {
    /// `timeout` from now; never, when that is past the representable end of time.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline(Instant::now().checked_add(timeout))
    }

    /// No deadline.
    pub fn never() -> Deadline {
        Deadline(None)
    }

    /// Time left (zero once passed); `None` without a deadline.
    pub fn left(&self) -> Option<Duration> {
        self.0.map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// The sooner of the two.
    pub fn earlier(self, other: Deadline) -> Deadline {
        match (self.0, other.0) {
            (Some(a), Some(b)) => Deadline(Some(a.min(b))),
            (a, b) => Deadline(a.or(b)),
        }
    }

    /// Whether the deadline has passed.
    pub fn passed(&self) -> bool {
        self.left().is_some_and(|l| l.is_zero())
    }

    /// Waits until `fd` is readable, a signal interrupts, or the deadline
    /// passes. `Ok(false)`: it had passed before waiting. `Ok(true)`: try
    /// the non-blocking read again (it may still find nothing: callers
    /// loop, and the next call reports the deadline).
    pub(crate) fn wait_readable(&self, fd: RawFd) -> Result<bool, Errno> {
        let ms = match self.left() {
            None => -1,
            Some(left) if left.is_zero() => return Ok(false),
            // Rounded up: a wait that ends short of the deadline would
            // only wake the caller to wait again.
            Some(left) => left.as_micros().div_ceil(1000).clamp(1, i32::MAX as u128) as i32,
        };
        let mut pfd = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, ms) } < 0 {
            let errno = Errno::last();
            if errno.0 != libc::EINTR {
                return Err(errno);
            }
        }
        Ok(true)
    }
}

/// A TCP stream whose reads and writes all end by one [`Deadline`]: a
/// peer that trickles its bytes cannot stretch an exchange past it (a
/// per-read timeout resets with every byte). A read or write cut short by
/// the deadline fails with [`TimedOut`](std::io::ErrorKind::TimedOut).
/// The stream (a blocking one) gets its own timeouts back when this is
/// dropped.
pub struct Bounded<'a> {
    stream: &'a std::net::TcpStream,
    deadline: Deadline,
    /// The stream's read and write timeouts before, put back on drop.
    before: (Option<Duration>, Option<Duration>),
}

impl<'a> Bounded<'a> {
    /// Reads and writes on `stream` that all end by `deadline`.
    pub fn new(stream: &'a std::net::TcpStream, deadline: Deadline) -> Bounded<'a> {
        let before = (stream.read_timeout().unwrap_or(None), stream.write_timeout().unwrap_or(None));
        Bounded { stream, deadline, before }
    }

    /// What is left, as a socket timeout (`None`: block), or `TimedOut`.
    fn left(&self) -> std::io::Result<Option<Duration>> {
        match self.deadline.left() {
            Some(l) if l.is_zero() => Err(passed()),
            left => Ok(left),
        }
    }
}

fn passed() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::TimedOut, "the exchange's deadline passed")
}

/// A socket timeout's expiry (`EAGAIN`, which std reports as
/// `WouldBlock`) is the deadline's: `TimedOut`.
fn by_deadline<T>(r: std::io::Result<T>) -> std::io::Result<T> {
    r.map_err(|e| if e.kind() == std::io::ErrorKind::WouldBlock { passed() } else { e })
}

impl std::io::Read for Bounded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(self.left()?)?;
        by_deadline((&mut &*self.stream).read(buf))
    }
}

impl Drop for Bounded<'_> {
    fn drop(&mut self) {
        let _ = self.stream.set_read_timeout(self.before.0);
        let _ = self.stream.set_write_timeout(self.before.1);
    }
}

impl std::io::Write for Bounded<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(self.left()?)?;
        by_deadline((&mut &*self.stream).write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_timeout_is_accepted() {
        let d = Deadline::after(Duration::MAX);
        assert!(d.left().is_none() || d.left().unwrap() > Duration::from_secs(1 << 40));
        assert!(!d.passed());
        assert!(Deadline::after(Duration::ZERO).passed());
        assert!(!Deadline::never().passed());
        assert!(Deadline::after(Duration::from_secs(60)).left().unwrap() <= Duration::from_secs(60));
    }

    #[test]
    fn wait_readable_reports_readiness_and_the_deadline() {
        let mut fds = [0; 2];
        // SAFETY: a two-int array for pipe(2).
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let d = Deadline::after(Duration::from_millis(20));
        let start = Instant::now();
        assert_eq!(d.wait_readable(fds[0]), Ok(true)); // slept to the deadline
        assert!(start.elapsed() >= Duration::from_millis(19));
        assert_eq!(d.wait_readable(fds[0]), Ok(false));
        // SAFETY: writes one byte from a valid buffer to the pipe.
        assert_eq!(unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) }, 1);
        assert_eq!(Deadline::never().wait_readable(fds[0]), Ok(true));
        assert_eq!(Deadline::after(Duration::ZERO).wait_readable(fds[0]), Ok(false));
        // SAFETY: closing the two descriptors made above, once.
        unsafe { libc::close(fds[0]) };
        // SAFETY: as above.
        unsafe { libc::close(fds[1]) };
    }
}
