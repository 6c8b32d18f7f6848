//! Postings: named blobs under a topic, posted by many processes and read
//! together by one, through the same stores agents rendezvous in (the
//! embedded server, etcd). What a pre-launch check collects: every node
//! of a job posts its report under the job's id, and a gate reads them
//! all. The library carries the bytes and proves who may post them; what
//! they mean is the caller's.
//!
//! Who may post is who holds the cluster's secret: the embedded server
//! serves only requests proven with it (and binds a posting to the
//! address that made it: another address may not replace or remove it);
//! in etcd, whoever can write the cluster could write a key, so each
//! value is sealed with the secret over its topic, name and bytes, and a
//! value whose seal does not verify is an error when fetched, never
//! believed (nor copied under another name).
//!
//! Bounds: a posting holds at most [`MAX_POSTING`] bytes; topics and
//! names are short and plain ([`posting_name_ok`]); a topic lists at most
//! [`MAX_ENTRIES`] names.

use super::super::error::EngineError;

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

/// Named blobs under a topic: posted by many, listed and fetched by one.
/// `Send + Sync`: one handle may serve every thread.
pub trait Board: Send + Sync {
    /// Posts `blob` as `name` under `topic`, replacing what this poster
    /// put there before.
    ///
    /// # Errors
    /// [`EngineError::Config`] for a topic or name that is not
    /// [plain](posting_name_ok) or a blob over [`MAX_POSTING`];
    /// [`EngineError::Auth`] when no cluster secret is at hand where the
    /// store needs one; [`EngineError::Rendezvous`] when the store cannot
    /// be reached or refuses it (its budgets, a posting of that name made
    /// from another address, a secret it does not share).
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
    /// secret, or copied from another name).
    fn fetch(&self, topic: &str, name: &str) -> Result<Option<Vec<u8>>, EngineError>;

    /// Removes `name` under `topic` (nothing there is fine).
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

    /// What every board does: a post is listed and fetched, a second
    /// replaces it, topics are apart, a remove (twice is fine) empties it,
    /// and bad names and sizes are refused before anything is sent.
    pub(in super::super) fn post_list_fetch_remove(b: &dyn Board) {
        b.post("job-1", "node002", b"two").unwrap();
        b.post("job-1", "node001", b"one").unwrap();
        b.post("job-2", "node001", b"other job").unwrap();
        assert_eq!(b.names("job-1").unwrap(), ["node001", "node002"]);
        assert_eq!(b.fetch("job-1", "node001").unwrap().as_deref(), Some(&b"one"[..]));
        b.post("job-1", "node001", b"one again").unwrap();
        assert_eq!(b.fetch("job-1", "node001").unwrap().as_deref(), Some(&b"one again"[..]), "a post replaces");
        assert_eq!(b.fetch("job-2", "node001").unwrap().as_deref(), Some(&b"other job"[..]));
        assert_eq!(b.fetch("job-1", "node003").unwrap(), None);
        assert!(b.names("job-3").unwrap().is_empty());
        b.remove("job-1", "node001").unwrap();
        b.remove("job-1", "node001").unwrap();
        assert_eq!(b.names("job-1").unwrap(), ["node002"]);
        b.post("job-1", "empty", b"").unwrap();
        assert_eq!(b.fetch("job-1", "empty").unwrap().as_deref(), Some(&b""[..]), "an empty posting is a posting");
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
