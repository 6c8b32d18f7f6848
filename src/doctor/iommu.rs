//! The IOMMU: whether it translates the DMA between GPU and NIC (which
//! costs, or breaks, peer-to-peer traffic) or passes it through.

use gpudirect::sysroot::SysRoot;
use gpudirect::topology::PciTopology;

use super::{Finding, Status};

const IOMMU_GROUPS: &str = "/sys/kernel/iommu_groups";

/// How a device's IOMMU group handles DMA.
enum GroupMode {
    NoGroup,
    Identity,
    Translated(String),
    Other(String),
    NoTypeFile,
}

/// Whether a kernel parameter steers the IOMMU.
fn is_iommu_param(p: &str) -> bool {
    ["iommu=", "iommu.", "intel_iommu=", "amd_iommu=", "amd_iommu_dump", "iommu_"].iter().any(|k| p.starts_with(k))
}

/// One finding on the IOMMU mode and the devices' groups.
pub(super) fn iommu_finding(root: &SysRoot, topo: &PciTopology) -> Finding {
    let cmdline = root.read("/proc/cmdline").ok();
    let params: Vec<&str> = cmdline.as_deref().map(|c| c.split_whitespace().collect()).unwrap_or_default();
    let has = |p: &str| params.contains(&p);
    let passthrough = has("iommu=pt")
        || params.iter().any(|p| matches!(*p, "iommu.passthrough=1" | "iommu.passthrough=on" | "iommu.passthrough=y"));
    let forced_translation = has("iommu=nopt")
        || params.iter().any(|p| matches!(*p, "iommu.passthrough=0" | "iommu.passthrough=off" | "iommu.passthrough=n"));
    let asked_on = params
        .iter()
        .any(|p| p.starts_with("intel_iommu=on") || (p.starts_with("amd_iommu=") && *p != "amd_iommu=off"));
    // Only the parameters that steer the IOMMU: the rest of the command line
    // (root devices, consoles, credentials passed by some boot setups) is
    // none of this finding's business.
    let iommu_params: Vec<&str> = params.iter().copied().filter(|p| is_iommu_param(p)).collect();
    let cmdline_evidence = match (&cmdline, iommu_params.is_empty()) {
        (None, _) => "/proc/cmdline: not readable".to_owned(),
        (Some(_), true) => "/proc/cmdline: no IOMMU parameter (iommu=, iommu.*, intel_iommu=, amd_iommu=)".to_owned(),
        (Some(_), false) => format!("/proc/cmdline, IOMMU parameters: {}", iommu_params.join(" ")),
    };
    let groups = root.list_dir(IOMMU_GROUPS).unwrap_or_default();
    if groups.is_empty() {
        let mut f = Finding::new(
            "iommu.mode",
            Status::Ok,
            format!("no IOMMU groups in {IOMMU_GROUPS}: the IOMMU is off, so DMA addresses are not translated"),
        )
        .evidence(cmdline_evidence);
        if asked_on {
            f = f.evidence(
                "the command line asks for the IOMMU but no groups exist: it is off in firmware (VT-d / AMD-Vi) or \
                 unsupported",
            );
        }
        return f;
    }

    let mut devices: Vec<(String, String, &str)> = Vec::new();
    for g in &topo.gpus {
        devices.push((g.label(), g.bdf.clone(), g.sysfs_path.as_str()));
    }
    for n in &topo.nics {
        devices.push((n.name.clone(), n.bdf.clone(), n.sysfs_path.as_str()));
    }
    let mut f_evidence = Vec::new();
    let (mut translated, mut other, mut no_type) = (Vec::new(), Vec::new(), Vec::new());
    for (label, bdf, path) in &devices {
        let group = root.resolve(&format!("{path}/iommu_group")).filter(|p| root.is_dir(p));
        let mode = match &group {
            None => GroupMode::NoGroup,
            Some(g) => match root.read(&format!("{g}/type")).ok() {
                None => GroupMode::NoTypeFile,
                Some(t) if t == "identity" => GroupMode::Identity,
                Some(t) if t == "DMA" || t == "DMA-FQ" => GroupMode::Translated(t),
                Some(t) => GroupMode::Other(t),
            },
        };
        let group_name = group.as_deref().and_then(|g| g.rsplit('/').next()).unwrap_or("-").to_owned();
        let what = match &mode {
            GroupMode::NoGroup => "not in an IOMMU group (not translated)".to_owned(),
            GroupMode::Identity => format!("group {group_name}, type identity (pass-through)"),
            GroupMode::Translated(t) => format!("group {group_name}, type {t} (translated)"),
            GroupMode::Other(t) => format!("group {group_name}, type {t} (not judged here)"),
            GroupMode::NoTypeFile => format!("group {group_name}, no type file (kernel too old to say)"),
        };
        f_evidence.push(format!("{label} {bdf}: {what}"));
        match mode {
            GroupMode::Translated(_) => translated.push(label.clone()),
            GroupMode::Other(t) => other.push(format!("{label} ({t})")),
            GroupMode::NoTypeFile => no_type.push(label.clone()),
            GroupMode::NoGroup | GroupMode::Identity => {}
        }
    }
    let fix = "Boot with iommu=pt (Intel: intel_iommu=on iommu=pt; AMD: iommu=pt): add it to GRUB_CMDLINE_LINUX in \
               /etc/default/grub, run update-grub (or grub2-mkconfig -o /boot/grub2/grub.cfg) and reboot. Host \
               devices then bypass translation and VFIO passthrough keeps working. If translation must stay, \
               peer-to-peer needs ATS on the NIC and ACS Direct Translated P2P on the switch ports; otherwise every \
               GPU<->NIC transfer detours to the root complex for translation, or fails.";
    let mut f = if !translated.is_empty() {
        Finding::new(
            "iommu.mode",
            Status::Warn,
            format!(
                "the IOMMU translates DMA for {}: GPU<->NIC peer-to-peer then needs ATS or goes through the root \
                 complex (slower) or fails",
                translated.join(", ")
            ),
        )
        .fix(fix)
    } else if !other.is_empty() {
        Finding::new("iommu.mode", Status::Warn, format!("IOMMU group type not judged here for {}", other.join(", ")))
            .fix("Expected `identity` (pass-through); check whether the device is bound to VFIO or blocked.")
    } else if !no_type.is_empty() {
        if passthrough {
            Finding::new(
                "iommu.mode",
                Status::Ok,
                format!(
                    "IOMMU groups exist but the kernel doesn't show their type; the command line's pass-through \
                     setting means {} are not translated (inferred)",
                    no_type.join(", ")
                ),
            )
        } else if forced_translation || asked_on {
            Finding::new(
                "iommu.mode",
                Status::Warn,
                format!(
                    "IOMMU on without pass-through on the command line: {} are most likely translated (inferred; \
                     the kernel doesn't show group types)",
                    no_type.join(", ")
                ),
            )
            .fix(fix)
        } else {
            Finding::new(
                "iommu.mode",
                Status::Skipped,
                format!(
                    "IOMMU groups exist but neither their type nor the command line says whether {} are translated",
                    no_type.join(", ")
                ),
            )
        }
    } else {
        Finding::new(
            "iommu.mode",
            Status::Ok,
            "GPUs and NICs are in pass-through (identity) IOMMU groups or none: DMA is not translated",
        )
    };
    for e in f_evidence {
        f = f.evidence(e);
    }
    f.evidence(cmdline_evidence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_iommu_parameters_are_shown() {
        let t = testkit::Tree::new("iommu-cmdline");
        t.file("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=UUID=abcd ro console=ttyS0 intel_iommu=on iommu=pt secret=hunter2\n");
        let root = SysRoot::at(t.path());
        let f = iommu_finding(&root, &PciTopology::default());
        let line = f.evidence.iter().find(|e| e.starts_with("/proc/cmdline")).unwrap();
        assert_eq!(line, "/proc/cmdline, IOMMU parameters: intel_iommu=on iommu=pt");
        t.file("/proc/cmdline", "ro quiet\n");
        let f = iommu_finding(&root, &PciTopology::default());
        assert!(f.evidence.iter().any(|e| e == "/proc/cmdline: no IOMMU parameter (iommu=, iommu.*, intel_iommu=, amd_iommu=)"));
    }
}
