//! Every `NCCL_*` and `UCX_*` name a job file names, accounted for: read
//! into a value by the reading, or listed as *seen, not read*. This is
//! what keeps a form the reading does not know (a launcher's own syntax,
//! a heredoc written to `/etc/nccl.conf`, `sudo NAME=v`, nesting past the
//! bound) from counting as "sets nothing": the text is scanned on its own,
//! apart from the reading, and a name it finds that the reading did not
//! take is reported.
//!
//! An occurrence is accounted for when
//! - the reading recorded an assignment (or `unset`) of that name on that
//!   line (or the logical line a `\` continuation joins it to), or took
//!   it as text printed by `echo`/`printf`;
//! - it is not shaped as an assignment (`NAME=`, `NAME:`, `NAME"] =`) and
//!   is either a reference (`$NAME`, `${NAME...}`, `$(NAME)`) or a name
//!   the file assigns somewhere (`export NAME`, `-x NAME`).
//!
//! Comments (in a shell script, where its lexer found them; elsewhere a
//! `#` at the start of a word, outside quotes) and what follows an
//! unconditional `exit` or `exec` (it never runs) are not read.
//! One pass over the text: linear.

use std::collections::HashSet;

use super::JobFile;

/// A name the file names that the reading did not take.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Seen {
    /// The variable.
    pub name: String,
    /// Its line, 1-based.
    pub line: usize,
    /// The line as written (at most 120 characters).
    pub text: String,
}

/// Most entries kept; the first of each name is kept past it.
const MAX_SEEN: usize = 256;

fn name_char(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_'
}

/// The line without its comment: from a `#` that starts a word, outside
/// quotes.
fn code(line: &str) -> &str {
    let b = line.as_bytes();
    let mut quote = 0u8;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match (quote, c) {
            (0, b'\\') => i += 1,
            (0, b'"' | b'\'') => quote = c,
            (q, c) if q != 0 && c == q => quote = 0,
            (b'"', b'\\') => i += 1,
            (0, b'#') if i == 0 || b[i - 1].is_ascii_whitespace() => return &line[..i],
            _ => {}
        }
        i += 1;
    }
    line
}

/// Whether what follows a name makes it the target of an assignment.
fn assignment_shaped(after: &[u8]) -> bool {
    let mut i = 0;
    while i < after.len() && matches!(after[i], b'"' | b'\'' | b']' | b')' | b'}') && i < 3 {
        i += 1;
    }
    // `${NAME:=v}` assigns too.
    if after.get(i) == Some(&b':') && after.get(i + 1) == Some(&b'=') {
        return true;
    }
    while i < after.len() && matches!(after[i], b' ' | b'\t') {
        i += 1;
    }
    match after.get(i) {
        Some(b'=') => after.get(i + 1) != Some(&b'='),
        Some(b'+') => after.get(i + 1) == Some(&b'='),
        Some(b':') => after.get(i + 1).is_none_or(|c| matches!(c, b' ' | b'\t')),
        _ => false,
    }
}

/// The judged names in `s` (`NCCL_*`, `UCX_*`), in order.
pub(super) fn names_in(s: &str) -> Vec<&str> {
    let b = s.as_bytes();
    let mut out = Vec::new();
    let mut at = 0;
    while at < b.len() {
        let rest = &b[at..];
        if (rest.starts_with(b"NCCL_") || rest.starts_with(b"UCX_")) && (at == 0 || !name_char(b[at - 1])) {
            let end = at + rest.iter().position(|c| !name_char(*c)).unwrap_or(rest.len());
            out.push(&s[at..end]);
            at = end;
        } else {
            at += 1;
        }
    }
    out
}

/// The names `text` names that the reading of it (`f`) did not account
/// for.
pub(super) fn unaccounted(text: &str, f: &JobFile, shell: bool) -> Vec<Seen> {
    // A shell's comments are where its lexer found them (a `#` inside a
    // string that spans lines is not one); other files' by the line.
    let comment_at: std::collections::HashMap<usize, usize> = f.comments.iter().map(|(l, c)| (*l, *c)).collect();
    let recorded: HashSet<(&str, usize)> = f.assignments.iter().map(|a| (a.name.as_str(), a.line)).chain(f.printed.iter().map(|(n, l)| (n.as_str(), *l))).collect();
    let assigned: HashSet<&str> = f.assignments.iter().map(|a| a.name.as_str()).collect();
    let (mut out, mut named) = (Vec::new(), HashSet::new());
    let mut logical_start = 1;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        if f.stopped_at.is_some_and(|s| n > s) {
            // Never runs.
            break;
        }
        let line = if shell {
            match comment_at.get(&n) {
                Some(col) => raw.char_indices().nth(*col).map_or(raw, |(b, _)| &raw[..b]),
                None => raw,
            }
        } else {
            code(raw)
        };
        let b = line.as_bytes();
        let mut at = 0;
        while at < b.len() {
            let rest = &b[at..];
            let prefix = if rest.starts_with(b"NCCL_") {
                5
            } else if rest.starts_with(b"UCX_") {
                4
            } else {
                at += 1;
                continue;
            };
            if at > 0 && name_char(b[at - 1]) {
                at += prefix;
                continue;
            }
            let end = at + rest.iter().position(|c| !name_char(*c)).unwrap_or(rest.len());
            let name = &line[at..end];
            let before = &b[..at];
            let reference = before.ends_with(b"$") || before.ends_with(b"${") || before.ends_with(b"$(");
            let shaped = assignment_shaped(&b[end..]);
            let ok = recorded.contains(&(name, n))
                || recorded.contains(&(name, logical_start))
                || (!shaped && (reference || assigned.contains(name)));
            let repeat = out.last().is_some_and(|s: &Seen| s.name == name && s.line == n);
            if !ok && !repeat && (out.len() < MAX_SEEN || !named.contains(name)) {
                named.insert(name.to_owned());
                out.push(Seen { name: name.to_owned(), line: n, text: raw.trim().chars().take(120).collect() });
            }
            at = end;
        }
        if !raw.trim_end().ends_with('\\') {
            logical_start = n + 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    fn seen(text: &str) -> Vec<(String, usize)> {
        super::super::read(text).seen.into_iter().map(|s| (s.name, s.line)).collect()
    }

    #[test]
    fn every_name_is_read_or_listed() {
        // Read: nothing listed.
        assert_eq!(seen("export NCCL_IB_HCA=mlx5_0\nmpirun -x NCCL_IB_HCA ./a\necho \"$NCCL_IB_HCA ${NCCL_IB_HCA}\"\n"), vec![]);
        // Commented out: not read, not listed.
        assert_eq!(seen("# export NCCL_IB_DISABLE=1\nexport NCCL_DEBUG=INFO # NCCL_NET=Socket\n"), vec![]);
        // Forms the reading does not take: listed with their lines.
        assert_eq!(seen("sudo -E NCCL_IB_DISABLE=1 python x.py\n"), vec![]);
        assert_eq!(seen("cat > /etc/nccl.conf <<EOF\nNCCL_IB_DISABLE=1\nEOF\npython x.py\n"), vec![("NCCL_IB_DISABLE".into(), 2)]);
        assert_eq!(seen("mylauncher --nccl NCCL_NET=Socket train\n"), vec![("NCCL_NET".into(), 1)]);
        assert_eq!(seen("export X=${NCCL_IB_DISABLE:=1}\n"), vec![("NCCL_IB_DISABLE".into(), 1)]);
        // Passed through but never set here: its value is the caller's.
        assert_eq!(seen("#!/bin/bash\nmpirun -x NCCL_IB_HCA ./a\n"), vec![("NCCL_IB_HCA".into(), 2)]);
        // Printed: accounted for.
        assert_eq!(seen("echo \"NCCL_IB_HCA=$NCCL_IB_HCA\"\n"), vec![]);
        // A Dockerfile's continuation line belongs to its instruction.
        assert_eq!(seen("FROM x\nENV NCCL_ALGO=Ring \\\n    NCCL_PROTO=Simple\n"), vec![]);
    }
}
