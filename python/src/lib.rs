//! `gpudirect._native`: the Python package's native module. A thin layer:
//! the engine is `gpudirect_engine` (`engine.rs`, its errors mapped to one
//! exception class per kind in `errors.rs`); the judging is
//! `gpudirect_tools`' (the same code as the `gpudirect` command), whose
//! reports cross as JSON that `gpudirect/__init__.py` turns into dicts. The
//! GIL is released around every post, wait and probe. The library's log
//! records reach Python's `logging` (`logs.rs`).

use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use gpudirect_tools::doctor::log::{explain_log, LogSource};
use gpudirect_tools::doctor::report::{Brief, Options, Report};
use gpudirect_tools::doctor::sources::{judge, Sources};
use gpudirect_tools::fleet;

mod engine;
mod errors;
mod logs;

create_exception!(gpudirect._native, GpudirectError, PyException, "Base class of every error gpudirect raises.");
create_exception!(
    gpudirect._native,
    DoctorError,
    GpudirectError,
    "The doctor could not run: an input (capture, env file, process, NCCL log) could not be read, or a capture could not be written."
);

/// What a judgement returns to Python: the JSON report, the text the
/// command prints, and the command's exit status.
type Rendered = (String, String, u8);

fn render(report: &Report, verbose: bool) -> PyResult<Rendered> {
    let json = serde_json::to_string(report).map_err(|e| GpudirectError::new_err(e.to_string()))?;
    let text = if verbose { report.to_string() } else { Brief(report).to_string() };
    Ok((json, text, report.exit_status()))
}

/// Judges this machine (or a capture) for the job's environment; see
/// `gpudirect.doctor`.
#[pyfunction]
#[pyo3(signature = (*, env_file=None, pid=None, nccl_log=None, capture=None, from_capture=None, gpu=None, device=None, verbose=false))]
#[allow(clippy::too_many_arguments)]
fn doctor(
    py: Python<'_>,
    env_file: Option<PathBuf>,
    pid: Option<u32>,
    nccl_log: Option<PathBuf>,
    capture: Option<PathBuf>,
    from_capture: Option<PathBuf>,
    gpu: Option<usize>,
    device: Option<String>,
    verbose: bool,
) -> PyResult<Rendered> {
    let sources = Sources { shell_over_capture: true, env_file, pid, nccl_log, capture, from: from_capture, ..Sources::this_machine() };
    let opts = Options { gpu, device };
    // Probing verbs and CUDA takes time; other Python threads run meanwhile.
    let report = py.detach(|| judge(&sources, &opts)).map_err(DoctorError::new_err)?;
    render(&report, verbose)
}

/// Reads an `NCCL_DEBUG=INFO` log's text; see `gpudirect.explain_nccl_log`.
#[pyfunction]
fn explain_nccl_log(py: Python<'_>, text: String) -> PyResult<Rendered> {
    let report = py.detach(|| explain_log(&LogSource::Text(text))).map_err(DoctorError::new_err)?;
    let json = serde_json::to_string(&report).map_err(|e| GpudirectError::new_err(e.to_string()))?;
    Ok((json, report.to_string(), report.exit_status()))
}

/// Judges every node's capture of a job together, from a shared folder,
/// the rendezvous server or etcd; see `gpudirect.fleet_check`.
#[pyfunction]
#[pyo3(signature = (dir=None, *, job=None, rendezvous=None, etcd=None, expect=None, nodes=None, wait=None, since=None, timeout=30.0))]
#[allow(clippy::too_many_arguments)]
fn fleet_check(
    py: Python<'_>,
    dir: Option<PathBuf>,
    job: Option<String>,
    rendezvous: Option<String>,
    etcd: Option<Vec<String>>,
    expect: Option<usize>,
    nodes: Option<String>,
    wait: Option<f64>,
    since: Option<u64>,
    timeout: f64,
) -> PyResult<Rendered> {
    // Python's seconds as a Duration; what they mean is the library's
    // to check, as for the command line.
    let secs = |what: &str, s: f64| {
        std::time::Duration::try_from_secs_f64(s).map_err(|_| PyValueError::new_err(format!("{what} {s}: seconds, at least 0 and finite")))
    };
    let args = fleet::CheckArgs {
        place: fleet::Place { dir, rendezvous, etcd: etcd.unwrap_or_default() },
        job,
        expect,
        nodes,
        wait: wait.map(|w| secs("wait", w)).transpose()?,
        since,
        timeout: secs("timeout", timeout)?,
    };
    let report = py.detach(|| fleet::CheckRequest::new(args)?.run()).map_err(DoctorError::new_err)?;
    let json = serde_json::to_string(&report).map_err(|e| GpudirectError::new_err(e.to_string()))?;
    Ok((json, report.to_string(), report.exit_status()))
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    logs::install(m.py())?;
    m.add_function(wrap_pyfunction!(doctor, m)?)?;
    m.add_function(wrap_pyfunction!(explain_nccl_log, m)?)?;
    m.add_function(wrap_pyfunction!(fleet_check, m)?)?;
    m.add("GpudirectError", m.py().get_type::<GpudirectError>())?;
    m.add("DoctorError", m.py().get_type::<DoctorError>())?;
    engine::add(m)?;
    Ok(())
}
