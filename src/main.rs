//! `gpudirect`: says whether GPUDirect RDMA works on this machine and why
//! not (`doctor`), what an NCCL log says about it (`nccl-log`), measures
//! bandwidth and latency the way perftest does (`bw`, `lat`), and serves
//! the transfer engine's rendezvous for a job (`rendezvous`).
//!
//! Logs (the library's, through `tracing`) go to stderr: warnings by
//! default, more with `RUST_LOG=info` or `RUST_LOG=debug`.
//!
//! Exit status: `doctor` 0 when GPUDirect RDMA is available, 1 when not,
//! 3 when a variable that decides it is left to the running job (a job
//! file's `${X:-...}`, `$(cmd)`, a branch), 2 when the tool itself could
//! not run; `nccl-log` 0 when the log shows
//! GPUDirect RDMA used, 1 when not or only partly, 3 when the log cannot
//! tell, 2 when the log could not be read; `bw` and `lat` 0 on success, 1
//! on any error; `rendezvous` runs until stopped, 2 when it cannot start.

use gpudirect_tools::{doctor, fleet, nccl_log, perf};

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Parser)]
#[command(name = "gpudirect", version, about = "GPUDirect RDMA diagnostics")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check whether GPUDirect RDMA works on this machine, and why not.
    Doctor {
        #[command(subcommand)]
        action: Option<DoctorAction>,
        /// Machine-readable output (schema documented in docs/doctor-json.md).
        #[arg(long)]
        json: bool,
        /// Only this GPU (CUDA ordinal).
        #[arg(long)]
        gpu: Option<usize>,
        /// Only this RDMA device.
        #[arg(long, short = 'd')]
        device: Option<String>,
        /// Read sysfs/procfs under this directory instead of / (for
        /// fixture trees and offline analysis of a copied tree).
        #[arg(long, hide = true, default_value = "/")]
        root: PathBuf,
        /// Judge the job's environment from this file instead of the
        /// doctor's own: KEY=VALUE lines, or a job script's `export` lines
        /// (nothing in it is run).
        #[arg(long, value_name = "FILE", conflicts_with = "pid")]
        env_file: Option<PathBuf>,
        /// Every finding with its evidence, not only the problems.
        #[arg(long, short = 'v')]
        verbose: bool,
        /// Also print the measurements to make next, scale first (one GPU,
        /// every GPU, two nodes), with the figure each should reach here.
        #[arg(long)]
        plan: bool,
        /// Judge the environment of the running process PID
        /// (/proc/PID/environ), e.g. a training job's rank.
        #[arg(long, value_name = "PID", conflicts_with = "from")]
        pid: Option<u32>,
        /// Judge the variables an NCCL_DEBUG=INFO log of the job shows NCCL
        /// read ("NAME set by environment to VALUE" lines).
        #[arg(long, value_name = "LOG", conflicts_with_all = ["env_file", "pid"])]
        nccl_log: Option<PathBuf>,
        /// Also write everything the judgement read (files, config space,
        /// the verbs' and CUDA's answers, the job's environment) to FILE,
        /// for `--from` on another machine.
        #[arg(long, value_name = "FILE")]
        capture: Option<PathBuf>,
        /// Judge a capture written by `--capture` instead of this machine.
        /// The captured environment is judged, with this shell's NCCL_ and
        /// UCX_ variables laid over it (or `--env-file` instead of it).
        #[arg(long, value_name = "FILE", conflicts_with_all = ["root", "answers"])]
        from: Option<PathBuf>,
        /// Probe answers (a capture's rdma, gpus and host fields) instead
        /// of asking verbs and CUDA: with --root, for fixture trees.
        #[arg(long, hide = true, value_name = "FILE")]
        answers: Option<PathBuf>,
    },
    /// Bandwidth per message size, measured as perftest's ib_*_bw.
    Bw(perf::bw::BwArgs),
    /// Latency per message size, measured as perftest's ib_write_lat / ib_send_lat.
    Lat(perf::lat::LatArgs),
    /// Serve the transfer engine's rendezvous (agents publish their
    /// metadata and look each other up by name) until stopped.
    Rendezvous {
        /// Address to listen on (IP:PORT).
        #[arg(long, default_value = "127.0.0.1:18700")]
        listen: String,
        /// The file holding the cluster's secret (default: the file named
        /// by GPUDIRECT_SECRET_FILE). Needed for a non-loopback address.
        #[arg(long, value_name = "PATH")]
        secret_file: Option<PathBuf>,
        /// Serve a network address without a secret: anyone who reaches it
        /// may publish and withdraw any name.
        #[arg(long)]
        insecure: bool,
        /// Drop an entry not published again within this many seconds.
        #[arg(long, value_name = "SECS")]
        lease: Option<u64>,
        /// Metadata and postings (fleet captures) held in all, in MiB.
        #[arg(long, default_value_t = 256, value_name = "MIB")]
        max_mib: usize,
        /// What one client address may make it hold, in MiB (raise it when
        /// one launcher posts many nodes' captures with `fleet post --from`).
        #[arg(long, default_value_t = 64, value_name = "MIB")]
        max_client_mib: usize,
    },
    /// The job's GPUDirect RDMA verdict across its nodes, before launch:
    /// every node's capture judged together, the nodes that would stage
    /// grouped by cause (exit 1), what sets nodes apart from the rest.
    Fleet {
        #[command(subcommand)]
        action: FleetAction,
    },
    /// Explain an NCCL_DEBUG=INFO log: was GPUDirect RDMA used?
    NcclLog {
        /// The log file, or - for standard input.
        file: String,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum DoctorAction {
    /// What changed between two `doctor --json` reports (or captures) that matters to
    /// the verdict (before and after a maintenance window, a good node and
    /// a bad one): the verdict, then findings that got worse, the cause
    /// first. Exit 1 when the verdict changed, 0 when not.
    Diff {
        /// The earlier report (`--json`) or capture (`--capture`).
        before: PathBuf,
        /// The later report or capture.
        after: PathBuf,
    },
}

/// Where a job's captures meet: exactly one of a shared folder, the
/// rendezvous server, etcd.
#[derive(Args)]
#[group(required = true, multiple = false)]
struct Place {
    /// A folder every node shares (captures at DIR/JOB/NODE.json).
    dir: Option<PathBuf>,
    /// The rendezvous server (`gpudirect rendezvous --listen ADDR`) at
    /// HOST:PORT; requests prove the cluster secret (GPUDIRECT_SECRET_FILE).
    #[arg(long, value_name = "HOST:PORT")]
    rendezvous: Option<String>,
    /// etcd's endpoints (http://HOST:2379, repeat for more members);
    /// captures are sealed with the cluster secret (GPUDIRECT_SECRET_FILE).
    #[arg(long, value_name = "URL")]
    etcd: Vec<String>,
}

impl Place {
    fn open(&self, timeout: u64) -> Result<fleet::Collection, String> {
        fleet::Collection::open(self.dir.as_deref(), self.rendezvous.as_deref(), &self.etcd, std::time::Duration::from_secs(timeout.max(1)))
    }
}

#[derive(Subcommand)]
enum FleetAction {
    /// Post this node's capture under the job's id (run it from the job's
    /// launcher, in the job's environment, on each node).
    Post {
        #[command(flatten)]
        place: Place,
        /// The job's id (a subfolder of DIR, a topic of the rendezvous or etcd).
        #[arg(long)]
        job: String,
        /// This node's name (default: the host name).
        #[arg(long)]
        node: Option<String>,
        /// Post this capture (`gpudirect doctor --capture`) instead of
        /// capturing this machine now.
        #[arg(long, value_name = "CAPTURE")]
        from: Option<PathBuf>,
        /// With --etcd: the capture expires this many seconds after this
        /// post (an etcd lease; at least 2). The rendezvous server's own
        /// `--lease` bounds what it holds.
        #[arg(long, value_name = "SECS")]
        lease: Option<u64>,
        /// Bound on each request to the rendezvous or etcd, in seconds (a
        /// post also waits this long for a rendezvous server not up yet).
        #[arg(long, value_name = "SECS", default_value_t = 30)]
        timeout: u64,
    },
    /// Judge every capture of the job together. Exit 0 when every node will
    /// use GPUDirect RDMA, 1 when any would stage (or is missing or
    /// unreadable), 3 when a job file leaves a node's verdict open, 2 when
    /// the check could not run.
    Check {
        #[command(flatten)]
        place: Place,
        /// The job's id (a subfolder of DIR; without it, DIR itself).
        #[arg(long)]
        job: Option<String>,
        /// Machine-readable output (docs/fleet-json.md).
        #[arg(long)]
        json: bool,
        /// The number of nodes in the allocation: fewer captures fail the check.
        #[arg(long, value_name = "N", conflicts_with = "nodes")]
        expect: Option<usize>,
        /// The allocation's nodes as a Slurm host list
        /// (`node[001-064]`, `$SLURM_JOB_NODELIST`): each one missing is
        /// named, and a capture from a node not in it fails the check.
        #[arg(long, value_name = "LIST")]
        nodes: Option<String>,
        /// Wait up to this many seconds for the --expect or --nodes captures to arrive.
        #[arg(long, value_name = "SECS")]
        wait: Option<u64>,
        /// Also draw nodes x checks into this SVG file.
        #[arg(long, value_name = "FILE")]
        svg: Option<PathBuf>,
        /// The job's start, in seconds since the epoch
        /// (`$SLURM_JOB_START_TIME`, `$(date +%s)` before the nodes
        /// post): a capture posted before it (an earlier run's, under the
        /// same job id) fails the check instead of being judged.
        #[arg(long, value_name = "UNIX_SECS")]
        since: Option<u64>,
        /// Bound on each request to the rendezvous or etcd, in seconds (a
        /// post also waits this long for a rendezvous server not up yet).
        #[arg(long, value_name = "SECS", default_value_t = 30)]
        timeout: u64,
    },
}

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
    match Cli::parse().command {
        Command::Doctor { action: Some(DoctorAction::Diff { before, after }), .. } => {
            let read = |p: &PathBuf| -> Result<serde_json::Value, String> {
                let text = doctor::input::read_text(p, "report", doctor::input::CAPTURE_LIMIT).map_err(|e| e.to_string())?;
                let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", p.display()))?;
                if v.get("format").is_none() {
                    return Ok(v);
                }
                // A capture: judged as `--from` would, in its own environment,
                // from the text already read.
                let c = doctor::capture::Capture::parse(&text, &p.display().to_string()).map_err(|e| e.to_string())?;
                let report = doctor::sources::judge_capture(c, &doctor::report::Options::default())?;
                serde_json::to_value(&report).map_err(|e| e.to_string())
            };
            match read(&before).and_then(|a| read(&after).and_then(|b| doctor::diff::diff(&a, &b))) {
                Ok(d) => {
                    let _ = std::io::stdout().lock().write_all((d.lines.join("\n") + "\n").as_bytes());
                    ExitCode::from(u8::from(d.verdict_changed))
                }
                Err(e) => {
                    eprintln!("gpudirect doctor diff: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Doctor { action: None, json, gpu, device, root, env_file, pid, nccl_log, verbose, plan, capture, from, answers } => {
            let sources = doctor::sources::Sources { shell_over_capture: true, root, env_file, pid, nccl_log, capture, from, answers };
            let report = match doctor::sources::judge(&sources, &doctor::report::Options { gpu, device }) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("gpudirect doctor: {e}");
                    return ExitCode::from(2);
                }
            };
            if !json && !verbose {
                let _ = std::io::stdout().lock().write_all(doctor::report::Brief(&report).to_string().as_bytes());
            } else if let Err(code) = emit(&report, json, "doctor") {
                return code;
            }
            if plan && !json {
                let _ = std::io::stdout().lock().write_all(doctor::plan::Shown(&report.plan).to_string().as_bytes());
            }
            ExitCode::from(report.exit_status())
        }
        Command::Fleet { action: FleetAction::Post { place, job, node, from, lease, timeout } } => {
            let to = match lease {
                Some(_) if place.etcd.is_empty() => Err("--lease applies to --etcd (the rendezvous server's own --lease bounds what it holds)".to_owned()),
                Some(secs) => fleet::Collection::etcd_leased(&place.etcd, std::time::Duration::from_secs(timeout.max(1)), Some(std::time::Duration::from_secs(secs))),
                None => place.open(timeout),
            };
            match to.and_then(|to| fleet::post(&to, &job, node.as_deref(), from.as_deref())) {
                Ok((place, report)) => {
                    println!("{} ({place})", report.verdict.line);
                    ExitCode::from(report.exit_status())
                }
                Err(e) => {
                    eprintln!("gpudirect fleet post: {e}");
                    ExitCode::from(2)
                }
            }
        }
        Command::Fleet { action: FleetAction::Check { place, job, json, expect, nodes, wait, svg, since, timeout } } => {
            let failed = |e: String| {
                eprintln!("gpudirect fleet check: {e}");
                ExitCode::from(2)
            };
            let from = match place.open(timeout) {
                Ok(c) => c,
                Err(e) => return failed(e),
            };
            let expect = match (expect, nodes) {
                (Some(n), _) => Some(fleet::Expect::Count(n)),
                (None, Some(list)) => match fleet::expand_hostlist(&list) {
                    Ok(names) => Some(fleet::Expect::Names(names)),
                    Err(e) => return failed(format!("--nodes: {e}")),
                },
                (None, None) if wait.is_some() => return failed("--wait needs --expect N or --nodes LIST: what to wait for".into()),
                (None, None) => None,
            };
            if let (Some(e), Some(secs)) = (&expect, wait) {
                from.wait_for(job.as_deref(), e, std::time::Duration::from_secs(secs));
            }
            let since = match since.map(|s| (s, std::time::SystemTime::UNIX_EPOCH.checked_add(std::time::Duration::from_secs(s)))) {
                None => None,
                Some((_, Some(t))) => Some(t),
                Some((s, None)) => return failed(format!("--since {s}: past what this system's clock can hold (seconds since 1970)")),
            };
            let report = match fleet::check_since(&from, job.as_deref(), expect.as_ref(), since) {
                Ok(r) => r,
                Err(e) => return failed(e),
            };
            if let Some(p) = svg {
                if let Err(e) = std::fs::write(&p, report.svg()) {
                    return failed(format!("{}: {e}", p.display()));
                }
            }
            match emit(&report, json, "fleet check") {
                Ok(()) => ExitCode::from(report.exit_status()),
                Err(code) => code,
            }
        }
        Command::Rendezvous { listen, secret_file, insecure, lease, max_mib, max_client_mib } => {
            rendezvous(&listen, secret_file, insecure, lease, (max_mib, max_client_mib))
        }
        Command::Bw(a) => {
            let out = perf::bw::run(&a);
            // A comparison whose GPU half could not be measured printed
            // its host half and why; the client did not get what it asked
            // for (the server did all it was asked).
            let client = matches!(a.common.role(), perf::Role::Client(_));
            let incomplete = client && out.as_ref().is_ok_and(|o| !o.complete());
            let code = perf_result(out, a.common.json, "bw");
            if incomplete {
                ExitCode::FAILURE
            } else {
                code
            }
        }
        Command::Lat(a) => perf_result(perf::lat::run(&a), a.common.json, "lat"),
        Command::NcclLog { file, json } => {
            // Streamed: memory stays bounded whatever the log's size.
            // A path is read only when it is a regular file (a FIFO would
            // wait for a writer): a stream comes in on stdin, as `-`.
            let read = if file == "-" {
                nccl_log::explain_reader(std::io::stdin().lock()).map_err(|e| format!("cannot read stdin: {e}"))
            } else {
                doctor::input::open_regular(std::path::Path::new(&file), "NCCL log", " or pipe it in (`... | gpudirect nccl-log -`)")
                    .map_err(|e| e.to_string())
                    .and_then(|f| {
                        nccl_log::explain_reader(std::io::BufReader::with_capacity(1 << 20, f)).map_err(|e| format!("cannot read {file}: {e}"))
                    })
            };
            let mut report = match read {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("gpudirect nccl-log: {e}");
                    return ExitCode::from(2);
                }
            };
            doctor::env::judge_log_environment(&mut report, &file);
            if let Err(code) = emit(&report, json, "nccl-log") {
                return code;
            }
            ExitCode::from(report.exit_status())
        }
    }
}

/// Serves the rendezvous until the process is stopped; 2 when it cannot start.
/// Serves the rendezvous; `mib` bounds what it holds in all and per client address.
fn rendezvous(listen: &str, secret_file: Option<PathBuf>, insecure: bool, lease: Option<u64>, mib: (usize, usize)) -> ExitCode {
    use gpudirect_engine::{ClusterSecret, RendezvousConfig, RendezvousServer};
    let secret = match secret_file.map(ClusterSecret::from_file).transpose() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpudirect rendezvous: {e}");
            return ExitCode::from(2);
        }
    };
    let config = RendezvousConfig {
        secret,
        insecure,
        lease: lease.map(std::time::Duration::from_secs),
        max_bytes: mib.0.saturating_mul(1 << 20),
        max_bytes_per_client: mib.1.saturating_mul(1 << 20),
        ..RendezvousConfig::default()
    };
    match RendezvousServer::bind_with(listen, config) {
        Ok(server) => {
            println!("gpudirect rendezvous listening on {}", server.addr());
            let _ = std::io::stdout().flush();
            loop {
                std::thread::park();
            }
        }
        Err(e) => {
            eprintln!("gpudirect rendezvous: {e}");
            ExitCode::from(2)
        }
    }
}

/// Prints a perf tool's report (both sides print the client's) or its error.
fn perf_result<R: std::fmt::Display + serde::Serialize>(r: perf::Res<R>, json: bool, cmd: &str) -> ExitCode {
    match r {
        Ok(report) => match emit(&report, json, cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(code) => code,
        },
        Err(e) => {
            eprintln!("gpudirect {cmd}: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Prints a report as text or JSON. A closed pipe (`| head`) is not an
/// error worth a panic: the output is simply cut.
fn emit<R: std::fmt::Display + serde::Serialize>(report: &R, json: bool, cmd: &str) -> Result<(), ExitCode> {
    let text = if json {
        match serde_json::to_string_pretty(report) {
            Ok(s) => s + "\n",
            Err(e) => {
                eprintln!("gpudirect {cmd}: cannot encode the report: {e}");
                return Err(ExitCode::from(2));
            }
        }
    } else {
        report.to_string()
    };
    let _ = std::io::stdout().lock().write_all(text.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("gpudirect").chain(args.iter().copied()))
    }

    /// perftest's defaults and no option that is listed and then refused.
    #[test]
    fn command_lines_follow_perftest() {
        assert!(matches!(parse(&["bw"]).unwrap().command, Command::Bw(_)), "no arguments: a server");
        assert!(matches!(parse(&["lat", "nodeA", "-p", "9000", "-s", "8"]).unwrap().command, Command::Lat(_)));
        let e = parse(&["lat", "--op", "read"]).err().expect("lat has no read");
        assert!(e.to_string().contains("possible values: write, send"), "{e}");
        assert!(parse(&["bw", "--op", "read", "nodeA"]).is_ok());
        assert!(matches!(parse(&["doctor", "-d", "mlx5_0"]).unwrap().command, Command::Doctor { .. }));
        assert!(matches!(parse(&["rendezvous", "--listen", "0.0.0.0:7000", "--lease", "30"]).unwrap().command, Command::Rendezvous { lease: Some(30), .. }));
    }
}
