//! An engine message's bytes in registered memory, for the send that
//! carries it: small ones (broadcast chunk messages and answers, short
//! notifications) in a slot of a slab one NIC keeps and reuses, so a
//! message costs no registration and pins no page of its own (a broadcast
//! of thousands of chunks pinned a page per chunk before); larger ones in
//! a region of their own.
//!
//! A slot goes back to its slab when its [`MsgBuf`] is dropped. Most go
//! back clean: the request that sent it finished (its last completion
//! came after the send's) or never went out, so nothing reads the slot,
//! and the next message is copied in without a claim (whose look at every
//! posted work request naming the slab cost more than the message). A
//! request dropped while in flight, or after a failed post, marks its
//! slot suspect: the NIC may still read it. A suspect slot is reused only
//! through the checked copy, which finds the bytes claimed by that posted
//! send (`Error::Busy`) while it is out; then the message takes a region
//! of its own, so a message in flight is never overwritten.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gpudirect::Result;
use gpudirect::{AccessFlags, LocalSlice, MemoryRegion};
use gpudirect::ProtectionDomain;
use gpudirect::sync::Mutex;

/// Bytes of one slot: a broadcast chunk message is 25.
pub(crate) const MSG_SLOT: usize = 64;
/// Slots of one slab (64 KiB).
const SLAB_SLOTS: usize = 1024;
/// Slabs one NIC keeps at most (4 MiB): past them, messages take regions
/// of their own.
const MAX_SLABS: usize = 64;

/// One NIC's slabs.
#[derive(Default)]
pub(crate) struct MsgPool {
    slabs: Mutex<Slabs>,
}

#[derive(Default)]
struct Slabs {
    regions: Vec<MemoryRegion>,
    /// Free slots nothing reads, `slab * SLAB_SLOTS + index`.
    free: Vec<u32>,
    /// Free slots a send may still read (see the module's docs).
    suspect: Vec<u32>,
}

/// A message in registered memory.
pub(crate) struct MsgBuf {
    region: MemoryRegion,
    at: usize,
    len: usize,
    /// The pool and slot to give back, for a slot.
    slot: Option<(Arc<MsgPool>, u32)>,
    /// A send may still read it when it is dropped.
    suspect: AtomicBool,
}

impl MsgBuf {
    /// The message, for a send.
    pub(crate) fn slice(&self) -> Result<LocalSlice<'_>> {
        self.region.slice(self.at..self.at + self.len)
    }

    /// A send of it may still be out: its slot goes back suspect.
    pub(crate) fn suspect(&self) {
        self.suspect.store(true, Ordering::Relaxed);
    }
}

impl Drop for MsgBuf {
    fn drop(&mut self) {
        if let Some((pool, slot)) = self.slot.take() {
            let mut slabs = pool.slabs.lock();
            if self.suspect.load(Ordering::Relaxed) {
                slabs.suspect.push(slot);
            } else {
                slabs.free.push(slot);
            }
        }
    }
}

impl MsgPool {
    /// `bytes` in registered memory of `pd` (this pool's NIC's).
    pub(crate) fn put(self: &Arc<Self>, pd: &ProtectionDomain, bytes: &[u8]) -> Result<MsgBuf> {
        if bytes.len() <= MSG_SLOT {
            if let Some((region, slot, clean)) = self.take(pd) {
                let at = (slot as usize % SLAB_SLOTS) * MSG_SLOT;
                let buf = MsgBuf { region, at, len: bytes.len(), slot: Some((self.clone(), slot)), suspect: AtomicBool::new(false) };
                if clean {
                    // SAFETY: a clean slot: the request whose message it
                    // held finished or never posted it, and the slot is
                    // this buffer's alone from `take` on.
                    unsafe { buf.region.write_owned_at(at, bytes) }?;
                    return Ok(buf);
                }
                // Busy: a send still reads the slot (its request was
                // dropped in flight); it goes back suspect, and this
                // message takes a region of its own.
                if buf.region.write_at(at, bytes).is_ok() {
                    return Ok(buf);
                }
                buf.suspect();
            }
        }
        let region = MemoryRegion::alloc(pd, bytes.len(), AccessFlags::LOCAL_WRITE)?;
        region.write_at(0, bytes)?;
        Ok(MsgBuf { region, at: 0, len: bytes.len(), slot: None, suspect: AtomicBool::new(false) })
    }

    /// A free slot, its slab and whether it is clean: a clean one first,
    /// growing by a slab when none is free, a suspect one last.
    fn take(&self, pd: &ProtectionDomain) -> Option<(MemoryRegion, u32, bool)> {
        let mut s = self.slabs.lock();
        if s.free.is_empty() && s.regions.len() < MAX_SLABS {
            match MemoryRegion::alloc(pd, SLAB_SLOTS * MSG_SLOT, AccessFlags::LOCAL_WRITE) {
                Ok(r) => {
                    let slab = s.regions.len() as u32;
                    s.regions.push(r);
                    // Lowest slots last: taken first.
                    s.free.extend((0..SLAB_SLOTS as u32).rev().map(|i| slab * SLAB_SLOTS as u32 + i));
                }
                Err(e) => tracing::debug!("no slab for engine messages: {e}"),
            }
        }
        let (slot, clean) = match s.free.pop() {
            Some(slot) => (slot, true),
            None => (s.suspect.pop()?, false),
        };
        Some((s.regions[slot as usize / SLAB_SLOTS].clone(), slot, clean))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpudirect::Context;

    /// A slot returned suspect (a send of it may still be out) is handed
    /// out again only once no clean slot is left, and then through the
    /// checked copy; a clean one is reused at once.
    #[test]
    #[ignore = "needs an RDMA device"]
    fn suspect_slots_are_reused_last_and_only_through_the_checked_copy() {
        let ctx = Context::open(Some(&testkit::device())).unwrap();
        let pd = ProtectionDomain::new(&ctx).unwrap();
        let pool = Arc::new(MsgPool::default());
        let slot_of = |b: &MsgBuf| b.slot.as_ref().map(|(_, s)| *s);
        let first = pool.put(&pd, b"first").unwrap();
        let s0 = slot_of(&first).unwrap();
        first.suspect();
        drop(first);
        // A clean slot goes back and comes out next; the suspect one stays.
        let clean = pool.put(&pd, b"clean").unwrap();
        let s1 = slot_of(&clean).unwrap();
        assert_ne!(s1, s0);
        drop(clean);
        assert_eq!(slot_of(&pool.put(&pd, b"again").unwrap()), Some(s1), "a clean slot is reused at once");
        // Every clean slot taken (all slabs grown): only then the suspect one.
        let mut held = Vec::new();
        loop {
            let b = pool.put(&pd, b"fill").unwrap();
            match slot_of(&b) {
                Some(s) if s == s0 => {
                    assert_eq!(held.len(), MAX_SLABS * SLAB_SLOTS - 1, "the suspect slot came out before the clean ones ran out");
                    let mut got = [0u8; 4];
                    b.region.read_at(b.at, &mut got).unwrap();
                    assert_eq!(&got, b"fill", "written through the checked copy");
                    break;
                }
                Some(_) => held.push(b),
                None => panic!("a region of its own while slots were left"),
            }
        }
    }
}
