//! Connection setup by the RDMA connection manager (librdmacm, feature
//! `rdmacm`): IP addresses instead of an out-of-band exchange of
//! endpoints.
//!
//! The active side resolves the peer's IP address to a local device and a
//! path ([`Route::resolve`]: `rdma_resolve_addr`, `rdma_resolve_route`),
//! creates its queue pair on the device the route names, and connects it
//! ([`Route::connect`]: `rdma_connect`, then `rdma_establish` once the queue
//! pair is up). The passive side listens ([`CmListener::bind`]:
//! `rdma_bind_addr`, `rdma_listen`), takes a [`ConnectRequest`]
//! (`RDMA_CM_EVENT_CONNECT_REQUEST`) and accepts it with a queue pair of its
//! own ([`ConnectRequest::accept`]: `rdma_accept`) or refuses it
//! ([`ConnectRequest::reject`]). Either way the result is a
//! [`CmConnection`] holding an ordinary [`QueuePair`].
//!
//! The queue pairs are the library's own ([`QueuePair::create`]), not
//! `rdma_create_qp`'s: rdma_cm negotiates the path, QP numbers and PSNs
//! (`rdma_init_qp_attr`), this library moves the queue pair through `RTR`
//! and `RTS` with them and its own [`QpConfig`](crate::QpConfig) settings.
//! So receives can be posted before connecting, memory is held as
//! everywhere else, and rdma_cm connections, TCP-bootstrapped ones and
//! any other queue pair share protection domains and completion queues in
//! one process.
//!
//! # Private data
//! Each step can carry a few bytes to the peer, typically the
//! [`RemoteBuffer`](crate::RemoteBuffer)s it may access
//! ([`RemoteBuffer::to_bytes`](crate::RemoteBuffer::to_bytes)): at most
//! [`MAX_CONNECT_PRIVATE_DATA`] with the request,
//! [`MAX_ACCEPT_PRIVATE_DATA`] with the acceptance and
//! [`MAX_REJECT_PRIVATE_DATA`] with a refusal. The InfiniBand CM pads
//! private data to a fixed size, so the library sends a length byte first
//! and the peer gets exactly the bytes given; a peer that is not this
//! library must frame them the same way.
//!
//! # Timeouts
//! Every step that waits on the peer or the network takes a timeout and
//! returns [`CmError::Timeout`] when it runs out; address and route
//! resolution are also given it as librdmacm's own timeout.
//!
//! # Needs
//! librdmacm at build time (Debian/Ubuntu: `librdmacm-dev`) and the
//! `rdma_ucm` kernel module at run time; on RoCE the peer's IP address
//! must be on the network interface of an RDMA device. Soft-RoCE on the
//! loopback interface cannot resolve routes to `127.0.0.1`: use two hosts.

use std::net::SocketAddr;
use std::time::Duration;

use gpudirect_sys as sys;
use sys::rdmacm as cm;

use crate::deadline::Deadline;
use crate::qp::{PreparedQueuePair, QueuePair};

mod error;
mod id;

pub use error::CmError;
use id::{check, event_name, failed, Event, Id};

/// Most private data [`Route::connect`] carries, in bytes.
pub const MAX_CONNECT_PRIVATE_DATA: usize = 55;
/// Most private data [`ConnectRequest::accept`] carries, in bytes.
pub const MAX_ACCEPT_PRIVATE_DATA: usize = 195;
/// Most private data [`ConnectRequest::reject`] carries, in bytes.
pub const MAX_REJECT_PRIVATE_DATA: usize = 147;

/// A length byte, then `data`.
fn frame(step: &'static str, data: &[u8], max: usize) -> Result<Vec<u8>, CmError> {
    if data.len() > max {
        return Err(CmError::PrivateDataTooLong { step, len: data.len(), max });
    }
    let mut out = Vec::with_capacity(1 + data.len());
    out.push(data.len() as u8);
    out.extend_from_slice(data);
    Ok(out)
}

/// The bytes a peer framed with [`frame`] (untrusted).
fn unframe(peer: SocketAddr, raw: &[u8]) -> Result<Vec<u8>, CmError> {
    match raw.split_first() {
        None => Ok(Vec::new()),
        Some((&len, rest)) if usize::from(len) <= rest.len() => Ok(rest[..len.into()].to_vec()),
        Some((&len, _)) => Err(CmError::BadPrivateData { peer, len, got: raw.len() }),
    }
}

/// Connection parameters for `rdma_connect` / `rdma_accept`; `private`
/// must outlive the call.
fn conn_param(private: &[u8], qp_num: u32, initiator: u8, responder: u8, retry: u8, rnr_retry: u8) -> cm::rdma_conn_param {
    cm::rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len() as u8,
        responder_resources: responder,
        initiator_depth: initiator,
        flow_control: 1,
        retry_count: retry.min(7),
        rnr_retry_count: rnr_retry.min(7),
        srq: 0,
        qp_num,
    }
}

/// Waits for the event `want`; any other, or none by the deadline, is an
/// error naming what happened.
fn expect(id: &Id, want: cm::rdma_cm_event_type, step: &'static str, peer: SocketAddr, deadline: Deadline, timeout: Duration) -> Result<Event, CmError> {
    let Some(ev) = id.next_event(deadline)? else {
        return Err(CmError::Timeout { step, peer, timeout });
    };
    if ev.kind == want && ev.status == 0 {
        return Ok(ev);
    }
    let errno = crate::errno::Errno(-ev.status);
    Err(match ev.kind {
        cm::RDMA_CM_EVENT_ADDR_ERROR => CmError::Address { peer, errno },
        cm::RDMA_CM_EVENT_ROUTE_ERROR => CmError::Route { peer, errno },
        cm::RDMA_CM_EVENT_UNREACHABLE => CmError::Unreachable { peer, errno },
        cm::RDMA_CM_EVENT_REJECTED => CmError::Rejected {
            peer,
            reason: ev.status,
            // A reject from the peer's CM, not its application, has no framing.
            private_data: unframe(peer, &ev.private_data).unwrap_or(ev.private_data),
        },
        cm::RDMA_CM_EVENT_CONNECT_ERROR => CmError::Connect { peer, errno },
        kind => CmError::Unexpected { expected: step, got: event_name(kind), status: ev.status, peer },
    })
}

/// `rdma_init_qp_attr` for `state`: the attributes and their mask.
fn negotiated(id: &Id, state: sys::ibv_qp_state) -> Result<(sys::ibv_qp_attr, u32), CmError> {
    let mut attr = sys::ibv_qp_attr { qp_state: state, ..Default::default() };
    let mut mask = 0;
    // SAFETY: a valid id past address resolution; out-pointers to plain data.
    check("rdma_init_qp_attr", unsafe { cm::rdma_init_qp_attr(id.as_ptr(), &mut attr, &mut mask) })?;
    Ok((attr, mask as u32))
}

/// Refuses a queue pair on another device or port than rdma_cm's.
fn check_device(id: &Id, qp: &PreparedQueuePair, peer: SocketAddr) -> Result<(), CmError> {
    let (qp_device, qp_port, _) = qp.cm_target();
    let (cm_device, cm_port) = id.device().unwrap_or_default();
    if cm_device != qp_device || cm_port != qp_port {
        return Err(CmError::WrongDevice { peer, cm_device, cm_port, qp_device: qp_device.to_string(), qp_port });
    }
    Ok(())
}

/// A resolved address and route to a peer: the device and port to create
/// the queue pair on, before [`connect`](Self::connect).
pub struct Route {
    id: Id,
    peer: SocketAddr,
}

impl std::fmt::Debug for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Route").field("peer", &self.peer).field("device", &self.id.device()).finish()
    }
}

impl Route {
    /// Resolves `peer` to a local RDMA device and a path to it
    /// (`rdma_resolve_addr`, then `rdma_resolve_route`), within `timeout`.
    ///
    /// # Errors
    /// [`CmError::Address`] when no RDMA device reaches the address
    /// (`ENETUNREACH`: no route at all),
    /// [`CmError::Route`], [`CmError::Timeout`], or [`CmError::Call`].
    pub fn resolve(peer: SocketAddr, timeout: Duration) -> Result<Route, CmError> {
        let deadline = Deadline::after(timeout);
        let id = Id::new()?;
        let mut dst = id::to_sockaddr(peer);
        let ms = |d: &Deadline| d.left().map_or(i32::MAX, |l| l.as_millis().clamp(1, i32::MAX as u128) as i32);
        // SAFETY: a valid id; `dst` is a sockaddr of the family it says; no source address.
        let ret = unsafe {
            cm::rdma_resolve_addr(id.as_ptr(), std::ptr::null_mut(), (&mut dst as *mut cm::sockaddr_storage).cast(), ms(&deadline))
        };
        // It fails at once (ENETUNREACH, EADDRNOTAVAIL) when no interface
        // routes there, or later with an ADDR_ERROR event.
        if ret != 0 {
            return Err(CmError::Address { peer, errno: crate::errno::Errno::last() });
        }
        expect(&id, cm::RDMA_CM_EVENT_ADDR_RESOLVED, "address resolution", peer, deadline, timeout)?;
        // SAFETY: a valid id with a resolved address.
        check("rdma_resolve_route", unsafe { cm::rdma_resolve_route(id.as_ptr(), ms(&deadline)) })?;
        expect(&id, cm::RDMA_CM_EVENT_ROUTE_RESOLVED, "route resolution", peer, deadline, timeout)?;
        let route = Route { id, peer };
        tracing::debug!(?route, "rdma_cm route resolved");
        Ok(route)
    }

    /// The device that reaches the peer: open its [`Context`](crate::Context)
    /// and create the queue pair there.
    pub fn device(&self) -> String {
        self.id.device().map(|d| d.0).unwrap_or_default()
    }

    /// The device's port that reaches the peer.
    pub fn port(&self) -> u8 {
        self.id.device().map_or(0, |d| d.1)
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// Connects `qp` to the listener at the peer (`rdma_connect`), giving it
    /// `private_data`; once the peer accepts, moves `qp` to `RTS` with the
    /// negotiated attributes and confirms (`rdma_establish`). Receives
    /// posted on `qp` before this stay posted.
    ///
    /// # Errors
    /// [`CmError::PrivateDataTooLong`] over [`MAX_CONNECT_PRIVATE_DATA`];
    /// [`CmError::WrongDevice`] when `qp` is not on [`device`](Self::device)
    /// and [`port`](Self::port); [`CmError::Rejected`] (with the peer's
    /// private data), [`CmError::Unreachable`], [`CmError::Timeout`];
    /// [`CmError::BadPrivateData`]; [`CmError::Verbs`] bringing `qp` up.
    pub fn connect(self, qp: PreparedQueuePair, private_data: &[u8], timeout: Duration) -> Result<CmConnection, CmError> {
        let deadline = Deadline::after(timeout);
        let private = frame("connect", private_data, MAX_CONNECT_PRIVATE_DATA)?;
        check_device(&self.id, &qp, self.peer)?;
        let (initiator, responder) = qp.rd_atomic();
        let (_, _, qp_num) = qp.cm_target();
        let (retry, rnr) = qp.retries();
        let mut param = conn_param(&private, qp_num, initiator, responder, retry, rnr);
        // SAFETY: a valid id with a resolved route; `param` and the private
        // data it points to live across the call (librdmacm copies them).
        check("rdma_connect", unsafe { cm::rdma_connect(self.id.as_ptr(), &mut param) })?;
        let ev = expect(&self.id, cm::RDMA_CM_EVENT_CONNECT_RESPONSE, "the connect response", self.peer, deadline, timeout)?;
        let peer_private_data = unframe(self.peer, &ev.private_data)?;
        // What the peer accepted: it answers our reads with at most its
        // responder resources, and reads from us at most its initiator depth.
        let depths = (initiator.min(ev.responder_resources), responder);
        let qp = qp.connect_negotiated(negotiated(&self.id, sys::IBV_QPS_RTR)?, negotiated(&self.id, sys::IBV_QPS_RTS)?, depths)?;
        // SAFETY: a valid id that got its connect response.
        check("rdma_establish", unsafe { cm::rdma_establish(self.id.as_ptr()) })?;
        Ok(CmConnection { qp, peer: self.peer, peer_private_data, id: self.id })
    }
}

/// Listens for connection requests on an IP address and port
/// (`rdma_bind_addr`, `rdma_listen`).
///
/// # Thread safety
/// `Send + Sync`: several threads may wait for requests on one listener;
/// each request goes to one of them.
pub struct CmListener {
    id: Id,
    addr: SocketAddr,
}

impl std::fmt::Debug for CmListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmListener").field("addr", &self.addr).finish()
    }
}

/// How many requests the kernel queues before the listener takes them.
const BACKLOG: i32 = 128;

impl CmListener {
    /// Listens on `addr` (`0.0.0.0:PORT` for every RDMA device's address;
    /// port 0 for any free port, see [`local_addr`](Self::local_addr)).
    ///
    /// # Errors
    /// [`CmError::Call`] from `rdma_bind_addr` (`EADDRINUSE`: another
    /// listener has the port; `EADDRNOTAVAIL`: no RDMA device has that
    /// address) or `rdma_listen`.
    pub fn bind(addr: SocketAddr) -> Result<CmListener, CmError> {
        let id = Id::new()?;
        let mut sa = id::to_sockaddr(addr);
        // SAFETY: a valid id; `sa` holds a sockaddr of the family it says.
        check("rdma_bind_addr", unsafe { cm::rdma_bind_addr(id.as_ptr(), (&mut sa as *mut cm::sockaddr_storage).cast()) })?;
        // SAFETY: a bound id.
        check("rdma_listen", unsafe { cm::rdma_listen(id.as_ptr(), BACKLOG) })?;
        let addr = id.local_addr().unwrap_or(addr);
        tracing::debug!(%addr, "rdma_cm listening");
        Ok(CmListener { id, addr })
    }

    /// The address listened on, with the port chosen when 0 was asked for.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits for the next connection request, for at most `timeout`
    /// (`None`: no limit).
    ///
    /// # Errors
    /// [`CmError::Timeout`]; [`CmError::Unexpected`] for an event on the
    /// listener itself (`RDMA_CM_EVENT_DEVICE_REMOVAL`, ...);
    /// [`CmError::BadPrivateData`] (the request is rejected);
    /// [`CmError::Call`].
    pub fn get_request(&self, timeout: Option<Duration>) -> Result<ConnectRequest, CmError> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        loop {
            let Some(ev) = self.id.next_event(deadline)? else {
                return Err(CmError::Timeout { step: "a connect request", peer: self.addr, timeout: timeout.unwrap_or_default() });
            };
            if ev.kind == cm::RDMA_CM_EVENT_CONNECT_REQUEST {
                return ConnectRequest::new(ev, self.addr);
            }
            if ev.id.as_ptr() != self.id.as_ptr() {
                // A request taken by another thread, its events not yet
                // moved to its own channel: the kernel moves those queued.
                tracing::debug!(event = %event_name(ev.kind), "rdma_cm event of an accepted id on the listener's channel");
                continue;
            }
            return Err(CmError::Unexpected { expected: "a connect request", got: event_name(ev.kind), status: ev.status, peer: self.addr });
        }
    }
}

/// A peer's request to connect: who, through which device, and what it
/// said. [`accept`](Self::accept) it with a queue pair on
/// [`device`](Self::device) and [`port`](Self::port), or
/// [`reject`](Self::reject) it; dropping it rejects it.
pub struct ConnectRequest {
    id: Option<Id>,
    peer: SocketAddr,
    private_data: Vec<u8>,
    device: (String, u8),
    /// The peer's offered depths.
    initiator_depth: u8,
    responder_resources: u8,
}

impl std::fmt::Debug for ConnectRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectRequest")
            .field("peer", &self.peer)
            .field("device", &self.device)
            .field("private_data", &self.private_data)
            .finish()
    }
}

impl ConnectRequest {
    fn new(ev: Event, listener: SocketAddr) -> Result<ConnectRequest, CmError> {
        let id = Id::adopt(ev.id)?;
        let peer = id.peer_addr().unwrap_or_else(|| id::unspecified(listener));
        let private_data = unframe(peer, &ev.private_data)?; // `id` drops: rejected
        let device = id.device().unwrap_or_default();
        tracing::debug!(%peer, ?device, "rdma_cm connect request");
        Ok(ConnectRequest {
            id: Some(id),
            peer,
            private_data,
            device,
            initiator_depth: ev.initiator_depth,
            responder_resources: ev.responder_resources,
        })
    }

    /// The requesting peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The private data the peer sent with its request.
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The device the request arrived on: create the queue pair there.
    pub fn device(&self) -> &str {
        &self.device.0
    }

    /// The device's port the request arrived on.
    pub fn port(&self) -> u8 {
        self.device.1
    }

    /// Accepts with `qp` (`rdma_accept`), which is moved to `RTS` with the
    /// negotiated attributes first, giving the peer `private_data`; waits
    /// for the peer's confirmation (`RDMA_CM_EVENT_ESTABLISHED`) for at
    /// most `timeout`.
    ///
    /// # Errors
    /// [`CmError::PrivateDataTooLong`] over [`MAX_ACCEPT_PRIVATE_DATA`] and
    /// [`CmError::WrongDevice`] (`qp` is dropped, the request stays
    /// pending: accept with a queue pair on [`device`](Self::device) or
    /// reject it); otherwise the request is answered (refused on a
    /// failure before `rdma_accept`):
    /// [`CmError::Timeout`], [`CmError::Unexpected`] (the peer gave up),
    /// [`CmError::Verbs`] bringing `qp` up, [`CmError::Call`].
    pub fn accept(&mut self, qp: PreparedQueuePair, private_data: &[u8], timeout: Duration) -> Result<CmConnection, CmError> {
        let deadline = Deadline::after(timeout);
        let private = frame("accept", private_data, MAX_ACCEPT_PRIVATE_DATA)?;
        check_device(self.pending()?, &qp, self.peer)?;
        let id = self.id.take().expect("pending, checked above");
        let (initiator, responder) = qp.rd_atomic();
        // Each side reads at most what the other answers.
        let (initiator, responder) = (initiator.min(self.responder_resources), responder.min(self.initiator_depth));
        let (_, _, qp_num) = qp.cm_target();
        let (retry, rnr) = qp.retries();
        let up = || -> Result<QueuePair, CmError> {
            let qp = qp.connect_negotiated(negotiated(&id, sys::IBV_QPS_RTR)?, negotiated(&id, sys::IBV_QPS_RTS)?, (initiator, responder))?;
            let mut param = conn_param(&private, qp_num, initiator, responder, retry, rnr);
            // SAFETY: a valid id of a pending request; `param` and its
            // private data live across the call.
            check("rdma_accept", unsafe { cm::rdma_accept(id.as_ptr(), &mut param) })?;
            Ok(qp)
        };
        let qp = up().inspect_err(|_| reject_quietly(&id))?;
        expect(&id, cm::RDMA_CM_EVENT_ESTABLISHED, "the peer's ESTABLISHED", self.peer, deadline, timeout)?;
        Ok(CmConnection { qp, peer: self.peer, peer_private_data: std::mem::take(&mut self.private_data), id })
    }

    /// The id of a request not answered yet.
    fn pending(&self) -> Result<&Id, CmError> {
        self.id.as_ref().ok_or_else(|| CmError::Unexpected {
            expected: "a pending request",
            got: "one already answered".into(),
            status: 0,
            peer: self.peer,
        })
    }

    /// Refuses the request (`rdma_reject`), telling the peer
    /// `private_data` (it sees [`CmError::Rejected`]).
    ///
    /// # Errors
    /// [`CmError::PrivateDataTooLong`] over [`MAX_REJECT_PRIVATE_DATA`]
    /// (nothing sent; the request is rejected without data when dropped);
    /// [`CmError::Call`].
    pub fn reject(mut self, private_data: &[u8]) -> Result<(), CmError> {
        let private = frame("reject", private_data, MAX_REJECT_PRIVATE_DATA)?;
        self.pending()?;
        let id = self.id.take().expect("pending, checked above");
        // SAFETY: a valid id of a pending request; the data outlives the call.
        check("rdma_reject", unsafe { cm::rdma_reject(id.as_ptr(), private.as_ptr().cast(), private.len() as u8) })
    }
}

/// Refuses a pending request without data, on the way out of a failure.
fn reject_quietly(id: &Id) {
    // SAFETY: a valid id of a pending request; no private data.
    if unsafe { cm::rdma_reject(id.as_ptr(), std::ptr::null(), 0) } != 0 {
        tracing::debug!("{}", failed("rdma_reject"));
    }
}

impl Drop for ConnectRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            reject_quietly(&id);
        }
    }
}

/// A queue pair connected by rdma_cm, with the connection's identity.
/// Dropping it destroys the queue pair, then disconnects
/// (`rdma_disconnect`, the peer sees it in
/// [`wait_disconnected`](Self::wait_disconnected)).
///
/// # Thread safety
/// `Send + Sync`, as [`QueuePair`].
pub struct CmConnection {
    // Declared first: destroyed before the id disconnects.
    qp: QueuePair,
    peer: SocketAddr,
    peer_private_data: Vec<u8>,
    id: Id,
}

impl std::fmt::Debug for CmConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmConnection").field("peer", &self.peer).field("qp", &self.qp).finish()
    }
}

impl CmConnection {
    /// [`Route::resolve`] then [`Route::connect`], within one `timeout`,
    /// for a `qp` already known to be on the device that reaches `peer`.
    ///
    /// # Errors
    /// As those two.
    pub fn connect(qp: PreparedQueuePair, peer: SocketAddr, private_data: &[u8], timeout: Duration) -> Result<CmConnection, CmError> {
        let deadline = Deadline::after(timeout);
        let route = Route::resolve(peer, timeout)?;
        route.connect(qp, private_data, deadline.left().unwrap_or(timeout))
    }

    /// The connected queue pair.
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    /// The private data the peer sent with its request or acceptance.
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private_data
    }

    /// Waits until the peer disconnects (`RDMA_CM_EVENT_DISCONNECTED`), for
    /// at most `timeout` (`None`: no limit).
    ///
    /// # Errors
    /// [`CmError::Timeout`]; [`CmError::Unexpected`] for another event.
    pub fn wait_disconnected(&self, timeout: Option<Duration>) -> Result<(), CmError> {
        let deadline = timeout.map_or(Deadline::never(), Deadline::after);
        loop {
            let ev = expect(&self.id, cm::RDMA_CM_EVENT_DISCONNECTED, "the peer's disconnect", self.peer, deadline, timeout.unwrap_or_default());
            match ev {
                // The passive side may still see its ESTABLISHED here when
                // the peer's RTU and its DREQ came close together.
                Err(CmError::Unexpected { ref got, .. }) if got == &event_name(cm::RDMA_CM_EVENT_ESTABLISHED) => continue,
                other => return other.map(drop),
            }
        }
    }
}

impl Drop for CmConnection {
    fn drop(&mut self) {
        // SAFETY: a valid, connected id; the queue pair (dropped after this
        // body) is the library's, which rdma_cm does not touch.
        if unsafe { cm::rdma_disconnect(self.id.as_ptr()) } != 0 {
            tracing::debug!("{}", failed("rdma_disconnect"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_is_framed_and_checked() {
        let peer: SocketAddr = "192.0.2.1:1".parse().unwrap();
        let framed = frame("connect", b"abc", MAX_CONNECT_PRIVATE_DATA).unwrap();
        assert_eq!(framed, b"\x03abc");
        // The transport pads: the peer still gets exactly three bytes.
        let mut padded = framed.clone();
        padded.resize(56, 0);
        assert_eq!(unframe(peer, &padded).unwrap(), b"abc");
        assert_eq!(unframe(peer, &[]).unwrap(), b"");
        assert!(matches!(unframe(peer, b"\x09ab"), Err(CmError::BadPrivateData { len: 9, got: 3, .. })));
        let long = [0u8; MAX_CONNECT_PRIVATE_DATA + 1];
        assert!(matches!(
            frame("connect", &long, MAX_CONNECT_PRIVATE_DATA),
            Err(CmError::PrivateDataTooLong { len: 56, max: 55, .. })
        ));
        assert_eq!(frame("accept", &[7; MAX_ACCEPT_PRIVATE_DATA], MAX_ACCEPT_PRIVATE_DATA).unwrap().len(), 196);
    }
}
