//! Job files read as the shell or the launcher reading them would: shell
//! scripts and env files, Dockerfiles, Compose and Kubernetes YAML,
//! Python and TOML, and the launchers' own flags inside them (`mpirun -x`,
//! `-genv`, `srun --export`, `docker -e`, `env`, `sh -c`).
//!
//! Nothing is run. Each assignment says where it came from (line and
//! form). A value is expanded from what the file set before it; what only
//! the running job settles (a variable the file does not set, a command's
//! output, a branch that may not run, a Kubernetes `valueFrom`) is an
//! [`Value::Unknown`] with the reason, never read as literal text.

mod forms;
mod shell;

use shell::{Seg, Word};

/// A value as the file leaves it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// Settled by the file alone.
    Known(String),
    /// Only the running job settles it.
    Unknown {
        /// The value as written.
        text: String,
        /// Why the file cannot settle it, and what would.
        why: String,
    },
}

/// How an assignment was written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Form {
    /// `NAME=value` on its own.
    Shell,
    /// `export NAME=value` (or `declare -x`, `readonly`, `local`).
    Export,
    /// `NAME=value command`: for that command only.
    CommandPrefix,
    /// `env NAME=value command`.
    Env,
    /// `unset NAME` or `env -u NAME`.
    Unset,
    /// `ENV NAME=value` or `ENV NAME value` (Dockerfile).
    DockerEnv,
    /// `ARG NAME=value` (Dockerfile; `--build-arg` may replace it).
    DockerArg,
    /// `- NAME=value` (a YAML list: Compose `environment:`).
    YamlList,
    /// `NAME: value` (a YAML map: Compose `environment:`).
    YamlMap,
    /// `- name: NAME` then `value: ...` (Kubernetes `env:`).
    KubernetesEnv,
    /// `mpirun -x NAME=value` (Open MPI).
    MpirunX,
    /// `mpirun -genv NAME value` or `-env NAME value` (MPICH, Intel MPI).
    MpirunGenv,
    /// `srun --export=...,NAME=value`.
    SrunExport,
    /// `docker run -e NAME=value` or `--env` (podman, apptainer too).
    ContainerEnv,
    /// `NAME = "value"` (TOML, Python).
    Spaced,
    /// `os.environ["NAME"] = "value"` (Python).
    PythonEnviron,
    /// `"NAME": "value"` (a dict or JSON object: Ray's `env_vars`).
    DictEntry,
}

impl Form {
    /// How the form is shown in an origin.
    pub fn shown(self) -> &'static str {
        match self {
            Form::Shell => "NAME=value",
            Form::Export => "export",
            Form::CommandPrefix => "a command's NAME=value prefix",
            Form::Env => "env NAME=value",
            Form::Unset => "unset",
            Form::DockerEnv => "Dockerfile ENV",
            Form::DockerArg => "Dockerfile ARG",
            Form::YamlList => "YAML list entry",
            Form::YamlMap => "YAML map entry",
            Form::KubernetesEnv => "Kubernetes env entry",
            Form::MpirunX => "mpirun -x",
            Form::MpirunGenv => "mpirun -genv",
            Form::SrunExport => "srun --export",
            Form::ContainerEnv => "container -e/--env",
            Form::Spaced => "NAME = value",
            Form::PythonEnviron => "os.environ",
            Form::DictEntry => "\"NAME\": value entry",
        }
    }
}

/// One assignment (or `unset`) found in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    /// The variable.
    pub name: String,
    /// Its value; `None` for `unset`.
    pub value: Option<Value>,
    /// Its line, 1-based.
    pub line: usize,
    /// How it was written.
    pub form: Form,
}

/// What a job file sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFile {
    /// Every assignment, of every name, in the order the file makes them.
    pub assignments: Vec<Assignment>,
    /// What the reading could not follow (`source`d files).
    pub notes: Vec<String>,
    /// A script run as a program (it starts with `#!`): its plain
    /// `NAME=value` lines reach its commands only when exported.
    pub script: bool,
    /// `set -a` (or `set -o allexport`): every assignment is exported.
    pub allexport: bool,
    /// Names `export`ed (or `declare -x`) anywhere in the file.
    pub exported: Vec<String>,
}

impl JobFile {
    /// The last assignment of `name`.
    pub fn last(&self, name: &str) -> Option<&Assignment> {
        self.assignments.iter().rev().find(|a| a.name == name)
    }

    fn set(&mut self, name: String, value: Option<Value>, line: usize, form: Form) {
        self.assignments.push(Assignment { name, value, line, form });
    }
}

/// Whether a variable belongs to the families the doctor judges (`NCCL_*`,
/// `UCX_*`); a job file's other names are kept only to expand later values.
pub fn judged(name: &str) -> bool {
    name.starts_with("NCCL_") || name.starts_with("UCX_")
}

/// Reads `text`, a job file of any of the forms above.
pub fn read(text: &str) -> JobFile {
    let mut f = JobFile::default();
    match forms::dialect(text) {
        forms::Dialect::Shell => forms::shell_script(&mut f, text, 1, None),
        forms::Dialect::Dockerfile => forms::dockerfile(&mut f, text),
        forms::Dialect::Yaml => forms::yaml(&mut f, text),
        forms::Dialect::Python => forms::python(&mut f, text),
    }
    f.script = text.starts_with("#!");
    f
}

impl Assignment {
    /// Whether the job's commands see this assignment: a plain
    /// `NAME=value` in a script reaches them only when the name is
    /// exported; a Dockerfile `ARG` never reaches the container.
    pub fn reaches_the_job(&self, f: &JobFile) -> bool {
        match self.form {
            Form::DockerArg => false,
            Form::Shell => !f.script || f.allexport || f.exported.contains(&self.name),
            _ => true,
        }
    }
}

/// Why a command substitution is unsettled.
const COMMAND_WHY: &str = "is the output of a command, which only running it settles";

/// What a word expands to with what `f` set before it.
fn expand(word: &Word, f: &JobFile) -> Value {
    match expand_segs(&word.segs, f) {
        Ok(s) => Value::Known(s),
        Err(why) => Value::Unknown { text: word.raw.clone(), why },
    }
}

fn expand_segs(segs: &[Seg], f: &JobFile) -> Result<String, String> {
    let mut out = String::new();
    for seg in segs {
        match seg {
            Seg::Lit { text, .. } => out.push_str(text),
            Seg::Command(c) => return Err(format!("`$({})` {COMMAND_WHY}", c.trim())),
            Seg::Other(o) => return Err(format!("`{o}` is expanded when the job runs")),
            Seg::Param { name, op } => {
                let set = f.last(name).map(|a| (a.value.clone(), a.line));
                let operand = || op.as_ref().map(|(_, s)| expand_segs(s, f));
                match (set, op.as_ref().map(|(o, _)| o.as_str())) {
                    (Some((Some(Value::Known(v)), _)), None) => out.push_str(&v),
                    (Some((Some(Value::Known(v)), _)), Some(o)) => {
                        let empty_unset = o.starts_with(':') && v.is_empty();
                        match o.trim_start_matches(':') {
                            "-" | "=" if empty_unset => out.push_str(&operand().unwrap_or(Ok(String::new()))?),
                            "+" if !empty_unset => out.push_str(&operand().unwrap_or(Ok(String::new()))?),
                            "+" => {}
                            _ => out.push_str(&v),
                        }
                    }
                    // Unset earlier in the file: the default applies, or nothing.
                    (Some((None, _)), None | Some(":-" | "-" | ":=" | "=")) => {
                        out.push_str(&operand().unwrap_or(Ok(String::new()))?);
                    }
                    (Some((None, _)), _) => {}
                    (Some((Some(Value::Unknown { .. }), line)), _) => {
                        return Err(format!("`${name}` is set on line {line} to a value the file cannot settle"));
                    }
                    (None, o) => {
                        let default = match (o, operand()) {
                            (Some(":-" | "-" | ":=" | "="), Some(Ok(d))) => format!(", and is {d:?} where it does not"),
                            _ => String::new(),
                        };
                        return Err(format!(
                            "`${name}` is not set in this file: the environment the job starts in sets it{default}"
                        ));
                    }
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
