//! etcd as the rendezvous (feature `etcd`): each agent's metadata blob is
//! one key, `<prefix><name>`, in an etcd v3 cluster, through the
//! `etcd-client` crate (gRPC). For jobs that already run etcd, as
//! Mooncake's and NIXL's deployments do; the embedded
//! [`TcpRendezvous`](super::TcpRendezvous) needs nothing installed.
//!
//! The trait is blocking and may be called from any thread, inside an
//! async runtime too, so the client lives on a runtime of its own (one
//! worker thread): a call hands its future to that runtime and waits on a
//! channel, never `block_on`, which panics inside another runtime. Every
//! call is bounded: each RPC by the timeout given to
//! [`EtcdRendezvous::connect`], a lookup by its own wait plus one RPC.
//!
//! With [`EtcdRendezvous::with_lease`], what a handle publishes lives
//! under one etcd lease that a task of its runtime keeps alive: when the
//! process dies (or drops the handle) the keys expire a TTL later, so a
//! crashed agent's metadata does not stay behind for peers to find.
//!
//! A lookup of a name not yet published reads the key, then watches it
//! from the revision of that read, so a publish between the two is seen
//! and the wait is not a polling loop. Values are decoded as hostile
//! input (anyone with access to the cluster can write them).
//!
//! Postings ([`Board`](super::Board), in `postings`) are keys
//! `<board prefix><topic>/<name>`, each value the blob and its seal
//! (`sealed`): the cluster's secret over the topic, the name, the bytes,
//! the poster's name for itself, the time, and the key's creation
//! revision, version and lease, so a value stands only where and when it
//! was put. A post is a transaction on the key's last revision: it
//! replaces only its own poster's value, and over another poster's leaves
//! a conflict naming both. A fetch believes only a value whose seal
//! verifies and that stands where it was sealed, so a writer without the
//! secret can neither make one, nor move a sealed value under another
//! name, nor put an old one back; without a secret at hand postings are
//! refused, not left unsealed.

use std::future::Future;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use etcd_client::{Client, ConnectOptions, EventType, PutOptions, WatchOptions};

use gpudirect::sync::Mutex;

use crate::wire::auth::{AuthError, ClusterSecret, Key, SECRET_FILE_ENV};
use crate::wire::desc::AgentMetadata;
use crate::error::EngineError;
use super::sealed::poster_name;
use super::{check_name, decode_for, rdv_err, Rendezvous};

mod postings;

/// The key prefix agents publish under unless told otherwise
/// ([`EtcdRendezvous::with_prefix`]).
pub const DEFAULT_PREFIX: &str = "/gpudirect/agents/";
/// The key prefix postings go under unless told otherwise
/// ([`EtcdRendezvous::with_board_prefix`]).
pub const DEFAULT_BOARD_PREFIX: &str = "/gpudirect/board/";

/// A rendezvous in an etcd cluster. Cheap to share: `Send + Sync`, one
/// handle serves every thread of a process.
///
/// ```no_run
/// # fn main() -> Result<(), gpudirect_engine::EngineError> {
/// use std::time::Duration;
/// use gpudirect_engine::{Agent, AgentConfig, EtcdRendezvous};
///
/// let etcd = EtcdRendezvous::connect(&["http://10.0.0.1:2379"], Duration::from_secs(2))?
///     .with_prefix("/job-42/agents/");
/// let agent = Agent::new(AgentConfig::named("prefill-0"))?;
/// agent.publish(&etcd)?;
/// let decode = agent.lookup("decode-0", &etcd, Duration::from_secs(30))?;
/// # let _ = decode; Ok(()) }
/// ```
pub struct EtcdRendezvous {
    client: Client,
    /// The endpoints, as errors name the store.
    server: String,
    prefix: String,
    board_prefix: String,
    /// What postings are sealed with; none: postings are refused.
    secret: Option<Key>,
    /// Who this handle says posts, in what it seals (its host's name).
    poster: String,
    /// Until when fetches wait for reserved postings to be written: one
    /// window for the handle, from the first reservation it met, so
    /// reservations left behind cost a reader that long in all.
    reserved_until: Mutex<Option<Instant>>,
    timeout: Duration,
    /// The lease's TTL, when publishing under one.
    lease_ttl: Option<Duration>,
    /// The lease granted (by the first publish) and kept alive; cleared
    /// by the keep-alive task when etcd says it expired.
    lease: Arc<Mutex<Option<i64>>>,
    /// `None` only while dropping.
    rt: Option<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for EtcdRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRendezvous").field("endpoints", &self.server).field("prefix", &self.prefix).finish()
    }
}

impl EtcdRendezvous {
    /// A client of the etcd cluster at `endpoints` (`http://host:port`,
    /// one or more members); connecting and every request are bounded by
    /// `timeout`. The connection is re-established on its own after an
    /// outage: requests fail while the cluster is unreachable and work
    /// again once it is back.
    ///
    /// Postings are sealed with the environment's cluster secret
    /// (`GPUDIRECT_SECRET_FILE`, `GPUDIRECT_SECRET`), or the one given to
    /// [`with_secret`](Self::with_secret).
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] for an endpoint that does not parse, a
    /// cluster not reachable within `timeout`, or a runtime thread that
    /// cannot start; [`EngineError::Config`] for no endpoints or a zero
    /// timeout; [`EngineError::Auth`] for an unusable secret in the
    /// environment.
    pub fn connect(endpoints: &[impl AsRef<str>], timeout: Duration) -> Result<EtcdRendezvous, EngineError> {
        let eps: Vec<String> = endpoints.iter().map(|e| e.as_ref().to_owned()).collect();
        if eps.is_empty() {
            return Err(EngineError::Config("etcd: no endpoints given".into()));
        }
        if timeout.is_zero() {
            return Err(EngineError::Config("etcd: a zero timeout would fail every request".into()));
        }
        let server = eps.join(",");
        let secret = ClusterSecret::from_env().map_err(|source| EngineError::Auth { peer: format!("etcd {server}"), source })?.map(|s| Key::of(Some(s)));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("gpudirect-etcd")
            .enable_all()
            .build()
            .map_err(|e| rdv_err(&server, format!("cannot start the etcd client's runtime: {e}")))?;
        let opts = ConnectOptions::new().with_connect_timeout(timeout).with_timeout(timeout);
        let client = on(&rt, &server, timeout, async move { Client::connect(eps, Some(opts)).await })?;
        tracing::info!(endpoints = %server, "etcd rendezvous connected");
        Ok(EtcdRendezvous {
            client,
            server,
            prefix: DEFAULT_PREFIX.to_owned(),
            board_prefix: DEFAULT_BOARD_PREFIX.to_owned(),
            secret,
            poster: postings::this_host(),
            reserved_until: Mutex::new(None),
            timeout,
            lease_ttl: None,
            lease: Arc::default(),
            rt: Some(rt),
        })
    }

    /// Publishes under a lease of `ttl` (whole seconds, at least 2; etcd
    /// may raise it to its minimum), renewed every third of it while this
    /// handle lives. Keys of a process that died, or dropped the handle,
    /// expire `ttl` later. An outage longer than `ttl` may expire the
    /// lease (etcd extends leases when it restarts); the next publish
    /// then takes a new one, so publish again after an outage.
    pub fn with_lease(mut self, ttl: Duration) -> EtcdRendezvous {
        self.lease_ttl = Some(ttl.max(Duration::from_secs(2)));
        self
    }

    /// The lease to publish under: the one held, or a new one, whose
    /// keep-alive task starts with it.
    fn lease_id(&self, ttl: Duration) -> Result<i64, EngineError> {
        let mut held = self.lease.lock();
        if let Some(id) = *held {
            return Ok(id);
        }
        let mut c = self.client.clone();
        let secs = ttl.as_secs() as i64; // at least 2: with_lease clamps
        let id = self.run(self.timeout, async move { c.lease_grant(secs, None).await.map(|g| g.id()) })?;
        *held = Some(id);
        let (c, lease, every) = (self.client.clone(), self.lease.clone(), ttl / 3);
        self.rt.as_ref().expect("the runtime lives until drop").spawn(keep_alive(c, id, every, lease));
        Ok(id)
    }

    /// Publishes and looks up under `prefix` instead of
    /// [`DEFAULT_PREFIX`]: several jobs sharing one cluster each take
    /// their own.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> EtcdRendezvous {
        self.prefix = prefix.into();
        self
    }

    /// Posts under `prefix` instead of [`DEFAULT_BOARD_PREFIX`].
    pub fn with_board_prefix(mut self, prefix: impl Into<String>) -> EtcdRendezvous {
        self.board_prefix = prefix.into();
        self
    }

    /// Seals and checks postings with `secret` instead of the
    /// environment's.
    pub fn with_secret(mut self, secret: ClusterSecret) -> EtcdRendezvous {
        self.secret = Some(Key::of(Some(secret)));
        self
    }

    /// Names this poster `name` in what it seals (at most 255 bytes)
    /// instead of this host's name: a poster of a name another holds
    /// leaves a conflict naming both, so two processes of one host that
    /// post as one node each name themselves. A name, not a proof: any
    /// holder of the secret could take another's.
    pub fn with_poster(mut self, name: &str) -> EtcdRendezvous {
        self.poster = poster_name(name);
        self
    }

    /// The key posting `name` under `topic` is kept at.
    pub fn posting_key(&self, topic: &str, name: &str) -> String {
        format!("{}{topic}/{name}", self.board_prefix)
    }

    /// The key postings are sealed with, or why there is none.
    fn sealer(&self) -> Result<&Key, EngineError> {
        self.secret.as_ref().ok_or_else(|| EngineError::Auth {
            peer: format!("etcd {}", self.server),
            source: AuthError::Secret(format!(
                "postings in etcd are sealed with the cluster's secret, and none is set: anyone who can write the etcd cluster could forge them ({SECRET_FILE_ENV}, or EtcdRendezvous::with_secret)"
            )),
        })
    }

    /// The key agent `name` is published under.
    pub fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn run<T: Send + 'static>(
        &self,
        bound: Duration,
        fut: impl Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
    ) -> Result<T, EngineError> {
        on(self.rt.as_ref().expect("the runtime lives until drop"), &self.server, bound, fut)
    }
}

/// An instant no wait reaches (about thirty years on), for a timeout past
/// what an `Instant` can hold.
fn far_future() -> Instant {
    let now = Instant::now();
    now.checked_add(Duration::from_secs(30 * 365 * 86_400)).unwrap_or(now)
}

/// Runs `fut` on `rt`, waiting at most `bound` for it.
fn on<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    server: &str,
    bound: Duration,
    fut: impl Future<Output = Result<T, etcd_client::Error>> + Send + 'static,
) -> Result<T, EngineError> {
    let (tx, rx) = mpsc::sync_channel(1);
    rt.spawn(async move {
        let _ = tx.send(tokio::time::timeout(bound, fut).await);
    });
    // The runtime's own timer ends the future; the grace covers a worker
    // that is slow to run it, and a runtime gone (drop) ends the wait too.
    match rx.recv_timeout(bound.saturating_add(Duration::from_secs(1))) {
        Ok(Ok(Ok(v))) => Ok(v),
        Ok(Ok(Err(e))) => Err(rdv_err(server, describe(&e))),
        Ok(Err(_)) | Err(_) => Err(rdv_err(server, format!("no answer within {bound:?}"))),
    }
}

/// gRPC status codes (the gRPC spec's numbers; etcd-client does not
/// re-export tonic's `Code`).
const GRPC_DEADLINE_EXCEEDED: i32 = 4;
const GRPC_UNAVAILABLE: i32 = 14;

/// etcd-client's errors, said the way an operator reads them.
fn describe(e: &etcd_client::Error) -> String {
    match e {
        etcd_client::Error::GRpcStatus(s) if i32::from(s.code()) == GRPC_UNAVAILABLE => format!("etcd unreachable: {}", s.message()),
        etcd_client::Error::GRpcStatus(s) if i32::from(s.code()) == GRPC_DEADLINE_EXCEEDED => {
            format!("etcd did not answer in time: {}", s.message())
        }
        etcd_client::Error::GRpcStatus(s) => format!("etcd answered {:?}: {}", s.code(), s.message()),
        etcd_client::Error::TransportError(t) => format!("cannot reach etcd: {t}"),
        other => other.to_string(),
    }
}

impl Drop for EtcdRendezvous {
    fn drop(&mut self) {
        // Not a blocking shutdown: the handle may be dropped inside
        // another runtime, where waiting for workers is refused.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Rendezvous for EtcdRendezvous {
    fn publish(&self, md: &AgentMetadata) -> Result<(), EngineError> {
        check_name(&md.name)?;
        let blob = md.encode()?;
        let opts = match self.lease_ttl {
            Some(ttl) => Some(PutOptions::new().with_lease(self.lease_id(ttl)?)),
            None => None,
        };
        let (mut c, key) = (self.client.clone(), self.key(&md.name));
        self.run(self.timeout, async move { c.put(key, blob, opts).await.map(drop) })
    }

    fn lookup(&self, name: &str, timeout: Duration) -> Result<AgentMetadata, EngineError> {
        check_name(name)?;
        let (c, key) = (self.client.clone(), self.key(name));
        // One RPC's bound on top of the wait, so an unreachable cluster
        // is an error about the cluster, not "not published".
        // Any timeout is accepted: one past what an Instant holds waits as
        // long as the process can.
        let deadline = Instant::now().checked_add(timeout).unwrap_or_else(far_future);
        match self.run(timeout.saturating_add(self.timeout), get_or_watch(c, key, deadline))? {
            // Decoding checks the length before anything else.
            Some(blob) => decode_for(name, &blob, &self.server),
            None => Err(EngineError::NotPublished { name: name.to_owned(), waited: timeout }),
        }
    }

    fn withdraw(&self, name: &str) -> Result<(), EngineError> {
        check_name(name)?;
        let (mut c, key) = (self.client.clone(), self.key(name));
        self.run(self.timeout, async move { c.delete(key, None).await.map(drop) })
    }
}

/// Renews lease `id` every `every` until etcd says it is gone (then
/// clears `held`, so the next publish takes a new one) or the runtime
/// stops with the handle. An outage is waited out: renewals resume when
/// etcd is back.
async fn keep_alive(mut c: Client, id: i64, every: Duration, held: Arc<Mutex<Option<i64>>>) {
    loop {
        match c.lease_keep_alive(id).await {
            Ok((mut keeper, mut answers)) => loop {
                if keeper.keep_alive().await.is_err() {
                    break;
                }
                match answers.message().await {
                    Ok(Some(a)) if a.ttl() > 0 => {}
                    Ok(Some(_)) => {
                        tracing::warn!(lease = id, "etcd lease expired: what was published under it is gone; publish again");
                        let mut h = held.lock();
                        if *h == Some(id) {
                            *h = None;
                        }
                        return;
                    }
                    Ok(None) | Err(_) => break,
                }
                tokio::time::sleep(every).await;
            },
            Err(e) => tracing::debug!(lease = id, "etcd lease keep-alive: {}", describe(&e)),
        }
        tokio::time::sleep(every).await;
    }
}

/// The value under `key`, waiting until `deadline` for one to be put;
/// `None` when none was.
async fn get_or_watch(mut c: Client, key: String, deadline: Instant) -> Result<Option<Vec<u8>>, etcd_client::Error> {
    let got = c.get(key.clone(), None).await?;
    if let Some(kv) = got.kvs().first() {
        return Ok(Some(kv.value().to_vec()));
    }
    if Instant::now() >= deadline {
        return Ok(None);
    }
    // From the revision after the read: a put in between is replayed.
    let from = got.header().map_or(0, |h| h.revision()) + 1;
    let mut events = c.watch(key, Some(WatchOptions::new().with_start_revision(from))).await?;
    loop {
        let msg = match tokio::time::timeout_at(deadline.into(), events.message()).await {
            Err(_) => return Ok(None),
            Ok(m) => m?,
        };
        let Some(resp) = msg else {
            return Err(etcd_client::Error::WatchError("the watch ended".into()));
        };
        if resp.canceled() {
            return Err(etcd_client::Error::WatchError(format!("the watch was cancelled: {}", resp.cancel_reason())));
        }
        let put = resp.events().iter().rev().filter(|e| e.event_type() == EventType::Put).find_map(|e| e.kv());
        if let Some(kv) = put {
            return Ok(Some(kv.value().to_vec()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::desc::tests::sample;
    use crate::wire::desc::MAX_METADATA;
    use testkit::Etcd;

    const T: Duration = Duration::from_secs(2);

    /// Writes `value` at `key` as whoever can write etcd does: no seal.
    pub(super) fn put_raw(r: &EtcdRendezvous, key: String, value: Vec<u8>) {
        let mut c = r.client.clone();
        r.run(T, async move { c.put(key, value, None).await.map(drop) }).unwrap();
    }

    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn publish_lookup_withdraw_and_a_lookup_that_watches() {
        let etcd = Etcd::local();
        let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
        let md = sample();
        super::super::tests::publish_replace_withdraw(&rdv);
        rdv.publish(&md).unwrap();
        let other_job = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_prefix("/job-2/");
        assert!(matches!(other_job.lookup("decode-0", Duration::ZERO), Err(EngineError::NotPublished { .. })), "prefixes keep jobs apart");
        rdv.withdraw("decode-0").unwrap();
        // A wait longer than the per-request timeout, answered by the
        // watch as soon as the publish lands, from another client.
        let url = etcd.url();
        let late = std::thread::spawn(move || {
            std::thread::sleep(T + Duration::from_millis(500));
            EtcdRendezvous::connect(&[url], T).unwrap().publish(&sample()).unwrap();
            Instant::now()
        });
        let got = rdv.lookup("decode-0", Duration::from_secs(20));
        let seen = Instant::now();
        let published = late.join().unwrap();
        assert_eq!(got.unwrap(), md);
        assert!(seen.duration_since(published) < Duration::from_secs(1), "seen {:?} after the publish", seen.duration_since(published));
    }

    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn hostile_values_are_typed_errors() {
        let etcd = Etcd::local();
        let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
        let mut blob = sample().encode().unwrap();
        put_raw(&rdv, rdv.key("garbage"), b"not metadata at all".to_vec());
        assert!(matches!(rdv.lookup("garbage", Duration::ZERO), Err(EngineError::Metadata(_))));
        blob.truncate(blob.len() - 3);
        put_raw(&rdv, rdv.key("short"), blob);
        assert!(matches!(rdv.lookup("short", Duration::ZERO), Err(EngineError::Metadata(_))));
        put_raw(&rdv, rdv.key("huge"), vec![0; MAX_METADATA + 1]);
        assert!(matches!(rdv.lookup("huge", Duration::ZERO), Err(EngineError::Metadata(_))));
        put_raw(&rdv, rdv.key("impostor"), sample().encode().unwrap());
        match rdv.lookup("impostor", Duration::ZERO) {
            Err(EngineError::Rendezvous { reason, .. }) => assert!(reason.contains("decode-0"), "{reason}"),
            r => panic!("{r:?}"),
        }
        for bad in ["", &"x".repeat(256)] {
            assert!(matches!(rdv.lookup(bad, Duration::ZERO), Err(EngineError::Config(_))));
            assert!(matches!(rdv.withdraw(bad), Err(EngineError::Config(_))));
        }
        assert!(matches!(EtcdRendezvous::connect(&[] as &[&str], T), Err(EngineError::Config(_))));
        assert!(matches!(EtcdRendezvous::connect(&["not a url at all"], T), Err(EngineError::Rendezvous { .. })));
    }

    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn an_outage_fails_within_the_bound_and_a_restart_heals() {
        let mut etcd = Etcd::local();
        let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
        rdv.publish(&sample()).unwrap();
        let leased = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_lease(Duration::from_secs(3));
        let mut kept = sample();
        kept.name = "leased".into();
        leased.publish(&kept).unwrap();
        etcd.stop();
        let started = Instant::now();
        match rdv.lookup("decode-0", Duration::from_millis(500)) {
            Err(EngineError::Rendezvous { server, reason }) => assert_eq!(server, etcd.url(), "{reason}"),
            r => panic!("a lookup during the outage gave {r:?}"),
        }
        let took = started.elapsed();
        assert!(took < Duration::from_millis(500) + T + Duration::from_secs(1), "took {took:?}");
        assert!(matches!(rdv.publish(&sample()), Err(EngineError::Rendezvous { .. })));
        // A lookup waiting across the restart would be an error about the
        // cluster, not "not published": it is asked after.
        etcd.restart();
        let back = Instant::now();
        loop {
            match rdv.lookup("decode-0", Duration::ZERO) {
                Ok(md) => break assert_eq!(md, sample(), "etcd keeps what it stored"),
                Err(EngineError::Rendezvous { .. }) if back.elapsed() < Duration::from_secs(30) => std::thread::sleep(Duration::from_millis(200)),
                r => panic!("after the restart: {r:?}"),
            }
        }
        let rejoined = back.elapsed();
        // The lease's keep-alive resumed: the key outlives several TTLs.
        std::thread::sleep(Duration::from_secs(7));
        assert_eq!(rdv.lookup("leased", Duration::ZERO).unwrap(), kept, "the lease is renewed after the outage");
        eprintln!("etcd outage: lookup failed in {took:?}; the client worked again {rejoined:?} after the restart");
        drop(rdv);
    }

    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn leased_keys_live_with_their_handle_and_expire_after_it() {
        let etcd = Etcd::local();
        // 3 s: renewals every second leave two seconds for a slow guest.
        let ttl = Duration::from_secs(3);
        let leased = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_lease(ttl);
        let reader = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
        leased.publish(&sample()).unwrap();
        let mut other = sample();
        other.name = "decode-1".into();
        leased.publish(&other).unwrap();
        std::thread::sleep(3 * ttl);
        assert_eq!(reader.lookup("decode-0", Duration::ZERO).unwrap(), sample(), "kept alive past its TTL");
        drop(leased);
        let dropped = Instant::now();
        loop {
            match reader.lookup("decode-1", Duration::ZERO) {
                Ok(_) if dropped.elapsed() < 3 * ttl => std::thread::sleep(Duration::from_millis(100)),
                Err(EngineError::NotPublished { .. }) => break,
                r => panic!("{:?} after the handle was dropped: {r:?}", dropped.elapsed()),
            }
        }
        eprintln!("leased keys expired {:?} after their handle was dropped (TTL {ttl:?})", dropped.elapsed());
        assert!(matches!(reader.lookup("decode-0", Duration::ZERO), Err(EngineError::NotPublished { .. })));
    }

    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn usable_and_droppable_inside_another_runtime() {
        let etcd = Etcd::local();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
            rdv.publish(&sample()).unwrap();
            assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap(), sample());
            drop(rdv);
        });
    }
}
