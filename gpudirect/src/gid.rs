//! GIDs and the choice of which one a RoCE connection uses.

use std::fmt;
use std::net::Ipv6Addr;


use crate::port::LinkLayer;

/// A 128-bit global identifier: an IPv6 address on RoCE, a port's subnet
/// prefix plus GUID on InfiniBand.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The address as IPv6 (IPv4-mapped for RoCE v2 over IPv4).
    pub fn to_ipv6(self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// Whether this is an IPv4-mapped address (`::ffff:a.b.c.d`).
    pub fn is_ipv4_mapped(self) -> bool {
        self.to_ipv6().to_ipv4_mapped().is_some()
    }

    /// Whether this is an IPv6 link-local address (`fe80::/10`).
    pub fn is_link_local(self) -> bool {
        self.0[0] == 0xfe && (self.0[1] & 0xc0) == 0x80
    }

    /// Whether every byte is zero (an empty table slot).
    pub fn is_zero(self) -> bool {
        self.0 == [0; 16]
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_ipv6(), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// What kind of GID a table entry is (`ibv_gid_entry::gid_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1: Ethernet frames, not routable.
    RoceV1,
    /// RoCE v2: UDP/IP, routable. What RoCE deployments should use.
    RoceV2,
    /// A type this library does not know.
    Other(u32),
}

impl GidType {
    pub(crate) fn from_raw(t: u32) -> GidType {
        match t {
            gpudirect_sys::IBV_GID_TYPE_IB => GidType::Ib,
            gpudirect_sys::IBV_GID_TYPE_ROCE_V1 => GidType::RoceV1,
            gpudirect_sys::IBV_GID_TYPE_ROCE_V2 => GidType::RoceV2,
            other => GidType::Other(other),
        }
    }
}

impl fmt::Display for GidType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GidType::Ib => f.write_str("IB"),
            GidType::RoceV1 => f.write_str("RoCE v1"),
            GidType::RoceV2 => f.write_str("RoCE v2"),
            GidType::Other(t) => write!(f, "type {t}"),
        }
    }
}

/// One valid entry of a port's GID table.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GidEntry {
    /// Index in the port's table: the `sgid_index` a queue pair uses.
    pub index: u32,
    /// The GID itself.
    pub gid: Gid,
    /// IB, RoCE v1 or RoCE v2.
    pub gid_type: GidType,
    /// The network interface the entry belongs to (RoCE only).
    pub netdev: Option<String>,
}

impl fmt::Display for GidEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GID index {} {} ({})", self.index, self.gid, self.gid_type)?;
        if let Some(n) = &self.netdev {
            write!(f, " on {n}")?;
        }
        Ok(())
    }
}

/// The GID a queue pair will use, and why that one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidChoice {
    /// The chosen entry.
    pub entry: GidEntry,
    /// Why it was chosen, for logs and `Debug` output.
    pub reason: &'static str,
}

impl fmt::Display for GidChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{}]", self.entry, self.reason)
    }
}

/// Why no GID could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GidError {
    /// The port's GID table has no valid entry.
    #[error(
        "the GID table of {device} port {port} is empty: on RoCE, bring the network \
         interface up and give it an IP address"
    )]
    Empty {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
    },
    /// The requested index is not a valid entry.
    #[error("GID index {index} is not a valid entry of {device} port {port}; valid entries: {}", list(.valid))]
    NoSuchIndex {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// The index asked for.
        index: u32,
        /// The entries that exist.
        valid: Vec<GidEntry>,
    },
}

fn list(entries: &[GidEntry]) -> String {
    if entries.is_empty() {
        return "none".into();
    }
    entries.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

/// Chooses the GID for a connection from a port's valid entries.
///
/// With `index` given, that entry is used (and must exist). Otherwise, on
/// InfiniBand the first entry (the port's GID from the subnet manager); on
/// Ethernet (RoCE), in order of preference: a RoCE v2 IPv4-mapped address,
/// a RoCE v2 global IPv6 address, a RoCE v2 link-local address, and only
/// then RoCE v1. Among equals the lowest index wins, which is what perftest
/// and NCCL's defaults reach on a single-address interface.
///
/// On RoCE the GID index decides the protocol version and the source IP
/// address of every packet. The wrong one (a RoCE v1 entry, or an IPv6
/// link-local address when the peer is reached over IPv4) is the classic
/// misconfiguration: the connection times out with no hint why. The choice
/// is therefore made explicitly by this function, logged, and shown by
/// every queue pair's `Debug` output.
pub fn choose_gid(
    device: &str,
    port: u8,
    link_layer: LinkLayer,
    entries: &[GidEntry],
    index: Option<u32>,
) -> Result<GidChoice, GidError> {
    if let Some(index) = index {
        return match entries.iter().find(|e| e.index == index) {
            Some(e) => Ok(GidChoice { entry: e.clone(), reason: "requested" }),
            None => Err(GidError::NoSuchIndex {
                device: device.into(),
                port,
                index,
                valid: entries.to_vec(),
            }),
        };
    }
    let rank = |e: &GidEntry| -> Option<(u8, &'static str)> {
        if link_layer != LinkLayer::Ethernet {
            return Some((0, "InfiniBand port: first GID"));
        }
        match e.gid_type {
            GidType::RoceV2 if e.gid.is_ipv4_mapped() => Some((0, "RoCE v2, IPv4-mapped")),
            GidType::RoceV2 if !e.gid.is_link_local() => Some((1, "RoCE v2, global IPv6")),
            GidType::RoceV2 => Some((2, "RoCE v2, link-local IPv6 (no IP address on the interface?)")),
            GidType::RoceV1 => Some((3, "RoCE v1 only: not routable, no RoCE v2 entry present")),
            _ => None,
        }
    };
    entries
        .iter()
        .filter(|e| !e.gid.is_zero())
        .filter_map(|e| rank(e).map(|(r, why)| (r, e.index, e, why)))
        .min_by_key(|(r, i, _, _)| (*r, *i))
        .map(|(_, _, e, reason)| GidChoice { entry: e.clone(), reason })
        .ok_or_else(|| GidError::Empty { device: device.into(), port })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u32, addr: &str, gid_type: GidType) -> GidEntry {
        let ip: Ipv6Addr = addr.parse().unwrap();
        GidEntry { index, gid: Gid(ip.octets()), gid_type, netdev: Some("eth0".into()) }
    }

    /// A table shaped like mlx5's on an interface with one IPv4 address:
    /// a v1 and a v2 entry for the link-local address, then for the
    /// IPv4-mapped one.
    fn rxe_table() -> Vec<GidEntry> {
        vec![
            entry(0, "fe80::5054:ff:fe00:1", GidType::RoceV1),
            entry(1, "fe80::5054:ff:fe00:1", GidType::RoceV2),
            entry(2, "::ffff:192.0.2.1", GidType::RoceV1),
            entry(3, "::ffff:192.0.2.1", GidType::RoceV2),
        ]
    }

    #[test]
    fn roce_prefers_v2_ipv4_mapped() {
        let c = choose_gid("rxe0", 1, LinkLayer::Ethernet, &rxe_table(), None).unwrap();
        assert_eq!(c.entry.index, 3);
        assert_eq!(c.reason, "RoCE v2, IPv4-mapped");
        assert_eq!(c.to_string(), "GID index 3 ::ffff:192.0.2.1 (RoCE v2) on eth0 [RoCE v2, IPv4-mapped]");
    }

    #[test]
    fn roce_without_ipv4_takes_global_then_link_local_v2() {
        let mut t = rxe_table();
        t.truncate(2);
        let c = choose_gid("rxe0", 1, LinkLayer::Ethernet, &t, None).unwrap();
        assert_eq!((c.entry.index, c.entry.gid_type), (1, GidType::RoceV2));
        assert!(c.reason.contains("link-local"));
        t.push(entry(4, "2001:db8::1", GidType::RoceV2));
        let c = choose_gid("rxe0", 1, LinkLayer::Ethernet, &t, None).unwrap();
        assert_eq!(c.entry.index, 4);
    }

    #[test]
    fn roce_v1_is_last_resort() {
        let t = vec![entry(0, "fe80::1", GidType::RoceV1)];
        let c = choose_gid("mlx5_0", 1, LinkLayer::Ethernet, &t, None).unwrap();
        assert!(c.reason.contains("RoCE v1 only"));
    }

    #[test]
    fn infiniband_takes_first() {
        let t = vec![entry(0, "fe80::248a:703:49:d4f2", GidType::Ib), entry(1, "fe80::1", GidType::Ib)];
        let c = choose_gid("mlx5_0", 1, LinkLayer::InfiniBand, &t, None).unwrap();
        assert_eq!(c.entry.index, 0);
    }

    #[test]
    fn override_must_exist_and_error_lists_table() {
        let c = choose_gid("rxe0", 1, LinkLayer::Ethernet, &rxe_table(), Some(0)).unwrap();
        assert_eq!((c.entry.index, c.reason), (0, "requested"));
        let e = choose_gid("rxe0", 1, LinkLayer::Ethernet, &rxe_table(), Some(7)).unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("GID index 7 is not a valid entry of rxe0 port 1; valid entries: GID index 0"), "{s}");
        assert!(s.contains("GID index 3 ::ffff:192.0.2.1 (RoCE v2) on eth0"), "{s}");
    }

    #[test]
    fn empty_table_says_what_to_do() {
        let e = choose_gid("rxe0", 1, LinkLayer::Ethernet, &[], None).unwrap_err();
        assert!(e.to_string().contains("give it an IP address"));
    }
}
