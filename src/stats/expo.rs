//! A reader of the Prometheus text exposition format (version 0.0.4), the
//! subset the engine's endpoint writes: `# HELP` and `# TYPE` comments
//! (other comments skipped), and sample lines `name{label="value",...}
//! value [timestamp]`, label values escaped as the format says (`\\`,
//! `\"`, `\n`, nothing else). The text comes from the network: every
//! malformed line is an [`ExpoError`] naming its line number, never a
//! panic; lines, their length and a sample's labels are bounded; a value
//! that is not a finite number and a series given twice are errors too.

use std::collections::{BTreeMap, HashMap};

/// The most lines read from one exposition.
pub const MAX_LINES: usize = 1 << 20;
/// The most bytes one line may take.
pub const MAX_LINE: usize = 64 << 10;
/// The most labels one sample may have.
pub const MAX_LABELS: usize = 32;

/// A sample's labels: (name, value), sorted by name, each name once.
pub type Labels = Vec<(String, String)>;

/// One sample: a series (name and labels) and its value.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The metric's name.
    pub name: String,
    /// Its labels, sorted by name, each name once; values unescaped.
    pub labels: Labels,
    /// The value, finite.
    pub value: f64,
    /// The value as a count, when it is a whole number from 0 to
    /// `u64::MAX`: exact when written in digits (the engine's counters of
    /// bytes outgrow an `f64`'s 53 bits), else as the float says
    /// (prometheus_client writes `3.145728e+06`).
    pub count: Option<u64>,
    /// The line it was read from (1-based).
    pub line: usize,
}

impl Sample {
    /// The value of label `name`.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// A metric family's declared type (`# TYPE`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up, until its process restarts.
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, a sum and a count.
    Histogram,
    /// Quantiles, a sum and a count.
    Summary,
    /// Declared untyped.
    Untyped,
}

/// An exposition, read.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exposition {
    /// Every sample, in the order given.
    pub samples: Vec<Sample>,
    /// The families' declared types, by name.
    pub types: BTreeMap<String, Kind>,
}

impl Exposition {
    /// The samples of metric `name`.
    pub fn family<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }
}

/// Why a line is not part of the format. Text quoted from the input is
/// escaped and cut short.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Malformed {
    /// Longer than [`MAX_LINE`].
    #[error("longer than {max} bytes")]
    TooLong {
        /// The bound.
        max: usize,
    },
    /// A metric name was expected here.
    #[error("no metric name at {at}")]
    BadName {
        /// What stood there.
        at: String,
    },
    /// A label name, `=` or an opening quote was expected here.
    #[error("a label (name=\"value\") expected at {at}")]
    BadLabel {
        /// What stood there.
        at: String,
    },
    /// A label value's escape other than `\\`, `\"`, `\n`.
    #[error("escape \\{escape} in a label value (only \\\\, \\\" and \\n are allowed)")]
    BadEscape {
        /// The character after the backslash (escaped for display).
        escape: String,
    },
    /// The line ended inside a label value or before `}`.
    #[error("the labels are not closed")]
    Unclosed,
    /// A label given twice in one sample.
    #[error("label {name} given twice")]
    DuplicateLabel {
        /// The label's name.
        name: String,
    },
    /// More than [`MAX_LABELS`] labels.
    #[error("more than {max} labels")]
    TooManyLabels {
        /// The bound.
        max: usize,
    },
    /// Not a number.
    #[error("value {text} is not a number")]
    BadValue {
        /// The text given.
        text: String,
    },
    /// NaN or an infinity: nothing a rate can be worked out from.
    #[error("value {text} is not a finite number")]
    NotFinite {
        /// The text given.
        text: String,
    },
    /// No value after the series.
    #[error("no value")]
    NoValue,
    /// A timestamp that is not a whole number of milliseconds.
    #[error("timestamp {text} is not a whole number")]
    BadTimestamp {
        /// The text given.
        text: String,
    },
    /// More after the value and timestamp.
    #[error("unexpected text after the value: {text}")]
    Trailing {
        /// The text.
        text: String,
    },
    /// A `# HELP` or `# TYPE` line without its metric name (or type).
    #[error("a {what} comment without its metric name or type")]
    BadComment {
        /// `HELP` or `TYPE`.
        what: &'static str,
    },
    /// A `# TYPE` other than counter, gauge, histogram, summary, untyped.
    #[error("unknown type {kind}")]
    UnknownType {
        /// The type given.
        kind: String,
    },
    /// A second `# TYPE` for a family.
    #[error("a second TYPE for {name}")]
    DuplicateType {
        /// The family.
        name: String,
    },
    /// The same series (name and labels) given twice.
    #[error("series {series} already given on line {first}")]
    DuplicateSeries {
        /// The series.
        series: String,
        /// Where it was first given.
        first: usize,
    },
}

/// Why an exposition was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExpoError {
    /// A line that is not part of the format.
    #[error("line {line}: {why}")]
    Line {
        /// The line (1-based).
        line: usize,
        /// What is wrong with it.
        why: Malformed,
    },
    /// More than [`MAX_LINES`] lines.
    #[error("more than {max} lines")]
    TooManyLines {
        /// The bound.
        max: usize,
    },
}

/// Input text as it may be shown: escaped (no control characters reach
/// a terminal) and cut to 40 characters.
pub(crate) fn shown(text: &str) -> String {
    let mut out: String = text.chars().take(40).flat_map(char::escape_debug).collect();
    if text.chars().nth(40).is_some() {
        out.push('…');
    }
    format!("\"{out}\"")
}

/// Reads `text`.
///
/// # Errors
/// The first malformed line, by number, or too many lines.
pub fn parse(text: &str) -> Result<Exposition, ExpoError> {
    let mut out = Exposition::default();
    let mut seen: HashMap<(String, Labels), usize> = HashMap::new();
    for (i, raw) in text.split('\n').enumerate() {
        let line = i + 1;
        if line > MAX_LINES {
            return Err(ExpoError::TooManyLines { max: MAX_LINES });
        }
        let at = |why| ExpoError::Line { line, why };
        if raw.len() > MAX_LINE {
            return Err(at(Malformed::TooLong { max: MAX_LINE }));
        }
        let l = raw.strip_suffix('\r').unwrap_or(raw).trim_matches([' ', '\t']);
        if l.is_empty() {
            continue;
        }
        if let Some(comment) = l.strip_prefix('#') {
            comment_line(comment, &mut out.types).map_err(at)?;
            continue;
        }
        let mut sample = sample_line(l).map_err(at)?;
        sample.line = line;
        let key = (sample.name.clone(), sample.labels.clone());
        if let Some(&first) = seen.get(&key) {
            return Err(at(Malformed::DuplicateSeries { series: series_name(&sample), first }));
        }
        seen.insert(key, line);
        out.samples.push(sample);
    }
    Ok(out)
}

/// `name{a="x",...}` for messages, escaped.
fn series_name(s: &Sample) -> String {
    let labels: Vec<String> = s.labels.iter().map(|(k, v)| format!("{k}={}", shown(v))).collect();
    format!("{}{{{}}}", s.name, labels.join(","))
}

/// A comment: `HELP` and `TYPE` are checked, anything else skipped.
fn comment_line(comment: &str, types: &mut BTreeMap<String, Kind>) -> Result<(), Malformed> {
    let mut words = comment.split([' ', '\t']).filter(|w| !w.is_empty());
    match words.next() {
        Some("HELP") => {
            let name = words.next().ok_or(Malformed::BadComment { what: "HELP" })?;
            metric_name(name).filter(|(_, rest)| rest.is_empty()).ok_or(Malformed::BadComment { what: "HELP" })?;
            Ok(())
        }
        Some("TYPE") => {
            let (Some(name), Some(kind), None) = (words.next(), words.next(), words.next()) else { return Err(Malformed::BadComment { what: "TYPE" }) };
            metric_name(name).filter(|(_, rest)| rest.is_empty()).ok_or(Malformed::BadComment { what: "TYPE" })?;
            let kind = match kind {
                "counter" => Kind::Counter,
                "gauge" => Kind::Gauge,
                "histogram" => Kind::Histogram,
                "summary" => Kind::Summary,
                "untyped" => Kind::Untyped,
                other => return Err(Malformed::UnknownType { kind: shown(other) }),
            };
            if types.insert(name.to_owned(), kind).is_some() {
                return Err(Malformed::DuplicateType { name: name.to_owned() });
            }
            Ok(())
        }
        _ => Ok(()),
    }
}

/// A metric name at the start of `s` (`[a-zA-Z_:][a-zA-Z0-9_:]*`) and
/// what follows it.
fn metric_name(s: &str) -> Option<(&str, &str)> {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(s.len());
    let (name, rest) = s.split_at(end);
    name.chars().next().filter(|c| !c.is_ascii_digit()).map(|_| (name, rest))
}

/// A label name at the start of `s` (`[a-zA-Z_][a-zA-Z0-9_]*`) and what
/// follows it.
fn label_name(s: &str) -> Option<(&str, &str)> {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    let (name, rest) = s.split_at(end);
    name.chars().next().filter(|c| !c.is_ascii_digit()).map(|_| (name, rest))
}

fn skip_blanks(s: &str) -> &str {
    s.trim_start_matches([' ', '\t'])
}

/// A sample line (already trimmed, not a comment).
fn sample_line(l: &str) -> Result<Sample, Malformed> {
    let (name, rest) = metric_name(l).ok_or_else(|| Malformed::BadName { at: shown(l) })?;
    let (labels, rest) = match rest.strip_prefix('{') {
        Some(inside) => labels(inside)?,
        None => (Vec::new(), rest),
    };
    if !rest.is_empty() && !rest.starts_with([' ', '\t']) {
        // `name{...}5` or `name-x 5`.
        let braced = l.get(name.len()..).is_some_and(|r| r.starts_with('{'));
        return Err(if braced { Malformed::BadValue { text: shown(rest) } } else { Malformed::BadName { at: shown(l) } });
    }
    let mut words = rest.split([' ', '\t']).filter(|w| !w.is_empty());
    let text = words.next().ok_or(Malformed::NoValue)?;
    let (value, count) = value(text)?;
    if let Some(ts) = words.next() {
        ts.parse::<i64>().map_err(|_| Malformed::BadTimestamp { text: shown(ts) })?;
    }
    if let Some(more) = words.next() {
        return Err(Malformed::Trailing { text: shown(more) });
    }
    Ok(Sample { name: name.to_owned(), labels, value, count, line: 0 })
}

/// The labels after `{`, up to and past `}`: sorted, and what follows.
fn labels(mut s: &str) -> Result<(Labels, &str), Malformed> {
    let mut out = Labels::new();
    loop {
        s = skip_blanks(s);
        if let Some(rest) = s.strip_prefix('}') {
            out.sort();
            return Ok((out, rest));
        }
        if s.is_empty() {
            return Err(Malformed::Unclosed);
        }
        if out.len() == MAX_LABELS {
            return Err(Malformed::TooManyLabels { max: MAX_LABELS });
        }
        let bad = |at: &str| Malformed::BadLabel { at: shown(at) };
        let (name, rest) = label_name(s).ok_or_else(|| bad(s))?;
        let rest = skip_blanks(rest).strip_prefix('=').ok_or_else(|| bad(rest))?;
        let rest = skip_blanks(rest);
        let inside = rest.strip_prefix('"').ok_or_else(|| bad(rest))?;
        let (value, rest) = label_value(inside)?;
        if out.iter().any(|(k, _)| k == name) {
            return Err(Malformed::DuplicateLabel { name: name.to_owned() });
        }
        out.push((name.to_owned(), value));
        let rest = skip_blanks(rest);
        s = match rest.strip_prefix(',') {
            Some(r) => r,
            None if rest.starts_with('}') => rest,
            None if rest.is_empty() => return Err(Malformed::Unclosed),
            None => return Err(bad(rest)),
        };
    }
}

/// A label value after its opening quote, unescaped, and what follows
/// its closing quote.
fn label_value(s: &str) -> Result<(String, &str), Malformed> {
    let mut out = String::new();
    let mut chars = s.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '"' => return Ok((out, &s[i + 1..])),
            '\\' => match chars.next() {
                Some((_, '\\')) => out.push('\\'),
                Some((_, '"')) => out.push('"'),
                Some((_, 'n')) => out.push('\n'),
                Some((_, other)) => return Err(Malformed::BadEscape { escape: other.escape_debug().to_string() }),
                None => return Err(Malformed::Unclosed),
            },
            c => out.push(c),
        }
    }
    Err(Malformed::Unclosed)
}

/// A sample's value: finite, and exact when a whole number.
fn value(text: &str) -> Result<(f64, Option<u64>), Malformed> {
    let lower = text.to_ascii_lowercase();
    let unsigned = lower.trim_start_matches(['+', '-']);
    if unsigned == "nan" || unsigned == "inf" || unsigned == "infinity" {
        return Err(Malformed::NotFinite { text: shown(text) });
    }
    if !text.bytes().all(|b| b.is_ascii_digit() || matches!(b, b'.' | b'e' | b'E' | b'+' | b'-')) {
        return Err(Malformed::BadValue { text: shown(text) });
    }
    let v: f64 = text.parse().map_err(|_| Malformed::BadValue { text: shown(text) })?;
    if !v.is_finite() {
        return Err(Malformed::NotFinite { text: shown(text) });
    }
    // 2^64, exactly representable: every whole f64 below it fits a u64.
    const BEYOND: f64 = 18_446_744_073_709_551_616.0;
    let count = match text.parse::<u64>() {
        Ok(n) => Some(n),
        Err(_) if v >= 0.0 && v.fract() == 0.0 && v < BEYOND => Some(v as u64),
        Err(_) => None,
    };
    Ok((v, count))
}

#[cfg(test)]
#[path = "expo_tests.rs"]
mod tests;
