//! A job's folder (`DIR/JOB/`), written and read without following a
//! link. The folder is shared, and whoever may write it may plant a link
//! in it; a `fleet post` run as root (a Slurm prolog) that followed one
//! would overwrite any file on the node. So the job's folder is opened
//! once, refusing a link, and everything in it is reached relative to
//! that descriptor: the temporary file is created with
//! `O_CREAT|O_EXCL|O_NOFOLLOW` (a planted entry of its name, a link
//! most of all, is refused, never written through), renamed within the
//! folder, and captures are opened with `O_NOFOLLOW`, as regular files
//! only, up to the capture bound.
//!
//! Beside each node's capture, `.NODE.poster` names who posted it (host
//! and user). A post of a node another poster posted does not replace
//! the capture: it adds itself to that file, and `fleet check` reports
//! the node as a conflict naming both. A claim, not a proof: the folder
//! cannot tell who wrote a file, and anyone who may write it may edit
//! both files by hand.

use std::ffi::CString;
use std::fs::{File, Metadata};
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The most bytes of a `.NODE.poster` file: a few posters' names.
const CLAIM_LIMIT: u64 = 64 << 10;
/// The most posters a claim file keeps: two make a conflict, a few more
/// show who else tried.
const MAX_POSTERS: usize = 8;

/// A job's folder, opened without following a link.
pub(super) struct JobDir {
    fd: OwnedFd,
    /// As errors name it.
    path: PathBuf,
}

/// What a name in the folder is, without following it.
fn kind_of(st: &libc::stat) -> &'static str {
    match st.st_mode & libc::S_IFMT {
        libc::S_IFLNK => "symbolic link",
        libc::S_IFDIR => "directory",
        libc::S_IFIFO => "FIFO (pipe)",
        libc::S_IFCHR => "character device",
        libc::S_IFBLK => "block device",
        libc::S_IFSOCK => "socket",
        libc::S_IFREG => "regular file",
        _ => "special file",
    }
}

fn c_name(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a name with a NUL byte"))
}

impl JobDir {
    /// The folder `DIR/JOB` (without a job, `DIR` itself), refused when
    /// it is a link; with `create`, made when missing (and `DIR` too).
    ///
    /// # Errors
    /// A folder that is a link or not a folder, or cannot be opened or made.
    pub(super) fn open(dir: &Path, job: Option<&str>, create: bool) -> Result<JobDir, String> {
        let path = super::job_dir(dir, job)?;
        let at = |e: io::Error| format!("{}: {e}", path.display());
        let fd = match job {
            Some(job) => {
                // DIR is the operator's choice and may be a link; the job's
                // folder inside it is anyone's who may write DIR.
                if create {
                    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
                }
                let base: OwnedFd = std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
                    .open(dir)
                    .map_err(|e| format!("{}: {e}", dir.display()))?
                    .into();
                let name = c_name(job).map_err(at)?;
                if create {
                    // SAFETY: `base` is open for the call and `name` is
                    // NUL-terminated; mkdirat creates, never follows, the
                    // last component.
                    if unsafe { libc::mkdirat(base.as_raw_fd(), name.as_ptr(), 0o777) } != 0 {
                        let e = io::Error::last_os_error();
                        if e.kind() != io::ErrorKind::AlreadyExists {
                            return Err(at(e));
                        }
                    }
                }
                openat(&base, &name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)
            }
            None => std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(dir)
                .map(OwnedFd::from),
        };
        match fd {
            Ok(fd) => Ok(JobDir { fd, path }),
            // ELOOP: the last component is a link; ENOTDIR: not a folder.
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                let kind = std::fs::symlink_metadata(&path).map_or("not a folder", |m| if m.file_type().is_symlink() { "symbolic link" } else { "not a folder" });
                Err(format!("the job's folder {} is a {kind}: refused (a job's folder is a folder, never a link, so no write or read goes where a link points)", path.display()))
            }
            Err(e) => Err(at(e)),
        }
    }

    /// `name` in the folder, as errors name it.
    pub(super) fn shown(&self, name: &str) -> String {
        self.path.join(name).display().to_string()
    }

    /// What `name` is, without following it; `None` when there is nothing.
    fn lstat(&self, name: &str) -> Result<Option<libc::stat>, String> {
        let c = c_name(name).map_err(|e| format!("{}: {e}", self.shown(name)))?;
        // SAFETY: a zeroed `stat` is a valid value of a plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `self.fd` is open, `c` NUL-terminated, `st` writable
        // for the call; AT_SYMLINK_NOFOLLOW describes a link, not its target.
        if unsafe { libc::fstatat(self.fd.as_raw_fd(), c.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } == 0 {
            return Ok(Some(st));
        }
        match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::NotFound => Ok(None),
            e => Err(format!("{}: {e}", self.shown(name))),
        }
    }

    /// The names in the folder.
    ///
    /// # Errors
    /// When it cannot be listed.
    pub(super) fn names(&self) -> Result<Vec<String>, String> {
        // The descriptor's own entry in /proc is the folder opened, not
        // its path looked up again: no link can be swapped in meanwhile.
        let me = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let entries = std::fs::read_dir(&me).map_err(|e| format!("{}: {e} (listed through {me})", self.path.display()))?;
        Ok(entries.flatten().filter_map(|e| e.file_name().into_string().ok()).collect())
    }

    /// The regular file `name` in the folder, at most `limit` bytes, and
    /// its metadata; `None` when there is none. A link is refused, not
    /// followed; a FIFO or device is refused without waiting on it.
    ///
    /// # Errors
    /// Anything but a regular file within `limit`, or a read that fails.
    pub(super) fn read(&self, name: &str, what: &str, limit: u64) -> Result<Option<(Vec<u8>, Metadata)>, String> {
        let shown = self.shown(name);
        let c = c_name(name).map_err(|e| format!("{shown}: {e}"))?;
        let f = match openat(&self.fd, &c, libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK, 0) {
            Ok(fd) => File::from(fd),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                return Err(format!("the {what} {shown} is a symbolic link: not followed (a {what} is a file in the job's folder)"));
            }
            Err(e) => return Err(format!("cannot read the {what} {shown}: {e}")),
        };
        let m = f.metadata().map_err(|e| format!("cannot read the {what} {shown}: {e}"))?;
        let t = m.file_type();
        if !t.is_file() {
            let kind = if t.is_dir() {
                "directory"
            } else if t.is_fifo() {
                "FIFO (pipe)"
            } else if t.is_char_device() || t.is_block_device() {
                "device"
            } else {
                "special file"
            };
            return Err(format!("the {what} {shown} is a {kind}, not a regular file"));
        }
        let too_large = || format!("the {what} {shown} is larger than {limit} bytes, the most read of one");
        if m.len() > limit {
            return Err(too_large());
        }
        let mut buf = Vec::new();
        f.take(limit + 1).read_to_end(&mut buf).map_err(|e| format!("cannot read the {what} {shown}: {e}"))?;
        if buf.len() as u64 > limit {
            return Err(too_large());
        }
        Ok(Some((buf, m)))
    }

    /// Writes `bytes` into a new temporary file for `name`, created
    /// exclusively and never through a link; returns its name.
    fn temporary(&self, name: &str, bytes: &[u8]) -> Result<CString, String> {
        let tmp = format!(".{name}.{}.tmp", std::process::id());
        let c_tmp = c_name(&tmp).map_err(|e| format!("{}: {e}", self.shown(&tmp)))?;
        let fd = openat(&self.fd, &c_tmp, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW, 0o644).map_err(|e| match self.lstat(&tmp) {
            Ok(Some(st)) if e.kind() == io::ErrorKind::AlreadyExists => format!(
                "{} already exists, a {}: refused, not written through (a post of this node under way, one that died, or a planted entry: remove it)",
                self.shown(&tmp),
                kind_of(&st)
            ),
            _ => format!("{}: {e}", self.shown(&tmp)),
        })?;
        if let Err(e) = File::from(fd).write_all(bytes) {
            self.unlink(&c_tmp);
            return Err(format!("{}: {e}", self.shown(&tmp)));
        }
        Ok(c_tmp)
    }

    /// Removes the temporary file `tmp` this process made.
    fn unlink(&self, tmp: &CString) {
        // SAFETY: `self.fd` is open and `tmp` NUL-terminated; unlinkat
        // removes the entry itself, never a link's target.
        unsafe { libc::unlinkat(self.fd.as_raw_fd(), tmp.as_ptr(), 0) };
    }

    /// Writes `bytes` as `name`: into a [temporary file](Self::temporary),
    /// then renamed over `name` within the folder, so a reader sees the
    /// old file or the new one, never half, and nothing is written
    /// outside the folder.
    ///
    /// # Errors
    /// A link or anything but a regular file at `name` (named), an entry
    /// planted at the temporary file's name (named), or a write that fails.
    pub(super) fn replace(&self, name: &str, bytes: &[u8]) -> Result<(), String> {
        if let Some(st) = self.lstat(name)? {
            if st.st_mode & libc::S_IFMT != libc::S_IFREG {
                return Err(format!("{} is a {}: refused (only a regular file is replaced)", self.shown(name), kind_of(&st)));
            }
        }
        let c = c_name(name).map_err(|e| format!("{}: {e}", self.shown(name)))?;
        let tmp = self.temporary(name, bytes)?;
        // SAFETY: both names are NUL-terminated and relative to the same
        // open descriptor; renameat replaces an entry at the target, a
        // link too, and never writes where one points.
        if unsafe { libc::renameat(self.fd.as_raw_fd(), tmp.as_ptr(), self.fd.as_raw_fd(), c.as_ptr()) } != 0 {
            let e = io::Error::last_os_error();
            self.unlink(&tmp);
            return Err(format!("{}: {e}", self.shown(name)));
        }
        Ok(())
    }

    /// Who posted `node`'s capture, as its `.NODE.poster` file says (one
    /// a line); empty when there is no such file.
    ///
    /// # Errors
    /// A claim file that is a link, not a regular file, or too large.
    pub(super) fn posters(&self, node: &str) -> Result<Vec<String>, String> {
        Ok(match self.read(&claim_name(node), "poster file", CLAIM_LIMIT)? {
            // Whoever may write the folder wrote these: shown escaped.
            Some((b, _)) => String::from_utf8_lossy(&b).lines().filter(|l| !l.is_empty()).map(crate::doctor::shown).collect(),
            None => Vec::new(),
        })
    }

    /// Claims `node` for `me` before its capture is written: the first
    /// claim makes `.NODE.poster` whole or not at all (linked into place,
    /// which fails when the name exists), and a claim by another poster
    /// adds `me` to it and is refused, naming every poster.
    ///
    /// # Errors
    /// The posters, when another claimed the node first; or a claim file
    /// that cannot be read or written.
    pub(super) fn claim(&self, node: &str, me: &str) -> Result<(), String> {
        let name = claim_name(node);
        let c = c_name(&name).map_err(|e| format!("{}: {e}", self.shown(&name)))?;
        let tmp = self.temporary(&name, format!("{me}\n").as_bytes())?;
        // SAFETY: both names are NUL-terminated and relative to the same
        // open descriptor; linkat (flags 0) follows no link and fails
        // with EEXIST when the name exists, whatever it is.
        let linked = unsafe { libc::linkat(self.fd.as_raw_fd(), tmp.as_ptr(), self.fd.as_raw_fd(), c.as_ptr(), 0) };
        let e = io::Error::last_os_error();
        self.unlink(&tmp);
        match linked {
            0 => return Ok(()),
            _ if e.kind() == io::ErrorKind::AlreadyExists => {}
            _ => return Err(format!("{}: {e}", self.shown(&name))),
        }
        let mut posters = self.posters(node)?;
        if posters.iter().all(|p| p == me) {
            if posters.is_empty() {
                self.replace(&name, format!("{me}\n").as_bytes())?;
            }
            return Ok(());
        }
        if !posters.iter().any(|p| p == me) && posters.len() < MAX_POSTERS {
            posters.push(me.to_owned());
            self.replace(&name, (posters.join("\n") + "\n").as_bytes())?;
        }
        Err(format!(
            "{} is claimed by {}: not replaced; a conflict, which `fleet check` reports naming every poster (remove it and {name}, then post again from the node itself)",
            self.shown(&format!("{node}.json")),
            posters.join(" and ")
        ))
    }
}

/// The file naming who posted `node`'s capture.
fn claim_name(node: &str) -> String {
    format!(".{node}.poster")
}

/// This poster as a claim file names it: host and user.
pub(super) fn this_poster() -> String {
    let host = super::this_node().unwrap_or_else(|| "(a host without a name)".into());
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    format!("{host} (uid {uid})")
}

/// `openat(2)` with `O_CLOEXEC`, as an owned descriptor.
fn openat(dir: &OwnedFd, name: &CString, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: `dir` is open for the call and `name` NUL-terminated; the
    // mode is read only with O_CREAT.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC, libc::c_uint::from(mode)) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by openat and is owned by nothing else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}
