//! The exposition reader on what the engine writes and on hostile text.

use super::*;

fn malformed(text: &str) -> (usize, Malformed) {
    match parse(text) {
        Err(ExpoError::Line { line, why }) => (line, why),
        other => panic!("{text:?} read as {other:?}"),
    }
}

#[test]
fn reads_what_the_engine_writes() {
    let text = "# HELP gpudirect_bytes_total Bytes this agent's NICs moved.\n\
                # TYPE gpudirect_bytes_total counter\n\
                gpudirect_bytes_total{agent=\"a\\\"b\\\\c\\nd\",nic=\"mlx5_0\",direction=\"out\",path=\"gdr\"} 18446744073709551615\n\
                # TYPE gpudirect_request_seconds histogram\n\
                gpudirect_request_seconds_bucket{agent=\"a\",op=\"write\",le=\"+Inf\"} 3\n\
                gpudirect_request_seconds_sum{agent=\"a\",op=\"write\"} 0.000125\n\
                gpudirect_other_peers{agent=\"a\"} 0 1700000000000\n\
                # a comment of another kind\n\
                up 1\n";
    let e = parse(text).unwrap();
    assert_eq!(e.types.get("gpudirect_bytes_total"), Some(&Kind::Counter));
    assert_eq!(e.types.get("gpudirect_request_seconds"), Some(&Kind::Histogram));
    let b = e.family("gpudirect_bytes_total").next().unwrap();
    assert_eq!(b.label("agent"), Some("a\"b\\c\nd"));
    assert_eq!(b.label("path"), Some("gdr"));
    assert_eq!(b.count, Some(u64::MAX), "counters are exact past 2^53");
    assert_eq!(b.line, 3);
    assert_eq!(b.labels.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["agent", "direction", "nic", "path"]);
    let sum = e.family("gpudirect_request_seconds_sum").next().unwrap();
    assert!((sum.value - 0.000125).abs() < 1e-12 && sum.count.is_none());
    assert_eq!(e.family("gpudirect_other_peers").next().unwrap().count, Some(0));
    assert_eq!(e.family("up").next().unwrap().labels, []);
    assert_eq!(e.samples.len(), 5);
    // Spaces inside the braces, a trailing comma, CRLF line ends.
    let e = parse("x{ a = \"1\" , b=\"2\", } 7\r\ny 1e3\r\n").unwrap();
    assert_eq!(e.samples[0].labels, [("a".into(), "1".into()), ("b".into(), "2".into())]);
    assert_eq!(e.samples[1].value, 1000.0);
    assert_eq!(parse("").unwrap(), Exposition::default());
    // prometheus_client's floats (gpudirect.metrics.Collector in a Python
    // process) are counts when whole.
    let e = parse("a 3.145728e+06\nb 4.0\nc 1.5\nd -1\ne 1e30\nf +7\n").unwrap();
    let counts: Vec<Option<u64>> = e.samples.iter().map(|s| s.count).collect();
    assert_eq!(counts, [Some(3_145_728), Some(4), None, None, None, Some(7)]);
}

#[test]
fn not_a_number_is_refused() {
    for v in ["NaN", "nan", "+Inf", "-Inf", "inf", "Infinity", "1e999", "-1e400"] {
        let (line, why) = malformed(&format!("ok 1\nx{{a=\"b\"}} {v}\n"));
        assert_eq!(line, 2);
        assert!(matches!(why, Malformed::NotFinite { .. }), "{v}: {why:?}");
    }
    for v in ["0x10", "1_000", "one", "1,5", "--1", "1e", "\u{661}"] {
        assert!(matches!(malformed(&format!("x {v}")).1, Malformed::BadValue { .. }), "{v}");
    }
    assert_eq!(malformed("x").1, Malformed::NoValue);
    assert_eq!(malformed("x{a=\"b\"}").1, Malformed::NoValue);
    assert!(matches!(malformed("x{a=\"b\"}5").1, Malformed::BadValue { .. }));
    assert!(matches!(malformed("x 1 12.5").1, Malformed::BadTimestamp { .. }));
    assert!(matches!(malformed("x 1 2 3").1, Malformed::Trailing { .. }));
}

#[test]
fn bad_escapes_and_unclosed_labels_are_refused() {
    let (line, why) = malformed("# TYPE x counter\nx{a=\"\\t\"} 1");
    assert_eq!((line, why), (2, Malformed::BadEscape { escape: "t".into() }));
    assert!(matches!(malformed("x{a=\"\\u0041\"} 1").1, Malformed::BadEscape { .. }));
    assert_eq!(malformed("x{a=\"b\\").1, Malformed::Unclosed);
    assert_eq!(malformed("x{a=\"b").1, Malformed::Unclosed);
    assert_eq!(malformed("x{a=\"b\"").1, Malformed::Unclosed);
    assert!(matches!(malformed("x{a=\"b\" 1").1, Malformed::BadLabel { .. }));
    assert!(matches!(malformed("x{a=b} 1").1, Malformed::BadLabel { .. }));
    assert!(matches!(malformed("x{=\"b\"} 1").1, Malformed::BadLabel { .. }));
    assert!(matches!(malformed("x{1a=\"b\"} 1").1, Malformed::BadLabel { .. }));
    assert!(matches!(malformed("x{a=\"b\" c=\"d\"} 1").1, Malformed::BadLabel { .. }));
    assert!(matches!(malformed("{a=\"b\"} 1").1, Malformed::BadName { .. }));
    assert!(matches!(malformed("9x 1").1, Malformed::BadName { .. }));
    assert!(matches!(malformed("x-y 1").1, Malformed::BadName { .. }));
    assert_eq!(malformed("x{a=\"1\",a=\"2\"} 1").1, Malformed::DuplicateLabel { name: "a".into() });
}

/// A name that tries to close its quote and start a series of its own is
/// read as a name when escaped, and refused when not.
#[test]
fn label_injection_stays_a_label_value() {
    let e = parse("x{agent=\"a\\\"} 999\\ny{agent=\\\"b\",nic=\"n\"} 1\n").unwrap();
    assert_eq!(e.samples.len(), 1);
    assert_eq!(e.samples[0].label("agent"), Some("a\"} 999\ny{agent=\"b"));
    assert_eq!(e.samples[0].value, 1.0);
    // Unescaped, the quote ends the value and what follows is not a label.
    assert!(matches!(malformed("x{agent=\"a\"} 999\"} 1").1, Malformed::BadValue { .. }));
    assert!(matches!(malformed("x{agent=\"a\",b=\"x\"y\"} 1").1, Malformed::BadLabel { .. }));
    // A control character in an error message is escaped, not sent to the
    // terminal.
    let e = parse("x{a=\"b\"} \u{1b}[2J").unwrap_err().to_string();
    assert!(!e.contains('\u{1b}') && e.contains("\\u{1b}"), "{e}");
}

#[test]
fn a_series_given_twice_is_refused() {
    let (line, why) = malformed("x{a=\"1\",b=\"2\"} 1\ny 2\nx{b=\"2\",a=\"1\"} 3\n");
    assert_eq!(line, 3);
    assert!(matches!(why, Malformed::DuplicateSeries { first: 1, .. }), "{why:?}");
    assert!(matches!(malformed("x 1\nx 1").1, Malformed::DuplicateSeries { first: 1, .. }));
    // The same labels under other names are other series.
    assert!(parse("x{a=\"1\"} 1\nx{a=\"2\"} 1\nz{a=\"1\"} 1\n").is_ok());
    assert!(matches!(malformed("# TYPE x counter\n# TYPE x gauge\n").1, Malformed::DuplicateType { .. }));
}

#[test]
fn comments_are_checked_where_they_declare() {
    assert!(matches!(malformed("# TYPE x").1, Malformed::BadComment { what: "TYPE" }));
    assert!(matches!(malformed("# TYPE x counter extra").1, Malformed::BadComment { what: "TYPE" }));
    assert!(matches!(malformed("# TYPE x{a=\"b\"} counter").1, Malformed::BadComment { what: "TYPE" }));
    assert!(matches!(malformed("# TYPE x meter").1, Malformed::UnknownType { .. }));
    assert!(matches!(malformed("# HELP").1, Malformed::BadComment { what: "HELP" }));
    assert!(parse("# HELP x any text at all: \"quotes\", \\ and {braces}\n#\n# EOF\n").is_ok());
}

#[test]
fn sizes_are_bounded() {
    let long = format!("x{{a=\"{}\"}} 1", "a".repeat(MAX_LINE));
    assert_eq!(malformed(&format!("ok 1\n{long}")), (2, Malformed::TooLong { max: MAX_LINE }));
    let many: String = (0..=MAX_LABELS).map(|i| format!("l{i}=\"v\",")).collect();
    assert_eq!(malformed(&format!("x{{{many}}} 1")).1, Malformed::TooManyLabels { max: MAX_LABELS });
    let lines = "\n".repeat(MAX_LINES + 1);
    assert_eq!(parse(&lines), Err(ExpoError::TooManyLines { max: MAX_LINES }));
    // Nothing panics on odd bytes anywhere in a line.
    let pieces = ["x", "{", "}", "\"", "\\", "=", ",", " ", "1", "é", "#", "\u{0}", "TYPE", "e", "-"];
    let mut seed = 7u64;
    for _ in 0..20_000 {
        let mut line = String::new();
        for _ in 0..(seed % 12) {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            line.push_str(pieces[(seed >> 33) as usize % pieces.len()]);
        }
        let _ = parse(&line);
    }
}
