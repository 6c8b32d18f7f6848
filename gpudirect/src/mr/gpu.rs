//! GPU memory regions by one path: zero-copy (dma-buf, peer memory) or a
//! host-staged mirror, staging host-staged regions in, and making NIC
//! writes visible to the GPU. Which path to take under a [`GpuPolicy`]
//! (the facts gathered and judged) is decided above the verbs objects, in
//! `gdr/register.rs`.

use std::os::fd::AsRawFd;
use std::ops::RangeBounds;

use super::{reg_dmabuf_mr, reg_mr, AccessFlags, GpuMemory, MemoryRegion};
use crate::claims::Use;
use crate::error::{Error, Result};
use crate::gpu::{GpuBuffer, PinnedHost};
use crate::pd::ProtectionDomain;
use crate::policy::RegistrationPath;

impl MemoryRegion {
    /// The GPU buffer of a zero-copy region, aliased (it never frees the
    /// memory), for registering the same memory on another NIC.
    ///
    /// # Safety
    /// The alias must be registered sharing this region (so the new
    /// region keeps this one, which owns the memory, as its backing), and
    /// not outlive it otherwise.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for host memory and host-staged regions.
    pub(crate) unsafe fn gpu_alias(&self) -> Result<GpuBuffer> {
        Ok(match &*self.inner.gpu {
            None => return Err(Error::InvalidArgument("host memory: register it on another NIC with MemoryRegion::register_in".into())),
            Some(g) if g.path == RegistrationPath::HostStaged => {
                return Err(Error::InvalidArgument(format!(
                    "{}: its one host mirror is staged through the NIC that registered it; register the GPU memory zero-copy to use it on several NICs",
                    self.location()
                )))
            }
            // SAFETY: the alias never frees the memory; the caller keeps
            // this region (which owns it) as the new region's backing.
            Some(g) => unsafe { g.buf.alias() },
        })
    }

    /// Registers GPU memory directly (zero-copy) by `path`:
    /// [`RegistrationPath::DmaBuf`] or [`RegistrationPath::PeerMemory`].
    /// [`crate::gdr`] decides which path to try; this performs it, and
    /// hands the buffer back on failure so the next path can be tried.
    pub(crate) fn register_gpu_direct_or_return(
        pd: &ProtectionDomain,
        buf: GpuBuffer,
        path: RegistrationPath,
        access: AccessFlags,
        share: Option<&MemoryRegion>,
    ) -> std::result::Result<MemoryRegion, (GpuBuffer, Error)> {
        let iova = buf.device_ptr();
        let len = buf.len();
        let registered = match path {
            RegistrationPath::DmaBuf => buf.export_dma_buf().and_then(|(fd, offset, _)| {
                // SAFETY: `fd` is a dma-buf exporting the buffer's pages;
                // the region will own `buf` (or, for an alias, the region
                // that owns it), so the memory outlives it. The
                // registration holds its own reference to the dma-buf, so
                // `fd` may close when this returns.
                unsafe { reg_dmabuf_mr(pd, offset, len, iova, fd.as_raw_fd(), access) }
            }),
            // SAFETY: a peer-memory client pins and maps the device range;
            // the region will own `buf` (or the region that owns it), so the
            // memory outlives it. The CPU never dereferences the address
            // (accessors copy through CUDA).
            RegistrationPath::PeerMemory => unsafe { reg_mr(pd, iova as *mut u8, len, access) },
            RegistrationPath::HostStaged => {
                return Err((buf, Error::InvalidArgument("host staging is not a direct registration path".into())))
            }
        };
        let (mr, access) = match registered {
            Ok(r) => r,
            Err(e) => return Err((buf, e)),
        };
        let gpu = Some(GpuMemory { buf, path });
        Ok(match share {
            None => Self::finish(pd, mr, iova as *mut u8, len, access, Box::new(()), gpu, None),
            Some(owner) => Self::finish(pd, mr, iova as *mut u8, len, access, Box::new(owner.clone()), gpu, Some(owner)),
        })
    }

    /// Registers a pinned host mirror of `buf` for the NIC: the
    /// [`RegistrationPath::HostStaged`] fallback.
    pub(crate) fn register_gpu_staged(pd: &ProtectionDomain, buf: GpuBuffer, access: AccessFlags) -> Result<MemoryRegion> {
        let mirror = PinnedHost::alloc(buf.gpu(), buf.len())?;
        let (ptr, len) = (mirror.ptr(), mirror.len());
        // SAFETY: the mirror is owned by the region and outlives the registration.
        let (mr, access) = unsafe { reg_mr(pd, ptr, len, access)? };
        let gpu = GpuMemory { buf, path: RegistrationPath::HostStaged };
        // Before the region exists, so before anything can be posted on it.
        pd.inner.stages_in.store(true, std::sync::atomic::Ordering::Relaxed);
        Ok(Self::finish(pd, mr, ptr, len, access, Box::new(mirror), Some(gpu), None))
    }

    /// For a host-staged region ([`RegistrationPath::HostStaged`]): copies
    /// `range` from the NIC's host mirror to the GPU. Receives and RDMA
    /// reads into the region are staged in automatically when their
    /// completions are reaped; call this after learning (e.g. from a write
    /// with immediate) that a peer RDMA-wrote the range. Other regions:
    /// nothing to do.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Cuda`]; [`Error::Busy`] while a
    /// posted work request uses the range (a receive or RDMA read would
    /// leave a half-written mirror) or a copy on another thread does.
    pub fn stage_in(&self, range: impl RangeBounds<usize>) -> Result<()> {
        let s = self.slice(range)?;
        let Some(buf) = self.staged() else { return Ok(()) };
        let _claim = self.claim_cpu(s.offset, s.len, Use::CpuWrites)?;
        // SAFETY: the mirror range is inside the region, no Rust reference
        // to it exists, and the claim keeps writers off it.
        unsafe { buf.copy_from_raw(s.offset, self.inner.addr.add(s.offset), s.len) }
    }

    /// Before a GPU kernel consumes data the NIC wrote into this region
    /// (a receive, an RDMA read, or a peer's write announced by a write
    /// with immediate): makes those writes visible to the GPU. On GPUs that
    /// order RDMA writes ([`Gpu::rdma_writes_ordered`](crate::Gpu::rdma_writes_ordered),
    /// Hopper and newer) there is nothing to do; older ones are flushed
    /// with `cuFlushGPUDirectRDMAWrites`. Host-staged regions need nothing
    /// more than their (synchronous) stage-in; host memory nothing at all.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn flush_gpu_writes(&self) -> Result<()> {
        match &*self.inner.gpu {
            Some(g) if g.path != RegistrationPath::HostStaged => {
                if g.buf.gpu().rdma_writes_ordered()? {
                    Ok(())
                } else {
                    g.buf.gpu().flush_rdma_writes()
                }
            }
            _ => Ok(()),
        }
    }
}
