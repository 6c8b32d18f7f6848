//! The machine's files (sysfs, procfs, /dev) read through one root path, so
//! every check that reads them can run against a fixture tree in tests;
//! and its page size.

use std::io;
use std::path::{Path, PathBuf};

/// A root under which `/sys`, `/proc` and `/dev` are read: `/` on a live
/// machine, a fixture directory in tests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysRoot {
    root: PathBuf,
}

impl Default for SysRoot {
    fn default() -> Self {
        SysRoot::live()
    }
}

impl SysRoot {
    /// The running machine (`/`).
    pub fn live() -> SysRoot {
        SysRoot { root: PathBuf::from("/") }
    }

    /// A fixture tree laid out like `/`.
    pub fn at(root: impl Into<PathBuf>) -> SysRoot {
        SysRoot { root: root.into() }
    }

    /// Where an absolute machine path (`/sys/...`) lives under this root.
    pub fn path(&self, machine_path: &str) -> PathBuf {
        self.root.join(machine_path.trim_start_matches('/'))
    }

    /// Whether the machine path exists.
    pub fn exists(&self, machine_path: &str) -> bool {
        self.path(machine_path).exists()
    }

    /// The file's text, trimmed of surrounding white space.
    ///
    /// # Errors
    /// The I/O error of reading it (e.g. `NotFound`, `PermissionDenied`).
    pub fn read(&self, machine_path: &str) -> io::Result<String> {
        Ok(std::fs::read_to_string(self.path(machine_path))?.trim().to_owned())
    }

    /// The root directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }
}

/// The system page size (`sysconf(_SC_PAGESIZE)`; 4096 if it fails).
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}
