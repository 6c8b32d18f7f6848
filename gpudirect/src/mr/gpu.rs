//! GPU memory regions: registering GPU memory under a [`GpuPolicy`] (the
//! paths the judge of [`crate::gdr`] allows, tried in order, then host
//! staging or an error), staging host-staged regions in, and making NIC
//! writes visible to the GPU.

use std::os::fd::AsRawFd;
use std::ops::RangeBounds;

use super::{reg_dmabuf_mr, reg_mr, AccessFlags, GpuMemory, MemoryRegion};
use crate::claims::Use;
use crate::error::{Error, Result};
use crate::gdr::judge::{plan, Cause, GdrError, Plan};
use crate::gdr::GdrFacts;
use crate::gpu::{GpuBuffer, PinnedHost};
use crate::pd::ProtectionDomain;
use crate::policy::{GpuPolicy, RegistrationPath};
use crate::sysroot::SysRoot;

impl MemoryRegion {
    /// Registers GPU memory for RDMA under `policy`, trying dma-buf, then
    /// peer memory, as the machine allows. The region reports the path
    /// used ([`MemoryRegion::location`]), which is also logged.
    ///
    /// # Errors
    /// With [`GpuPolicy::Require`], [`Error::Gdr`] listing every cause (what
    /// was checked, what it showed, the fix) when no zero-copy path works.
    /// With `Prefer` and `HostStaged`, only the errors of allocating and
    /// registering the host mirror ([`Error::Cuda`], [`Error::Verb`]).
    pub fn register_gpu(pd: &ProtectionDomain, buf: GpuBuffer, access: AccessFlags, policy: GpuPolicy) -> Result<MemoryRegion> {
        Self::register_gpu_at(pd, buf, access, policy, &SysRoot::live())
    }

    /// [`register_gpu`](Self::register_gpu) reading the host's files under `root`.
    ///
    /// # Errors
    /// As [`register_gpu`](Self::register_gpu).
    pub fn register_gpu_at(pd: &ProtectionDomain, buf: GpuBuffer, access: AccessFlags, policy: GpuPolicy, root: &SysRoot) -> Result<MemoryRegion> {
        if policy == GpuPolicy::HostStaged {
            return MemoryRegion::register_gpu_staged(pd, buf, access);
        }
        match MemoryRegion::register_gpu_zero_copy(pd, buf, access, root, None) {
            Ok(mr) => Ok(mr),
            Err((buf, err)) if policy == GpuPolicy::Prefer => {
                tracing::warn!("falling back to host staging: {err}");
                MemoryRegion::register_gpu_staged(pd, buf, access)
            }
            Err((_, err)) => Err(Error::Gdr(err)),
        }
    }

    /// Registers this region's GPU memory again, zero-copy, in protection
    /// domain `pd` (another NIC's), that NIC's path judged on its own: the
    /// facts of [`crate::gdr`] are gathered for `pd`'s device and its
    /// paths tried in order, as [`register_gpu`](Self::register_gpu) does
    /// under [`GpuPolicy::Require`]. The two regions share one record of
    /// who uses the bytes (as [`register_in`](Self::register_in)'s do), and
    /// the GPU memory lives until every registration of it is gone.
    ///
    /// ```no_run
    /// # fn f(a: &gpudirect::ProtectionDomain, b: &gpudirect::ProtectionDomain, gpu: &gpudirect::Gpu) -> gpudirect::Result<()> {
    /// use gpudirect::{AccessFlags, GpuBuffer, GpuPolicy, MemoryRegion};
    /// let access = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE;
    /// let on_a = MemoryRegion::register_gpu(a, GpuBuffer::alloc(gpu, 1 << 20)?, access, GpuPolicy::Require)?;
    /// let on_b = on_a.register_gpu_in(b, access)?;
    /// println!("{} / {}", on_a.location(), on_b.location());
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`Error::Gdr`] listing every cause when no zero-copy path works for
    /// `pd`'s NIC; [`Error::InvalidArgument`] for host memory (use
    /// [`register_in`](Self::register_in)) and for a host-staged region
    /// (its one host mirror is staged through the NIC that registered it).
    pub fn register_gpu_in(&self, pd: &ProtectionDomain, access: AccessFlags) -> Result<MemoryRegion> {
        self.register_gpu_in_at(pd, access, &SysRoot::live())
    }

    /// [`register_gpu_in`](Self::register_gpu_in) reading the host's files under `root`.
    ///
    /// # Errors
    /// As [`register_gpu_in`](Self::register_gpu_in).
    pub fn register_gpu_in_at(&self, pd: &ProtectionDomain, access: AccessFlags, root: &SysRoot) -> Result<MemoryRegion> {
        let alias = match &*self.inner.gpu {
            None => return Err(Error::InvalidArgument("host memory: register it on another NIC with MemoryRegion::register_in".into())),
            Some(g) if g.path == RegistrationPath::HostStaged => {
                return Err(Error::InvalidArgument(format!(
                    "{}: its one host mirror is staged through the NIC that registered it; register the GPU memory zero-copy to use it on several NICs",
                    self.location()
                )))
            }
            // SAFETY: the alias never frees the memory, and the new region
            // keeps this one (which owns it) as its backing.
            Some(g) => unsafe { g.buf.alias() },
        };
        MemoryRegion::register_gpu_zero_copy(pd, alias, access, root, Some(self)).map_err(|(_, e)| Error::Gdr(e))
    }

    /// Registers `buf` zero-copy (dma-buf or peer memory, the paths
    /// [`plan`] allows for `pd`'s NIC, tried in order), or gives it back
    /// with every cause when none works, so the caller can try another NIC
    /// or stage it: what [`register_gpu_at`](Self::register_gpu_at) under
    /// [`GpuPolicy::Require`] does, without losing the buffer.
    ///
    /// # Errors
    /// The buffer and the judged causes ([`GdrError`]) when no zero-copy
    /// path registers it.
    pub fn register_gpu_direct(
        pd: &ProtectionDomain,
        buf: GpuBuffer,
        access: AccessFlags,
        root: &SysRoot,
    ) -> std::result::Result<MemoryRegion, (GpuBuffer, Box<GdrError>)> {
        MemoryRegion::register_gpu_zero_copy(pd, buf, access, root, None)
    }

    /// The zero-copy paths [`plan`] allows for `pd`'s NIC, tried in order;
    /// the buffer back with every cause when none works. With `share`, the
    /// region shares `share`'s record of users and keeps it as backing.
    pub(crate) fn register_gpu_zero_copy(
        pd: &ProtectionDomain,
        buf: GpuBuffer,
        access: AccessFlags,
        root: &SysRoot,
        share: Option<&MemoryRegion>,
    ) -> std::result::Result<MemoryRegion, (GpuBuffer, Box<GdrError>)> {
        let facts = GdrFacts::gather(pd, buf.gpu().ordinal(), root);
        let Plan { try_paths, mut causes } = plan(&facts);
        let mut buf = buf;
        for path in try_paths {
            match MemoryRegion::register_gpu_direct_or_return(pd, buf, path, access, share) {
                Ok(mr) => return Ok(mr),
                Err((b, e)) => {
                    causes.push(Cause::RegistrationFailed { path, call: call_of(&e, path), error: detail(&e) });
                    buf = b;
                }
            }
        }
        Err((buf, Box::new(GdrError { facts, causes })))
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
            None => Self::finish(pd, mr, iova as *mut u8, len, access, Box::new(()), gpu),
            Some(owner) => Self::finish_shared(pd, mr, iova as *mut u8, len, access, Box::new(owner.clone()), gpu, owner.inner.claims.clone()),
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
        Ok(Self::finish(pd, mr, ptr, len, access, Box::new(mirror), Some(gpu)))
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

fn call_of(e: &Error, path: RegistrationPath) -> &'static str {
    match e {
        Error::Verb { verb, .. } => verb,
        Error::Cuda { call, .. } => call,
        _ if path == RegistrationPath::DmaBuf => "ibv_reg_dmabuf_mr",
        _ => "ibv_reg_mr",
    }
}

fn detail(e: &Error) -> String {
    match e {
        Error::Verb { errno, .. } => errno.to_string(),
        Error::Cuda { error, .. } => error.clone(),
        other => other.to_string(),
    }
}
