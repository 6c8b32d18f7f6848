//! Memory NCCL registers (`regMr`, `regMrDmaBuf`): through the library's
//! registration and the registering comm's cache, in that comm's own
//! protection domain, never with remote read: with memory windows, with no
//! remote access at all (`Keys::registration_access`). GPU memory
//! takes the library's paths (dma-buf first, then peer memory) under
//! `GpuPolicy::Require`: a GPU buffer is never quietly given a host mirror.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use gpudirect::rcache::{CachedRegion, RegistrationCache};
use gpudirect::{current_gpu, Gpu, GpuPolicy, LocalSlice, Location, MemoryRegion, RegistrationPath};

use crate::abi;
use crate::error::{NetError, Result};
use crate::site::Keys;

/// What NCCL holds as a memory handle.
#[derive(Debug)]
pub struct Reg {
    region: CachedRegion,
    /// The cache of the comm it was registered through.
    cache: Arc<RegistrationCache>,
    /// How GPU memory was registered; `None` for host memory.
    pub gpu: Option<RegistrationPath>,
}

/// The GPUs opened so far (opening retains the primary context: once each).
static GPUS: Mutex<Option<HashMap<usize, Gpu>>> = Mutex::new(None);

fn gpu(ordinal: usize) -> Result<Gpu> {
    let mut map = GPUS.lock().unwrap_or_else(|e| e.into_inner());
    let map = map.get_or_insert_with(HashMap::new);
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let g = Gpu::open(ordinal)?;
    map.insert(ordinal, g.clone());
    Ok(g)
}

impl Reg {
    /// Registers `size` bytes at `data` through `cache` (a comm's); `ptr_type` is NCCL's
    /// `NCCL_PTR_HOST` or `NCCL_PTR_CUDA` (a dma-buf NCCL exported is
    /// registered as CUDA memory: the library exports its own).
    ///
    /// # Safety
    /// The memory stays valid until [`Reg::release`] (NCCL deregisters
    /// before it frees).
    ///
    /// # Errors
    /// [`NetError::Invalid`] for an unknown type or a null pointer;
    /// [`NetError::Library`] from the registration (for GPU memory, the
    /// library's `GdrError` naming each cause and fix).
    pub unsafe fn register(cache: &Arc<RegistrationCache>, keys: &Keys, data: u64, size: usize, ptr_type: i32) -> Result<Box<Reg>> {
        if data == 0 || size == 0 {
            return Err(NetError::Invalid(format!("regMr of {size} bytes at {data:#x}: nothing to register")));
        }
        let access = keys.registration_access();
        let region = match ptr_type {
            abi::PTR_HOST => {
                // SAFETY: the caller's promise.
                unsafe { cache.get(data as *mut u8, size, access)? }
            }
            abi::PTR_CUDA => {
                let ordinal = current_gpu()?.ok_or_else(|| NetError::Invalid("regMr of CUDA memory with no CUDA context current on the calling thread".into()))?;
                let gpu = gpu(ordinal)?;
                // SAFETY: the caller's promise.
                unsafe { cache.get_gpu(&gpu, data, size, access, GpuPolicy::Require)? }
            }
            other => return Err(NetError::Invalid(format!("regMr of memory type {other}: the plugin knows NCCL_PTR_HOST (1) and NCCL_PTR_CUDA (2)"))),
        };
        let gpu = match region.mr().location() {
            Location::Host => None,
            Location::Gpu { path, .. } => Some(path),
        };
        Ok(Box::new(Reg { region, cache: cache.clone(), gpu }))
    }

    /// Drops the registration and the cache's entry for its range (NCCL
    /// may free the memory next, and a later buffer at the same address
    /// must not find this one).
    pub fn release(self: Box<Reg>) {
        let (addr, len) = (self.region.mr().addr() + self.region.offset() as u64, self.region.len());
        let cache = self.cache.clone();
        drop(self);
        cache.invalidate(addr, len);
    }

    /// The region.
    pub fn mr(&self) -> &MemoryRegion {
        self.region.mr()
    }

    /// The rkey a peer writes with.
    pub fn rkey(&self) -> u32 {
        self.region.mr().rkey()
    }

    /// Checks that `[addr, addr + size)` lies inside the region.
    ///
    /// # Errors
    /// [`NetError::Invalid`] when it does not.
    pub fn check(&self, addr: u64, size: usize) -> Result<&Reg> {
        let mr = self.region.mr();
        let inside = addr >= mr.addr() && addr.checked_add(size as u64).is_some_and(|end| end <= mr.addr() + mr.len() as u64);
        if !inside {
            return Err(NetError::Invalid(format!(
                "{size} bytes at {addr:#x} lie outside the memory handle passed with them ({} bytes at {:#x})",
                mr.len(),
                mr.addr()
            )));
        }
        Ok(self)
    }

    /// `[addr, addr + size)` as a slice of the region.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    #[inline]
    pub fn slice(&self, addr: u64, size: usize) -> Result<LocalSlice<'_>> {
        let mr = self.mr();
        // The region's own bounds check is the one check (a range past it
        // gets `check`'s error, which names both).
        match addr.checked_sub(mr.addr()).and_then(|off| usize::try_from(off).ok()).and_then(|off| mr.slice(off..off.checked_add(size)?).ok()) {
            Some(s) => Ok(s),
            None => Err(self.check(addr, size).err().unwrap_or_else(|| NetError::Invalid(format!("{size} bytes at {addr:#x}: not a slice of the registration")))),
        }
    }
}
