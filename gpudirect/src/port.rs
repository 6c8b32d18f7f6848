//! Port attributes (`ibv_query_port`): plain data, a leaf that the
//! context, GID choice, queue pairs and the bootstrap wire format share.

use std::fmt;

use gpudirect_sys as sys;

/// Path MTU, as negotiated between the two ends of a queue pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// From `enum ibv_mtu` (1 = 256 ... 5 = 4096).
    pub fn from_raw(v: u32) -> Option<Mtu> {
        Some(match v {
            sys::IBV_MTU_256 => Mtu::Mtu256,
            sys::IBV_MTU_512 => Mtu::Mtu512,
            sys::IBV_MTU_1024 => Mtu::Mtu1024,
            sys::IBV_MTU_2048 => Mtu::Mtu2048,
            sys::IBV_MTU_4096 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// As `enum ibv_mtu`.
    pub fn to_raw(self) -> u32 {
        match self {
            Mtu::Mtu256 => sys::IBV_MTU_256,
            Mtu::Mtu512 => sys::IBV_MTU_512,
            Mtu::Mtu1024 => sys::IBV_MTU_1024,
            Mtu::Mtu2048 => sys::IBV_MTU_2048,
            Mtu::Mtu4096 => sys::IBV_MTU_4096,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << self.to_raw()
    }
}

impl fmt::Display for Mtu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.bytes())
    }
}

/// What the port's link runs: InfiniBand or Ethernet (RoCE).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID only.
    Ethernet,
    /// Unspecified (reported by some older providers; treated as InfiniBand).
    Unspecified,
}

/// Logical port state (`enum ibv_port_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum PortState {
    /// Link down.
    Down,
    /// Link up, waiting for the subnet manager (InfiniBand).
    Init,
    /// Armed.
    Armed,
    /// Ready to carry traffic.
    Active,
    /// Other (`NOP`, `ACTIVE_DEFER`, or unknown).
    Other(u32),
}

/// Attributes of one port (`ibv_query_port`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct PortAttr {
    /// Port number, from 1.
    pub port: u8,
    /// Logical state.
    pub state: PortState,
    /// Largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// MTU currently in force (on RoCE, derived from the netdev's MTU).
    pub active_mtu: Option<Mtu>,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
    /// Size of the GID table.
    pub gid_table_len: u32,
}
