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
    assert_eq!(std::fs::read_dir(tree.path().join("j7")).unwrap().count(), 1, "no temporary file left behind");
    let check = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "j7", "--json"]).output().unwrap();
    let r: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    assert_eq!(r["nodes"], 1);
    assert_eq!(check.status.code(), Some(if r["available_everywhere"] == true { 0 } else { 1 }));
    let bad = gpudirect().args(["fleet", "post"]).arg(tree.path()).args(["--job", "j7", "--node", "../x"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
}
