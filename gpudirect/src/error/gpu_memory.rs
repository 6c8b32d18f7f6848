//! Why device memory cannot be given to a NIC: the error the GPU range
//! judge (`gpu_range.rs`) returns, plain data in the errors' layer.

/// Why device memory cannot be given to a NIC, each with its fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GpuMemoryError {
    /// The range is empty.
    #[error("device pointer {ptr:#x}: an empty range cannot be registered")]
    Empty {
        /// The pointer.
        ptr: u64,
    },
    /// Not device memory (host, managed, or an address CUDA does not know).
    #[error(
        "{at:#x} is not device memory (CU_POINTER_ATTRIBUTE_MEMORY_TYPE = {memory_type}): register host memory \
         with Agent::register, and GPU memory from cudaMalloc/cuMemAlloc or cuMemCreate"
    )]
    NotDeviceMemory {
        /// The address.
        at: u64,
        /// What the driver reports.
        memory_type: u32,
    },
    /// Device memory of another GPU than the one named.
    #[error("{at:#x} belongs to GPU{ordinal}, not GPU{want}: register it with GPU{ordinal}")]
    OtherGpu {
        /// The address.
        at: u64,
        /// Its GPU.
        ordinal: i32,
        /// The GPU it was registered with.
        want: usize,
    },
    /// Stream-ordered pool memory, which GPUDirect RDMA does not support.
    #[error(
        "{at:#x} comes from a stream-ordered memory pool (cudaMallocAsync), which GPUDirect RDMA does not support: \
         allocate with cudaMalloc/cuMemAlloc (PyTorch: PYTORCH_CUDA_ALLOC_CONF=backend:native, the default)"
    )]
    StreamOrderedPool {
        /// The address.
        at: u64,
    },
    /// A virtual-memory-management mapping created without the GPUDirect
    /// RDMA flag.
    #[error(
        "the mapping {base:#x}+{size} (cuMemCreate/cuMemMap) was not created GPUDirect RDMA capable \
         (CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 0): a NIC cannot reach it. PyTorch's \
         expandable_segments allocator gives such memory: unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF \
         for the memory you register, or allocate it from a pool whose cuMemCreate sets \
         CUmemAllocationProp.allocFlags.gpuDirectRDMACapable = 1"
    )]
    NotRdmaCapable {
        /// The mapping's first address.
        base: u64,
        /// Its size.
        size: u64,
    },
    /// The range crosses addresses that are not mapped (reserved only).
    #[error(
        "the range {ptr:#x}+{len} crosses unmapped addresses at {at:#x}: register only memory that is mapped \
         (a tensor's own bytes, not the reservation around it)"
    )]
    Unmapped {
        /// The range's start.
        ptr: u64,
        /// Its length.
        len: u64,
        /// The first unmapped address.
        at: u64,
    },
    /// The range runs past the end of its `cuMemAlloc` allocation.
    #[error("the range {ptr:#x}+{len} extends past its allocation ({base:#x}+{size}): register a range inside one allocation")]
    PastAllocation {
        /// The range's start.
        ptr: u64,
        /// Its length.
        len: u64,
        /// The allocation's start.
        base: u64,
        /// Its size.
        size: u64,
    },
    /// Rounded out to host pages (as a dma-buf export must be), the range
    /// leaves its allocation: it shares a page with other allocations.
    #[error(
        "the range {ptr:#x}+{len} rounded out to {page}-byte host pages ({export_base:#x}+{export_len}) leaves its \
         allocation ({base:#x}+{size}): a dma-buf export covers whole pages. Register page-aligned memory: a \
         whole cudaMalloc allocation, or a tensor of at least 2 MiB (caching allocators pack smaller ones \
         into shared blocks)"
    )]
    Misaligned {
        /// The range's start.
        ptr: u64,
        /// Its length.
        len: u64,
        /// The host page size.
        page: u64,
        /// The rounded-out export's start.
        export_base: u64,
        /// Its length.
        export_len: u64,
        /// The mapped memory's start.
        base: u64,
        /// Its size.
        size: u64,
    },
    /// More mappings than the judge walks.
    #[error("the range {ptr:#x}+{len} spans more than {max} mappings: register it in parts")]
    TooManyMappings {
        /// The range's start.
        ptr: u64,
        /// Its length.
        len: u64,
        /// The limit.
        max: usize,
    },
}
