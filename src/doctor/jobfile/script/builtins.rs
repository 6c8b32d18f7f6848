//! The builtins whose changes stay in the script's shell: `export` and
//! its kin, `unset`, `set`, `shopt`, `let`, `source`, `eval`, `read` and
//! its kin, `exit`.

use super::super::shell::{is_name, Word};
use super::super::{Form, Value};
use super::{base, lit, Reader};

impl Reader {
    /// The builtins whose changes stay in the script's shell.
    pub(super) fn builtin(&mut self, words: &[Word], cond: Option<&str>, unconditional: bool, in_function: bool) {
        let line = words[0].line;
        let name = base(&words[0]);
        let rest = &words[1..];
        match name.as_str() {
            "local" if !in_function => {
                // Outside a function `local` is an error: nothing is set.
            }
            "export" | "declare" | "typeset" | "readonly" | "local" => {
                let opts: String = rest.iter().map(lit).filter(|w| w.starts_with('-')).collect();
                let plus: String = rest.iter().map(lit).filter(|w| w.starts_with('+')).collect();
                let named = rest.iter().any(|w| !w.raw.starts_with(['-', '+']));
                // Functions, or a listing (`export -p NAME` still exports NAME).
                if opts.contains('f') || !named || (opts.contains('p') && name != "export") {
                    return;
                }
                // `-i`, `-l`, `-u`: what is assigned later is transformed
                // (evaluated, case-changed), so not taken as written.
                let transforms = opts.contains('i') || opts.contains('l') || opts.contains('u');
                // `export -n` and `declare +x` take the mark away.
                let unexports = (name == "export" && opts.contains('n')) || plus.contains('x');
                let exports = !unexports && (name == "export" || opts.contains('x'));
                let readonly = name == "readonly" || opts.contains('r');
                let nameref = name != "export" && opts.contains('n');
                for w in rest.iter().filter(|w| !w.raw.starts_with(['-', '+'])) {
                    let (n, value, append) = match w.split_assignment_op(false) {
                        Some((n, value, append)) => (n, Some(value), append),
                        None if is_name(&lit(w)) => (lit(w), None, false),
                        // A name only running the script settles
                        // (`export $V=0`, brace expansion).
                        None => return self.opaque(line, &format!("names a variable as `{}`", super::super::shown(&w.raw))),
                    };
                    if transforms {
                        self.transformed.insert(n.clone());
                    }
                    if nameref {
                        // Assignments to the reference reach another name.
                        return self.opaque(line, &format!("makes `{n}` a reference to another variable"));
                    }
                    let refused = value.is_some() && self.vars.get(&n).is_some_and(|v| v.readonly == Some(self.proc));
                    if refused && name != "export" {
                        // `declare -x NAME=v` on a read-only NAME fails whole:
                        // recorded as read, nothing changes.
                        if let Some(value) = &value {
                            let v = self.expand(value);
                            self.f.set(n, Some(v), w.line, Form::Shell);
                        }
                        continue;
                    }
                    if let Some(value) = value {
                        // `export` of a read-only variable refuses the value,
                        // not the mark.
                        if exports && refused {
                            self.flag(&n, true, false);
                        }
                        let v = self.value_of(&n, &value, append);
                        self.assign(n.clone(), v, w.line, if exports { Form::Export } else { Form::Shell }, cond);
                    }
                    if exports || readonly {
                        self.flag(&n, exports, readonly);
                    }
                    if unexports {
                        if let Some(mut v) = self.vars.get(&n).copied() {
                            v.exported = false;
                            self.put(&n, Some(v));
                        }
                    }
                }
            }
            "unset" => {
                for w in rest {
                    match lit(w).as_str() {
                        "-v" => {}
                        "-f" => return,
                        n if is_name(n) => self.unset(n.to_owned(), w.line, cond),
                        _ => return self.opaque(line, &format!("unsets `{}`", super::super::shown(&w.raw))),
                    }
                }
            }
            "set" => {
                // `-a`/`+a`, `-o allexport`/`+o allexport`, in order: the
                // last one of each option wins.
                let all: Vec<String> = rest.iter().map(lit).collect();
                let mut k = 0;
                while let Some(w) = all.get(k) {
                    let on = w.starts_with('-');
                    if !(on || w.starts_with('+')) || w == "--" || w == "-" {
                        break;
                    }
                    // Each letter an option; `o` takes the next word's name.
                    let mut names: Vec<String> = w[1..].chars().filter(|c| *c != 'o').map(|c| c.to_string()).collect();
                    if w[1..].contains('o') {
                        k += 1;
                        names.extend(all.get(k).cloned());
                    }
                    for n in names {
                        match n.as_str() {
                            "a" | "allexport" => self.allexport = on,
                            "e" | "errexit" => self.errexit = on,
                            "posix" => self.posix = on,
                            "k" | "keyword" if on => self.opaque(line, "`set -k` makes any NAME=value word an assignment"),
                            _ => {}
                        }
                    }
                    k += 1;
                }
            }
            "let" => {
                // Arithmetic: a judged name in it may be assigned.
                for w in rest {
                    self.arithmetic(&w.raw, w.line);
                }
            }
            "shopt" => {
                if rest.iter().any(|w| lit(w) == "-s") && rest.iter().any(|w| lit(w) == "lastpipe") {
                    self.lastpipe = true;
                }
            }
            "source" | "." => {
                let file = rest.first().map_or_else(String::new, |w| super::super::shown(&w.raw));
                self.opaque(line, &format!("reads {file}"));
            }
            "eval" => self.opaque(line, "runs `eval`"),
            "read" | "mapfile" | "readarray" | "getopts" | "printf" => {
                // The names they assign, with values only running them settles.
                let targets: Vec<&Word> = match name.as_str() {
                    "printf" => rest.iter().skip_while(|w| lit(w) != "-v").nth(1).into_iter().collect(),
                    "getopts" => rest.get(1).into_iter().collect(),
                    _ => rest.iter().filter(|w| !lit(w).starts_with('-')).collect(),
                };
                for w in targets {
                    match w.literal().filter(|n| is_name(n)) {
                        Some(n) => {
                            let why = format!("set by `{name}` on line {line}: only running it settles it");
                            self.assign(n, Value::Unknown { text: format!("({name})"), why }, line, Form::Shell, cond);
                        }
                        None if name != "read" && name != "mapfile" && name != "readarray" => {}
                        None => {}
                    }
                }
                if rest.iter().any(|w| w.literal().is_none() && !w.raw.starts_with('-')) && name != "printf" {
                    self.opaque(line, &format!("`{name}` into a name only running it settles"));
                }
            }
            ":" | "true" => {}
            _ => {
                // `exit`.
                if unconditional {
                    self.stop(line);
                }
            }
        }
    }
}
