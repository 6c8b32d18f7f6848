//! Each kind of job file, read into [`JobFile`] assignments.

use super::shell::{is_name, Lexer, Sep, Tok, Word};
use super::{expand, judged, Form, JobFile, Value};

/// Which language a job file is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Dialect {
    Shell,
    Dockerfile,
    Yaml,
    Python,
}

const DOCKER: [&str; 12] = ["FROM", "RUN", "ENV", "ARG", "COPY", "ADD", "WORKDIR", "CMD", "ENTRYPOINT", "LABEL", "USER", "EXPOSE"];

/// The file's language, from its lines.
pub(super) fn dialect(text: &str) -> Dialect {
    let lines: Vec<&str> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
    let first_word = |l: &str| l.split_whitespace().next().unwrap_or("").to_owned();
    if lines.first().is_some_and(|l| matches!(first_word(l).as_str(), "FROM" | "ARG"))
        || lines.iter().filter(|l| DOCKER.contains(&first_word(l).as_str())).count() * 2 > lines.len()
    {
        return Dialect::Dockerfile;
    }
    if lines.iter().any(|l| l.starts_with("import ") || (l.starts_with("from ") && l.contains(" import ")) || l.contains("os.environ")) {
        return Dialect::Python;
    }
    let yamlish = |l: &&&str| {
        l.starts_with("- ") || **l == "-" || l.starts_with("---") || yaml_key(l).is_some_and(|(k, _)| !k.contains(' ') && !k.contains('='))
    };
    if !lines.is_empty() && lines.iter().filter(yamlish).count() * 2 > lines.len() {
        return Dialect::Yaml;
    }
    if lines.iter().any(|l| l.starts_with('[') && l.ends_with(']') && !l.starts_with("[[ ") && !l.starts_with("[ ")) {
        return Dialect::Python;
    }
    Dialect::Shell
}

/// `key: value` (the key unquoted).
fn yaml_key(l: &str) -> Option<(String, &str)> {
    let (k, v) = if let Some(q) = l.strip_prefix('"').or_else(|| l.strip_prefix('\'')) {
        let close = q.find(['"', '\''])?;
        (&q[..close], q[close + 1..].strip_prefix(':')?)
    } else {
        let at = l.find(':')?;
        (&l[..at], &l[at + 1..])
    };
    if !(v.is_empty() || v.starts_with([' ', '\t'])) || k.is_empty() || k.contains(['$', '(', '"', '\'']) {
        return None;
    }
    Some((k.to_owned(), v.trim()))
}

/// Records an assignment made where it may not run (`cond`: why).
fn assign(f: &mut JobFile, name: String, value: Value, line: usize, form: Form, cond: Option<&str>) {
    let value = match (value, cond) {
        (Value::Known(v), Some(why)) => {
            let same = f.last(&name).is_some_and(|a| a.value == Some(Value::Known(v.clone())));
            if same {
                Value::Known(v)
            } else {
                Value::Unknown { text: v, why: format!("set on line {line} {why}, so only the running job settles it") }
            }
        }
        (v, _) => v,
    };
    f.set(name, Some(value), line, form);
}

fn unset(f: &mut JobFile, name: String, line: usize, cond: Option<&str>) {
    match cond {
        None => f.set(name, None, line, Form::Unset),
        Some(why) => {
            let why = format!("unset on line {line} {why}, so only the running job settles it");
            f.set(name, Some(Value::Unknown { text: "(unset)".into(), why }), line, Form::Unset);
        }
    }
}

/// A block that may not run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Block {
    If,
    Case,
    Loop,
    Function,
    Group,
}

impl Block {
    fn why(self) -> Option<&'static str> {
        match self {
            Block::If => Some("inside an `if`, which runs only when its condition holds"),
            Block::Case => Some("inside a `case` branch"),
            Block::Loop => Some("inside a loop"),
            Block::Function => Some("inside a function, which sets it only when called"),
            Block::Group => None,
        }
    }
}

/// Reads shell text; `outer` says why none of it may run.
pub(super) fn shell_script(f: &mut JobFile, text: &str, first_line: usize, outer: Option<&str>) {
    // `NAME = "value"` lines (TOML, Python) are not shell: taken apart
    // first, blanked for the shell.
    let mut shellish = String::with_capacity(text.len());
    for (i, l) in text.lines().enumerate() {
        if spaced(f, l, first_line + i) {
            shellish.push('\n');
        } else {
            shellish.push_str(l);
            shellish.push('\n');
        }
    }
    let mut lx = Lexer::new(&shellish, first_line);
    let (mut words, mut blocks, mut fn_pending, mut after_or) = (Vec::new(), Vec::new(), false, false);
    loop {
        let tok = lx.next_tok();
        match tok {
            Some(Tok::Word(w)) => words.push(w),
            Some(Tok::Sep(sep)) => {
                if sep == Sep::Open && words.len() == 1 {
                    fn_pending = true;
                    words.clear();
                    continue;
                }
                let or_why = after_or.then_some("after `||`, which runs only when what precedes it fails");
                command(f, &words, &mut blocks, &mut fn_pending, outer.or(or_why));
                words.clear();
                after_or = sep == Sep::Or;
            }
            None => {
                command(f, &words, &mut blocks, &mut fn_pending, outer);
                return;
            }
        }
    }
}

/// `NAME = value` of a judged name, as TOML and Python write it.
fn spaced(f: &mut JobFile, line: &str, n: usize) -> bool {
    let t = line.trim();
    let Some((name, rest)) = t.split_once('=') else { return false };
    let name = name.trim();
    if !judged(name) || !is_name(name) || !(t[name.len()..].starts_with([' ', '\t'])) || rest.starts_with('=') {
        return false;
    }
    let value = literal_value(rest.trim());
    assign(f, name.to_owned(), value, n, Form::Spaced, None);
    true
}

/// A TOML, Python or YAML scalar: a quoted string or a bare word; an
/// expression otherwise.
fn literal_value(v: &str) -> Value {
    let v = strip_comment(v).trim().trim_end_matches(',').trim();
    for q in ['"', '\''] {
        if let Some(inner) = v.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            if !inner.contains(q) {
                return Value::Known(inner.to_owned());
            }
        }
    }
    if !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || "_-.:/^=,+".contains(c)) {
        return Value::Known(v.to_owned());
    }
    Value::Unknown { text: v.to_owned(), why: "an expression evaluated when the job runs".into() }
}

/// A line without its ` # comment` (outside quotes).
fn strip_comment(l: &str) -> &str {
    let mut quote = None;
    let mut prev = ' ';
    for (i, c) in l.char_indices() {
        match (quote, c) {
            (None, '"' | '\'') => quote = Some(c),
            (Some(q), c) if c == q => quote = None,
            (None, '#') if prev.is_whitespace() || i == 0 => return l[..i].trim_end(),
            _ => {}
        }
        prev = c;
    }
    l
}

fn lit(w: &Word) -> String {
    w.literal().unwrap_or_default()
}

/// One command: block keywords, leading assignments, then the builtins
/// and launchers that set variables.
fn command(f: &mut JobFile, words: &[Word], blocks: &mut Vec<Block>, fn_pending: &mut bool, outer: Option<&str>) {
    // What `$( )` runs is read too: `OUT=$(NCCL_DEBUG=INFO cmd)` runs cmd so.
    for w in words {
        for seg in &w.segs {
            if let super::shell::Seg::Command(inner) = seg {
                shell_script(f, inner, w.line, outer);
            }
        }
    }
    let mut i = 0;
    while let Some(w) = words.get(i) {
        match lit(w).as_str() {
            "if" => blocks.push(Block::If),
            "while" | "until" => blocks.push(Block::Loop),
            "then" | "do" | "else" | "elif" | "!" | "time" => {}
            "fi" | "done" | "esac" | "}" => {
                blocks.pop();
            }
            "{" => blocks.push(if std::mem::take(fn_pending) { Block::Function } else { Block::Group }),
            "for" | "select" => return blocks.push(Block::Loop),
            "case" => return blocks.push(Block::Case),
            "function" => {
                if words.last().is_some_and(|w| lit(w) == "{") {
                    blocks.push(Block::Function);
                } else {
                    *fn_pending = true;
                }
                return;
            }
            _ => break,
        }
        i += 1;
    }
    let cond = outer.or_else(|| blocks.iter().rev().find_map(|b| b.why()));
    let mut prefix = Vec::new();
    while let Some((name, value)) = words.get(i).and_then(|w| w.split_assignment(true)) {
        prefix.push((name, value));
        i += 1;
    }
    let form = if i < words.len() { Form::CommandPrefix } else { Form::Shell };
    for (name, value) in prefix {
        let v = expand(&value, f);
        assign(f, name, v, value.line, form, cond);
    }
    let Some(cmd) = words.get(i) else { return };
    let line = cmd.line;
    let base = lit(cmd).rsplit('/').next().unwrap_or_default().to_owned();
    let rest = &words[i + 1..];
    match base.as_str() {
        "export" | "declare" | "typeset" | "readonly" | "local" => {
            let exports = base == "export" || rest.iter().any(|w| lit(w).starts_with('-') && lit(w).contains('x'));
            for w in rest {
                if let Some((name, value)) = w.split_assignment(false) {
                    if exports {
                        f.exported.push(name.clone());
                    }
                    let v = expand(&value, f);
                    assign(f, name, v, w.line, if exports { Form::Export } else { Form::Shell }, cond);
                } else if exports && is_name(&lit(w)) {
                    f.exported.push(lit(w));
                }
            }
        }
        "unset" => {
            for w in rest {
                match lit(w).as_str() {
                    "-v" => {}
                    "-f" => return,
                    n if is_name(n) => unset(f, n.to_owned(), w.line, cond),
                    _ => {}
                }
            }
        }
        "set" => {
            if rest.iter().any(|w| {
                let s = lit(w);
                (s.starts_with('-') && s.contains('a')) || s == "allexport"
            }) {
                f.allexport = true;
            }
        }
        "source" | "." => {
            let file = rest.first().map_or_else(String::new, |w| w.raw.clone());
            f.notes.push(format!("line {line}: reads {file}, which this reading does not follow: what it sets is not judged"));
        }
        "env" => {
            let mut j = 0;
            while let Some(w) = rest.get(j) {
                match lit(w).as_str() {
                    "-u" | "--unset" => {
                        if let Some(n) = rest.get(j + 1).map(lit).filter(|n| is_name(n)) {
                            unset(f, n, w.line, cond);
                        }
                        j += 2;
                        continue;
                    }
                    "-i" | "-" | "--ignore-environment" => {}
                    _ => match w.split_assignment(false) {
                        Some((name, value)) => {
                            let v = expand(&value, f);
                            assign(f, name, v, w.line, Form::Env, cond);
                        }
                        None => break,
                    },
                }
                j += 1;
            }
            launcher_flags(f, &rest[j..], cond);
        }
        _ => launcher_flags(f, &words[i..], cond),
    }
}

const SHELLS: [&str; 5] = ["sh", "bash", "zsh", "dash", "ksh"];

/// Variables a launcher passes to what it starts.
fn launcher_flags(f: &mut JobFile, words: &[Word], cond: Option<&str>) {
    let mut j = 0;
    while let Some(w) = words.get(j) {
        let s = lit(w);
        let next = words.get(j + 1);
        let pair = |form: Form, word: Option<&Word>, f: &mut JobFile| {
            if let Some((name, value)) = word.and_then(|w| w.split_assignment(false)) {
                let v = expand(&value, f);
                assign(f, name, v, value.line, form, cond);
            }
        };
        match s.as_str() {
            "-x" => pair(Form::MpirunX, next, f),
            "-e" | "--env" => pair(Form::ContainerEnv, next, f),
            "-genv" | "-env" => {
                if let (Some(n), Some(v)) = (next.map(lit).filter(|n| is_name(n)), words.get(j + 2)) {
                    let value = expand(v, f);
                    assign(f, n, value, v.line, Form::MpirunGenv, cond);
                    j += 1;
                }
            }
            "--export" => {
                if let Some(n) = next {
                    export_list(f, n, None, cond);
                }
            }
            _ if s.starts_with("--export=") || w.raw.starts_with("--export=") => export_list(f, w, Some("--export="), cond),
            _ if w.raw.starts_with("--env=") => {
                let stripped = strip_word_prefix(w, "--env=");
                pair(Form::ContainerEnv, stripped.as_ref(), f);
                j += 1;
                continue;
            }
            _ if s.starts_with('-') && s.ends_with('c') && !s.starts_with("--") && words[..j].iter().any(|p| SHELLS.contains(&lit(p).rsplit('/').next().unwrap_or(""))) => {
                if let Some(script) = next {
                    if let Value::Known(text) = expand(script, f) {
                        shell_script(f, &text, script.line, cond);
                    }
                }
                return;
            }
            _ => {
                j += 1;
                continue;
            }
        }
        j += 2;
    }
}

/// `word` without its leading literal `prefix`.
fn strip_word_prefix(word: &Word, prefix: &str) -> Option<Word> {
    let mut w = word.clone();
    let super::shell::Seg::Lit { text, .. } = w.segs.first_mut()? else { return None };
    *text = text.strip_prefix(prefix)?.to_owned();
    w.raw = w.raw.strip_prefix(prefix).unwrap_or(&w.raw).to_owned();
    Some(w)
}

/// `srun --export=ALL,NAME=value,...`: the names it sets.
fn export_list(f: &mut JobFile, word: &Word, prefix: Option<&str>, cond: Option<&str>) {
    let word = match prefix {
        Some(p) => match strip_word_prefix(word, p) {
            Some(w) => w,
            None => return,
        },
        None => word.clone(),
    };
    match expand(&word, f) {
        Value::Known(list) => {
            for item in list.split(',') {
                if let Some((n, v)) = item.split_once('=').filter(|(n, _)| is_name(n)) {
                    assign(f, n.to_owned(), Value::Known(v.to_owned()), word.line, Form::SrunExport, cond);
                }
            }
        }
        Value::Unknown { why, .. } => {
            for item in word.raw.split(',') {
                if let Some((n, v)) = item.split_once('=').filter(|(n, _)| is_name(n)) {
                    let text = v.to_owned();
                    let v = if text.contains(['$', '`']) { Value::Unknown { text, why: why.clone() } } else { Value::Known(text) };
                    assign(f, n.to_owned(), v, word.line, Form::SrunExport, cond);
                }
            }
        }
    }
}

/// A Dockerfile: `ENV`, `ARG`, and the shell of `RUN`, `CMD`,
/// `ENTRYPOINT`.
pub(super) fn dockerfile(f: &mut JobFile, text: &str) {
    for (line, instr) in logical_lines(text) {
        let t = instr.trim_start();
        let (word, rest) = t.split_once(char::is_whitespace).unwrap_or((t, ""));
        let rest = rest.trim();
        match word.to_ascii_uppercase().as_str() {
            "ENV" | "ARG" => {
                let form = if word.eq_ignore_ascii_case("ENV") { Form::DockerEnv } else { Form::DockerArg };
                let words = words_of(rest, line);
                if words.first().is_some_and(|w| w.split_assignment(false).is_some()) {
                    for w in &words {
                        if let Some((name, value)) = w.split_assignment(false) {
                            let v = expand(&value, f);
                            assign(f, name, v, line, form, None);
                        }
                    }
                } else if let (Some(name), true) = (words.first().map(lit).filter(|n| is_name(n)), form == Form::DockerEnv) {
                    // The legacy `ENV NAME value with spaces`.
                    let value = rest[name.len()..].trim();
                    let v = expand(&super::shell::Lexer::new(value, line).whole_word(), f);
                    assign(f, name, v, line, form, None);
                }
            }
            "RUN" | "CMD" | "ENTRYPOINT" => shell_script(f, &flow_to_shell(rest), line, None),
            _ => {}
        }
    }
}

/// Lines with their `\` continuations joined, each with its first line
/// number; comment lines dropped.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out: Vec<(usize, String)> = Vec::new();
    let mut open = false;
    for (i, l) in text.lines().enumerate() {
        if l.trim_start().starts_with('#') {
            continue;
        }
        let (body, cont) = match l.trim_end().strip_suffix('\\') {
            Some(b) => (b, true),
            None => (l, false),
        };
        match (open, out.last_mut()) {
            (true, Some((_, acc))) => {
                acc.push(' ');
                acc.push_str(body);
            }
            _ => out.push((i + 1, body.to_owned())),
        }
        open = cont;
    }
    out
}

fn words_of(text: &str, line: usize) -> Vec<Word> {
    let mut lx = Lexer::new(text, line);
    let mut out = Vec::new();
    while let Some(t) = lx.next_tok() {
        if let Tok::Word(w) = t {
            out.push(w);
        }
    }
    out
}

/// A JSON-style list (`["bash", "-c", "..."]`, exec form, YAML flow
/// sequences) as shell words; anything else as it is.
fn flow_to_shell(text: &str) -> String {
    let t = text.trim();
    let Some(inner) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) else { return text.to_owned() };
    let mut items = Vec::new();
    let mut chars = inner.chars().peekable();
    while let Some(&c) = chars.peek() {
        match c {
            ' ' | ',' | '\t' => {
                chars.next();
            }
            '"' | '\'' => {
                chars.next();
                let mut s = String::new();
                while let Some(ch) = chars.next() {
                    match ch {
                        '\\' if c == '"' => match chars.next() {
                            Some('n') => s.push('\n'),
                            Some(o) => s.push(o),
                            None => {}
                        },
                        ch if ch == c => break,
                        ch => s.push(ch),
                    }
                }
                items.push(s);
            }
            _ => {
                let mut s = String::new();
                while let Some(&ch) = chars.peek().filter(|ch| **ch != ',') {
                    s.push(ch);
                    chars.next();
                }
                items.push(s.trim().to_owned());
            }
        }
    }
    items.iter().map(|i| format!("'{}'", i.replace('\'', "'\\''"))).collect::<Vec<_>>().join(" ")
}

/// Compose and Kubernetes YAML: `environment:` lists and maps, `env:`
/// entries, and the shell in `command:`, `args:` and block scalars.
pub(super) fn yaml(f: &mut JobFile, text: &str) {
    let lines: Vec<&str> = text.lines().collect();
    let mut pending: Option<(String, usize)> = None;
    let mut i = 0;
    while i < lines.len() {
        let raw = lines[i];
        let n = i + 1;
        i += 1;
        let indent = raw.len() - raw.trim_start().len();
        let t = strip_comment(raw.trim());
        let item = t.strip_prefix("- ").map(str::trim);
        let body = item.unwrap_or(t);
        if body.is_empty() || body == "---" {
            continue;
        }
        // A block scalar (`|`, `>-`): its more-indented lines are shell.
        let scalar_of = |v: &str| matches!(v, "|" | "|-" | "|+" | ">" | ">-" | ">+");
        let value_part = yaml_key(body).map(|(_, v)| v).unwrap_or(body);
        if scalar_of(value_part) {
            let start = i;
            while i < lines.len() && (lines[i].trim().is_empty() || lines[i].len() - lines[i].trim_start().len() > indent) {
                i += 1;
            }
            let block = lines[start..i].join("\n");
            shell_script(f, &block, start + 1, None);
            continue;
        }
        if let Some((key, v)) = yaml_key(body) {
            match key.as_str() {
                "name" if is_name(unquote(v)) => {
                    pending = Some((unquote(v).to_owned(), n));
                    continue;
                }
                "value" if pending.is_some() => {
                    let (name, _) = pending.take().unwrap_or_default();
                    let v = kubernetes_value(unquote(v), f, n);
                    assign(f, name, v, n, Form::KubernetesEnv, None);
                    continue;
                }
                "valueFrom" if pending.is_some() => {
                    let (name, _) = pending.take().unwrap_or_default();
                    let why = "comes from a Secret, a ConfigMap or a field of the pod (valueFrom), which only the cluster settles".to_owned();
                    assign(f, name, Value::Unknown { text: "valueFrom".into(), why }, n, Form::KubernetesEnv, None);
                    continue;
                }
                k if is_name(k) && k.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') => {
                    let v = interpolated(unquote(v.trim_end_matches(',')), f, n);
                    assign(f, key, v, n, Form::YamlMap, None);
                    continue;
                }
                _ => {
                    if !v.is_empty() {
                        shell_script(f, &flow_to_shell(v), n, None);
                    }
                    continue;
                }
            }
        }
        if item.is_some() {
            let entry = unquote(body);
            if let Some((name, v)) = entry.split_once('=').filter(|(k, _)| is_name(k)) {
                let v = interpolated(v, f, n);
                assign(f, name.to_owned(), v, n, Form::YamlList, None);
            } else {
                shell_script(f, &flow_to_shell(body), n, None);
            }
        }
    }
}

fn unquote(v: &str) -> &str {
    let v = v.trim();
    ['"', '\''].iter().find_map(|q| v.strip_prefix(*q).and_then(|s| s.strip_suffix(*q))).unwrap_or(v)
}

/// A Compose value: `${NAME}` and `${NAME:-default}` interpolated as
/// the shell would.
fn interpolated(v: &str, f: &JobFile, line: usize) -> Value {
    expand(&Lexer::new(v, line).whole_word(), f)
}

/// A Kubernetes `value:`: `$(NAME)` refers to an earlier entry of the
/// same `env:` (kept as written when there is none), `$$` is `$`.
fn kubernetes_value(v: &str, f: &JobFile, line: usize) -> Value {
    let mut out = String::new();
    let mut rest = v;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        if let Some(t) = tail.strip_prefix('$') {
            out.push('$');
            rest = t;
        } else if let Some((name, t)) = tail.strip_prefix('(').and_then(|t| t.split_once(')')).filter(|(n, _)| is_name(n)) {
            match f.last(name).and_then(|a| a.value.clone()) {
                Some(Value::Known(s)) => out.push_str(&s),
                Some(Value::Unknown { .. }) => {
                    return Value::Unknown { text: v.to_owned(), why: format!("`$({name})` refers to an entry the file cannot settle (line {line})") };
                }
                None => out.push_str(&format!("$({name})")),
            }
            rest = t;
        } else {
            out.push('$');
            rest = tail;
        }
    }
    out.push_str(rest);
    Value::Known(out)
}

/// Python (and TOML): `os.environ[...] = ...`, `setdefault`, dict
/// entries of judged names, `NAME = value` lines.
pub(super) fn python(f: &mut JobFile, text: &str) {
    for (i, l) in text.lines().enumerate() {
        let n = i + 1;
        let t = l.trim();
        if t.starts_with('#') {
            continue;
        }
        if let Some(rest) = t.strip_prefix("os.environ[") {
            if let Some((key, value)) = rest.split_once(']') {
                let name = unquote(key);
                if let Some(v) = value.trim().strip_prefix('=').filter(|v| !v.starts_with('=')) {
                    if is_name(name) {
                        let v = match literal_value(v.trim()) {
                            Value::Unknown { text, .. } => Value::Unknown { text, why: "a Python expression, evaluated when the job runs".into() },
                            k => k,
                        };
                        assign(f, name.to_owned(), v, n, Form::PythonEnviron, None);
                    }
                }
            }
            continue;
        }
        if let Some(rest) = t.strip_prefix("os.environ.setdefault(").and_then(|r| r.strip_suffix(')')) {
            if let Some((key, value)) = rest.split_once(',') {
                let name = unquote(key);
                if is_name(name) {
                    let why = format!("setdefault keeps the value the job's environment already has, and sets {} otherwise", value.trim());
                    assign(f, name.to_owned(), Value::Unknown { text: value.trim().to_owned(), why }, n, Form::PythonEnviron, None);
                }
            }
            continue;
        }
        if spaced(f, l, n) {
            continue;
        }
        dict_entries(f, t, n);
    }
}

/// `"NAME": value` entries of judged names on a line.
fn dict_entries(f: &mut JobFile, line: &str, n: usize) {
    let mut rest = line;
    while let Some(at) = rest.find(['"', '\'']) {
        let q = rest[at..].chars().next().unwrap_or('"');
        let after = &rest[at + 1..];
        let Some(close) = after.find(q) else { return };
        let name = &after[..close];
        let tail = after[close + 1..].trim_start();
        rest = &after[close + 1..];
        let Some(value) = tail.strip_prefix(':') else { continue };
        if !judged(name) || !is_name(name) {
            continue;
        }
        let value = value.trim_start();
        let end = match value.chars().next() {
            Some(c @ ('"' | '\'')) => value[1..].find(c).map_or(value.len(), |e| e + 2),
            _ => value.find([',', '}', ')']).unwrap_or(value.len()),
        };
        let v = literal_value(&value[..end]);
        assign(f, name.to_owned(), v, n, Form::DictEntry, None);
        rest = &value[end..];
    }
}
