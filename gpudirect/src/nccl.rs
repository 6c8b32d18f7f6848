//! How NCCL reads the environment variables that decide whether it uses
//! GPUDirect RDMA: one reading for every tool that judges them
//! (`gpudirect doctor` for a job's environment, `gpudirect nccl-log` for
//! the values a log shows), so the two cannot disagree.
//!
//! The rules, from NCCL's sources:
//! - Integer parameters (`NCCL_PARAM`: `NCCL_IB_DISABLE`,
//!   `NCCL_NET_GDR_READ`, `NCCL_DMABUF_ENABLE`, ...) go through
//!   `strtoll(value, NULL, 0)`: leading white space and a sign are
//!   accepted, `0x` means hex and a leading `0` octal, reading stops at the
//!   first other character, and a value with no digits is 0 without an
//!   error. An empty value or one out of range (`ERANGE`) leaves the
//!   default. NCCL logs the number it read (`NCCL_IB_DISABLE set by
//!   environment to 1.`). See [`param_int`].
//! - `NCCL_NET_GDR_LEVEL` (and `NCCL_P2P_LEVEL`) is an exact,
//!   case-sensitive path name (`strcmp`), or, when the value starts with a
//!   digit, a legacy number read by `strtol` and mapped through
//!   `levelsOldToNew`; anything else is ignored. NCCL logs the raw string.
//!   See [`gdr_level`].
//! - The rules that stop GPUDirect RDMA on a pair (`NCCL_NET`,
//!   `NCCL_IB_DISABLE`, a missing plugin, `NCCL_IB_HCA`, the distance
//!   limit, `NCCL_DMABUF_ENABLE`, `NCCL_NET_GDR_READ`) are one table,
//!   [`stops`], each typed ([`Stop`]) and worded once.
//! - `NCCL_NET` names a network, compared case-insensitively
//!   (`strcasecmp`) with the names of the built-in transports (`IB`,
//!   `Socket`) and of loaded plugins. See [`is_tcp_network`].

use std::fmt;

mod lines;
mod rules;
pub use lines::{PluginLine, PluginPath, PLUGIN_PREFIX};
pub use rules::{dmabuf_disabled, plugin_network, registration_stops, stops, transport_off, var, Pair, Stop, DECIDING};


/// How an integer parameter's value is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Int {
    /// Empty: NCCL keeps the default.
    Empty,
    /// `strtoll` read these digits (anything after them is ignored).
    Number(i64),
    /// No digits at all: `strtoll` returns 0 without an error, so NCCL uses 0.
    NotANumber,
    /// Out of range: `strtoll` sets `ERANGE` and NCCL keeps the default.
    Overflow,
}

impl Int {
    /// The value NCCL ends up using; `None` means its default.
    pub fn used(self) -> Option<i64> {
        match self {
            Int::Number(n) => Some(n),
            Int::NotANumber => Some(0),
            Int::Empty | Int::Overflow => None,
        }
    }
}

/// Reads `value` as NCCL reads an integer parameter: C's
/// `strtoll(value, NULL, 0)`, with NCCL's handling of an empty value and
/// of `ERANGE`.
pub fn param_int(value: &str) -> Int {
    if value.is_empty() {
        return Int::Empty;
    }
    let b = value.as_bytes();
    let mut i = 0;
    while i < b.len() && matches!(b[i], b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r') {
        i += 1;
    }
    let negative = b.get(i) == Some(&b'-');
    if matches!(b.get(i), Some(b'-' | b'+')) {
        i += 1;
    }
    let radix = if b.get(i) == Some(&b'0') && matches!(b.get(i + 1), Some(b'x' | b'X')) && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit) {
        i += 2;
        16
    } else if b.get(i) == Some(&b'0') {
        8
    } else {
        10
    };
    let mut magnitude: i128 = 0;
    let mut digits = 0;
    while let Some(d) = b.get(i).and_then(|c| (*c as char).to_digit(radix)) {
        magnitude = magnitude * i128::from(radix) + i128::from(d);
        if magnitude > i128::from(i64::MAX) + 1 {
            return Int::Overflow;
        }
        digits += 1;
        i += 1;
    }
    if digits == 0 {
        return Int::NotANumber;
    }
    let value = if negative { -magnitude } else { magnitude };
    i64::try_from(value).map_or(Int::Overflow, Int::Number)
}

/// NCCL's path types between two devices, nearest first: the order in
/// which `NCCL_NET_GDR_LEVEL` compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "UPPERCASE"))]
pub enum PathType {
    /// Same device.
    Loc,
    /// Direct NVLink.
    Nvl,
    /// NVLink through another GPU.
    Nvb,
    /// Chip-to-chip (Grace).
    C2c,
    /// One PCIe switch.
    Pix,
    /// Several PCIe switches.
    Pxb,
    /// C2C plus the CPU's PCIe (Grace: NIC on the CPU).
    P2c,
    /// Through another GPU over NVLink, then PCIe.
    Pxn,
    /// Through the CPU.
    Phb,
    /// Across CPUs.
    Sys,
}

impl PathType {
    /// Every path type, nearest first.
    pub const ALL: [PathType; 10] = [
        PathType::Loc,
        PathType::Nvl,
        PathType::Nvb,
        PathType::C2c,
        PathType::Pix,
        PathType::Pxb,
        PathType::P2c,
        PathType::Pxn,
        PathType::Phb,
        PathType::Sys,
    ];

    /// NCCL's spelling, e.g. `PXB`.
    pub fn name(self) -> &'static str {
        match self {
            PathType::Loc => "LOC",
            PathType::Nvl => "NVL",
            PathType::Nvb => "NVB",
            PathType::C2c => "C2C",
            PathType::Pix => "PIX",
            PathType::Pxb => "PXB",
            PathType::P2c => "P2C",
            PathType::Pxn => "PXN",
            PathType::Phb => "PHB",
            PathType::Sys => "SYS",
        }
    }

    /// Whether a GDR limit of this type rules out GPUDirect RDMA to every
    /// NIC: each GPU–NIC path crosses PCIe, so it is at least `PIX`.
    pub fn forbids_every_nic(self) -> bool {
        self < PathType::Pix
    }
}

impl fmt::Display for PathType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What NCCL makes of an `NCCL_NET_GDR_LEVEL` value: the limit and how it
/// was read, or `None` when NCCL ignores the value and keeps its default
/// (PXB). NCCL's `ncclTopoGetLevel`: an exact, case-sensitive path name;
/// otherwise, if the value starts with a digit, `strtol(value, NULL, 0)`
/// (so `0x3` is hex and `07` octal, `00` is 0) clamped to 5 and mapped
/// through `levelsOldToNew`: 0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and above SYS.
pub fn gdr_level(value: &str) -> Option<(PathType, String)> {
    if let Some(t) = PathType::ALL.iter().find(|t| t.name() == value) {
        return Some((*t, format!("{value} is one of NCCL's path names")));
    }
    if !value.as_bytes().first().is_some_and(u8::is_ascii_digit) {
        return None;
    }
    const OLD_TO_NEW: [PathType; 6] = [PathType::Loc, PathType::Pix, PathType::Pxb, PathType::Phb, PathType::Sys, PathType::Sys];
    // strtol saturates where NCCL_PARAM would keep the default: no errno check here.
    let number = match param_int(value) {
        Int::Number(n) => n,
        _ => i64::MAX,
    };
    let level = OLD_TO_NEW[usize::try_from(number.clamp(0, 5)).unwrap_or(5)];
    let how = if value.len() > 1 && value.starts_with('0') && !value[1..].starts_with(['x', 'X']) {
        format!("legacy integer, read by strtol as octal: {value} = {number} = {level}")
    } else {
        format!("legacy integer {number} = {level} (0 LOC, 1 PIX, 2 PXB, 3 PHB, 4 and up SYS)")
    };
    Some((level, how))
}

/// Whether an `NCCL_IB_DISABLE` value turns NCCL's InfiniBand/RoCE
/// transport off: any value read as non-zero does (`yes` reads as 0).
pub fn ib_disabled(value: &str) -> bool {
    param_int(value).used().is_some_and(|n| n != 0)
}

/// Whether a network name (an `NCCL_NET` value, or the name in `Using
/// network <name>`) is a TCP transport, which stages every transfer in
/// host memory: NCCL's built-in `Socket` and socket plugins such as
/// `FastSocket`. Compared without case, as NCCL compares `NCCL_NET`.
pub fn is_tcp_network(name: &str) -> bool {
    name.to_ascii_lowercase().contains("socket")
}

/// An `NCCL_IB_HCA` value as NCCL reads it (`parseStringList` and
/// `matchIfList`): a leading `^` excludes the listed devices, then a
/// leading `=` makes names exact (otherwise each is a prefix: `mlx5`
/// selects `mlx5_0` and `mlx5_10`); entries are `name[:port]`, comma
/// separated, and an entry without a port selects every port. An empty
/// list selects every device; an empty exclusion list does too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NicList {
    /// `^`: the list names the devices NOT to use.
    pub exclude: bool,
    /// `=`: names match exactly, not as prefixes.
    pub exact: bool,
    /// The entries in order.
    pub entries: Vec<NicListEntry>,
}

/// One `name[:port]` entry of a [`NicList`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicListEntry {
    /// The device name (or prefix).
    pub name: String,
    /// The port as written, when the entry names one.
    pub port: Option<String>,
}

impl NicListEntry {
    /// Whether this entry selects port `port` of device `device`: the
    /// name exactly (`exact`) or as a prefix, and the port when it names
    /// one (read as NCCL's `atoi` reads it).
    pub fn selects(&self, exact: bool, device: &str, port: u32) -> bool {
        let named = if exact { self.name == device } else { device.starts_with(self.name.as_str()) };
        named && self.port.as_deref().is_none_or(|p| atoi(p) == i64::from(port))
    }
}

impl NicList {
    /// Parses a value; never fails (NCCL ignores what it cannot read).
    pub fn parse(value: &str) -> NicList {
        let mut v = value.trim();
        let exclude = v.starts_with('^');
        if exclude {
            v = &v[1..];
        }
        let exact = v.starts_with('=');
        if exact {
            v = &v[1..];
        }
        let entries = v
            .split(',')
            .filter_map(|e| {
                let mut parts = e.trim().split(':');
                let name = parts.next().filter(|n| !n.is_empty())?;
                let port = parts.next().filter(|p| !p.is_empty()).map(str::to_owned);
                Some(NicListEntry { name: name.to_owned(), port })
            })
            .collect();
        NicList { exclude, exact, entries }
    }

    /// Whether NCCL (and the plugin) may use port `port` of `device`.
    pub fn selects(&self, device: &str, port: u32) -> bool {
        if self.entries.is_empty() {
            return true;
        }
        self.entries.iter().any(|e| e.selects(self.exact, device, port)) != self.exclude
    }
}

/// C's `atoi`: leading blanks and sign, digits until the first other
/// character, 0 without digits.
fn atoi(s: &str) -> i64 {
    let t = s.trim_start();
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let n = t.bytes().take_while(u8::is_ascii_digit).fold(0i64, |n, d| n.saturating_mul(10).saturating_add(i64::from(d - b'0')));
    if neg {
        -n
    } else {
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nic_lists_read_as_nccl_reads_them() {
        let l = NicList::parse("mlx5_0:1,mlx5_3");
        assert!(l.selects("mlx5_0", 1) && !l.selects("mlx5_0", 2) && l.selects("mlx5_3", 2));
        assert!(l.selects("mlx5_01", 1), "names are prefixes without =");
        assert!(!l.selects("mlx5_1", 1));
        let l = NicList::parse("=mlx5_0");
        assert!(l.selects("mlx5_0", 1) && !l.selects("mlx5_01", 1));
        let l = NicList::parse("^mlx5_1:1");
        assert!(l.selects("mlx5_0", 1) && !l.selects("mlx5_1", 1) && l.selects("mlx5_1", 2));
        let l = NicList::parse("^=rxe0");
        assert!(l.exclude && l.exact && !l.selects("rxe0", 1) && l.selects("rxe01", 1));
        for every in ["", "^", "=", ",", "^="] {
            assert!(NicList::parse(every).selects("anything", 7), "{every:?}");
        }
        assert!(NicList::parse("mlx5_0:01").selects("mlx5_0", 1), "ports read by atoi");
        assert!(!NicList::parse("mlx5_0:x").selects("mlx5_0", 1));
    }

    #[test]
    fn integers_read_as_strtoll() {
        let cases = [
            ("1", Int::Number(1)),
            ("01", Int::Number(1)),
            ("010", Int::Number(8)),
            ("0x10", Int::Number(16)),
            ("  -3", Int::Number(-3)),
            ("+2abc", Int::Number(2)),
            ("0x", Int::Number(0)),
            ("yes", Int::NotANumber),
            ("", Int::Empty),
            ("99999999999999999999", Int::Overflow),
            ("-9223372036854775808", Int::Number(i64::MIN)),
            ("9223372036854775807", Int::Number(i64::MAX)),
            ("9223372036854775808", Int::Overflow),
            ("+7x", Int::Number(7)),
            ("0x1F", Int::Number(31)),
            // Octal stops at the 9, as strtoll does: "0" is read.
            ("09", Int::Number(0)),
            ("true", Int::NotANumber),
            ("-", Int::NotANumber),
        ];
        for (v, want) in cases {
            assert_eq!(param_int(v), want, "{v:?}");
        }
        assert_eq!(Int::NotANumber.used(), Some(0));
        assert_eq!(Int::Overflow.used(), None);
        assert!(ib_disabled("1") && ib_disabled("2") && ib_disabled("0x1") && ib_disabled(" 1"));
        assert!(!ib_disabled("0") && !ib_disabled("yes") && !ib_disabled(""));
    }

    #[test]
    fn gdr_levels_read_as_ncclgetlevel() {
        use PathType::*;
        let cases = [
            ("LOC", Some(Loc)),
            ("PIX", Some(Pix)),
            ("PXB", Some(Pxb)),
            ("PHB", Some(Phb)),
            ("SYS", Some(Sys)),
            ("NVL", Some(Nvl)),
            ("C2C", Some(C2c)),
            ("P2C", Some(P2c)),
            ("PXN", Some(Pxn)),
            ("0", Some(Loc)),
            ("00", Some(Loc)),
            ("1", Some(Pix)),
            ("2", Some(Pxb)),
            ("3", Some(Phb)),
            ("4", Some(Sys)),
            ("5", Some(Sys)),
            ("9", Some(Sys)),
            ("99999999999999999999999", Some(Sys)),
            ("08", Some(Loc)),
            ("0x3", Some(Phb)),
            ("2abc", Some(Pxb)),
            ("phb", None),
            ("loc", None),
            (" 2", None),
        ];
        for (value, want) in cases {
            assert_eq!(gdr_level(value).map(|p| p.0), want, "{value:?}");
        }
        assert!(gdr_level("").is_none());
        assert!(gdr_level("010").unwrap().1.contains("octal"));
        assert!(Loc.forbids_every_nic() && C2c.forbids_every_nic() && !Pix.forbids_every_nic());
        assert!(is_tcp_network("Socket") && is_tcp_network("socket") && is_tcp_network("FastSocket") && !is_tcp_network("IB"));
    }
}
