//! Finding NVIDIA GPUs and RDMA NICs in sysfs.

use std::io;

use super::{GpuDev, IbPort, NicDev, OtherRdma, PciTopology, IB_CLASS, PCI_DEVICES};
use crate::sysroot::SysRoot;

const NVIDIA_VENDOR: u32 = 0x10de;

/// Finds NVIDIA GPUs (vendor 0x10de, class 0x0300xx or 0x0302xx) in
/// `/sys/bus/pci/devices` and RDMA NICs in `/sys/class/infiniband`.
pub fn discover(root: &SysRoot) -> PciTopology {
    let mut topo = PciTopology::default();
    match root.list_dir(PCI_DEVICES) {
        Err(e) => topo.notes.push(format!("cannot list {PCI_DEVICES}: {e}")),
        Ok(names) => {
            for name in names {
                let bdf = name.to_ascii_lowercase();
                if !is_bdf(&bdf) {
                    continue;
                }
                let Some(path) = root.resolve(&format!("{PCI_DEVICES}/{name}")) else {
                    topo.notes.push(format!("{PCI_DEVICES}/{name}: symlink loop"));
                    continue;
                };
                let vendor = root.read(&format!("{path}/vendor")).ok().and_then(|v| parse_hex(&v));
                let class_text = root.read(&format!("{path}/class")).ok();
                let class = class_text.as_deref().and_then(parse_hex);
                let is_gpu =
                    vendor == Some(NVIDIA_VENDOR) && class.is_some_and(|c| c >> 8 == 0x0300 || c >> 8 == 0x0302);
                if !is_gpu {
                    continue;
                }
                let device = root.read(&format!("{path}/device")).ok().and_then(|v| parse_hex(&v));
                topo.gpus.push(GpuDev {
                    index: 0,
                    bdf,
                    pci_id: format!("10de:{:04x}", device.unwrap_or(0)),
                    class: class_text.unwrap_or_default(),
                    numa_node: parse_numa(root.read(&format!("{path}/numa_node")).ok().as_deref()),
                    sysfs_path: path,
                });
            }
        }
    }
    topo.gpus.sort_by(|a, b| a.bdf.cmp(&b.bdf));
    for (i, g) in topo.gpus.iter_mut().enumerate() {
        g.index = i;
    }

    match root.list_dir(IB_CLASS) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            topo.notes.push(format!("{IB_CLASS} does not exist: no RDMA driver is loaded (or it is hidden here)"))
        }
        Err(e) => topo.notes.push(format!("cannot list {IB_CLASS}: {e}")),
        Ok(names) => {
            for name in names {
                match nic_from_class(root, &name) {
                    Ok(nic) => topo.nics.push(nic),
                    Err(reason) => topo.other_rdma.push(OtherRdma { name, reason }),
                }
            }
        }
    }
    topo.nics.sort_by_key(|n| natural_key(&n.name));
    topo
}

fn nic_from_class(root: &SysRoot, name: &str) -> Result<NicDev, String> {
    let class_dir = format!("{IB_CLASS}/{name}");
    let device_link = format!("{class_dir}/device");
    let dev = root.resolve(&device_link).filter(|p| root.is_dir(p));
    let Some(path) = dev else {
        return Err(match root.read(&format!("{class_dir}/parent")).ok() {
            Some(parent) => format!("no PCI device: software RDMA on network interface {parent} (rxe/siw)"),
            None => "no PCI device behind it (no device link): software or virtual RDMA".to_owned(),
        });
    };
    let bdf = path.rsplit('/').next().unwrap_or_default().to_ascii_lowercase();
    if !path.starts_with("/sys/devices/pci") || !is_bdf(&bdf) {
        return Err(format!("its device link leads to {path}, not a PCI function"));
    }
    let vendor = root.read(&format!("{path}/vendor")).ok().and_then(|v| parse_hex(&v)).unwrap_or(0);
    let device = root.read(&format!("{path}/device")).ok().and_then(|v| parse_hex(&v)).unwrap_or(0);
    let mut ports = Vec::new();
    if let Ok(entries) = root.list_dir(&format!("{class_dir}/ports")) {
        for entry in entries {
            let Ok(port) = entry.parse::<u32>() else { continue };
            let dir = format!("{class_dir}/ports/{entry}");
            let rate = root.read(&format!("{dir}/rate")).ok();
            ports.push(IbPort {
                port,
                rate_gbps: rate.as_deref().and_then(parse_rate_gbps),
                rate,
                link_layer: root.read(&format!("{dir}/link_layer")).ok(),
                state: root.read(&format!("{dir}/state")).ok(),
            });
        }
    }
    ports.sort_by_key(|p| p.port);
    Ok(NicDev {
        name: name.to_owned(),
        bdf,
        pci_id: format!("{vendor:04x}:{device:04x}"),
        numa_node: parse_numa(root.read(&format!("{path}/numa_node")).ok().as_deref()),
        netdevs: root.list_dir(&format!("{path}/net")).unwrap_or_default(),
        ports,
        sysfs_path: path,
    })
}

/// `400 Gb/sec (4X NDR)` → 400.
pub(crate) fn parse_rate_gbps(text: &str) -> Option<f64> {
    let mut words = text.split_whitespace();
    let value = words.next()?.parse::<f64>().ok()?;
    let unit = words.next()?;
    (unit.starts_with("Gb/s") && value.is_finite() && value > 0.0 && value < 1.0e6).then_some(value)
}

/// `0x10de`-style sysfs values.
pub(crate) fn parse_hex(text: &str) -> Option<u32> {
    let t = text.trim();
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")).unwrap_or(t);
    u32::from_str_radix(digits, 16).ok()
}

/// `numa_node`: -1 (and anything unparsable) means the kernel doesn't know.
pub(crate) fn parse_numa(text: Option<&str>) -> Option<i32> {
    text.and_then(|t| t.trim().parse::<i32>().ok()).filter(|n| *n >= 0)
}

/// A PCI bus id, `DDDD:BB:DD.F`; the domain may be longer than four digits
/// (Intel VMD puts devices in domains 10000 and up).
pub fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    if b.len() < 12 {
        return false;
    }
    // `BB:DD.F` is the last seven bytes; everything before is `DDDD...:`.
    let (dom, tail) = b.split_at(b.len() - 7);
    dom.last() == Some(&b':')
        && dom[..dom.len() - 1].iter().all(u8::is_ascii_hexdigit)
        && tail[2] == b':'
        && tail[5] == b'.'
        && [0, 1, 3, 4].iter().all(|&i| tail[i].is_ascii_hexdigit())
        && tail[6].is_ascii_digit()
}

/// NCCL's `checkBDFFormat`: exactly 12 characters. Kept separate from
/// [`is_bdf`] because NCCL treats a VMD domain directory as the CPU, and the
/// point of its view is to predict what NCCL decides.
pub(crate) fn nccl_is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && [0, 1, 2, 3, 5, 6, 8, 9, 11].iter().all(|&i| b[i].is_ascii_hexdigit())
}

/// `mlx5_10` after `mlx5_2`, as people number them.
pub fn natural_key(name: &str) -> (String, u64, String) {
    let digits_start = name.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let num = name[digits_start..].parse::<u64>().unwrap_or(0);
    (name[..digits_start].to_owned(), num, name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::super::placement;
    use super::*;

    #[test]
    fn sysfs_value_parsers() {
        assert_eq!(parse_rate_gbps("200 Gb/sec (2X HDR)"), Some(200.0));
        assert_eq!(parse_rate_gbps("2.5 Gb/sec (1X SDR)"), Some(2.5));
        assert_eq!(parse_rate_gbps("garbage"), None);
        assert_eq!(parse_rate_gbps("1e308 Gb/sec (4X NDR)"), None);
        assert_eq!(parse_hex("0x10de\n"), Some(0x10de));
        assert_eq!(parse_numa(Some("-1")), None);
        assert_eq!(parse_numa(Some("1")), Some(1));
        assert!(is_bdf("0000:3a:00.0") && is_bdf("10000:01:00.0") && !is_bdf("pci0000:00"));
        assert!(nccl_is_bdf("0000:3a:00.0") && !nccl_is_bdf("10000:01:00.0"));
        let mut names = vec!["mlx5_10", "mlx5_2", "mlx5_1"];
        names.sort_by_key(|n| natural_key(n));
        assert_eq!(names, ["mlx5_1", "mlx5_2", "mlx5_10"]);
    }

    /// Every one- and two-character substitution of real sysfs values,
    /// over an alphabet of what sysfs text and garbage hold: no parser
    /// panics, and real values still parse.
    #[test]
    fn garbage_text_never_panics_the_parsers() {
        let alphabet: Vec<char> = "0123456789.x-+ :/GTbsPCIeXNDRn()\n\t\u{e9}\u{1f600}".chars().collect();
        let seeds = ["400 Gb/sec (4X NDR)", "0x10de", "0000:3a:00.0", "-1", "mlx5_10", "/sys/devices/pci0000:00/0000:00:01.0"];
        let mut parsed = 0;
        for seed in seeds {
            let chars: Vec<char> = seed.chars().collect();
            for i in 0..chars.len() {
                for (k, &a) in alphabet.iter().enumerate() {
                    let mut t = chars.clone();
                    t[i] = a;
                    // A second substitution further on, with another character.
                    if i + 1 < t.len() {
                        let n = t.len();
                        t[(i * 7 + k) % n] = alphabet[(k * 5 + i) % alphabet.len()];
                    }
                    let t: String = t.into_iter().collect();
                    parsed += usize::from(parse_rate_gbps(&t).is_some()) + usize::from(parse_hex(&t).is_some());
                    let _ = (parse_numa(Some(&t)), is_bdf(&t), nccl_is_bdf(&t), natural_key(&t), placement(&t));
                }
            }
            let _ = (parse_rate_gbps(seed), parse_hex(seed), is_bdf(seed), natural_key(seed), placement(seed));
        }
        assert!(parsed > 0, "no mutated value parsed: the test exercised nothing");
    }
}
