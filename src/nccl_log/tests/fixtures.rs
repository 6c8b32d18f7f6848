//! Per-fixture details: what each real log from a public issue thread
//! (and each synthetic one) is read as.

use super::*;

#[test]
fn mesh_plugin_hostless_prefix_alternating_nics() {
    let r = fixture("nccl-mesh-plugin56-gb10-ib-nogdr-hostless-prefix.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.connections.len(), 16);
    assert!(r
        .connections
        .iter()
        .all(|c| c.host.is_none() && c.pid == Some(22901)));
    let devs: BTreeSet<u64> = r.connections.iter().filter_map(|c| c.net_dev).collect();
    assert_eq!(devs, BTreeSet::from([4, 5]));
    assert!(r
        .connections
        .iter()
        .all(|c| c.sub == Some(0) && c.gdr == Some(false)));
    assert_eq!(r.ranks.len(), 1);
    assert_eq!(r.ranks[0].net_without_gdr, vec![Direction::Send]);
    assert_eq!(r.environment[0].name, "NCCL_IB_GID_INDEX");
    assert_eq!(r.environment[0].value, "3");
    // The summary line is reported as not evidence, in either direction.
    assert_eq!(r.misleading.len(), 1);
    assert!(r.misleading[0].text.contains("use ring PXN 0 GDR 0"));
    assert_eq!(r.misleading[0].line, 18);
}

#[test]
fn fastsocket_disabled_for_every_hca() {
    let r = fixture("nccl1519-h100-vm-fastsocket-gdr-disabled.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.gdr_support.len(), 8);
    assert!(r
        .gdr_support
        .iter()
        .all(|s| !s.enabled && s.net.as_deref() == Some("FastSocket")));
    let names: Vec<&str> = r
        .gdr_support
        .iter()
        .filter_map(|s| s.hca_name.as_deref())
        .collect();
    assert_eq!(
        names,
        ["eth0", "eth1", "eth2", "eth3", "eth4", "eth5", "eth6", "eth7"]
    );
    assert_eq!(r.gdr_support[7].hca, Some(7));
    assert!(
        r.evidence[0].contains("every one of the 8"),
        "{:?}",
        r.evidence
    );
    assert!(
        r.causes
            .iter()
            .any(|c| c.contains("NET/FastSocket") && c.contains("TCP")),
        "{:?}",
        r.causes
    );
    assert_eq!(r.environment[0].value, "topo.xml");
}

#[test]
fn roce_gdr_disabled_for_both_hcas() {
    let r = fixture("nccl1537-roce-gdr-disabled-for-hca.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.networks, ["IB"]);
    assert_eq!(r.net_devices.len(), 1);
    assert_eq!(r.net_devices[0].devices, ["mlx5_0", "mlx5_1"]);
    assert_eq!(r.net_devices[0].host.as_deref(), Some("hostname1"));
    let hcas: Vec<(Option<u64>, Option<&str>)> = r
        .gdr_support
        .iter()
        .map(|s| (s.hca, s.hca_name.as_deref()))
        .collect();
    assert_eq!(hcas, [(Some(0), Some("mlx5_0")), (Some(1), Some("mlx5_1"))]);
    // The peer-memory cause names the module and the NCCL <= 2.22.3 trap.
    assert!(
        r.causes[0].contains("nvidia_peermem") && r.causes[0].contains("2.22.3"),
        "{:?}",
        r.causes
    );
}

#[test]
fn nccl_2_4_ring_lines_over_sockets() {
    let r = fixture("nccl226-aws-ring-socket-nobusid-2.4.7.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.connections.len(), 16);
    let c = &r.connections[0];
    assert_eq!(
        (c.channel.unwrap(), c.sub, c.from_rank, c.to_rank),
        (0, None, 45, 46)
    );
    assert_eq!((c.from_gpu.as_deref(), c.to_gpu.as_deref()), (None, None));
    assert_eq!(c.host.as_deref(), Some("ip-172-31-5-50"));
    assert_eq!(c.net.as_deref(), Some("Socket"));
    assert_eq!(
        c.gpu.as_deref(),
        Some("0"),
        "falls back to the prefix device"
    );
    assert_eq!(r.ranks.len(), 16);
    assert!(
        r.evidence.iter().any(|e| e.contains("TCP sockets")),
        "{:?}",
        r.evidence
    );
    assert!(r
        .causes
        .iter()
        .any(|c| c.contains("TCP sockets between nodes")));
}

#[test]
fn nccl_2_5_receive_only_leading_space() {
    let r = fixture("nccl392-roce-receive-only-leading-space-2.5.7.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.nccl_versions, ["2.5.7+cuda10.0"]);
    assert_eq!(r.net_devices[0].devices, ["mlx5_0"]);
    // Ring-order lines (`Channel 00/02 :    0   1 ...`) are not connections.
    assert_eq!(r.connections.len(), 5);
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 2);
    assert!(net
        .iter()
        .all(|c| c.rank == 0 && c.direction == Direction::Receive && c.from_rank == 15));
    assert_eq!(net[0].to_gpu.as_deref(), Some("1b000"));
    let shm = r
        .connections
        .iter()
        .find(|c| c.transport == Transport::Shm)
        .unwrap();
    assert_eq!(shm.via, "direct shared memory");
    assert!(
        r.evidence.iter().any(|e| e.contains("only one rank")),
        "{:?}",
        r.evidence
    );
    let env: Vec<(&str, &str)> = r
        .environment
        .iter()
        .map(|e| (e.name.as_str(), e.value.as_str()))
        .collect();
    assert_eq!(env, [("NCCL_IB_DISABLE", "0"), ("NCCL_IB_GID_INDEX", "3")]);
}

#[test]
fn vendor_err_81_is_unknown_and_points_at_acs() {
    let r = fixture("nccl660-vm-gdr-vendor-err81-acs-hint.txt");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(r.headline.contains("IB error 4"), "{}", r.headline);
    let settle = r.settle_with.as_deref().unwrap();
    assert!(
        settle.contains("NCCL_DEBUG_SUBSYS=INIT,NET") && settle.contains("ACSCtl"),
        "{settle}"
    );
    assert!(
        r.causes[0].contains("ACS") && r.causes[0].contains("vendor err 81"),
        "{:?}",
        r.causes
    );
    assert_eq!(r.warnings.len(), 2);
    assert_eq!(r.warnings[0].host.as_deref(), Some("vm2"));
    assert_eq!(r.warnings[1].host.as_deref(), Some("vm1"));
    assert!(r.connections.is_empty());
}

#[test]
fn nccl_2_11_channels_with_bus_ids_used() {
    let r = fixture("nccl687-a100-gdrdma-nosubchannel-2.11.4.txt");
    assert_eq!(r.verdict, Verdict::Used);
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 4);
    assert!(net
        .iter()
        .all(|c| c.gdr == Some(true) && c.sub.is_none() && c.direction == Direction::Send));
    assert_eq!(net[0].from_gpu.as_deref(), Some("4a000"));
    let senders: BTreeSet<u64> = net.iter().map(|c| c.rank).collect();
    assert_eq!(senders, BTreeSet::from([3, 7]));
    assert!(r
        .connections
        .iter()
        .any(|c| c.via == "P2P/IPC/read" && c.transport == Transport::P2p));
    assert!(r.causes.is_empty(), "{:?}", r.causes);
}

#[test]
fn loopback_through_net_counts_as_used() {
    let r = fixture("nccl707-a100-gdrdma-loopback-2.7.6.txt");
    assert_eq!(r.verdict, Verdict::Used);
    assert_eq!(r.connections.len(), 12);
    let devs: BTreeSet<u64> = r.connections.iter().filter_map(|c| c.net_dev).collect();
    assert_eq!(devs, BTreeSet::from([0, 2, 4, 5]));
    assert_eq!(
        r.ranks.iter().map(|r| r.rank).collect::<Vec<_>>(),
        [0, 1, 2, 3]
    );
    let rank2 = r.ranks.iter().find(|r| r.rank == 2).unwrap();
    assert_eq!(rank2.net_with_gdr, [Direction::Send, Direction::Receive]);
}

#[test]
fn socket_network_from_init_lines() {
    let r = fixture("nccltests284-rtx4090-init-using-network-socket-2.25.1.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.nccl_versions, ["2.25.1+cuda12.1", "2.25.1+cuda12.4"]);
    assert_eq!(r.networks, ["Socket"]);
    assert_eq!(r.net_devices[0].net, "Socket");
    assert_eq!(r.net_devices[0].devices, ["eno2"]);
    assert!(
        r.evidence[0].contains("Using network Socket"),
        "{:?}",
        r.evidence
    );
    assert!(r.causes[0].contains("NCCL_IB_DISABLE=1"), "{:?}", r.causes);
    assert!(
        r.causes.iter().any(|c| c.contains("GeForce")),
        "{:?}",
        r.causes
    );
    // Same version on both hosts, only the CUDA build differs: no mismatch.
    assert!(!r
        .causes
        .iter()
        .any(|c| c.contains("different NCCL versions")));
}

#[test]
fn nccl_2_4_per_gpu_distance_lines() {
    let r = fixture("nvpeermem56-gdr-disabled-distance-2.4.x.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.gdr_support.len(), 3, "deduplicated per host");
    let s = &r.gdr_support[0];
    assert_eq!(
        (s.gpu.as_deref(), s.hca, s.enabled),
        (Some("2[2]"), Some(0), false)
    );
    assert_eq!(s.detail.as_deref(), Some("(distance 3 >= 2)"));
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 4);
    assert!(net
        .iter()
        .all(|c| c.from_gpu.is_none() && c.gdr == Some(false)));
    let recv = net
        .iter()
        .find(|c| c.direction == Direction::Receive)
        .unwrap();
    assert_eq!((recv.rank, recv.host.as_deref()), (2, Some("master_node")));
    assert!(r
        .causes
        .iter()
        .any(|c| c.contains("distance 3 >= 2") && c.contains("nvidia-smi topo -m")));
}

#[test]
fn net_between_gpus_of_one_host_counts() {
    let r = fixture("sglang4289-intranode-net-gdrdma-2.21.5.txt");
    assert_eq!(r.verdict, Verdict::Used);
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 4);
    assert!(net.iter().all(|c| c.host.as_deref() == Some("node17-2")));
    let receivers: BTreeSet<u64> = net.iter().map(|c| c.rank).collect();
    assert_eq!(receivers, BTreeSet::from([0, 4]));
    assert!(
        r.headline
            .contains("all 4 NET connection line(s) of 2 rank(s)"),
        "{}",
        r.headline
    );
    assert_eq!(
        r.evidence[1],
        "with GPUDirect RDMA: rank 0 on node17-2 GPU 0 (receive), rank 4 on node17-2 GPU 4 (receive)"
    );
}

#[test]
fn synthetic_partial_names_ranks_on_both_sides() {
    let r = fixture("synthetic-partial-gpu-nic-distance-2.21.5.txt");
    assert_eq!(r.verdict, Verdict::Partial);
    assert_eq!(
        r.headline,
        "GPUDirect RDMA was partially used: with it: rank 3 on nodeA GPU 3 (send), rank 4 on \
         nodeB GPU 0 (receive); without it (through host memory): rank 0 on nodeA GPU 0 \
         (receive), rank 7 on nodeB GPU 3 (send); the ranks without it move about half as much, and \
         each collective waits for them"
    );
    let r0 = r.ranks.iter().find(|s| s.rank == 0).unwrap();
    assert_eq!(r0.net_without_gdr, [Direction::Receive]);
    assert!(r0.net_with_gdr.is_empty());
    assert_eq!(r0.transports, ["NET/IB/0", "P2P/IPC"]);
    // Per-GPU topology lines are kept with their distances.
    assert_eq!(r.gdr_support.iter().filter(|s| s.gpu.is_some()).count(), 4);
    assert!(
        r.causes.iter().any(|c| c.contains("distance 7 > 4")),
        "{:?}",
        r.causes
    );
    // Not a pure direction split: no GDR_READ advice.
    assert!(!r.causes.iter().any(|c| c.contains("NCCL_NET_GDR_READ")));
    assert_eq!(r.misleading.len(), 1);
}

#[test]
fn synthetic_open_mpi_tags_and_ibext_plugin() {
    let r = fixture("synthetic-ompi-tag-output-ibext-gdrdma-2.19.4.txt");
    assert_eq!(r.verdict, Verdict::Used);
    assert_eq!(r.nccl_versions, ["2.19.4+cuda12.3"]);
    assert_eq!(r.networks, ["IBext_v8"]);
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 8);
    assert!(net
        .iter()
        .all(|c| c.net.as_deref() == Some("IBext_v8") && c.gdr == Some(true)));
    let hosts: BTreeSet<&str> = r
        .connections
        .iter()
        .filter_map(|c| c.host.as_deref())
        .collect();
    assert_eq!(hosts, BTreeSet::from(["gpu-a01", "gpu-a02"]));
    let dmabuf = r
        .misleading
        .iter()
        .find(|m| m.text.contains("DMA-BUF"))
        .unwrap();
    assert_eq!(dmabuf.count, 2);
    let pxn = r
        .misleading
        .iter()
        .find(|m| m.text.contains("GDR 1"))
        .unwrap();
    assert_eq!(pxn.count, 2);
    assert!(pxn.why.contains("/GDRDMA"));
}

#[test]
fn synthetic_init_only_is_unknown_and_names_the_subsystems() {
    let r = fixture("synthetic-init-only-dmabuf-pxn-gdr1-2.20.5.txt");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(
        r.headline.contains("NCCL_DEBUG_SUBSYS=INIT,NET"),
        "{}",
        r.headline
    );
    assert!(r
        .settle_with
        .as_deref()
        .unwrap()
        .contains("NCCL_DEBUG_SUBSYS=INIT,NET"));
    assert!(
        r.connections.is_empty(),
        "ring-order line taken for a connection"
    );
    assert_eq!(r.misleading.len(), 2);
    assert!(
        r.evidence[0].starts_with("no NET connection line"),
        "{:?}",
        r.evidence
    );
    assert!(r.misleading[0].text.contains("DMA-BUF") && r.misleading[0].why.contains("dma-buf"));
    assert_eq!(
        r.net_devices[0].devices,
        ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]
    );
    let text = r.to_string();
    assert!(text.contains("To settle it: rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET"));
    assert!(
        text.contains(
            "Not evidence (misleading lines):\n  line 8: 'DMA-BUF is available on GPU device 0'"
        ),
        "{text}"
    );
}

#[test]
fn synthetic_plugin_disabling_gdr() {
    let r = fixture("synthetic-plugin-disabling-gdr-bare-version-2.16.5.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.nccl_versions, ["2.16.5+cuda11.8"], "bare version line");
    assert_eq!(r.networks, ["AWS Libfabric"]);
    assert!(
        r.evidence[0].contains("disabling GDR support"),
        "{:?}",
        r.evidence
    );
    assert!(r
        .causes
        .iter()
        .any(|c| c.contains("plugin disabled GPUDirect RDMA")));
}

#[test]
fn synthetic_srun_labels_plugin_with_space_pxn_and_shared() {
    let r = fixture("synthetic-srun-prefix-ofi-shared-pxn-2.14.3.txt");
    assert_eq!(r.verdict, Verdict::Used);
    let net: Vec<&Connection> = r
        .connections
        .iter()
        .filter(|c| c.transport == Transport::Net)
        .collect();
    assert_eq!(net.len(), 6);
    assert!(net
        .iter()
        .all(|c| c.net.as_deref() == Some("AWS Libfabric")));
    let pxn = net.iter().find(|c| c.proxy_rank.is_some()).unwrap();
    assert_eq!(
        (pxn.rank, pxn.net_dev, pxn.proxy_rank),
        (1, Some(1), Some(0))
    );
    assert_eq!(pxn.via, "NET/AWS Libfabric/1(0)/GDRDMA");
    let shared: Vec<&&Connection> = net.iter().filter(|c| c.shared).collect();
    assert_eq!(shared.len(), 2);
    assert!(shared
        .iter()
        .all(|c| c.sub == Some(1) && c.gdr == Some(true)));
    assert_eq!(net[1].host.as_deref(), Some("p4d-st-2"));
}

#[test]
fn synthetic_receive_only_gdr_is_partial_with_gdr_read_advice() {
    let r = fixture("synthetic-recv-gdr-send-host-2.12.12.txt");
    assert_eq!(r.verdict, Verdict::Partial);
    assert!(r.headline.contains(
        "with it: rank 0 on gpu-node1 GPU 1a000 (receive), rank 1 on gpu-node2 GPU 1a000 (receive)"
    ));
    assert!(r
        .headline
        .contains("without it (through host memory): rank 0 on gpu-node1 GPU 1a000 (send)"));
    assert!(r.causes[0].contains("NCCL_NET_GDR_READ"), "{:?}", r.causes);
    // `[1] ` launcher prefix: host still read, device is NCCL's `[0]`.
    assert!(r.connections.iter().all(|c| c.device == Some(0)));
    assert_eq!(
        r.gdr_support[0].detail.as_deref(),
        Some("(distance 3 <= 4), read 0")
    );
}

#[test]
fn synthetic_no_module_cause() {
    let r = fixture("synthetic-no-module-2.10.3.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert_eq!(r.gdr_support.len(), 2);
    assert!(r
        .gdr_support
        .iter()
        .all(|s| s.detail.as_deref() == Some("(no module)")));
    assert!(
        r.causes[0].starts_with("no peer-memory module"),
        "{:?}",
        r.causes
    );
    assert_eq!(r.ranks.len(), 2);
    assert!(r
        .ranks
        .iter()
        .all(|s| s.net_without_gdr == [Direction::Send, Direction::Receive]));
}

#[test]
fn synthetic_single_node_crlf() {
    let raw =
        std::fs::read_to_string(data_dir().join("synthetic-single-node-intranode-crlf-2.23.4.txt"))
            .unwrap();
    assert!(raw.contains("\r\n"), "fixture lost its CRLF endings");
    let r = fixture("synthetic-single-node-intranode-crlf-2.23.4.txt");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert!(r.headline.contains("only intra-node"), "{}", r.headline);
    assert_eq!(r.connections.len(), 4);
    assert!(r.connections.iter().all(|c| !c.via.ends_with('\r')));
    assert_eq!(r.connections[2].via, "SHM/direct/direct");
    assert_eq!(r.connections[2].transport, Transport::Shm);
}

/// aws-ofi-nccl's provider and dma-buf lines (NVIDIA/nccl#1597): the
/// provider is recorded with its NIC count, and a plugin that will not
/// register dma-buf is named as a cause (GDR then needs peer memory).
#[test]
fn ofi_provider_and_plugin_dma_buf_support() {
    let r = fixture("nccl1597-p5en-efa-ofi-no-dmabuf.txt");
    assert_eq!(r.verdict, Verdict::Unknown);
    assert_eq!(r.providers.len(), 1);
    let p = &r.providers[0];
    assert_eq!((p.name.as_str(), p.nics, p.line, p.host.as_deref()), ("efa", Some(16), 10, Some("8h200-3")));
    assert_eq!(r.plugin_dmabuf, Some(false));
    assert!(r.causes[0].contains("does not register GPU memory through dma-buf (line 7"), "{:?}", r.causes);
    assert!(r.to_string().contains("Libfabric provider: efa, 16 NIC(s) (line 10)"), "{r}");
    // A "true" elsewhere does not hide a rank's "false".
    let log = "a:1:2 [0] NCCL INFO NET/OFI Support for DMA-BUF registrations: true\n\
               b:1:2 [0] NCCL INFO NET/OFI Support for DMA-BUF registrations: false\n";
    assert_eq!(explain(log).plugin_dmabuf, Some(false));
    // A tcp provider is no RDMA network.
    let log = "a:1:2 [0] NCCL INFO NET/OFI Selected Provider is tcp (found 1 nics)\n";
    assert_eq!(explain(log).providers[0].nics, Some(1));
}

/// Google's Fast Socket plugin setting up its data sockets
/// (NVIDIA/nccl#651): a TCP transport, so the traffic went through host
/// memory, even with no channel line in the excerpt.
#[test]
fn fastsocket_connect_and_accept_lines_settle_not_used() {
    let r = fixture("nccl651-gcp-a100-fastsocket-connect-accept.txt");
    assert_eq!(r.verdict, Verdict::NotUsed);
    assert!(r.evidence[0].contains("line 4: 'NET/FastSocket : Connected after 18 retries.'"), "{:?}", r.evidence);
    // The same lines from an RDMA plugin's name are no socket evidence.
    let log = "a:1:2 [0] NCCL INFO NET/IBext : Connected after 3 retries.\n";
    assert_eq!(explain(log).verdict, Verdict::Unknown);
    assert_eq!(parse::parse_tcp_connect("NET/FastSocket : Accepted data socket 2"), Some("FastSocket"));
    assert_eq!(parse::parse_tcp_connect("NET/FastSocket : Using [0]eth0"), None);
}

/// Ray cuts workers' records mid-line: a connection that lost its
/// `Channel` head is still read from its ranks on (its channel when what
/// is left still shows it), and what lost its sending rank is not read
/// as a connection at all.
#[test]
fn ray_interleaved_fragments_are_read_from_their_ranks() {
    let r = fixture("vllm-ray-interleaved-fragments-2.21.5.txt");
    assert_eq!(r.verdict, Verdict::Used);
    let p2p: Vec<(Option<u64>, u64, u64)> =
        r.connections.iter().filter(|c| c.transport == Transport::P2p).map(|c| (c.channel, c.from_rank, c.to_rank)).collect();
    assert_eq!(p2p, [(Some(23), 4, 5), (Some(23), 7, 0), (None, 6, 7)]);
    assert_eq!(r.connections.iter().filter(|c| c.gdr == Some(true)).count(), 8);
}
