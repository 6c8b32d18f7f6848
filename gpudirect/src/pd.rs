//! Protection domains (`ibv_alloc_pd`): the scope in which memory regions
//! and queue pairs may be used together.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::claims::Holders;
use crate::context::Context;
use crate::error::{Error, Result};

pub(crate) struct PdInner {
    pd: NonNull<sys::ibv_pd>,
    ctx: Context,
    /// The queue pairs of this domain, where CPU copies of its regions
    /// look up what posted requests hold.
    pub(crate) holders: Holders,
    /// Set once a host-staged GPU region is registered here: until then no
    /// completion of the domain's queue pairs has bytes to stage in.
    pub(crate) stages_in: Arc<AtomicBool>,
}

// SAFETY: a PD is an opaque kernel handle; verbs using it are thread-safe.
unsafe impl Send for PdInner {}
// SAFETY: as above; the Rust-side state (`holders`) is behind a mutex.
unsafe impl Sync for PdInner {}

impl Drop for PdInner {
    fn drop(&mut self) {
        // SAFETY: every MR and QP holds an Arc to this PD, so none remain.
        let ret = unsafe { sys::ibv_dealloc_pd(self.pd.as_ptr()) };
        if ret != 0 {
            tracing::warn!("{}", Error::returned("ibv_dealloc_pd", ret));
        }
    }
}

/// A protection domain. Cheap to clone; memory regions and queue pairs
/// created in it keep it (and its [`Context`]) alive.
#[derive(Clone)]
pub struct ProtectionDomain {
    pub(crate) inner: Arc<PdInner>,
}

impl fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProtectionDomain").field("device", &self.inner.ctx.name()).finish()
    }
}

impl ProtectionDomain {
    /// Allocates a protection domain on `ctx`.
    ///
    /// # Errors
    /// [`Error::Verb`] from `ibv_alloc_pd` (e.g. `ENOMEM` when the device's
    /// PD limit is reached).
    pub fn new(ctx: &Context) -> Result<ProtectionDomain> {
        // SAFETY: valid context.
        let pd = unsafe { sys::ibv_alloc_pd(ctx.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| Error::last("ibv_alloc_pd"))?;
        Ok(ProtectionDomain { inner: Arc::new(PdInner { pd, ctx: ctx.clone(), holders: Holders::default(), stages_in: Arc::default() }) })
    }

    /// The device context this domain belongs to.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_pd {
        self.inner.pd.as_ptr()
    }

    /// Whether two handles name the same domain.
    #[inline]
    pub fn same_as(&self, other: &ProtectionDomain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
