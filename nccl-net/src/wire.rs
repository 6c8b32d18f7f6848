//! The plugin's bytes on the wire, as plain data: the handle NCCL carries
//! between ranks, the three setup messages over TCP, and the fifo entry a
//! receiver writes into its sender's memory. A leaf module (it imports
//! no module of the plugin but NCCL's constants), public so that tools and tests can play
//! a peer, a hostile one included, without writing the layout again.
//!
//! # Setup
//! The connecting side (the sender) sends [`hello`]: [`HELLO`], the
//! handle's 16-byte token, its queue pair's endpoint and its fifo (address
//! and rkey). The listener answers [`reply`]: [`REPLY`], its endpoint and
//! its sizes slots. The sender moves its queue pair to RTS and sends
//! [`READY`].

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

use gpudirect::{Endpoint, Gid, Mtu, RemoteBuffer};

use crate::abi::{HANDLE_MAXSIZE, MAX_REQUESTS};

const MAGIC: [u8; 8] = *b"GDRNCCL\x01";
/// The first bytes of the sender's setup message.
pub const HELLO: [u8; 8] = *b"GDNCHELO";
/// The first bytes of the listener's answer.
pub const REPLY: [u8; 8] = *b"GDNCRPLY";
/// The sender's last setup message: its queue pair is ready.
pub const READY: [u8; 8] = *b"GDNCRDY!";
/// An endpoint: queue pair number, PSN, LID, MTU code, GID.
pub const ENDPOINT_LEN: usize = 4 + 4 + 2 + 1 + 16;
/// [`hello`]'s length.
pub const HELLO_LEN: usize = 8 + 16 + ENDPOINT_LEN + 12;
/// [`reply`]'s length.
pub const REPLY_LEN: usize = 8 + ENDPOINT_LEN + 12;
/// Where `connect` keeps its state's name (index and generation, 16
/// bytes) in NCCL's copy of the handle.
pub const STAGE_AT: usize = 48;

/// Receives per group (`maxRecvs`), as NCCL's IB transport offers.
pub const MAX_RECVS: usize = 8;
/// One fifo entry.
pub const ENTRY: usize = 32;
/// One fifo slot: a group's entries.
pub const SLOT: usize = ENTRY * MAX_RECVS;
/// One sizes slot: a 4-byte size per receive of a group.
pub const SIZES: usize = 4 * MAX_RECVS;

/// The handle's contents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Handle {
    /// Where the listener listens.
    pub addr: SocketAddr,
    /// What a connection must present.
    pub token: [u8; 16],
}

/// Why bytes are not a handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("not a GPUDirect handle ({0}): NCCL passed bytes another plugin or a corrupted exchange wrote")]
pub struct NotAHandle(&'static str);

impl Handle {
    /// Writes the handle into NCCL's `NCCL_NET_HANDLE_MAXSIZE` bytes.
    pub fn write(&self, out: &mut [u8; HANDLE_MAXSIZE]) {
        *out = [0; HANDLE_MAXSIZE];
        out[..8].copy_from_slice(&MAGIC);
        let (family, ip): (u16, [u8; 16]) = match self.addr.ip() {
            IpAddr::V4(v4) => (4, v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => (6, v6.octets()),
        };
        out[8..10].copy_from_slice(&family.to_le_bytes());
        out[10..12].copy_from_slice(&self.addr.port().to_be_bytes());
        out[12..28].copy_from_slice(&ip);
        out[28..44].copy_from_slice(&self.token);
    }

    /// Reads a handle (the connection state `connect` keeps at
    /// [`STAGE_AT`] is not part of it).
    ///
    /// # Errors
    /// [`NotAHandle`] for bytes that are not a handle `listen` made.
    pub fn read(bytes: &[u8; HANDLE_MAXSIZE]) -> Result<Handle, NotAHandle> {
        if bytes[..8] != MAGIC {
            return Err(NotAHandle("wrong magic"));
        }
        let family = u16::from_le_bytes([bytes[8], bytes[9]]);
        let port = u16::from_be_bytes([bytes[10], bytes[11]]);
        let ip: [u8; 16] = bytes[12..28].try_into().expect("16 bytes");
        let ip = match family {
            4 => IpAddr::V4(Ipv6Addr::from(ip).to_ipv4_mapped().ok_or(NotAHandle("an IPv4 handle without an IPv4 address"))?),
            6 => IpAddr::V6(Ipv6Addr::from(ip)),
            _ => return Err(NotAHandle("unknown address family")),
        };
        if port == 0 || ip.is_unspecified() {
            return Err(NotAHandle("no address"));
        }
        if bytes[STAGE_AT + 16..].iter().any(|&b| b != 0) || bytes[44..STAGE_AT].iter().any(|&b| b != 0) {
            return Err(NotAHandle("bytes set where a handle has none"));
        }
        Ok(Handle { addr: SocketAddr::new(ip, port), token: bytes[28..44].try_into().expect("16 bytes") })
    }
}

/// The sender's setup message.
pub fn hello(token: &[u8; 16], endpoint: &Endpoint, fifo_addr: u64, fifo_rkey: u32) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..8].copy_from_slice(&HELLO);
    b[8..24].copy_from_slice(token);
    b[24..24 + ENDPOINT_LEN].copy_from_slice(&encode_endpoint(endpoint));
    b[24 + ENDPOINT_LEN..].copy_from_slice(&encode_remote(fifo_addr, fifo_rkey));
    b
}

/// The listener's answer.
pub fn reply(endpoint: &Endpoint, sizes_addr: u64, sizes_rkey: u32) -> [u8; REPLY_LEN] {
    let mut b = [0u8; REPLY_LEN];
    b[..8].copy_from_slice(&REPLY);
    b[8..8 + ENDPOINT_LEN].copy_from_slice(&encode_endpoint(endpoint));
    b[8 + ENDPOINT_LEN..].copy_from_slice(&encode_remote(sizes_addr, sizes_rkey));
    b
}

/// A setup message that cannot be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(String);

/// [`hello`] read back: the token presented, the sender's endpoint and its
/// fifo ([`fifo_len`] bytes).
///
/// # Errors
/// [`Malformed`] for another message or an unknown MTU code.
pub fn read_hello(b: &[u8; HELLO_LEN]) -> Result<([u8; 16], Endpoint, RemoteBuffer), Malformed> {
    if b[..8] != HELLO {
        return Err(Malformed("not a setup message".into()));
    }
    let token = b[8..24].try_into().expect("16 bytes");
    let ep = decode_endpoint(&b[24..24 + ENDPOINT_LEN])?;
    Ok((token, ep, decode_remote(&b[24 + ENDPOINT_LEN..], fifo_len() as u64)))
}

/// [`reply`] read back: the listener's endpoint and its sizes slots
/// ([`sizes_len`] bytes).
///
/// # Errors
/// [`Malformed`] for another message or an unknown MTU code.
pub fn read_reply(b: &[u8; REPLY_LEN]) -> Result<(Endpoint, RemoteBuffer), Malformed> {
    if b[..8] != REPLY {
        return Err(Malformed("the listener answered with a malformed reply".into()));
    }
    let ep = decode_endpoint(&b[8..8 + ENDPOINT_LEN])?;
    Ok((ep, decode_remote(&b[8 + ENDPOINT_LEN..], sizes_len() as u64)))
}

/// Bytes of a sender's fifo: one [`SLOT`] per request.
pub const fn fifo_len() -> usize {
    MAX_REQUESTS * SLOT
}

/// Bytes of a receiver's sizes slots: one [`SIZES`] per request.
pub const fn sizes_len() -> usize {
    MAX_REQUESTS * SIZES
}

fn encode_endpoint(e: &Endpoint) -> [u8; ENDPOINT_LEN] {
    let mut b = [0u8; ENDPOINT_LEN];
    b[0..4].copy_from_slice(&e.qp_num.to_le_bytes());
    b[4..8].copy_from_slice(&e.psn.to_le_bytes());
    b[8..10].copy_from_slice(&e.lid.to_le_bytes());
    b[10] = e.mtu.to_raw() as u8;
    b[11..27].copy_from_slice(&e.gid.0);
    b
}

fn decode_endpoint(b: &[u8]) -> Result<Endpoint, Malformed> {
    let mtu = Mtu::from_raw(u32::from(b[10])).ok_or_else(|| Malformed(format!("the peer sent MTU code {}", b[10])))?;
    Ok(Endpoint {
        qp_num: u32::from_le_bytes(b[0..4].try_into().expect("4")),
        psn: u32::from_le_bytes(b[4..8].try_into().expect("4")),
        lid: u16::from_le_bytes([b[8], b[9]]),
        mtu,
        gid: Gid(b[11..27].try_into().expect("16")),
    })
}

fn encode_remote(addr: u64, rkey: u32) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..8].copy_from_slice(&addr.to_le_bytes());
    b[8..].copy_from_slice(&rkey.to_le_bytes());
    b
}

fn decode_remote(b: &[u8], len: u64) -> RemoteBuffer {
    RemoteBuffer { addr: u64::from_le_bytes(b[..8].try_into().expect("8")), len, rkey: u32::from_le_bytes(b[8..12].try_into().expect("4")) }
}

/// One receive as the receiver writes it into the sender's fifo: every
/// field is the receiver's claim, checked by the sender before use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The receive's address in the receiver's memory.
    pub addr: u64,
    /// The key that opens it.
    pub rkey: u32,
    /// Its size.
    pub size: u32,
    /// NCCL's tag.
    pub tag: i32,
    /// Receives in the group.
    pub nreqs: u32,
    /// The group's sequence number plus one (written last).
    pub seq: u64,
}

impl Entry {
    /// The entry's 32 bytes.
    pub fn to_bytes(self) -> [u8; ENTRY] {
        let mut b = [0u8; ENTRY];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        b[12..16].copy_from_slice(&self.size.to_le_bytes());
        b[16..20].copy_from_slice(&self.tag.to_le_bytes());
        b[20..24].copy_from_slice(&self.nreqs.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    /// An entry read from its 32 bytes.
    pub fn from_bytes(b: &[u8; ENTRY]) -> Entry {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4"));
        Entry {
            addr: u64::from_le_bytes(b[0..8].try_into().expect("8")),
            rkey: u32_at(8),
            size: u32_at(12),
            tag: u32_at(16) as i32,
            nreqs: u32_at(20),
            seq: u64::from_le_bytes(b[24..32].try_into().expect("8")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_garbage_is_refused() {
        let h = Handle { addr: "192.0.2.1:4791".parse().unwrap(), token: [7; 16] };
        let mut b = [0u8; HANDLE_MAXSIZE];
        h.write(&mut b);
        assert_eq!(Handle::read(&b).unwrap(), h);
        let h6 = Handle { addr: "[fd00::1]:9".parse().unwrap(), token: [1; 16] };
        h6.write(&mut b);
        assert_eq!(Handle::read(&b).unwrap(), h6);
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut g = [0u8; HANDLE_MAXSIZE];
            for x in g.iter_mut() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                *x = rng as u8;
            }
            assert!(Handle::read(&g).is_err());
            g[..8].copy_from_slice(&MAGIC);
            let _ = Handle::read(&g); // never panics
        }
        h.write(&mut b);
        b[100] = 1;
        assert!(Handle::read(&b).unwrap_err().to_string().contains("bytes set where a handle has none"));
        h.write(&mut b);
        b[STAGE_AT..STAGE_AT + 16].copy_from_slice(&[9; 16]);
        assert_eq!(Handle::read(&b).unwrap(), h, "the connection state is not part of the handle");
        h.write(&mut b);
        b[10..12].copy_from_slice(&[0, 0]);
        assert!(Handle::read(&b).is_err(), "port 0");
    }

    #[test]
    fn messages_and_entries_round_trip() {
        let ep = Endpoint { qp_num: 77, psn: 5, lid: 3, mtu: Mtu::from_raw(5).unwrap(), gid: Gid([4; 16]) };
        let (token, back, fifo) = read_hello(&hello(&[2; 16], &ep, 0x1000, 9)).unwrap();
        assert_eq!((token, back.qp_num, back.gid, fifo.addr, fifo.rkey, fifo.len), ([2; 16], 77, Gid([4; 16]), 0x1000, 9, fifo_len() as u64));
        let (back, sizes) = read_reply(&reply(&ep, 0x2000, 8)).unwrap();
        assert_eq!((back.psn, sizes.addr, sizes.rkey, sizes.len), (5, 0x2000, 8, sizes_len() as u64));
        let mut bad = hello(&[2; 16], &ep, 0, 0);
        bad[24 + 10] = 0xee;
        assert!(read_hello(&bad).unwrap_err().to_string().contains("MTU code 238"));
        let e = Entry { addr: 1 << 40, rkey: 0xdead, size: 16, tag: -3, nreqs: 2, seq: 9 };
        assert_eq!(Entry::from_bytes(&e.to_bytes()), e);
    }
}
