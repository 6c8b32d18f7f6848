//! What wakes the engine's futures (feature `tokio`): each NIC's
//! completion channels registered with a runtime's reactor ([`Channels`])
//! and the word every reap that found something sends to sleeping tasks
//! ([`Progress`]). State only: `core` holds it and tells it, `asynch`
//! sleeps on it; neither imports the other through here.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::os::fd::AsFd;
use std::sync::OnceLock;

use tokio::sync::Notify;

use gpudirect::{watch_fd, WatchedFd};
use gpudirect::Error;
use gpudirect::sync::Mutex;

use crate::error::EngineError;
use crate::nics::nic::Nic;

/// Told when a reap found completions, for the tasks that sleep.
#[derive(Default)]
pub(crate) struct Progress {
    /// Tasks between their look and their sleep, or asleep: with none,
    /// a reap costs one load here.
    waiting: AtomicUsize,
    pub(crate) notify: Notify,
}

impl Progress {
    pub(crate) fn tell(&self) {
        if self.waiting.load(Ordering::SeqCst) > 0 {
            self.notify.notify_waiters();
        }
    }
}

/// Counts a task as waiting while it lives.
pub(crate) struct Waiting<'a>(&'a Progress);

impl<'a> Waiting<'a> {
    pub(crate) fn new(p: &'a Progress) -> Waiting<'a> {
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
    pub(crate) send: WatchedFd,
    pub(crate) recv: WatchedFd,
}

impl Channels {
    pub(crate) fn get(&self, nics: &[Nic]) -> Result<&[NicFds], EngineError> {
        let here = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::InvalidArgument(format!("awaiting the engine needs a tokio runtime with I/O enabled ({e})")))?
            .id();
        if self.bound.get().is_none() {
            let _init = self.init.lock();
            if self.bound.get().is_none() {
                let fds = nics
                    .iter()
                    .map(|n| Ok(NicFds { send: watch_fd(n.send_cq.as_fd())?, recv: watch_fd(n.recv_cq.as_fd())? }))
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

