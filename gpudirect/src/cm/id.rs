//! An `rdma_cm_id` with an event channel of its own, its events, and the
//! conversions between `SocketAddr` and `sockaddr`.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ptr::NonNull;

use gpudirect_sys as sys;
use sys::rdmacm as cm;

use super::error::CmError;
use crate::deadline::{set_nonblocking, Deadline};
use crate::errno::Errno;

/// The `errno` a failed librdmacm call left.
pub(super) fn failed(call: &'static str) -> CmError {
    CmError::Call { call, errno: Errno::last() }
}

/// Turns a librdmacm return code into a result.
pub(super) fn check(call: &'static str, ret: i32) -> Result<(), CmError> {
    if ret == 0 {
        Ok(())
    } else {
        Err(failed(call))
    }
}

/// An event channel (non-blocking, so waits can be bounded) and one id on it.
pub(super) struct Id {
    id: NonNull<cm::rdma_cm_id>,
    channel: NonNull<cm::rdma_event_channel>,
}

// SAFETY: librdmacm's calls on one id are safe from any thread; every event
// is read whole by one read(2), so concurrent waiters each get their own.
unsafe impl Send for Id {}
// SAFETY: as above.
unsafe impl Sync for Id {}

/// What an event carried, copied out before it was acknowledged.
pub(super) struct Event {
    pub kind: cm::rdma_cm_event_type,
    pub status: i32,
    /// The event's id: for a connect request, the new connection's.
    pub id: NonNull<cm::rdma_cm_id>,
    /// The peer's private data as it arrived (padded by the transport).
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
}

fn new_channel() -> Result<NonNull<cm::rdma_event_channel>, CmError> {
    // SAFETY: no arguments; NULL on failure.
    let ch = NonNull::new(unsafe { cm::rdma_create_event_channel() }).ok_or_else(|| failed("rdma_create_event_channel"))?;
    // SAFETY: the channel is open; `fd` is its descriptor.
    if let Err(errno) = set_nonblocking(unsafe { (*ch.as_ptr()).fd }) {
        tracing::warn!("making the rdma_cm event channel's fd non-blocking failed: {errno}");
    }
    Ok(ch)
}

impl Id {
    /// A new RC (`RDMA_PS_TCP`) id on a new channel.
    pub(super) fn new() -> Result<Id, CmError> {
        let channel = new_channel()?;
        let mut id = std::ptr::null_mut();
        // SAFETY: a valid channel and out-pointer; no user context.
        let ret = unsafe { cm::rdma_create_id(channel.as_ptr(), &mut id, std::ptr::null_mut(), cm::RDMA_PS_TCP) };
        match NonNull::new(id) {
            Some(id) if ret == 0 => Ok(Id { id, channel }),
            _ => {
                let e = failed("rdma_create_id");
                // SAFETY: the channel has no id.
                unsafe { cm::rdma_destroy_event_channel(channel.as_ptr()) };
                Err(e)
            }
        }
    }

    /// Takes over the id of a connect request, moving it off the
    /// listener's channel to one of its own (so its events reach its
    /// owner only). On failure the id is destroyed, which rejects it.
    pub(super) fn adopt(id: NonNull<cm::rdma_cm_id>) -> Result<Id, CmError> {
        let destroy = |e: CmError| {
            // SAFETY: the request's id, owned by us, destroyed once.
            unsafe { cm::rdma_destroy_id(id.as_ptr()) };
            e
        };
        let channel = new_channel().map_err(destroy)?;
        // SAFETY: a valid id, whose events so far are all acknowledged, and channel.
        if unsafe { cm::rdma_migrate_id(id.as_ptr(), channel.as_ptr()) } != 0 {
            let e = failed("rdma_migrate_id");
            // SAFETY: the new channel has no id.
            unsafe { cm::rdma_destroy_event_channel(channel.as_ptr()) };
            return Err(destroy(e));
        }
        Ok(Id { id, channel })
    }

    pub(super) fn as_ptr(&self) -> *mut cm::rdma_cm_id {
        self.id.as_ptr()
    }

    /// The device and port the id is bound to, once an address is resolved
    /// or a request arrived.
    pub(super) fn device(&self) -> Option<(String, u8)> {
        // SAFETY: the id is valid; `verbs` is NULL or an open context.
        unsafe {
            let verbs = (*self.as_ptr()).verbs;
            if verbs.is_null() {
                return None;
            }
            let name = CStr::from_ptr(sys::ibv_get_device_name((*verbs).device)).to_string_lossy().into_owned();
            Some((name, (*self.as_ptr()).port_num))
        }
    }

    /// The local address (the route's source).
    pub(super) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: a valid id; its route's address is plain data.
        unsafe { from_sockaddr(&(*self.as_ptr()).route.addr.__bindgen_anon_1.src_storage) }
    }

    /// The peer's address (the route's destination).
    pub(super) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above.
        unsafe { from_sockaddr(&(*self.as_ptr()).route.addr.__bindgen_anon_2.dst_storage) }
    }

    /// The next event on the channel, waiting until `deadline`; `None` once
    /// it passed.
    pub(super) fn next_event(&self, deadline: Deadline) -> Result<Option<Event>, CmError> {
        // SAFETY: the channel is open while `self` lives.
        let fd = unsafe { (*self.channel.as_ptr()).fd };
        loop {
            let mut ev = std::ptr::null_mut();
            // SAFETY: a valid (non-blocking) channel and out-pointer.
            if unsafe { cm::rdma_get_cm_event(self.channel.as_ptr(), &mut ev) } == 0 {
                // SAFETY: a delivered event, valid until acknowledged below.
                let event = unsafe { copy_event(&*ev) };
                // SAFETY: acknowledged once; nothing points into it after.
                unsafe { cm::rdma_ack_cm_event(ev) };
                return Ok(Some(event));
            }
            let errno = Errno::last();
            if errno.0 != libc::EAGAIN && errno.0 != libc::EINTR {
                return Err(CmError::Call { call: "rdma_get_cm_event", errno });
            }
            match deadline.wait_readable(fd) {
                Ok(true) => {}
                Ok(false) => return Ok(None),
                Err(errno) => return Err(CmError::Call { call: "poll", errno }),
            }
        }
    }
}

impl Drop for Id {
    fn drop(&mut self) {
        // SAFETY: created or adopted by us and destroyed once, here; every
        // event was acknowledged when read (rdma_destroy_id waits for that).
        if unsafe { cm::rdma_destroy_id(self.id.as_ptr()) } != 0 {
            tracing::warn!("{}", failed("rdma_destroy_id"));
        }
        // SAFETY: its only id is gone.
        unsafe { cm::rdma_destroy_event_channel(self.channel.as_ptr()) };
    }
}

/// # Safety
/// `ev` is an event not yet acknowledged.
unsafe fn copy_event(ev: &cm::rdma_cm_event) -> Event {
    // SAFETY: the connection parameters are the union's member for every
    // event of an RC id; private data is NULL or `private_data_len` bytes.
    let conn = unsafe { ev.param.conn.as_ref() };
    let private_data = if conn.private_data.is_null() {
        Vec::new()
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(conn.private_data.cast::<u8>(), conn.private_data_len.into()) }.to_vec()
    };
    Event {
        kind: ev.event,
        status: ev.status,
        id: NonNull::new(ev.id).expect("rdma_cm events name their id"),
        private_data,
        responder_resources: conn.responder_resources,
        initiator_depth: conn.initiator_depth,
    }
}

/// `rdma_event_str`'s name for an event type.
pub(super) fn event_name(kind: cm::rdma_cm_event_type) -> String {
    // SAFETY: returns a static string for any value.
    unsafe { CStr::from_ptr(cm::rdma_event_str(kind)) }.to_string_lossy().into_owned()
}

/// `addr` as librdmacm's `sockaddr_storage` (bindgen's copy of libc's).
pub(super) fn to_sockaddr(addr: SocketAddr) -> cm::sockaddr_storage {
    const _: () = assert!(std::mem::size_of::<cm::sockaddr_storage>() == std::mem::size_of::<libc::sockaddr_storage>());
    let (s, _) = crate::sockaddr::to_storage(addr);
    // SAFETY: the same C type, bindgen's and libc's, of the same size.
    unsafe { std::ptr::read_unaligned((&s as *const libc::sockaddr_storage).cast::<cm::sockaddr_storage>()) }
}

/// librdmacm's `sockaddr_storage` as a `SocketAddr`; `None` for other families.
pub(super) fn from_sockaddr(s: &cm::sockaddr_storage) -> Option<SocketAddr> {
    // SAFETY: the same C type, bindgen's and libc's, of the same size.
    let s = unsafe { std::ptr::read_unaligned((s as *const cm::sockaddr_storage).cast::<libc::sockaddr_storage>()) };
    crate::sockaddr::from_storage(&s)
}

/// The unspecified address of `addr`'s family, port 0: a peer's address
/// when librdmacm gave none.
pub(super) fn unspecified(like: SocketAddr) -> SocketAddr {
    let ip = if like.is_ipv4() { IpAddr::V4(Ipv4Addr::UNSPECIFIED) } else { IpAddr::V6(Ipv6Addr::UNSPECIFIED) };
    SocketAddr::new(ip, 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_addresses_round_trip_through_sockaddr() {
        for a in ["192.0.2.1:18515", "[fe80::1%3]:7471", "0.0.0.0:0", "[::]:1"] {
            let a: SocketAddr = a.parse().unwrap();
            assert_eq!(from_sockaddr(&to_sockaddr(a)), Some(a));
        }
        assert_eq!(from_sockaddr(&cm::sockaddr_storage::default()), None);
    }
}
