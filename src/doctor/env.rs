//! `NCCL_*` and `UCX_*` environment variables that turn GPUDirect RDMA off,
//! force it, or pick the NICs it could use.
//!
//! A stale variable in a job script is one of the commonest reasons GDR is
//! off on a machine whose hardware is fine, and nothing warns about it: NCCL
//! and UCX take the setting and quietly stage through host memory. Each set
//! variable is explained as one of three kinds, because they call for
//! different actions: *diagnoses* (only changes what is logged), *configures*
//! (tells NCCL/UCX something about this site it can't know) and *overrides*
//! (replaces a decision NCCL/UCX would make on its own, usually correctly).
//!
//! Values are read the way the libraries read them, so that the verdict
//! matches what they will do, not what the value looks like: NCCL's integer
//! parameters go through `strtoll(value, NULL, 0)`, so `NCCL_IB_DISABLE=yes`
//! is 0 (IB stays on) and `NCCL_NET_GDR_READ=off` is 0 (GDR reads off);
//! `NCCL_NET_GDR_LEVEL` follows NCCL's `ncclTopoGetLevel`. Those readings
//! are the library's ([`gpudirect::nccl`]), shared with `nccl-log`; UCX's
//! yes/no/try values follow `ucs_config_sscanf_ternary`.

use std::collections::BTreeMap;

use gpudirect::nccl::{self, ib_disabled, is_tcp_network, param_int as nccl_int, Int as NcclInt, PathType as NcclPathType};

use super::{Finding, Status};

/// What setting a variable does to the decision NCCL/UCX would make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Only changes logging.
    Diagnoses,
    /// Tells the library a site fact it can't discover.
    Configures,
    /// Replaces the library's own choice.
    Overrides,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Diagnoses => "diagnoses",
            Kind::Configures => "configures",
            Kind::Overrides => "overrides tuning that is normally right",
        }
    }
}

/// A judged variable, before it becomes a [`Finding`].
struct Verdict {
    kind: Kind,
    status: Status,
    meaning: String,
    notes: Vec<String>,
    fix: Option<String>,
}

impl Verdict {
    fn new(kind: Kind, status: Status, meaning: impl Into<String>) -> Verdict {
        Verdict { kind, status, meaning: meaning.into(), notes: Vec::new(), fix: None }
    }

    fn note(mut self, n: impl Into<String>) -> Verdict {
        self.notes.push(n.into());
        self
    }

    fn fix(mut self, f: impl Into<String>) -> Verdict {
        self.fix = Some(f.into());
        self
    }
}

/// A sentence on how a non-obvious integer value was read.
fn int_note(raw: &str, read: NcclInt) -> Option<String> {
    match read {
        NcclInt::NotANumber => Some(format!(
            "{raw:?} is not a number: NCCL reads it with strtoll, which gives 0 without complaint, so this means 0"
        )),
        NcclInt::Overflow => Some(format!("{raw:?} is out of range: NCCL ignores it and keeps its default")),
        NcclInt::Empty => Some("empty: NCCL keeps its default".to_owned()),
        NcclInt::Number(n) if raw.trim() != n.to_string() => {
            Some(format!("NCCL reads {raw:?} as {n} (strtoll: 0x is hex, a leading 0 octal, trailing text ignored)"))
        }
        NcclInt::Number(_) => None,
    }
}

fn with_int_note(v: Verdict, raw: &str, read: NcclInt) -> Verdict {
    match int_note(raw, read) {
        Some(n) => v.note(n),
        None => v,
    }
}

/// Explains every `NCCL_*` and `UCX_*` variable that matters to GPUDirect
/// RDMA; unknown ones of those families are listed as not judged. With none
/// set, one finding says the defaults apply. The last assignment of a name
/// wins, as in a process environment built from a list.
pub fn check(vars: &[(String, String)]) -> Vec<Finding> {
    let mut set: BTreeMap<&str, &str> = BTreeMap::new();
    for (k, v) in vars {
        if k.starts_with("NCCL_") || k.starts_with("UCX_") {
            set.insert(k.as_str(), v.as_str());
        }
    }
    if set.is_empty() {
        return vec![Finding::new(
            "env.defaults",
            Status::Ok,
            "no NCCL_* or UCX_* variable is set: NCCL and UCX decide on GPUDirect RDMA themselves",
        )
        .evidence(
            "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET would make NCCL print its GDR decision (\"GPU Direct RDMA \
             Enabled for HCA ...\" and channel lines ending in /GDRDMA)",
        )
        .evidence(
            "NCCL also reads NCCL_CONF_FILE or ~/.nccl.conf, then /etc/nccl.conf; this check sees only the environment",
        )];
    }
    let mut out = Vec::new();
    let mut unjudged = Vec::new();
    for (name, value) in &set {
        match judge(name, value, &set) {
            Some(v) => {
                let mut f = Finding::new(
                    format!("env.{}", name.to_ascii_lowercase()),
                    v.status,
                    format!("{name}={value} ({}): {}", v.kind.word(), v.meaning),
                )
                .evidence(format!("set in the environment: {name}={value:?}"));
                for n in v.notes {
                    f = f.evidence(n);
                }
                if let Some(fix) = v.fix {
                    f = f.fix(fix);
                }
                out.push(f);
            }
            None => unjudged.push(format!("{name}={value}")),
        }
    }
    if !unjudged.is_empty() {
        let mut f = Finding::new(
            "env.unjudged",
            Status::Skipped,
            format!(
                "not judged: {} other NCCL_*/UCX_* variable(s) that this check doesn't know to affect GPUDirect RDMA",
                unjudged.len()
            ),
        );
        for u in unjudged {
            f = f.evidence(u);
        }
        out.push(f);
    }
    out
}

fn judge(name: &str, value: &str, all: &BTreeMap<&str, &str>) -> Option<Verdict> {
    Some(match name {
        "NCCL_NET_GDR_LEVEL" => gdr_level(value),
        "NCCL_IB_GDR_LEVEL" => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "the pre-2.4 name of NCCL_NET_GDR_LEVEL; current NCCL doesn't read it, so it changes nothing",
        )
        .fix("Remove it; if the limit is really wanted, set NCCL_NET_GDR_LEVEL instead."),
        "NCCL_NET_GDR_READ" => gdr_read(value),
        "NCCL_DMABUF_ENABLE" => dmabuf(value),
        "NCCL_IB_DISABLE" => ib_disable(value),
        "NCCL_IB_HCA" => ib_hca(value),
        "NCCL_SOCKET_IFNAME" => socket_ifname(value),
        "NCCL_P2P_DISABLE" => p2p_disable(value),
        "NCCL_P2P_LEVEL" => Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "limits GPU-to-GPU peer-to-peer inside the node; it does not decide GPU<->NIC GPUDirect RDMA (that is \
             NCCL_NET_GDR_LEVEL)",
        ),
        "NCCL_IB_GID_INDEX" => gid_index(value),
        "NCCL_NET" => net(value),
        "NCCL_NET_PLUGIN" => net_plugin(value),
        "NCCL_IB_CUDA_SUPPORT" => ib_cuda_support(value),
        "NCCL_NET_GDR_C2C" => gdr_c2c(value),
        "NCCL_GDRCOPY_ENABLE" => Verdict::new(
            Kind::Configures,
            Status::Ok,
            "GDRCopy (the CPU mapping GPU memory for small copies) is not GPUDirect RDMA; it neither enables nor \
             disables the NIC's direct access to GPU memory",
        ),
        "NCCL_TOPO_FILE" => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL takes the PCIe topology from this XML file instead of sysfs, so its GPU<->NIC distances (and GDR \
             decisions) follow the file, not the topology findings of this doctor",
        )
        .fix(format!(
            "Make sure {value} describes this machine (compare with NCCL_TOPO_DUMP_FILE output), or unset it."
        )),
        "NCCL_TOPO_DUMP_FILE" => Verdict::new(
            Kind::Diagnoses,
            Status::Ok,
            "NCCL writes the topology it detected to this file: it shows the path types (PIX, PXB, PHB, SYS) NCCL \
             computed for each GPU and NIC",
        ),
        "NCCL_DEBUG" => debug(value, all),
        "NCCL_DEBUG_SUBSYS" => debug_subsys(value),
        "NCCL_DEBUG_FILE" => Verdict::new(
            Kind::Diagnoses,
            Status::Ok,
            "NCCL's log goes to this file (%h = host, %p = pid) instead of stdout: look for /GDRDMA there",
        ),
        "UCX_IB_GPU_DIRECT_RDMA" => ucx_gdr(value),
        "UCX_TLS" => ucx_tls(value),
        "UCX_NET_DEVICES" => ucx_net_devices(value),
        _ => return None,
    })
}

fn gdr_level(value: &str) -> Verdict {
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
        NcclPathType::Loc | NcclPathType::Nvl | NcclPathType::Nvb | NcclPathType::C2c => Verdict::new(
            Kind::Overrides,
            Status::Fail,
            format!(
                "limit {level}: every PCIe path is longer than that, so GPUDirect RDMA is off for every NIC and all \
                 network traffic is staged through host memory"
            ),
        )
        .fix("Unset NCCL_NET_GDR_LEVEL (NCCL's default PXB allows GDR for GPUs and NICs under common PCIe switches)."),
        NcclPathType::Pix => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit PIX: only a NIC under the GPU's own PCIe switch gets GPUDirect RDMA; pairs NCCL would allow by \
             default (PXB, several switch levels) lose it",
        )
        .fix("Unset NCCL_NET_GDR_LEVEL unless PXB paths were measured to be slower here."),
        NcclPathType::Pxb | NcclPathType::P2c | NcclPathType::Pxn => Verdict::new(
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
        NcclPathType::Phb => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit PHB: GPUDirect RDMA also through the CPU's root complex (GPU and NIC on one NUMA node); whether \
             that beats host staging depends on the CPU",
        )
        .fix("Keep it only if ib_write_bw --use_cuda on such a pair was measured faster than without; else unset it."),
        NcclPathType::Sys => Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "limit SYS: GPUDirect RDMA even across the inter-socket link, which is usually slower than staging \
             through host memory",
        )
        .fix("Unset it, and use a NIC on each GPU's own socket (NCCL_IB_HCA), unless it was measured faster."),
    };
    v.note(how)
}

fn gdr_read(value: &str) -> Verdict {
    let read = nccl_int(value);
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

fn dmabuf(value: &str) -> Verdict {
    let read = nccl_int(value);
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

fn ib_disable(value: &str) -> Verdict {
    let read = nccl_int(value);
    let v = match read.used() {
        _ if ib_disabled(value) => Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "turns off NCCL's InfiniBand/RoCE transport: inter-node traffic goes over TCP sockets (NET/Socket), with \
             no GPUDirect RDMA at all",
        )
        .fix("Unset NCCL_IB_DISABLE (or set 0)."),
        _ if read == NcclInt::NotANumber => Verdict::new(
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

fn ib_hca(value: &str) -> Verdict {
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

fn socket_ifname(value: &str) -> Verdict {
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

fn p2p_disable(value: &str) -> Verdict {
    // ncclGetLevel: strtol, and only exactly 1 disables.
    let read = nccl_int(value);
    let v = if read.used() == Some(1) {
        Verdict::new(
            Kind::Overrides,
            Status::Warn,
            "turns off GPU-to-GPU peer-to-peer inside the node (NVLink and PCIe): intra-node traffic goes through \
             host shared memory and PXN (reaching another GPU's NIC over NVLink) is off; GPU<->NIC GPUDirect RDMA \
             itself is not affected",
        )
        .fix("Unset it unless it works around a known P2P fault on this machine.")
    } else if read == NcclInt::NotANumber {
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

fn gid_index(value: &str) -> Verdict {
    let read = nccl_int(value);
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

fn net(value: &str) -> Verdict {
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

fn net_plugin(value: &str) -> Verdict {
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

fn ib_cuda_support(value: &str) -> Verdict {
    let intent = match nccl_int(value).used() {
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

fn gdr_c2c(value: &str) -> Verdict {
    let read = nccl_int(value);
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

fn debug(value: &str, all: &BTreeMap<&str, &str>) -> Verdict {
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
fn subsys_shows_net(value: &str) -> bool {
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

fn debug_subsys(value: &str) -> Verdict {
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

fn ucx_gdr(value: &str) -> Verdict {
    let v = value.trim();
    let lower = v.to_ascii_lowercase();
    if lower == "try" || lower == "maybe" {
        Verdict::new(Kind::Overrides, Status::Ok, "UCX's default: use GPUDirect RDMA when available, else stage")
    } else if lower == "y" || lower == "yes" || v == "1" {
        Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "GPUDirect RDMA required: UCX fails (\"Couldn't enable GPUDirect RDMA\") instead of silently staging \
             through host memory, which makes a missing GDR path visible",
        )
    } else if lower == "n" || lower == "no" || v == "0" {
        Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "UCX never lets the NIC access GPU memory: GPU buffers are staged through host memory",
        )
        .fix("Unset UCX_IB_GPU_DIRECT_RDMA (default try), or set yes to fail loudly when GDR is missing.")
    } else {
        Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "not a value UCX accepts (yes/no/try): UCX reports a configuration error and doesn't start",
        )
        .fix("Use yes, no or try (or unset it).")
    }
}

/// UCX transport names that use the RDMA NIC.
fn is_ib_transport(t: &str) -> bool {
    matches!(
        t,
        "ib" | "rc"
            | "rc_v"
            | "rc_verbs"
            | "rc_x"
            | "rc_mlx5"
            | "dc"
            | "dc_x"
            | "dc_mlx5"
            | "ud"
            | "ud_v"
            | "ud_verbs"
            | "ud_x"
            | "ud_mlx5"
            | "srd"
            | "gga"
            | "gga_mlx5"
    )
}

fn ucx_tls(value: &str) -> Verdict {
    let (negate, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let names: Vec<String> = list
        .split(',')
        .map(|t| t.trim().split(':').next().unwrap_or("").to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let has = |pred: &dyn Fn(&str) -> bool| names.iter().any(|n| pred(n));
    let all = has(&|n| n == "all");
    let (ib, cuda) = if negate {
        (!has(&|n| n == "ib" || n == "all"), !has(&|n| n == "cuda" || n == "cuda_copy" || n == "all"))
    } else {
        (all || has(&|n| is_ib_transport(n)), all || has(&|n| n == "cuda" || n == "cuda_copy"))
    };
    let mut v = if !ib {
        Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "no InfiniBand/RoCE transport (rc, dc, ud or ib) is allowed: UCX moves data over TCP or shared memory, \
             never with GPUDirect RDMA",
        )
        .fix("Allow an IB transport, e.g. UCX_TLS=rc,cuda_copy,cuda_ipc (or unset UCX_TLS).")
    } else if !cuda {
        Verdict::new(
            Kind::Overrides,
            Status::Fail,
            "no CUDA transport (cuda_copy or cuda): UCX can't recognize GPU memory, so GPU buffers can't use \
             GPUDirect RDMA",
        )
        .fix("Add cuda_copy (and cuda_ipc for intra-node), e.g. UCX_TLS=rc,cuda_copy,cuda_ipc, or unset UCX_TLS.")
    } else {
        Verdict::new(
            Kind::Overrides,
            Status::Ok,
            "an IB transport and a CUDA transport are allowed, which GPUDirect RDMA through UCX needs",
        )
    };
    if names.iter().any(|n| n == "gdr_copy") {
        v = v.note("gdr_copy is GDRCopy (CPU access to GPU memory for small messages), not GPUDirect RDMA");
    }
    v
}

fn ucx_net_devices(value: &str) -> Verdict {
    let devices: Vec<&str> = value.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    if devices.iter().any(|d| d.eq_ignore_ascii_case("all")) {
        return Verdict::new(Kind::Configures, Status::Ok, "all devices (UCX's default)");
    }
    let rdma: Vec<&str> = devices.iter().copied().filter(|d| d.contains(':')).collect();
    if rdma.is_empty() {
        Verdict::new(
            Kind::Configures,
            Status::Warn,
            format!(
                "no entry has the device:port form that UCX's InfiniBand/RoCE transports go by (e.g. mlx5_0:1); \
                 the entries ({}) look like IP interface names, so UCX is likely left with TCP and no GPUDirect RDMA",
                devices.join(", ")
            ),
        )
        .fix("List RDMA ports, e.g. UCX_NET_DEVICES=mlx5_0:1 (see `ucx_info -d`), or unset it.")
    } else {
        Verdict::new(Kind::Configures, Status::Ok, format!("UCX uses only {} for RDMA", rdma.join(", "))).note(
            "pick the port(s) closest to each GPU (the topology findings name them), or GDR may be off by distance",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn judged(name: &str, value: &str) -> Finding {
        let f = check(&vars(&[(name, value)]));
        assert_eq!(f.len(), 1, "{f:#?}");
        assert_eq!(f[0].check, format!("env.{}", name.to_ascii_lowercase()));
        f[0].clone()
    }

    #[test]
    fn nothing_set_means_defaults() {
        let f = check(&vars(&[("PATH", "/usr/bin"), ("CUDA_VISIBLE_DEVICES", "0")]));
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].check.as_str(), f[0].status), ("env.defaults", Status::Ok));
        assert!(f[0].evidence.iter().any(|e| e.contains("NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET")));
    }

    /// Each variable and value: the status, a phrase the summary must carry,
    /// and (for warn/fail) a phrase the fix must carry.
    #[test]
    fn every_known_variable() {
        use Status::*;
        let table: &[(&str, &str, Status, &str, &str)] = &[
            ("NCCL_NET_GDR_LEVEL", "LOC", Fail, "GPUDirect RDMA is off for every NIC", "Unset NCCL_NET_GDR_LEVEL"),
            ("NCCL_NET_GDR_LEVEL", "0", Fail, "limit LOC", "Unset"),
            ("NCCL_NET_GDR_LEVEL", "1", Warn, "limit PIX", "Unset"),
            ("NCCL_NET_GDR_LEVEL", "PXB", Ok, "same as NCCL's default", ""),
            ("NCCL_NET_GDR_LEVEL", "2", Ok, "same as NCCL's default", ""),
            ("NCCL_NET_GDR_LEVEL", "PHB", Warn, "through the CPU's root complex", "measured"),
            ("NCCL_NET_GDR_LEVEL", "5", Warn, "limit SYS", "NCCL_IB_HCA"),
            ("NCCL_NET_GDR_LEVEL", "phb", Warn, "NCCL ignores this value", "upper case"),
            ("NCCL_IB_GDR_LEVEL", "3", Warn, "doesn't read it", "NCCL_NET_GDR_LEVEL"),
            ("NCCL_NET_GDR_READ", "0", Warn, "off for sends", "Unset"),
            ("NCCL_NET_GDR_READ", "off", Warn, "off for sends", "Unset"),
            ("NCCL_NET_GDR_READ", "1", Ok, "for sends too", ""),
            ("NCCL_DMABUF_ENABLE", "0", Warn, "nvidia-peermem", "nvidia_peermem"),
            ("NCCL_DMABUF_ENABLE", "1", Ok, "NCCL's default", ""),
            ("NCCL_IB_DISABLE", "1", Fail, "no GPUDirect RDMA at all", "Unset NCCL_IB_DISABLE"),
            ("NCCL_IB_DISABLE", "2", Fail, "TCP sockets", "Unset"),
            ("NCCL_IB_DISABLE", "yes", Warn, "stays on", "Write 0 or 1"),
            ("NCCL_IB_DISABLE", "0", Ok, "stays on", ""),
            ("NCCL_IB_HCA", "mlx5_0:1,mlx5_1:1", Ok, "only HCAs whose names start with mlx5_0 port 1", ""),
            ("NCCL_IB_HCA", "=mlx5_0", Ok, "exactly named mlx5_0 (all ports)", ""),
            ("NCCL_IB_HCA", "^mlx5_2", Ok, "every HCA except", ""),
            ("NCCL_IB_HCA", "^", Warn, "excludes every HCA", "NCCL_IB_HCA==mlx5_0:1"),
            ("NCCL_SOCKET_IFNAME", "=eth0", Ok, "exactly the interfaces eth0", ""),
            ("NCCL_SOCKET_IFNAME", "^docker,lo", Ok, "every interface except those starting with docker, lo", ""),
            ("NCCL_P2P_DISABLE", "1", Warn, "GPU<->NIC GPUDirect RDMA itself is not affected", "Unset"),
            ("NCCL_P2P_DISABLE", "2", Ok, "only the value 1 disables", ""),
            ("NCCL_P2P_DISABLE", "true", Warn, "reads this as 0", "Write 0 or 1"),
            ("NCCL_P2P_LEVEL", "NVL", Ok, "does not decide GPU<->NIC", ""),
            ("NCCL_IB_GID_INDEX", "3", Ok, "forces GID index 3", ""),
            ("NCCL_IB_GID_INDEX", "-1", Ok, "automatic", ""),
            ("NCCL_NET", "Socket", Fail, "no GPUDirect RDMA", "Unset NCCL_NET"),
            ("NCCL_NET", "IB", Ok, "built-in InfiniBand", ""),
            ("NCCL_NET", "AWS Libfabric", Ok, "depends on that plugin", ""),
            ("NCCL_NET_PLUGIN", "aws-ofi", Ok, "libnccl-net-aws-ofi.so", ""),
            ("NCCL_NET_PLUGIN", "none", Ok, "no external network plugin", ""),
            ("NCCL_IB_CUDA_SUPPORT", "0", Warn, "meant to disable", "NCCL_NET_GDR_LEVEL=LOC"),
            ("NCCL_IB_CUDA_SUPPORT", "1", Warn, "does nothing now", "NCCL_NET_GDR_LEVEL=SYS"),
            ("NCCL_NET_GDR_C2C", "0", Warn, "Grace", "Unset"),
            ("NCCL_GDRCOPY_ENABLE", "1", Ok, "not GPUDirect RDMA", ""),
            ("NCCL_TOPO_FILE", "/opt/topo.xml", Warn, "instead of sysfs", "/opt/topo.xml"),
            ("NCCL_TOPO_DUMP_FILE", "/tmp/t.xml", Ok, "path types", ""),
            ("NCCL_DEBUG", "INFO", Ok, "/GDRDMA", ""),
            ("NCCL_DEBUG", "warn", Ok, "only warnings", ""),
            ("NCCL_DEBUG", "LOUD", Ok, "not a level", ""),
            ("NCCL_DEBUG_SUBSYS", "INIT,NET", Ok, "NET lines are logged", ""),
            ("NCCL_DEBUG_SUBSYS", "^NET", Ok, "filtered out", ""),
            ("NCCL_DEBUG_FILE", "/tmp/nccl.%h.%p", Ok, "/GDRDMA", ""),
            ("UCX_IB_GPU_DIRECT_RDMA", "no", Fail, "staged through host memory", "Unset UCX_IB_GPU_DIRECT_RDMA"),
            ("UCX_IB_GPU_DIRECT_RDMA", "0", Fail, "never lets the NIC", "Unset"),
            ("UCX_IB_GPU_DIRECT_RDMA", "YES", Ok, "required", ""),
            ("UCX_IB_GPU_DIRECT_RDMA", "try", Ok, "UCX's default", ""),
            ("UCX_IB_GPU_DIRECT_RDMA", "sometimes", Fail, "configuration error", "yes, no or try"),
            ("UCX_TLS", "tcp,cuda_copy", Fail, "no InfiniBand/RoCE transport", "UCX_TLS=rc,cuda_copy,cuda_ipc"),
            ("UCX_TLS", "rc,sm", Fail, "no CUDA transport", "cuda_copy"),
            ("UCX_TLS", "rc_x,cuda_copy,gdr_copy", Ok, "IB transport and a CUDA transport", ""),
            ("UCX_TLS", "^ib", Fail, "no InfiniBand/RoCE transport", "UCX_TLS"),
            ("UCX_TLS", "^tcp", Ok, "IB transport and a CUDA transport", ""),
            ("UCX_TLS", "all", Ok, "IB transport", ""),
            ("UCX_NET_DEVICES", "bond1", Warn, "device:port form", "mlx5_0:1"),
            ("UCX_NET_DEVICES", "mlx5_0:1,eth0", Ok, "only mlx5_0:1", ""),
            ("UCX_NET_DEVICES", "all", Ok, "UCX's default", ""),
        ];
        assert!(table.len() > 50);
        for (name, value, status, summary, fix) in table {
            let f = judged(name, value);
            assert_eq!(f.status, *status, "{name}={value}: {f:#?}");
            assert!(f.summary.contains(summary), "{name}={value}: summary {:?} lacks {summary:?}", f.summary);
            assert!(f.summary.starts_with(&format!("{name}={value} (")), "{}", f.summary);
            match f.status {
                Status::Warn | Status::Fail => {
                    let got = f.fix.as_deref().unwrap_or_else(|| panic!("{name}={value}: no fix"));
                    assert!(got.contains(fix), "{name}={value}: fix {got:?} lacks {fix:?}");
                }
                _ => assert!(fix.is_empty(), "{name}={value}: table expects a fix for a passing value"),
            }
        }
    }

    #[test]
    fn kinds_are_named() {
        assert!(judged("NCCL_DEBUG", "INFO").summary.contains("(diagnoses)"));
        assert!(judged("NCCL_IB_HCA", "mlx5_0").summary.contains("(configures)"));
        assert!(judged("NCCL_IB_DISABLE", "1").summary.contains("(overrides tuning that is normally right)"));
    }

    #[test]
    fn value_traps_are_explained() {
        let f = judged("NCCL_IB_DISABLE", "yes");
        assert!(f.evidence.iter().any(|e| e.contains("not a number") && e.contains("means 0")), "{f:#?}");
        let f = judged("NCCL_NET_GDR_LEVEL", "08");
        assert!(f.evidence.iter().any(|e| e.contains("octal")), "{f:#?}");
        assert_eq!(f.status, Status::Fail, "08 is octal 0 = LOC");
        let f = judged("NCCL_IB_HCA", "mlx5_1");
        assert!(f.evidence.iter().any(|e| e.contains("mlx5_10")), "{f:#?}");
        let f = judged("NCCL_IB_HCA", "=mlx5_1");
        assert!(!f.evidence.iter().any(|e| e.contains("prefix match")), "{f:#?}");
        let f = judged("NCCL_NET_GDR_READ", "99999999999999999999");
        assert_eq!(f.status, Status::Ok);
        assert!(f.evidence.iter().any(|e| e.contains("out of range")));
    }

    #[test]
    fn debug_reads_the_subsystems_next_to_it() {
        let f = check(&vars(&[("NCCL_DEBUG", "INFO")]));
        assert!(f[0].evidence.iter().any(|e| e.contains("add NCCL_DEBUG_SUBSYS=INIT,NET")), "{f:#?}");
        let f = check(&vars(&[("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET")]));
        let d = f.iter().find(|f| f.check == "env.nccl_debug").unwrap();
        assert!(d.evidence.iter().any(|e| e.contains("includes NET")), "{d:#?}");
        assert!(subsys_shows_net("ALL") && subsys_shows_net("^INIT") && !subsys_shows_net("INIT,GRAPH"));
    }

    #[test]
    fn unknown_variables_are_listed_not_judged() {
        let f = check(&vars(&[("NCCL_ALGO", "Ring"), ("UCX_LOG_LEVEL", "debug"), ("NCCL_IB_DISABLE", "1")]));
        assert_eq!(f.len(), 2, "{f:#?}");
        let u = f.iter().find(|f| f.check == "env.unjudged").unwrap();
        assert_eq!(u.status, Status::Skipped);
        assert!(u.summary.contains("not judged"));
        assert_eq!(u.evidence, ["NCCL_ALGO=Ring", "UCX_LOG_LEVEL=debug"]);
        assert_eq!(f.iter().find(|f| f.check == "env.nccl_ib_disable").unwrap().status, Status::Fail);
    }

    #[test]
    fn last_assignment_wins_and_order_is_stable() {
        let f = check(&vars(&[("NCCL_IB_DISABLE", "1"), ("UCX_TLS", "rc,cuda_copy"), ("NCCL_IB_DISABLE", "0")]));
        let names: Vec<&str> = f.iter().map(|f| f.check.as_str()).collect();
        assert_eq!(names, ["env.nccl_ib_disable", "env.ucx_tls"]);
        assert_eq!(f[0].status, Status::Ok);
    }

    #[test]
    fn strtoll_emulation() {
        assert_eq!(nccl_int(""), NcclInt::Empty);
        assert_eq!(nccl_int("1"), NcclInt::Number(1));
        assert_eq!(nccl_int("  -3"), NcclInt::Number(-3));
        assert_eq!(nccl_int("+7x"), NcclInt::Number(7));
        assert_eq!(nccl_int("0x1F"), NcclInt::Number(31));
        assert_eq!(nccl_int("010"), NcclInt::Number(8));
        assert_eq!(nccl_int("09"), NcclInt::Number(0));
        assert_eq!(nccl_int("0x"), NcclInt::Number(0));
        assert_eq!(nccl_int("true"), NcclInt::NotANumber);
        assert_eq!(nccl_int("-"), NcclInt::NotANumber);
        assert_eq!(nccl_int("9223372036854775807"), NcclInt::Number(i64::MAX));
        assert_eq!(nccl_int("-9223372036854775808"), NcclInt::Number(i64::MIN));
        assert_eq!(nccl_int("9223372036854775808"), NcclInt::Overflow);
    }

    /// xorshift64*, so a failure reproduces.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    #[test]
    fn garbage_values_never_panic() {
        let names = [
            "NCCL_NET_GDR_LEVEL",
            "NCCL_NET_GDR_READ",
            "NCCL_DMABUF_ENABLE",
            "NCCL_IB_DISABLE",
            "NCCL_IB_HCA",
            "NCCL_SOCKET_IFNAME",
            "NCCL_P2P_DISABLE",
            "NCCL_IB_GID_INDEX",
            "NCCL_NET",
            "NCCL_NET_PLUGIN",
            "NCCL_IB_CUDA_SUPPORT",
            "NCCL_DEBUG",
            "NCCL_DEBUG_SUBSYS",
            "UCX_IB_GPU_DIRECT_RDMA",
            "UCX_TLS",
            "UCX_NET_DEVICES",
            "NCCL_X",
            "UCX_",
        ];
        let alphabet: Vec<char> = "0123456789xX+-^=,: \t\u{e9}\u{1f600}abcPHBSYSLOCmlx_".chars().collect();
        let mut state = 7u64;
        let mut findings = 0;
        for _ in 0..3000 {
            let len = (next(&mut state) % 24) as usize;
            let value: String =
                (0..len).map(|_| alphabet[(next(&mut state) % alphabet.len() as u64) as usize]).collect();
            let name = names[(next(&mut state) % names.len() as u64) as usize];
            let f = check(&vars(&[(name, &value)]));
            assert!(!f.is_empty());
            findings += f.len();
        }
        assert!(findings >= 3000);
    }
}
