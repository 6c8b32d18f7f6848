//! What every queue pair of this crate is, whatever its transport (RC in
//! `qp`, UD in `ud`): the verbs object, its protection domain and
//! completion queues, the tracker that matches its completions to what
//! each request held, its port and GID, and its room in the CQs; made
//! and destroyed in one place.

use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

use gpudirect_sys as sys;

use crate::cq::{CompletionQueue, Reservation};
use crate::error::{check, Error, Result};
use crate::gid::GidChoice;
use crate::pd::ProtectionDomain;
use crate::port::PortAttr;
use crate::tracker::{holder, Tracker};

/// The port, the GID and the CQ room a queue pair is made with, taken
/// before the verbs object exists (so a failure leaves nothing to undo).
pub(crate) struct Prepared {
    pub(crate) port: PortAttr,
    pub(crate) gid: GidChoice,
    pub(crate) room: [Option<Reservation>; 2],
}

/// A created queue pair and what it holds; destroyed when dropped, or
/// earlier by its owner ([`QpCore::destroy`]).
pub(crate) struct QpCore {
    pub(crate) qp: NonNull<sys::ibv_qp>,
    pub(crate) qp_num: u32,
    pub(crate) pd: ProtectionDomain,
    pub(crate) send_cq: CompletionQueue,
    pub(crate) recv_cq: CompletionQueue,
    pub(crate) tracker: Arc<Tracker>,
    pub(crate) gid: GidChoice,
    pub(crate) port: PortAttr,
    /// The inline size the provider granted.
    pub(crate) max_inline: u32,
    /// Room in the send and receive CQs; see [`QpCore::destroy`].
    room: [Option<Reservation>; 2],
    /// `None` until destroyed; then whether `ibv_destroy_qp` succeeded.
    destroyed: Option<bool>,
    /// Held around `ibv_modify_qp` and `ibv_query_qp`: libibverbs stores
    /// `qp->state` after each without a lock of its own, so two threads
    /// moving one queue pair (an abort and a drop both flushing it) race
    /// on that field.
    transition: Mutex<()>,
}

// SAFETY: posting and modifying are thread-safe verbs; Rust-side state
// lives behind the tracker's mutexes.
unsafe impl Send for QpCore {}
// SAFETY: as above.
unsafe impl Sync for QpCore {}

impl QpCore {
    /// Checks the CQs are `pd`'s device's, picks the port's GID and
    /// reserves room for `send_wr` send completions and, with
    /// `Some(recv_wr)`, receive completions (`None`: the receives come
    /// from a shared receive queue, which holds that room itself).
    pub(crate) fn prepare(
        pd: &ProtectionDomain,
        cqs: [&CompletionQueue; 2],
        port_num: u8,
        gid_index: Option<u32>,
        send_wr: u32,
        recv_wr: Option<u32>,
    ) -> Result<Prepared> {
        check_cqs(pd, cqs)?;
        let ctx = pd.context();
        let port = ctx.query_port(port_num)?;
        let gid = ctx.choose_gid_on(&port, gid_index)?;
        // Every send may be signaled and every receive completes: the CQs
        // must hold them all, or they overrun.
        let room = [Some(cqs[0].reserve(send_wr)?), recv_wr.map(|n| cqs[1].reserve(n)).transpose()?];
        Ok(Prepared { port, gid, room })
    }

    /// Takes a queue pair just created on `cqs`: its completions are
    /// matched by `tracker` from now on (registered before any post, so no
    /// completion can go unmatched), and `pd` knows it holds memory.
    pub(crate) fn adopt(
        qp: NonNull<sys::ibv_qp>,
        pd: &ProtectionDomain,
        cqs: [&CompletionQueue; 2],
        tracker: Arc<Tracker>,
        prepared: Prepared,
        max_inline: u32,
    ) -> QpCore {
        // SAFETY: a created QP is readable.
        let qp_num = unsafe { (*qp.as_ptr()).qp_num };
        cqs[0].register(qp_num, tracker.clone());
        cqs[1].register(qp_num, tracker.clone());
        pd.inner.holders.add(holder(&tracker));
        QpCore {
            qp,
            qp_num,
            pd: pd.clone(),
            send_cq: cqs[0].clone(),
            recv_cq: cqs[1].clone(),
            tracker,
            gid: prepared.gid,
            port: prepared.port,
            max_inline,
            room: prepared.room,
            destroyed: None,
            transition: Mutex::new(()),
        }
    }

    /// `ibv_modify_qp` with the fields `mask` names, one transition of
    /// this queue pair at a time.
    pub(crate) fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: u32) -> Result<()> {
        let _one = self.transition.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: a valid QP and attribute struct; the mask names fields set.
        check("ibv_modify_qp", unsafe { sys::ibv_modify_qp(self.qp.as_ptr(), attr, mask as i32) })
    }

    /// `ibv_query_qp` for the fields `mask` names, under the same lock as
    /// [`QpCore::modify`] (the query stores `qp->state` too).
    pub(crate) fn query(&self, mask: u32) -> Result<sys::ibv_qp_attr> {
        let mut attr = std::mem::MaybeUninit::<sys::ibv_qp_attr>::zeroed();
        let mut init = std::mem::MaybeUninit::<sys::ibv_qp_init_attr>::zeroed();
        let _one = self.transition.lock().unwrap_or_else(PoisonError::into_inner);
        // SAFETY: a valid QP and out-pointers to zeroed structs.
        check("ibv_query_qp", unsafe { sys::ibv_query_qp(self.qp.as_ptr(), attr.as_mut_ptr(), mask as i32, init.as_mut_ptr()) })?;
        // SAFETY: all-zero is a valid ibv_qp_attr, and the fields asked
        // for were written over it.
        Ok(unsafe { attr.assume_init() })
    }

    /// Destroys the queue pair (once; later calls answer the same) and
    /// lets go of what it held: its tracker's outstanding work (released:
    /// the NIC no longer touches memory on its behalf) and its room in the
    /// CQs. Returns false when `ibv_destroy_qp` failed: then the held
    /// memory and the room are leaked instead (the NIC may still use the
    /// one and complete into the other), and so must be whatever else the
    /// owner keeps that the NIC can reach through the queue pair.
    pub(crate) fn destroy(&mut self) -> bool {
        if let Some(done) = self.destroyed {
            return done;
        }
        let done = self.destroy_now();
        self.destroyed = Some(done);
        done
    }

    fn destroy_now(&mut self) -> bool {
        let cqs = [&self.send_cq, &self.recv_cq];
        // SAFETY: the QP came from ibv_create_qp and is destroyed once,
        // here (`destroyed` guards it).
        let ret = unsafe { sys::ibv_destroy_qp(self.qp.as_ptr()) };
        #[cfg(feature = "fault-injection")]
        if ret == 0 && crate::fault::purging() {
            for cq in cqs {
                cq.purge(self.qp_num);
            }
        }
        for cq in cqs {
            cq.unregister(self.qp_num, &self.tracker);
        }
        if ret != 0 {
            tracing::warn!("{}", Error::returned("ibv_destroy_qp", ret));
            std::mem::forget(self.tracker.clone());
            std::mem::forget(self.room.each_mut().map(Option::take));
            return false;
        }
        // Work left unreaped may have left completions in the CQ (rxe keeps
        // a destroyed QP's; mlx5 removes them): that room stays owed until
        // the CQ has been seen empty.
        for (left, room) in self.tracker.clear().into_iter().zip(&mut self.room) {
            if let (true, Some(r)) = (left, room.take()) {
                r.into_debt();
            }
        }
        self.pd.inner.holders.remove(&holder(&self.tracker));
        true
    }
}

impl Drop for QpCore {
    fn drop(&mut self) {
        self.destroy();
    }
}

/// Refuses completion queues of another device than `pd`'s.
pub(crate) fn check_cqs(pd: &ProtectionDomain, cqs: [&CompletionQueue; 2]) -> Result<()> {
    let ctx = pd.context();
    for cq in cqs {
        if !Arc::ptr_eq(&cq.context().inner, &ctx.inner) {
            return Err(Error::InvalidArgument(format!(
                "completion queue of device {} used with a protection domain of {}",
                cq.context().name(),
                ctx.name()
            )));
        }
    }
    Ok(())
}
