//! A posting as etcd keeps it (feature `etcd`): the blob, what the
//! poster says about it, and the seal over all of it. Whoever can write
//! the etcd cluster can write any key, and could put back any value it
//! once read; so the seal covers, besides the topic, the name and the
//! bytes, what makes a value stand only where and when it was put:
//!
//! - the revision etcd created the key at: a value put back after a
//!   remove, or after its lease expired (which deletes the key), lands
//!   in a key created later;
//! - the key's version the value was written as (the poster writes in a
//!   transaction on the key's last revision, so it knows): anything put
//!   over it since, an older posting too, leaves the key at a later one;
//! - the lease it was put under (a value put back without it, or under
//!   another, is not the one posted);
//! - when it was posted, by the poster's clock (a reader may refuse what
//!   predates the job);
//! - who posted it, as the poster names itself (its host): a claim any
//!   holder of the secret could make, which tells two honest posters of
//!   one name apart, not a member who lies.
//!
//! A posting is created in two writes: a reservation (kind `Reserved`)
//! creates the key, so the posting that replaces it can be sealed to the
//! revision the key was created at. A conflict (kind `Conflict`) is what
//! a second poster of a name leaves: the posters, no bytes.
//!
//! Layout: `"GDP2"`, kind (1 byte), created, version, lease (i64 each,
//! big-endian), time (u64, ms since the epoch), the posters (a count
//! byte, each a length byte and its bytes), the blob, the seal (32).
//! Every length is checked against what is left before it is used.

use std::time::{Duration, SystemTime};

use crate::wire::auth::{Key, Label, TAG};
use super::board::{plain_poster, MAX_POSTING};

const MAGIC: &[u8; 4] = b"GDP2";
/// Under the seal first, so a seal of another layout never verifies as
/// this one.
const LAYOUT: &[u8] = b"posting: created, version, lease, time, posters";
/// The most posters a conflict names.
pub(super) const MAX_POSTERS: usize = 8;
/// The longest poster's name, in bytes.
pub(super) const MAX_POSTER: usize = 255;
/// Magic, kind, three i64, the time, the posters' count.
const FIXED: usize = 4 + 1 + 8 * 3 + 8 + 1;
/// The longest value a posting is kept as.
pub(super) const MAX_SEALED: usize = FIXED + MAX_POSTERS * (1 + MAX_POSTER) + MAX_POSTING + TAG;

/// What a sealed value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// A post under way: the key made, the posting not yet written.
    Reserved = 1,
    /// A posting.
    Posting = 2,
    /// Two or more posters posted the name: none is believed.
    Conflict = 3,
}

/// A sealed value, as written or as read and verified.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Sealed {
    pub(super) kind: Kind,
    /// The revision etcd created the key at; 0 in a reservation (the key
    /// does not exist yet when it is sealed).
    pub(super) created: i64,
    /// The key's version this value was written as.
    pub(super) version: i64,
    /// The lease it was put under; 0: none.
    pub(super) lease: i64,
    /// When it was posted, ms since the epoch by the poster's clock.
    pub(super) at_ms: u64,
    /// Who posted it as each names itself; a conflict names them all,
    /// the first holder first.
    pub(super) posters: Vec<String>,
    /// The posting's bytes (none in a reservation or a conflict).
    pub(super) blob: Vec<u8>,
}

/// `s` cut to [`MAX_POSTER`] bytes at a character boundary.
pub(super) fn poster_name(s: &str) -> String {
    let mut end = s.len().min(MAX_POSTER);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_owned()
}

/// Milliseconds since the epoch, now.
pub(super) fn now_ms() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Sealed {
    /// Everything the seal covers but the blob, after the magic.
    fn header(&self) -> Vec<u8> {
        let mut h = vec![self.kind as u8];
        for v in [self.created, self.version, self.lease] {
            h.extend_from_slice(&v.to_be_bytes());
        }
        h.extend_from_slice(&self.at_ms.to_be_bytes());
        let posters = &self.posters[..self.posters.len().min(MAX_POSTERS)];
        h.push(posters.len() as u8);
        for p in posters {
            let p = poster_name(p);
            h.push(p.len() as u8);
            h.extend_from_slice(p.as_bytes());
        }
        h
    }

    /// The value to put for `topic/name`, sealed with `key`.
    pub(super) fn seal(&self, key: &Key, topic: &str, name: &str) -> Vec<u8> {
        let header = self.header();
        let tag = key.tag(Label::Posting, &[LAYOUT, topic.as_bytes(), name.as_bytes(), &header, &self.blob]);
        let mut v = Vec::with_capacity(MAGIC.len() + header.len() + self.blob.len() + TAG);
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&header);
        v.extend_from_slice(&self.blob);
        v.extend_from_slice(&tag);
        v
    }

    /// The value kept as `topic/name`, if its seal verifies with `key`;
    /// otherwise why it is not believed.
    pub(super) fn open(value: &[u8], key: &Key, topic: &str, name: &str) -> Result<Sealed, &'static str> {
        if value.len() > MAX_SEALED {
            return Err("longer than a posting");
        }
        if value.len() < FIXED + TAG {
            return Err("shorter than a seal");
        }
        let (body, tag) = value.split_at(value.len() - TAG);
        if &body[..4] != MAGIC {
            return Err("not a sealed posting of this release");
        }
        let mut r = Reader(&body[4..]);
        let kind = match r.byte()? {
            1 => Kind::Reserved,
            2 => Kind::Posting,
            3 => Kind::Conflict,
            _ => return Err("a kind of value no post makes"),
        };
        let (created, version, lease) = (r.i64()?, r.i64()?, r.i64()?);
        let at_ms = u64::from_be_bytes(r.take(8)?.try_into().expect("8 bytes"));
        let n = usize::from(r.byte()?);
        if n > MAX_POSTERS {
            return Err("more posters than a seal names");
        }
        let mut posters = Vec::with_capacity(n);
        for _ in 0..n {
            let len = usize::from(r.byte()?);
            posters.push(String::from_utf8_lossy(r.take(len)?).into_owned());
        }
        let header = &body[4..body.len() - r.0.len()];
        let blob = r.0;
        if !key.verify(Label::Posting, &[LAYOUT, topic.as_bytes(), name.as_bytes(), header, blob], tag) {
            return Err("its seal");
        }
        Ok(Sealed { kind, created, version, lease, at_ms, posters, blob: blob.to_vec() })
    }

    /// Who posted it, fit to print (whoever holds the secret names
    /// itself as it likes).
    pub(super) fn shown_posters(&self) -> Vec<String> {
        self.posters.iter().map(|p| plain_poster(p)).collect()
    }

    /// When it was posted, by the poster's clock.
    pub(super) fn posted_at(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(self.at_ms)).unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// Why this verified value cannot stand as the key etcd holds it in
    /// (created at `created`, at `version`, under `lease`), if it cannot:
    /// it was put there by someone who did not seal it there.
    pub(super) fn misplaced(&self, created: i64, version: i64, lease: i64) -> Option<String> {
        // A reservation is sealed before the key exists: it stands only
        // as the key's first write.
        if self.kind != Kind::Reserved && self.created != created {
            return Some(format!(
                "sealed for the key etcd created at revision {}, and this key was created at revision {created}: an old posting put back after it was removed or its lease expired",
                self.created
            ));
        }
        if self.version != version {
            return Some(format!(
                "sealed as the key's version {}, and the key is at version {version}: written over since by someone who did not seal it (an older posting put back over a newer one?)",
                self.version
            ));
        }
        if self.lease != lease {
            return Some(format!("sealed under lease {:x}, and the key is under lease {lease:x}: put back after its lease expired, or moved to another", self.lease));
        }
        None
    }
}

/// Reads a sealed value's fields, each checked against what is left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], &'static str> {
        if self.0.len() < n {
            return Err("cut short");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn byte(&mut self) -> Result<u8, &'static str> {
        Ok(self.take(1)?[0])
    }

    fn i64(&mut self) -> Result<i64, &'static str> {
        Ok(i64::from_be_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::auth::ClusterSecret;

    fn key(b: u8) -> Key {
        Key::of(Some(ClusterSecret::new(vec![b; 32]).unwrap()))
    }

    fn sample() -> Sealed {
        Sealed { kind: Kind::Posting, created: 41, version: 2, lease: 0x7a, at_ms: 1_700_000_000_000, posters: vec!["gpu-node-2".into()], blob: b"capture".to_vec() }
    }

    /// What is sealed opens as it was, only as the same topic and name
    /// with the same key; any byte changed, any cut, and values too long
    /// or too short are refused without a panic.
    #[test]
    fn a_seal_opens_only_as_sealed() {
        let s = sample();
        let v = s.seal(&key(1), "job-1", "node2");
        assert_eq!(Sealed::open(&v, &key(1), "job-1", "node2").unwrap(), s);
        assert_eq!(Sealed::open(&v, &key(2), "job-1", "node2"), Err("its seal"));
        assert_eq!(Sealed::open(&v, &key(1), "job-1", "node3"), Err("its seal"), "not under another name");
        assert_eq!(Sealed::open(&v, &key(1), "job-2", "node2"), Err("its seal"), "nor another job");
        for i in 0..v.len() {
            let mut bad = v.clone();
            bad[i] ^= 1;
            assert!(Sealed::open(&bad, &key(1), "job-1", "node2").is_err(), "byte {i}");
        }
        for n in 0..v.len() {
            assert!(Sealed::open(&v[..n], &key(1), "job-1", "node2").is_err(), "cut at {n}");
        }
        assert!(Sealed::open(&vec![0; MAX_SEALED + 1], &key(1), "j", "n").is_err());
        let mut odd = v.clone();
        odd[4] = 9;
        assert!(Sealed::open(&odd, &key(1), "job-1", "node2").is_err());
        // A conflict names up to MAX_POSTERS, each cut to MAX_POSTER bytes.
        let many = Sealed { kind: Kind::Conflict, posters: (0..MAX_POSTERS + 3).map(|i| format!("{i}{}", "é".repeat(200))).collect(), blob: vec![], ..sample() };
        let got = Sealed::open(&many.seal(&key(1), "j", "n"), &key(1), "j", "n").unwrap();
        assert_eq!(got.posters.len(), MAX_POSTERS);
        assert!(got.posters.iter().all(|p| p.len() <= MAX_POSTER && p.ends_with('é')));
    }

    /// A verified value stands only in the key incarnation, version and
    /// lease it was sealed for.
    #[test]
    fn a_value_stands_only_where_it_was_sealed() {
        let s = sample();
        assert_eq!(s.misplaced(41, 2, 0x7a), None);
        assert!(s.misplaced(57, 2, 0x7a).unwrap().contains("after it was removed or its lease expired"));
        assert!(s.misplaced(41, 4, 0x7a).unwrap().contains("an older posting put back"));
        assert!(s.misplaced(41, 2, 0).unwrap().contains("lease"));
        let reserved = Sealed { kind: Kind::Reserved, created: 0, version: 1, ..sample() };
        assert_eq!(reserved.misplaced(99, 1, 0x7a), None, "a reservation is sealed before the key exists");
        assert!(reserved.misplaced(99, 3, 0x7a).is_some());
    }
}
