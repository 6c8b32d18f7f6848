//! An agent's settings: plain data, with the defaults in one place.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use gpudirect::topology::PathLevel;

use crate::wire::auth::ClusterSecret;

/// Most queue pairs one rail may carry to one peer
/// ([`AgentConfig::qps_per_rail`]).
pub const MAX_QPS_PER_RAIL: usize = 8;

/// An agent's settings. [`named`](Self::named) gives the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentConfig {
    /// The agent's name, unique among the agents that talk to each other.
    pub name: String,
    /// The RDMA devices to use, in rail order: a transfer goes from this
    /// agent's NIC `i` to the peer's NIC `i`, so agents list the NICs of
    /// one network (rail) at the same index. Empty: the first device.
    pub devices: Vec<String>,
    /// Requests of at least this many bytes are sliced evenly across every
    /// rail that reaches their memory on both ends; smaller ones go whole
    /// on one rail, the agent's requests taking the rails in turn.
    pub slice_threshold: u64,
    /// Queue pairs each rail carries to each peer: a sliced request's
    /// slices are striped over them (rails × queue pairs), and smaller
    /// requests take them in turn. One RC queue pair is served by one
    /// engine of the NIC in order; on a ConnectX-7 at 400 Gb/s perftest
    /// measures about 91 % of line rate for one queue pair's RDMA writes
    /// (80 % for reads) and about 98 % for two. `None` (the default): 2 on
    /// a hardware NIC, 1 on a software one (rxe, siw: there a second
    /// queue pair only adds kernel work on the same CPUs). At most
    /// [`MAX_QPS_PER_RAIL`]. Each queue pair counts against
    /// [`max_connections`](Self::max_connections).
    pub qps_per_rail: Option<u8>,
    /// Chunk size of broadcasts ([`Agent::broadcast`](super::Agent::broadcast)):
    /// each receiver forwards a chunk once it landed whole, so smaller
    /// chunks start the forwarding sooner, at one message and one
    /// completion per chunk and receiver.
    pub broadcast_chunk: u64,
    /// Port number on each device (from 1).
    pub port: u8,
    /// GID index override; `None` chooses as [`choose_gid`](gpudirect::choose_gid) does.
    pub gid_index: Option<u32>,
    /// Where the control listener binds. Port 0 picks a free one. The
    /// default, [`DEFAULT_LISTEN`] (any address, a free port), binds
    /// loopback instead when the agent has no cluster secret (nor
    /// `insecure`): one host works out of the box, and a log line at
    /// `info` says how to reach other hosts (a secret, then any address
    /// or a network one). Any other network address without a secret is
    /// refused ([`AuthError::Unprotected`](super::AuthError::Unprotected)).
    pub listen: SocketAddr,
    /// The address peers reach the control listener at. `None`: the
    /// listen address, or, when that is unspecified (`0.0.0.0`), the IPv4
    /// address of the NIC's RoCE GID (on InfiniBand, set it).
    pub advertise: Option<IpAddr>,
    /// Send queue depth of each connection.
    pub send_depth: u32,
    /// Notification receives kept posted per NIC, shared by every peer.
    pub srq_depth: u32,
    /// Connections the agent may hold per NIC (sizes its completion
    /// queue); at the limit the least recently used idle one is evicted.
    pub max_connections: usize,
    /// Bound on a connection setup and on waiting for send-queue room.
    pub timeout: Duration,
    /// The farthest PCIe path GPU memory is registered over, in NCCL's
    /// sense (as `NCCL_NET_GDR_LEVEL`): GPU memory goes on the NICs
    /// nearest its GPU, and only while they are this near. Farther, under
    /// [`GpuPolicy::Require`](gpudirect::GpuPolicy::Require) registration fails naming the path; under
    /// `Prefer` it is host-staged, and says so.
    pub gpu_path_limit: PathLevel,
    /// The cluster's secret, the same on every agent of the job: peers
    /// prove they hold it before they get a queue pair, and metadata
    /// sealed with it is the only kind [`Agent::load_remote`](super::Agent::load_remote) takes.
    /// `None`: the secret in the file named by `GPUDIRECT_SECRET_FILE`
    /// (or the text of `GPUDIRECT_SECRET`), else none, which is allowed
    /// only with a loopback [`listen`](Self::listen) address or
    /// [`insecure`](Self::insecure).
    pub secret: Option<ClusterSecret>,
    /// Listen on a network address without a secret. Anyone who reaches
    /// the control port can then take a peer's name, and with it read and
    /// write every memory region in this agent's metadata: for a
    /// private test network only.
    pub insecure: bool,
    /// Where to serve the agent's metrics (Prometheus' text format over
    /// HTTP, GET `/metrics`), from threads of its own; `None` (the
    /// default): not served. A snapshot holds counts and the names of the
    /// agent, its NICs and peers, never a secret or a memory address;
    /// still, give a loopback address unless the scraper runs elsewhere.
    /// [`metrics_addr`] reads `GPUDIRECT_METRICS` the way the tools do.
    pub metrics: Option<SocketAddr>,
}

/// Where [`METRICS_ENV`](gpudirect::metrics::METRICS_ENV) asks for the metrics: `None` when unset or
/// empty, a port alone on loopback.
///
/// # Errors
/// [`EngineError::Config`](crate::EngineError::Config) naming the value
/// when it is neither a port nor `HOST:PORT` with an IP address.
pub fn metrics_addr() -> Result<Option<SocketAddr>, crate::EngineError> {
    gpudirect::metrics::metrics_addr_from_env().map_err(crate::EngineError::Config)
}

/// `v` as [`METRICS_ENV`](gpudirect::metrics::METRICS_ENV) takes it: a port alone (digits only) on
/// loopback, or `IP:PORT`.
///
/// # Errors
/// [`EngineError::Config`](crate::EngineError::Config) naming the value
/// otherwise.
pub fn parse_metrics_addr(v: &str) -> Result<SocketAddr, crate::EngineError> {
    gpudirect::metrics::parse_metrics_addr(v).map_err(crate::EngineError::Config)
}

impl AgentConfig {
    /// The defaults for an agent named `name`: the first RDMA device,
    /// requests of 256 KiB and more sliced across rails, two queue pairs
    /// per rail on hardware NICs (one on rxe/siw), broadcasts in 1 MiB
    /// chunks, port 1, a control
    /// listener on any address (loopback without a secret) and a free port, 128-deep send queues, 256 notification slots, 64 connections, 30 s setup
    /// bound, GPU memory over paths up to PXB (NCCL's default), the
    /// cluster secret from the environment (see [`secret`](Self::secret)).
    pub fn named(name: impl Into<String>) -> AgentConfig {
        AgentConfig {
            name: name.into(),
            devices: Vec::new(),
            slice_threshold: 256 << 10,
            qps_per_rail: None,
            broadcast_chunk: 1 << 20,
            port: 1,
            gid_index: None,
            listen: DEFAULT_LISTEN,
            advertise: None,
            send_depth: 128,
            srq_depth: 256,
            max_connections: 64,
            timeout: Duration::from_secs(30),
            gpu_path_limit: PathLevel::Pxb,
            secret: None,
            insecure: false,
            metrics: None,
        }
    }
}

/// [`AgentConfig::listen`]'s default: any address, a free port (loopback
/// for an agent without a cluster secret).
pub const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);
