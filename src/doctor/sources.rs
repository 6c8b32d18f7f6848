//! Where the doctor reads the machine and the job from: this machine (or a
//! tree under a root), a capture, and the job's environment from the
//! doctor's own, a job script, a running process or an NCCL log; and the
//! one entry point that judges them, writing a capture when asked. The
//! command line and the Python package both call [`judge`].

use std::path::{Path, PathBuf};

use gpudirect::sysroot::SysRoot;

use super::capture::{Answers, Capture, Recorder};
use super::input;
use super::jobenv::{self, JobEnv};
use super::probes::{LiveProbes, Probes};
use super::report::{self, Options, Report};
use super::Machine;

/// Where the doctor reads the machine and the job from.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// Lay this process's NCCL_/UCX_ variables over a capture's environment.
    pub shell_over_capture: bool,
    /// Where sysfs and procfs are read (`/` for this machine).
    pub root: PathBuf,
    /// The job's variables from a file (KEY=VALUE lines or a script's
    /// `export` lines) instead of this process's.
    pub env_file: Option<PathBuf>,
    /// The job's variables from a running process.
    pub pid: Option<u32>,
    /// The job's variables from an NCCL log's `set by environment to` lines.
    pub nccl_log: Option<PathBuf>,
    /// Also write what the judgement read to this file.
    pub capture: Option<PathBuf>,
    /// Judge this capture instead of a machine.
    pub from: Option<PathBuf>,
    /// Probe answers to use instead of asking verbs and CUDA (fixtures).
    pub answers: Option<PathBuf>,
}

impl Sources {
    /// This machine, judged with this process's environment.
    pub fn this_machine() -> Sources {
        Sources { root: PathBuf::from("/"), ..Sources::default() }
    }

    /// Whether the sources can be judged together: the job's environment
    /// comes from one place (a file, a process or a log, each the whole
    /// of it), and a capture stands for the machine (no root, no answers
    /// beside it). The one check of a request, whichever front end made it.
    ///
    /// # Errors
    /// A sentence naming the sources that exclude each other.
    pub fn check(&self) -> Result<(), String> {
        let env: Vec<&str> = [(self.env_file.is_some(), "env_file"), (self.pid.is_some(), "pid"), (self.nccl_log.is_some(), "nccl_log")]
            .into_iter()
            .filter_map(|(given, name)| given.then_some(name))
            .collect();
        if env.len() > 1 {
            return Err(format!("{} given together: give at most one, each is the whole job environment", env.join(" and ")));
        }
        let root_given = !(self.root.as_os_str().is_empty() || self.root == Path::new("/"));
        if self.from.is_some() && (root_given || self.answers.is_some()) {
            return Err("a capture (from) stands for the machine: not with a root or answers".into());
        }
        // A capture's environment is read from the capture (or a file or
        // log laid over it); a process of this machine is not part of it,
        // and judging without reading it would fail open.
        if self.from.is_some() && self.pid.is_some() {
            return Err("a capture (from) is judged in its own environment (or an env file's or NCCL log's): a pid of this machine is not read with it".into());
        }
        Ok(())
    }
}

/// Judges this machine (or the one under `root`, or a capture), writing a
/// capture when asked.
///
/// # Errors
/// A sentence naming sources that exclude each other ([`Sources::check`]),
/// or what could not be read (a capture, an env file, a process, a log)
/// or written.
pub fn judge(s: &Sources, opts: &Options) -> Result<Report, String> {
    s.check()?;
    let (root, job, probes): (SysRoot, JobEnv, Box<dyn Probes>) = if let Some(from) = &s.from {
        captured(Capture::read(from).map_err(|e| e.to_string())?, s)?
    } else {
        if !s.root.join("proc").is_dir() && !s.root.join("sys").is_dir() {
            return Err(format!("{} has neither proc/ nor sys/: nothing to examine", s.root.display()));
        }
        let probes: Box<dyn Probes> = match &s.answers {
            Some(a) => Box::new(Answers::read(a).map_err(|e| e.to_string())?),
            None => Box::new(LiveProbes),
        };
        let job = match &s.nccl_log {
            Some(log) => job_from_log(log)?,
            None => job_env(&s.root, s.env_file.as_deref(), s.pid)?,
        };
        (SysRoot::at(&s.root), job, probes)
    };
    let Some(out) = &s.capture else {
        return Ok(report::run(&Machine { root, job }, probes.as_ref(), opts));
    };
    let (report, capture) = recording(root, job, probes.as_ref(), opts);
    capture.write(out).map_err(|e| e.to_string())?;
    eprintln!(
        "gpudirect doctor: wrote {} ({} files, the verbs' and CUDA's answers, {} variables); judge it anywhere with --from",
        out.display(),
        capture.files.len(),
        capture.env.vars.len()
    );
    Ok(report)
}

/// Judges this machine in this process's environment, recording what was
/// read: the report and its capture, in memory (what `fleet post` sends).
///
/// # Errors
/// As [`judge`].
pub fn judge_this_machine_recording(opts: &Options) -> Result<(Report, Capture), String> {
    let s = Sources::this_machine();
    let job = job_env(&s.root, None, None)?;
    Ok(recording(SysRoot::at(&s.root), job, &LiveProbes, opts))
}

/// Runs the judge over a recording root and probes.
fn recording(root: SysRoot, job: JobEnv, probes: &dyn Probes, opts: &Options) -> (Report, Capture) {
    let recorder = Recorder::new(probes);
    let machine = Machine { root: root.recording(), job };
    let report = report::run(&machine, &recorder, opts);
    let capture = recorder.capture(&machine.root, &machine.job);
    (report, capture)
}

/// Judges a capture already read, in its own captured environment (what
/// `--from` does without a shell, an env file or a log over it).
///
/// # Errors
/// A capture whose tree is refused.
pub fn judge_capture(c: Capture, opts: &Options) -> Result<Report, String> {
    let (root, job, probes) = captured(c, &Sources::default())?;
    Ok(report::run(&Machine { root, job }, probes.as_ref(), opts))
}

/// What a capture is judged from: its tree in memory (read as it would
/// read unpacked on disk), the job environment `s` asks for, its answers.
fn captured(c: Capture, s: &Sources) -> Result<(SysRoot, JobEnv, Box<dyn Probes>), String> {
    let tree = c.tree().map_err(|e| e.to_string())?;
    let job = match (&s.nccl_log, &s.env_file) {
        (Some(log), _) => job_from_log(log)?,
        // The capture's own configuration files, never this machine's
        // nor a path the capture's tree leads to.
        (None, Some(f)) => jobenv::over_captured_files(read_env_file(f)?.0, &c.env.conf_files),
        (None, None) if s.shell_over_capture => over_capture(c.env, std::env::vars()),
        (None, None) => c.env,
    };
    Ok((SysRoot::in_memory(tree), job, Box::new(c.answers)))
}

/// The variables an NCCL log shows NCCL read.
fn job_from_log(log: &std::path::Path) -> Result<JobEnv, String> {
    let f = input::open_regular(log, "NCCL log", "").map_err(|e| e.to_string())?;
    let report = crate::nccl_log::explain_reader(std::io::BufReader::new(f)).map_err(|e| format!("cannot read the NCCL log {}: {e}", log.display()))?;
    if report.environment.is_empty() {
        return Err(format!(
            "{} has no \"set by environment to\" line: NCCL prints them with NCCL_DEBUG=INFO for the variables it read; judge the job's script with --env-file instead",
            log.display()
        ));
    }
    Ok(jobenv::from_nccl_log(&report.environment, &log.display().to_string()))
}

/// The captured environment with this shell's NCCL_ and UCX_ variables
/// laid over it: what a support engineer tries against a customer's
/// capture (`NCCL_IB_DISABLE=1 gpudirect doctor --from c.json`).
fn over_capture(mut env: JobEnv, own: impl Iterator<Item = (String, String)>) -> JobEnv {
    for (k, v) in own.filter(|(k, _)| jobenv::judged(k)) {
        env.origins.push((k.clone(), "this shell, over the capture".to_owned()));
        env.vars.push((k, v));
    }
    env
}

/// The job's environment as NCCL will see it: the variables of the env
/// file, of process `pid`, or of this process, then NCCL's configuration
/// files (under `root`).
fn job_env(root: &std::path::Path, env_file: Option<&std::path::Path>, pid: Option<u32>) -> Result<JobEnv, String> {
    let (process, home) = match (env_file, pid) {
        (Some(f), _) => read_env_file(f)?,
        (None, Some(pid)) => {
            let path = root.join(format!("proc/{pid}/environ"));
            let bytes = input::read_bounded(&path, "environment of the process", input::SCRIPT_LIMIT)
                .map_err(|e| format!("{e}: is process {pid} running, and yours (or are you root)?"))?;
            let vars = jobenv::parse_environ(&bytes);
            let home = home_of(&vars);
            (jobenv::from_process(vars, &format!("process {pid}")), home)
        }
        (None, None) => {
            let vars: Vec<(String, String)> = std::env::vars().collect();
            let home = home_of(&vars);
            (jobenv::from_process(vars, "the environment"), home)
        }
    };
    let home = home.or_else(|| std::env::var_os("HOME").map(PathBuf::from));
    Ok(jobenv::resolve(process, &SysRoot::at(root), home.as_deref()))
}

fn home_of(vars: &[(String, String)]) -> Option<PathBuf> {
    vars.iter().rev().find(|(k, _)| k == "HOME").map(|(_, v)| PathBuf::from(v))
}

/// What an env file or job script sets, and the `HOME` it settles.
fn read_env_file(f: &std::path::Path) -> Result<(JobEnv, Option<PathBuf>), String> {
    let text = input::read_text(f, "env file", input::SCRIPT_LIMIT).map_err(|e| e.to_string())?;
    let file = super::jobfile::read(&text);
    let home = match file.last("HOME").and_then(|a| a.value.clone()) {
        Some(super::jobfile::Value::Known(h)) => Some(PathBuf::from(h)),
        _ => None,
    };
    Ok((jobenv::from_job_file(&file, &f.display().to_string()), home))
}
