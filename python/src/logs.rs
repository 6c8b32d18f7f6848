//! The library's log records in Python's `logging`, under the logger
//! `gpudirect` (a record of `gpudirect_engine::conn` goes to
//! `gpudirect.engine.conn`). The library logs through `tracing`, whose
//! `log` feature turns each event into a `log` record; pyo3-log turns those
//! into Python log calls.
//!
//! Not directly: a Python log call needs the GIL, and the engine's own
//! threads log while holding the engine's locks, which a Python thread
//! holding the GIL may be waiting for (a deadlock). So records are queued
//! here, bounded, and one thread of this module, which holds no engine lock,
//! takes the GIL to hand them to Python in order. Records past the bound
//! are dropped, oldest first, and counted in the next one handed over.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, OnceLock};

use log::{Level, LevelFilter, Log, Metadata, Record};
use pyo3::prelude::*;

/// Most records waiting for the GIL.
const MAX_QUEUED: usize = 4096;

/// The most verbose level handed to Python: debug and trace records of
/// the hot paths would cost a queue push each.
const MAX_LEVEL: LevelFilter = LevelFilter::Info;

struct Queued {
    level: Level,
    target: String,
    message: String,
}

#[derive(Default)]
struct Queue {
    records: VecDeque<Queued>,
    dropped: u64,
}

struct Forward {
    queue: Mutex<Queue>,
    ready: Condvar,
    /// pyo3-log's logger, made with the GIL at import and used only by the
    /// forwarding thread, started at the first record.
    python: Mutex<Option<pyo3_log::Logger>>,
    thread: OnceLock<()>,
}

static FORWARD: OnceLock<Forward> = OnceLock::new();

impl Log for Forward {
    fn enabled(&self, meta: &Metadata<'_>) -> bool {
        meta.level() <= MAX_LEVEL && meta.target().starts_with("gpudirect")
    }

    fn log(&self, record: &Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let q = Queued { level: record.level(), target: python_target(record.target()), message: record.args().to_string() };
        {
            let Ok(mut queue) = self.queue.lock() else { return };
            if queue.records.len() == MAX_QUEUED {
                queue.records.pop_front();
                queue.dropped += 1;
            }
            queue.records.push_back(q);
        }
        self.thread.get_or_init(|| {
            let started = std::thread::Builder::new().name("gpudirect-log".into()).spawn(forward);
            if let Err(e) = started {
                eprintln!("gpudirect: cannot start the thread that hands log records to Python: {e}");
            }
        });
        self.ready.notify_one();
    }

    fn flush(&self) {}
}

/// The Python loggers keep one tree under `gpudirect`: the engine crate's
/// records (target `gpudirect_engine::...`) log as `gpudirect.engine...`,
/// where a program's `logging.getLogger("gpudirect")` finds them.
fn python_target(target: &str) -> String {
    match target.strip_prefix("gpudirect_engine") {
        Some(rest) => format!("gpudirect::engine{rest}"),
        None => target.to_owned(),
    }
}

/// Hands queued records to Python until the interpreter is gone.
fn forward() {
    let Some(f) = FORWARD.get() else { return };
    let Some(logger) = f.python.lock().ok().and_then(|mut l| l.take()) else { return };
    loop {
        let (batch, dropped) = {
            let Ok(mut queue) = f.queue.lock() else { return };
            while queue.records.is_empty() {
                queue = match f.ready.wait(queue) {
                    Ok(q) => q,
                    Err(_) => return,
                };
            }
            (std::mem::take(&mut queue.records), std::mem::take(&mut queue.dropped))
        };
        let handed = Python::try_attach(|_py| {
            if dropped > 0 {
                let args = format_args!("{dropped} log record(s) dropped: Python did not take them as fast as they came");
                logger.log(&Record::builder().level(Level::Warn).target("gpudirect").args(args).build());
            }
            for q in &batch {
                logger.log(&Record::builder().level(q.level).target(&q.target).args(format_args!("{}", q.message)).build());
            }
        });
        if handed.is_none() {
            // The interpreter is finalizing: nobody is left to log to.
            return;
        }
    }
}

/// Installs the forwarding logger (once per process; a second import or
/// a logger already installed by another module leaves it as it is).
pub fn install(py: Python<'_>) -> PyResult<()> {
    let logger = pyo3_log::Logger::new(py, pyo3_log::Caching::LoggersAndLevels)?.filter(MAX_LEVEL);
    let forward = Forward { queue: Mutex::default(), ready: Condvar::new(), python: Mutex::new(Some(logger)), thread: OnceLock::new() };
    if FORWARD.set(forward).is_err() {
        return Ok(());
    }
    if let Some(f) = FORWARD.get() {
        if log::set_logger(f).is_ok() {
            log::set_max_level(MAX_LEVEL);
        }
    }
    Ok(())
}
