// The engine's manual (what it is, its guarantees, threads, broadcast,
// connections, GPU memory) is one file, rendered as the crate's docs: the
// one place the engine's guarantees are written.
#![doc = include_str!("manual.md")]
#![warn(missing_docs)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
// By concern: the agent and its configuration here; who it talks to
// (`peers/`), moving bytes (`transfers/`), one range to many (`cast/`),
// waiting from async code (`waiting/`), finding peers (`meta/`).
// The README's example (what crates.io shows) compiles as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

mod agent;
mod cast;
mod config;
mod error;
mod meta;
mod metrics;
mod peers;
mod serve;
mod nics;
mod transfers;
mod waiting;
mod wire;
#[cfg(test)]
mod device_tests;

pub use agent::Agent;
pub use cast::broadcast::{Broadcast, ReceiverStatus, PROBE_EVERY};
pub use wire::castmsg::MAX_BROADCAST_TARGETS;
pub use config::{metrics_addr, parse_metrics_addr, AgentConfig, DEFAULT_LISTEN, MAX_QPS_PER_RAIL};
pub use gpudirect::metrics::METRICS_ENV;
pub use gpudirect::metrics::{DataPath, Direction, Histogram, PathTraffic, LATENCY_BOUNDS, LATENCY_SAMPLE};
pub use gpudirect::metrics::{ACCEPTS_PER_SEC, ACCEPT_BURST, MAX_CONNECTIONS, MAX_REQUEST, MIN_SILENT_AGE, RENDER_EVERY, SCRAPE_TIMEOUT};
pub use metrics::snapshot::{AgentStats, NicTraffic, OpStats, OtherPeers, PeerEventCounts, PeerStats, Refusals, MAX_LISTED_PEERS};
pub use metrics::text::prometheus_text;
pub use gpudirect::metrics::PROMETHEUS_CONTENT_TYPE;
pub use wire::auth::{AuthError, ClusterSecret, MIN_SECRET, SECRET_ENV, SECRET_FILE_ENV};
pub use wire::desc::{AgentMetadata, MemoryDesc, MetadataError, NicDesc, MAX_MEMORIES, MAX_METADATA, MAX_NAME, MAX_NICS, METADATA_MAGIC, METADATA_VERSION, SEAL_LEN};
pub use error::EngineError;
pub use peers::events::{PeerEvent, MAX_PEER_EVENTS};
pub use transfers::memory::{LocalRange, Registration};
#[cfg(feature = "etcd")]
#[cfg_attr(docsrs, doc(cfg(feature = "etcd")))]
pub use meta::{EtcdRendezvous, DEFAULT_BOARD_PREFIX, DEFAULT_PREFIX};
pub use meta::{posting_name_ok, Board, Posting, MAX_POSTING, MAX_POSTING_NAME, MAX_TOPIC};
pub use meta::{Rendezvous, RendezvousConfig, RendezvousServer, TcpRendezvous, MAX_ENTRIES};
pub use nics::nic::NicStats;
pub use wire::notify::{Notification, MAX_NOTIFICATION};
pub use nics::ready::Readiness;
pub use peers::peer::{Peer, RemoteMemory, RemoteRange};
pub use transfers::stats::{BroadcastRefusals, TransferStats};
pub use transfers::transfer::{Op, TransferRequest, TransferStatus};

#[cfg(test)]
mod tests {
    /// The engine's handles are meant to be shared across threads.
    #[test]
    fn handles_are_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<super::Agent>();
        check::<super::TransferRequest>();
        check::<super::Registration>();
        check::<super::EngineError>();
    }
}
