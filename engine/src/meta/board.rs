//! Postings: named blobs under a topic, posted by many processes and read
//! together by one, through the same stores agents rendezvous in (the
//! embedded server, etcd). What a pre-launch check collects: every node
//! of a job posts its report under the job's id, and a gate reads them
//! all. The library carries the bytes and proves who may post them; what
//! they mean is the caller's.
//!
//! Who may post is who holds the cluster's secret: the embedded server
//! serves only requests proven with it; in etcd, whoever can write the
//! cluster could write a key, so each value is sealed with the secret,
//! and a value whose seal does not verify is an error when fetched, never
//! believed (nor copied under another name).
//!
//! A name is its first poster's: a member holding the secret who posts
//! a name another poster holds does not replace it, and the store keeps
//! the clash, so a reader gets [`EngineError::PostingConflict`] naming
//! both rather than either posting. Each store tells posters apart as far
//! as it can: the server by the address a request came from (what TCP
//! establishes), etcd by the host the poster names inside its seal (a
//! claim any holder of the secret could make, so it catches two nodes
//! posting one name, not a member who lies).
//!
//! In etcd a seal also binds the posting to the key's incarnation (the
//! revision etcd created the key at), to how many times it was written
//! (its version), to the lease it lives under and to the time it was
//! posted: an old sealed value put back after a remove, after its lease
//! expired, or over a newer one, is [`EngineError::StalePosting`], never
//! believed. The server holds postings in memory and proves every
//! request over a fresh nonce, so nothing is put back there.
//!
//! Bounds: a posting holds at most [`MAX_POSTING`] bytes; topics and
//! names are short and plain ([`posting_name_ok`]); a topic lists at most
//! [`MAX_ENTRIES`] names.

use std::time::SystemTime;

use crate::error::EngineError;

/// Most names a [`RendezvousServer`](super::RendezvousServer) holds
/// (agents and postings together), and so the most one topic lists.
pub const MAX_ENTRIES: usize = 65536;
/// The most bytes one posting holds (a node's doctor capture is tens of
/// KiB; etcd refuses requests over 1.5 MiB unless its
/// `--max-request-bytes` is raised).
pub const MAX_POSTING: usize = 4 << 20;
/// The longest topic, in bytes.
pub const MAX_TOPIC: usize = 64;
/// The longest posting name, in bytes.
pub const MAX_POSTING_NAME: usize = 128;

/// A posting as fetched: its bytes, and when it was posted as far as
/// the store vouches for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posting {
    /// What was posted.
    pub blob: Vec<u8>,
    /// When: by the rendezvous server's clock (how long it has held it),
    /// or the poster's, sealed with it in etcd; `None` where the store
    /// cannot tell.
    pub posted_at: Option<SystemTime>,
}

/// Named blobs under a topic: posted by many, listed and fetched by one.
/// `Send + Sync`: one handle may serve every thread.
pub trait Board: Send + Sync {
    /// Posts `blob` as `name` under `topic`, replacing what this poster
    /// put there before. A name another poster holds is not replaced:
    /// the post is refused and the store keeps the clash, which every
    /// later [`fetch`](Self::fetch) reports.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a topic or name that is not
    /// [plain](posting_name_ok) or a blob over [`MAX_POSTING`];
    /// [`EngineError::Auth`] when no cluster secret is at hand where the
    /// store needs one; [`EngineError::PostingConflict`] naming both
    /// posters when another holds the name; [`EngineError::Rendezvous`]
    /// when the store cannot be reached or refuses it (its budgets, a
    /// secret it does not share).
    fn post(&self, topic: &str, name: &str, blob: &[u8]) -> Result<(), EngineError>;

    /// The names posted under `topic`, sorted.
    ///
    /// # Errors
    /// As [`post`](Self::post), and [`EngineError::Rendezvous`] for a
    /// topic holding more names than a listing carries.
    fn names(&self, topic: &str) -> Result<Vec<String>, EngineError>;

    /// What is posted as `name` under `topic`; `None` when nothing is.
    ///
    /// # Errors
    /// As [`post`](Self::post); [`EngineError::Auth`] for a value whose
    /// seal does not verify (written by someone without this cluster's
    /// secret, or copied from another name);
    /// [`EngineError::PostingConflict`] for a name more than one poster
    /// posted; [`EngineError::StalePosting`] for a sealed value that was
    /// put back (after a remove, its lease's expiry, or over a newer one).
    fn fetch(&self, topic: &str, name: &str) -> Result<Option<Posting>, EngineError>;

    /// Removes `name` under `topic` (nothing there is fine), and with it
    /// any clash over the name.
    ///
    /// # Errors
    /// As [`post`](Self::post).
    fn remove(&self, topic: &str, name: &str) -> Result<(), EngineError>;
}

/// Whether `s` is a plain topic or posting name: 1 to
/// [`MAX_POSTING_NAME`] bytes of ASCII letters, digits, `-`, `_` and `.`,
/// not starting with `.` (so it is also a file name, a key segment and a
/// Slurm or Kubernetes node name).
pub fn posting_name_ok(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_POSTING_NAME && !s.starts_with('.') && s.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// A poster's name, as read from a store, fit to print: control
/// characters escaped, so a name a member chose cannot forge a line of
/// the log or report it is printed in.
pub(super) fn plain_poster(s: &str) -> String {
    s.chars().flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] }).collect()
}

/// Checks a topic and a name before anything is sent.
pub(super) fn check_posting(topic: &str, name: Option<&str>) -> Result<(), EngineError> {
    if !posting_name_ok(topic) || topic.len() > MAX_TOPIC {
        return Err(EngineError::Config(format!("topic {topic:?}: 1 to {MAX_TOPIC} letters, digits, '-', '_' or '.', not starting with '.'")));
    }
    match name {
        Some(n) if !posting_name_ok(n) => {
            Err(EngineError::Config(format!("posting name {n:?}: 1 to {MAX_POSTING_NAME} letters, digits, '-', '_' or '.', not starting with '.'")))
        }
        _ => Ok(()),
    }
}

/// Checks a blob's size before anything is sent.
pub(super) fn check_blob(topic: &str, name: &str, blob: &[u8]) -> Result<(), EngineError> {
    if blob.len() > MAX_POSTING {
        return Err(EngineError::Config(format!("the posting {topic}/{name} holds {} bytes; at most {MAX_POSTING}", blob.len())));
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    #[test]
    fn plain_names_only() {
        for ok in ["node001", "gpu-a.rack_1", "a", &"x".repeat(MAX_POSTING_NAME)] {
            assert!(posting_name_ok(ok), "{ok}");
        }
        for bad in ["", ".hidden", "..", "a/b", "a b", "nöde", &"x".repeat(MAX_POSTING_NAME + 1)] {
            assert!(!posting_name_ok(bad), "{bad}");
        }
        assert!(check_posting(&"j".repeat(MAX_TOPIC + 1), None).is_err(), "topics are shorter than names");
        assert!(check_blob("j", "n", &vec![0; MAX_POSTING + 1]).is_err());
    }

    /// A second poster of a name, whoever posted first: its post is
    /// refused naming both, the name stays listed, and every fetch after
    /// (by either) is a conflict naming both, never either's bytes.
    /// `shown`: the squatter and the node as the store names them. Leaves
    /// `job-s/node2` in conflict (the squatter first) for the caller.
    pub(in super::super) fn a_second_poster_is_a_conflict(squatter: &dyn Board, node: &dyn Board, shown: (&str, &str)) {
        let names_both = |e: EngineError, want: [&str; 2]| match e {
            EngineError::PostingConflict { posting, posters } => {
                assert!(posting.contains("job-s/node"), "{posting}");
                assert_eq!(posters, want, "{posting}");
            }
            e => panic!("not a conflict: {e}"),
        };
        for (name, first, second, want) in [("node3", node, squatter, [shown.1, shown.0]), ("node2", squatter, node, [shown.0, shown.1])] {
            first.post("job-s", name, b"first").unwrap();
            names_both(second.post("job-s", name, b"second").unwrap_err(), want);
            for reader in [squatter, node] {
                names_both(reader.fetch("job-s", name).unwrap_err(), want);
            }
            assert!(node.names("job-s").unwrap().iter().any(|n| n == name), "a conflict stays listed: the gate sees it");
        }
        node.remove("job-s", "node3").unwrap();
        assert_eq!(node.fetch("job-s", "node3").unwrap(), None, "a remove ends it");
    }

    /// What every board does: a post is listed and fetched, a second
    /// replaces it, topics are apart, a remove (twice is fine) empties it,
    /// and bad names and sizes are refused before anything is sent.
    pub(in super::super) fn post_list_fetch_remove(b: &dyn Board) {
        let got = |t: &str, n: &str| b.fetch(t, n).unwrap().map(|p| p.blob);
        b.post("job-1", "node002", b"two").unwrap();
        b.post("job-1", "node001", b"one").unwrap();
        b.post("job-2", "node001", b"other job").unwrap();
        assert_eq!(b.names("job-1").unwrap(), ["node001", "node002"]);
        assert_eq!(got("job-1", "node001").as_deref(), Some(&b"one"[..]));
        b.post("job-1", "node001", b"one again").unwrap();
        assert_eq!(got("job-1", "node001").as_deref(), Some(&b"one again"[..]), "a post replaces");
        assert_eq!(got("job-2", "node001").as_deref(), Some(&b"other job"[..]));
        assert_eq!(got("job-1", "node003"), None);
        assert!(b.names("job-3").unwrap().is_empty());
        b.remove("job-1", "node001").unwrap();
        b.remove("job-1", "node001").unwrap();
        assert_eq!(b.names("job-1").unwrap(), ["node002"]);
        b.post("job-1", "empty", b"").unwrap();
        assert_eq!(got("job-1", "empty").as_deref(), Some(&b""[..]), "an empty posting is a posting");
        for (t, n) in [("job/1", "n"), ("", "n"), ("j", "../n"), ("j", ""), (".j", "n")] {
            assert!(matches!(b.post(t, n, b"x"), Err(EngineError::Config(_))), "{t:?} {n:?}");
        }
        assert!(matches!(b.post("job-1", "huge", &vec![0; MAX_POSTING + 1]), Err(EngineError::Config(_))));
        for n in ["empty", "node002"] {
            b.remove("job-1", n).unwrap();
        }
        b.remove("job-2", "node001").unwrap();
    }
}
