//! Containers and pods: whether the doctor runs in one, which way the pod
//! reaches the RDMA fabric (host networking, an SR-IOV virtual function, a
//! macvlan or ipvlan on the fabric NIC, or only the overlay), what each
//! costs, and whether `NCCL_SOCKET_IFNAME` and `NCCL_IB_HCA` name what the
//! pod has.
//!
//! Read from the pod's own sysfs (a container sees its network
//! namespace's `/sys/class/net`): a netdev with a PCI `device` is a NIC
//! function, a virtual function when that device has a `physfn`; a
//! virtual netdev named by a RoCE GID of a visible RDMA device is a
//! macvlan or ipvlan on the fabric NIC (a veth never gets such a GID); the
//! kind `ip -d link` prints (`veth`, `macvlan`, `vxlan`, ...) names the
//! rest when the probe could run.

use std::collections::BTreeMap;

use gpudirect::sysroot::SysRoot;

use super::env;
use super::probes::RdmaDevice;
use super::{Finding, Status};

/// How one interface of the pod reaches other hosts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Class {
    /// A NIC's physical function with an RDMA device: the node's own NIC
    /// (host networking, or bare metal).
    Fabric,
    /// A NIC function with no RDMA device (virtio, an Intel X710 VF, a
    /// NIC whose RDMA driver is not loaded): TCP only.
    PlainNic,
    /// An SR-IOV virtual function, with its physical function's address.
    Vf(String),
    /// A macvlan or ipvlan on the fabric NIC: carries a RoCE GID of an
    /// RDMA device this pod sees.
    SharedFabric,
    /// A macvlan or ipvlan that carries no RoCE GID of a device this pod
    /// sees: on some node NIC, with no RDMA device behind it here.
    SharedNoRdma,
    /// The pod network: a veth to the node, or a tunnel (vxlan, geneve,
    /// ipip) the CNI encapsulates in.
    Overlay,
    /// Something else (a bridge, a bond, a kind the probe did not name).
    Other,
}

impl std::fmt::Display for Class {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Class::Fabric => f.write_str("the node's NIC"),
            Class::PlainNic => f.write_str("a NIC without RDMA"),
            Class::Vf(pf) => write!(f, "an SR-IOV VF of {pf}"),
            Class::SharedFabric => f.write_str("a macvlan/ipvlan on the fabric NIC"),
            Class::SharedNoRdma => f.write_str("a macvlan/ipvlan with no RDMA device"),
            Class::Overlay => f.write_str("the overlay"),
            Class::Other => f.write_str("other"),
        }
    }
}

/// One interface of the pod as the checks see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Iface {
    /// Its name (`eth0`, `net1`).
    pub name: String,
    /// How it reaches other hosts.
    pub class: Class,
    /// The RDMA device behind it (its PCI function's, or the one whose GID
    /// names it).
    pub rdma: Option<String>,
    /// What was read to say so.
    pub why: String,
}

/// The kinds `ip -d link` prints on the line after `link/...`, for the
/// virtual interfaces that matter here.
const OVERLAY_KINDS: [&str; 7] = ["veth", "vxlan", "geneve", "ipip", "gre", "wireguard", "tun"];

/// `name -> kind` from `ip -d link` (or `ip addr`, which has no kinds)
/// output: each block starts `N: name[@peer]: <FLAGS>`, and with `-d` its
/// third line starts with the link kind (`veth`, `macvlan mode bridge`).
pub fn parse_ip_link(text: &str) -> BTreeMap<String, Option<String>> {
    let mut out = BTreeMap::new();
    let mut current: Option<(String, usize)> = None;
    for line in text.lines() {
        let head = line.split_once(": ").filter(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        if let Some((_, rest)) = head {
            let name = rest.split(':').next().unwrap_or_default();
            let name = name.split('@').next().unwrap_or_default().trim().to_owned();
            if !name.is_empty() {
                out.insert(name.clone(), None);
                current = Some((name, 0));
            }
            continue;
        }
        let Some((name, seen)) = current.as_mut() else { continue };
        *seen += 1;
        // Line 1 is `link/ether ...`; line 2, with -d, names the kind.
        if *seen == 2 {
            let word = line.split_whitespace().next().unwrap_or_default();
            let known = OVERLAY_KINDS.contains(&word) || ["macvlan", "macvtap", "ipvlan", "ipvtap", "bridge", "bond", "vlan", "dummy"].contains(&word);
            if known {
                out.insert(name.clone(), Some(word.to_owned()));
            }
        }
    }
    out
}

/// The pod's interfaces, classified (loopback left out).
pub fn interfaces(root: &SysRoot, ip_link: &Result<String, String>) -> Vec<Iface> {
    let kinds = ip_link.as_ref().map(|t| parse_ip_link(t)).unwrap_or_default();
    let gid_owner = roce_gid_netdevs(root);
    let mut out = Vec::new();
    for name in root.list_dir("/sys/class/net").unwrap_or_default() {
        if name == "lo" {
            continue;
        }
        let base = format!("/sys/class/net/{name}");
        // `ip -d link`'s kind, else the kernel's own word for the
        // virtual devices that set one (`DEVTYPE=` in uevent: macvlan,
        // ipvlan, vlan, bond, bridge), so a pod without `ip` still tells a
        // macvlan from a veth.
        let kind = kinds.get(&name).cloned().flatten().or_else(|| devtype(root, &format!("/sys/class/net/{name}")));
        let bdf = |p: &str| root.resolve(p).and_then(|r| r.rsplit('/').next().map(str::to_owned));
        let iface = if root.exists(&format!("{base}/device")) {
            let fn_bdf = bdf(&format!("{base}/device")).unwrap_or_default();
            let rdma = root.list_dir(&format!("{base}/device/infiniband")).ok().and_then(|d| d.into_iter().next());
            let driver = super::driver_name(root, &format!("{base}/device")).map_or_else(String::new, |d| format!(" (driver {d})"));
            // A virtio NIC's `device` is its virtio device, not a PCI function.
            let function = if fn_bdf.contains(':') { format!("PCI function {fn_bdf}") } else { format!("device {fn_bdf}") };
            let pf = root.exists(&format!("{base}/device/physfn")).then(|| bdf(&format!("{base}/device/physfn"))).flatten();
            match (pf, &rdma) {
                (Some(pf), Some(_)) => Iface { name, class: Class::Vf(pf.clone()), rdma, why: format!("PCI function {fn_bdf}, a virtual function of {pf}") },
                (Some(pf), None) => Iface { name, class: Class::PlainNic, rdma, why: format!("{function}{driver}, a virtual function of {pf} with no RDMA device") },
                (None, Some(_)) => Iface { name, class: Class::Fabric, rdma, why: format!("PCI function {fn_bdf}") },
                (None, None) => Iface { name, class: Class::PlainNic, rdma, why: format!("{function}{driver}, no RDMA device") },
            }
        } else if let Some((dev, port)) = gid_owner.get(&name) {
            let why = format!("virtual ({}), carries a RoCE GID of {dev} port {port}", kind.as_deref().unwrap_or("macvlan or ipvlan"));
            Iface { name, class: Class::SharedFabric, rdma: Some(dev.clone()), why }
        } else {
            let overlay_name = ["cali", "flannel", "cilium", "vxlan", "tunl", "genev", "weave", "kube-ipvs"].iter().any(|p| name.starts_with(p));
            let class = match kind.as_deref() {
                Some(k) if OVERLAY_KINDS.contains(&k) => Class::Overlay,
                Some("macvlan" | "macvtap" | "ipvlan" | "ipvtap") => Class::SharedNoRdma,
                Some(_) => Class::Other,
                None if overlay_name => Class::Overlay,
                // A virtual interface linked to another namespace with no
                // fabric GID: the pod's veth (or an unattached macvlan).
                None if linked_elsewhere(root, &base) => Class::Overlay,
                None => Class::Other,
            };
            let why = match &kind {
                Some(k) => format!("virtual ({k}), no RDMA GID"),
                None => "virtual, no PCI device and no RDMA GID".to_owned(),
            };
            Iface { name, class, rdma: None, why }
        };
        out.push(iface);
    }
    out
}

/// The `DEVTYPE` a virtual netdev's uevent names, if any.
fn devtype(root: &SysRoot, base: &str) -> Option<String> {
    let text = root.read(&format!("{base}/uevent")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("DEVTYPE=")).map(|t| t.trim().to_owned()).filter(|t| !t.is_empty())
}

/// A netdev whose `iflink` differs from its `ifindex` has its other end
/// (veth peer, macvlan lower) in another namespace.
fn linked_elsewhere(root: &SysRoot, base: &str) -> bool {
    match (root.read(&format!("{base}/ifindex")), root.read(&format!("{base}/iflink"))) {
        (Ok(a), Ok(b)) => a != b,
        _ => false,
    }
}

/// Netdev name -> (RDMA device, port) for every RoCE GID entry's netdev.
fn roce_gid_netdevs(root: &SysRoot) -> BTreeMap<String, (String, String)> {
    let mut out = BTreeMap::new();
    for dev in root.list_dir("/sys/class/infiniband").unwrap_or_default() {
        for port in root.list_dir(&format!("/sys/class/infiniband/{dev}/ports")).unwrap_or_default() {
            let ndevs = format!("/sys/class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs");
            for idx in root.list_dir(&ndevs).unwrap_or_default() {
                if let Ok(n) = root.read(&format!("{ndevs}/{idx}")) {
                    out.entry(n).or_insert((dev.clone(), port.clone()));
                }
            }
        }
    }
    out
}

/// What says this is a container, and whether Kubernetes runs it.
pub fn container(root: &SysRoot) -> (Option<&'static str>, Vec<String>) {
    let mut evidence = Vec::new();
    let k8s = root.is_dir("/var/run/secrets/kubernetes.io/serviceaccount") || root.is_dir("/run/secrets/kubernetes.io/serviceaccount");
    if k8s {
        evidence.push("/var/run/secrets/kubernetes.io/serviceaccount exists".to_owned());
    }
    let cgroup = root.read("/proc/1/cgroup").unwrap_or_default();
    let runtime = ["kubepods", "docker", "containerd", "crio", "libpod"].into_iter().find(|r| cgroup.contains(r));
    if let Some(r) = runtime {
        evidence.push(format!("/proc/1/cgroup names {r}"));
    }
    for f in ["/.dockerenv", "/run/.containerenv"] {
        if root.exists(f) {
            evidence.push(format!("{f} exists"));
        }
    }
    let what = if k8s || runtime == Some("kubepods") {
        Some("a Kubernetes pod")
    } else if !evidence.is_empty() {
        Some("a container")
    } else {
        None
    };
    (what, evidence)
}

/// The pod findings: `pod.container`, and in a container `pod.fabric` and
/// `pod.nccl_names`.
/// `ip_link` runs `ip -d link show` (or answers as a capture did); it is
/// asked only inside a container, so a bare-metal run spawns nothing.
pub fn check(
    root: &SysRoot,
    rdma: &Result<Vec<RdmaDevice>, String>,
    ip_link: impl FnOnce() -> Result<String, String>,
    vars: &[(String, String)],
) -> Vec<Finding> {
    let (what, evidence) = container(root);
    let Some(what) = what else {
        return vec![Finding::new("pod.container", Status::Ok, "not in a container: the node's own NICs are used as they are")];
    };
    let mut out = vec![evidence.into_iter().fold(Finding::new("pod.container", Status::Ok, format!("running in {what}")), Finding::evidence)];
    let ifaces = interfaces(root, &ip_link());
    let devices: Vec<&RdmaDevice> = rdma.as_ref().map(|v| v.iter().collect()).unwrap_or_default();
    let listed = |f: Finding| ifaces.iter().fold(f, |f, i| f.evidence(format!("{}: {}: {}", i.name, i.class, i.why)));
    let of = |c: fn(&Class) -> bool| ifaces.iter().filter(|i| c(&i.class)).map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ");
    // A VF whose RDMA port is not active carries nothing.
    let port_active = |dev: &Option<String>| {
        devices.iter().find(|d| Some(&d.name) == dev.as_ref()).is_none_or(|d| d.ports.first().is_none_or(|p| p.state == gpudirect::PortState::Active))
    };
    let vfs = ifaces.iter().filter(|i| matches!(i.class, Class::Vf(_)) && port_active(&i.rdma)).map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ");
    let vfs_down = ifaces.iter().filter(|i| matches!(i.class, Class::Vf(_)) && !port_active(&i.rdma)).map(|i| format!("{} ({})", i.name, i.rdma.as_deref().unwrap_or("?"))).collect::<Vec<_>>();
    let shared = of(|c| *c == Class::SharedFabric);
    let fabric = of(|c| *c == Class::Fabric);
    let plain = of(|c| *c == Class::PlainNic);
    // Devices the kernel lists that this process could not open (no
    // uverbs node, no user-space provider): their ports are unknown.
    let unopened: Vec<&str> = devices.iter().filter(|d| d.ports.is_empty()).map(|d| d.name.as_str()).collect();
    let link_layer = |d: &RdmaDevice| match d.ports.first() {
        Some(p) => Some(p.link_layer != gpudirect::LinkLayer::Ethernet),
        None => root.read(&format!("/sys/class/infiniband/{}/ports/1/link_layer", d.name)).ok().map(|l| l.trim() == "InfiniBand"),
    };
    let ib_only = !devices.is_empty() && devices.iter().all(|d| link_layer(d) == Some(true));
    // An InfiniBand VF has no netdev to find it by: its own PCI function says.
    let ib_vfs: Vec<String> = devices
        .iter()
        .filter(|d| !ifaces.iter().any(|i| i.rdma.as_deref() == Some(d.name.as_str())))
        .filter_map(|d| {
            let link = format!("/sys/class/infiniband/{}/device/physfn", d.name);
            let pf = root.exists(&link).then(|| root.resolve(&link)).flatten()?;
            Some(format!("{} (a virtual function of {})", d.name, pf.rsplit('/').next().unwrap_or_default()))
        })
        .collect();
    let f = if !unopened.is_empty() && unopened.len() == devices.len() {
        let why = devices.first().and_then(|d| d.chosen_gid.as_ref().err()).cloned().unwrap_or_default();
        Finding::new(
            "pod.fabric",
            Status::Fail,
            format!("RDMA device(s) {} are in this pod's sysfs but cannot be opened ({why}): NCCL finds no usable device and uses TCP sockets", unopened.join(", ")),
        )
        .fix("pass the device nodes in (/dev/infiniband/uverbs* through the RDMA device plugin, or --device), and install the NIC's user-space provider (rdma-core's libmlx5, libbnxt_re, libefa ...) in the image")
    } else if !fabric.is_empty() {
        Finding::new("pod.fabric", Status::Ok, format!("host networking: the pod has the node's NICs ({fabric}): full rate, and no isolation between pods"))
    } else if !vfs.is_empty() || !ib_vfs.is_empty() {
        let all = [vfs.clone(), ib_vfs.join(", ")].into_iter().filter(|s| !s.is_empty()).collect::<Vec<_>>().join(", ");
        Finding::new("pod.fabric", Status::Ok, format!("SR-IOV virtual function ({all}): line rate through the NIC's embedded switch, one function per pod; whether GPUDirect RDMA is used through it is the verdict's"))
    } else if !vfs_down.is_empty() {
        Finding::new("pod.fabric", Status::Fail, format!("SR-IOV virtual function(s) {} whose RDMA port is not active: nothing reaches the fabric through them, so NCCL uses TCP sockets", vfs_down.join(", ")))
            .fix("check the VF's link on the node (`ip link show` on the PF: the VF's link-state, VLAN and trust) and the switch port; `ibv_devinfo` in the pod must show PORT_ACTIVE")
    } else if !shared.is_empty() {
        Finding::new("pod.fabric", Status::Ok, format!("macvlan/ipvlan on the fabric NIC ({shared}): full rate; the NIC's RDMA device is shared with the other pods on it (RDMA shared device plugin)"))
    } else if ib_only {
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        Finding::new("pod.fabric", Status::Ok, format!("InfiniBand devices {} with no netdev in the pod: InfiniBand needs none; the overlay carries NCCL's bootstrap only", names.join(", ")))
    } else if devices.is_empty() && !plain.is_empty() {
        Finding::new(
            "pod.fabric",
            Status::Fail,
            format!("the pod's NIC(s) {plain} have no RDMA device: NCCL can only use TCP sockets through them, staged in host memory, well below the NIC's rate"),
        )
        .fix("use a NIC with RDMA (InfiniBand, RoCE: mlx5, bnxt_re, irdma; EFA on AWS) and its RDMA driver; in a VM, pass the NIC or an SR-IOV VF through instead of a virtio NIC")
    } else if devices.is_empty() && !of(|c| *c == Class::SharedNoRdma).is_empty() {
        let shared = of(|c| *c == Class::SharedNoRdma);
        Finding::new(
            "pod.fabric",
            Status::Fail,
            format!("macvlan/ipvlan {shared} on a node NIC, but no RDMA device in this pod: NCCL can only use TCP sockets over it, staged in host memory"),
        )
        .fix("give the pod the NIC's RDMA device too (the RDMA shared device plugin's resource, or /dev/infiniband passed in), or attach an SR-IOV virtual function instead")
    } else if devices.is_empty() {
        Finding::new("pod.fabric", Status::Fail, "only the pod network (overlay): no RDMA device in this pod, so NCCL uses TCP sockets through the overlay, staged in host memory")
            .fix("attach the fabric: an SR-IOV virtual function (sriov-network-device-plugin and Multus), a macvlan or ipvlan on the fabric NIC with the RDMA shared device plugin, or hostNetwork: true with /dev/infiniband passed in")
    } else {
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        Finding::new("pod.fabric", Status::Fail, format!("RoCE device(s) {} visible, but no interface of this pod carries their GIDs: RoCE needs a netdev on the fabric in the pod", names.join(", ")))
            .fix("attach a macvlan or ipvlan on the RDMA NIC's netdev (Multus), or an SR-IOV virtual function")
    };
    out.push(listed(f));
    out.extend(names_check(&ifaces, &devices, vars));
    out
}

/// Whether `NCCL_SOCKET_IFNAME` and `NCCL_IB_HCA` name what the pod has.
fn names_check(ifaces: &[Iface], devices: &[&RdmaDevice], vars: &[(String, String)]) -> Vec<Finding> {
    let get = |n: &str| env::var(vars, n);
    let mut out = Vec::new();
    if let Some(v) = get("NCCL_SOCKET_IFNAME") {
        let picked: Vec<&Iface> = ifaces.iter().filter(|i| env::list_selects(v, &i.name)).collect();
        let all: Vec<&str> = ifaces.iter().map(|i| i.name.as_str()).collect();
        let f = if picked.is_empty() {
            Finding::new("pod.nccl_socket_ifname", Status::Fail, format!("NCCL_SOCKET_IFNAME={v} names no interface of this pod ({}): NCCL cannot bootstrap", all.join(", ")))
                .fix("name the pod's interface: the overlay (eth0) for the bootstrap, or the fabric interface")
        } else {
            let names: Vec<String> = picked.iter().map(|i| format!("{} ({})", i.name, i.class)).collect();
            Finding::new("pod.nccl_socket_ifname", Status::Ok, format!("NCCL_SOCKET_IFNAME={v} picks {}: NCCL's bootstrap (and socket traffic) goes there", names.join(", ")))
        };
        out.push(f);
    }
    if let Some(v) = get("NCCL_IB_HCA") {
        let have: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        let picked: Vec<&str> = have.iter().copied().filter(|d| env::list_selects(v, d)).collect();
        let f = if picked.is_empty() {
            Finding::new("pod.nccl_ib_hca", Status::Fail, format!("NCCL_IB_HCA={v} names no RDMA device of this pod ({}): a value written for the node, not the pod", have.join(", ")))
                .fix(format!("name the pod's devices (NCCL_IB_HCA={}), or unset it", have.join(",")))
        } else {
            Finding::new("pod.nccl_ib_hca", Status::Ok, format!("NCCL_IB_HCA={v} picks {} of this pod", picked.join(", ")))
        };
        out.push(f);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpudirect::{LinkLayer, Mtu, PortAttr, PortState};
    use testkit::Tree;

    fn pod_text(name: &str) -> String {
        let t = std::fs::read_to_string(format!("{}/tests/data/pods/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap();
        t.split_once("\n---\n").unwrap().1.to_owned()
    }

    /// A pod's network namespace as sysfs shows it: each netdev a link to
    /// its device directory, a NIC function's `device` a link to its PCI
    /// function (with `physfn` for a VF and the RDMA device under it).
    struct Pod(Tree);

    impl Pod {
        fn new(tag: &str, kubernetes: bool) -> Pod {
            let t = Tree::new(tag);
            t.file("/proc/1/cgroup", if kubernetes { "0::/kubepods.slice/kubepods-besteffort.slice/cri-containerd-1f2e.scope\n" } else { "0::/\n" });
            if kubernetes {
                t.dir("/var/run/secrets/kubernetes.io/serviceaccount");
            }
            Pod(t)
        }
        fn virtual_if(&self, name: &str, ifindex: u32, iflink: u32) -> &Self {
            let dir = format!("/sys/devices/virtual/net/{name}");
            self.0.file(&format!("{dir}/ifindex"), format!("{ifindex}\n")).file(&format!("{dir}/iflink"), format!("{iflink}\n"));
            self.0.link(&format!("/sys/class/net/{name}"), &format!("../../devices/virtual/net/{name}"));
            self
        }
        fn pci_if(&self, name: &str, bdf: &str, pf: Option<&str>, rdma: &str) -> &Self {
            let dev = format!("/sys/devices/pci0000:3a/0000:3a:00.0/{bdf}");
            self.0.file(&format!("{dev}/net/{name}/ifindex"), "25\n").file(&format!("{dev}/net/{name}/iflink"), "25\n");
            self.0.link(&format!("{dev}/net/{name}/device"), "../../../{bdf}".replace("{bdf}", bdf).as_str());
            self.0.dir(&format!("{dev}/infiniband/{rdma}"));
            if let Some(pf) = pf {
                self.0.link(&format!("{dev}/physfn"), &format!("../{pf}"));
                self.0.dir(&format!("/sys/devices/pci0000:3a/0000:3a:00.0/{pf}"));
            }
            self.0.link(&format!("/sys/class/net/{name}"), &format!("../../devices/pci0000:3a/0000:3a:00.0/{bdf}/net/{name}"));
            self
        }
        /// A NIC function with no RDMA device (virtio, an X710 VF).
        fn plain_if(&self, name: &str, device: &str, pf: Option<&str>) -> &Self {
            let dev = format!("/sys/devices/pci0000:00/0000:00:05.0/{device}");
            self.0.file(&format!("{dev}/net/{name}/ifindex"), "2\n").file(&format!("{dev}/net/{name}/iflink"), "2\n");
            self.0.link(&format!("{dev}/net/{name}/device"), &format!("../../../{device}"));
            if let Some(pf) = pf {
                self.0.link(&format!("{dev}/physfn"), &format!("../{pf}"));
                self.0.dir(&format!("/sys/devices/pci0000:00/0000:00:05.0/{pf}"));
            }
            self.0.link(&format!("/sys/class/net/{name}"), &format!("../../devices/pci0000:00/0000:00:05.0/{device}/net/{name}"));
            self
        }
        fn gid(&self, dev: &str, netdev: &str) -> &Self {
            self.0.file(&format!("/sys/class/infiniband/{dev}/ports/1/gid_attrs/ndevs/3"), format!("{netdev}\n"));
            self
        }
        fn root(&self) -> SysRoot {
            SysRoot::at(self.0.path())
        }
    }

    fn roce(name: &str) -> RdmaDevice {
        RdmaDevice {
            name: name.into(),
            fw_ver: "28.39.1002".into(),
            ports: vec![PortAttr {
                port: 1,
                state: PortState::Active,
                max_mtu: Some(Mtu::Mtu4096),
                active_mtu: Some(Mtu::Mtu4096),
                lid: 0,
                link_layer: LinkLayer::Ethernet,
                gid_table_len: 256,
            }],
            gids: vec![],
            chosen_gid: Err("not asked".into()),
            dma_buf: Err("not asked".into()),
        }
    }

    fn find<'a>(f: &'a [Finding], check: &str) -> &'a Finding {
        f.iter().find(|x| x.check == check).unwrap_or_else(|| panic!("no {check} in {f:#?}"))
    }

    fn vars(v: &[(&str, &str)]) -> Vec<(String, String)> {
        v.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn ip_output_names_interfaces_and_their_kinds() {
        let k = parse_ip_link(&pod_text("sriov588-pod-ip-addr.txt"));
        assert_eq!(k.keys().collect::<Vec<_>>(), ["eth0", "lo", "net1"]);
        assert!(k.values().all(Option::is_none), "`ip addr` prints no kinds");
        let k = parse_ip_link(&pod_text("calico94-pod-ip-addr.txt"));
        assert!(k.contains_key("tunl0") && k.contains_key("eth0"));
        // `ip -d link`'s layout: the kind opens the line after link/ether.
        let d = "3: net1@if2: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 qdisc noqueue state UP mode DEFAULT group default\n    link/ether 8a:1f:45:26:b5:22 brd ff:ff:ff:ff:ff:ff link-netnsid 0 promiscuity 0 minmtu 68 maxmtu 16110\n    macvlan mode bridge bcqueuelen 1000 numtxqueues 1\n2: eth0@if9: <BROADCAST> mtu 1450\n    link/ether 66:59:21:19:8f:ae brd ff:ff:ff:ff:ff:ff\n    veth numtxqueues 1 numrxqueues 1\n";
        let k = parse_ip_link(d);
        assert_eq!((k["net1"].as_deref(), k["eth0"].as_deref()), (Some("macvlan"), Some("veth")));
    }

    /// The pod of sriov-network-device-plugin#588 as it would look with no
    /// VF attached: the overlay alone, no RDMA device. NCCL can only use
    /// sockets; the fix names the three ways in.
    #[test]
    fn an_overlay_only_pod_fails_with_the_three_ways_in() {
        let p = Pod::new("pod-overlay", true);
        p.virtual_if("eth0", 1757, 1758);
        let f = check(&p.root(), &Err("no RDMA device".into()), || Ok(pod_text("sriov588-pod-ip-addr.txt")), &[]);
        assert_eq!(find(&f, "pod.container").summary, "running in a Kubernetes pod");
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail, "{fabric:?}");
        assert!(fabric.summary.starts_with("only the pod network (overlay)"), "{}", fabric.summary);
        let fix = fabric.fix.as_deref().unwrap();
        assert!(fix.contains("SR-IOV") && fix.contains("macvlan") && fix.contains("hostNetwork"), "{fix}");
    }

    /// sriov-network-device-plugin#588's pod: net1 is a VF with its RDMA
    /// device; NCCL variables written for the node name devices and
    /// interfaces the pod does not have.
    #[test]
    fn an_sriov_vf_pod_and_variables_written_for_the_node() {
        let p = Pod::new("pod-vf", true);
        p.virtual_if("eth0", 1757, 1758).pci_if("net1", "0000:3b:02.1", Some("0000:3b:00.0"), "mlx5_3");
        let ip = Ok(pod_text("sriov588-pod-ip-addr.txt"));
        let f = check(&p.root(), &Ok(vec![roce("mlx5_3")]), || ip.clone(), &vars(&[("NCCL_IB_HCA", "mlx5_0"), ("NCCL_SOCKET_IFNAME", "ib0")]));
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Ok);
        assert!(fabric.summary.starts_with("SR-IOV virtual function (net1)"), "{}", fabric.summary);
        // The way into the fabric is not a verdict on GPUDirect RDMA.
        assert!(fabric.summary.ends_with("whether GPUDirect RDMA is used through it is the verdict's"), "{}", fabric.summary);
        assert!(fabric.evidence.iter().any(|e| e == "net1: an SR-IOV VF of 0000:3b:00.0: PCI function 0000:3b:02.1, a virtual function of 0000:3b:00.0"), "{:?}", fabric.evidence);
        let hca = find(&f, "pod.nccl_ib_hca");
        assert_eq!(hca.status, Status::Fail);
        assert!(hca.summary.contains("names no RDMA device of this pod (mlx5_3)") && hca.fix.as_deref() == Some("name the pod's devices (NCCL_IB_HCA=mlx5_3), or unset it"), "{hca:?}");
        assert_eq!(find(&f, "pod.nccl_socket_ifname").status, Status::Fail);
        let f = check(&p.root(), &Ok(vec![roce("mlx5_3")]), || ip.clone(), &vars(&[("NCCL_IB_HCA", "mlx5_3:1"), ("NCCL_SOCKET_IFNAME", "eth0")]));
        assert_eq!((find(&f, "pod.nccl_ib_hca").status, find(&f, "pod.nccl_socket_ifname").status), (Status::Ok, Status::Ok));
        assert!(find(&f, "pod.nccl_socket_ifname").summary.contains("picks eth0 (the overlay)"));
    }

    /// The RDMA shared device plugin's setup (k8s-rdma-shared-dev-plugin#297):
    /// a macvlan on the NIC's netdev, whose RoCE GID names it.
    #[test]
    fn a_macvlan_on_the_fabric_nic_is_found_by_its_gid() {
        let p = Pod::new("pod-macvlan", true);
        p.virtual_if("eth0", 2, 9).virtual_if("net1", 3, 2).gid("mlx5_0", "net1");
        let f = check(&p.root(), &Ok(vec![roce("mlx5_0")]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Ok);
        assert!(fabric.summary.starts_with("macvlan/ipvlan on the fabric NIC (net1)"), "{}", fabric.summary);
        // The same RoCE device without the macvlan: no netdev carries its GIDs.
        let p = Pod::new("pod-roce-nogid", true);
        p.virtual_if("eth0", 2, 9);
        let f = check(&p.root(), &Ok(vec![roce("mlx5_0")]), || Err("ip not installed".into()), &[]);
        assert_eq!(find(&f, "pod.fabric").status, Status::Fail);
    }

    #[test]
    fn host_networking_and_no_container() {
        let p = Pod::new("pod-host", false);
        p.0.file("/.dockerenv", "");
        p.pci_if("ens1f0np0", "0000:3b:00.0", None, "mlx5_0").virtual_if("docker0", 4, 4);
        let f = check(&p.root(), &Ok(vec![roce("mlx5_0")]), || Err("not asked".into()), &[]);
        assert_eq!(find(&f, "pod.container").summary, "running in a container");
        assert!(find(&f, "pod.fabric").summary.starts_with("host networking: the pod has the node's NICs (ens1f0np0)"));
        let bare = Tree::new("pod-bare");
        bare.file("/proc/1/cgroup", "0::/init.scope\n");
        let f = check(&SysRoot::at(bare.path()), &Ok(vec![roce("mlx5_0")]), || panic!("ip -d link asked outside a container"), &[]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].summary, "not in a container: the node's own NICs are used as they are");
    }

    /// The H200 VM's container: a virtio NIC and no RDMA device is not
    /// "host networking at full rate"; an X710 VF without RDMA is not "as on
    /// the node".
    #[test]
    fn a_nic_without_rdma_is_never_full_rate() {
        let p = Pod::new("pod-virtio", false);
        p.0.file("/.dockerenv", "");
        p.plain_if("eth0", "virtio2", None);
        let f = check(&p.root(), &Ok(vec![]), || Err("not asked".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail, "{fabric:#?}");
        assert!(fabric.summary.starts_with("the pod's NIC(s) eth0 have no RDMA device"), "{}", fabric.summary);
        assert!(fabric.evidence.iter().any(|e| e == "eth0: a NIC without RDMA: device virtio2, no RDMA device"), "{:?}", fabric.evidence);
        let p = Pod::new("pod-x710", true);
        p.virtual_if("eth0", 3, 60).plain_if("net1", "0000:00:05.2", Some("0000:00:05.0"));
        let f = check(&p.root(), &Ok(vec![]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail, "{fabric:#?}");
        assert!(fabric.summary.contains("net1 have no RDMA device"), "{}", fabric.summary);
    }

    /// A VF whose RDMA port is down carries nothing; an InfiniBand VF with
    /// no netdev is found by its own `physfn`; devices the pod cannot open
    /// are named as such, not as RoCE without GIDs.
    #[test]
    fn vfs_by_their_port_and_their_own_function_and_devices_that_cannot_open() {
        let p = Pod::new("pod-vf-down", true);
        p.virtual_if("eth0", 1757, 1758).pci_if("net1", "0000:3b:02.1", Some("0000:3b:00.0"), "mlx5_3");
        let mut down = roce("mlx5_3");
        down.ports[0].state = PortState::Down;
        let f = check(&p.root(), &Ok(vec![down]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail, "{fabric:#?}");
        assert!(fabric.summary.contains("net1 (mlx5_3) whose RDMA port is not active"), "{}", fabric.summary);

        let p = Pod::new("pod-ib-vf", true);
        p.virtual_if("eth0", 2, 9);
        p.0.dir("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0");
        p.0.link("/sys/devices/pci0000:3a/0000:3a:00.0/0000:3b:00.4/physfn", "../0000:3b:00.0");
        p.0.link("/sys/class/infiniband/mlx5_4/device", "../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.4");
        let mut ib = roce("mlx5_4");
        ib.ports[0].link_layer = LinkLayer::InfiniBand;
        let f = check(&p.root(), &Ok(vec![ib]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Ok, "{fabric:#?}");
        assert!(fabric.summary.starts_with("SR-IOV virtual function (mlx5_4 (a virtual function of 0000:3b:00.0))"), "{}", fabric.summary);

        let p = Pod::new("pod-ib-closed", true);
        p.virtual_if("eth0", 2, 9);
        p.0.file("/sys/class/infiniband/mlx5_0/ports/1/link_layer", "InfiniBand\n").file("/sys/class/infiniband/mlx5_1/ports/1/link_layer", "InfiniBand\n");
        let closed = |n: &str| RdmaDevice { ports: vec![], chosen_gid: Err("ibv_open_device: No such file or directory".into()), ..roce(n) };
        let f = check(&p.root(), &Ok(vec![closed("mlx5_0"), closed("mlx5_1")]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail, "{fabric:#?}");
        assert!(fabric.summary.starts_with("RDMA device(s) mlx5_0, mlx5_1 are in this pod's sysfs but cannot be opened (ibv_open_device"), "{}", fabric.summary);
        assert!(!fabric.summary.contains("GIDs"));
    }

    /// Without `ip`, a macvlan is told from a veth by the kernel's DEVTYPE:
    /// with no RDMA device behind it, the pod is not "overlay only" but a
    /// macvlan that lacks its RDMA device.
    #[test]
    fn a_macvlan_without_ip_or_rdma_is_named_as_such() {
        let p = Pod::new("pod-macvlan-nordma", true);
        p.virtual_if("eth0", 2, 9).virtual_if("net1", 3, 2);
        p.0.file("/sys/devices/virtual/net/net1/uevent", "DEVTYPE=macvlan\nINTERFACE=net1\nIFINDEX=3\n");
        let ifs = interfaces(&p.root(), &Err("ip not installed".into()));
        let class = |n: &str| ifs.iter().find(|i| i.name == n).unwrap().class.clone();
        assert_eq!((class("eth0"), class("net1")), (Class::Overlay, Class::SharedNoRdma));
        let f = check(&p.root(), &Ok(vec![]), || Err("ip not installed".into()), &[]);
        let fabric = find(&f, "pod.fabric");
        assert_eq!(fabric.status, Status::Fail);
        assert!(fabric.summary.starts_with("macvlan/ipvlan net1 on a node NIC, but no RDMA device in this pod"), "{}", fabric.summary);
        assert!(fabric.fix.as_deref().unwrap().contains("RDMA shared device plugin"));
    }

    /// sriov-network-device-plugin#94's Calico pod: the veth and the IP-in-IP
    /// tunnel are the overlay, net1 the VF.
    #[test]
    fn calico_tunnels_are_the_overlay() {
        let p = Pod::new("pod-calico", true);
        p.virtual_if("eth0", 3, 60).virtual_if("tunl0", 4, 0).pci_if("net1", "0000:3b:02.3", Some("0000:3b:00.0"), "mlx5_5");
        let ifs = interfaces(&p.root(), &Ok(pod_text("calico94-pod-ip-addr.txt")));
        let class = |n: &str| ifs.iter().find(|i| i.name == n).unwrap().class.clone();
        assert_eq!((class("eth0"), class("tunl0"), class("net1")), (Class::Overlay, Class::Overlay, Class::Vf("0000:3b:00.0".into())));
    }
}
