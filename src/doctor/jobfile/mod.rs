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
mod script;
mod seen;
mod shell;

use shell::{Seg, Word};

pub use seen::Seen;
pub(crate) use super::shown;
pub use shell::MAX_NESTING;

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

/// The command taken as the job's launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    /// Its line.
    pub line: usize,
    /// The launcher it runs (`torchrun`, `srun`, a function that does).
    pub command: String,
    /// Why it may not run (inside an `if`...), when it may not.
    pub uncertain: Option<String>,
}

/// What a job file sets.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobFile {
    /// Every assignment of the judged names (and `LD_LIBRARY_PATH`), in
    /// the order the file makes them, whether or not it reaches the job;
    /// of other names, kept only to expand later values, the last.
    pub assignments: Vec<Assignment>,
    /// The job's environment as the file leaves it: `(index into
    /// assignments, whether the launched job sees it)`, in file order,
    /// one per name. A script's is what its launch sees.
    pub env: Vec<(usize, bool)>,
    /// The launch, when the file runs one.
    pub launch: Option<Launch>,
    /// Assignments that do not reach the launch, and why (a command's
    /// prefix, after the launch, refused as read-only).
    pub scope_notes: Vec<String>,
    /// `NCCL_*`/`UCX_*` names the file names that the reading did not
    /// take into a value or account for otherwise.
    pub seen: Vec<Seen>,
    /// The first line where nesting went deeper than the reading follows.
    pub too_deep: Option<usize>,
    /// The line of the unconditional `exit` or `exec` after which nothing
    /// runs.
    pub stopped_at: Option<usize>,
    /// Names printed by `echo`/`printf`, with their lines: text, not
    /// settings.
    pub printed: Vec<(String, usize)>,
    /// Where the shell's comments start: `(line, column in characters)`.
    pub comments: Vec<(usize, usize)>,
    /// For an unsettled value set in branches, the values it may have
    /// (`None`: unset), by assignment index, where they can be listed.
    pub alternatives: std::collections::HashMap<usize, Vec<Option<String>>>,
    /// What the reading could not follow (`source`d files).
    pub notes: Vec<String>,
    /// A script run as a program (it starts with `#!`): its plain
    /// `NAME=value` lines reach its commands only when exported.
    pub script: bool,
}

impl JobFile {
    /// The last assignment of `name` in the file, wherever it is.
    pub fn last(&self, name: &str) -> Option<&Assignment> {
        self.assignments.iter().rev().find(|a| a.name == name)
    }

    /// `name` as the job sees it: its assignment, and whether it reaches
    /// the launched job.
    pub fn job(&self, name: &str) -> Option<(&Assignment, bool)> {
        self.env.iter().map(|(i, r)| (&self.assignments[*i], *r)).find(|(a, _)| a.name == name)
    }

    /// The job's environment in file order, each with whether it reaches
    /// the launched job.
    pub fn job_env(&self) -> impl Iterator<Item = (&Assignment, bool)> {
        self.env.iter().map(|(i, r)| (&self.assignments[*i], *r))
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

/// Reads `text`, a job file of any of the forms above. Time and memory
/// are linear in the text.
pub fn read(text: &str) -> JobFile {
    let mut r = script::Reader::default();
    r.f.script = text.starts_with("#!");
    let shebang = text.lines().next().unwrap_or_default();
    r.posix = ["/sh", "/dash", "/ash", " sh", " dash"].iter().any(|s| shebang.starts_with("#!") && shebang.trim_end().ends_with(s));
    // Functions called again and scripts read again cost at most this.
    r.budget = 4 * text.len() + (64 << 10);
    let dialect = forms::dialect(text);
    match dialect {
        forms::Dialect::Shell => forms::shell_script(&mut r, text),
        forms::Dialect::Dockerfile => forms::dockerfile(&mut r, text),
        forms::Dialect::Yaml => forms::yaml(&mut r, text),
        forms::Dialect::Python => forms::python(&mut r, text),
    }
    let mut f = r.finish(dialect == forms::Dialect::Shell);
    f.seen = seen::unaccounted(text, &f, dialect == forms::Dialect::Shell);
    f
}

/// The longest value a file's expansions may build: `A=$A$A` repeated
/// doubles a value each line, and a Kubernetes `$(NAME)` chain grows it
/// each entry. Past it the value is unsettled, not built.
pub const MAX_VALUE: usize = 64 << 10;

/// Why a command substitution is unsettled.
const COMMAND_WHY: &str = "is the output of a command, which only running it settles";

/// How a value is looked up: `(value, line)` of the name's assignment as
/// the shell has it now, `None` when the file has not set it.
type Lookup<'a> = dyn Fn(&str) -> Option<(Option<Value>, usize)> + 'a;

/// What a word expands to with what was set before it.
fn expand(word: &Word, f: &Lookup<'_>) -> Value {
    match expand_segs(&word.segs, f) {
        Ok(s) => Value::Known(s),
        Err(why) => Value::Unknown { text: word.raw.clone(), why },
    }
}

fn expand_segs(segs: &[Seg], f: &Lookup<'_>) -> Result<String, String> {
    let mut out = String::new();
    for seg in segs {
        if out.len() > MAX_VALUE {
            return Err(format!("expands to more than {MAX_VALUE} bytes"));
        }
        match seg {
            Seg::Lit { text, .. } => out.push_str(text),
            Seg::Command(c) => return Err(format!("`$({})` {COMMAND_WHY}", c.preview(80).trim())),
            Seg::Other(o) => return Err(format!("`{o}` is expanded when the job runs")),
            Seg::Param { name, op } => {
                let set = f(name);
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
    if out.len() > MAX_VALUE {
        return Err(format!("expands to more than {MAX_VALUE} bytes"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod scoping_tests;

#[cfg(test)]
mod attack_tests;
#[cfg(test)] mod attack2_tests;
