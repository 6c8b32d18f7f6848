//! Shell text as the shell reads it, far enough to find the job's
//! variables: words with their quoting, `$` expansions kept as parts (so
//! a value is expanded from what the file set before it, or said to be
//! unsettled), comments, line continuations, here-documents (their
//! bodies kept aside, for a shell they are fed to), and commands split at
//! `;`, `&&`, `||`, `|`, `&`, parentheses and newlines.
//!
//! The cost is linear in the text: one buffer shared by every nested
//! reading (a `$( )` body or a `${NAME:-...}` operand is a span of it, not
//! a copy), words keep at most [`RAW_LIMIT`] characters of their text as
//! written, and nesting deeper than [`MAX_NESTING`] is not followed: it is
//! recorded ([`Lexer::too_deep`]) so the reading says it could not tell.

use std::rc::Rc;

/// The deepest nesting of `$( )`, `${...}` and `bash -c` followed; past
/// it the text is left unread and the reading is open.
pub const MAX_NESTING: usize = 64;

/// The most characters of a word's text kept as written (for reports);
/// longer text is cut, never needed whole.
pub(super) const RAW_LIMIT: usize = 256;

/// A stretch of the shared buffer: a `$( )` body or a here-document.
#[derive(Clone, Debug)]
pub(super) struct Span {
    pub buf: Rc<[char]>,
    pub start: usize,
    pub end: usize,
    /// The line of its first character.
    pub line: usize,
    /// How deep inside other text it sits.
    pub depth: usize,
}

impl Span {
    /// Its text, at most `max` characters (an ellipsis marks a cut).
    pub fn preview(&self, max: usize) -> String {
        capped(&self.buf[self.start..self.end], max)
    }

    /// A lexer over it.
    pub fn lexer(&self) -> Lexer {
        Lexer {
            s: self.buf.clone(),
            pos: self.start,
            end: self.end,
            line: self.line,
            depth: self.depth,
            heredocs: Vec::new(),
            bodies: Vec::new(),
            too_deep: None,
            comments: Vec::new(),
            redirected: false,
        }
    }
}

impl PartialEq for Span {
    fn eq(&self, o: &Span) -> bool {
        self.buf[self.start..self.end] == o.buf[o.start..o.end]
    }
}

impl Eq for Span {}

/// `chars` as a string of at most `max` characters.
fn capped(chars: &[char], max: usize) -> String {
    let mut s: String = chars.iter().take(max).collect();
    if chars.len() > max {
        s.push('…');
    }
    s
}

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
    Command(Span),
    /// Anything else expanded at run time (`$1`, `$@`, `$((...))`,
    /// `${#x}`, `${x%y}`), as written.
    Other(String),
}

/// A word: its parts, its text as written (at most [`RAW_LIMIT`]
/// characters) and its line (1-based).
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
        self.split_assignment_op(unquoted).filter(|(_, _, append)| !append).map(|(n, w, _)| (n, w))
    }

    /// [`Word::split_assignment`], `NAME+=value` too (the third: whether
    /// it appends).
    pub fn split_assignment_op(&self, unquoted: bool) -> Option<(String, Word, bool)> {
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
                    let append = name.ends_with('+');
                    if append {
                        name.pop();
                    }
                    if !is_name(&name) {
                        return None;
                    }
                    let mut segs = Vec::new();
                    if at + 1 < text.len() {
                        segs.push(Seg::Lit { text: text[at + 1..].to_owned(), quoted: *quoted });
                    }
                    segs.extend(self.segs[i + 1..].iter().cloned());
                    let raw = self.raw.split_once('=').map_or(String::new(), |(_, r)| r.to_owned());
                    return Some((name, Word { segs, raw, line: self.line }, append));
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
    /// `;`, `;;`, `&` or a newline.
    End,
    /// `&&`.
    And,
    /// `||`: what follows runs only when what precedes failed.
    Or,
    /// `|`.
    Pipe,
    /// `(`: a subshell, or after a lone word a function.
    Open,
    /// `)`: the end of a subshell or of a `case` pattern.
    Close,
}

/// A token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Tok {
    Word(Word),
    Sep(Sep),
}

/// A here-document waiting for its body: its delimiter, whether tabs are
/// stripped.
type Pending = (String, bool);

/// Splits shell text into words and separators.
pub(super) struct Lexer {
    s: Rc<[char]>,
    pos: usize,
    end: usize,
    line: usize,
    /// How deep this text sits inside other text.
    depth: usize,
    heredocs: Vec<Pending>,
    /// Bodies of the here-documents read since [`Lexer::take_bodies`].
    bodies: Vec<Span>,
    /// The first line where nesting went past [`MAX_NESTING`].
    pub too_deep: Option<usize>,
    /// Where each comment starts: `(line, column in characters)`.
    pub comments: Vec<(usize, usize)>,
    /// An output redirection to a file since [`Lexer::take_redirected`].
    redirected: bool,
}

impl Lexer {
    /// A lexer over `text`, whose first line is `line`.
    pub fn new(text: &str, line: usize) -> Lexer {
        let s: Rc<[char]> = text.chars().collect();
        Lexer { end: s.len(), s, pos: 0, line, depth: 0, heredocs: Vec::new(), bodies: Vec::new(), too_deep: None, comments: Vec::new(), redirected: false }
    }

    /// The here-document bodies read since the last call, in order.
    pub fn take_bodies(&mut self) -> Vec<Span> {
        std::mem::take(&mut self.bodies)
    }

    /// The text it reads.
    pub fn buffer(&self) -> Rc<[char]> {
        self.s.clone()
    }

    /// Whether it reads `text`.
    pub fn shares(&self, text: &Rc<[char]>) -> bool {
        Rc::ptr_eq(&self.s, text)
    }

    /// Whether output was redirected to a file since the last call.
    pub fn take_redirected(&mut self) -> bool {
        std::mem::take(&mut self.redirected)
    }

    fn peek(&self) -> Option<char> {
        (self.pos < self.end).then(|| self.s[self.pos])
    }

    fn at(&self, k: usize) -> Option<char> {
        (self.pos + k < self.end).then(|| self.s[self.pos + k])
    }

    fn span(&self, start: usize, end: usize, line: usize) -> Span {
        Span { buf: self.s.clone(), start, end, line, depth: self.depth + 1 }
    }

    /// Whether text one level further in is still followed; records the
    /// line where it is not.
    fn may_nest(&mut self, line: usize) -> bool {
        if self.depth + 1 >= MAX_NESTING {
            self.too_deep.get_or_insert(line);
            return false;
        }
        true
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
                    let col = self.s[..self.pos].iter().rev().take_while(|c| **c != '\n').count();
                    self.comments.push((self.line, col));
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
                '(' if self.at(1) == Some('(') => {
                    // `(( ... ))`: an arithmetic command, one word.
                    let (at, line) = (self.pos, self.line);
                    self.pos += 2;
                    self.balanced('(', ')');
                    if self.peek() == Some(')') {
                        self.pos += 1;
                    }
                    let raw = capped(&self.s[at..self.pos], RAW_LIMIT);
                    return Some(Tok::Word(Word { segs: vec![Seg::Other(raw.clone())], raw, line }));
                }
                '(' => {
                    self.pos += 1;
                    return Some(Tok::Sep(Sep::Open));
                }
                ')' => {
                    self.pos += 1;
                    return Some(Tok::Sep(Sep::Close));
                }
                '<' | '>' if self.at(1) == Some('(') => return Some(Tok::Word(self.word())),
                '<' | '>' => self.redirection(),
                _ => {
                    let w = self.word();
                    // `2>file`, `{fd}>file`: the descriptor of a redirection.
                    let named = w.raw.strip_prefix('{').and_then(|r| r.strip_suffix('}')).is_some_and(is_name);
                    let fd = (named || w.raw.bytes().all(|b| b.is_ascii_digit())) && matches!(self.peek(), Some('<' | '>'));
                    if !fd {
                        return Some(Tok::Word(w));
                    }
                }
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
        if matches!(last, '>' | '|') && target.raw != "/dev/null" {
            self.redirected = true;
        }
        if heredoc {
            self.heredocs.push((delimiter(&target), strip));
        }
    }

    fn skip_heredocs(&mut self) {
        for (delim, strip) in std::mem::take(&mut self.heredocs) {
            let (body_start, body_line) = (self.pos, self.line);
            let mut body_end = self.end;
            while self.peek().is_some() {
                let start = self.pos;
                while self.peek().is_some_and(|c| c != '\n') {
                    self.pos += 1;
                }
                let mut text = &self.s[start..self.pos];
                if strip {
                    while text.first() == Some(&'\t') {
                        text = &text[1..];
                    }
                }
                if text.last() == Some(&'\r') {
                    text = &text[..text.len() - 1];
                }
                let is_delim = text.len() == delim.chars().count() && text.iter().copied().eq(delim.chars());
                if is_delim {
                    body_end = start;
                    self.bump();
                    break;
                }
                self.bump();
            }
            self.bodies.push(Span { buf: self.s.clone(), start: body_start, end: body_end.max(body_start), line: body_line, depth: self.depth + 1 });
        }
    }

    /// All the text as one word, blanks and operators kept as text
    /// (a `${NAME:-a b}` operand, a Compose value).
    pub fn whole_word(&mut self) -> Word {
        let (start, line) = (self.pos, self.line);
        let segs = self.whole_segs();
        Word { segs, raw: capped(&self.s[start..self.end], RAW_LIMIT), line }
    }

    fn whole_segs(&mut self) -> Vec<Seg> {
        let mut segs = Vec::new();
        while self.peek().is_some() {
            let w = self.word();
            segs.extend(w.segs);
            if let Some(c) = self.bump() {
                lit(&mut segs, c, false);
            }
        }
        segs
    }

    /// One word, up to unquoted blank or operator.
    fn word(&mut self) -> Word {
        let (start, line) = (self.pos, self.line);
        let mut segs = Vec::new();
        while let Some(c) = self.peek() {
            match c {
                '<' | '>' if self.at(1) == Some('(') => {
                    // `<( ... )`: a command whose output is read, a subshell.
                    let (at, line) = (self.pos, self.line);
                    self.pos += 2;
                    let seg = self.command_body(at, line);
                    segs.push(seg);
                }
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
                                Some('r') => lit(&mut segs, '\r', true),
                                Some('e' | 'E') => lit(&mut segs, '\x1b', true),
                                Some('a') => lit(&mut segs, '\x07', true),
                                Some('b') => lit(&mut segs, '\x08', true),
                                Some('f') => lit(&mut segs, '\x0c', true),
                                Some('v') => lit(&mut segs, '\x0b', true),
                                Some('x') => {
                                    // `\xHH`: one or two hex digits.
                                    let mut v = 0u32;
                                    let mut n = 0;
                                    while n < 2 && self.peek().is_some_and(|c| c.is_ascii_hexdigit()) {
                                        v = v * 16 + self.bump().and_then(|c| c.to_digit(16)).unwrap_or(0);
                                        n += 1;
                                    }
                                    if n == 0 {
                                        lit(&mut segs, '\\', true);
                                        lit(&mut segs, 'x', true);
                                    } else {
                                        lit(&mut segs, char::from_u32(v).unwrap_or('?'), true);
                                    }
                                }
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
        let raw = capped(&self.s[start..self.pos], RAW_LIMIT);
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
        let (start, line) = (self.pos, self.line);
        let mut inner = String::new();
        while let Some(c) = self.bump() {
            match c {
                '`' => break,
                '\\' => inner.extend(self.bump()),
                c => inner.push(c),
            }
        }
        // Backquotes do not nest without escapes, so the body is read from
        // its own (unescaped) text.
        let mut body = Lexer::new(&inner, line);
        body.depth = self.depth + 1;
        if self.may_nest(line) {
            segs.push(Seg::Command(Span { buf: body.s, start: 0, end: body.end, line, depth: self.depth + 1 }));
        } else {
            segs.push(Seg::Other(capped(&self.s[start - 1..self.pos], RAW_LIMIT)));
        }
    }

    /// Where the text up to the `close` that matches an already consumed
    /// open bracket ends, quotes respected; the close is consumed. A loop,
    /// not a recursion: nesting costs no stack.
    ///
    /// As the shell finds the end: a comment's brackets do not count, nor a
    /// here-document body's, nor a `case` pattern's `)` (`case` ... `esac`
    /// words are counted).
    fn balanced(&mut self, open: char, close: char) -> usize {
        let mut depth = 1usize;
        let mut cases = 0usize;
        let mut pending: Vec<Pending> = Vec::new();
        let mut word = String::new();
        // Whether the next character starts a word.
        let mut at_start = true;
        while let Some(c) = self.bump() {
            let starts = at_start;
            at_start = c.is_whitespace() || matches!(c, ';' | '&' | '|' | '(' | ')');
            if c.is_ascii_alphanumeric() || c == '_' {
                word.push(c);
            } else {
                match word.as_str() {
                    "case" => cases += 1,
                    "esac" => cases = cases.saturating_sub(1),
                    _ => {}
                }
                word.clear();
            }
            match c {
                '\\' => {
                    self.bump();
                }
                '\'' | '"' => {
                    while let Some(q) = self.bump() {
                        if q == '\\' && c == '"' {
                            self.bump();
                        } else if q == c {
                            break;
                        }
                    }
                }
                '#' if starts => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.pos += 1;
                    }
                }
                '<' if self.peek() == Some('<') && self.at(1) != Some('<') => {
                    self.pos += 1;
                    let strip = self.peek() == Some('-');
                    if strip {
                        self.pos += 1;
                    }
                    while matches!(self.peek(), Some(' ' | '\t')) {
                        self.pos += 1;
                    }
                    let target = self.word();
                    pending.push((delimiter(&target), strip));
                }
                '\n' if !pending.is_empty() => {
                    let saved = std::mem::replace(&mut self.heredocs, std::mem::take(&mut pending));
                    let bodies = self.bodies.len();
                    self.skip_heredocs();
                    self.bodies.truncate(bodies);
                    self.heredocs = saved;
                }
                c if c == open => depth += 1,
                c if c == close && close == ')' && cases > 0 => {}
                c if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return self.pos - 1;
                    }
                }
                _ => {}
            }
        }
        self.pos
    }

    fn dollar(&mut self, segs: &mut Vec<Seg>) {
        let (at, line) = (self.pos, self.line);
        self.pos += 1;
        match self.peek() {
            Some('(') if self.at(1) == Some('(') => {
                self.pos += 2;
                self.balanced('(', ')');
                // The second closing parenthesis of `$(( ))`.
                if self.peek() == Some(')') {
                    self.pos += 1;
                }
                segs.push(Seg::Other(capped(&self.s[at..self.pos], RAW_LIMIT)));
            }
            Some('(') => {
                self.pos += 1;
                let seg = self.command_body(at, line);
                segs.push(seg);
            }
            Some('{') => {
                self.pos += 1;
                let start = self.pos;
                let end = self.balanced('{', '}');
                if self.may_nest(line) {
                    let seg = self.braced(start, end, line);
                    segs.push(seg);
                } else {
                    segs.push(Seg::Other(capped(&self.s[at..self.pos], RAW_LIMIT)));
                }
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

    /// A command's body after its `(` (`$(`, `<(`), up to its `)`: a span
    /// to read one level further in, or past [`MAX_NESTING`] the text from
    /// `at`, unread.
    fn command_body(&mut self, at: usize, line: usize) -> Seg {
        let start = self.pos;
        let end = self.balanced('(', ')');
        if self.may_nest(line) {
            Seg::Command(self.span(start, end, line))
        } else {
            Seg::Other(capped(&self.s[at..self.pos], RAW_LIMIT))
        }
    }

    /// `${...}`'s inside, `start..end` of the buffer; an operand is read
    /// one level further in (its nesting bounded by [`MAX_NESTING`]).
    fn braced(&mut self, start: usize, end: usize, line: usize) -> Seg {
        let inner = &self.s[start..end];
        let other = || Seg::Other(format!("${{{}}}", capped(inner, RAW_LIMIT)));
        let name_len = inner.iter().position(|c| !(c.is_ascii_alphanumeric() || *c == '_')).unwrap_or(inner.len());
        let name: String = inner[..name_len].iter().collect();
        if !is_name(&name) {
            return other();
        }
        let rest = &inner[name_len..];
        if rest.is_empty() {
            return Seg::Param { name, op: None };
        }
        for op in [":-", ":=", ":+", ":?", "-", "=", "+", "?"] {
            let n = op.len();
            if rest.len() >= n && rest[..n].iter().copied().eq(op.chars()) {
                let mut sub = self.span(start + name_len + n, end, line).lexer();
                let segs = sub.whole_segs();
                if let Some(l) = sub.too_deep {
                    self.too_deep.get_or_insert(l);
                }
                return Seg::Param { name, op: Some((op.to_owned(), segs)) };
            }
        }
        other()
    }
}

/// A here-document's delimiter: its word's text, quotes removed.
fn delimiter(target: &Word) -> String {
    target
        .segs
        .iter()
        .map(|s| match s {
            Seg::Lit { text, .. } => text.clone(),
            _ => String::new(),
        })
        .collect()
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
