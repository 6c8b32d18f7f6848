//! The verdict rules on small inputs.

use super::*;

#[test]
fn empty_and_unrelated_text_is_unknown() {
    for text in [
        "",
        "\n\n",
        "hello world\nTraceback (most recent call last):",
    ] {
        let r = explain(text);
        assert_eq!(r.verdict, Verdict::Unknown);
        assert!(r.headline.contains("NCCL_DEBUG=INFO"), "{}", r.headline);
    }
}

#[test]
fn hca_enabled_alone_is_not_proof() {
    let r = explain("h:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'\n");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(
        r.evidence[1].contains("not that each connection did"),
        "{:?}",
        r.evidence
    );
}

#[test]
fn mixed_hca_lines_without_connections_are_unknown() {
    let log = "a:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'\n\
               b:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'\n";
    assert_eq!(explain(log).verdict, Verdict::Unknown);
}

#[test]
fn gdr_level_loc_and_ib_disable_settle_not_used() {
    let r = explain("h:1:2 [0] NCCL INFO NCCL_NET_GDR_LEVEL set by environment to LOC\n");
    assert_eq!(r.verdict, Verdict::NotUsed);
    let log = "h:1:2 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation\n\
               h:1:2 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n";
    assert_eq!(explain(log).verdict, Verdict::NotUsed);
    // Without knowing that no plugin took over, IB_DISABLE alone does not settle it.
    let r = explain("h:1:2 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(r.causes[0].contains("NCCL_IB_DISABLE=1"));
}

#[test]
fn connections_decide_over_hca_lines() {
    let log = "a:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA Enabled for HCA 0 'mlx5_0'\n\
               a:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0\n";
    let r = explain(log);
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert!(
        r.evidence
            .iter()
            .any(|e| e.contains("only says the NIC could")),
        "{:?}",
        r.evidence
    );
    let log = "a:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0'\n\
               b:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA\n";
    let r = explain(log);
    assert_eq!(r.verdict, Verdict::Used);
    assert!(
        r.evidence.iter().any(|e| e.starts_with("yet line 1")),
        "{:?}",
        r.evidence
    );
}

#[test]
fn socket_channel_next_to_gdr_channel_is_partial() {
    let log = "a:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA(PCI)\n\
               b:3:4 [0] NCCL INFO Channel 00/0 : 2[0] -> 3[0] [send] via NET/Socket/0\n";
    let r = explain(log);
    assert_eq!(r.verdict, Verdict::Partial);
    assert_eq!(r.connections[0].gdr, Some(true), "qualified GDRDMA flag");
    assert!(
        r.headline.contains("with it: rank 0 on a GPU 0 (send)")
            && r.headline.contains("rank 2 on b GPU 0 (send)")
    );
}

#[test]
fn duplicate_lines_are_counted_once() {
    let line = "a:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA\n";
    let r = explain(&line.repeat(5));
    assert_eq!(r.connections.len(), 1);
    assert_eq!(r.ranks[0].connections, 1);
}

#[test]
fn display_lists_sections() {
    let r = fixture("nccl392-roce-receive-only-leading-space-2.5.7.txt");
    let text = r.to_string();
    assert_eq!(text.lines().next(), Some(HEAD_NOT_USED));
    for section in [
        "Evidence:",
        "NCCL version: 2.5.7+cuda10.0",
        "NICs:",
        "Environment:",
        "Connections per rank:",
        "Likely causes to check next:",
    ] {
        assert!(text.contains(section), "missing {section}:\n{text}");
    }
    assert!(text.contains("receive from 15"), "{text}");
    assert!(
        text.contains("channels 00-01  (no GDRDMA: host memory)"),
        "{text}"
    );
}

#[test]
fn json_shape_is_stable() {
    let r = fixture("synthetic-recv-gdr-send-host-2.12.12.txt");
    let v = serde_json::to_value(&r).unwrap();
    let keys: BTreeSet<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    let expected = BTreeSet::from([
        "verdict",
        "headline",
        "evidence",
        "settle_with",
        "nccl_versions",
        "networks",
        "net_devices",
        "providers",
        "plugin_dmabuf",
        "gdr_support",
        "environment",
        "environment_judged",
        "ranks",
        "connections",
        "misleading",
        "warnings",
        "causes",
        "lines_read",
        "nccl_lines",
        "lines_cut",
        "not_kept",
    ]);
    assert_eq!(keys, expected);
    assert_eq!(v["verdict"], "partial");
    assert_eq!(v["connections"][0]["direction"], "receive");
    assert_eq!(v["connections"][0]["transport"], "net");
    assert_eq!(v["connections"][0]["gdr"], true);
    assert_eq!(v["ranks"][0]["net_with_gdr"][0], "receive");
    assert_eq!(verdict_word(Verdict::NotUsed), "not-used");
}

/// One node (`nNodes 1`, one rank): no traffic crossed a network, so the
/// log says what inter-node traffic would do, and never "went through"
/// or "between nodes" as a fact; the real H200 log of one rank.
#[test]
fn a_single_node_log_says_what_would_happen_between_nodes() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nccl-logs/h200-vm-1rank-no-rdma-socket-2.28.9.txt")).unwrap();
    let body = text.split_once("\n---\n").unwrap().1;
    let r = explain(body);
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert!(r.headline.starts_with("GPUDirect RDMA would NOT be used between nodes: this run was on one node"), "{}", r.headline);
    assert!(r.headline.contains("nNodes 1") && !r.headline.contains("went through"), "{}", r.headline);
    assert!(r.causes.iter().any(|c| c.starts_with("NCCL would use TCP sockets between nodes (this run had one node)")), "{:#?}", r.causes);
    assert!(!r.causes.iter().any(|c| c.starts_with("NCCL used TCP sockets")), "{:#?}", r.causes);
    // Only device lists are NIC lists: 2.27+'s `NET/IB : Using [RO]; OOB eth0` has none.
    assert_eq!(r.net_devices.iter().map(|d| d.printed.as_str()).collect::<Vec<_>>(), ["NET/Socket : Using [0]eth0:192.0.2.2<0>"]);
    // A multi-node log with the same lines keeps the plain headline.
    let multi = body.replace("nNodes 1", "nNodes 2").replace("nranks 1", "nranks 2").replace("nRanks 1", "nRanks 2");
    assert!(explain(&multi).headline.starts_with("GPUDirect RDMA was NOT used: inter-node traffic went through host memory"));
}

/// A log that does not show whether the run spanned nodes (no `nNodes`
/// line, more than one rank) says what would happen between nodes, never
/// that traffic between them went through host memory.
#[test]
fn a_log_that_does_not_show_nodes_says_what_would_happen() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nccl-logs/h200-vm-1rank-no-rdma-socket-2.28.9.txt")).unwrap();
    let body = text.split_once("\n---\n").unwrap().1;
    let unspanned: String = body.lines().filter(|l| !l.contains("nNodes")).map(|l| format!("{}\n", l.replace("nranks 1", "nranks 2").replace("nRanks 1", "nRanks 2"))).collect();
    let r = explain(&unspanned);
    assert_eq!(r.verdict, Verdict::NotUsed, "{r:#?}");
    assert!(r.headline.starts_with("GPUDirect RDMA would NOT be used between nodes: this log does not show whether the run spanned nodes"), "{}", r.headline);
    assert!(!r.headline.contains("went through"), "{}", r.headline);
    assert!(r.causes.iter().any(|c| c.contains("would use TCP sockets between nodes (this log does not show")), "{:#?}", r.causes);
}

/// NCCL 2.4 lists both its IB and its socket network at start-up: a
/// listing is not a connection, and sockets are not the cause.
#[test]
fn a_start_up_listing_of_both_networks_is_not_a_socket_run() {
    let log = "node1:10:10 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>\n\
               node1:10:10 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB ; OOB eth0:10.0.0.1<0>\n\
               node1:10:10 [0] NCCL INFO NCCL_NET_GDR_LEVEL set by environment to LOC\n";
    let r = explain(log);
    assert!(!r.causes.iter().any(|c| c.contains("TCP sockets")), "{:#?}", r.causes);
    assert!(!r.evidence.iter().any(|e| e.contains("TCP socket transport")), "{:#?}", r.evidence);
}

/// A one-node log with only intra-node connections is not told to rerun
/// with NET debug output: no run on one node can show it.
#[test]
fn a_single_node_log_without_network_lines_names_what_would_settle_it() {
    let log = "h:1:2 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0\n\
               h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM\n";
    let r = explain(log);
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(r.headline.contains("it is of one node") && !r.headline.contains("NCCL_DEBUG_SUBSYS"), "{}", r.headline);
    assert!(r.settle_with.as_deref().unwrap().starts_with("run across two nodes"), "{:?}", r.settle_with);
}

/// A WARN-only log (NCCL_DEBUG=WARN) where libibverbs failed to load:
/// NCCL's IB transport never started, so sockets are all that is left.
#[test]
fn a_warn_only_log_without_libibverbs_is_sockets_only() {
    let log = "node1:7:7 [0] NCCL WARN Failed to open libibverbs.so[.1]\n";
    let r = explain(log);
    assert_eq!(r.verdict, Verdict::NotUsed, "{r:#?}");
    assert!(r.evidence[0].contains("libibverbs could not be loaded (line 1"), "{:?}", r.evidence);
    // With a plugin loaded, it is the plugin's network that counts.
    let with_plugin = format!("{log}node1:7:7 [0] NCCL INFO NET/Plugin: Loaded net plugin AWS Libfabric (v8)\n");
    assert_eq!(explain(&with_plugin).verdict, Verdict::Unknown);
}

/// Lines that name no device are not NIC lists, and device lists are
/// quoted as NCCL printed them, never rewritten.
#[test]
fn nic_lists_are_only_device_lists_quoted_as_printed() {
    let log = "h:1:2 [0] NCCL INFO NET/Plugin : Using internal network plugin.\n\
               h:1:2 [0] NCCL INFO NET/Socket : Using 2 threads and 8 sockets per thread\n\
               h:1:2 [0] NCCL INFO NET/IB : [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>\n\
               h:1:2 [0] NCCL INFO NET/IB : Using [0]mlx5_2:1/IB ; OOB ib0:10.1.0.1<0>\n";
    let r = explain(log);
    let printed: Vec<&str> = r.net_devices.iter().map(|d| d.printed.as_str()).collect();
    assert_eq!(printed, ["NET/IB : [0]mlx5_0:1/RoCE [1]mlx5_1:1/RoCE [RO]; OOB eth0:10.0.0.1<0>", "NET/IB : Using [0]mlx5_2:1/IB ; OOB ib0:10.1.0.1<0>"]);
    assert_eq!(r.net_devices[0].devices, ["mlx5_0", "mlx5_1"]);
    let text = r.to_string();
    assert!(text.contains("line 3: NET/IB : [0]mlx5_0:1/RoCE") && !text.contains("NET/IB : Using [0]mlx5_0"), "{text}");
}

/// aws-ofi-nccl sets NCCL_TOPO_FILE itself for the instance types it knows:
/// that is not the job overriding NCCL's topology.
#[test]
fn a_topology_file_the_plugin_set_is_not_a_user_override() {
    let log = "h:1:2 [0] NCCL INFO NET/OFI Setting NCCL_TOPO_FILE environment variable to /opt/amazon/ofi-nccl/share/aws-ofi-nccl/xml/p5.48xlarge-topo.xml\n\
               h:1:2 [0] NCCL INFO NCCL_TOPO_FILE set by environment to /opt/amazon/ofi-nccl/share/aws-ofi-nccl/xml/p5.48xlarge-topo.xml\n\
               h:1:2 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n";
    let mut r = explain(log);
    assert_eq!(r.environment[0].set_by_plugin, Some(1));
    crate::doctor::env::judge_log_environment(&mut r, "job.log");
    let topo = r.environment_judged.iter().find(|j| j.check == "env.nccl_topo_file").unwrap();
    assert_eq!(topo.status, "ok");
    assert!(topo.summary.contains("set by the network plugin itself (line 1)"), "{}", topo.summary);
    assert_eq!(r.environment_judged.iter().find(|j| j.check == "env.nccl_ib_disable").unwrap().status, "fail");
    let env = crate::doctor::jobenv::from_nccl_log(&r.environment, "job.log");
    assert_eq!(env.vars, vec![("NCCL_IB_DISABLE".to_owned(), "1".to_owned())]);
}

/// Two processes' output spliced mid-record: the host of the record after
/// the splice is unknown, never the splice's text.
#[test]
fn a_host_is_never_taken_from_a_spliced_record() {
    let log = "hostA:11:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDhostB:22:22 [1] NCCL INFO Channel 00/0 : 1[1] -> 0[0] [receive] via NET/IB/0\n";
    let r = explain(log);
    assert!(r.connections.iter().all(|c| c.host.as_deref().is_none_or(|h| !h.contains('/'))), "{:#?}", r.connections);
    let whole = explain("[1,3]<stdout>:ip-10-0-0-1.ec2:11:11 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] [send] via NET/IB/0/GDRDMA\n");
    assert_eq!(whole.connections[0].host.as_deref(), Some("ip-10-0-0-1.ec2"));
}

/// gpudirect's own plugin's lines decide, refusal first.
#[test]
fn the_gpudirect_plugin_s_lines_decide() {
    let gdr = "n1:10:11 [0] NCCL INFO NET/GPUDirect : GPU0 -> mlx5_0:1: GPUDirect RDMA via dma-buf\n\
               n1:10:11 [0] NCCL INFO NET/GPUDirect : GPU0 <- mlx5_0:1: GPUDirect RDMA via dma-buf\n\
               n1:10:11 [0] NCCL INFO NET/GPUDirect : host memory -> rxe0:1: no GPU is current on NCCL's proxy thread, nothing is staged\n\
               n1:10:11 [0] NCCL INFO NET/GPUDirect : mlx5_0:1: sent 4096 B from GPU memory, 512 B from host memory; received 4096 B into GPU memory, 0 B into host memory\n";
    let r = explain(gdr);
    assert_eq!(r.verdict, Verdict::Used, "{r:?}");
    assert!(r.headline.contains("all 2 GPU connection(s) of the GPUDirect NCCL plugin"), "{}", r.headline);
    assert!(r.evidence.iter().any(|e| e.starts_with("mlx5_0:1 moved 8192 B to and from GPU memory and 512 B through host memory")), "{:?}", r.evidence);

    let staged = format!("{gdr}n2:20:21 [1] NCCL INFO NET/GPUDirect : GPU1 <- mlx5_1:1: staged through host memory: GPU1 is SYS from mlx5_1:1, beyond NCCL's default limit PXB. Fix: set NCCL_NET_GDR_LEVEL=SYS\n");
    let r = explain(&staged);
    assert_eq!(r.verdict, Verdict::Partial, "{r:?}");
    assert!(r.evidence.iter().any(|e| e.starts_with("GPU1 <- mlx5_1:1 staged through host memory (line 5 on n2)")), "{:?}", r.evidence);
    assert!(r.causes[0].starts_with("GPU1 is SYS from mlx5_1:1, beyond NCCL's default limit PXB: set NCCL_NET_GDR_LEVEL=SYS"), "{:?}", r.causes);

    let refused = format!("{staged}n2:20:21 [1] NCCL WARN NET/GPUDirect : irecv: refusing to stage GPU1's traffic through host memory on mlx5_1:1 (GPUDIRECT_NCCL_GDR=require): GPU1 is SYS from mlx5_1:1. Fix: set NCCL_NET_GDR_LEVEL=SYS. To run staged at about half the bandwidth, set GPUDIRECT_NCCL_GDR=prefer\n");
    let r = explain(&refused);
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert!(r.headline.contains("refused to stage"), "{}", r.headline);
    assert!(r.evidence[0].contains("refused to stage GPU1's traffic through host memory on mlx5_1:1 (line 6 on n2)"), "{:?}", r.evidence);
}
