use std::collections::BTreeSet;
use std::path::PathBuf;

use super::parse::{self, Level};
use super::text::channel_ranges;
use super::*;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/nccl-logs")
}

/// A fixture: its `expected:` header and the excerpt after the first `---`.
struct Fixture {
    name: String,
    expected: String,
    excerpt: String,
}

fn parse_fixture(name: &str, text: &str) -> Fixture {
    let mut expected = None;
    let mut lines = text.lines();
    for line in lines.by_ref() {
        if line == "---" {
            break;
        }
        if let Some(v) = line.strip_prefix("expected: gdr=") {
            expected = Some(v.trim().to_string());
        }
    }
    let excerpt: Vec<&str> = lines.collect();
    assert!(!excerpt.is_empty(), "{name}: no excerpt after ---");
    Fixture {
        name: name.to_string(),
        expected: expected.unwrap_or_else(|| panic!("{name}: no 'expected: gdr=' header")),
        excerpt: excerpt.join("\n"),
    }
}

fn fixtures() -> Vec<Fixture> {
    let mut out: Vec<Fixture> = std::fs::read_dir(data_dir())
        .expect("tests/data/nccl-logs exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            parse_fixture(&name, &std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn fixture(name: &str) -> Report {
    let path = data_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    explain(&parse_fixture(name, &text).excerpt)
}

fn verdict_word(v: Verdict) -> String {
    serde_json::to_value(v)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn every_fixture_gets_its_expected_verdict() {
    let all = fixtures();
    // 11 real excerpts from public threads plus our synthetic ones.
    assert!(all.len() >= 19, "only {} fixtures found", all.len());
    assert!(
        all.iter()
            .filter(|f| f.name.starts_with("synthetic-"))
            .count()
            >= 8
    );
    let mut wrong = Vec::new();
    for f in &all {
        let report = explain(&f.excerpt);
        let got = verdict_word(report.verdict);
        if got != f.expected {
            wrong.push(format!(
                "{}: expected {}, got {got}\n{report}",
                f.name, f.expected
            ));
        }
        let text = report.to_string();
        assert_eq!(
            text.lines().next(),
            Some(report.headline.as_str()),
            "{}",
            f.name
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["verdict"], f.expected.as_str(), "{}", f.name);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

#[test]
fn every_verdict_appears_in_the_fixtures() {
    let seen: BTreeSet<String> = fixtures().iter().map(|f| f.expected.clone()).collect();
    for v in ["used", "partial", "not-used", "unknown"] {
        assert!(seen.contains(v), "no fixture expects {v}");
    }
}

#[test]
fn headlines_use_the_verdict_sentences() {
    let cases = [
        (
            "nccl687-a100-gdrdma-nosubchannel-2.11.4.txt",
            "GPUDirect RDMA was used",
        ),
        (
            "synthetic-recv-gdr-send-host-2.12.12.txt",
            "GPUDirect RDMA was partially used",
        ),
        (
            "nccl226-aws-ring-socket-nobusid-2.4.7.txt",
            "GPUDirect RDMA was NOT used: inter-node traffic went through host memory",
        ),
        (
            "nccl660-vm-gdr-vendor-err81-acs-hint.txt",
            "cannot tell from this log",
        ),
    ];
    for (name, start) in cases {
        let r = fixture(name);
        assert!(r.headline.starts_with(start), "{name}: {}", r.headline);
    }
}

// --- per-fixture details -------------------------------------------------

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
        (c.channel, c.sub, c.from_rank, c.to_rank),
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
         (receive), rank 7 on nodeB GPU 3 (send)"
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

// --- rules on small inputs ----------------------------------------------

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
        "gdr_support",
        "environment",
        "ranks",
        "connections",
        "misleading",
        "warnings",
        "causes",
        "lines_read",
        "nccl_lines",
    ]);
    assert_eq!(keys, expected);
    assert_eq!(v["verdict"], "partial");
    assert_eq!(v["connections"][0]["direction"], "receive");
    assert_eq!(v["connections"][0]["transport"], "net");
    assert_eq!(v["connections"][0]["gdr"], true);
    assert_eq!(v["ranks"][0]["net_with_gdr"][0], "receive");
    assert_eq!(verdict_word(Verdict::NotUsed), "not-used");
}

// --- line recognisers ----------------------------------------------------

#[test]
fn prefixes_are_split_in_all_known_shapes() {
    // (line, host, pid, device)
    type Case<'a> = (&'a str, Option<&'a str>, Option<u64>, Option<u64>);
    let cases: [Case; 7] = [
        (
            "host:12:34 [3] NCCL INFO x",
            Some("host"),
            Some(12),
            Some(3),
        ),
        (":22901:22901 [0] NCCL INFO x", None, Some(22901), Some(0)),
        (" [0] NCCL INFO x", None, None, Some(0)),
        (
            "[1,3]<stdout>:node:5:6 [2] NCCL INFO x",
            Some("node"),
            Some(5),
            Some(2),
        ),
        (
            "[0] node:5:6 [1] NCCL INFO x",
            Some("node"),
            Some(5),
            Some(1),
        ),
        (
            " 12: node:5:6 [7] NCCL INFO x",
            Some("node"),
            Some(5),
            Some(7),
        ),
        (
            "vm2:15364:15376 [0] transport/net_ib.cc:1192 NCCL WARN x",
            Some("vm2"),
            Some(15364),
            Some(0),
        ),
    ];
    for (line, host, pid, dev) in cases {
        let (p, level, msg) = parse::split_line(line);
        assert_eq!(
            (p.host.as_deref(), p.pid, p.device),
            (host, pid, dev),
            "{line}"
        );
        assert_ne!(level, Level::None);
        assert_eq!(msg, "x");
    }
    let (p, level, msg) = parse::split_line("NCCL version 2.4.7+cuda9.2");
    assert_eq!(
        (p, level, msg),
        (
            parse::Prefix::default(),
            Level::None,
            "NCCL version 2.4.7+cuda9.2"
        )
    );
}

#[test]
fn connection_formats_of_every_era() {
    let c = parse::parse_connection("Ring 00 : 45 -> 46 [send] via NET/Socket/0").unwrap();
    assert_eq!(
        (c.channel, c.from_rank, c.to_rank, c.direction),
        (0, 45, 46, Direction::Send)
    );
    let c =
        parse::parse_connection("Channel 07 : 3[4a000] -> 6[44000] [receive] via NET/IB/0/GDRDMA")
            .unwrap();
    assert_eq!(
        (c.channel, c.sub, c.to_gpu.as_deref()),
        (7, None, Some("44000"))
    );
    assert!(c.net.as_ref().unwrap().gdr());
    let c = parse::parse_connection(
        "Channel 12/1 : 0[0] -> 8[0] [send] via NET/IB/3(2)/GDRDMA/Shared comm 0x1 nRanks 16",
    )
    .unwrap();
    assert_eq!(c.via, "NET/IB/3(2)/GDRDMA/Shared");
    let net = c.net.unwrap();
    assert_eq!(
        (net.dev, net.proxy_rank, net.flags.len()),
        (Some(3), Some(2), 2)
    );
    let c =
        parse::parse_connection("Channel 00/0 : 0[0] -> 1[1] via P2P/direct pointer/read").unwrap();
    assert_eq!(
        (c.transport, c.via.as_str()),
        (Transport::P2p, "P2P/direct pointer/read")
    );
    assert!(parse::parse_connection("Channel 00/02 :    0   1   2   3").is_none());
    assert!(parse::parse_connection("Ring 00 : 0 1 2 3").is_none());
    assert!(parse::parse_connection("Channel 00/0 : 0[0] -> 1[0] [send] via").is_none());
}

#[test]
fn support_lines_of_every_era() {
    let s =
        parse::parse_support("NET/IB : GPU Direct RDMA Disabled for HCA 0 'mlx5_0' (no module)")
            .unwrap();
    assert_eq!(
        (s.net.as_deref(), s.enabled, s.hca, s.hca_name.as_deref()),
        (Some("IB"), false, Some(0), Some("mlx5_0"))
    );
    let s = parse::parse_support(
        "GPU Direct RDMA Enabled for GPU 1b000 / HCA 2 (distance 4 <= 4), read 1",
    )
    .unwrap();
    assert_eq!(
        (s.net, s.gpu.as_deref(), s.hca, s.enabled),
        (None, Some("1b000"), Some(2), true)
    );
    let s = parse::parse_support(
        "NET/IB : GPU Direct RDMA (nvidia-peermem) enabled for HCA 1 'mlx5_1'",
    )
    .unwrap();
    assert!(s.enabled && s.hca == Some(1));
    assert!(parse::parse_support("GPU Direct RDMA Disabled").is_none());
    assert!(parse::parse_support("GPU Direct RDMA Disabled for").is_none());
    assert_eq!(
        parse::parse_completion_error("NET/IB : Got completion from peer 1.2.3.4<5> with error 4, opcode 0, len 0, vendor err 81"),
        Some((4, Some("81".to_string())))
    );
    assert_eq!(
        parse::parse_env("NCCL_NET_GDR_LEVEL set by environment to PHB"),
        Some(("NCCL_NET_GDR_LEVEL".into(), "PHB".into()))
    );
}

// --- never panics ---------------------------------------------------------

use crate::test_rng::Rng;

const PIECES: &[&str] = &[
    "Channel ",
    "Ring ",
    "00",
    "/",
    "0",
    " : ",
    "[",
    "]",
    "->",
    " [send] ",
    "[receive]",
    "via ",
    "NET/",
    "IB",
    "/GDRDMA",
    "/Shared",
    "(",
    ")",
    "NCCL INFO ",
    "NCCL WARN ",
    ":",
    " ",
    "\n",
    "é",
    "\u{FFFD}",
    "GPU Direct RDMA ",
    "Disabled",
    "Enabled ",
    "for HCA ",
    "for GPU ",
    "'",
    "HCA ",
    " set by environment to ",
    "with error ",
    "vendor err ",
    "Using network ",
    "NET/Socket : Using ",
    "NCCL version ",
    "99999999999999999999999",
    "18446744073709551615",
    "DMA-BUF is available",
    "use ring PXN 0 GDR 1",
    "host:1:2 [0] ",
    "[1,3]<stdout>:",
    "\t",
    "\r",
    "Got completion ",
];

fn check_no_panic(text: &str) {
    let r = explain(text);
    let shown = r.to_string();
    assert_eq!(shown.lines().next(), Some(r.headline.as_str()));
    let expected_start = match r.verdict {
        Verdict::Used => HEAD_USED,
        Verdict::Partial => HEAD_PARTIAL,
        Verdict::NotUsed => HEAD_NOT_USED,
        Verdict::Unknown => HEAD_UNKNOWN,
    };
    assert!(
        r.headline.starts_with(expected_start),
        "{:?} / {}",
        r.verdict,
        r.headline
    );
    assert_eq!(r.verdict == Verdict::Unknown, r.settle_with.is_some());
    serde_json::to_string(&r).unwrap();
}

#[test]
fn never_panics_on_random_bytes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..500 {
        let len = rng.below(400);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        check_no_panic(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn never_panics_on_spliced_log_pieces() {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for _ in 0..3000 {
        let mut s = String::new();
        for _ in 0..rng.below(40) {
            s.push_str(PIECES[rng.below(PIECES.len())]);
        }
        check_no_panic(&s);
    }
}

#[test]
fn never_panics_on_truncated_and_mangled_fixture_lines() {
    let mut rng = Rng(42);
    let lines: Vec<String> = fixtures()
        .into_iter()
        .flat_map(|f| f.excerpt.lines().map(str::to_string).collect::<Vec<_>>())
        .collect();
    assert!(lines.len() > 150);
    for line in &lines {
        // Every prefix of every real line, cut at each character boundary.
        for (i, _) in line.char_indices() {
            check_no_panic(&line[..i]);
        }
    }
    for _ in 0..2000 {
        let line = &lines[rng.below(lines.len())];
        let mut chars: Vec<char> = line.chars().collect();
        for _ in 0..=rng.below(4) {
            let at = rng.below(chars.len() + 1);
            match rng.below(3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 => chars
                    .splice(at..at, PIECES[rng.below(PIECES.len())].chars())
                    .for_each(drop),
                _ => chars.insert(
                    at,
                    char::from_u32(rng.next() as u32 % 0x11_0000).unwrap_or('\u{FFFD}'),
                ),
            }
        }
        check_no_panic(&chars.into_iter().collect::<String>());
    }
}

#[test]
fn huge_numbers_are_not_connections_but_do_not_panic() {
    let r = explain(
        "h:1:2 [0] NCCL INFO Channel 99999999999999999999 : 1 -> 2 [send] via NET/IB/0/GDRDMA\n",
    );
    assert!(r.connections.is_empty());
    let r = explain(
        "h:1:2 [0] NCCL INFO Channel 18446744073709551615/18446744073709551615 : 18446744073709551615[0] -> 0[0] [send] via NET/IB/18446744073709551615/GDRDMA\n\
         h:1:2 [0] NCCL INFO Channel 18446744073709551614/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA\n",
    );
    assert_eq!(r.connections.len(), 2);
    assert_eq!(r.connections[0].net_dev, Some(u64::MAX));
    assert_eq!(r.verdict, Verdict::Used);
    assert!(channel_ranges(&BTreeSet::from([u64::MAX - 1, u64::MAX])).contains('-'));
    check_no_panic(&"NCCL INFO ".repeat(10_000));
}
