//! Each kind of job file, read into [`JobFile`] assignments.

use super::script::Reader;
use super::shell::{is_name, Lexer, Tok, Word};
use super::{judged, Form, Value};

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

/// A shell script or env file: `NAME = "value"` lines (TOML, Python)
/// are taken apart first and blanked for the shell.
pub(super) fn shell_script(r: &mut Reader, text: &str) {
    let mut shellish = String::with_capacity(text.len());
    for (i, l) in text.lines().enumerate() {
        if !spaced(r, l, i + 1, None) {
            shellish.push_str(l);
        }
        shellish.push('\n');
    }
    r.top(&shellish, 1);
}

/// `NAME = value` of a judged name, as TOML and Python write it.
fn spaced(r: &mut Reader, line: &str, n: usize, cond: Option<&str>) -> bool {
    let t = line.trim();
    let Some((name, rest)) = t.split_once('=') else { return false };
    let name = name.trim();
    if !judged(name) || !is_name(name) || !(t[name.len()..].starts_with([' ', '\t'])) || rest.starts_with('=') {
        return false;
    }
    let value = literal_value(rest.trim());
    r.assign(name.to_owned(), value, n, Form::Spaced, cond);
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

/// A Dockerfile: `ENV`, `ARG`, and the shell of `RUN`, `CMD`,
/// `ENTRYPOINT`.
pub(super) fn dockerfile(r: &mut Reader, text: &str) {
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
                            let v = r.expand(&value);
                            r.assign(name, v, line, form, None);
                        }
                    }
                } else if let (Some(name), true) = (words.first().map(lit).filter(|n| is_name(n)), form == Form::DockerEnv) {
                    // The legacy `ENV NAME value with spaces`.
                    let value = rest[name.len()..].trim();
                    let v = r.expand(&Lexer::new(value, line).whole_word());
                    r.assign(name, v, line, form, None);
                }
            }
            // A build step runs in its own shell and is not the job.
            "RUN" => r.child_text(&flow_to_shell(rest), line, None, true),
            "CMD" | "ENTRYPOINT" => r.child_text(&flow_to_shell(rest), line, None, false),
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
pub(super) fn yaml(r: &mut Reader, text: &str) {
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
            r.child_text(&block, start + 1, None, false);
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
                    let v = kubernetes_value(unquote(v), r, n);
                    r.assign(name, v, n, Form::KubernetesEnv, None);
                    continue;
                }
                "valueFrom" if pending.is_some() => {
                    let (name, _) = pending.take().unwrap_or_default();
                    let why = "comes from a Secret, a ConfigMap or a field of the pod (valueFrom), which only the cluster settles".to_owned();
                    r.assign(name, Value::Unknown { text: "valueFrom".into(), why }, n, Form::KubernetesEnv, None);
                    continue;
                }
                k if is_name(k) && k.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_') => {
                    let v = interpolated(unquote(v.trim_end_matches(',')), r, n);
                    r.assign(key, v, n, Form::YamlMap, None);
                    continue;
                }
                _ => {
                    if !v.is_empty() {
                        r.child_text(&flow_to_shell(v), n, None, false);
                    }
                    continue;
                }
            }
        }
        if item.is_some() {
            let entry = unquote(body);
            if let Some((name, v)) = entry.split_once('=').filter(|(k, _)| is_name(k)) {
                let v = interpolated(v, r, n);
                r.assign(name.to_owned(), v, n, Form::YamlList, None);
            } else {
                r.child_text(&flow_to_shell(body), n, None, false);
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
fn interpolated(v: &str, r: &Reader, line: usize) -> Value {
    r.expand(&Lexer::new(v, line).whole_word())
}

/// A Kubernetes `value:`: `$(NAME)` refers to an earlier entry of the
/// same `env:` (kept as written when there is none), `$$` is `$`.
fn kubernetes_value(v: &str, r: &Reader, line: usize) -> Value {
    let mut out = String::new();
    let mut rest = v;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let tail = &rest[at + 1..];
        if let Some(t) = tail.strip_prefix('$') {
            out.push('$');
            rest = t;
        } else if let Some((name, t)) = tail.strip_prefix('(').and_then(|t| t.split_once(')')).filter(|(n, _)| is_name(n)) {
            match r.get(name).and_then(|(v, _)| v) {
                Some(Value::Known(s)) if out.len() + s.len() <= super::MAX_VALUE => out.push_str(&s),
                Some(Value::Known(_)) => {
                    return Value::Unknown { text: v.chars().take(super::shell::RAW_LIMIT).collect(), why: format!("expands to more than {} bytes", super::MAX_VALUE) };
                }
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
    if out.len() > super::MAX_VALUE {
        return Value::Unknown { text: v.chars().take(super::shell::RAW_LIMIT).collect(), why: format!("expands to more than {} bytes", super::MAX_VALUE) };
    }
    Value::Known(out)
}

/// Python (and TOML): `os.environ[...] = ...`, `setdefault`, dict
/// entries of judged names, `NAME = value` lines.
pub(super) fn python(r: &mut Reader, text: &str) {
    // Python's blocks, by indentation: `(indent, why it may not run)`.
    let mut blocks: Vec<(usize, Option<&'static str>)> = Vec::new();
    for (i, l) in text.lines().enumerate() {
        let n = i + 1;
        let t = l.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let indent = l.len() - l.trim_start().len();
        while blocks.last().is_some_and(|(at, _)| *at >= indent) {
            blocks.pop();
        }
        let cond = blocks.iter().rev().find_map(|(_, why)| *why);
        if let Some(why) = python_block(t) {
            blocks.push((indent, why));
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
                        r.assign(name.to_owned(), v, n, Form::PythonEnviron, cond);
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
                    r.assign(name.to_owned(), Value::Unknown { text: value.trim().to_owned(), why }, n, Form::PythonEnviron, cond);
                }
            }
            continue;
        }
        if spaced(r, l, n, cond) {
            continue;
        }
        dict_entries(r, t, n, cond);
    }
}

/// A Python line that opens a block (`if ...:`), with why what is in it
/// may not run: `Some(Some(why))` for a branch or a loop, `Some(None)` for
/// a block that runs (`def`, taken to be called; `with`, `try`; the
/// script's own `if __name__ == "__main__":`), `None` for another line.
fn python_block(t: &str) -> Option<Option<&'static str>> {
    let code = strip_comment(t);
    if !code.ends_with(':') {
        return None;
    }
    let word = code.split(|c: char| !c.is_ascii_alphanumeric() && c != '_').next().unwrap_or_default();
    match word {
        "if" if code.contains("__name__") && code.contains("__main__") => Some(None),
        "if" | "elif" | "else" => Some(Some("inside a Python `if`, which runs only when its condition holds")),
        "for" | "while" => Some(Some("inside a Python loop")),
        "except" => Some(Some("inside a Python `except`, which runs only on an error")),
        "match" | "case" => Some(Some("inside a Python `match`")),
        "def" | "async" | "class" | "with" | "try" | "finally" => Some(None),
        _ => None,
    }
}

/// `"NAME": value` entries of judged names on a line.
fn dict_entries(r: &mut Reader, line: &str, n: usize, cond: Option<&str>) {
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
        r.assign(name.to_owned(), v, n, Form::DictEntry, cond);
        rest = &value[end..];
    }
}
