//! `gpudirect stats` against a stand-in endpoint on 127.0.0.1: the frame
//! between two snapshots (MB/s by path, the staged verdict, refusals),
//! and the ways a scrape fails, each a clear message and exit status 2
//! within the timeout.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn gpudirect() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_gpudirect"));
    c.env_remove("NO_COLOR").stdin(Stdio::null());
    c
}

/// Runs `c`, killing it past `limit` (a hang fails the test, never blocks it).
fn run_within(mut c: Command, limit: Duration) -> (Output, Duration) {
    let t = Instant::now();
    let mut child = c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!("still running after {limit:?}: {}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let elapsed = t.elapsed();
    (child.wait_with_output().unwrap(), elapsed)
}

/// The engine's exposition for agent `prefill-0` with one NIC:
/// `[[out gdr, host, staged], [in gdr, host, staged]]`, and its
/// `unknown_sender` refusals.
fn exposition(b: [[u64; 3]; 2], unknown_sender: u64, completed: u64) -> String {
    let mut t = String::from("# HELP gpudirect_bytes_total Bytes this agent's NICs moved.\n# TYPE gpudirect_bytes_total counter\n");
    for (d, dir) in ["out", "in"].iter().enumerate() {
        for (p, path) in ["gdr", "host", "staged"].iter().enumerate() {
            t += &format!("gpudirect_bytes_total{{agent=\"prefill-0\",nic=\"mlx5_3\",direction=\"{dir}\",path=\"{path}\"}} {}\n", b[d][p]);
        }
    }
    t += "# HELP gpudirect_requests_total Transfer requests.\n# TYPE gpudirect_requests_total counter\n";
    for (outcome, n) in [("posted", completed), ("completed", completed), ("failed", 0), ("refused", 0)] {
        t += &format!("gpudirect_requests_total{{agent=\"prefill-0\",op=\"write\",outcome=\"{outcome}\"}} {n}\n");
    }
    t += "# HELP gpudirect_request_seconds Latency.\n# TYPE gpudirect_request_seconds histogram\n";
    t += &format!("gpudirect_request_seconds_bucket{{agent=\"prefill-0\",op=\"write\",le=\"+Inf\"}} {completed}\n");
    t += &format!("gpudirect_request_seconds_sum{{agent=\"prefill-0\",op=\"write\"}} 0.0125\ngpudirect_request_seconds_count{{agent=\"prefill-0\",op=\"write\"}} {completed}\n");
    t += "# HELP gpudirect_refusals_total Refused.\n# TYPE gpudirect_refusals_total counter\n";
    t += "gpudirect_refusals_total{agent=\"prefill-0\",reason=\"control\"} 0\n";
    t += &format!("gpudirect_refusals_total{{agent=\"prefill-0\",reason=\"unknown_sender\"}} {unknown_sender}\n");
    t += "# HELP gpudirect_connections Connections.\n# TYPE gpudirect_connections gauge\ngpudirect_connections{agent=\"prefill-0\",state=\"live\"} 3\n";
    t
}

/// Serves `answers` to successive connections (the last one from then
/// on), each after reading the request head; returns the port.
fn serve(answers: Vec<Vec<u8>>) -> (u16, JoinHandle<usize>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let h = std::thread::spawn(move || {
        let mut served = 0;
        for s in l.incoming().take(answers.len()) {
            let mut s = s.unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            assert!(head.starts_with(b"GET /metrics HTTP/1.1\r\n"), "{}", String::from_utf8_lossy(&head));
            let _ = s.write_all(&answers[served]);
            served += 1;
        }
        served
    });
    (port, h)
}

fn ok(body: &str) -> Vec<u8> {
    format!("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).into_bytes()
}

/// The figure in column `col` (0: gdr MB/s, 1: host, 2: staged) of the
/// row for `dir`.
fn rate(frame: &str, dir: &str, col: usize) -> f64 {
    let row = frame.lines().find(|l| l.split_whitespace().take(2).eq(["mlx5_3", dir])).unwrap_or_else(|| panic!("no {dir} row: {frame}"));
    row.split_whitespace().nth(2 + col).unwrap().parse().unwrap()
}

#[test]
fn one_frame_shows_rates_by_path_and_the_staged_share() {
    let before = exposition([[0, 0, 0], [0, 0, 0]], 2, 0);
    // Over the interval: out 100 MiB by GPUDirect RDMA and 25 MiB staged,
    // in 20 MiB of host memory; three more unknown senders refused.
    let after = exposition([[100 * MIB, 0, 25 * MIB], [0, 20 * MIB, 0]], 5, 40);
    let (port, server) = serve(vec![ok(&before), ok(&after)]);
    let mut c = gpudirect();
    c.args(["stats", &format!("127.0.0.1:{port}"), "--once", "--interval", "0.2"]);
    let (out, took) = run_within(c, Duration::from_secs(20));
    let frame = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{frame}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(server.join().unwrap(), 2, "two scrapes");
    assert!(took >= Duration::from_millis(200), "the scrapes are an interval apart");
    println!("{frame}");

    // The rates are the interval's bytes over its measured length.
    let secs: f64 = frame.split("over the last ").nth(1).and_then(|r| r.split(" s").next()).unwrap().parse().unwrap();
    assert!((0.2..2.0).contains(&secs), "{secs}");
    let near = |shown: f64, mib: f64| (shown - mib / secs).abs() <= 0.03 * mib / secs + 0.1;
    assert!(near(rate(&frame, "out", 0), 100.0), "gdr out: {frame}");
    assert!(near(rate(&frame, "out", 2), 25.0), "staged out: {frame}");
    assert_eq!(rate(&frame, "out", 1), 0.0);
    assert!(near(rate(&frame, "in", 1), 20.0), "host in: {frame}");
    assert_eq!(rate(&frame, "in", 0), 0.0);
    assert_eq!(rate(&frame, "in", 2), 0.0);
    let out_row = frame.lines().find(|l| l.contains("mlx5_3 out")).unwrap();
    assert!(out_row.contains(" 20% ") && out_row.contains("100.0 MiB") && out_row.ends_with("25.0 MiB"), "{out_row}");

    // 25 of the 145 MiB on the NIC were staged (17%), 25 of the GPU's 125 (20%).
    let verdict = frame.lines().find(|l| l.contains("GPU traffic staged through host memory")).unwrap_or_else(|| panic!("{frame}"));
    let (head, since) = verdict.trim().split_once(" since ").unwrap();
    assert_eq!(head, "GPU traffic staged through host memory: 17% of bytes on mlx5_3");
    let (hhmm, rest) = since.split_once(' ').unwrap();
    assert!(hhmm.len() == 5 && hhmm.as_bytes()[2] == b':' && hhmm.bytes().filter(u8::is_ascii_digit).count() == 4, "{hhmm}");
    assert_eq!(rest, "(20% of its GPU bytes)");
    assert!(frame.contains("agent prefill-0: 3 connection(s) live"), "{frame}");
    assert!(frame.contains("refused in the interval: unknown_sender +3"), "{frame}");
    assert!(frame.contains("requests in the interval: write 40 posted, 40 completed"), "{frame}");
    assert!(!frame.contains('\x1b'), "no colour on a pipe: {frame:?}");
}

#[test]
fn a_server_that_never_answers_fails_within_the_timeout() {
    // Bound and never accepted: the kernel completes the connection, and
    // no answer ever comes.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port().to_string();
    let mut c = gpudirect();
    c.args(["stats", &port, "--once", "--interval", "0.2", "--timeout", "1"]);
    let (out, took) = run_within(c, Duration::from_secs(15));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.starts_with(&format!("gpudirect stats: 127.0.0.1:{port} did not answer within 1s")), "{err}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    assert!(out.stdout.is_empty());
    drop(l);
}

#[test]
fn what_is_not_an_agent_s_metrics_is_named() {
    let expect = |answers: Vec<Vec<u8>>, says: &str| {
        let (port, _server) = serve(answers);
        let mut c = gpudirect();
        c.args(["stats", &port.to_string(), "--once", "--interval", "0.1", "--timeout", "2"]);
        let (out, _) = run_within(c, Duration::from_secs(15));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(err.contains(says), "{says:?} not in {err}");
    };
    expect(vec![b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec()], "answered 404 \"Not Found\" to GET /metrics");
    let bad = exposition([[0; 3]; 2], 0, 0).replace("} 0\ngpudirect_bytes_total{agent=\"prefill-0\",nic=\"mlx5_3\",direction=\"out\",path=\"host\"", "} NaN\ngpudirect_bytes_total{agent=\"prefill-0\",nic=\"mlx5_3\",direction=\"out\",path=\"host\"");
    expect(vec![ok(&bad)], "is not Prometheus text: line 3: value \"NaN\" is not a finite number");
    expect(vec![ok("# TYPE node_cpu_seconds_total counter\nnode_cpu_seconds_total{cpu=\"0\"} 1\n")], "not a gpudirect agent's metrics endpoint");
    // Counters from an endpoint that went away between the scrapes.
    let (port, server) = serve(vec![ok(&exposition([[0; 3]; 2], 0, 0))]);
    let mut c = gpudirect();
    c.args(["stats", &port.to_string(), "--count", "2", "--interval", "0.1", "--timeout", "2"]);
    let waiter = std::thread::spawn(move || run_within(c, Duration::from_secs(15)));
    assert_eq!(server.join().unwrap(), 1);
    let (out, _) = waiter.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot connect to 127.0.0.1:") || err.contains("did not answer"), "{err}");
    let e = gpudirect().args(["stats", "localhost"]).output().unwrap();
    assert_eq!(e.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&e.stderr).contains("give HOST:PORT, or PORT for 127.0.0.1"));
}
