//! The environment of the job, as NCCL will see it: the variables of a
//! process (this one, another by its pid, or a job script's), then the
//! NCCL configuration files in NCCL's own order. NCCL reads the user's
//! file (`NCCL_CONF_FILE` when set and not empty, else `~/.nccl.conf`)
//! and then `/etc/nccl.conf`, each `NAME=VALUE` line set only if the name
//! is not set yet, so the process environment wins over the user's file,
//! which wins over the system's. A line starting with `#` is a comment;
//! the name is everything before the first `=`, spaces included, so
//! `NCCL_IB_DISABLE = 1` sets a variable NCCL never reads.

use std::path::{Path, PathBuf};

use gpudirect::sysroot::SysRoot;

use super::input::SCRIPT_LIMIT;

/// Variables, each with where it came from.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct JobEnv {
    /// `(name, value)` in the order judged; a later name wins.
    pub vars: Vec<(String, String)>,
    /// `(name, origin)`: `the environment`, a file's path.
    pub origins: Vec<(String, String)>,
    /// What was read and what could not be, for the report.
    pub notes: Vec<String>,
    /// The NCCL configuration files read, in NCCL's order, with the
    /// assignments the doctor judges: a capture carries them, so judging
    /// it with another job's variables reads no file of the machine it is
    /// judged on.
    #[serde(default)]
    pub conf_files: Vec<ConfFile>,
    /// Variables a job file sets to values only the running job settles
    /// (`${X:-...}`, `$(cmd)`, a branch): not in `vars`, never judged as
    /// their text.
    #[serde(default)]
    pub unsettled: Vec<Unsettled>,
    /// The job's `LD_LIBRARY_PATH`, where NCCL's network plugin is looked
    /// for first.
    #[serde(default)]
    pub library_path: Option<String>,
    /// `NCCL_*`/`UCX_*` names a job file names that its reading did not
    /// take into a value (*seen, not read*), each with its line.
    #[serde(default)]
    pub seen: Vec<super::jobfile::Seen>,
}

/// A variable whose value the job file cannot settle.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Unsettled {
    /// The variable.
    pub name: String,
    /// Its value as written.
    pub text: String,
    /// Why the file cannot settle it.
    pub why: String,
    /// Where it is set (`job.sh line 4 (export)`).
    pub origin: String,
    /// The values it may have, where the file lists them (branches that
    /// set known values; `None`: unset); empty when they cannot be listed.
    #[serde(default)]
    pub alternatives: Vec<Option<String>>,
}

/// One NCCL configuration file as read.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConfFile {
    /// Its path on the machine (`/etc/nccl.conf`).
    pub path: String,
    /// Its `NCCL_`/`UCX_` assignments, as NCCL reads them; other names
    /// are not kept (a file may hold anything, credentials included).
    pub vars: Vec<(String, String)>,
}

impl JobEnv {
    /// Where `name` came from (`the environment` when not recorded).
    pub fn origin(&self, name: &str) -> &str {
        self.origins.iter().rev().find(|(n, _)| n == name).map_or("the environment", |(_, o)| o.as_str())
    }
}

pub use super::jobfile::judged;

/// The job's variables as a job file sets them ([`super::jobfile`]): the
/// `NCCL_*` and `UCX_*` names its launch sees, each with its line and
/// form; those the file unsets are left out, those it cannot settle are
/// [`JobEnv::unsettled`], and plain assignments a script does not export
/// are noted, not taken (its commands do not see them). Names the file
/// names but the reading did not take are [`JobEnv::seen`]; a deciding
/// one among them leaves the verdict open, as an unsettled value does.
pub fn from_job_file(file: &super::jobfile::JobFile, shown: &str) -> JobEnv {
    use super::jobfile::{Form, Value};
    let mut env = JobEnv::default();
    if let Some((a, true)) = file.job("LD_LIBRARY_PATH") {
        if let Some(Value::Known(p)) = &a.value {
            env.library_path = Some(p.clone());
        }
    }
    match &file.launch {
        Some(l) => {
            let may = l.uncertain.as_ref().map_or_else(String::new, |w| format!(" ({w})"));
            env.notes.push(format!("{shown}: the job's launch is taken to be line {} ({}){may}: the variables are those it sees", l.line, l.command));
        }
        None if file.script => env.notes.push(format!("{shown}: no launcher found (torchrun, python, srun, mpirun, ...): the variables are those set at the end of the file")),
        None => {}
    }
    for &(idx, reaches) in &file.env {
        let a = &file.assignments[idx];
        if !judged(&a.name) {
            continue;
        }
        let origin = format!("{shown} line {} ({})", a.line, a.form.shown());
        if !reaches {
            let why = match a.form {
                Form::DockerArg => "a build argument, not in the container's environment",
                _ => "not exported, so the script's commands do not see it (export it)",
            };
            env.notes.push(format!("{origin}: {} is {why}", a.name));
            continue;
        }
        match &a.value {
            None => env.notes.push(format!("{origin}: {} is unset", a.name)),
            Some(Value::Known(v)) => {
                env.origins.push((a.name.clone(), origin));
                env.vars.push((a.name.clone(), v.clone()));
            }
            Some(Value::Unknown { text, why }) => {
                let alternatives = file.alternatives.get(&idx).cloned().unwrap_or_default();
                env.unsettled.push(Unsettled { name: a.name.clone(), text: text.clone(), why: why.clone(), origin, alternatives });
            }
        }
    }
    for s in &file.seen {
        if gpudirect::nccl::DECIDING.contains(&s.name.as_str()) && !env.unsettled.iter().any(|u| u.name == s.name) {
            let why = format!("line {} names it in a form this reading does not take into a value, so what the job gets is not known here", s.line);
            env.unsettled.push(Unsettled { name: s.name.clone(), text: s.text.clone(), why, origin: format!("{shown} line {}", s.line), alternatives: vec![] });
        }
    }
    let (taken, unsettled) = (env.vars.len(), env.unsettled.len());
    env.notes.insert(0, format!("{shown}: {taken} NCCL_/UCX_ variable(s) settled, {unsettled} left to the running job, {} seen, not read", file.seen.len()));
    if let Some(l) = file.too_deep {
        env.notes.push(format!("{shown}: line {l} nests deeper than {} levels: what it sets there is seen, not read", super::jobfile::MAX_NESTING));
    }
    env.notes.extend(file.scope_notes.iter().map(|n| format!("{shown}: {n}")));
    env.notes.extend(file.notes.iter().map(|n| format!("{shown}: {n}")));
    env.seen = file.seen.clone();
    env
}

/// The variables of a process (or this one) as they are, each from
/// `origin`.
pub fn from_process(vars: Vec<(String, String)>, origin: &str) -> JobEnv {
    let mut env = JobEnv { library_path: vars.iter().rev().find(|(n, _)| n == "LD_LIBRARY_PATH").map(|(_, v)| v.clone()), ..JobEnv::default() };
    for (n, v) in vars.into_iter().filter(|(n, _)| judged(n)) {
        env.origins.push((n.clone(), origin.to_owned()));
        env.vars.push((n, v));
    }
    env
}

/// The variables of `/proc/PID/environ` (NUL-separated `NAME=VALUE`).
pub fn parse_environ(bytes: &[u8]) -> Vec<(String, String)> {
    bytes
        .split(|&b| b == 0)
        .filter_map(|e| {
            let s = String::from_utf8_lossy(e);
            let (n, v) = s.split_once('=')?;
            (!n.is_empty()).then(|| (n.to_owned(), v.to_owned()))
        })
        .collect()
}

/// A NCCL configuration file's assignments, read as NCCL reads them.
pub fn parse_nccl_conf(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(n, v)| (n.to_owned(), v.to_owned()))
        .collect()
}

/// The variables an NCCL log shows NCCL read (`NAME set by environment to
/// VALUE`, printed at `NCCL_DEBUG=INFO`), each with its line: what that
/// run saw, the configuration files' lines included (NCCL sets those into
/// its environment before reading its parameters), so no file is read
/// again.
pub fn from_nccl_log(settings: &[crate::nccl_log::EnvSetting], shown: &str) -> JobEnv {
    let mut env = JobEnv::default();
    for s in settings {
        if let Some(l) = s.set_by_plugin {
            env.notes.push(format!("{shown}: {}={} was set by the network plugin itself (line {l}), not by the job: not judged", s.name, s.value));
            continue;
        }
        env.origins.push((s.name.clone(), format!("the NCCL log {shown} (line {})", s.line)));
        env.vars.push((s.name.clone(), s.value.clone()));
    }
    env.notes.push(format!("{shown}: {} variable(s) NCCL reported as set by the environment", settings.len()));
    env
}

/// `process` (in order, a later name winning) completed by the NCCL
/// configuration files of the machine under `root`: the user's file, in
/// `home` unless `NCCL_CONF_FILE` names one, then `/etc/nccl.conf`. Each is
/// read inside `root` (links resolved there), only when it is a regular
/// file, and up to [`SCRIPT_LIMIT`].
pub fn resolve(process: JobEnv, root: &SysRoot, home: Option<&Path>) -> JobEnv {
    let named = unsettled_conf_file(&process);
    let (files, notes, unread) = read_conf_files(&process.vars, root, home);
    let mut env = layer(process, files);
    env.notes.extend(notes);
    for (file, why) in unread.into_iter().chain(named) {
        unread_file(&mut env, &file, &why);
    }
    env
}

/// When the job leaves `NCCL_CONF_FILE` to the running job (a value only
/// it settles, a branch, a function), the file NCCL reads instead of
/// `~/.nccl.conf` is not known: it is a file not read.
fn unsettled_conf_file(process: &JobEnv) -> Option<(String, String)> {
    let u = process.unsettled.iter().find(|u| u.name == "NCCL_CONF_FILE")?;
    Some((format!("the file NCCL_CONF_FILE names ({})", u.origin), format!("NCCL_CONF_FILE is `{}`, and {}", u.text, u.why)))
}

/// NCCL reads `file`, which was not read here (`why`): each deciding
/// variable the environment does not set may be set there, so each is
/// left to the running job, never judged as unset.
fn unread_file(env: &mut JobEnv, file: &str, why: &str) {
    for name in gpudirect::nccl::DECIDING {
        if env.vars.iter().any(|(n, _)| n == name) || env.unsettled.iter().any(|u| u.name == name) {
            continue;
        }
        env.unsettled.push(Unsettled {
            name: name.to_owned(),
            text: format!("(in {file})"),
            why: format!("NCCL reads {file}, which was not read here ({why}), and it may set it"),
            origin: file.to_owned(),
            alternatives: vec![],
        });
    }
}

/// `process` completed by the configuration files a capture holds
/// (`captured`), as they were read on the captured machine: nothing is
/// read here. A `NCCL_CONF_FILE` in `process` that names a file the
/// capture does not hold is noted, not looked for.
pub fn over_captured_files(process: JobEnv, captured: &[ConfFile]) -> JobEnv {
    let named = process.vars.iter().rev().find(|(n, _)| n == "NCCL_CONF_FILE").map(|(_, v)| v.clone()).filter(|v| !v.is_empty());
    let mut note = None;
    if let Some(f) = &named {
        if !captured.iter().any(|c| c.path == *f) {
            note = Some(format!("NCCL_CONF_FILE={f}: that file is not in the capture (it holds {}); judged without it", held(captured)));
        }
    }
    let unsettled = unsettled_conf_file(&process);
    let mut env = layer(process, captured.to_vec());
    if let (Some(f), Some(_)) = (&named, &note) {
        unread_file(&mut env, f, "the capture does not hold it");
    }
    if let Some((file, why)) = unsettled {
        unread_file(&mut env, &file, &why);
    }
    env.notes.extend(note);
    env
}

fn held(files: &[ConfFile]) -> String {
    if files.is_empty() {
        return "no NCCL configuration file".into();
    }
    files.iter().map(|f| f.path.as_str()).collect::<Vec<_>>().join(", ")
}

/// The NCCL configuration files `process` makes NCCL read, as read under
/// `root`, and notes on those that could not be.
/// Also the files NCCL would read that could not be, with why.
fn read_conf_files(process: &[(String, String)], root: &SysRoot, home: Option<&Path>) -> (Vec<ConfFile>, Vec<String>, Vec<(String, String)>) {
    let conf_file = process.iter().rev().find(|(n, _)| n == "NCCL_CONF_FILE").map(|(_, v)| v.clone()).filter(|v| !v.is_empty());
    let user: Option<PathBuf> = match conf_file {
        Some(f) => Some(PathBuf::from(f)),
        None => home.map(|h| h.join(".nccl.conf")),
    };
    let (mut files, mut notes, mut unread) = (Vec::new(), Vec::new(), Vec::new());
    for file in user.into_iter().chain(std::iter::once(PathBuf::from("/etc/nccl.conf"))) {
        let shown = file.display().to_string();
        let machine_path = if file.is_absolute() {
            shown.clone()
        } else if *root == SysRoot::live() {
            // NCCL opens a relative NCCL_CONF_FILE from the job's working
            // directory: this one's, for a live judgement.
            match std::env::current_dir() {
                Ok(d) => d.join(&file).display().to_string(),
                Err(e) => {
                    notes.push(format!("{shown}: relative, and the working directory is unknown ({e})"));
                    unread.push((shown, "relative, and the working directory is unknown".to_owned()));
                    continue;
                }
            }
        } else {
            notes.push(format!("{shown}: a relative path, which only the job's working directory settles: not read"));
            unread.push((shown, "a relative path only the job's working directory settles".to_owned()));
            continue;
        };
        match root.read_bytes(&machine_path, SCRIPT_LIMIT + 1) {
            Ok(b) if b.len() as u64 > SCRIPT_LIMIT => {
                notes.push(format!("{shown}: larger than {SCRIPT_LIMIT} bytes: not read"));
                unread.push((shown, format!("larger than {SCRIPT_LIMIT} bytes")));
            }
            Ok(b) => {
                let text = String::from_utf8_lossy(&b);
                let all = parse_nccl_conf(&text);
                let others = all.iter().filter(|(n, _)| !judged(n.trim())).count();
                if others > 0 {
                    notes.push(format!("{shown}: {others} assignment(s) of other names than NCCL_ and UCX_ ones, not kept"));
                }
                files.push(ConfFile { path: shown, vars: all.into_iter().filter(|(n, _)| judged(n.trim())).collect() });
            }
            // Most machines have neither file: nothing worth a line.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                notes.push(format!("{shown}: cannot be read ({e})"));
                unread.push((shown, e.to_string()));
            }
        }
    }
    (files, notes, unread)
}

/// `process` (a later name winning) with each configuration file's
/// assignments below it, in order: a name is set only if not set yet.
fn layer(mut env: JobEnv, files: Vec<ConfFile>) -> JobEnv {
    for file in &files {
        let shown = &file.path;
        let mut took = 0;
        for (n, v) in &file.vars {
            if env.vars.iter().any(|(k, _)| k == n) {
                env.notes.push(format!("{shown}: {n}={v} is not used: {n} is already set by {}", env.origin(n)));
                continue;
            }
            if let Some(u) = env.unsettled.iter().find(|u| u.name == *n) {
                env.notes.push(format!("{shown}: {n}={v} is used only if the job leaves {n} unset ({} sets it to a value only the running job settles)", u.origin));
                continue;
            }
            if n.trim() != n {
                env.notes.push(format!("{shown}: {n:?} has spaces around its name: NCCL sets a variable of that exact name, which it never reads"));
            }
            env.origins.push((n.clone(), shown.clone()));
            env.vars.push((n.clone(), v.clone()));
            took += 1;
        }
        env.notes.push(format!("{shown}: read, {took} variable(s) taken"));
    }
    env.conf_files = files;
    env
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_files_and_scripts_are_read_without_running_them() {
        let script = "# job\nexport NCCL_IB_DISABLE=1\nNCCL_NET_GDR_LEVEL='LOC'\n  export NCCL_IB_HCA=\"=mlx5_1:1\"\nexport NCCL_SOCKET_IFNAME=$IFACE\npython train.py --lr=3\nPATH=/x\nexport NCCL_ALGO=Ring\n";
        let e = from_job_file(&crate::doctor::jobfile::read(script), "job.sh");
        assert_eq!(
            e.vars,
            vec![("NCCL_IB_DISABLE".into(), "1".into()), ("NCCL_NET_GDR_LEVEL".into(), "LOC".into()), ("NCCL_IB_HCA".into(), "=mlx5_1:1".into())]
        );
        assert_eq!(e.origin("NCCL_IB_HCA"), "job.sh line 4 (export)");
        assert_eq!((e.unsettled.len(), e.unsettled[0].name.as_str(), e.unsettled[0].text.as_str()), (1, "NCCL_SOCKET_IFNAME", "$IFACE"));
        assert_eq!(e.unsettled[0].origin, "job.sh line 5 (export)");
        assert!(e.notes.iter().any(|n| n.contains("launch is taken to be line 6 (python)")), "{:?}", e.notes);
        assert!(e.notes.iter().any(|n| n.contains("line 8: NCCL_ALGO is set after the launch on line 6")), "{:?}", e.notes);
        let run = from_job_file(&crate::doctor::jobfile::read("#!/bin/bash\nNCCL_IB_HCA=mlx5_0\npython x.py\n"), "run.sh");
        assert!(run.vars.is_empty() && run.notes.iter().any(|n| n.contains("not exported")), "{run:?}");
        assert_eq!(parse_environ(b"A=1\0NCCL_NET=Socket\0junk\0=x\0"), vec![("A".into(), "1".into()), ("NCCL_NET".into(), "Socket".into())]);
    }

    #[test]
    fn an_nccl_log_names_what_nccl_read_and_where() {
        let log = "h:1:1 [0] NCCL INFO Bootstrap : Using eth0\nh:1:1 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\nh:1:1 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0\n";
        let e = from_nccl_log(&crate::nccl_log::explain(log).environment, "job.log");
        assert_eq!(e.vars, vec![("NCCL_IB_DISABLE".into(), "1".into()), ("NCCL_SOCKET_IFNAME".into(), "eth0".into())]);
        assert_eq!(e.origin("NCCL_IB_DISABLE"), "the NCCL log job.log (line 2)");
    }

    #[test]
    fn nccl_conf_files_fill_in_below_the_environment_in_ncclss_order() {
        let root = std::env::temp_dir().join(format!("gpudirect-jobenv-{}", std::process::id()));
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(root.join("home/u")).unwrap();
        std::fs::write(root.join("etc/nccl.conf"), "NCCL_IB_DISABLE=1\nNCCL_DEBUG=WARN\n#NCCL_NET=Socket\n").unwrap();
        std::fs::write(root.join("home/u/.nccl.conf"), "NCCL_DEBUG=INFO\nNCCL_IB_HCA = mlx5_0\n").unwrap();
        let e = resolve(from_process(vec![("NCCL_NET_GDR_LEVEL".into(), "PIX".into())], "the environment"), &SysRoot::at(&root), Some(Path::new("/home/u")));
        let get = |n: &str| e.vars.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!((get("NCCL_IB_DISABLE"), get("NCCL_DEBUG"), get("NCCL_NET")), (Some("1"), Some("INFO"), None), "the user's file wins over /etc's");
        assert_eq!(e.origin("NCCL_IB_DISABLE"), "/etc/nccl.conf");
        assert_eq!(e.origin("NCCL_DEBUG"), "/home/u/.nccl.conf");
        assert_eq!(e.origin("NCCL_NET_GDR_LEVEL"), "the environment");
        assert!(e.notes.iter().any(|n| n.contains("NCCL_DEBUG=WARN is not used")), "{:?}", e.notes);
        assert!(e.notes.iter().any(|n| n.contains("spaces around its name")), "{:?}", e.notes);
        // The environment wins over both; NCCL_CONF_FILE replaces ~/.nccl.conf.
        std::fs::write(root.join("job.conf"), "NCCL_NET=Socket\n").unwrap();
        let e = resolve(from_process(vec![("NCCL_IB_DISABLE".into(), "0".into()), ("NCCL_CONF_FILE".into(), "/job.conf".into())], "process 7"), &SysRoot::at(&root), Some(Path::new("/home/u")));
        let get = |n: &str| e.vars.iter().rev().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
        assert_eq!((get("NCCL_IB_DISABLE"), get("NCCL_NET"), get("NCCL_DEBUG")), (Some("0"), Some("Socket"), Some("WARN")));
        assert_eq!(e.origin("NCCL_IB_DISABLE"), "process 7");
        // A file NCCL reads that cannot be read here leaves each deciding
        // variable the environment does not set to the running job.
        std::fs::create_dir_all(root.join("big")).unwrap();
        let e = resolve(from_process(vec![("NCCL_CONF_FILE".into(), "/big".into()), ("NCCL_NET".into(), "IB".into())], "process 7"), &SysRoot::at(&root), None);
        let names: Vec<&str> = e.unsettled.iter().map(|u| u.name.as_str()).collect();
        assert!(names.contains(&"NCCL_IB_HCA") && !names.contains(&"NCCL_NET") && !names.contains(&"NCCL_IB_DISABLE"), "{names:?}");
        assert!(e.unsettled[0].why.starts_with("NCCL reads /big, which was not read here"), "{:?}", e.unsettled[0]);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
