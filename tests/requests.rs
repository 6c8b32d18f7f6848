//! Requests decided once (cli.rs, fleet::CheckRequest, Sources::check),
//! as an outside review attacked them: combinations of arguments the
//! command line and Python once accepted differently, ignored silently,
//! or that crashed the check. Each held after its fix.

use std::process::Command;
use std::time::Duration;

use gpudirect_tools::doctor::report::Options;
use gpudirect_tools::doctor::sources::{judge, Sources};
use gpudirect_tools::fleet::{CheckArgs, CheckRequest, Place};

fn gpudirect() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpudirect"))
}

fn capture() -> &'static str {
    concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")
}

/// The command line refuses `--pid` with `--from` (clap's conflicts_with);
/// Sources::check, "the one check of a request, whichever front end made
/// it", does not, so Python's `doctor(from_capture=..., pid=...)` is
/// accepted.
#[test]
fn sources_check_refuses_a_pid_beside_a_capture() {
    let s = Sources { shell_over_capture: true, from: Some(capture().into()), pid: Some(1), ..Sources::this_machine() };
    assert!(s.check().is_err(), "from + pid accepted by Sources::check; the command refuses it");
}

/// What that acceptance does: the process named by `pid` (a job whose
/// environment turns NCCL's RDMA transport off) is never read, and the
/// capture is judged "available" as if no pid had been given (fail open
/// on what was not read).
#[test]
fn judge_with_a_capture_never_ignores_a_pid_it_was_given() {
    let mut job = Command::new("sleep").arg("20").env("NCCL_IB_DISABLE", "1").spawn().unwrap();
    let s = Sources { shell_over_capture: true, from: Some(capture().into()), pid: Some(job.id()), ..Sources::this_machine() };
    let got = judge(&s, &Options::default());
    let _ = job.kill();
    let _ = job.wait();
    match got {
        Err(_) => {}
        Ok(r) => panic!(
            "the pid's environment (NCCL_IB_DISABLE=1) was not read, yet the verdict was given: available={} ({})",
            r.verdict.available, r.verdict.line
        ),
    }
}

fn dir_args(dir: &std::path::Path) -> CheckArgs {
    CheckArgs {
        place: Place { dir: Some(dir.to_path_buf()), ..Place::default() },
        job: Some("j".into()),
        expect: None,
        nodes: None,
        wait: None,
        since: None,
        timeout: Duration::from_secs(5),
    }
}

/// `--expect 0` (an allocation of no nodes; `expect=0` from Python) turns
/// the attendance check off: captures present, none expected, the gate
/// opens. A wait with it has nothing to wait for, which the request
/// otherwise refuses.
#[test]
fn expect_zero_is_refused() {
    let tree = testkit::Tree::new("review-expect-zero");
    std::fs::create_dir_all(tree.path().join("j")).unwrap();
    std::fs::copy(capture(), tree.path().join("j/n1.json")).unwrap();
    let r = CheckRequest::new(CheckArgs { expect: Some(0), wait: Some(Duration::from_secs(5)), ..dir_args(tree.path()) });
    assert!(r.is_err(), "expect 0 with a wait accepted");
    let out = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "j", "--expect", "0"]).output().unwrap();
    assert_ne!(out.status.code(), Some(0), "--expect 0 opened the gate: {}", String::from_utf8_lossy(&out.stdout));
}

/// More captures than the allocation's size (`--expect 1`, two nodes
/// posted): at least one capture is not of this allocation (a stale or
/// stray node's), yet the gate opens; with `--nodes` the same stray
/// capture shuts it.
#[test]
fn more_captures_than_expected_shut_the_gate() {
    let tree = testkit::Tree::new("review-expect-more");
    std::fs::create_dir_all(tree.path().join("j")).unwrap();
    for n in ["n1", "stray"] {
        std::fs::copy(capture(), tree.path().join(format!("j/{n}.json"))).unwrap();
    }
    let out = gpudirect().args(["fleet", "check"]).arg(tree.path()).args(["--job", "j", "--expect", "1"]).output().unwrap();
    assert_ne!(out.status.code(), Some(0), "2 captures for 1 expected node: {}", String::from_utf8_lossy(&out.stdout));
}

/// `--timeout` near u64::MAX seconds with etcd panics in the etcd
/// client's `bound + 1s` (engine/src/meta/etcd.rs `on`) instead of being
/// refused or waited (exit 101, not a verdict or a usage error).
#[test]
fn a_huge_timeout_with_etcd_is_not_a_panic() {
    let args = CheckArgs {
        place: Place { etcd: vec!["http://127.0.0.1:1".into()], ..Place::default() },
        job: Some("j".into()),
        expect: None,
        nodes: None,
        wait: None,
        since: None,
        timeout: Duration::from_secs(u64::MAX),
    };
    let got = std::panic::catch_unwind(|| CheckRequest::new(args).map(drop));
    assert!(got.is_ok(), "CheckRequest::new panicked on a large timeout");
    let out = gpudirect()
        .args(["fleet", "check", "--etcd", "http://127.0.0.1:1", "--job", "j", "--timeout", &u64::MAX.to_string()])
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(101), "the command panicked: {}", String::from_utf8_lossy(&out.stderr));
}

/// Held: `since` in the future refuses every capture (never judged as recent).
#[test]
fn since_in_the_future_refuses_the_captures() {
    let tree = testkit::Tree::new("review-since-future");
    std::fs::create_dir_all(tree.path().join("j")).unwrap();
    std::fs::copy(capture(), tree.path().join("j/n1.json")).unwrap();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let r = CheckRequest::new(CheckArgs { since: Some(now + 3600), ..dir_args(tree.path()) }).unwrap().run().unwrap();
    assert!(!r.available_everywhere, "{}", r.line);
}

/// Held: an empty or blank host list is refused, not read as "no node".
#[test]
fn a_blank_host_list_is_refused() {
    let tree = testkit::Tree::new("review-nodes-blank");
    for list in ["", " ", ",", " , "] {
        assert!(CheckRequest::new(CheckArgs { nodes: Some(list.into()), ..dir_args(tree.path()) }).is_err(), "{list:?}");
    }
}
