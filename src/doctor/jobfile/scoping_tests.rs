//! The shell's scoping, with bash itself as the reference: each script
//! runs under bash with a fake launcher on `PATH` that writes down what
//! it sees; the reading's value for the launch must be the same, or
//! unsettled (the verdict then open), never another value.

use std::path::PathBuf;
use std::process::Command;

use super::*;

/// A folder with fake launchers (`python`, `torchrun`) that append what
/// they see of `NCCL_IB_DISABLE` to `$GD_OUT`, an `mpirun` that passes
/// `-x NAME=value` on as Open MPI does, and an `nsys` that runs the rest
/// of its line, as a profiler does.
pub(super) fn bed() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("gpudirect-scoping-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let report = "printf '%s\\n' \"${NCCL_IB_DISABLE-<unset>}\" >> \"$GD_OUT\"\n";
        let programs = [
            ("python", format!("#!/bin/sh\n{report}")),
            ("torchrun", format!("#!/bin/sh\n{report}")),
            ("mpirun", format!("#!/bin/bash\nwhile [ $# -gt 0 ]; do case \"$1\" in -x) export \"$2\"; shift 2;; *) shift;; esac; done\n{report}")),
            ("nsys", "#!/bin/sh\nshift\nexec \"$@\"\n".to_owned()),
        ];
        for (name, body) in programs {
            let p = dir.join(name);
            std::fs::write(&p, body).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        dir
    })
    .clone()
}

/// What the last launch `script` runs under bash sees of
/// `NCCL_IB_DISABLE` (`Some(None)`: unset), `None` when no launch ran.
pub(super) fn bash_sees(script: &str) -> Option<Option<String>> {
    bash_sees_with(script, &[])
}

/// [`bash_sees`] with `vars` in bash's environment.
pub(super) fn bash_sees_with(script: &str, vars: &[(&str, &str)]) -> Option<Option<String>> {
    static CASE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let case = CASE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = bed();
    let (file, out) = (dir.join(format!("case{case}.sh")), dir.join(format!("case{case}.out")));
    std::fs::write(&file, script).unwrap();
    let _ = std::fs::remove_file(&out);
    let _ = Command::new("bash")
        .arg(&file)
        .current_dir(&dir)
        .env_clear()
        .env("PATH", format!("{}:/usr/bin:/bin", dir.display()))
        .env("GD_OUT", &out)
        .envs(vars.iter().copied())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    let seen = std::fs::read_to_string(&out).unwrap_or_default();
    seen.lines().last().map(|l| (l != "<unset>").then(|| l.to_owned()))
}

/// What the reading says the launch sees: `Ok(value)`, or `Err` when it
/// leaves it to the running job (unsettled, or seen, not read).
pub(super) fn reading_sees(f: &JobFile) -> Result<Option<String>, String> {
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

/// `#!/bin/bash\n` then `body`.
pub(super) fn sh(body: &str) -> String {
    format!("#!/bin/bash\n{body}")
}

/// The reading must agree with bash or leave it open.
pub(super) fn agrees(script: &str) {
    let bash = bash_sees(script).expect("the script launches under bash");
    let f = read(script);
    if let Ok(v) = reading_sees(&f) {
        assert_eq!(v, bash, "bash hands the launch {bash:?}, the reading says {v:?}:\n{script}\n{f:#?}");
    }
}

/// `(script body after the shebang, whether the reading must settle it)`.
const CASES: &[(&str, bool)] = &[
    // A prefix or `env` on another command is that command's only.
    ("export NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0 true\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nenv NCCL_IB_DISABLE=0 true\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0 python train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nenv NCCL_IB_DISABLE=0 torchrun train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nenv -u NCCL_IB_DISABLE python train.py\n", true),
    // Subshells, `$( )` bodies and pipeline elements change nothing after them.
    ("export NCCL_IB_DISABLE=1\n( export NCCL_IB_DISABLE=0 )\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\n(export NCCL_IB_DISABLE=0; (unset NCCL_IB_DISABLE))\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nX=$(export NCCL_IB_DISABLE=0; echo x)\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nexport NCCL_IB_DISABLE=0 | cat\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\necho x | export NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\n(export NCCL_IB_DISABLE=0; python train.py)\n", true),
    ("export NCCL_IB_DISABLE=0\npython train.py 2>&1 | tee log\n", true),
    // What comes after the launch does not reach it.
    ("export NCCL_IB_DISABLE=1\npython train.py\nunset NCCL_IB_DISABLE\n", true),
    ("export NCCL_IB_DISABLE=1\npython train.py\nexport NCCL_IB_DISABLE=0\n", true),
    ("export NCCL_IB_DISABLE=0\npython prepare.py\nexport NCCL_IB_DISABLE=1\ntorchrun train.py\n", true),
    // Read-only wins.
    ("readonly NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0\nexport NCCL_IB_DISABLE\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nreadonly NCCL_IB_DISABLE\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\ndeclare -r NCCL_IB_DISABLE\nunset NCCL_IB_DISABLE\npython train.py\n", true),
    ("NCCL_IB_DISABLE=0\nreadonly NCCL_IB_DISABLE\ndeclare -x NCCL_IB_DISABLE=1\npython train.py\n", true),
    ("NCCL_IB_DISABLE=0\nreadonly NCCL_IB_DISABLE\nexport NCCL_IB_DISABLE=1\npython train.py\n", true),
    // Nothing runs after an unconditional exit or exec; a conditional one goes on.
    ("export NCCL_IB_DISABLE=1\npython train.py\nexit 0\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nexec python train.py\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\ncd /tmp || exit 1\n[ -n \"$NOPE\" ] && exit 1\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nexec 2>/dev/null\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\n(exit 0)\nexport NCCL_IB_DISABLE=0\npython train.py\n", true),
    // A child shell's script: its launch is the job, its changes end with it.
    ("export NCCL_IB_DISABLE=1\nbash <<EOF\nexport NCCL_IB_DISABLE=0\npython train.py\nEOF\n", true),
    ("export NCCL_IB_DISABLE=1\nbash -s <<'EOF'\nexport NCCL_IB_DISABLE=0\npython train.py\nEOF\n", true),
    ("export NCCL_IB_DISABLE=1\nbash -c 'export NCCL_IB_DISABLE=0; python train.py'\n", true),
    ("export NCCL_IB_DISABLE=1\nbash -c 'export NCCL_IB_DISABLE=0'\npython train.py\n", true),
    ("export NCCL_IB_DISABLE=1\nNCCL_IB_DISABLE=0 bash -c 'python train.py'\n", true),
    ("export NCCL_IB_DISABLE=1\ncat > /tmp/gd-notes <<EOF\nexport NCCL_IB_DISABLE=0\nEOF\npython train.py\n", false),
    // Exported before or after it is set; not exported at all.
    ("export NCCL_IB_DISABLE\nNCCL_IB_DISABLE=1\npython train.py\n", true),
    ("NCCL_IB_DISABLE=1\nexport NCCL_IB_DISABLE\npython train.py\n", true),
    ("NCCL_IB_DISABLE=1\npython train.py\n", true),
    ("set -a\nNCCL_IB_DISABLE=1\npython train.py\n", true),
    // A function that launches is the launch where it is called.
    ("run() {\n  python train.py\n}\nexport NCCL_IB_DISABLE=1\nrun\n", true),
    ("function run {\n  torchrun train.py\n}\nexport NCCL_IB_DISABLE=1\nrun \"$@\"\nexport NCCL_IB_DISABLE=0\n", true),
    // A `case` pattern's parenthesis is not a subshell.
    ("export NCCL_IB_DISABLE=1\ncase x in\n  y) true ;;\nesac\npython train.py\n", true),
    // Branches the reading cannot decide leave it open.
    ("export NCCL_IB_DISABLE=1\nif [ -n \"$X\" ]; then export NCCL_IB_DISABLE=0; fi\npython train.py\n", false),
    ("export NCCL_IB_DISABLE=1\n[ -z \"$X\" ] || export NCCL_IB_DISABLE=0\npython train.py\n", false),
    // Forms the reading does not take into a value are seen.
    ("sudo NCCL_IB_DISABLE=1 true\npython train.py\n", true),
    ("export X=1\n: ${NCCL_IB_DISABLE:=1}\nexport NCCL_IB_DISABLE\npython train.py\n", false),
];

#[test]
fn the_launch_sees_what_bash_hands_it() {
    let mut failures = Vec::new();
    for (i, (body, settled)) in CASES.iter().enumerate() {
        let script = format!("#!/bin/bash\n{body}");
        let bash = bash_sees(&script).expect("every case launches");
        let f = read(&script);
        match reading_sees(&f) {
            Ok(v) if v == bash => {}
            Ok(v) => failures.push(format!("case {i}: bash hands the launch {bash:?}, the reading says {v:?}:\n{body}")),
            Err(why) if *settled => failures.push(format!("case {i}: bash hands the launch {bash:?}, the reading leaves it open ({why}):\n{body}")),
            Err(_) => {}
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The launch taken is named, with its line.
#[test]
fn the_launch_is_the_last_launcher() {
    let f = read("#!/bin/bash\npython prep.py\nsrun --ntasks=8 python train.py\necho done\n");
    assert_eq!(f.launch.as_ref().map(|l| (l.line, l.command.as_str())), Some((3, "srun")));
    let f = read("#!/bin/bash\nX=$(python -c 'print(1)')\n");
    assert_eq!(f.launch, None, "what runs in $( ) is not the job");
    let f = read("FROM x\nRUN python setup.py\nENV NCCL_IB_DISABLE=1\n");
    assert_eq!(f.launch, None, "a Dockerfile's RUN is a build step");
}

/// Random scripts from fragments, each run by bash: the reading never
/// gives the launch a value bash does not. `GD_SEED` and `GD_N` change
/// the seed and the count for a longer run.
#[test]
fn random_scripts_never_disagree_with_bash() {
    const FRAGMENTS: [&str; 38] = [
        "exec 2>/dev/null\n",
        "f() { export NCCL_IB_DISABLE=0; }\n",
        "f\n",
        "NCCL_IB_DISABLE=0 export X=1\n",
        "export -n NCCL_IB_DISABLE\n",
        "declare -x NCCL_IB_DISABLE=1\n",
        "case $X in *) export NCCL_IB_DISABLE=0 ;; esac\n",
        "sh -c \"python train.py\"\n",
        "export NCCL_IB_DISABLE=1\n",
        "export NCCL_IB_DISABLE=0\n",
        "NCCL_IB_DISABLE=1\n",
        "unset NCCL_IB_DISABLE\n",
        "export NCCL_IB_DISABLE\n",
        "NCCL_IB_DISABLE=0 true\n",
        "env NCCL_IB_DISABLE=1 true\n",
        "( export NCCL_IB_DISABLE=1 )\n",
        "X=$(export NCCL_IB_DISABLE=0)\n",
        "export NCCL_IB_DISABLE=1 | cat\n",
        "python train.py\n",
        "torchrun train.py\n",
        "NCCL_IB_DISABLE=1 python train.py\n",
        "env -u NCCL_IB_DISABLE python train.py\n",
        "python train.py | tee log\n",
        "readonly NCCL_IB_DISABLE\n",
        "exit 0\n",
        "true || exit 1\n",
        "exec python train.py\n",
        "bash -c 'export NCCL_IB_DISABLE=1; python train.py'\n",
        "bash <<EOF\nexport NCCL_IB_DISABLE=0\npython train.py\nEOF\n",
        "cat > /dev/null <<EOF\nNCCL_IB_DISABLE=1\nEOF\n",
        "set -a\n",
        "if true; then export NCCL_IB_DISABLE=1; fi\n",
        "run() { python train.py; }\n",
        "run\n",
        "A=${NCCL_IB_DISABLE:-0}\n",
        "export NCCL_IB_DISABLE=$A\n",
        "{ export NCCL_IB_DISABLE=0; }\n",
        "# export NCCL_IB_DISABLE=1\n",
    ];
    let mut rng = testkit::Rng(std::env::var("GD_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(48));
    let mut failures = Vec::new();
    for _ in 0..std::env::var("GD_N").ok().and_then(|s| s.parse().ok()).unwrap_or(300) {
        let n = 2 + rng.index(6);
        let body: String = (0..n).map(|_| FRAGMENTS[rng.index(FRAGMENTS.len())]).collect();
        let script = format!("#!/bin/bash\n{body}");
        // Without a launch the reading's answer (the end of the file) is
        // not bash's to give.
        let Some(bash) = bash_sees(&script) else { continue };
        if let Ok(v) = reading_sees(&read(&script)) {
            if v != bash {
                failures.push(format!("bash hands the launch {bash:?}, the reading says {v:?}:\n{body}"));
            }
        }
    }
    assert!(failures.is_empty(), "{} of 300:\n{}", failures.len(), failures.join("\n\n"));
}

/// Branches: for each, bash run both ways (`X` unset and `X=1`); the
/// reading leaves the value unsettled and lists every value bash gave
/// among its alternatives, so the doctor can tell whether they agree.
#[test]
fn branches_list_every_value_bash_gives() {
    const BRANCHES: &[&str] = &[
        "export NCCL_IB_DISABLE=1\nif [ -n \"$X\" ]; then export NCCL_IB_DISABLE=0; fi\npython train.py\n",
        "if [ -n \"$X\" ]; then export NCCL_IB_DISABLE=0; else export NCCL_IB_DISABLE=1; fi\npython train.py\n",
        "export NCCL_IB_DISABLE=1\ncase \"$X\" in\n  1) export NCCL_IB_DISABLE=0 ;;\n  *) unset NCCL_IB_DISABLE ;;\nesac\npython train.py\n",
        "export NCCL_IB_DISABLE=1\n[ -n \"$X\" ] && export NCCL_IB_DISABLE=0\npython train.py\n",
        "export NCCL_IB_DISABLE=1\n[ -z \"$X\" ] || { export NCCL_IB_DISABLE=0; }\npython train.py\n",
        "export NCCL_IB_DISABLE=1\nwhile [ -n \"$X\" ]; do export NCCL_IB_DISABLE=0; X=; done\npython train.py\n",
    ];
    for (i, body) in BRANCHES.iter().enumerate() {
        let script = format!("#!/bin/bash\n{body}");
        let f = read(&script);
        let Some((a, true)) = f.job("NCCL_IB_DISABLE") else { panic!("case {i}: {f:#?}") };
        let idx = f.env.iter().find(|(j, _)| f.assignments[*j].name == "NCCL_IB_DISABLE").map(|(j, _)| *j).unwrap();
        assert!(matches!(a.value, Some(Value::Unknown { .. })), "case {i}: a branch's value is unsettled: {a:?}");
        let alternatives = f.alternatives.get(&idx).unwrap_or_else(|| panic!("case {i}: no alternatives listed: {f:#?}"));
        for vars in [&[][..], &[("X", "1")][..]] {
            let bash = bash_sees_with(&script, vars).expect("it launches");
            assert!(alternatives.contains(&bash), "case {i}: bash with {vars:?} gives {bash:?}, not among {alternatives:?}:\n{body}");
        }
    }
}
