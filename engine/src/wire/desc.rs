//! What agents tell each other: an [`AgentMetadata`] names the agent,
//! where its control listener is, its NICs and the memory it registered
//! ([`MemoryDesc`]: length and, per NIC, address and rkey). Plain data with
//! one bounded binary form ([`AgentMetadata::encode`] / [`decode`](AgentMetadata::decode)),
//! the blob NIXL calls local metadata: hand it to peers by any channel
//! (a file, a key-value store, the bootstrap exchange).
//!
//! The form: `"GDAM"`, version (u16), a reserved u16, the instance (u64),
//! then the body, big-endian, and last the seal (32 bytes), a proof made
//! with the cluster's secret over everything before it. Everything from a
//! peer is untrusted: each count and length is checked against its limit
//! and against the bytes present before anything is allocated for it;
//! the seal is checked by the agent that loads the metadata.

use std::collections::HashSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::ops::Bound;

use gpudirect::Error;

use gpudirect::Gid;
use gpudirect::Mtu;
use gpudirect::decode::{Reader, Truncated};
use gpudirect::RemoteBuffer;

/// Magic bytes opening an encoded [`AgentMetadata`].
pub const METADATA_MAGIC: [u8; 4] = *b"GDAM";
/// The metadata version this library writes and reads.
pub const METADATA_VERSION: u16 = 2;
/// Bytes of a metadata seal.
pub const SEAL_LEN: usize = 32;
/// Largest encoded metadata accepted, in bytes.
pub const MAX_METADATA: usize = 1 << 20;
/// Most NICs one agent describes.
pub const MAX_NICS: usize = 16;
/// Most memory descriptors in one agent's metadata.
pub const MAX_MEMORIES: usize = 8192;
/// Longest agent, NIC or memory name, in bytes (UTF-8).
pub const MAX_NAME: usize = 255;

/// Why bytes are not valid agent metadata.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// Not agent metadata at all.
    #[error("agent metadata starts with {0:02x?}, not \"GDAM\": not gpudirect agent metadata")]
    BadMagic([u8; 4]),
    /// Written by another version of the engine.
    #[error("agent metadata version {got}, this side reads version {ours}: use the same gpudirect release on every agent")]
    Version {
        /// The version found.
        got: u16,
        /// Ours.
        ours: u16,
    },
    /// Bigger than a limit allows.
    #[error("agent metadata {what}: {len} exceeds the limit of {max}")]
    TooLarge {
        /// What was too large.
        what: &'static str,
        /// Its size or count.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// Ended inside a field.
    #[error("agent metadata truncated in {field}: needs {need} more bytes, has {have}")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// Bytes after the last field.
    #[error("agent metadata has {0} unexpected trailing bytes")]
    TrailingBytes(usize),
    /// A field holds a value that cannot be valid.
    #[error("agent metadata field {field} has invalid value {value}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A name is empty, too long or not UTF-8.
    #[error("agent metadata {field} is not a valid name (1 to 255 bytes of UTF-8)")]
    BadName {
        /// Which name.
        field: &'static str,
    },
    /// Two memory descriptors share a name.
    #[error("agent metadata lists memory {0:?} twice")]
    DuplicateMemory(String),
}

impl From<Truncated> for MetadataError {
    fn from(t: Truncated) -> Self {
        MetadataError::Truncated { field: t.field, need: t.need, have: t.have }
    }
}

/// One NIC of an agent: what a peer needs to connect a queue pair to it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct NicDesc {
    /// The RDMA device's name on the agent's host (`mlx5_0`, `rxe0`).
    pub device: String,
    /// The port used.
    pub port: u8,
    /// The port's LID (0 on RoCE).
    pub lid: u16,
    /// The GID its queue pairs send from.
    pub gid: Gid,
    /// The port's active MTU.
    pub mtu: Mtu,
}

/// Memory an agent registered, as peers target it: its name, length and,
/// for each of the agent's NICs it is registered on, where it is and its
/// rkey there.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct MemoryDesc {
    /// The name the agent registered it under.
    pub name: String,
    /// Length in bytes.
    pub len: u64,
    /// Per NIC: the index into [`AgentMetadata::nics`] and the buffer
    /// there (address, rkey; its length is `len`).
    pub keys: Vec<(u8, RemoteBuffer)>,
}

impl MemoryDesc {
    /// The buffer to target through the agent's NIC `nic`.
    pub fn on_nic(&self, nic: usize) -> Option<&RemoteBuffer> {
        self.keys.iter().find(|(n, _)| usize::from(*n) == nic).map(|(_, b)| b)
    }
}

/// Everything a peer needs to reach an agent: its name, its control
/// listener (where connections are set up on demand), its NICs and its
/// registered memory. Take it from [`Agent::metadata`](crate::Agent::metadata),
/// give it to [`Agent::load_remote`](crate::Agent::load_remote) on the peer.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct AgentMetadata {
    /// The agent's name, unique among the agents that talk to each other.
    pub name: String,
    /// Which run of the agent this is: random, new for every
    /// [`Agent::new`](crate::Agent::new). A process restarted under the
    /// same name has another, so peers tell a restart from a reconnect.
    pub instance: u64,
    /// Where its control listener accepts connection requests.
    pub control: SocketAddr,
    /// Its NICs, in its own order (memory keys index into it).
    pub nics: Vec<NicDesc>,
    /// The memory it registered.
    pub memories: Vec<MemoryDesc>,
    /// The proof, made with the cluster's secret by the agent itself
    /// ([`Agent::metadata`](crate::Agent::metadata)), that an agent
    /// holding the secret wrote every other field as they are:
    /// [`Agent::load_remote`](crate::Agent::load_remote) refuses metadata
    /// whose seal does not verify. Zero: not sealed.
    pub seal: [u8; SEAL_LEN],
}

impl fmt::Display for AgentMetadata {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "agent {:?} (instance {:016x}) at {}, {} NIC(s), {} memory region(s)", self.name, self.instance, self.control, self.nics.len(), self.memories.len())
    }
}

/// `(offset, len)` of the range from `start` to `end` within `len` bytes
/// of `what`. Local and remote ranges of transfer entries are both cut by
/// it.
///
/// # Errors
/// [`Error::OutOfBounds`] for a range that is reversed, overflows or ends
/// past `len`.
pub(crate) fn cut(what: &'static str, start: Bound<u64>, end: Bound<u64>, len: u64) -> Result<(u64, u64), Error> {
    let s = match start {
        Bound::Included(s) => Some(s),
        Bound::Excluded(s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let e = match end {
        Bound::Included(e) => e.checked_add(1),
        Bound::Excluded(e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (s, e) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok((s, e - s)),
        (s, e) => {
            let offset = s.unwrap_or(u64::MAX);
            Err(Error::OutOfBounds { what, offset, requested: e.unwrap_or(u64::MAX).saturating_sub(offset), len })
        }
    }
}

fn put_name(out: &mut Vec<u8>, name: &str) {
    out.push(name.len() as u8);
    out.extend_from_slice(name.as_bytes());
}

fn check_name(name: &str, field: &'static str) -> Result<(), MetadataError> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(MetadataError::BadName { field });
    }
    Ok(())
}

fn name(r: &mut Reader<'_>, field: &'static str) -> Result<String, MetadataError> {
    let n = r.u8(field)? as usize;
    let s = std::str::from_utf8(r.take(field, n)?).map_err(|_| MetadataError::BadName { field })?;
    check_name(s, field)?;
    Ok(s.to_owned())
}

/// Bytes of one key (NIC index and buffer) in the encoded form.
const KEY_LEN: usize = 1 + 8 + 4;

impl AgentMetadata {
    /// The binary form (see the module docs).
    ///
    /// # Errors
    /// [`MetadataError::BadName`] or [`MetadataError::TooLarge`] when the
    /// metadata breaks a limit the decoder enforces (so what encodes
    /// always decodes).
    pub fn encode(&self) -> Result<Vec<u8>, MetadataError> {
        let mut out = self.encode_sealed_part()?;
        out.extend_from_slice(&self.seal);
        if out.len() > MAX_METADATA {
            return Err(MetadataError::TooLarge { what: "size", len: out.len() as u64, max: MAX_METADATA as u64 });
        }
        Ok(out)
    }

    /// The bytes the seal covers: the binary form without the seal.
    pub(crate) fn encode_sealed_part(&self) -> Result<Vec<u8>, MetadataError> {
        check_name(&self.name, "agent name")?;
        if self.nics.len() > MAX_NICS {
            return Err(MetadataError::TooLarge { what: "NIC count", len: self.nics.len() as u64, max: MAX_NICS as u64 });
        }
        if self.memories.len() > MAX_MEMORIES {
            return Err(MetadataError::TooLarge { what: "memory count", len: self.memories.len() as u64, max: MAX_MEMORIES as u64 });
        }
        let mut out = Vec::with_capacity(64 + self.memories.len() * 48);
        out.extend_from_slice(&METADATA_MAGIC);
        out.extend_from_slice(&METADATA_VERSION.to_be_bytes());
        out.extend_from_slice(&[0, 0]);
        out.extend_from_slice(&self.instance.to_be_bytes());
        put_name(&mut out, &self.name);
        match self.control.ip() {
            IpAddr::V4(a) => {
                out.push(4);
                out.extend_from_slice(&a.octets());
            }
            IpAddr::V6(a) => {
                out.push(6);
                out.extend_from_slice(&a.octets());
            }
        }
        out.extend_from_slice(&self.control.port().to_be_bytes());
        out.push(self.nics.len() as u8);
        for n in &self.nics {
            check_name(&n.device, "NIC name")?;
            put_name(&mut out, &n.device);
            out.push(n.port);
            out.extend_from_slice(&n.lid.to_be_bytes());
            out.extend_from_slice(&n.gid.0);
            out.push(n.mtu.to_raw() as u8);
        }
        out.extend_from_slice(&(self.memories.len() as u32).to_be_bytes());
        for m in &self.memories {
            check_name(&m.name, "memory name")?;
            if m.keys.len() > self.nics.len() {
                return Err(MetadataError::TooLarge { what: "keys of one memory", len: m.keys.len() as u64, max: self.nics.len() as u64 });
            }
            put_name(&mut out, &m.name);
            out.extend_from_slice(&m.len.to_be_bytes());
            out.push(m.keys.len() as u8);
            for (nic, b) in &m.keys {
                out.push(*nic);
                out.extend_from_slice(&b.addr.to_be_bytes());
                out.extend_from_slice(&b.rkey.to_be_bytes());
            }
        }
        Ok(out)
    }

    /// Reads the binary form, checking every field; the result is
    /// internally consistent (each key names one of the NICs, at most one
    /// key per NIC, no range wraps the address space, names unique).
    ///
    /// # Errors
    /// A [`MetadataError`] naming the first field that is wrong.
    pub fn decode(bytes: &[u8]) -> Result<AgentMetadata, MetadataError> {
        if bytes.len() > MAX_METADATA {
            return Err(MetadataError::TooLarge { what: "size", len: bytes.len() as u64, max: MAX_METADATA as u64 });
        }
        let mut r = Reader(bytes);
        let magic = r.array::<4>("magic")?;
        if magic != METADATA_MAGIC {
            return Err(MetadataError::BadMagic(magic));
        }
        let version = r.u16("version")?;
        if version != METADATA_VERSION {
            return Err(MetadataError::Version { got: version, ours: METADATA_VERSION });
        }
        let reserved = r.u16("reserved")?;
        if reserved != 0 {
            return Err(MetadataError::InvalidField { field: "reserved", value: reserved.into() });
        }
        let instance = r.u64("instance")?;
        let agent = name(&mut r, "agent name")?;
        let ip = match r.u8("address family")? {
            4 => IpAddr::V4(Ipv4Addr::from(r.array::<4>("control address")?)),
            6 => IpAddr::V6(Ipv6Addr::from(r.array::<16>("control address")?)),
            f => return Err(MetadataError::InvalidField { field: "address family", value: f.into() }),
        };
        let port = r.u16("control port")?;
        if port == 0 {
            return Err(MetadataError::InvalidField { field: "control port", value: 0 });
        }
        let n_nics = r.u8("NIC count")? as usize;
        if n_nics > MAX_NICS {
            return Err(MetadataError::TooLarge { what: "NIC count", len: n_nics as u64, max: MAX_NICS as u64 });
        }
        let mut nics = Vec::with_capacity(n_nics);
        for _ in 0..n_nics {
            let device = name(&mut r, "NIC name")?;
            let port = r.u8("NIC port")?;
            let lid = r.u16("NIC LID")?;
            let gid = Gid(r.array("NIC GID")?);
            let mtu_raw = r.u8("NIC MTU")?;
            let mtu = Mtu::from_raw(mtu_raw.into()).ok_or(MetadataError::InvalidField { field: "NIC MTU", value: mtu_raw.into() })?;
            if port == 0 {
                return Err(MetadataError::InvalidField { field: "NIC port", value: 0 });
            }
            nics.push(NicDesc { device, port, lid, gid, mtu });
        }
        let n_mem = r.u32("memory count")? as usize;
        if n_mem > MAX_MEMORIES {
            return Err(MetadataError::TooLarge { what: "memory count", len: n_mem as u64, max: MAX_MEMORIES as u64 });
        }
        // Each memory takes at least a name byte, a length and a key
        // count: check the bytes exist before reserving room for them.
        r.need("memories", n_mem * (1 + 1 + 8 + 1))?;
        let mut memories = Vec::with_capacity(n_mem);
        let mut names = HashSet::with_capacity(n_mem);
        for _ in 0..n_mem {
            let name = name(&mut r, "memory name")?;
            let len = r.u64("memory length")?;
            let n_keys = r.u8("key count")? as usize;
            if n_keys > nics.len() {
                return Err(MetadataError::TooLarge { what: "keys of one memory", len: n_keys as u64, max: nics.len() as u64 });
            }
            r.need("keys", n_keys * KEY_LEN)?;
            let mut keys: Vec<(u8, RemoteBuffer)> = Vec::with_capacity(n_keys);
            for _ in 0..n_keys {
                let nic = r.u8("key NIC")?;
                let addr = r.u64("key address")?;
                let rkey = r.u32("key rkey")?;
                if usize::from(nic) >= nics.len() || keys.iter().any(|(n, _)| *n == nic) {
                    return Err(MetadataError::InvalidField { field: "key NIC", value: nic.into() });
                }
                if addr.checked_add(len).is_none() {
                    return Err(MetadataError::InvalidField { field: "key address", value: addr });
                }
                keys.push((nic, RemoteBuffer { addr, len, rkey }));
            }
            if !names.insert(name.clone()) {
                return Err(MetadataError::DuplicateMemory(name));
            }
            memories.push(MemoryDesc { name, len, keys });
        }
        let seal = r.array::<SEAL_LEN>("seal")?;
        if r.rest() != 0 {
            return Err(MetadataError::TrailingBytes(r.rest()));
        }
        Ok(AgentMetadata { name: agent, instance, control: SocketAddr::new(ip, port), nics, memories, seal })
    }

    /// The memory registered under `name`.
    pub fn memory(&self, name: &str) -> Option<&MemoryDesc> {
        self.memories.iter().find(|m| m.name == name)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> AgentMetadata {
        AgentMetadata {
            name: "decode-0".into(),
            instance: 0x1234_5678_9abc_def0,
            control: "192.0.2.7:18600".parse().unwrap(),
            nics: vec![
                NicDesc { device: "mlx5_0".into(), port: 1, lid: 0, gid: Gid([0xfe; 16]), mtu: Mtu::Mtu4096 },
                NicDesc { device: "mlx5_1".into(), port: 1, lid: 7, gid: Gid([0x20; 16]), mtu: Mtu::Mtu1024 },
            ],
            memories: vec![
                MemoryDesc {
                    name: "kv-table".into(),
                    len: 1 << 30,
                    keys: vec![
                        (0, RemoteBuffer { addr: 0x7f00_0000_0000, len: 1 << 30, rkey: 0x11 }),
                        (1, RemoteBuffer { addr: 0x7f00_0000_0000, len: 1 << 30, rkey: 0x22 }),
                    ],
                },
                MemoryDesc { name: "flags".into(), len: 4096, keys: vec![] },
            ],
            seal: [0x5e; SEAL_LEN],
        }
    }

    #[test]
    fn ranges_are_cut_in_every_form() {
        use std::ops::Bound::*;
        let c = |s, e| cut("x", s, e, 10).ok();
        assert_eq!(c(Unbounded, Unbounded), Some((0, 10)));
        assert_eq!(c(Included(2), Excluded(5)), Some((2, 3)));
        assert_eq!(c(Included(2), Included(5)), Some((2, 4)));
        assert_eq!(c(Excluded(3), Unbounded), Some((4, 6)));
        assert_eq!(c(Included(5), Excluded(2)), None);
        assert_eq!(c(Included(0), Included(u64::MAX)), None);
        assert!(matches!(
            cut("x", Included(4), Excluded(11), 10),
            Err(Error::OutOfBounds { what: "x", offset: 4, requested: 7, len: 10 })
        ));
    }

    #[test]
    fn round_trip() {
        let m = sample();
        assert_eq!(AgentMetadata::decode(&m.encode().unwrap()).unwrap(), m);
        let mut v6 = sample();
        v6.control = "[fe80::1]:9".parse().unwrap();
        v6.memories.clear();
        assert_eq!(AgentMetadata::decode(&v6.encode().unwrap()).unwrap(), v6);
        assert_eq!(m.memory("kv-table").unwrap().on_nic(1).unwrap().rkey, 0x22);
        assert!(m.memory("nope").is_none());
    }

    #[test]
    fn every_truncation_is_an_error() {
        let b = sample().encode().unwrap();
        for n in 0..b.len() {
            assert!(AgentMetadata::decode(&b[..n]).is_err(), "prefix of {n} bytes accepted");
        }
        let mut long = b.clone();
        long.push(0);
        assert_eq!(AgentMetadata::decode(&long), Err(MetadataError::TrailingBytes(1)));
    }

    #[test]
    fn wrong_magic_version_and_fields_are_named() {
        let b = sample().encode().unwrap();
        let mut x = b.clone();
        x[0] = b'X';
        assert!(matches!(AgentMetadata::decode(&x), Err(MetadataError::BadMagic(_))));
        let mut x = b.clone();
        x[5] = 9;
        assert_eq!(AgentMetadata::decode(&x), Err(MetadataError::Version { got: 9, ours: METADATA_VERSION }));
        // The address family follows the instance and the agent name (8 + 8 + 1 + 8 bytes).
        let mut x = b.clone();
        x[25] = 5;
        assert_eq!(AgentMetadata::decode(&x), Err(MetadataError::InvalidField { field: "address family", value: 5 }));
        let mut dup = sample();
        dup.memories[1].name = "kv-table".into();
        assert_eq!(AgentMetadata::decode(&dup.encode().unwrap()), Err(MetadataError::DuplicateMemory("kv-table".into())));
        let mut bad = sample();
        bad.memories[0].keys[1].0 = 0;
        assert_eq!(AgentMetadata::decode(&bad.encode().unwrap()), Err(MetadataError::InvalidField { field: "key NIC", value: 0 }));
        let mut wrap = sample();
        wrap.memories[0].keys[0].1.addr = u64::MAX - 10;
        assert!(matches!(AgentMetadata::decode(&wrap.encode().unwrap()), Err(MetadataError::InvalidField { field: "key address", .. })));
        let mut anon = sample();
        anon.name.clear();
        assert_eq!(anon.encode(), Err(MetadataError::BadName { field: "agent name" }));
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        let mut m = sample();
        m.memories.clear();
        let mut b = m.encode().unwrap();
        b.truncate(b.len() - SEAL_LEN);
        let n = b.len();
        b[n - 4..].copy_from_slice(&(MAX_MEMORIES as u32).to_be_bytes());
        assert!(matches!(AgentMetadata::decode(&b), Err(MetadataError::Truncated { field: "memories", .. })));
        b[n - 4..].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(AgentMetadata::decode(&b), Err(MetadataError::TooLarge { what: "memory count", .. })));
    }

    #[test]
    fn random_and_mutated_bytes_never_panic() {
        let good = sample().encode().unwrap();
        let mut rng = testkit::Rng(0x5eed_0fae_5700);
        let mut accepted = 0;
        for _ in 0..100_000 {
            let r = rng.next();
            let mut b = good.clone();
            for _ in 0..1 + (r >> 60) {
                let i = rng.index(b.len());
                b[i] ^= (rng.next() as u8) | 1;
            }
            if r & 1 != 0 {
                b.truncate(rng.index(b.len() + 1));
            }
            if let Ok(m) = AgentMetadata::decode(&b) {
                // What decodes re-encodes to the same bytes: nothing is
                // accepted that the encoder would not write.
                assert_eq!(m.encode().unwrap(), b);
                accepted += 1;
            }
        }
        // Flips inside addresses, rkeys and GIDs are valid metadata.
        assert!(accepted > 0);
    }
}
