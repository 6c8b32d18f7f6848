//! One command as the shell runs it: block keywords, assignments and
//! their scope, the programs that set variables or start the job.

use super::super::shell::{is_name, Seg, Span, Word};
use super::super::{judged, Form, Value};
use super::{base, is_launcher, launcher_in, lit, Block, Blocks, Ctx, Reader, Scoped, DECIDING, DECLARED, PERSISTENT, SHELLS, SPECIAL};

impl Reader {
    /// One command: block keywords, leading assignments, then the
    /// builtins and launchers that set variables or start the job.
    /// `ctx`: where it stands among its neighbours.
    pub(super) fn command(&mut self, words: &[Word], bodies: &[Span], blocks: &mut Blocks, fn_pending: &mut Option<String>, ctx: Ctx<'_>) {
        if self.f.stopped_at.is_some() || words.is_empty() {
            return;
        }
        let outer = ctx.outer;
        // What `$( )` and `<( )` run is read, as a subshell whose output
        // is taken: nothing it sets stays, and it is not the job. An
        // arithmetic expansion may assign.
        for w in words {
            for seg in &w.segs {
                match seg {
                    Seg::Command(body) => self.child(body, outer, true),
                    Seg::Other(text) if text.contains("((") => self.arithmetic(text, w.line),
                    _ => {}
                }
            }
        }
        let (mut i, mut negated) = (0, false);
        while let Some(w) = words.get(i) {
            match lit(w).as_str() {
                "!" => negated = true,
                "if" => blocks.push(Block::If),
                "while" | "until" => blocks.push(Block::Loop),
                "then" | "do" | "else" | "elif" | "time" => {}
                "fi" | "done" | "esac" | "}" => {
                    if let Some(Block::Function(name, mark, false)) = blocks.pop() {
                        self.define(name, mark);
                    }
                }
                "{" => {
                    let b = match fn_pending.take() {
                        Some(name) => Block::Function(name, self.mark(), false),
                        // After `&&`/`||` the whole group may not run.
                        None => Block::Group((outer.is_some() && ctx.conditional).then_some("inside a `{ }` group after `&&` or `||`, which may not run")),
                    };
                    blocks.push(b);
                }
                "for" | "select" => {
                    // The loop's variable keeps the last value it takes.
                    if let Some(n) = words.get(i + 1).map(lit).filter(|n| is_name(n)) {
                        let why = format!("the variable of a loop on line {}: only running it settles it", w.line);
                        self.assign(n, Value::Unknown { text: "(a loop's)".into(), why }, w.line, Form::Shell, None);
                    }
                    return blocks.push(Block::Loop);
                }
                "case" => return blocks.push(Block::Case),
                "function" => {
                    let name = words.get(i + 1).map(lit).unwrap_or_default();
                    if words.last().is_some_and(|w| lit(w) == "{") {
                        let mark = self.mark();
                        blocks.push(Block::Function(name, mark, false));
                    } else {
                        *fn_pending = Some(name);
                    }
                    return;
                }
                _ => break,
            }
            i += 1;
        }
        let cond = outer.or_else(|| blocks.why());
        let mut prefix = Vec::new();
        while let Some((name, value, append)) = words.get(i).and_then(|w| w.split_assignment_op(true)) {
            prefix.push((name, value, append));
            i += 1;
        }
        if i >= words.len() {
            for (name, value, append) in prefix {
                let v = self.value_of(&name, &value, append);
                self.assign(name, v, value.line, Form::Shell, cond);
            }
            return;
        }
        // The shell expands every word before it assigns a command's
        // prefixes, so each is expanded with what was set before it.
        let scoped: Vec<Scoped> = prefix.iter().map(|(n, v, append)| (n.clone(), Some(self.value_of(n, v, *append)), v.line, Form::CommandPrefix)).collect();
        let words = &words[i..];
        // A negated command's failure never ends the script (`set -e`).
        let unconditional = cond.is_none() && !ctx.conditional && !negated && self.depth == 0 && !blocks.in_subshell();
        let program = base(&words[0]);
        // In POSIX mode a special builtin's prefixes stay in the shell.
        if self.posix && SPECIAL.contains(&program.as_str()) {
            for (n, v, line, _) in scoped.iter().cloned() {
                if let Some(v) = v {
                    self.assign(n, v, line, Form::Shell, cond);
                }
            }
        }
        if PERSISTENT.contains(&program.as_str()) {
            // A builtin's prefixes last for the builtin only; its own
            // changes stay.
            if !self.posix || !SPECIAL.contains(&program.as_str()) {
                for (n, v, line, form) in scoped {
                    self.f.set(n, v, line, form);
                }
            }
            self.builtin(words, cond, unconditional, blocks.function().is_some());
        } else {
            self.run_command(scoped, words, bodies, blocks, cond, unconditional, ctx);
        }
    }

    /// A value as assigned: `NAME+=v` appends to what the shell has.
    pub(super) fn value_of(&self, name: &str, word: &Word, append: bool) -> Value {
        let v = self.expand(word);
        if !append {
            return v;
        }
        match (self.get(name).map(|(v, _)| v), v) {
            (None | Some(None), v) => v,
            (Some(Some(Value::Known(old))), Value::Known(new)) => Value::Known(old + &new),
            (_, v) => {
                let text = match &v {
                    Value::Known(t) | Value::Unknown { text: t, .. } => t.clone(),
                };
                Value::Unknown { text, why: format!("`{name}+=` appends to a value the file cannot settle") }
            }
        }
    }

    /// `(( ... ))` or `$(( ... ))`: a judged name in it may be assigned.
    pub(super) fn arithmetic(&mut self, text: &str, line: usize) {
        for n in super::super::seen::names_in(text) {
            let why = format!("arithmetic on line {line} may assign it");
            self.assign(n.to_owned(), Value::Unknown { text: text.to_owned(), why }, line, Form::Shell, None);
        }
    }

    /// A command that is not a builtin: `scoped` (its prefixes, then
    /// what `env` and the launcher's flags pass) is its own environment,
    /// gone after it.
    #[allow(clippy::too_many_arguments)]
    fn run_command(&mut self, mut scoped: Vec<Scoped>, mut words: &[Word], bodies: &[Span], blocks: &Blocks, cond: Option<&str>, unconditional: bool, ctx: Ctx<'_>) {
        let mut stop_after = false;
        let (mut cleared, mut sudo_reset, mut split) = (false, false, false);
        let line = words[0].line;
        loop {
            let Some(first) = words.first() else { return };
            match base(first).as_str() {
                "exec" => {
                    stop_after = unconditional;
                    words = &words[1..];
                    // `-c` clears the environment, `-a NAME` names the program.
                    while let Some(o) = words.first().map(lit).filter(|o| o.starts_with('-') && o.len() > 1) {
                        cleared |= o.contains('c');
                        words = &words[if o.contains('a') { 2 } else { 1 }.min(words.len())..];
                    }
                }
                // Programs that run the rest of their line as a command.
                "nohup" | "command" | "builtin" | "time" | "stdbuf" | "nice" | "ionice" | "setsid" => {
                    words = &words[1..];
                    while words.first().is_some_and(|w| w.raw.starts_with('-')) {
                        words = &words[1..];
                    }
                }
                "sudo" => {
                    // sudo's options, then `NAME=value` it puts in the
                    // command's environment; without `-E` it starts the
                    // command with a reset environment.
                    let mut j = 1;
                    let mut keep = false;
                    while let Some(w) = words.get(j) {
                        let o = lit(w);
                        if matches!(o.as_str(), "-u" | "-g" | "-C" | "-D" | "-h" | "-p" | "-r" | "-t" | "-U" | "-T") {
                            j += 2;
                        } else if o.starts_with('-') {
                            keep |= o == "-E" || o.starts_with("--preserve-env") || (!o.starts_with("--") && o.contains('E'));
                            j += 1;
                        } else if let Some((n, value)) = w.split_assignment(true) {
                            scoped.push((n, Some(self.expand(&value)), w.line, Form::Env));
                            j += 1;
                        } else {
                            break;
                        }
                    }
                    words = &words[j.min(words.len())..];
                    sudo_reset |= !keep;
                }
                "printf" if words.iter().any(|w| lit(w) == "-v") => {
                    // `printf -v NAME`: sets NAME to what only running it settles.
                    match words.iter().skip_while(|w| lit(w) != "-v").nth(1).and_then(Word::literal).filter(|n| is_name(n)) {
                        Some(n) => {
                            let why = format!("set by `printf -v` on line {line}: only running it settles it");
                            self.assign(n, Value::Unknown { text: "(printf -v)".into(), why }, line, Form::Shell, cond);
                        }
                        None => self.opaque(line, "`printf -v` into a name only running it settles"),
                    }
                    return;
                }
                "echo" | "printf" if !ctx.piped_out => {
                    // Printed to the terminal: text, not settings.
                    for w in &words[1..] {
                        for n in super::super::seen::names_in(&w.raw) {
                            self.f.printed.push((n.to_owned(), w.line));
                        }
                    }
                    return;
                }
                "false" => {
                    if self.errexit && unconditional {
                        self.stop(line);
                    }
                    return;
                }
                "env" => {
                    let rest = &words[1..];
                    let mut j = 0;
                    while let Some(w) = rest.get(j) {
                        let o = lit(w);
                        match o.as_str() {
                            "--unset" => {
                                if let Some(n) = rest.get(j + 1).map(lit).filter(|n| is_name(n)) {
                                    scoped.push((n, None, w.line, Form::Unset));
                                }
                                j += 2;
                                continue;
                            }
                            "-" | "--ignore-environment" => cleared = true,
                            _ if o.starts_with("--unset=") => {
                                if let Some(n) = o.strip_prefix("--unset=").filter(|n| is_name(n)) {
                                    scoped.push((n.to_owned(), None, w.line, Form::Unset));
                                }
                            }
                            _ if o.starts_with("--split-string") || o.starts_with("--chdir") && !o.contains('=') => {
                                j += usize::from(!o.contains('='));
                                split |= o.starts_with("--split-string");
                            }
                            _ if o.starts_with("--") => {}
                            // Short options, several in one word: `-i`, `-u NAME`
                            // or `-uNAME`, `-C DIR`, `-S STRING`.
                            _ if o.starts_with('-') => {
                                let letters: Vec<char> = o[1..].chars().collect();
                                for (k, c) in letters.iter().enumerate() {
                                    match c {
                                        'i' => cleared = true,
                                        'u' | 'C' | 'S' => {
                                            let attached: String = letters[k + 1..].iter().collect();
                                            let arg = if attached.is_empty() {
                                                j += 1;
                                                rest.get(j).map(lit).unwrap_or_default()
                                            } else {
                                                attached
                                            };
                                            if *c == 'u' && is_name(&arg) {
                                                scoped.push((arg, None, w.line, Form::Unset));
                                            }
                                            split |= *c == 'S';
                                            break;
                                        }
                                        _ => {}
                                    }
                                }
                            }
                            _ => match w.split_assignment(false) {
                                Some((n, value)) => scoped.push((n, Some(self.expand(&value)), w.line, Form::Env)),
                                None => break,
                            },
                        }
                        j += 1;
                    }
                    words = &rest[j.min(rest.len())..];
                }
                _ => break,
            }
        }
        if split {
            // `env -S STRING`: env splits a command line this reading does
            // not, which may set anything and start the job.
            self.opaque(line, "runs `env -S`");
            self.launch(line, "env -S", blocks, Some(cond.unwrap_or("the command line `env -S` splits may start the job")));
        }
        if words.is_empty() {
            // `exec` with redirections only: the shell goes on.
            return;
        }
        // A program named by an expansion: its value, where the file
        // settles it; else it may be anything, a launcher or `eval`.
        let mut name = base(&words[0]);
        let mut named_by: Option<String> = None;
        if words[0].literal().is_none() {
            match self.expand(&words[0]) {
                Value::Known(v) => name = v.split_whitespace().next().unwrap_or_default().rsplit('/').next().unwrap_or_default().to_owned(),
                Value::Unknown { .. } => named_by = Some(super::super::shown(&words[0].raw)),
            }
        }
        let script = self.launcher_flags(words, &mut scoped);
        if let Some(sets) = self.functions.get(&name).cloned() {
            self.call(&name, sets, line);
        }
        if let Some(what) = &named_by {
            self.opaque(line, &format!("runs a program named by `{what}`"));
        }
        let mark = self.mark();
        if cleared {
            // `env -i`: the command starts with only what it is given.
            for n in DECIDING.iter().chain(["LD_LIBRARY_PATH"].iter()) {
                if self.vars.contains_key(*n) {
                    self.external = true;
                    self.unset((*n).to_owned(), line, None);
                }
            }
        }
        for (n, v, l, form) in scoped {
            self.external = form != Form::CommandPrefix;
            match v {
                Some(v) => self.assign(n, v, l, form, cond),
                None => self.unset(n, l, cond),
            }
        }
        self.external = false;
        if sudo_reset {
            // sudo resets the environment, keeping what its sudoers
            // configuration keeps: each deciding variable set here may
            // reach the command or not.
            for n in DECIDING {
                if self.vars.get(n).is_some_and(|v| v.exported) {
                    self.unset(n.to_owned(), line, Some("by `sudo`, which keeps it only where its sudoers configuration says"));
                }
            }
        }
        let shell_reads_stdin = SHELLS.contains(&name.as_str()) && words[1..].iter().all(|w| w.raw.starts_with('-'));
        if self.launching.contains(&name) {
            self.launch(line, &format!("{name} (a function that runs the launcher)"), blocks, cond);
        } else if let Some(script) = script {
            match script {
                Ok((text, at)) => {
                    if self.spend(text.len(), at) {
                        self.child_text(&text, at, cond, false);
                    }
                }
                Err(note) => {
                    self.f.notes.push(note);
                    self.opaque(line, "runs a shell script only running the job settles");
                    self.launch(line, "a shell's script", blocks, Some(cond.unwrap_or("a script this reading cannot read may launch it")));
                }
            }
        } else if let Some(l) = launcher_in(words).or_else(|| is_launcher(&name).then(|| name.clone())) {
            self.launch(line, &l, blocks, cond);
        } else if named_by.is_some() {
            self.launch(line, "a program named by a variable", blocks, Some(cond.unwrap_or("its program is named by a variable, so it may be the launcher")));
        } else if shell_reads_stdin && ctx.piped_in {
            // `... | bash`: a script from a pipe, which this reading cannot read.
            self.opaque(line, "feeds a shell a script from a pipe");
            self.launch(line, "a shell reading a pipe", blocks, Some(cond.unwrap_or("the script it reads may launch the job")));
        } else if words.iter().any(|w| SHELLS.contains(&base(w).as_str())) && !words.iter().skip(1).any(|w| w.raw.contains('/') || w.raw.ends_with(".sh")) {
            // `bash <<EOF`, `ssh host bash <<EOF`, `srun bash <<EOF`: the
            // here-document is the script.
            for b in bodies {
                self.child(b, cond, false);
            }
        } else if let Some(l) = words[1..].iter().map(base).find(|b| is_launcher(b)) {
            // A launcher further on the line (`nsys profile python ...`).
            self.launch(line, &l, blocks, Some(cond.unwrap_or("a launcher run by another program")));
        }
        self.end_command(mark, words);
        if stop_after {
            self.stop(line);
        }
    }

    /// A call of a function whose body sets `sets`: what it sets stays in
    /// the shell; the reading does not follow the body again, so each is
    /// unsettled (past the budget, every deciding variable is).
    fn call(&mut self, name: &str, sets: std::rc::Rc<[String]>, line: usize) {
        if !self.spend(sets.len(), line) {
            return;
        }
        for n in sets.iter().cloned() {
            let text = format!("(set by {name})");
            if self.get(&n).is_some_and(|(v, _)| matches!(v, Some(Value::Unknown { text: t, .. }) if *t == text)) {
                continue;
            }
            let why = format!("set inside the function `{name}`, called on line {line}, which this reading does not follow into");
            self.external = false;
            self.assign(n, Value::Unknown { text, why }, line, Form::Export, None);
        }
    }

    /// Takes `cost` from the budget for work a file can repeat (calls,
    /// scripts read again); past it, the reading stops following and
    /// every deciding variable is unsettled.
    fn spend(&mut self, cost: usize, line: usize) -> bool {
        if cost <= self.budget {
            self.budget -= cost;
            return true;
        }
        self.budget = 0;
        self.opaque(line, "repeats more work than this reading follows (functions called, scripts read again)");
        false
    }

    /// Variables a launcher passes to what it starts (into `scoped`), and
    /// the text of a `sh -c` script, expanded now (or why it cannot be).
    fn launcher_flags(&mut self, words: &[Word], scoped: &mut Vec<Scoped>) -> Option<Result<(String, usize), String>> {
        let mut j = 0;
        while let Some(w) = words.get(j) {
            let s = lit(w);
            let next = words.get(j + 1);
            match s.as_str() {
                "-x" => self.pair(Form::MpirunX, next, scoped),
                "-e" | "--env" => self.pair(Form::ContainerEnv, next, scoped),
                "-genv" | "-env" => {
                    if let (Some(n), Some(v)) = (next.map(lit).filter(|n| is_name(n)), words.get(j + 2)) {
                        scoped.push((n, Some(self.expand(v)), v.line, Form::MpirunGenv));
                        j += 1;
                    }
                }
                "--export" => {
                    if let Some(n) = next {
                        self.export_list(n, None, scoped);
                    }
                }
                _ if s.starts_with("--export=") || w.raw.starts_with("--export=") => self.export_list(w, Some("--export="), scoped),
                _ if w.raw.starts_with("--env=") => {
                    let stripped = strip_word_prefix(w, "--env=");
                    self.pair(Form::ContainerEnv, stripped.as_ref(), scoped);
                    j += 1;
                    continue;
                }
                _ if s.starts_with('-') && s.ends_with('c') && !s.starts_with("--") && words[..j].iter().any(|p| SHELLS.contains(&base(p).as_str())) => {
                    let script = next?;
                    return Some(match self.expand(script) {
                        Value::Known(text) => Ok((text, script.line)),
                        Value::Unknown { why, .. } => Err(format!("line {}: the script given to `{s}` {why}: what it sets is not read", script.line)),
                    });
                }
                _ => {
                    j += 1;
                    continue;
                }
            }
            j += 2;
        }
        None
    }

    /// Ends a command's own assignments, saying which of the judged
    /// names did not reach the job.
    fn end_command(&mut self, mark: usize, words: &[Word]) {
        let launched = self.f.launch.as_ref().is_some_and(|l| words.first().is_some_and(|w| w.line == l.line));
        if !launched && self.captured == 0 {
            let cmd = words.first().map(|w| w.raw.clone()).unwrap_or_default();
            let mut dropped: Vec<(usize, String)> = Vec::new();
            for (n, _) in &self.undo[mark..] {
                if let Some(v) = self.vars.get(n).filter(|v| judged(n) && v.idx != DECLARED) {
                    dropped.push((self.f.assignments[v.idx].line, n.clone()));
                }
            }
            dropped.dedup();
            for (line, n) in dropped {
                self.note(format!("line {line}: {n} is set for `{cmd}` only, which is not the job's launch: the job does not see it"));
            }
        }
        self.rollback(mark);
    }

    fn pair(&mut self, form: Form, word: Option<&Word>, scoped: &mut Vec<Scoped>) {
        if let Some((name, value)) = word.and_then(|w| w.split_assignment(false)) {
            scoped.push((name, Some(self.expand(&value)), value.line, form));
        }
    }

    /// `srun --export=ALL,NAME=value,...`: the names it sets.
    fn export_list(&mut self, word: &Word, prefix: Option<&str>, scoped: &mut Vec<Scoped>) {
        let word = match prefix {
            Some(p) => match strip_word_prefix(word, p) {
                Some(w) => w,
                None => return,
            },
            None => word.clone(),
        };
        match self.expand(&word) {
            Value::Known(list) => {
                for item in list.split(',') {
                    if let Some((n, v)) = item.split_once('=').filter(|(n, _)| is_name(n)) {
                        scoped.push((n.to_owned(), Some(Value::Known(v.to_owned())), word.line, Form::SrunExport));
                    }
                }
            }
            Value::Unknown { why, .. } => {
                for item in word.raw.split(',') {
                    if let Some((n, v)) = item.split_once('=').filter(|(n, _)| is_name(n)) {
                        let text = v.to_owned();
                        let v = if text.contains(['$', '`']) { Value::Unknown { text, why: why.clone() } } else { Value::Known(text) };
                        scoped.push((n.to_owned(), Some(v), word.line, Form::SrunExport));
                    }
                }
            }
        }
    }
}

/// `word` without its leading literal `prefix`.
pub(super) fn strip_word_prefix(word: &Word, prefix: &str) -> Option<Word> {
    let mut w = word.clone();
    let Seg::Lit { text, .. } = w.segs.first_mut()? else { return None };
    *text = text.strip_prefix(prefix)?.to_owned();
    w.raw = w.raw.strip_prefix(prefix).unwrap_or(&w.raw).to_owned();
    Some(w)
}
