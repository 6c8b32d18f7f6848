//! Asynchronous events (`ibv_get_async_event`, `ibv_ack_async_event`):
//! what the device reports outside any completion (a port going down, a
//! queue pair's fatal error, a shared receive queue running low).

use std::time::Duration;

use gpudirect_sys as sys;

use crate::context::Context;
use crate::deadline::Deadline;
use crate::error::{Errno, Error, Result};
use crate::srq::SrqId;

/// An asynchronous event (`enum ibv_event_type` with its element).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// Fewer receives are posted on the shared receive queue than its
    /// armed limit ([`SharedReceiveQueue::arm_limit`](crate::SharedReceiveQueue::arm_limit)),
    /// which is now disarmed (`IBV_EVENT_SRQ_LIMIT_REACHED`).
    SrqLimitReached(SrqId),
    /// The shared receive queue failed; its queue pairs go to the error state (`IBV_EVENT_SRQ_ERR`).
    SrqError(SrqId),
    /// A queue pair on a shared receive queue will take no more of its
    /// receives (`IBV_EVENT_QP_LAST_WQE_REACHED`).
    QpLastWqeReached {
        /// The queue pair's number.
        qp_num: u32,
    },
    /// A queue pair hit an error not tied to one work request and is in the error state (`IBV_EVENT_QP_FATAL`).
    QpFatal {
        /// The queue pair's number.
        qp_num: u32,
    },
    /// A peer's request violated the transport (`IBV_EVENT_QP_REQ_ERR`).
    QpRequestError {
        /// The queue pair's number.
        qp_num: u32,
    },
    /// A peer's request broke an access rule (`IBV_EVENT_QP_ACCESS_ERR`).
    QpAccessError {
        /// The queue pair's number.
        qp_num: u32,
    },
    /// A first packet arrived on a queue pair in RTR (`IBV_EVENT_COMM_EST`).
    CommEstablished {
        /// The queue pair's number.
        qp_num: u32,
    },
    /// A completion queue overran or failed (`IBV_EVENT_CQ_ERR`).
    CqError,
    /// A port became active (`IBV_EVENT_PORT_ACTIVE`).
    PortActive {
        /// Port number.
        port: u8,
    },
    /// A port went down (`IBV_EVENT_PORT_ERR`): its queue pairs' peers
    /// are unreachable until it comes back.
    PortError {
        /// Port number.
        port: u8,
    },
    /// A port's GID table changed (`IBV_EVENT_GID_CHANGE`): a RoCE address
    /// came or went.
    GidChange {
        /// Port number.
        port: u8,
    },
    /// A port's LID, P_Key table, SM or registration changed
    /// (`IBV_EVENT_LID_CHANGE`, `PKEY_CHANGE`, `SM_CHANGE`, `CLIENT_REREGISTER`).
    PortChange {
        /// Port number.
        port: u8,
    },
    /// The device failed; every object of its context is unusable (`IBV_EVENT_DEVICE_FATAL`).
    DeviceFatal,
    /// Another event (the raw `ibv_event_type`).
    Other(u32),
}

impl AsyncEvent {
    /// Reads the event's kind and element. The element is valid until the
    /// event is acknowledged, which the caller does after this returns.
    fn from_raw(e: &sys::ibv_async_event) -> AsyncEvent {
        // Each closure reads the member the event type says is active
        // (ibv_get_async_event(3)), and only for such an event.
        // SAFETY: a QP event's element; the QP stays valid until the event
        // is acknowledged (destroying it waits for that).
        let qp_num = || unsafe { (*e.element.qp).qp_num };
        // SAFETY: an SRQ event's element; only its address is kept.
        let srq = || SrqId(unsafe { e.element.srq } as usize);
        // SAFETY: a port event's element, a plain integer.
        let port = || unsafe { e.element.port_num }.clamp(0, 255) as u8;
        match e.event_type {
            sys::IBV_EVENT_SRQ_LIMIT_REACHED => AsyncEvent::SrqLimitReached(srq()),
            sys::IBV_EVENT_SRQ_ERR => AsyncEvent::SrqError(srq()),
            sys::IBV_EVENT_QP_LAST_WQE_REACHED => AsyncEvent::QpLastWqeReached { qp_num: qp_num() },
            sys::IBV_EVENT_QP_FATAL => AsyncEvent::QpFatal { qp_num: qp_num() },
            sys::IBV_EVENT_QP_REQ_ERR => AsyncEvent::QpRequestError { qp_num: qp_num() },
            sys::IBV_EVENT_QP_ACCESS_ERR => AsyncEvent::QpAccessError { qp_num: qp_num() },
            sys::IBV_EVENT_COMM_EST => AsyncEvent::CommEstablished { qp_num: qp_num() },
            sys::IBV_EVENT_CQ_ERR => AsyncEvent::CqError,
            sys::IBV_EVENT_PORT_ACTIVE => AsyncEvent::PortActive { port: port() },
            sys::IBV_EVENT_PORT_ERR => AsyncEvent::PortError { port: port() },
            sys::IBV_EVENT_GID_CHANGE => AsyncEvent::GidChange { port: port() },
            sys::IBV_EVENT_LID_CHANGE | sys::IBV_EVENT_PKEY_CHANGE | sys::IBV_EVENT_SM_CHANGE | sys::IBV_EVENT_CLIENT_REREGISTER => {
                AsyncEvent::PortChange { port: port() }
            }
            sys::IBV_EVENT_DEVICE_FATAL => AsyncEvent::DeviceFatal,
            other => AsyncEvent::Other(other),
        }
    }
}

impl Context {
    /// Waits for the device's next asynchronous event, acknowledges it and
    /// returns it. `None` waits without limit. Events are handed out once
    /// each, to whichever thread asks; a program that never asks loses
    /// nothing but the news (the kernel queues them).
    ///
    /// # Errors
    /// [`Error::Timeout`] when `timeout` passes with no event;
    /// [`Error::Verb`] from poll(2) or `ibv_get_async_event`.
    pub fn async_event(&self, timeout: Option<Duration>) -> Result<AsyncEvent> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        // SAFETY: the context is open while `self` lives.
        let fd = unsafe { (*self.as_ptr()).async_fd };
        loop {
            if let Some(event) = self.try_async_event()? {
                return Ok(event);
            }
            match deadline.wait_readable(fd) {
                Ok(true) => {}
                Ok(false) => return Err(Error::Timeout(timeout.unwrap_or_default())),
                Err(errno) => return Err(Error::Verb { verb: "poll", errno }),
            }
        }
    }

    /// Takes the next event if one is queued, without waiting.
    pub(crate) fn try_async_event(&self) -> Result<Option<AsyncEvent>> {
        let mut raw = std::mem::MaybeUninit::<sys::ibv_async_event>::uninit();
        // SAFETY: valid context; its async fd is non-blocking (made so at
        // open), so this returns at once when no event is queued.
        if unsafe { sys::ibv_get_async_event(self.as_ptr(), raw.as_mut_ptr()) } == 0 {
            // SAFETY: filled in by the successful call.
            let raw = unsafe { raw.assume_init_mut() };
            let event = AsyncEvent::from_raw(raw);
            // SAFETY: one event taken, acknowledged once.
            unsafe { sys::ibv_ack_async_event(raw) };
            return Ok(Some(event));
        }
        let errno = Errno::last();
        if errno.0 == libc::EAGAIN || errno.0 == libc::EINTR {
            return Ok(None);
        }
        Err(Error::Verb { verb: "ibv_get_async_event", errno })
    }
}
