//! ACS on the PCIe bridges between a GPU and a NIC: what each bridge's
//! configuration space says, and whether it redirects peer-to-peer traffic
//! up to the root complex (where it is slow or blocked).

use std::collections::BTreeMap;

use serde::Serialize;

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::{Pair, PathLevel, PCI_DEVICES};

use super::{Finding, Status};

/// PCIe configuration space is 4 KiB; nothing past it has meaning.
const CONFIG_LIMIT: u64 = 4096;

/// What a bridge's configuration space says about ACS.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum ConfigAcs {
    /// Only the 64-byte header came back: sysfs truncates config reads for
    /// readers without CAP_SYS_ADMIN.
    NeedsRoot {
        /// Bytes read.
        len: usize,
    },
    /// 256 bytes: no extended configuration space (conventional PCI, or a
    /// kernel/VM without access to it), so no ACS capability to read.
    NoExtendedSpace {
        /// Bytes read.
        len: usize,
    },
    /// The extended capability list has no ACS capability.
    Absent,
    /// The ACS extended capability.
    Present {
        /// Offset of its header.
        offset: usize,
        /// ACS Capability register (what the port supports).
        cap: u16,
        /// ACS Control register (what is enabled).
        ctrl: u16,
    },
    /// The bytes don't form a valid capability list.
    Broken(String),
}

/// ACS Control bits (PCIe base spec, ACS Extended Capability).
const ACS_BITS: [(u16, &str); 7] = [
    (0x01, "SrcValid"),
    (0x02, "TransBlk"),
    (0x04, "ReqRedir"),
    (0x08, "CmpltRedir"),
    (0x10, "UpstreamFwd"),
    (0x20, "EgressCtrl"),
    (0x40, "DirectTrans"),
];
const ACS_RR: u16 = 0x04;
const ACS_CR: u16 = 0x08;
const ACS_EC: u16 = 0x20;
const ACS_CAP_ID: u32 = 0x000d;
const PCIE_CAP_ID: u8 = 0x10;

fn le16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes([*b.get(at)?, *b.get(at + 1)?]))
}

fn le32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes([*b.get(at)?, *b.get(at + 1)?, *b.get(at + 2)?, *b.get(at + 3)?]))
}

/// Walks the extended capability list from 0x100 (header: id in bits 15:0,
/// version 19:16, next offset 31:20) to the ACS capability.
pub fn acs_from_config(cfg: &[u8]) -> ConfigAcs {
    let len = cfg.len();
    if len < 64 {
        return ConfigAcs::Broken(format!("only {len} bytes, shorter than the 64-byte header"));
    }
    if len < 256 {
        return ConfigAcs::NeedsRoot { len };
    }
    if len < 0x104 {
        return ConfigAcs::NoExtendedSpace { len };
    }
    let mut off = 0x100usize;
    // (4096 - 256) / 4 headers at most; more means a loop.
    for _ in 0..960 {
        let Some(header) = le32(cfg, off) else {
            return ConfigAcs::Broken(format!("capability at {off:#x} runs past the {len} bytes read"));
        };
        if header == 0 && off == 0x100 {
            return ConfigAcs::Absent;
        }
        if header == 0xffff_ffff {
            return ConfigAcs::Broken(format!("header at {off:#x} reads all ones (device not responding)"));
        }
        if header & 0xffff == ACS_CAP_ID {
            return match (le16(cfg, off + 4), le16(cfg, off + 6)) {
                (Some(cap), Some(ctrl)) => ConfigAcs::Present { offset: off, cap, ctrl },
                _ => ConfigAcs::Broken(format!("ACS capability at {off:#x} is cut off")),
            };
        }
        let next = ((header >> 20) & 0xffc) as usize;
        if next == 0 {
            return ConfigAcs::Absent;
        }
        if next < 0x100 {
            return ConfigAcs::Broken(format!("capability at {off:#x} points to {next:#x}, inside the header"));
        }
        off = next;
    }
    ConfigAcs::Broken("extended capability list loops".to_owned())
}

/// The PCIe Device/Port Type from the standard capability list, when the
/// bytes reach it (they don't in a 64-byte read).
fn pcie_port_type(cfg: &[u8]) -> Option<u8> {
    if le16(cfg, 6)? & 0x10 == 0 {
        return None;
    }
    let mut ptr = usize::from(*cfg.get(0x34)? & 0xfc);
    for _ in 0..48 {
        if ptr < 0x40 {
            return None;
        }
        if *cfg.get(ptr)? == PCIE_CAP_ID {
            return Some(((le16(cfg, ptr + 2)? >> 4) & 0xf) as u8);
        }
        ptr = usize::from(*cfg.get(ptr + 1)? & 0xfc);
    }
    None
}

fn port_role(port_type: Option<u8>) -> &'static str {
    match port_type {
        Some(4) => "root port",
        Some(5) => "switch upstream port",
        Some(6) => "switch downstream port",
        Some(7) => "PCIe-to-PCI bridge",
        Some(8) => "PCI-to-PCIe bridge",
        _ => "bridge",
    }
}

/// lspci's rendering, so the evidence reads like `lspci -vvv`.
fn acs_flags(v: u16) -> String {
    ACS_BITS
        .iter()
        .map(|(bit, name)| format!("{name}{}", if v & bit != 0 { '+' } else { '-' }))
        .collect::<Vec<_>>()
        .join(" ")
}

/// One ACS finding per bridge on the placed pairs' paths.
pub(super) fn acs_findings(root: &SysRoot, pairs: &[Pair]) -> Vec<Finding> {
    if pairs.is_empty() {
        return vec![Finding::new("acs.path", Status::Skipped, "ACS not checked: no GPU–NIC pair could be placed")];
    }
    let mut by_bridge: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for p in pairs.iter().filter(|p| matches!(p.level, PathLevel::Pix | PathLevel::Pxb)) {
        for b in &p.bridges {
            by_bridge.entry(b.as_str()).or_default().push(p.label());
        }
    }
    if by_bridge.is_empty() {
        let levels: Vec<String> = pairs.iter().map(Pair::label).collect();
        return vec![Finding::new(
            "acs.path",
            Status::Ok,
            "ACS redirection changes nothing here: no GPU–NIC pair shares a PCIe switch, so their traffic goes \
             through the root complex anyway",
        )
        .evidence(format!("pairs: {}", levels.join(", ")))];
    }
    by_bridge.into_iter().map(|(bdf, labels)| acs_bridge_finding(root, bdf, &labels)).collect()
}

fn acs_bridge_finding(root: &SysRoot, bdf: &str, labels: &[String]) -> Finding {
    let cfg_path = format!("{PCI_DEVICES}/{bdf}/config");
    let on_path = format!("on the path of {}", labels.join(", "));
    let bytes = match root.read_bytes(&cfg_path, CONFIG_LIMIT) {
        Ok(b) => b,
        Err(e) => {
            return Finding::new(
                format!("acs.bridge.{bdf}"),
                Status::Skipped,
                format!("{bdf}: cannot read {cfg_path}: {e}"),
            )
            .evidence(on_path)
        }
    };
    let role = port_role(pcie_port_type(&bytes));
    let read = format!("{cfg_path}: {} bytes", bytes.len());
    let id = format!("acs.bridge.{bdf}");
    let f = |status, summary: String| Finding::new(id.clone(), status, summary).evidence(read.clone());
    match acs_from_config(&bytes) {
        ConfigAcs::NeedsRoot { len } => f(
            Status::Skipped,
            format!(
                "{bdf}: ACS needs root to check: only {len} bytes of config space came back (sysfs gives readers \
                 without CAP_SYS_ADMIN the 64-byte header only)"
            ),
        )
        .evidence(on_path)
        .fix("Run the doctor as root (in a container, root of the host's user namespace) to read ACS."),
        ConfigAcs::NoExtendedSpace { len } => f(
            Status::Skipped,
            format!(
                "{bdf}: ACS not visible: {len} bytes of config space means no extended space (a conventional PCI \
                 bridge, or a VM without ECAM access)"
            ),
        )
        .evidence(on_path),
        ConfigAcs::Broken(why) => {
            f(Status::Skipped, format!("{bdf}: extended capabilities not judged: {why}")).evidence(on_path)
        }
        ConfigAcs::Absent => {
            f(Status::Ok, format!("{bdf} ({role}): no ACS capability, so it forwards peer-to-peer directly"))
                .evidence(on_path)
        }
        ConfigAcs::Present { offset, cap, ctrl } => {
            let regs = format!(
                "ACS capability at {offset:#x}: ACSCap: {}; ACSCtl: {} ({ctrl:#06x})",
                acs_flags(cap),
                acs_flags(ctrl)
            );
            if ctrl & (ACS_RR | ACS_CR) != 0 {
                f(
                    Status::Fail,
                    format!(
                        "{bdf} ({role}): ACS ReqRedir{} CmpltRedir{} sends GPU<->NIC peer-to-peer up to the root \
                         complex instead of across the switch: GPUDirect RDMA slows down or fails (NCCL: \
                         IBV_WC_LOC_PROT_ERR, vendor err 81)",
                        if ctrl & ACS_RR != 0 { '+' } else { '-' },
                        if ctrl & ACS_CR != 0 { '+' } else { '-' }
                    ),
                )
                .evidence(regs)
                .evidence(on_path)
                .fix(format!(
                    "Disable ACS redirection on {bdf}: as root, `setpci -s {bdf} ECAP_ACS+6.w=0000` (or \
                     `setpci -s {bdf} {:#x}.w=0000` with pciutils too old to know ECAP_ACS), run at every boot \
                     (e.g. a systemd unit before the GPU jobs start); or boot with `pci=disable_acs_redir={bdf}` \
                     (Linux 5.1+), or turn ACS off in the BIOS. The kernel turns ACS on when the IOMMU is enabled, \
                     even with iommu=pt. Turning it off merges IOMMU groups, so don't on hosts that pass devices to \
                     VMs.",
                    offset + 6
                ))
            } else if ctrl & ACS_EC != 0 {
                f(
                    Status::Warn,
                    format!(
                        "{bdf} ({role}): ACS P2P Egress Control is on: whether it blocks GPU<->NIC traffic depends \
                         on its egress control vector, not read here"
                    ),
                )
                .evidence(regs)
                .evidence(on_path)
                .fix(format!("Clear it with `setpci -s {bdf} ECAP_ACS+6.w=0000` (as root, at every boot)."))
            } else {
                let note = if ctrl & 0x01 != 0 { " (SrcValid alone doesn't reroute)" } else { "" };
                f(Status::Ok, format!("{bdf} ({role}): ACS does not redirect peer-to-peer{note}"))
                    .evidence(regs)
                    .evidence(on_path)
            }
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// A 4096-byte bridge config space: AER at 0x100, then (optionally) ACS.
    pub(crate) fn bridge_config(acs_ctrl: Option<u16>) -> Vec<u8> {
        let mut b = vec![0u8; 4096];
        b[0..4].copy_from_slice(&[0xb5, 0x10, 0x47, 0x87]);
        b[0x06] = 0x10;
        b[0x0b] = 0x06;
        b[0x0a] = 0x04;
        b[0x0e] = 0x01;
        b[0x34] = 0x40;
        b[0x40] = 0x10;
        b[0x42] = 0x62; // PCIe v2, downstream port
        let next = if acs_ctrl.is_some() { 0x148u32 } else { 0 };
        b[0x100..0x104].copy_from_slice(&(0x0001 | (2 << 16) | (next << 20)).to_le_bytes());
        if let Some(ctrl) = acs_ctrl {
            b[0x148..0x14c].copy_from_slice(&(0x000d_u32 | (1 << 16)).to_le_bytes());
            b[0x14c..0x14e].copy_from_slice(&0x005f_u16.to_le_bytes());
            b[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
        }
        b
    }

    #[test]
    fn config_space_walk() {
        assert_eq!(
            acs_from_config(&bridge_config(Some(0x001d))),
            ConfigAcs::Present { offset: 0x148, cap: 0x005f, ctrl: 0x001d }
        );
        assert_eq!(acs_from_config(&bridge_config(None)), ConfigAcs::Absent);
        assert_eq!(acs_from_config(&bridge_config(Some(0))[..64]), ConfigAcs::NeedsRoot { len: 64 });
        assert_eq!(acs_from_config(&bridge_config(Some(0))[..256]), ConfigAcs::NoExtendedSpace { len: 256 });
        assert!(matches!(acs_from_config(&[0u8; 10]), ConfigAcs::Broken(_)));
        let mut looped = bridge_config(None);
        looped[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x100 << 20)).to_le_bytes());
        assert!(matches!(acs_from_config(&looped), ConfigAcs::Broken(ref w) if w.contains("loops")));
        let mut into_header = bridge_config(None);
        into_header[0x100..0x104].copy_from_slice(&(0x0001u32 | (0x40 << 20)).to_le_bytes());
        assert!(matches!(acs_from_config(&into_header), ConfigAcs::Broken(_)));
        let mut cut = bridge_config(Some(0x1d));
        cut.truncate(0x14d);
        assert!(matches!(acs_from_config(&cut), ConfigAcs::Broken(_)));
        assert_eq!(pcie_port_type(&bridge_config(None)), Some(6));
        assert_eq!(pcie_port_type(&bridge_config(None)[..64]), None);
        assert_eq!(
            acs_flags(0x001d),
            "SrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-"
        );
    }
}
