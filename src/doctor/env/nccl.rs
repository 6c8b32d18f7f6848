//! The `NCCL_*` variables, each read as NCCL reads it ([`gpudirect::nccl`]).

use std::collections::BTreeMap;

use gpudirect::nccl::{self, ib_disabled, is_tcp_network, param_int, Int, PathType};

use super::{with_int_note, Kind, Verdict};
use crate::doctor::Status;

pub(super) fn gdr_level(value: &str) -> Verdict {
    let Some((level, how)) = nccl::gdr_level(value) else {
        return Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL ignores this value (it must be an exact upper-case path name or start with a digit), so the \
             default PXB applies and the setting does nothing",
        )
        .fix("Use one of LOC, PIX, PXB, PHB, SYS (upper case), or unset it.");
    };
    let v = match level {
        PathType::Loc | PathType::Nvl | PathType::Nvb | PathType::C2c => Verdict::new(
            Kind::Overrides,
            Status::Fail,
            format!(
                "limit {level}: every PCIe path is longer than that, so GPUDirect RDMA is off for every NIC and all \
                 network traffic is staged through host memory"
            ),
        )
        .fix("Unset NCCL_NET_GDR_LEVEL (NCCL's default PXB allows GDR for GPUs and NICs under common PCIe switches)."),
        PathType::Pix => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit PIX: only a NIC under the GPU's own PCIe switch gets GPUDirect RDMA; pairs NCCL would allow by \
             default (PXB, several switch levels) lose it",
        )
        .fix("Unset NCCL_NET_GDR_LEVEL unless PXB paths were measured to be slower here."),
        PathType::Pxb | PathType::P2c | PathType::Pxn => Verdict::new(
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
        PathType::Phb => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit PHB: GPUDirect RDMA also through the CPU's root complex (GPU and NIC on one NUMA node); whether \
             that beats host staging depends on the CPU",
        )
        .fix("Keep it only if ib_write_bw --use_cuda on such a pair was measured faster than without; else unset it."),
        PathType::Sys => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit SYS: GPUDirect RDMA even across the inter-socket link, which is usually slower than staging \
             through host memory",
        )
        .fix("Unset it, and use a NIC on each GPU's own socket (NCCL_IB_HCA), unless it was measured faster."),
    };
    v.note(how)
}

pub(super) fn gdr_read(value: &str) -> Verdict {
    let read = param_int(value);
    let v = match read.used() {
        Some(0) => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "GPUDirect RDMA off for sends: data to send is first copied to host memory (receives still land in GPU \
             memory directly)",
        )
        .fix(
            "Unset it: NCCL reads GPU memory directly for sends on Ampere and newer GPUs, and on older ones when \
             NVLink connects them.",
        ),
        Some(n) if n > 0 => Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "GPUDirect RDMA for sends too, also on pre-Ampere GPUs without NVLink where NCCL leaves it off by default \
             (reading GPU memory over PCIe can be slower there)",
        ),
        _ => Verdict::new(Kind::Overrides, Status::Ok, "NCCL's default: GDR for sends on Ampere+ or NVLink systems"),
    };
    with_int_note(v, value, read)
}

pub(super) fn dmabuf(value: &str) -> Verdict {
    let read = param_int(value);
    let v = match read.used() {
        Some(0) => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL won't register GPU memory through dma-buf; GPUDirect RDMA then needs the nvidia-peermem module, \
             and without it NCCL logs \"GPU Direct RDMA Disabled\" and stages through host memory",
        )
        .fix(
            "Unset it (NCCL 2.13+ uses dma-buf when the kernel is 5.12+, CUDA 11.7+ and NVIDIA's open kernel module \
             allow it), or make sure nvidia_peermem is loaded.",
        ),
        _ => Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "NCCL's default: register GPU memory through dma-buf where the kernel, driver and NIC support it",
        ),
    };
    with_int_note(v, value, read)
}

pub(super) fn ib_disable(value: &str) -> Verdict {
    let read = param_int(value);
    let v = match read.used() {
        _ if ib_disabled(value) => Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "turns off NCCL's InfiniBand/RoCE transport: inter-node traffic goes over TCP sockets (NET/Socket), with \
             no GPUDirect RDMA at all",
        )
        .fix("Unset NCCL_IB_DISABLE (or set 0)."),
        _ if read == Int::NotANumber => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "the IB/RoCE transport stays on, whatever the value seems to say: NCCL reads it as 0",
        )
        .fix(format!("Write 0 or 1: {value:?} reads as 0. Remove it if IB should stay on.")),
        _ => Verdict::new(Kind::Overrides, Status::Ok, "the IB/RoCE transport stays on (NCCL's default)"),
    };
    with_int_note(v, value, read)
}

/// Splits NCCL's interface/HCA list syntax: `^` excludes, `=` matches
/// exactly, otherwise names are prefixes; entries are `name[:port]`.
fn nccl_list(value: &str) -> (bool, bool, Vec<(String, Option<String>)>) {
    let mut v = value;
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
            let mut parts = e.split(':');
            let name = parts.next().filter(|n| !n.is_empty())?;
            let port = parts.next().filter(|p| !p.is_empty()).map(str::to_owned);
            Some((name.to_owned(), port))
        })
        .collect();
    (exclude, exact, entries)
}

/// Whether an `NCCL_IB_HCA` value lets NCCL use the device `nic` (its
/// port 1, or any port when the entry names none).
pub(super) fn hca_selects(value: &str, nic: &str) -> bool {
    let (exclude, exact, entries) = nccl_list(value);
    if entries.is_empty() {
        // An empty exclusion list matches every HCA; an empty list is no filter.
        return !exclude;
    }
    let listed = entries.iter().any(|(n, port)| {
        let named = if exact { n == nic } else { nic.starts_with(n.as_str()) };
        named && port.as_deref().is_none_or(|p| p == "1")
    });
    listed != exclude
}

pub(super) fn ib_hca(value: &str) -> Verdict {
    let (exclude, exact, entries) = nccl_list(value);
    let listed: Vec<String> = entries
        .iter()
        .map(|(n, p)| match p {
            Some(p) => format!("{n} port {p}"),
            None => format!("{n} (all ports)"),
        })
        .collect();
    if entries.is_empty() {
        return Verdict::new(
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
    let mut v = Verdict::new(Kind::Configures, Status::Ok, meaning).note(
        "if no HCA matches, NCCL finds no IB device and silently uses sockets (NET/Socket), with no GPUDirect RDMA: \
         check the names against `ibv_devices`, and the NCCL log for NET/IB lines",
    );
    if !exact {
        let ambiguous: Vec<&str> = entries
            .iter()
            .filter(|(n, _)| n.ends_with(|c: char| c.is_ascii_digit()))
            .map(|(n, _)| n.as_str())
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

pub(super) fn socket_ifname(value: &str) -> Verdict {
    let (exclude, exact, entries) = nccl_list(value);
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let how = match (exclude, exact) {
        (false, false) => "interfaces whose names start with",
        (false, true) => "exactly the interfaces",
        (true, false) => "every interface except those starting with",
        (true, true) => "every interface except exactly",
    };
    Verdict::new(
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

pub(super) fn p2p_disable(value: &str) -> Verdict {
    // ncclGetLevel: strtol, and only exactly 1 disables.
    let read = param_int(value);
    let v = if read.used() == Some(1) {
        Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "turns off GPU-to-GPU peer-to-peer inside the node (NVLink and PCIe): intra-node traffic goes through \
             host shared memory and PXN (reaching another GPU's NIC over NVLink) is off; GPU<->NIC GPUDirect RDMA \
             itself is not affected",
        )
        .fix("Unset it unless it works around a known P2P fault on this machine.")
    } else if read == Int::NotANumber {
        Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "only the value 1 disables P2P, and NCCL reads this as 0: P2P stays on, whatever the value seems to say",
        )
        .fix(format!("Write 0 or 1: {value:?} reads as 0. Remove it if P2P should stay on."))
    } else {
        Verdict::new(Kind::Overrides, Status::Ok, "only the value 1 disables P2P; this leaves it on")
    };
    with_int_note(v, value, read)
}

pub(super) fn gid_index(value: &str) -> Verdict {
    let read = param_int(value);
    let v = match read.used() {
        Some(n) if n < 0 => Verdict::new(
            Kind::Configures,
            Status::Ok,
            "automatic GID selection (NCCL's default since 2.21: a RoCE v2 GID of the preferred address family)",
        ),
        Some(n) => Verdict::new(
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
        None => Verdict::new(Kind::Configures, Status::Ok, "NCCL's default: automatic GID selection"),
    };
    with_int_note(v, value, read)
}

pub(super) fn net(value: &str) -> Verdict {
    if is_tcp_network(value) {
        Verdict::new(Kind::Overrides, Status::Fail, "forces a TCP socket transport (NCCL's Socket, or a socket plugin such as FastSocket): no RDMA, so no GPUDirect RDMA")
            .fix("Unset NCCL_NET (or set NCCL_NET=IB).")
    } else if value.eq_ignore_ascii_case("ib") {
        Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "forces NCCL's built-in InfiniBand/RoCE transport (network plugins are skipped); initialization fails \
             if it finds no usable HCA",
        )
    } else {
        Verdict::new(
            Kind::Overrides,
            Status::Ok,
            format!(
                "selects the network named {value:?} (a plugin such as \"AWS Libfabric\" or \"IBext\"); GDR then \
                 depends on that plugin, and NCCL fails to initialize if no network of that name loads"
            ),
        )
    }
}

pub(super) fn net_plugin(value: &str) -> Verdict {
    if value.eq_ignore_ascii_case("none") {
        Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "no external network plugin: NCCL uses its built-in IB/RoCE or socket transport",
        )
    } else {
        Verdict::new(
            Kind::Configures,
            Status::Ok,
            format!(
                "NCCL loads the network plugin libnccl-net-{value}.so (or the file named); whether GPU memory is \
                 registered for RDMA is then the plugin's decision"
            ),
        )
        .note("if the library isn't found NCCL falls back to its built-in transports: look for NET/Plugin lines")
    }
}

pub(super) fn ib_cuda_support(value: &str) -> Verdict {
    let intent = match param_int(value).used() {
        Some(0) => "meant to disable GPUDirect RDMA",
        Some(_) => "meant to force GPUDirect RDMA",
        None => "meant to leave the default",
    };
    Verdict::new(
        Kind::Overrides,
        Status::Warn,
        format!(
            "obsolete: NCCL removed it in 2.4 (replaced by NCCL_NET_GDR_LEVEL), so this setting ({intent}) does \
             nothing now"
        ),
    )
    .fix("Remove it. To force GDR use NCCL_NET_GDR_LEVEL=SYS; to disable it, NCCL_NET_GDR_LEVEL=LOC.")
}

pub(super) fn gdr_c2c(value: &str) -> Verdict {
    let read = param_int(value);
    let v = match read.used() {
        Some(0) => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "on Grace (C2C) systems, NICs attached to the CPU no longer get GPUDirect RDMA (NCCL's default limit \
             drops from P2C to PXB); no effect on PCIe-only machines",
        )
        .fix("Unset it unless GDR through the Grace CPU was measured slower."),
        _ => Verdict::new(Kind::Overrides, Status::Ok, "NCCL's default (2.26+): GDR through the CPU on C2C systems"),
    };
    with_int_note(v, value, read)
}

pub(super) fn debug(value: &str, all: &BTreeMap<&str, &str>) -> Verdict {
    let level = value.trim().to_ascii_uppercase();
    let subsys_has_net = all.get("NCCL_DEBUG_SUBSYS").is_some_and(|s| subsys_shows_net(s));
    match level.as_str() {
        "INFO" | "TRACE" => {
            let v = Verdict::new(
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
        "WARN" | "VERSION" | "ABORT" => Verdict::new(
            Kind::Diagnoses,
            Status::Ok,
            "only warnings (or the version) are printed: the GDR decision is not; NCCL_DEBUG=INFO shows it",
        ),
        _ => Verdict::new(
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

pub(super) fn debug_subsys(value: &str) -> Verdict {
    if subsys_shows_net(value) {
        Verdict::new(
            Kind::Diagnoses,
            Status::Ok,
            "NET lines are logged (with NCCL_DEBUG=INFO): \"NET/IB : GPU Direct RDMA Enabled/Disabled for HCA\" \
             says per NIC whether GDR is possible",
        )
    } else {
        Verdict::new(
            Kind::Diagnoses,
            Status::Ok,
            "NET lines are filtered out, so the per-HCA GPU Direct RDMA line won't show; channel lines (INIT) still \
             carry the /GDRDMA suffix",
        )
        .note("NCCL_DEBUG_SUBSYS=INIT,NET shows both")
    }
}
