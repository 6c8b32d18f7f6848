//! Waiting for the engine from any event loop (Python's asyncio, mio, a
//! hand-written epoll): one descriptor per agent that turns readable when
//! a waiter should look again. State only: `core` holds it and tells it;
//! the polls that arm it are `Core::poll_*`.
//!
//! The descriptor is an epoll set holding every NIC's two completion
//! channels and an eventfd. A channel fires at the first completion after
//! its CQ was armed; the eventfd fires when a reap elsewhere (a blocking
//! `wait` on another thread, a tokio task) found completions while a
//! waiter was armed, since the channel event that would have woken the
//! loop may then be taken, or may never come (the completion was in the
//! CQ before the arm).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};

use gpudirect::CompletionQueue;
use gpudirect::{Errno, Error};

/// A descriptor that turns readable when a request an event loop waits
/// for may have finished, or a notification may have arrived
/// ([`Agent::readiness`](crate::Agent::readiness)). Level-triggered:
/// it stays readable until [`clear`](Self::clear).
///
/// The loop goes: [`TransferRequest::poll_completed`](crate::TransferRequest::poll_completed)
/// (or [`Agent::poll_notification`](crate::Agent::poll_notification));
/// if it is not ready, wait until this is readable, `clear`, and poll
/// again. A poll that finds nothing arms everything it needs, so no wakeup
/// is lost whichever thread reaps.
#[derive(Debug)]
pub struct Readiness {
    epoll: OwnedFd,
    wake: OwnedFd,
    /// Set by a poll that found nothing; a reap that found something
    /// takes it and writes the eventfd.
    armed: AtomicBool,
    /// The CQs whose channels are in the set (clones: they stay open
    /// while this lives), to take their events in `clear`.
    cqs: Box<[CompletionQueue]>,
}

impl Readiness {
    /// An epoll set over the completion channels of `cqs` and a fresh
    /// eventfd.
    pub(crate) fn new(cqs: Vec<CompletionQueue>) -> Result<Readiness, Error> {
        let verb = |verb: &'static str| Error::Verb { verb, errno: Errno::last() };
        // SAFETY: plain syscalls; each result is checked before it is owned.
        let epoll = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if epoll < 0 {
            return Err(verb("epoll_create1"));
        }
        // SAFETY: a descriptor just created, owned by nothing else.
        let epoll = unsafe { OwnedFd::from_raw_fd(epoll) };
        // SAFETY: as above.
        let wake = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if wake < 0 {
            return Err(verb("eventfd"));
        }
        // SAFETY: as above.
        let wake = unsafe { OwnedFd::from_raw_fd(wake) };
        for fd in cqs.iter().map(|cq| cq.as_fd().as_raw_fd()).chain([wake.as_raw_fd()]) {
            let mut ev = libc::epoll_event { events: libc::EPOLLIN as u32, u64: fd as u64 };
            // SAFETY: both descriptors are open (the channels of CQs we
            // hold, our eventfd); `ev` is a valid event for the call.
            if unsafe { libc::epoll_ctl(epoll.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
                return Err(verb("epoll_ctl"));
            }
        }
        Ok(Readiness { epoll, wake, armed: AtomicBool::new(false), cqs: cqs.into() })
    }

    /// Takes every event that made the descriptor readable: the eventfd's
    /// count and each channel's events (acknowledged). Call it before
    /// polling again, never instead: the events only say "look".
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_get_cq_event` or reading the eventfd.
    pub fn clear(&self) -> Result<(), Error> {
        let mut count = 0u64;
        // SAFETY: our open eventfd, an 8-byte buffer; non-blocking.
        let got = unsafe { libc::read(self.wake.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        if got < 0 && Errno::last().0 != libc::EAGAIN {
            return Err(Error::Verb { verb: "read(eventfd)", errno: Errno::last() });
        }
        for cq in self.cqs.iter() {
            cq.ack_events()?;
        }
        Ok(())
    }

    /// Marks a waiter as armed: the next reap that finds something says so.
    /// An exchange, not a store: when a reap took the flag just before,
    /// this reads its write, so whatever that reap finished is seen by
    /// the look that follows.
    pub(crate) fn arm(&self) {
        self.armed.swap(true, Ordering::SeqCst);
    }

    /// After a reap that found something: wakes the loop if a waiter is
    /// armed.
    pub(crate) fn tell(&self) {
        if self.armed.swap(false, Ordering::SeqCst) {
            let one = 1u64;
            // SAFETY: our open eventfd, an 8-byte value. A full counter
            // (EAGAIN) is already readable, which is all this wants.
            unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

impl AsFd for Readiness {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.epoll.as_fd()
    }
}

impl AsRawFd for Readiness {
    fn as_raw_fd(&self) -> RawFd {
        self.epoll.as_raw_fd()
    }
}
