//! PCIe topology, ACS, IOMMU and link bandwidth between GPUs and NICs (stub: being written).
