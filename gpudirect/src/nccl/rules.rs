//! NCCL's rules for using GPUDirect RDMA on one GPU–NIC pair the machine
//! allows, in a job's environment: one table, in the order NCCL meets
//! them (its network, the NIC, the distance, the registration path, the
//! direction), each rule typed ([`Stop`]) and worded once. `gpudirect
//! doctor` judges a job's environment by it, `gpudirect nccl-log` the
//! variables a log shows NCCL read, and the NCCL plugin says by it why a
//! connection was staged: the three cannot disagree on a variable.

use std::fmt;

use super::{ib_disabled, is_tcp_network, param_int, NicList};
use crate::topology::{gdr_limit, nccl_path_type, PathLevel};

/// The variables the rules read, in the table's order: one of them that
/// a job file leaves to the running job leaves a verdict open.
pub const DECIDING: [&str; 7] =
    ["NCCL_NET", "NCCL_IB_DISABLE", "NCCL_NET_PLUGIN", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE", "NCCL_NET_GDR_READ"];

/// A GPU–NIC pair as the rules weigh it.
#[derive(Clone, Copy, Debug, Default)]
pub struct Pair<'a> {
    /// The NIC's RDMA device name; `None` when the pair is not known (a
    /// log's environment, judged for every pair).
    pub nic: Option<&'a str>,
    /// Their PCIe relation in NCCL's view (the one that decides), when
    /// known.
    pub level: Option<PathLevel>,
    /// The relation to name in the wording, where it differs (nvidia-smi's
    /// `NODE` is NCCL's `PHB`); `None`: `level`.
    pub shown: Option<PathLevel>,
    /// dma-buf is the only registration path (no peer memory).
    pub dma_buf_only: bool,
    /// `NCCL_NET` names a plugin's network and the plugin NCCL would load
    /// is not on the machine: the names it would try.
    pub plugin_missing: Option<&'a str>,
    /// Which direction is judged: sends need GPUDirect RDMA reads.
    pub sends: bool,
}

/// Why NCCL will not use GPUDirect RDMA on a pair: the variable, what
/// NCCL makes of it ([`Stop::cause`]) and the fix ([`Stop::fix`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `NCCL_NET` names a TCP socket transport.
    Sockets {
        /// `NCCL_NET`'s value.
        value: String,
    },
    /// `NCCL_IB_DISABLE` turns NCCL's IB/RoCE transport off.
    IbDisabled {
        /// `NCCL_IB_DISABLE`'s value.
        value: String,
    },
    /// `NCCL_NET` names a plugin's network and no plugin NCCL would load
    /// is on the machine: NCCL stops at initialization.
    PluginMissing {
        /// `NCCL_NET`'s value.
        net: String,
        /// The libraries NCCL would try.
        tried: String,
    },
    /// `NCCL_IB_HCA` leaves the pair's NIC out.
    HcaLeavesOut {
        /// `NCCL_IB_HCA`'s value.
        value: String,
        /// The pair's NIC.
        nic: String,
    },
    /// `NCCL_NET_GDR_LEVEL` is below the pair's distance (or below any
    /// PCIe path).
    LevelBelowPath {
        /// The setting as NCCL reads it (`NCCL_NET_GDR_LEVEL=2 (= PXB)`).
        setting: String,
        /// What it allows, against the pair.
        what: String,
    },
    /// Unset, NCCL's default distance (PXB) is below the pair's.
    DefaultBelowPath {
        /// The pair's distance.
        level: String,
        /// The `NCCL_NET_GDR_LEVEL` that would reach it.
        value: String,
    },
    /// `NCCL_DMABUF_ENABLE` turns off dma-buf, the pair's only path.
    DmabufOff {
        /// `NCCL_DMABUF_ENABLE`'s value.
        value: String,
    },
    /// `NCCL_NET_GDR_READ` turns GPUDirect RDMA reads off: sends go from
    /// host memory.
    GdrReadOff {
        /// `NCCL_NET_GDR_READ`'s value.
        value: String,
    },
}

impl Stop {
    /// The variable the rule reads.
    pub fn variable(&self) -> &'static str {
        match self {
            Stop::Sockets { .. } | Stop::PluginMissing { .. } => "NCCL_NET",
            Stop::IbDisabled { .. } => "NCCL_IB_DISABLE",
            Stop::HcaLeavesOut { .. } => "NCCL_IB_HCA",
            Stop::LevelBelowPath { .. } | Stop::DefaultBelowPath { .. } => "NCCL_NET_GDR_LEVEL",
            Stop::DmabufOff { .. } => "NCCL_DMABUF_ENABLE",
            Stop::GdrReadOff { .. } => "NCCL_NET_GDR_READ",
        }
    }

    /// Whether it stops only the sends (receives keep GPUDirect RDMA).
    pub fn sends_only(&self) -> bool {
        matches!(self, Stop::GdrReadOff { .. })
    }

    /// What NCCL makes of the setting.
    pub fn cause(&self) -> String {
        match self {
            Stop::Sockets { value } => format!("NCCL_NET={value} selects a TCP socket transport, which stages every transfer through host memory"),
            Stop::IbDisabled { value } => format!("NCCL_IB_DISABLE={value} turns NCCL's InfiniBand/RoCE transport off: it uses sockets, through host memory"),
            Stop::PluginMissing { net, tried } => format!(
                "NCCL_NET={net} names a network only a plugin provides, and NCCL would load {tried}, which is not in the library directories here: \
                 NCCL stops at initialization (\"Failed to initialize any NET plugin\")"
            ),
            Stop::HcaLeavesOut { value, nic } => format!("NCCL_IB_HCA={value} leaves out {nic}"),
            Stop::LevelBelowPath { setting, what } => format!("{setting} {what}"),
            Stop::DefaultBelowPath { level, .. } => {
                format!("NCCL's default NCCL_NET_GDR_LEVEL (PXB) stops short of this {level} path, so NCCL stages through host memory")
            }
            Stop::DmabufOff { value } => format!("NCCL_DMABUF_ENABLE={value} turns dma-buf off, the only registration path here (nvidia-peermem is not loaded)"),
            Stop::GdrReadOff { value } => {
                format!("NCCL_NET_GDR_READ={value} turns GPUDirect RDMA reads off: NCCL sends from host memory (receives keep GPUDirect RDMA)")
            }
        }
    }

    /// What to do.
    pub fn fix(&self) -> String {
        match self {
            Stop::Sockets { .. } | Stop::IbDisabled { .. } | Stop::DmabufOff { .. } => "unset it".to_owned(),
            Stop::PluginMissing { net, .. } => format!("install the plugin that provides {net:?}, or unset NCCL_NET"),
            Stop::HcaLeavesOut { nic, .. } => format!("set NCCL_IB_HCA=={nic}:1, or add it, or unset NCCL_IB_HCA"),
            Stop::LevelBelowPath { .. } => "unset it: NCCL's default is PXB".to_owned(),
            Stop::DefaultBelowPath { value, .. } => format!(
                "set NCCL_NET_GDR_LEVEL={value} where that path carries peer-to-peer traffic well, or pair the GPU with a NIC under its PCIe switch"
            ),
            Stop::GdrReadOff { .. } => "unset NCCL_NET_GDR_READ (or set it to 1)".to_owned(),
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stop::DmabufOff { .. } => write!(f, "{}: {}", self.cause(), self.fix()),
            _ => write!(f, "{} ({})", self.cause(), self.fix()),
        }
    }
}

type Vars = [(String, String)];

/// The value NCCL sees for `name` in `vars`: the last assignment wins.
pub fn var<'a>(vars: &'a Vars, name: &str) -> Option<&'a str> {
    vars.iter().rev().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// What a rule decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    /// Which network NCCL uses, and whether it can load it.
    Network,
    /// Which NICs it opens.
    Nic,
    /// Whether a connection on that NIC registers GPU memory.
    Registration,
}

/// One rule: the variable it reads, what it decides, and when it stops
/// the pair.
struct Rule {
    var: &'static str,
    stage: Stage,
    stops: fn(&Vars, &Pair<'_>) -> Option<Stop>,
}

/// The rules, in the order NCCL meets them.
const RULES: [Rule; 7] = [
    Rule { var: DECIDING[0], stage: Stage::Network, stops: |v, _| sockets(v) },
    Rule { var: DECIDING[1], stage: Stage::Network, stops: |v, _| ib_off(v) },
    Rule { var: DECIDING[2], stage: Stage::Network, stops: plugin_missing },
    Rule { var: DECIDING[3], stage: Stage::Nic, stops: hca_leaves_out },
    Rule { var: DECIDING[4], stage: Stage::Registration, stops: distance },
    Rule {
        var: DECIDING[5],
        stage: Stage::Registration,
        stops: |v, p| p.dma_buf_only.then(|| dmabuf_disabled(v).map(|value| Stop::DmabufOff { value: value.to_owned() })).flatten(),
    },
    Rule { var: DECIDING[6], stage: Stage::Registration, stops: |v, p| p.sends.then(|| gdr_read_off(v)).flatten() },
];

/// Why NCCL, run with the environment `vars`, will not use GPUDirect RDMA
/// for `pair` although the machine allows it; `None` when the environment
/// leaves it on. The first rule that stops it, in NCCL's order.
pub fn stops(vars: &Vars, pair: &Pair<'_>) -> Option<Stop> {
    debug_assert!(RULES.iter().map(|r| r.var).eq(DECIDING));
    RULES.iter().find_map(|r| (r.stops)(vars, pair))
}

/// [`stops`] for a connection NCCL already set up on a network and NIC
/// (a network plugin judging its own connection): only the rules that
/// decide whether it registers GPU memory.
pub fn registration_stops(vars: &Vars, pair: &Pair<'_>) -> Option<Stop> {
    RULES.iter().filter(|r| r.stage == Stage::Registration).find_map(|r| (r.stops)(vars, pair))
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

fn plugin_missing(vars: &Vars, pair: &Pair<'_>) -> Option<Stop> {
    let net = var(vars, "NCCL_NET").filter(|n| plugin_network(n))?;
    pair.plugin_missing.map(|tried| Stop::PluginMissing { net: net.to_owned(), tried: tried.to_owned() })
}

fn hca_leaves_out(vars: &Vars, pair: &Pair<'_>) -> Option<Stop> {
    let nic = pair.nic?;
    var(vars, "NCCL_IB_HCA").filter(|v| !NicList::parse(v).selects(nic, 1)).map(|v| Stop::HcaLeavesOut { value: v.to_owned(), nic: nic.to_owned() })
}

fn distance(vars: &Vars, pair: &Pair<'_>) -> Option<Stop> {
    let limit = gdr_limit(vars);
    let shown = pair.shown.or(pair.level);
    if limit.env_used {
        let stops = match pair.level {
            Some(level) => !limit.allows(level),
            None => limit.limit.forbids_every_nic(),
        };
        let what = match shown {
            Some(level) => format!("allows GPUDirect RDMA only up to {}, and this pair is {level}", limit.limit),
            None => format!("allows GPUDirect RDMA only up to {}, shorter than any PCIe path", limit.limit),
        };
        return stops.then(|| Stop::LevelBelowPath { setting: limit.describe(), what });
    }
    // Unset, the limit is NCCL's own: the job runs staged by default.
    let level = pair.level?;
    (!limit.allows(level)).then(|| Stop::DefaultBelowPath {
        level: shown.unwrap_or(level).to_string(),
        // NCCL's own name for the path (it knows no NODE: that is PHB to it).
        value: nccl_path_type(level).to_string(),
    })
}

/// `NCCL_DMABUF_ENABLE`'s value when it turns dma-buf off (reads as 0).
pub fn dmabuf_disabled(vars: &Vars) -> Option<&str> {
    var(vars, "NCCL_DMABUF_ENABLE").filter(|v| param_int(v).used() == Some(0))
}

fn gdr_read_off(vars: &Vars) -> Option<Stop> {
    var(vars, "NCCL_NET_GDR_READ").filter(|v| param_int(v).used() == Some(0)).map(|v| Stop::GdrReadOff { value: v.to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// The first rule in NCCL's order decides; each is typed and names
    /// its variable.
    #[test]
    fn the_first_rule_in_nccl_s_order_decides() {
        let pair = Pair { nic: Some("mlx5_0"), level: Some(PathLevel::Pix), shown: None, dma_buf_only: true, plugin_missing: None, sends: true };
        let both = vars(&[("NCCL_IB_HCA", "mlx5_1"), ("NCCL_NET", "Socket")]);
        assert_eq!(stops(&both, &pair), Some(Stop::Sockets { value: "Socket".into() }));
        assert_eq!(stops(&vars(&[("NCCL_IB_HCA", "mlx5_1")]), &pair), Some(Stop::HcaLeavesOut { value: "mlx5_1".into(), nic: "mlx5_0".into() }));
        assert_eq!(stops(&vars(&[("NCCL_DMABUF_ENABLE", "0")]), &pair), Some(Stop::DmabufOff { value: "0".into() }));
        assert!(matches!(stops(&vars(&[("NCCL_NET_GDR_LEVEL", "LOC")]), &pair), Some(Stop::LevelBelowPath { .. })));
        assert_eq!(stops(&vars(&[("NCCL_IB_DISABLE", "yes")]), &pair), None, "strtoll reads yes as 0");
        assert_eq!(stops(&vars(&[("NCCL_NET_GDR_READ", "0x0")]), &pair).map(|s| s.variable()), Some("NCCL_NET_GDR_READ"));
        assert_eq!(stops(&vars(&[("NCCL_NET_GDR_READ", "0")]), &Pair { sends: false, ..pair }), None, "receives need no reads");
        // Without a known pair, only what holds for every pair.
        let unplaced = Pair::default();
        assert_eq!(stops(&vars(&[("NCCL_IB_HCA", "mlx5_1")]), &unplaced), None);
        assert!(matches!(stops(&vars(&[("NCCL_NET_GDR_LEVEL", "00")]), &unplaced), Some(Stop::LevelBelowPath { .. })));
        assert_eq!(stops(&vars(&[("NCCL_NET_GDR_LEVEL", "PIX")]), &unplaced), None);
        // NCCL knows no NODE: named as nvidia-smi names it, the fix says
        // the value NCCL reads.
        let node = Pair { level: Some(PathLevel::Phb), shown: Some(PathLevel::Node), ..pair };
        let why = stops(&[], &node).unwrap().to_string();
        assert!(why.contains("this NODE path") && why.contains("set NCCL_NET_GDR_LEVEL=PHB "), "{why}");
        // A connection already on a network and NIC: only registration.
        let off = vars(&[("NCCL_IB_DISABLE", "1"), ("NCCL_NET_GDR_LEVEL", "LOC")]);
        assert!(matches!(registration_stops(&off, &pair), Some(Stop::LevelBelowPath { .. })));
        assert!(matches!(stops(&off, &pair), Some(Stop::IbDisabled { .. })));
        for s in [Stop::Sockets { value: "Socket".into() }, Stop::GdrReadOff { value: "0".into() }] {
            assert_eq!(s.to_string(), format!("{} ({})", s.cause(), s.fix()));
        }
    }
}
