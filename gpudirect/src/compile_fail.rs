//! Misuses the type system refuses (point 6 of `docs/reliability.md`, soundness): one `compile_fail`
//! doctest each. This module exists only under `cfg(doctest)`; it adds
//! nothing to the library.
//!
//! Each block names the error code it must fail with. Stable rustdoc only
//! checks that the block does not compile; nightly rustdoc also checks the
//! code, so `cargo +nightly test -p gpudirect --doc compile_fail` (run by
//! `testbed/sanitize`) proves each fails for the intended reason and not a
//! typo. The figures are in `docs/reliability/soundness.md`.
//!
//! # Borrowed memory cannot outlive its region
//!
//! A [`LocalSlice`](crate::LocalSlice) borrows its region (E0597, borrowed
//! value does not live long enough):
//!
//! ```compile_fail,E0597
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion};
//! let slice = {
//!     let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
//!     mr.slice(0..64)?
//! };
//! # let _ = slice; Ok(()) }
//! ```
//!
//! So does a send work request built from one (E0597):
//!
//! ```compile_fail,E0597
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, SendWr};
//! let wr = {
//!     let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
//!     SendWr::send(mr.slice(..)?)
//! };
//! # let _ = wr; Ok(()) }
//! ```
//!
//! and a receive work request (E0597):
//!
//! ```compile_fail,E0597
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, RecvWr};
//! let wr = {
//!     let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::LOCAL_WRITE)?;
//!     RecvWr::new(mr.slice(..)?)
//! };
//! # let _ = wr; Ok(()) }
//! ```
//!
//! A prepared [`SendList`](crate::SendList) borrows every region it
//! names, so none can be dropped while the list may still be posted
//! (E0505):
//!
//! ```compile_fail,E0505
//! # fn f(pd: &gpudirect::ProtectionDomain, qp: &gpudirect::QueuePair, remote: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, SendList, SendWr};
//! let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
//! let mut list = SendList::new(&[SendWr::write(mr.slice(..)?, remote, 0)?])?;
//! drop(mr);
//! qp.post_list(&mut list)?;
//! # Ok(()) }
//! ```
//!
//! An RDMA write request holds the local region, not the remote descriptor
//! (a copy), but the region still may not be dropped before posting (E0505,
//! move out of a borrowed value):
//!
//! ```compile_fail,E0505
//! # fn f(pd: &gpudirect::ProtectionDomain, qp: &gpudirect::QueuePair, remote: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, SendWr};
//! let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
//! let wr = SendWr::write(mr.slice(..)?, remote, 0)?;
//! drop(mr);
//! qp.post_send(&[wr])?;
//! # Ok(()) }
//! ```
//!
//! Nor moved to another thread while a request borrows it (E0505):
//!
//! ```compile_fail,E0505
//! # fn f(pd: &gpudirect::ProtectionDomain, qp: &gpudirect::QueuePair) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, RecvWr};
//! let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::LOCAL_WRITE)?;
//! let wr = RecvWr::new(mr.slice(..)?);
//! let t = std::thread::spawn(move || mr.len());
//! qp.post_recv(&[wr])?;
//! # t.join().unwrap(); Ok(()) }
//! ```
//!
//! A slice cannot be smuggled into a thread that may outlive the region
//! (E0597: `thread::spawn` needs `'static`):
//!
//! ```compile_fail,E0597
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion};
//! let mr = MemoryRegion::alloc(pd, 4096, AccessFlags::default())?;
//! let s = mr.slice(..)?;
//! std::thread::spawn(move || s.len());
//! # Ok(()) }
//! ```
//!
//! # Bounds cannot be forged
//!
//! A slice's offset and length are private: the only way to make one is
//! [`MemoryRegion::slice`](crate::MemoryRegion::slice), which checks them
//! (E0451, private field):
//!
//! ```compile_fail,E0451
//! # fn f(mr: &gpudirect::MemoryRegion) {
//! let s = gpudirect::LocalSlice { mr, offset: 0, len: usize::MAX };
//! # }
//! ```
//!
//! Likewise a work request's remote address and key come only from a
//! [`RemoteBuffer`](crate::RemoteBuffer), checked by `SendWr::write` (E0451):
//!
//! ```compile_fail,E0451
//! # fn f(s: gpudirect::LocalSlice<'_>) {
//! let wr = gpudirect::SendWr::send(s);
//! let forged = gpudirect::SendWr { remote_addr: 0xdead_0000, rkey: 7, ..wr };
//! # }
//! ```
//!
//! # Only memory that stays put can be registered
//!
//! A borrowed buffer could be freed while the NIC still uses it
//! (E0277, `&mut Vec<u8>` is not `Registerable`):
//!
//! ```compile_fail,E0277
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion};
//! let mut v = vec![0u8; 4096];
//! let mr = MemoryRegion::register(pd, &mut v, AccessFlags::default())?;
//! drop(v);
//! # Ok(()) }
//! ```
//!
//! An array moves with its value, so the registered address would dangle
//! (E0277):
//!
//! ```compile_fail,E0277
//! # fn f(pd: &gpudirect::ProtectionDomain) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion};
//! let mr = MemoryRegion::register(pd, [0u8; 4096], AccessFlags::default())?;
//! # Ok(()) }
//! ```
//!
//! Promising that a type stays put is itself `unsafe` (E0200, the trait
//! requires an `unsafe impl`):
//!
//! ```compile_fail,E0200
//! struct Mine(Vec<u8>);
//! impl gpudirect::Registerable for Mine {
//!     fn as_mut_ptr(&mut self) -> *mut u8 { self.0.as_mut_ptr() }
//!     fn len(&self) -> usize { self.0.len() }
//! }
//! ```
//!
//! # Queue pair states
//!
//! A queue pair that is not connected yet cannot send (E0599, no such
//! method on `PreparedQueuePair`):
//!
//! ```compile_fail,E0599
//! # fn f(qp: gpudirect::PreparedQueuePair, wr: gpudirect::SendWr<'_>) {
//! qp.post_send(&[wr]);
//! # }
//! ```
//!
//! Connecting consumes it: it cannot be connected twice (E0382, use of a
//! moved value)
//!
//! ```compile_fail,E0382
//! # fn f(qp: gpudirect::PreparedQueuePair, peer: gpudirect::Endpoint) -> gpudirect::Result<()> {
//! let a = qp.connect(&peer)?;
//! let b = qp.connect(&peer)?;
//! # Ok(()) }
//! ```
//!
//! nor used in its prepared state afterwards, e.g. to post receives that
//! the connected handle does not know about (E0382):
//!
//! ```compile_fail,E0382
//! # fn f(qp: gpudirect::PreparedQueuePair, peer: gpudirect::Endpoint, wr: gpudirect::RecvWr<'_>) -> gpudirect::Result<()> {
//! let connected = qp.connect(&peer)?;
//! qp.post_recv(&[wr])?;
//! # Ok(()) }
//! ```
//!
//! # Unchecked views are `unsafe`
//!
//! Zero-copy views of a region race with the NIC and the peer (E0133, call
//! to an unsafe function):
//!
//! ```compile_fail,E0133
//! # fn f(mr: &gpudirect::MemoryRegion) {
//! let bytes: Option<&[u8]> = mr.as_slice();
//! # }
//! ```
//!
//! ```compile_fail,E0133
//! # fn f(mr: &gpudirect::MemoryRegion) {
//! let bytes: Option<&mut [u8]> = mr.as_mut_slice();
//! # }
//! ```
//!
//! Adopting a raw device pointer as a GPU buffer is `unsafe` too (E0133):
//!
//! ```compile_fail,E0133
//! # fn f(gpu: &gpudirect::Gpu) -> gpudirect::Result<()> {
//! let buf = gpudirect::GpuBuffer::from_raw(gpu, 0x7000_0000, 4096)?;
//! # Ok(()) }
//! ```
//!
//! # Atomics return into registered memory
//!
//! An atomic's result lands where the NIC writes: a slice of a registered
//! region, never a plain buffer (E0308, mismatched types):
//!
//! ```compile_fail,E0308
//! # fn f(dst: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
//! let mut word = [0u8; 8];
//! let wr = gpudirect::SendWr::fetch_add(&mut word[..], dst, 0, 1)?;
//! # let _ = wr; Ok(()) }
//! ```
//!
//! and that slice outlives the request (E0597):
//!
//! ```compile_fail,E0597
//! # fn f(pd: &gpudirect::ProtectionDomain, dst: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
//! use gpudirect::{AccessFlags, MemoryRegion, SendWr};
//! let wr = {
//!     let results = MemoryRegion::alloc(pd, 8, AccessFlags::default())?;
//!     SendWr::compare_swap(results.slice(..)?, dst, 0, 0, 1)?
//! };
//! # let _ = wr; Ok(()) }
//! ```
//!
//! An atomic works on one 8-byte word, so its result is one slice, never
//! a scatter/gather list (E0308):
//!
//! ```compile_fail,E0308
//! # fn f(mr: &gpudirect::MemoryRegion, dst: &gpudirect::RemoteBuffer) -> gpudirect::Result<()> {
//! let parts = [mr.slice(0..4)?, mr.slice(8..12)?];
//! let wr = gpudirect::SendWr::fetch_add(&parts, dst, 0, 1)?;
//! # let _ = wr; Ok(()) }
//! ```
//!
//! # Scatter/gather lists borrow their slices
//!
//! A request made from a list of slices cannot outlive the list (E0597):
//!
//! ```compile_fail,E0597
//! # fn f(mr: &gpudirect::MemoryRegion) -> gpudirect::Result<()> {
//! use gpudirect::RecvWr;
//! let wr = {
//!     let parts = [mr.slice(0..8)?, mr.slice(64..72)?];
//!     RecvWr::new(&parts)
//! };
//! # let _ = wr; Ok(()) }
//! ```
//!
//! nor can the list's regions be dropped while it exists (E0505, move out
//! of a borrowed value):
//!
//! ```compile_fail,E0505
//! # fn f(mr: gpudirect::MemoryRegion) -> gpudirect::Result<()> {
//! use gpudirect::SendWr;
//! let parts = [mr.slice(0..8)?, mr.slice(64..72)?];
//! let wr = SendWr::send(&parts);
//! drop(mr);
//! # let _ = wr; Ok(()) }
//! ```
//!
//! # Dropping in any order is allowed, by design
//!
//! Nothing stops dropping a context before its queue pairs, or a region
//! while a request that names it is in flight: every handle keeps what it
//! depends on alive (reference counts), so these compile and are tested at
//! run time instead (`objects_drop_in_any_order_without_leaks` in
//! `tests/rxe.rs`):
//!
//! ```no_run
//! # fn f() -> gpudirect::Result<()> {
//! use gpudirect::*;
//! let ctx = Context::open(None)?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 16)?;
//! let qp = QueuePair::create(&pd, &cq, &cq, &QpConfig::default())?;
//! drop(ctx);
//! drop(pd);
//! drop(cq);
//! drop(qp); // the last handle: everything is destroyed here, in order
//! # Ok(()) }
//! ```

/// # rdma_cm requests are answered once (feature `rdmacm`)
///
/// Rejecting consumes a connect request: it cannot be accepted after
/// (E0382, use of moved value):
///
/// ```compile_fail,E0382
/// # fn f(req: gpudirect::cm::ConnectRequest, qp: gpudirect::PreparedQueuePair) -> Result<(), gpudirect::cm::CmError> {
/// let mut req = req;
/// req.reject(b"busy")?;
/// req.accept(qp, b"", std::time::Duration::from_secs(5))?;
/// # Ok(()) }
/// ```
///
/// A resolved route connects one queue pair (E0382):
///
/// ```compile_fail,E0382
/// # fn f(route: gpudirect::cm::Route, a: gpudirect::PreparedQueuePair, b: gpudirect::PreparedQueuePair) -> Result<(), gpudirect::cm::CmError> {
/// let t = std::time::Duration::from_secs(5);
/// let first = route.connect(a, b"", t)?;
/// let second = route.connect(b, b"", t)?;
/// # Ok(()) }
/// ```
///
/// And a queue pair given to rdma_cm is its connection's: it cannot also
/// be connected by endpoint (E0382):
///
/// ```compile_fail,E0382
/// # fn f(route: gpudirect::cm::Route, qp: gpudirect::PreparedQueuePair, peer: gpudirect::Endpoint) -> Result<(), Box<dyn std::error::Error>> {
/// let conn = route.connect(qp, b"", std::time::Duration::from_secs(5))?;
/// let again = qp.connect(&peer)?;
/// # Ok(()) }
/// ```
#[cfg(feature = "rdmacm")]
mod cm {}

/// A descriptor watched on tokio's reactor cannot be reached mutably, so
/// safe code cannot swap two watches' descriptors (which tokio's
/// registration forbids: dropping one would deregister the other's and
/// leave a stale entry in the reactor). `WatchedFd` has no `get_mut`
/// (E0599):
///
/// ```compile_fail,E0599
/// fn f(mut a: gpudirect::WatchedFd, mut b: gpudirect::WatchedFd) {
///     std::mem::swap(a.get_mut(), b.get_mut());
/// }
/// ```
#[cfg(feature = "tokio")]
mod watch {}
