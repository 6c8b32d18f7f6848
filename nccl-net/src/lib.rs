//! NCCL's network plugin over gpudirect: `libnccl-net-gpudirect.so`.
//!
//! NCCL carries most GPU network traffic, and where GPUDirect RDMA is not
//! available between a GPU and its NIC it stages that GPU's traffic
//! through host memory, at about half the bandwidth, and says so only in
//! a line of `NCCL_DEBUG=INFO` output. This plugin carries NCCL's traffic
//! over RDMA through the gpudirect library and, by default, refuses to
//! stage: a GPU's connection that NCCL set up in host memory fails before
//! its first byte, with the GPU, the NIC, the cause and the fix in NCCL's
//! log.
//!
//! # Enabling it
//! Build with `cargo build --release -p gpudirect-nccl-net`, then either
//! point NCCL at the file, or install it under the name NCCL looks for:
//!
//! ```text
//! NCCL_NET_PLUGIN=/path/to/target/release/libnccl_net_gpudirect.so NCCL_NET=GPUDirect ...
//! # or: cp target/release/libnccl_net_gpudirect.so /usr/local/lib/libnccl-net-gpudirect.so
//! NCCL_NET_PLUGIN=gpudirect NCCL_NET=GPUDirect ...
//! ```
//!
//! With `NCCL_NET=GPUDirect` a plugin that cannot start stops NCCL
//! ("Failed to initialize any NET plugin") instead of NCCL falling back to
//! its own transports; without it NCCL may choose another network.
//!
//! # Policy: `GPUDIRECT_NCCL_GDR`
//! - `require` (the default): a connection set up by a thread with a
//!   current GPU whose buffers NCCL registered in host memory only is
//!   refused at its first transfer (NCCL fails with `ncclInvalidUsage`,
//!   the WARN line says why).
//! - `prefer`: it runs, with one WARN line naming the pair and the cause.
//! - `off`: it runs; the INFO path line still tells.
//!
//! A NIC advertises GPU memory (`NCCL_PTR_CUDA`, `NCCL_PTR_DMABUF`) only
//! where the library's judge finds a zero-copy path to some GPU; GPU
//! memory is registered under the library's `GpuPolicy::Require`, so a
//! registration that cannot be zero-copy fails with the judge's causes.
//!
//! # What a peer can reach: `GPUDIRECT_NCCL_KEYS`
//! Only what it was offered, with write access only (see the `comm`
//! module): a protection domain per comm (`regIsGlobal` 0), no remote
//! read, and, where the device has type-2 memory windows (`windows`, the
//! default), a window per receive, invalidated before `test` reports it
//! done, with NCCL's registrations granting no remote access of their own.
//! `per-comm` uses the comm's registrations as keys even there. Any other
//! value stops init, naming it. Every size, slot and count a peer writes
//! is checked against what was posted.
//!
//! # What the log says
//! At init (INFO, `NCCL_DEBUG_SUBSYS` INIT or NET), one line per device:
//! `NET/GPUDirect : Using mlx5_0:1/RoCE speed 400000 Mb/s, GPUDirect RDMA: GPU0 dma-buf (PIX), ...; keys per receive (...)`,
//! the last part what a receive's key opens on that device.
//! At each connection's first transfer (INFO, NET):
//! `NET/GPUDirect : GPU2 -> mlx5_3:1: GPUDirect RDMA via dma-buf`, or
//! `... staged through host memory: CAUSE`. When a device's last
//! connection closes, and at finalize:
//! `NET/GPUDirect : mlx5_3:1: sent N B from GPU memory, N B from host memory; received ...`.
//! `gpudirect nccl-log` reads these lines.
//!
//! # Metrics: `GPUDIRECT_METRICS`
//! `PORT` (on loopback) or `IP:PORT`: the plugin serves its counters
//! ([`stats`]) in Prometheus' text format there, from a thread of its own
//! (`gpudirect::metrics::MetricsEndpoint`, with its bounds), started at
//! the first init and said in an init line. Bytes are counted per device
//! and direction by path: `gdr` for GPU memory NCCL registered, `host` for
//! host memory on a connection with no GPU, `staged` for the host memory
//! of a connection judged staged ([`data_path`]). A port that cannot be
//! bound stops init, naming it.
//!
//! # NCCL's variables it honours
//! `NCCL_IB_HCA` (NCCL's syntax: prefixes, `=` exact, `^` exclude,
//! `:port`), `NCCL_IB_GID_INDEX` (otherwise the library's RoCE v2 choice),
//! `NCCL_IB_TC` (a v10+ communicator's traffic class wins), `NCCL_IB_SL`,
//! `NCCL_IB_TIMEOUT`, `NCCL_IB_RETRY_CNT`; `NCCL_NET_GDR_LEVEL` and
//! `NCCL_NET_GDR_READ` are read to explain a staged connection.
//!
//! # Bounds
//! See the `comm` and `setup` modules: 32 requests per comm (NCCL's
//! limit), 8 receives per group, 1 GiB per message, setup deadlines,
//! unproven connections on a budget of their own (per source address and
//! in all) that a rank's connection never waits behind, a dead peer found
//! within the queue pair's retry bound, malformed, stale and copied
//! handles refused, and no panic crosses into NCCL. The byte layouts a
//! peer sees are the `wire` module.

#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

pub mod abi;
mod comm;
mod config;
mod error;
mod ffi;
mod log;
mod reg;
mod setup;
mod site;
mod stats;
mod verdict;
pub mod wire;

pub use config::{Config, GdrPolicy, KeysChoice};
pub use error::NetError;
pub use ffi::{ncclNetPlugin_v10, ncclNetPlugin_v11, ncclNetPlugin_v8, ncclNetPlugin_v9, stats};
pub use stats::{prometheus_text, NicStats, PluginStats, AGENT_LABEL};
pub use log::PREFIX as LOG_PREFIX;
pub use setup::MAX_PROVEN;
pub use verdict::{data_path, decide, judge, ptr_support, Action, ConnPath, PairJudgement, Seen, Side};
