//! What a work request names of local memory: a byte range of one region
//! ([`LocalSlice`]), or a scatter/gather list of several ([`SgList`]).

use gpudirect_sys as sys;

use crate::error::{Error, Result};
use crate::pd::ProtectionDomain;

use super::inflight::{Gathered, Hold};
use super::MemoryRegion;

/// A byte range of a local [`MemoryRegion`], named in a work request.
///
/// It borrows the region handle, so it cannot outlive it:
///
/// ```compile_fail,E0597
/// # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
/// use gpudirect::{AccessFlags, MemoryRegion};
/// let slice = {
///     let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
///     mr.slice(0..64)?
/// }; // `mr` dropped here while still borrowed
/// # let _ = slice; Ok(()) }
/// ```
#[derive(Clone, Copy, Debug)]
pub struct LocalSlice<'a> {
    pub(crate) mr: &'a MemoryRegion,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl LocalSlice<'_> {
    /// The slice as verbs' scatter/gather entry. The length fits: requests
    /// over `u32::MAX` bytes are refused before they are written out.
    #[inline]
    pub(crate) fn sge(&self) -> sys::ibv_sge {
        sys::ibv_sge { addr: self.mr.addr() + self.offset as u64, length: self.len as u32, lkey: self.mr.lkey() }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the slice is empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Offset within the region.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

/// The local memory of one work request, as verbs' scatter/gather list:
/// nothing, one [`LocalSlice`], or several, which the NIC gathers (sends,
/// writes) or scatters into (receives, RDMA reads) in list order as one
/// message.
///
/// Work request constructors take anything that converts: a
/// `LocalSlice`, a slice or array reference of them, or
/// [`SgList::empty`] for a request that moves no bytes (a receive that
/// only takes a write-with-immediate's notification). Each slice is held
/// until the request's completion is reaped, exactly as a single one is.
///
/// ```
/// # fn f(qp: &gpudirect::QueuePair, header: &gpudirect::MemoryRegion, body: &gpudirect::MemoryRegion) -> gpudirect::Result<()> {
/// use gpudirect::SendWr;
/// // One message: 64 header bytes followed by 4 KiB of payload.
/// let parts = [header.slice(0..64)?, body.slice(0..4096)?];
/// qp.post_send(&[SendWr::send(&parts)])?;
/// # Ok(()) }
/// ```
///
/// The list borrows its slices, and they their regions, so neither can go
/// while a request made from them exists:
///
/// ```compile_fail,E0597
/// # fn f(mr: &gpudirect::MemoryRegion) -> gpudirect::Result<()> {
/// use gpudirect::SendWr;
/// let wr = {
///     let parts = [mr.slice(0..8)?, mr.slice(64..72)?];
///     SendWr::send(&parts)
/// }; // `parts` dropped here while still borrowed
/// # let _ = wr; Ok(()) }
/// ```
///
/// How many non-empty slices one request may carry is the queue pair's
/// [`max_send_sge`](crate::QpConfig::max_send_sge) or
/// [`max_recv_sge`](crate::QpConfig::max_recv_sge) (and, for RDMA reads,
/// the device's [`max_sge_rd`](crate::DeviceAttr::max_sge_rd)); empty
/// slices are left out. A list of several slices may not name a
/// host-staged GPU region ([`RegistrationPath::HostStaged`](crate::RegistrationPath::HostStaged)):
/// post such bytes in a request of their own.
#[derive(Clone, Copy, Debug)]
pub struct SgList<'a>(Sg<'a>);

#[derive(Clone, Copy, Debug)]
enum Sg<'a> {
    Empty,
    One(LocalSlice<'a>),
    Many(&'a [LocalSlice<'a>]),
}

impl<'a> From<LocalSlice<'a>> for SgList<'a> {
    fn from(s: LocalSlice<'a>) -> Self {
        SgList(Sg::One(s))
    }
}

impl<'a> From<&'a [LocalSlice<'a>]> for SgList<'a> {
    fn from(s: &'a [LocalSlice<'a>]) -> Self {
        SgList(match s {
            [] => Sg::Empty,
            [one] => Sg::One(*one),
            many => Sg::Many(many),
        })
    }
}

impl<'a, const N: usize> From<&'a [LocalSlice<'a>; N]> for SgList<'a> {
    fn from(s: &'a [LocalSlice<'a>; N]) -> Self {
        Self::from(&s[..])
    }
}

impl<'a> SgList<'a> {
    /// A list of no memory: the request moves no bytes.
    pub const fn empty() -> Self {
        SgList(Sg::Empty)
    }

    /// Total length in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        match self.0 {
            Sg::Empty => 0,
            Sg::One(s) => s.len,
            Sg::Many(m) => m.iter().fold(0usize, |n, s| n.saturating_add(s.len)),
        }
    }

    /// Whether the list moves no bytes.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many scatter/gather entries the request carries: its non-empty
    /// slices.
    #[inline]
    pub fn num_sge(&self) -> usize {
        match self.0 {
            Sg::Empty => 0,
            Sg::One(s) => usize::from(!s.is_empty()),
            Sg::Many(m) => m.iter().filter(|s| !s.is_empty()).count(),
        }
    }

    /// The non-empty slices, in list order.
    pub fn slices(&self) -> impl Iterator<Item = LocalSlice<'a>> + 'a {
        let (one, many): (Option<LocalSlice<'a>>, &'a [LocalSlice<'a>]) = match self.0 {
            Sg::Empty => (None, &[]),
            Sg::One(s) => (Some(s), &[]),
            Sg::Many(m) => (None, m),
        };
        one.into_iter().chain(many.iter().copied()).filter(|s| !s.is_empty())
    }

    /// The one slice, when the list is not of several.
    #[inline]
    pub(crate) fn one(&self) -> Option<&LocalSlice<'a>> {
        match &self.0 {
            Sg::One(s) => Some(s),
            _ => None,
        }
    }

    /// Entries beyond a request's own SGE slot: those a list of several
    /// needs from the shared gather space (see [`write_sges`](Self::write_sges)).
    #[inline]
    pub(crate) fn gather_sges(&self) -> usize {
        match self.0 {
            Sg::Many(_) => self.num_sge(),
            _ => 0,
        }
    }

    /// The first region named, for lists that must share one domain.
    pub(crate) fn first_region(&self) -> Option<&'a MemoryRegion> {
        self.slices().next().map(|s| s.mr)
    }

    /// What can be checked of the list before posting it in `pd`: each
    /// region is of `pd`, the message is at most `u32::MAX` bytes, and a
    /// list of several names no host-staged region.
    #[inline]
    pub(crate) fn check(&self, pd: &ProtectionDomain) -> Result<()> {
        match self.0 {
            Sg::Empty => Ok(()),
            Sg::One(s) => {
                if !s.mr.pd().same_as(pd) {
                    return Err(Error::ForeignMemoryRegion);
                }
                if s.len > u32::MAX as usize {
                    return Err(Error::TooLong(s.len as u64));
                }
                Ok(())
            }
            Sg::Many(_) => self.check_many(pd),
        }
    }

    #[cold]
    fn check_many(&self, pd: &ProtectionDomain) -> Result<()> {
        for s in self.slices() {
            if !s.mr.pd().same_as(pd) {
                return Err(Error::ForeignMemoryRegion);
            }
            if s.mr.is_host_staged() {
                return Err(Error::InvalidArgument(
                    "a scatter/gather list of several slices names a host-staged GPU region, which is staged \
                     one request at a time: post its bytes in a request of their own"
                        .into(),
                ));
            }
        }
        let len = self.len();
        if len > u32::MAX as usize {
            return Err(Error::TooLong(len as u64));
        }
        Ok(())
    }

    /// Whether the CPU can read every slice (inline payloads are copied by it).
    pub(crate) fn cpu_addressable(&self) -> bool {
        self.slices().all(|s| s.mr.cpu_addressable())
    }

    /// Claims every slice for the NIC until the request's completion is
    /// reaped; a refused claim releases those already made.
    #[inline(always)]
    pub(crate) fn claim(&self, nic_writes: bool) -> Result<Hold> {
        match self.0 {
            Sg::Empty => Ok(Hold::None),
            Sg::One(s) if s.is_empty() => Ok(Hold::None),
            Sg::One(s) => s.mr.claim_for_nic(s.offset, s.len, nic_writes).map(Hold::One),
            Sg::Many(_) => self.claim_many(nic_writes),
        }
    }

    #[cold]
    #[inline(never)]
    fn claim_many(&self, nic_writes: bool) -> Result<Hold> {
        let holds = self.slices().map(|s| s.mr.claim_for_nic(s.offset, s.len, nic_writes)).collect::<Result<Box<_>>>()?;
        Ok(Hold::Many(Gathered::new(holds)))
    }

    /// Writes the list's entries for a request, and returns its `sg_list`
    /// and `num_sge`: a single slice into the request's own slot `sg`, a
    /// list of several into the front of `gather`, which it then no longer
    /// includes. The caller sized `gather` by [`gather_sges`](Self::gather_sges).
    #[inline]
    pub(crate) fn write_sges(&self, sg: &mut sys::ibv_sge, gather: &mut &mut [sys::ibv_sge]) -> (*mut sys::ibv_sge, i32) {
        match self.0 {
            Sg::Empty => (std::ptr::null_mut(), 0),
            Sg::One(s) if s.is_empty() => (std::ptr::null_mut(), 0),
            Sg::One(s) => {
                *sg = s.sge();
                (sg, 1)
            }
            Sg::Many(_) => {
                let (mine, rest) = std::mem::take(gather).split_at_mut(self.num_sge());
                for (e, s) in mine.iter_mut().zip(self.slices()) {
                    *e = s.sge();
                }
                *gather = rest;
                // At most max_send_sge / max_recv_sge entries, checked
                // before posting: fits in an i32.
                (mine.as_mut_ptr(), mine.len() as i32)
            }
        }
    }
}
