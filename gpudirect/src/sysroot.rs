//! The machine's files (sysfs, procfs, /dev) read through one root path, so
//! every check that reads them can run against a fixture tree in tests;
//! and its page size.
//!
//! Every read stays inside the root: symlinks are followed the way the
//! kernel follows them, but an absolute target restarts at the root and
//! `..` at the root stays there, so a fixture (or a hostile tree) can never
//! make a reader see the real `/`. Reads are bounded and open regular files
//! only (never a FIFO or device node, which could block or have side
//! effects).
//!
//! A root can also record what it is asked ([`SysRoot::recording`]), so a
//! tool can copy exactly the files a judgement read (the doctor's
//! `--capture`) and judge them again elsewhere.

use std::collections::BTreeMap;
use std::io::{self, BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The most [`SysRoot::read`] returns: sysfs attributes are a page at most;
/// this keeps a fixture (or a misbehaving file) from being read whole.
pub const TEXT_LIMIT: u64 = 64 * 1024;
/// The most [`SysRoot::any_line`] streams through (`/proc/kallsyms` is a
/// few MiB).
const STREAM_LIMIT: u64 = 256 << 20;
/// Linux's own limit on symlink hops (MAXSYMLINKS).
const MAX_SYMLINK_HOPS: usize = 40;

/// A root under which `/sys`, `/proc` and `/dev` are read: `/` on a live
/// machine, a fixture directory in tests.
///
/// Two roots are equal when they read the same directory (or the same
/// tree in memory), recording or not.
#[derive(Clone, Debug)]
pub struct SysRoot {
    root: PathBuf,
    /// Shared by clones, so a recording root handed down by value still
    /// records into one place.
    seen: Option<Arc<Mutex<BTreeMap<String, Access>>>>,
    /// A tree held in memory instead of `root` on disk.
    mem: Option<Arc<MemTree>>,
}

impl PartialEq for SysRoot {
    fn eq(&self, other: &SysRoot) -> bool {
        match (&self.mem, &other.mem) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => self.root == other.root,
            _ => false,
        }
    }
}

/// A file tree held in memory (a saved capture's), read through
/// [`SysRoot::in_memory`] exactly as the same tree on disk would be read:
/// directories, regular files and symbolic links by machine path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemTree {
    nodes: BTreeMap<String, MemNode>,
}

/// One path of a [`MemTree`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemNode {
    /// A directory.
    Dir,
    /// A regular file and its bytes.
    File(Vec<u8>),
    /// A symbolic link and its target, as written.
    Link(String),
}

/// What a path is, as `lstat` says.
enum Kind {
    Dir,
    File,
    Link(String),
}

impl MemTree {
    /// An empty tree (only `/`).
    pub fn new() -> MemTree {
        MemTree::default()
    }

    /// Puts `node` at the absolute machine path `path` (replacing what was
    /// there), its missing parents as directories.
    pub fn insert(&mut self, path: &str, node: MemNode) {
        let path = format!("/{}", path.trim_matches('/'));
        let mut at = path.as_str();
        while let Some((parent, _)) = at.rsplit_once('/') {
            if parent.is_empty() {
                break;
            }
            self.nodes.entry(parent.to_owned()).or_insert(MemNode::Dir);
            at = parent;
        }
        if path != "/" {
            self.nodes.insert(path, node);
        }
    }

    /// What is at `path`, if anything.
    pub fn get(&self, path: &str) -> Option<&MemNode> {
        self.nodes.get(path)
    }

    /// How many paths the tree holds (its parents included).
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree holds nothing but `/`.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn kind(&self, path: &str) -> Option<Kind> {
        if path == "/" {
            return Some(Kind::Dir);
        }
        Some(match self.nodes.get(path)? {
            MemNode::Dir => Kind::Dir,
            MemNode::File(_) => Kind::File,
            MemNode::Link(t) => Kind::Link(t.clone()),
        })
    }

    fn children(&self, path: &str) -> Vec<String> {
        let prefix = if path == "/" { "/".to_owned() } else { format!("{path}/") };
        self.nodes
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter_map(|(k, _)| {
                let rest = &k[prefix.len()..];
                (!rest.is_empty() && !rest.contains('/')).then(|| rest.to_owned())
            })
            .collect()
    }
}

impl Eq for SysRoot {}

impl Default for SysRoot {
    fn default() -> Self {
        SysRoot::live()
    }
}

/// What [`SysRoot::resolve_visiting`] passed on the way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Passed<'a> {
    /// A directory.
    Dir,
    /// A symbolic link, with its target as written.
    Link(&'a str),
}

/// What a [`recording`](SysRoot::recording) root was asked about one
/// machine path, the most a reader needed of it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Whether it exists, is a directory, or where its links lead.
    Stat,
    /// The directory's entry names.
    List,
    /// The first line [`any_line`](SysRoot::any_line) accepted (`None`:
    /// none was), not the whole file: `/proc/kallsyms` is megabytes.
    Line(Option<String>),
    /// The file's bytes, up to [`TEXT_LIMIT`].
    Read,
}

impl SysRoot {
    /// The running machine (`/`).
    pub fn live() -> SysRoot {
        SysRoot::at("/")
    }

    /// A fixture tree laid out like `/`.
    pub fn at(root: impl Into<PathBuf>) -> SysRoot {
        SysRoot { root: root.into(), seen: None, mem: None }
    }

    /// A root over a tree held in memory (a saved capture's): read as the
    /// same tree unpacked on disk would be, without touching the disk.
    /// [`path`](Self::path) and [`root`](Self::root) name a directory that
    /// does not exist.
    pub fn in_memory(tree: MemTree) -> SysRoot {
        SysRoot { root: PathBuf::from("/nonexistent/gpudirect-in-memory-root"), seen: None, mem: Some(Arc::new(tree)) }
    }

    /// What `at` (a machine path with no link to resolve above it) is.
    fn kind(&self, at: &str) -> Option<Kind> {
        if let Some(mem) = &self.mem {
            return mem.kind(at);
        }
        let host = self.path(at);
        let meta = std::fs::symlink_metadata(&host).ok()?;
        if meta.file_type().is_symlink() {
            return Some(Kind::Link(std::fs::read_link(&host).ok()?.to_str()?.to_owned()));
        }
        Some(if meta.is_dir() { Kind::Dir } else { Kind::File })
    }

    /// This root, recording from now on every machine path asked about
    /// through it or its clones ([`recorded`](Self::recorded)).
    pub fn recording(self) -> SysRoot {
        SysRoot { seen: Some(Arc::default()), ..self }
    }

    /// What a [`recording`](Self::recording) root was asked, per machine
    /// path as asked (before links were followed); empty when not
    /// recording.
    pub fn recorded(&self) -> BTreeMap<String, Access> {
        self.seen.as_ref().map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).clone()).unwrap_or_default()
    }

    /// Notes `access` to `machine_path`, keeping the most any reader
    /// needed (a read covers a stat).
    fn note(&self, machine_path: &str, access: Access) {
        if let Some(seen) = &self.seen {
            let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
            let slot = seen.entry(machine_path.to_owned()).or_insert(Access::Stat);
            if access > *slot {
                *slot = access;
            }
        }
    }

    /// Where an absolute machine path (`/sys/...`) lives under this root,
    /// without following any link: for writing fixtures. Readers use the
    /// methods below, which resolve links inside the root.
    pub fn path(&self, machine_path: &str) -> PathBuf {
        self.root.join(machine_path.trim_start_matches('/'))
    }

    /// The root directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a machine path component by component inside the root (see
    /// the module docs). `None` on a symlink loop or a non-UTF-8 target.
    pub fn resolve(&self, machine_path: &str) -> Option<String> {
        self.resolve_visiting(machine_path, |_, _| {})
    }

    /// [`resolve`](Self::resolve), telling `visit` each directory and link
    /// it passes (by machine path, a link with its target as written): what
    /// a copy of the tree needs so the same path resolves the same way.
    pub fn resolve_visiting(&self, machine_path: &str, mut visit: impl FnMut(&str, Passed<'_>)) -> Option<String> {
        self.note(machine_path, Access::Stat);
        let mut pending: Vec<String> =
            machine_path.split('/').filter(|c| !c.is_empty() && *c != ".").rev().map(str::to_owned).collect();
        let mut done: Vec<String> = Vec::new();
        let mut hops = 0;
        while let Some(comp) = pending.pop() {
            if comp == ".." {
                done.pop();
                continue;
            }
            done.push(comp);
            let at = format!("/{}", done.join("/"));
            let target = match self.kind(&at) {
                None | Some(Kind::File) => continue,
                Some(Kind::Dir) => {
                    visit(&at, Passed::Dir);
                    continue;
                }
                Some(Kind::Link(target)) => target,
            };
            hops += 1;
            if hops > MAX_SYMLINK_HOPS {
                return None;
            }
            visit(&at, Passed::Link(&target));
            done.pop();
            if target.starts_with('/') {
                done.clear();
            }
            for c in target.split('/').rev().filter(|c| !c.is_empty() && *c != ".") {
                pending.push(c.to_owned());
            }
        }
        Some(format!("/{}", done.join("/")))
    }

    fn open_regular(&self, machine_path: &str) -> io::Result<std::fs::File> {
        let resolved = self.resolve(machine_path).ok_or_else(|| io::Error::other("symlink loop or unreadable link"))?;
        let host = self.path(&resolved);
        // Opened without blocking and checked once open: a FIFO swapped in
        // after a check by path would hold the reader until a writer came.
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&host)?;
        if !f.metadata()?.is_file() {
            return Err(io::Error::other("not a regular file"));
        }
        Ok(f)
    }

    /// At most `limit` bytes of a regular file.
    ///
    /// # Errors
    /// The I/O error of opening or reading it; an error when it is not a
    /// regular file or its links loop.
    pub fn read_bytes(&self, machine_path: &str, limit: u64) -> io::Result<Vec<u8>> {
        self.note(machine_path, Access::Read);
        if let Some(bytes) = self.mem_file(machine_path)? {
            return Ok(bytes[..bytes.len().min(usize::try_from(limit).unwrap_or(usize::MAX))].to_vec());
        }
        let mut buf = Vec::new();
        self.open_regular(machine_path)?.take(limit).read_to_end(&mut buf)?;
        Ok(buf)
    }

    /// For a root in memory: the regular file's bytes at `machine_path`
    /// (`Ok(None)` for a root on disk).
    fn mem_file(&self, machine_path: &str) -> io::Result<Option<&[u8]>> {
        let Some(mem) = &self.mem else { return Ok(None) };
        let resolved = self.resolve(machine_path).ok_or_else(|| io::Error::other("symlink loop or unreadable link"))?;
        match mem.get(&resolved) {
            Some(MemNode::File(bytes)) => Ok(Some(bytes)),
            Some(_) => Err(io::Error::other("not a regular file")),
            None => Err(io::Error::from(io::ErrorKind::NotFound)),
        }
    }

    /// The file's text (at most [`TEXT_LIMIT`] bytes, invalid UTF-8
    /// replaced), trimmed of surrounding white space: a sysfs attribute
    /// ends with a newline.
    ///
    /// # Errors
    /// As [`read_bytes`](Self::read_bytes) (e.g. `NotFound`, `PermissionDenied`).
    pub fn read(&self, machine_path: &str) -> io::Result<String> {
        let bytes = self.read_bytes(machine_path, TEXT_LIMIT)?;
        Ok(String::from_utf8_lossy(&bytes).trim().to_owned())
    }

    /// Whether any line of a (possibly large) file satisfies `pred`,
    /// streamed rather than read whole: for `/proc/kallsyms`.
    ///
    /// # Errors
    /// As [`read_bytes`](Self::read_bytes).
    pub fn any_line(&self, machine_path: &str, mut pred: impl FnMut(&str) -> bool) -> io::Result<bool> {
        let reader: Box<dyn BufRead + '_> = match self.mem_file(machine_path)? {
            Some(bytes) => Box::new(&bytes[..bytes.len().min(STREAM_LIMIT as usize)]),
            None => Box::new(BufReader::new(self.open_regular(machine_path)?.take(STREAM_LIMIT))),
        };
        for line in reader.split(b'\n') {
            let line = String::from_utf8_lossy(&line?).into_owned();
            if pred(&line) {
                self.note(machine_path, Access::Line(Some(line)));
                return Ok(true);
            }
        }
        self.note(machine_path, Access::Line(None));
        Ok(false)
    }

    /// Whether the machine path exists (links followed inside the root).
    pub fn exists(&self, machine_path: &str) -> bool {
        self.resolve(machine_path).is_some_and(|p| self.kind(&p).is_some())
    }

    /// Whether `machine_path` resolves to a regular file (not a directory,
    /// device node or FIFO), links followed inside the root.
    pub fn is_file(&self, machine_path: &str) -> bool {
        let Some(p) = self.resolve(machine_path) else { return false };
        match &self.mem {
            Some(mem) => matches!(mem.get(&p), Some(MemNode::File(_))),
            None => std::fs::metadata(self.path(&p)).is_ok_and(|m| m.is_file()),
        }
    }

    /// Whether the machine path is a directory (links followed inside the root).
    pub fn is_dir(&self, machine_path: &str) -> bool {
        self.resolve(machine_path).is_some_and(|p| matches!(self.kind(&p), Some(Kind::Dir)))
    }

    /// A directory's entry names, sorted so what is built from them comes
    /// out in a stable order.
    ///
    /// # Errors
    /// The I/O error of reading the directory.
    pub fn list_dir(&self, machine_path: &str) -> io::Result<Vec<String>> {
        self.note(machine_path, Access::List);
        let resolved = self.resolve(machine_path).ok_or_else(|| io::Error::other("symlink loop or unreadable link"))?;
        if let Some(mem) = &self.mem {
            return match mem.kind(&resolved) {
                Some(Kind::Dir) => Ok(mem.children(&resolved)),
                Some(_) => Err(io::Error::other("not a directory")),
                None => Err(io::Error::from(io::ErrorKind::NotFound)),
            };
        }
        let mut names: Vec<String> = std::fs::read_dir(self.path(&resolved))?
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect();
        names.sort();
        Ok(names)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_stay_inside_the_root_and_are_bounded() {
        let tree = testkit::Tree::new("sysroot-confined");
        let root = SysRoot::at(tree.path());
        tree.file("/sys/a/attr", "42\n").file("/big", vec![b'x'; 100_000]);
        // An absolute link restarts at the root, `..` stops there.
        tree.link("/sys/link", "/sys/a").link("/sys/a/up", "../../../../etc").link("/loop", "/loop");
        assert_eq!(root.read("/sys/link/attr").unwrap(), "42");
        assert_eq!(root.resolve("/sys/a/up/passwd").as_deref(), Some("/etc/passwd"));
        assert!(root.read("/sys/a/up/passwd").is_err(), "the host's /etc is never reached");
        assert!(root.resolve("/loop/x").is_none());
        assert_eq!(root.read("/big").unwrap().len() as u64, TEXT_LIMIT);
        assert!(root.read("/sys/a").is_err(), "a directory is not read");
        assert!(root.is_dir("/sys/link") && root.exists("/sys/link/attr") && !root.exists("/sys/a/up/passwd"));
        assert_eq!(root.list_dir("/sys/link").unwrap(), ["attr", "up"]);
        assert!(root.any_line("/sys/a/attr", |l| l == "42").unwrap());
    }

    #[test]
    fn a_recording_root_and_its_clones_note_what_each_reader_needed() {
        let tree = testkit::Tree::new("sysroot-recording");
        tree.file("/sys/a/attr", "42\n").file("/proc/kallsyms", "1 T x\n2 T ib_register_peer_memory_client\n3 T y\n");
        let root = SysRoot::at(tree.path()).recording();
        let clone = root.clone();
        assert!(clone.exists("/sys/a/attr"));
        assert_eq!(root.read("/sys/a/attr").unwrap(), "42");
        assert!(root.any_line("/proc/kallsyms", |l| l.ends_with("peer_memory_client")).unwrap());
        assert!(!root.any_line("/sys/a/attr", |l| l == "7").unwrap());
        assert_eq!(root.list_dir("/sys/a").unwrap(), ["attr"]);
        assert!(!root.exists("/sys/missing"));
        let seen = root.recorded();
        assert_eq!(seen["/sys/a/attr"], Access::Read, "the read outranks the stat and the failed line search");
        assert_eq!(seen["/proc/kallsyms"], Access::Line(Some("2 T ib_register_peer_memory_client".into())));
        assert_eq!((seen["/sys/a"].clone(), seen["/sys/missing"].clone()), (Access::List, Access::Stat));
        assert_eq!(root, SysRoot::at(tree.path()), "recording does not change which tree is read");
        assert!(SysRoot::at(tree.path()).recorded().is_empty());
    }

    /// A tree in memory answers every read as the same tree on disk does:
    /// relative and absolute links, `..` at the root, a loop, listings.
    #[test]
    fn a_tree_in_memory_reads_as_the_same_tree_on_disk() {
        let tree = testkit::Tree::new("sysroot-mem");
        let disk = SysRoot::at(tree.path());
        let mut mem = MemTree::new();
        let mut file = |p: &str, text: &str| {
            tree.file(p, text);
            mem.insert(p, MemNode::File(text.as_bytes().to_vec()));
        };
        file("/sys/devices/pci0000:00/0000:00:01.0/vendor", "0x10de\n");
        file("/proc/cmdline", "ro iommu=pt\n");
        let mut link = |p: &str, target: &str| {
            let at = tree.path().join(&p[1..]);
            std::fs::create_dir_all(at.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(target, &at).unwrap();
            mem.insert(p, MemNode::Link(target.to_owned()));
        };
        link("/sys/bus/pci/devices/0000:00:01.0", "../../../devices/pci0000:00/0000:00:01.0");
        link("/sys/abs", "/proc");
        link("/sys/escape", "../../../../../etc");
        link("/sys/loop", "/sys/loop");
        let mem = SysRoot::in_memory(mem);
        for p in [
            "/sys/bus/pci/devices/0000:00:01.0/vendor",
            "/sys/abs/cmdline",
            "/sys/escape",
            "/sys/loop",
            "/sys/bus/pci/devices",
            "/sys/devices/pci0000:00",
            "/nothing",
            "/",
        ] {
            assert_eq!(mem.resolve(p), disk.resolve(p), "{p}");
            assert_eq!(mem.read(p).ok(), disk.read(p).ok(), "{p}");
            assert_eq!(mem.exists(p), disk.exists(p), "{p}");
            assert_eq!(mem.is_dir(p), disk.is_dir(p), "{p}");
            assert_eq!(mem.is_file(p), disk.is_file(p), "{p}");
            assert_eq!(mem.list_dir(p).ok(), disk.list_dir(p).ok(), "{p}");
        }
        assert_eq!(mem.read("/sys/abs/cmdline").unwrap(), "ro iommu=pt");
        assert_eq!(mem.read_bytes("/proc/cmdline", 2).unwrap(), b"ro");
        assert!(mem.any_line("/proc/cmdline", |l| l.contains("iommu=pt")).unwrap());
        assert!(mem.read("/etc/passwd").is_err() && !mem.path("/etc").exists(), "nothing reaches the disk");
        assert_ne!(mem, disk);
        assert_eq!(mem.clone(), mem);
    }
}
