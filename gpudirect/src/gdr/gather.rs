//! Gathering the facts live: CUDA for the GPU, the dma-buf probe on the
//! NIC, the host's files.

use super::facts::{DmaBufProbe, GdrFacts, GpuFacts, HostFacts, ModuleFlavour, NicFacts};
use crate::error::Error;
use crate::gpu::{self, Gpu};
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;
use crate::sysroot::SysRoot;

impl GdrFacts {
    /// Gathers the facts live: CUDA for GPU `ordinal`, the dma-buf probe on
    /// the NIC of `pd`, and the host's files under `root` (`SysRoot::live()`
    /// on a real machine). Never fails: what cannot be learned is recorded
    /// as unknown or as the reason it is unavailable.
    pub fn gather(pd: &ProtectionDomain, ordinal: usize, root: &SysRoot) -> GdrFacts {
        GdrFacts { gpu: GpuFacts::gather(ordinal, root), nic: Self::gather_nic(pd), host: HostFacts::read(root) }
    }

    /// The NIC side alone: the dma-buf probe on the device of `pd`.
    pub fn gather_nic(pd: &ProtectionDomain) -> NicFacts {
        NicFacts { device: pd.context().name().to_owned(), dma_buf: DmaBufProbe::from_errno(MemoryRegion::probe_dmabuf(pd)) }
    }
}

impl GpuFacts {
    /// Asks CUDA about GPU `ordinal`.
    pub fn gather(ordinal: usize, root: &SysRoot) -> GpuFacts {
        let module = ModuleFlavour::read(root);
        let unknown = |why: String| GpuFacts {
            ordinal,
            label: format!("GPU{ordinal}"),
            pci_bus_id: None,
            cuda_unavailable: Some(why),
            driver_version: None,
            gdr_supported: None,
            dma_buf_supported: None,
            module: module.clone(),
        };
        match Gpu::open(ordinal) {
            Err(Error::CudaUnavailable(why)) => unknown(why),
            Err(e) => unknown(e.to_string()),
            Ok(gpu) => GpuFacts {
                ordinal,
                label: gpu.to_string(),
                pci_bus_id: gpu.pci_bus_id().map(str::to_owned),
                cuda_unavailable: None,
                driver_version: gpu::driver_version().ok(),
                gdr_supported: gpu.gpudirect_rdma_supported().ok(),
                dma_buf_supported: gpu.dma_buf_supported().ok(),
                module,
            },
        }
    }
}
