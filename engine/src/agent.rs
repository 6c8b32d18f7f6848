//! The agent: one per process, owning its NICs, its registered memory,
//! its connections and its control listener. What each call does is
//! here; how (connections, transfers, broadcast, waiting) is in the
//! folders below it.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use gpudirect::GpuBuffer;
use gpudirect::{HostBuffer, MemoryRegion, Registerable};
use gpudirect::GpuPolicy;
use gpudirect::QpConfig;
use gpudirect::sync::Mutex;
use gpudirect::sysroot::SysRoot;
use gpudirect::topology::PathLevel;

use crate::cast::broadcast::Broadcast;
use crate::config::{AgentConfig, DEFAULT_LISTEN, MAX_QPS_PER_RAIL};
use crate::error::EngineError;
use crate::meta::{self, Rendezvous};
use crate::nics::nic::NicStats;
use crate::nics::ready::Readiness;
use crate::peers::events::PeerEvent;
use crate::peers::peer::{Peer, RemoteRange};
use crate::transfers::memory::{self, LocalRange, Registration};
use crate::transfers::stats::{BroadcastRefusals, TransferStats};
use crate::transfers::transfer::{Op, TransferRequest};
use crate::wire::auth::AuthError;
use crate::wire::desc::{AgentMetadata, MAX_NAME, MAX_NICS, SEAL_LEN};
use crate::wire::notify::{Notification, MAX_NOTIFICATION};
use crate::nics::nic::{Nic, NicSetup};
use crate::peers::conn::ConnPool;
use crate::transfers::core::Core;
use gpudirect::metrics::{MetricsEndpoint, Render};
use crate::metrics::snapshot::{self, AgentStats};
use crate::metrics::text::prometheus_text;
use crate::{cast, peers, transfers, wire};

/// A transfer engine agent: one per process, owning its NICs' verbs
/// objects, its registered memory, its connections and a control listener.
/// `Send + Sync`; share it by reference or `Arc`.
pub struct Agent {
    /// The state every thread shares (the engine's tests reach in).
    pub(crate) core: Arc<Core>,
    control: SocketAddr,
    /// Where the control listener is bound (its own address, for waking it).
    listen_addr: SocketAddr,
    gpu_path_limit: PathLevel,
    broadcast_chunk: u64,
    /// Set to stop the control listener; a lock, not an atomic, so that
    /// helgrind and drd see the hand-over (the valgrind build).
    stop: Arc<Mutex<bool>>,
    listener: Option<JoinHandle<()>>,
    /// The metrics endpoint, when configured.
    metrics: Option<MetricsEndpoint>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("name", &&*self.core.pool.name).field("control", &self.control).finish()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        *self.stop.lock() = true;
        // Now rather than at its next look (within half a second).
        crate::serve::wake_listener(self.listen_addr);
        if let Some(t) = self.listener.take() {
            let _ = t.join();
        }
    }
}

impl Agent {
    /// Opens the NIC, posts its notification receives and starts the
    /// control listener.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a bad name, zero depths, or no address
    /// to advertise; [`EngineError::Auth`] with
    /// [`AuthError::Unprotected`] for a network listen address without a
    /// cluster secret (nor `insecure`; the default address then binds
    /// loopback), [`AuthError::Secret`] for an
    /// unusable one; [`EngineError::Verbs`] opening the device or creating
    /// its queues; [`EngineError::Control`] binding the listener.
    pub fn new(mut config: AgentConfig) -> Result<Agent, EngineError> {
        meta::check_name(&config.name)?;
        // The default address is checked once the secret is known: without
        // one it binds loopback rather than refusing.
        let default = config.listen == DEFAULT_LISTEN;
        let key = wire::auth::Key::resolve(config.secret.as_ref(), config.insecure, "the control listener", (!default).then_some(config.listen.ip()))
            .map_err(|source| EngineError::Auth { peer: config.name.clone(), source })?;
        if default && !key.is_secret() && !config.insecure {
            config.listen = SocketAddr::from(([127, 0, 0, 1], 0));
            tracing::info!(
                agent = %config.name,
                "no cluster secret: the control listener is on loopback, for agents on this host only; for other hosts, give every agent and the rendezvous the same secret ({} naming a file of 32 random bytes, or AgentConfig::secret)",
                wire::auth::SECRET_FILE_ENV
            );
        }
        if config.send_depth < 2 || config.srq_depth == 0 || config.max_connections == 0 {
            return Err(EngineError::Config("send_depth must be at least 2, srq_depth and max_connections at least 1".into()));
        }
        if let Some(n) = config.qps_per_rail.filter(|&n| n == 0 || n as usize > MAX_QPS_PER_RAIL) {
            return Err(EngineError::Config(format!("qps_per_rail {n}: 1 to {MAX_QPS_PER_RAIL}")));
        }
        let setup = NicSetup {
            port: config.port,
            gid_index: config.gid_index,
            send_depth: config.send_depth,
            max_connections: config.max_connections,
            srq_depth: config.srq_depth,
            qps_per_rail: config.qps_per_rail,
        };
        let nics = match config.devices.as_slice() {
            [] => vec![Nic::open(None, &setup)?],
            names if names.len() > MAX_NICS => {
                return Err(EngineError::Config(format!("{} devices: an agent uses at most {MAX_NICS}", names.len())))
            }
            names => {
                if let Some((i, d)) = names.iter().enumerate().find(|(i, d)| names[..*i].contains(d)) {
                    return Err(EngineError::Config(format!("device {d:?} is listed twice (again at index {i})")));
                }
                names.iter().map(|d| Nic::open(Some(d), &setup)).collect::<Result<Vec<_>, _>>()?
            }
        };
        let nic = &nics[0];
        let ip = match (config.advertise, config.listen.ip()) {
            (Some(ip), _) => ip,
            (None, ip) if !ip.is_unspecified() => ip,
            (None, _) => match nic.desc.gid.to_ipv6().to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => {
                    return Err(EngineError::Config(format!(
                        "{}'s GID {} is not an IPv4 address: set AgentConfig::advertise to the address peers reach this host at",
                        nic.desc.device, nic.desc.gid
                    )))
                }
            },
        };
        let listener = TcpListener::bind(config.listen).map_err(|e| EngineError::Control {
            peer: config.name.clone(),
            source: gpudirect::bootstrap::BootstrapError::Io { op: format!("bind {}", config.listen), source: e },
        })?;
        let listen_addr = listener.local_addr().unwrap_or(config.listen);
        let port = listen_addr.port();
        // Notifications of many peers share one receive queue: a burst
        // larger than it finds no receive posted until the target's next
        // poll reposts. The longest receiver-not-ready timer (655 ms, the
        // IB encoding 0) lets a sender retry for about 4.6 s (7 tries)
        // before its transfer fails; a queue that never runs short never
        // waits for it. A dead peer still fails within retry_cnt's bound.
        let qp = QpConfig {
            port: config.port,
            gid_index: config.gid_index,
            max_send_wr: config.send_depth,
            max_send_sge: 1,
            min_rnr_timer: 0,
            ..QpConfig::default()
        };
        let control = SocketAddr::new(ip, port);
        let me = peers::control::Identity { name: config.name.clone(), instance: u64::from_be_bytes(wire::auth::random()) };
        let pool = Arc::new(ConnPool::new(me, key, control, nics, qp, config.timeout));
        let stop = Arc::new(Mutex::new(false));
        let thread = {
            let (pool, stop) = (pool.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("gpudirect-engine-{}", config.name))
                .spawn(move || peers::conn::serve(pool, listener, stop))
                .map_err(|e| EngineError::Config(format!("cannot start the control listener thread: {e}")))?
        };
        tracing::info!(agent = %config.name, %control, "engine agent started");
        let core = Arc::new_cyclic(|me| Core::new(pool, me.clone(), config.slice_threshold));
        let _ = core.relay.set(cast::relay::new());
        let mut agent = Agent { core, control, listen_addr, gpu_path_limit: config.gpu_path_limit, broadcast_chunk: config.broadcast_chunk, stop, listener: Some(thread), metrics: None };
        if let Some(addr) = config.metrics {
            // A weak handle: the endpoint never keeps the agent alive.
            let core = Arc::downgrade(&agent.core);
            let render: Render = Arc::new(move || core.upgrade().map(|c| prometheus_text(&snapshot::take(&c))).unwrap_or_default());
            agent.metrics = Some(MetricsEndpoint::start(addr, &config.name, render).map_err(|e| EngineError::Config(format!("the metrics endpoint at {addr}: {e}")))?);
        }
        Ok(agent)
    }

    /// The agent's name.
    pub fn name(&self) -> &str {
        &self.core.pool.name
    }

    /// Where peers reach its control listener.
    pub fn control_addr(&self) -> SocketAddr {
        self.control
    }

    fn add(&self, name: &str, regions: Vec<Option<MemoryRegion>>, skipped: Vec<(String, String)>, started: Instant) -> Result<Registration, EngineError> {
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(EngineError::Config(format!("memory name {name:?}: 1 to {MAX_NAME} bytes")));
        }
        let devices = self.core.pool.nics.iter().map(|n| n.desc.device.clone()).collect();
        let reg = Registration::new(name.to_owned(), regions, devices, skipped, started.elapsed());
        self.core.registry.add(&reg)?;
        tracing::info!(agent = self.name(), memory = name, bytes = reg.len(), took = ?reg.took(), "registered");
        Ok(reg)
    }

    fn check_name(&self, name: &str) -> Result<(), EngineError> {
        if self.core.registry.contains(name) {
            return Err(EngineError::DuplicateName(name.to_owned()));
        }
        Ok(())
    }

    /// Allocates `len` zeroed bytes of host memory and registers them
    /// under `name`, for peers to write and read.
    ///
    /// # Errors
    /// [`EngineError::DuplicateName`]; [`EngineError::Verbs`] from the
    /// allocation or registration (e.g. the locked-memory limit).
    pub fn alloc(&self, name: &str, len: usize) -> Result<Registration, EngineError> {
        self.register(name, HostBuffer::new(len)?)
    }

    /// Registers host memory the caller allocated under `name`, on every
    /// NIC of the agent.
    ///
    /// # Errors
    /// As [`alloc`](Self::alloc).
    pub fn register<B: Registerable>(&self, name: &str, buf: B) -> Result<Registration, EngineError> {
        let started = Instant::now();
        self.check_name(name)?;
        let regions = memory::register_host(&self.core.pool.nics, buf)?;
        self.add(name, regions, Vec::new(), started)
    }

    /// Registers GPU memory under `name` on the agent's NICs nearest its
    /// GPU, each NIC's path judged on its own under `policy`:
    ///
    /// - The NICs: those at the shortest PCIe distance from the GPU among
    ///   the agent's (two NICs under the GPU's switch both carry it, and
    ///   large requests are sliced across them), within
    ///   [`AgentConfig::gpu_path_limit`]. Farther NICs, software NICs
    ///   (rxe, siw) and NICs beyond the limit are skipped, each with its
    ///   reason ([`Registration::skipped`]). When the topology cannot
    ///   place the GPU (no sysfs entry), every NIC is tried, with a warning.
    /// - [`GpuPolicy::Require`] (the default): zero-copy on every chosen
    ///   NIC, or an error naming the NIC, the cause and the fix.
    /// - `Prefer`: a chosen NIC that cannot register it zero-copy is
    ///   skipped (logged and reported); when none can, or none is near
    ///   enough, the memory is host-staged through the nearest NIC, with a
    ///   warning.
    /// - `HostStaged`: staged through the nearest NIC only (one mirror).
    ///
    /// Host-staged memory is the local side of transfers only (the source
    /// of writes, the destination of reads) and is left out of the
    /// agent's metadata: a peer's one-sided access would reach its host
    /// mirror, not the GPU ([`Registration::is_targetable`]).
    ///
    /// [`Registration::paths`] says which path each NIC got.
    ///
    /// # Errors
    /// [`EngineError::GpuPlacement`] when no NIC is near enough (or can
    /// reach GPU memory at all) under `Require`; [`EngineError::Verbs`]
    /// with [`Error::Gdr`](gpudirect::Error::Gdr) when a chosen NIC cannot
    /// register it zero-copy under `Require`, and the errors of
    /// [`MemoryRegion::register_gpu`]; [`EngineError::DuplicateName`].
    pub fn register_gpu(&self, name: &str, buf: GpuBuffer, policy: GpuPolicy) -> Result<Registration, EngineError> {
        self.register_gpu_at(name, buf, policy, &SysRoot::live())
    }

    fn register_gpu_at(&self, name: &str, buf: GpuBuffer, policy: GpuPolicy, root: &SysRoot) -> Result<Registration, EngineError> {
        let started = Instant::now();
        self.check_name(name)?;
        let (regions, skipped) = memory::register_gpu(&self.core.pool.nics, self.name(), name, buf, policy, root, self.gpu_path_limit)?;
        self.add(name, regions, skipped, started)
    }

    /// The registration named `name`, as the call that registered it
    /// returned it: the one registry of this agent's memory, so a program
    /// (or a binding) need not keep its own.
    ///
    /// # Errors
    /// [`EngineError::UnknownMemory`] when nothing is registered under it.
    pub fn registration(&self, name: &str) -> Result<Registration, EngineError> {
        self.core.registry.get(name).ok_or_else(|| EngineError::UnknownMemory { peer: self.name().to_owned(), name: name.to_owned() })
    }

    /// Takes the registration named `name` out of this agent's metadata.
    /// Its memory is deregistered once nothing names it any more (its
    /// [`Registration`] handles, ranges and transfer requests); peers that
    /// still target it get a remote access error on their side.
    ///
    /// # Errors
    /// [`EngineError::UnknownMemory`] when nothing is registered under it.
    pub fn deregister(&self, name: &str) -> Result<(), EngineError> {
        if !self.core.registry.remove(name) {
            return Err(EngineError::UnknownMemory { peer: self.name().to_owned(), name: name.to_owned() });
        }
        Ok(())
    }

    /// This agent's metadata now: its name, this run's instance, control
    /// address, NICs and live registrations, sealed with the cluster's
    /// secret. Give it ([`AgentMetadata::encode`]) to every peer that
    /// targets this agent; again after registering more.
    pub fn metadata(&self) -> AgentMetadata {
        let mut md = AgentMetadata {
            name: self.name().to_owned(),
            instance: self.core.pool.instance,
            control: self.control,
            nics: self.core.pool.nics.iter().map(|n| n.desc.clone()).collect(),
            memories: self.core.registry.descs(),
            seal: [0; SEAL_LEN],
        };
        // What the engine made encodes (its names and counts are checked
        // where they enter); unsealed metadata would be refused by peers.
        if let Ok(bytes) = md.encode_sealed_part() {
            md.seal = self.core.pool.key.tag(wire::auth::Label::Metadata, &[&bytes]);
        }
        md
    }

    /// Learns a peer from its metadata, once its seal proves an agent
    /// holding the cluster's secret made it, replacing what was known of
    /// it: new transfers use the new metadata. When it is another run of
    /// the peer (a new [`AgentMetadata::instance`]: it restarted), the
    /// connections to the old run are retired first, so the next
    /// transfer goes to the new process.
    ///
    /// # Errors
    /// [`EngineError::Config`] for this agent's own metadata;
    /// [`EngineError::Auth`] with [`AuthError::BadProof`] when the seal
    /// does not verify (another secret, none, or changed after sealing).
    pub fn load_remote(&self, md: &AgentMetadata) -> Result<Peer, EngineError> {
        if md.name == self.name() {
            return Err(EngineError::Config(format!("the metadata loaded is this agent's own ({:?})", md.name)));
        }
        let pool = &self.core.pool;
        let sealed = md.encode_sealed_part().is_ok_and(|b| pool.key.verify(wire::auth::Label::Metadata, &[&b], &md.seal));
        if !sealed {
            self.core.metadata_seal.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let what = format!("the seal of the metadata of {:?}", md.name);
            return Err(EngineError::Auth { peer: md.name.clone(), source: AuthError::BadProof { what } });
        }
        let md = Arc::new(md.clone());
        let before = pool.loaded.lock().insert(md.name.clone(), md.clone()).map(|b| b.instance);
        let retired = pool.retire_unlike(&md);
        if let Some(old) = retired.or(before).filter(|&old| old != md.instance) {
            pool.replaced(&md.name, old, md.instance);
        }
        Ok(Peer { md })
    }

    /// Publishes this agent's metadata now in `rendezvous` (again after
    /// registering more).
    ///
    /// # Errors
    /// As [`Rendezvous::publish`].
    pub fn publish(&self, rendezvous: &dyn Rendezvous) -> Result<(), EngineError> {
        rendezvous.publish(&self.metadata())
    }

    /// Looks the agent `name` up in `rendezvous` (waiting up to `timeout`
    /// for it to be published) and loads it, as
    /// [`load_remote`](Self::load_remote). Peers loaded stay known when the
    /// rendezvous goes away: [`peer`](Self::peer) needs no lookup.
    ///
    /// # Errors
    /// As [`Rendezvous::lookup`] and [`load_remote`](Self::load_remote).
    pub fn lookup(&self, name: &str, rendezvous: &dyn Rendezvous, timeout: Duration) -> Result<Peer, EngineError> {
        self.load_remote(&rendezvous.lookup(name, timeout)?)
    }

    /// The lookup and load of [`lookup`](Self::lookup), awaited (feature
    /// `tokio`): the lookup, which may wait up to `timeout`, runs on
    /// tokio's blocking pool, so no worker thread waits for it.
    ///
    /// # Errors
    /// As [`lookup`](Self::lookup); [`EngineError::Config`] outside a
    /// tokio runtime.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn lookup_async(&self, name: &str, rendezvous: Arc<dyn Rendezvous>, timeout: Duration) -> Result<Peer, EngineError> {
        let n = name.to_owned();
        let md = blocking(move || rendezvous.lookup(&n, timeout)).await?;
        self.load_remote(&md)
    }

    /// Sets up the connections to `peer` now, on every rail both have
    /// (this agent's NIC `i` to the peer's NIC `i`), instead of at the
    /// first post: afterwards a post to it waits on nothing but room in
    /// its send queue. Connections there already are kept.
    ///
    /// # Errors
    /// The connection errors of [`TransferRequest::post`].
    pub fn connect(&self, peer: &Peer) -> Result<(), EngineError> {
        connect_rails(&self.core.pool, &peer.md)
    }

    /// [`connect`](Self::connect), awaited (feature `tokio`): the setup,
    /// which may take up to [`AgentConfig::timeout`] per rail against a
    /// peer that does not answer, runs on tokio's blocking pool.
    ///
    /// # Errors
    /// As [`connect`](Self::connect); [`EngineError::Config`] outside a
    /// tokio runtime.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn connect_async(&self, peer: &Peer) -> Result<(), EngineError> {
        let (pool, md) = (self.core.pool.clone(), peer.md.clone());
        blocking(move || connect_rails(&pool, &md)).await
    }

    /// A peer loaded before.
    ///
    /// # Errors
    /// [`EngineError::UnknownPeer`].
    pub fn peer(&self, name: &str) -> Result<Peer, EngineError> {
        self.core.peer(name)
    }

    /// Prepares a transfer of `entries`, each a local range and a range of
    /// one peer's memory of the same length, and after them, if given, the
    /// notification `notify` for the peer. Nothing is sent until
    /// [`TransferRequest::post`].
    ///
    /// Which rails (pairs of this agent's NIC `i` and the peer's NIC `i`)
    /// carry it is decided here, once: every rail on which both ends
    /// registered all of its memory is usable; a request of
    /// [`AgentConfig::slice_threshold`] bytes or more is cut into equal
    /// slices, one per queue pair of every usable rail
    /// ([`AgentConfig::qps_per_rail`]), a smaller one takes the next
    /// queue pair in turn. A notification after a write on one queue pair
    /// follows the writes on it; after a sliced write, or after a read, it
    /// is sent once the initiator has reaped every slice's completion (RC
    /// acknowledges a write once it is placed), one round trip later.
    ///
    /// # Errors
    /// [`EngineError::EmptyRequest`], [`EngineError::LengthMismatch`],
    /// [`EngineError::MixedPeers`], [`EngineError::NotificationTooLong`];
    /// [`EngineError::NoRail`] when no rail reaches all the memory;
    /// [`EngineError::Verbs`] registering the notification.
    pub fn prepare(&self, op: Op, entries: &[(LocalRange, RemoteRange)], notify: Option<&[u8]>) -> Result<TransferRequest, EngineError> {
        if let Some(msg) = notify.filter(|m| m.len() > MAX_NOTIFICATION) {
            return Err(EngineError::NotificationTooLong { len: msg.len(), max: MAX_NOTIFICATION });
        }
        transfers::transfer::prepare(&self.core, op, entries, notify.map(wire::notify::encode))
    }

    /// Prepares a broadcast of `source` into every range of `targets`
    /// (one per receiver agent, each as long as `source`), each receiver
    /// notified `notify` once its copy is whole. The source's NIC sends
    /// each byte about once: receivers forward chunks to each other as
    /// they land ([`Broadcast`] says how, and what every agent of it must
    /// do). Nothing is sent until [`Broadcast::post`].
    ///
    /// # Errors
    /// [`EngineError::EmptyRequest`] (no receiver, or nothing to send),
    /// [`EngineError::LengthMismatch`]; [`EngineError::Config`] for more
    /// than [`MAX_BROADCAST_TARGETS`](crate::MAX_BROADCAST_TARGETS) receivers, one named twice or this
    /// agent; [`EngineError::NotificationTooLong`] when the plan every
    /// chunk message carries (the receivers' and memory names, `notify`)
    /// exceeds a 1 KiB receive slot.
    pub fn broadcast(&self, source: &LocalRange, targets: &[RemoteRange], notify: &[u8]) -> Result<Broadcast, EngineError> {
        cast::broadcast::prepare(&self.core, source, targets, notify, self.broadcast_chunk)
    }

    /// What the agent did so far, in one snapshot: per NIC, direction
    /// and path the bytes moved; per op the requests and their
    /// latencies; the busiest peers; what it refused. Taking one holds
    /// no lock the data path takes. The metrics endpoint
    /// ([`AgentConfig::metrics`]) serves the same, rendered.
    pub fn stats(&self) -> AgentStats {
        snapshot::take(&self.core)
    }

    /// Where the metrics endpoint listens, when there is one
    /// ([`AgentConfig::metrics`]; its port, when 0 was asked for).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::addr)
    }

    /// What each NIC carried so far, in the agent's NIC order.
    pub fn nic_stats(&self) -> Vec<NicStats> {
        self.core.pool.nics.iter().map(Nic::stats).collect()
    }

    /// What every request to the peer `name` did so far (summed over
    /// them, dropped ones included); `None` before one was prepared.
    pub fn peer_stats(&self, name: &str) -> Option<TransferStats> {
        self.core.peer_stats(name)
    }

    /// Every notification received so far (none waits).
    ///
    /// # Errors
    /// [`EngineError::Verbs`] from polling or reposting receives, or from
    /// the GPU flush.
    pub fn notifications(&self) -> Result<Vec<Notification>, EngineError> {
        self.core.notifications()
    }

    /// The next notification, waiting up to `timeout` (`None`: no limit).
    ///
    /// # Errors
    /// [`EngineError::Timeout`]; as [`notifications`](Self::notifications).
    pub fn wait_notification(&self, timeout: Option<Duration>) -> Result<Notification, EngineError> {
        self.core.wait_notification(timeout)
    }

    /// The next notification, awaited (feature `tokio`): as
    /// [`wait_notification`](Self::wait_notification) without blocking a
    /// thread. Cancel-safe: a future dropped before it is ready takes
    /// nothing, and the notification goes to the next call. For a bound,
    /// wrap it in `tokio::time::timeout`.
    ///
    /// The agent's completion channels are registered with the runtime
    /// of its first await (`notification` or
    /// [`TransferRequest::completed`]); await one agent from one runtime.
    ///
    /// # Errors
    /// As [`notifications`](Self::notifications); [`EngineError::Verbs`]
    /// outside a tokio runtime with I/O enabled; [`EngineError::Config`]
    /// from a runtime other than the first.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub async fn notification(&self) -> Result<Notification, EngineError> {
        self.core.notification().await
    }

    /// The descriptor an event loop waits on for this agent's requests
    /// and notifications (made on first use; one per agent). With
    /// [`poll_notification`](Self::poll_notification) and
    /// [`TransferRequest::poll_completed`], any loop that watches a file
    /// descriptor (asyncio, mio, epoll) waits for the engine without a
    /// thread and without spinning; the Python package's `await` is this.
    ///
    /// # Errors
    /// [`EngineError::Verbs`] when the epoll set or eventfd cannot be made.
    pub fn readiness(&self) -> Result<&Readiness, EngineError> {
        self.core.readiness()
    }

    /// The next notification if one is here, never waiting. `None` arms
    /// [`readiness`](Self::readiness): it turns readable when one may
    /// have arrived; then [`Readiness::clear`] and poll again.
    ///
    /// # Errors
    /// As [`notifications`](Self::notifications); as
    /// [`readiness`](Self::readiness).
    pub fn poll_notification(&self) -> Result<Option<Notification>, EngineError> {
        self.core.poll_note()
    }

    /// Connections alive now (set up by either side).
    pub fn connections(&self) -> usize {
        self.core.pool.connections()
    }

    /// What happened to peers since the last call, oldest first: a
    /// connection lost ([`PeerEvent::Lost`]), a peer restarted
    /// ([`PeerEvent::Replaced`]), a name claimed by another member
    /// ([`PeerEvent::Impostor`]), and how many events were dropped
    /// unread (at most [`MAX_PEER_EVENTS`](crate::MAX_PEER_EVENTS) are kept).
    pub fn peer_events(&self) -> (Vec<PeerEvent>, u64) {
        self.core.pool.events.lock().take()
    }

    /// Control requests this agent refused so far: unproven (no secret,
    /// another one, a replay), not matching the metadata loaded for the
    /// name they claim, or malformed. Each is also logged with its reason.
    pub fn refused_requests(&self) -> u64 {
        self.core.pool.refused()
    }

    /// Broadcast messages this agent refused so far, by reason: what a
    /// member holding the secret sent that no honest source or receiver
    /// sends (forged or inconsistent plans, chunks from agents that do not
    /// own them, memory never published), and starts it could not take.
    /// Each is also logged with the peer and its reason.
    pub fn broadcast_refusals(&self) -> BroadcastRefusals {
        self.core.cast_refusals.read()
    }
}

/// Connections from each of this agent's NICs to the peer's of the same
/// index, every queue pair of each rail, made where missing.
fn connect_rails(pool: &ConnPool, md: &AgentMetadata) -> Result<(), EngineError> {
    for rail in 0..pool.nics.len().min(md.nics.len()) {
        for qp in 0..pool.nics[rail].qps {
            pool.get(md, (rail, rail, qp))?;
        }
    }
    Ok(())
}

/// Runs `f` on tokio's blocking pool and awaits it.
#[cfg(feature = "tokio")]
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, EngineError> + Send + 'static) -> Result<T, EngineError> {
    let handle = tokio::runtime::Handle::try_current().map_err(|e| EngineError::Config(format!("awaiting this needs a tokio runtime ({e})")))?;
    handle.spawn_blocking(f).await.map_err(|e| EngineError::Config(format!("the blocking task failed: {e}")))?
}


