//! Second hostile review, end to end: `gpudirect doctor --from CAPTURE
//! --env-file JOB` says "available" (exit 0) where NCCL will not use
//! GPUDirect RDMA, or where what it rests on was not read.

use std::process::Command;

const CAPTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");

fn gpudirect() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    for v in ["NCCL_IB_DISABLE", "NCCL_NET", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE", "NCCL_NET_PLUGIN", "NCCL_CONF_FILE", "NCCL_NET_GDR_READ"] {
        c.env_remove(v);
    }
    c
}

fn exit_of(name: &str, job: &str) -> (Option<i32>, String) {
    let tree = testkit::Tree::new(name);
    let j = tree.path().join("job.sh");
    std::fs::write(&j, job).unwrap();
    let out = gpudirect().arg("doctor").arg("--json").arg("--from").arg(CAPTURE).arg("--env-file").arg(&j).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Control: a settled NCCL_CONF_FILE the capture does not hold leaves
/// the verdict open (holds).
#[test]
fn control_conf_file_not_in_capture_holds() {
    let (code, out) = exit_of("atk2-conf-known", "#!/bin/bash\nexport NCCL_CONF_FILE=/scratch/nccl.conf\npython train.py\n");
    assert_ne!(code, Some(0), "{out}");
}

/// class 2: NCCL_CONF_FILE set to a value only the job settles: NCCL
/// reads that file, the doctor reads none and says available.
#[test]
fn unsettled_conf_file_is_not_read_yet_available() {
    let (code, out) = exit_of("atk2-conf-unknown", "#!/bin/bash\nexport NCCL_CONF_FILE=$SCRATCH/nccl.conf\npython train.py\n");
    assert_ne!(code, Some(0), "NCCL reads $SCRATCH/nccl.conf, which may set NCCL_NET=Socket; the doctor read no such file:\n{out}");
}

/// The same with NCCL_CONF_FILE set in a branch.
#[test]
fn conf_file_set_in_a_branch_is_not_read_yet_available() {
    let (code, out) = exit_of("atk2-conf-branch", "#!/bin/bash\nif [ -n \"$SITE\" ]; then export NCCL_CONF_FILE=/site/nccl.conf; fi\npython train.py\n");
    assert_ne!(code, Some(0), "where SITE is set NCCL reads /site/nccl.conf; the doctor read no such file:\n{out}");
}

/// The same with NCCL_CONF_FILE set by a function call.
#[test]
fn conf_file_set_by_a_function_is_not_read_yet_available() {
    let (code, out) = exit_of("atk2-conf-fn", "#!/bin/bash\nsetup() { export NCCL_CONF_FILE=/site/nccl.conf; }\nsetup\npython train.py\n");
    assert_ne!(code, Some(0), "NCCL reads /site/nccl.conf; the doctor read no such file:\n{out}");
}

/// class 1 end to end: `set +e` turns errexit off; the doctor stops at
/// `false` and misses NCCL_NET=Socket.
#[test]
fn set_plus_e_hides_socket() {
    let (code, out) = exit_of("atk2-plus-e", "#!/bin/bash\nset -e\nset +e\nfalse\nexport NCCL_NET=Socket\npython train.py\n");
    assert_ne!(code, Some(0), "bash's launch sees NCCL_NET=Socket; the doctor says available:\n{out}");
}

/// `let NCCL_IB_DISABLE++`: 0 becomes 1, IB is off.
#[test]
fn let_increment_disables_ib() {
    let (code, out) = exit_of("atk2-let", "#!/bin/bash\nexport NCCL_IB_DISABLE=0\nlet NCCL_IB_DISABLE++\npython train.py\n");
    assert_ne!(code, Some(0), "bash's launch sees NCCL_IB_DISABLE=1; the doctor says available:\n{out}");
}

/// `declare -i`: `NCCL_IB_DISABLE=ON` is ON's value, 1: IB off.
#[test]
fn integer_attribute_disables_ib() {
    let (code, out) = exit_of("atk2-int", "#!/bin/bash\nON=1\ndeclare -i NCCL_IB_DISABLE\nexport NCCL_IB_DISABLE=ON\npython train.py\n");
    assert_ne!(code, Some(0), "bash's launch sees NCCL_IB_DISABLE=1; the doctor says available:\n{out}");
}
