//! `gpudirect doctor` judging a job's environment other than its own: a
//! job script (`--env-file`) and a running process (`--pid`), with where
//! each variable came from in the findings.

use std::process::Command;

fn doctor_json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect"))
        .arg("doctor")
        .arg("--json")
        .args(args)
        .env_remove("NCCL_IB_DISABLE")
        .env_remove("NCCL_NET")
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(2), "the doctor could not run: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn finding<'a>(report: &'a serde_json::Value, check: &str) -> &'a serde_json::Value {
    report["findings"].as_array().unwrap().iter().find(|f| f["check"] == check).unwrap_or_else(|| panic!("no {check} in {report:#}"))
}

#[test]
fn a_job_script_is_judged_without_running_it() {
    let script = std::env::temp_dir().join(format!("gpudirect-job-{}.sh", std::process::id()));
    std::fs::write(&script, "#!/bin/sh\nexport NCCL_IB_DISABLE=1\nexport NCCL_NET_GDR_LEVEL='LOC'  # off\nNCCL_IB_HCA=mlx5_9\npython train.py\n").unwrap();
    let r = doctor_json(&["--env-file", script.to_str().unwrap()]);
    let f = finding(&r, "env.nccl_ib_disable");
    assert_eq!(f["status"], "fail");
    assert_eq!(f["evidence"][0].as_str().unwrap(), format!("set by {} line 2 (export): NCCL_IB_DISABLE=\"1\"", script.display()), "{f:#}");
    assert_eq!(finding(&r, "env.nccl_net_gdr_level")["status"], "fail");
    // Not exported: python does not see it; the sources say so.
    assert!(r["findings"].as_array().unwrap().iter().all(|f| f["check"] != "env.nccl_ib_hca"), "{r:#}");
    let sources = finding(&r, "env.sources")["evidence"].to_string();
    assert!(sources.contains("line 4 (NAME=value): NCCL_IB_HCA is not exported"), "{sources}");
    std::fs::remove_file(&script).unwrap();
}

/// A value only the running job settles is never judged as its text: on a
/// capture where GPUDirect RDMA is available, `${NCCL_IB_HCA:-...}` leaves
/// the verdict open (exit 3), and the finding says what would settle it.
#[test]
fn a_value_the_job_file_cannot_settle_leaves_the_verdict_open() {
    let dir = std::env::temp_dir().join(format!("gpudirect-unsettled-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let capture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");
    let run = |text: &str| {
        let job = dir.join("job.yaml");
        std::fs::write(&job, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_gpudirect"))
            .args(["doctor", "--json", "--from", capture, "--env-file", job.to_str().unwrap()])
            .env_remove("NCCL_IB_HCA")
            .output()
            .unwrap();
        (out.status.code(), serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap())
    };
    let (code, r) = run("env:\n- name: NCCL_IB_HCA\n  valueFrom:\n    configMapKeyRef: {name: nics, key: hca}\n- name: NCCL_DEBUG\n  value: INFO\n");
    assert_eq!(code, Some(3), "{r:#}");
    assert_eq!(r["verdict"]["available"], false);
    assert_eq!(r["verdict"]["unsettled"], serde_json::json!(["NCCL_IB_HCA"]));
    let line = r["verdict"]["line"].as_str().unwrap();
    assert!(line.starts_with("GPUDirect RDMA: cannot tell:") && line.contains("valueFrom"), "{line}");
    let f = finding(&r, "env.nccl_ib_hca");
    assert_eq!(f["status"], "skipped");
    assert!(f["evidence"].to_string().contains("--pid PID"), "{f:#}");
    // A variable that does not decide it leaves the verdict as it is.
    let (code, r) = run("env:\n- name: NCCL_DEBUG\n  valueFrom: {fieldRef: {fieldPath: x}}\n- name: NCCL_IB_HCA\n  value: mlx5\n");
    assert_eq!((code, r["verdict"]["available"].as_bool()), (Some(0), Some(true)), "{r:#}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_running_process_is_judged_by_its_pid() {
    let mut job = Command::new("sleep").arg("30").env("NCCL_NET", "Socket").spawn().unwrap();
    // Under load the new image's environment can show a moment after
    // spawn returns: wait for it, so the test judges the doctor only.
    let environ = format!("/proc/{}/environ", job.id());
    for _ in 0..500 {
        if std::fs::read(&environ).is_ok_and(|b| b.windows(15).any(|w| w == b"NCCL_NET=Socket")) {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let r = doctor_json(&["--pid", &job.id().to_string()]);
    let _ = job.kill();
    let _ = job.wait();
    let f = finding(&r, "env.nccl_net");
    assert_eq!(f["status"], "fail");
    assert!(f["evidence"][0].as_str().unwrap().starts_with(&format!("set by process {}", job.id())), "{f:#}");
}

#[test]
fn a_missing_process_or_file_is_an_error_naming_it() {
    for args in [["--pid", "999999999"], ["--env-file", "/nonexistent/job.sh"]] {
        let out = Command::new(env!("CARGO_BIN_EXE_gpudirect")).arg("doctor").args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(args[1]), "{err}");
    }
}

/// `doctor diff` over two real reports of this machine: one judged with a
/// job script that disables NCCL's IB transport. The new failure leads;
/// the verdict (this machine's hardware) did not change: exit 0.
#[test]
fn diff_names_what_got_worse_between_two_reports() {
    let dir = std::env::temp_dir().join(format!("gpudirect-diff-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("job.sh");
    std::fs::write(&script, "export NCCL_IB_DISABLE=1\n").unwrap();
    let before = doctor_json(&[]);
    let after = doctor_json(&["--env-file", script.to_str().unwrap()]);
    std::fs::write(dir.join("a.json"), before.to_string()).unwrap();
    std::fs::write(dir.join("b.json"), after.to_string()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect"))
        .args(["doctor", "diff"])
        .args([dir.join("a.json"), dir.join("b.json")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("verdict unchanged: GPUDirect RDMA"), "{text}");
    assert!(lines[1].starts_with("new    [fail] env.nccl_ib_disable: NCCL_IB_DISABLE=1"), "{text}");
    let bad = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["doctor", "diff"]).arg(&script).arg(dir.join("b.json")).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("is not JSON"));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A real log (nccl-tests on an RTX 4090 pair, NCCL 2.25.1) shows NCCL read
/// `NCCL_IB_DISABLE=1`: judged as the job's environment, the finding says
/// the log and line it came from.
#[test]
fn an_nccl_logs_set_by_environment_lines_are_the_jobs_environment() {
    let log = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/nccl-logs/nccltests284-rtx4090-init-using-network-socket-2.25.1.txt");
    let r = doctor_json(&["--nccl-log", log]);
    let f = finding(&r, "env.nccl_ib_disable");
    assert_eq!(f["status"], "fail", "{f:#}");
    assert!(f["evidence"][0].as_str().unwrap().starts_with(&format!("set by the NCCL log {log} (line ")), "{f:#}");
    // A log without such lines is refused, naming what to do instead.
    let empty = std::env::temp_dir().join(format!("gpudirect-empty-{}.log", std::process::id()));
    std::fs::write(&empty, "h:1:1 [0] NCCL INFO Bootstrap : Using eth0\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["doctor", "--nccl-log"]).arg(&empty).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--env-file"), "{}", String::from_utf8_lossy(&out.stderr));
    std::fs::remove_file(&empty).unwrap();
}
