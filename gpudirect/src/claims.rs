//! Who may touch which bytes of a memory region, and when: the one judge
//! of conflicts between posted work requests and CPU copies.
//!
//! Two records, each where its owner already is, decide together:
//! - What the NIC holds is the pending list of the queue pair that posted
//!   the request (its entry names the region and range until the
//!   completion is reaped). Posting therefore takes no lock beyond the
//!   queue's own, and queue pairs posting from one shared region never
//!   contend on it.
//! - What the CPU copies is a short list per region ([`RegionClaims`]),
//!   kept for the duration of one `write_at`, `read_at`, `fill`, staging
//!   copy or flag poll.
//!
//! Each side announces itself before it looks at the other: a post counts
//! its hold (`nic_holds`) and then checks `cpu_active`; a copy counts its
//! claim (`cpu_active`) and then checks `nic_holds`. Both are sequentially
//! consistent, so at least one of two conflicting parties sees the other
//! and answers [`Error::Busy`]; neither ever proceeds unseen. A copy that
//! finds holds looks them up through the protection domain's [`Holders`]
//! (every queue pair of the domain, as only those can post the region).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Weak;

use crate::error::Error;
use crate::sync::Mutex;

/// Who is using a range of a region, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Use {
    /// A posted send or RDMA write reads it.
    NicReads,
    /// A posted receive or RDMA read writes it.
    NicWrites,
    /// A CPU copy out of it (`MemoryRegion::read_at`).
    CpuReads,
    /// A CPU copy into it (`write_at`, `fill`, staging a host-staged
    /// region's mirror).
    CpuWrites,
    /// `MemoryRegion::read_volatile`: a flag load that expects the NIC to
    /// change the byte, so it only waits out CPU writers.
    CpuPolls,
}

impl Use {
    fn cpu(self) -> bool {
        !matches!(self, Use::NicReads | Use::NicWrites)
    }

    /// Whether two overlapping uses may not run at once. Two posted work
    /// requests never conflict here: what the NIC does to memory is the
    /// application protocol's business and no Rust access. A CPU copy
    /// conflicts with anything that writes what it touches, or that it
    /// writes, except that a poll only waits for CPU writers.
    pub(crate) fn conflicts(self, other: Use) -> bool {
        match (self, other) {
            (a, b) if !a.cpu() && !b.cpu() => false,
            (Use::CpuPolls, b) | (b, Use::CpuPolls) => b == Use::CpuWrites,
            (a, b) => matches!(a, Use::NicWrites | Use::CpuWrites) || matches!(b, Use::NicWrites | Use::CpuWrites),
        }
    }
}

pub(crate) const BUSY_NIC: &str = "a posted work request that has not completed; poll its completion queue first";
pub(crate) const BUSY_CPU: &str = "a copy in progress on another thread (write_at, read_at, fill, stage_in); retry when it returns";

fn busy(start: usize, end: usize, holder: &'static str) -> Error {
    Error::Busy { offset: start as u64, end: end as u64, holder }
}

/// Whether `a..b` and `c..d` share a byte.
pub(crate) fn overlap(a: usize, b: usize, c: usize, d: usize) -> bool {
    a < d && c < b
}

/// Something that holds ranges of regions for the NIC: a queue pair's
/// pending work requests.
pub(crate) trait HoldsNic: Send + Sync {
    /// Whether a request it holds names bytes `start..end` of `region` (a
    /// region's identity, [`RegionClaims::id`]) in a way that conflicts
    /// with `use_`.
    fn holds_conflicting(&self, region: usize, start: usize, end: usize, use_: Use) -> bool;
}

/// Every holder of a protection domain, for copies that must look up what
/// the NIC holds.
#[derive(Default)]
pub(crate) struct Holders(Mutex<Vec<Weak<dyn HoldsNic>>>);

impl Holders {
    pub(crate) fn add(&self, h: Weak<dyn HoldsNic>) {
        self.0.lock().push(h);
    }

    /// Removes `h` (by identity), and any holder already gone.
    pub(crate) fn remove(&self, h: &Weak<dyn HoldsNic>) {
        self.0.lock().retain(|x| !Weak::ptr_eq(x, h) && x.strong_count() > 0);
    }

    pub(crate) fn conflict(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
        self.0.lock().iter().filter_map(Weak::upgrade).any(|h| h.holds_conflicting(region, start, end, use_))
    }
}

/// The CPU copies in progress on one region, and the counts each side
/// checks before it looks at the other.
#[derive(Default)]
pub(crate) struct RegionClaims {
    cpu: Mutex<CpuClaims>,
    /// CPU claims held or being established.
    cpu_active: AtomicUsize,
    /// Posted requests naming the region, not yet released.
    nic_holds: AtomicUsize,
}

#[derive(Default)]
struct CpuClaims {
    next_token: u64,
    list: Vec<CpuClaim>,
}

#[derive(Debug)]
struct CpuClaim {
    start: usize,
    end: usize,
    use_: Use,
    token: u64,
}

impl CpuClaims {
    fn find(&self, start: usize, end: usize, use_: Use) -> Option<&CpuClaim> {
        self.list.iter().find(|c| overlap(c.start, c.end, start, end) && use_.conflicts(c.use_))
    }
}

impl RegionClaims {
    /// For a request about to be posted on `start..end`: counts its hold,
    /// then refuses it if a CPU copy conflicts. The caller holds its
    /// queue's lock and enters the request into the queue's pending list
    /// before releasing it; [`release_nic`](Self::release_nic) undoes the
    /// count once the entry is gone.
    #[inline(always)]
    pub(crate) fn hold_for_nic(&self, start: usize, end: usize, use_: Use) -> Result<(), Error> {
        self.nic_holds.fetch_add(1, Ordering::SeqCst);
        if self.cpu_active.load(Ordering::SeqCst) == 0 {
            return Ok(());
        }
        self.hold_beside_copies(start, end, use_)
    }

    /// [`hold_for_nic`](Self::hold_for_nic) while some CPU copy runs.
    #[cold]
    #[inline(never)]
    fn hold_beside_copies(&self, start: usize, end: usize, use_: Use) -> Result<(), Error> {
        if self.cpu.lock().find(start, end, use_).is_some() {
            self.release_nic();
            return Err(busy(start, end, BUSY_CPU));
        }
        Ok(())
    }

    /// Counts a hold on bytes the caller's own CPU claim already keeps
    /// everyone else off (a staged chunk, see
    /// [`hand_prefix_to_nic`](Self::hand_prefix_to_nic)).
    pub(crate) fn hold_claimed(&self) {
        self.nic_holds.fetch_add(1, Ordering::SeqCst);
    }

    /// Undoes one [`hold_for_nic`](Self::hold_for_nic) or
    /// [`hold_claimed`](Self::hold_claimed), after the entry left its list.
    #[inline]
    pub(crate) fn release_nic(&self) {
        self.nic_holds.fetch_sub(1, Ordering::Release);
    }

    /// Claims `start..end` of region `region` for a CPU copy, or reports
    /// who conflicts with it (`holders` answers whether a posted request
    /// does, as [`Holders::conflict`]). Returns the token to release.
    pub(crate) fn claim_cpu(&self, holders: &dyn Fn(usize, usize, usize, Use) -> bool, region: usize, start: usize, end: usize, use_: Use) -> Result<u64, Error> {
        let token = {
            let mut c = self.cpu.lock();
            if c.find(start, end, use_).is_some() {
                return Err(busy(start, end, BUSY_CPU));
            }
            self.cpu_active.fetch_add(1, Ordering::SeqCst);
            c.next_token += 1;
            let token = c.next_token;
            c.list.push(CpuClaim { start, end, use_, token });
            token
        };
        // A poll conflicts with no request; others look the holds up only
        // when there are any.
        if use_ != Use::CpuPolls
            && self.nic_holds.load(Ordering::SeqCst) != 0
            && holders(region, start, end, use_)
        {
            self.release_cpu(token);
            return Err(busy(start, end, BUSY_NIC));
        }
        Ok(token)
    }

    pub(crate) fn release_cpu(&self, token: u64) {
        let mut c = self.cpu.lock();
        if let Some(i) = c.list.iter().position(|x| x.token == token) {
            c.list.swap_remove(i);
            self.cpu_active.fetch_sub(1, Ordering::Release);
        }
    }

    /// Gives up the front of CPU claim `token`, up to `upto`, once the
    /// caller has counted the NIC's hold on it ([`hold_claimed`](Self::hold_claimed))
    /// and entered the request: a staged chunk passes from the copy to the
    /// NIC with no moment in which another copy could write it. Returns
    /// whether the claim is used up.
    pub(crate) fn hand_prefix_to_nic(&self, token: u64, upto: usize) -> bool {
        let mut c = self.cpu.lock();
        let Some(i) = c.list.iter().position(|x| x.token == token) else { return true };
        c.list[i].start = upto;
        if upto < c.list[i].end {
            return false;
        }
        c.list.swap_remove(i);
        self.cpu_active.fetch_sub(1, Ordering::Release);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// A holder with fixed ranges of region 1.
    struct Fixed(Vec<(usize, usize, Use)>);

    impl HoldsNic for Fixed {
        fn holds_conflicting(&self, region: usize, start: usize, end: usize, use_: Use) -> bool {
            region == 1 && self.0.iter().any(|&(s, e, u)| overlap(s, e, start, end) && use_.conflicts(u))
        }
    }

    fn holders(h: &Arc<Fixed>) -> Holders {
        let hs = Holders::default();
        let w: Weak<dyn HoldsNic> = Arc::downgrade(h) as Weak<dyn HoldsNic>;
        hs.add(w);
        hs
    }

    /// CPU copies and posted requests exclude each other exactly where one
    /// of them writes what the other touches; posts never conflict with
    /// posts; polls wait only for CPU writers.
    #[test]
    fn uses_conflict_where_someone_writes() {
        use Use::*;
        let all = [NicReads, NicWrites, CpuReads, CpuWrites, CpuPolls];
        for a in all {
            for b in all {
                let expect = match (a, b) {
                    (NicReads | NicWrites, NicReads | NicWrites) => false,
                    (CpuPolls, x) | (x, CpuPolls) => x == CpuWrites,
                    (NicReads | CpuReads, NicReads | CpuReads) => false,
                    _ => true,
                };
                assert_eq!(a.conflicts(b), expect, "{a:?} then {b:?}");
                assert_eq!(b.conflicts(a), expect, "symmetric");
            }
        }
    }

    #[test]
    fn a_post_is_refused_while_a_conflicting_copy_runs() {
        let c = RegionClaims::default();
        let none = Holders::default();
        let t = c.claim_cpu(&|r, s, e, u| none.conflict(r, s, e, u), 1, 0, 10, Use::CpuWrites).unwrap();
        let e = c.hold_for_nic(5, 6, Use::NicReads).unwrap_err();
        assert!(matches!(e, Error::Busy { offset: 5, end: 6, holder } if holder == BUSY_CPU), "{e}");
        assert_eq!(c.nic_holds.load(Ordering::SeqCst), 0, "a refused hold is not counted");
        c.hold_for_nic(10, 20, Use::NicWrites).expect("disjoint");
        assert!(c.claim_cpu(&|r, s, e, u| none.conflict(r, s, e, u), 1, 0, 5, Use::CpuWrites).is_err(), "CPU claims exclude each other too");
        c.release_cpu(t);
        assert_eq!(c.cpu_active.load(Ordering::SeqCst), 0);
        c.hold_for_nic(0, 10, Use::NicReads).expect("the copy is done");
    }

    #[test]
    fn a_copy_is_refused_where_a_holder_conflicts() {
        let h = Arc::new(Fixed(vec![(20, 30, Use::NicWrites), (40, 50, Use::NicReads)]));
        let hs = holders(&h);
        let c = RegionClaims::default();
        c.hold_for_nic(20, 30, Use::NicWrites).unwrap();
        c.hold_for_nic(40, 50, Use::NicReads).unwrap();
        let e = c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 1, 25, 26, Use::CpuReads).unwrap_err();
        assert!(e.to_string().contains("poll its completion queue"), "{e}");
        assert_eq!(c.cpu_active.load(Ordering::SeqCst), 0, "a refused claim is not left behind");
        let t = c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 1, 40, 50, Use::CpuReads).expect("reading a send's source is fine");
        assert!(c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 1, 45, 46, Use::CpuWrites).is_err(), "writing it is not");
        let other = c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 2, 20, 30, Use::CpuWrites).expect("another region's holds do not count");
        c.release_cpu(other);
        let poll = c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 1, 25, 26, Use::CpuPolls).expect("a poll waits for no request");
        c.release_cpu(poll);
        c.release_cpu(t);
        // With no holds counted, the holders are not even asked.
        c.release_nic();
        c.release_nic();
        assert!(c.claim_cpu(&|r, s, e, u| hs.conflict(r, s, e, u), 1, 20, 30, Use::CpuWrites).is_ok());
    }

    /// Staging hands a CPU claim to the NIC front to back, never leaving a
    /// moment in which another copy could write a staged chunk.
    #[test]
    fn staging_claim_moves_to_the_nic_chunk_by_chunk() {
        let none = Holders::default();
        let c = RegionClaims::default();
        let t = c.claim_cpu(&|r, s, e, u| none.conflict(r, s, e, u), 1, 0, 30, Use::CpuWrites).unwrap();
        c.hold_claimed();
        assert!(!c.hand_prefix_to_nic(t, 10));
        assert!(c.hold_for_nic(15, 16, Use::NicReads).is_err(), "the rest is still being staged");
        c.hold_claimed();
        assert!(c.hand_prefix_to_nic(t, 30), "fully handed over");
        assert_eq!(c.cpu_active.load(Ordering::SeqCst), 0);
        assert!(c.hold_for_nic(15, 16, Use::NicReads).is_ok());
    }

    #[test]
    fn holders_are_removed_by_identity() {
        let (a, b) = (Arc::new(Fixed(vec![(0, 10, Use::NicWrites)])), Arc::new(Fixed(vec![])));
        let hs = holders(&a);
        let wb: Weak<dyn HoldsNic> = Arc::downgrade(&b) as Weak<dyn HoldsNic>;
        hs.add(wb.clone());
        assert!(hs.conflict(1, 0, 1, Use::CpuReads));
        hs.remove(&wb);
        assert!(hs.conflict(1, 0, 1, Use::CpuReads), "removing b keeps a");
        let wa: Weak<dyn HoldsNic> = Arc::downgrade(&a) as Weak<dyn HoldsNic>;
        hs.remove(&wa);
        assert!(!hs.conflict(1, 0, 1, Use::CpuReads));
    }
}
