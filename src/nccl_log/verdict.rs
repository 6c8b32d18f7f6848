//! The verdict rules and the causes to check next (see the module docs of
//! [`super`] for the rules in prose).

use std::collections::{BTreeMap, BTreeSet};

use gpudirect::nccl::is_tcp_network;

use super::{
    describe_support, quote, CompletionError, Connection, Direction, GdrSupport, Scan,
    Verdict, HEAD_NOT_USED, HEAD_NOT_USED_ONE_NODE, HEAD_NOT_USED_UNSPANNED, HEAD_PARTIAL, HEAD_WOULD_STAGE, HEAD_UNKNOWN, HEAD_USED, PARTIAL_COST, SETTLE_SUBSYS,
};

/// The verdict and what it rests on, before causes are added.
pub(super) struct Decision {
    pub(super) verdict: Verdict,
    pub(super) headline: String,
    pub(super) evidence: Vec<String>,
    pub(super) settle_with: Option<String>,
}

/// Connection lines are the only direct evidence, so they decide whenever
/// present; the other rules only apply to logs without them.
pub(super) fn decide(scan: &Scan) -> Decision {
    if let Some((verdict, headline, evidence)) = super::plugin::decide(scan) {
        return Decision { verdict, headline, evidence, settle_with: None };
    }
    let net: Vec<&Connection> = scan.net_conns().collect();
    if !net.is_empty() {
        return decide_from_connections(scan, &net);
    }
    let mut evidence = Vec::new();
    // One node: nothing crossed a network; the log says what inter-node
    // traffic would do, not what it did.
    // Without connection lines, "went through host memory" needs the run
    // to have spanned nodes; a log that does not show it says what would.
    let headline = match (scan.single_node(), scan.spans_nodes()) {
        (Some(why), _) => format!("{HEAD_NOT_USED_ONE_NODE} ({why}): {HEAD_WOULD_STAGE}"),
        (None, Some(_)) => HEAD_NOT_USED.to_string(),
        (None, None) => format!("{HEAD_NOT_USED_UNSPANNED}: {HEAD_WOULD_STAGE}"),
    };
    let not_used = |evidence: Vec<String>| Decision {
        verdict: Verdict::NotUsed,
        headline: headline.clone(),
        evidence,
        settle_with: None,
    };

    let socket_lines = scan.socket_evidence();
    let socket_devices = scan.socket_devices();
    if (!socket_lines.is_empty() || !socket_devices.is_empty()) && !scan.rdma_network_named() {
        for l in socket_lines {
            evidence.push(format!(
                "NCCL's network is the TCP socket transport ({})",
                quote(l)
            ));
        }
        for d in socket_devices {
            evidence.push(format!(
                "NET/{} chose its interfaces (line {}: '{}'): TCP sockets stage every transfer \
                 in host memory",
                d.net, d.line, d.printed
            ));
        }
        return not_used(evidence);
    }
    // A WARN-only log: libibverbs could not be loaded, so NCCL's IB
    // transport never started and only sockets were left.
    if let (Some(l), None, false) = (&scan.no_libibverbs, &scan.plugin_loaded, scan.rdma_network_named()) {
        evidence.push(format!(
            "libibverbs could not be loaded ({}): NCCL's InfiniBand/RoCE transport cannot start, \
             so NCCL's network is TCP sockets, staged in host memory",
            quote(l)
        ));
        return not_used(evidence);
    }
    if let Some(l) = scan.plugin_gdr_off.first() {
        evidence.push(format!(
            "the network plugin turned GPUDirect RDMA off ({})",
            quote(l)
        ));
        return not_used(evidence);
    }
    if !scan.support.is_empty() && scan.support.iter().all(|s| !s.enabled) {
        let first = &scan.support[0];
        evidence.push(format!(
            "every one of the {} 'GPU Direct RDMA' line(s) says Disabled, none Enabled (line {}: \
             {})",
            scan.support.len(),
            first.line,
            describe_support(first)
        ));
        return not_used(evidence);
    }
    // The variables NCCL read, judged by the library's rule table (as the
    // doctor and the NCCL plugin judge them) for what holds on every
    // pair: sockets, IB off, a distance limit shorter than any PCIe path.
    // NCCL_IB_DISABLE stops only NCCL's internal IB: it counts where the
    // log shows that network and no plugin's or RDMA network.
    let ib_counts = scan.internal_net.is_some() && scan.plugin_loaded.is_none() && !scan.rdma_network_named();
    let vars: Vec<(String, String)> =
        scan.env.iter().filter(|e| e.set_by_plugin.is_none() && (ib_counts || e.name != "NCCL_IB_DISABLE")).map(|e| (e.name.clone(), e.value.clone())).collect();
    if let Some(stop) = gpudirect::nccl::stops(&vars, &gpudirect::nccl::Pair::default()) {
        if let Some(e) = scan.env(stop.variable()) {
            let network = match (&stop, &scan.internal_net) {
                (gpudirect::nccl::Stop::IbDisabled { .. }, Some(internal)) => format!(", with NCCL's internal network ({})", quote(internal)),
                _ => String::new(),
            };
            evidence.push(format!("{}={} (line {}{network}): {}", e.name, e.value, e.line, stop.cause()));
            return not_used(evidence);
        }
    }

    // Nothing settles it: say what was seen and what would settle it.
    let no_nccl = scan.nccl_lines == 0 && scan.versions.is_empty() && scan.conns.is_empty();
    let mut settle = SETTLE_SUBSYS.to_string();
    if no_nccl {
        evidence.push("no NCCL debug line (host:pid:tid [dev] NCCL INFO ...) in this text".into());
        settle =
            format!("run the job with NCCL_DEBUG=INFO and pass its whole output; {SETTLE_SUBSYS}");
    } else {
        evidence.push(
            "no NET connection line ('Channel NN/N : a[x] -> b[y] [send] via NET/...') in this log"
                .to_string(),
        );
    }
    for e in &scan.completion_errors {
        evidence.push(format!(
            "the run failed with IB completion {} before any line showed which connections used \
             /GDRDMA{}",
            e.describe(),
            if e.is_protection() {
                ": error 4 is a local protection error, which in many cases means ACS or the \
                 IOMMU broke GPUDirect RDMA"
            } else {
                ""
            }
        ));
    }
    if scan
        .completion_errors
        .iter()
        .any(CompletionError::is_protection)
    {
        settle.push_str("; and check PCIe ACS on the GPU-NIC path (lspci -vvv | grep ACSCtl)");
    }
    let enabled: Vec<&GdrSupport> = scan.support.iter().filter(|s| s.enabled).collect();
    let disabled: Vec<&GdrSupport> = scan.support.iter().filter(|s| !s.enabled).collect();
    if let Some(e) = enabled.first() {
        evidence.push(format!(
            "{} 'GPU Direct RDMA Enabled' line(s) (line {}: {}) say a NIC or GPU-NIC pair can \
             use it, not that each connection did",
            enabled.len(),
            e.line,
            describe_support(e)
        ));
    }
    for e in receive_only_gpus(scan) {
        evidence.push(format!(
            "GPU {}{}: 'GPU Direct RDMA Enabled' only with read 0 (line {}: {}), NCCL's check \
             for receives; it prints no 'read 1' line when it keeps sends from a GPU off \
             GPUDirect RDMA (NCCL_NET_GDR_READ=0, or a pre-Ampere GPU without NVLink), so sends \
             from that GPU go through host memory: at most partial",
            e.gpu.as_deref().unwrap_or("?"),
            e.host.as_ref().map(|h| format!(" on {h}")).unwrap_or_default(),
            e.line,
            describe_support(e)
        ));
    }
    if let Some(d) = disabled.first() {
        evidence.push(format!(
            "{} 'GPU Direct RDMA Disabled' line(s) (line {}: {}): those NICs or GPUs go through \
             host memory",
            disabled.len(),
            d.line,
            describe_support(d)
        ));
    }
    if !scan.conns.is_empty() {
        evidence.push(format!(
            "all {} connection line(s) are intra-node (P2P/SHM); GPUDirect RDMA only concerns \
             NET connections, and none is in this log",
            scan.conns.len()
        ));
    }
    let one_node = scan.single_node();
    if let (Some(why), false) = (&one_node, no_nccl) {
        evidence.push(format!("this log is of one node ({why}): NCCL opens no network connection there, so no line can show whether GPUDirect RDMA works between nodes"));
        settle = "run across two nodes with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET (each 'Channel ... via NET/...' line ends in /GDRDMA exactly when that connection uses GPUDirect RDMA), or judge each node with `gpudirect doctor`".to_owned();
    }
    let reason = if no_nccl {
        "no NCCL debug output in it; run with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"
    } else if scan
        .completion_errors
        .iter()
        .any(CompletionError::is_protection)
    {
        "the run failed with IB error 4 before any NET channel line; rerun with \
         NCCL_DEBUG_SUBSYS=INIT,NET and check PCIe ACS"
    } else if one_node.is_some() {
        "it is of one node, with no inter-node traffic to show; run across two nodes, or judge the node with `gpudirect doctor`"
    } else if !scan.conns.is_empty() {
        "it shows only intra-node connections; keep the NET channel lines \
         (NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET)"
    } else {
        "no NET channel line; rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"
    };
    Decision {
        verdict: Verdict::Unknown,
        headline: format!("{HEAD_UNKNOWN}: {reason}"),
        evidence,
        settle_with: Some(settle),
    }
}

/// The first `Enabled ... read 0` line of each GPU (per host) that has no
/// `Enabled ... read 1` line: receives may use GPUDirect RDMA, sends from it
/// do not.
pub(super) fn receive_only_gpus(scan: &Scan) -> Vec<&GdrSupport> {
    let per_gpu = || scan.support.iter().filter(|s| s.enabled && s.gpu.is_some());
    let sends: BTreeSet<(&Option<String>, &Option<String>)> = per_gpu()
        .filter(|s| s.read == Some(true))
        .map(|s| (&s.host, &s.gpu))
        .collect();
    let mut seen = BTreeSet::new();
    per_gpu()
        .filter(|s| s.read == Some(false))
        .filter(|s| !sends.contains(&(&s.host, &s.gpu)) && seen.insert((&s.host, &s.gpu)))
        .collect()
}

/// One label per rank whose NET lines do (or do not) carry /GDRDMA:
/// `rank 4 on node17-2 GPU 4 (receive)`, `rank 0 GPU 0 (send, receive)`.
fn rank_labels(net: &[&Connection], gdr: bool) -> Vec<String> {
    type Key = (u64, Option<String>);
    let mut by_rank: BTreeMap<Key, (Option<String>, BTreeSet<Direction>)> = BTreeMap::new();
    for c in net.iter().filter(|c| c.gdr == Some(gdr)) {
        by_rank
            .entry((c.rank, c.host.clone()))
            .or_insert_with(|| (c.gpu.clone(), BTreeSet::new()))
            .1
            .insert(c.direction);
    }
    by_rank
        .into_iter()
        .map(|((rank, host), (gpu, dirs))| {
            let host = host.map(|h| format!(" on {h}")).unwrap_or_default();
            let host = match gpu {
                Some(g) => format!("{host} GPU {g}"),
                None => host,
            };
            let dirs: Vec<&str> = dirs
                .into_iter()
                .filter(|d| *d != Direction::Unspecified)
                .map(Direction::word)
                .collect();
            if dirs.is_empty() {
                format!("rank {rank}{host}")
            } else {
                format!("rank {rank}{host} ({})", dirs.join(", "))
            }
        })
        .collect()
}

fn join_capped(items: &[String], cap: usize) -> String {
    if items.len() <= cap {
        items.join(", ")
    } else {
        format!("{} and {} more", items[..cap].join(", "), items.len() - cap)
    }
}

fn decide_from_connections(scan: &Scan, net: &[&Connection]) -> Decision {
    let with: Vec<&&Connection> = net.iter().filter(|c| c.gdr == Some(true)).collect();
    let without: Vec<&&Connection> = net.iter().filter(|c| c.gdr == Some(false)).collect();
    let mut evidence = Vec::new();
    let (verdict, headline) = if without.is_empty() {
        evidence.push(format!(
            "all {} NET connection line(s) end in /GDRDMA ({})",
            net.len(),
            with[0].describe()
        ));
        let who = rank_labels(net, true);
        evidence.push(format!("with GPUDirect RDMA: {}", join_capped(&who, 32)));
        (
            Verdict::Used,
            format!(
                "{HEAD_USED}: all {} NET connection line(s) of {} rank(s) carry /GDRDMA",
                net.len(),
                who.len()
            ),
        )
    } else if with.is_empty() {
        evidence.push(format!(
            "{} NET connection line(s), none ends in /GDRDMA ({})",
            net.len(),
            without[0].describe()
        ));
        if let Some(s) = without
            .iter()
            .find(|c| c.net.as_deref().is_some_and(is_tcp_network))
        {
            evidence.push(format!(
                "NET/{} is TCP sockets: every transfer is staged in host memory ({})",
                s.net.as_deref().unwrap_or("Socket"),
                s.describe()
            ));
        }
        let reporters: BTreeSet<(u64, Option<&str>)> =
            net.iter().map(|c| (c.rank, c.host.as_deref())).collect();
        if reporters.len() == 1 {
            evidence.push(
                "only one rank's NET lines are in this log; other ranks may differ".to_string(),
            );
        }
        (Verdict::NotUsed, HEAD_NOT_USED.to_string())
    } else {
        let yes = rank_labels(net, true);
        let no = rank_labels(net, false);
        evidence.push(format!(
            "{} NET connection line(s) end in /GDRDMA ({}), {} do not ({})",
            with.len(),
            with[0].describe(),
            without.len(),
            without[0].describe()
        ));
        evidence.push(format!("with GPUDirect RDMA: {}", join_capped(&yes, 32)));
        evidence.push(format!("through host memory: {}", join_capped(&no, 32)));
        (
            Verdict::Partial,
            format!(
                "{HEAD_PARTIAL}: with it: {}; without it (through host memory): {}; {PARTIAL_COST}",
                join_capped(&yes, 6),
                join_capped(&no, 6)
            ),
        )
    };
    if verdict != Verdict::NotUsed {
        // Lines from another host or run can contradict the connections.
        for d in scan
            .support
            .iter()
            .filter(|s| !s.enabled && s.gpu.is_none())
            .take(1)
        {
            evidence.push(format!(
                "yet line {} says '{}': its host's connections are missing from this log or come \
                 from another run",
                d.line,
                describe_support(d)
            ));
        }
        for l in scan.plugin_gdr_off.iter().take(1) {
            evidence.push(format!("yet {} says GDR is off for some process", quote(l)));
        }
    } else if let Some(e) = scan.support.iter().find(|s| s.enabled) {
        evidence.push(format!(
            "line {} ('{}') only says the NIC could; the connections above did not use it",
            e.line,
            describe_support(e)
        ));
    }
    for e in &scan.completion_errors {
        evidence.push(format!(
            "the run later failed with IB completion {}",
            e.describe()
        ));
    }
    Decision {
        verdict,
        headline,
        evidence,
        settle_with: None,
    }
}

/// What to check next, the causes named by lines of this log first and
/// the generic ones only when nothing more specific is known.
/// Why sends can stage through host memory while receives do not.
const GDR_READ: &str = "NCCL lets the NIC read GPU memory for sends only where \
     NCCL_NET_GDR_READ allows it (by default only on some platforms); NCCL_NET_GDR_READ=1 \
     enables it, measure before keeping it";

pub(super) fn causes(scan: &Scan, d: &Decision) -> Vec<String> {
    let mut out = Causes::default();
    for c in super::plugin::causes(scan) {
        out.add(c);
    }
    for e in scan.completion_errors.iter().filter(|e| e.is_protection()) {
        out.add(format!(
            "IB error 4 (local protection error{}) at line {}: in many cases PCIe ACS is \
             enabled and redirects peer-to-peer traffic, which breaks GPUDirect RDMA; check \
             `lspci -vvv | grep ACSCtl` on the bridges between GPU and NIC (SrcValid+, \
             ReqRedir+, CmpltRedir+ mean redirected; in a VM the hypervisor's topology counts) \
             and that the IOMMU passes DMA through (iommu=pt)",
            e.vendor
                .as_ref()
                .map(|v| format!(", vendor err {v}"))
                .unwrap_or_default(),
            e.first.line
        ));
    }
    if d.verdict == Verdict::Used {
        return out.0;
    }
    let socket_run = scan.socket_transport();
    if let Some(e) = scan.env("NCCL_IB_DISABLE").filter(|e| gpudirect::nccl::ib_disabled(&e.value)) {
        out.add(format!(
            "NCCL_IB_DISABLE={} is set (line {}): NCCL skips InfiniBand/RoCE and falls back to \
             TCP sockets; unset it on every rank",
            e.value, e.line
        ));
    }
    if let Some(e) = scan.env("NCCL_NET").filter(|e| is_tcp_network(&e.value)) {
        out.add(format!(
            "NCCL_NET={} is set (line {}): it forces TCP sockets",
            e.value, e.line
        ));
    }
    if let Some(l) = &scan.no_ib_device {
        out.add(format!(
            "NCCL found no RDMA device ({}): check `ibv_devinfo` on each node, that rdma-core \
             or MLNX/DOCA OFED is installed and, in containers, that /dev/infiniband is mounted \
             and the pod has an RDMA interface (host network, SR-IOV or a macvlan secondary \
             interface)",
            quote(l)
        ));
    }
    if socket_run {
        let plugins: BTreeSet<&str> = scan
            .net_devices
            .iter()
            .map(|d| d.net.as_str())
            .chain(scan.networks.iter().map(|(n, _)| n.as_str()))
            .chain(scan.net_conns().filter_map(|c| c.net.as_deref()))
            .chain(scan.support.iter().filter_map(|s| s.net.as_deref()))
            .filter(|n| is_tcp_network(n) && *n != "Socket")
            .collect();
        for p in plugins {
            out.add(format!(
                "NET/{p} moves data over TCP sockets and has no GPUDirect RDMA path: GDR needs \
                 RDMA NICs (InfiniBand, RoCE, EFA) and the NCCL net plugin that drives them"
            ));
        }
        let used = match (scan.single_node(), scan.spans_nodes()) {
            (Some(_), _) => "would use TCP sockets between nodes (this run had one node)",
            (None, Some(_)) => "used TCP sockets between nodes",
            (None, None) => "would use TCP sockets between nodes (this log does not show whether the run spanned nodes)",
        };
        out.add(format!(
            "NCCL {used}: check that every node has an RDMA NIC with a link up (`ibv_devinfo`), \
             that NCCL can see it (NCCL_IB_HCA, container devices) and that no setting disables it"
        ));
    }
    let hca_off: Vec<&GdrSupport> = scan
        .support
        .iter()
        .filter(|s| !s.enabled && s.gpu.is_none())
        .collect();
    if let Some(s) = hca_off
        .iter()
        .find(|s| s.detail.as_deref().is_some_and(|x| x.contains("no module")))
    {
        out.add(format!(
            "no peer-memory module (line {}: '{}'): load nvidia_peermem (`modprobe \
             nvidia_peermem`) or use dma-buf (NVIDIA open kernel module, kernel >= 5.12, CUDA \
             >= 11.7)",
            s.line,
            describe_support(s)
        ));
    } else if let Some(s) = hca_off
        .iter()
        .find(|s| !s.net.as_deref().is_some_and(is_tcp_network))
    {
        out.add(format!(
            "NCCL could not register GPU memory with the NIC (line {}: '{}'): check that \
             nvidia_peermem is loaded (`lsmod | grep peermem`; \
             /sys/kernel/mm/memory_peers/nv_mem/version or /sys/module/nvidia_peermem/version) \
             or that dma-buf works (open kernel module, kernel >= 5.12, CUDA >= 11.7); NCCL <= \
             2.22.3 only looks for the memory_peers files, which kernels >= 6.4 no longer \
             create (NVIDIA/nccl#1676): upgrade NCCL or use dma-buf",
            s.line,
            describe_support(s)
        ));
    }
    if let Some(s) = scan
        .support
        .iter()
        .find(|s| !s.enabled && s.detail.as_deref().is_some_and(|x| x.contains("distance")))
    {
        out.add(format!(
            "GPU and NIC are too far apart for NCCL's GDR threshold (line {}: '{}'): check \
             `nvidia-smi topo -m` (PIX/PXB allow GDR by default; PHB, NODE and SYS do not), put \
             each GPU's traffic on the NIC under its own PCIe switch (NCCL_IB_HCA), or raise \
             NCCL_NET_GDR_LEVEL knowing that GDR through the CPU can be slower",
            s.line,
            describe_support(s)
        ));
    }
    if let Some(e) = scan.env("NCCL_NET_GDR_LEVEL") {
        out.add(format!(
            "NCCL_NET_GDR_LEVEL={} is set (line {}): LOC/0 forbids GPUDirect RDMA, and any level \
             below the GPU-NIC distance disables it for that GPU",
            e.value, e.line
        ));
    }
    if let Some((false, l)) = &scan.plugin_dmabuf {
        out.add(format!(
            "the network plugin does not register GPU memory through dma-buf ({}): GPUDirect \
             RDMA through it rests on a peer-memory client (nvidia-peermem) on every node; \
             `gpudirect doctor` on each node says whether one is loaded",
            quote(l)
        ));
    }
    if let Some(l) = scan.plugin_gdr_off.first() {
        out.add(format!(
            "the network plugin disabled GPUDirect RDMA ({}): check the plugin's own GDR \
             requirements (peer-memory module or dma-buf, provider support, its GDR setting)",
            quote(l)
        ));
    }
    for l in scan.reg_failures.iter().take(1) {
        out.add(format!(
            "memory registration failed ({}): GPU buffers could not be registered with the \
             NIC; check nvidia_peermem / dma-buf support and the GPU's BAR1 size",
            quote(l)
        ));
    }
    if d.verdict == Verdict::Unknown && !receive_only_gpus(scan).is_empty() {
        out.add(format!("the per-GPU lines check receives only (read 0): {GDR_READ}"));
    }
    if d.verdict == Verdict::Partial {
        let net: Vec<&Connection> = scan.net_conns().collect();
        let recv_only = net
            .iter()
            .any(|c| c.direction == Direction::Receive && c.gdr == Some(true))
            && net
                .iter()
                .all(|c| c.direction != Direction::Receive || c.gdr == Some(true));
        let sends_differ = net
            .iter()
            .any(|c| c.direction == Direction::Send && c.gdr == Some(true))
            && net
                .iter()
                .any(|c| c.direction == Direction::Send && c.gdr == Some(false));
        if recv_only {
            out.add(format!("every receive uses GPUDirect RDMA but some sends do not: {GDR_READ}"));
        }
        if !recv_only || sends_differ {
            out.add(
                "for the ranks without /GDRDMA, compare their GPU-NIC placement (`nvidia-smi \
                 topo -m` on their hosts: PHB/NODE/SYS disable GDR by default) and whether \
                 nvidia_peermem or dma-buf is available on those hosts"
                    .to_string(),
            );
        }
    }
    if let Some(l) = &scan.geforce {
        out.add(format!(
            "a GeForce GPU appears ({}): GeForce GPUs do not support GPUDirect RDMA",
            quote(l)
        ));
    }
    let majors: BTreeSet<&str> = scan
        .versions
        .iter()
        .map(|v| v.split('+').next().unwrap_or(v))
        .collect();
    if majors.len() > 1 {
        let list: Vec<&str> = majors.into_iter().collect();
        out.add(format!(
            "ranks run different NCCL versions ({}): use one version everywhere",
            list.join(", ")
        ));
    }
    if d.verdict == Verdict::NotUsed && !socket_run && out.0.is_empty() {
        out.add(
            "no peer-memory path: check that nvidia_peermem is loaded or dma-buf is usable (open \
             kernel module, kernel >= 5.12, CUDA >= 11.7)"
                .to_string(),
        );
        out.add(
            "GPU-NIC distance: `nvidia-smi topo -m`; PHB, NODE and SYS between a GPU and its NIC \
             disable GDR at the default NCCL_NET_GDR_LEVEL"
                .to_string(),
        );
        out.add(
            "GPU support: GeForce and some cloud/VM GPU models do not support GPUDirect RDMA"
                .to_string(),
        );
    }
    out.add(
        "run `gpudirect doctor` on each node: it checks peer memory, dma-buf, GPU-NIC topology, \
         ACS and IOMMU directly"
            .to_string(),
    );
    out.0
}

/// Causes in order, each once.
#[derive(Default)]
struct Causes(Vec<String>);

impl Causes {
    fn add(&mut self, cause: String) {
        if !self.0.contains(&cause) {
            self.0.push(cause);
        }
    }
}
