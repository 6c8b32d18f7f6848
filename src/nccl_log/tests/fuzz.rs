//! Never panics: random bytes, spliced and mangled fixture lines.

use super::*;

use testkit::Rng;

const PIECES: &[&str] = &[
    "Channel ",
    "Ring ",
    "00",
    "/",
    "0",
    " : ",
    "[",
    "]",
    "->",
    " [send] ",
    "[receive]",
    "via ",
    "NET/",
    "IB",
    "/GDRDMA",
    "/Shared",
    "(",
    ")",
    "NCCL INFO ",
    "NCCL WARN ",
    ":",
    " ",
    "\n",
    "é",
    "\u{FFFD}",
    "GPU Direct RDMA ",
    "Disabled",
    "Enabled ",
    "for HCA ",
    "for GPU ",
    "'",
    "HCA ",
    " set by environment to ",
    "with error ",
    "vendor err ",
    "Using network ",
    "NET/Socket : Using ",
    "NCCL version ",
    "99999999999999999999999",
    "18446744073709551615",
    "DMA-BUF is available",
    "use ring PXN 0 GDR 1",
    "host:1:2 [0] ",
    "[1,3]<stdout>:",
    "\t",
    "\r",
    "Got completion ",
];

fn check_no_panic(text: &str) {
    let r = explain(text);
    let shown = r.to_string();
    assert_eq!(shown.lines().next(), Some(r.headline.as_str()));
    let expected_start = match r.verdict {
        Verdict::Used => HEAD_USED,
        Verdict::Partial => HEAD_PARTIAL,
        Verdict::NotUsed => HEAD_NOT_USED,
        Verdict::Unknown => HEAD_UNKNOWN,
    };
    // A "not used" log that does not show traffic between nodes says
    // what would happen there.
    let would = r.verdict == Verdict::NotUsed && r.headline.starts_with("GPUDirect RDMA would NOT be used between nodes: ");
    assert!(
        would || r.headline.starts_with(expected_start),
        "{:?} / {}",
        r.verdict,
        r.headline
    );
    assert_eq!(r.verdict == Verdict::Unknown, r.settle_with.is_some());
    serde_json::to_string(&r).unwrap();
}

#[test]
fn never_panics_on_random_bytes() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..500 {
        let len = rng.index(400);
        let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
        check_no_panic(&String::from_utf8_lossy(&bytes));
    }
}

#[test]
fn never_panics_on_spliced_log_pieces() {
    let mut rng = Rng(0xdead_beef_cafe_f00d);
    for _ in 0..3000 {
        let mut s = String::new();
        for _ in 0..rng.index(40) {
            s.push_str(PIECES[rng.index(PIECES.len())]);
        }
        check_no_panic(&s);
    }
}

#[test]
fn never_panics_on_truncated_and_mangled_fixture_lines() {
    let mut rng = Rng(42);
    let lines: Vec<String> = fixtures()
        .into_iter()
        .flat_map(|f| f.excerpt.lines().map(str::to_string).collect::<Vec<_>>())
        .collect();
    assert!(lines.len() > 150);
    for line in &lines {
        // Every prefix of every real line, cut at each character boundary.
        for (i, _) in line.char_indices() {
            check_no_panic(&line[..i]);
        }
    }
    for _ in 0..2000 {
        let line = &lines[rng.index(lines.len())];
        let mut chars: Vec<char> = line.chars().collect();
        for _ in 0..=rng.index(4) {
            let at = rng.index(chars.len() + 1);
            match rng.index(3) {
                0 if at < chars.len() => {
                    chars.remove(at);
                }
                1 => chars
                    .splice(at..at, PIECES[rng.index(PIECES.len())].chars())
                    .for_each(drop),
                _ => chars.insert(
                    at,
                    char::from_u32(rng.next() as u32 % 0x11_0000).unwrap_or('\u{FFFD}'),
                ),
            }
        }
        check_no_panic(&chars.into_iter().collect::<String>());
    }
}

#[test]
fn huge_numbers_are_not_connections_but_do_not_panic() {
    let r = explain(
        "h:1:2 [0] NCCL INFO Channel 99999999999999999999 : 1 -> 2 [send] via NET/IB/0/GDRDMA\n",
    );
    assert!(r.connections.is_empty());
    let r = explain(
        "h:1:2 [0] NCCL INFO Channel 18446744073709551615/18446744073709551615 : 18446744073709551615[0] -> 0[0] [send] via NET/IB/18446744073709551615/GDRDMA\n\
         h:1:2 [0] NCCL INFO Channel 18446744073709551614/0 : 1[0] -> 0[0] [send] via NET/IB/0/GDRDMA\n",
    );
    assert_eq!(r.connections.len(), 2);
    assert_eq!(r.connections[0].net_dev, Some(u64::MAX));
    assert_eq!(r.verdict, Verdict::Used);
    assert!(channel_ranges(&BTreeSet::from([u64::MAX - 1, u64::MAX])).contains('-'));
    check_no_panic(&"NCCL INFO ".repeat(10_000));
}

/// The streamed reader: lines split at `\n` (a `\r` before it dropped), an
/// over-long line read only in part and counted, the last line without a
/// newline kept, and the same report as from memory.
#[test]
fn streamed_lines_are_bounded_and_read_as_in_memory() {
    let fixture_text = std::fs::read_to_string(data_dir().join("nccl687-a100-gdrdma-nosubchannel-2.11.4.txt")).unwrap();
    let excerpt = fixture_text.split_once("\n---\n").unwrap().1.replace('\n', "\r\n");
    let streamed = explain_reader(std::io::BufReader::with_capacity(7, excerpt.as_bytes())).unwrap();
    let whole = explain(&excerpt);
    assert_eq!((streamed.verdict, streamed.connections.len()), (whole.verdict, whole.connections.len()));
    assert!(streamed.connections.len() > 1 && streamed.lines_cut == 0);
    // A 1 MiB line of noise between two connection lines: its start is
    // read, the rest skipped, and the lines around it still count.
    let conn = "h:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/IB/0/GDRDMA";
    let long = format!("{conn}\n{}\n{}", "x".repeat(1 << 20), conn.replace("00/0", "01/0"));
    let r = explain_reader(std::io::BufReader::new(long.as_bytes())).unwrap();
    assert_eq!((r.lines_read, r.lines_cut, r.connections.len()), (3, 1, 2));
    assert_eq!(r.connections[1].line, 3);
}

/// CPU per byte of a log made of one repeated piece, against ordinary
/// log text of the same size: what a line full of markers, brackets or
/// keywords costs. Printed; the bound is asserted in
/// `no_line_costs_much_more_than_ordinary_text`.
fn cost_ratios() -> Vec<(String, f64)> {
    let ordinary = std::fs::read_to_string(super::data_dir().join("nccltests284-rtx4090-init-using-network-socket-2.25.1.txt")).unwrap();
    let ordinary: String = ordinary.lines().skip_while(|l| *l != "---").skip(1).collect::<Vec<_>>().join("\n");
    let size = 4 << 20;
    let fill = |piece: &str| -> String {
        let line: String = piece.repeat((60_000 / piece.len()).max(1));
        let mut out = String::with_capacity(size + line.len());
        while out.len() < size {
            out.push_str(&line);
            out.push('\n');
        }
        out
    };
    let time = |text: &str| {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = std::time::Instant::now();
            std::hint::black_box(explain(text));
            best = best.min(t.elapsed().as_secs_f64());
        }
        best / text.len() as f64
    };
    let mut base_text = String::new();
    while base_text.len() < size {
        base_text.push_str(&ordinary);
        base_text.push('\n');
    }
    let base = time(&base_text);
    let pieces = [
        "NCCL INFO ",
        "NCCL WARN ",
        "h:1:1 [0] NCCL INFO ",
        " INFO ",
        "h:1:1 [0] INFO ",
        "[",
        "[0",
        "]",
        "->",
        " via NET/",
        "NET/IB : Using ",
        "GPU Direct RDMA ",
        "Channel 00/0 : 0[0] -> 1[1] via NET/IB/0/GDRDMA ",
        " set by environment to ",
        "NCCL INFO [",
        "/",
        "CollNet ",
        ":",
        "1:",
        "9",
        " ",
    ];
    pieces.iter().map(|p| (p.to_string(), time(&fill(p)) / base)).collect()
}

#[test]
#[ignore = "a measurement: run with --release --ignored --nocapture"]
fn line_costs_against_ordinary_text() {
    for (piece, r) in cost_ratios() {
        println!("{r:7.1}x  {piece:?}");
    }
}

/// A line of thousands of markers is read as at most
/// `MAX_RECORDS_PER_LINE` records, and a glued paste of a few real
/// records still splits into each of them.
#[test]
fn records_per_line_are_bounded() {
    use super::super::parse::{records, MAX_RECORDS_PER_LINE};
    let line = "h:1:1 [0] NCCL INFO x ".repeat(10_000);
    let got = records(&line);
    assert!(got.len() <= MAX_RECORDS_PER_LINE + 1, "{}", got.len());
    assert_eq!(got.iter().map(|r| r.len()).sum::<usize>(), line.len(), "every byte in one record or another");
    let glued = "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via NET/IB/0/GDRDMA      h:1:2 [1] NCCL INFO Connected all rings";
    assert_eq!(records(glued).len(), 2);
}
