//! The files a user hands the doctor and nccl-log (an env file or job
//! script, NCCL configuration files, a capture, probe answers, a process's
//! environment, an NCCL log), opened one way: regular files only, opened
//! without blocking, and read up to a bound. A FIFO, `/dev/stdin`, a
//! device (`/dev/zero`) or a file past its bound is a typed error naming
//! it, never a hang or an unbounded read. A leaf: nothing above it.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Most bytes of an env file, a job script or an NCCL configuration
/// file: real ones are a few KiB.
pub const SCRIPT_LIMIT: u64 = 4 << 20;

/// Most bytes of a capture or a probe-answers file: a capture of an
/// 8-GPU node is about 200 KiB.
pub const CAPTURE_LIMIT: u64 = 64 << 20;

/// Why an input file was not read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum InputError {
    /// It could not be opened or read.
    #[error("cannot read the {what} {path}: {source}")]
    Io {
        /// What it was to be (`env file`, `capture`, ...).
        what: &'static str,
        /// The path as given.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Not a regular file: reading a FIFO or a terminal would wait for a
    /// writer, and a device may never end.
    #[error("the {what} {path} is a {kind}, not a regular file: save it to a file first{hint}")]
    NotRegular {
        /// What it was to be.
        what: &'static str,
        /// The path as given.
        path: String,
        /// What it is.
        kind: &'static str,
        /// How to hand it over instead, when there is another way.
        hint: &'static str,
    },
    /// Larger than the doctor reads of such a file.
    #[error("the {what} {path} is larger than {limit} bytes, the most read of one: is it the right file?")]
    TooLarge {
        /// What it was to be.
        what: &'static str,
        /// The path as given.
        path: String,
        /// The bound.
        limit: u64,
    },
}

fn kind_of(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "directory"
    } else if t.is_fifo() {
        "FIFO (pipe)"
    } else if t.is_char_device() {
        "character device"
    } else if t.is_block_device() {
        "block device"
    } else if t.is_socket() {
        "socket"
    } else {
        "special file"
    }
}

/// Opens `path` for reading if it is a regular file (links followed),
/// without blocking on a FIFO.
///
/// # Errors
/// [`InputError::NotRegular`] naming what it is, [`InputError::Io`].
pub fn open_regular(path: &Path, what: &'static str, hint: &'static str) -> Result<File, InputError> {
    let shown = || path.display().to_string();
    let io = |source| InputError::Io { what, path: shown(), source };
    let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path).map_err(io)?;
    let t = f.metadata().map_err(io)?.file_type();
    if !t.is_file() {
        return Err(InputError::NotRegular { what, path: shown(), kind: kind_of(t), hint });
    }
    Ok(f)
}

/// The bytes of the regular file `path`, at most `limit` of them.
///
/// # Errors
/// As [`open_regular`]; [`InputError::TooLarge`] past `limit` (counted
/// as read: procfs files report no size).
pub fn read_bounded(path: &Path, what: &'static str, limit: u64) -> Result<Vec<u8>, InputError> {
    let f = open_regular(path, what, "")?;
    let too_large = || InputError::TooLarge { what, path: path.display().to_string(), limit };
    if f.metadata().is_ok_and(|m| m.len() > limit) {
        return Err(too_large());
    }
    let mut buf = Vec::new();
    f.take(limit + 1).read_to_end(&mut buf).map_err(|source| InputError::Io { what, path: path.display().to_string(), source })?;
    if buf.len() as u64 > limit {
        return Err(too_large());
    }
    Ok(buf)
}

/// [`read_bounded`] as text, invalid UTF-8 replaced.
///
/// # Errors
/// As [`read_bounded`].
pub fn read_text(path: &Path, what: &'static str, limit: u64) -> Result<String, InputError> {
    read_bounded(path, what, limit).map(|b| String::from_utf8(b).unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_are_read_and_only_up_to_their_bound() {
        let dir = std::env::temp_dir().join(format!("gpudirect-input-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let small = dir.join("env");
        std::fs::write(&small, "NCCL_IB_DISABLE=1\n").unwrap();
        assert_eq!(read_text(&small, "env file", 64).unwrap(), "NCCL_IB_DISABLE=1\n");
        let e = read_bounded(&small, "env file", 4).unwrap_err();
        assert!(matches!(e, InputError::TooLarge { limit: 4, .. }), "{e}");
        // A FIFO with no writer: refused at once, not waited on.
        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = std::time::Instant::now();
        let e = read_bounded(&fifo, "env file", SCRIPT_LIMIT).unwrap_err();
        assert!(matches!(e, InputError::NotRegular { kind: "FIFO (pipe)", .. }), "{e}");
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        // A device that never ends, through a link.
        let link = dir.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let e = read_bounded(&link, "capture", CAPTURE_LIMIT).unwrap_err();
        assert!(e.to_string().contains("character device, not a regular file"), "{e}");
        let e = read_bounded(&dir, "capture", CAPTURE_LIMIT).unwrap_err();
        assert!(matches!(e, InputError::NotRegular { kind: "directory", .. }), "{e}");
        // procfs reports no size: counted as read.
        let e = read_bounded(Path::new("/proc/self/maps"), "environment", 16).unwrap_err();
        assert!(matches!(e, InputError::TooLarge { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
