//! `gpudirect doctor --capture` and `--from`: every fixture machine, with
//! capable probe answers, captured and judged again from the capture alone
//! gives the same JSON; the job's environment laid over a capture changes
//! the first line and the exit code; a hostile capture writes nothing
//! outside its own tree.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use gpudirect::sysroot::SysRoot;
use gpudirect::topology;
use serde_json::{json, Value};

fn doctor(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    c.arg("doctor").args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("NCCL_") || k.starts_with("UCX_")) {
        c.env_remove(k);
    }
    c.envs(env.iter().copied());
    c.output().unwrap()
}

fn scratch(what: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("gpudirect-capture-test-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What verbs and CUDA would answer on a capable machine with the
/// fixture's GPUs and NICs: CUDA 12.8 with the open module, every NIC
/// able to register dma-buf, RoCE ports with a RoCE v2 IPv4-mapped GID.
fn capable_answers(machine: &Path) -> Value {
    let topo = topology::discover(&SysRoot::at(machine));
    let gpus: Vec<Value> = topo
        .gpus
        .iter()
        .enumerate()
        .map(|(i, g)| {
            json!({"ordinal": i, "label": format!("GPU{i} (NVIDIA H100, {})", g.bdf), "pci_bus_id": g.bdf, "cuda_unavailable": null,
                   "driver_version": 12080, "gdr_supported": true, "dma_buf_supported": true, "module": "Open"})
        })
        .collect();
    let nics: Vec<Value> = topo
        .nics
        .iter()
        .map(|n| {
            let ethernet = n.ports.first().and_then(|p| p.link_layer.as_deref()) == Some("Ethernet");
            let mut gid = [0u8; 16];
            gid[10..].copy_from_slice(&[0xff, 0xff, 192, 0, 2, 1]);
            let entry = json!({"index": 3, "gid": gid, "gid_type": "RoceV2", "netdev": n.netdevs.first()});
            json!({"name": n.name, "fw_ver": "28.39.1002",
                   "ports": [{"port": 1, "state": "Active", "max_mtu": "Mtu4096", "active_mtu": "Mtu4096", "lid": if ethernet { 0 } else { 7 },
                              "link_layer": if ethernet { "Ethernet" } else { "InfiniBand" }, "gid_table_len": 8}],
                   "gids": if ethernet { vec![entry.clone()] } else { vec![] },
                   "chosen_gid": if ethernet { json!({"Ok": {"entry": entry, "reason": "RoCE v2, IPv4-mapped"}}) } else { json!({"Err": "InfiniBand: LID-addressed"}) },
                   "dma_buf": {"Ok": {"Supported": libc::EBADF}}})
        })
        .collect();
    let rdma = if nics.is_empty() { json!({"Err": "no RDMA device: /sys/class/infiniband is empty"}) } else { json!({"Ok": nics}) };
    let gpus = if gpus.is_empty() { json!({"Err": "CUDA is not available"}) } else { json!({"Ok": gpus}) };
    json!({"rdma": rdma, "gpus": gpus, "host": {"kernel_release": "6.8.0-45-generic", "peer_memory_found": [], "peer_memory_api": false}})
}

fn fixtures() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(testkit::machine(""))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

fn json_of(out: &Output) -> Value {
    assert_ne!(out.status.code(), Some(2), "the doctor could not run: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)))
}

/// Captures `name` with capable answers; the path of the capture and the
/// report of the capturing run.
fn capture_fixture(dir: &Path, name: &str, env: &[(&str, &str)]) -> (PathBuf, Value) {
    let tag = if env.is_empty() { name.to_owned() } else { format!("{name}-env") };
    let answers = dir.join(format!("{tag}.answers.json"));
    std::fs::write(&answers, capable_answers(&testkit::machine(name)).to_string()).unwrap();
    let capture = dir.join(format!("{tag}.capture.json"));
    let root = testkit::machine(name);
    let out = doctor(
        &["--json", "--root", root.to_str().unwrap(), "--answers", answers.to_str().unwrap(), "--capture", capture.to_str().unwrap()],
        env,
    );
    (capture, json_of(&out))
}

#[test]
fn every_fixture_judged_from_its_capture_gives_the_same_json() {
    let dir = scratch("roundtrip");
    let names = fixtures();
    assert!(names.len() >= 8, "{names:?}");
    for name in &names {
        let (capture, live) = capture_fixture(&dir, name, &[]);
        let from = json_of(&doctor(&["--json", "--from", capture.to_str().unwrap()], &[]));
        assert_eq!(live, from, "{name}: the capture judged elsewhere differs");
        // A capture of a capture is the same capture.
        let again = dir.join(format!("{name}.again.json"));
        json_of(&doctor(&["--json", "--from", capture.to_str().unwrap(), "--capture", again.to_str().unwrap()], &[]));
        let (a, b): (Value, Value) = (
            serde_json::from_slice(&std::fs::read(&capture).unwrap()).unwrap(),
            serde_json::from_slice(&std::fs::read(&again).unwrap()).unwrap(),
        );
        assert_eq!(a["files"], b["files"], "{name}: capturing the unpacked tree changed it");
        let files = a["files"].as_array().unwrap().len();
        println!("{name}: {files} entries, {} bytes, verdict: {}", std::fs::metadata(&capture).unwrap().len(), live["verdict"]["line"]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first example: on a machine whose hardware allows
/// GPUDirect RDMA, `NCCL_IB_DISABLE=1 gpudirect doctor --from <capture>`
/// says on its first line that NCCL will not use it and why, and exits 1;
/// the healthy run prints the verdict and nothing that is not a problem.
#[test]
fn the_environment_over_a_capture_decides_the_first_line() {
    let dir = scratch("env");
    let (capture, _) = capture_fixture(&dir, "dgx-pix", &[]);
    let c = capture.to_str().unwrap();
    let healthy = doctor(&["--from", c], &[]);
    let text = String::from_utf8_lossy(&healthy.stdout);
    assert_eq!(healthy.status.code(), Some(0), "{text}");
    assert_eq!(
        text.lines().next(),
        Some("GPUDirect RDMA: available via dma-buf for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (PIX)"),
        "{text}"
    );
    assert!(!text.contains("[fail") && !text.contains("[ok"), "only problems and what is worth knowing:\n{text}");
    let disabled = doctor(&["--from", c], &[("NCCL_IB_DISABLE", "1")]);
    let text = String::from_utf8_lossy(&disabled.stdout);
    assert_eq!(disabled.status.code(), Some(1), "{text}");
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with("GPUDirect RDMA: the hardware allows it for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (dma-buf, PIX), but NCCL with this environment will not use it: NCCL_IB_DISABLE=1"),
        "{first}"
    );
    assert!(text.contains("this shell, over the capture"), "the variable's origin is named:\n{text}");
    // The capture keeps the environment it was taken with.
    let (captured_off, _) = capture_fixture(&dir, "dgx-pix", &[("NCCL_NET", "Socket")]);
    let out = doctor(&["--from", captured_off.to_str().unwrap()], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.lines().next().unwrap().contains("will not use it: NCCL_NET=Socket selects a TCP socket transport"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `doctor diff` takes captures as well as reports: judged each in its own
/// environment, the change of variable is the cause named first.
#[test]
fn diff_judges_two_captures() {
    let dir = scratch("diff");
    let (good, _) = capture_fixture(&dir, "dgx-pix", &[]);
    let (bad, _) = capture_fixture(&dir, "dgx-pix", &[("NCCL_NET", "Socket")]);
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["doctor", "diff"]).arg(&good).arg(&bad).env("NCCL_IB_DISABLE", "1").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "the verdict changed:\n{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<&str> = text.lines().collect();
    assert!(lines[0].starts_with("verdict: GPUDirect RDMA: available via dma-buf"), "{text}");
    assert!(lines.iter().any(|l| l.starts_with("new    [fail] env.nccl_net: NCCL_NET=Socket")), "{text}");
    assert!(!text.contains("NCCL_IB_DISABLE"), "this shell's variables are not laid over captures being compared:\n{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every fixture machine under every form of the job's environment: the
/// first line and the exit status follow what NCCL will do there. Each
/// machine is captured once with capable probes and judged `--from` its
/// capture with the variables laid over it.
#[test]
fn every_fixture_under_every_environment_form() {
    let dir = scratch("matrix");
    let mut judged = 0;
    for name in fixtures() {
        let (capture, _) = capture_fixture(&dir, &name, &[]);
        let c = capture.to_str().unwrap();
        let run = |env: &[(&str, &str)]| {
            let out = doctor(&["--json", "--from", c], env);
            let v = json_of(&out);
            (out.status.code(), v["verdict"].clone())
        };
        let (code0, base) = run(&[]);
        assert_eq!(code0, Some(if base["available"] == true { 0 } else { 1 }), "{name}: exit status and verdict disagree");
        let line0 = base["line"].as_str().unwrap().to_owned();
        let hw = base["hardware_allows"] == true;
        let topo = base["topology"].as_str().unwrap_or("").to_owned();
        let nic = base["nic"].as_str().unwrap_or("").to_owned();
        let stopped = |env: &[(&str, &str)], names: &str| {
            let (code, v) = run(env);
            let line = v["line"].as_str().unwrap();
            assert_eq!(code, Some(1), "{name} {env:?}: {line}");
            if hw {
                assert!(line.starts_with("GPUDirect RDMA: the hardware allows it for "), "{name} {env:?}: {line}");
                assert!(line.contains(names), "{name} {env:?}: {line}");
            } else {
                assert_eq!(line, line0, "{name} {env:?}: the hardware's reason stays first");
            }
        };
        let same = |env: &[(&str, &str)]| {
            let (code, v) = run(env);
            assert_eq!((code, v["line"].as_str().unwrap()), (code0, line0.as_str()), "{name} {env:?}");
        };
        stopped(&[("NCCL_IB_DISABLE", "1")], "NCCL_IB_DISABLE=1");
        stopped(&[("NCCL_NET", "Socket")], "NCCL_NET=Socket");
        same(&[("NCCL_IB_DISABLE", "0")]);
        same(&[("NCCL_NET", "IB")]);
        if hw {
            stopped(&[("NCCL_NET_GDR_LEVEL", "LOC")], "NCCL_NET_GDR_LEVEL=LOC");
            let (code, _) = run(&[("NCCL_NET_GDR_LEVEL", "SYS")]);
            assert_eq!(code, Some(0), "{name}: SYS allows every pair");
            let (code, v) = run(&[("NCCL_NET_GDR_LEVEL", "PIX")]);
            assert_eq!(code == Some(0), v["topology"] == "PIX", "{name} PIX: {}", v["line"]);
            // The nearest NIC named exactly keeps the verdict; left out, it
            // is named as what stops (or moves) GPUDirect RDMA.
            let (code, v) = run(&[("NCCL_IB_HCA", &format!("={nic}:1"))]);
            assert_eq!((code, v["nic"].as_str()), (code0, Some(nic.as_str())), "{name}: {}", v["line"]);
            let (code, v) = run(&[("NCCL_IB_HCA", &format!("^={nic}"))]);
            let line = v["line"].as_str().unwrap();
            assert!(line.contains(&format!("leaves out {nic}")), "{name} ^={nic}: {line}");
            assert_eq!(code == Some(0), line.starts_with("GPUDirect RDMA: available via"), "{name}: {line}");
        } else {
            same(&[("NCCL_NET_GDR_LEVEL", "SYS")]);
        }
        judged += 1;
        println!("{name} ({topo}): {line0}");
    }
    assert!(judged >= 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The committed capture (tests/data/captures) still reads, and still
/// judges to what its README shows.
#[test]
fn the_committed_capture_still_judges_as_documented() {
    let c = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");
    let out = doctor(&["--from", c], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().next(), Some("GPUDirect RDMA: available via dma-buf for GPU0 (NVIDIA H100, 0000:18:00.0) <-> mlx5_0 (PIX)"));
    let out = doctor(&["--from", c], &[("NCCL_IB_DISABLE", "1")]);
    assert_eq!(out.status.code(), Some(1));
}

/// Hostile or mistaken inputs: a capture judged with a job script reads
/// the capture's own configuration files, never a file its tree links to
/// on this machine; env files, captures and logs that are FIFOs, devices
/// or too large are refused at once with the reason; a configuration
/// file's other lines (credentials) never reach a capture.
#[test]
fn inputs_are_confined_to_the_capture_and_bounded() {
    let dir = scratch("hostile-inputs");
    let committed = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json");
    // A file of "the engineer's machine", and a capture whose tree links
    // /etc/nccl.conf to it.
    let host_conf = dir.join("host.conf");
    std::fs::write(&host_conf, "NCCL_IB_DISABLE=1\naws_secret_access_key=AKIAEXAMPLESECRET\n").unwrap();
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(committed).unwrap()).unwrap();
    c["files"].as_array_mut().unwrap().push(json!({"kind": "link", "path": "/etc/nccl.conf", "target": host_conf.to_str().unwrap()}));
    let linked = dir.join("linked.json");
    std::fs::write(&linked, c.to_string()).unwrap();
    let script = dir.join("job.sh");
    std::fs::write(&script, "export NCCL_DEBUG=INFO\n").unwrap();
    let out = doctor(&["--from", linked.to_str().unwrap(), "--env-file", script.to_str().unwrap(), "--json"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "the host file was read: {text}");
    assert!(!text.contains("NCCL_IB_DISABLE"), "{text}");
    // The script naming a configuration file: not in the capture, said
    // so, and not read here either: what it may set leaves the verdict open.
    std::fs::write(&script, format!("export NCCL_CONF_FILE={}\n", host_conf.display())).unwrap();
    let out = doctor(&["--from", committed, "--env-file", script.to_str().unwrap(), "-v"], &[]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "{text}");
    assert!(text.contains("that file is not in the capture"), "{text}");
    assert!(text.lines().next().is_some_and(|l| l.starts_with("GPUDirect RDMA: cannot tell") && l.contains("which was not read here (the capture does not hold it)")), "{text}");
    assert!(!text.contains("AKIAEXAMPLESECRET"), "{text}");

    // Files that are not regular files, or too large: refused at once.
    let fifo = dir.join("fifo");
    let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
    let big = dir.join("big.json");
    std::fs::File::create(&big).unwrap().set_len(100 << 20).unwrap();
    let cases: [(&[&str], &str); 6] = [
        (&["--env-file", "/dev/zero"], "character device, not a regular file"),
        (&["--env-file", fifo.to_str().unwrap()], "FIFO (pipe), not a regular file"),
        (&["--from", "/dev/zero"], "character device"),
        (&["--from", big.to_str().unwrap()], "larger than 67108864 bytes"),
        (&["--from", committed, "--env-file", fifo.to_str().unwrap()], "FIFO"),
        (&["--nccl-log", fifo.to_str().unwrap()], "FIFO"),
    ];
    for (args, why) in cases {
        let started = std::time::Instant::now();
        let out = doctor(args, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(started.elapsed() < std::time::Duration::from_secs(10), "{args:?} took {:?}", started.elapsed());
    }
    let started = std::time::Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect")).args(["nccl-log", fifo.to_str().unwrap()]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("pipe it in"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(started.elapsed() < std::time::Duration::from_secs(10));

    // A configuration file's other names never reach a capture; its
    // NCCL variables do, and judge the same from the capture.
    std::fs::write(&script, format!("export NCCL_CONF_FILE={}\n", host_conf.display())).unwrap();
    let answers = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.answers.json");
    let captured = dir.join("captured.json");
    // The live root, where the file named exists.
    let out = doctor(&["--root", "/", "--answers", answers, "--env-file", script.to_str().unwrap(), "--capture", captured.to_str().unwrap()], &[]);
    assert!(out.status.code().is_some_and(|c| c < 2), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&captured).unwrap();
    assert!(!text.contains("AKIA") && !text.contains("aws_secret"), "a credential reached the capture");
    assert!(text.contains("NCCL_IB_DISABLE"), "the configuration file's NCCL variable is captured");
    let out = doctor(&["--from", captured.to_str().unwrap(), "--env-file", script.to_str().unwrap(), "-v"], &[]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("NCCL_IB_DISABLE"), "{}", String::from_utf8_lossy(&out.stdout));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The real capture of the H200 VM's container (driver 580.159, CUDA 13.0,
/// a virtio NIC, no RDMA device): the verdict names the missing RDMA
/// device; missing peer memory does not claim dma-buf is ruled out (the GPU
/// and kernel support it); the virtio NIC is not "full rate".
#[test]
fn the_h200_vm_capture_is_judged_as_the_machine_is() {
    let capture = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/h200-vm-container.json");
    let out = doctor(&["--json", "--from", capture], &[]);
    assert_eq!(out.status.code(), Some(1));
    let r = json_of(&out);
    assert_eq!(r["verdict"]["line"], "GPUDirect RDMA: not available: no RDMA device is visible");
    let find = |check: &str| r["findings"].as_array().unwrap().iter().find(|f| f["check"] == check).cloned().unwrap_or_else(|| panic!("no {check}"));
    let peer = find("peermem.client");
    assert_eq!(peer["status"], "ok", "{peer:#}");
    assert!(!peer["summary"].as_str().unwrap().contains("dma-buf is ruled out"), "{peer:#}");
    assert_eq!(find("cuda.dmabuf.gpu0")["status"], "ok");
    let fabric = find("pod.fabric");
    assert_eq!(fabric["status"], "fail", "{fabric:#}");
    let summary = fabric["summary"].as_str().unwrap();
    assert!(summary.contains("eth0 have no RDMA device") && !summary.contains("full rate"), "{summary}");
}
