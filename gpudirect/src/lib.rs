//! Safe RDMA over rdma-core's verbs, for host and GPU memory (dma-buf or
//! peer memory, judged before anything is registered and refused with the
//! cause and the fix where GPUDirect RDMA cannot work), with nothing
//! hidden: every choice the library makes (which GID, which MTU, which
//! registration path) is visible and logged. How the crate is layered and
//! the path of a byte through the engine: `docs/architecture.md` in the
//! repository.
//!
//! # The path of a byte
//! 1. Register memory: [`MemoryRegion`] (`mr/`), described to a peer by
//!    a [`RemoteBuffer`].
//! 2. Post work requests ([`SendWr`], [`RecvWr`], a prepared [`SendList`])
//!    that name that memory on a connected [`QueuePair`] (`qp/`; posting in `qp/post.rs`).
//! 3. Reap [`WorkCompletion`]s from a [`CompletionQueue`] (`cq.rs`);
//!    reaping is what releases the memory a request held.
//!
//! # What is where
//! One public path per item: the verbs objects and their plain data are at
//! the crate root; subsystems with their own vocabulary are namespaces.
//! - Devices and ports: [`devices`] ([`DeviceInfo`], [`Guid`]), an opened
//!   [`Context`] ([`DeviceAttr`], [`PortAttr`], [`PortState`], [`Mtu`],
//!   [`LinkLayer`]), GIDs and the RoCE GID choice ([`Gid`], [`GidEntry`],
//!   [`GidType`], [`GidChoice`], [`choose_gid`]).
//! - Memory: [`ProtectionDomain`], [`MemoryRegion`] ([`AccessFlags`],
//!   [`HostBuffer`], [`Registerable`], [`LocalSlice`], [`SgList`], [`Location`]).
//! - Queues: [`QueuePair`] ([`PreparedQueuePair`], [`QpConfig`],
//!   [`QpState`], [`Endpoint`], [`PartialPost`]), work requests
//!   ([`SendWr`], [`RecvWr`], [`SendList`]), [`SharedReceiveQueue`]
//!   ([`SrqConfig`], [`SrqId`]), unreliable datagrams ([`UdQueuePair`],
//!   [`UdConfig`], [`AddressHandle`], [`UdSendWr`]), [`CompletionQueue`] ([`WorkCompletion`],
//!   [`WcStatus`], [`WcOpcode`], [`WcError`]), the device's
//!   [`AsyncEvent`]s ([`Context::async_event`]).
//! - GPUs: [`Gpu`], [`GpuBuffer`], [`GpuAllocation`], [`gpu_count`],
//!   [`driver_version`]; how GPU memory is registered: [`GpuPolicy`],
//!   [`RegistrationPath`]; whether a framework's device memory (a
//!   `cudaMalloc` block, `cuMemCreate`/`cuMemMap` mappings such as
//!   PyTorch's `expandable_segments`, a stream-ordered pool) may be given to
//!   a NIC, judged from the driver's answers before anything is
//!   registered: [`judge_gpu_range`] ([`GpuMapping`], [`GpuRangePlan`],
//!   [`GpuMemoryError`], which names the fix).
//! - Errors: [`Error`], [`Result`], [`Errno`].
//! - Namespaces: [`gdr`] (the facts GPUDirect RDMA rests on, judged:
//!   why a path is or is not available), [`topology`] (PCIe placement of
//!   GPUs and NICs, the NIC nearest a GPU), [`nccl`] (how NCCL reads its
//!   GPUDirect variables), [`rcache`] (a registration cache for memory the
//!   program does not own), [`bootstrap`] (the out-of-band TCP exchange),
//!   `cm` (connection setup by rdma_cm, feature `rdmacm`),
//!   [`sysroot`] (the machine's files, read through one root); for
//!   services built over this crate, [`deadline`] (timeouts that accept
//!   any duration, exchanges bounded as a whole) and [`decode`] (the
//!   bounds-checked reader of a peer's bytes).
//!
//! The transfer engine (agents that find each other by metadata, memory
//! registered under names, connections on first use, lists of ranges
//! moved with a notification that arrives after its data) is the crate
//! `gpudirect-engine`, over this one's public API.
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
//! - [`RegistrationCache`](rcache::RegistrationCache): lookups from several threads share the cache.
//! - [`SharedReceiveQueue`]: as a queue pair's receive queue; its
//!   receives complete on the receive CQs of the queue pairs attached.
//! - [`Context`], [`ProtectionDomain`], [`Gpu`]: immutable after creation;
//!   [`Context::async_event`] hands each event to one caller.
//!
//! A queue pair may be dropped while other threads poll its CQ: its
//! outstanding requests complete no more, and their memory is released
//! once the QP is destroyed. Its room in the CQ is given back only when
//! the CQ has been seen empty afterwards (some providers leave a
//! destroyed QP's completions in the CQ), so a CQ can never overrun.
//!
//! # Logging
//! The library reports through [`tracing`](https://docs.rs/tracing):
//! warnings for what a caller should know but that is not an error (a GPU
//! region staged through host memory under [`GpuPolicy::Prefer`], a
//! teardown verb that failed), `info` for the choices it makes (the GID,
//! the connected MTU, each GPU region's registration path), `debug` for
//! the objects it creates. Nothing is printed unless the program installs a
//! subscriber, e.g. `tracing_subscriber::fmt().with_env_filter(
//! tracing_subscriber::EnvFilter::from_default_env()).init()`; the
//! `gpudirect` tools and examples do, on stderr, honouring `RUST_LOG`
//! (`RUST_LOG=debug gpudirect bw ...`).
//!
//! # Features
//! - `cuda` (default): GPU memory through CUDA (cudarc, loaded at run
//!   time: nothing CUDA is needed to build). Without it the GPU types
//!   remain and every CUDA call returns [`Error::CudaUnavailable`] saying
//!   so; cudarc is not in the dependency tree.
//! - `tokio`: `AsyncCompletionQueue` (awaitable completions, and the
//!   completion of one work request by id) and `AsyncEvents`, on tokio's
//!   reactor. Without it, [`CompletionQueue`] still gives any event loop
//!   its channel's fd (`AsFd`), [`req_notify`](CompletionQueue::req_notify)
//!   and [`ack_events`](CompletionQueue::ack_events).
//! - `rdmacm`: the `cm` module, connection setup by the RDMA connection
//!   manager (listen, connect and accept by IP address, private data,
//!   timeouts) for the library's own queue pairs. Links librdmacm (the
//!   build needs `librdmacm-dev`); at run time the `rdma_ucm` module.
//! - `serde` (default): `Serialize` on the plain data types, and
//!   `Deserialize` on the wire types ([`Endpoint`], [`RemoteBuffer`],
//!   [`Gid`], [`Mtu`], [`bootstrap::Handshake`]) and on the facts a
//!   diagnosis rests on ([`PortAttr`], [`GidEntry`], [`gdr::GpuFacts`],
//!   [`gdr::HostFacts`], [`gdr::DmaBufProbe`]), so a tool can save them and
//!   judge them on another machine.
//!
//! The minimum supported Rust version is 1.88.
//!
//! # Example
//! The client side of one RDMA write; the server runs the same setup,
//! waits with [`OobChannel::accept`](bootstrap::OobChannel::accept) on a
//! `TcpListener` instead of connecting, and learns the write has landed
//! when the client says so ([`barrier`](bootstrap::OobChannel::barrier)).
//! Both sides in one program: the crate's README ("Use it from your
//! crate"), compiled as a doctest.
//!
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
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

#[cfg(feature = "tokio")]
mod asynch;
pub mod bootstrap;
#[cfg(feature = "rdmacm")]
#[cfg_attr(docsrs, doc(cfg(feature = "rdmacm")))]
pub mod cm;
mod context;
mod cq;
mod device;
mod error;
mod event;
pub mod gdr;
pub mod metrics;
mod gid;
mod gpu;
mod gpu_range;
mod mr;
mod mw;
mod mw_probe;
pub mod nccl;
mod pd;
mod qp;
pub mod rcache;
mod srq;
mod ud;
pub mod sysroot;
pub mod topology;
mod wr;

// Crate-private leaves: who may touch which bytes (claims), deadlines,
// and the mutex helgrind can see.
mod claims;
mod policy;
#[cfg(feature = "fault-injection")]
#[doc(hidden)]
pub mod fault;
mod errno;
mod port;
mod wc;
mod wire;
pub mod deadline;
pub mod decode;
pub mod hash;
pub mod sockaddr;
pub mod sync;
mod tracker;

// Misuses the compiler refuses: compile_fail doctests only.
#[cfg(doctest)]
mod compile_fail;

// The README's example (what crates.io shows) compiles as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

#[cfg(feature = "tokio")]
#[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
pub use asynch::{watch_fd, AsyncCompletionQueue, AsyncEvents, ReadyGuard, WatchedFd};
pub use context::{Context, DeviceAttr};
pub use event::AsyncEvent;
pub use port::{LinkLayer, Mtu, PortAttr, PortState};
pub use cq::CompletionQueue;
pub use wc::{WcError, WcOpcode, WcStatus, WorkCompletion};
pub use device::{devices, DeviceInfo, Guid};
pub use error::{Errno, Error, Result};
pub use gid::{choose_gid, Gid, GidChoice, GidEntry, GidType};
pub use policy::{GpuPolicy, RegistrationPath};
pub use gpu::{current_gpu, driver_version, gpu_count, Gpu, GpuAllocation, GpuBuffer, GPU_PAGE};
pub use error::gpu_memory::GpuMemoryError;
pub use gpu_range::{judge_gpu_range, GpuMapping, GpuRangePlan, CU_MEMORYTYPE_DEVICE, MAX_GPU_MAPPINGS};
pub use mr::{AccessFlags, HostBuffer, LocalSlice, Location, MemoryRegion, Registerable, SgList};
pub use mw::{next_rkey, MemoryWindow};
pub use mw_probe::{probe_window_range, WindowRange};
pub use pd::ProtectionDomain;
pub use qp::{PartialPost, PreparedQueuePair, QpConfig, QpState, QueuePair};
pub use srq::{SharedReceiveQueue, SrqConfig, SrqId};
pub use ud::{AddressHandle, UdConfig, UdQueuePair, UdSendWr, GRH_LEN};
pub use wire::{Endpoint, RemoteBuffer};
pub use wr::{RecvWr, SendList, SendTemplate, SendWr, ATOMIC_WORD};

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
        check::<rcache::RegistrationCache>();
        check::<rcache::CachedRegion>();
        check::<Error>();
    }

    /// Endpoints and buffer descriptors can travel over the user's own
    /// channel (JSON here).
    #[cfg(feature = "serde")]
    #[test]
    fn endpoint_and_remote_buffer_are_serde() {
        let ep = Endpoint { qp_num: 0x1234, psn: 0x42, lid: 0, gid: Gid([0xfe; 16]), mtu: Mtu::Mtu4096 };
        let rb = RemoteBuffer { addr: 0x7f00_0000_0000, len: 1 << 20, rkey: 0xabc };
        let s = serde_json::to_string(&(ep, rb)).unwrap();
        assert_eq!(serde_json::from_str::<(Endpoint, RemoteBuffer)>(&s).unwrap(), (ep, rb));
        assert!(serde_json::from_str::<Endpoint>(r#"{"qp_num":1,"psn":1,"lid":0,"gid":[0],"mtu":"Mtu4096"}"#).is_err());
    }
}
