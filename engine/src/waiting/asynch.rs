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
use std::task::Poll;

use tokio::sync::futures::Notified;

use gpudirect::Error;

use crate::transfers::core::{Core, Phase};
use crate::error::EngineError;
use crate::nics::wake::{NicFds, Waiting};

/// Which of a NIC's two CQs a wait sleeps on.
#[derive(Clone, Copy)]
enum Side {
    Send,
    Recv,
}

impl Core {
    /// Until the post `state` is in has finished (or failed), reaping the
    /// send completions of `nics`.
    pub(crate) async fn completed(&self, state: &crate::transfers::core::ReqState, nics: &[usize]) -> Result<(), EngineError> {
        let (fds, _, _w) = self.waiting()?;
        loop {
            let notified = self.progress.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            match &*state.phase.lock() {
                Phase::Idle | Phase::Done => return Ok(()),
                Phase::Failed(f) => return Err(f.to_error()),
                Phase::Posted => {}
            }
            if self.reap_sends(nics.iter().copied())? > 0 {
                continue;
            }
            for &nic in nics {
                self.pool.nics[nic].send_cq.req_notify()?;
            }
            if self.reap_sends(nics.iter().copied())? > 0 {
                continue;
            }
            self.sleep(fds, nics, &[Side::Send], notified).await?;
        }
    }

    /// Until `look` says done, looking again whenever a completion
    /// arrives on any CQ of the agent, another thread reaps, or `tick`
    /// passes (for what is due by time, such as a broadcast's probes).
    /// `look` reaps what it needs; the CQs are armed before each look,
    /// so nothing that arrives after it goes unseen.
    pub(crate) async fn until(&self, mut look: impl FnMut() -> Result<bool, EngineError>, tick: std::time::Duration) -> Result<(), EngineError> {
        let (fds, all, _w) = self.waiting()?;
        loop {
            let notified = self.progress.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            for n in self.pool.nics.iter() {
                n.send_cq.req_notify()?;
                n.recv_cq.req_notify()?;
            }
            if look()? {
                return Ok(());
            }
            if let Ok(r) = tokio::time::timeout(tick, self.sleep(fds, &all, &[Side::Send, Side::Recv], notified)).await {
                r?;
            }
        }
    }

    /// The next notification.
    pub(crate) async fn notification(&self) -> Result<crate::wire::notify::Notification, EngineError> {
        let (fds, all, _w) = self.waiting()?;
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
            // While this agent relays a broadcast, its forwards' send
            // completions wake it too (a failed one is told to the source).
            let relaying = self.relaying();
            for n in self.pool.nics.iter() {
                n.recv_cq.req_notify()?;
                if relaying {
                    n.send_cq.req_notify()?;
                }
            }
            if self.reap_recvs()? > 0 {
                continue;
            }
            let sides: &[Side] = if relaying { &[Side::Recv, Side::Send] } else { &[Side::Recv] };
            self.sleep(fds, &all, sides, notified).await?;
        }
    }

    /// What every wait here starts with: the channels (registered with
    /// this runtime once), every NIC's index, and this task counted among
    /// the sleepers for as long as the guard lives.
    fn waiting(&self) -> Result<(&[NicFds], Vec<usize>, Waiting<'_>), EngineError> {
        let fds = self.channels.get(&self.pool.nics)?;
        Ok((fds, (0..self.pool.nics.len()).collect(), Waiting::new(&self.progress)))
    }

    /// Until one of `nics`' channels of `sides` fires (its events taken)
    /// or a reap elsewhere tells `notified`.
    async fn sleep(&self, fds: &[NicFds], nics: &[usize], sides: &[Side], mut notified: Pin<&mut Notified<'_>>) -> Result<(), EngineError> {
        poll_fn(|cx| {
            if notified.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(()));
            }
            for (&nic, &side) in nics.iter().flat_map(|n| sides.iter().map(move |s| (n, s))) {
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
                        let errno = gpudirect::Errno(e.raw_os_error().unwrap_or(libc::EIO));
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
