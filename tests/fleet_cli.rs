//! `gpudirect fleet` as a launcher runs it: post, wait, check, exit status.

use std::process::Command;

fn gpudirect() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpudirect"))
}

#[test]
fn the_gate_fails_on_a_staging_node_and_on_a_missing_one() {
    let tree = testkit::Tree::new("fleet-cli");
    let job = tree.path().join("job-1");
    std::fs::create_dir_all(&job).unwrap();
    let base = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")).unwrap();
    for n in ["n1", "n2", "n3"] {
        std::fs::write(job.join(format!("{n}.json")), &base).unwrap();
    }
    let ok = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "job-1", "--expect", "3"]).output().unwrap();
    assert_eq!(ok.status.code(), Some(0), "{}", String::from_utf8_lossy(&ok.stdout));
    assert_eq!(String::from_utf8_lossy(&ok.stdout).lines().next(), Some("fleet: GPUDirect RDMA on all 3 node(s)"));

    // A node whose environment turns NCCL's RDMA transport off.
    let mut c: serde_json::Value = serde_json::from_str(&base).unwrap();
    c["env"]["vars"].as_array_mut().unwrap().push(serde_json::json!(["NCCL_IB_DISABLE", "1"]));
    c["env"]["origins"].as_array_mut().unwrap().push(serde_json::json!(["NCCL_IB_DISABLE", "rank environment"]));
    std::fs::write(job.join("n4.json"), serde_json::to_vec(&c).unwrap()).unwrap();
    let bad = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "job-1", "--json"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(1));
    let r: serde_json::Value = serde_json::from_slice(&bad.stdout).unwrap();
    assert_eq!(r["staging"][0]["folded"], "n4");
    assert_eq!(r["staging"][0]["checks"][0], "env.nccl_ib_disable");
    assert_eq!(r["available_everywhere"], false);

    // --wait gives up after its time and the missing nodes fail the gate.
    let t = std::time::Instant::now();
    let short = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "job-1", "--expect", "6", "--wait", "1", "--json"]).output().unwrap();
    assert!(t.elapsed() >= std::time::Duration::from_secs(1));
    assert_eq!(short.status.code(), Some(1));
    let r: serde_json::Value = serde_json::from_slice(&short.stdout).unwrap();
    assert_eq!(r["missing"], 2);

    // A job id that is a path is refused.
    let odd = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "../etc"]).output().unwrap();
    assert_eq!(odd.status.code(), Some(2));
}

#[test]
fn post_writes_this_node_s_capture_where_check_finds_it() {
    let tree = testkit::Tree::new("fleet-post");
    let out = gpudirect().args(["fleet", "post"]).arg(tree.path()).args(["--job", "j7", "--node", "this-node"]).output().unwrap();
    // The doctor's exit status for this machine (0, 1 or 3), never 2.
    assert_ne!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    let file = tree.path().join("j7/this-node.json");
    let c: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(c["format"], 1);
    let mut left: Vec<String> = std::fs::read_dir(tree.path().join("j7")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    left.sort();
    assert_eq!(left, [".this-node.poster", "this-node.json"], "no temporary file left behind");
    let poster = std::fs::read_to_string(tree.path().join("j7/.this-node.poster")).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    assert!(poster.starts_with(host.trim()) && poster.contains("(uid "), "{poster:?}");
    let check = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "j7", "--json"]).output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    assert_eq!(r["nodes"], 1);
    assert_eq!(check.status.code(), Some(if r["available_everywhere"] == true { 0 } else { 1 }));
    let bad = gpudirect().args(["fleet", "post"]).arg(tree.path()).args(["--job", "j7", "--node", "../x"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
}

/// Through `gpudirect rendezvous`, as a Slurm prolog and a gate would use
/// it: nodes post with the cluster's secret file, the gate waits for them;
/// a node posting with another secret is refused (exit 2) and left out;
/// two places at once is a usage error.
#[test]
fn nodes_post_to_the_rendezvous_and_the_gate_reads_it() {
    let tree = testkit::Tree::new("fleet-rdv");
    let (secret, other) = (tree.path().join("secret"), tree.path().join("other"));
    std::fs::write(&secret, [7u8; 32]).unwrap();
    std::fs::write(&other, [8u8; 32]).unwrap();
    let addr = format!("127.0.0.1:{}", testkit::port_below_ephemeral());
    // The gate starts first and waits; the server comes up after it.
    let gate = gpudirect()
        .args(["fleet", "check", "--rendezvous", &addr, "--job", "job-7", "--expect", "3", "--wait", "60", "--json"])
        .env("GPUDIRECT_SECRET_FILE", &secret)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = gpudirect().args(["rendezvous", "--listen", &addr]).arg("--secret-file").arg(&secret).stdout(std::process::Stdio::null()).spawn().unwrap();
    let capture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");
    let post = |node: &str, key: &std::path::Path| {
        gpudirect().args(["fleet", "post", "--rendezvous", &addr, "--job", "job-7", "--node", node, "--from", capture, "--timeout", "20"]).env("GPUDIRECT_SECRET_FILE", key).output().unwrap()
    };
    let intruder = post("n9", &other);
    assert_eq!(intruder.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&intruder.stderr).contains("did not verify"), "{}", String::from_utf8_lossy(&intruder.stderr));
    for n in ["n1", "n2", "n3"] {
        let out = post(n, &secret);
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
        assert!(String::from_utf8_lossy(&out.stdout).contains(&format!("job-7/{n} at rendezvous {addr}")), "{}", String::from_utf8_lossy(&out.stdout));
    }
    let out = gate.wait_with_output().unwrap();
    let _ = server.kill();
    let _ = server.wait();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!((r["nodes"].as_u64(), r["missing"].as_u64()), (Some(3), Some(0)), "{r}");
    let both = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--rendezvous", &addr, "--job", "j"]).output().unwrap();
    assert_eq!(both.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"), "{}", String::from_utf8_lossy(&both.stderr));
}

/// `gpudirect rendezvous` on `listen` (port 0: its own pick), once it
/// listens; killed when dropped.
fn rendezvous(listen: &str, secret: &std::path::Path) -> testkit::Listening {
    let mut cmd = gpudirect();
    cmd.args(["rendezvous", "--listen", listen]).arg("--secret-file").arg(secret);
    testkit::Listening::start(cmd, "gpudirect rendezvous listening on ")
}

fn capture() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")
}

/// A job's folder or a node's capture that is a link planted by whoever
/// may write the shared folder: `fleet post` (root, in a prolog) refuses
/// each, naming it, and writes nothing where it points; `fleet check`
/// reads no capture through a link and no job folder that is one.
#[test]
fn post_and_check_refuse_links_in_the_job_folder() {
    use std::os::unix::fs::symlink;
    let tree = testkit::Tree::new("fleet-cli-links");
    let (jobs, outside) = (tree.path().join("jobs"), tree.path().join("outside"));
    std::fs::create_dir_all(jobs.join("job-b")).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let victim = outside.join("victim");
    std::fs::write(&victim, "precious").unwrap();
    symlink(&outside, jobs.join("job-a")).unwrap();
    symlink(&victim, jobs.join("job-b/n1.json")).unwrap();
    let post = |job: &str| gpudirect().args(["fleet", "post"]).arg(&jobs).args(["--job", job, "--node", "n1", "--from", capture()]).output().unwrap();
    for (job, named) in [("job-a", "jobs/job-a is a symbolic link"), ("job-b", "jobs/job-b/n1.json is a symbolic link")] {
        let out = post(job);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{job}: {err}");
        assert!(err.contains(named), "{job}: {err}");
    }
    assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1, "nothing written where job-a points");
    // The check: a capture through a link is unreadable; a job folder
    // that is a link is not read (exit 2).
    std::fs::copy(capture(), &victim).unwrap();
    std::fs::copy(capture(), jobs.join("job-b/n2.json")).unwrap();
    let check = |job: &str| gpudirect().args(["fleet", "check"]).arg(&jobs).args(["--job", job, "--nodes", "n[1-2]", "--json"]).output().unwrap();
    let out = check("job-b");
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["nodes"], 1);
    assert!(r["unreadable"][0]["error"].as_str().unwrap().contains("n1.json is a symbolic link: not followed"), "{r}");
    let out = check("job-a");
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("job-a is a symbolic link"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A member holding the secret posts `JOB/node2` first, from its own
/// address; node2 posts from another. node2's post is refused naming
/// both, and `fleet check --nodes` reports node2 as a conflict naming
/// both addresses and exits 1, never judging the squatter's capture as
/// node2's. Two addresses of this host: IPv4 and IPv6 loopback to a
/// dual-stack server.
#[test]
fn a_squatter_at_the_rendezvous_shuts_the_gate_naming_both() {
    let tree = testkit::Tree::new("fleet-cli-squat");
    let secret = tree.path().join("secret");
    std::fs::write(&secret, [7u8; 32]).unwrap();
    let server = rendezvous("[::]:0", &secret);
    let port = server.port();
    let post = |at: &str, node: &str| {
        gpudirect()
            .args(["fleet", "post", "--rendezvous", &format!("{at}:{port}"), "--job", "job-9", "--node", node, "--from", capture(), "--timeout", "20"])
            .env("GPUDIRECT_SECRET_FILE", &secret)
            .output()
            .unwrap()
    };
    let squat = post("127.0.0.1", "node2");
    assert_eq!(squat.status.code(), Some(0), "{}", String::from_utf8_lossy(&squat.stderr));
    assert_eq!(post("[::1]", "node1").status.code(), Some(0));
    let own = post("[::1]", "node2");
    let err = String::from_utf8_lossy(&own.stderr);
    assert_eq!(own.status.code(), Some(2), "{err}");
    assert!(err.contains("claimed by more than one poster: 127.0.0.1 and ::1"), "{err}");
    let gate = gpudirect()
        .args(["fleet", "check", "--rendezvous", &format!("127.0.0.1:{port}"), "--job", "job-9", "--nodes", "node[1-2]", "--json"])
        .env("GPUDIRECT_SECRET_FILE", &secret)
        .output()
        .unwrap();
    assert_eq!(gate.status.code(), Some(1), "{}", String::from_utf8_lossy(&gate.stdout));
    let r: serde_json::Value = serde_json::from_slice(&gate.stdout).unwrap();
    assert_eq!((r["nodes"].as_u64(), r["missing"].as_u64()), (Some(1), Some(0)), "{r}");
    let u = &r["unreadable"][0];
    assert!(u["file"].as_str().unwrap().contains("job-9/node2"), "{u}");
    assert!(u["error"].as_str().unwrap().contains("claimed by more than one poster: 127.0.0.1 and ::1"), "{u}");
}

/// `--since`: a capture posted before the job's start fails the check.
#[test]
fn a_capture_from_before_the_job_s_start_fails_the_check() {
    let tree = testkit::Tree::new("fleet-cli-since");
    let job = tree.path().join("job-1");
    std::fs::create_dir_all(&job).unwrap();
    std::fs::copy(capture(), job.join("n1.json")).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let check = |since: u64| gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "job-1", "--since", &since.to_string()]).output().unwrap();
    assert_eq!(check(now - 60).status.code(), Some(0));
    for past_the_clock in [u64::MAX, 1 << 63] {
        let out = check(past_the_clock);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains("past what this system's clock can hold") && !err.contains("panicked"), "{err}");
    }
    let late = check(now + 60);
    assert_eq!(late.status.code(), Some(1));
    let text = String::from_utf8_lossy(&late.stdout);
    assert!(text.contains("UNREADABLE") && text.contains("before the job's start"), "{text}");
}

/// Poster names come from the folder (anyone who may write it wrote
/// them): `fleet post`'s conflict error, which a prolog's log keeps,
/// shows them escaped, never raw terminal escapes or a carriage return.
#[test]
fn a_conflict_names_its_posters_escaped() {
    let tree = testkit::Tree::new("fleet-cli-escaped");
    let job = tree.path().join("job-1");
    std::fs::create_dir_all(&job).unwrap();
    std::fs::write(job.join(".node2.poster"), "squatter\x1b[2K\rgpudirect fleet post: all is well (uid 0)\n").unwrap();
    let out = gpudirect().args(["fleet", "post"]).arg(tree.path()).args(["--job", "job-1", "--node", "node2", "--from", capture()]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(r"squatter\u{1b}[2K\rgpudirect fleet post: all is well (uid 0) and "), "{err}");
    assert!(!err.contains('\x1b') && !err.contains('\r'), "{err:?}");
    assert!(!job.join("node2.json").exists(), "the conflict wrote no capture");
}
