//! Hostile review of the doctor's job-file reading, end to end: each test
//! is one attack on `gpudirect doctor --from CAPTURE --env-file JOB`.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CAPTURE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");

fn gpudirect() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    for v in ["NCCL_IB_DISABLE", "NCCL_NET", "NCCL_IB_HCA", "NCCL_NET_GDR_LEVEL", "NCCL_DMABUF_ENABLE", "NCCL_NET_PLUGIN", "NCCL_CONF_FILE"] {
        c.env_remove(v);
    }
    c
}

/// The doctor's exit status and stdout on the dgx-pix capture judged with
/// `job`, with extra `args` (`--json`, `--verbose`).
fn doctor(name: &str, job: &str, args: &[&str]) -> (Option<i32>, String) {
    let tree = testkit::Tree::new(name);
    let j = tree.path().join("job.sh");
    std::fs::write(&j, job).unwrap();
    let out = gpudirect().arg("doctor").args(args).arg("--from").arg(CAPTURE).arg("--env-file").arg(&j).output().unwrap();
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned())
}

fn exit_of(name: &str, job: &str) -> (Option<i32>, String) {
    doctor(name, job, &["--json"])
}

// ---- class 1: "available" (exit 0) on what was not read ----

/// The control: NCCL_NET=Socket is "not available" (exit 1).
#[test]
fn control_socket_is_not_available_holds() {
    let (code, out) = exit_of("atk-control", "#!/bin/bash\nexport NCCL_NET=Socket\npython train.py\n");
    assert_eq!(code, Some(1), "{out}");
}

/// `cd DIR || { echo; exit 1; }`: the reading stops at the `exit`, so the
/// `NCCL_NET=Socket` after it is neither read nor seen: exit 0.
#[test]
fn exit_in_or_group_hides_the_rest_of_the_script() {
    let (code, out) = exit_of("atk-orgroup", "#!/bin/bash\ncd /work || { echo 'no /work'; exit 1; }\nexport NCCL_NET=Socket\npython train.py\n");
    assert_ne!(code, Some(0), "bash's launch sees NCCL_NET=Socket; the doctor says available:\n{out}");
}

/// `echo NAME=v >> ~/.nccl.conf`: NCCL reads it; the doctor neither reads
/// nor lists it: exit 0.
#[test]
fn echo_into_nccl_conf_is_available() {
    let (code, out) = exit_of("atk-echoconf", "#!/bin/bash\necho 'NCCL_NET=Socket' >> ~/.nccl.conf\npython train.py\n");
    assert_ne!(code, Some(0), "NCCL reads NCCL_NET=Socket from ~/.nccl.conf; the doctor says available:\n{out}");
}

/// `A && export NCCL_NET=IB`: taken as certain, over the Socket that
/// stands when A fails.
#[test]
fn and_list_assignment_taken_as_certain() {
    let (code, out) = exit_of("atk-and", "#!/bin/bash\nexport NCCL_NET=Socket\n[ -n \"$USE_IB\" ] && export NCCL_NET=IB\npython train.py\n");
    assert_ne!(code, Some(0), "without USE_IB the launch sees NCCL_NET=Socket; the doctor says available:\n{out}");
}

/// A sourced file is noted, not read; "available" rests on it.
#[test]
fn sourced_file_leaves_the_verdict_available() {
    let (code, out) = exit_of("atk-source", "#!/bin/bash\nsource ./nccl-env.sh\npython train.py\n");
    assert_ne!(code, Some(0), "what ./nccl-env.sh sets was not read; the doctor says available:\n{out}");
}

/// A one-line `case` whose arm does not match.
#[test]
fn one_line_case_arm_taken_as_certain() {
    let (code, out) = exit_of("atk-case", "#!/bin/bash\nexport NCCL_NET=Socket\ncase \"$NET\" in ib) export NCCL_NET=IB;; esac\npython train.py\n");
    assert_ne!(code, Some(0), "the arm runs only when NET=ib; the doctor says available:\n{out}");
}

// ---- class 9: text from the job file printed raw ----

/// The verdict line carries a `$( )` body's preview raw: a newline in it
/// forges a second verdict line in the default text output.
#[test]
fn command_substitution_text_forges_a_verdict_line() {
    let job = "#!/bin/bash\nexport NCCL_IB_DISABLE=$(cat <<X\nGPUDirect RDMA: available via forged\nX\n)\npython train.py\n";
    let (_, out) = doctor("atk-forge", job, &[]);
    let verdicts = out.lines().filter(|l| l.starts_with("GPUDirect RDMA:")).count();
    assert_eq!(verdicts, 1, "the file's text forged a report line:\n{out}");
}

/// A `${...}` operand's text, raw, with a terminal escape.
#[test]
fn parameter_text_carries_escapes_into_the_verdict() {
    let job = "#!/bin/bash\nexport NCCL_IB_DISABLE=${X#\x1b[2K\rGPUDirect RDMA: available}\npython train.py\n";
    let (_, out) = doctor("atk-esc", job, &[]);
    assert!(!out.contains('\x1b') && !out.contains('\r'), "a terminal escape from the file reached the report: {out:?}");
}

/// A seen line's text (an unread here-document) with escapes, shown by
/// `--verbose` in the unsettled finding's summary.
#[test]
fn seen_line_text_carries_escapes_into_verbose_output() {
    let job = "#!/bin/bash\ncat > /etc/nccl.conf <<EOF\nNCCL_NET=Socket \x1b[1A\x1b[2K\rGPUDirect RDMA: available\nEOF\npython train.py\n";
    let (_, out) = doctor("atk-seen-esc", job, &["--verbose"]);
    assert!(!out.contains('\x1b') && !out.contains('\r'), "a terminal escape from the file reached the report: {out:?}");
}

// ---- class 8: input cost of ~1 MB job files, read by the doctor ----

const MB: usize = 1 << 20;

/// Seconds the doctor takes on `job` under a 2 GiB address-space limit,
/// killed after `limit`; `None` when it failed or was killed.
fn doctor_cost(name: &str, job: &str, limit: Duration) -> (f64, Option<i32>, String) {
    let tree = testkit::Tree::new(name);
    let j = tree.path().join("job.sh");
    std::fs::write(&j, job).unwrap();
    let mut c = Command::new("sh");
    c.arg("-c").arg("ulimit -v 2097152; exec \"$@\"").arg("sh").arg(env!("CARGO_BIN_EXE_gpudirect"));
    c.args(["doctor", "--json", "--from", CAPTURE, "--env-file"]).arg(&j);
    let t = Instant::now();
    let mut child = c.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            let _ = child.stderr.take().unwrap().read_to_string(&mut err);
            return (t.elapsed().as_secs_f64(), st.code(), err.chars().take(300).collect());
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return (t.elapsed().as_secs_f64(), None, "killed: over the time limit".into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn bound() -> f64 {
    // As tests/jobfile_cost.rs: release 1 s, debug scaled by 20.
    if cfg!(debug_assertions) { 20.0 } else { 1.0 }
}

fn assert_cheap(what: &str, job: &str) {
    assert!(job.len() <= MB + 4096, "{what}: {} bytes", job.len());
    let (s, code, err) = doctor_cost(what, job, Duration::from_secs_f64(bound() * 3.0));
    assert!(code.is_some() && code != Some(2) && s < bound(), "{what}: {} bytes took {s:.1} s (exit {code:?}) {err}", job.len());
}

/// The control: 1 MB of plain assignments (holds).
#[test]
fn cost_control_plain_assignments_holds() {
    let job = format!("#!/bin/bash\n{}python x.py\n", "export NCCL_DEBUG=INFO\n".repeat(MB / 24));
    assert_cheap("atk-cost-control", &job);
}

/// A function setting K names, called M times: K x M assignments.
#[test]
fn cost_function_called_many_times() {
    let k = 4000;
    let body: String = (0..k).map(|i| format!("export NCCL_F{i:05}=1;")).collect();
    let head = format!("#!/bin/bash\nf() {{ {body} }}\n");
    let job = format!("{head}{}python x.py\n", "f\n".repeat((MB - head.len()) / 2 - 16));
    assert_cheap("atk-cost-function", &job);
}

/// A 64 KB script in a variable, run by `bash -c "$S"` over and over:
/// each run is read again.
#[test]
fn cost_bash_c_of_a_big_variable() {
    let head = format!("#!/bin/bash\nS='{}'\n", "export NCCL_X=1;".repeat(4000));
    let job = format!("{head}{}python x.py\n", "bash -c \"$S\"\n".repeat((MB - head.len()) / 13 - 2));
    assert_cheap("atk-cost-bash-c", &job);
}

/// A 64 KB value referenced on each of many lines: each lookup clones it
/// (holds: under the bound in debug and release).
#[test]
fn cost_lines_referencing_a_big_value() {
    let head = format!("#!/bin/bash\nA={}\n", "x".repeat(60_000));
    let job = format!("{head}{}python x.py\n", "X=$A\n".repeat((MB - head.len()) / 5 - 4));
    assert_cheap("atk-cost-big-ref", &job);
}

/// One line of `${A:+}` with A 64 KB: each clones A and adds nothing, so
/// the value bound never trips (holds: under the bound in debug and release).
#[test]
fn cost_alternate_of_a_big_value() {
    let head = format!("#!/bin/bash\nA={}\n", "x".repeat(60_000));
    let job = format!("{head}X={}\npython x.py\n", "${A:+}".repeat((MB - head.len()) / 6 - 4));
    assert_cheap("atk-cost-alt", &job);
}
