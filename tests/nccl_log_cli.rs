//! `gpudirect nccl-log` as a user runs it: the headline says what "not
//! used" costs, and the log's variables are judged by the doctor's rules.

use std::process::Command;

#[test]
fn the_headline_names_the_cost_and_the_variables_are_judged() {
    let log = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nccl-logs/nccltests284-rtx4090-init-using-network-socket-2.25.1.txt");
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["nccl-log", "--json", log]).output().unwrap();
    assert_eq!(out.status.code(), Some(1), "not used: {}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // Two ranks, no nNodes line: whether the run spanned nodes is not
    // shown, so the headline says what would happen between nodes.
    let headline = r["headline"].as_str().unwrap();
    assert!(headline.starts_with("GPUDirect RDMA would NOT be used between nodes: this log does not show whether the run spanned nodes"), "{headline}");
    assert!(headline.ends_with("crossing PCIe twice, at about half the multi-node bandwidth"), "{headline}");
    let judged = r["environment_judged"].as_array().unwrap();
    let ib = judged.iter().find(|j| j["check"] == "env.nccl_ib_disable").unwrap_or_else(|| panic!("{judged:?}"));
    assert_eq!(ib["status"], "fail");
    assert!(ib["summary"].as_str().unwrap().starts_with("NCCL_IB_DISABLE=1"));
    let text = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["nccl-log", log]).output().unwrap();
    assert!(String::from_utf8_lossy(&text.stdout).contains("  [fail] NCCL_IB_DISABLE=1"), "{}", String::from_utf8_lossy(&text.stdout));
}
