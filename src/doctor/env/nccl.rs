//! The `NCCL_*` variables, each read as NCCL reads it ([`gpudirect::nccl`]).

use std::collections::BTreeMap;

use gpudirect::nccl::{self, ib_disabled, is_tcp_network, param_int, Int, NicList, NicListEntry, PathType};

use super::{plugin_names, with_int_note, Judged, Kind, Site};
use crate::doctor::Status;

pub(super) fn gdr_level(value: &str) -> Judged {
    let Some((level, how)) = nccl::gdr_level(value) else {
        return Judged::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL ignores this value (it must be an exact upper-case path name or start with a digit), so the \
             default PXB applies and the setting does nothing",
        )
        .fix("Use one of LOC, PIX, PXB, PHB, SYS (upper case), or unset it.");
    };
    let v = match level {
        PathType::Loc | PathType::Nvl | PathType::Nvb | PathType::C2c => Judged::new(
            Kind::Overrides,
            Status::Fail,
            format!(
                "limit {level}: every PCIe path is longer than that, so GPUDirect RDMA is off for every NIC and all \
                 network traffic is staged through host memory"
            ),
        )
        .fix("Unset NCCL_NET_GDR_LEVEL (NCCL's default PXB allows GDR for GPUs and NICs under common PCIe switches)."),
        PathType::Pix => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "limit PIX: only a NIC under the GPU's own PCIe switch gets GPUDirect RDMA; pairs NCCL would allow by \
             default (PXB, several switch levels) lose it",
        )
        .fix("Unset NCCL_NET_GDR_LEVEL unless PXB paths were measured to be slower here."),
        PathType::Pxb | PathType::P2c | PathType::Pxn => Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!(
                "limit {level}: on a PCIe-only machine the same as NCCL's default (PXB): GPUs and NICs under common \
                 switches get GPUDirect RDMA"
            ),
        )
        .note(
            "on Grace (C2C) systems NCCL's own default is P2C, which also allows NICs attached to the CPU; PXB there \
             turns that off",
        ),
        PathType::Phb => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "limit PHB: GPUDirect RDMA also through the CPU's root complex (GPU and NIC on one NUMA node); whether \
             that beats host staging depends on the CPU",
        )
        .fix("Keep it only if ib_write_bw --use_cuda on such a pair was measured faster than without; else unset it."),
        PathType::Sys => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "limit SYS: GPUDirect RDMA even across the inter-socket link, which is usually slower than staging \
             through host memory",
        )
        .fix("Unset it, and use a NIC on each GPU's own socket (NCCL_IB_HCA), unless it was measured faster."),
    };
    v.note(how)
}

pub(super) fn gdr_read(value: &str) -> Judged {
    let read = param_int(value);
    let v = match read.used() {
        // A stop in the rule table (the verdict says so too): sends staged
        // is no GPUDirect RDMA for half the traffic.
        Some(0) => Judged::new(
            Kind::Overrides,
            Status::Fail,
            "GPUDirect RDMA off for sends: NCCL sends from host memory (receives still land in GPU memory directly)",
        )
        .fix("unset NCCL_NET_GDR_READ (or set it to 1): NCCL reads GPU memory directly for sends on Ampere and newer GPUs, and on older ones when NVLink connects them."),
        Some(n) if n > 0 => Judged::new(
            Kind::Overrides,
            Status::Ok,
            "GPUDirect RDMA for sends too, also on pre-Ampere GPUs without NVLink where NCCL leaves it off by default \
             (reading GPU memory over PCIe can be slower there)",
        ),
        _ => Judged::new(Kind::Overrides, Status::Ok, "NCCL's default: GDR for sends on Ampere+ or NVLink systems"),
    };
    with_int_note(v, value, read)
}

pub(super) fn dmabuf(value: &str, site: &Site) -> Judged {
    let read = param_int(value);
    let v = match read.used() {
        Some(0) if site.dma_buf_only => Judged::new(
            Kind::Overrides,
            Status::Fail,
            "NCCL won't register GPU memory through dma-buf, and dma-buf is the only registration path here \
             (no peer-memory module is loaded): NCCL logs \"GPU Direct RDMA Disabled\" and stages through host memory",
        )
        .fix("Unset NCCL_DMABUF_ENABLE (or set 1)."),
        Some(0) => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL won't register GPU memory through dma-buf; GPUDirect RDMA then needs the nvidia-peermem module, \
             and without it NCCL logs \"GPU Direct RDMA Disabled\" and stages through host memory",
        )
        .fix(
            "Unset it (NCCL 2.13+ uses dma-buf when the kernel is 5.12+, CUDA 11.7+ and NVIDIA's open kernel module \
             allow it), or make sure nvidia_peermem is loaded.",
        ),
        _ => Judged::new(
            Kind::Overrides,
            Status::Ok,
            "NCCL's default: register GPU memory through dma-buf where the kernel, driver and NIC support it",
        ),
    };
    with_int_note(v, value, read)
}

pub(super) fn ib_disable(value: &str) -> Judged {
    let read = param_int(value);
    let v = match read.used() {
        _ if ib_disabled(value) => Judged::new(
            Kind::Overrides,
            Status::Fail,
            "turns off NCCL's InfiniBand/RoCE transport: inter-node traffic goes over TCP sockets (NET/Socket), with \
             no GPUDirect RDMA at all",
        )
        .fix("Unset NCCL_IB_DISABLE (or set 0)."),
        _ if read == Int::NotANumber => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "the IB/RoCE transport stays on, whatever the value seems to say: NCCL reads it as 0",
        )
        .fix(format!("Write 0 or 1: {value:?} reads as 0. Remove it if IB should stay on.")),
        _ => Judged::new(Kind::Overrides, Status::Ok, "the IB/RoCE transport stays on (NCCL's default)"),
    };
    with_int_note(v, value, read)
}

/// NCCL's list syntax, read by the library's one reader
/// ([`NicList`](gpudirect::nccl::NicList)), as `(exclude, exact, entries)`.
fn nccl_list(value: &str) -> (bool, bool, Vec<NicListEntry>) {
    let l = NicList::parse(value);
    (l.exclude, l.exact, l.entries)
}

/// Whether a list entry selects `nic`'s port 1 (any port when it names none).
fn entry_selects(exact: bool, entry: &NicListEntry, nic: &str) -> bool {
    entry.selects(exact, nic, 1)
}

/// Whether an `NCCL_IB_HCA` value lets NCCL use the device `nic` (its
/// port 1, or any port when the entry names none).
pub(super) fn hca_selects(value: &str, nic: &str) -> bool {
    NicList::parse(value).selects(nic, 1)
}

/// Whether a name looks like a network interface's, not an RDMA device's.
fn interface_like(name: &str) -> bool {
    const PREFIXES: [&str; 12] = ["eth", "ens", "enp", "eno", "enx", "hsn", "bond", "docker", "veth", "virbr", "lo", "wlan"];
    PREFIXES.iter().any(|p| name.starts_with(p)) || (name.starts_with("ib") && name[2..].starts_with(|c: char| c.is_ascii_digit()))
}

pub(super) fn ib_hca(value: &str, site: &Site) -> Judged {
    let v = ib_hca_list(value);
    let (exclude, exact, entries) = nccl_list(value);
    if exclude || entries.is_empty() {
        return v;
    }
    let named: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let interfaces: Vec<&str> = named.iter().copied().filter(|n| interface_like(n)).collect();
    let unmatched: Vec<&str> = match &site.rdma_devices {
        Some(devs) => entries.iter().filter(|e| !devs.iter().any(|d| entry_selects(exact, e, d))).map(|e| e.name.as_str()).collect(),
        None => Vec::new(),
    };
    if interfaces.is_empty() && unmatched.is_empty() {
        return v;
    }
    let mut why = Vec::new();
    if !interfaces.is_empty() {
        why.push(format!("{} look(s) like network interface names, and NCCL_IB_HCA takes RDMA device names (`ibv_devices`: mlx5_0, ...); interfaces go in NCCL_SOCKET_IFNAME", interfaces.join(", ")));
    }
    if let (false, Some(devs)) = (unmatched.is_empty(), &site.rdma_devices) {
        why.push(format!("{} match(es) no RDMA device here ({})", unmatched.join(", "), if devs.is_empty() { "none".to_owned() } else { devs.join(", ") }));
    }
    let all_unmatched = site.rdma_devices.is_some() && unmatched.len() == named.len();
    let status = if all_unmatched || interfaces.len() == named.len() { Status::Fail } else { Status::Warn };
    let mut j = Judged::new(
        Kind::Configures,
        status,
        format!(
            "{}: {}",
            v.meaning,
            if status == Status::Fail { "no RDMA device is selected, so NCCL finds no IB device and uses sockets, with no GPUDirect RDMA" } else { "some entries select nothing" }
        ),
    )
    .fix("List the RDMA devices (`ibv_devices`), e.g. NCCL_IB_HCA==mlx5_0:1,mlx5_1:1, or unset NCCL_IB_HCA.");
    for w in why {
        j = j.note(w);
    }
    j
}

fn ib_hca_list(value: &str) -> Judged {
    let (exclude, exact, entries) = nccl_list(value);
    let listed: Vec<String> = entries
        .iter()
        .map(|e| match &e.port {
            Some(p) => format!("{} port {p}", e.name),
            None => format!("{} (all ports)", e.name),
        })
        .collect();
    if entries.is_empty() {
        return Judged::new(
            Kind::Configures,
            Status::Warn,
            if exclude {
                "excludes every HCA (an empty exclusion list matches all): NCCL finds no IB device and falls back \
                 to sockets, with no GPUDirect RDMA"
            } else {
                "an empty list, which NCCL treats as no filter"
            },
        )
        .fix("Unset it or list HCAs, e.g. NCCL_IB_HCA==mlx5_0:1,mlx5_1:1.");
    }
    let how = if exact { "exactly named" } else { "whose names start with" };
    let meaning = if exclude {
        format!("NCCL uses every HCA except those {how} {}", listed.join(", "))
    } else {
        format!("NCCL uses only HCAs {how} {}", listed.join(", "))
    };
    let mut v = Judged::new(Kind::Configures, Status::Ok, meaning).note(
        "if no HCA matches, NCCL finds no IB device and silently uses sockets (NET/Socket), with no GPUDirect RDMA: \
         check the names against `ibv_devices`, and the NCCL log for NET/IB lines",
    );
    if !exact {
        let ambiguous: Vec<&str> = entries
            .iter()
            .filter(|e| e.name.ends_with(|c: char| c.is_ascii_digit()))
            .map(|e| e.name.as_str())
            .collect();
        if !ambiguous.is_empty() {
            v = v.note(format!(
                "prefix match: {} also match(es) longer names ({}0, {}1, ...); start the list with = for exact names",
                ambiguous.join(", "),
                ambiguous[0],
                ambiguous[0]
            ));
        }
    }
    v
}

pub(super) fn socket_ifname(value: &str) -> Judged {
    let (exclude, exact, entries) = nccl_list(value);
    let names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
    let how = match (exclude, exact) {
        (false, false) => "interfaces whose names start with",
        (false, true) => "exactly the interfaces",
        (true, false) => "every interface except those starting with",
        (true, true) => "every interface except exactly",
    };
    Judged::new(
        Kind::Configures,
        Status::Ok,
        format!(
            "NCCL bootstraps (and, without IB, moves data) over {how} {}; it does not choose the RDMA NICs (that is \
             NCCL_IB_HCA)",
            names.join(", ")
        ),
    )
    .note("if IB is disabled or unusable, all inter-node data goes over these interfaces as TCP, never with GDR")
}

pub(super) fn p2p_disable(value: &str) -> Judged {
    // ncclGetLevel: strtol, and only exactly 1 disables.
    let read = param_int(value);
    let v = if read.used() == Some(1) {
        Judged::new(
            Kind::Overrides,
            Status::Warn,
            "turns off GPU-to-GPU peer-to-peer inside the node (NVLink and PCIe): intra-node traffic goes through \
             host shared memory and PXN (reaching another GPU's NIC over NVLink) is off; GPU<->NIC GPUDirect RDMA \
             itself is not affected",
        )
        .fix("Unset it unless it works around a known P2P fault on this machine.")
    } else if read == Int::NotANumber {
        Judged::new(
            Kind::Overrides,
            Status::Warn,
            "only the value 1 disables P2P, and NCCL reads this as 0: P2P stays on, whatever the value seems to say",
        )
        .fix(format!("Write 0 or 1: {value:?} reads as 0. Remove it if P2P should stay on."))
    } else {
        Judged::new(Kind::Overrides, Status::Ok, "only the value 1 disables P2P; this leaves it on")
    };
    with_int_note(v, value, read)
}

pub(super) fn gid_index(value: &str) -> Judged {
    let read = param_int(value);
    let v = match read.used() {
        Some(n) if n < 0 => Judged::new(
            Kind::Configures,
            Status::Ok,
            "automatic GID selection (NCCL's default since 2.21: a RoCE v2 GID of the preferred address family)",
        ),
        Some(n) => Judged::new(
            Kind::Configures,
            Status::Ok,
            format!(
                "forces GID index {n} on RoCE ports (InfiniBand ports ignore it); a wrong index makes connections \
                 fail or use RoCE v1"
            ),
        )
        .note(format!(
            "check with `show_gids` that index {n} is a RoCE v2 GID on every node; NCCL 2.21+ finds one itself when \
             this is unset (or -1)"
        )),
        None => Judged::new(Kind::Configures, Status::Ok, "NCCL's default: automatic GID selection"),
    };
    with_int_note(v, value, read)
}

pub(super) fn net(value: &str, all: &BTreeMap<&str, &str>, site: &Site) -> Judged {
    let plugin = all.get("NCCL_NET_PLUGIN").copied();
    if let Some(libs) = site.net_libs.as_ref().filter(|_| super::rules::plugin_network(value)) {
        // The verdict's rule, worded once there.
        if let Some(stop) = super::rules::plugin_missing_for(value, plugin, site) {
            return Judged::new(Kind::Overrides, Status::Fail, stop.to_string())
                .note(format!("looked in {}", libs.dirs.join(", ")))
                .note("none of the files NCCL would load is there")
                .fix(format!("Install the plugin that provides {value:?} (its directory in LD_LIBRARY_PATH, or NCCL_NET_PLUGIN naming it), or unset NCCL_NET."));
        }
        let found: Vec<&str> = plugin_names(plugin).iter().filter_map(|n| libs.find(n)).collect();
        return Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!(
                "selects the network named {value:?}, from the plugin {}: GDR then depends on that plugin, and NCCL stops at \
                 initialization if the plugin's init fails or it finds no device",
                found.join(", ")
            ),
        );
    }
    if is_tcp_network(value) {
        Judged::new(Kind::Overrides, Status::Fail, "forces a TCP socket transport (NCCL's Socket, or a socket plugin such as FastSocket): no RDMA, so no GPUDirect RDMA")
            .fix("Unset NCCL_NET (or set NCCL_NET=IB).")
    } else if value.eq_ignore_ascii_case("ib") {
        Judged::new(
            Kind::Overrides,
            Status::Ok,
            "forces NCCL's built-in InfiniBand/RoCE transport (network plugins are skipped); initialization fails \
             if it finds no usable HCA",
        )
    } else {
        Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!(
                "selects the network named {value:?} (a plugin such as \"AWS Libfabric\" or \"IBext\"); GDR then \
                 depends on that plugin, and NCCL fails to initialize if no network of that name loads"
            ),
        )
    }
}

pub(super) fn net_plugin(value: &str, site: &Site) -> Judged {
    let names = plugin_names(Some(value));
    if names.is_empty() {
        return Judged::new(
            Kind::Overrides,
            Status::Ok,
            "no external network plugin: NCCL uses its built-in IB/RoCE or socket transport",
        );
    }
    let tried = names.join(", then ");
    if let Some(libs) = &site.net_libs {
        if let Some(found) = names.iter().find_map(|n| libs.find(n)) {
            return Judged::new(
                Kind::Configures,
                Status::Ok,
                format!("NCCL loads the network plugin {found}; whether GPU memory is registered for RDMA is then the plugin's decision"),
            );
        }
        return Judged::new(
            Kind::Configures,
            Status::Warn,
            format!(
                "NCCL tries {tried}, and none is in the library directories here: it goes on with its built-in IB/RoCE and \
                 socket transports (unless NCCL_NET names the plugin's network, when it stops)"
            ),
        )
        .note(format!("looked in {}", libs.dirs.join(", ")))
        .fix("Install the plugin, name its file (NCCL_NET_PLUGIN=/path/to/libnccl-net-NAME.so), or unset NCCL_NET_PLUGIN.");
    }
    Judged::new(
        Kind::Configures,
        Status::Ok,
        format!("NCCL tries {tried}; whether GPU memory is registered for RDMA is then the plugin's decision"),
    )
    .note("if the library isn't found NCCL falls back to its built-in transports: look for NET/Plugin lines")
}

pub(super) fn debug_file(value: &str) -> Judged {
    if value.contains("%p") {
        return Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "NCCL's log goes to this file (%h = host, %p = pid) instead of stdout: look for /GDRDMA there",
        );
    }
    Judged::new(
        Kind::Diagnoses,
        Status::Warn,
        "every process of a node writes NCCL's log to this one file (no %p): they overwrite each other's lines, and \
         the GDR decision of a rank can be lost",
    )
    .fix(format!("Add the pid: NCCL_DEBUG_FILE={}.%h.%p", value.trim_end_matches(".log")))
}

/// `NCCL_COMM_ID`: `host:port`, `[ipv6]:port`, as NCCL parses it.
pub(super) fn comm_id(value: &str) -> Judged {
    let v = value.trim();
    let (host, port) = match v.strip_prefix('[') {
        Some(rest) => match rest.split_once("]:") {
            Some((h, p)) => (h, p),
            None => ("", ""),
        },
        None => match v.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p),
            _ => ("", ""),
        },
    };
    let port_ok = port.parse::<u32>().is_ok_and(|p| (1..=65535).contains(&p));
    if host.is_empty() || !port_ok {
        return Judged::new(
            Kind::Configures,
            Status::Fail,
            "NCCL rejects this address (it takes host:port, or [IPv6]:port): every rank fails at initialization",
        )
        .fix("Write NCCL_COMM_ID=<rank 0's address>:<port>, e.g. 10.0.0.1:29600 or [fd00::1]:29600, or unset it.");
    }
    Judged::new(
        Kind::Configures,
        Status::Ok,
        format!("NCCL's bootstrap meets at {host} port {port} instead of the address the launcher hands out"),
    )
}

/// Names NCCL removed or never had: setting them does nothing.
pub(super) fn dead_name(name: &str) -> Option<Judged> {
    let (what, instead) = match name {
        "NCCL_SINGLE_RING_THRESHOLD" => ("removed in NCCL 2.3", "NCCL's tuner chooses per message size"),
        "NCCL_LL_THRESHOLD" | "NCCL_TREE_THRESHOLD" => ("removed in NCCL 2.5; its tuner chooses per size", "NCCL_PROTO and NCCL_ALGO restrict the choice where that is really wanted"),
        "NCCL_NET_GDR_DISABLE" | "NCCL_GDR_DISABLE" | "NCCL_IB_GDR_DISABLE" | "NCCL_GDR_LEVEL" => {
            ("never a variable NCCL read", "NCCL_NET_GDR_LEVEL=LOC turns GPUDirect RDMA off; unset it to keep it on")
        }
        _ => return None,
    };
    Some(
        Judged::new(Kind::Overrides, Status::Warn, format!("NCCL does not read this name ({what}): setting it changes nothing"))
            .fix(format!("Remove it; {instead}.")),
    )
}

pub(super) fn ib_cuda_support(value: &str) -> Judged {
    let intent = match param_int(value).used() {
        Some(0) => "meant to disable GPUDirect RDMA",
        Some(_) => "meant to force GPUDirect RDMA",
        None => "meant to leave the default",
    };
    Judged::new(
        Kind::Overrides,
        Status::Warn,
        format!(
            "obsolete: NCCL removed it in 2.4 (replaced by NCCL_NET_GDR_LEVEL), so this setting ({intent}) does \
             nothing now"
        ),
    )
    .fix("Remove it. To force GDR use NCCL_NET_GDR_LEVEL=SYS; to disable it, NCCL_NET_GDR_LEVEL=LOC.")
}

pub(super) fn gdr_c2c(value: &str) -> Judged {
    let read = param_int(value);
    let v = match read.used() {
        Some(0) => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "on Grace (C2C) systems, NICs attached to the CPU no longer get GPUDirect RDMA (NCCL's default limit \
             drops from P2C to PXB); no effect on PCIe-only machines",
        )
        .fix("Unset it unless GDR through the Grace CPU was measured slower."),
        _ => Judged::new(Kind::Overrides, Status::Ok, "NCCL's default (2.26+): GDR through the CPU on C2C systems"),
    };
    with_int_note(v, value, read)
}

pub(super) fn debug(value: &str, all: &BTreeMap<&str, &str>) -> Judged {
    let level = value.trim().to_ascii_uppercase();
    let subsys_has_net = all.get("NCCL_DEBUG_SUBSYS").is_some_and(|s| subsys_shows_net(s));
    match level.as_str() {
        "INFO" | "TRACE" => {
            let v = Judged::new(
                Kind::Diagnoses,
                Status::Ok,
                "NCCL logs its decisions: channel lines ending in /GDRDMA (e.g. \"via NET/IB/0/GDRDMA\") show GPUDirect \
                 RDMA in use; without the suffix it is off",
            );
            if subsys_has_net {
                v.note("NCCL_DEBUG_SUBSYS includes NET, so the per-HCA \"GPU Direct RDMA Enabled/Disabled\" line shows too")
            } else {
                v.note(
                    "the per-HCA \"GPU Direct RDMA Enabled/Disabled for HCA\" line is logged under NET, which the \
                     default NCCL_DEBUG_SUBSYS (INIT,BOOTSTRAP,ENV) hides: add NCCL_DEBUG_SUBSYS=INIT,NET",
                )
            }
        }
        "WARN" | "VERSION" | "ABORT" => Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "only warnings (or the version) are printed: the GDR decision is not; NCCL_DEBUG=INFO shows it",
        ),
        _ => Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "not a level NCCL knows (VERSION, WARN, INFO, TRACE), so NCCL prints nothing extra",
        ),
    }
}

/// Whether a `NCCL_DEBUG_SUBSYS` value lets NET lines through (`^` inverts).
pub(super) fn subsys_shows_net(value: &str) -> bool {
    let (invert, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let named = list.split(',').any(|s| {
        let s = s.trim();
        s.eq_ignore_ascii_case("NET") || s.eq_ignore_ascii_case("ALL")
    });
    named != invert
}

pub(super) fn debug_subsys(value: &str) -> Judged {
    if subsys_shows_net(value) {
        Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "NET lines are logged (with NCCL_DEBUG=INFO): \"NET/IB : GPU Direct RDMA Enabled/Disabled for HCA\" \
             says per NIC whether GDR is possible",
        )
    } else {
        Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "NET lines are filtered out, so the per-HCA GPU Direct RDMA line won't show; channel lines (INIT) still \
             carry the /GDRDMA suffix",
        )
        .note("NCCL_DEBUG_SUBSYS=INIT,NET shows both")
    }
}
