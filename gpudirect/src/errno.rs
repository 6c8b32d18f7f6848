//! Operating-system error numbers as verbs return them: a leaf of plain
//! data, which the error type and every module that reports an errno use.

use std::fmt;

/// An operating-system error number as returned by a verb (`errno`).
///
/// Displays as its symbolic name and its meaning, e.g.
/// `EOPNOTSUPP (Operation not supported)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(transparent))]
pub struct Errno(pub i32);

impl Errno {
    /// The calling thread's current `errno`.
    pub fn last() -> Errno {
        Errno(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    /// The symbolic name (`"ENOMEM"`), when it is one verbs are known to return.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            libc::EPERM => "EPERM",
            libc::ENOENT => "ENOENT",
            libc::EINTR => "EINTR",
            libc::EIO => "EIO",
            libc::EBADF => "EBADF",
            libc::EAGAIN => "EAGAIN",
            libc::ENOMEM => "ENOMEM",
            libc::EACCES => "EACCES",
            libc::EFAULT => "EFAULT",
            libc::EBUSY => "EBUSY",
            libc::EEXIST => "EEXIST",
            libc::ENODEV => "ENODEV",
            libc::EINVAL => "EINVAL",
            libc::ENOSPC => "ENOSPC",
            libc::ENOSYS => "ENOSYS",
            libc::EPROTONOSUPPORT => "EPROTONOSUPPORT",
            libc::EOPNOTSUPP => "EOPNOTSUPP",
            libc::ETIMEDOUT => "ETIMEDOUT",
            libc::ECONNREFUSED => "ECONNREFUSED",
            libc::ECONNRESET => "ECONNRESET",
            libc::EADDRINUSE => "EADDRINUSE",
            libc::EADDRNOTAVAIL => "EADDRNOTAVAIL",
            libc::ENETUNREACH => "ENETUNREACH",
            libc::EHOSTUNREACH => "EHOSTUNREACH",
            _ => return None,
        })
    }

    /// The C library's description (`strerror`).
    pub fn description(self) -> String {
        let s = std::io::Error::from_raw_os_error(self.0).to_string();
        // std appends " (os error N)"; the name already says which.
        match s.rfind(" (os error") {
            Some(i) => s[..i].to_owned(),
            None => s,
        }
    }
}

impl fmt::Display for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n} ({})", self.description()),
            None => write!(f, "errno {} ({})", self.0, self.description()),
        }
    }
}

impl fmt::Debug for Errno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}
