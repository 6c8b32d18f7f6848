//! CUDA GPUs and GPU memory, through the CUDA driver API (cudarc, loaded at
//! run time). `driver.rs` makes the driver calls; without the `cuda`
//! feature `no_driver.rs` stands in, and every entry point here answers
//! [`Error::CudaUnavailable`].

use std::fmt;
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock};

use crate::error::{Error, Result};

use crate::gpu_range::judge_gpu_range;

#[cfg(feature = "cuda")]
mod driver;
#[cfg(not(feature = "cuda"))]
#[path = "no_driver.rs"]
mod driver;

// Plain data both driver variants speak.

/// The device attributes the library reads.
#[derive(Clone, Copy, Debug)]
enum Attr {
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` (116).
    GpuDirectRdmaSupported,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (124).
    DmaBufSupported,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` (118).
    RdmaWritesOrdering,
}

/// What the driver says about a device address.
#[derive(Clone, Copy, Debug, Default)]
struct PointerInfo {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` is DEVICE.
    pub device_memory: bool,
    /// The raw memory type, for messages.
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (-1 when unknown).
    pub ordinal: i32,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`.
    pub buffer_id: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`.
    pub base: u64,
    /// `CU_POINTER_ATTRIBUTE_RANGE_SIZE`.
    pub size: u64,
}

/// GPU pages are 64 KiB: GPUDirect RDMA maps GPU memory to the NIC in these
/// units, and peer-memory registration refuses other sizes.
pub const GPU_PAGE: usize = 64 * 1024;

/// Loads the driver and runs `cuInit` once per process.
fn driver() -> Result<()> {
    static INIT: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    INIT.get_or_init(driver::init).clone().map_err(Error::CudaUnavailable)
}

/// Checks that the driver exports `name` before it is called: cudarc's
/// run-time loader panics on a missing symbol, and a driver older than the
/// CUDA release that added an entry point lacks it. Looked up once.
fn require_symbol(cache: &OnceLock<bool>, name: &'static str, since: &'static str) -> Result<()> {
    driver()?;
    let present = *cache.get_or_init(|| driver::has_symbol(name));
    symbol_answer(name, since, present, driver_version().ok())
}

/// The verdict on a looked-up driver symbol (split out so the missing case
/// can be tested on machines whose driver has every symbol, or none).
fn symbol_answer(name: &'static str, since: &'static str, present: bool, version: Option<i32>) -> Result<()> {
    if present {
        return Ok(());
    }
    let installed = version.map(|v| format!("{}.{}", v / 1000, v % 1000 / 10)).unwrap_or_else(|| "unknown".into());
    Err(Error::Cuda {
        call: name,
        error: format!(
            "the installed CUDA driver (version {installed}) has no {name}, which CUDA {since} added: upgrade the NVIDIA driver"
        ),
    })
}

/// The CUDA driver's version, e.g. 12080 for 12.8.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver.
pub fn driver_version() -> Result<i32> {
    driver()?;
    driver::version()
}

/// How many CUDA GPUs this process sees.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver.
pub fn gpu_count() -> Result<usize> {
    driver()?;
    driver::count()
}

/// The CUDA ordinal of the GPU whose context is current on the calling
/// thread (`cuCtxGetDevice`), as a framework leaves it after
/// `cudaSetDevice` (NCCL's proxy threads, PyTorch's current device);
/// `None` when no context is current on this thread.
///
/// # Errors
/// [`Error::CudaUnavailable`] without a driver, [`Error::Cuda`] otherwise.
pub fn current_gpu() -> Result<Option<usize>> {
    driver()?;
    driver::current_device()
}

struct GpuInner {
    ordinal: usize,
    dev: driver::Device,
    ctx: driver::Ctx,
    name: String,
    pci_bus_id: Option<String>,
}

impl Drop for GpuInner {
    fn drop(&mut self) {
        // Retained in `Gpu::open`; every buffer holds an Arc to us.
        if let Err(e) = driver::release(self.dev) {
            tracing::warn!("{e}");
        }
    }
}

/// A CUDA GPU with its primary context retained. Cheap to clone.
///
/// Nothing here needs CUDA at build time, and on a machine without the
/// driver every entry point returns [`Error::CudaUnavailable`] instead of
/// panicking (cudarc panics on first use when `libcuda` is missing; this
/// library checks first).
#[derive(Clone)]
pub struct Gpu {
    inner: Arc<GpuInner>,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu").field("ordinal", &self.inner.ordinal).field("name", &self.inner.name).field("pci", &self.inner.pci_bus_id).finish()
    }
}

impl fmt::Display for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bus = self.inner.pci_bus_id.as_deref().unwrap_or("unknown PCI address");
        write!(f, "GPU{} ({}, {bus})", self.inner.ordinal, self.inner.name)
    }
}

impl Gpu {
    /// Opens GPU `ordinal` (as numbered by CUDA, honouring
    /// `CUDA_VISIBLE_DEVICES`).
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] without a driver, [`Error::GpuNotFound`]
    /// for an ordinal past the last GPU, [`Error::Cuda`] otherwise.
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let count = gpu_count()?;
        if ordinal >= count {
            return Err(Error::GpuNotFound { ordinal, count });
        }
        let (dev, ctx, name, pci_bus_id) = driver::open(ordinal)?;
        Ok(Gpu { inner: Arc::new(GpuInner { ordinal, dev, ctx, name, pci_bus_id }) })
    }

    /// CUDA ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// Marketing name, e.g. `NVIDIA H200`.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// PCI address, e.g. `0000:17:00.0`; `None` when CUDA could not tell
    /// (`cuDeviceGetPCIBusId` failed).
    pub fn pci_bus_id(&self) -> Option<&str> {
        self.inner.pci_bus_id.as_deref()
    }

    /// A device attribute (`cuDeviceGetAttribute`), named by cudarc's
    /// enum; only with the `cuda` feature.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    pub fn attribute(&self, attr: cudarc::driver::sys::CUdevice_attribute) -> Result<i32> {
        driver::raw_attribute(self.inner.dev, attr)
    }

    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED` (116): whether the
    /// GPU can do GPUDirect RDMA at all (0 on GeForce and some cloud SKUs).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn gpudirect_rdma_supported(&self) -> Result<bool> {
        Ok(driver::attribute(self.inner.dev, Attr::GpuDirectRdmaSupported)? != 0)
    }

    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` (124): whether the GPU's
    /// memory can be exported as dma-buf (needs the open kernel module).
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn dma_buf_supported(&self) -> Result<bool> {
        Ok(driver::attribute(self.inner.dev, Attr::DmaBufSupported)? != 0)
    }

    /// Whether data the NIC wrote into this GPU's memory is visible to the
    /// GPU's own kernels, in order, once the RDMA completion is seen
    /// (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` (118) is
    /// OWNER or ALL_DEVICES: Hopper and newer report it). When `false`,
    /// call [`flush_rdma_writes`](Self::flush_rdma_writes) before a kernel
    /// consumes received data.
    ///
    /// # Errors
    /// [`Error::Cuda`].
    pub fn rdma_writes_ordered(&self) -> Result<bool> {
        Ok(driver::attribute(self.inner.dev, Attr::RdmaWritesOrdering)? >= driver::WRITES_ORDERING_OWNER)
    }

    /// Makes every GPUDirect RDMA write that reached this GPU so far
    /// visible to its kernels (`cuFlushGPUDirectRDMAWrites`, to-owner
    /// scope). The driver's equivalent of the loopback RDMA read NCCL
    /// issues after a receive on pre-Hopper GPUs. Cheap where the GPU
    /// already orders such writes.
    ///
    /// # Errors
    /// [`Error::Cuda`]: `CUDA_ERROR_NOT_SUPPORTED`, or a driver older than
    /// 11.3, which lacks the call (checked before calling).
    pub fn flush_rdma_writes(&self) -> Result<()> {
        static SYMBOL: OnceLock<bool> = OnceLock::new();
        require_symbol(&SYMBOL, "cuFlushGPUDirectRDMAWrites", "11.3")?;
        self.bind()?;
        driver::flush_rdma_writes()
    }

    /// Makes the GPU's primary context current on this thread.
    fn bind(&self) -> Result<()> {
        driver::set_current(self.inner.ctx)
    }
}

/// The CUDA allocation a device address lies in, as the driver identifies
/// it: what a registration cache keys GPU memory by
/// ([`crate::rcache`]).
///
/// `buffer_id` (`CU_POINTER_ATTRIBUTE_BUFFER_ID`) is unique per allocation
/// for the life of the process: memory freed and allocated again at the
/// same address gets a new id, so a registration made for the old
/// allocation is recognisably stale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GpuAllocation {
    /// CUDA ordinal of the GPU holding the allocation.
    pub ordinal: usize,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`.
    pub buffer_id: u64,
    /// First address of the allocation (`CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`).
    pub base: u64,
    /// Its size in bytes (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`).
    pub size: u64,
}

impl GpuAllocation {
    /// One past the allocation's last address (saturating).
    pub fn end(&self) -> u64 {
        self.base.saturating_add(self.size)
    }
}

impl Gpu {
    /// Which allocation of this GPU `ptr` points into.
    ///
    /// One `cuPointerGetAttributes` call: this runs on every GPU lookup of
    /// a registration cache, hits included.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `ptr` is not device memory of this
    /// GPU (host, managed or unknown memory, another GPU's);
    /// [`Error::Cuda`] when the driver call fails.
    pub fn allocation_of(&self, ptr: u64) -> Result<GpuAllocation> {
        self.bind()?;
        let info = driver::pointer_info(ptr)?;
        if !info.device_memory {
            return Err(Error::InvalidArgument(format!(
                "{ptr:#x} is not device memory (CU_POINTER_ATTRIBUTE_MEMORY_TYPE = {})",
                info.memory_type
            )));
        }
        let ordinal = info.ordinal;
        if ordinal < 0 || ordinal as usize != self.ordinal() {
            return Err(Error::InvalidArgument(format!("{ptr:#x} belongs to GPU{ordinal}, not GPU{}", self.ordinal())));
        }
        Ok(GpuAllocation { ordinal: ordinal as usize, buffer_id: info.buffer_id, base: info.base, size: info.size })
    }
}

/// GPU memory the NIC may be given: allocated with `cuMemAlloc` (not
/// stream-ordered pool memory, which GPUDirect RDMA does not support),
/// with `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` set so CUDA copies on it are
/// complete before they return, as the NIC's view requires.
pub struct GpuBuffer {
    gpu: Gpu,
    ptr: u64,
    len: usize,
    /// Freed on drop (allocated here) or owned by the caller.
    owned: bool,
    /// What keeps caller-owned memory allocated ([`GpuBuffer::from_raw_owned`]).
    keep: Option<Box<dyn std::any::Any + Send + Sync>>,
}

impl fmt::Debug for GpuBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuBuffer").field("gpu", &self.gpu.ordinal()).field("ptr", &format_args!("{:#x}", self.ptr)).field("len", &self.len).finish()
    }
}

impl Drop for GpuBuffer {
    fn drop(&mut self) {
        if self.owned && self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemAlloc in `alloc`; no region uses it
            // any more (regions own their buffer).
            if let Err(e) = unsafe { driver::free(self.ptr) } {
                tracing::warn!("{e}");
            }
        }
    }
}

impl GpuBuffer {
    /// The same device memory under a second handle that never frees it,
    /// for a registration of the memory on another NIC.
    ///
    /// # Safety
    /// The caller keeps the memory allocated (e.g. by keeping this buffer,
    /// or the region owning it, alive) for as long as the alias is used.
    pub(crate) unsafe fn alias(&self) -> GpuBuffer {
        GpuBuffer { gpu: self.gpu.clone(), ptr: self.ptr, len: self.len, owned: false, keep: None }
    }

    /// Allocates `len` bytes (rounded up to 64 KiB) on `gpu`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for 0 bytes, [`Error::Cuda`] (e.g.
    /// `CUDA_ERROR_OUT_OF_MEMORY`).
    pub fn alloc(gpu: &Gpu, len: usize) -> Result<GpuBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument("a GPU buffer cannot be empty".into()));
        }
        let size = len
            .checked_next_multiple_of(GPU_PAGE)
            .ok_or_else(|| Error::InvalidArgument(format!("cannot allocate {len} bytes of GPU memory")))?;
        gpu.bind()?;
        let ptr = driver::alloc_zeroed(size)?;
        // Freed on drop, also when the attribute cannot be set.
        let buf = GpuBuffer { gpu: gpu.clone(), ptr, len: size, owned: true, keep: None };
        driver::set_sync_memops(ptr)?;
        Ok(buf)
    }

    /// Wraps device memory the caller allocated (e.g. another framework's
    /// tensor), checking that it can be given to a NIC before anything is
    /// registered ([`judge_gpu_range`] on the driver's answers): device
    /// memory of `gpu`, not from a stream-ordered pool, inside one
    /// `cuMemAlloc` allocation or across virtual-memory-management
    /// mappings (`cuMemCreate` + `cuMemMap`, as PyTorch's
    /// `expandable_segments` gives) that are all GPUDirect RDMA capable and
    /// back to back, and whole host pages of it (a dma-buf export covers
    /// pages). `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS` is set on `cuMemAlloc`
    /// memory.
    ///
    /// # Safety
    /// The memory must stay allocated until the returned buffer (and any
    /// region made from it) is dropped; it is not freed here.
    ///
    /// # Errors
    /// [`Error::GpuMemory`] naming the rule broken and the fix;
    /// [`Error::Cuda`].
    pub unsafe fn from_raw(gpu: &Gpu, ptr: u64, len: usize) -> Result<GpuBuffer> {
        gpu.bind()?;
        let maps = driver::mappings(ptr, len as u64)?;
        let plan = judge_gpu_range(ptr, len as u64, gpu.ordinal(), crate::sysroot::page_size() as u64, &maps)?;
        if !plan.vmm {
            // Only asked of cuMemAlloc memory, which the driver documents
            // it for.
            driver::set_sync_memops(ptr)?;
        }
        Ok(GpuBuffer { gpu: gpu.clone(), ptr, len, owned: false, keep: None })
    }

    /// As [`from_raw`](Self::from_raw), holding `owner` (the object that
    /// owns the memory: a framework's tensor, a Python object) until the
    /// buffer, and every region made from it, is dropped.
    ///
    /// # Safety
    /// The memory must stay allocated for as long as `owner` lives.
    ///
    /// # Errors
    /// As [`from_raw`](Self::from_raw).
    pub unsafe fn from_raw_owned(gpu: &Gpu, ptr: u64, len: usize, owner: Box<dyn std::any::Any + Send + Sync>) -> Result<GpuBuffer> {
        // SAFETY: the memory lives as long as `owner` (caller), which the
        // buffer holds until it is dropped.
        let mut buf = unsafe { GpuBuffer::from_raw(gpu, ptr, len) }?;
        buf.keep = Some(owner);
        Ok(buf)
    }

    /// The GPU holding the buffer.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The device address (also the address peers use for RDMA).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Length in bytes (a multiple of 64 KiB when allocated here).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty (never, for allocated buffers).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds { what: "GPU buffer", offset: offset as u64, requested: len as u64, len: self.len as u64 }),
        }
    }

    /// Copies host bytes into the buffer at `offset` (synchronous).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Cuda`].
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        self.gpu.bind()?;
        // SAFETY: the device range is inside the allocation (checked);
        // `src` is a slice.
        unsafe { driver::copy_htod(self.ptr + offset as u64, src.as_ptr(), src.len()) }
    }

    /// Copies bytes of the buffer at `offset` to the host (synchronous).
    ///
    /// # Errors
    /// [`Error::OutOfBounds`], [`Error::Cuda`].
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        self.gpu.bind()?;
        // SAFETY: the device range is inside the allocation (checked);
        // `dst` is a slice we hold exclusively.
        unsafe { driver::copy_dtoh(dst.as_mut_ptr(), self.ptr + offset as u64, dst.len()) }
    }

    /// Exports the buffer as a dma-buf (`cuMemGetHandleForAddressRange`):
    /// the file descriptor, the offset of the buffer's start within it, and
    /// the exported length. The export starts at the host page below the
    /// buffer and ends at the host page above it, as the kernel requires.
    ///
    /// # Errors
    /// [`Error::Cuda`]: `CUDA_ERROR_NOT_SUPPORTED` when the GPU or driver
    /// cannot export dma-buf (see [`Gpu::dma_buf_supported`]), or a driver
    /// older than 11.7, which lacks the call (checked before calling).
    pub fn export_dma_buf(&self) -> Result<(OwnedFd, u64, usize)> {
        let page = crate::sysroot::page_size() as u64;
        let base = self.ptr & !(page - 1);
        let offset = self.ptr - base;
        let len = (offset + self.len as u64).next_multiple_of(page) as usize;
        static SYMBOL: OnceLock<bool> = OnceLock::new();
        require_symbol(&SYMBOL, "cuMemGetHandleForAddressRange", "11.7")?;
        self.gpu.bind()?;
        Ok((driver::export_dma_buf(base, len)?, offset, len))
    }
}

impl GpuBuffer {
    /// Copies `len` bytes from the buffer at `offset` to raw host memory.
    ///
    /// # Safety
    /// `dst..dst+len` must be writable host memory not referenced by Rust
    /// references meanwhile.
    pub(crate) unsafe fn copy_to_raw(&self, offset: usize, dst: *mut u8, len: usize) -> Result<()> {
        self.check(offset, len)?;
        self.gpu.bind()?;
        // SAFETY: device range checked; host range per our contract.
        unsafe { driver::copy_dtoh(dst, self.ptr + offset as u64, len) }
    }

    /// Copies `len` bytes from raw host memory into the buffer at `offset`.
    ///
    /// # Safety
    /// `src..src+len` must be readable host memory.
    pub(crate) unsafe fn copy_from_raw(&self, offset: usize, src: *const u8, len: usize) -> Result<()> {
        self.check(offset, len)?;
        self.gpu.bind()?;
        // SAFETY: device range checked; host range per our contract.
        unsafe { driver::copy_htod(self.ptr + offset as u64, src, len) }
    }
}

/// Pinned (page-locked) host memory from `cuMemHostAlloc`: the bounce
/// buffer of a host-staged region, which CUDA copies to and from at full
/// PCIe speed and the NIC registers like any host memory.
pub(crate) struct PinnedHost {
    gpu: Gpu,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: plain bytes owned exclusively; only used through raw pointers.
unsafe impl Send for PinnedHost {}
// SAFETY: as above.
unsafe impl Sync for PinnedHost {}

impl PinnedHost {
    pub(crate) fn alloc(gpu: &Gpu, len: usize) -> Result<PinnedHost> {
        gpu.bind()?;
        let ptr = driver::host_alloc_zeroed(len)?;
        Ok(PinnedHost { gpu: gpu.clone(), ptr, len })
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: allocated by cuMemHostAlloc; the region that used it
            // was deregistered first (it is dropped after the MR).
            if let Err(e) = unsafe { driver::host_free(self.ptr) } {
                tracing::warn!("{e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A driver without an entry point (here: the answer a CUDA 11.2
    /// driver gives for the dma-buf export) is a typed error naming the
    /// call, the CUDA release that added it and the fix; cudarc would panic.
    #[test]
    fn a_missing_driver_symbol_is_a_typed_error() {
        let e = symbol_answer("cuMemGetHandleForAddressRange", "11.7", false, Some(11020)).unwrap_err();
        assert!(matches!(e, Error::Cuda { call: "cuMemGetHandleForAddressRange", .. }));
        assert_eq!(
            e.to_string(),
            "cuMemGetHandleForAddressRange failed: the installed CUDA driver (version 11.2) has no \
             cuMemGetHandleForAddressRange, which CUDA 11.7 added: upgrade the NVIDIA driver"
        );
        assert!(symbol_answer("cuFlushGPUDirectRDMAWrites", "11.3", true, Some(11020)).is_ok());
        assert!(symbol_answer("cuFlushGPUDirectRDMAWrites", "11.3", false, None).unwrap_err().to_string().contains("version unknown"));
    }

    /// Built without the `cuda` feature: every entry point answers
    /// CudaUnavailable naming the feature, and nothing panics.
    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_feature_every_entry_point_says_so() {
        let answers = [gpu_count().map(drop), driver_version().map(drop), Gpu::open(0).map(drop)];
        for a in answers {
            assert!(matches!(a, Err(Error::CudaUnavailable(ref m)) if m.contains("`cuda` feature")), "{a:?}");
        }
    }

    /// The real lookup: without a driver it answers CudaUnavailable before
    /// looking anything up; with one, a symbol the driver lacks (a made-up
    /// name here) is the typed error and a present one passes.
    #[test]
    fn symbol_check_looks_up_the_real_driver() {
        static MISSING: OnceLock<bool> = OnceLock::new();
        static PRESENT: OnceLock<bool> = OnceLock::new();
        let missing = require_symbol(&MISSING, "cuNoSuchEntryPoint", "99.0");
        if driver::present() && driver().is_ok() {
            assert!(matches!(missing, Err(Error::Cuda { call: "cuNoSuchEntryPoint", .. })), "{missing:?}");
            assert_eq!(MISSING.get(), Some(&false));
            require_symbol(&PRESENT, "cuDriverGetVersion", "2.2").unwrap();
        } else {
            assert!(matches!(missing, Err(Error::CudaUnavailable(_))), "{missing:?}");
            assert!(MISSING.get().is_none(), "no lookup without a driver");
        }
    }
}
