//! The `gpudirect` command's flags, parsed once ([`Cli`], clap's derive)
//! and decided once into a typed [`Request`]: the places, sources and
//! bounds checked by the same constructors the Python package uses
//! ([`fleet::CheckRequest`], [`fleet::PostRequest`],
//! [`Sources::check`], [`LogSource`]). The
//! binary only runs a request and renders what it returns.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::doctor::log::LogSource;
use crate::doctor::report::Options;
use crate::doctor::sources::Sources;
use crate::stats::render::Style;
use crate::stats::{StatsArgs, StatsRequest};
use crate::{fleet, perf};

/// The command line as given.
#[derive(Parser)]
#[command(name = "gpudirect", version, about = "GPUDirect RDMA diagnostics")]
pub struct Cli {
    /// The subcommand.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand)]
pub enum Command {
    /// Check whether GPUDirect RDMA works on this machine, and why not.
    Doctor {
        /// `diff`, or none: judge.
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
        /// `post` or `check`.
        #[command(subcommand)]
        action: FleetAction,
    },
    /// Watch an agent's metrics endpoint: MB/s per NIC by path (gdr,
    /// host, staged) and direction, totals since the agent started, and
    /// whether GPU memory is staged through host memory.
    Stats {
        /// The endpoint (AgentConfig::metrics, GPUDIRECT_METRICS): HOST:PORT
        /// (an IPv6 address in brackets), or PORT for 127.0.0.1.
        addr: String,
        /// Seconds between scrapes (rates are over this interval).
        #[arg(long, value_name = "SECS", default_value_t = 1.0)]
        interval: f64,
        /// Print one frame (two scrapes an interval apart) and exit.
        #[arg(long, conflicts_with = "count")]
        once: bool,
        /// Print this many frames and exit.
        #[arg(long, value_name = "N")]
        count: Option<u64>,
        /// Seconds one scrape may take before the command gives up.
        #[arg(long, value_name = "SECS", default_value_t = 5.0)]
        timeout: f64,
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

/// What `doctor` does besides judging this machine.
#[derive(Subcommand)]
pub enum DoctorAction {
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
pub struct PlaceArgs {
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


/// `fleet`'s two sides.
#[derive(Subcommand)]
pub enum FleetAction {
    /// Post this node's capture under the job's id (run it from the job's
    /// launcher, in the job's environment, on each node).
    Post {
        /// Where the captures meet.
        #[command(flatten)]
        place: PlaceArgs,
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
        /// Where the captures meet.
        #[command(flatten)]
        place: PlaceArgs,
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

impl PlaceArgs {
    fn place(self) -> fleet::Place {
        fleet::Place { dir: self.dir, rendezvous: self.rendezvous, etcd: self.etcd }
    }
}

/// A request decided from the command line: what to run, typed.
pub enum Request {
    /// `doctor`: judge the sources.
    Doctor {
        /// What to judge.
        sources: Sources,
        /// Which GPU and device.
        options: Options,
        /// Output as JSON.
        json: bool,
        /// Every finding, not the brief.
        verbose: bool,
        /// Also the measurement plan.
        plan: bool,
    },
    /// `doctor diff BEFORE AFTER`.
    DoctorDiff {
        /// The earlier report or capture.
        before: PathBuf,
        /// The later one.
        after: PathBuf,
    },
    /// `fleet post`.
    FleetPost(fleet::PostRequest),
    /// `fleet check`.
    FleetCheck {
        /// The check.
        check: fleet::CheckRequest,
        /// Output as JSON.
        json: bool,
        /// Also draw the grid into this SVG file.
        svg: Option<PathBuf>,
    },
    /// `nccl-log`.
    NcclLog {
        /// Where the log comes from.
        source: LogSource,
        /// Output as JSON.
        json: bool,
    },
    /// `rendezvous`: serve until stopped.
    Rendezvous {
        /// The address to listen on.
        listen: String,
        /// The cluster's secret file.
        secret_file: Option<PathBuf>,
        /// Serve a network address without a secret.
        insecure: bool,
        /// Drop an entry not published again within this long.
        lease: Option<Duration>,
        /// Bytes held in all.
        max_bytes: usize,
        /// Bytes one client address may make it hold.
        max_bytes_per_client: usize,
    },
    /// `stats`: watch an agent's metrics endpoint.
    Stats {
        /// Where, how often, how many frames.
        request: StatsRequest,
        /// How frames are drawn on this standard output.
        style: Style,
    },
    /// `bw`.
    Bw(perf::bw::BwArgs),
    /// `lat`.
    Lat(perf::lat::LatArgs),
}

impl Command {
    /// The subcommand's name, for its error lines.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Doctor { action: Some(DoctorAction::Diff { .. }), .. } => "doctor diff",
            Command::Doctor { .. } => "doctor",
            Command::Fleet { action: FleetAction::Post { .. } } => "fleet post",
            Command::Fleet { action: FleetAction::Check { .. } } => "fleet check",
            Command::NcclLog { .. } => "nccl-log",
            Command::Stats { .. } => "stats",
            Command::Rendezvous { .. } => "rendezvous",
            Command::Bw(_) => "bw",
            Command::Lat(_) => "lat",
        }
    }

    /// Decides the command into a request, checked as a whole.
    ///
    /// # Errors
    /// A sentence naming what cannot go together or cannot be opened.
    pub fn decide(self) -> Result<Request, String> {
        Ok(match self {
            Command::Doctor { action: Some(DoctorAction::Diff { before, after }), .. } => Request::DoctorDiff { before, after },
            Command::Doctor { action: None, json, gpu, device, root, env_file, pid, nccl_log, verbose, plan, capture, from, answers } => {
                let sources = Sources { shell_over_capture: true, root, env_file, pid, nccl_log, capture, from, answers };
                sources.check()?;
                Request::Doctor { sources, options: Options { gpu, device }, json, verbose, plan }
            }
            Command::Fleet { action: FleetAction::Post { place, job, node, from, lease, timeout } } => Request::FleetPost(fleet::PostRequest::new(fleet::PostArgs {
                place: place.place(),
                job,
                node,
                from,
                lease: lease.map(Duration::from_secs),
                timeout: Duration::from_secs(timeout),
            })?),
            Command::Fleet { action: FleetAction::Check { place, job, json, expect, nodes, wait, svg, since, timeout } } => {
                let check = fleet::CheckRequest::new(fleet::CheckArgs {
                    place: place.place(),
                    job,
                    expect,
                    nodes,
                    wait: wait.map(Duration::from_secs),
                    since,
                    timeout: Duration::from_secs(timeout),
                })?;
                Request::FleetCheck { check, json, svg }
            }
            Command::NcclLog { file, json } => {
                // A stream comes in on stdin, as `-`.
                let source = if file == "-" { LogSource::Stdin } else { LogSource::File(file.into()) };
                Request::NcclLog { source, json }
            }
            Command::Rendezvous { listen, secret_file, insecure, lease, max_mib, max_client_mib } => Request::Rendezvous {
                listen,
                secret_file,
                insecure,
                lease: lease.map(Duration::from_secs),
                max_bytes: max_mib.saturating_mul(1 << 20),
                max_bytes_per_client: max_client_mib.saturating_mul(1 << 20),
            },
            Command::Stats { addr, interval, once, count, timeout } => {
                use std::io::IsTerminal;
                let request = StatsRequest::new(StatsArgs { addr, interval, timeout, once, count }).map_err(|e| e.to_string())?;
                let style = request.style(std::io::stdout().is_terminal(), std::env::var_os("NO_COLOR").as_deref());
                Request::Stats { request, style }
            }
            Command::Bw(a) => Request::Bw(a),
            Command::Lat(a) => Request::Lat(a),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command, Request};

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

    /// What the command refuses is what the library's requests refuse.
    #[test]
    fn requests_are_decided_by_the_library_s_checks() {
        let decided = |args: &[&str]| parse(args).unwrap().command.decide();
        let e = decided(&["fleet", "check", "/tmp", "--wait", "5"]).err().unwrap();
        assert!(e.contains("--wait needs --expect N or --nodes LIST"), "{e}");
        let e = decided(&["fleet", "check", "/tmp", "--since", &u64::MAX.to_string()]).err().unwrap();
        assert!(e.contains("clock"), "{e}");
        let e = decided(&["fleet", "post", "/tmp", "--job", "j", "--lease", "10"]).err().unwrap();
        assert!(e.contains("applies to --etcd"), "{e}");
        assert!(matches!(decided(&["nccl-log", "-"]), Ok(Request::NcclLog { .. })));
        assert!(matches!(decided(&["doctor", "--pid", "1"]), Ok(Request::Doctor { .. })));
        assert!(matches!(decided(&["stats", "9400", "--once", "--interval", "0.2"]), Ok(Request::Stats { request, .. }) if request.frames == Some(1)));
        assert!(parse(&["stats", "9400", "--once", "--count", "2"]).is_err(), "--once or --count");
        let e = decided(&["stats", "9400", "--interval", "0"]).err().unwrap();
        assert!(e.contains("--interval"), "{e}");
        let e = decided(&["stats", "localhost"]).err().unwrap();
        assert!(e.contains("HOST:PORT"), "{e}");
    }
}
