//! An engine message's bytes in registered memory, for the send that
//! carries it: small ones (broadcast chunk messages and answers, short
//! notifications) in a slot of a slab one NIC keeps and reuses, so a
//! message costs no registration and pins no page of its own (a broadcast
//! of thousands of chunks pinned a page per chunk before); larger ones in
//! a region of their own.
//!
//! A slot goes back to its slab when its [`MsgBuf`] is dropped. The NIC may
//! still be reading it then (a request dropped while in flight): the next
//! message put there finds the bytes claimed by that posted send
//! (`Error::Busy` from the copy) and takes a region of its own instead,
//! so a message in flight is never overwritten.

use std::sync::Arc;

use crate::error::Result;
use crate::mr::{AccessFlags, LocalSlice, MemoryRegion};
use crate::pd::ProtectionDomain;
use crate::sync::Mutex;

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
    /// Free slots, `slab * SLAB_SLOTS + index`.
    free: Vec<u32>,
}

/// A message in registered memory.
pub(crate) struct MsgBuf {
    region: MemoryRegion,
    at: usize,
    len: usize,
    /// The pool and slot to give back, for a slot.
    slot: Option<(Arc<MsgPool>, u32)>,
}

impl MsgBuf {
    /// The message, for a send.
    pub(crate) fn slice(&self) -> Result<LocalSlice<'_>> {
        self.region.slice(self.at..self.at + self.len)
    }
}

impl Drop for MsgBuf {
    fn drop(&mut self) {
        if let Some((pool, slot)) = self.slot.take() {
            pool.slabs.lock().free.push(slot);
        }
    }
}

impl MsgPool {
    /// `bytes` in registered memory of `pd` (this pool's NIC's).
    pub(crate) fn put(self: &Arc<Self>, pd: &ProtectionDomain, bytes: &[u8]) -> Result<MsgBuf> {
        if bytes.len() <= MSG_SLOT {
            if let Some((region, slot)) = self.take(pd) {
                let at = (slot as usize % SLAB_SLOTS) * MSG_SLOT;
                let buf = MsgBuf { region, at, len: bytes.len(), slot: Some((self.clone(), slot)) };
                // Busy: a send still reads the slot (its request was
                // dropped in flight); it goes back, and this message
                // takes a region of its own.
                if buf.region.write_at(at, bytes).is_ok() {
                    return Ok(buf);
                }
            }
        }
        let region = MemoryRegion::alloc(pd, bytes.len(), AccessFlags::LOCAL_WRITE)?;
        region.write_at(0, bytes)?;
        Ok(MsgBuf { region, at: 0, len: bytes.len(), slot: None })
    }

    /// A free slot and its slab, growing by a slab when none is free.
    fn take(&self, pd: &ProtectionDomain) -> Option<(MemoryRegion, u32)> {
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
        let slot = s.free.pop()?;
        Some((s.regions[slot as usize / SLAB_SLOTS].clone(), slot))
    }
}
