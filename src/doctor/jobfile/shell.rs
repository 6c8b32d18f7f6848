//! Shell text as the shell reads it, far enough to find the job's
//! variables: words with their quoting, `$` expansions kept as parts (so
//! a value is expanded from what the file set before it, or said to be
//! unsettled), comments, line continuations, here-documents skipped, and
//! commands split at `;`, `&&`, `||`, `|`, `&` and newlines.

/// One part of a word.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seg {
    /// Text taken as written; `quoted` when inside quotes or escaped (an
    /// `=` there does not make an assignment).
    Lit { text: String, quoted: bool },
    /// `$NAME` or `${NAME}`, with a default operator (`:-`, `-`, `:=`,
    /// `=`, `:+`, `+`, `:?`, `?`) and its operand.
    Param { name: String, op: Option<(String, Vec<Seg>)> },
    /// `$(...)` or `` `...` ``: the inner text.
    Command(String),
    /// Anything else expanded at run time (`$1`, `$@`, `$((...))`,
    /// `${#x}`, `${x%y}`), as written.
    Other(String),
}

/// A word: its parts, its text as written and its line (1-based).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Word {
    pub segs: Vec<Seg>,
    pub raw: String,
    pub line: usize,
}

impl Word {
    /// The word's text when it is plain literal text.
    pub fn literal(&self) -> Option<String> {
        let mut s = String::new();
        for seg in &self.segs {
            match seg {
                Seg::Lit { text, .. } => s.push_str(text),
                _ => return None,
            }
        }
        Some(s)
    }

    /// Splits `NAME=rest` at the first `=` of the word's leading literal
    /// text. With `unquoted`, the name and the `=` must be unquoted, as
    /// the shell requires of an assignment; a launcher's argument
    /// (`-x "NAME=v"`) may be quoted.
    pub fn split_assignment(&self, unquoted: bool) -> Option<(String, Word)> {
        let mut name = String::new();
        for (i, seg) in self.segs.iter().enumerate() {
            let Seg::Lit { text, quoted } = seg else { return None };
            if unquoted && *quoted {
                return None;
            }
            match text.find('=') {
                None => name.push_str(text),
                Some(at) => {
                    name.push_str(&text[..at]);
                    if !is_name(&name) {
                        return None;
                    }
                    let mut segs = Vec::new();
                    if at + 1 < text.len() {
                        segs.push(Seg::Lit { text: text[at + 1..].to_owned(), quoted: *quoted });
                    }
                    segs.extend(self.segs[i + 1..].iter().cloned());
                    let raw = self.raw.split_once('=').map_or(String::new(), |(_, r)| r.to_owned());
                    return Some((name, Word { segs, raw, line: self.line }));
                }
            }
        }
        None
    }
}

/// Whether `s` is a shell variable name.
pub(super) fn is_name(s: &str) -> bool {
    let mut c = s.chars();
    c.next().is_some_and(|f| f.is_ascii_alphabetic() || f == '_') && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// What separates two commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Sep {
    /// `;`, `;;`, `&`, a newline, `(` or `)`.
    End,
    /// `&&`.
    And,
    /// `||`: what follows runs only when what precedes failed.
    Or,
    /// `|`.
    Pipe,
    /// `(`, which after a lone word makes a function.
    Open,
}

/// A token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Tok {
    Word(Word),
    Sep(Sep),
}

/// Splits shell text into words and separators.
pub(super) struct Lexer {
    s: Vec<char>,
    pos: usize,
    line: usize,
    heredocs: Vec<(String, bool)>,
}

impl Lexer {
    /// A lexer over `text`, whose first line is `line`.
    pub fn new(text: &str, line: usize) -> Lexer {
        Lexer { s: text.chars().collect(), pos: 0, line, heredocs: Vec::new() }
    }

    fn peek(&self) -> Option<char> {
        self.s.get(self.pos).copied()
    }

    fn at(&self, k: usize) -> Option<char> {
        self.s.get(self.pos + k).copied()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += 1;
        if c == '\n' {
            self.line += 1;
        }
        Some(c)
    }

    /// The next token, `None` at the end.
    pub fn next_tok(&mut self) -> Option<Tok> {
        loop {
            match self.peek()? {
                ' ' | '\t' | '\r' => {
                    self.pos += 1;
                }
                '\\' if self.at(1) == Some('\n') => {
                    self.bump();
                    self.bump();
                }
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '\n' => {
                    self.bump();
                    self.skip_heredocs();
                    return Some(Tok::Sep(Sep::End));
                }
                ';' => {
                    self.pos += 1;
                    if self.peek() == Some(';') {
                        self.pos += 1;
                    }
                    return Some(Tok::Sep(Sep::End));
                }
                '&' => {
                    self.pos += 1;
                    if self.peek() == Some('&') {
                        self.pos += 1;
                        return Some(Tok::Sep(Sep::And));
                    }
                    return Some(Tok::Sep(Sep::End));
                }
                '|' => {
                    self.pos += 1;
                    if self.peek() == Some('|') {
                        self.pos += 1;
                        return Some(Tok::Sep(Sep::Or));
                    }
                    return Some(Tok::Sep(Sep::Pipe));
                }
                '(' => {
                    self.pos += 1;
                    return Some(Tok::Sep(Sep::Open));
                }
                ')' => {
                    self.pos += 1;
                    return Some(Tok::Sep(Sep::End));
                }
                '<' | '>' => self.redirection(),
                _ => return Some(Tok::Word(self.word())),
            }
        }
    }

    /// Skips a redirection and its target; a here-document's body is
    /// skipped at the end of its line.
    fn redirection(&mut self) {
        let heredoc = self.peek() == Some('<') && self.at(1) == Some('<') && self.at(2) != Some('<');
        let mut last = ' ';
        while let Some(c) = self.peek().filter(|c| matches!(c, '<' | '>' | '&' | '|')) {
            last = c;
            self.pos += 1;
        }
        let strip = heredoc && self.peek() == Some('-');
        if strip {
            self.pos += 1;
        }
        if last == '&' {
            while self.peek().is_some_and(|c| c.is_ascii_digit() || c == '-') {
                self.pos += 1;
            }
            return;
        }
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.pos += 1;
        }
        if self.peek().is_none_or(|c| matches!(c, '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>')) {
            return;
        }
        let target = self.word();
        if heredoc {
            let delim: String = target.segs.iter().map(|s| match s {
                Seg::Lit { text, .. } => text.clone(),
                _ => String::new(),
            }).collect();
            self.heredocs.push((delim, strip));
        }
    }

    fn skip_heredocs(&mut self) {
        for (delim, strip) in std::mem::take(&mut self.heredocs) {
            while self.peek().is_some() {
                let start = self.pos;
                while self.peek().is_some_and(|c| c != '\n') {
                    self.pos += 1;
                }
                let text: String = self.s[start..self.pos].iter().collect();
                self.bump();
                let text = if strip { text.trim_start_matches('\t') } else { text.as_str() };
                if text.trim_end_matches('\r') == delim {
                    break;
                }
            }
        }
    }

    /// All the text as one word, blanks and operators kept as text
    /// (a `${NAME:-a b}` operand, a Compose value).
    pub fn whole_word(&mut self) -> Word {
        let (start, line) = (self.pos, self.line);
        let mut segs = Vec::new();
        while self.peek().is_some() {
            let w = self.word();
            segs.extend(w.segs);
            if let Some(c) = self.bump() {
                lit(&mut segs, c, false);
            }
        }
        Word { segs, raw: self.s[start..].iter().collect(), line }
    }

    /// One word, up to unquoted blank or operator.
    fn word(&mut self) -> Word {
        let (start, line) = (self.pos, self.line);
        let mut segs = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' | '\r' | '\n' | ';' | '&' | '|' | '(' | ')' | '<' | '>' => break,
                '\\' => {
                    self.pos += 1;
                    match self.bump() {
                        Some('\n') | None => {}
                        Some(e) => lit(&mut segs, e, true),
                    }
                }
                '\'' => {
                    self.pos += 1;
                    while let Some(q) = self.bump() {
                        if q == '\'' {
                            break;
                        }
                        lit(&mut segs, q, true);
                    }
                    // An empty '' still quotes: `A=''` is an empty value.
                    lit_str(&mut segs, "", true);
                }
                '"' => {
                    self.pos += 1;
                    self.double_quoted(&mut segs);
                }
                '$' if self.at(1) == Some('\'') => {
                    self.pos += 2;
                    while let Some(q) = self.bump() {
                        match q {
                            '\'' => break,
                            '\\' => match self.bump() {
                                Some('n') => lit(&mut segs, '\n', true),
                                Some('t') => lit(&mut segs, '\t', true),
                                Some(o) => lit(&mut segs, o, true),
                                None => {}
                            },
                            o => lit(&mut segs, o, true),
                        }
                    }
                    lit_str(&mut segs, "", true);
                }
                '$' => self.dollar(&mut segs),
                '`' => self.backtick(&mut segs),
                _ => {
                    self.pos += 1;
                    lit(&mut segs, c, false);
                }
            }
        }
        let raw = self.s[start..self.pos].iter().collect();
        Word { segs, raw, line }
    }

    fn double_quoted(&mut self, segs: &mut Vec<Seg>) {
        lit_str(segs, "", true);
        while let Some(c) = self.peek() {
            match c {
                '"' => {
                    self.pos += 1;
                    return;
                }
                '\\' => {
                    self.pos += 1;
                    match self.bump() {
                        Some('\n') | None => {}
                        Some(e @ ('$' | '`' | '"' | '\\')) => lit(segs, e, true),
                        Some(e) => {
                            lit(segs, '\\', true);
                            lit(segs, e, true);
                        }
                    }
                }
                '$' => self.dollar(segs),
                '`' => self.backtick(segs),
                _ => {
                    self.bump();
                    lit(segs, c, true);
                }
            }
        }
    }

    fn backtick(&mut self, segs: &mut Vec<Seg>) {
        self.pos += 1;
        let mut inner = String::new();
        while let Some(c) = self.bump() {
            match c {
                '`' => break,
                '\\' => inner.extend(self.bump()),
                c => inner.push(c),
            }
        }
        segs.push(Seg::Command(inner));
    }

    /// The text up to the `close` that matches an already consumed open
    /// bracket, quotes respected; the close is consumed.
    fn balanced(&mut self, open: char, close: char) -> String {
        let mut depth = 1;
        let mut out = String::new();
        while let Some(c) = self.bump() {
            match c {
                '\\' => {
                    out.push(c);
                    out.extend(self.bump());
                    continue;
                }
                '\'' | '"' => {
                    out.push(c);
                    while let Some(q) = self.bump() {
                        out.push(q);
                        if q == '\\' && c == '"' {
                            out.extend(self.bump());
                        } else if q == c {
                            break;
                        }
                    }
                    continue;
                }
                c if c == open => depth += 1,
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return out;
                    }
                }
                _ => {}
            }
            out.push(c);
        }
        out
    }

    fn dollar(&mut self, segs: &mut Vec<Seg>) {
        self.pos += 1;
        match self.peek() {
            Some('(') if self.at(1) == Some('(') => {
                self.pos += 2;
                let inner = self.balanced('(', ')');
                // The second closing parenthesis of `$(( ))`.
                if self.peek() == Some(')') {
                    self.pos += 1;
                }
                segs.push(Seg::Other(format!("$(({inner}))")));
            }
            Some('(') => {
                self.pos += 1;
                segs.push(Seg::Command(self.balanced('(', ')')));
            }
            Some('{') => {
                self.pos += 1;
                let inner = self.balanced('{', '}');
                segs.push(braced(&inner));
            }
            Some(c) if c.is_ascii_alphabetic() || c == '_' => {
                let mut name = String::new();
                while let Some(c) = self.peek().filter(|c| c.is_ascii_alphanumeric() || *c == '_') {
                    name.push(c);
                    self.pos += 1;
                }
                segs.push(Seg::Param { name, op: None });
            }
            Some(c) if c.is_ascii_digit() || "@*#?$!-".contains(c) => {
                self.pos += 1;
                segs.push(Seg::Other(format!("${c}")));
            }
            _ => lit(segs, '$', false),
        }
    }
}

/// `${...}`'s inside.
fn braced(inner: &str) -> Seg {
    let name_len = inner.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(inner.len());
    let (name, rest) = inner.split_at(name_len);
    if !is_name(name) {
        return Seg::Other(format!("${{{inner}}}"));
    }
    if rest.is_empty() {
        return Seg::Param { name: name.to_owned(), op: None };
    }
    for op in [":-", ":=", ":+", ":?", "-", "=", "+", "?"] {
        if let Some(operand) = rest.strip_prefix(op) {
            let segs = Lexer::new(operand, 0).whole_word().segs;
            return Seg::Param { name: name.to_owned(), op: Some((op.to_owned(), segs)) };
        }
    }
    Seg::Other(format!("${{{inner}}}"))
}

fn lit(segs: &mut Vec<Seg>, c: char, quoted: bool) {
    let mut b = [0u8; 4];
    lit_str(segs, c.encode_utf8(&mut b), quoted);
}

fn lit_str(segs: &mut Vec<Seg>, s: &str, quoted: bool) {
    if let Some(Seg::Lit { text, quoted: q }) = segs.last_mut() {
        if *q == quoted {
            text.push_str(s);
            return;
        }
    }
    segs.push(Seg::Lit { text: s.to_owned(), quoted });
}
