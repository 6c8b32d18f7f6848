//! Registering GPU memory under a [`GpuPolicy`]: the paths the judge
//! allows, tried in order, and what to do when none works.

use super::judge::{plan, Cause, GdrError, Plan};
use super::GdrFacts;
use crate::policy::{GpuPolicy, RegistrationPath};
use crate::error::{Error, Result};
use crate::gpu::GpuBuffer;
use crate::mr::{AccessFlags, MemoryRegion};
use crate::pd::ProtectionDomain;
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
        let facts = GdrFacts::gather(pd, buf.gpu().ordinal(), root);
        let Plan { try_paths, mut causes } = plan(&facts);
        let mut buf = Some(buf);
        for path in try_paths {
            let b = buf.take().expect("the buffer is put back after each failed try");
            let retry = match MemoryRegion::register_gpu_direct_or_return(pd, b, path, access) {
                Ok(mr) => return Ok(mr),
                Err((b, e)) => {
                    causes.push(Cause::RegistrationFailed { path, call: call_of(&e, path), error: detail(&e) });
                    b
                }
            };
            buf = Some(retry);
        }
        let err = GdrError { facts, causes };
        match policy {
            GpuPolicy::Prefer => {
                tracing::warn!("falling back to host staging: {err}");
                MemoryRegion::register_gpu_staged(pd, buf.expect("the buffer is back after the tries"), access)
            }
            _ => Err(Error::Gdr(Box::new(err))),
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
