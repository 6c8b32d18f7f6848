//! GPUDirect RDMA: which path registers GPU memory with the NIC, and why
//! none can when none can.
//!
//! Two zero-copy paths exist. **dma-buf** (the modern one): CUDA exports the
//! memory as a dma-buf (`cuMemGetHandleForAddressRange`) and the NIC
//! registers that (`ibv_reg_dmabuf_mr`, iova = the device pointer).
//! **Peer memory** (the legacy one): plain `ibv_reg_mr` on the device
//! pointer, served by the `nvidia-peermem` kernel module. When neither
//! works, other stacks quietly copy through host memory at about half the
//! bandwidth. Here the caller decides, with [`GpuPolicy`]:
//! [`Require`](GpuPolicy::Require) (the default) returns a [`GdrError`]
//! listing each cause, what was checked and what to do; with
//! [`Prefer`](GpuPolicy::Prefer) the region falls back to host staging and
//! says so. Every GPU region reports the [`RegistrationPath`] used.
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

use std::fmt;

mod facts;
mod gather;
pub(crate) mod judge;
mod register;

pub use facts::{DmaBufProbe, GdrFacts, GpuFacts, HostFacts, ModuleFlavour, NicFacts, PEER_MEMORY_FILES};
pub use judge::{plan, Cause, Fact, GdrError, Judgement, Plan};

/// How a GPU memory region was registered with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RegistrationPath {
    /// Zero-copy through a dma-buf export of the GPU memory.
    DmaBuf,
    /// Zero-copy through the `nvidia-peermem` peer-memory client.
    PeerMemory,
    /// Not zero-copy: the NIC uses a pinned host mirror and every transfer
    /// is copied between it and the GPU.
    HostStaged,
}

impl fmt::Display for RegistrationPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegistrationPath::DmaBuf => "dma-buf",
            RegistrationPath::PeerMemory => "peer memory",
            RegistrationPath::HostStaged => "host-staged",
        })
    }
}

/// What to do when GPUDirect RDMA is not available.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuPolicy {
    /// GPUDirect RDMA or an error naming why not. The default.
    #[default]
    Require,
    /// GPUDirect RDMA if possible, otherwise host staging, reported by the
    /// region's path and a warning in the log.
    Prefer,
    /// Host staging, without trying GPUDirect RDMA.
    HostStaged,
}

impl std::str::FromStr for GpuPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "require" => Ok(GpuPolicy::Require),
            "prefer" => Ok(GpuPolicy::Prefer),
            "host-staged" | "hoststaged" | "staged" => Ok(GpuPolicy::HostStaged),
            _ => Err(format!("unknown GPU policy {s:?}: expected require, prefer or host-staged")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse() {
        assert_eq!("require".parse::<GpuPolicy>().unwrap(), GpuPolicy::Require);
        assert_eq!("Prefer".parse::<GpuPolicy>().unwrap(), GpuPolicy::Prefer);
        assert_eq!("host-staged".parse::<GpuPolicy>().unwrap(), GpuPolicy::HostStaged);
        assert!("always".parse::<GpuPolicy>().is_err());
        assert_eq!(GpuPolicy::default(), GpuPolicy::Require);
    }
}
