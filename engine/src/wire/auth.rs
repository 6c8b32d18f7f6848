//! Who may talk to an agent: the cluster's secret, the proofs made with
//! it, and why a peer or a blob was not believed. A leaf: it knows
//! nothing of agents or connections.
//!
//! Every proof is HMAC-SHA-256 keyed by the secret over a label (which
//! message it is, so a proof of one kind is never accepted as another)
//! and length-prefixed parts (so two different transcripts never MAC the
//! same bytes). Proofs over a control connection cover fresh nonces from
//! both sides: a recorded handshake does not verify again. Checks are
//! constant-time ([`Mac::verify_slice`]).
//!
//! Without a secret the same proofs are made with a public key, so the
//! protocol is one, and agents with and without a secret refuse each
//! other with a reason; such an agent authenticates nobody, and
//! [`Key::resolve`] allows it only on loopback or when asked for by name
//! (`insecure`).

use std::fmt;
use std::net::IpAddr;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a proof (an HMAC-SHA-256 tag) and of a nonce.
pub(crate) const TAG: usize = 32;
/// Fewest bytes a secret may have.
pub const MIN_SECRET: usize = 16;
/// Longest secret accepted (a file of more is not a secret).
const MAX_SECRET: usize = 4096;
/// The environment variable naming a file that holds the secret.
pub const SECRET_FILE_ENV: &str = "GPUDIRECT_SECRET_FILE";
/// The environment variable holding the secret itself (the file is
/// better: the environment of a process is readable by more than it).
pub const SECRET_ENV: &str = "GPUDIRECT_SECRET";
/// The key of agents without a secret: public, so it proves nothing.
const NO_SECRET: &[u8] = b"gpudirect: no cluster secret (loopback or insecure)";

/// Why a peer, a request or a blob was not believed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// A proof made with the cluster's secret did not verify: the other
    /// side holds another secret, none, or replayed an old exchange.
    #[error("{what} did not verify: the other side does not hold this agent's cluster secret (give every agent and the rendezvous the same one: AgentConfig::secret or {SECRET_FILE_ENV}), or it replayed an earlier exchange")]
    BadProof {
        /// What was not proven (`the peer's handshake`, `the metadata of "decode-0"`).
        what: String,
    },
    /// A peer holding the secret claims a name whose metadata loaded here
    /// says otherwise: a stale process, or a member impersonating another.
    #[error("agent {name:?} does not match the metadata loaded for it: {mismatch}; reload its metadata if it restarted")]
    NotAsLoaded {
        /// The name claimed.
        name: String,
        /// Which fact differs, both values.
        mismatch: String,
    },
    /// The secret given cannot be used.
    #[error("cluster secret: {0}")]
    Secret(String),
    /// No secret, and the port would be reachable from the network.
    #[error("{what} at {addr} is reachable from the network and no cluster secret is set: set one (AgentConfig::secret, or {SECRET_FILE_ENV} naming a file of at least {MIN_SECRET} random bytes, the same on every agent and the rendezvous), or bind loopback only; `insecure` turns this check off, and then anyone who reaches the port can take a peer's name and read and write its registered memory")]
    Unprotected {
        /// What would listen (`the control listener`).
        what: &'static str,
        /// Where.
        addr: String,
    },
}

/// The secret every agent of one cluster (job) shares: only holders get a
/// queue pair, publish to the rendezvous, or make metadata other agents
/// load. At least [`MIN_SECRET`] bytes; make it random (`head -c 32
/// /dev/urandom > secret`). Its `Debug` never shows it; its bytes are
/// wiped when dropped.
#[derive(Clone)]
pub struct ClusterSecret(Box<[u8]>);

impl ClusterSecret {
    /// A secret from its bytes.
    ///
    /// # Errors
    /// [`AuthError::Secret`] for fewer than [`MIN_SECRET`] or more than
    /// 4096 bytes.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<ClusterSecret, AuthError> {
        let b = bytes.into();
        if b.len() < MIN_SECRET || b.len() > MAX_SECRET {
            return Err(AuthError::Secret(format!("{} bytes; a secret has {MIN_SECRET} to {MAX_SECRET}", b.len())));
        }
        Ok(ClusterSecret(b.into_boxed_slice()))
    }

    /// The secret in the file at `path` (one trailing newline is not part
    /// of it).
    ///
    /// # Errors
    /// [`AuthError::Secret`] when the file cannot be read or holds no
    /// usable secret.
    pub fn from_file(path: impl AsRef<Path>) -> Result<ClusterSecret, AuthError> {
        let path = path.as_ref();
        let mut b = std::fs::read(path).map_err(|e| AuthError::Secret(format!("cannot read {}: {e}", path.display())))?;
        if b.last() == Some(&b'\n') {
            b.pop();
        }
        ClusterSecret::new(b).map_err(|e| AuthError::Secret(format!("{}: {e}", path.display())))
    }

    /// The secret the environment names: the file in
    /// `GPUDIRECT_SECRET_FILE`, else the text of `GPUDIRECT_SECRET`;
    /// `None` when neither is set.
    ///
    /// # Errors
    /// [`AuthError::Secret`] when one is set and unusable.
    pub fn from_env() -> Result<Option<ClusterSecret>, AuthError> {
        if let Some(p) = std::env::var_os(SECRET_FILE_ENV).filter(|p| !p.is_empty()) {
            return ClusterSecret::from_file(p).map(Some);
        }
        match std::env::var_os(SECRET_ENV).filter(|s| !s.is_empty()) {
            Some(s) => {
                use std::os::unix::ffi::OsStringExt;
                ClusterSecret::new(s.into_vec()).map(Some).map_err(|e| AuthError::Secret(format!("{SECRET_ENV}: {e}")))
            }
            None => Ok(None),
        }
    }
}

impl fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl PartialEq for ClusterSecret {
    fn eq(&self, other: &ClusterSecret) -> bool {
        self.0.len() == other.0.len() && self.0.iter().zip(other.0.iter()).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
    }
}

impl Eq for ClusterSecret {}

impl Drop for ClusterSecret {
    fn drop(&mut self) {
        for b in self.0.iter_mut() {
            // SAFETY: `b` is a valid, aligned, exclusive reference; a
            // volatile write keeps the wipe from being optimised away.
            unsafe { std::ptr::write_volatile(b, 0) };
        }
    }
}

/// The key proofs are made with: the secret's, or the public one.
#[derive(Clone)]
pub(crate) struct Key {
    secret: Option<ClusterSecret>,
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.secret.is_some() { "Key(cluster secret)" } else { "Key(none)" })
    }
}

/// Which proof a tag is: each label is MACed first, so a tag made for one
/// message never verifies as another.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Label {
    /// The initiator of a control connection: its request.
    Initiator,
    /// The target of a control connection: who it is.
    Target,
    /// The target's answer to a request.
    Answer,
    /// Agent metadata.
    Metadata,
    /// A request to the rendezvous server.
    RendezvousRequest,
    /// The rendezvous server's answer.
    RendezvousAnswer,
    /// A posting's seal (a value in a store anyone may write: etcd).
    #[cfg_attr(not(feature = "etcd"), allow(dead_code))]
    Posting,
}

impl Label {
    fn bytes(self) -> &'static [u8] {
        match self {
            Label::Initiator => b"gpudirect engine control v3: initiator",
            Label::Target => b"gpudirect engine control v3: target",
            Label::Answer => b"gpudirect engine control v3: answer",
            Label::Metadata => b"gpudirect agent metadata v2",
            Label::RendezvousRequest => b"gpudirect rendezvous v2: request",
            Label::RendezvousAnswer => b"gpudirect rendezvous v2: answer",
            Label::Posting => b"gpudirect posting v1",
        }
    }
}

impl Key {
    /// The key of `secret`, or of the environment's secret, checked
    /// against where `what` listens: without a secret only a loopback
    /// address, or `insecure`.
    ///
    /// # Errors
    /// [`AuthError::Secret`] for an unusable secret in the environment;
    /// [`AuthError::Unprotected`] with no secret on a network address.
    pub(crate) fn resolve(secret: Option<&ClusterSecret>, insecure: bool, what: &'static str, listen: Option<IpAddr>) -> Result<Key, AuthError> {
        let secret = match secret {
            Some(s) => Some(s.clone()),
            None => ClusterSecret::from_env()?,
        };
        Key::guard(secret, insecure, what, listen)
    }

    /// The rule of [`resolve`](Self::resolve) once the secret is known
    /// (given or from the environment): none is allowed only on loopback
    /// or with `insecure`.
    fn guard(secret: Option<ClusterSecret>, insecure: bool, what: &'static str, listen: Option<IpAddr>) -> Result<Key, AuthError> {
        if secret.is_none() && !insecure {
            if let Some(ip) = listen.filter(|ip| !ip.is_loopback()) {
                return Err(AuthError::Unprotected { what, addr: ip.to_string() });
            }
        }
        if secret.is_none() && insecure {
            tracing::warn!("{what}: no cluster secret and `insecure` set: anyone who reaches it is believed");
        }
        Ok(Key { secret })
    }

    /// The key of `secret` as given (none: the public key), for clients
    /// that listen nowhere.
    pub(crate) fn of(secret: Option<ClusterSecret>) -> Key {
        Key { secret }
    }

    /// Whether a cluster secret keys it.
    pub(crate) fn is_secret(&self) -> bool {
        self.secret.is_some()
    }

    fn mac(&self, label: Label, parts: &[&[u8]]) -> Hmac<Sha256> {
        let key: &[u8] = self.secret.as_ref().map_or(NO_SECRET, |s| &s.0);
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes keys of any length");
        let label = label.bytes();
        m.update(&(label.len() as u32).to_be_bytes());
        m.update(label);
        for p in parts {
            m.update(&(p.len() as u32).to_be_bytes());
            m.update(p);
        }
        m
    }

    /// The proof of `parts` as `label`.
    pub(crate) fn tag(&self, label: Label, parts: &[&[u8]]) -> [u8; TAG] {
        self.mac(label, parts).finalize().into_bytes().into()
    }

    /// Whether `tag` proves `parts` as `label` (constant-time).
    pub(crate) fn verify(&self, label: Label, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.mac(label, parts).verify_slice(tag).is_ok()
    }
}

/// Fresh random bytes from the kernel (a nonce, an instance id).
///
/// # Panics
/// Never in practice: `getrandom(2)` on Linux fails only for bad
/// arguments, or on a kernel older than 3.17, where it reads
/// `/dev/urandom` instead.
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut out = [0u8; N];
    let mut got = 0;
    while got < N {
        // SAFETY: the pointer and length describe the unfilled tail of
        // `out`, which lives across the call.
        let n = unsafe { libc::getrandom(out[got..].as_mut_ptr().cast(), N - got, 0) };
        if n > 0 {
            got += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            use std::io::Read;
            std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut out)).expect("no source of random bytes (getrandom, /dev/urandom)");
            return out;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(s: &[u8]) -> Key {
        Key::of(Some(ClusterSecret::new(s.to_vec()).unwrap()))
    }

    #[test]
    fn tags_bind_key_label_and_every_part() {
        let k = key(b"0123456789abcdef");
        let t = k.tag(Label::Initiator, &[b"ab", b"c"]);
        assert!(k.verify(Label::Initiator, &[b"ab", b"c"], &t));
        assert!(!k.verify(Label::Target, &[b"ab", b"c"], &t), "another label");
        assert!(!k.verify(Label::Initiator, &[b"a", b"bc"], &t), "parts are length-prefixed");
        assert!(!k.verify(Label::Initiator, &[b"ab", b"c"], &t[..31]), "a short tag");
        assert!(!key(b"0123456789abcdeX").verify(Label::Initiator, &[b"ab", b"c"], &t), "another secret");
        assert!(!Key::of(None).verify(Label::Initiator, &[b"ab", b"c"], &t), "no secret");
        let mut bad = t;
        bad[0] ^= 1;
        assert!(!k.verify(Label::Initiator, &[b"ab", b"c"], &bad));
    }

    #[test]
    fn secrets_are_checked_hidden_and_read_from_files() {
        assert!(matches!(ClusterSecret::new(vec![1; 15]), Err(AuthError::Secret(_))));
        assert!(ClusterSecret::new(vec![1; 16]).is_ok());
        assert!(ClusterSecret::new(vec![1; 4097]).is_err());
        let s = ClusterSecret::new(b"very secret bytes!".to_vec()).unwrap();
        assert_eq!(format!("{s:?}"), "ClusterSecret(..)");
        let dir = std::env::temp_dir().join(format!("gpudirect-secret-{}", std::process::id()));
        std::fs::write(&dir, b"very secret bytes!\n").unwrap();
        assert_eq!(ClusterSecret::from_file(&dir).unwrap(), s, "one trailing newline is dropped");
        std::fs::write(&dir, b"short\n").unwrap();
        let e = ClusterSecret::from_file(&dir).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains("gpudirect-secret"), "{e}");
        std::fs::remove_file(&dir).unwrap();
        assert!(ClusterSecret::from_file(&dir).unwrap_err().to_string().contains("cannot read"));
    }

    #[test]
    fn without_a_secret_only_loopback_or_insecure_listens() {
        // The rule itself, whatever this process's environment holds.
        let any: IpAddr = "0.0.0.0".parse().unwrap();
        let e = Key::guard(None, false, "the control listener", Some(any)).unwrap_err();
        assert!(matches!(e, AuthError::Unprotected { .. }));
        assert!(e.to_string().contains(SECRET_FILE_ENV), "{e}");
        assert!(!Key::guard(None, false, "x", Some("127.0.0.1".parse().unwrap())).unwrap().is_secret());
        assert!(!Key::guard(None, false, "x", Some("::1".parse().unwrap())).unwrap().is_secret());
        assert!(!Key::guard(None, true, "x", Some(any)).unwrap().is_secret());
        let s = ClusterSecret::new(vec![7; 32]).unwrap();
        assert!(Key::guard(Some(s.clone()), false, "x", Some(any)).unwrap().is_secret());
        assert!(Key::resolve(Some(&s), false, "x", Some(any)).unwrap().is_secret(), "a given secret needs no environment");
    }

    #[test]
    fn random_bytes_differ() {
        let (a, b) = (random::<32>(), random::<32>());
        assert_ne!(a, b);
        assert_ne!(a, [0; 32]);
    }
}
