//! The doctor says "available" only on what it read and saw: a job file's
//! deciding name the reading did not take, a capture whose sysfs holds
//! nothing, a network plugin nobody looked for: each leaves the verdict
//! open (exit 3) naming it, and the fleet refuses such a capture.

use std::process::Command;

const CAPTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");

fn gpudirect() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    for v in ["NCCL_IB_DISABLE", "NCCL_NET", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE", "NCCL_NET_PLUGIN"] {
        c.env_remove(v);
    }
    c
}

/// The doctor's exit status and report on `capture` judged with `job`.
fn judge(tree: &testkit::Tree, capture: &str, job: &str) -> (Option<i32>, serde_json::Value) {
    let (c, j) = (tree.path().join("capture.json"), tree.path().join("job.sh"));
    std::fs::write(&c, capture).unwrap();
    std::fs::write(&j, job).unwrap();
    let out = gpudirect().args(["doctor", "--json", "--from"]).arg(&c).arg("--env-file").arg(&j).output().unwrap();
    (out.status.code(), serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr))))
}

fn base() -> String {
    std::fs::read_to_string(CAPTURE).unwrap()
}

#[test]
fn a_deciding_name_the_reading_did_not_take_leaves_the_verdict_open() {
    let tree = testkit::Tree::new("unseen-job");
    let (code, r) = judge(&tree, &base(), "#!/bin/bash\nexport NCCL_DEBUG=INFO\npython train.py\n");
    assert_eq!(code, Some(0), "the control: {r:#}");
    // NCCL reads /etc/nccl.conf; the reading does not follow what a
    // here-document writes there.
    let job = "#!/bin/bash\ncat > /etc/nccl.conf <<EOF\nNCCL_IB_DISABLE=1\nEOF\nexport NCCL_DEBUG=INFO\npython train.py\n";
    let (code, r) = judge(&tree, &base(), job);
    assert_eq!(code, Some(3), "{r:#}");
    let open = &r["verdict"]["open"][0];
    assert_eq!((open["kind"].as_str(), open["name"].as_str()), (Some("variable"), Some("NCCL_IB_DISABLE")), "{r:#}");
    assert!(r["verdict"]["line"].as_str().unwrap().starts_with("GPUDirect RDMA: cannot tell"), "{r:#}");
    let seen = r["findings"].as_array().unwrap().iter().find(|f| f["check"] == "env.seen_not_read").expect("env.seen_not_read");
    assert_eq!(seen["evidence"][0], "line 3: NCCL_IB_DISABLE in \"NCCL_IB_DISABLE=1\"");
    // A prefix on another command never reaches the launch: what the
    // launch sees (exported, 1) decides.
    let (code, r) = judge(&tree, &base(), "#!/bin/bash\nexport NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0 true\npython train.py\n");
    assert_eq!(code, Some(1), "{r:#}");
    assert!(r["verdict"]["environment"].as_str().unwrap().starts_with("NCCL_IB_DISABLE=1"), "{r:#}");
}

#[test]
fn a_capture_whose_sysfs_holds_nothing_is_not_available() {
    let tree = testkit::Tree::new("unseen-sysfs");
    let mut c: serde_json::Value = serde_json::from_str(&base()).unwrap();
    c["files"].as_array_mut().unwrap().retain(|f| !f["path"].as_str().unwrap().starts_with("/sys"));
    let empty = serde_json::to_string(&c).unwrap();
    let (code, r) = judge(&tree, &empty, "");
    assert_eq!(code, Some(3), "{r:#}");
    assert_eq!(r["verdict"]["available"], false);
    assert!(r["verdict"]["open"].as_array().unwrap().iter().any(|o| o["kind"] == "fact" && o["what"].as_str().unwrap().starts_with("the PCIe path between")), "{r:#}");
    // The fleet cannot judge it: unreadable, the gate fails.
    let job = tree.path().join("fleet/j1");
    std::fs::create_dir_all(&job).unwrap();
    std::fs::write(job.join("n1.json"), base()).unwrap();
    std::fs::write(job.join("n2.json"), &empty).unwrap();
    let out = gpudirect().args(["fleet", "check"]).arg(tree.path().join("fleet")).args(["--job", "j1", "--expect", "2", "--json"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stdout));
    let f: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(f["unreadable"].as_array().unwrap().len(), 1, "{f:#}");
    assert!(f["unreadable"][0]["error"].as_str().unwrap().contains("does not show what the verdict rests on"), "{f:#}");
}

#[test]
fn a_plugin_network_nobody_looked_for_is_open_never_fine() {
    let tree = testkit::Tree::new("unseen-plugin");
    // The capture recorded no library directory: whether gIB's plugin is
    // there was not looked at.
    let (code, r) = judge(&tree, &base(), "export NCCL_NET=gIB\n");
    assert_eq!(code, Some(3), "{r:#}");
    assert!(r["verdict"]["open"].as_array().unwrap().iter().any(|o| o["what"].as_str().is_some_and(|w| w.contains("network plugin for NCCL_NET=\"gIB\""))), "{r:#}");
    // NCCL's own IB network needs no plugin.
    let (code, _) = judge(&tree, &base(), "export NCCL_NET=IB\n");
    assert_eq!(code, Some(0));
}

/// A deciding variable set in branches: where every value the branches
/// give leads to the same verdict, it holds and names them; where they
/// differ, it stays open and names a value that changes it.
#[test]
fn branches_that_agree_hold_and_branches_that_differ_stay_open() {
    let tree = testkit::Tree::new("unseen-branches");
    // mlx5_0 or every NIC: GPU0's nearest NIC either way.
    let (code, r) = judge(&tree, &base(), "#!/bin/bash\nif [ -n \"$PIN\" ]; then\n  export NCCL_IB_HCA=mlx5_0\nfi\npython train.py\n");
    assert_eq!(code, Some(0), "{r:#}");
    let line = r["verdict"]["line"].as_str().unwrap();
    assert!(line.contains("the same for every value the branches give NCCL_IB_HCA (") && line.contains("NCCL_IB_HCA unset; NCCL_IB_HCA=mlx5_0"), "{line}");
    // Sockets in one branch: open, naming it.
    let (code, r) = judge(&tree, &base(), "#!/bin/bash\ncase \"$NET\" in\n  tcp) export NCCL_NET=Socket ;;\nesac\npython train.py\n");
    assert_eq!(code, Some(3), "{r:#}");
    let line = r["verdict"]["line"].as_str().unwrap();
    assert!(line.contains("the branches decide it: with NCCL_NET unset available, with NCCL_NET=Socket not"), "{line}");
    // Not available either way: the verdict holds, exit 1.
    let (code, r) = judge(&tree, &base(), "#!/bin/bash\nexport NCCL_IB_DISABLE=1\n[ -n \"$X\" ] && export NCCL_IB_DISABLE=2\npython train.py\n");
    assert_eq!(code, Some(1), "{r:#}");
    assert!(r["verdict"]["line"].as_str().unwrap().contains("NCCL_IB_DISABLE=1; NCCL_IB_DISABLE=2"), "{r:#}");
}
