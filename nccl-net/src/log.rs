//! Lines into NCCL's own log, through the logger NCCL hands to `init`:
//! they appear with NCCL's prefix (`host:pid:tid [dev] NCCL INFO ...`) and
//! obey `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` like NCCL's own lines.

use std::ffi::{c_char, CString};
use std::sync::Mutex;

use crate::abi::{self, Logger};

static LOGGER: Mutex<Logger> = Mutex::new(None);

/// Every line starts with this, as NCCL's IB transport's start with `NET/IB :`.
pub const PREFIX: &str = gpudirect::nccl::PLUGIN_PREFIX;

/// Keeps NCCL's logger for later lines (each `init` may hand a new one).
pub fn set(logger: Logger) {
    if logger.is_some() {
        *LOGGER.lock().unwrap_or_else(|e| e.into_inner()) = logger;
    }
}

/// A WARN line (shown at `NCCL_DEBUG=WARN` and above).
pub fn warn(text: &str) {
    emit(abi::LOG_WARN, abi::SUBSYS_NET, text);
}

/// An INFO line of subsystem NET (shown at `NCCL_DEBUG=INFO`).
pub fn info(text: &str) {
    emit(abi::LOG_INFO, abi::SUBSYS_NET, text);
}

/// An INFO line of subsystems INIT and NET.
pub fn info_init(text: &str) {
    emit(abi::LOG_INFO, abi::SUBSYS_INIT | abi::SUBSYS_NET, text);
}

fn emit(level: i32, flags: std::ffi::c_ulong, text: &str) {
    let logger = *LOGGER.lock().unwrap_or_else(|e| e.into_inner());
    let line = format!("{PREFIX}{text}");
    let Some(log) = logger else {
        // Before init (or from a host that passed no logger) WARN lines
        // still reach someone.
        if level == abi::LOG_WARN {
            eprintln!("NCCL WARN {line}");
        }
        return;
    };
    let c = CString::new(line.replace('\0', " ")).unwrap_or_default();
    let file = c"nccl-net-gpudirect".as_ptr();
    // SAFETY: NCCL's logger is printf-like; the format is "%s" and the one
    // argument a NUL-terminated string that outlives the call.
    unsafe { log(level, flags, file, line!() as i32, c"%s".as_ptr(), c.as_ptr() as *const c_char) };
}
