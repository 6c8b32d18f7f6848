//! One pass over the log: every line kind [`super::parse`] recognises,
//! collected and de-duplicated for the verdict rules.

use std::collections::{HashMap, HashSet};

use gpudirect::nccl::is_tcp_network;

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
}

impl Scan {
    pub(super) fn read(text: &str) -> Scan {
        let mut scan = Scan::default();
        // Logs repeat themselves (one copy per rank, per communicator, or a
        // paste twice); the explanation counts distinct facts.
        // Sets and index maps, not list scans, so a pathological input of
        // many distinct lines stays linear.
        let mut seen: HashSet<(u8, Option<String>, String)> = HashSet::new();
        let mut seen_conn = HashSet::new();
        let mut misleading_at: HashMap<String, usize> = HashMap::new();
        let mut error_at: HashMap<(u64, Option<String>), usize> = HashMap::new();
        scan.lines_read = text.lines().count();
        // Line numbers stay physical: glued records share their line's number.
        let records = text.lines().enumerate().flat_map(|(index, raw)| {
            parse::records(raw).into_iter().map(move |r| (index + 1, r))
        });
        for (n, record) in records {
            let (prefix, level, msg) = parse::split_line(record);
            if level != parse::Level::None {
                scan.nccl_lines += 1;
            }
            if msg.is_empty() {
                continue;
            }
            let here = |text: &str| LogLine {
                line: n,
                host: prefix.host.clone(),
                text: clip(text),
            };
            if let Some(v) = parse::parse_version(msg) {
                if seen.insert((3, None, v.clone())) {
                    scan.versions.push(v);
                }
            }
            if level == parse::Level::Warn
                && scan.warnings.len() < MAX_WARNINGS
                && seen.insert((0, None, msg.to_string()))
            {
                scan.warnings.push(here(msg));
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
                if seen_conn.insert(key) {
                    scan.conns.push(connection(n, &prefix, c));
                }
                continue;
            }
            if let Some(s) = parse::parse_support(msg) {
                if seen.insert((1, prefix.host.clone(), msg.to_string())) {
                    scan.support.push(GdrSupport {
                        line: n,
                        host: prefix.host.clone(),
                        net: s.net,
                        enabled: s.enabled,
                        hca: s.hca,
                        hca_name: s.hca_name,
                        gpu: s.gpu,
                        detail: s.detail,
                        mechanism: s.mechanism,
                        read: s.read,
                    });
                }
                continue;
            }
            if let Some((net, list)) = parse::parse_net_using(msg) {
                if seen.insert((2, prefix.host.clone(), msg.to_string())) {
                    scan.net_devices.push(NetDevices {
                        line: n,
                        host: prefix.host.clone(),
                        devices: parse::net_device_names(&list),
                        net,
                        text: clip(&list),
                    });
                }
                continue;
            }
            if let Some(name) = parse::parse_network(msg) {
                if seen.insert((4, None, name.to_string())) {
                    scan.networks.push((clip(name), here(msg)));
                }
                continue;
            }
            if parse::parse_tcp_connect(msg).is_some() {
                if scan.tcp_setup.len() < MAX_QUOTED {
                    scan.tcp_setup.push(here(msg));
                }
                continue;
            }
            if let Some((name, nics)) = parse::parse_provider(msg) {
                if seen.insert((7, None, name.clone())) {
                    scan.providers.push(Provider { line: n, host: prefix.host.clone(), name, nics });
                }
                continue;
            }
            if let Some(supported) = parse::parse_plugin_dmabuf(msg) {
                // A "false" on any rank is what matters; keep the first one.
                if scan.plugin_dmabuf.as_ref().is_none_or(|(s, _)| *s && !supported) {
                    scan.plugin_dmabuf = Some((supported, here(msg)));
                }
                continue;
            }
            if let Some((name, value)) = parse::parse_env(msg) {
                if seen.insert((5, Some(name.clone()), value.clone())) {
                    scan.env.push(EnvSetting {
                        line: n,
                        name,
                        value: clip(&value),
                    });
                }
                continue;
            }
            if let Some((status, vendor)) = parse::parse_completion_error(msg) {
                match error_at.get(&(status, vendor.clone())) {
                    Some(&i) => scan.completion_errors[i].count += 1,
                    None => {
                        error_at.insert((status, vendor.clone()), scan.completion_errors.len());
                        scan.completion_errors.push(CompletionError {
                            status,
                            vendor,
                            first: here(msg),
                            count: 1,
                        });
                    }
                }
                continue;
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
                match misleading_at.get(&text) {
                    Some(&i) => scan.misleading[i].count += 1,
                    None => {
                        misleading_at.insert(text.clone(), scan.misleading.len());
                        scan.misleading.push(Misleading {
                            line: n,
                            text,
                            count: 1,
                            why: why.to_string(),
                        });
                    }
                }
                continue;
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
                if scan.plugin_gdr_off.len() < MAX_QUOTED {
                    scan.plugin_gdr_off.push(here(msg));
                }
                continue;
            }
            if msg.contains("NET/IB") && msg.contains("No device found") {
                scan.no_ib_device.get_or_insert_with(|| here(msg));
            }
            if msg.contains("NET/Plugin") {
                if lower.contains("loaded") {
                    scan.plugin_loaded.get_or_insert_with(|| here(msg));
                } else if [
                    "no plugin found",
                    "could not find",
                    "using internal",
                    "cannot open",
                ]
                .iter()
                .any(|w| lower.contains(w))
                {
                    scan.internal_net.get_or_insert_with(|| here(msg));
                }
            }
            if [
                "reg_dmabuf_mr failed",
                "reg_mr failed",
                "failed to register",
            ]
            .iter()
            .any(|w| lower.contains(w))
                && scan.reg_failures.len() < MAX_QUOTED
            {
                scan.reg_failures.push(here(msg));
            }
            if msg.contains("GeForce") {
                scan.geforce.get_or_insert_with(|| here(msg));
            }
        }
        scan
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

