//! The view: snapshots read strictly, frames between two, verdicts across
//! frames, and what is drawn of them.

use std::time::{Duration, Instant, SystemTime};

use super::*;
use crate::stats::expo::parse;
use crate::stats::render::{clock, render, verdict, Style};

/// An exposition as the engine writes it, for one agent and its NICs:
/// `(nic, [[out gdr, host, staged], [in ...]])`, then refusals by reason
/// and requests by (op, outcome).
fn text(agent: &str, nics: &[(&str, Bytes)], refusals: &[(&str, u64)], requests: &[(&str, &str, u64)]) -> String {
    let mut t = String::from("# HELP gpudirect_bytes_total Bytes.\n# TYPE gpudirect_bytes_total counter\n");
    for (nic, b) in nics {
        for (d, dir) in ["out", "in"].iter().enumerate() {
            for (p, path) in ["gdr", "host", "staged"].iter().enumerate() {
                t += &format!("gpudirect_bytes_total{{agent=\"{agent}\",nic=\"{nic}\",direction=\"{dir}\",path=\"{path}\"}} {}\n", b[d][p]);
            }
        }
    }
    t += "# TYPE gpudirect_requests_total counter\n";
    for (op, outcome, n) in requests {
        t += &format!("gpudirect_requests_total{{agent=\"{agent}\",op=\"{op}\",outcome=\"{outcome}\"}} {n}\n");
    }
    t += "# TYPE gpudirect_refusals_total counter\n";
    for (why, n) in refusals {
        t += &format!("gpudirect_refusals_total{{agent=\"{agent}\",reason=\"{why}\"}} {n}\n");
    }
    t += &format!("# TYPE gpudirect_connections gauge\ngpudirect_connections{{agent=\"{agent}\",state=\"live\"}} 2\n");
    t
}

const MIB: u64 = 1 << 20;

fn snap(t: &str, at: Instant, wall: SystemTime) -> Snapshot {
    Snapshot::read(&parse(t).unwrap(), at, wall).unwrap()
}

/// Pushes snapshots one second apart, from `t0`.
struct Bed {
    watch: Watch,
    t0: Instant,
    wall0: SystemTime,
    n: u32,
}

impl Bed {
    fn new() -> Bed {
        Bed { watch: Watch::new(), t0: Instant::now(), wall0: SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000), n: 0 }
    }
    fn push(&mut self, t: &str) -> Option<Frame> {
        let d = Duration::from_secs(u64::from(self.n));
        self.n += 1;
        self.watch.push(snap(t, self.t0 + d, self.wall0 + d))
    }
}

fn read_err(t: &str) -> ViewError {
    Snapshot::read(&parse(t).unwrap(), Instant::now(), SystemTime::now()).unwrap_err()
}

#[test]
fn snapshots_are_read_strictly() {
    assert_eq!(read_err("up 1\n"), ViewError::NotAnAgent);
    assert_eq!(read_err("# TYPE gpudirect_bytes_total gauge\n"), ViewError::NotAnAgent);
    let head = "# TYPE gpudirect_bytes_total counter\n";
    let e = read_err(&format!("{head}gpudirect_bytes_total{{agent=\"a\",direction=\"out\",path=\"gdr\"}} 1\n"));
    assert_eq!(e, ViewError::MissingLabel { family: BYTES, label: "nic", line: 2 });
    let e = read_err(&format!("{head}gpudirect_bytes_total{{agent=\"a\",nic=\"n\",direction=\"out\",path=\"nvlink\"}} 1\n"));
    assert!(matches!(e, ViewError::UnknownValue { label: "path", line: 2, .. }), "{e}");
    let e = read_err(&format!("{head}gpudirect_bytes_total{{agent=\"a\",nic=\"n\",direction=\"out\",path=\"gdr\"}} 1.5\n"));
    assert!(matches!(e, ViewError::NotACount { line: 2, .. }));
    let e = read_err(&format!(
        "{head}gpudirect_bytes_total{{agent=\"a\",nic=\"n\",direction=\"out\",path=\"gdr\",job=\"1\"}} 1\ngpudirect_bytes_total{{agent=\"a\",nic=\"n\",direction=\"out\",path=\"gdr\",job=\"2\"}} 1\n"
    ));
    assert_eq!(e, ViewError::Repeated { family: BYTES, line: 3, first: 2 });
    // An agent with no NIC yet is still an agent.
    let s = snap(&format!("{head}# TYPE gpudirect_connections gauge\ngpudirect_connections{{agent=\"a\",state=\"live\"}} 0\n"), Instant::now(), SystemTime::now());
    assert_eq!(s.agents.keys().collect::<Vec<_>>(), ["a"]);
}

#[test]
fn rates_by_path_and_direction() {
    let mut bed = Bed::new();
    assert!(bed.push(&text("a", &[("mlx5_0", [[0, 0, 0], [0, 0, 0]])], &[], &[])).is_none(), "one scrape shows nothing");
    let f = bed.push(&text("a", &[("mlx5_0", [[300 * MIB, 10 * MIB, 0], [0, 0, 0]])], &[], &[("write", "posted", 5), ("write", "completed", 5), ("read", "failed", 0)])).unwrap();
    assert_eq!(f.elapsed, Duration::from_secs(1));
    let a = &f.agents[0];
    assert_eq!(a.continuity, Continuity::Same);
    assert_eq!(a.live, Some(2));
    let n = &a.nics[0];
    assert_eq!(n.rates[0], [300.0 * MIB as f64, 10.0 * MIB as f64, 0.0]);
    assert_eq!(n.staged_share(0), Some(0.0));
    assert_eq!(n.staged_share(1), None);
    assert_eq!(n.verdict, Verdict::NotStaged { gdr: 300 * MIB });
    assert_eq!(a.requests[1], OpRequests { op: "write".into(), outcomes: vec![("posted".into(), 5), ("completed".into(), 5)] });
    assert!(a.requests[0].outcomes.is_empty(), "read: nothing grew");
    let shown = render(&f, "127.0.0.1:1", Style::default());
    assert!(shown.contains("no GPU traffic staged on mlx5_0: 300.0 MiB of GPU memory moved by GPUDirect RDMA"), "{shown}");
    assert!(shown.contains("      300.0        10.0         0.0      0%"), "{shown}");
    assert!(!shown.contains('\x1b'), "no colour unless asked");
}

/// Staged bytes: the share since the view first saw them grow, the time,
/// and red on a terminal.
#[test]
fn staging_is_named_with_its_share_and_since_when() {
    let mut bed = Bed::new();
    let one = |gdr, host, staged| text("a", &[("mlx5_3", [[gdr, host, staged], [0, 0, 0]]), ("mlx5_4", [[0, 5, 0], [0, 0, 0]])], &[], &[]);
    bed.push(&one(1000, 0, 0));
    let f = bed.push(&one(2000, 0, 0)).unwrap();
    assert!(matches!(f.agents[0].nics[0].verdict, Verdict::NotStaged { .. }));
    // 880 gdr and 120 staged bytes in the interval: 12%.
    let f = bed.push(&one(2880, 0, 120)).unwrap();
    let v = f.agents[0].nics[0].verdict.clone();
    let since = bed.wall0 + Duration::from_secs(2);
    assert_eq!(v, Verdict::Staged { since, share: 0.12, gpu_share: 0.12 });
    // Later intervals add to the window, whatever they move; the time stays.
    let f = bed.push(&one(2880, 1000, 220)).unwrap();
    let Verdict::Staged { since: s2, share, gpu_share } = f.agents[0].nics[0].verdict.clone() else { panic!() };
    assert_eq!(s2, since);
    assert!((share - 220.0 / 2100.0).abs() < 1e-12 && (gpu_share - 0.2).abs() < 1e-12, "{share} {gpu_share}");
    let nic = &f.agents[0].nics[0];
    let line = verdict(nic);
    let hhmm = clock(since, false);
    assert_eq!(line, format!("GPU traffic staged through host memory: 10% of bytes on mlx5_3 since {hhmm} (20% of its GPU bytes)"));
    assert_eq!(verdict(&f.agents[0].nics[1]), "no GPU traffic seen on mlx5_4 (host memory only)");
    let red = render(&f, "x:1", Style { colour: true, clear: false });
    assert!(red.contains(&format!("\x1b[31m{line}\x1b[0m")), "{red}");
    assert!(red.contains("\x1b[31m     9%\x1b[0m"), "the interval's staged share in red: {red}");
    assert!(render(&f, "x:1", Style { colour: false, clear: true }).starts_with("\x1b[H\x1b[2J"));
}

#[test]
fn staging_before_the_view_and_no_gpu_traffic() {
    let mut bed = Bed::new();
    let t = text("a", &[("n0", [[0, 0, 50], [50, 0, 0]]), ("n1", [[0, 0, 0], [0, 0, 0]])], &[], &[]);
    bed.push(&t);
    let f = bed.push(&t).unwrap();
    assert_eq!(f.agents[0].nics[0].verdict, Verdict::StagedBefore { share: 0.5, gpu_share: 0.5 });
    assert!(verdict(&f.agents[0].nics[0]).contains("before this view began: 50% of bytes on n0 since the agent started"));
    assert_eq!(f.agents[0].nics[1].verdict, Verdict::NoGpuTraffic);
    assert_eq!(verdict(&f.agents[0].nics[1]), "no GPU traffic seen on n1");
    let shown = render(&f, "x:1", Style::default());
    assert!(!shown.contains("GPUDirect RDMA"), "nothing said to work where no gdr byte moved: {shown}");
}

#[test]
fn a_restart_is_said_not_shown_as_negative_rates() {
    let mut bed = Bed::new();
    bed.push(&text("a", &[("n", [[900 * MIB, 0, 0], [0, 0, 0]])], &[("control", 4)], &[("write", "posted", 100)]));
    let f = bed.push(&text("a", &[("n", [[10 * MIB, 0, 0], [0, 0, 0]])], &[("control", 1)], &[("write", "posted", 3)])).unwrap();
    let a = &f.agents[0];
    assert_eq!(a.continuity, Continuity::Restarted);
    assert_eq!(a.nics[0].rates[0][0], 10.0 * MIB as f64, "counted from the restart");
    assert_eq!(a.refusals, [("control".to_owned(), 1)]);
    let shown = render(&f, "x:1", Style::default());
    assert!(shown.contains("restarted during this interval (its counters went down)"), "{shown}");
    assert!(!shown.split_whitespace().any(|w| w.len() > 1 && w.starts_with('-')), "no negative figure: {shown}");
    // A refusal count going down alone is a restart too.
    let mut bed = Bed::new();
    bed.push(&text("a", &[("n", Bytes::default())], &[("control", 4)], &[]));
    assert_eq!(bed.push(&text("a", &[("n", Bytes::default())], &[("control", 3)], &[])).unwrap().agents[0].continuity, Continuity::Restarted);
}

#[test]
fn refusals_that_grew_and_agents_that_came_and_went() {
    let mut bed = Bed::new();
    bed.push(&text("a", &[("n", Bytes::default())], &[("control", 1), ("unknown_sender", 0)], &[]));
    let f = bed.push(&text("a", &[("n", Bytes::default())], &[("control", 1), ("unknown_sender", 3)], &[("read", "failed", 2)])).unwrap();
    assert_eq!(f.agents[0].refusals, [("unknown_sender".to_owned(), 3)]);
    let shown = render(&f, "x:1", Style { colour: true, clear: false });
    assert!(shown.contains("\x1b[31mrefused in the interval: unknown_sender +3\x1b[0m"), "{shown}");
    assert!(shown.contains("requests in the interval: read \x1b[31m2 failed\x1b[0m"), "{shown}");
    let f = bed.push(&text("b", &[("n", [[MIB, 0, 0], [0, 0, 0]])], &[], &[])).unwrap();
    assert_eq!(f.gone, ["a"]);
    assert_eq!(f.agents[0].continuity, Continuity::New);
    assert!(render(&f, "x:1", Style::default()).contains("agent a no longer served"));
}

#[test]
fn hostile_names_are_shown_escaped_and_cut() {
    let mut bed = Bed::new();
    let evil = "127.0.0.1:1\u{1b}[2J";
    let t = format!("# TYPE gpudirect_bytes_total counter\ngpudirect_bytes_total{{agent=\"{}\",nic=\"{}\",direction=\"out\",path=\"gdr\"}} 1\n", "\u{1b}[2J", "a".repeat(500));
    bed.push(&t);
    let f = bed.push(&t).unwrap();
    let shown = render(&f, evil, Style::default());
    assert!(!shown.contains('\u{1b}'), "{shown}");
    assert!(shown.contains("agent \\u{1b}[2J"), "{shown}");
    assert!(shown.lines().all(|l| l.chars().count() < 200), "{shown}");
}

/// What prometheus_client serves of the same snapshot in a Python process
/// (`gpudirect.metrics.Collector`): labels sorted, floats, other families.
#[test]
fn prometheus_client_s_exposition_reads_the_same() {
    let t = "# HELP python_gc_objects_collected_total Objects collected during gc\n\
             # TYPE python_gc_objects_collected_total counter\n\
             python_gc_objects_collected_total{generation=\"0\"} 351.0\n\
             # HELP gpudirect_bytes_total Bytes this agent's NICs moved.\n\
             # TYPE gpudirect_bytes_total counter\n\
             gpudirect_bytes_total{agent=\"pre\\\"fill\",direction=\"out\",nic=\"mlx5_0\",path=\"host\"} 3.145728e+06\n\
             gpudirect_bytes_total{agent=\"pre\\\"fill\",direction=\"in\",nic=\"mlx5_0\",path=\"staged\"} 4096.0\n\
             # HELP gpudirect_connections Connections.\n\
             # TYPE gpudirect_connections gauge\n\
             gpudirect_connections{agent=\"pre\\\"fill\",state=\"live\"} 3.0\n";
    let s = snap(t, Instant::now(), SystemTime::now());
    let a = &s.agents["pre\"fill"];
    assert_eq!(a.nics["mlx5_0"], [[0, 3 << 20, 0], [0, 0, 4096]]);
    assert_eq!(a.connections["live"], 3);
}

/// An endpoint that answers two scrapes a second apart with snapshots
/// half a second apart (its render cache, a slow agent): the rate divides
/// by the agent's own clock; a clock that went back is a restart.
#[test]
fn rates_divide_by_the_agents_own_clock() {
    let up = |s: f64| format!("# TYPE gpudirect_uptime_seconds gauge\ngpudirect_uptime_seconds{{agent=\"a\"}} {s}\n");
    let mut bed = Bed::new();
    assert!(bed.push(&(text("a", &[("mlx5_0", [[0; 3], [0; 3]])], &[], &[]) + &up(10.0))).is_none());
    let f = bed.push(&(text("a", &[("mlx5_0", [[0, 50 * MIB, 0], [0; 3]])], &[], &[]) + &up(10.5))).unwrap();
    assert_eq!(f.agents[0].nics[0].rates[0][1], (100 * MIB) as f64);
    let f = bed.push(&(text("a", &[("mlx5_0", [[0, 60 * MIB, 0], [0; 3]])], &[], &[]) + &up(0.2))).unwrap();
    assert_eq!(f.agents[0].continuity, Continuity::Restarted);
    assert!(matches!(read_err(&(text("a", &[], &[], &[]) + &up(-1.0))), ViewError::NotACount { .. }));
}

/// The NCCL plugin's endpoint, as its own renderer writes it, reads as
/// an agent named `nccl-net`: its staged bytes staged, its comms live,
/// its refusals by reason, the verdict red on the staged NIC.
#[test]
fn the_nccl_plugin_s_exposition_reads_as_an_agent() {
    use gpudirect::metrics::{DataPath, Direction, PathCounters};
    use nccl_net_gpudirect::{prometheus_text, NicStats, PluginStats};
    let plugin = |staged: u64, uptime: f64| {
        let t = PathCounters::default();
        t.add(Direction::Out, DataPath::Staged, staged);
        t.add(Direction::Out, DataPath::Gdr, 3 * staged);
        let nic = |name: &str, traffic| NicStats { nic: name.into(), traffic, comms: 1, rcache: Default::default() };
        prometheus_text(&PluginStats {
            uptime: Duration::from_secs_f64(uptime),
            nics: vec![nic("mlx5_0:1", t.read()), nic("mlx5_1:1", PathCounters::default().read())],
            refused_staged: 0,
            refused_peer_claims: 2,
            refused_setup_closed: 0,
        })
    };
    let mut bed = Bed::new();
    assert!(bed.push(&plugin(0, 1.0)).is_none());
    let f = bed.push(&plugin(MIB, 2.0)).unwrap();
    let a = &f.agents[0];
    assert_eq!(a.name, "nccl-net");
    let staged = a.nics.iter().find(|n| n.nic == "mlx5_0:1").unwrap();
    assert_eq!(staged.rates[0], [(3 * MIB) as f64, 0.0, MIB as f64]);
    assert_eq!(staged.staged_share(0), Some(0.25));
    assert!(verdict(staged).contains("staged"), "{}", verdict(staged));
    let s = snap(&plugin(MIB, 2.0), Instant::now(), SystemTime::now());
    let c = &s.agents["nccl-net"];
    assert_eq!((c.connections["live"], c.refusals["nccl_peer_claim"]), (2, 2));
}

/// Attack (review, fail open): the plugin's text with its staged series
/// cut (a proxy, a relabelling, an older plugin) and GPU bytes moving:
/// the verdict is "cannot tell", never "not staged" or "no GPU traffic",
/// and says so when drawn.
#[test]
fn plugin_text_without_staged_series_cannot_tell() {
    use gpudirect::metrics::{DataPath, Direction, PathCounters};
    use nccl_net_gpudirect::{prometheus_text, NicStats, PluginStats};
    let plugin = |gdr: u64, host: u64, uptime: f64| {
        let t = PathCounters::default();
        t.add(Direction::Out, DataPath::Gdr, gdr);
        t.add(Direction::In, DataPath::Host, host);
        let text = prometheus_text(&PluginStats {
            uptime: Duration::from_secs_f64(uptime),
            nics: vec![NicStats { nic: "mlx5_0:1".into(), traffic: t.read(), comms: 1, rcache: Default::default() }],
            refused_staged: 0,
            refused_peer_claims: 0,
            refused_setup_closed: 0,
        });
        text.lines().filter(|l| !l.contains("path=\"staged\"")).map(|l| format!("{l}\n")).collect::<String>()
    };
    for (gdr, host) in [(MIB, 0), (0, MIB), (0, 0)] {
        let mut bed = Bed::new();
        assert!(bed.push(&plugin(0, 0, 1.0)).is_none());
        let f = bed.push(&plugin(gdr, host, 2.0)).unwrap();
        let nic = &f.agents[0].nics[0];
        assert!(matches!(nic.verdict, Verdict::Unread { .. }), "gdr {gdr} host {host}: {:?}", nic.verdict);
        assert!(verdict(nic).contains("cannot tell"), "{}", verdict(nic));
    }
}

/// Attack (review, output carrying input): a NIC name with the format's
/// specials and control characters comes back whole from the plugin's
/// text, forges no other agent or NIC, and is drawn escaped.
#[test]
fn plugin_nic_names_round_trip_and_are_drawn_escaped() {
    use gpudirect::metrics::{DataPath, Direction, PathCounters};
    use nccl_net_gpudirect::{prometheus_text, NicStats, PluginStats};
    let evil = "x\"} 1\ngpudirect_bytes_total{agent=\"other\",nic=\"y\",direction=\"out\",path=\"staged\"} 999\r\u{1b}[2J\\";
    let t = PathCounters::default();
    t.add(Direction::Out, DataPath::Staged, 4096);
    let text = prometheus_text(&PluginStats {
        uptime: Duration::from_secs(1),
        nics: vec![NicStats { nic: evil.into(), traffic: t.read(), comms: 1, rcache: Default::default() }],
        refused_staged: 0,
        refused_peer_claims: 0,
        refused_setup_closed: 0,
    });
    let s = snap(&text, Instant::now(), SystemTime::now());
    assert_eq!(s.agents.keys().collect::<Vec<_>>(), ["nccl-net"]);
    let a = &s.agents["nccl-net"];
    assert_eq!(a.nics.keys().collect::<Vec<_>>(), [evil]);
    assert_eq!(a.nics[evil][0][2], 4096);
    let mut bed = Bed::new();
    bed.push(&text);
    let f = bed.push(&text).unwrap();
    let drawn = render(&f, "127.0.0.1:9400", Style::default());
    assert!(!drawn.contains('\u{1b}') && !drawn.contains('\r'), "{drawn:?}");
}
