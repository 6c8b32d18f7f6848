//! What peers exchange to reach each other: a queue pair's [`Endpoint`]
//! and the [`RemoteBuffer`]s it may access. Plain, `serde` serialisable
//! data, shared by queue pairs, memory regions and the bootstrap exchange.

use std::fmt;

use crate::error::{Error, Result};
use crate::gid::Gid;
use crate::port::Mtu;

/// What a peer needs to connect its queue pair to ours. Exchange it out of
/// band ([`crate::bootstrap`], or any channel: it is `serde` serialisable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID the queue pair sends from.
    pub gid: Gid,
    /// The port's active MTU; the connection uses the smaller of both ends'.
    pub mtu: Mtu,
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "QP {:#08x} PSN {:#08x} LID {} GID {} MTU {}", self.qp_num, self.psn, self.lid, self.gid, self.mtu)
    }
}

/// What a peer needs to access a region of ours with RDMA: address, length
/// and remote key. Give it to the peer over the bootstrap channel
/// ([`crate::bootstrap`]) or any channel of your own (it is `serde`
/// serialisable).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct RemoteBuffer {
    /// Start address in the peer's address space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The peer region's rkey.
    pub rkey: u32,
}

impl RemoteBuffer {
    /// Bytes in [`to_bytes`](Self::to_bytes)' form.
    pub const WIRE_LEN: usize = 20;

    /// A fixed 20-byte form: address, length (u64) and rkey (u32),
    /// big-endian; the bootstrap handshake's, and small enough for
    /// rdma_cm's private data.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut out = [0; Self::WIRE_LEN];
        out[..8].copy_from_slice(&self.addr.to_be_bytes());
        out[8..16].copy_from_slice(&self.len.to_be_bytes());
        out[16..].copy_from_slice(&self.rkey.to_be_bytes());
        out
    }

    /// Reads [`to_bytes`](Self::to_bytes)' form from the start of `bytes`
    /// (from a peer: untrusted).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for fewer than 20 bytes or a range that
    /// would wrap past the end of the address space.
    pub fn from_bytes(bytes: &[u8]) -> Result<RemoteBuffer> {
        Self::parse(bytes).ok_or_else(|| match bytes.len() {
            n if n < Self::WIRE_LEN => Error::InvalidArgument(format!("a remote buffer takes 20 bytes, got {n}")),
            _ => Error::InvalidArgument("remote buffer: its range wraps past the end of the address space".into()),
        })
    }

    /// [`from_bytes`](Self::from_bytes) without the error's text (nothing
    /// allocated: the bootstrap decoder's bound on what a peer makes it
    /// allocate counts every byte).
    pub(crate) fn parse(bytes: &[u8]) -> Option<RemoteBuffer> {
        let b = bytes.get(..Self::WIRE_LEN)?;
        let u64_at = |i: usize| u64::from_be_bytes([b[i], b[i + 1], b[i + 2], b[i + 3], b[i + 4], b[i + 5], b[i + 6], b[i + 7]]);
        let rb = RemoteBuffer { addr: u64_at(0), len: u64_at(8), rkey: u32::from_be_bytes([b[16], b[17], b[18], b[19]]) };
        rb.addr.checked_add(rb.len).map(|_| rb)
    }

    /// The remote address of `offset`, after checking that `len` bytes from
    /// there lie within the buffer.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`]: nothing is posted for a range outside the
    /// buffer the peer described.
    /// A descriptor whose range would wrap past the end of the address
    /// space (hand-built or from a lying peer) has no valid offset.
    pub fn addr_of(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len && self.addr.checked_add(end).is_some() => Ok(self.addr + offset),
            _ => Err(Error::OutOfBounds { what: "remote buffer", offset, requested: len, len: self.len }),
        }
    }
}

impl fmt::Display for RemoteBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} bytes at {:#x} rkey {:#x}", self.len, self.addr, self.rkey)
    }
}
