//! One pass over the log: every line kind [`super::parse`] recognises,
//! collected and de-duplicated for the verdict rules.

use std::collections::{HashMap, HashSet};

use gpudirect::nccl::{is_tcp_network, PluginLine};

use super::{
    clip, parse, quote, Connection, Direction, EnvSetting, GdrSupport, LogLine, Misleading,
    NetDevices, Provider, Transport, MAX_QUOTED, MAX_WARNINGS, WHY_DMABUF, WHY_GDRCOPY,
    WHY_PXN_GDR,
};

/// Everything recognised in one pass over the log.
#[derive(Default)]
pub(super) struct Scan {
    pub(super) lines_read: usize,
    pub(super) nccl_lines: usize,
    pub(super) versions: Vec<String>,
    pub(super) networks: Vec<(String, LogLine)>,
    pub(super) net_devices: Vec<NetDevices>,
    pub(super) support: Vec<GdrSupport>,
    pub(super) env: Vec<EnvSetting>,
    pub(super) conns: Vec<Connection>,
    pub(super) misleading: Vec<Misleading>,
    pub(super) warnings: Vec<LogLine>,
    pub(super) plugin_gdr_off: Vec<LogLine>,
    pub(super) providers: Vec<Provider>,
    pub(super) plugin_dmabuf: Option<(bool, LogLine)>,
    /// A TCP plugin connecting or accepting its data sockets.
    pub(super) tcp_setup: Vec<LogLine>,
    pub(super) completion_errors: Vec<CompletionError>,
    pub(super) reg_failures: Vec<LogLine>,
    pub(super) no_ib_device: Option<LogLine>,
    pub(super) internal_net: Option<LogLine>,
    pub(super) plugin_loaded: Option<LogLine>,
    pub(super) geforce: Option<LogLine>,
    /// `nNodes N` of each communicator (`comm 0x... rank r nRanks n nNodes
    /// N ...`), and the largest `nranks`/`nRanks` printed.
    pub(super) n_nodes: Vec<(u64, LogLine)>,
    pub(super) max_ranks: Option<u64>,
    /// `NET/IB : Failed to open libibverbs` (or NCCL's ibvwrap WARN): the
    /// IB transport cannot start.
    pub(super) no_libibverbs: Option<LogLine>,
    /// Variables a plugin set in NCCL's environment itself (aws-ofi-nccl's
    /// `Setting NCCL_TOPO_FILE environment variable to ...`): name, value,
    /// line.
    pub(super) plugin_env: Vec<(String, String, usize)>,
    /// gpudirect's NCCL plugin's own lines.
    pub(super) plugin: Vec<(PluginLine, LogLine)>,
    /// Distinct facts past the limits below: counted, not listed.
    pub(super) not_kept: usize,
    /// Lines longer than [`MAX_LINE`]: only their start was read.
    pub(super) lines_cut: usize,
    seen: Seen,
}

/// Memory stays bounded whatever the input: at most this many distinct
/// connection lines are kept (a 512-GPU job prints about 32,000), and
/// `MAX_FACTS` other facts (versions, support, device, environment lines,
/// ...), each clipped to 300 characters. Measured on 600,000 distinct
/// lines: 75 MB peak for the text report, 106 MB with `--json`.
const MAX_CONNECTIONS: usize = 50_000;
const MAX_FACTS: usize = 10_000;
/// Bytes read of one physical line; NCCL's lines are far shorter, a
/// terminal paste of glued records a few KiB.
pub(super) const MAX_LINE: usize = 64 * 1024;

/// What the de-duplication has met. Logs repeat themselves (one copy per
/// rank, per communicator, or a paste twice); the explanation counts
/// distinct facts. Sets and index maps, not list scans, so a pathological
/// input of many distinct lines stays linear.
#[derive(Default)]
struct Seen {
    facts: HashSet<(u8, Option<String>, String)>,
    conns: HashSet<ConnKey>,
    misleading_at: HashMap<String, usize>,
    error_at: HashMap<(u64, Option<String>), usize>,
}

/// A connection line's identity: host, pid, channel, sub-channel, ranks,
/// direction and transport.
type ConnKey = (Option<String>, Option<u64>, Option<u64>, Option<u64>, u64, u64, Direction, String);

impl Scan {
    /// Scans a log line by line from `reader`, holding at most
    /// [`MAX_LINE`] bytes of it at a time (the rest of a longer line is
    /// skipped and counted in `lines_cut`). Lines end at `\n`, a `\r`
    /// before it is dropped, and bytes that are not UTF-8 are replaced.
    pub(super) fn read(mut reader: impl std::io::BufRead) -> std::io::Result<Scan> {
        let mut scan = Scan::default();
        let mut line: Vec<u8> = Vec::new();
        let mut cut = false;
        loop {
            let buf = match reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if buf.is_empty() {
                if !line.is_empty() || cut {
                    scan.finish_line(&line, cut);
                }
                return Ok(scan);
            }
            let (chunk, end) = match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (&buf[..i], Some(i + 1)),
                None => (buf, None),
            };
            let room = MAX_LINE - line.len();
            cut |= chunk.len() > room;
            line.extend_from_slice(&chunk[..chunk.len().min(room)]);
            let used = end.unwrap_or(buf.len());
            reader.consume(used);
            if end.is_some() {
                if line.last() == Some(&b'\r') && !cut {
                    line.pop();
                }
                scan.finish_line(&line, cut);
                line.clear();
                cut = false;
            }
        }
    }

    fn finish_line(&mut self, bytes: &[u8], cut: bool) {
        if cut {
            self.lines_cut += 1;
        }
        self.line(&String::from_utf8_lossy(bytes));
    }

    /// Scans the next physical line. Line numbers stay physical: records
    /// glued on one line share its number.
    pub(super) fn line(&mut self, raw: &str) {
        self.lines_read += 1;
        let n = self.lines_read;
        for record in parse::records(raw) {
            self.record(n, record);
        }
    }

    /// Whether a fact of `kind` (from `host`) is new and there is room to
    /// keep it; what finds no room is counted in `not_kept`.
    fn first_time(&mut self, kind: u8, host: Option<String>, text: &str) -> bool {
        let key = (kind, host, clip(text));
        if self.seen.facts.contains(&key) {
            return false;
        }
        if self.seen.facts.len() >= MAX_FACTS {
            self.not_kept += 1;
            return false;
        }
        self.seen.facts.insert(key)
    }

    fn record(&mut self, n: usize, record: &str) {
        let (prefix, level, msg) = parse::split_line(record);
        if level != parse::Level::None {
            self.nccl_lines += 1;
        }
        if msg.is_empty() {
            return;
        }
        let here = |text: &str| LogLine {
            line: n,
            host: prefix.host.clone(),
            text: clip(text),
        };
        if let Some(v) = parse::parse_version(msg) {
            if self.first_time(3, None, &v) {
                self.versions.push(v);
            }
        }
        if level == parse::Level::Warn
            && self.warnings.len() < MAX_WARNINGS
            && self.first_time(0, None, msg)
        {
            self.warnings.push(here(msg));
        }
        if let Some(pl) = PluginLine::parse(msg) {
            if self.plugin.len() < MAX_FACTS && self.first_time(12, prefix.host.clone(), msg) {
                self.plugin.push((pl, here(msg)));
            }
            return;
        }
        if let Some(c) = parse::parse_connection(msg) {
            let key = (
                prefix.host.clone(),
                prefix.pid,
                c.channel,
                c.sub,
                c.from_rank,
                c.to_rank,
                c.direction,
                c.via.clone(),
            );
            if self.seen.conns.contains(&key) {
                return;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                self.not_kept += 1;
            } else {
                self.seen.conns.insert(key);
                self.conns.push(connection(n, &prefix, c));
            }
            return;
        }
        if let Some(s) = parse::parse_support(msg) {
            if self.first_time(1, prefix.host.clone(), msg) {
                self.support.push(GdrSupport { line: n, host: prefix.host.clone(), ..s });
            }
            return;
        }
        if let Some((net, list)) = parse::parse_net_using(msg) {
            if self.first_time(2, prefix.host.clone(), msg) {
                self.net_devices.push(NetDevices {
                    line: n,
                    host: prefix.host.clone(),
                    devices: parse::net_device_names(&list),
                    net,
                    text: clip(&list),
                    printed: clip(msg),
                });
            }
            return;
        }
        if let Some(nodes) = parse::parse_n_nodes(msg) {
            if self.n_nodes.len() < MAX_QUOTED && !self.n_nodes.iter().any(|(k, _)| *k == nodes) {
                self.n_nodes.push((nodes, here(msg)));
            }
        }
        if let Some(r) = parse::parse_n_ranks(msg) {
            self.max_ranks = Some(self.max_ranks.map_or(r, |m| m.max(r)));
        }
        if let Some((name, value)) = parse::parse_plugin_setenv(msg) {
            if self.plugin_env.len() < MAX_QUOTED {
                self.plugin_env.push((name, clip(&value), n));
            }
            return;
        }
        if let Some(name) = parse::parse_network(msg) {
            if self.first_time(4, None, name) {
                self.networks.push((clip(name), here(msg)));
            }
            return;
        }
        if parse::parse_tcp_connect(msg).is_some() {
            if self.tcp_setup.len() < MAX_QUOTED {
                self.tcp_setup.push(here(msg));
            }
            return;
        }
        if let Some((name, nics)) = parse::parse_provider(msg) {
            if self.first_time(7, None, &name) {
                self.providers.push(Provider { line: n, host: prefix.host.clone(), name, nics });
            }
            return;
        }
        if let Some(supported) = parse::parse_plugin_dmabuf(msg) {
            // A "false" on any rank is what matters; keep the first one.
            if self.plugin_dmabuf.as_ref().is_none_or(|(s, _)| *s && !supported) {
                self.plugin_dmabuf = Some((supported, here(msg)));
            }
            return;
        }
        if let Some((name, value)) = parse::parse_env(msg) {
            if self.first_time(5, Some(name.clone()), &value) {
                self.env.push(EnvSetting {
                    line: n,
                    name,
                    value: clip(&value),
                    set_by_plugin: None,
                });
            }
            return;
        }
        if let Some((status, vendor)) = parse::parse_completion_error(msg) {
            match self.seen.error_at.get(&(status, vendor.clone())) {
                Some(&i) => self.completion_errors[i].count += 1,
                None => {
                    self.seen.error_at.insert((status, vendor.clone()), self.completion_errors.len());
                    self.completion_errors.push(CompletionError {
                        status,
                        vendor,
                        first: here(msg),
                        count: 1,
                    });
                }
            }
            return;
        }
        let lower = msg.to_ascii_lowercase();
        let misleading = if msg.contains("DMA-BUF is available") {
            Some(WHY_DMABUF)
        } else if msg.contains("use ring PXN") && msg.contains("GDR") {
            Some(WHY_PXN_GDR)
        } else if lower.contains("gdrcopy") {
            Some(WHY_GDRCOPY)
        } else {
            None
        };
        if let Some(why) = misleading {
            let text = clip(msg);
            match self.seen.misleading_at.get(&text) {
                Some(&i) => self.misleading[i].count += 1,
                None => {
                    self.seen.misleading_at.insert(text.clone(), self.misleading.len());
                    self.misleading.push(Misleading {
                        line: n,
                        text,
                        count: 1,
                        why: why.to_string(),
                    });
                }
            }
            return;
        }
        let mentions_gdr = lower.contains("gdr")
            || lower.contains("gpudirect")
            || lower.contains("gpu direct");
        let says_off = ["disabl", "not supported", "unsupported", "not available"]
            .iter()
            .any(|w| lower.contains(w));
        // `NCCL_GDR_FLUSH_DISABLE` and friends tune GDR, they do not turn it off.
        // The rule is broad, so it only trusts lines NCCL (or its plugin)
        // printed itself: prose pasted around a log must not settle it.
        if level != parse::Level::None && mentions_gdr && says_off && !lower.contains("flush") {
            if self.plugin_gdr_off.len() < MAX_QUOTED {
                self.plugin_gdr_off.push(here(msg));
            }
            return;
        }
        if lower.contains("libibverbs") && ["failed to open", "cannot open", "could not open", "failed to load"].iter().any(|w| lower.contains(w)) {
            self.no_libibverbs.get_or_insert_with(|| here(msg));
        }
        if msg.contains("NET/IB") && msg.contains("No device found") {
            self.no_ib_device.get_or_insert_with(|| here(msg));
        }
        if msg.contains("NET/Plugin") {
            if lower.contains("loaded") {
                self.plugin_loaded.get_or_insert_with(|| here(msg));
            } else if [
                "no plugin found",
                "could not find",
                "using internal",
                "cannot open",
            ]
            .iter()
            .any(|w| lower.contains(w))
            {
                self.internal_net.get_or_insert_with(|| here(msg));
            }
        }
        if [
            "reg_dmabuf_mr failed",
            "reg_mr failed",
            "failed to register",
        ]
        .iter()
        .any(|w| lower.contains(w))
            && self.reg_failures.len() < MAX_QUOTED
        {
            self.reg_failures.push(here(msg));
        }
        if msg.contains("GeForce") {
            self.geforce.get_or_insert_with(|| here(msg));
        }
    }

    pub(super) fn env(&self, name: &str) -> Option<&EnvSetting> {
        self.env.iter().rev().find(|e| e.name == name)
    }

    pub(super) fn net_conns(&self) -> impl Iterator<Item = &Connection> {
        self.conns.iter().filter(|c| c.transport == Transport::Net)
    }

    /// Lines showing the socket transport was NCCL's network: `Using
    /// network Socket`, or a TCP plugin connecting its data sockets.
    pub(super) fn socket_evidence(&self) -> Vec<&LogLine> {
        self.networks
            .iter()
            .filter(|(name, _)| is_tcp_network(name))
            .map(|(_, l)| l)
            .chain(self.tcp_setup.iter().take(1))
            .collect()
    }

    /// Networks other than sockets named anywhere (`Using network IB`, a
    /// `NET/IB : Using` list, a non-socket NET connection).
    pub(super) fn rdma_network_named(&self) -> bool {
        self.networks.iter().any(|(name, _)| !is_tcp_network(name))
            || self.net_devices.iter().any(|d| !is_tcp_network(&d.net))
            || self.providers.iter().any(|p| !matches!(p.name.as_str(), "tcp" | "sockets" | "udp"))
            || self
                .net_conns()
                .any(|c| !c.net.as_deref().is_some_and(is_tcp_network))
    }

    /// Whether the log shows NCCL's network was TCP sockets: a socket
    /// connection or GDR line, or start-up lines that name sockets and no
    /// RDMA network (NCCL 2.4 lists both `NET/IB` and `NET/Socket` at
    /// start-up: a listing is not a connection).
    pub(super) fn socket_transport(&self) -> bool {
        ((!self.socket_evidence().is_empty() || !self.socket_devices().is_empty()) && !self.rdma_network_named())
            || self.net_conns().any(|c| c.net.as_deref().is_some_and(is_tcp_network))
            || self.support.iter().any(|s| s.net.as_deref().is_some_and(is_tcp_network))
    }

    /// Whether the run is shown to have spanned nodes: the line of a
    /// communicator with `nNodes` above 1.
    pub(super) fn spans_nodes(&self) -> Option<String> {
        self.n_nodes.iter().find(|(n, _)| *n > 1).map(|(n, l)| format!("{}: nNodes {n}", quote(l)))
    }

    /// The line showing this log is of one node: every communicator's
    /// `nNodes` is 1, or (with none printed) the largest rank count is 1.
    pub(super) fn single_node(&self) -> Option<String> {
        if !self.n_nodes.is_empty() {
            return self.n_nodes.iter().all(|(n, _)| *n == 1).then(|| format!("{}: nNodes 1", quote(&self.n_nodes[0].1)));
        }
        (self.max_ranks == Some(1)).then(|| "every communicator has one rank (nranks 1)".to_owned())
    }

    pub(super) fn socket_devices(&self) -> Vec<&NetDevices> {
        self.net_devices
            .iter()
            .filter(|d| is_tcp_network(&d.net))
            .collect()
    }
}

/// IB work-completion errors, grouped by status and vendor syndrome.
pub(super) struct CompletionError {
    pub(super) status: u64,
    pub(super) vendor: Option<String>,
    pub(super) first: LogLine,
    pub(super) count: usize,
}

impl CompletionError {
    /// `error 4, vendor err 81 (2 times; first line 1: '...')`.
    pub(super) fn describe(&self) -> String {
        let vendor = self
            .vendor
            .as_ref()
            .map(|v| format!(", vendor err {v}"))
            .unwrap_or_default();
        let times = if self.count > 1 {
            format!("{} times; first ", self.count)
        } else {
            String::new()
        };
        format!(
            "error {}{vendor} ({times}{})",
            self.status,
            quote(&self.first)
        )
    }

    pub(super) fn is_protection(&self) -> bool {
        self.status == 4
    }
}

pub(super) fn connection(line: usize, prefix: &parse::Prefix, c: parse::ConnLine) -> Connection {
    let (rank, gpu) = match c.direction {
        Direction::Receive => (c.to_rank, c.to_gpu.clone()),
        _ => (c.from_rank, c.from_gpu.clone()),
    };
    let gpu = gpu.or_else(|| prefix.device.map(|d| d.to_string()));
    let net = c.net.as_ref();
    Connection {
        line,
        host: prefix.host.clone(),
        pid: prefix.pid,
        device: prefix.device,
        channel: c.channel,
        sub: c.sub,
        from_rank: c.from_rank,
        from_gpu: c.from_gpu,
        to_rank: c.to_rank,
        to_gpu: c.to_gpu,
        direction: c.direction,
        rank,
        gpu,
        transport: c.transport,
        net: net.map(|n| n.name.clone()),
        net_dev: net.and_then(|n| n.dev),
        proxy_rank: net.and_then(|n| n.proxy_rank),
        gdr: net.map(parse::NetVia::gdr),
        shared: net.is_some_and(|n| n.flags.iter().any(|f| f.starts_with("Shared"))),
        via: c.via,
    }
}

