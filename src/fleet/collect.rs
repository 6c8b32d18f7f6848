//! Where the nodes' captures meet: a folder every node shares
//! (`DIR/JOB/NODE.json`, written and read without following a link:
//! `folder`), or a board in the project's rendezvous server or in etcd
//! ([`gpudirect_engine::Board`]), where a posting is proven with the
//! cluster's secret (`GPUDIRECT_SECRET_FILE`): the server serves only
//! requests that prove it and keeps each node's posting for the address
//! that made it; in etcd each capture is sealed with it, and one that
//! does not verify, or was put back, is reported unreadable, never judged.
//!
//! A node's name is its first poster's: a second poster of it (another
//! address, host or user, as far as each place tells them apart) leaves a
//! conflict, which is reported as that node's, naming both, and never
//! judged. With a job's start given (`since`), a capture posted before it
//! (by the time each place vouches for) is refused too.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime};

use gpudirect_engine::{Board, EngineError, TcpRendezvous};

use super::folder::{this_poster, JobDir};
use super::{natural, valid_name, Unreadable, MAX_NODES};

/// A job's captures as (node, where) and the names refused.
type Found = (Vec<(String, String)>, Vec<Unreadable>);

/// Captures fetched at once from a board (each fetch is one request).
const FETCHERS: usize = 8;

/// Where a job's captures are posted and read.
pub enum Collection {
    /// A folder all nodes share: `DIR/JOB/NODE.json`.
    Dir(PathBuf),
    /// Postings under the job's id as topic, each node's capture under its name.
    Board {
        /// The store.
        board: Box<dyn Board>,
        /// How errors name it (`rendezvous 10.0.0.1:7000`).
        shown: String,
    },
}

impl std::fmt::Debug for Collection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Collection::Dir(d) => write!(f, "Collection::Dir({})", d.display()),
            Collection::Board { shown, .. } => write!(f, "Collection::Board({shown})"),
        }
    }
}

/// One capture as read: its node, where it was, its text or why not.
pub struct Posted {
    /// The node's name.
    pub node: String,
    /// The file, or the posting at its store.
    pub place: String,
    /// The capture's text, or why it could not be read.
    pub text: Result<String, String>,
}

impl Collection {
    /// The one place given: a folder, the rendezvous server at
    /// `rendezvous`, or etcd at `etcd` (each request within `timeout`).
    ///
    /// # Errors
    /// None or more than one given, or as [`rendezvous`](Self::rendezvous)
    /// and [`etcd`](Self::etcd).
    pub fn open(dir: Option<&Path>, rendezvous: Option<&str>, etcd: &[String], timeout: Duration) -> Result<Collection, String> {
        match (dir, rendezvous, etcd.is_empty()) {
            (Some(d), None, true) => Ok(Collection::Dir(d.to_path_buf())),
            (None, Some(addr), true) => Collection::rendezvous(addr, timeout),
            (None, None, false) => Collection::etcd(etcd, timeout),
            _ => Err("give exactly one place for the captures: a shared folder, a rendezvous server or etcd".into()),
        }
    }

    /// The board of the rendezvous server at `addr`, each request within
    /// `timeout`, proving the environment's cluster secret.
    ///
    /// # Errors
    /// An address that does not resolve, or an unusable secret.
    pub fn rendezvous(addr: &str, timeout: Duration) -> Result<Collection, String> {
        let board = TcpRendezvous::new(addr, timeout).map_err(|e| e.to_string())?;
        Ok(Collection::Board { board: Box::new(board), shown: format!("rendezvous {addr}") })
    }

    /// The board in the etcd cluster at `endpoints`, sealed with the
    /// environment's cluster secret.
    ///
    /// # Errors
    /// etcd not reachable within `timeout`, or an unusable secret.
    pub fn etcd(endpoints: &[String], timeout: Duration) -> Result<Collection, String> {
        Collection::etcd_leased(endpoints, timeout, None)
    }

    /// [`etcd`](Self::etcd), whose postings live under an etcd lease of
    /// `ttl`: once the posting process is gone, they expire `ttl` later
    /// (a job's captures do not outlive its gate).
    ///
    /// # Errors
    /// As [`etcd`](Self::etcd).
    pub fn etcd_leased(endpoints: &[String], timeout: Duration, ttl: Option<Duration>) -> Result<Collection, String> {
        let mut board = gpudirect_engine::EtcdRendezvous::connect(endpoints, timeout).map_err(|e| e.to_string())?;
        if let Some(ttl) = ttl {
            board = board.with_lease(ttl);
        }
        Ok(Collection::Board { board: Box::new(board), shown: format!("etcd {}", endpoints.join(",")) })
    }

    fn topic<'a>(&self, job: Option<&'a str>) -> Result<&'a str, String> {
        match job {
            Some(j) if valid_name(j) => Ok(j),
            Some(j) => Err(format!("job id {j:?}: use letters, digits, '-', '_' and '.' only")),
            None => Err("a job id (--job) is needed to read captures from a rendezvous or etcd".into()),
        }
    }

    /// Posts `node`'s capture `text` under `job`; returns where it went.
    /// In a folder, the job's folder and everything in it are reached
    /// without following a link, and a node another poster (host and
    /// user) posted is not replaced.
    ///
    /// # Errors
    /// A folder that cannot be written, a link where the job's folder,
    /// the capture or its temporary file would be (named), another
    /// poster's node (a conflict naming both), or the store's refusal.
    pub fn post(&self, job: &str, node: &str, text: &str) -> Result<String, String> {
        self.post_as(job, node, text, &this_poster())
    }

    /// [`post`](Self::post), claiming a folder's node for `poster` (a
    /// board tells its posters apart itself).
    pub(super) fn post_as(&self, job: &str, node: &str, text: &str, poster: &str) -> Result<String, String> {
        if !valid_name(node) {
            return Err(format!("node name {node:?}: use letters, digits, '-', '_' and '.' only"));
        }
        match self {
            Collection::Dir(dir) => {
                let folder = JobDir::open(dir, Some(job), true)?;
                folder.claim(node, poster)?;
                let file = format!("{node}.json");
                folder.replace(&file, text.as_bytes())?;
                Ok(folder.shown(&file))
            }
            Collection::Board { board, shown } => {
                board.post(self.topic(Some(job))?, node, text.as_bytes()).map_err(|e| format!("{shown}: {e}"))?;
                Ok(format!("{job}/{node} at {shown}"))
            }
        }
    }

    /// The nodes that posted under `job`, in natural order, and the names
    /// refused.
    fn names(&self, job: Option<&str>) -> Result<Found, String> {
        let (mut found, bad) = match self {
            Collection::Dir(dir) => dir_captures(&JobDir::open(dir, job, false)?)?,
            Collection::Board { board, shown } => {
                let topic = self.topic(job)?;
                let names = board.names(topic).map_err(|e| format!("{shown}: {e}"))?;
                if names.len() > MAX_NODES {
                    return Err(format!("{shown}: more than {MAX_NODES} captures under {topic}"));
                }
                let placed = names.into_iter().map(|n| {
                    let place = format!("{topic}/{n} at {shown}");
                    (n, place)
                });
                (placed.collect(), Vec::new())
            }
        };
        found.sort_by_key(|a| natural(&a.0));
        Ok((found, bad))
    }

    /// How many of the nodes `expect`ed posted under `job` (0 when it
    /// cannot be read yet).
    fn arrived(&self, job: Option<&str>, expect: &super::Expect) -> usize {
        let Ok((names, _)) = self.names(job) else { return 0 };
        match expect {
            super::Expect::Count(_) => names.len(),
            super::Expect::Names(want) => {
                let posted: std::collections::HashSet<&str> = names.iter().map(|(n, _)| n.as_str()).collect();
                want.iter().filter(|n| posted.contains(n.as_str())).count()
            }
        }
    }

    /// Waits until the nodes `expect`ed posted under `job`, or `wait`
    /// passes; returns how many did.
    pub fn wait_for(&self, job: Option<&str>, expect: &super::Expect, wait: Duration) -> usize {
        let start = Instant::now();
        loop {
            let n = self.arrived(job, expect);
            if n >= expect.count() || start.elapsed() >= wait {
                return n;
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Hands every capture under `job` to `each`, one at a time and in
    /// natural order (so memory holds a few captures, not the fleet's),
    /// and returns the names refused. A board's captures are fetched a
    /// few at a time ahead of `each`. A node whose name two posters
    /// posted is handed over as unreadable (a conflict naming both), as
    /// is, with `since`, one posted before it (by the server's clock, the
    /// time sealed in etcd, a file's modification time). Names outside
    /// `wanted` are handed over unread.
    ///
    /// # Errors
    /// When the job cannot be listed.
    pub fn for_each(&self, job: Option<&str>, since: Option<SystemTime>, wanted: Option<&HashSet<&str>>, mut each: impl FnMut(Posted)) -> Result<Vec<Unreadable>, String> {
        // A name outside those wanted is handed over unread: what it
        // holds cannot matter, nor cost the reader anything.
        let unwanted = |node: &str| wanted.is_some_and(|w| !w.contains(node));
        let unread = || Err("not among the nodes expected: not read".to_owned());
        match self {
            Collection::Dir(dir) => {
                let folder = JobDir::open(dir, job, false)?;
                let (mut found, bad) = dir_captures(&folder)?;
                found.sort_by_key(|a| natural(&a.0));
                for (node, path) in found {
                    let text = if unwanted(&node) { unread() } else { dir_capture(&folder, &node, since) };
                    each(Posted { node, place: path, text });
                }
                Ok(bad)
            }
            Collection::Board { board, shown } => {
                let (found, bad) = self.names(job)?;
                let topic = self.topic(job)?;
                // A node's own posting that cannot be believed is that
                // node's problem (unreadable); a store that stopped
                // answering is the check's (it could not run), and ends
                // the fetching rather than waiting it out node by node.
                let fetch = |node: &str| {
                    if unwanted(node) {
                        return Ok(unread());
                    }
                    match board.fetch(topic, node) {
                        Ok(Some(p)) => Ok(not_before(p.posted_at, since).and_then(|()| String::from_utf8(p.blob).map_err(|_| "the posting is not UTF-8 text".to_owned()))),
                        Ok(None) => Ok(Err("listed, then gone before it was read (removed or expired)".to_owned())),
                        Err(e @ EngineError::Rendezvous { .. }) => Err(format!("{shown}: {e}")),
                        Err(e) => Ok(Err(format!("{shown}: {e}"))),
                    }
                };
                fetch_ahead(&found, &fetch, &mut each)?;
                Ok(bad)
            }
        }
    }
}

/// What fetching one posting gives: the node's text or why it is
/// unreadable, or (outer `Err`) why the store cannot be read at all.
type Fetched = Result<Result<String, String>, String>;

/// Fetches `found` with [`FETCHERS`] threads, handing each to `each` in
/// order; at most a few fetched captures wait in memory at a time. The
/// first failure of the store itself stops every fetcher and is returned.
fn fetch_ahead(found: &[(String, String)], fetch: &(dyn Fn(&str) -> Fetched + Sync), each: &mut dyn FnMut(Posted)) -> Result<(), String> {
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let mut slots = Vec::with_capacity(FETCHERS);
        for k in 0..FETCHERS {
            // One bounded channel per fetcher, read in turn: order kept,
            // each fetcher at most two captures ahead.
            let (tx, rx) = mpsc::sync_channel::<(usize, Fetched)>(1);
            slots.push(rx);
            let stop = &stop;
            s.spawn(move || {
                for (i, (node, _)) in found.iter().enumerate().skip(k).step_by(FETCHERS) {
                    if stop.load(std::sync::atomic::Ordering::Relaxed) || tx.send((i, fetch(node))).is_err() {
                        return;
                    }
                }
            });
        }
        let mut result = Ok(());
        for (i, (node, place)) in found.iter().enumerate() {
            match slots[i % FETCHERS].recv() {
                Ok((j, Ok(text))) if j == i => each(Posted { node: node.clone(), place: place.clone(), text }),
                Ok((_, Err(e))) => {
                    result = Err(e);
                    break;
                }
                _ => {
                    result = Err(format!("fetching {node} stopped unanswered"));
                    break;
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        // Receivers dropped here: a fetcher blocked on a full channel returns.
        drop(slots);
        result
    })
}

/// Refuses what was posted at `at` when that is before `since`, the
/// job's start; a time the place cannot tell is refused too (never
/// judged as recent).
fn not_before(at: Option<SystemTime>, since: Option<SystemTime>) -> Result<(), String> {
    let Some(since) = since else { return Ok(()) };
    let secs = |t: SystemTime| t.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    match at {
        Some(at) if at >= since => Ok(()),
        Some(at) => Err(format!("posted at {} (unix seconds), before the job's start at {} (--since): a capture of an earlier run, not judged", secs(at), secs(since))),
        None => Err("the place cannot tell when it was posted, so it cannot be shown to be of this job (--since)".into()),
    }
}

/// A node's capture in a job's folder, or why it is not judged: a link,
/// not a regular file, posted by more than one poster, or before `since`.
fn dir_capture(folder: &JobDir, node: &str, since: Option<SystemTime>) -> Result<String, String> {
    let posters = folder.posters(node)?;
    if posters.len() > 1 {
        return Err(format!(
            "claimed by more than one poster: {} (its .{node}.poster says); neither is believed (remove {node}.json and .{node}.poster, then post again from its own node)",
            posters.join(" and ")
        ));
    }
    match folder.read(&format!("{node}.json"), "capture", crate::doctor::input::CAPTURE_LIMIT)? {
        Some((bytes, meta)) => {
            not_before(meta.modified().ok(), since)?;
            Ok(String::from_utf8(bytes).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
        }
        None => Err("listed, then gone before it was read (removed)".into()),
    }
}

/// A job folder's captures (node name, path) and the files refused for
/// their names.
fn dir_captures(folder: &JobDir) -> Result<Found, String> {
    let mut found = Vec::new();
    let mut bad = Vec::new();
    for file in folder.names()? {
        let Some(name) = file.strip_suffix(".json").map(str::to_owned) else { continue };
        if !valid_name(&name) {
            bad.push(Unreadable { file: folder.shown(&file), error: "not a node name (letters, digits, '-', '_', '.')".into() });
            continue;
        }
        if found.len() >= MAX_NODES {
            return Err(format!("{}: more than {MAX_NODES} captures", folder.shown("")));
        }
        found.push((name, folder.shown(&file)));
    }
    Ok((found, bad))
}
