//! ACS on the PCIe bridges between a GPU and a NIC: what each bridge's
//! configuration space says, and whether it redirects peer-to-peer traffic
//! up to the root complex (where it is slow or blocked).

use std::collections::BTreeMap;

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::acs::{acs_flags, acs_from_config, pcie_port_type, port_role, ConfigAcs, ACS_CR, ACS_EC, ACS_RR, CONFIG_LIMIT};
use gpudirect::topology::{Pair, PCI_DEVICES};

use super::{Blocker, Finding, Status};

/// One ACS finding per bridge on the placed pairs' paths.
pub(super) fn acs_findings(root: &SysRoot, pairs: &[Pair]) -> Vec<Finding> {
    if pairs.is_empty() {
        return vec![Finding::new("acs.path", Status::Skipped, "ACS not checked: no GPU–NIC pair could be placed")];
    }
    let mut by_bridge: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for p in pairs.iter().filter(|p| p.level.turns_in_a_switch()) {
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
    let acs = acs_from_config(&bytes);
    let redirects = acs.redirects();
    match acs {
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
            if redirects {
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
                .blocking(Blocker::AcsBridge(bdf.to_owned()))
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
mod tests {
    use super::*;
    use testkit::bridge_config;

    /// The doctor fails a redirecting bridge by the library's judge, and
    /// only such a bridge.
    #[test]
    fn a_redirecting_bridge_fails_by_the_librarys_judge() {
        for (ctrl, redirects) in [(0x001d, true), (0x0004, true), (0x0008, true), (0x0001, false), (0x0000, false)] {
            let acs = acs_from_config(&bridge_config(Some(ctrl)));
            assert_eq!(acs.redirects(), redirects, "{ctrl:#x}");
        }
        assert!(!acs_from_config(&bridge_config(None)).redirects());
    }
}
