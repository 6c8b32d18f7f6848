//! `nccl-log`, decided once: where the log comes from ([`LogSource`]),
//! read bounded and streamed, and the variables it shows NCCL read judged
//! by the doctor's rules. The command line and the Python package each
//! name a source and render the report.

use std::path::PathBuf;

use crate::nccl_log::{explain, explain_reader, Report};

/// Where an `NCCL_DEBUG=INFO` log comes from.
#[derive(Clone, Debug)]
pub enum LogSource {
    /// Standard input (`-`): a stream of any length.
    Stdin,
    /// A regular file (a FIFO or device is refused, never waited on).
    File(PathBuf),
    /// Text already in memory (Python's).
    Text(String),
}

impl LogSource {
    /// How the report names it.
    fn shown(&self) -> String {
        match self {
            LogSource::Stdin => "-".into(),
            LogSource::File(p) => p.display().to_string(),
            LogSource::Text(_) => "the log given".into(),
        }
    }
}

/// Reads the log (streamed: memory stays bounded whatever its size) and
/// judges the environment it shows.
///
/// # Errors
/// A sentence naming what could not be read.
pub fn explain_log(source: &LogSource) -> Result<Report, String> {
    let mut report = match source {
        LogSource::Stdin => explain_reader(std::io::stdin().lock()).map_err(|e| format!("cannot read stdin: {e}"))?,
        LogSource::File(path) => {
            let f = super::input::open_regular(path, "NCCL log", " or pipe it in (`... | gpudirect nccl-log -`)").map_err(|e| e.to_string())?;
            explain_reader(std::io::BufReader::with_capacity(1 << 20, f)).map_err(|e| format!("cannot read {}: {e}", path.display()))?
        }
        LogSource::Text(text) => explain(text),
    };
    super::env::judge_log_environment(&mut report, &source.shown());
    Ok(report)
}
