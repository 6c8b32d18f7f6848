//! Line-level recognisers for NCCL debug output.
//!
//! Every function here takes one line (or its message part) and either
//! recognises it or returns `None`; none of them may panic on any input,
//! because the explainer is fed whatever users paste. All slicing happens at
//! positions found by searching for ASCII text, which are always character
//! boundaries.

use super::{Direction, Transport};

/// What NCCL's own prefix (`host:pid:tid [dev] NCCL INFO`) said about a line.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Prefix {
    pub host: Option<String>,
    pub pid: Option<u64>,
    pub device: Option<u64>,
}

/// The level marker found on a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Level {
    Info,
    Warn,
    /// No `NCCL INFO` / `NCCL WARN` marker: a bare `NCCL version` line, a
    /// line whose prefix was stripped, or text from something else.
    None,
}

/// Splits a line into NCCL's prefix, its level and the message after the
/// marker. Without a marker the whole (trimmed) line is the message, so
/// recognisers still work on logs whose prefixes were cut off.
pub(super) fn split_line(line: &str) -> (Prefix, Level, &str) {
    let info = line.find("NCCL INFO");
    let warn = line.find("NCCL WARN");
    let (at, level) = match (info, warn) {
        (Some(i), Some(w)) if w < i => (w, Level::Warn),
        (Some(i), _) => (i, Level::Info),
        (None, Some(w)) => (w, Level::Warn),
        (None, None) => return (Prefix::default(), Level::None, line.trim()),
    };
    let msg = line[at + "NCCL INFO".len()..].trim();
    (parse_prefix(&line[..at]), level, msg)
}

/// Reads `host:pid:tid [dev]` from the text before the marker, ignoring a
/// launcher's own prefix (`[1,3]<stdout>:`, `[0] `, `0: `, `[default0]:`) and,
/// on WARN lines, the `file.cc:line` that follows the device.
fn parse_prefix(head: &str) -> Prefix {
    let mut prefix = Prefix::default();
    // The device is the last `[digits]` group; launcher prefixes come earlier
    // and are either not all digits (`[1,3]`) or followed by the host part.
    let mut search_end = head.len();
    let mut before = None;
    while let Some(open) = head[..search_end].rfind('[') {
        let inner = &head[open + 1..];
        if let Some(close) = inner.find(']') {
            let digits = &inner[..close];
            if !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()) {
                prefix.device = digits.parse().ok();
                before = Some(&head[..open]);
                break;
            }
        }
        search_end = open;
    }
    let Some(before) = before else { return prefix };
    let Some(token) = before.split_whitespace().last() else {
        return prefix;
    };
    let parts: Vec<&str> = token.split(':').collect();
    if parts.len() >= 3 {
        let pid = parts[parts.len() - 2];
        let tid = parts[parts.len() - 1];
        if is_digits(pid) && is_digits(tid) {
            prefix.pid = pid.parse().ok();
            let host = parts[parts.len() - 3];
            if !host.is_empty() {
                prefix.host = Some(host.to_string());
            }
        }
    }
    prefix
}

fn is_digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// Leading ASCII digits as a number, and the rest. `None` when there are no
/// digits or the number does not fit (a corrupted line is not a connection).
fn take_number(s: &str) -> Option<(u64, &str)> {
    let end = s
        .bytes()
        .position(|b| !b.is_ascii_digit())
        .unwrap_or(s.len());
    if end == 0 {
        return None;
    }
    Some((s[..end].parse().ok()?, &s[end..]))
}

/// An optional `[...]` right after a rank: the GPU as NCCL printed it (CUDA
/// or NVML index, or PCI bus id in 2.5-2.11).
fn take_bracket(s: &str) -> (Option<String>, &str) {
    if let Some(inner) = s.strip_prefix('[') {
        if let Some(close) = inner.find(']') {
            let content = &inner[..close];
            if !content.is_empty()
                && content.len() <= 32
                && content
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b':' || b == b'.')
            {
                return (Some(content.to_string()), &inner[close + 1..]);
            }
        }
    }
    (None, s)
}

/// One connection line as printed by NCCL, before the line's prefix is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ConnLine {
    pub channel: u64,
    pub sub: Option<u64>,
    pub from_rank: u64,
    pub from_gpu: Option<String>,
    pub to_rank: u64,
    pub to_gpu: Option<String>,
    pub direction: Direction,
    pub via: String,
    pub transport: Transport,
    pub net: Option<NetVia>,
}

/// The parts of a `via NET/<name>/<dev>[(proxy)][/GDRDMA][/Shared]` path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NetVia {
    pub name: String,
    pub dev: Option<u64>,
    pub proxy_rank: Option<u64>,
    pub flags: Vec<String>,
}

impl NetVia {
    /// NCCL appends `/GDRDMA` exactly when the connection registers GPU
    /// memory with the NIC; later versions may qualify it (`GDRDMA(PCI)`).
    pub fn gdr(&self) -> bool {
        self.flags.iter().any(|f| f.starts_with("GDRDMA"))
    }
}

/// Recognises `Ring 00 : 45 -> 46 [send] via NET/Socket/0` (2.4),
/// `Channel 00 : 3[4a000] -> 6[44000] [send] via NET/IB/0/GDRDMA` (2.5-2.11)
/// and `Channel 00/0 : 0[0] -> 1[0] [receive] via NET/IB/4` (2.12+), with or
/// without a prefix. Ring-order lines (`Channel 00/02 :    0   1   2`) and
/// anything else are rejected.
pub(super) fn parse_connection(msg: &str) -> Option<ConnLine> {
    for keyword in ["Channel ", "Ring "] {
        let mut from = 0;
        while let Some(found) = msg[from..].find(keyword) {
            let start = from + found + keyword.len();
            if let Some(conn) = parse_connection_at(&msg[start..]) {
                return Some(conn);
            }
            from = start;
        }
    }
    None
}

fn parse_connection_at(s: &str) -> Option<ConnLine> {
    let (channel, rest) = take_number(s)?;
    let (sub, rest) = match rest.strip_prefix('/') {
        Some(r) => {
            let (n, r) = take_number(r)?;
            (Some(n), r)
        }
        None => (None, rest),
    };
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let (from_rank, rest) = take_number(rest)?;
    let (from_gpu, rest) = take_bracket(rest);
    let rest = rest.trim_start().strip_prefix("->")?.trim_start();
    let (to_rank, rest) = take_number(rest)?;
    let (to_gpu, rest) = take_bracket(rest);
    let mut rest = rest.trim_start();
    let mut direction = Direction::Unspecified;
    for (tag, dir) in [
        ("[send]", Direction::Send),
        ("[receive]", Direction::Receive),
        ("[recv]", Direction::Receive),
    ] {
        if let Some(r) = rest.strip_prefix(tag) {
            direction = dir;
            rest = r.trim_start();
            break;
        }
    }
    let via = rest.strip_prefix("via ")?.trim();
    if via.is_empty() {
        return None;
    }
    let (via, transport, net) = classify_via(via);
    Some(ConnLine {
        channel,
        sub,
        from_rank,
        from_gpu,
        to_rank,
        to_gpu,
        direction,
        via,
        transport,
        net,
    })
}

/// Cuts the transport description out of the text after `via ` and says
/// what kind it is. Plugin names may contain spaces (`NET/AWS Libfabric/0`),
/// so the NET form is parsed by structure, not by whitespace.
fn classify_via(via: &str) -> (String, Transport, Option<NetVia>) {
    if let Some(body) = via.strip_prefix("NET/") {
        let name_end = body.find('/').unwrap_or(body.len());
        let name = body[..name_end].trim();
        if !name.is_empty() && name.len() <= 64 {
            let mut rest = &body[name_end..];
            let mut net = NetVia {
                name: name.to_string(),
                dev: None,
                proxy_rank: None,
                flags: Vec::new(),
            };
            if let Some(r) = rest.strip_prefix('/') {
                if let Some((dev, r)) = take_number(r) {
                    net.dev = Some(dev);
                    rest = r;
                    // 2.12+ with PXN: `NET/IB/0(3)` names the proxy rank.
                    if let Some(inner) = rest.strip_prefix('(') {
                        if let Some(close) = inner.find(')') {
                            let content = &inner[..close];
                            match content.parse() {
                                Ok(p) => net.proxy_rank = Some(p),
                                Err(_) => net.flags.push(format!("({content})")),
                            }
                            rest = &inner[close + 1..];
                        }
                    }
                }
            }
            while let Some(r) = rest.strip_prefix('/') {
                let end = r
                    .find(|c: char| c == '/' || c.is_whitespace())
                    .unwrap_or(r.len());
                if end == 0 {
                    break;
                }
                net.flags.push(r[..end].to_string());
                rest = &r[end..];
            }
            let consumed = via.len() - rest.len();
            return (via[..consumed].to_string(), Transport::Net, Some(net));
        }
    }
    // Trailing `comm 0x...` style annotations are not part of the transport.
    let via = via.split(" comm ").next().unwrap_or(via).trim();
    let transport = if via.starts_with("P2P") {
        Transport::P2p
    } else if via.starts_with("SHM") || via.starts_with("direct shared memory") {
        Transport::Shm
    } else {
        Transport::Other
    };
    (via.to_string(), transport, None)
}

/// The version after `NCCL version ` (`2.5.7+cuda10.0`), printed with or
/// without a prefix depending on NCCL_DEBUG level and version.
pub(super) fn parse_version(msg: &str) -> Option<String> {
    let at = msg.find("NCCL version ")?;
    let token = msg[at + "NCCL version ".len()..]
        .split_whitespace()
        .next()?;
    let token = token.trim_end_matches([',', ';']);
    if token.starts_with(|c: char| c.is_ascii_digit()) && token.len() <= 64 {
        Some(token.to_string())
    } else {
        None
    }
}

/// A `GPU Direct RDMA Enabled|Disabled for ...` line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SupportLine {
    pub net: Option<String>,
    pub enabled: bool,
    pub hca: Option<u64>,
    pub hca_name: Option<String>,
    pub gpu: Option<String>,
    pub detail: Option<String>,
}

/// Recognises the per-HCA line (`NET/IB : GPU Direct RDMA Disabled for HCA 0
/// 'mlx5_0'`, with `(no module)` up to 2.12) and the per-GPU topology lines
/// (2.4: `... for GPU 2[2] / HCA 0 (distance 3 >= 2)`; later
/// `GPU Direct RDMA Enabled for GPU 1b000 / HCA 0 (distance 1 <= 3), read 0`).
pub(super) fn parse_support(msg: &str) -> Option<SupportLine> {
    let at = msg.find("GPU Direct RDMA ")?;
    let mut rest = &msg[at + "GPU Direct RDMA ".len()..];
    // Tolerate a qualifier such as `(nvidia-peermem) ` before the state.
    if let Some(inner) = rest.strip_prefix('(') {
        let close = inner.find(')')?;
        rest = inner[close + 1..].trim_start();
    }
    let (enabled, after) = if let Some(r) = strip_prefix_ignore_case(rest, "enabled ") {
        (true, r)
    } else if let Some(r) = strip_prefix_ignore_case(rest, "disabled ") {
        (false, r)
    } else {
        return None;
    };
    rest = after.trim_start().strip_prefix("for ")?;
    let mut line = SupportLine {
        net: net_name_before(&msg[..at]),
        enabled,
        hca: None,
        hca_name: None,
        gpu: None,
        detail: None,
    };
    if let Some(r) = rest.strip_prefix("GPU ") {
        let end = r.find(|c: char| c.is_whitespace()).unwrap_or(r.len());
        line.gpu = Some(r[..end].to_string());
        rest = r[end..].trim_start();
        rest = rest.strip_prefix('/').map(str::trim_start).unwrap_or(rest);
    }
    if let Some(r) = rest.strip_prefix("HCA ") {
        let end = r.find(|c: char| c.is_whitespace()).unwrap_or(r.len());
        line.hca = r[..end].parse().ok();
        rest = r[end..].trim_start();
        if let Some(inner) = rest.strip_prefix('\'') {
            if let Some(close) = inner.find('\'') {
                line.hca_name = Some(inner[..close].to_string());
                rest = &inner[close + 1..];
            }
        }
    } else if line.gpu.is_none() {
        return None;
    }
    let rest = rest.trim();
    if !rest.is_empty() {
        line.detail = Some(rest.to_string());
    }
    Some(line)
}

fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// The plugin name in `NET/<name> :` (or `NET/<name>:`) ending the text.
fn net_name_before(head: &str) -> Option<String> {
    let at = head.rfind("NET/")?;
    let name = head[at + 4..].trim().trim_end_matches(':').trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        None
    } else {
        Some(name.to_string())
    }
}

/// `NET/IB : Using [0]mlx5_0:1/RoCE ...` or `NET/Socket : Using [0]eth0:...`:
/// the network plugin's name and what follows `Using `.
pub(super) fn parse_net_using(msg: &str) -> Option<(String, String)> {
    let body = msg.strip_prefix("NET/")?;
    let using = body.find(": Using ")?;
    let name = body[..using].trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    Some((
        name.to_string(),
        body[using + ": Using ".len()..].trim().to_string(),
    ))
}

/// The device names in a `Using` list: `[0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE`.
pub(super) fn net_device_names(list: &str) -> Vec<String> {
    list.split_whitespace()
        .filter_map(|tok| {
            let inner = tok.strip_prefix('[')?;
            let close = inner.find(']')?;
            if !is_digits(&inner[..close]) {
                return None;
            }
            let name = &inner[close + 1..];
            let name = name.split([':', '<', ';']).next().unwrap_or(name);
            (!name.is_empty()).then(|| name.to_string())
        })
        .collect()
}

/// A socket plugin's connection set-up, `NET/FastSocket : Connected after 18
/// retries.` or `NET/FastSocket : Accepted data socket 2`: the plugin's
/// name, when it is a TCP transport (data then moves through host memory).
pub(super) fn parse_tcp_connect(msg: &str) -> Option<&str> {
    let rest = msg.strip_prefix("NET/")?;
    let (name, tail) = rest.split_once(" : ")?;
    let setup = tail.starts_with("Connected after ") || tail.starts_with("Accepted data socket");
    (setup && gpudirect::nccl::is_tcp_network(name)).then_some(name)
}

/// aws-ofi-nccl's `NET/OFI Selected Provider is efa (found 16 nics)`: the
/// libfabric provider and how many NICs it found.
pub(super) fn parse_provider(msg: &str) -> Option<(String, Option<u32>)> {
    let at = msg.find("Selected Provider is ")?;
    let rest = &msg[at + "Selected Provider is ".len()..];
    let name: String = rest.chars().take_while(|c| !c.is_whitespace() && *c != ',').collect();
    if name.is_empty() {
        return None;
    }
    let nics = rest.find("(found ").and_then(|i| take_number(&rest[i + "(found ".len()..])).map(|(n, _)| n);
    Some((name, nics.and_then(|n| u32::try_from(n).ok())))
}

/// aws-ofi-nccl's `NET/OFI Support for DMA-BUF registrations: false`.
pub(super) fn parse_plugin_dmabuf(msg: &str) -> Option<bool> {
    let at = msg.find("Support for DMA-BUF registrations:")?;
    match msg[at + "Support for DMA-BUF registrations:".len()..].trim() {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// `NCCL_IB_DISABLE set by environment to 1.` as a name and value.
pub(super) fn parse_env(msg: &str) -> Option<(String, String)> {
    let at = msg.find(" set by environment to")?;
    let name = msg[..at].split_whitespace().last()?;
    if !name
        .bytes()
        .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
    {
        return None;
    }
    // NCCL prints `to %s` (one space, then the value as set: a leading
    // space is part of it, and NCCL reads " 0" differently from "0"), or
    // `to %lld.` for integer parameters; trailing space is padding.
    let rest = &msg[at + " set by environment to".len()..];
    let value = rest.strip_prefix(' ').unwrap_or(rest).trim_end();
    let value = value.strip_suffix('.').unwrap_or(value).trim_end();
    Some((name.to_string(), value.to_string()))
}

/// `Got completion from peer ... with error 4, opcode ..., vendor err 81`:
/// the IB work-completion status and the vendor syndrome.
pub(super) fn parse_completion_error(msg: &str) -> Option<(u64, Option<String>)> {
    if !msg.contains("Got completion") {
        return None;
    }
    let at = msg.find("with error ")?;
    let (status, _) = take_number(&msg[at + "with error ".len()..])?;
    let vendor = msg.find("vendor err ").and_then(|v| {
        let tail = &msg[v + "vendor err ".len()..];
        let end = tail
            .find(|c: char| !c.is_ascii_alphanumeric())
            .unwrap_or(tail.len());
        (end > 0).then(|| tail[..end].to_string())
    });
    Some((status, vendor))
}
