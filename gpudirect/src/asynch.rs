//! Completions and async events that async Rust can await, on tokio's
//! reactor (feature `tokio`): [`AsyncCompletionQueue`] and
//! [`AsyncEvents`].
//!
//! Waiting on a completion channel from an event loop has one trap: an
//! armed CQ raises one event, for the first completion after the arm, so
//! a waiter that arms after polling (or polls once after an event and
//! sleeps again) can sleep past completions that are already there. Here
//! every wait goes: poll; arm; poll again (what came before the arm raises
//! no event); only then sleep until the channel's fd is readable, take
//! the events, and start over.

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Notify;

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::error::{Errno, Error, Result};
use crate::event::AsyncEvent;
use crate::sync::Mutex;
use crate::wc::WorkCompletion;

/// What tokio watches: a duplicate of a channel's descriptor, its own.
/// Dropping the `AsyncFd` deregisters it and only then closes it, whatever
/// its owner struct's field order, so the owner's descriptor being closed
/// first (and its number reused by another thread's file) can never make
/// the deregistration remove someone else's registration. Private, and
/// never handed out mutably: tokio's `AsyncFd::get_mut` would let safe
/// code swap two of them, breaking the registration's promise (the same
/// descriptor for its whole life).
struct Dup(OwnedFd);

impl AsRawFd for Dup {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// A descriptor watched for readability on a tokio runtime's reactor
/// ([`watch_fd`]): wait for it with [`readable`](Self::readable) or
/// [`poll_read_ready`](Self::poll_read_ready). It owns a duplicate of the
/// descriptor, deregistered before it is closed; the descriptor itself
/// cannot be reached or replaced through it.
pub struct WatchedFd(AsyncFd<Dup>);

impl std::fmt::Debug for WatchedFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("WatchedFd").field(&self.0.get_ref().0).finish()
    }
}

/// Readiness of a [`WatchedFd`]: clear it once every event was taken (the
/// channel said `EAGAIN`), so the next event wakes the waiter anew.
pub struct ReadyGuard<'a>(tokio::io::unix::AsyncFdReadyGuard<'a, Dup>);

impl ReadyGuard<'_> {
    /// Forgets the readiness: the next wait sleeps until the descriptor is
    /// readable again.
    pub fn clear_ready(&mut self) {
        self.0.clear_ready();
    }
}

impl WatchedFd {
    /// Until the descriptor is readable.
    ///
    /// # Errors
    /// The reactor's I/O error.
    pub async fn readable(&self) -> std::io::Result<ReadyGuard<'_>> {
        self.0.readable().await.map(ReadyGuard)
    }

    /// [`readable`](Self::readable) as a poll, for hand-written futures.
    pub fn poll_read_ready<'a>(&'a self, cx: &mut std::task::Context<'_>) -> std::task::Poll<std::io::Result<ReadyGuard<'a>>> {
        self.0.poll_read_ready(cx).map(|r| r.map(ReadyGuard))
    }
}

/// Registers a duplicate of `fd` with the current runtime's reactor for
/// readability (readiness is the open file's, so the duplicate is
/// readable exactly when `fd` is): how a service over this crate sleeps on
/// a [`CompletionQueue`]'s channel (`cq.as_fd()`) beside other futures.
/// The duplicate keeps the file open; keep the channel's owner alive for
/// as long as the returned watch to get its events.
///
/// # Errors
/// [`Error::InvalidArgument`] outside a tokio runtime, in one built
/// without I/O (`enable_io`), or when the descriptor cannot be duplicated
/// or registered.
pub fn watch_fd(fd: BorrowedFd<'_>) -> Result<WatchedFd> {
    watch(fd).map(WatchedFd)
}

/// [`watch_fd`] for this module's own waiters.
fn watch(fd: BorrowedFd<'_>) -> Result<AsyncFd<Dup>> {
    let refused = |why: String| {
        Error::InvalidArgument(format!("watching a completion or event channel with tokio failed ({why}): it needs a tokio runtime with I/O enabled"))
    };
    // Registering outside a runtime would panic: refuse instead.
    tokio::runtime::Handle::try_current().map_err(|e| refused(e.to_string()))?;
    let own = fd.try_clone_to_owned().map_err(|e| refused(format!("dup: {e}")))?;
    // A runtime built without I/O panics at registration, and tokio offers
    // no way to ask first: the panic is caught and refused instead (the
    // panic hook still prints tokio's message).
    let registered = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `Dup` owns the duplicate and never hands it out mutably;
        // it stays open, the same file, until the `AsyncFd` drops it,
        // which deregisters it first.
        unsafe { AsyncFd::register_with_interest(Dup(own), Interest::READABLE) }
    }));
    match registered {
        Ok(r) => r.map_err(|e| refused(e.to_string())),
        Err(_) => Err(refused("the runtime has no I/O driver: build it with enable_io".into())),
    }
}

/// Waits until `fd` is readable, or `notified` fires first.
async fn readable_or(fd: &AsyncFd<Dup>, notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>, take: impl FnOnce() -> Result<()>) -> Result<()> {
    tokio::select! {
        guard = fd.readable() => {
            let mut guard = guard.map_err(|e| Error::Verb { verb: "epoll", errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)) })?;
            take()?;
            // Every event has been taken (the fd said EAGAIN): tokio may
            // forget this readiness; a later event makes it readable anew.
            guard.clear_ready();
        }
        () = notified => {}
    }
    Ok(())
}

/// A [`CompletionQueue`] whose completions can be awaited, from any number
/// of tasks at once, under a multi-threaded runtime.
///
/// Completions are reaped into a shared queue, from which
/// [`poll`](Self::poll) hands them out in order, and
/// [`completion`](Self::completion) takes the one of a given work request
/// (`wr_id`) wherever it is in it; tasks waiting for either are woken
/// when another task reaps what they wait for. Reaping is what releases
/// a request's memory, as with the blocking CQ: a future dropped while it
/// waits (cancelled, timed out) changes nothing about that, and the
/// completion it waited for stays queued for a later call.
///
/// Use one `AsyncCompletionQueue` per CQ: completions reaped through the
/// CQ directly ([`CompletionQueue::poll`]) bypass its queue.
///
/// ```no_run
/// # async fn f(cq: gpudirect::CompletionQueue, qp: gpudirect::QueuePair, wr: gpudirect::SendWr<'_>) -> gpudirect::Result<()> {
/// let acq = gpudirect::AsyncCompletionQueue::new(&cq)?;
/// qp.post_send(&[wr.wr_id(7)])?;
/// acq.completion(7).await?.ok()?; // the wait, then the work request
/// # Ok(()) }
/// ```
pub struct AsyncCompletionQueue {
    cq: CompletionQueue,
    fd: AsyncFd<Dup>,
    reaped: Mutex<VecDeque<WorkCompletion>>,
    /// Told whenever completions are reaped into `reaped`.
    reaped_more: Notify,
}

impl std::fmt::Debug for AsyncCompletionQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncCompletionQueue").field("cq", &self.cq).finish()
    }
}

impl AsyncCompletionQueue {
    /// Watches `cq`'s completion channel with the current tokio runtime.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside a tokio runtime with I/O enabled.
    pub fn new(cq: &CompletionQueue) -> Result<AsyncCompletionQueue> {
        Ok(AsyncCompletionQueue {
            cq: cq.clone(),
            fd: watch(cq.as_fd())?,
            reaped: Mutex::new(VecDeque::new()),
            reaped_more: Notify::new(),
        })
    }

    /// The completion queue.
    pub fn cq(&self) -> &CompletionQueue {
        &self.cq
    }

    /// Waits for at least one completion and moves up to `out.len()` of
    /// them into `out`, in the order they were reaped; returns how many.
    ///
    /// # Errors
    /// As [`CompletionQueue::poll`], and [`Error::Verb`] from the channel.
    pub async fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        self.wait_for(|q| {
            let n = out.len().min(q.len());
            for (o, wc) in out.iter_mut().zip(q.drain(..n)) {
                *o = wc;
            }
            (n > 0).then_some(n)
        })
        .await
    }

    /// Waits for the completion of the work request whose id is `wr_id`
    /// (the first such, should several share it) and returns it, failed
    /// or not ([`WorkCompletion::ok`] turns a failure into an error). An
    /// unsignaled request has no completion of its own: wait for the
    /// signaled one after it.
    ///
    /// # Errors
    /// As [`poll`](Self::poll).
    pub async fn completion(&self, wr_id: u64) -> Result<WorkCompletion> {
        self.wait_for(|q| {
            let i = q.iter().position(|wc| wc.wr_id == wr_id)?;
            q.remove(i)
        })
        .await
    }

    /// Runs `take` on the reaped queue until it finds what it wants,
    /// reaping and sleeping in between without ever sleeping past a
    /// completion (the module's notes).
    async fn wait_for<T>(&self, mut take: impl FnMut(&mut VecDeque<WorkCompletion>) -> Option<T>) -> Result<T> {
        loop {
            // Registered before looking, so a reap by another task after
            // the look still wakes this one.
            let notified = self.reaped_more.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(t) = take(&mut self.reaped.lock()) {
                return Ok(t);
            }
            if self.reap()? {
                continue;
            }
            self.cq.req_notify()?;
            if self.reap()? {
                continue;
            }
            readable_or(&self.fd, notified, || self.cq.ack_events().map(drop)).await?;
        }
    }

    /// Moves what the CQ holds into the reaped queue; says whether there
    /// was anything (and if so, wakes every waiting task to look).
    fn reap(&self) -> Result<bool> {
        let mut batch = [WorkCompletion::default(); 32];
        let mut any = false;
        loop {
            // The queue's lock is held across the poll, so completions
            // enter it in the order the CQ gave them out.
            let mut q = self.reaped.lock();
            let n = self.cq.poll(&mut batch)?;
            q.extend(&batch[..n]);
            drop(q);
            any |= n > 0;
            if n < batch.len() {
                break;
            }
        }
        if any {
            self.reaped_more.notify_waiters();
        }
        Ok(any)
    }
}

/// The device's asynchronous events ([`AsyncEvent`]) as something async
/// Rust awaits: [`recv`](Self::recv) is [`Context::async_event`] without
/// blocking a thread. Each event goes to one receiver.
pub struct AsyncEvents {
    ctx: Context,
    fd: AsyncFd<Dup>,
}

impl std::fmt::Debug for AsyncEvents {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncEvents").field("device", &self.ctx.name()).finish()
    }
}

impl AsyncEvents {
    /// Watches `ctx`'s async event channel with the current tokio runtime.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] outside a tokio runtime with I/O enabled.
    pub fn new(ctx: &Context) -> Result<AsyncEvents> {
        // SAFETY: the context is open while `ctx` lives.
        let fd = unsafe { (*ctx.as_ptr()).async_fd };
        // SAFETY: the descriptor is the context's and open while `ctx`
        // lives, which outlasts this call.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        Ok(AsyncEvents { ctx: ctx.clone(), fd: watch(fd)? })
    }

    /// Waits for the next event, acknowledges it and returns it.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_get_async_event` or the reactor.
    pub async fn recv(&self) -> Result<AsyncEvent> {
        loop {
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|e| Error::Verb { verb: "epoll", errno: Errno(e.raw_os_error().unwrap_or(libc::EIO)) })?;
            match self.ctx.try_async_event()? {
                Some(event) => return Ok(event),
                None => guard.clear_ready(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pipe() -> (OwnedFd, OwnedFd) {
        let mut fds = [0; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2 writes.
        assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC | libc::O_NONBLOCK) }, 0);
        // SAFETY: pipe2 succeeded: both are open and ours alone.
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
    }

    use std::os::fd::FromRawFd;

    /// The owner's descriptor closed before its watch is dropped (the
    /// order a struct's fields once gave), and its number taken at once by
    /// another file that another watch registers: dropping the first watch
    /// must not deregister the second, which still wakes.
    #[test]
    fn a_watch_dropped_after_its_owner_closed_leaves_a_reused_number_alone() {
        let rt = tokio::runtime::Builder::new_current_thread().enable_io().enable_time().build().unwrap();
        rt.block_on(async {
            let (r1, _w1) = pipe();
            let number = r1.as_raw_fd();
            let first = watch(r1.as_fd()).unwrap();
            // dup3 closes the first pipe's file and puts the second's on the
            // same number in one step: waiting for the lowest free number to
            // be reused races with other tests' threads opening files.
            let (tmp, w2) = pipe();
            // SAFETY: both are open descriptors this test owns; `number`
            // stays owned by `r1`, which now names the second pipe's file.
            assert_eq!(unsafe { libc::dup3(tmp.as_raw_fd(), number, libc::O_CLOEXEC) }, number);
            drop(tmp);
            let r2 = r1;
            let second = watch(r2.as_fd()).unwrap();
            drop(first);
            // SAFETY: writing one byte from a valid buffer to an open pipe.
            assert_eq!(unsafe { libc::write(w2.as_raw_fd(), b"x".as_ptr().cast(), 1) }, 1);
            let woke = tokio::time::timeout(Duration::from_secs(2), second.readable()).await;
            assert!(woke.is_ok(), "the second watch lost its registration");
        });
    }
}
