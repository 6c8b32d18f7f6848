//! The entry points NCCL calls, and the four tables that name them. Each
//! entry point checks its pointers, runs the work in the modules behind it
//! inside `guard` (an error becomes a WARN line and its NCCL code; a panic
//! is caught here and never unwinds into NCCL), and writes its results.
//! Versions differ only in argument types; one body serves them all.

use std::ffi::{c_char, c_int};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

use gpudirect::metrics::{MetricsEndpoint, Render, METRICS_ENV};

use crate::abi::*;
use crate::comm::{request, Comm, MAX_BYTES, MAX_RECVS};
use crate::config::Config;
use crate::error::{NetError, Result};
use crate::log;
use crate::reg::Reg;
use crate::setup::{connect as setup_connect, Listen};
use crate::site::Site;
use crate::stats::{prometheus_text, PluginStats};

static SITE: OnceLock<std::result::Result<Site, (String, NcclResult)>> = OnceLock::new();
/// The metrics endpoint, when `GPUDIRECT_METRICS` asked for one: started
/// once, at the first init, and kept for the process's life (NCCL calls
/// init again per communicator).
static METRICS: OnceLock<std::result::Result<Option<MetricsEndpoint>, String>> = OnceLock::new();
const NAME: &std::ffi::CStr = c"GPUDirect";

fn guard(what: &str, f: impl FnOnce() -> Result<()>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => SUCCESS,
        Ok(Err(e)) => {
            log::warn(&format!("{what}: {e}"));
            e.code()
        }
        Err(_) => {
            log::warn(&format!("{what}: internal error (a panic, caught at the plugin's boundary; please report it)"));
            INTERNAL_ERROR
        }
    }
}

fn site() -> Result<&'static Site> {
    match SITE.get() {
        Some(Ok(s)) => Ok(s),
        Some(Err((why, _))) => Err(NetError::Config(why.clone())),
        None => Err(NetError::Invalid("called before init".into())),
    }
}

fn init(logger: Logger) -> Result<()> {
    log::set(logger);
    let s = SITE.get_or_init(|| {
        let opened = Config::from_process().and_then(Site::open);
        match opened {
            Ok(site) => {
                for nic in &site.nics {
                    log::info_init(&format!("Using {}", nic.describe()));
                }
                for why in &site.skipped {
                    log::info_init(&format!("Not using {why}"));
                }
                log::info_init(&format!(
                    "gpudirect {} ; policy {}={} ; {} device(s)",
                    env!("CARGO_PKG_VERSION"),
                    crate::config::GdrPolicy::VAR,
                    site.config.policy.name(),
                    site.nics.len()
                ));
                Ok(site)
            }
            Err(e) => Err((e.to_string(), e.code())),
        }
    });
    let site = match s {
        Ok(site) => site,
        Err((why, _)) => return Err(NetError::Config(why.clone())),
    };
    let served = METRICS.get_or_init(|| {
        let Some(addr) = site.config.metrics else { return Ok(None) };
        let render: Render = Arc::new(move || prometheus_text(&site.stats()));
        match MetricsEndpoint::start(addr, "nccl-net", render) {
            Ok(ep) => {
                log::info_init(&format!("metrics at http://{}/metrics ({METRICS_ENV})", ep.addr()));
                Ok(Some(ep))
            }
            Err(e) => Err(format!("{METRICS_ENV} asks for metrics at {addr}, which cannot be served: {e}; name a free port, or unset it")),
        }
    });
    match served {
        Ok(_) => Ok(()),
        Err(why) => Err(NetError::Config(why.clone())),
    }
}

/// The plugin's counters now, once init has opened its devices.
pub fn stats() -> Option<PluginStats> {
    match SITE.get() {
        Some(Ok(site)) => Some(site.stats()),
        _ => None,
    }
}

/// # Safety
/// `p` is null or valid for a write of `T`.
unsafe fn out<T>(p: *mut T, v: T) -> Result<()> {
    if p.is_null() {
        return Err(NetError::Invalid("a null output pointer".into()));
    }
    // SAFETY: the caller's promise.
    unsafe { p.write(v) };
    Ok(())
}

unsafe extern "C" fn init_v8(logger: Logger) -> NcclResult {
    guard("init", || init(logger))
}

unsafe extern "C" fn init_v10(logger: Logger, _prof: ProfilerCallback) -> NcclResult {
    guard("init", || init(logger))
}

/// The per-communicator context of v11: the traffic class NCCL asks for.
struct Ctx {
    traffic_class: Option<u8>,
}

unsafe extern "C" fn init_v11(ctx: *mut Ptr, _comm_id: u64, config: *mut CommConfig, logger: Logger, _prof: ProfilerCallback) -> NcclResult {
    guard("init", || {
        init(logger)?;
        // SAFETY: NCCL passes its config or null.
        let tc = unsafe { config.as_ref() }.and_then(|c| u8::try_from(c.traffic_class).ok());
        // SAFETY: NCCL's out pointer.
        unsafe { out(ctx, Box::into_raw(Box::new(Ctx { traffic_class: tc })).cast()) }
    })
}

unsafe extern "C" fn finalize(ctx: Ptr) -> NcclResult {
    guard("finalize", || {
        if !ctx.is_null() {
            // SAFETY: made by init_v11, finalized once.
            drop(unsafe { Box::from_raw(ctx.cast::<Ctx>()) });
        }
        if let Ok(site) = site() {
            for nic in &site.nics {
                log::info(&nic.traffic_line());
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn set_net_attr(_ctx: Ptr, _attr: *mut NetAttrV11) -> NcclResult {
    SUCCESS
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    // SAFETY: NCCL's out pointer.
    guard("devices", || unsafe { out(ndev, site()?.nics.len() as c_int) })
}

/// The v9+ properties of device `dev` (v8 and v11 are made from them).
fn props(dev: c_int) -> Result<PropertiesV11> {
    let nic = site()?.nic(dev)?;
    Ok(PropertiesV11 {
        name: nic.c_name.as_ptr() as *mut c_char,
        pci_path: nic.c_pci_path.as_ptr() as *mut c_char,
        guid: nic.guid,
        ptr_support: nic.ptr_support,
        // Registrations live in their comm's protection domain.
        reg_is_global: 0,
        force_flush: 0,
        speed: nic.speed_mbps,
        port: c_int::from(nic.port),
        latency: 0.0,
        max_comms: 65536,
        max_recvs: MAX_RECVS as c_int,
        net_device_type: NET_DEVICE_HOST,
        net_device_version: 0,
        v_props: VDeviceProps { ndevs: 1, devs: [dev, 0, 0, 0] },
        max_p2p_bytes: MAX_BYTES,
        max_coll_bytes: MAX_BYTES,
        max_multi_request_size: 1,
    })
}

unsafe extern "C" fn get_properties_v8(dev: c_int, p: *mut PropertiesV8) -> NcclResult {
    guard("getProperties", || {
        let v = props(dev)?;
        let v8 = PropertiesV8 {
            name: v.name,
            pci_path: v.pci_path,
            guid: v.guid,
            ptr_support: v.ptr_support,
            reg_is_global: v.reg_is_global,
            speed: v.speed,
            port: v.port,
            latency: v.latency,
            max_comms: v.max_comms,
            max_recvs: v.max_recvs,
            net_device_type: v.net_device_type,
            net_device_version: v.net_device_version,
        };
        // SAFETY: NCCL's out pointer.
        unsafe { out(p, v8) }
    })
}

unsafe extern "C" fn get_properties_v9(dev: c_int, p: *mut PropertiesV9) -> NcclResult {
    guard("getProperties", || {
        let v = props(dev)?;
        let v9 = PropertiesV9 {
            name: v.name,
            pci_path: v.pci_path,
            guid: v.guid,
            ptr_support: v.ptr_support,
            reg_is_global: v.reg_is_global,
            force_flush: v.force_flush,
            speed: v.speed,
            port: v.port,
            latency: v.latency,
            max_comms: v.max_comms,
            max_recvs: v.max_recvs,
            net_device_type: v.net_device_type,
            net_device_version: v.net_device_version,
            v_props: v.v_props,
            max_p2p_bytes: v.max_p2p_bytes,
        };
        // SAFETY: NCCL's out pointer.
        unsafe { out(p, v9) }
    })
}

unsafe extern "C" fn get_properties_v11(dev: c_int, p: *mut PropertiesV11) -> NcclResult {
    // SAFETY: NCCL's out pointer.
    guard("getProperties", || unsafe { out(p, props(dev)?) })
}

fn handle_bytes<'a>(handle: Ptr) -> Result<&'a mut [u8; HANDLE_MAXSIZE]> {
    if handle.is_null() {
        return Err(NetError::Invalid("a null handle".into()));
    }
    // SAFETY: NCCL's handles are NCCL_NET_HANDLE_MAXSIZE bytes it owns.
    Ok(unsafe { &mut *(handle as *mut [u8; HANDLE_MAXSIZE]) })
}

fn listen(dev: c_int, handle: Ptr, comm: *mut Ptr, tc: Option<u8>) -> Result<()> {
    let site = site()?;
    site.nic(dev)?;
    let bytes = handle_bytes(handle)?;
    let (l, h) = Listen::new(site, dev as usize, tc)?;
    h.write(bytes);
    // SAFETY: NCCL's out pointer.
    unsafe { out(comm, Box::into_raw(l).cast()) }
}

unsafe extern "C" fn listen_v8(dev: c_int, handle: Ptr, comm: *mut Ptr) -> NcclResult {
    guard("listen", || listen(dev, handle, comm, None))
}

unsafe extern "C" fn listen_v11(ctx: Ptr, dev: c_int, handle: Ptr, comm: *mut Ptr) -> NcclResult {
    // SAFETY: made by init_v11, or null.
    let tc = unsafe { ctx.cast::<Ctx>().as_ref() }.and_then(|c| c.traffic_class);
    guard("listen", || listen(dev, handle, comm, tc))
}

fn connect(dev: c_int, handle: Ptr, comm: *mut Ptr, dev_comm: DevHandleOut, tc: Option<u8>) -> Result<()> {
    let site = site()?;
    site.nic(dev)?;
    let bytes = handle_bytes(handle)?;
    // SAFETY: NCCL's out pointers (the device handle is optional).
    unsafe {
        out(comm, std::ptr::null_mut())?;
        if !dev_comm.is_null() {
            *dev_comm = std::ptr::null_mut();
        }
    }
    if let Some(c) = setup_connect(site, dev as usize, bytes, tc)? {
        // SAFETY: checked above.
        unsafe { *comm = Box::into_raw(c).cast() };
    }
    Ok(())
}

unsafe extern "C" fn connect_v8(dev: c_int, handle: Ptr, comm: *mut Ptr, dev_comm: DevHandleOut) -> NcclResult {
    guard("connect", || connect(dev, handle, comm, dev_comm, None))
}

unsafe extern "C" fn connect_v10(dev: c_int, config: *mut CommConfig, handle: Ptr, comm: *mut Ptr, dev_comm: DevHandleOut) -> NcclResult {
    // SAFETY: NCCL's config, or null.
    let tc = unsafe { config.as_ref() }.and_then(|c| u8::try_from(c.traffic_class).ok());
    guard("connect", || connect(dev, handle, comm, dev_comm, tc))
}

unsafe extern "C" fn connect_v11(ctx: Ptr, dev: c_int, handle: Ptr, comm: *mut Ptr, dev_comm: DevHandleOut) -> NcclResult {
    // SAFETY: made by init_v11, or null.
    let tc = unsafe { ctx.cast::<Ctx>().as_ref() }.and_then(|c| c.traffic_class);
    guard("connect", || connect(dev, handle, comm, dev_comm, tc))
}

unsafe extern "C" fn accept(listen: Ptr, comm: *mut Ptr, dev_comm: DevHandleOut) -> NcclResult {
    guard("accept", || {
        if listen.is_null() {
            return Err(NetError::Invalid("accept on a null listen comm".into()));
        }
        // SAFETY: a listen comm `listen` made and not yet closed.
        let l = unsafe { &mut *listen.cast::<Listen>() };
        // SAFETY: NCCL's out pointers.
        unsafe {
            out(comm, std::ptr::null_mut())?;
            if !dev_comm.is_null() {
                *dev_comm = std::ptr::null_mut();
            }
        }
        if let Some(c) = l.accept()? {
            // SAFETY: checked above.
            unsafe { *comm = Box::into_raw(c).cast() };
        }
        Ok(())
    })
}

fn comm<'a>(p: Ptr) -> Result<&'a Comm> {
    if p.is_null() {
        return Err(NetError::Invalid("a null comm".into()));
    }
    // SAFETY: NCCL passes comms connect/accept returned, not yet closed.
    Ok(unsafe { &*p.cast::<Comm>() })
}

fn reg_mr(c: Ptr, data: Ptr, size: usize, ty: c_int, mhandle: *mut Ptr) -> Result<()> {
    let c = comm(c)?;
    // SAFETY: NCCL keeps the memory until deregMr.
    let reg = unsafe { Reg::register(c.cache(), &c.nic().keys, data as u64, size, ty)? };
    c.saw(&reg);
    // SAFETY: NCCL's out pointer.
    unsafe { out(mhandle, Box::into_raw(reg).cast()) }
}

unsafe extern "C" fn reg_mr_entry(c: Ptr, data: Ptr, size: usize, ty: c_int, mhandle: *mut Ptr) -> NcclResult {
    guard("regMr", || reg_mr(c, data, size, ty, mhandle))
}

unsafe extern "C" fn reg_mr_dma_buf(c: Ptr, data: Ptr, size: usize, ty: c_int, _offset: u64, _fd: c_int, mhandle: *mut Ptr) -> NcclResult {
    // The library exports its own dma-buf of the range (and falls back to
    // peer memory where dma-buf fails); NCCL's descriptor is not kept.
    guard("regMrDmaBuf", || reg_mr(c, data, size, ty, mhandle))
}

unsafe extern "C" fn dereg_mr(c: Ptr, mhandle: Ptr) -> NcclResult {
    guard("deregMr", || {
        let c = comm(c)?;
        if mhandle.is_null() {
            return Err(NetError::Invalid("deregMr of a null handle".into()));
        }
        // SAFETY: a handle regMr returned, deregistered once.
        let reg = unsafe { Box::from_raw(mhandle.cast::<Reg>()) };
        c.forget_windows(&reg);
        reg.release();
        Ok(())
    })
}

// Inlined into each version's entry point (an `#[inline]` hint was not
// followed): one call per message less.
#[inline(always)]
fn isend(c: Ptr, data: Ptr, size: usize, tag: c_int, mhandle: Ptr, req: *mut Ptr) -> Result<()> {
    let c = comm(c)?;
    // SAFETY: NCCL's out pointer, written before anything can fail later.
    unsafe { out(req, std::ptr::null_mut())? };
    let r = c.isend(data as u64, size, tag, mhandle.cast::<Reg>().cast_const())?;
    // SAFETY: checked above.
    unsafe { *req = r };
    Ok(())
}

unsafe extern "C" fn isend_v8(c: Ptr, data: Ptr, size: c_int, tag: c_int, mhandle: Ptr, req: *mut Ptr) -> NcclResult {
    guard("isend", || isend(c, data, usize::try_from(size).map_err(|_| NetError::Invalid(format!("isend of {size} bytes")))?, tag, mhandle, req))
}

unsafe extern "C" fn isend_v9(c: Ptr, data: Ptr, size: usize, tag: c_int, mhandle: Ptr, req: *mut Ptr) -> NcclResult {
    guard("isend", || isend(c, data, size, tag, mhandle, req))
}

unsafe extern "C" fn isend_v10(c: Ptr, data: Ptr, size: usize, tag: c_int, mhandle: Ptr, _ph: Ptr, req: *mut Ptr) -> NcclResult {
    guard("isend", || isend(c, data, size, tag, mhandle, req))
}

/// # Safety
/// The arrays hold `n` elements each (NCCL's promise).
unsafe fn irecv<S: Copy + TryInto<usize>>(c: Ptr, n: c_int, data: *mut Ptr, sizes: *mut S, tags: *mut c_int, mhandles: *mut Ptr, req: *mut Ptr) -> Result<()> {
    let c = comm(c)?;
    // SAFETY: NCCL's out pointer.
    unsafe { out(req, std::ptr::null_mut())? };
    let n = usize::try_from(n).ok().filter(|n| (1..=MAX_RECVS).contains(n)).ok_or_else(|| NetError::Invalid(format!("irecv of {n} receives: 1 to {MAX_RECVS}")))?;
    if data.is_null() || sizes.is_null() || tags.is_null() || mhandles.is_null() {
        return Err(NetError::Invalid("irecv with a null array".into()));
    }
    let mut bufs = [(0u64, 0usize, 0i32, std::ptr::null::<Reg>()); MAX_RECVS];
    for (i, b) in bufs.iter_mut().enumerate().take(n) {
        // SAFETY: the caller's promise: n elements each.
        let (d, s, t, m) = unsafe { (*data.add(i), *sizes.add(i), *tags.add(i), *mhandles.add(i)) };
        let s: usize = s.try_into().map_err(|_| NetError::Invalid("irecv of a negative size".into()))?;
        *b = (d as u64, s, t, m.cast::<Reg>().cast_const());
    }
    let r = c.irecv(&bufs[..n])?;
    // SAFETY: checked above.
    unsafe { *req = r };
    Ok(())
}

unsafe extern "C" fn irecv_v8(c: Ptr, n: c_int, data: *mut Ptr, sizes: *mut c_int, tags: *mut c_int, mh: *mut Ptr, req: *mut Ptr) -> NcclResult {
    // SAFETY: NCCL's arrays of n elements.
    guard("irecv", || unsafe { irecv(c, n, data, sizes, tags, mh, req) })
}

unsafe extern "C" fn irecv_v9(c: Ptr, n: c_int, data: *mut Ptr, sizes: *mut usize, tags: *mut c_int, mh: *mut Ptr, req: *mut Ptr) -> NcclResult {
    // SAFETY: NCCL's arrays of n elements.
    guard("irecv", || unsafe { irecv(c, n, data, sizes, tags, mh, req) })
}

unsafe extern "C" fn irecv_v10(c: Ptr, n: c_int, data: *mut Ptr, sizes: *mut usize, tags: *mut c_int, mh: *mut Ptr, _ph: *mut Ptr, req: *mut Ptr) -> NcclResult {
    // SAFETY: NCCL's arrays of n elements.
    guard("irecv", || unsafe { irecv(c, n, data, sizes, tags, mh, req) })
}

unsafe extern "C" fn iflush(c: Ptr, n: c_int, _data: *mut Ptr, sizes: *mut c_int, mhandles: *mut Ptr, req: *mut Ptr) -> NcclResult {
    guard("iflush", || {
        let c = comm(c)?;
        // SAFETY: NCCL's out pointer.
        unsafe { out(req, std::ptr::null_mut())? };
        let n = usize::try_from(n).unwrap_or(0).min(MAX_RECVS);
        if n > 0 && (sizes.is_null() || mhandles.is_null()) {
            return Err(NetError::Invalid("iflush with a null array".into()));
        }
        // SAFETY: NCCL's arrays of n elements.
        let regs: Vec<(usize, *const Reg)> = (0..n).map(|i| unsafe { ((*sizes.add(i)).max(0) as usize, (*mhandles.add(i)).cast::<Reg>().cast_const()) }).collect();
        c.iflush(&regs)
    })
}

unsafe extern "C" fn test(req: Ptr, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    guard("test", || {
        // SAFETY: NCCL passes requests isend/irecv returned, until done.
        let (c, slot) = unsafe { request(req)? };
        // SAFETY: NCCL's out pointer.
        unsafe { out(done, 0)? };
        let mut got = [0i32; MAX_RECVS];
        if let Some(n) = c.test(slot, &mut got)? {
            if !sizes.is_null() {
                // SAFETY: NCCL's array holds one size per receive of the
                // request (one for a send); one is written without a call.
                unsafe {
                    if n == 1 {
                        *sizes = got[0];
                    } else {
                        std::ptr::copy_nonoverlapping(got.as_ptr(), sizes, n);
                    }
                }
            }
            // SAFETY: checked above.
            unsafe { *done = 1 };
        }
        Ok(())
    })
}

unsafe extern "C" fn close_comm(c: Ptr) -> NcclResult {
    guard("close", || {
        if !c.is_null() {
            // SAFETY: a comm connect/accept returned, closed once.
            drop(unsafe { Box::from_raw(c.cast::<Comm>()) });
        }
        Ok(())
    })
}

unsafe extern "C" fn close_listen(l: Ptr) -> NcclResult {
    guard("closeListen", || {
        if !l.is_null() {
            // SAFETY: a listen comm listen returned, closed once.
            drop(unsafe { Box::from_raw(l.cast::<Listen>()) });
        }
        Ok(())
    })
}

unsafe extern "C" fn irecv_consumed(_c: Ptr, _n: c_int, _req: Ptr) -> NcclResult {
    SUCCESS
}

/// NCCL 2.19 and 2.20 (and later, when nothing newer is found).
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: NAME.as_ptr(),
    init: init_v8,
    devices,
    get_properties: get_properties_v8,
    listen: listen_v8,
    connect: connect_v8,
    accept,
    reg_mr: reg_mr_entry,
    reg_mr_dma_buf,
    dereg_mr,
    isend: isend_v8,
    irecv: irecv_v8,
    iflush,
    test,
    close_send: close_comm,
    close_recv: close_comm,
    close_listen,
    get_device_mr: None,
    irecv_consumed,
};

/// NCCL 2.21 and 2.22.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: NAME.as_ptr(),
    init: init_v8,
    devices,
    get_properties: get_properties_v9,
    listen: listen_v8,
    connect: connect_v8,
    accept,
    reg_mr: reg_mr_entry,
    reg_mr_dma_buf,
    dereg_mr,
    isend: isend_v9,
    irecv: irecv_v9,
    iflush,
    test,
    close_send: close_comm,
    close_recv: close_comm,
    close_listen,
    get_device_mr: None,
    irecv_consumed,
    make_v_device: None,
};

/// NCCL 2.23 to 2.27.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: NAME.as_ptr(),
    init: init_v10,
    devices,
    get_properties: get_properties_v9,
    listen: listen_v8,
    connect: connect_v10,
    accept,
    reg_mr: reg_mr_entry,
    reg_mr_dma_buf,
    dereg_mr,
    isend: isend_v10,
    irecv: irecv_v10,
    iflush,
    test,
    close_send: close_comm,
    close_recv: close_comm,
    close_listen,
    get_device_mr: None,
    irecv_consumed,
    make_v_device: None,
};

/// NCCL 2.28 and later.
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
    name: NAME.as_ptr(),
    init: init_v11,
    devices,
    get_properties: get_properties_v11,
    listen: listen_v11,
    connect: connect_v11,
    accept,
    reg_mr: reg_mr_entry,
    reg_mr_dma_buf,
    dereg_mr,
    isend: isend_v10,
    irecv: irecv_v10,
    iflush,
    test,
    close_send: close_comm,
    close_recv: close_comm,
    close_listen,
    get_device_mr: None,
    irecv_consumed,
    make_v_device: None,
    finalize,
    set_net_attr,
};
