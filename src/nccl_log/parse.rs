//! Line-level recognisers for NCCL debug output.
//!
//! Every function here takes one line (or its message part) and either
//! recognises it or returns `None`; none of them may panic on any input,
//! because the explainer is fed whatever users paste. All slicing happens at
//! positions found by searching for ASCII text, which are always character
//! boundaries.

use super::{Direction, GdrSupport, Transport};

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
    let Some((at, level)) = find_marker(line) else {
        return match legacy_marker(line) {
            Some((at, level)) => (
                parse_prefix(&line[..at]),
                level,
                line[at + LEGACY_MARKER_LEN..].trim(),
            ),
            None => (Prefix::default(), Level::None, line.trim()),
        };
    };
    let msg = line[at + MARKER_LEN..].trim();
    (parse_prefix(&line[..at]), level, msg)
}

/// `NCCL INFO` and `NCCL WARN` are the same length.
const MARKER_LEN: usize = "NCCL INFO".len();
/// ` INFO ` / ` WARN `: NCCL up to 2.2 printed no `NCCL` before the level.
const LEGACY_MARKER_LEN: usize = " INFO ".len();

/// The first `NCCL INFO` / `NCCL WARN` marker on a line, in one pass (two
/// searches, each to the end of the line, made a line of many markers
/// cost their number times its length).
fn find_marker(line: &str) -> Option<(usize, Level)> {
    line.match_indices("NCCL ").find_map(|(at, _)| match line.as_bytes().get(at + 5..at + MARKER_LEN) {
        Some(b"INFO") => Some((at, Level::Info)),
        Some(b"WARN") => Some((at, Level::Warn)),
        _ => None,
    })
}

/// Most records read from one physical line. Terminal pastes glue a few
/// records together; past this many, the rest of the line is one record
/// (a line of thousands of markers is not a log, and would cost its
/// reader thousands of records).
pub(super) const MAX_RECORDS_PER_LINE: usize = 64;

/// NCCL 2.0-2.2's marker, `host:pid:tid [dev] INFO msg`. Only taken after a
/// whole `host:pid:tid [dev]` prefix: `INFO` alone is common in other tools'
/// output (`INFO:tensorflow:...`).
fn legacy_marker(line: &str) -> Option<(usize, Level)> {
    for (word, level) in [(" INFO ", Level::Info), (" WARN ", Level::Warn)] {
        let mut from = 0;
        while let Some(found) = line[from..].find(word) {
            let at = from + found;
            if record_start(line, at).is_some() {
                return Some((at, level));
            }
            from = at + 1;
        }
    }
    None
}

/// Splits one physical line into the NCCL records on it. Terminal pastes
/// padded to a fixed width put several records on one line (`... via
/// NET/IBext/1/GDRDMA      host:11979:12555 [1] NCCL INFO Channel ...`);
/// each one after the first starts at the `host:pid:tid [dev]` prefix of
/// its marker, or at the marker when the prefix was stripped.
pub(super) fn records(line: &str) -> Vec<&str> {
    let mut markers = Vec::new();
    let mut from = 0;
    while let Some((at, _)) = find_marker(&line[from..]) {
        markers.push(from + at);
        from += at + MARKER_LEN;
        if markers.len() == MAX_RECORDS_PER_LINE {
            break;
        }
    }
    let Some(&first) = markers.first() else {
        return vec![line];
    };
    let mut out = Vec::with_capacity(markers.len() + 1);
    // Text before the first prefix is the tail of a record broken across
    // lines (`NFO Channel 01/0 : ...`), or a launcher's own prefix.
    let mut start = record_start(line, first).unwrap_or(0);
    if line[..start].trim().is_empty() {
        start = 0;
    } else {
        out.push(&line[..start]);
    }
    for pair in markers.windows(2) {
        let (previous, at) = (pair[0], pair[1]);
        // A prefix cannot reach back into the previous record's marker.
        let cut = record_start(line, at).unwrap_or(at).max(previous + MARKER_LEN);
        out.push(&line[start..cut]);
        start = cut;
    }
    out.push(&line[start..]);
    out
}

/// Where the `host:pid:tid [dev]` prefix (with a launcher's prefix glued to
/// its front, and on WARN lines the `file.cc:line` after the device) ending
/// just before `marker` begins; `None` when the text there is not one.
fn record_start(line: &str, marker: usize) -> Option<usize> {
    let mut head = line[..marker].trim_end();
    if !head.ends_with(']') {
        // `transport/net_ib.cc:1192` between the device and `NCCL WARN`.
        let token_at = head.rfind(char::is_whitespace).map_or(0, |i| i + 1);
        let (file, number) = head[token_at..].rsplit_once(':')?;
        if file.is_empty() || !is_digits(number) {
            return None;
        }
        head = head[..token_at].trim_end();
    }
    let open = head.strip_suffix(']')?.rfind('[')?;
    if !is_digits(&head[open + 1..head.len() - 1]) {
        return None;
    }
    let before = head[..open].trim_end();
    let token_at = before.rfind(char::is_whitespace).map_or(0, |i| i + 1);
    let mut parts = before[token_at..].rsplit(':');
    let (tid, pid) = (parts.next()?, parts.next()?);
    // The host may be empty (`:22901:22901 [0]`), but its colon is there.
    parts.next()?;
    (is_digits(tid) && is_digits(pid)).then_some(token_at)
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
            // A name no host can have (`NET/IB/0/GDRDhostB`) is two
            // processes' output spliced together: the host is unknown,
            // never the splice.
            let hostname = host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
            if !host.is_empty() && hostname {
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
    /// `None` for a fragment whose `Channel NN :` head was cut off.
    pub channel: Option<u64>,
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
/// without a prefix, and CollNet's `CollNet 00/0 : 0 [receive] via
/// COLLNET/SHARP/1/GDRDMA` (one rank: its side of the SHARP tree). Ring-order
/// lines (`Channel 00/02 :    0   1   2`) and anything else are rejected.
/// A fragment whose head was cut off (a paste, or a launcher that
/// interleaves workers' output mid-line) is read from its ranks on.
pub(super) fn parse_connection(msg: &str) -> Option<ConnLine> {
    if let Some(at) = msg.find("CollNet ") {
        if let Some(conn) = parse_collnet_at(&msg[at + "CollNet ".len()..]) {
            return Some(conn);
        }
    }
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
    // A line that names its channel but did not parse is corrupt, not cut.
    if msg.contains("Channel ") || msg.contains("Ring ") {
        return None;
    }
    parse_fragment(msg)
}

/// `9[1a000] -> 2[6b000] [send] via NET/IB/0/GDRDMA`, `l 23/0 : 4[4] -> 5[5]
/// via P2P/IPC/read`: the sending rank is the last word before the first
/// `->`, and the channel is read when what precedes it still ends in
/// `NN[/N] :`. Only a transport NCCL prints (`NET/`, `P2P`, `SHM`,
/// `COLLNET/`) makes it a connection: an arrow in other text is not one.
fn parse_fragment(msg: &str) -> Option<ConnLine> {
    let arrow = msg.find("->")?;
    let before = msg[..arrow].trim_end();
    let word = before.rfind(char::is_whitespace).map_or(0, |i| i + 1);
    let (from_rank, rest) = take_number(&before[word..])?;
    let (from_gpu, rest) = take_bracket(rest);
    if !rest.is_empty() {
        return None;
    }
    let head = before[..word].trim_end();
    let (channel, sub) = match head.strip_suffix(':') {
        Some(h) => {
            let h = h.trim_end();
            let last = &h[h.rfind(char::is_whitespace).map_or(0, |i| i + 1)..];
            let mut parts = last.splitn(2, '/');
            // Digits left of the colon are a channel, and one that does not
            // parse (too large) makes the line corrupt; other words are what
            // came before the cut.
            let number = |t: &str| take_number(t).filter(|(_, r)| r.is_empty()).map(|(n, _)| n);
            if last.is_empty() || !last.bytes().all(|b| b.is_ascii_digit() || b == b'/') {
                (None, None)
            } else {
                let channel = number(parts.next()?)?;
                let sub = match parts.next() {
                    Some(t) => Some(number(t)?),
                    None => None,
                };
                (Some(channel), sub)
            }
        }
        None => (None, None),
    };
    let mut conn = parse_connection_at(&format!("0 : {from_rank} {}", &msg[arrow..]))?;
    if !matches!(conn.transport, Transport::Net | Transport::P2p | Transport::Shm) {
        return None;
    }
    conn.from_gpu = from_gpu;
    conn.channel = channel;
    conn.sub = sub;
    Some(conn)
}

/// `CC/S : RANK [dir] via COLLNET/<plugin>/<dev>[/GDRDMA]`: the rank's
/// connection to the in-network reduction, through NIC `dev`.
fn parse_collnet_at(s: &str) -> Option<ConnLine> {
    let (channel, sub, rest) = take_channel(s)?;
    let channel = Some(channel);
    let (rank, rest) = take_number(rest)?;
    let (direction, rest) = take_direction(rest);
    let via = rest.strip_prefix("via ")?.trim();
    if !via.starts_with("COLLNET/") {
        return None;
    }
    let (via, transport, net) = classify_via(via);
    net.as_ref().and_then(|n| n.dev)?;
    Some(ConnLine { channel, sub, from_rank: rank, from_gpu: None, to_rank: rank, to_gpu: None, direction, via, transport, net })
}

/// `CC[/S] :`, a channel and its optional sub-channel, and the rest.
fn take_channel(s: &str) -> Option<(u64, Option<u64>, &str)> {
    let (channel, rest) = take_number(s)?;
    let (sub, rest) = match rest.strip_prefix('/') {
        Some(r) => {
            let (n, r) = take_number(r)?;
            (Some(n), r)
        }
        None => (None, rest),
    };
    Some((channel, sub, rest.trim_start().strip_prefix(':')?.trim_start()))
}

/// An optional `[send]` / `[receive]` / `[recv]` tag, and the rest.
fn take_direction(s: &str) -> (Direction, &str) {
    let rest = s.trim_start();
    for (tag, dir) in [
        ("[send]", Direction::Send),
        ("[receive]", Direction::Receive),
        ("[recv]", Direction::Receive),
    ] {
        if let Some(r) = rest.strip_prefix(tag) {
            return (dir, r.trim_start());
        }
    }
    (Direction::Unspecified, rest)
}

fn parse_connection_at(s: &str) -> Option<ConnLine> {
    let (channel, sub, rest) = take_channel(s)?;
    let channel = Some(channel);
    let (from_rank, rest) = take_number(rest)?;
    let (from_gpu, rest) = take_bracket(rest);
    let rest = rest.trim_start().strip_prefix("->")?.trim_start();
    let (to_rank, rest) = take_number(rest)?;
    let (to_gpu, rest) = take_bracket(rest);
    let (direction, rest) = take_direction(rest);
    let via = rest.strip_prefix("via ")?.trim();
    if via.is_empty() {
        return None;
    }
    let (via, transport, net) = classify_via(via);
    // `via NET/IBext/` at the end of a pasted excerpt: NCCL always prints
    // the NIC index, so a NET path without one was cut off, and its
    // `/GDRDMA` (or not) is unknown.
    if net.as_ref().is_some_and(|n| n.dev.is_none()) {
        return None;
    }
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
    // CollNet's path has the NET form behind its own prefix: the plugin
    // (SHARP), the NIC index, and `/GDRDMA` when GPU memory is registered.
    if let Some(body) = via.strip_prefix("NET/").or_else(|| via.strip_prefix("COLLNET/")) {
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

/// Recognises the per-HCA line (`NET/IB : GPU Direct RDMA Disabled for HCA 0
/// 'mlx5_0'`, with `(no module)` up to 2.12) and the per-GPU topology lines
/// (2.4: `... for GPU 2[2] / HCA 0 (distance 3 >= 2)`; later
/// `GPU Direct RDMA Enabled for GPU 1b000 / HCA 0 (distance 1 <= 3), read 0`).
/// The line's number and host are the scan's to fill (0 and none here).
pub(super) fn parse_support(msg: &str) -> Option<GdrSupport> {
    let at = msg.find("GPU Direct RDMA ")?;
    let mut rest = &msg[at + "GPU Direct RDMA ".len()..];
    // 2.19+ name the registration path: `(DMABUF) enabled`, `(nvidia-peermem) enabled`.
    let mut mechanism = None;
    if let Some(inner) = rest.strip_prefix('(') {
        let close = inner.find(')')?;
        mechanism = Some(inner[..close].to_string());
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
    let mut line = GdrSupport {
        line: 0,
        host: None,
        net: net_name_before(&msg[..at]),
        enabled,
        hca: None,
        hca_name: None,
        gpu: None,
        detail: None,
        mechanism,
        read: None,
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
            // The DMABUF and nvidia-peermem lines print `'%s` without the
            // closing quote.
            let close = inner
                .find(|c: char| c == '\'' || c.is_whitespace())
                .unwrap_or(inner.len());
            if close > 0 {
                line.hca_name = Some(inner[..close].to_string());
            }
            rest = inner[close..].strip_prefix('\'').unwrap_or(&inner[close..]);
        }
    } else if line.gpu.is_none() {
        return None;
    }
    let rest = rest.trim();
    if !rest.is_empty() {
        line.detail = Some(rest.to_string());
    }
    // `..., read 1`: the per-GPU check NCCL ran for sends (the NIC reads GPU
    // memory); `read 0` is the one for receives.
    line.read = rest
        .rfind("read ")
        .and_then(|i| take_number(&rest[i + "read ".len()..]))
        .map(|(n, _)| n != 0);
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
/// NCCL 2.3 and older print one line per NIC instead: `NET/IB: [0]
/// mlx4_0:1/IB`. Their `NET/IB : Using interface eth0 for sideband
/// communication` names the bootstrap interface, not a NIC, and is not a
/// list.
pub(super) fn parse_net_using(msg: &str) -> Option<(String, String)> {
    let body = msg.strip_prefix("NET/")?;
    let colon = body.find(':')?;
    let name = body[..colon].trim();
    if name.is_empty() || name.contains(char::is_whitespace) {
        return None;
    }
    let tail = body[colon + 1..].trim_start();
    let list = match tail.strip_prefix("Using ") {
        Some(list) if !list.starts_with("interface ") => list,
        Some(_) => return None,
        None if tail.starts_with('[') => tail,
        None => return None,
    };
    // Only a list of devices is a NIC list: `Using internal network
    // plugin`, `Using 2 threads`, and 2.27's `Using [RO]; OOB eth0` with no
    // device are not.
    if net_device_names(list).is_empty() {
        return None;
    }
    Some((name.to_string(), list.trim().to_string()))
}

/// `nNodes N` in a communicator's summary line.
pub(super) fn parse_n_nodes(msg: &str) -> Option<u64> {
    word_after(msg, "nNodes ")
}

/// `nranks N` or `nRanks N` in an init or summary line.
pub(super) fn parse_n_ranks(msg: &str) -> Option<u64> {
    word_after(msg, " nranks ").or_else(|| word_after(msg, " nRanks "))
}

fn word_after(msg: &str, key: &str) -> Option<u64> {
    let at = msg.find(key)? + key.len();
    let digits: String = msg[at..].chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// A plugin setting a variable in NCCL's environment itself:
/// aws-ofi-nccl's `Setting NCCL_TOPO_FILE environment variable to PATH`.
pub(super) fn parse_plugin_setenv(msg: &str) -> Option<(String, String)> {
    let at = msg.find("Setting NCCL_")?;
    let rest = &msg[at + "Setting ".len()..];
    let (name, tail) = rest.split_once(' ')?;
    let value = tail.strip_prefix("environment variable to ")?.trim();
    (!value.is_empty() && name.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')).then(|| (name.to_owned(), value.to_owned()))
}

/// The network NCCL chose: `Using network IB` (2.4+) or `Using internal
/// Network Socket` (2.3 and older).
pub(super) fn parse_network(msg: &str) -> Option<&str> {
    let name = msg
        .strip_prefix("Using network ")
        .or_else(|| msg.strip_prefix("Using internal Network "))?
        .trim();
    (!name.is_empty()).then_some(name)
}

/// The device names in a `Using` list: `[0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE`,
/// the 2.3 form `[0] mlx4_0:1/IB`, and 2.19+ merged NICs `[0]={[0]
/// mlx5_2:1/RoCE, [1] mlx5_3:1/RoCE}`, whose members are the devices.
pub(super) fn net_device_names(list: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut after_index = false;
    for tok in list.split_whitespace() {
        let mut name = tok;
        if let Some(inner) = tok.strip_prefix('[') {
            let Some(close) = inner.find(']') else {
                after_index = false;
                continue;
            };
            if !is_digits(&inner[..close]) {
                after_index = false;
                continue;
            }
            name = &inner[close + 1..];
            if name.is_empty() || name.starts_with('=') {
                after_index = true;
                continue;
            }
        } else if !after_index {
            continue;
        }
        after_index = false;
        let name = name.split([':', '<', ';', ',', '}']).next().unwrap_or(name);
        if name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
            names.push(name.to_string());
        }
    }
    names
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
