//! The bootstrap exchange's error: plain data, a leaf the crate's error
//! type wraps.

use std::io;
use std::time::Duration;

/// Why the exchange with the peer failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BootstrapError {
    /// A socket operation failed.
    #[error("bootstrap {op} failed: {source}")]
    Io {
        /// What was being done (`"connect to 10.0.0.2:18515"`, `"read"`, ...).
        op: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// The peer did not answer in time.
    #[error("bootstrap peer did not answer within {0:?}")]
    Timeout(Duration),
    /// The peer closed the connection before a whole message arrived.
    #[error("bootstrap peer closed the connection after {got} of {expected} bytes")]
    Closed {
        /// Bytes expected.
        expected: usize,
        /// Bytes received.
        got: usize,
    },
    /// The peer is not speaking this protocol.
    #[error("bootstrap peer sent {0:02x?} instead of the magic \"GDRX\": not a gpudirect peer (wrong port?)")]
    BadMagic([u8; 4]),
    /// The peer speaks another protocol version.
    #[error("bootstrap peer speaks protocol version {peer}, this side speaks {ours}: use the same gpudirect release on both ends")]
    Version {
        /// The peer's version.
        peer: u16,
        /// Ours.
        ours: u16,
    },
    /// A message of an unexpected kind arrived.
    #[error("bootstrap peer sent message kind {got}, expected {expected}")]
    UnexpectedKind {
        /// Expected kind.
        expected: u8,
        /// Received kind.
        got: u8,
    },
    /// The announced payload is larger than allowed.
    #[error("bootstrap payload of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        /// Announced length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The payload ended inside a field.
    #[error("bootstrap payload truncated in {field}: needs {need} more bytes, has {have}")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes left.
        have: usize,
    },
    /// The payload has bytes after its last field.
    #[error("bootstrap payload has {0} unexpected trailing bytes")]
    TrailingBytes(usize),
    /// A field holds a value that cannot be valid.
    #[error("bootstrap field {field} has invalid value {value}")]
    InvalidField {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
    },
}
