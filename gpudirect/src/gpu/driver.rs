//! The CUDA driver calls the GPU types make, through cudarc (loaded at run
//! time), each checked and turned into this crate's errors. The only file
//! that names cudarc; `no_driver.rs` has the same functions for builds
//! without the `cuda` feature.

use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::result as cu;
use cudarc::driver::sys as cusys;
use cudarc::driver::DriverError;

use crate::error::{Error, Result};

use super::{Attr, PointerInfo};
use crate::gpu_range::GpuMapping;

/// A device handle (`CUdevice`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Device(cusys::CUdevice);

/// A retained primary context (`CUcontext`).
#[derive(Clone, Copy, Debug)]
pub(super) struct Ctx(cusys::CUcontext);

// SAFETY: a CUDA context may be made current on any thread; the handle is
// only used through driver calls, which are thread-safe.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

/// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER`: the least ordering value
/// under which a GPU's own kernels see NIC writes in order.
pub(super) const WRITES_ORDERING_OWNER: i32 = cusys::CUGPUDirectRDMAWritesOrdering::CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER as i32;

pub(super) fn cuda_err(call: &'static str, e: DriverError) -> Error {
    let name = e.error_name().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    Error::Cuda { call, error: if text.is_empty() { name } else { format!("{name} ({text})") } }
}

/// Loads the driver and runs `cuInit`; the reason as text when it cannot.
pub(super) fn init() -> std::result::Result<(), String> {
    // SAFETY: only probes whether the shared library can be loaded.
    if !unsafe { cusys::is_culib_present() } {
        return Err("the CUDA driver library (libcuda.so.1) cannot be loaded: no NVIDIA driver is installed, \
                    or, in a container, the driver is not mounted in (run with --gpus / the NVIDIA container toolkit)"
            .into());
    }
    cu::init().map_err(|e| match cuda_err("cuInit", e) {
        Error::Cuda { error, .. } => format!("cuInit failed: {error}"),
        other => other.to_string(),
    })
}

/// Whether the loaded driver exports `name` (the caller ran [`init`]).
pub(super) fn has_symbol(name: &str) -> bool {
    // SAFETY: only looks the symbol up (dlsym); nothing is called. The
    // library is loaded (`init` succeeded).
    unsafe { cusys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()).is_ok() }
}

pub(super) fn version() -> Result<i32> {
    let mut v = 0;
    // SAFETY: valid out-pointer; the driver is loaded.
    unsafe { cusys::cuDriverGetVersion(&mut v) }.result().map_err(|e| cuda_err("cuDriverGetVersion", e))?;
    Ok(v)
}

pub(super) fn count() -> Result<usize> {
    Ok(cu::device::get_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?.max(0) as usize)
}

/// Device `ordinal` with its primary context retained, its name and PCI
/// address (lower case; `None` when the driver cannot tell).
pub(super) fn open(ordinal: usize) -> Result<(Device, Ctx, String, Option<String>)> {
    let dev = cu::device::get(ordinal as i32).map_err(|e| cuda_err("cuDeviceGet", e))?;
    // SAFETY: `dev` came from cuDeviceGet.
    let ctx = unsafe { cu::primary_ctx::retain(dev) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRetain", e))?;
    let name = cu::device::get_name(dev).unwrap_or_else(|_| "unknown GPU".into());
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: the buffer is 32 bytes, as passed; the id is NUL-terminated.
    let pci_bus_id = match unsafe { cusys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) }.result() {
        // SAFETY: NUL-terminated on success.
        Ok(()) => Some(unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }.to_string_lossy().to_lowercase()),
        Err(_) => None,
    };
    Ok((Device(dev), Ctx(ctx), name, pci_bus_id))
}

/// Releases the primary context [`open`] retained.
pub(super) fn release(dev: Device) -> Result<()> {
    // SAFETY: retained by `open`, released once (by GpuInner's drop).
    unsafe { cu::primary_ctx::release(dev.0) }.map_err(|e| cuda_err("cuDevicePrimaryCtxRelease", e))
}

pub(super) fn raw_attribute(dev: Device, attr: cusys::CUdevice_attribute) -> Result<i32> {
    // SAFETY: `dev` came from cuDeviceGet.
    unsafe { cu::device::get_attribute(dev.0, attr) }.map_err(|e| cuda_err("cuDeviceGetAttribute", e))
}

pub(super) fn attribute(dev: Device, attr: Attr) -> Result<i32> {
    use cusys::CUdevice_attribute as A;
    raw_attribute(
        dev,
        match attr {
            Attr::GpuDirectRdmaSupported => A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED,
            Attr::DmaBufSupported => A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED,
            Attr::RdmaWritesOrdering => A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING,
        },
    )
}

/// `cuFlushGPUDirectRDMAWrites` for the current context, to-owner scope
/// (the caller checked the symbol and made the context current).
pub(super) fn flush_rdma_writes() -> Result<()> {
    // SAFETY: a context is current; the enum values are the documented ones.
    unsafe {
        cusys::cuFlushGPUDirectRDMAWrites(
            cusys::CUflushGPUDirectRDMAWritesTarget::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
            cusys::CUflushGPUDirectRDMAWritesScope::CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER,
        )
    }
    .result()
    .map_err(|e| cuda_err("cuFlushGPUDirectRDMAWrites", e))
}

/// The ordinal of the device whose context is current on this thread
/// (`cuCtxGetDevice`); `None` when no context is current.
pub(super) fn current_device() -> Result<Option<usize>> {
    let mut dev: cusys::CUdevice = 0;
    // SAFETY: valid out-pointer; the driver is loaded.
    match unsafe { cusys::cuCtxGetDevice(&mut dev) } {
        cusys::CUresult::CUDA_SUCCESS => Ok(Some(dev.max(0) as usize)),
        cusys::CUresult::CUDA_ERROR_INVALID_CONTEXT => Ok(None),
        other => Err(cuda_err("cuCtxGetDevice", DriverError(other))),
    }
}

pub(super) fn set_current(ctx: Ctx) -> Result<()> {
    // SAFETY: the context is retained for as long as its Gpu lives.
    unsafe { cu::ctx::set_current(ctx.0) }.map_err(|e| cuda_err("cuCtxSetCurrent", e))
}

/// Everything [`PointerInfo`] holds, in one `cuPointerGetAttributes` call
/// (a context is current).
pub(super) fn pointer_info(ptr: u64) -> Result<PointerInfo> {
    let mut mem_type: std::ffi::c_uint = 0;
    let mut ordinal: std::ffi::c_int = -1;
    let mut buffer_id: std::ffi::c_ulonglong = 0;
    let mut base: cusys::CUdeviceptr = 0;
    let mut size: usize = 0;
    use cusys::CUpointer_attribute as A;
    let mut attrs = [
        A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        A::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        A::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        A::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
    ];
    let mut data: [*mut std::ffi::c_void; 5] = [
        (&mut mem_type as *mut std::ffi::c_uint).cast(),
        (&mut ordinal as *mut std::ffi::c_int).cast(),
        (&mut buffer_id as *mut std::ffi::c_ulonglong).cast(),
        (&mut base as *mut cusys::CUdeviceptr).cast(),
        (&mut size as *mut usize).cast(),
    ];
    // SAFETY: a context is current; each data pointer addresses a variable
    // of the type its attribute is documented to write (unsigned int, int,
    // unsigned long long, CUdeviceptr, size_t), and both arrays have the
    // length passed.
    unsafe { cusys::cuPointerGetAttributes(attrs.len() as std::ffi::c_uint, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) }
        .result()
        .map_err(|e| cuda_err("cuPointerGetAttributes", e))?;
    Ok(PointerInfo {
        // Unlike cuPointerGetAttribute, the plural form succeeds for
        // pointers CUDA does not know and leaves zeros.
        device_memory: mem_type == cusys::CUmemorytype::CU_MEMORYTYPE_DEVICE as std::ffi::c_uint,
        memory_type: mem_type,
        ordinal,
        buffer_id,
        base,
        size: size as u64,
    })
}

/// Most granules [`mappings`] looks at for one range, beyond those the
/// range covers (the parts of its first and last mappings outside it).
const MAX_WALK: u64 = 1 << 16;

/// The driver's answers for every mapping `ptr..ptr + len` touches (a
/// context is current): the one holding `ptr`, then the one at each
/// mapping's end, until past the range, an unknown address, or
/// [`MAX_GPU_MAPPINGS`](crate::gpu_range::MAX_GPU_MAPPINGS).
///
/// For a virtual-memory-management mapping, the pointer's range attributes
/// describe the address reservation (`cuMemAddressReserve`), as CUDA
/// documents and an H200 showed, not the physical allocation mapped there.
/// A mapping is found by its allocation handle instead: the run of granules
/// whose `cuMemRetainAllocationHandle` answers the same handle (`cuMemMap`
/// maps whole granules). A granule of the reservation with no handle is not
/// mapped, and is reported as memory CUDA does not know.
pub(super) fn mappings(ptr: u64, len: u64) -> Result<Vec<GpuMapping>> {
    let end = ptr.saturating_add(len);
    let mut at = ptr;
    let mut out = Vec::new();
    // The reservation of the last mapping seen, while it was a VMM one.
    let mut reservation = None;
    while out.len() <= crate::gpu_range::MAX_GPU_MAPPINGS {
        let info = pointer_info(at)?;
        let mut m = GpuMapping { base: info.base, size: info.size, memory_type: info.memory_type, ordinal: info.ordinal, ..Default::default() };
        let limits = (info.base, info.base.saturating_add(info.size));
        let handle = if info.device_memory { allocation_handle(at) } else { None };
        if let Some(h) = handle {
            let (base, size) = vmm_extent(at, end, h, limits);
            (m.base, m.size, m.vmm) = (base, size, true);
            reservation = Some(limits);
        } else if reservation.is_some_and(|(lo, hi)| (lo..hi).contains(&at)) {
            // A granule of a reservation whose earlier granules were
            // mapped: a hole, whatever the reservation's attributes say.
            (m.base, m.size, m.memory_type) = (at, 0, 0);
        }
        if info.device_memory && m.memory_type != 0 {
            m.rdma_capable = rdma_capable(at);
            m.pool = from_pool(at);
        }
        out.push(m);
        let next = m.base.saturating_add(m.size);
        if m.memory_type != crate::gpu_range::CU_MEMORYTYPE_DEVICE || next >= end || next <= at || !m.vmm {
            break;
        }
        at = next;
    }
    Ok(out)
}

/// The allocation handle mapped at `ptr`, when it is mapped through the
/// virtual-memory-management API (only such memory has one). The reference
/// the lookup takes is dropped at once: the value only identifies the
/// allocation, which stays mapped for as long as the caller's memory does.
fn allocation_handle(ptr: u64) -> Option<cusys::CUmemGenericAllocationHandle> {
    static SYMBOLS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let present = || {
        ["cuMemRetainAllocationHandle", "cuMemRelease", "cuMemGetAllocationPropertiesFromHandle", "cuMemGetAllocationGranularity"]
            .iter()
            .all(|s| has_symbol(s))
    };
    if !*SYMBOLS.get_or_init(present) {
        return None;
    }
    let mut handle: cusys::CUmemGenericAllocationHandle = 0;
    // SAFETY: `handle` is the out-parameter the call documents; `ptr` is
    // only looked up.
    let r = unsafe { cusys::cuMemRetainAllocationHandle(&mut handle, ptr as *mut std::ffi::c_void) };
    r.result().ok()?;
    // SAFETY: the handle was retained just above; this drops that reference.
    if let Err(e) = unsafe { cusys::cuMemRelease(handle) }.result() {
        tracing::warn!("cuMemRelease of a retained allocation handle: {e:?}");
    }
    Some(handle)
}

/// The minimum mapping granularity of the allocation `handle` (its
/// mappings start and end on multiples of it).
fn granularity(handle: cusys::CUmemGenericAllocationHandle) -> Option<u64> {
    // SAFETY: plain-data C struct, filled by the call below.
    let mut prop: cusys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer; `handle` names a mapped allocation.
    unsafe { cusys::cuMemGetAllocationPropertiesFromHandle(&mut prop, handle) }.result().ok()?;
    let mut g = 0usize;
    // SAFETY: valid out-pointer and the allocation's own properties.
    unsafe { cusys::cuMemGetAllocationGranularity(&mut g, &prop, cusys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM) }
        .result()
        .ok()?;
    (g as u64).is_power_of_two().then_some(g as u64)
}

/// The mapping of allocation `handle` that holds `at`, as `(base, size)`:
/// granules of the same handle before and after `at`, within the
/// reservation `limits`, walking no further than [`MAX_WALK`] granules
/// outside `at..end`.
fn vmm_extent(at: u64, end: u64, handle: cusys::CUmemGenericAllocationHandle, limits: (u64, u64)) -> (u64, u64) {
    let Some(g) = granularity(handle) else {
        // Without a granularity the driver's own range answer stands.
        return (limits.0, limits.1 - limits.0);
    };
    let same = |a: u64| allocation_handle(a) == Some(handle);
    let mut lo = at & !(g - 1);
    let mut steps = 0;
    while lo >= limits.0.saturating_add(g) && steps < MAX_WALK && same(lo - g) {
        lo -= g;
        steps += 1;
    }
    let mut hi = (at & !(g - 1)).saturating_add(g);
    let mut beyond = 0;
    while hi < limits.1 && beyond < MAX_WALK && same(hi) {
        hi += g;
        if hi > end {
            beyond += 1;
        }
    }
    (lo, hi - lo)
}

/// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`; `None` when the
/// driver does not answer it.
fn rdma_capable(ptr: u64) -> Option<bool> {
    let mut v: std::ffi::c_int = 0;
    // SAFETY: the attribute writes a boolean as an int into `v`.
    let r = unsafe {
        cusys::cuPointerGetAttribute((&mut v as *mut std::ffi::c_int).cast(), cusys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, ptr)
    };
    r.result().ok().map(|()| v != 0)
}

/// Whether `ptr` came from a stream-ordered memory pool
/// (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE` set; unreadable counts as no).
pub(super) fn from_pool(ptr: u64) -> bool {
    let mut pool: usize = 0;
    // SAFETY: the attribute writes a pointer-sized handle into `pool`.
    let r = unsafe {
        cusys::cuPointerGetAttribute((&mut pool as *mut usize).cast(), cusys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, ptr)
    };
    r.result().is_ok() && pool != 0
}

/// `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` on: CUDA copies on the memory are
/// complete when they return.
pub(super) fn set_sync_memops(ptr: u64) -> Result<()> {
    let one: std::ffi::c_uint = 1;
    // SAFETY: `ptr` is device memory of the current context; the value is a c_uint as documented.
    unsafe {
        cusys::cuPointerSetAttribute(
            (&one as *const std::ffi::c_uint).cast(),
            cusys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_SYNC_MEMOPS,
            ptr,
        )
    }
    .result()
    .map_err(|e| cuda_err("cuPointerSetAttribute(SYNC_MEMOPS)", e))
}

/// `cuMemAlloc` of `size` bytes, zeroed (a context is current).
pub(super) fn alloc_zeroed(size: usize) -> Result<u64> {
    // SAFETY: a context is current; the memory is zeroed below before use.
    let ptr = unsafe { cu::malloc_sync(size) }.map_err(|e| cuda_err("cuMemAlloc", e))?;
    // SAFETY: `ptr` is `size` bytes of device memory just allocated.
    if let Err(e) = unsafe { cu::memset_d8_sync(ptr, 0, size) } {
        // SAFETY: allocated just above, used by nothing.
        let _ = unsafe { cu::free_sync(ptr) };
        return Err(cuda_err("cuMemsetD8", e));
    }
    Ok(ptr)
}

/// Frees memory from [`alloc_zeroed`].
///
/// # Safety
/// `ptr` came from [`alloc_zeroed`], is freed once, and nothing uses it.
pub(super) unsafe fn free(ptr: u64) -> Result<()> {
    // SAFETY: per this function's contract.
    unsafe { cu::free_sync(ptr) }.map_err(|e| cuda_err("cuMemFree", e))
}

/// Copies host bytes to device memory (a context is current).
///
/// # Safety
/// `dst..dst+len` is allocated device memory.
pub(super) unsafe fn copy_htod(dst: u64, src: *const u8, len: usize) -> Result<()> {
    // SAFETY: device range per our contract; `src` is readable for `len`
    // bytes per the callers' (a slice, or their own contracts).
    unsafe { cusys::cuMemcpyHtoD_v2(dst, src.cast(), len) }.result().map_err(|e| cuda_err("cuMemcpyHtoD", e))
}

/// Copies device memory to host bytes (a context is current).
///
/// # Safety
/// `src..src+len` is allocated device memory and `dst` writable for `len`
/// bytes, not referenced by Rust references meanwhile.
pub(super) unsafe fn copy_dtoh(dst: *mut u8, src: u64, len: usize) -> Result<()> {
    // SAFETY: per this function's contract.
    unsafe { cusys::cuMemcpyDtoH_v2(dst.cast(), src, len) }.result().map_err(|e| cuda_err("cuMemcpyDtoH", e))
}

/// `cuMemGetHandleForAddressRange` as a dma-buf descriptor (the caller
/// checked the symbol, made the context current and rounded the range to
/// host pages inside allocated device memory).
pub(super) fn export_dma_buf(base: u64, len: usize) -> Result<OwnedFd> {
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: `fd` is an int out-parameter as the DMA_BUF_FD handle type
    // requires; the range covers allocated device memory (caller).
    unsafe {
        cusys::cuMemGetHandleForAddressRange(
            (&mut fd as *mut std::ffi::c_int).cast(),
            base,
            len,
            cusys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    }
    .result()
    .map_err(|e| cuda_err("cuMemGetHandleForAddressRange", e))?;
    // SAFETY: on success `fd` is a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuMemHostAlloc` (portable) of `len` bytes, zeroed (a context is current).
pub(super) fn host_alloc_zeroed(len: usize) -> Result<*mut u8> {
    // SAFETY: a context is current; the memory is zeroed before use.
    let ptr = unsafe { cu::malloc_host(len, cusys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| cuda_err("cuMemHostAlloc", e))?;
    // SAFETY: `len` bytes were just allocated.
    unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, len) };
    Ok(ptr.cast())
}

/// Frees memory from [`host_alloc_zeroed`].
///
/// # Safety
/// `ptr` came from [`host_alloc_zeroed`], is freed once, and nothing uses it.
pub(super) unsafe fn host_free(ptr: *mut u8) -> Result<()> {
    // SAFETY: per this function's contract.
    unsafe { cu::free_host(ptr.cast()) }.map_err(|e| cuda_err("cuMemFreeHost", e))
}

/// Whether the driver library can be loaded at all (tests).
#[cfg(test)]
pub(super) fn present() -> bool {
    // SAFETY: only probes whether the library loads.
    unsafe { cusys::is_culib_present() }
}
