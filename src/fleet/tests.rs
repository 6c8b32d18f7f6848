//! A fleet of the dgx-pix capture, a few nodes mutated as the field breaks
//! them: each named in the right group with the right cause, nothing else.

use super::*;

/// A node's name and what breaks it.
type Mutation<'a> = (&'a str, fn(&mut serde_json::Value));

/// Ten nodes' captures (`node001`..`node010`), the named ones mutated.
fn captures(mutate: &[Mutation<'_>]) -> Vec<(String, String)> {
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")).unwrap()).unwrap();
    (1..=10)
        .map(|i| {
            let name = format!("node{i:03}");
            let mut c = base.clone();
            if let Some((_, f)) = mutate.iter().find(|(n, _)| *n == name) {
                f(&mut c);
            }
            (name, serde_json::to_string(&c).unwrap())
        })
        .collect()
}

fn fleet(dir: &Path, mutate: &[Mutation<'_>]) {
    for (name, text) in captures(mutate) {
        std::fs::write(dir.join(format!("{name}.json")), text).unwrap();
    }
}

/// The mutations the tests break nodes with, as the field does.
const BROKEN: [Mutation<'static>; 5] = [("node003", ib_disable), ("node005", no_path), ("node006", no_path), ("node007", old_driver), ("node009", far_hca)];

fn set_env(c: &mut serde_json::Value, k: &str, v: &str) {
    c["env"]["vars"].as_array_mut().unwrap().push(serde_json::json!([k, v]));
    c["env"]["origins"].as_array_mut().unwrap().push(serde_json::json!([k, "rank environment"]));
}

fn ib_disable(c: &mut serde_json::Value) {
    set_env(c, "NCCL_IB_DISABLE", "1");
}

fn no_path(c: &mut serde_json::Value) {
    for g in c["gpus"]["Ok"].as_array_mut().unwrap() {
        g["dma_buf_supported"] = false.into();
    }
    for r in c["rdma"]["Ok"].as_array_mut().unwrap() {
        r["dma_buf"] = serde_json::json!({"Ok": {"Unsupported": 95}});
    }
}

fn old_driver(c: &mut serde_json::Value) {
    for g in c["gpus"]["Ok"].as_array_mut().unwrap() {
        g["driver_version"] = 12020.into();
    }
}

fn far_hca(c: &mut serde_json::Value) {
    set_env(c, "NCCL_IB_HCA", "=mlx5_1");
}

#[test]
fn each_bad_node_is_named_with_its_cause_and_nothing_else() {
    let tree = testkit::Tree::new("fleet");
    fleet(tree.path(), &BROKEN);
    let r = check(&Collection::Dir(tree.path().to_path_buf()), None, Some(&Expect::Count(10))).unwrap();
    assert_eq!(r.nodes, 10);
    assert_eq!(r.exit_status(), 1);
    assert!(!r.available_everywhere);
    assert!(r.line.starts_with("fleet: 3 of 10 node(s) will NOT use GPUDirect RDMA (2 cause(s))"), "{}", r.line);
    let groups: Vec<(&str, &[String])> = r.staging.iter().map(|g| (g.folded.as_str(), g.checks.as_slice())).collect();
    assert_eq!(groups.len(), 2, "{groups:?}");
    let ib = r.staging.iter().find(|g| g.folded == "node003").expect("node003's group");
    assert_eq!(ib.checks, ["env.nccl_ib_disable"]);
    assert!(ib.fix.as_deref().is_some_and(|f| f.contains("Unset NCCL_IB_DISABLE")), "{ib:?}");
    let nopath = r.staging.iter().find(|g| g.folded == "node[005-006]").expect("the no-path group");
    assert!(nopath.checks.iter().any(|c| c.starts_with("rdma.dmabuf")), "{nopath:?}");
    // Where the verdict holds: the old driver and the far NIC are told apart
    // from the majority, and no healthy node is named anywhere.
    let named = |node: &str| r.differences.iter().filter(|d| d.others.iter().any(|g| g.names.iter().any(|n| n == node))).map(|d| d.check.as_str()).collect::<Vec<_>>();
    assert!(!named("node007").is_empty(), "{:#?}", r.differences);
    assert!(named("node009").iter().any(|c| c.starts_with("nccl.nic")), "{:?}", named("node009"));
    for healthy in ["node001", "node002", "node004", "node008", "node010"] {
        assert!(named(healthy).is_empty(), "{healthy} named in {:?}", named(healthy));
        assert!(r.staging.iter().all(|g| !g.names.iter().any(|n| n == healthy)));
    }
    assert!(r.shared.is_empty(), "{:?}", r.shared);
    let text = r.to_string();
    assert!(text.contains("NOT USED on 2 node(s) node[005-006]"), "{text}");
    // The picture: a row per node, a column per check that matters, the
    // staging nodes' names in red.
    let svg = r.svg();
    assert_eq!(svg.matches("<rect").count(), 10 * r.grid.checks.len());
    assert!(r.grid.checks.iter().any(|c| c == "env.nccl_ib_disable") && r.grid.checks.iter().any(|c| c.starts_with("nccl.nic")));
    assert!(svg.contains(r##"fill="#c0392b">node003</text>"##) && svg.contains(r##"fill="#222">node001</text>"##), "{svg}");
}

#[test]
fn a_healthy_fleet_passes_and_a_missing_node_fails_the_gate() {
    let jobs = testkit::Tree::new("fleet-ok");
    let job = jobs.path().join("job-1");
    std::fs::create_dir(&job).unwrap();
    fleet(&job, &[]);
    let r = check(&Collection::Dir(jobs.path().to_path_buf()), Some("job-1"), None).unwrap();
    assert_eq!(r.job.as_deref(), Some("job-1"));
    assert_eq!((r.exit_status(), r.line.as_str()), (0, "fleet: GPUDirect RDMA on all 10 node(s)"));
    assert!(r.differences.is_empty(), "{:?}", r.differences);
    // Without a job id, the folder itself.
    let here = Collection::Dir(job.clone());
    let r = check(&here, None, Some(&Expect::Count(12))).unwrap();
    assert_eq!((r.exit_status(), r.missing), (1, 2));
    std::fs::write(job.join("node011.json"), b"{ not json").unwrap();
    std::fs::write(job.join("bad name.json"), b"{}").unwrap();
    let r = check(&here, None, None).unwrap();
    assert_eq!(r.unreadable.len(), 2, "{:?}", r.unreadable);
    assert_eq!(r.exit_status(), 1);
    // An empty fleet proves nothing: the gate stays shut.
    let empty = testkit::Tree::new("fleet-empty");
    let r = check(&Collection::Dir(empty.path().to_path_buf()), None, None).unwrap();
    assert_eq!((r.nodes, r.available_everywhere, r.exit_status()), (0, false, 1), "{}", r.line);
}

/// The same fleet posted to the rendezvous server, by ten threads at
/// once each proving the secret (one node posting its capture file as
/// `fleet post --from` does), is judged as the folder is; posters without
/// the secret, or with another, are refused and leave nothing behind.
#[test]
fn a_fleet_posted_to_the_rendezvous_is_judged_as_the_folder_is() {
    use gpudirect_engine::{ClusterSecret, RendezvousConfig, RendezvousServer, TcpRendezvous};
    let secret = |b: u8| ClusterSecret::new(vec![b; 32]).unwrap();
    let server = RendezvousServer::bind_with("127.0.0.1:0", RendezvousConfig { secret: Some(secret(7)), ..Default::default() }).unwrap();
    let board = |s: Option<ClusterSecret>| {
        let c = TcpRendezvous::new(server.addr(), std::time::Duration::from_secs(5)).unwrap();
        let c = match s {
            Some(s) => c.with_secret(s),
            None => c,
        };
        Collection::Board { board: Box::new(c), shown: format!("rendezvous {}", server.addr()) }
    };
    let to = board(Some(secret(7)));
    let nodes = captures(&BROKEN);
    std::thread::scope(|sc| {
        for (name, text) in &nodes[..9] {
            let to = &to;
            sc.spawn(move || to.post("job-1", name, text).unwrap());
        }
    });
    let (place, own) = post(&to, "job-1", Some("node010"), Some(Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")))).unwrap();
    assert!(own.verdict.available && place.contains("job-1/node010"), "{place}");
    let tree = testkit::Tree::new("fleet-same");
    fleet(tree.path(), &BROKEN);
    let by_board = check(&to, Some("job-1"), Some(&Expect::Count(10))).unwrap();
    let by_dir = check(&Collection::Dir(tree.path().to_path_buf()), None, Some(&Expect::Count(10))).unwrap();
    assert_eq!((by_board.nodes, &by_board.line, &by_board.staging, &by_board.differences), (by_dir.nodes, &by_dir.line, &by_dir.staging, &by_dir.differences));
    assert_eq!(by_board.exit_status(), 1);
    for intruder in [board(None), board(Some(secret(8)))] {
        let e = intruder.post("job-1", "node011", &nodes[0].1).unwrap_err();
        assert!(e.contains("did not verify"), "{e}");
        assert!(check(&intruder, Some("job-1"), None).is_err(), "nor may it read the captures");
    }
    assert_eq!(check(&to, Some("job-1"), None).unwrap().nodes, 10, "nothing left by the intruders");
    assert!(check(&to, None, None).unwrap_err().contains("job id"), "a board needs the job");
}

#[test]
fn a_bad_variable_on_every_node_is_one_shared_line() {
    let tree = testkit::Tree::new("fleet-shared");
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")).unwrap()).unwrap();
    for i in 1..=4 {
        let mut c = base.clone();
        far_hca(&mut c);
        std::fs::write(tree.path().join(format!("gpu-{i}.json")), serde_json::to_vec(&c).unwrap()).unwrap();
    }
    let r = check(&Collection::Dir(tree.path().to_path_buf()), None, None).unwrap();
    assert!(r.shared.iter().any(|s| s.check.starts_with("nccl.nic") && s.status == Status::Warn), "{:?}", r.shared);
    assert!(r.differences.is_empty());
}

#[test]
fn names_fold_as_slurm_writes_them() {
    let names: Vec<String> = ["node003", "node004", "node005", "node007", "node019", "login", "gpu-a1", "gpu-a2", "node1"].iter().map(|s| s.to_string()).collect();
    assert_eq!(fold_names(&names), "gpu-a[1-2],node1,node[003-005,007,019],login");
    assert_eq!(fold_names(&["n01".to_string()]), "n01");
    assert!(valid_name("node-1.rack_2") && !valid_name("../x") && !valid_name("a b") && !valid_name(""));
}

/// A board whose posting for `node003` does not verify and which stops
/// answering at `node006`.
struct Flaky(Vec<(String, String)>);

impl gpudirect_engine::Board for Flaky {
    fn post(&self, _: &str, _: &str, _: &[u8]) -> Result<(), gpudirect_engine::EngineError> {
        unreachable!("only read")
    }
    fn names(&self, _: &str) -> Result<Vec<String>, gpudirect_engine::EngineError> {
        Ok(self.0.iter().map(|(n, _)| n.clone()).collect())
    }
    fn fetch(&self, _: &str, name: &str) -> Result<Option<gpudirect_engine::Posting>, gpudirect_engine::EngineError> {
        use gpudirect_engine::{AuthError, EngineError};
        match name {
            "node003" => Err(EngineError::Auth { peer: "etcd test".into(), source: AuthError::BadProof { what: "the posting j/node003 (its seal)".into() } }),
            "node006" => Err(EngineError::Rendezvous { server: "test".into(), reason: "unreachable".into() }),
            _ => Ok(self.0.iter().find(|(n, _)| n == name).map(|(_, t)| gpudirect_engine::Posting { blob: t.clone().into_bytes(), posted_at: None })),
        }
    }
    fn remove(&self, _: &str, _: &str) -> Result<(), gpudirect_engine::EngineError> {
        unreachable!("only read")
    }
}

/// A posting that does not verify is that node's (unreadable, the gate
/// shut); a store that stops answering is the check's: it could not run.
#[test]
fn an_unproven_posting_is_unreadable_and_a_store_gone_fails_the_check() {
    let mut nodes = captures(&[]);
    let healthy = || Collection::Board { board: Box::new(Flaky(captures(&[]).into_iter().filter(|(n, _)| n != "node006").collect())), shown: "test".into() };
    let r = check(&healthy(), Some("j"), None).unwrap();
    assert_eq!((r.nodes, r.exit_status()), (8, 1));
    assert_eq!(r.unreadable.len(), 1, "{:?}", r.unreadable);
    assert!(r.unreadable[0].file.contains("j/node003") && r.unreadable[0].error.contains("did not verify"), "{:?}", r.unreadable);
    nodes.truncate(10);
    let gone = Collection::Board { board: Box::new(Flaky(nodes)), shown: "test".into() };
    let e = check(&gone, Some("j"), None).unwrap_err();
    assert!(e.contains("unreachable"), "{e}");
    // A name outside --nodes is listed as unexpected and never fetched:
    // what it holds (here, a store that stops answering) costs nothing.
    let want = Expect::Names(expand_hostlist("node[001-005,007-010]").unwrap());
    let r = check(&gone, Some("j"), Some(&want)).unwrap();
    assert_eq!((r.nodes, r.unexpected.as_slice(), r.exit_status()), (8, &["node006".to_owned()][..], 1), "{:?}", r.unreadable);
}

/// With the allocation's host list, each missing node is named, and a
/// capture from a node outside it (a stray job's, or a member posting a
/// healthy capture under a made-up name to stand in for a missing node)
/// is listed, not judged, and shuts the gate.
#[test]
fn named_nodes_name_the_missing_and_refuse_the_unexpected() {
    let tree = testkit::Tree::new("fleet-named");
    fleet(tree.path(), &[]);
    std::fs::remove_file(tree.path().join("node004.json")).unwrap();
    std::fs::copy(tree.path().join("node001.json"), tree.path().join("stand-in.json")).unwrap();
    let dir = Collection::Dir(tree.path().to_path_buf());
    let want = Expect::Names(expand_hostlist("node[001-010]").unwrap());
    let r = check(&dir, None, Some(&want)).unwrap();
    assert_eq!((r.nodes, r.missing, r.missing_nodes.as_slice(), r.unexpected.as_slice()), (9, 1, &["node004".to_owned()][..], &["stand-in".to_owned()][..]));
    assert_eq!(r.exit_status(), 1);
    let text = r.to_string();
    assert!(text.contains("MISSING: 1 node(s) expected sent no capture: node004") && text.contains("NOT EXPECTED: 1 capture(s)"), "{text}");
    // The count alone would have been fooled: ten captures, none missing.
    let r = check(&dir, None, Some(&Expect::Count(10))).unwrap();
    assert_eq!((r.missing, r.exit_status()), (0, 0), "{}", r.line);
    std::fs::remove_file(tree.path().join("stand-in.json")).unwrap();
    std::fs::copy(tree.path().join("node001.json"), tree.path().join("node004.json")).unwrap();
    assert_eq!(check(&dir, None, Some(&want)).unwrap().exit_status(), 0);
}

/// Through etcd: the mutated fleet judged as the folder is; a value
/// sealed with another secret, or with none, is unreadable; a leased
/// posting expires after its poster is gone.
#[test]
#[ignore = "needs etcd (Debian: etcd-server)"]
fn a_fleet_in_etcd_is_sealed_and_a_leased_posting_expires() {
    use gpudirect_engine::{Board, ClusterSecret, EtcdRendezvous};
    let etcd = testkit::Etcd::local();
    let t = std::time::Duration::from_secs(5);
    let secret = |b: u8| ClusterSecret::new(vec![b; 32]).unwrap();
    let board = |b: u8| Collection::Board { board: Box::new(EtcdRendezvous::connect(&[etcd.url()], t).unwrap().with_secret(secret(b))), shown: "etcd".into() };
    let to = board(7);
    for (name, text) in captures(&BROKEN) {
        to.post("job-1", &name, &text).unwrap();
    }
    board(8).post("job-1", "node011", &captures(&[])[0].1).unwrap();
    let r = check(&to, Some("job-1"), None).unwrap();
    assert_eq!((r.nodes, r.unreadable.len(), r.staging.len(), r.exit_status()), (10, 1, 2, 1), "{:?}", r.unreadable);
    assert!(r.unreadable[0].file.contains("job-1/node011") && r.unreadable[0].error.contains("did not verify"), "{:?}", r.unreadable);
    {
        let leased = EtcdRendezvous::connect(&[etcd.url()], t).unwrap().with_secret(secret(7)).with_lease(std::time::Duration::from_secs(2));
        leased.post("job-2", "node001", b"{}").unwrap();
        assert_eq!(to_names(&to, "job-2"), ["node001"]);
    }
    let gone = std::time::Instant::now();
    while !to_names(&to, "job-2").is_empty() {
        assert!(gone.elapsed() < std::time::Duration::from_secs(15), "a leased posting outlived its poster by {:?}", gone.elapsed());
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

fn to_names(c: &Collection, topic: &str) -> Vec<String> {
    match c {
        Collection::Board { board, .. } => board.names(topic).unwrap(),
        Collection::Dir(_) => unreachable!(),
    }
}

/// Links planted in a shared job folder, as anyone who may write it
/// could plant them before a root prolog posts: at the job's folder, at
/// the node's capture, at the temporary file's name, at the poster file
/// and its temporary file. None is written through: each post is refused
/// naming the link, and the file the link points to stays as it was.
#[test]
fn a_post_never_writes_through_a_planted_link() {
    use std::os::unix::fs::symlink;
    let tree = testkit::Tree::new("fleet-links");
    let (jobs, outside) = (tree.path().join("jobs"), tree.path().join("outside"));
    std::fs::create_dir_all(&jobs).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let victim = outside.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    let to = Collection::Dir(jobs.clone());
    let capture = &captures(&[])[0].1;
    let pid = std::process::id();
    symlink(&outside, jobs.join("job-a")).unwrap();
    let planted: [(&str, String); 4] =
        [("job-b", "node2.json".into()), ("job-c", format!(".node2.json.{pid}.tmp")), ("job-d", format!("..node2.poster.{pid}.tmp")), ("job-e", ".node2.poster".into())];
    for (job, name) in &planted {
        std::fs::create_dir_all(jobs.join(job)).unwrap();
        symlink(&victim, jobs.join(job).join(name)).unwrap();
    }
    let e = to.post("job-a", "node2", capture).unwrap_err();
    assert!(e.contains("jobs/job-a is a symbolic link: refused"), "{e}");
    for (job, name) in &planted {
        let e = to.post(job, "node2", capture).unwrap_err();
        assert!(e.contains(&format!("{job}/{name}")) && e.contains("symbolic link"), "{job}: {e}");
        assert!(std::fs::symlink_metadata(jobs.join(job).join(name)).unwrap().file_type().is_symlink(), "{job}: the link is left as it was");
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1, "nothing written into the folder a job link points to");
    // Nothing planted: the post goes through, and leaves no temporary file.
    let place = to.post("job-f", "node2", capture).unwrap();
    assert!(place.ends_with("jobs/job-f/node2.json"), "{place}");
    let mut left: Vec<String> = std::fs::read_dir(jobs.join("job-f")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, [".node2.poster", "node2.json"]);
}

/// `fleet check` follows no link in the job's folder: a capture that is
/// a link (to a healthy capture elsewhere) is unreadable, not judged, and
/// so is a poster file that is a link; a job's folder that is a link is
/// not read at all.
#[test]
fn a_check_follows_no_link_in_the_job_folder() {
    use std::os::unix::fs::symlink;
    let tree = testkit::Tree::new("fleet-check-links");
    let (jobs, outside) = (tree.path().join("jobs"), tree.path().join("outside"));
    std::fs::create_dir_all(jobs.join("job-1")).unwrap();
    fleet(&outside_dir(&outside), &[]);
    fleet(&jobs.join("job-1"), &[]);
    std::fs::remove_file(jobs.join("job-1/node002.json")).unwrap();
    symlink(outside.join("node002.json"), jobs.join("job-1/node002.json")).unwrap();
    symlink(outside.join("node003.json"), jobs.join("job-1/.node003.poster")).unwrap();
    let r = check(&Collection::Dir(jobs.clone()), Some("job-1"), Some(&Expect::Names(expand_hostlist("node[001-010]").unwrap()))).unwrap();
    assert_eq!((r.nodes, r.exit_status()), (8, 1), "{}", r.line);
    let why: Vec<(&str, &str)> = r.unreadable.iter().map(|u| (u.file.as_str(), u.error.as_str())).collect();
    assert_eq!(why.len(), 2, "{why:?}");
    assert!(why[0].0.ends_with("job-1/node002.json") && why[0].1.contains("node002.json is a symbolic link: not followed"), "{why:?}");
    assert!(why[1].0.ends_with("job-1/node003.json") && why[1].1.contains(".node003.poster is a symbolic link: not followed"), "{why:?}");
    symlink(jobs.join("job-1"), jobs.join("job-2")).unwrap();
    let e = check(&Collection::Dir(jobs.clone()), Some("job-2"), None).unwrap_err();
    assert!(e.contains("job-2 is a symbolic link: refused"), "{e}");
    // Without a job id the folder given is the job's folder: a link too.
    let e = check(&Collection::Dir(jobs.join("job-2")), None, None).unwrap_err();
    assert!(e.contains("job-2 is a symbolic link"), "{e}");
}

fn outside_dir(p: &Path) -> PathBuf {
    std::fs::create_dir_all(p).unwrap();
    p.to_path_buf()
}

/// In a shared folder a member posts a node's name first, from another
/// host: the node's own post does not replace it and names both; the
/// check reports the node as a conflict naming both (exit 1), never
/// judges either capture; whoever posted first. A poster posting again
/// replaces its own.
#[test]
fn a_squatter_in_the_folder_is_a_conflict_naming_both() {
    let tree = testkit::Tree::new("fleet-squat");
    let to = Collection::Dir(tree.path().to_path_buf());
    let nodes = captures(&[("node002", ib_disable)]);
    let healthy = &nodes[0].1;
    for (n, text) in &nodes {
        to.post_as("job-1", n, text, &format!("{n}-host (uid 0)")).unwrap();
    }
    let want = Expect::Names(expand_hostlist("node[001-010]").unwrap());
    assert_eq!(check(&to, Some("job-1"), Some(&want)).unwrap().staging[0].names, ["node002"]);
    // node002 first, the squatter's healthy capture after it.
    let e = to.post_as("job-1", "node002", healthy, "squatter-host (uid 0)").unwrap_err();
    assert!(e.contains("claimed by node002-host (uid 0) and squatter-host (uid 0): not replaced"), "{e}");
    // The squatter first, node003 after it.
    std::fs::remove_file(tree.path().join("job-1/node003.json")).unwrap();
    std::fs::remove_file(tree.path().join("job-1/.node003.poster")).unwrap();
    to.post_as("job-1", "node003", healthy, "squatter-host (uid 0)").unwrap();
    let e = to.post_as("job-1", "node003", healthy, "node003-host (uid 0)").unwrap_err();
    assert!(e.contains("claimed by squatter-host (uid 0) and node003-host (uid 0)"), "{e}");
    let r = check(&to, Some("job-1"), Some(&want)).unwrap();
    assert_eq!((r.nodes, r.exit_status(), r.staging.len()), (8, 1, 0), "neither node002's nor the squatter's capture judged: {}", r.line);
    for (u, (node, first, second)) in r.unreadable.iter().zip([("node002", "node002-host", "squatter-host"), ("node003", "squatter-host", "node003-host")]) {
        assert!(u.file.ends_with(&format!("job-1/{node}.json")), "{u:?}");
        assert!(u.error.contains(&format!("claimed by more than one poster: {first} (uid 0) and {second} (uid 0)")), "{u:?}");
    }
    to.post_as("job-1", "node004", healthy, "node004-host (uid 0)").unwrap();
}

/// With the job's start given, a capture posted before it (a file last
/// written before it) is refused, not judged.
#[test]
fn a_capture_older_than_the_job_s_start_is_refused() {
    let tree = testkit::Tree::new("fleet-since");
    fleet(tree.path(), &[]);
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    std::fs::File::options().write(true).open(tree.path().join("node004.json")).unwrap().set_modified(old).unwrap();
    let dir = Collection::Dir(tree.path().to_path_buf());
    let since = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    let r = check_since(&dir, None, None, Some(since)).unwrap();
    assert_eq!((r.nodes, r.exit_status(), r.unreadable.len()), (9, 1, 1), "{}", r.line);
    assert!(r.unreadable[0].file.ends_with("node004.json") && r.unreadable[0].error.contains("before the job's start"), "{:?}", r.unreadable);
    assert_eq!(check_since(&dir, None, None, Some(old - std::time::Duration::from_secs(1))).unwrap().exit_status(), 0);
}

/// Through etcd, with the same secret: a squatter posting a node's name
/// from another host shuts the gate naming both; an earlier run's
/// posting under the same job id is refused with the job's start.
#[test]
#[ignore = "needs etcd (Debian: etcd-server)"]
fn in_etcd_a_squatter_is_a_conflict_and_an_earlier_run_is_refused() {
    use gpudirect_engine::{ClusterSecret, EtcdRendezvous};
    let etcd = testkit::Etcd::local();
    let t = std::time::Duration::from_secs(5);
    let at = |host: &str| Collection::Board {
        board: Box::new(EtcdRendezvous::connect(&[etcd.url()], t).unwrap().with_secret(ClusterSecret::new(vec![7; 32]).unwrap()).with_poster(host)),
        shown: "etcd".into(),
    };
    let nodes = captures(&[("node002", ib_disable)]);
    let squatter = at("squatter-host");
    squatter.post("job-1", "node002", &nodes[0].1).unwrap();
    for (n, text) in &nodes {
        let r = at(&format!("{n}-host")).post("job-1", n, text);
        assert_eq!(r.is_err(), n == "node002", "{n}: {r:?}");
    }
    let want = Expect::Names(expand_hostlist("node[001-010]").unwrap());
    let r = check(&squatter, Some("job-1"), Some(&want)).unwrap();
    assert_eq!((r.nodes, r.exit_status(), r.unreadable.len()), (9, 1, 1), "{}", r.line);
    assert!(r.unreadable[0].error.contains("claimed by more than one poster: squatter-host and node002-host"), "{:?}", r.unreadable);
    let since = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
    std::thread::sleep(std::time::Duration::from_secs(2));
    at("node001-host").post("job-1", "node001", &nodes[0].1).unwrap();
    let r = check_since(&squatter, Some("job-1"), Some(&want), Some(since)).unwrap();
    assert_eq!((r.nodes, r.unreadable.len()), (1, 9), "only node001 posted since; {:?}", r.unreadable);
    assert!(r.unreadable.iter().filter(|u| u.error.contains("before the job's start")).count() == 8, "{:?}", r.unreadable);
}
