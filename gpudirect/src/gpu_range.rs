//! Whether a range of device memory may be given to a NIC, mapping by
//! mapping: the driver's answers ([`GpuMapping`], gathered by `driver.rs` or
//! injected by tests) and the one judge of them ([`judge_gpu_range`]): plain
//! data and a pure function, over the errors' layer ([`GpuMemoryError`]).
//!
//! Frameworks hand out memory of three kinds. `cudaMalloc`/`cuMemAlloc`
//! memory is one allocation the driver reports whole. Memory mapped with
//! the virtual-memory-management API (`cuMemCreate` + `cuMemMap`: PyTorch's
//! `expandable_segments`, NCCL's cuMem buffers) is reported one physical
//! allocation at a time, so a tensor may span several mappings in one
//! contiguous virtual range; each must have been created GPUDirect-RDMA
//! capable (`CUmemAllocationProp::allocFlags.gpuDirectRDMACapable`), which
//! `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE` reports. Stream-ordered
//! pool memory (`cudaMallocAsync`) cannot be given to a NIC at all.

use crate::error::gpu_memory::GpuMemoryError;

/// What the driver says about one mapping of device memory: a `cuMemAlloc`
/// allocation, or one physical allocation mapped with `cuMemMap`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GpuMapping {
    /// First address: `CU_POINTER_ATTRIBUTE_RANGE_START_ADDR` for a
    /// `cuMemAlloc` allocation; for a `cuMemMap` mapping, the first granule
    /// mapped to the same allocation handle (the attribute gives the
    /// address reservation around it).
    pub base: u64,
    /// Bytes (`CU_POINTER_ATTRIBUTE_RANGE_SIZE`, or the mapping's granules).
    pub size: u64,
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (2: device; 0: CUDA does not know
    /// the address, e.g. reserved but unmapped).
    pub memory_type: u32,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (-1 when unknown).
    pub ordinal: i32,
    /// Mapped through the virtual-memory-management API
    /// (`cuMemRetainAllocationHandle` answers for it).
    pub vmm: bool,
    /// `CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE`; `None` when the
    /// driver does not answer it.
    pub rdma_capable: Option<bool>,
    /// From a stream-ordered memory pool (`CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE`).
    pub pool: bool,
}

/// `CU_MEMORYTYPE_DEVICE`.
pub const CU_MEMORYTYPE_DEVICE: u32 = 2;

/// How a range may be registered: one dma-buf export (and one peer-memory
/// registration) over `export_base..export_base + export_len`, which
/// covers the range rounded out to host pages and lies in mapped memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuRangePlan {
    /// First byte of the export (a host page boundary).
    pub export_base: u64,
    /// Bytes of the export (whole host pages).
    pub export_len: u64,
    /// Mappings the range spans.
    pub mappings: usize,
    /// Whether they are virtual-memory-management mappings.
    pub vmm: bool,
}

/// Most mappings one range may span (expandable segments map 20 MiB
/// at a time: 4096 of them is 80 GiB).
pub const MAX_GPU_MAPPINGS: usize = 4096;

/// Whether `ptr..ptr + len` on GPU `ordinal` may be given to a NIC, from
/// `maps`: the driver's answers for the mapping holding `ptr`, then for the
/// address after each mapping's end, until one reaches past the range.
/// `page` is the host page size the dma-buf export is rounded to.
///
/// # Errors
/// The first rule the range breaks, as a [`GpuMemoryError`] naming the fix.
pub fn judge_gpu_range(ptr: u64, len: u64, ordinal: usize, page: u64, maps: &[GpuMapping]) -> Result<GpuRangePlan, GpuMemoryError> {
    if len == 0 {
        return Err(GpuMemoryError::Empty { ptr });
    }
    let end = ptr.checked_add(len).ok_or(GpuMemoryError::Unmapped { ptr, len, at: u64::MAX })?;
    let mut at = ptr;
    let mut used = 0;
    for m in maps {
        if m.memory_type != CU_MEMORYTYPE_DEVICE {
            return Err(if used == 0 {
                GpuMemoryError::NotDeviceMemory { at, memory_type: m.memory_type }
            } else {
                GpuMemoryError::Unmapped { ptr, len, at }
            });
        }
        if m.base > at || m.base.saturating_add(m.size) <= at {
            // The driver's answer for `at` does not hold it: nothing is mapped there.
            return Err(GpuMemoryError::Unmapped { ptr, len, at });
        }
        if m.ordinal < 0 || m.ordinal as usize != ordinal {
            return Err(GpuMemoryError::OtherGpu { at, ordinal: m.ordinal, want: ordinal });
        }
        if m.pool {
            return Err(GpuMemoryError::StreamOrderedPool { at });
        }
        if m.vmm && m.rdma_capable == Some(false) {
            return Err(GpuMemoryError::NotRdmaCapable { base: m.base, size: m.size });
        }
        used += 1;
        at = m.base.saturating_add(m.size);
        if at >= end {
            break;
        }
        if !m.vmm {
            // A cuMemAlloc allocation is reported whole: the range leaves it.
            return Err(GpuMemoryError::PastAllocation { ptr, len, base: m.base, size: m.size });
        }
        if used == MAX_GPU_MAPPINGS {
            return Err(GpuMemoryError::TooManyMappings { ptr, len, max: MAX_GPU_MAPPINGS });
        }
    }
    if at < end {
        return Err(GpuMemoryError::Unmapped { ptr, len, at });
    }
    let (first, last) = (maps[0], maps[used - 1]);
    let export_base = ptr & !(page - 1);
    let export_end = end.next_multiple_of(page);
    let (base, mapped_end) = (first.base, last.base.saturating_add(last.size));
    if export_base < base || export_end > mapped_end {
        return Err(GpuMemoryError::Misaligned {
            ptr,
            len,
            page,
            export_base,
            export_len: export_end - export_base,
            base,
            size: mapped_end - base,
        });
    }
    Ok(GpuRangePlan { export_base, export_len: export_end - export_base, mappings: used, vmm: first.vmm })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;
    const PAGE: u64 = 4096;

    fn alloc(base: u64, size: u64) -> GpuMapping {
        GpuMapping { base, size, memory_type: CU_MEMORYTYPE_DEVICE, ordinal: 0, vmm: false, rdma_capable: Some(true), pool: false }
    }

    fn vmm(base: u64, size: u64, capable: bool) -> GpuMapping {
        GpuMapping { vmm: true, rdma_capable: Some(capable), ..alloc(base, size) }
    }

    /// PyTorch's expandable segments: 20 MiB physical allocations mapped
    /// back to back into one reservation.
    fn segments(base: u64, n: u64, capable: bool) -> Vec<GpuMapping> {
        (0..n).map(|i| vmm(base + i * 20 * MIB, 20 * MIB, capable)).collect()
    }

    #[test]
    fn a_range_inside_a_cudamalloc_allocation_is_one_export_rounded_to_pages() {
        let p = judge_gpu_range(0x7f00_0000_1000 + 100, 8 * MIB, 0, PAGE, &[alloc(0x7f00_0000_0000, 64 * MIB)]).unwrap();
        assert_eq!(p, GpuRangePlan { export_base: 0x7f00_0000_1000, export_len: 8 * MIB + PAGE, mappings: 1, vmm: false });
    }

    #[test]
    fn a_tensor_across_capable_expandable_segments_is_one_export_over_all_of_them() {
        let maps = segments(0x7e00_0000_0000, 4, true);
        // 50 MiB starting 5 MiB into the first segment: three segments.
        let p = judge_gpu_range(0x7e00_0000_0000 + 5 * MIB, 50 * MIB, 0, PAGE, &maps).unwrap();
        assert_eq!((p.mappings, p.vmm, p.export_len), (3, true, 50 * MIB));
    }

    #[test]
    fn expandable_segments_without_the_rdma_flag_fail_naming_the_allocator_setting() {
        let mut maps = segments(0x7e00_0000_0000, 3, true);
        maps[1].rdma_capable = Some(false);
        let e = judge_gpu_range(0x7e00_0000_0000, 50 * MIB, 0, PAGE, &maps).unwrap_err();
        assert_eq!(e, GpuMemoryError::NotRdmaCapable { base: 0x7e00_0000_0000 + 20 * MIB, size: 20 * MIB });
        let msg = e.to_string();
        assert!(msg.contains("expandable_segments") && msg.contains("gpuDirectRDMACapable = 1"), "{msg}");
        // The first segment alone is fine.
        assert!(judge_gpu_range(0x7e00_0000_0000, 20 * MIB, 0, PAGE, &maps).is_ok());
        // A driver that does not answer the attribute is not taken as a no.
        maps[1].rdma_capable = None;
        assert!(judge_gpu_range(0x7e00_0000_0000, 50 * MIB, 0, PAGE, &maps).is_ok());
    }

    #[test]
    fn a_hole_in_the_reservation_is_unmapped() {
        let maps = [vmm(0x7e00_0000_0000, 20 * MIB, true), GpuMapping { memory_type: 0, ..Default::default() }];
        let e = judge_gpu_range(0x7e00_0000_0000, 30 * MIB, 0, PAGE, &maps).unwrap_err();
        assert_eq!(e, GpuMemoryError::Unmapped { ptr: 0x7e00_0000_0000, len: 30 * MIB, at: 0x7e00_0000_0000 + 20 * MIB });
        // The driver's answer runs out before the range does.
        let e = judge_gpu_range(0x7e00_0000_0000, 30 * MIB, 0, PAGE, &maps[..1]).unwrap_err();
        assert!(matches!(e, GpuMemoryError::Unmapped { .. }), "{e}");
    }

    #[test]
    fn each_other_kind_of_memory_fails_with_its_cause() {
        let host = GpuMapping { memory_type: 1, ..Default::default() };
        assert!(matches!(judge_gpu_range(0x1000, 4096, 0, PAGE, &[host]), Err(GpuMemoryError::NotDeviceMemory { memory_type: 1, .. })));
        let other = GpuMapping { ordinal: 3, ..alloc(0x10_0000, MIB) };
        assert_eq!(judge_gpu_range(0x10_0000, 4096, 0, PAGE, &[other]), Err(GpuMemoryError::OtherGpu { at: 0x10_0000, ordinal: 3, want: 0 }));
        let pool = GpuMapping { pool: true, ..alloc(0x10_0000, MIB) };
        let e = judge_gpu_range(0x10_0000, 4096, 0, PAGE, &[pool]).unwrap_err();
        assert!(e.to_string().contains("cudaMallocAsync"), "{e}");
        assert_eq!(
            judge_gpu_range(0x10_0000, 2 * MIB, 0, PAGE, &[alloc(0x10_0000, MIB)]),
            Err(GpuMemoryError::PastAllocation { ptr: 0x10_0000, len: 2 * MIB, base: 0x10_0000, size: MIB })
        );
        assert_eq!(judge_gpu_range(0x10_0000, 0, 0, PAGE, &[alloc(0x10_0000, MIB)]), Err(GpuMemoryError::Empty { ptr: 0x10_0000 }));
    }

    #[test]
    fn a_small_allocation_sharing_a_page_is_refused_before_registering() {
        // A 1 KiB allocation at 512 bytes into a page: the export's page
        // would take in another allocation's bytes.
        let e = judge_gpu_range(0x20_0200, 1024, 0, PAGE, &[alloc(0x20_0200, 1024)]).unwrap_err();
        assert!(matches!(e, GpuMemoryError::Misaligned { export_base: 0x20_0000, export_len: 4096, .. }), "{e}");
        assert!(e.to_string().contains("at least 2 MiB"), "{e}");
    }

    #[test]
    fn a_walk_is_bounded() {
        let maps: Vec<GpuMapping> = (0..MAX_GPU_MAPPINGS as u64 + 1).map(|i| vmm(i * 2 * MIB, 2 * MIB, true)).collect();
        let e = judge_gpu_range(0, (MAX_GPU_MAPPINGS as u64 + 1) * 2 * MIB, 0, PAGE, &maps).unwrap_err();
        assert!(matches!(e, GpuMemoryError::TooManyMappings { .. }), "{e}");
    }
}
