//! What a posted work request holds of local memory until its completion
//! is reaped: one [`InFlight`] per slice it names, as a [`Hold`].

use std::mem::ManuallyDrop;

use crate::claims::{overlap, Use};

use super::MemoryRegion;

/// Holds a region (alive and claimed) on behalf of a posted work request,
/// until its completion is reaped or its queue pair destroyed.
pub(crate) struct InFlight {
    pub(super) mr: MemoryRegion,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) nic_writes: bool,
}

impl InFlight {
    /// After the NIC wrote `written` bytes of the range (a receive or an
    /// RDMA read completed): brings them to the GPU if the region is
    /// host-staged, before anyone is told the data is there. The caller
    /// still holds the queue's lock with this hold in its list, so every
    /// CPU copy stays off the range. Returns whether the bytes are where
    /// the program reads them (a failure is logged).
    #[inline]
    pub(crate) fn landed(&self, written: usize) -> bool {
        !self.nic_writes || self.stage_in_landed(written)
    }

    fn stage_in_landed(&self, written: usize) -> bool {
        let Some(buf) = self.mr.staged() else { return true };
        let len = written.min(self.len);
        // SAFETY: the range is inside the region's mirror (it was posted),
        // no Rust reference to it exists, and this request's hold keeps
        // CPU copies off it.
        match unsafe { buf.copy_from_raw(self.offset, self.mr.inner.addr.add(self.offset), len) } {
            Ok(()) => true,
            Err(e) => {
                tracing::error!(offset = self.offset, len, "staging received bytes into GPU memory failed: {e}");
                false
            }
        }
    }

    /// Whether this hold names bytes `start..end` of region `region` in a
    /// way that conflicts with a CPU copy's `use_`.
    #[inline]
    pub(crate) fn conflicts(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
        let held = if self.nic_writes { Use::NicWrites } else { Use::NicReads };
        self.mr.id() == region && overlap(self.offset, self.offset + self.len, start, end) && use_.conflicts(held)
    }
}

impl Drop for InFlight {
    #[inline]
    fn drop(&mut self) {
        self.mr.inner.claims.release_nic();
    }
}

/// The holds of one work request: none (no local memory, or an inline
/// payload already copied), one slice's, or a scatter/gather list's.
pub(crate) enum Hold {
    None,
    One(InFlight),
    Many(Gathered),
}

/// The holds of a request of several slices. Their release is out of
/// line, so releasing the common single-slice hold stays small enough to
/// be inlined where completions are matched.
pub(crate) struct Gathered(ManuallyDrop<Box<[InFlight]>>);

impl Gathered {
    pub(crate) fn new(holds: Box<[InFlight]>) -> Self {
        Gathered(ManuallyDrop::new(holds))
    }

    /// `written` bytes fill the slices in list order, as the NIC scatters them.
    #[cold]
    #[inline(never)]
    fn landed(&self, written: usize) -> bool {
        let mut left = written;
        self.0.iter().fold(true, |ok, h| {
            let w = left.min(h.len);
            left -= w;
            h.landed(w) && ok
        })
    }
}

impl Drop for Gathered {
    #[inline(never)]
    fn drop(&mut self) {
        // SAFETY: dropped once, here; the field is never used again.
        unsafe { ManuallyDrop::drop(&mut self.0) }
    }
}

impl Hold {
    /// As [`InFlight::landed`], for every slice.
    #[inline(always)]
    pub(crate) fn landed(&self, written: usize) -> bool {
        match self {
            Hold::One(h) => h.landed(written),
            Hold::None => true,
            Hold::Many(g) => g.landed(written),
        }
    }

    /// As [`InFlight::conflicts`], for any slice.
    #[inline]
    pub(crate) fn conflicts(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
        match self {
            Hold::None => false,
            Hold::One(h) => h.conflicts(region, start, end, use_),
            Hold::Many(g) => g.0.iter().any(|h| h.conflicts(region, start, end, use_)),
        }
    }
}
