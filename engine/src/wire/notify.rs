//! Notifications: the application bytes a transfer delivers to its
//! target after its data, and their form on the wire, a send into the
//! target NIC's shared receive queue: `"GN"`, version (u8), a reserved
//! byte, the length (u16) and a reserved u16, then the bytes. Plain data
//! and codec; the engine's progress (`core`) receives them.

use gpudirect::decode::Reader;

/// Bytes of one notification receive slot, header included.
pub(crate) const SLOT: usize = 1024;
const HEADER: usize = 8;
const MAGIC: [u8; 2] = *b"GN";
const VERSION: u8 = 1;

/// Longest notification, in bytes.
pub const MAX_NOTIFICATION: usize = SLOT - HEADER;

/// A notification a peer's transfer delivered: every byte of that
/// transfer was in place, and visible to GPU kernels for GPU memory,
/// before it was handed out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notification {
    /// The agent whose transfer it was.
    pub peer: String,
    /// The bytes the initiator attached.
    pub msg: Vec<u8>,
}

/// The wire form of `msg` (its length already checked).
pub(crate) fn encode(msg: &[u8]) -> Vec<u8> {
    debug_assert!(msg.len() <= MAX_NOTIFICATION);
    let mut out = Vec::with_capacity(HEADER + msg.len());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(0);
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(msg);
    out
}

/// The bytes a received message carries, or why it is not a notification
/// (from a peer: untrusted).
pub(crate) fn decode(bytes: &[u8]) -> Result<&[u8], String> {
    let mut r = Reader(bytes);
    let h: [u8; HEADER] = r.array("header").map_err(|t| format!("{} bytes, shorter than a notification header", t.have))?;
    if h[..2] != MAGIC || h[2] != VERSION {
        return Err(format!("header {:02x?} is not a version-{VERSION} notification", &h[..4]));
    }
    let len = u16::from_be_bytes([h[4], h[5]]) as usize;
    if r.rest() != len {
        return Err(format!("announces {len} bytes, carries {}", r.rest()));
    }
    Ok(r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bad_input() {
        assert_eq!(decode(&encode(b"layer 7")).unwrap(), b"layer 7");
        assert_eq!(decode(&encode(b"")).unwrap(), b"");
        let big = vec![3; MAX_NOTIFICATION];
        assert_eq!(decode(&encode(&big)).unwrap(), &big[..]);
        let good = encode(b"abc");
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err());
        }
        let mut x = good.clone();
        x[2] = 2;
        assert!(decode(&x).unwrap_err().contains("not a version-1"));
        let mut x = good.clone();
        x.push(0);
        assert!(decode(&x).unwrap_err().contains("announces 3 bytes, carries 4"));
    }
}
