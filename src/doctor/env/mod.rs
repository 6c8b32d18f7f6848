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

use gpudirect::nccl::Int;

use super::jobenv::JobEnv;

use super::{Finding, Status};

mod nccl;
mod rules;
mod site;
mod tuning;
mod ucx;

pub use rules::{dmabuf_disabled, nccl_stops, plugin_network, registration_path, transport_off, Stop, DECIDING};
pub use site::{find_net_libs, plugin_names, LibSearch, Site};

use nccl::{
    comm_id, debug, debug_file, debug_subsys, dmabuf, gdr_c2c, gdr_level, gdr_read, gid_index, hca_selects, ib_cuda_support, ib_disable,
    ib_hca, net, net_plugin, p2p_disable, socket_ifname,
};
use ucx::{ucx_gdr, ucx_net_devices, ucx_tls};

/// Overrides in one job from which the configuration as a whole is named.
const MANY_OVERRIDES: usize = 4;

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

/// A variable as judged, before it becomes a [`Finding`].
struct Judged {
    kind: Kind,
    status: Status,
    meaning: String,
    notes: Vec<String>,
    fix: Option<String>,
}

impl Judged {
    fn new(kind: Kind, status: Status, meaning: impl Into<String>) -> Judged {
        Judged { kind, status, meaning: meaning.into(), notes: Vec::new(), fix: None }
    }

    fn note(mut self, n: impl Into<String>) -> Judged {
        self.notes.push(n.into());
        self
    }

    fn fix(mut self, f: impl Into<String>) -> Judged {
        self.fix = Some(f.into());
        self
    }
}

/// A sentence on how a non-obvious integer value was read.
fn int_note(raw: &str, read: Int) -> Option<String> {
    match read {
        Int::NotANumber => Some(format!(
            "{raw:?} is not a number: NCCL reads it with strtoll, which gives 0 without complaint, so this means 0"
        )),
        Int::Overflow => Some(format!("{raw:?} is out of range: NCCL ignores it and keeps its default")),
        Int::Empty => Some("empty: NCCL keeps its default".to_owned()),
        Int::Number(n) if raw.trim() != n.to_string() => {
            Some(format!("NCCL reads {raw:?} as {n} (strtoll: 0x is hex, a leading 0 octal, trailing text ignored)"))
        }
        Int::Number(_) => None,
    }
}

fn with_int_note(v: Judged, raw: &str, read: Int) -> Judged {
    match int_note(raw, read) {
        Some(n) => v.note(n),
        None => v,
    }
}

/// A GPU and NIC pair as the verdict weighs it against the environment.
pub struct PairInEnv<'a> {
    /// The NIC's RDMA device name.
    pub nic: &'a str,
    /// Their PCIe relation as nvidia-smi names it, when the topology
    /// knows it.
    pub level: Option<gpudirect::topology::PathLevel>,
    /// Their PCIe relation in NCCL's view, the one that decides.
    pub nccl_level: Option<gpudirect::topology::PathLevel>,
    /// dma-buf is the only registration path here (no peer memory).
    pub dma_buf_only: bool,
    /// What the machine offers (its network plugins).
    pub site: &'a Site,
}

/// Judges the variables an NCCL log shows NCCL read (its `environment`)
/// by the same rules as the doctor's `env.*` findings, into the report's
/// `environment_judged`: one judge per fact, whichever tool shows it.
pub fn judge_log_environment(report: &mut crate::nccl_log::Report, source: &str) {
    if report.environment.is_empty() {
        return;
    }
    let env = super::jobenv::from_nccl_log(&report.environment, source);
    let by_plugin = report.environment.iter().filter_map(|e| e.set_by_plugin.map(|l| (e, l))).map(|(e, l)| crate::nccl_log::EnvJudgement {
        check: format!("env.{}", e.name.to_ascii_lowercase()),
        status: Status::Ok.to_string(),
        summary: format!("{}={} was set by the network plugin itself (line {l}), not by the job: not a user override", e.name, e.value),
    });
    let mut judged: Vec<crate::nccl_log::EnvJudgement> = check(&env, &Site::default())
        .into_iter()
        .filter(|f| f.check != "env.sources" && f.check != "env.defaults")
        .map(|f| crate::nccl_log::EnvJudgement { check: f.check, status: f.status.to_string(), summary: f.summary })
        .collect();
    judged.extend(by_plugin);
    report.environment_judged = judged;
}

/// Whether an NCCL name list (`NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME`:
/// prefixes, `=` for exact names, `^` to exclude) selects `name`.
pub fn list_selects(value: &str, name: &str) -> bool {
    hca_selects(value, name)
}

/// The value NCCL sees for `name` in `vars`: the last assignment wins.
pub fn var<'a>(vars: &'a [(String, String)], name: &str) -> Option<&'a str> {
    vars.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// Whether NCCL, run with `vars`, may open `nic` at all (`NCCL_IB_HCA`).
pub fn hca_allows(vars: &[(String, String)], nic: &str) -> bool {
    var(vars, "NCCL_IB_HCA").is_none_or(|v| hca_selects(v, nic))
}

/// Explains every `NCCL_*` and `UCX_*` variable that matters to GPUDirect
/// RDMA; unknown ones of those families are listed as not judged. With none
/// set, one finding says the defaults apply. The last assignment of a name
/// wins, as in a process environment built from a list.
///
/// Each finding says where its variable came from ([`JobEnv::origin`]);
/// what was read to find them is a finding of its own when there is any.
pub fn check(job: &JobEnv, site: &Site) -> Vec<Finding> {
    let mut set: BTreeMap<&str, &str> = BTreeMap::new();
    for (k, v) in &job.vars {
        if super::jobenv::judged(k) {
            set.insert(k.as_str(), v.as_str());
        }
    }
    let mut sources = Vec::new();
    if !job.notes.is_empty() {
        let mut f = Finding::new("env.sources", Status::Ok, "the job's environment: the process's variables, then NCCL's configuration files in NCCL's order");
        for n in &job.notes {
            f = f.evidence(n.clone());
        }
        sources.push(f);
    }
    let unsettled: Vec<Finding> = job.unsettled.iter().filter(|u| super::jobenv::judged(&u.name)).map(unsettled_finding).collect();
    if let Some(f) = seen_finding(job) {
        sources.push(f);
    }
    if set.is_empty() && unsettled.is_empty() && job.seen.is_empty() {
        return sources.into_iter().chain([Finding::new(
            "env.defaults",
            Status::Ok,
            "no NCCL_* or UCX_* variable is set: NCCL and UCX decide on GPUDirect RDMA themselves",
        )
        .evidence(
            "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET would make NCCL print its GDR decision (\"GPU Direct RDMA \
             Enabled for HCA ...\" and channel lines ending in /GDRDMA)",
        )
        .evidence(
            "NCCL also reads NCCL_CONF_FILE or ~/.nccl.conf, then /etc/nccl.conf; env.sources lists what was read",
        )])
        .collect();
    }
    let mut out = sources;
    out.extend(unsettled);
    let mut unjudged = Vec::new();
    let mut overrides = Vec::new();
    for (name, value) in &set {
        match judge(name, value, &set, site) {
            Some(v) => {
                if v.kind == Kind::Overrides && !name.starts_with("UCX_") {
                    overrides.push(format!("{name}={value}"));
                }
                let mut f = Finding::new(
                    format!("env.{}", name.to_ascii_lowercase()),
                    v.status,
                    format!("{name}={value} ({}): {}", v.kind.word(), v.meaning),
                )
                .evidence(format!("set by {}: {name}={value:?}", job.origin(name)));
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
    if overrides.len() >= MANY_OVERRIDES {
        let mut f = Finding::new(
            "env.overrides",
            Status::Warn,
            format!(
                "{} variables override choices NCCL makes per machine and message size: a configuration nobody has measured as a whole",
                overrides.len()
            ),
        )
        .fix(
            "Each was right for some machine once: measure this job's collectives (nccl-tests, or the job's own step time) with \
             none of them, then add back only those that still help.",
        );
        for o in overrides {
            f = f.evidence(o);
        }
        out.push(f);
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

/// The variables the job file leaves to the running job that decide
/// whether NCCL uses GPUDirect RDMA.
pub fn unsettled_deciding(job: &JobEnv) -> Vec<&super::jobenv::Unsettled> {
    job.unsettled.iter().filter(|u| DECIDING.contains(&u.name.as_str())).collect()
}

/// The names a job file names that its reading did not take (*seen, not
/// read*): a deciding one among them leaves the verdict open.
fn seen_finding(job: &JobEnv) -> Option<Finding> {
    let first = job.seen.first()?;
    let deciding: Vec<&str> = job.seen.iter().map(|s| s.name.as_str()).filter(|n| DECIDING.contains(n)).collect();
    let mut f = Finding::new(
        "env.seen_not_read",
        Status::Skipped,
        format!(
            "{} NCCL_*/UCX_* name(s) the job file names in a form this reading does not take into a value (first: {} on line {}){}",
            job.seen.len(),
            first.name,
            first.line,
            if deciding.is_empty() { String::new() } else { format!("; deciding ones leave the verdict open: {}", deciding.join(", ")) }
        ),
    )
    .fix(format!("write each as `export NAME=value` before the job's launch, or {SETTLE}"));
    for s in &job.seen {
        // Quoted: the line is the file's, not the report's.
        f = f.evidence(format!("line {}: {} in {:?}", s.line, s.name, s.text));
    }
    Some(f)
}

/// What would settle a value the job file cannot.
const SETTLE: &str = "judge the running job instead (--pid PID, or --nccl-log with NCCL_DEBUG=INFO, which prints each variable NCCL read), or write the value out in the file";

fn unsettled_finding(u: &super::jobenv::Unsettled) -> Finding {
    Finding::new(
        format!("env.{}", u.name.to_ascii_lowercase()),
        Status::Skipped,
        format!("{}: left to the running job: {} sets it to `{}`, and {}", u.name, u.origin, u.text, u.why),
    )
    .evidence(format!("set by {}: {}={:?}", u.origin, u.name, u.text))
    .evidence(format!("to settle it, {SETTLE}"))
}

fn judge(name: &str, value: &str, all: &BTreeMap<&str, &str>, site: &Site) -> Option<Judged> {
    if let Some(j) = nccl::dead_name(name) {
        return Some(j);
    }
    Some(match name {
        "NCCL_NET_GDR_LEVEL" => gdr_level(value),
        "NCCL_IB_GDR_LEVEL" => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "the pre-2.4 name of NCCL_NET_GDR_LEVEL; current NCCL doesn't read it, so it changes nothing",
        )
        .fix("Remove it; if the limit is really wanted, set NCCL_NET_GDR_LEVEL instead."),
        "NCCL_NET_GDR_READ" => gdr_read(value),
        "NCCL_DMABUF_ENABLE" => dmabuf(value, site),
        "NCCL_IB_DISABLE" => ib_disable(value),
        "NCCL_IB_HCA" => ib_hca(value, site),
        "NCCL_SOCKET_IFNAME" => socket_ifname(value),
        "NCCL_P2P_DISABLE" => p2p_disable(value),
        "NCCL_P2P_LEVEL" => Judged::new(
            Kind::Overrides,
            Status::Ok,
            "limits GPU-to-GPU peer-to-peer inside the node; it does not decide GPU<->NIC GPUDirect RDMA (that is \
             NCCL_NET_GDR_LEVEL)",
        ),
        "NCCL_IB_GID_INDEX" => gid_index(value),
        "NCCL_NET" => net(value, all, site),
        "NCCL_NET_PLUGIN" => net_plugin(value, site),
        "NCCL_COMM_ID" => comm_id(value),
        "NCCL_IB_CUDA_SUPPORT" => ib_cuda_support(value),
        "NCCL_NET_GDR_C2C" => gdr_c2c(value),
        "NCCL_GDRCOPY_ENABLE" => Judged::new(
            Kind::Configures,
            Status::Ok,
            "GDRCopy (the CPU mapping GPU memory for small copies) is not GPUDirect RDMA; it neither enables nor \
             disables the NIC's direct access to GPU memory",
        ),
        "NCCL_TOPO_FILE" => Judged::new(
            Kind::Overrides,
            Status::Warn,
            "NCCL takes the PCIe topology from this XML file instead of sysfs, so its GPU<->NIC distances (and GDR \
             decisions) follow the file, not the topology findings of this doctor",
        )
        .fix(format!(
            "Make sure {value} describes this machine (compare with NCCL_TOPO_DUMP_FILE output), or unset it."
        )),
        "NCCL_TOPO_DUMP_FILE" => Judged::new(
            Kind::Diagnoses,
            Status::Ok,
            "NCCL writes the topology it detected to this file: it shows the path types (PIX, PXB, PHB, SYS) NCCL \
             computed for each GPU and NIC",
        ),
        "NCCL_DEBUG" => debug(value, all),
        "NCCL_DEBUG_SUBSYS" => debug_subsys(value),
        "NCCL_DEBUG_FILE" => debug_file(value),
        "UCX_IB_GPU_DIRECT_RDMA" => ucx_gdr(value),
        "UCX_TLS" => ucx_tls(value),
        "UCX_NET_DEVICES" => ucx_net_devices(value),
        other => return tuning::judge(other, value),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nccl::subsys_shows_net;

    fn check(job: &JobEnv) -> Vec<Finding> {
        super::check(job, &Site::default())
    }

    fn job(pairs: &[(&str, &str)]) -> JobEnv {
        JobEnv { vars: vars(pairs), ..Default::default() }
    }

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn judged(name: &str, value: &str) -> Finding {
        let f = check(&job(&[(name, value)]));
        assert_eq!(f.len(), 1, "{f:#?}");
        assert_eq!(f[0].check, format!("env.{}", name.to_ascii_lowercase()));
        f[0].clone()
    }

    #[test]
    fn nothing_set_means_defaults() {
        let f = check(&job(&[("PATH", "/usr/bin"), ("CUDA_VISIBLE_DEVICES", "0")]));
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
            ("NCCL_NET_GDR_READ", "0", Fail, "NCCL sends from host memory", "unset NCCL_NET_GDR_READ"),
            ("NCCL_NET_GDR_READ", "off", Fail, "NCCL sends from host memory", "unset NCCL_NET_GDR_READ"),
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

    /// Judged against what the machine offers: a plugin network without its
    /// plugin stops NCCL; NCCL_NET_PLUGIN names the files NCCL tries;
    /// dma-buf off where it is the only path fails; NCCL_IB_HCA naming
    /// interfaces or absent devices; a shared debug file; a bad
    /// NCCL_COMM_ID; names NCCL never read.
    #[test]
    fn variables_are_judged_against_the_site() {
        use Status::*;
        let libs = |found: &[&str]| Some(LibSearch { dirs: vec!["/usr/lib".into()], found: found.iter().map(|f| f.to_string()).collect() });
        let none = Site { rdma_devices: Some(vec!["mlx5_0".into(), "mlx5_1".into()]), net_libs: libs(&[]), dma_buf_only: true };
        let ofi = Site { net_libs: libs(&["/opt/amazon/ofi-nccl/lib/libnccl-net-ofi.so", "/usr/lib/libnccl-net.so"]), ..Site::default() };
        let at = |site: &Site, pairs: &[(&str, &str)], name: &str| {
            let f = super::check(&job(pairs), site);
            f.into_iter().find(|f| f.check == format!("env.{}", name.to_ascii_lowercase())).unwrap_or_else(|| panic!("{name}"))
        };
        let f = at(&none, &[("NCCL_NET", "UCX")], "NCCL_NET");
        assert_eq!(f.status, Fail, "{f:#?}");
        assert!(f.summary.contains("Failed to initialize any NET plugin") && f.summary.contains("libnccl-net.so"), "{}", f.summary);
        assert_eq!(at(&ofi, &[("NCCL_NET", "AWS Libfabric")], "NCCL_NET").status, Ok);
        let f = at(&ofi, &[("NCCL_NET", "AWS Libfabric"), ("NCCL_NET_PLUGIN", "aws-ofi")], "NCCL_NET");
        assert_eq!(f.status, Fail, "aws-ofi means aws-ofi or libnccl-net-aws-ofi.so, neither here: {f:#?}");
        assert_eq!(at(&ofi, &[("NCCL_NET", "AWS Libfabric"), ("NCCL_NET_PLUGIN", "ofi")], "NCCL_NET").status, Ok);
        let f = at(&ofi, &[("NCCL_NET_PLUGIN", "libX.so")], "NCCL_NET_PLUGIN");
        assert!(f.status == Warn && f.summary.contains("NCCL tries libX.so, and none") && !f.summary.contains("libnccl-net-libX"), "{f:#?}");
        assert_eq!(plugin_names(Some("libX.so")), ["libX.so"]);
        assert_eq!(plugin_names(Some("/opt/p/libnccl-net-x.so")), ["/opt/p/libnccl-net-x.so"]);
        assert_eq!(plugin_names(Some("ofi")), ["ofi", "libnccl-net-ofi.so"]);
        assert_eq!(plugin_names(None), ["libnccl-net.so"]);
        assert!(plugin_names(Some("NONE")).is_empty());
        assert_eq!(at(&none, &[("NCCL_DMABUF_ENABLE", "0")], "NCCL_DMABUF_ENABLE").status, Fail);
        assert_eq!(at(&ofi, &[("NCCL_DMABUF_ENABLE", "0")], "NCCL_DMABUF_ENABLE").status, Warn);
        let f = at(&Site::default(), &[("NCCL_IB_HCA", "eth0")], "NCCL_IB_HCA");
        assert!(f.status == Fail && f.evidence.iter().any(|e| e.contains("network interface names")), "{f:#?}");
        assert_eq!(at(&Site::default(), &[("NCCL_IB_HCA", "mlx5_0,hsn0")], "NCCL_IB_HCA").status, Warn);
        let f = at(&none, &[("NCCL_IB_HCA", "=mlx5_4:1")], "NCCL_IB_HCA");
        assert!(f.status == Fail && f.evidence.iter().any(|e| e.contains("mlx5_4 match(es) no RDMA device here (mlx5_0, mlx5_1)")), "{f:#?}");
        assert_eq!(at(&none, &[("NCCL_IB_HCA", "mlx5")], "NCCL_IB_HCA").status, Ok);
        assert_eq!(at(&none, &[("NCCL_IB_HCA", "^mlx5_4")], "NCCL_IB_HCA").status, Ok);
        let f = at(&none, &[("NCCL_DEBUG_FILE", "/tmp/nccl.log")], "NCCL_DEBUG_FILE");
        assert!(f.status == Warn && f.fix.as_deref() == Some("Add the pid: NCCL_DEBUG_FILE=/tmp/nccl.%h.%p"), "{f:#?}");
        for (v, status) in [("10.0.0.1:29600", Ok), ("[fd00::1]:29600", Ok), ("node1:80", Ok), ("10.0.0.1", Fail), ("fd00::1:29600", Fail), ("h:0", Fail), (":29600", Fail)] {
            assert_eq!(at(&none, &[("NCCL_COMM_ID", v)], "NCCL_COMM_ID").status, status, "NCCL_COMM_ID={v}");
        }
        for dead in ["NCCL_SINGLE_RING_THRESHOLD", "NCCL_NET_GDR_DISABLE", "NCCL_LL_THRESHOLD"] {
            let f = at(&none, &[(dead, "1")], dead);
            assert!(f.status == Warn && f.summary.contains("NCCL does not read this name"), "{f:#?}");
        }
        // The verdict's judge says the same of a plugin network.
        let pair = PairInEnv { nic: "mlx5_0", level: None, nccl_level: None, dma_buf_only: false, site: &none };
        let stop = nccl_stops(&vars(&[("NCCL_NET", "gIB")]), &pair).unwrap();
        assert!(matches!(&stop, Stop::PluginMissing { net, .. } if net == "gIB"), "{stop:?}");
        assert!(stop.to_string().contains("Failed to initialize any NET plugin"));
        let pair = PairInEnv { site: &Site::default(), ..pair };
        assert_eq!(nccl_stops(&vars(&[("NCCL_NET", "gIB")]), &pair), None, "plugins not looked for: not judged absent");
        // NCCL knows no NODE: the fix names the value NCCL reads.
        let node = PairInEnv { level: Some(gpudirect::topology::PathLevel::Node), nccl_level: Some(gpudirect::topology::PathLevel::Phb), ..pair };
        let why = nccl_stops(&[], &node).unwrap().to_string();
        assert!(why.contains("this NODE path") && why.contains("set NCCL_NET_GDR_LEVEL=PHB "), "{why}");
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
        let f = check(&job(&[("NCCL_DEBUG", "INFO")]));
        assert!(f[0].evidence.iter().any(|e| e.contains("add NCCL_DEBUG_SUBSYS=INIT,NET")), "{f:#?}");
        let f = check(&job(&[("NCCL_DEBUG", "INFO"), ("NCCL_DEBUG_SUBSYS", "INIT,NET")]));
        let d = f.iter().find(|f| f.check == "env.nccl_debug").unwrap();
        assert!(d.evidence.iter().any(|e| e.contains("includes NET")), "{d:#?}");
        assert!(subsys_shows_net("ALL") && subsys_shows_net("^INIT") && !subsys_shows_net("INIT,GRAPH"));
    }

    /// The tuning variables the field sets most are judged by kind; none
    /// claims to touch GPUDirect RDMA; a tiny buffer and a disabled
    /// shared-memory transport warn with a fix.
    #[test]
    fn tuning_variables_are_judged_by_kind() {
        let cases = [
            ("NCCL_ALGO", "Ring", "overrides", Status::Ok),
            ("NCCL_PROTO", "^LL128", "overrides", Status::Ok),
            ("NCCL_MIN_NCHANNELS", "16", "overrides", Status::Ok),
            ("NCCL_MAX_NCHANNELS", "0x8", "overrides", Status::Ok),
            ("NCCL_BUFFSIZE", "8388608", "overrides", Status::Ok),
            ("NCCL_BUFFSIZE", "65536", "overrides", Status::Warn),
            ("NCCL_CROSS_NIC", "0", "configures", Status::Ok),
            ("NCCL_IB_QPS_PER_CONNECTION", "4", "overrides", Status::Ok),
            ("NCCL_IB_TC", "106", "configures", Status::Ok),
            ("NCCL_IB_SL", "3", "configures", Status::Ok),
            ("NCCL_SHM_DISABLE", "1", "overrides", Status::Warn),
            ("NCCL_SHM_DISABLE", "0", "overrides", Status::Ok),
        ];
        for (name, value, kind, status) in cases {
            let f = judged(name, value);
            assert_eq!(f.status, status, "{name}={value}: {f:#?}");
            assert!(f.summary.contains(&format!("({kind}")), "{name}={value}: {}", f.summary);
            assert_eq!(f.fix.is_some(), status == Status::Warn, "{name}={value}");
        }
        assert!(judged("NCCL_MAX_NCHANNELS", "0x8").evidence.iter().any(|e| e.contains("0x is hex")));
        assert!(judged("NCCL_CROSS_NIC", "0").summary.contains("rail-optimized"));
    }

    /// Four or more overrides at once are named as a configuration nobody
    /// measured as a whole, each listed; three are not.
    #[test]
    fn many_overrides_are_named_together() {
        let some = [("NCCL_ALGO", "Ring"), ("NCCL_PROTO", "Simple"), ("NCCL_BUFFSIZE", "8388608")];
        assert!(!check(&job(&some)).iter().any(|f| f.check == "env.overrides"));
        let mut many = some.to_vec();
        many.push(("NCCL_MIN_NCHANNELS", "32"));
        many.push(("NCCL_IB_TC", "106"));
        let f = check(&job(&many));
        let o = f.iter().find(|f| f.check == "env.overrides").unwrap();
        assert_eq!(o.status, Status::Warn);
        assert!(o.summary.starts_with("4 variables override"), "{}", o.summary);
        assert_eq!(o.evidence.len(), 4, "NCCL_IB_TC configures, it is not counted: {:?}", o.evidence);
    }

    #[test]
    fn unknown_variables_are_listed_not_judged() {
        let f = check(&job(&[("NCCL_LAUNCH_MODE", "GROUP"), ("UCX_LOG_LEVEL", "debug"), ("NCCL_IB_DISABLE", "1")]));
        assert_eq!(f.len(), 2, "{f:#?}");
        let u = f.iter().find(|f| f.check == "env.unjudged").unwrap();
        assert_eq!(u.status, Status::Skipped);
        assert!(u.summary.contains("not judged"));
        assert_eq!(u.evidence, ["NCCL_LAUNCH_MODE=GROUP", "UCX_LOG_LEVEL=debug"]);
        assert_eq!(f.iter().find(|f| f.check == "env.nccl_ib_disable").unwrap().status, Status::Fail);
    }

    #[test]
    fn last_assignment_wins_and_order_is_stable() {
        let f = check(&job(&[("NCCL_IB_DISABLE", "1"), ("UCX_TLS", "rc,cuda_copy"), ("NCCL_IB_DISABLE", "0")]));
        let names: Vec<&str> = f.iter().map(|f| f.check.as_str()).collect();
        assert_eq!(names, ["env.nccl_ib_disable", "env.ucx_tls"]);
        assert_eq!(f[0].status, Status::Ok);
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
        let mut rng = testkit::Rng(7);
        let mut findings = 0;
        for _ in 0..3000 {
            let len = rng.index(24);
            let value: String = (0..len).map(|_| alphabet[rng.index(alphabet.len())]).collect();
            let name = names[rng.index(names.len())];
            let f = check(&job(&[(name, &value)]));
            assert!(!f.is_empty());
            findings += f.len();
        }
        assert!(findings >= 3000);
    }
}
