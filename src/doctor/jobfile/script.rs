//! A shell script read as the shell runs it, far enough to know what the
//! job's launch sees: one table of the shell's variables (each the index
//! of its last assignment, exported or not, read-only or not), scopes
//! that end as the shell's do, and the launch.
//!
//! What the shell never hands the launched job is not the job's value: a
//! `NAME=v cmd` prefix or `env NAME=v cmd` is for that command only; a
//! `( ... )` subshell, a `$( ... )` body, a pipeline's element and a child
//! shell (`bash -c`, a here-document fed to `bash`) change nothing after
//! them; a read-only variable keeps its value; nothing after an
//! unconditional `exit` or `exec` runs; and what comes after the launch
//! does not reach it. The launch is the last command that runs a known
//! launcher (or a function that does); without one, the end of the file.
//!
//! Every change goes through [`Reader::put`] with an undo log, so leaving
//! a scope costs what the scope changed, and the launch's environment is
//! kept up to date from the names changed since the last launch: the
//! reading is linear in the file.

use std::collections::{HashMap, HashSet};

mod builtins;
mod commands;

use super::shell::{Lexer, Sep, Span, Tok, Word, MAX_NESTING};
use super::{expand, judged, Form, JobFile, Launch, Value};
use gpudirect::nccl::DECIDING;

/// [`Var::idx`] of a name declared (`export NAME`, `readonly NAME`)
/// before any value: marked, not set.
const DECLARED: usize = usize::MAX;

/// A shell variable: its last assignment and how it is marked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Var {
    /// Index into [`JobFile::assignments`], or [`DECLARED`].
    pub idx: usize,
    pub exported: bool,
    /// Read-only in this process (the mark is not passed to a child
    /// process; a subshell keeps it).
    pub readonly: Option<usize>,
    /// The scope it was set in: 0 for the file's own level.
    pub depth: usize,
}

/// Names whose value at the launch is kept: the judged ones and where
/// NCCL looks for its plugin.
fn tracked(name: &str) -> bool {
    judged(name) || name == "LD_LIBRARY_PATH"
}

/// Most bytes of values the reading builds in all.
const MAX_BUILT: usize = 16 << 20;

/// Most values a variable set in branches is followed with.
const MAX_ALTERNATIVES: usize = 8;

/// Most notes on assignments that do not reach the launch.
const MAX_NOTES: usize = 64;

/// What a launch sees of one deciding variable: its assignment and
/// whether it is exported (`None`: not set).
type Seen = Option<(usize, bool)>;

/// A command's own assignment: name, value (`None`: unset), line, form.
type Scoped = (String, Option<Value>, usize, Form);

/// Builtins whose changes stay in the script's shell.
const PERSISTENT: [&str; 19] = [
    "export", "declare", "typeset", "readonly", "local", "unset", "set", "source", ".", "exit", "eval", "shopt", "read", "mapfile", "readarray", "getopts",
    ":", "true", "let",
];

/// POSIX's special builtins: in POSIX mode their prefixes stay.
const SPECIAL: [&str; 15] = [":", ".", "break", "continue", "eval", "exec", "exit", "export", "readonly", "return", "set", "shift", "times", "trap", "unset"];

/// Where a command stands among its neighbours.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    /// Why none of it may run (a child's, or after `&&`/`||`).
    outer: Option<&'a str>,
    /// After `&&`/`||`, or in a pipeline.
    conditional: bool,
    /// Its input is a pipe.
    piped_in: bool,
    /// Its output goes to a pipe or a file.
    piped_out: bool,
}

/// The state of one reading.
#[derive(Default)]
pub(super) struct Reader {
    pub f: JobFile,
    vars: HashMap<String, Var>,
    undo: Vec<(String, Option<Var>)>,
    /// The process reading now (a child shell is another), and how many
    /// have been.
    proc: usize,
    procs: usize,
    /// Assignments now are a program's (`env`, a launcher's flags), not
    /// the shell's: read-only does not stop them.
    external: bool,
    /// Scopes open (marks not yet rolled back).
    open: usize,
    /// Bytes of values built so far.
    built: usize,
    pub depth: usize,
    /// The tracked variables as the last launch saw them.
    launch_env: HashMap<String, Var>,
    dirty: HashSet<String>,
    allexport: bool,
    /// Inside `$( )`: what runs there is not the job.
    captured: usize,
    /// The tracked names each function's body sets.
    functions: HashMap<String, std::rc::Rc<[String]>>,
    /// Functions whose body runs a launcher.
    launching: HashSet<String>,
    /// The last launch that certainly runs: its line and the deciding
    /// variables' assignments it saw.
    certain: Option<(usize, Vec<Seen>)>,
    /// Deciding variables whose value differs between the last certain
    /// launch and a later uncertain one: (certain line, uncertain line, why).
    diverged: std::collections::BTreeMap<String, (usize, usize, String)>,
    /// Assignments made by [`Reader::opaque`].
    opaque_made: HashSet<usize>,
    /// The file's text as the lexer reads it.
    file_text: Option<std::rc::Rc<[char]>>,
    /// `shopt -s lastpipe`: a pipeline's last element runs in this shell.
    lastpipe: bool,
    /// POSIX mode (`sh`, `set -o posix`): a special builtin's prefixes stay.
    pub posix: bool,
    /// `set -e`: a command that fails ends the script.
    errexit: bool,
    /// Names given `declare -i`/`-l`/`-u`: a value assigned to them is
    /// transformed, so never taken as written (kept for the whole file).
    transformed: HashSet<String>,
    /// What calls of functions and re-read scripts may still cost, in
    /// assignments and characters: past it, they are opaque.
    pub budget: usize,
}

/// A block that may not run, or a scope.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Block {
    If,
    Case,
    Loop,
    /// A function's body, with the undo mark of its definition (it sets
    /// nothing where it is defined) and whether a `)` ends it (`f() ( ... )`).
    Function(String, usize, bool),
    /// `{ ... }`, with why it may not run (after `&&`/`||`).
    Group(Option<&'static str>),
    /// `( ... )`: its undo mark.
    Subshell(usize),
}

/// The open blocks, each with what holds inside it, so that each
/// question costs the same at any depth: why a command there may not run,
/// how many subshells are open, the innermost function.
#[derive(Default)]
struct Blocks {
    v: Vec<(Block, Option<&'static str>, usize, Option<usize>)>,
}

impl Blocks {
    fn push(&mut self, b: Block) {
        let (why, subshells, function) = self.v.last().map_or((None, 0, None), |(_, w, s, f)| (*w, *s, *f));
        let entry = (
            b.why().or(why),
            subshells + usize::from(matches!(b, Block::Subshell(_) | Block::Function(_, _, true))),
            if matches!(b, Block::Function(..)) { Some(self.v.len()) } else { function },
        );
        self.v.push((b, entry.0, entry.1, entry.2));
    }

    fn pop(&mut self) -> Option<Block> {
        self.v.pop().map(|e| e.0)
    }

    fn last(&self) -> Option<&Block> {
        self.v.last().map(|e| &e.0)
    }

    /// Why a command here may not run.
    fn why(&self) -> Option<&'static str> {
        self.v.last().and_then(|e| e.1)
    }

    fn in_subshell(&self) -> bool {
        self.v.last().is_some_and(|e| e.2 > 0)
    }

    /// Whether a `)` has something to close.
    fn open_parens(&self) -> bool {
        self.in_subshell()
    }

    /// The function whose body this is.
    fn function(&self) -> Option<&str> {
        match &self.v[self.v.last()?.3?].0 {
            Block::Function(name, _, _) => Some(name),
            _ => None,
        }
    }
}

impl Block {
    fn why(&self) -> Option<&'static str> {
        match self {
            Block::If => Some("inside an `if`, which runs only when its condition holds"),
            Block::Case => Some("inside a `case` branch"),
            Block::Loop => Some("inside a loop"),
            Block::Function(..) => Some("inside a function, which sets it only when called"),
            Block::Group(why) => *why,
            Block::Subshell(_) => None,
        }
    }
}

/// Programs that start the job (`python3.11` too).
const LAUNCHERS: [&str; 22] = [
    "torchrun", "python", "python3", "srun", "mpirun", "mpiexec", "mpiexec.hydra", "orterun", "deepspeed", "accelerate", "ray", "horovodrun", "jsrun",
    "aprun", "flux", "docker", "podman", "apptainer", "singularity", "enroot", "composer", "vllm",
];

/// Programs that run the command after their own options.
const WRAPPERS: [&str; 10] = ["nohup", "time", "sudo", "numactl", "taskset", "stdbuf", "nice", "timeout", "ionice", "command"];

pub(super) const SHELLS: [&str; 5] = ["sh", "bash", "zsh", "dash", "ksh"];

fn base(w: &Word) -> String {
    lit(w).rsplit('/').next().unwrap_or_default().to_owned()
}

fn lit(w: &Word) -> String {
    w.literal().unwrap_or_default()
}

fn is_launcher(name: &str) -> bool {
    LAUNCHERS.contains(&name) || name.strip_prefix("python").is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.'))
}

/// The launcher `words` run, when they run one.
fn launcher_in(words: &[Word]) -> Option<String> {
    let first = base(words.first()?);
    if is_launcher(&first) {
        return Some(first);
    }
    if WRAPPERS.contains(&first.as_str()) {
        return words[1..].iter().map(base).find(|b| is_launcher(b));
    }
    None
}

impl Reader {
    /// A value as the shell has it now: `(value, line)`, `None` when the
    /// file has not set the name.
    pub fn get(&self, name: &str) -> Option<(Option<Value>, usize)> {
        let v = self.vars.get(name).filter(|v| v.idx != DECLARED)?;
        let a = &self.f.assignments[v.idx];
        Some((a.value.clone(), a.line))
    }

    /// What `word` expands to now.
    pub fn expand(&self, word: &Word) -> Value {
        expand(word, &|n| self.get(n))
    }

    fn put(&mut self, name: &str, var: Option<Var>) {
        let old = match var {
            Some(v) => self.vars.insert(name.to_owned(), v),
            None => self.vars.remove(name),
        };
        // With no scope open, nothing will be undone.
        if self.open > 0 {
            self.undo.push((name.to_owned(), old));
        }
        if tracked(name) {
            self.dirty.insert(name.to_owned());
        }
    }

    /// Opens a scope: what changes after it can be undone.
    fn mark(&mut self) -> usize {
        self.open += 1;
        self.undo.len()
    }

    /// Undoes every change since `mark`, and closes its scope.
    fn rollback(&mut self, mark: usize) {
        self.open = self.open.saturating_sub(1);
        while self.undo.len() > mark {
            let Some((name, old)) = self.undo.pop() else { break };
            match old {
                Some(v) => self.vars.insert(name.clone(), v),
                None => self.vars.remove(&name),
            };
            if tracked(&name) {
                self.dirty.insert(name);
            }
        }
    }

    fn note(&mut self, n: String) {
        if self.f.scope_notes.len() < MAX_NOTES {
            self.f.scope_notes.push(n);
        }
    }

    /// Records an assignment (`cond`: why it may not run) and sets the
    /// variable, unless it is read-only.
    pub fn assign(&mut self, name: String, value: Value, line: usize, form: Form, cond: Option<&str>) {
        let mut alternatives = None;
        let value = match (value, cond) {
            (Value::Known(v), Some(why)) => {
                let same = self.get(&name).is_some_and(|(a, _)| a == Some(Value::Known(v.clone())));
                if same {
                    Value::Known(v)
                } else {
                    // The value the branch sets, or the one before it.
                    alternatives = self.alternatives_of(&name).map(|mut a| {
                        a.push(Some(v.clone()));
                        a
                    });
                    Value::Unknown { text: v, why: format!("set on line {line} {why}, so only the running job settles it") }
                }
            }
            (v, _) => v,
        };
        self.record(name.clone(), Some(value), line, form);
        self.keep_alternatives(&name, alternatives);
    }

    /// The values `name` may have here, where they can be listed (`None`:
    /// unset): a known value, or an unsettled one's alternatives.
    fn alternatives_of(&self, name: &str) -> Option<Vec<Option<String>>> {
        let Some(v) = self.vars.get(name).filter(|v| v.idx != DECLARED) else { return Some(vec![None]) };
        match &self.f.assignments[v.idx].value {
            None => Some(vec![None]),
            Some(Value::Known(k)) => Some(vec![Some(k.clone())]),
            Some(Value::Unknown { .. }) => self.f.alternatives.get(&v.idx).cloned(),
        }
    }

    /// Records `alternatives` for `name`'s assignment just made (when it
    /// was not refused), at most [`MAX_ALTERNATIVES`] of them.
    fn keep_alternatives(&mut self, name: &str, alternatives: Option<Vec<Option<String>>>) {
        let Some(mut a) = alternatives else { return };
        let last = self.f.assignments.len().checked_sub(1);
        if self.vars.get(name).map(|v| v.idx) != last {
            return;
        }
        a.dedup();
        let mut seen = Vec::new();
        a.retain(|x| !seen.contains(x) && {
            seen.push(x.clone());
            true
        });
        if a.len() <= MAX_ALTERNATIVES {
            if let Some(idx) = last {
                self.f.alternatives.insert(idx, a);
            }
        }
    }

    fn record(&mut self, name: String, value: Option<Value>, line: usize, form: Form) {
        // What expansions build is bounded in all, not only per value: a
        // chain of `$(NAME)x` entries grows each by one.
        let value = match value {
            Some(Value::Known(v)) if self.built + v.len() > MAX_BUILT => {
                let why = format!("the file's values come to more than {MAX_BUILT} bytes in all by here: not built");
                Some(Value::Unknown { text: v.chars().take(super::shell::RAW_LIMIT).collect(), why })
            }
            Some(Value::Known(v)) => {
                self.built += v.len();
                Some(Value::Known(v))
            }
            other => other,
        };
        let value = match value {
            Some(Value::Known(v)) if self.transformed.contains(&name) => {
                Some(Value::Unknown { text: v, why: format!("{name} has an integer or case attribute (declare -i/-l/-u): what is assigned is transformed") })
            }
            v => v,
        };
        let old = self.vars.get(&name).copied();
        let unsettled = matches!(value, Some(Value::Unknown { .. }));
        // Another name's history is not kept (it only expands later
        // values): with nothing to undo, its slot is reused, so a file of
        // many assignments holds one per name.
        let reuse = old.filter(|o| !tracked(&name) && self.open == 0 && o.idx != DECLARED && o.readonly != Some(self.proc));
        let idx = match reuse {
            Some(o) => {
                self.f.assignments[o.idx] = super::Assignment { name: name.clone(), value, line, form };
                o.idx
            }
            None => {
                self.f.set(name.clone(), value, line, form);
                self.f.assignments.len() - 1
            }
        };
        if let Some(o) = old.filter(|o| o.readonly == Some(self.proc) && !self.external) {
            if judged(&name) {
                let since = self.f.assignments.get(o.idx).map_or_else(|| "before".to_owned(), |a| format!("since line {}", a.line));
                self.note(format!("line {line}: {name} is read-only {since}: the shell refuses this assignment, the value stays"));
            }
            return;
        }
        // `unset` takes the export mark away with the value.
        let exported = match form {
            Form::Shell | Form::Spaced => self.allexport || old.is_some_and(|o| o.exported),
            // An `unset` that may not run keeps the mark it may not take.
            Form::Unset => unsettled && old.is_some_and(|o| o.exported),
            Form::DockerArg => false,
            _ => true,
        };
        self.put(&name, Some(Var { idx, exported, readonly: None, depth: self.depth }));
    }

    pub fn unset(&mut self, name: String, line: usize, cond: Option<&str>) {
        match cond {
            None => self.record(name, None, line, Form::Unset),
            Some(why) => {
                let why = format!("unset on line {line} {why}, so only the running job settles it");
                let alternatives = self.alternatives_of(&name).map(|mut a| {
                    a.push(None);
                    a
                });
                self.record(name.clone(), Some(Value::Unknown { text: "(unset)".into(), why }), line, Form::Unset);
                self.keep_alternatives(&name, alternatives);
            }
        }
    }

    fn flag(&mut self, name: &str, export: bool, readonly: bool) {
        if let Some(mut v) = self.vars.get(name).copied() {
            v.exported |= export;
            if readonly {
                v.readonly = Some(self.proc);
            }
            self.put(name, Some(v));
        } else {
            self.put(name, Some(Var { idx: DECLARED, exported: export, readonly: readonly.then_some(self.proc), depth: self.depth }));
        }
    }

    /// The command on `line` starts the job: the environment it sees now
    /// is the job's, unless a later launch replaces it.
    fn launch(&mut self, line: usize, what: &str, blocks: &Blocks, cond: Option<&str>) {
        if self.captured > 0 {
            return;
        }
        if let Some(name) = blocks.function() {
            self.launching.insert(name.to_owned());
            return;
        }
        for name in std::mem::take(&mut self.dirty) {
            match self.vars.get(&name) {
                Some(v) => self.launch_env.insert(name, *v),
                None => self.launch_env.remove(&name),
            };
        }
        // What each deciding variable is here and whether the launch sees it.
        let deciding: Vec<Seen> = DECIDING.iter().map(|n| self.vars.get(*n).map(|v| (v.idx, v.exported))).collect();
        match cond {
            // A launch that may not run, or may not be one: where it sees
            // other deciding values than the last certain launch, which
            // one is the job's is not known here.
            Some(why) => {
                if let Some((at, before)) = &self.certain {
                    for (k, n) in DECIDING.iter().enumerate() {
                        if before[k] != deciding[k] {
                            self.diverged.entry((*n).to_owned()).or_insert((*at, line, why.to_owned()));
                        }
                    }
                }
            }
            None => {
                self.certain = Some((line, deciding));
                self.diverged.clear();
            }
        }
        self.f.launch = Some(Launch { line, command: what.to_owned(), uncertain: cond.map(str::to_owned) });
    }

    /// A command that may set any variable in ways this reading does not
    /// follow (`eval`, `source`, a program named by a variable): every
    /// deciding variable is unsettled from here.
    fn opaque(&mut self, line: usize, what: &str) {
        for n in DECIDING {
            let is_opaque = self.vars.get(n).is_some_and(|v| self.opaque_made.contains(&v.idx));
            if !is_opaque {
                let why = format!("line {line} {what}, which this reading does not follow: it may set it");
                self.external = false;
                self.assign(n.to_owned(), Value::Unknown { text: format!("(after line {line})"), why }, line, Form::Export, None);
                if let Some(v) = self.vars.get(n) {
                    self.opaque_made.insert(v.idx);
                }
            }
        }
        self.note(format!("line {line}: {what}: what it sets is not read, so every deciding variable is left to the running job"));
    }

    /// Reads a child's script (`bash -c`, a here-document fed to a
    /// shell, a `$( )` body, a Dockerfile `RUN`): its changes end with it.
    pub fn child(&mut self, body: &Span, outer: Option<&str>, captured: bool) {
        // `$( )` is a subshell of this process; a here-document's shell
        // is a process of its own.
        self.nested(&mut body.lexer(), body.line, outer, captured, !captured);
    }

    /// Reads `text` as a child script; `captured`: what it runs is not
    /// the job (a build step).
    pub fn child_text(&mut self, text: &str, line: usize, outer: Option<&str>, captured: bool) {
        self.nested(&mut Lexer::new(text, line), line, outer, captured, true);
    }

    /// Reads what `lx` holds one scope further in (`own_process`: a
    /// process of its own, which read-only marks do not reach); its
    /// changes end with it.
    fn nested(&mut self, lx: &mut Lexer, line: usize, outer: Option<&str>, captured: bool, own_process: bool) {
        if self.too_deep(line) {
            return;
        }
        let mark = self.mark();
        self.depth += 1;
        self.captured += usize::from(captured);
        let proc = self.proc;
        if own_process {
            self.procs += 1;
            self.proc = self.procs;
        }
        self.run(lx, outer);
        self.proc = proc;
        self.captured -= usize::from(captured);
        self.depth -= 1;
        self.rollback(mark);
    }

    /// The end of a function's body: what it set is undone (it runs only
    /// when called) and remembered for its calls.
    fn define(&mut self, name: String, mark: usize) {
        let mut sets: Vec<String> = self.undo[mark.min(self.undo.len())..].iter().map(|(n, _)| n.clone()).filter(|n| tracked(n)).collect();
        sets.sort();
        sets.dedup();
        self.rollback(mark);
        self.functions.insert(name, sets.into());
    }

    /// Nothing after `line` runs.
    fn stop(&mut self, line: usize) {
        self.f.stopped_at = Some(line);
    }

    /// Whether a child one level further in is past [`MAX_NESTING`]
    /// (recorded: what it sets is then seen, not read).
    fn too_deep(&mut self, line: usize) -> bool {
        if self.depth + 1 >= MAX_NESTING {
            self.f.too_deep.get_or_insert(line);
            return true;
        }
        false
    }

    /// Reads shell text at the file's own level.
    pub fn top(&mut self, text: &str, first_line: usize) {
        let mut lx = Lexer::new(text, first_line);
        self.file_text = Some(lx.buffer());
        self.run(&mut lx, None);
    }

    /// Reads commands until the lexer ends; `outer` says why none of it
    /// may run.
    fn run(&mut self, lx: &mut Lexer, outer: Option<&str>) {
        let (mut words, mut blocks): (Vec<Word>, Blocks) = (Vec::new(), Blocks::default());
        let mut fn_pending: Option<String> = None;
        let (mut before, mut in_pipe) = (Sep::End, false);
        // Inside `NAME=( ... )`: array elements, not commands.
        let mut array = 0usize;
        loop {
            let tok = lx.next_tok();
            let sep = match tok {
                Some(Tok::Word(w)) => {
                    if array == 0 {
                        words.push(w);
                    }
                    continue;
                }
                Some(Tok::Sep(s)) => s,
                None => Sep::End,
            };
            if array > 0 {
                match sep {
                    Sep::Open => array += 1,
                    Sep::Close => array -= 1,
                    _ => {}
                }
                if tok.is_some() {
                    continue;
                }
            }
            match sep {
                // `NAME=(...)`, `declare -a NAME=(...)`: an array.
                Sep::Open if words.last().is_some_and(|w| w.raw.ends_with('=') && w.split_assignment_op(false).is_some()) => {
                    if let Some((name, _, _)) = words.last().and_then(|w| w.split_assignment_op(false)) {
                        let line = words.last().map_or(0, |w| w.line);
                        let why = format!("an array, set on line {line}: NCCL reads the environment's strings");
                        self.assign(name, Value::Unknown { text: "( ... )".into(), why }, line, Form::Shell, None);
                    }
                    words.pop();
                    array = 1;
                    continue;
                }
                Sep::Open if words.len() == 1 || (words.len() == 2 && lit(&words[0]) == "function") => {
                    fn_pending = words.pop().map(|w| lit(&w));
                    words.clear();
                    continue;
                }
                Sep::Close if words.is_empty() && fn_pending.is_some() && !matches!(blocks.last(), Some(Block::Subshell(_) | Block::Function(_, _, true))) => continue,
                // A `case` pattern's `)`: not a command; one-line `case`s too.
                Sep::Close if words.first().is_some_and(|w| lit(w) == "case") => {
                    blocks.push(Block::Case);
                    words.clear();
                    continue;
                }
                Sep::Close if matches!(blocks.last(), Some(Block::Case)) => {
                    words.clear();
                    continue;
                }
                _ => {}
            }
            let pipe = in_pipe || sep == Sep::Pipe;
            let or_why = match before {
                Sep::Or => Some("after `||`, which runs only when what precedes it fails"),
                Sep::And => Some("after `&&`, which runs only when what precedes it succeeds"),
                _ => None,
            };
            let bodies = lx.take_bodies();
            let redirected = lx.take_redirected();
            // Each element of a pipeline runs in a subshell (the last one
            // in this shell with `lastpipe`).
            let own = self.lastpipe && in_pipe && sep != Sep::Pipe;
            let mark = (pipe && !own).then(|| self.mark());
            let ctx = Ctx { outer: outer.or(or_why), conditional: or_why.is_some() || pipe, piped_in: in_pipe, piped_out: sep == Sep::Pipe || redirected };
            self.command(&words, &bodies, &mut blocks, &mut fn_pending, ctx);
            if let Some(m) = mark {
                self.rollback(m);
            }
            words.clear();
            in_pipe = sep == Sep::Pipe;
            match sep {
                Sep::Open => match fn_pending.take() {
                    // `f() ( ... )`: a function whose body is a subshell.
                    Some(name) => {
                        let mark = self.mark();
                        blocks.push(Block::Function(name, mark, true));
                    }
                    None => {
                        let mark = self.mark();
                        blocks.push(Block::Subshell(mark));
                    }
                },
                // Only a `)` that closes a subshell (or a function's
                // subshell body) ends one.
                Sep::Close if blocks.open_parens() => {
                    while let Some(b) = blocks.pop() {
                        match b {
                            Block::Subshell(m) => {
                                self.rollback(m);
                                break;
                            }
                            Block::Function(name, m, true) => {
                                self.define(name, m);
                                break;
                            }
                            _ => {}
                        }
                    }
                }
                _ => {}
            }
            before = sep;
            if tok.is_none() {
                if let Some(l) = lx.too_deep {
                    self.f.too_deep.get_or_insert(l);
                }
                // Comments in the file's own text (not in a string a child
                // shell is given) say what the file does not run.
                if self.file_text.as_ref().is_some_and(|t| lx.shares(t)) {
                    self.f.comments.extend(std::mem::take(&mut lx.comments));
                }
                return;
            }
        }
    }

    /// The job's environment: `(assignment index, reaches the job)` in
    /// file order. A shell script's is what its launch saw (the end of the
    /// file without one); another file's is its own entries, with what a
    /// script inside it set before its launch over them.
    pub fn finish(mut self, shell: bool) -> JobFile {
        let script = self.f.script;
        let launched = self.f.launch.is_some();
        let mut env: HashMap<String, Var> = if shell && launched {
            self.launch_env.clone()
        } else {
            self.vars.iter().filter(|(n, _)| tracked(n)).map(|(n, v)| (n.clone(), *v)).collect()
        };
        if !shell {
            env.extend(self.launch_env.iter().filter(|(_, v)| v.depth > 0).map(|(n, v)| (n.clone(), *v)));
        }
        if let Some(at) = self.f.launch.as_ref().filter(|_| shell).map(|l| l.line) {
            let mut after: Vec<(usize, String)> = Vec::new();
            for (n, v) in self.vars.iter().filter(|(_, v)| v.idx != DECLARED) {
                let a = &self.f.assignments[v.idx];
                if judged(n) && a.line > at && env.get(n).map(|e| e.idx) != Some(v.idx) {
                    after.push((a.line, n.clone()));
                }
            }
            after.sort();
            for (line, n) in after {
                self.note(format!("line {line}: {n} is set after the launch on line {at}: the job does not see it"));
            }
        }
        for (n, (certain, maybe, why)) in std::mem::take(&mut self.diverged) {
            let why = format!(
                "the launch on line {certain} and the one on line {maybe} ({why}) see different values, and which one starts the job only running it settles"
            );
            self.f.set(n.clone(), Some(Value::Unknown { text: "(either launch's)".into(), why }), maybe, Form::Shell);
            env.insert(n, Var { idx: self.f.assignments.len() - 1, exported: true, readonly: None, depth: 0 });
        }
        let reaches = |v: &Var| v.exported || (!script && self.f.assignments[v.idx].form != Form::DockerArg);
        let mut out: Vec<(usize, bool)> = env.values().filter(|v| v.idx != DECLARED).map(|v| (v.idx, reaches(v))).collect();
        out.sort_unstable();
        self.f.env = out;
        self.f
    }
}
