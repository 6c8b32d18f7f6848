//! Safe RDMA over rdma-core's verbs, for host memory today and GPU memory
//! next, with nothing hidden: every choice the library makes (which GID,
//! which MTU, which registration path) is visible and logged.
//!
//! # The path of a byte
//! 1. [`mr`]: register memory ([`MemoryRegion`]), describe it to a peer
//!    ([`RemoteBuffer`]).
//! 2. [`qp`]: connect a reliable-connected [`QueuePair`] and post work
//!    requests ([`SendWr`], [`RecvWr`]) that name that memory.
//! 3. [`cq`]: reap [`WorkCompletion`]s from a [`CompletionQueue`]; reaping
//!    is what releases the memory a request held.
//!
//! # Objects, one module each
//! - [`device`]: listing RDMA devices.
//! - [`context`]: an opened device ([`Context`]), its ports and GID table.
//! - [`gid`]: GIDs and the RoCE GID choice.
//! - [`pd`]: protection domains.
//! - [`mr`]: memory regions and access flags.
//! - [`rcache`]: a registration cache for memory the program does not own
//!   (GPU entries invalidated by allocation identity, host entries by the
//!   caller).
//! - [`cq`]: completion queues; the work completions they report
//!   ([`WorkCompletion`], [`WcStatus`], [`WcOpcode`], [`WcError`]) are
//!   plain data at the crate root.
//! - [`qp`]: queue pairs and posting; what the NIC holds until each
//!   completion is matched lives beside it (private `tracker`).
//! - [`wr`]: work requests and prepared send lists.
//! - [`Endpoint`], [`RemoteBuffer`]: what peers exchange (plain, `serde`
//!   serialisable); [`PortAttr`], [`Mtu`], [`LinkLayer`], [`PortState`]:
//!   port attributes; [`Errno`]: error numbers. Leaves every module shares.
//! - [`gpu`]: CUDA GPUs and GPU buffers (driver loaded at run time).
//! - [`gdr`]: GPUDirect RDMA: registering GPU memory (dma-buf, peer
//!   memory, or explicitly host-staged) and saying why not.
//! - [`nccl`]: how NCCL reads the variables that decide its use of
//!   GPUDirect RDMA (`NCCL_NET_GDR_LEVEL`, `NCCL_IB_DISABLE`, `NCCL_NET`).
//! - [`sysroot`]: the machine's sysfs/procfs, read through one root.
//! - [`topology`]: where GPUs and RDMA NICs sit in the PCIe tree, and which
//!   NIC is nearest each GPU (PIX, PXB, PHB, NODE, SYS).
//! - [`bootstrap`]: the out-of-band TCP exchange of endpoints and buffers.
//! - [`error`]: the error type.
//!
//! # Thread safety
//! Every handle is `Send + Sync` and cheap to clone; share them freely.
//! What each guarantees when used from several threads at once:
//! - [`MemoryRegion`]: copies ([`write_at`](MemoryRegion::write_at),
//!   [`read_at`](MemoryRegion::read_at), [`fill`](MemoryRegion::fill),
//!   [`stage_in`](MemoryRegion::stage_in),
//!   [`read_volatile`](MemoryRegion::read_volatile)) and posts that name
//!   the region are judged against each other: a copy claims its range
//!   for as long as it runs; a posted request holds its range until its
//!   completion is reaped (the hold is its entry in its queue pair's
//!   pending list, so posting takes no lock but the queue's). Anything
//!   that would overlap a conflicting claim
//!   (someone writes what the other touches) fails at once with
//!   [`Error::Busy`] instead of waiting or racing: two reads may overlap,
//!   a read and a write may not, a copy and a receive into it may not, two
//!   posts always may (what the NIC does to memory is the application
//!   protocol's business, not a Rust data race). A copy of a region with
//!   requests outstanding on it looks them up in the pending lists of
//!   every queue pair of the region's protection domain, so its cost grows
//!   with the domain's outstanding work; with none outstanding it checks
//!   one counter.
//! - [`QueuePair`]: [`post_send`](QueuePair::post_send), [`post_list`](QueuePair::post_list)
//!   and [`post_recv`](QueuePair::post_recv) may run on several threads; each
//!   call's batch is posted whole (one lock per queue covers the room
//!   check, the holds, host staging and the doorbell), and batches of
//!   different threads do not interleave.
//! - [`CompletionQueue`]: any number of threads may
//!   [`poll`](CompletionQueue::poll) and [`wait`](CompletionQueue::wait).
//!   Each completion is reported exactly once, to one of them; one lock is
//!   held from `ibv_poll_cq` until the completions it returned are matched
//!   to their requests, so pollers cannot reorder one queue pair's
//!   completions. Which thread gets which completion is not defined.
//! - [`RegistrationCache`]: lookups from several threads share the cache.
//! - [`Context`], [`ProtectionDomain`], [`Gpu`]: immutable after creation.
//!
//! A queue pair may be dropped while other threads poll its CQ: its
//! outstanding requests complete no more, and their memory is released
//! once the QP is destroyed. Its room in the CQ is given back only when
//! the CQ has been seen empty afterwards (some providers leave a
//! destroyed QP's completions in the CQ), so a CQ can never overrun.
//!
//! # Example
//! ```no_run
//! use gpudirect::{AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain,
//!                 QpConfig, QueuePair, RecvWr, SendWr, WorkCompletion};
//! use gpudirect::bootstrap::{Handshake, OobChannel, DEFAULT_TIMEOUT};
//!
//! # fn main() -> gpudirect::Result<()> {
//! let ctx = Context::open(Some("mlx5_0"))?;
//! let pd = ProtectionDomain::new(&ctx)?;
//! let cq = CompletionQueue::new(&ctx, 256)?;
//! let buf = MemoryRegion::alloc(&pd, 1 << 20, AccessFlags::REMOTE_WRITE)?;
//! let qp = QueuePair::create(&pd, &cq, &cq, &QpConfig::default())?;
//!
//! // Swap endpoints and buffer descriptors with the peer over TCP.
//! let mut oob = OobChannel::connect("peer-host:18515", DEFAULT_TIMEOUT)?;
//! let peer = oob.exchange(&Handshake {
//!     endpoint: Some(qp.endpoint()),
//!     buffers: vec![buf.remote()],
//!     ..Default::default()
//! })?;
//! let qp = qp.connect(&peer.endpoint.expect("peer sent its endpoint"))?;
//!
//! // Write 4 KiB into the peer's buffer and wait for the completion.
//! buf.write_at(0, &[42; 4096])?;
//! qp.post_send(&[SendWr::write(buf.slice(0..4096)?, &peer.buffers[0], 0)?.wr_id(1)])?;
//! let mut wc = [WorkCompletion::default(); 1];
//! cq.wait(&mut wc, None)?;
//! wc[0].ok()?;
//! # let _ = RecvWr::new(buf.slice(0..0)?);
//! # Ok(()) }
//! ```

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod bootstrap;
pub mod context;
pub mod cq;
pub mod device;
pub mod error;
pub mod gdr;
pub mod gid;
pub mod gpu;
pub mod mr;
pub mod nccl;
pub mod pd;
pub mod qp;
pub mod rcache;
pub mod sysroot;
pub mod topology;
pub mod wr;

// Crate-private leaves: who may touch which bytes (claims), deadlines,
// and the mutex helgrind can see.
mod claims;
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault;
mod errno;
mod port;
mod wc;
mod wire;
mod deadline;
mod sync;
mod tracker;

// Misuses the compiler refuses: compile_fail doctests only.
#[cfg(doctest)]
mod compile_fail;

pub use context::{Context, DeviceAttr};
pub use port::{LinkLayer, Mtu, PortAttr, PortState};
pub use cq::CompletionQueue;
pub use wc::{WcError, WcOpcode, WcStatus, WorkCompletion};
pub use device::{devices, DeviceInfo, Guid};
pub use error::{Errno, Error, Result};
pub use gid::{Gid, GidChoice, GidEntry, GidType};
pub use gdr::{GdrError, GpuPolicy, RegistrationPath};
pub use gpu::{Gpu, GpuAllocation, GpuBuffer};
pub use mr::{AccessFlags, HostBuffer, LocalSlice, Location, MemoryRegion, Registerable};
pub use pd::ProtectionDomain;
pub use qp::{PreparedQueuePair, QpConfig, QpState, QueuePair};
pub use wire::{Endpoint, RemoteBuffer};
pub use rcache::{CacheConfig, CacheStats, CachedRegion, RegistrationCache};
pub use wr::{RecvWr, SendList, SendWr};

#[cfg(test)]
mod tests {
    use super::*;

    /// Handles are meant to be shared across threads: posting, polling and
    /// the copy accessors are all thread-safe.
    #[test]
    fn handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Context>();
        check::<ProtectionDomain>();
        check::<CompletionQueue>();
        check::<MemoryRegion>();
        check::<QueuePair>();
        check::<PreparedQueuePair>();
        check::<RegistrationCache>();
        check::<CachedRegion>();
        check::<Error>();
    }

    /// Endpoints and buffer descriptors can travel over the user's own
    /// channel (JSON here).
    #[test]
    fn endpoint_and_remote_buffer_are_serde() {
        let ep = Endpoint { qp_num: 0x1234, psn: 0x42, lid: 0, gid: Gid([0xfe; 16]), mtu: Mtu::Mtu4096 };
        let rb = RemoteBuffer { addr: 0x7f00_0000_0000, len: 1 << 20, rkey: 0xabc };
        let s = serde_json::to_string(&(ep, rb)).unwrap();
        assert_eq!(serde_json::from_str::<(Endpoint, RemoteBuffer)>(&s).unwrap(), (ep, rb));
        assert!(serde_json::from_str::<Endpoint>(r#"{"qp_num":1,"psn":1,"lid":0,"gid":[0],"mtu":"Mtu4096"}"#).is_err());
    }
}
