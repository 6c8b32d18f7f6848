//! Line kinds from older NCCL versions and from pastes: records glued on one
//! terminal line, NCCL 2.0-2.3 wording, the per-GPU `read` suffix and the
//! 2.19+ registration path on per-HCA lines.

use super::*;

#[test]
fn records_glued_on_one_terminal_line_are_read_apart() {
    let r = fixture("deepep106-glued-terminal-records-receive-gdrdma.txt");
    assert_eq!(r.verdict, Verdict::Used);
    // Six whole records on the first line, the one broken inside its marker
    // ('NCCL I' / 'NFO Channel 01/0 ...') read from its second half, one
    // more whole record; the last, cut after 'via NET/IBext/', is dropped.
    let conns: Vec<(usize, u64, u64, u64)> = r
        .connections
        .iter()
        .map(|c| (c.line, c.channel.unwrap(), c.from_rank, c.to_rank))
        .collect();
    assert_eq!(
        conns,
        [
            (1, 8, 9, 1),
            (1, 7, 11, 3),
            (1, 3, 8, 0),
            (1, 9, 10, 2),
            (1, 3, 14, 6),
            (1, 6, 12, 4),
            (2, 1, 15, 7),
            (2, 4, 13, 5),
        ]
    );
    assert!(r
        .connections
        .iter()
        .all(|c| c.gdr == Some(true) && c.direction == Direction::Receive));
    // Each glued record has its own prefix; the fragment has none.
    let devices: Vec<Option<u64>> = r.connections.iter().map(|c| c.device).collect();
    assert_eq!(
        devices,
        [Some(1), Some(3), Some(0), Some(2), Some(6), Some(4), None, Some(5)]
    );
    assert_eq!(r.connections[6].host, None);
    assert_eq!(r.connections[7].host.as_deref(), Some("VM-17-82-centos"));
    assert_eq!(r.lines_read, 2);
    assert_eq!(r.nccl_lines, 8);
    assert_eq!(r.ranks.len(), 8);
}

#[test]
fn glued_records_with_a_record_broken_after_via() {
    let r = fixture("deepep106-glued-terminal-records-send-receive-gdrdma.txt");
    assert_eq!(r.verdict, Verdict::Used);
    let conns: Vec<(u64, u64, u64, Direction)> = r
        .connections
        .iter()
        .map(|c| (c.channel.unwrap(), c.from_rank, c.to_rank, c.direction))
        .collect();
    assert_eq!(
        conns,
        [
            (12, 13, 5, Direction::Receive),
            (3, 2, 10, Direction::Send),
            (12, 8, 0, Direction::Receive),
            (9, 15, 7, Direction::Receive),
            (2, 1, 9, Direction::Send),
            (1, 3, 11, Direction::Send),
            (12, 14, 6, Direction::Receive),
            (4, 2, 10, Direction::Send),
        ]
    );
    // The record whose prefix the excerpt cut off keeps its marker.
    assert_eq!(r.connections[0].host, None);
    assert!(r.connections.iter().all(|c| c.gdr == Some(true)));
    assert!(r.connections.iter().all(|c| c.net.as_deref() == Some("IBext")));
}

#[test]
fn nccl_2_3_internal_socket_and_the_sideband_line() {
    let r = fixture("horovod110-nccl-2.3.5-internal-socket-sideband.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.networks, ["Socket"]);
    // `NET/IB : Using interface br0 for sideband communication` is no NIC list.
    assert!(r.net_devices.is_empty(), "{:?}", r.net_devices);
    assert_eq!(r.nccl_versions, ["2.3.5+cuda9.0"]);
    assert!(
        r.evidence[0].contains("Using internal Network Socket"),
        "{:?}",
        r.evidence
    );
    // The two bare `INFO NCCL debug level set to INFO` lines are not records.
    assert_eq!(r.nccl_lines, 7);
}

#[test]
fn legacy_info_prefix_internal_ib_with_a_device_line() {
    let r = fixture("horovod489-legacy-info-prefix-internal-ib-mlx4.txt");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert_eq!(r.networks, ["IB"]);
    assert_eq!(r.net_devices.len(), 1);
    assert_eq!(r.net_devices[0].net, "IB");
    assert_eq!(r.net_devices[0].devices, ["mlx4_0"]);
    assert_eq!(r.net_devices[0].host.as_deref(), Some("nmyjs-202-75"));
    // Nine NCCL lines; TensorFlow's `INFO:tensorflow:` lines are not.
    assert_eq!(r.nccl_lines, 9);
    assert_eq!(r.lines_read, 12);
    assert!(
        !r.evidence.iter().any(|e| e.contains("no NCCL debug line")),
        "{:?}",
        r.evidence
    );
}

#[test]
fn legacy_info_prefix_internal_socket() {
    let r = fixture("horovod67-legacy-info-prefix-internal-socket.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.networks, ["Socket"]);
    assert!(r.net_devices.is_empty());
    assert_eq!(r.nccl_lines, 9);
    assert!(r.evidence[0].contains("line 3"), "{:?}", r.evidence);
}

#[test]
fn per_gpu_line_with_read_1_next_to_gdrdma_sends() {
    let r = fixture("nccltests350-gdrdma-enabled-read-1.txt");
    assert_eq!(r.verdict, Verdict::Used);
    assert_eq!(r.gdr_support.len(), 1);
    let s = &r.gdr_support[0];
    assert!(s.enabled);
    assert_eq!(s.gpu.as_deref(), Some("81000"));
    assert_eq!(s.hca, Some(1));
    assert_eq!(s.read, Some(true));
    assert_eq!(s.detail.as_deref(), Some("(distance 6 <= 7), read 1"));
    assert_eq!(s.mechanism, None);
    // `NET/IB: Dev 1 Port 1 qpn ...` is a queue pair, not a device list.
    assert!(r.net_devices.is_empty(), "{:?}", r.net_devices);
}

// No excerpt with `, read 0` alone or with the `(DMABUF)` per-HCA line was
// found in a public issue thread; these lines follow NCCL's format strings
// (src/graph/paths.cc `GPU Direct RDMA %s for GPU %lx / HCA %d (distance %d
// %s %d), read %d`; src/transport/net_ib.cc `NET/IB : GPU Direct RDMA
// (DMABUF) enabled for HCA %d '%s`, which has no closing quote).

#[test]
fn enabled_with_read_0_only_means_sends_go_through_host_memory() {
    let receive_only = "\
node1:7:9 [0] NCCL INFO GPU Direct RDMA Enabled for GPU 1b000 / HCA 0 (distance 4 <= 4), read 0
node1:7:9 [1] NCCL INFO GPU Direct RDMA Enabled for GPU 1c000 / HCA 0 (distance 4 <= 4), read 0
node1:7:9 [1] NCCL INFO GPU Direct RDMA Enabled for GPU 1c000 / HCA 0 (distance 4 <= 4), read 1";
    let r = explain(receive_only);
    assert_eq!(r.verdict, Verdict::Unknown);
    assert_eq!(
        r.gdr_support.iter().map(|s| s.read).collect::<Vec<_>>(),
        [Some(false), Some(false), Some(true)]
    );
    let at_most: Vec<&String> = r
        .evidence
        .iter()
        .filter(|e| e.contains("at most partial"))
        .collect();
    // GPU 1b000 has no read 1 line; 1c000 has one.
    assert_eq!(at_most.len(), 1, "{:?}", r.evidence);
    assert!(at_most[0].starts_with("GPU 1b000 on node1"), "{}", at_most[0]);
    assert!(
        r.causes.iter().any(|c| c.contains("NCCL_NET_GDR_READ=1")),
        "{:?}",
        r.causes
    );
    let both = explain(&receive_only.lines().skip(1).collect::<Vec<_>>().join("\n"));
    assert!(!both.evidence.iter().any(|e| e.contains("at most partial")));
    assert!(!both.causes.iter().any(|c| c.contains("NCCL_NET_GDR_READ")));
}

#[test]
fn dmabuf_and_peermem_per_hca_lines_keep_their_path() {
    let r = explain(
        "h:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA (DMABUF) enabled for HCA 0 'mlx5_0\n\
         h:1:2 [0] NCCL INFO NET/IB : GPU Direct RDMA (nvidia-peermem) enabled for HCA 1 'mlx5_1",
    );
    // (mechanism, HCA, name, enabled, detail)
    type Row<'a> = (Option<&'a str>, Option<u64>, Option<&'a str>, bool, Option<&'a str>);
    let got: Vec<Row> = r
        .gdr_support
        .iter()
        .map(|s| {
            (
                s.mechanism.as_deref(),
                s.hca,
                s.hca_name.as_deref(),
                s.enabled,
                s.detail.as_deref(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (Some("DMABUF"), Some(0), Some("mlx5_0"), true, None),
            (Some("nvidia-peermem"), Some(1), Some("mlx5_1"), true, None)
        ]
    );
    assert_eq!(r.gdr_support[0].net.as_deref(), Some("IB"));
    assert!(
        r.evidence.iter().any(|e| e.contains("(DMABUF) Enabled for HCA 0 'mlx5_0'")),
        "{:?}",
        r.evidence
    );
    assert_eq!(r.verdict, Verdict::Unknown);
}

#[test]
fn merged_nic_lists_name_their_member_devices() {
    // NVIDIA/nccl-tests#373: NCCL 2.19+ with NCCL_IB_MERGE_NICS.
    let r = explain(
        "bigo:1884:2298 [0] NCCL INFO NET/IB : Using [0]={[0] mlx5_2:1/RoCE, [1] \
         mlx5_3:1/RoCE} [1]={[2] mlx5_0:1/RoCE, [3] mlx5_1:1/RoCE} [RO]; OOB \
         bond0.526:169.136.106.9<0>",
    );
    assert_eq!(r.net_devices.len(), 1);
    assert_eq!(
        r.net_devices[0].devices,
        ["mlx5_2", "mlx5_3", "mlx5_0", "mlx5_1"]
    );
}

#[test]
fn records_split_at_each_prefix_and_keep_prose_whole() {
    let glued = "a:1:2 [0] NCCL INFO x    b:3:4 [1] misc/socket.cc:397 NCCL WARN y   [1,0]<stdout>:c:5:6 [2] NCCL INFO z";
    assert_eq!(
        parse::records(glued),
        [
            "a:1:2 [0] NCCL INFO x    ",
            "b:3:4 [1] misc/socket.cc:397 NCCL WARN y   ",
            "[1,0]<stdout>:c:5:6 [2] NCCL INFO z"
        ]
    );
    // A marker without a prefix starts its record at the marker.
    assert_eq!(
        parse::records("a:1:2 [0] NCCL INFO x NCCL INFO y"),
        ["a:1:2 [0] NCCL INFO x ", "NCCL INFO y"]
    );
    for whole in [
        "a:1:2 [0] NCCL INFO x",
        "   a:1:2 [0] NCCL INFO x",
        "no marker here at all",
        "INFO:tensorflow:Saving checkpoints",
    ] {
        assert_eq!(parse::records(whole), [whole]);
    }
    // A legacy `INFO` needs the whole prefix before it.
    let (p, level, msg) = parse::split_line("cx50:18926:19004 [1] INFO NET/Socket : 5 interfaces found");
    assert_eq!((p.host.as_deref(), p.device, level), (Some("cx50"), Some(1), Level::Info));
    assert_eq!(msg, "NET/Socket : 5 interfaces found");
    let (_, level, _) = parse::split_line("the job printed [1] INFO lines");
    assert_eq!(level, Level::None);
}

#[test]
fn dmabuf_enabled_in_one_layer_disabled_in_the_plugin() {
    let r = fixture("dgxmanager-gb10-dmabuf-enabled-plugin-disabled.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    // (mechanism, enabled, plugin, HCA name)
    type Row<'a> = (Option<&'a str>, bool, Option<&'a str>, Option<&'a str>);
    let s: Vec<Row> = r
        .gdr_support
        .iter()
        .map(|s| (s.mechanism.as_deref(), s.enabled, s.net.as_deref(), s.hca_name.as_deref()))
        .collect();
    assert_eq!(
        s,
        [
            (Some("DMABUF"), true, Some("IB"), Some("rocep1s0f0")),
            (None, false, None, Some("rocep1s0f0"))
        ]
    );
    assert_eq!(r.connections.len(), 1);
    let c = &r.connections[0];
    assert_eq!((c.net.as_deref(), c.net_dev, c.gdr), (Some("NCCL RDMA Plugin v10"), Some(0), Some(false)));
    // The DMABUF line only says the NIC could; the connection did not.
    assert!(
        r.evidence.iter().any(|e| e.contains("(DMABUF) Enabled for HCA 0 'rocep1s0f0'") && e.contains("only says the NIC could")),
        "{:?}",
        r.evidence
    );
    assert_eq!(r.net_devices[0].devices, ["rocep1s0f0"]);
}
