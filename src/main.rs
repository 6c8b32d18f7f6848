//! `gpudirect`: says whether GPUDirect RDMA works on this machine and why
//! not (`doctor`), what an NCCL log says about it (`nccl-log`), judges a
//! job's nodes together before launch (`fleet`), measures bandwidth and
//! latency the way perftest does (`bw`, `lat`), serves the transfer
//! engine's rendezvous for a job (`rendezvous`), and watches an agent's
//! metrics endpoint (`stats`).
//!
//! Thin: the flags are parsed and decided into a typed request by the
//! library (`gpudirect_tools::cli`); here a request runs and its report
//! is printed.
//!
//! Logs (the library's, through `tracing`) go to stderr: warnings by
//! default, more with `RUST_LOG=info` or `RUST_LOG=debug`.
//!
//! Exit status: `doctor` 0 when GPUDirect RDMA is available, 1 when not,
//! 3 when a variable that decides it is left to the running job (a job
//! file's `${X:-...}`, `$(cmd)`, a branch), 2 when the tool itself could
//! not run; `nccl-log` 0 when the log shows
//! GPUDirect RDMA used, 1 when not or only partly, 3 when the log cannot
//! tell, 2 when the log could not be read; `fleet check` as `doctor`, for
//! every node; `bw` and `lat` 0 on success, 1 on any error; `rendezvous`
//! runs until stopped, 2 when it cannot start; `stats` 0 after its
//! frames (or runs until stopped), 2 when a scrape fails or its answer is
//! not an agent's metrics.

use gpudirect_tools::cli::{Cli, Request};
use gpudirect_tools::{doctor, perf, stats};

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

/// The library reports through `tracing`: its warnings (a region staged
/// through host memory, a teardown that failed) show by default, on
/// stderr so `--json` output stays clean; `RUST_LOG=debug` adds the choices
/// it makes (device, GID, MTU, registration path).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn main() -> ExitCode {
    init_logging();
    let command = Cli::parse().command;
    let name = command.name();
    match command.decide().and_then(run) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("gpudirect {name}: {e}");
            ExitCode::from(2)
        }
    }
}

/// Runs a request and prints its report; `Err` is a failure of the tool
/// itself (exit 2).
fn run(request: Request) -> Result<ExitCode, String> {
    Ok(match request {
        Request::DoctorDiff { before, after } => {
            let d = doctor::diff::read_report(&before).and_then(|a| doctor::diff::read_report(&after).and_then(|b| doctor::diff::diff(&a, &b)))?;
            let _ = std::io::stdout().lock().write_all((d.lines.join("\n") + "\n").as_bytes());
            ExitCode::from(u8::from(d.verdict_changed))
        }
        Request::Doctor { sources, options, json, verbose, plan } => {
            let report = doctor::sources::judge(&sources, &options)?;
            if !json && !verbose {
                print(&doctor::report::Brief(&report).to_string());
            } else {
                emit(&report, json)?;
            }
            if plan && !json {
                print(&doctor::plan::Shown(&report.plan).to_string());
            }
            ExitCode::from(report.exit_status())
        }
        Request::FleetPost(post) => {
            let (place, report) = post.run()?;
            println!("{} ({place})", report.verdict.line);
            ExitCode::from(report.exit_status())
        }
        Request::FleetCheck { check, json, svg } => {
            let report = check.run()?;
            if let Some(p) = svg {
                std::fs::write(&p, report.svg()).map_err(|e| format!("{}: {e}", p.display()))?;
            }
            emit(&report, json)?;
            ExitCode::from(report.exit_status())
        }
        Request::NcclLog { source, json } => {
            let report = doctor::log::explain_log(&source)?;
            emit(&report, json)?;
            ExitCode::from(report.exit_status())
        }
        Request::Rendezvous { listen, secret_file, insecure, lease, max_bytes, max_bytes_per_client } => {
            use gpudirect_engine::{ClusterSecret, RendezvousConfig, RendezvousServer};
            let secret = secret_file.map(ClusterSecret::from_file).transpose().map_err(|e| e.to_string())?;
            let config = RendezvousConfig { secret, insecure, lease, max_bytes, max_bytes_per_client, ..RendezvousConfig::default() };
            let server = RendezvousServer::bind_with(&listen, config).map_err(|e| e.to_string())?;
            println!("gpudirect rendezvous listening on {}", server.addr());
            let _ = std::io::stdout().flush();
            loop {
                std::thread::park();
            }
        }
        Request::Stats { request, style } => {
            let mut watcher = stats::Watcher::new(&request);
            let mut shown = 0u64;
            while request.frames.is_none_or(|n| shown < n) {
                let frame = watcher.next_frame().map_err(|e| e.to_string())?;
                let mut out = std::io::stdout().lock();
                if out.write_all(stats::render::render(&frame, &request.target.to_string(), style).as_bytes()).and_then(|()| out.flush()).is_err() {
                    // The reader went away (`| head`): nothing more to show.
                    break;
                }
                shown += 1;
            }
            ExitCode::SUCCESS
        }
        Request::Bw(a) => {
            let out = perf::bw::run(&a);
            // A comparison whose GPU half could not be measured printed
            // its host half and why; the client did not get what it asked
            // for (the server did all it was asked).
            let client = matches!(a.common.role(), perf::Role::Client(_));
            let incomplete = client && out.as_ref().is_ok_and(|o| !o.complete());
            let code = perf_result(out, a.common.json, "bw")?;
            if incomplete {
                ExitCode::FAILURE
            } else {
                code
            }
        }
        Request::Lat(a) => perf_result(perf::lat::run(&a), a.common.json, "lat")?,
    })
}

/// A perf tool's report (both sides print the client's), or its error
/// (exit 1: the measurement failed, not the tool).
fn perf_result<R: std::fmt::Display + serde::Serialize>(r: perf::Res<R>, json: bool, cmd: &str) -> Result<ExitCode, String> {
    match r {
        Ok(report) => emit(&report, json).map(|()| ExitCode::SUCCESS),
        Err(e) => {
            eprintln!("gpudirect {cmd}: error: {e}");
            Ok(ExitCode::FAILURE)
        }
    }
}

/// Prints a report as text or JSON.
fn emit<R: std::fmt::Display + serde::Serialize>(report: &R, json: bool) -> Result<(), String> {
    let text = if json { serde_json::to_string_pretty(report).map_err(|e| format!("cannot encode the report: {e}"))? + "\n" } else { report.to_string() };
    print(&text);
    Ok(())
}

/// A closed pipe (`| head`) is not an error worth a panic: the output is
/// simply cut.
fn print(text: &str) {
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
}
