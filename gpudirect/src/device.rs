//! RDMA devices present on this machine (`ibv_get_device_list`).

use std::ffi::CStr;
use std::fmt;
use std::ptr::NonNull;

use gpudirect_sys as sys;

use crate::error::{Errno, Error, Result};

/// A node or port GUID, displayed as `ibv_devinfo` does (`0002:c903:0031:7c40`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Guid(pub u64);

impl fmt::Display for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let g = self.0;
        write!(f, "{:04x}:{:04x}:{:04x}:{:04x}", g >> 48, (g >> 32) & 0xffff, (g >> 16) & 0xffff, g & 0xffff)
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Guid({self})")
    }
}

/// An RDMA device as listed by `ibv_get_device_list`, before it is opened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `mlx5_0` or `rxe0`.
    pub name: String,
    /// Node GUID.
    pub guid: Guid,
}

/// The device list; devices are only valid while it lives, so it never
/// leaves this crate.
pub(crate) struct DeviceList {
    list: NonNull<*mut sys::ibv_device>,
    len: usize,
}

impl DeviceList {
    pub(crate) fn get() -> Result<DeviceList> {
        let mut n = 0;
        // SAFETY: `n` is a valid out-pointer; the list is freed in Drop.
        let list = unsafe { sys::ibv_get_device_list(&mut n) };
        match NonNull::new(list) {
            Some(list) => Ok(DeviceList { list, len: n.max(0) as usize }),
            None => match Errno::last() {
                Errno(libc::ENOSYS) => Err(Error::NoRdmaSubsystem),
                errno => Err(Error::Verb { verb: "ibv_get_device_list", errno }),
            },
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (*mut sys::ibv_device, DeviceInfo)> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: the list holds `len` valid device pointers while it lives.
            let dev = unsafe { *self.list.as_ptr().add(i) };
            // SAFETY: `dev` is a valid device; the name is a NUL-terminated
            // string owned by it, and the GUID query only reads it.
            let (name, guid) = unsafe {
                (
                    CStr::from_ptr(sys::ibv_get_device_name(dev)).to_string_lossy().into_owned(),
                    u64::from_be(sys::ibv_get_device_guid(dev)),
                )
            };
            (dev, DeviceInfo { name, guid: Guid(guid) })
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        // SAFETY: the list came from ibv_get_device_list and is freed once.
        // Contexts opened from it stay valid (ibv_get_device_list(3)).
        unsafe { sys::ibv_free_device_list(self.list.as_ptr()) }
    }
}

/// Lists the RDMA devices on this machine.
///
/// # Errors
/// [`Error::NoRdmaSubsystem`] when the kernel has no RDMA support, or
/// [`Error::Verb`] for other failures. An empty list is not an error here;
/// [`Context::open`](crate::Context::open) reports [`Error::NoDevices`].
pub fn devices() -> Result<Vec<DeviceInfo>> {
    Ok(DeviceList::get()?.iter().map(|(_, info)| info).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_displays_like_ibv_devinfo() {
        assert_eq!(Guid(0x0002_c903_0031_7c40).to_string(), "0002:c903:0031:7c40");
    }
}
