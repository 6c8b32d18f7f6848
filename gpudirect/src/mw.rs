//! Memory windows (`ibv_alloc_mw`, type 2): a remote key to part of a
//! memory region, opened and closed by work requests on one queue pair.
//!
//! A region registered with [`AccessFlags::MW_BIND`] and no remote access
//! gives a peer nothing by its own key. A type-2 window bound to a range of
//! it ([`SendWr::bind_window`](crate::SendWr::bind_window)) opens exactly
//! that range, with the access the bind grants, to the peer of the queue
//! pair the bind was posted on, and to no other queue pair; an
//! [`invalidate`](crate::SendWr::invalidate) posted on that queue pair
//! closes it again (`ibv_alloc_mw(3)`, `ibv_wr_bind_mw(3)`: "type 2 memory
//! windows ... are bound using a work request ... and are valid only for
//! the QP they were bound to"). Each bind gives the window a new key:
//! [`next_rkey`] advances the eight bits the consumer owns, so a key from
//! an earlier bind opens nothing once the window is bound again.
//!
//! Where a device has them is [`DeviceAttr::mem_windows`](crate::DeviceAttr::mem_windows)
//! (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`).
//!
//! # Lifetimes
//! A window keeps the region of its last bind registered until it is bound
//! again or dropped: a region cannot be deregistered while a window is
//! bound to it (Soft-RoCE refuses, and the pinned memory would stay), and
//! an invalidation posted by key does not say which window it closed.
//! Drop (or invalidate) a window before the queue pair it was bound
//! through: a queue pair destroyed with a window still bound through it
//! waits in `ibv_destroy_qp` for the window (measured on Soft-RoCE in
//! Linux 6.1: 50 s).

use std::fmt;
use std::ptr::NonNull;

use gpudirect_sys as sys;

use crate::error::{Error, Result};
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;
use crate::sync::Mutex;

/// A type-2 memory window of one protection domain.
pub struct MemoryWindow {
    mw: NonNull<sys::ibv_mw>,
    pd: ProtectionDomain,
    /// The key it was allocated with.
    initial: u32,
    /// The key of the last bind posted (or the allocation's), and the
    /// region that bind named, kept registered while it may be bound.
    last: Mutex<(u32, Option<MemoryRegion>)>,
}

// SAFETY: a window is an opaque kernel handle; the verbs that use it
// (posting a bind or an invalidation, ibv_dealloc_mw) are thread-safe, and
// its Rust state is the domain (Send + Sync) and a mutex.
unsafe impl Send for MemoryWindow {}
// SAFETY: as above.
unsafe impl Sync for MemoryWindow {}

impl fmt::Debug for MemoryWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryWindow").field("rkey", &format_args!("{:#x}", self.last_rkey())).finish()
    }
}

impl MemoryWindow {
    /// Allocates a type-2 window in `pd`, bound to nothing.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_alloc_mw` (`EOPNOTSUPP` or `ENOSYS` where
    /// the device or its provider has no type-2 windows: see
    /// [`DeviceAttr::mem_windows`](crate::DeviceAttr::mem_windows)).
    pub fn alloc(pd: &ProtectionDomain) -> Result<MemoryWindow> {
        // SAFETY: a live protection domain.
        let mw = unsafe { sys::ibv_alloc_mw(pd.as_ptr(), sys::IBV_MW_TYPE_2) };
        let mw = NonNull::new(mw).ok_or_else(|| Error::last("ibv_alloc_mw"))?;
        // SAFETY: just allocated; rkey is plain data the provider set.
        let rkey = unsafe { (*mw.as_ptr()).rkey };
        Ok(MemoryWindow { mw, pd: pd.clone(), initial: rkey, last: Mutex::new((rkey, None)) })
    }

    /// The key the window was allocated with; its first bind's key is
    /// [`next_rkey`] of it.
    pub fn initial_rkey(&self) -> u32 {
        self.initial
    }

    /// The key of the last bind posted (the allocation's before any): the
    /// next bind's key must be [`next_rkey`] of it.
    pub fn last_rkey(&self) -> u32 {
        self.last.lock().0
    }

    /// The protection domain of the window (and of the queue pairs and
    /// regions it may be bound with).
    pub fn pd(&self) -> &ProtectionDomain {
        &self.pd
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_mw {
        self.mw.as_ptr()
    }

    /// Records `rkey` as the window's current key, once a bind giving it
    /// was posted: providers read the window's key as the one a type-2
    /// bind replaces (Soft-RoCE refuses a bind whose window key is not
    /// the kernel's current one), and for binds posted on a queue pair
    /// the verbs leave keeping it to the consumer.
    pub(crate) fn posted_bind(&self, rkey: u32, region: &MemoryRegion) {
        // The region stays registered while the window may be bound to it;
        // the one before was unbound by the invalidation this bind needed.
        *self.last.lock() = (rkey, Some(region.clone()));
        // SAFETY: the window lives while `self` does and `rkey` is an
        // aligned u32 field; it is written atomically, under the send
        // queue's lock of the queue pair that posted the bind, and read
        // by the provider only while posting a bind of this window.
        // Binds of one window from two threads at once are a misuse the
        // NIC refuses (a bound window cannot be bound), not a memory error.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(std::ptr::addr_of_mut!((*self.mw.as_ptr()).rkey)) }.store(rkey, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for MemoryWindow {
    fn drop(&mut self) {
        // SAFETY: allocated by ibv_alloc_mw, deallocated once. A bound
        // window is invalidated by its deallocation.
        let ret = unsafe { sys::ibv_dealloc_mw(self.mw.as_ptr()) };
        if ret != 0 {
            tracing::warn!("ibv_dealloc_mw failed: {}", Error::returned("ibv_dealloc_mw", ret));
        }
        // Only now may the region of its last bind be deregistered.
        self.last.lock().1 = None;
    }
}

/// The key a window's next bind gives after a bind (or allocation) that
/// gave `rkey`: the low eight bits, the consumer's, advanced by one
/// (`ibv_inc_rkey`).
pub const fn next_rkey(rkey: u32) -> u32 {
    (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff)
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_advance_in_the_low_byte_only() {
        assert_eq!(super::next_rkey(0x1234_5600), 0x1234_5601);
        assert_eq!(super::next_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(super::next_rkey(0xffff_ffff), 0xffff_ff00);
    }
}
