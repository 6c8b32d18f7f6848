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
