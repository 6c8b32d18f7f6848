//! The rendezvous server: name -> sealed metadata blob, in memory, for
//! the agents of one cluster. Every request proves the cluster's secret
//! over the server's fresh nonce before it is acted on (see `tcp`); what
//! one client can make the server hold is bounded (names and bytes per
//! client address, bytes in all), and with a lease an entry not published
//! again within it expires, as etcd's leases do. Each connection is served
//! on a thread of its own, bounded by `SERVE_TIMEOUT`, at most
//! `MAX_CLIENTS` at once (more are closed unanswered), so a client that
//! stalls delays nobody else.
//!
//! Beside agents' metadata it holds postings (`board`): named blobs under
//! a topic, each bound to the address that posted it, counted in the same
//! budgets and leases. Another address posting the same name replaces
//! nothing: it is refused, and the server keeps the clash (the rivals'
//! addresses) with the posting, so every fetch after answers "conflict"
//! naming both. The clash outlives the remove of one of its posters (the
//! others' claims stay, and only a name's last claimant may post it
//! again), and ends when all but one withdraw or the lease expires it. A
//! member holding the secret who takes a node's name first thus shuts the
//! gate rather than standing in for the node once the node posts too, and
//! cannot reopen it by removing its posting and posting again.

use std::collections::HashMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::serve::{serve_each, Server, Slot, WhenFull};
use gpudirect::deadline::{Bounded, Deadline};
use gpudirect::sync::Mutex;

use crate::wire::auth::{random, ClusterSecret, Key, Label, TAG};
use crate::wire::desc::AgentMetadata;
use crate::error::EngineError;
use super::board::{posting_name_ok, MAX_ENTRIES, MAX_TOPIC};
use super::rdv_err;
use super::tcp::{read_request, Op, CONFLICT, MAGIC, NOT_FOUND, OK, REFUSED, VERSION};

/// Bound on serving one request.
const SERVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once.
const MAX_CLIENTS: usize = 32;
/// Rival addresses kept for one posting: two are enough to name a
/// conflict, a few more show who else tried.
const MAX_RIVALS: usize = 8;

/// A rendezvous server's settings; [`Default`] gives the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousConfig {
    /// The cluster's secret: only requests proving it are served. `None`:
    /// the environment's (`GPUDIRECT_SECRET_FILE`, `GPUDIRECT_SECRET`),
    /// else none, allowed only on a loopback address or with `insecure`.
    pub secret: Option<ClusterSecret>,
    /// Serve a network address without a secret (anyone who reaches it
    /// can publish and withdraw any name).
    pub insecure: bool,
    /// An entry not published again within this long expires; `None`:
    /// entries stay until withdrawn (or the server stops).
    pub lease: Option<Duration>,
    /// Bytes of metadata held in all (default 256 MiB).
    pub max_bytes: usize,
    /// Names one client address may hold (default 4096).
    pub max_names_per_client: usize,
    /// Bytes one client address may hold (default 64 MiB).
    pub max_bytes_per_client: usize,
}

impl Default for RendezvousConfig {
    fn default() -> RendezvousConfig {
        RendezvousConfig { secret: None, insecure: false, lease: None, max_bytes: 256 << 20, max_names_per_client: 4096, max_bytes_per_client: 64 << 20 }
    }
}

/// A rendezvous server: hosts every agent's metadata, in memory, for as
/// long as it lives. Start it in one process (a launcher's, an agent's,
/// or `gpudirect rendezvous --listen ADDR`); stops when dropped.
pub struct RendezvousServer {
    addr: SocketAddr,
    stop: Arc<Mutex<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RendezvousServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousServer").field("addr", &self.addr).finish()
    }
}

impl RendezvousServer {
    /// Binds `addr` (port 0: a free one) and starts serving, with the
    /// [default settings](RendezvousConfig::default).
    ///
    /// # Errors
    /// As [`bind_with`](Self::bind_with).
    pub fn bind(addr: impl ToSocketAddrs) -> Result<RendezvousServer, EngineError> {
        RendezvousServer::bind_with(addr, RendezvousConfig::default())
    }

    /// Binds `addr` (port 0: a free one) and starts serving under `config`.
    ///
    /// # Errors
    /// [`EngineError::Auth`] for a network address without a secret (nor
    /// `insecure`) or an unusable secret; [`EngineError::Rendezvous`] when
    /// it cannot bind or start its thread.
    pub fn bind_with(addr: impl ToSocketAddrs, config: RendezvousConfig) -> Result<RendezvousServer, EngineError> {
        let listener = TcpListener::bind(addr).map_err(|e| rdv_err("(bind)", format!("cannot bind the rendezvous server: {e}")))?;
        let addr = listener.local_addr().map_err(|e| rdv_err("(bind)", e.to_string()))?;
        let key = Key::resolve(config.secret.as_ref(), config.insecure, "the rendezvous server", Some(addr.ip()))
            .map_err(|source| EngineError::Auth { peer: format!("rendezvous {addr}"), source })?;
        listener.set_nonblocking(true).map_err(|e| rdv_err("(bind)", e.to_string()))?;
        let stop = Arc::new(Mutex::new(false));
        let thread = {
            let stop = stop.clone();
            let store = Store { config, key, entries: HashMap::new(), claims: HashMap::new(), bytes: 0, clients: HashMap::new(), swept: Instant::now() };
            std::thread::Builder::new()
                .name("gpudirect-rendezvous".into())
                .spawn(move || serve(listener, stop, store))
                .map_err(|e| rdv_err("(bind)", format!("cannot start the rendezvous thread: {e}")))?
        };
        tracing::info!(%addr, "rendezvous server started");
        Ok(RendezvousServer { addr, stop, thread: Some(thread) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        *self.stop.lock() = true;
        crate::serve::wake_listener(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What an entry is held as: an agent's metadata by its name, or a
/// posting by its topic and name (apart: neither can take the other's).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Name {
    Agent(String),
    Posting { topic: String, name: String },
}

impl std::fmt::Display for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Name::Agent(n) => write!(f, "{n}"),
            Name::Posting { topic, name } => write!(f, "{topic}/{name}"),
        }
    }
}

/// A posting's `topic/name` as a request carries it, checked.
fn posting(key: &str) -> Result<Name, String> {
    match key.split_once('/') {
        Some((t, n)) if posting_name_ok(t) && t.len() <= MAX_TOPIC && posting_name_ok(n) => Ok(Name::Posting { topic: t.to_owned(), name: n.to_owned() }),
        _ => Err(format!("{key:?} is not topic/name (each plain: letters, digits, '-', '_', '.')")),
    }
}

struct Entry {
    blob: Vec<u8>,
    from: IpAddr,
    at: Instant,
    /// Other addresses that posted this name while `from` held it.
    rivals: Vec<IpAddr>,
}

/// The addresses still claiming a posting's name after its holder
/// removed it while others had posted it too.
struct Claim {
    posters: Vec<IpAddr>,
    at: Instant,
}

/// Why a post was not stored.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    /// Another address holds the name: every poster, the holder first.
    Conflict(Vec<IpAddr>),
    /// Any other reason, said.
    Other(String),
}

impl From<String> for Refusal {
    fn from(why: String) -> Refusal {
        Refusal::Other(why)
    }
}

/// What one client address holds.
#[derive(Default)]
struct Held {
    names: usize,
    bytes: usize,
}

struct Store {
    config: RendezvousConfig,
    key: Key,
    entries: HashMap<Name, Entry>,
    /// Names in conflict whose holder removed its posting.
    claims: HashMap<Name, Claim>,
    bytes: usize,
    clients: HashMap<IpAddr, Held>,
    swept: Instant,
}

impl Entry {
    /// The holder, then its rivals.
    fn posters(&self) -> Vec<IpAddr> {
        std::iter::once(self.from).chain(self.rivals.iter().copied()).collect()
    }
}

impl Store {
    fn remove(&mut self, name: &Name) {
        if let Some(e) = self.entries.remove(name) {
            self.bytes -= e.blob.len();
            if let Some(h) = self.clients.get_mut(&e.from) {
                h.names -= 1;
                h.bytes -= e.blob.len();
                if h.names == 0 {
                    self.clients.remove(&e.from);
                }
            }
        }
    }

    /// Drops what outlived its lease (at most once a second: a sweep
    /// walks every entry).
    fn sweep(&mut self, now: Instant) {
        let Some(lease) = self.config.lease else { return };
        if now.duration_since(self.swept) < Duration::from_secs(1).min(lease) {
            return;
        }
        self.swept = now;
        let old: Vec<Name> = self.entries.iter().filter(|(_, e)| now.duration_since(e.at) > lease).map(|(n, _)| n.clone()).collect();
        for n in old {
            tracing::info!(name = %n, "rendezvous entry expired (not published again within its lease)");
            self.remove(&n);
        }
        self.claims.retain(|_, c| now.duration_since(c.at) <= lease);
    }

    /// Whether something stamped `at` is still within the lease.
    fn fresh(&self, at: Instant, now: Instant) -> bool {
        self.config.lease.is_none_or(|l| now.duration_since(at) <= l)
    }

    fn live(&self, name: &Name, now: Instant) -> Option<&Entry> {
        self.entries.get(name).filter(|e| self.fresh(e.at, now))
    }

    /// Who still claims `name` after its holder removed it.
    fn claimed(&self, name: &Name, now: Instant) -> Option<&[IpAddr]> {
        self.claims.get(name).filter(|c| self.fresh(c.at, now)).map(|c| c.posters.as_slice())
    }

    fn publish(&mut self, name: String, blob: Vec<u8>, from: IpAddr, now: Instant) -> Result<(), String> {
        let md = AgentMetadata::decode(&blob).map_err(|e| format!("not agent metadata: {e}"))?;
        if md.name != name {
            return Err(format!("metadata of {:?} published as {name:?}", md.name));
        }
        self.hold(Name::Agent(name), blob, from, now)
    }

    /// A posting, bound to the address that first made it: a member
    /// holding the secret may not replace another node's, and its try is
    /// kept as a rival, which turns every fetch into a conflict.
    fn post(&mut self, name: Name, blob: Vec<u8>, from: IpAddr, now: Instant) -> Result<(), Refusal> {
        let held = self.live(&name, now).is_some_and(|e| e.from != from);
        if let Some(e) = self.entries.get_mut(&name).filter(|_| held) {
            if !e.rivals.contains(&from) && e.rivals.len() < MAX_RIVALS {
                e.rivals.push(from);
            }
            tracing::warn!(posting = %name, holder = %e.from, rival = %from, "a posting's name posted from a second address: a conflict");
            return Err(Refusal::Conflict(e.posters()));
        }
        // Its holder removed it while others claimed it: only the one
        // claimant left may post it again.
        let claimed = self.claimed(&name, now).is_some_and(|c| c != [from]);
        if let Some(c) = self.claims.get_mut(&name).filter(|_| claimed) {
            if !c.posters.contains(&from) && c.posters.len() < MAX_RIVALS {
                c.posters.push(from);
            }
            c.at = now;
            tracing::warn!(posting = %name, claimants = ?c.posters, rival = %from, "a posting's name in conflict posted again: still a conflict");
            return Err(Refusal::Conflict(c.posters.clone()));
        }
        self.hold(name.clone(), blob, from, now)?;
        self.claims.remove(&name);
        Ok(())
    }

    /// `from` removes its posting of `name`, or withdraws its claim to
    /// it. A holder's remove leaves its rivals' claims (a conflict is not
    /// ended by one of its posters); an address that neither holds nor
    /// claims the name may not remove it.
    fn withdraw_posting(&mut self, name: &Name, from: IpAddr, now: Instant) -> Result<(), String> {
        let (holder, rival) = match self.live(name, now) {
            Some(e) => (Some(e.from), e.rivals.contains(&from)),
            None => (None, false),
        };
        match holder {
            Some(h) if h == from => {
                let rivals = self.entries.get_mut(name).map(|e| std::mem::take(&mut e.rivals)).unwrap_or_default();
                self.remove(name);
                if !rivals.is_empty() {
                    self.claims.insert(name.clone(), Claim { posters: rivals, at: now });
                }
            }
            Some(_) if rival => {
                if let Some(e) = self.entries.get_mut(name) {
                    e.rivals.retain(|r| *r != from);
                }
            }
            Some(h) => {
                return Err(format!("{name} was posted from {h}; {from} may not remove it (remove it from there, or wait for the server's lease to expire it)"));
            }
            None => {
                // What outlived its lease goes; a claim loses this claimant.
                self.remove(name);
                if let Some(c) = self.claims.get_mut(name) {
                    c.posters.retain(|p| *p != from);
                    if c.posters.is_empty() {
                        self.claims.remove(name);
                    }
                }
            }
        }
        Ok(())
    }

    /// The names posted under `topic`, and those in conflict after a
    /// holder's remove, sorted, one a line.
    fn list(&self, topic: &str, now: Instant) -> Vec<u8> {
        let posted = self.entries.keys().filter(|k| self.live(k, now).is_some());
        let contested = self.claims.keys().filter(|k| self.claimed(k, now).is_some_and(|c| c.len() > 1));
        let names: std::collections::BTreeSet<&str> = posted
            .chain(contested)
            .filter_map(|k| match k {
                Name::Posting { topic: t, name } if t == topic => Some(name.as_str()),
                _ => None,
            })
            .collect();
        names.into_iter().collect::<Vec<_>>().join("\n").into_bytes()
    }

    /// Holds `blob` as `name` within the budgets, replacing what was there
    /// (and keeping the rivals of a name its holder posts again: a
    /// conflict ends only with the posting).
    fn hold(&mut self, name: Name, blob: Vec<u8>, from: IpAddr, now: Instant) -> Result<(), String> {
        // Limits as if the old entry of that name were gone already.
        let old = self.entries.get(&name).map(|e| (e.from, e.blob.len()));
        let rivals = match self.live(&name, now) {
            Some(e) if e.from == from => e.rivals.clone(),
            _ => Vec::new(),
        };
        let (mut names, mut bytes) = self.clients.get(&from).map_or((0, 0), |h| (h.names, h.bytes));
        let mut total = self.bytes;
        if let Some((f, len)) = old {
            total -= len;
            if f == from {
                names -= 1;
                bytes -= len;
            }
        }
        let c = &self.config;
        if old.is_none() && self.entries.len() + self.claims.len() >= MAX_ENTRIES {
            return Err(format!("the server holds its maximum of {MAX_ENTRIES} names"));
        }
        if total + blob.len() > c.max_bytes {
            return Err(format!("the server holds {total} bytes; {} more would pass its budget of {} (RendezvousConfig::max_bytes)", blob.len(), c.max_bytes));
        }
        if names + 1 > c.max_names_per_client {
            return Err(format!("{from} holds {names} names, the most one client may (RendezvousConfig::max_names_per_client)"));
        }
        if bytes + blob.len() > c.max_bytes_per_client {
            return Err(format!("{from} holds {bytes} bytes; {} more would pass the {} one client may (RendezvousConfig::max_bytes_per_client)", blob.len(), c.max_bytes_per_client));
        }
        self.remove(&name);
        self.bytes += blob.len();
        let h = self.clients.entry(from).or_default();
        h.names += 1;
        h.bytes += blob.len();
        self.entries.insert(name, Entry { blob, from, at: now, rivals });
        Ok(())
    }
}

fn serve(listener: TcpListener, stop: Arc<Mutex<bool>>, store: Store) {
    let store = Mutex::new(store);
    let server = Server { name: "gpudirect-rendezvous", max: MAX_CLIENTS, when_full: WhenFull::Close };
    serve_each(&listener, &stop, &server, hello, |s, from, nonce, slot| {
        // One address, one poster: an IPv4 client of a dual-stack
        // listener is named as IPv4.
        if let Err(e) = answer(s, from.ip().to_canonical(), nonce, &store, slot) {
            tracing::warn!(%from, "rendezvous request not served: {e}");
        }
    });
}

/// Posters as a conflict answer names them: one address a line.
fn shown(posters: &[IpAddr]) -> Vec<u8> {
    posters.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n").into_bytes()
}

/// The server's opening, sent on accepting (a fresh socket's buffer
/// takes it whole): magic, version and the nonce the request must prove.
fn hello(s: &TcpStream) -> std::io::Result<[u8; TAG]> {
    let nonce: [u8; TAG] = random();
    let mut hello = MAGIC.to_vec();
    hello.push(VERSION);
    hello.extend_from_slice(&nonce);
    (&mut &*s).write_all(&hello)?;
    Ok(nonce)
}

/// Serves the request after `hello`, the whole exchange within
/// [`SERVE_TIMEOUT`].
fn answer(s: TcpStream, from: IpAddr, nonce: [u8; TAG], store: &Mutex<Store>, slot: &Slot<'_>) -> std::io::Result<()> {
    let mut s = Bounded::new(&s, Deadline::after(SERVE_TIMEOUT));
    let req = read_request(&mut s)?;
    let key = store.lock().key.clone();
    let (status, body) = match req {
        Err(why) => (REFUSED, why.into_bytes()),
        Ok(r) if !key.verify(Label::RendezvousRequest, &[&nonce, &r.signed], &r.tag) => (
            REFUSED,
            b"the request's proof did not verify: this client does not hold the rendezvous server's cluster secret (GPUDIRECT_SECRET_FILE, RendezvousConfig::secret, TcpRendezvous::with_secret)".to_vec(),
        ),
        Ok(r) => {
            slot.proven();
            let now = Instant::now();
            let mut store = store.lock();
            store.sweep(now);
            match r.op {
                Op::Publish => match store.publish(r.name, r.blob, from, now) {
                    Ok(()) => (OK, Vec::new()),
                    Err(why) => (REFUSED, why.into_bytes()),
                },
                Op::Lookup => match store.live(&Name::Agent(r.name), now) {
                    Some(e) => (OK, e.blob.clone()),
                    None => (NOT_FOUND, Vec::new()),
                },
                Op::Withdraw => {
                    store.remove(&Name::Agent(r.name));
                    (OK, Vec::new())
                }
                Op::Post => match posting(&r.name).map_err(Refusal::Other).and_then(|n| store.post(n, r.blob, from, now)) {
                    Ok(()) => (OK, Vec::new()),
                    Err(Refusal::Conflict(posters)) => (CONFLICT, shown(&posters)),
                    Err(Refusal::Other(why)) => (REFUSED, why.into_bytes()),
                },
                Op::Fetch => match posting(&r.name) {
                    Ok(n) => match store.live(&n, now) {
                        None => match store.claimed(&n, now) {
                            Some(c) if c.len() > 1 => (CONFLICT, shown(c)),
                            _ => (NOT_FOUND, Vec::new()),
                        },
                        Some(e) if !e.rivals.is_empty() => (CONFLICT, shown(&e.posters())),
                        // How long it has been held, then the bytes: the
                        // reader's "posted at" by this server's clock.
                        Some(e) => {
                            let age = u64::try_from(now.duration_since(e.at).as_millis()).unwrap_or(u64::MAX);
                            let mut body = age.to_be_bytes().to_vec();
                            body.extend_from_slice(&e.blob);
                            (OK, body)
                        }
                    },
                    Err(why) => (REFUSED, why.into_bytes()),
                },
                Op::List if posting_name_ok(&r.name) && r.name.len() <= MAX_TOPIC => (OK, store.list(&r.name, now)),
                Op::List => (REFUSED, format!("topic {:?}: letters, digits, '-', '_', '.'", r.name).into_bytes()),
                Op::Remove => match posting(&r.name).and_then(|n| store.withdraw_posting(&n, from, now)) {
                    Ok(()) => (OK, Vec::new()),
                    Err(why) => (REFUSED, why.into_bytes()),
                },
            }
        }
    };
    let mut out = vec![status];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    let tag = key.tag(Label::RendezvousAnswer, &[&nonce, &out]);
    out.extend_from_slice(&tag);
    s.write_all(&out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> Store {
        Store { config: RendezvousConfig::default(), key: Key::of(None), entries: HashMap::new(), claims: HashMap::new(), bytes: 0, clients: HashMap::new(), swept: Instant::now() }
    }

    /// A posting is its poster's: another address (a member holding the
    /// secret) neither replaces nor removes it; its try is kept, and the
    /// name answers "conflict" naming both from then on, even after the
    /// holder posts again, and after the holder removes it and posts
    /// again; it ends when all but one poster withdraw.
    #[test]
    fn a_second_address_posting_a_name_is_a_conflict_naming_both() {
        let mut s = store();
        let [a, b, c]: [IpAddr; 3] = ["10.0.0.1", "10.0.0.2", "10.0.0.3"].map(|ip| ip.parse().unwrap());
        let now = Instant::now();
        let n = posting("job-1/node001").unwrap();
        s.post(n.clone(), b"mine".to_vec(), a, now).unwrap();
        assert_eq!(s.post(n.clone(), b"forged".to_vec(), b, now), Err(Refusal::Conflict(vec![a, b])));
        assert_eq!(s.post(n.clone(), b"forged".to_vec(), b, now), Err(Refusal::Conflict(vec![a, b])), "a rival is kept once");
        assert!(s.withdraw_posting(&n, c, now).unwrap_err().contains("10.0.0.3 may not remove it"));
        let e = s.live(&n, now).unwrap();
        assert_eq!((e.blob.as_slice(), e.posters()), (&b"mine"[..], vec![a, b]));
        s.post(n.clone(), b"again".to_vec(), a, now).unwrap();
        assert_eq!(s.live(&n, now).unwrap().posters(), vec![a, b], "the holder posting again keeps the conflict");
        assert_eq!((s.bytes, s.clients[&a].names), (5, 1), "a replacement is counted once");
        assert!(!s.clients.contains_key(&b), "a rival holds nothing");
        assert_eq!(s.list("job-1", now), b"node001");
        // The holder removes and posts again: still a conflict, listed.
        s.withdraw_posting(&n, a, now).unwrap();
        assert_eq!((s.live(&n, now).is_none(), s.claimed(&n, now)), (true, Some(&[b][..])));
        assert_eq!(s.list("job-1", now), b"", "one claimant and no posting: nothing to judge");
        assert_eq!(s.post(n.clone(), b"squat again".to_vec(), a, now), Err(Refusal::Conflict(vec![b, a])));
        assert_eq!(s.list("job-1", now), b"node001");
        assert_eq!(s.post(n.clone(), b"b's".to_vec(), b, now), Err(Refusal::Conflict(vec![b, a])));
        // All but one withdraw: the one left posts, alone.
        s.withdraw_posting(&n, a, now).unwrap();
        s.post(n.clone(), b"b's".to_vec(), b, now).unwrap();
        assert!(s.live(&n, now).unwrap().rivals.is_empty() && s.claimed(&n, now).is_none());
        // A rival withdrawing leaves the holder's posting alone.
        s.post(n.clone(), b"again".to_vec(), c, now).unwrap_err();
        s.withdraw_posting(&n, c, now).unwrap();
        assert_eq!(s.live(&n, now).unwrap().posters(), vec![b]);
        for bad in ["job-1", "job-1/", "/node", "job/a/b", "job-1/.x"] {
            assert!(posting(bad).is_err(), "{bad}");
        }
    }
}
