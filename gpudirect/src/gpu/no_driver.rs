//! The driver calls of `driver.rs` for a build without the `cuda` feature:
//! [`init`] says so, and the GPU types turn that into
//! [`Error::CudaUnavailable`] before anything else is reached. The other
//! functions answer the same error rather than trusting that.

use std::os::fd::OwnedFd;

use crate::error::{Error, Result};

use super::{Attr, PointerInfo};

const NOT_BUILT: &str = "gpudirect was built without its `cuda` feature: GPU memory is not available \
                         (enable the feature, which is on by default)";

fn not_built<T>() -> Result<T> {
    Err(Error::CudaUnavailable(NOT_BUILT.into()))
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Device;

#[derive(Clone, Copy, Debug)]
pub(super) struct Ctx;

pub(super) const WRITES_ORDERING_OWNER: i32 = 100;

pub(super) fn init() -> std::result::Result<(), String> {
    Err(NOT_BUILT.into())
}

pub(super) fn has_symbol(_name: &str) -> bool {
    false
}

pub(super) fn version() -> Result<i32> {
    not_built()
}

pub(super) fn count() -> Result<usize> {
    not_built()
}

pub(super) fn open(_ordinal: usize) -> Result<(Device, Ctx, String, Option<String>)> {
    not_built()
}

pub(super) fn release(_dev: Device) -> Result<()> {
    Ok(())
}

pub(super) fn attribute(_dev: Device, _attr: Attr) -> Result<i32> {
    not_built()
}

pub(super) fn flush_rdma_writes() -> Result<()> {
    not_built()
}

pub(super) fn current_device() -> Result<Option<usize>> {
    not_built()
}

pub(super) fn set_current(_ctx: Ctx) -> Result<()> {
    not_built()
}

pub(super) fn pointer_info(_ptr: u64) -> Result<PointerInfo> {
    not_built()
}

pub(super) fn mappings(_ptr: u64, _len: u64) -> Result<Vec<crate::gpu_range::GpuMapping>> {
    not_built()
}

pub(super) fn set_sync_memops(_ptr: u64) -> Result<()> {
    not_built()
}

pub(super) fn alloc_zeroed(_size: usize) -> Result<u64> {
    not_built()
}

/// # Safety
/// Nothing is freed here; no memory can have been allocated.
pub(super) unsafe fn free(_ptr: u64) -> Result<()> {
    not_built()
}

/// # Safety
/// Nothing is copied here.
pub(super) unsafe fn copy_htod(_dst: u64, _src: *const u8, _len: usize) -> Result<()> {
    not_built()
}

/// # Safety
/// Nothing is copied here.
pub(super) unsafe fn copy_dtoh(_dst: *mut u8, _src: u64, _len: usize) -> Result<()> {
    not_built()
}

pub(super) fn export_dma_buf(_base: u64, _len: usize) -> Result<OwnedFd> {
    not_built()
}

pub(super) fn host_alloc_zeroed(_len: usize) -> Result<*mut u8> {
    not_built()
}

/// # Safety
/// Nothing is freed here; no memory can have been allocated.
pub(super) unsafe fn host_free(_ptr: *mut u8) -> Result<()> {
    not_built()
}

#[cfg(test)]
pub(super) fn present() -> bool {
    false
}
