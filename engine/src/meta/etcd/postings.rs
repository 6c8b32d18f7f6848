//! Postings in etcd ([`Board`] for [`EtcdRendezvous`]): keys
//! `<board prefix><topic>/<name>`, each value sealed (`sealed`). A post
//! reads the key, then writes in a transaction on the revision it read:
//! over nothing, a reservation first (so the posting is sealed to the
//! revision etcd created the key at); over its own poster's value, the
//! new posting; over another poster's, a conflict naming both. A fetch
//! believes a value only when its seal verifies and it stands where it
//! was sealed (the key's creation, version and lease).

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, GetOptions, PutOptions, Txn, TxnOp};

use crate::wire::auth::{AuthError, Key};
use crate::error::EngineError;
use super::super::board::{check_blob, check_posting, plain_poster, posting_name_ok, Board, Posting, MAX_ENTRIES};
use super::super::rdv_err;
use super::super::sealed::{now_ms, poster_name, Kind, Sealed};
use super::EtcdRendezvous;

/// Tries a post makes while other writes to the key come between its
/// read and its write.
const RACES: usize = 8;
/// How long a handle's fetches wait, in all, for reserved keys' postings
/// to be written (a post writes its posting right after reserving).
const RESERVED_WAIT: Duration = Duration::from_secs(2);

/// Postings as sealed keys; see the module's documentation.
impl Board for EtcdRendezvous {
    fn post(&self, topic: &str, name: &str, blob: &[u8]) -> Result<(), EngineError> {
        check_posting(topic, Some(name))?;
        check_blob(topic, name, blob)?;
        let lease = match self.lease_ttl {
            Some(ttl) => Some(self.lease_id(ttl)?),
            None => None,
        };
        let p = Poster { key: self.sealer()?.clone(), topic: topic.to_owned(), name: name.to_owned(), me: self.poster.clone(), lease };
        let (mut c, k, blob) = (self.client.clone(), self.posting_key(topic, name), blob.to_vec());
        let tried = self.run(self.timeout, async move {
            for _ in 0..RACES {
                match post_once(&mut c, &k, &p, &blob).await? {
                    Tried::Raced => continue,
                    done => return Ok(done),
                }
            }
            Ok(Tried::Raced)
        })?;
        match tried {
            Tried::Posted => Ok(()),
            Tried::Conflict(posters) => Err(EngineError::PostingConflict { posting: format!("{topic}/{name}"), posters: posters.iter().map(|p| plain_poster(p)).collect() }),
            Tried::Raced => Err(rdv_err(&self.server, format!("{topic}/{name} was written {RACES} times between this post's read and its write: another poster of that name?"))),
        }
    }

    fn names(&self, topic: &str) -> Result<Vec<String>, EngineError> {
        check_posting(topic, None)?;
        self.sealer()?;
        let (mut c, under) = (self.client.clone(), self.posting_key(topic, ""));
        let opts = GetOptions::new().with_prefix().with_keys_only().with_limit(MAX_ENTRIES as i64 + 1);
        let keys: Vec<Vec<u8>> = self.run(self.timeout, async move { c.get(under, Some(opts)).await.map(|r| r.kvs().iter().map(|kv| kv.key().to_vec()).collect()) })?;
        if keys.len() > MAX_ENTRIES {
            return Err(rdv_err(&self.server, format!("topic {topic:?} holds more than {MAX_ENTRIES} postings")));
        }
        let under = self.posting_key(topic, "");
        let mut names = Vec::with_capacity(keys.len());
        for k in keys {
            // Keys no post makes (written by hand, or by a hostile
            // writer) are no posting: fetching them could only fail.
            match std::str::from_utf8(&k).ok().and_then(|k| k.strip_prefix(under.as_str())) {
                Some(n) if posting_name_ok(n) => names.push(n.to_owned()),
                _ => tracing::warn!(key = %String::from_utf8_lossy(&k), "etcd: a key under the board's topic that no post makes, left out"),
            }
        }
        names.sort_unstable();
        Ok(names)
    }

    fn fetch(&self, topic: &str, name: &str) -> Result<Option<Posting>, EngineError> {
        check_posting(topic, Some(name))?;
        let sealer = self.sealer()?;
        let posting = format!("{topic}/{name}");
        loop {
            let (mut c, key) = (self.client.clone(), self.posting_key(topic, name));
            let got = self.run(self.timeout, async move {
                c.get(key, None).await.map(|r| r.kvs().first().map(|kv| (kv.value().to_vec(), kv.create_revision(), kv.version(), kv.lease())))
            })?;
            let Some((value, created, version, lease)) = got else { return Ok(None) };
            let s = Sealed::open(&value, sealer, topic, name).map_err(|why| EngineError::Auth {
                peer: format!("etcd {}", self.server),
                source: AuthError::BadProof { what: format!("the posting {topic}/{name} ({why})") },
            })?;
            if let Some(reason) = s.misplaced(created, version, lease) {
                return Err(EngineError::StalePosting { posting, reason });
            }
            match s.kind {
                Kind::Posting => return Ok(Some(Posting { posted_at: Some(s.posted_at()), blob: s.blob })),
                Kind::Conflict => return Err(EngineError::PostingConflict { posting, posters: s.shown_posters() }),
                Kind::Reserved if Instant::now() < self.reserved_until() => std::thread::sleep(Duration::from_millis(50)),
                Kind::Reserved => {
                    let reason = format!("reserved by {} {} ms after the epoch and never written: a post that stopped half-way (post it again)", s.shown_posters().join(", "), s.at_ms);
                    return Err(EngineError::StalePosting { posting, reason });
                }
            }
        }
    }

    fn remove(&self, topic: &str, name: &str) -> Result<(), EngineError> {
        check_posting(topic, Some(name))?;
        self.sealer()?;
        let (mut c, key) = (self.client.clone(), self.posting_key(topic, name));
        self.run(self.timeout, async move { c.delete(key, None).await.map(drop) })
    }
}

impl EtcdRendezvous {
    /// The end of the handle's one window of waiting for reservations,
    /// opened by the first reservation met.
    fn reserved_until(&self) -> Instant {
        *self.reserved_until.lock().get_or_insert_with(|| Instant::now() + RESERVED_WAIT.min(self.timeout))
    }
}

/// What a post seals with, moved onto the runtime.
struct Poster {
    key: Key,
    topic: String,
    name: String,
    /// The poster's name for itself.
    me: String,
    lease: Option<i64>,
}

/// What one try at a post came to.
enum Tried {
    Posted,
    /// Another poster holds the name: every poster the key now names.
    Conflict(Vec<String>),
    /// The key was written between this try's read and its write.
    Raced,
}

/// One try at posting `blob` at key `k`: read the key, then write in a
/// transaction on what was read.
async fn post_once(c: &mut Client, k: &str, p: &Poster, blob: &[u8]) -> Result<Tried, etcd_client::Error> {
    let lease = p.lease.unwrap_or(0);
    let opts = || p.lease.map(|l| PutOptions::new().with_lease(l));
    let seal = |kind, created, version, posters: Vec<String>, blob: Vec<u8>| Sealed { kind, created, version, lease, at_ms: now_ms(), posters, blob }.seal(&p.key, &p.topic, &p.name);
    let write_over = |rev: i64, value: Vec<u8>| Txn::new().when([Compare::mod_revision(k, CompareOp::Equal, rev)]).and_then([TxnOp::put(k, value, opts())]);
    let got = c.get(k, None).await?;
    let Some(kv) = got.kvs().first() else {
        // The key is made by a reservation first, so the posting can be
        // sealed to the revision etcd made it at.
        let reserve = seal(Kind::Reserved, 0, 1, vec![p.me.clone()], Vec::new());
        let made = c.txn(Txn::new().when([Compare::create_revision(k, CompareOp::Equal, 0)]).and_then([TxnOp::put(k, reserve, opts())])).await?;
        if !made.succeeded() {
            return Ok(Tried::Raced);
        }
        let created = made.header().map(|h| h.revision()).ok_or_else(|| etcd_client::Error::InvalidArgs("etcd answered a transaction without its revision".into()))?;
        let put = match c.txn(write_over(created, seal(Kind::Posting, created, 2, vec![p.me.clone()], blob.to_vec()))).await {
            Ok(put) => put,
            Err(e) => {
                // A post that failed (etcd refused a value that large, or
                // went away) takes its reservation back, if it still can:
                // readers would otherwise wait for a posting never coming.
                let undo = Txn::new().when([Compare::mod_revision(k, CompareOp::Equal, created)]).and_then([TxnOp::delete(k, None)]);
                let _ = c.txn(undo).await;
                return Err(e);
            }
        };
        return Ok(if put.succeeded() { Tried::Posted } else { Tried::Raced });
    };
    let (created, version, rev) = (kv.create_revision(), kv.version(), kv.mod_revision());
    // Who holds the name: only a value that verifies and stands where it
    // is says; anything else is no posting, and is replaced.
    let (conflict, mut posters) = match Sealed::open(kv.value(), &p.key, &p.topic, &p.name) {
        Ok(s) if s.misplaced(created, version, kv.lease()).is_none() => (s.kind == Kind::Conflict || s.posters.iter().any(|h| *h != p.me), s.posters),
        _ => (false, Vec::new()),
    };
    if !conflict {
        let put = c.txn(write_over(rev, seal(Kind::Posting, created, version + 1, vec![p.me.clone()], blob.to_vec()))).await?;
        return Ok(if put.succeeded() { Tried::Posted } else { Tried::Raced });
    }
    if !posters.contains(&p.me) {
        posters.push(p.me.clone());
    }
    let put = c.txn(write_over(rev, seal(Kind::Conflict, created, version + 1, posters.clone(), Vec::new()))).await?;
    Ok(if put.succeeded() { Tried::Conflict(posters) } else { Tried::Raced })
}

/// This host's name, as postings name their poster by default.
pub(super) fn this_host() -> String {
    match std::fs::read_to_string("/proc/sys/kernel/hostname") {
        Ok(h) if !h.trim().is_empty() => poster_name(h.trim()),
        _ => "(a host without a name)".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::auth::ClusterSecret;
    use crate::DEFAULT_BOARD_PREFIX;
    use testkit::Etcd;

    use super::super::tests::put_raw;

    const T: Duration = Duration::from_secs(2);

    /// Postings: the board's contract; a value not sealed with this
    /// secret (forged, or sealed with another, or moved under another
    /// name) is an error when fetched; no secret, no postings.
    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn postings_are_sealed_with_the_secret() {
        let etcd = Etcd::local();
        let secret = |b: u8| ClusterSecret::new(vec![b; 32]).unwrap();
        let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_secret(secret(1));
        crate::meta::board::tests::post_list_fetch_remove(&rdv);
        rdv.post("job-1", "node001", b"healthy").unwrap();
        // A writer with another secret, and one with none but etcd access.
        let other = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_secret(secret(2));
        other.post("job-1", "node002", b"forged").unwrap();
        put_raw(&rdv, rdv.posting_key("job-1", "node003"), b"no seal at all, long enough to hold one".to_vec());
        // A sealed value copied under another name.
        let mut c = rdv.client.clone();
        let sealed = rdv
            .run(T, async move { c.get("/gpudirect/board/job-1/node001", None).await.map(|r| r.kvs()[0].value().to_vec()) })
            .unwrap();
        put_raw(&rdv, rdv.posting_key("job-1", "node004"), sealed);
        put_raw(&rdv, format!("{}job-1/not/plain", DEFAULT_BOARD_PREFIX), b"x".to_vec());
        assert_eq!(rdv.names("job-1").unwrap(), ["node001", "node002", "node003", "node004"], "keys no post makes are left out");
        assert_eq!(rdv.fetch("job-1", "node001").unwrap().unwrap().blob, b"healthy");
        for n in ["node002", "node003", "node004"] {
            match rdv.fetch("job-1", n) {
                Err(EngineError::Auth { source: AuthError::BadProof { what }, .. }) => assert!(what.contains(n), "{what}"),
                r => panic!("{n}: {r:?}"),
            }
        }
        let mut none = EtcdRendezvous::connect(&[etcd.url()], T).unwrap();
        none.secret = None;
        for e in [none.post("job-1", "x", b"x").unwrap_err(), none.fetch("job-1", "node001").unwrap_err()] {
            assert!(matches!(e, EngineError::Auth { source: AuthError::Secret(_), .. }), "{e}");
        }
    }

    fn get_raw(r: &EtcdRendezvous, key: String) -> Vec<u8> {
        let mut c = r.client.clone();
        r.run(T, async move { c.get(key, None).await.map(|r| r.kvs()[0].value().to_vec()) }).unwrap()
    }

    fn secret(b: u8) -> ClusterSecret {
        ClusterSecret::new(vec![b; 32]).unwrap()
    }

    /// A member holding the secret posts a node's name (from another
    /// host, as its seal names it): whoever posted first, the second post
    /// is refused naming both, and every fetch after is a conflict naming
    /// both; the squatter posting again does not end it; a remove does.
    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn a_squatted_posting_is_a_conflict_naming_both_hosts() {
        let etcd = Etcd::local();
        let at = |host: &str| EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_secret(secret(1)).with_poster(host);
        let (squatter, node) = (at("squatter-host"), at("node2-host"));
        crate::meta::board::tests::a_second_poster_is_a_conflict(&squatter, &node, ("squatter-host", "node2-host"));
        assert!(matches!(squatter.post("job-s", "node2", b"again"), Err(EngineError::PostingConflict { .. })));
        match node.fetch("job-s", "node2") {
            Err(EngineError::PostingConflict { posters, .. }) => assert_eq!(posters, ["squatter-host", "node2-host"]),
            r => panic!("{r:?}"),
        }
        node.remove("job-s", "node2").unwrap();
        node.post("job-s", "node2", b"node2's").unwrap();
        node.post("job-s", "node2", b"node2's again").unwrap();
        let got = node.fetch("job-s", "node2").unwrap().unwrap();
        assert_eq!(got.blob, b"node2's again", "a poster replaces its own");
        let age = std::time::SystemTime::now().duration_since(got.posted_at.unwrap()).unwrap();
        assert!(age < Duration::from_secs(5), "sealed {age:?} ago");
    }

    /// Whoever can write etcd puts an old sealed posting back: after a
    /// remove, over the node's newer posting, after its lease expired.
    /// Each is refused with the reason, never believed; the node's next
    /// post replaces it. A reservation never followed by its posting is
    /// refused after a bounded wait.
    #[test]
    #[ignore = "needs etcd (Debian: etcd-server)"]
    fn an_old_sealed_posting_put_back_is_refused() {
        let etcd = Etcd::local();
        let rdv = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_secret(secret(1));
        let key = rdv.posting_key("job-r", "node1");
        let stale = |r: Result<Option<Posting>, EngineError>, name: &str, why: &str| match r {
            Err(EngineError::StalePosting { posting, reason }) => assert!(posting.contains(&format!("job-r/{name}")) && reason.contains(why), "{posting}: {reason}"),
            r => panic!("not refused as stale ({why}): {r:?}"),
        };
        // After a remove.
        rdv.post("job-r", "node1", b"old").unwrap();
        let old = get_raw(&rdv, key.clone());
        rdv.remove("job-r", "node1").unwrap();
        put_raw(&rdv, key.clone(), old.clone());
        stale(rdv.fetch("job-r", "node1"), "node1", "after it was removed");
        // Over a newer one.
        rdv.post("job-r", "node1", b"first").unwrap();
        let first = get_raw(&rdv, key.clone());
        rdv.post("job-r", "node1", b"newer").unwrap();
        put_raw(&rdv, key.clone(), first);
        stale(rdv.fetch("job-r", "node1"), "node1", "an older posting put back over a newer one");
        rdv.post("job-r", "node1", b"newest").unwrap();
        assert_eq!(rdv.fetch("job-r", "node1").unwrap().unwrap().blob, b"newest", "the node's own post replaces what was put back");
        // After its lease expired (which deleted the key).
        let leased = EtcdRendezvous::connect(&[etcd.url()], T).unwrap().with_secret(secret(1)).with_lease(Duration::from_secs(2));
        leased.post("job-r", "node9", b"leased").unwrap();
        let was = get_raw(&rdv, rdv.posting_key("job-r", "node9"));
        drop(leased);
        let dropped = Instant::now();
        while rdv.fetch("job-r", "node9").unwrap().is_some() {
            assert!(dropped.elapsed() < Duration::from_secs(15), "the lease did not expire");
            std::thread::sleep(Duration::from_millis(200));
        }
        put_raw(&rdv, rdv.posting_key("job-r", "node9"), was);
        stale(rdv.fetch("job-r", "node9"), "node9", "after it was removed or its lease expired");
        // Reservations whose postings never came: refused, after one
        // wait for them all, not one each.
        let k = rdv.secret.clone().unwrap();
        let reserved = Sealed { kind: Kind::Reserved, created: 0, version: 1, lease: 0, at_ms: now_ms(), posters: vec!["died".into()], blob: vec![] };
        for i in 0..20 {
            let n = format!("gone{i}");
            put_raw(&rdv, rdv.posting_key("job-r", &n), reserved.seal(&k, "job-r", &n));
        }
        let t = Instant::now();
        for i in 0..20 {
            let n = format!("gone{i}");
            stale(rdv.fetch("job-r", &n), &n, "never written");
        }
        assert!(t.elapsed() < RESERVED_WAIT + T, "20 reservations left behind held the reader {:?}", t.elapsed());
        // A post etcd refuses (over its 1.5 MiB request limit) takes its
        // reservation back: nothing is left for a reader to wait on.
        assert!(matches!(rdv.post("job-r", "big", &vec![b' '; 3 << 20]), Err(EngineError::Rendezvous { .. })));
        assert_eq!(rdv.fetch("job-r", "big").unwrap(), None);
    }

}
