//! Registering GPU memory under a [`GpuPolicy`]: the facts of `pd`'s NIC
//! and the GPU gathered (`gather.rs`) and judged (`judge.rs`), the paths
//! the judge allows tried in order, then host staging or an error that
//! names every cause. Above the verbs objects (it gathers through them);
//! the registrations by one path are `mr/gpu.rs`'s.

use crate::error::{Error, Result};
use crate::error::gdr::{Cause, GdrError};
use crate::gdr::judge::{plan, Plan};
use crate::gdr::GdrFacts;
use crate::gpu::GpuBuffer;
use crate::mr::{AccessFlags, MemoryRegion};
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
        // SAFETY: the alias is registered sharing this region (`Some(self)`),
        // which keeps the memory's owner as its backing.
        let alias = unsafe { self.gpu_alias()? };
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
