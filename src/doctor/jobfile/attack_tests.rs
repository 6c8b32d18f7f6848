//! Hostile review of the job-file reading: each test is one attack.
//! The oracle is bash with a fake launcher on PATH (as in scoping_tests).

use std::path::PathBuf;
use std::process::Command;

use super::*;

fn bed() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("gpudirect-attack-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for l in ["python", "torchrun", "srun", "mpirun", "deepspeed", "python3"] {
            let p = dir.join(l);
            std::fs::write(&p, "#!/bin/sh\nprintf '%s\\n' \"${NCCL_IB_DISABLE-<unset>}\" >> \"$GD_OUT\"\n").unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir
    })
    .clone()
}

static CASE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// What the last launch sees of NCCL_IB_DISABLE under bash.
fn bash_sees(script: &str) -> Option<Option<String>> {
    let dir = bed();
    let case = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (file, out) = (dir.join(format!("a{case}.sh")), dir.join(format!("a{case}.out")));
    std::fs::write(&file, script).unwrap();
    let _ = std::fs::remove_file(&out);
    let _ = Command::new("bash")
        .arg(&file)
        .current_dir(&dir)
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", dir.display()))
        .env("GD_OUT", &out)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    let seen = std::fs::read_to_string(&out).unwrap_or_default();
    seen.lines().last().map(|l| (l != "<unset>").then(|| l.to_owned()))
}

fn reading_sees(f: &JobFile) -> Result<Option<String>, String> {
    if let Some(s) = f.seen.iter().find(|s| s.name == "NCCL_IB_DISABLE") {
        return Err(format!("seen, not read, line {}", s.line));
    }
    match f.job("NCCL_IB_DISABLE") {
        None | Some((_, false)) => Ok(None),
        Some((a, true)) => match &a.value {
            None => Ok(None),
            Some(Value::Known(v)) => Ok(Some(v.clone())),
            Some(Value::Unknown { why, .. }) => Err(why.clone()),
        },
    }
}

/// The reading must agree with bash or leave it open.
fn agrees(script: &str) {
    let bash = bash_sees(script).expect("the script launches under bash");
    let f = read(script);
    if let Ok(v) = reading_sees(&f) {
        assert_eq!(v, bash, "bash hands the launch {bash:?}, the reading says {v:?}:\n{script}\n{f:#?}");
    }
}

#[test]
fn placeholder() {
    agrees("#!/bin/bash\nexport NCCL_IB_DISABLE=1\npython x.py\n");
}
