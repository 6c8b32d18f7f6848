//! `gpudirect doctor diff A B`: what changed between two reports (the
//! `--json` of two runs: before and after a maintenance window, a good
//! node and a bad one) that matters to the verdict. The cause first: a
//! verdict that changed, then the findings that got worse, then those
//! that got better, appeared or went; findings whose status stayed are
//! not shown (their evidence may differ in harmless ways, such as link
//! speeds of idle GPUs).

use std::collections::HashMap;

use serde_json::Value;

/// The difference of two reports, for printing.
#[derive(Debug, PartialEq, Eq)]
pub struct Diff {
    /// Whether the verdict's availability changed.
    pub verdict_changed: bool,
    /// Lines, cause first.
    pub lines: Vec<String>,
}

fn rank(status: &str) -> u8 {
    match status {
        "fail" => 3,
        "warn" => 2,
        "ok" => 1,
        _ => 0,
    }
}

/// `(check, status, summary)` of each finding.
fn findings(r: &Value) -> Vec<(String, String, String)> {
    r["findings"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|f| (f["check"].as_str().unwrap_or("?").to_owned(), f["status"].as_str().unwrap_or("?").to_owned(), f["summary"].as_str().unwrap_or("").to_owned()))
                .collect()
        })
        .unwrap_or_default()
}

/// Each check's first finding, by its name.
fn by_check(f: &[(String, String, String)]) -> HashMap<&str, &(String, String, String)> {
    let mut m = HashMap::with_capacity(f.len());
    for x in f {
        m.entry(x.0.as_str()).or_insert(x);
    }
    m
}

/// A doctor report (`doctor --json`) or a capture, as the report to
/// compare: a capture is judged as `--from` would, in its own
/// environment, from the text already read (bounded, regular files only).
///
/// # Errors
/// A sentence naming the file and what is wrong with it.
pub fn read_report(path: &std::path::Path) -> Result<Value, String> {
    let text = super::input::read_text(path, "report", super::input::CAPTURE_LIMIT).map_err(|e| e.to_string())?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    if v.get("format").is_none() {
        return Ok(v);
    }
    let c = super::capture::Capture::parse(&text, &path.display().to_string()).map_err(|e| e.to_string())?;
    let report = super::sources::judge_capture(c, &super::report::Options::default())?;
    serde_json::to_value(&report).map_err(|e| e.to_string())
}

/// Compares report `a` (before) with `b` (after).
///
/// # Errors
/// When either is not a doctor report (no `verdict`), or their schemas
/// differ.
pub fn diff(a: &Value, b: &Value) -> Result<Diff, String> {
    for (name, r) in [("the first", a), ("the second", b)] {
        if !r["verdict"].is_object() || !r["findings"].is_array() {
            return Err(format!("{name} file is not a `gpudirect doctor --json` report"));
        }
    }
    if a["schema"] != b["schema"] {
        return Err(format!("the reports have schemas {} and {}: compare reports of one gpudirect release", a["schema"], b["schema"]));
    }
    let mut lines = Vec::new();
    let (va, vb) = (&a["verdict"], &b["verdict"]);
    let verdict_changed = va["available"] != vb["available"];
    if va["line"] != vb["line"] {
        lines.push(format!("verdict: {}", va["line"].as_str().unwrap_or("?")));
        lines.push(format!("     ->  {}", vb["line"].as_str().unwrap_or("?")));
    } else {
        lines.push(format!("verdict unchanged: {}", vb["line"].as_str().unwrap_or("?")));
    }
    let (fa, fb) = (findings(a), findings(b));
    // Each check's first finding, by name: one pass per report, so the
    // diff grows with the findings, not with their square (a report of
    // a million findings took minutes with a search per finding).
    let (ia, ib) = (by_check(&fa), by_check(&fb));
    let before = |check: &str| ia.get(check).copied();
    let after = |check: &str| ib.get(check).copied();
    let mut worse = Vec::new();
    let mut better = Vec::new();
    for (check, status, summary) in &fb {
        match before(check) {
            Some((_, old, _)) if rank(status) > rank(old) => worse.push((rank(status), format!("worse  [{old} -> {status}] {check}: {summary}"))),
            Some((_, old, _)) if rank(status) < rank(old) => better.push(format!("better [{old} -> {status}] {check}: {summary}")),
            Some(_) => {}
            None if rank(status) >= 2 => worse.push((rank(status), format!("new    [{status}] {check}: {summary}"))),
            None => better.push(format!("new    [{status}] {check}: {summary}")),
        }
    }
    for (check, status, summary) in &fa {
        if after(check).is_none() {
            better.push(format!("gone   [{status}] {check}: {summary}"));
        }
    }
    worse.sort_by_key(|w| std::cmp::Reverse(w.0));
    lines.extend(worse.into_iter().map(|(_, l)| l));
    lines.extend(better);
    if lines.len() == 1 {
        lines.push("no finding changed its status".into());
    }
    Ok(Diff { verdict_changed, lines })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn report(available: bool, line: &str, findings: &[(&str, &str, &str)]) -> Value {
        json!({
            "schema": 1,
            "verdict": {"available": available, "line": line},
            "findings": findings.iter().map(|(c, s, m)| json!({"check": c, "status": s, "summary": m, "evidence": [], "fix": null})).collect::<Vec<_>>()
        })
    }

    /// After a maintenance window: the NIC's port went down and ACS came
    /// back on a bridge; the verdict changed, the cause leads.
    #[test]
    fn the_cause_comes_first() {
        let before = report(true, "GPUDirect RDMA: available via dma-buf for GPU0 <-> mlx5_0 (PIX)", &[
            ("rdma.port.mlx5_0", "ok", "port 1 ACTIVE"),
            ("acs.bridge.0000:17:01.0", "ok", "ACS redirect off"),
            ("bandwidth.path", "ok", "x16"),
            ("peermem.client", "warn", "nvidia-peermem not loaded"),
        ]);
        let after = report(false, "GPUDirect RDMA: not available for GPU0 <-> mlx5_0: ACS redirects", &[
            ("rdma.port.mlx5_0", "warn", "port 1 ACTIVE at 100 Gb/s"),
            ("acs.bridge.0000:17:01.0", "fail", "ACS redirect on"),
            ("bandwidth.path", "ok", "x16 (idle GPU at 2.5 GT/s)"),
            ("iommu.mode", "warn", "translated"),
        ]);
        let d = diff(&before, &after).unwrap();
        assert!(d.verdict_changed);
        assert!(d.lines[0].starts_with("verdict: GPUDirect RDMA: available"));
        assert!(d.lines[1].contains("not available"));
        assert_eq!(d.lines[2], "worse  [ok -> fail] acs.bridge.0000:17:01.0: ACS redirect on", "the failure first: {:#?}", d.lines);
        assert!(d.lines[3..5].iter().all(|l| l.starts_with("worse  [ok -> warn]") || l.starts_with("new    [warn]")), "{:#?}", d.lines);
        assert!(d.lines.iter().any(|l| l == "gone   [warn] peermem.client: nvidia-peermem not loaded"));
        assert!(!d.lines.iter().any(|l| l.contains("bandwidth.path")), "same status: not shown");
        let same = diff(&before, &before).unwrap();
        assert!(!same.verdict_changed);
        assert_eq!(same.lines[1], "no finding changed its status");
        assert!(diff(&json!({"x": 1}), &before).unwrap_err().contains("not a `gpudirect doctor --json` report"));
    }

    /// Hundreds of thousands of findings diff in one pass each: the
    /// worse, better, new and gone ones all found.
    #[test]
    fn large_reports_diff_by_lookup() {
        let n = 200_000;
        let mk = |f: &dyn Fn(usize) -> (String, &'static str)| {
            let v: Vec<_> = (0..n).map(|i| { let (c, s) = f(i); json!({"check": c, "status": s, "summary": "", "evidence": [], "fix": null}) }).collect();
            json!({"schema": 1, "verdict": {"available": true, "line": "x"}, "findings": v})
        };
        let a = mk(&|i| (format!("c{i}"), "ok"));
        let b = mk(&|i| (format!("c{}", i + 1), if i % 1000 == 0 { "fail" } else { "ok" }));
        let t = std::time::Instant::now();
        let d = diff(&a, &b).unwrap();
        let took = t.elapsed();
        assert_eq!(d.lines.iter().filter(|l| l.starts_with("worse")).count(), n / 1000, "c1, c1001, c2001, ... got worse");
        assert_eq!(d.lines.iter().filter(|l| l.starts_with("gone")).count(), 1);
        assert_eq!(d.lines.iter().filter(|l| l.starts_with("new")).count(), 1);
        println!("{n} findings diffed in {took:?}");
    }
}
