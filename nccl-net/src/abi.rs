//! NCCL's network-plugin interface as C lays it out, versions 8 to 11:
//! plain data, written from NCCL's `plugins/net/README.md` and the
//! `net_v8.h` .. `net_v11.h` headers it documents. Nothing here acts; the
//! entry points are in `ffi`, the work behind them in the other modules.
//!
//! Which NCCL reads which table: 2.19 and 2.20 look for `ncclNetPlugin_v8`
//! (then older), 2.21 and 2.22 for v9 first, 2.23 to 2.27 for v10 first,
//! 2.28 and later for v11 first (then v10, v9, v8, ...). One library
//! exports all four; NCCL takes the newest it knows.
//!
//! Fields carry the headers' names in snake case and mean what the
//! headers say; they are not documented one by one here.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const SUCCESS: NcclResult = 0;
/// `ncclSystemError`: the system (verbs, sockets, CUDA) failed.
pub const SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: a bug (a panic caught at the boundary).
pub const INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`: a bad argument (a malformed handle, a bad size).
pub const INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`: the job's configuration is refused (no device, a
/// GPU's traffic that would be staged under `require`).
pub const INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: the peer failed or went away.
pub const REMOTE_ERROR: NcclResult = 6;

/// `NCCL_NET_HANDLE_MAXSIZE`: the bytes NCCL carries from `listen` to `connect`.
pub const HANDLE_MAXSIZE: usize = 128;
/// `NCCL_PTR_HOST`.
pub const PTR_HOST: c_int = 0x1;
/// `NCCL_PTR_CUDA`.
pub const PTR_CUDA: c_int = 0x2;
/// `NCCL_PTR_DMABUF`.
pub const PTR_DMABUF: c_int = 0x4;
/// `NCCL_NET_MAX_REQUESTS`: requests NCCL keeps in flight per comm.
pub const MAX_REQUESTS: usize = 32;
/// `NCCL_NET_MAX_DEVS_PER_NIC` (v9 to v11).
pub const MAX_DEVS_PER_NIC: usize = 4;
/// `NCCL_NET_DEVICE_HOST`: no device offload.
pub const NET_DEVICE_HOST: c_int = 0;

/// `NCCL_LOG_WARN`.
pub const LOG_WARN: c_int = 2;
/// `NCCL_LOG_INFO`.
pub const LOG_INFO: c_int = 3;
/// `NCCL_INIT` subsystem.
pub const SUBSYS_INIT: c_ulong = 1;
/// `NCCL_NET` subsystem.
pub const SUBSYS_NET: c_ulong = 16;

/// `ncclDebugLogger_t`: `printf`-style; called here with `"%s"` only.
pub type Logger = Option<unsafe extern "C" fn(level: c_int, flags: c_ulong, file: *const c_char, line: c_int, fmt: *const c_char, ...)>;
/// `ncclProfilerCallback_t` (v10+); never called by this plugin.
pub type ProfilerCallback = Option<unsafe extern "C" fn(*mut *mut c_void, c_int, *mut c_void, i64, *mut c_void) -> NcclResult>;

/// `ncclNetVDeviceProps_v9_t` .. `_v11_t` (identical).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct VDeviceProps {
    /// Physical devices merged into this virtual one.
    pub ndevs: c_int,
    /// Their indices.
    pub devs: [c_int; MAX_DEVS_PER_NIC],
}

/// `ncclNetCommConfig_v10_t` / `_v11_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CommConfig {
    /// The traffic class NCCL asks for (`NCCL_NET_TRAFFIC_CLASS_UNDEF`, -1, when none).
    pub traffic_class: c_int,
}

/// `ncclNetProperties_v8_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV8 {
    pub name: *mut c_char,
    pub pci_path: *mut c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
}

/// `ncclNetProperties_v9_t` and `_v10_t` (identical).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV9 {
    pub name: *mut c_char,
    pub pci_path: *mut c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub v_props: VDeviceProps,
    pub max_p2p_bytes: usize,
}

/// `ncclNetProperties_v11_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV11 {
    pub name: *mut c_char,
    pub pci_path: *mut c_char,
    pub guid: u64,
    pub ptr_support: c_int,
    pub reg_is_global: c_int,
    pub force_flush: c_int,
    pub speed: c_int,
    pub port: c_int,
    pub latency: f32,
    pub max_comms: c_int,
    pub max_recvs: c_int,
    pub net_device_type: c_int,
    pub net_device_version: c_int,
    pub v_props: VDeviceProps,
    pub max_p2p_bytes: usize,
    pub max_coll_bytes: usize,
    pub max_multi_request_size: c_int,
}

/// `ncclNetAttr_v11_t` (hints NCCL may hand to `setNetAttr`; read by no one here).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NetAttrV11 {
    pub send_comm_attr: [i32; 4],
    pub recv_comm_attr: [i32; 4],
    pub op: u32,
    pub algo: u32,
    pub proto: u32,
}

/// `void*` as NCCL passes comms, handles, requests and memory handles.
pub type Ptr = *mut c_void;
/// `ncclNetDeviceHandle_t**`: this plugin offloads nothing and leaves it NULL.
pub type DevHandleOut = *mut *mut c_void;

type RegMr = unsafe extern "C" fn(Ptr, Ptr, usize, c_int, *mut Ptr) -> NcclResult;
type RegMrDmaBuf = unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, *mut Ptr) -> NcclResult;
type Dereg = unsafe extern "C" fn(Ptr, Ptr) -> NcclResult;
type Iflush = unsafe extern "C" fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut Ptr, *mut Ptr) -> NcclResult;
type Test = unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult;
type Close = unsafe extern "C" fn(Ptr) -> NcclResult;
type GetDeviceMr = unsafe extern "C" fn(Ptr, Ptr, *mut Ptr) -> NcclResult;
type IrecvConsumed = unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult;
type Accept = unsafe extern "C" fn(Ptr, *mut Ptr, DevHandleOut) -> NcclResult;
type Devices = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type MakeVDevice = unsafe extern "C" fn(*mut c_int, *mut VDeviceProps) -> NcclResult;

/// `ncclNet_v8_t`.
#[repr(C)]
pub struct NetV8 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(Logger) -> NcclResult,
    pub devices: Devices,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV8) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, *mut Ptr) -> NcclResult,
    pub connect: unsafe extern "C" fn(c_int, Ptr, *mut Ptr, DevHandleOut) -> NcclResult,
    pub accept: Accept,
    pub reg_mr: RegMr,
    pub reg_mr_dma_buf: RegMrDmaBuf,
    pub dereg_mr: Dereg,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, c_int, c_int, Ptr, *mut Ptr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(Ptr, c_int, *mut Ptr, *mut c_int, *mut c_int, *mut Ptr, *mut Ptr) -> NcclResult,
    pub iflush: Iflush,
    pub test: Test,
    pub close_send: Close,
    pub close_recv: Close,
    pub close_listen: Close,
    pub get_device_mr: Option<GetDeviceMr>,
    pub irecv_consumed: IrecvConsumed,
}

/// `ncclNet_v9_t`.
#[repr(C)]
pub struct NetV9 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(Logger) -> NcclResult,
    pub devices: Devices,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, *mut Ptr) -> NcclResult,
    pub connect: unsafe extern "C" fn(c_int, Ptr, *mut Ptr, DevHandleOut) -> NcclResult,
    pub accept: Accept,
    pub reg_mr: RegMr,
    pub reg_mr_dma_buf: RegMrDmaBuf,
    pub dereg_mr: Dereg,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, *mut Ptr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr) -> NcclResult,
    pub iflush: Iflush,
    pub test: Test,
    pub close_send: Close,
    pub close_recv: Close,
    pub close_listen: Close,
    pub get_device_mr: Option<GetDeviceMr>,
    pub irecv_consumed: IrecvConsumed,
    pub make_v_device: Option<MakeVDevice>,
}

/// `ncclNet_v10_t`.
#[repr(C)]
pub struct NetV10 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(Logger, ProfilerCallback) -> NcclResult,
    pub devices: Devices,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV9) -> NcclResult,
    pub listen: unsafe extern "C" fn(c_int, Ptr, *mut Ptr) -> NcclResult,
    pub connect: unsafe extern "C" fn(c_int, *mut CommConfig, Ptr, *mut Ptr, DevHandleOut) -> NcclResult,
    pub accept: Accept,
    pub reg_mr: RegMr,
    pub reg_mr_dma_buf: RegMrDmaBuf,
    pub dereg_mr: Dereg,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, *mut Ptr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr, *mut Ptr) -> NcclResult,
    pub iflush: Iflush,
    pub test: Test,
    pub close_send: Close,
    pub close_recv: Close,
    pub close_listen: Close,
    pub get_device_mr: Option<GetDeviceMr>,
    pub irecv_consumed: IrecvConsumed,
    pub make_v_device: Option<MakeVDevice>,
}

/// `ncclNet_v11_t`.
#[repr(C)]
pub struct NetV11 {
    pub name: *const c_char,
    pub init: unsafe extern "C" fn(*mut Ptr, u64, *mut CommConfig, Logger, ProfilerCallback) -> NcclResult,
    pub devices: Devices,
    pub get_properties: unsafe extern "C" fn(c_int, *mut PropertiesV11) -> NcclResult,
    pub listen: unsafe extern "C" fn(Ptr, c_int, Ptr, *mut Ptr) -> NcclResult,
    pub connect: unsafe extern "C" fn(Ptr, c_int, Ptr, *mut Ptr, DevHandleOut) -> NcclResult,
    pub accept: Accept,
    pub reg_mr: RegMr,
    pub reg_mr_dma_buf: RegMrDmaBuf,
    pub dereg_mr: Dereg,
    pub isend: unsafe extern "C" fn(Ptr, Ptr, usize, c_int, Ptr, Ptr, *mut Ptr) -> NcclResult,
    pub irecv: unsafe extern "C" fn(Ptr, c_int, *mut Ptr, *mut usize, *mut c_int, *mut Ptr, *mut Ptr, *mut Ptr) -> NcclResult,
    pub iflush: Iflush,
    pub test: Test,
    pub close_send: Close,
    pub close_recv: Close,
    pub close_listen: Close,
    pub get_device_mr: Option<GetDeviceMr>,
    pub irecv_consumed: IrecvConsumed,
    pub make_v_device: Option<MakeVDevice>,
    pub finalize: Close,
    pub set_net_attr: unsafe extern "C" fn(Ptr, *mut NetAttrV11) -> NcclResult,
}

// SAFETY: the tables are immutable after construction: function pointers
// and a pointer to a 'static NUL-terminated name, never written through.
unsafe impl Sync for NetV8 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV9 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV10 {}
// SAFETY: as for NetV8.
unsafe impl Sync for NetV11 {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The offsets a C compiler gives the headers' structs on LP64 (x86-64
    /// and aarch64 Linux), worked out field by field from the headers.
    #[test]
    fn properties_lay_out_as_the_headers_do() {
        assert_eq!((size_of::<PropertiesV8>(), offset_of!(PropertiesV8, ptr_support), offset_of!(PropertiesV8, net_device_version)), (64, 24, 56));
        assert_eq!(offset_of!(PropertiesV9, force_flush), 32);
        assert_eq!(offset_of!(PropertiesV9, latency), 44);
        assert_eq!(offset_of!(PropertiesV9, v_props), 64);
        assert_eq!(offset_of!(PropertiesV9, max_p2p_bytes), 88);
        assert_eq!(size_of::<PropertiesV9>(), 96);
        assert_eq!(offset_of!(PropertiesV11, max_coll_bytes), 96);
        assert_eq!(offset_of!(PropertiesV11, max_multi_request_size), 104);
        assert_eq!(size_of::<PropertiesV11>(), 112);
        assert_eq!(size_of::<VDeviceProps>(), 20);
        assert_eq!(size_of::<NetAttrV11>(), 44);
    }

    /// Every table is the name and then one pointer per entry, in the
    /// headers' order.
    #[test]
    fn tables_have_the_headers_entries() {
        let p = size_of::<usize>();
        assert_eq!(size_of::<NetV8>(), 19 * p);
        assert_eq!(size_of::<NetV9>(), 20 * p);
        assert_eq!(size_of::<NetV10>(), 20 * p);
        assert_eq!(size_of::<NetV11>(), 22 * p);
        assert_eq!(offset_of!(NetV11, isend), 10 * p);
        assert_eq!(offset_of!(NetV11, test), 13 * p);
        assert_eq!(offset_of!(NetV11, finalize), 20 * p);
        assert_eq!(offset_of!(NetV8, irecv_consumed), 18 * p);
    }
}
