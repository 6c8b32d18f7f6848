//! Awaiting the engine (feature `tokio`): a request's completion and the
//! next notification as futures, on tokio's reactor.
//!
//! Progress stays where the blocking calls do it (`core.rs`): a future
//! reaps the CQs it cares about, and sleeps only once they are armed and
//! seen empty (poll, arm, poll again: a completion before the arm raises
//! no event). Any thread may reap what a task waits for: the blocking
//! `wait`, another task. So a sleeping task also wakes on [`Progress`],
//! told by every reap that found something, and looks again.
//!
//! The completion channels are registered with the reactor of the
//! runtime of the first await, once per agent; awaiting from another
//! runtime afterwards is refused (its reactor would never see them).
//! Futures hold no state of the engine's: dropping one (a timeout, a
//! `select!`) loses nothing, and what it waited for is there for the
//! next call.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::task::Poll;

use tokio::io::unix::AsyncFd;
use tokio::sync::futures::Notified;
use tokio::sync::Notify;

use crate::asynch::{watch, Watched};
use crate::cq::CompletionQueue;
use crate::error::Error;
use crate::sync::Mutex;

use super::core::{Core, Phase};
use super::error::EngineError;
use super::nic::Nic;

/// Told when a reap found completions, for the tasks that sleep.
#[derive(Default)]
pub(crate) struct Progress {
    /// Tasks between their look and their sleep, or asleep: with none,
    /// a reap costs one load here.
    waiting: AtomicUsize,
    notify: Notify,
}

impl Progress {
    pub(crate) fn tell(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }
}

/// Counts a task as waiting while it lives.
struct Waiting<'a>(&'a Progress);

impl<'a> Waiting<'a> {
    fn new(p: &'a Progress) -> Waiting<'a> {
        p.waiting.fetch_add(1, Ordering::SeqCst);
        Waiting(p)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Each NIC's completion channels, registered with one runtime's reactor.
/// Declared before the connection pool in [`Core`], so it is dropped
/// (deregistered) while the CQs that own the descriptors are open.
#[derive(Default)]
pub(crate) struct Channels {
    bound: OnceLock<(tokio::runtime::Id, Box<[NicFds]>)>,
    /// Held while registering: a descriptor goes into a reactor once
    /// (a second registration of it fails with EEXIST), so two first
    /// awaits on two worker threads must not both register.
    init: Mutex<()>,
}

pub(crate) struct NicFds {
    send: AsyncFd<Watched>,
    recv: AsyncFd<Watched>,
}

impl Channels {
    fn get(&self, nics: &[Nic]) -> Result<&[NicFds], EngineError> {
        let here = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::InvalidArgument(format!("awaiting the engine needs a tokio runtime with I/O enabled ({e})")))?
            .id();
        if self.bound.get().is_none() {
            let _init = self.init.lock();
            if self.bound.get().is_none() {
                let fds = nics
                    .iter()
                    .map(|n| Ok(NicFds { send: watch(fd(&n.send_cq))?, recv: watch(fd(&n.recv_cq))? }))
                    .collect::<Result<Box<[_]>, Error>>()?;
                let _ = self.bound.set((here, fds));
            }
        }
        let (bound, fds) = self.bound.get().expect("set above");
        if *bound != here {
            return Err(EngineError::Config(format!(
                "this agent's completion channels are registered with tokio runtime {bound}, not {here}: await one agent from one runtime"
            )));
        }
        Ok(fds)
    }
}

fn fd(cq: &CompletionQueue) -> std::os::fd::RawFd {
    use std::os::fd::{AsFd, AsRawFd};
    cq.as_fd().as_raw_fd()
}

/// Which of a NIC's two CQs a wait sleeps on.
#[derive(Clone, Copy)]
enum Side {
    Send,
    Recv,
}

impl Core {
    /// Until the post `state` is in has finished (or failed), reaping the
    /// send completions of `nics`.
    pub(crate) async fn completed(&self, state: &super::core::ReqState, nics: &[usize]) -> Result<(), EngineError> {
        let fds = self.channels.get(&self.pool.nics)?;
        let _w = Waiting::new(&self.progress);
        loop {
            let notified = self.progress.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match &*state.phase.lock() {
                Phase::Idle | Phase::Done => return Ok(()),
                Phase::Failed(f) => return Err(f.to_error()),
                Phase::Posted => {}
            }
            if self.reap_sends(nics)? > 0 {
                continue;
            }
            for &nic in nics {
                self.pool.nics[nic].send_cq.req_notify()?;
            }
            if self.reap_sends(nics)? > 0 {
                continue;
            }
            self.sleep(fds, nics, Side::Send, notified).await?;
        }
    }

    fn reap_sends(&self, nics: &[usize]) -> Result<usize, EngineError> {
        nics.iter().try_fold(0, |got, &nic| Ok(got + self.progress_send(nic, None)?))
    }

    /// The next notification.
    pub(crate) async fn notification(&self) -> Result<super::notify::Notification, EngineError> {
        let fds = self.channels.get(&self.pool.nics)?;
        let all: Vec<usize> = (0..self.pool.nics.len()).collect();
        let _w = Waiting::new(&self.progress);
        loop {
            let notified = self.progress.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(n) = self.next_note() {
                return Ok(n);
            }
            if self.reap_recvs()? > 0 {
                continue;
            }
            for n in self.pool.nics.iter() {
                n.recv_cq.req_notify()?;
            }
            if self.reap_recvs()? > 0 {
                continue;
            }
            self.sleep(fds, &all, Side::Recv, notified).await?;
        }
    }

    /// Until one of `nics`' `side` channels fires (its events taken) or
    /// a reap elsewhere tells `notified`.
    async fn sleep(&self, fds: &[NicFds], nics: &[usize], side: Side, mut notified: Pin<&mut Notified<'_>>) -> Result<(), EngineError> {
        poll_fn(|cx| {
            if notified.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            for &nic in nics {
                let (fd, cq) = match side {
                    Side::Send => (&fds[nic].send, &self.pool.nics[nic].send_cq),
                    Side::Recv => (&fds[nic].recv, &self.pool.nics[nic].recv_cq),
                };
                match fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(mut guard)) => {
                        // Every event taken (EAGAIN seen), so the
                        // readiness may be forgotten: the next event
                        // makes the fd readable anew.
                        let taken = cq.ack_events().map(drop).map_err(EngineError::from);
                        guard.clear_ready();
                        return Poll::Ready(taken);
                    }
                    Poll::Ready(Err(e)) => {
                        let errno = crate::error::Errno(e.raw_os_error().unwrap_or(libc::EIO));
                        return Poll::Ready(Err(Error::Verb { verb: "epoll", errno }.into()));
                    }
                    Poll::Pending => {}
                }
            }
            Poll::Pending
        })
        .await
    }
}
