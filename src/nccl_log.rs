//! `gpudirect nccl-log`: did GPUDirect RDMA carry NCCL's network traffic?
//!
//! GPUDirect RDMA fails open: when it is unavailable NCCL quietly stages
//! every network transfer through host memory and the job merely runs at
//! about half the bandwidth. The only reliable trace is in an
//! `NCCL_DEBUG=INFO` log: each network connection line
//! (`Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA`) ends in
//! `/GDRDMA` exactly when that connection registers GPU memory with the NIC.
//! [`explain_reader`] reads such a log (NCCL 2.4 `Ring` lines through 2.2x
//! `Channel NN/N` lines, with host names, stripped prefixes or launcher
//! prefixes such as `[1,3]<stdout>:`; NCCL 2.0-2.3 wording such as `Using
//! internal Network Socket` and `host:pid:tid [dev] INFO` without `NCCL`;
//! terminal pastes with several records glued on one line or one record
//! broken across two) and says whether it was used, per rank and per
//! direction, what would settle it when the log cannot, and what to check
//! next.
//!
//! # Verdict rules
//! 1. NET connection lines decide when present: all `/GDRDMA` → used; none →
//!    not used; a mix → partial, naming the ranks (host, GPU) and directions
//!    on each side.
//!    A NET connection between GPUs of one host counts like any other.
//! 2. Without NET connection lines, these settle "not used": the socket
//!    transport (`Using network Socket`, `NET/Socket : Using`, a
//!    `*Socket` plugin, or such a plugin's `Connected after N retries` /
//!    `Accepted data socket N` lines), a line in which a plugin says GDR is disabled or
//!    unsupported, `GPU Direct RDMA Disabled` on every per-HCA / per-GPU
//!    line (no `Enabled` anywhere), `NCCL_NET_GDR_LEVEL` at a limit below
//!    `PIX` (`LOC`, `0`, `00`: read as NCCL reads it, [`gpudirect::nccl`],
//!    so `loc` is ignored), `NCCL_NET` naming a TCP transport (`Socket`,
//!    `FastSocket`), `NCCL_IB_DISABLE` non-zero with NCCL's internal
//!    network, or (a WARN-only log) libibverbs failing to load with no
//!    plugin loaded.
//!    A log of one node (every `nNodes` 1, or one rank) had no inter-node
//!    traffic: its headline says what traffic between nodes *would* do,
//!    and when it cannot tell, it says no one-node run can show it. A log
//!    that does not show the run spanned nodes (no `nNodes` above 1) says
//!    what *would* happen too, never that inter-node traffic went through
//!    host memory. A start-up listing of networks is not a connection:
//!    `NET/Socket` listed beside an RDMA network is not a socket run.
//! 0. Before all of these: the lines of gpudirect's own NCCL plugin
//!    (`NET/GPUDirect : GPU2 -> mlx5_3:1: GPUDirect RDMA via dma-buf`, `...
//!    staged through host memory: CAUSE. Fix: FIX`, `refusing to stage
//!    ...`; typed in [`gpudirect::nccl::PluginLine`]) decide where present:
//!    a refusal → not used (NCCL stopped); every GPU connection via
//!    GPUDirect RDMA → used; none → not used; a mix → partial. The
//!    plugin's per-NIC byte counts are evidence, and its fixes are causes.
//! 3. Anything else is "cannot tell", with the setting or line that would
//!    settle it. `DMA-BUF is available`, the `use ring PXN 0 GDR 1` summary
//!    and GDRCopy lines never count as evidence (see [`Misleading`]);
//!    `Enabled for HCA` alone only says a NIC could. A GPU whose per-GPU
//!    `Enabled` lines all end in `read 0` (the check for receives) keeps its
//!    sends off GPUDirect RDMA: at most partial, said in the evidence. An IB
//!    completion error 4 (local protection, often ACS breaking GDR) is
//!    reported as a cause.
//!
//! # JSON (`--json`)
//! The [`Report`] serialises with serde; field names are stable and new
//! fields are only ever added. Line numbers are 1-based in the input given.
//! - `verdict`: `"used"`, `"partial"`, `"not-used"` or `"unknown"`.
//! - `headline`: the verdict sentence (first line of the text output).
//! - `evidence`: sentences naming the lines that decided the verdict.
//! - `settle_with`: for `unknown`, the setting or line that would settle it
//!   (otherwise `null`).
//! - `nccl_versions`: distinct `NCCL version` strings, e.g. `"2.5.7+cuda10.0"`.
//! - `networks`: distinct `Using network <name>` names.
//! - `net_devices`: the lines where a network plugin lists its devices
//!   (`NET/<plugin> : Using [0]mlx5_0:1/RoCE ...`, 2.27's `NET/IB :
//!   [0]...`), each quoted as printed in `printed` ([`NetDevices`]); lines
//!   naming no device (`Using internal network plugin`, `Using 2 threads`,
//!   `Using [RO]; OOB eth0`) are not NIC lists.
//! - `providers`: aws-ofi-nccl's selected libfabric providers ([`Provider`]).
//! - `plugin_dmabuf`: aws-ofi-nccl's `Support for DMA-BUF registrations`
//!   (`false` when any rank said so), or `null`.
//! - `gdr_support`: per-HCA / per-GPU `GPU Direct RDMA Enabled|Disabled`
//!   lines ([`GdrSupport`]), with the registration path (`mechanism`:
//!   `DMABUF`, `nvidia-peermem`) and the per-GPU `read` flag when printed.
//! - `environment`: `NAME set by environment to VALUE` lines ([`EnvSetting`]);
//!   `set_by_plugin` is the line where a plugin set the variable itself
//!   (aws-ofi-nccl's `Setting NCCL_TOPO_FILE environment variable to ...`).
//! - `environment_judged`: those variables judged by the doctor's rules
//!   ([`EnvJudgement`]: `check`, `status`, `summary`), filled in by the
//!   command; empty when the log shows none.
//! - `ranks`: per-rank summary of its connections ([`RankSummary`]).
//! - `connections`: every distinct connection line ([`Connection`]), the
//!   per-rank, per-channel transports; `channel` is `null` for a fragment
//!   whose head was cut off (`9[1a000] -> 2[6b000] [send] via ...`, or a
//!   launcher such as Ray interleaving workers' output mid-line).
//! - `misleading`: lines that look like evidence but are not ([`Misleading`]).
//! - `warnings`: distinct `NCCL WARN` lines ([`LogLine`], at most 200).
//! - `causes`: what to check next, most specific first.
//! - `lines_read`, `nccl_lines`: lines in the input, and the NCCL records
//!   in them (an `NCCL INFO` / `NCCL WARN` marker each, or NCCL 2.0-2.2's
//!   bare `INFO` / `WARN` after a full prefix).
//! - `lines_cut`, `not_kept`: lines longer than 64 KiB (only their start
//!   is read), and distinct facts past the limits that keep memory bounded
//!   (50,000 connections, 10,000 other lines), counted but not listed.

mod parse;
mod plugin;
mod scan;
#[cfg(test)]
mod tests;
mod text;
mod verdict;

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use scan::{CompletionError, Scan};

/// Whether GPUDirect RDMA carried the network traffic seen in a log.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Every NET connection in the log used GPUDirect RDMA.
    Used,
    /// Some NET connections (ranks, GPUs or directions) used it, others
    /// went through host memory.
    Partial,
    /// Network traffic demonstrably went through host memory.
    NotUsed,
    /// The log cannot settle it; [`Report::settle_with`] says what would.
    Unknown,
}

/// Which side of a connection a line describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Direction {
    /// `[send]`: the line is printed by the sending rank. With GDR the NIC
    /// reads GPU memory.
    Send,
    /// `[receive]`: printed by the receiving rank. With GDR the NIC writes
    /// GPU memory.
    Receive,
    /// No direction tag (intra-node transports).
    Unspecified,
}

impl Direction {
    fn word(self) -> &'static str {
        match self {
            Direction::Send => "send",
            Direction::Receive => "receive",
            Direction::Unspecified => "unspecified",
        }
    }
}

/// The kind of transport after `via`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// `NET/<plugin>/...`: through a NIC (IB, RoCE, sockets, plugins), the
    /// only kind GPUDirect RDMA applies to.
    Net,
    /// `P2P/...`: GPU to GPU inside a node (NVLink or PCIe).
    P2p,
    /// `SHM` or `direct shared memory`: through host memory inside a node.
    Shm,
    /// Anything else NCCL printed after `via`.
    Other,
}

/// One line of the input, for quoting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LogLine {
    /// 1-based line number in the input.
    pub line: usize,
    /// Host name from NCCL's prefix, when present.
    pub host: Option<String>,
    /// The message after NCCL's prefix (clipped to 300 characters).
    pub text: String,
}

/// A libfabric provider the OFI plugin selected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Provider {
    /// 1-based line number.
    pub line: usize,
    /// Host name from the prefix, when present.
    pub host: Option<String>,
    /// The provider (`efa`, `tcp`, `verbs;ofi_rxm`).
    pub name: String,
    /// NICs it found, when said.
    pub nics: Option<u32>,
}

/// A `NET/<plugin> : Using ...` line: the NICs a network plugin chose.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetDevices {
    /// 1-based line number.
    pub line: usize,
    /// Host name from the prefix, when present.
    pub host: Option<String>,
    /// Plugin name: `IB`, `Socket`, `IBext`, ...
    pub net: String,
    /// Device names in the list (`mlx5_0`, `eth0`).
    pub devices: Vec<String>,
    /// Everything after `Using `.
    pub text: String,
    /// The line as NCCL printed it (after the prefix), quoted as it is.
    pub printed: String,
}

/// A `GPU Direct RDMA Enabled|Disabled for HCA n 'name'` line (NIC side) or
/// `... for GPU g / HCA n (distance ...)` line (GPU-NIC topology check).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GdrSupport {
    /// 1-based line number.
    pub line: usize,
    /// Host name from the prefix, when present.
    pub host: Option<String>,
    /// Plugin name from `NET/<plugin> :`, when printed.
    pub net: Option<String>,
    /// `Enabled` (true) or `Disabled` (false).
    pub enabled: bool,
    /// HCA index.
    pub hca: Option<u64>,
    /// HCA name, per-HCA form only.
    pub hca_name: Option<String>,
    /// GPU as printed (`2[2]`, `1b000`), per-GPU form only.
    pub gpu: Option<String>,
    /// What follows: `(no module)`, `(distance 3 >= 2)`, `..., read 0`.
    pub detail: Option<String>,
    /// The registration path NCCL 2.19+ name on per-HCA lines: `DMABUF`
    /// or `nvidia-peermem`.
    pub mechanism: Option<String>,
    /// Per-GPU lines from NCCL 2.5 on end in `read 1` when the check was
    /// for sends (the NIC reads GPU memory) and `read 0` for receives.
    pub read: Option<bool>,
}

/// A `NAME set by environment to VALUE` line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvSetting {
    /// 1-based line number of the first occurrence.
    pub line: usize,
    /// Variable name.
    pub name: String,
    /// Value, without the trailing period NCCL prints.
    pub value: String,
    /// The line where a network plugin set this variable itself
    /// (aws-ofi-nccl sets `NCCL_TOPO_FILE` for the instance types it
    /// knows): not the job's setting.
    pub set_by_plugin: Option<usize>,
}

/// One variable of the log's environment as the doctor judges it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EnvJudgement {
    /// The doctor's finding id (`env.nccl_ib_disable`).
    pub check: String,
    /// `ok`, `warn`, `fail` or `skipped`.
    pub status: String,
    /// The doctor's one-line judgement.
    pub summary: String,
}

/// One side of one channel connection, as NCCL printed it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Connection {
    /// 1-based line number.
    pub line: usize,
    /// Host name from the prefix, when present.
    pub host: Option<String>,
    /// Process id from the prefix, when present.
    pub pid: Option<u64>,
    /// CUDA device of the logging thread (`[n]` in the prefix).
    pub device: Option<u64>,
    /// Channel (or 2.4 ring) number; `null` for a fragment of a line
    /// whose head was cut off (`9[1a000] -> 2[6b000] [send] via ...`).
    pub channel: Option<u64>,
    /// The number after `/` in `Channel 00/1` (connection index, 2.12+).
    pub sub: Option<u64>,
    /// Sending rank.
    pub from_rank: u64,
    /// Sending GPU as printed in brackets (index or PCI bus id).
    pub from_gpu: Option<String>,
    /// Receiving rank.
    pub to_rank: u64,
    /// Receiving GPU as printed in brackets.
    pub to_gpu: Option<String>,
    /// `[send]`, `[receive]` or none.
    pub direction: Direction,
    /// The rank whose side this is: the sender for send lines, the receiver
    /// for receive lines.
    pub rank: u64,
    /// That rank's GPU (bracket, else the prefix device).
    pub gpu: Option<String>,
    /// Kind of transport.
    pub transport: Transport,
    /// The transport as printed after `via` (`NET/IB/0/GDRDMA`, `P2P/IPC`).
    pub via: String,
    /// Network plugin name for NET transports (`IB`, `Socket`, `OFI`, ...).
    pub net: Option<String>,
    /// NIC index for NET transports.
    pub net_dev: Option<u64>,
    /// PXN proxy rank (`NET/IB/0(3)`), when printed.
    pub proxy_rank: Option<u64>,
    /// For NET transports, whether the line ends in `/GDRDMA`; `null`
    /// otherwise.
    pub gdr: Option<bool>,
    /// `/Shared` (shared network buffers for point-to-point operations).
    pub shared: bool,
}

/// What one rank's connection lines say.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RankSummary {
    /// Rank number.
    pub rank: u64,
    /// Host, when the prefix named it (the same rank number on two hosts
    /// means two communicators or runs and is listed twice).
    pub host: Option<String>,
    /// GPU as printed.
    pub gpu: Option<String>,
    /// Directions in which this rank has NET connections with `/GDRDMA`.
    pub net_with_gdr: Vec<Direction>,
    /// Directions in which it has NET connections without it.
    pub net_without_gdr: Vec<Direction>,
    /// Distinct transports (as printed after `via`) of its connections.
    pub transports: Vec<String>,
    /// Number of its connection lines.
    pub connections: usize,
}

/// A line that looks like evidence about GPUDirect RDMA but is not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Misleading {
    /// 1-based line number of the first occurrence.
    pub line: usize,
    /// The message.
    pub text: String,
    /// How many times the same message appears.
    pub count: usize,
    /// Why it was not used as evidence.
    pub why: String,
}

/// The explanation of one NCCL log.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The verdict.
    pub verdict: Verdict,
    /// The verdict as a sentence; the first line of the text output.
    pub headline: String,
    /// The lines that decided it, as sentences.
    pub evidence: Vec<String>,
    /// For [`Verdict::Unknown`], the setting or line that would settle it.
    pub settle_with: Option<String>,
    /// Distinct NCCL versions printed (`2.11.4+cuda11.4`).
    pub nccl_versions: Vec<String>,
    /// Distinct `Using network <name>` names.
    pub networks: Vec<String>,
    /// NIC lists the network plugins printed.
    pub net_devices: Vec<NetDevices>,
    /// aws-ofi-nccl's `Selected Provider is <name> (found N nics)` lines.
    pub providers: Vec<Provider>,
    /// aws-ofi-nccl's `Support for DMA-BUF registrations:` (false when any
    /// rank said false): whether the plugin registers GPU memory through
    /// dma-buf. `None` when no such line.
    pub plugin_dmabuf: Option<bool>,
    /// Per-HCA and per-GPU GPUDirect RDMA lines.
    pub gdr_support: Vec<GdrSupport>,
    /// Settings NCCL reported taking from the environment.
    pub environment: Vec<EnvSetting>,
    /// Those settings judged by the doctor's rules (the same judge as
    /// `gpudirect doctor`'s `env.*` findings), when the caller judged them:
    /// this module reads logs and judges nothing of the environment itself.
    pub environment_judged: Vec<EnvJudgement>,
    /// Per-rank summaries, ordered by rank.
    pub ranks: Vec<RankSummary>,
    /// Every distinct connection line, in input order.
    pub connections: Vec<Connection>,
    /// Lines not taken as evidence, and why.
    pub misleading: Vec<Misleading>,
    /// Distinct `NCCL WARN` lines (at most 200).
    pub warnings: Vec<LogLine>,
    /// What to check next, most specific first.
    pub causes: Vec<String>,
    /// Lines in the input.
    pub lines_read: usize,
    /// NCCL records: `NCCL INFO` / `NCCL WARN` markers (several records
    /// glued on one line count apart), and NCCL 2.0-2.2's bare `INFO` /
    /// `WARN` after a `host:pid:tid [dev]` prefix.
    pub nccl_lines: usize,
    /// Lines longer than 64 KiB, of which only the first 64 KiB were read.
    pub lines_cut: usize,
    /// Distinct facts past the limits (50,000 connections, 10,000 other
    /// lines): counted here, not listed.
    pub not_kept: usize,
}

const MAX_WARNINGS: usize = 200;
/// Lines kept per kind of internal evidence; the first ones are quoted.
const MAX_QUOTED: usize = 20;
const CLIP: usize = 300;

const SETTLE_SUBSYS: &str = "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET and keep \
     the lines printed while communicators connect: each 'Channel NN/N : a[x] -> b[y] \
     [send|receive] via NET/...' line ends in /GDRDMA exactly when that connection uses \
     GPUDirect RDMA, and 'NET/<plugin> : GPU Direct RDMA Enabled|Disabled for HCA n' (NET \
     subsystem) says whether each NIC can";

const WHY_DMABUF: &str = "says the GPU driver can export dma-buf handles; NCCL prints it \
     whether or not the NIC accepts them and whether or not any connection uses GPUDirect \
     RDMA";
const WHY_PXN_GDR: &str = "a communicator-wide setting printed after ring setup, even on \
     socket runs; it does not say which connections used GPUDirect RDMA: only the /GDRDMA \
     suffix of NET channel lines does";
const WHY_GDRCOPY: &str = "GDRCopy lets the CPU map GPU memory for small copies; it is not \
     the NIC reading or writing GPU memory";

/// [`explain_reader`] on a log in memory.
#[must_use]
pub fn explain(text: &str) -> Report {
    // Reading from memory cannot fail.
    explain_reader(text.as_bytes()).unwrap_or_else(|_| report(Scan::default()))
}

/// Reads an NCCL debug log from `reader` and explains whether GPUDirect
/// RDMA carried its network traffic. Text that is not an NCCL log yields
/// [`Verdict::Unknown`]. The log is streamed: memory stays bounded whatever
/// its size (one line of at most 64 KiB at a time, and at most 50,000
/// distinct connections and 10,000 other facts kept).
///
/// # Errors
/// The reader's I/O error.
pub fn explain_reader(reader: impl std::io::BufRead) -> std::io::Result<Report> {
    Ok(report(Scan::read(reader)?))
}

impl Report {
    /// The exit status `gpudirect nccl-log` gives this report: 0 used, 1
    /// not or only partly used, 3 cannot tell.
    pub fn exit_status(&self) -> u8 {
        match self.verdict {
            Verdict::Used => 0,
            Verdict::Partial | Verdict::NotUsed => 1,
            Verdict::Unknown => 3,
        }
    }
}

fn report(mut scan: Scan) -> Report {
    for e in &mut scan.env {
        e.set_by_plugin = scan.plugin_env.iter().find(|(n, v, _)| *n == e.name && *v == e.value).map(|(_, _, l)| *l);
    }
    let decision = verdict::decide(&scan);
    let causes = verdict::causes(&scan, &decision);
    let ranks = summarise_ranks(&scan.conns);
    Report {
        verdict: decision.verdict,
        headline: decision.headline,
        evidence: decision.evidence,
        settle_with: decision.settle_with,
        nccl_versions: scan.versions,
        networks: scan.networks.into_iter().map(|(name, _)| name).collect(),
        net_devices: scan.net_devices,
        providers: scan.providers,
        plugin_dmabuf: scan.plugin_dmabuf.map(|(s, _)| s),
        gdr_support: scan.support,
        environment: scan.env,
        environment_judged: Vec::new(),
        ranks,
        connections: scan.conns,
        misleading: scan.misleading,
        warnings: scan.warnings,
        causes,
        lines_read: scan.lines_read,
        nccl_lines: scan.nccl_lines,
        lines_cut: scan.lines_cut,
        not_kept: scan.not_kept,
    }
}

fn clip(text: &str) -> String {
    if text.chars().count() <= CLIP {
        text.to_string()
    } else {
        let mut s: String = text.chars().take(CLIP).collect();
        s.push('…');
        s
    }
}

impl Connection {
    fn describe(&self) -> String {
        let sub = self.sub.map(|s| format!("/{s}")).unwrap_or_default();
        let gpu = |g: &Option<String>| g.as_ref().map(|g| format!("[{g}]")).unwrap_or_default();
        let dir = match self.direction {
            Direction::Unspecified => String::new(),
            d => format!(" [{}]", d.word()),
        };
        format!(
            "line {}: channel {}{sub} : {}{} -> {}{}{dir} via {}",
            self.line,
            self.channel.map_or_else(|| "?".to_owned(), |c| format!("{c:02}")),
            self.from_rank,
            gpu(&self.from_gpu),
            self.to_rank,
            gpu(&self.to_gpu),
            self.via
        )
    }
}

fn quote(l: &LogLine) -> String {
    format!("line {}: '{}'", l.line, l.text)
}

fn summarise_ranks(conns: &[Connection]) -> Vec<RankSummary> {
    let mut by_rank: BTreeMap<(u64, Option<String>), RankSummary> = BTreeMap::new();
    for c in conns {
        let s = by_rank
            .entry((c.rank, c.host.clone()))
            .or_insert_with(|| RankSummary {
                rank: c.rank,
                host: c.host.clone(),
                gpu: c.gpu.clone(),
                net_with_gdr: Vec::new(),
                net_without_gdr: Vec::new(),
                transports: Vec::new(),
                connections: 0,
            });
        s.connections += 1;
        if !s.transports.contains(&c.via) {
            s.transports.push(c.via.clone());
        }
        let list = match c.gdr {
            Some(true) => &mut s.net_with_gdr,
            Some(false) => &mut s.net_without_gdr,
            None => continue,
        };
        if !list.contains(&c.direction) {
            list.push(c.direction);
            list.sort();
        }
    }
    by_rank.into_values().collect()
}

const HEAD_USED: &str = "GPUDirect RDMA was used";
const HEAD_PARTIAL: &str = "GPUDirect RDMA was partially used";
/// What "not used" costs is said with it: every byte crosses PCIe twice
/// (GPU to host, host to NIC) and shares host memory bandwidth.
const HEAD_NOT_USED: &str =
    "GPUDirect RDMA was NOT used: inter-node traffic went through host memory, crossing PCIe twice: expect about half the multi-node bandwidth";
/// A one-node log whose setup rules GPUDirect RDMA out.
const HEAD_NOT_USED_ONE_NODE: &str = "GPUDirect RDMA would NOT be used between nodes: this run was on one node, so no traffic crossed the network";
/// A log without connection lines that does not show the run spanned nodes.
const HEAD_NOT_USED_UNSPANNED: &str = "GPUDirect RDMA would NOT be used between nodes: this log does not show whether the run spanned nodes (no communicator with nNodes above 1)";
const HEAD_WOULD_STAGE: &str = "with this setup inter-node traffic would go through host memory, crossing PCIe twice, at about half the multi-node bandwidth";
/// The cost of a partial use, appended to its headline.
const PARTIAL_COST: &str = "the ranks without it move about half as much, and each collective waits for them";
const HEAD_UNKNOWN: &str = "cannot tell from this log whether GPUDirect RDMA was used";

fn describe_support(s: &GdrSupport) -> String {
    let mut out = String::new();
    if let Some(net) = &s.net {
        let _ = write!(out, "NET/{net} : ");
    }
    out.push_str("GPU Direct RDMA ");
    if let Some(m) = &s.mechanism {
        let _ = write!(out, "({m}) ");
    }
    out.push_str(if s.enabled { "Enabled for " } else { "Disabled for " });
    if let Some(g) = &s.gpu {
        let _ = write!(out, "GPU {g} / ");
    }
    if let Some(h) = s.hca {
        let _ = write!(out, "HCA {h}");
    }
    if let Some(name) = &s.hca_name {
        let _ = write!(out, " '{name}'");
    }
    if let Some(d) = &s.detail {
        let _ = write!(out, " {d}");
    }
    if let Some(h) = &s.host {
        let _ = write!(out, " on {h}");
    }
    out
}
