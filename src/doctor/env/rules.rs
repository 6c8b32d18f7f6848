//! The rules by which NCCL, in a job's environment, does not use
//! GPUDirect RDMA on a GPU–NIC pair the machine allows: one table, in the
//! order NCCL meets them, each rule typed ([`Stop`]) and worded once. The
//! verdict, each GPU's NIC finding and the per-variable findings' status
//! for these variables all come from here.

use std::fmt;

use gpudirect::nccl::{ib_disabled, is_tcp_network, param_int};
use gpudirect::RegistrationPath;

use super::{hca_selects, plugin_names, var, PairInEnv, Site};

/// Why NCCL will not use GPUDirect RDMA on a pair: the variable, what
/// NCCL makes of it, and the fix (its `Display`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `NCCL_NET` names a TCP socket transport.
    Sockets { value: String },
    /// `NCCL_IB_DISABLE` turns NCCL's IB/RoCE transport off.
    IbDisabled { value: String },
    /// `NCCL_NET` names a plugin's network and no plugin NCCL would load
    /// is on the machine: NCCL stops at initialization.
    PluginMissing { net: String, tried: String },
    /// `NCCL_IB_HCA` leaves the pair's NIC out.
    HcaLeavesOut { value: String, nic: String },
    /// `NCCL_NET_GDR_LEVEL` is below the pair's distance.
    LevelBelowPath { setting: String, what: String },
    /// Unset, NCCL's default distance (PXB) is below the pair's.
    DefaultBelowPath { level: String, value: String },
    /// `NCCL_DMABUF_ENABLE` turns off dma-buf, the pair's only path.
    DmabufOff { value: String },
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::Sockets { value } => write!(f, "NCCL_NET={value} selects a TCP socket transport, which stages every transfer through host memory (unset it)"),
            Stop::IbDisabled { value } => {
                write!(f, "NCCL_IB_DISABLE={value} turns NCCL's InfiniBand/RoCE transport off: it uses sockets, through host memory (unset it)")
            }
            Stop::PluginMissing { net, tried } => write!(
                f,
                "NCCL_NET={net} names a network only a plugin provides, and NCCL would load {tried}, which is not in the library directories here: \
                 NCCL stops at initialization (\"Failed to initialize any NET plugin\") (install the plugin that provides {net:?}, or unset NCCL_NET)"
            ),
            Stop::HcaLeavesOut { value, nic } => write!(f, "NCCL_IB_HCA={value} leaves out {nic} (set NCCL_IB_HCA=={nic}:1, or add it, or unset NCCL_IB_HCA)"),
            Stop::LevelBelowPath { setting, what } => write!(f, "{setting} {what} (unset it: NCCL's default is PXB)"),
            Stop::DefaultBelowPath { level, value } => write!(
                f,
                "NCCL's default NCCL_NET_GDR_LEVEL (PXB) stops short of this {level} path, so NCCL stages through host memory \
                 (set NCCL_NET_GDR_LEVEL={value} where that path carries peer-to-peer traffic well, or pair the GPU with a NIC under its PCIe switch)"
            ),
            Stop::DmabufOff { value } => {
                write!(f, "NCCL_DMABUF_ENABLE={value} turns dma-buf off, the only registration path here (nvidia-peermem is not loaded): unset it")
            }
        }
    }
}

type Vars = [(String, String)];

/// One rule: the variable it reads and when it stops the pair.
struct Rule {
    var: &'static str,
    stops: fn(&Vars, &PairInEnv<'_>) -> Option<Stop>,
}

/// The rules, in the order NCCL meets them: its network first, then the
/// NIC, the distance, the registration path.
const RULES: [Rule; 6] = [
    Rule { var: "NCCL_NET", stops: |v, _| sockets(v) },
    Rule { var: "NCCL_IB_DISABLE", stops: |v, _| ib_off(v) },
    Rule { var: "NCCL_NET_PLUGIN", stops: |v, p| plugin_missing(v, p.site) },
    Rule { var: "NCCL_IB_HCA", stops: hca_leaves_out },
    Rule { var: "NCCL_NET_GDR_LEVEL", stops: distance },
    Rule { var: "NCCL_DMABUF_ENABLE", stops: |v, p| p.dma_buf_only.then(|| dmabuf_disabled(v).map(|value| Stop::DmabufOff { value: value.to_owned() })).flatten() },
];

/// The variables the rules read: one of them that a job file leaves to
/// the running job leaves the verdict open.
pub const DECIDING: [&str; 6] = [RULES[0].var, RULES[1].var, RULES[2].var, RULES[3].var, RULES[4].var, RULES[5].var];

/// Why NCCL, run with the environment `vars`, will not use GPUDirect RDMA
/// for `pair` although the machine allows it; `None` when the environment
/// leaves it on. The first rule that stops it, in NCCL's order. The last
/// assignment of a name wins.
pub fn nccl_stops(vars: &Vars, pair: &PairInEnv<'_>) -> Option<Stop> {
    RULES.iter().find_map(|r| (r.stops)(vars, pair))
}

/// Why `vars` turn NCCL's RDMA transport off for every NIC (`NCCL_NET`
/// naming sockets, `NCCL_IB_DISABLE`); `None` when they leave it on.
pub fn transport_off(vars: &Vars) -> Option<Stop> {
    sockets(vars).or_else(|| ib_off(vars))
}

fn sockets(vars: &Vars) -> Option<Stop> {
    var(vars, "NCCL_NET").filter(|v| is_tcp_network(v)).map(|v| Stop::Sockets { value: v.to_owned() })
}

fn ib_off(vars: &Vars) -> Option<Stop> {
    var(vars, "NCCL_IB_DISABLE").filter(|v| ib_disabled(v)).map(|v| Stop::IbDisabled { value: v.to_owned() })
}

/// Whether `NCCL_NET=value` names a network only a plugin provides (not
/// sockets, not NCCL's built-in IB).
pub fn plugin_network(value: &str) -> bool {
    !is_tcp_network(value) && !value.trim().eq_ignore_ascii_case("ib")
}

/// `NCCL_NET` names a network only a plugin provides and the plugin
/// library NCCL would load is not on `site` (NCCL then fails "to
/// initialize any NET plugin"; it does not fall back). `None` when the
/// plugins were not looked for.
fn plugin_missing(vars: &Vars, site: &Site) -> Option<Stop> {
    plugin_missing_for(var(vars, "NCCL_NET")?, var(vars, "NCCL_NET_PLUGIN"), site)
}

/// [`plugin_missing`] for `NCCL_NET=net` and `NCCL_NET_PLUGIN=plugin`.
pub(super) fn plugin_missing_for(net: &str, plugin: Option<&str>, site: &Site) -> Option<Stop> {
    if !plugin_network(net) {
        return None;
    }
    let libs = site.net_libs.as_ref()?;
    let names = plugin_names(plugin);
    if names.iter().any(|n| libs.find(n).is_some()) {
        return None;
    }
    let tried = if names.is_empty() { "no plugin (NCCL_NET_PLUGIN=none)".to_owned() } else { names.join(" or ") };
    Some(Stop::PluginMissing { net: net.to_owned(), tried })
}

fn hca_leaves_out(vars: &Vars, pair: &PairInEnv<'_>) -> Option<Stop> {
    var(vars, "NCCL_IB_HCA").filter(|v| !hca_selects(v, pair.nic)).map(|v| Stop::HcaLeavesOut { value: v.to_owned(), nic: pair.nic.to_owned() })
}

fn distance(vars: &Vars, pair: &PairInEnv<'_>) -> Option<Stop> {
    let limit = gpudirect::topology::gdr_limit(vars);
    if limit.env_used {
        let stops = match pair.level {
            Some(level) => !limit.allows(level),
            None => limit.limit.forbids_every_nic(),
        };
        let what = match pair.level {
            Some(level) => format!("allows GPUDirect RDMA only up to {}, and this pair is {level}", limit.limit),
            None => format!("allows GPUDirect RDMA only up to {}, shorter than any PCIe path", limit.limit),
        };
        return stops.then(|| Stop::LevelBelowPath { setting: limit.describe(), what });
    }
    // Unset, the limit is NCCL's own: the job runs staged by default.
    (pair.nccl_default == Some(false)).then(|| Stop::DefaultBelowPath {
        level: pair.level.map_or_else(|| "this pair's".to_owned(), |l| l.to_string()),
        // NCCL's own name for the path (it knows no NODE: that is PHB to it).
        value: pair.level.map_or_else(|| "PHB".to_owned(), |l| gpudirect::topology::nccl_path_type(l).to_string()),
    })
}

/// `NCCL_DMABUF_ENABLE`'s value when it turns dma-buf off (reads as 0).
pub fn dmabuf_disabled(vars: &Vars) -> Option<&str> {
    var(vars, "NCCL_DMABUF_ENABLE").filter(|v| param_int(v).used() == Some(0))
}

/// The path NCCL registers a pair's GPU memory by, in `vars`: the
/// library's first (`path`), except that with dma-buf turned off NCCL
/// uses peer memory where that is possible too (`dma_buf_only` false).
pub fn registration_path(vars: &Vars, path: RegistrationPath, dma_buf_only: bool) -> RegistrationPath {
    match path {
        RegistrationPath::DmaBuf if dmabuf_disabled(vars).is_some() && !dma_buf_only => RegistrationPath::PeerMemory,
        p => p,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The first rule in NCCL's order decides; each is typed; the deciding
    /// variables are the rules' own.
    #[test]
    fn the_first_rule_in_ncclss_order_decides() {
        let site = Site::default();
        let pair = PairInEnv { nic: "mlx5_0", level: Some(gpudirect::topology::PathLevel::Pix), dma_buf_only: true, nccl_default: Some(true), site: &site };
        let both = vars(&[("NCCL_IB_HCA", "mlx5_1"), ("NCCL_NET", "Socket")]);
        assert_eq!(nccl_stops(&both, &pair), Some(Stop::Sockets { value: "Socket".into() }));
        assert_eq!(nccl_stops(&vars(&[("NCCL_IB_HCA", "mlx5_1")]), &pair), Some(Stop::HcaLeavesOut { value: "mlx5_1".into(), nic: "mlx5_0".into() }));
        assert_eq!(nccl_stops(&vars(&[("NCCL_DMABUF_ENABLE", "0")]), &pair), Some(Stop::DmabufOff { value: "0".into() }));
        assert!(matches!(nccl_stops(&vars(&[("NCCL_NET_GDR_LEVEL", "LOC")]), &pair), Some(Stop::LevelBelowPath { .. })));
        assert_eq!(nccl_stops(&vars(&[("NCCL_IB_DISABLE", "yes")]), &pair), None, "strtoll reads yes as 0");
        assert_eq!(DECIDING, ["NCCL_NET", "NCCL_IB_DISABLE", "NCCL_NET_PLUGIN", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE"]);
    }

    /// With dma-buf off NCCL registers by peer memory where it can; where
    /// dma-buf is the only path, the path stays and the rule stops it.
    #[test]
    fn dma_buf_off_moves_ncclss_path_to_peer_memory_where_it_can() {
        let off = vars(&[("NCCL_DMABUF_ENABLE", "0")]);
        assert_eq!(registration_path(&off, RegistrationPath::DmaBuf, false), RegistrationPath::PeerMemory);
        assert_eq!(registration_path(&off, RegistrationPath::DmaBuf, true), RegistrationPath::DmaBuf);
        assert_eq!(registration_path(&[], RegistrationPath::DmaBuf, false), RegistrationPath::DmaBuf);
    }
}
