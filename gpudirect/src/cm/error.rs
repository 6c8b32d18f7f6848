//! rdma_cm's error: plain data, a leaf that imports nothing of the
//! connection code.

use std::net::SocketAddr;
use std::time::Duration;

use crate::errno::Errno;
use crate::error::Error;

/// Why an rdma_cm operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmError {
    /// A librdmacm call failed.
    #[error("{call} failed: {errno}")]
    Call {
        /// The C function, e.g. `rdma_bind_addr`.
        call: &'static str,
        /// What it set `errno` to.
        errno: Errno,
    },
    /// An address, route or connection step did not finish in time.
    #[error("rdma_cm: {step} with {peer} did not finish within {timeout:?}")]
    Timeout {
        /// What was waited for (`"address resolution"`, `"route resolution"`,
        /// `"connection"`, `"the peer's ESTABLISHED"`, ...).
        step: &'static str,
        /// The other side.
        peer: SocketAddr,
        /// The time allowed.
        timeout: Duration,
    },
    /// No RDMA device could reach the address (`RDMA_CM_EVENT_ADDR_ERROR`).
    #[error(
        "rdma_cm cannot resolve {peer} to an RDMA device ({errno}): no RDMA device's network \
         interface has a route to it; check that the interface of an RDMA device (a RoCE NIC or \
         rxe's netdev) is up, has an IP address, and that the peer's IP is on its subnet"
    )]
    Address {
        /// The address.
        peer: SocketAddr,
        /// The status the event carried.
        errno: Errno,
    },
    /// No path to the peer (`RDMA_CM_EVENT_ROUTE_ERROR`).
    #[error("rdma_cm found no route to {peer} ({errno}): on InfiniBand, is the subnet manager running?")]
    Route {
        /// The address.
        peer: SocketAddr,
        /// The status the event carried.
        errno: Errno,
    },
    /// The peer's connection manager never answered
    /// (`RDMA_CM_EVENT_UNREACHABLE`).
    #[error("{peer} did not answer the connection request ({errno}): is the peer's host up and its RDMA device's port active?")]
    Unreachable {
        /// The address.
        peer: SocketAddr,
        /// The status the event carried.
        errno: Errno,
    },
    /// The peer refused (`RDMA_CM_EVENT_REJECTED`). Reason 8 (invalid
    /// service ID) is the InfiniBand CM's "nobody listens on that port";
    /// 28 (consumer defined) is the peer application's `reject`.
    #[error(
        "{peer} rejected the connection (CM reason {reason}{})",
        match reason { 8 => ": nobody listens there (wrong port, or the server is not up yet)", 28 => ": refused by the peer application", _ => "" }
    )]
    Rejected {
        /// The address.
        peer: SocketAddr,
        /// The InfiniBand CM reject reason.
        reason: i32,
        /// What the peer said with its refusal.
        private_data: Vec<u8>,
    },
    /// The exchange failed after it began (`RDMA_CM_EVENT_CONNECT_ERROR`).
    #[error("connection with {peer} failed during the exchange ({errno})")]
    Connect {
        /// The address.
        peer: SocketAddr,
        /// The status the event carried.
        errno: Errno,
    },
    /// Another event came than the step waits for.
    #[error("rdma_cm sent {got} (status {status}) while waiting for {expected} with {peer}")]
    Unexpected {
        /// The event waited for.
        expected: &'static str,
        /// The event received, as `rdma_event_str` names it.
        got: String,
        /// Its status.
        status: i32,
        /// The other side.
        peer: SocketAddr,
    },
    /// The route or the request is on another device or port than the
    /// queue pair given to connect.
    #[error(
        "rdma_cm reaches {peer} through {cm_device} port {cm_port}, but the queue pair is on {qp_device} \
         port {qp_port}: create it on that device and port (Route::device names it before connecting)"
    )]
    WrongDevice {
        /// The other side.
        peer: SocketAddr,
        /// The device rdma_cm resolved.
        cm_device: String,
        /// Its port.
        cm_port: u8,
        /// The queue pair's device.
        qp_device: String,
        /// The queue pair's port.
        qp_port: u8,
    },
    /// Private data longer than the step carries.
    #[error("{len} bytes of private data; {step} carries at most {max}")]
    PrivateDataTooLong {
        /// The step (`"connect"`, `"accept"`, `"reject"`).
        step: &'static str,
        /// Bytes given.
        len: usize,
        /// The most it carries.
        max: usize,
    },
    /// The peer's private data is not in this library's framing (a length
    /// byte, then the bytes).
    #[error("{peer} sent private data that is not a gpudirect peer's: length byte {len} in {got} bytes")]
    BadPrivateData {
        /// The other side.
        peer: SocketAddr,
        /// The length byte.
        len: u8,
        /// Bytes that arrived.
        got: usize,
    },
    /// The queue pair could not be brought up with the negotiated
    /// attributes, or another verbs error.
    #[error(transparent)]
    Verbs(#[from] Error),
}
