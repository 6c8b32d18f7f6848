//! Host memory a region can own: [`Registerable`] buffers (`Vec<u8>`,
//! `Box<[u8]>`) and the page-aligned [`HostBuffer`].

use std::alloc::{self, Layout};
use std::ptr::NonNull;

use crate::error::{Error, Result};
use crate::sysroot::page_size;

/// Memory that can be handed to [`MemoryRegion::register`](super::MemoryRegion::register).
///
/// # Safety
/// An implementor promises that, from the call to
/// [`as_mut_ptr`](Self::as_mut_ptr) until the value is dropped:
/// - the pointer addresses [`len`](Self::len) bytes that stay allocated at
///   the same address (moving the value must not move them), and
/// - nothing reads or writes those bytes except through that pointer (the
///   region owns the value and never calls anything else on it but `Drop`).
#[allow(clippy::len_without_is_empty)]
pub unsafe trait Registerable: Send + Sync + 'static {
    /// Pointer to the first byte; called once, before registration.
    fn as_mut_ptr(&mut self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
}

// SAFETY: a Vec's heap buffer does not move when the Vec is moved, and the
// region never touches the Vec again until dropping it.
unsafe impl Registerable for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: as for Vec: the boxed slice stays put when the Box moves.
unsafe impl Registerable for Box<[u8]> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        <[u8]>::as_mut_ptr(self)
    }
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
}

/// A zeroed, page-aligned host buffer: the usual backing for a region.
///
/// Page alignment keeps the region from sharing pages with unrelated
/// allocations (which `fork` would otherwise copy-on-write away from the
/// NIC) and is what NICs translate fastest.
pub struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
    len: usize,
}

// SAFETY: HostBuffer owns its allocation exclusively; it is plain bytes.
unsafe impl Send for HostBuffer {}
// SAFETY: no interior mutability is reachable through `&HostBuffer`.
unsafe impl Sync for HostBuffer {}


impl HostBuffer {
    /// Allocates `len` zeroed bytes, page-aligned (at least one byte is
    /// allocated even for `len == 0`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `len` cannot be allocated.
    pub fn new(len: usize) -> Result<HostBuffer> {
        let page = page_size();
        let size = len.max(1).checked_next_multiple_of(page);
        let layout = size
            .and_then(|s| Layout::from_size_align(s, page).ok())
            .ok_or_else(|| Error::InvalidArgument(format!("cannot allocate a {len}-byte host buffer")))?;
        // SAFETY: layout has non-zero size.
        let ptr = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr)
            .ok_or_else(|| Error::InvalidArgument(format!("out of memory allocating {len} bytes")))?;
        Ok(HostBuffer { ptr, layout, len })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// SAFETY: the allocation never moves and only the region uses it.
unsafe impl Registerable for HostBuffer {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}
