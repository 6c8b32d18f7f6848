//! An opened RDMA device (`ibv_open_device`) and what it can tell about
//! itself: device attributes, ports and GID tables.

use std::ffi::CStr;
use std::fmt;
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

use gpudirect_sys as sys;

use crate::device::{DeviceList, Guid};
use crate::error::{check, Error, Result};
use crate::gid::{choose_gid, Gid, GidChoice, GidEntry, GidType};
use crate::port::{LinkLayer, Mtu, PortAttr, PortState};

/// The device attributes the library uses (`ibv_query_device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: Guid,
    /// Vendor id (PCI vendor for hardware NICs).
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Most work requests on one queue.
    pub max_qp_wr: u32,
    /// Most entries in one completion queue.
    pub max_cqe: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most scatter/gather entries per RDMA read.
    pub max_sge_rd: u32,
    /// Most shared receive queues (0: the device has none).
    pub max_srq: u32,
    /// Most receives in one shared receive queue.
    pub max_srq_wr: u32,
    /// Most scatter/gather entries per shared receive.
    pub max_srq_sge: u32,
    /// Largest memory region, in bytes.
    pub max_mr_size: u64,
    /// Most outstanding RDMA reads/atomics a queue pair can initiate.
    pub max_qp_init_rd_atom: u32,
    /// Most outstanding RDMA reads/atomics a queue pair can answer.
    pub max_qp_rd_atom: u32,
    /// Whether the device does atomic operations (`atomic_cap` is
    /// `IBV_ATOMIC_HCA` or `IBV_ATOMIC_GLOB`). Upstream mlx5 says
    /// `IBV_ATOMIC_NONE` when its firmware is not set to host byte order,
    /// so where this is true the words are read and written in host order.
    pub atomics: bool,
    /// Whether the device has type-2 memory windows
    /// (`IBV_DEVICE_MEM_WINDOW_TYPE_2B`): see [`MemoryWindow`](crate::MemoryWindow).
    pub mem_windows: bool,
}

pub(crate) struct ContextInner {
    ctx: NonNull<sys::ibv_context>,
    name: String,
    attr: DeviceAttr,
}

// SAFETY: libibverbs contexts may be used from any thread; all verbs on
// them are thread-safe (rdma-core's libibverbs/man/ibv_open_device.3 and
// its threading notes). The struct has no interior Rust state besides
// immutable fields.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: every child (PD, CQ, QP, MR) holds an Arc to this context,
        // so none remain; the pointer came from ibv_open_device.
        let ret = unsafe { sys::ibv_close_device(self.ctx.as_ptr()) };
        if ret != 0 {
            tracing::warn!(device = %self.name, "ibv_close_device failed: {}", Error::returned("ibv_close_device", ret));
        }
    }
}

/// An opened RDMA device. Cheap to clone; every object created from it
/// keeps it open.
#[derive(Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context").field("device", &self.inner.name).field("guid", &self.inner.attr.node_guid).finish()
    }
}

impl Context {
    /// Opens the device named `name` (e.g. `"mlx5_0"`, `"rxe0"`), or the
    /// first device when `name` is `None`.
    ///
    /// # Errors
    /// [`Error::NoRdmaSubsystem`], [`Error::NoDevices`],
    /// [`Error::DeviceNotFound`] (listing the devices present), or
    /// [`Error::Verb`] from `ibv_open_device` / `ibv_query_device`.
    pub fn open(name: Option<&str>) -> Result<Context> {
        let list = DeviceList::get()?;
        let mut found = None;
        let mut names = Vec::new();
        for (dev, info) in list.iter() {
            if found.is_none() && name.is_none_or(|n| n == info.name) {
                found = Some((dev, info.name.clone()));
            }
            names.push(info.name);
        }
        let Some((dev, name)) = found else {
            return Err(match name {
                _ if names.is_empty() => Error::NoDevices,
                Some(n) => Error::DeviceNotFound { name: n.into(), available: names },
                None => Error::NoDevices,
            });
        };
        // SAFETY: `dev` is valid while `list` lives; the context outlives
        // the list by contract of ibv_open_device(3).
        let ctx = unsafe { sys::ibv_open_device(dev) };
        let ctx = NonNull::new(ctx).ok_or_else(|| Error::last("ibv_open_device"))?;
        drop(list);
        // Async events are read with a timeout (Context::async_event):
        // ibv_get_async_event(3) says to make the fd non-blocking for that.
        // SAFETY: the context is open; its async fd is a valid descriptor.
        if let Err(errno) = crate::deadline::set_nonblocking(unsafe { (*ctx.as_ptr()).async_fd }) {
            tracing::warn!("making the async event fd non-blocking failed: {errno}");
        }
        let attr = match query_device(ctx) {
            Ok(a) => a,
            Err(e) => {
                // SAFETY: just opened, nothing else refers to it.
                unsafe { sys::ibv_close_device(ctx.as_ptr()) };
                return Err(e);
            }
        };
        tracing::debug!(device = %name, fw = %attr.fw_ver, "opened RDMA device");
        Ok(Context { inner: Arc::new(ContextInner { ctx, name, attr }) })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Device attributes, queried when the device was opened.
    pub fn attr(&self) -> &DeviceAttr {
        &self.inner.attr
    }

    /// Queries a port (numbered from 1).
    ///
    /// # Errors
    /// [`Error::InvalidPort`] for a port the device lacks, or
    /// [`Error::Verb`] from `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        self.check_port(port)?;
        let mut attr = MaybeUninit::<sys::ibv_port_attr>::zeroed();
        // SAFETY: valid context, valid out-pointer of the right type. The
        // inline `___ibv_query_port` is what the `ibv_query_port` macro
        // expands to: it zeroes and fills the extended fields.
        check("ibv_query_port", unsafe {
            sys::___ibv_query_port(self.as_ptr(), port, attr.as_mut_ptr())
        })?;
        // SAFETY: initialised by the successful call (and zeroed before).
        let a = unsafe { attr.assume_init() };
        Ok(PortAttr {
            port,
            state: match a.state {
                sys::IBV_PORT_DOWN => PortState::Down,
                sys::IBV_PORT_INIT => PortState::Init,
                sys::IBV_PORT_ARMED => PortState::Armed,
                sys::IBV_PORT_ACTIVE => PortState::Active,
                s => PortState::Other(s),
            },
            max_mtu: Mtu::from_raw(a.max_mtu),
            active_mtu: Mtu::from_raw(a.active_mtu),
            lid: a.lid,
            link_layer: match u32::from(a.link_layer) {
                sys::IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                sys::IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                _ => LinkLayer::Unspecified,
            },
            gid_table_len: a.gid_tbl_len.max(0) as u32,
        })
    }

    /// The valid entries of a port's GID table, with their types and
    /// network interfaces (`ibv_query_gid_table`).
    ///
    /// # Errors
    /// [`Error::InvalidPort`], or [`Error::Verb`] from `ibv_query_gid_table`.
    pub fn gid_table(&self, port: u8) -> Result<Vec<GidEntry>> {
        self.gid_table_of(&self.query_port(port)?)
    }

    /// The GID table of a port already queried.
    fn gid_table_of(&self, attr: &PortAttr) -> Result<Vec<GidEntry>> {
        let port = attr.port;
        let len = attr.gid_table_len as usize * usize::from(self.inner.attr.phys_port_cnt);
        let mut raw = vec![sys::ibv_gid_entry::default(); len.max(1)];
        // SAFETY: `raw` has room for `raw.len()` entries; the inline passes
        // the entry size so the library writes no more than that.
        let n = unsafe { sys::ibv_query_gid_table(self.as_ptr(), raw.as_mut_ptr(), raw.len(), 0) };
        if n < 0 {
            return Err(Error::returned("ibv_query_gid_table", n as i32));
        }
        raw.truncate(n as usize);
        Ok(raw
            .into_iter()
            .filter(|e| e.port_num == u32::from(port))
            .map(|e| GidEntry {
                index: e.gid_index,
                // SAFETY: `raw` is the byte view of the GID union; every
                // bit pattern is valid.
                gid: Gid(unsafe { e.gid.raw }),
                gid_type: GidType::from_raw(e.gid_type),
                netdev: ifname(e.ndev_ifindex),
            })
            .collect())
    }

    /// Chooses the GID a queue pair on `port` uses: `index` when given,
    /// otherwise by the rules of [`choose_gid`]. The choice is logged at
    /// `info` level.
    ///
    /// # Errors
    /// [`Error::Gid`] when no entry fits, plus the errors of
    /// [`query_port`](Self::query_port) and [`gid_table`](Self::gid_table).
    pub fn choose_gid(&self, port: u8, index: Option<u32>) -> Result<GidChoice> {
        self.choose_gid_on(&self.query_port(port)?, index)
    }

    /// [`choose_gid`](Self::choose_gid) for a port already queried.
    pub(crate) fn choose_gid_on(&self, attr: &PortAttr, index: Option<u32>) -> Result<GidChoice> {
        let table = self.gid_table_of(attr)?;
        let choice = choose_gid(self.name(), attr.port, attr.link_layer, &table, index)?;
        tracing::info!(device = %self.name(), port = attr.port, gid = %choice, "using GID");
        Ok(choice)
    }

    fn check_port(&self, port: u8) -> Result<()> {
        let ports = self.inner.attr.phys_port_cnt;
        if port == 0 || port > ports {
            return Err(Error::InvalidPort { device: self.name().into(), port, ports });
        }
        Ok(())
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ibv_context {
        self.inner.ctx.as_ptr()
    }
}

fn query_device(ctx: NonNull<sys::ibv_context>) -> Result<DeviceAttr> {
    let mut a = MaybeUninit::<sys::ibv_device_attr>::zeroed();
    // SAFETY: valid context and out-pointer.
    check("ibv_query_device", unsafe { sys::ibv_query_device(ctx.as_ptr(), a.as_mut_ptr()) })?;
    // SAFETY: filled by the successful call.
    let a = unsafe { a.assume_init() };
    // SAFETY: fw_ver is a NUL-terminated C string within its 64 bytes (zeroed first).
    let fw = unsafe { CStr::from_ptr(a.fw_ver.as_ptr()) };
    let u = |v: i32| v.max(0) as u32;
    Ok(DeviceAttr {
        fw_ver: fw.to_string_lossy().into_owned(),
        node_guid: Guid(u64::from_be(a.node_guid)),
        vendor_id: a.vendor_id,
        vendor_part_id: a.vendor_part_id,
        phys_port_cnt: a.phys_port_cnt,
        max_qp_wr: u(a.max_qp_wr),
        max_cqe: u(a.max_cqe),
        max_sge: u(a.max_sge),
        max_sge_rd: u(a.max_sge_rd),
        max_srq: u(a.max_srq),
        max_srq_wr: u(a.max_srq_wr),
        max_srq_sge: u(a.max_srq_sge),
        max_mr_size: a.max_mr_size,
        max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
        max_qp_rd_atom: u(a.max_qp_rd_atom),
        atomics: a.atomic_cap != sys::IBV_ATOMIC_NONE,
        mem_windows: a.device_cap_flags & sys::IBV_DEVICE_MEM_WINDOW_TYPE_2B != 0,
    })
}

fn ifname(index: u32) -> Option<String> {
    if index == 0 {
        return None;
    }
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has IF_NAMESIZE bytes as if_indextoname(3) requires.
    let p = unsafe { libc::if_indextoname(index, buf.as_mut_ptr()) };
    if p.is_null() {
        return None;
    }
    // SAFETY: on success `buf` holds a NUL-terminated name.
    Some(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
}
