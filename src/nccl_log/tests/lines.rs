//! The line recognisers: prefixes, connection and support lines of every era.

use super::*;

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

/// CollNet's lines (the SHARP plugin): one rank, the NIC index, and
/// `/GDRDMA` exactly when the rank's GPU memory is registered with it.
#[test]
fn collnet_lines_are_network_connections() {
    let c = parse::parse_connection("CollNet 00/0 : 6 [receive] via COLLNET/SHARP/1/GDRDMA").unwrap();
    assert_eq!((c.channel.unwrap(), c.sub, c.from_rank, c.to_rank, c.direction), (0, Some(0), 6, 6, Direction::Receive));
    assert_eq!((c.transport, c.via.as_str()), (Transport::Net, "COLLNET/SHARP/1/GDRDMA"));
    let net = c.net.unwrap();
    assert_eq!((net.name.as_str(), net.dev), ("SHARP", Some(1)));
    assert!(net.gdr());
    let c = parse::parse_connection("CollNet 01/0 : 2 [send] via COLLNET/SHARP/5").unwrap();
    assert!(!c.net.unwrap().gdr());
    // Cut off before the NIC index, or not a CollNet path: not a connection.
    assert!(parse::parse_connection("CollNet 00/0 : 0 [receive] via COLLNET/SHARP/").is_none());
    assert!(parse::parse_connection("CollNet 00/0 : 0 [receive] via P2P/IPC").is_none());
}

#[test]
fn connection_formats_of_every_era() {
    let c = parse::parse_connection("Ring 00 : 45 -> 46 [send] via NET/Socket/0").unwrap();
    assert_eq!(
        (c.channel.unwrap(), c.from_rank, c.to_rank, c.direction),
        (0, 45, 46, Direction::Send)
    );
    let c =
        parse::parse_connection("Channel 07 : 3[4a000] -> 6[44000] [receive] via NET/IB/0/GDRDMA")
            .unwrap();
    assert_eq!(
        (c.channel.unwrap(), c.sub, c.to_gpu.as_deref()),
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

/// A bare connection fragment, as users paste them into threads: read from
/// its ranks, with no channel; an arrow in other text is not a connection.
#[test]
fn bare_fragments_without_a_channel_head() {
    let c = parse::parse_connection("9[1a000] -> 2[6b000] [send] via NET/IB/0/GDRDMA").unwrap();
    assert_eq!((c.channel, c.from_rank, c.from_gpu.as_deref(), c.to_rank, c.direction), (None, 9, Some("1a000"), 2, Direction::Send));
    assert!(c.net.as_ref().unwrap().gdr());
    let c = parse::parse_connection("l 23/0 : 4[4] -> 5[5] via P2P/IPC/read").unwrap();
    assert_eq!((c.channel, c.sub), (Some(23), Some(0)));
    for not in ["a -> b via NET/IB/0", "rank 3 -> 4 means nothing", "> 2[2] via P2P/IPC/read", "0 -> 1 via something else", "x 3 -> 4 via NET/IB/"] {
        assert!(parse::parse_connection(not).is_none(), "{not}");
    }
}
