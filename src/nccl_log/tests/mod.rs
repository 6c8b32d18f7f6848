use std::collections::BTreeSet;
use std::path::PathBuf;

use super::parse::{self, Level};
use super::text::channel_ranges;
use super::*;

fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/nccl-logs")
}

/// A fixture: its `expected:` header and the excerpt after the first `---`.
struct Fixture {
    name: String,
    expected: String,
    excerpt: String,
}

fn parse_fixture(name: &str, text: &str) -> Fixture {
    let mut expected = None;
    let mut lines = text.lines();
    for line in lines.by_ref() {
        if line == "---" {
            break;
        }
        if let Some(v) = line.strip_prefix("expected: gdr=") {
            expected = Some(v.trim().to_string());
        }
    }
    let excerpt: Vec<&str> = lines.collect();
    assert!(!excerpt.is_empty(), "{name}: no excerpt after ---");
    Fixture {
        name: name.to_string(),
        expected: expected.unwrap_or_else(|| panic!("{name}: no 'expected: gdr=' header")),
        excerpt: excerpt.join("\n"),
    }
}

fn fixtures() -> Vec<Fixture> {
    let mut out: Vec<Fixture> = std::fs::read_dir(data_dir())
        .expect("tests/data/nccl-logs exists")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "txt"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            parse_fixture(&name, &std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn fixture(name: &str) -> Report {
    let path = data_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{name}: {e}"));
    explain(&parse_fixture(name, &text).excerpt)
}

fn verdict_word(v: Verdict) -> String {
    serde_json::to_value(v)
        .unwrap()
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn every_fixture_gets_its_expected_verdict() {
    let all = fixtures();
    // 21 real excerpts (20 from public issue threads, one from a public
    // write-up) plus our synthetic ones.
    assert!(all.len() >= 28, "only {} fixtures found", all.len());
    assert!(
        all.iter()
            .filter(|f| f.name.starts_with("synthetic-"))
            .count()
            >= 8
    );
    let mut wrong = Vec::new();
    for f in &all {
        let report = explain(&f.excerpt);
        let got = verdict_word(report.verdict);
        if got != f.expected {
            wrong.push(format!(
                "{}: expected {}, got {got}\n{report}",
                f.name, f.expected
            ));
        }
        let text = report.to_string();
        assert_eq!(
            text.lines().next(),
            Some(report.headline.as_str()),
            "{}",
            f.name
        );
        let json = serde_json::to_value(&report).unwrap();
        assert_eq!(json["verdict"], f.expected.as_str(), "{}", f.name);
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
}

#[test]
fn every_verdict_appears_in_the_fixtures() {
    let seen: BTreeSet<String> = fixtures().iter().map(|f| f.expected.clone()).collect();
    for v in ["used", "partial", "not-used", "unknown"] {
        assert!(seen.contains(v), "no fixture expects {v}");
    }
}

#[test]
fn headlines_use_the_verdict_sentences() {
    let cases = [
        (
            "nccl687-a100-gdrdma-nosubchannel-2.11.4.txt",
            "GPUDirect RDMA was used",
        ),
        (
            "synthetic-recv-gdr-send-host-2.12.12.txt",
            "GPUDirect RDMA was partially used",
        ),
        (
            "nccl226-aws-ring-socket-nobusid-2.4.7.txt",
            "GPUDirect RDMA was NOT used: inter-node traffic went through host memory",
        ),
        (
            "nccl660-vm-gdr-vendor-err81-acs-hint.txt",
            "cannot tell from this log",
        ),
    ];
    for (name, start) in cases {
        let r = fixture(name);
        assert!(r.headline.starts_with(start), "{name}: {}", r.headline);
    }
}

mod fixtures;
mod fuzz;
mod lines;
mod rules;
mod wording;
