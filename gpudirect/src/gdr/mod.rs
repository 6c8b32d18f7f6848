//! GPUDirect RDMA: which path registers GPU memory with the NIC, and why
//! none can when none can.
//!
//! Two zero-copy paths exist. **dma-buf** (the modern one): CUDA exports the
//! memory as a dma-buf (`cuMemGetHandleForAddressRange`) and the NIC
//! registers that (`ibv_reg_dmabuf_mr`, iova = the device pointer).
//! **Peer memory** (the legacy one): plain `ibv_reg_mr` on the device
//! pointer, served by the `nvidia-peermem` kernel module. When neither
//! works, other stacks quietly copy through host memory at about half the
//! bandwidth. Here the caller decides, with [`GpuPolicy`](crate::GpuPolicy):
//! [`Require`](crate::GpuPolicy::Require) (the default) returns a [`GdrError`]
//! listing each cause, what was checked and what to do; with
//! [`Prefer`](crate::GpuPolicy::Prefer) the region falls back to host staging and
//! says so. Every GPU region reports the [`RegistrationPath`](crate::RegistrationPath) used.
//!
//! The decision is a pure function of [`GdrFacts`], so every cause is
//! tested with injected facts; [`GdrFacts::gather`] collects them live.
//!
//! # When received data is really there
//! A receive completion (including the one a write with immediate data
//! consumes) means the NIC has issued every PCIe write of the message and
//! the CPU may read host memory. For GPU memory written directly (dma-buf
//! or peer memory) that is not yet a promise to the GPU's kernels: unless
//! the GPU orders inbound RDMA writes
//! (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` >= OWNER, as on
//! Hopper), the writes may still be in flight inside the GPU. Call
//! [`MemoryRegion::flush_gpu_writes`](crate::MemoryRegion::flush_gpu_writes) after reaping the completion and
//! before launching the consumer kernel: it is free on GPUs that order
//! writes and issues `cuFlushGPUDirectRDMAWrites` on older ones (NCCL
//! issues a loopback RDMA read for the same purpose). Copies through the
//! region's own accessors (`read_at`) are ordered already: buffers are
//! allocated with `CU_POINTER_ATTRIBUTE_SYNC_MEMOPS`. Host-staged regions
//! copy into the GPU synchronously when the completion is reaped (or when
//! [`MemoryRegion::stage_in`](crate::MemoryRegion::stage_in) is called for a peer's write), so the data is
//! complete when that returns.

pub(crate) mod facts;
mod gather;
mod register;
pub(crate) mod judge;

pub use facts::{DmaBufProbe, GdrFacts, GpuFacts, HostFacts, ModuleFlavour, NicFacts, PEER_MEMORY_FILES};
pub use crate::error::gdr::{Cause, GdrError};
pub use judge::{plan, Fact, Judgement, Plan};

