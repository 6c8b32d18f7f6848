//! A machine's judgement in one file: `doctor --capture FILE` saves
//! everything the checks read (the sysfs/procfs files, config-space bytes,
//! the verbs and CUDA answers, the job's environment), and `doctor --from
//! FILE` judges that on any machine, with the same verdict and JSON.
//!
//! The files are the ones the checks asked a recording [`SysRoot`] for,
//! each with the links that led to it, so the copy answers every question
//! the judgement asks and nothing else; `/proc/kallsyms` keeps only the
//! line that was searched for. A capture comes from another machine and is
//! unpacked here: its paths are checked (absolute, no `..`, nothing under
//! a link it creates) and its size is bounded before anything is written.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use gpudirect::gdr::{GpuFacts, HostFacts};
use gpudirect::sysroot::{Access, MemNode, MemTree, Passed, SysRoot, TEXT_LIMIT};

use super::input;
use super::jobenv::JobEnv;
use super::probes::{Probes, RdmaDevice};

/// The layout version of a capture; bumped on any incompatible change.
pub const CAPTURE_FORMAT: u32 = 1;
/// The most entries a capture may hold (a large machine's capture has a
/// few thousand).
const MAX_ENTRIES: usize = 200_000;
/// The most bytes of file contents a capture may unpack.
const MAX_BYTES: usize = 256 << 20;

/// Everything one judgement read.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capture {
    /// [`CAPTURE_FORMAT`].
    pub format: u32,
    /// The tool that wrote it (`gpudirect 0.1.0`).
    pub written_by: String,
    /// The job's environment as judged, with where each variable came from.
    pub env: JobEnv,
    /// What the verbs and CUDA answered.
    #[serde(flatten)]
    pub answers: Answers,
    /// The files, directories and links the checks read, by machine path.
    pub files: Vec<Entry>,
}

/// What the live probes answered on one machine; as probes, it answers
/// the same again.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answers {
    /// The verbs' answer: the RDMA devices, or why they could not be listed.
    pub rdma: Result<Vec<RdmaDevice>, String>,
    /// CUDA's answer: every GPU's facts, or why CUDA could not be used.
    pub gpus: Result<Vec<GpuFacts>, String>,
    /// The host's facts (kernel, peer-memory client).
    pub host: HostFacts,
    /// What `ip -d link show` printed, or why it could not run.
    #[serde(default = "not_captured")]
    pub ip_link: Result<String, String>,
}

fn not_captured() -> Result<String, String> {
    Err("not in this capture".into())
}

impl Answers {
    /// Reads answers written by hand for a fixture tree (`--answers`):
    /// the `rdma`, `gpus` and `host` fields of a capture.
    ///
    /// # Errors
    /// [`CaptureError::Io`] or [`CaptureError::Malformed`].
    pub fn read(path: &Path) -> Result<Answers, CaptureError> {
        let shown = path.display().to_string();
        let text = input::read_text(path, "probe answers", input::CAPTURE_LIMIT)?;
        serde_json::from_str(&text).map_err(|e| CaptureError::Malformed { path: shown, why: e.to_string() })
    }
}

/// One path of the captured tree.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Entry {
    /// A directory.
    Dir {
        /// Machine path (`/sys/bus/pci/devices`).
        path: String,
    },
    /// A symbolic link and its target, as written.
    Link {
        /// Machine path.
        path: String,
        /// The target (`../../../devices/pci0000:00/...`).
        target: String,
    },
    /// A file whose bytes are text.
    File {
        /// Machine path.
        path: String,
        /// Its bytes.
        text: String,
    },
    /// A file of other bytes (PCI config space), as hex.
    Bytes {
        /// Machine path.
        path: String,
        /// Its bytes, two lowercase hex digits each.
        hex: String,
    },
    /// A name a listed directory held that nothing read further: unpacked
    /// as an empty file, so the listing is the same.
    Name {
        /// Machine path.
        path: String,
    },
}

impl Entry {
    /// Its machine path.
    pub fn path(&self) -> &str {
        match self {
            Entry::Dir { path }
            | Entry::Link { path, .. }
            | Entry::File { path, .. }
            | Entry::Bytes { path, .. }
            | Entry::Name { path } => path,
        }
    }

    /// What the entry is, for choosing between two at one path: the one
    /// that says more wins.
    fn rank(&self) -> u8 {
        match self {
            Entry::Name { .. } => 0,
            Entry::Dir { .. } => 1,
            Entry::File { .. } | Entry::Bytes { .. } => 2,
            Entry::Link { .. } => 3,
        }
    }
}

/// Why a capture could not be read or unpacked.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Not a capture this version understands.
    #[error("{path} is not a doctor capture: {why}")]
    Malformed {
        /// The file.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// The file is not one the doctor reads (not a regular file, too large).
    #[error(transparent)]
    Input(#[from] input::InputError),
    /// An entry would unpack outside the capture's own tree, or past its bounds.
    #[error("the capture's entry {entry:?} is refused: {why}")]
    Refused {
        /// The entry's path.
        entry: String,
        /// Why.
        why: String,
    },
}

/// Probes that answer with what another probe answered, and keep it.
pub struct Recorder<'a> {
    inner: &'a dyn Probes,
    rdma: std::cell::RefCell<Option<Result<Vec<RdmaDevice>, String>>>,
    gpus: std::cell::RefCell<Option<Result<Vec<GpuFacts>, String>>>,
    host: std::cell::RefCell<Option<HostFacts>>,
    ip_link: std::cell::RefCell<Option<Result<String, String>>>,
}

impl<'a> Recorder<'a> {
    /// Records what `inner` answers.
    pub fn new(inner: &'a dyn Probes) -> Recorder<'a> {
        Recorder { inner, rdma: Default::default(), gpus: Default::default(), host: Default::default(), ip_link: Default::default() }
    }

    /// The capture of a judgement that ran with these probes, the job's
    /// environment `env` and the recording root `root`.
    pub fn capture(&self, root: &SysRoot, env: &JobEnv) -> Capture {
        Capture {
            format: CAPTURE_FORMAT,
            written_by: concat!("gpudirect ", env!("CARGO_PKG_VERSION")).to_owned(),
            env: env.clone(),
            answers: Answers {
                rdma: self.rdma(),
                gpus: self.gpus(root),
                host: self.host(root),
                // Asked only inside a container: a capture from elsewhere
                // needs no `ip` run.
                ip_link: self.ip_link.borrow().clone().unwrap_or_else(not_captured),
            },
            files: snapshot(root),
        }
    }
}

impl Probes for Recorder<'_> {
    fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
        self.rdma.borrow_mut().get_or_insert_with(|| self.inner.rdma()).clone()
    }
    fn gpus(&self, root: &SysRoot) -> Result<Vec<GpuFacts>, String> {
        self.gpus.borrow_mut().get_or_insert_with(|| self.inner.gpus(root)).clone()
    }
    fn host(&self, root: &SysRoot) -> HostFacts {
        self.host.borrow_mut().get_or_insert_with(|| self.inner.host(root)).clone()
    }
    fn ip_link(&self) -> Result<String, String> {
        self.ip_link.borrow_mut().get_or_insert_with(|| self.inner.ip_link()).clone()
    }
}

impl Probes for Answers {
    fn rdma(&self) -> Result<Vec<RdmaDevice>, String> {
        self.rdma.clone()
    }
    fn gpus(&self, _: &SysRoot) -> Result<Vec<GpuFacts>, String> {
        self.gpus.clone()
    }
    fn host(&self, _: &SysRoot) -> HostFacts {
        self.host.clone()
    }
    fn ip_link(&self) -> Result<String, String> {
        self.ip_link.clone()
    }
}

/// The entries that answer every question `root` recorded, the way it
/// answered them.
pub fn snapshot(root: &SysRoot) -> Vec<Entry> {
    let mut out: BTreeMap<String, Entry> = BTreeMap::new();
    for (asked, access) in root.recorded() {
        let Some(resolved) = walk(root, &asked, &mut out) else {
            continue;
        };
        if root.is_dir(&resolved) {
            put(&mut out, Entry::Dir { path: resolved.clone() });
            if access == Access::List {
                for name in root.list_dir(&resolved).unwrap_or_default() {
                    put(&mut out, Entry::Name { path: join(&resolved, &name) });
                }
            }
            continue;
        }
        if !root.is_file(&resolved) {
            continue;
        }
        let bytes = match access {
            Access::Read => root.read_bytes(&resolved, TEXT_LIMIT).unwrap_or_default(),
            Access::Line(Some(line)) => format!("{line}\n").into_bytes(),
            Access::Line(None) | Access::Stat | Access::List => Vec::new(),
        };
        put(&mut out, file_entry(resolved, bytes));
    }
    out.into_values().collect()
}

/// Adds `e` unless an entry that says more holds its path already.
fn put(out: &mut BTreeMap<String, Entry>, e: Entry) {
    if out.get(e.path()).is_none_or(|old| old.rank() < e.rank()) {
        out.insert(e.path().to_owned(), e);
    }
}

fn file_entry(path: String, bytes: Vec<u8>) -> Entry {
    match String::from_utf8(bytes) {
        Ok(text) => Entry::File { path, text },
        Err(e) => Entry::Bytes { path, hex: e.into_bytes().iter().map(|b| format!("{b:02x}")).collect() },
    }
}

fn join(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// Resolves `machine_path` as [`SysRoot::resolve`] does, adding every
/// directory and link passed on the way; the resolved path, or `None`
/// when the links loop.
fn walk(root: &SysRoot, machine_path: &str, out: &mut BTreeMap<String, Entry>) -> Option<String> {
    root.resolve_visiting(machine_path, |path, passed| match passed {
        Passed::Dir => put(out, Entry::Dir { path: path.to_owned() }),
        Passed::Link(target) => put(out, Entry::Link { path: path.to_owned(), target: target.to_owned() }),
    })
}

impl Capture {
    /// Reads a capture file.
    ///
    /// # Errors
    /// [`CaptureError::Io`] when it cannot be read, [`CaptureError::Malformed`]
    /// when it is not a capture of [`CAPTURE_FORMAT`].
    pub fn read(path: &Path) -> Result<Capture, CaptureError> {
        Self::parse(&input::read_text(path, "capture", input::CAPTURE_LIMIT)?, &path.display().to_string())
    }

    /// Reads a capture's text, already read from `shown` (for messages).
    ///
    /// # Errors
    /// [`CaptureError::Malformed`] when it is not a capture of [`CAPTURE_FORMAT`].
    pub fn parse(text: &str, shown: &str) -> Result<Capture, CaptureError> {
        let shown = shown.to_owned();
        /// The format alone: the rest is skipped, not built, so a file
        /// that is not a capture costs no more than its text.
        #[derive(Deserialize)]
        struct Format {
            format: Option<u64>,
        }
        let format = serde_json::from_str::<Format>(text).map_err(|e| CaptureError::Malformed { path: shown.clone(), why: e.to_string() })?.format;
        if format != Some(u64::from(CAPTURE_FORMAT)) {
            let why =
                format!("its format is {format:?}; this doctor reads format {CAPTURE_FORMAT} (write the capture again with this version)");
            return Err(CaptureError::Malformed { path: shown, why });
        }
        serde_json::from_str(text).map_err(|e| CaptureError::Malformed { path: shown, why: e.to_string() })
    }

    /// Writes the capture as JSON.
    ///
    /// # Errors
    /// [`CaptureError::Io`] when the file cannot be written.
    pub fn write(&self, path: &Path) -> Result<(), CaptureError> {
        std::fs::write(path, self.to_text()).map_err(|source| CaptureError::Io { path: path.display().to_string(), source })
    }

    /// The capture as the JSON text [`write`](Self::write) writes.
    pub fn to_text(&self) -> String {
        serde_json::to_string_pretty(self).expect("a capture is plain data") + "\n"
    }

    /// Unpacks the files into `dir` (empty, or not there yet), so a
    /// [`SysRoot`] at `dir` reads what the machine read. Directories and
    /// files come first and links last, and no entry may lie under a link
    /// it creates: nothing is ever written through a link.
    ///
    /// # Errors
    /// [`CaptureError::Refused`] for a path that is not absolute, holds
    /// `..`, lies under a link entry, or past the bounds;
    /// [`CaptureError::Io`] when writing fails.
    /// The entries in the order they are laid out (links last), each
    /// checked: refused for a path that is not absolute, holds `..`, lies
    /// under a link entry, or past the bounds.
    fn plan(&self) -> Result<Vec<&Entry>, CaptureError> {
        if self.files.len() > MAX_ENTRIES {
            return Err(CaptureError::Refused {
                entry: String::new(),
                why: format!("{} entries, more than {MAX_ENTRIES}", self.files.len()),
            });
        }
        let links: std::collections::BTreeSet<&str> =
            self.files.iter().filter(|e| matches!(e, Entry::Link { .. })).map(Entry::path).collect();
        let mut bytes = 0usize;
        let mut planned: Vec<&Entry> = Vec::new();
        for e in &self.files {
            let p = e.path();
            let refuse = |why: &str| CaptureError::Refused { entry: p.to_owned(), why: why.to_owned() };
            if !p.starts_with('/') || p.split('/').skip(1).any(|c| c.is_empty() || c == "." || c == "..") || p.contains('\0') {
                return Err(refuse("not a plain absolute path"));
            }
            let mut above = p.rsplit_once('/').map(|(a, _)| a).unwrap_or_default();
            while !above.is_empty() {
                if links.contains(above) {
                    return Err(refuse("it lies under a link of the capture"));
                }
                above = above.rsplit_once('/').map(|(a, _)| a).unwrap_or_default();
            }
            bytes += match e {
                Entry::File { text, .. } => text.len(),
                Entry::Bytes { hex, .. } => hex.len() / 2,
                _ => 0,
            };
            if bytes > MAX_BYTES {
                return Err(refuse(&format!("the files hold more than {} MiB", MAX_BYTES >> 20)));
            }
            planned.push(e);
        }
        planned.sort_by_key(|e| matches!(e, Entry::Link { .. }));
        Ok(planned)
    }

    /// The captured tree in memory, as [`unpack`](Self::unpack) would lay
    /// it out on disk: what `--from` and `fleet check` judge, without
    /// writing a file.
    ///
    /// # Errors
    /// As [`unpack`](Self::unpack), but never [`CaptureError::Io`].
    pub fn tree(&self) -> Result<MemTree, CaptureError> {
        let mut tree = MemTree::new();
        for e in self.plan()? {
            let p = e.path();
            match e {
                Entry::Dir { .. } => {
                    if tree.get(p).is_none() {
                        tree.insert(p, MemNode::Dir);
                    }
                }
                Entry::File { text, .. } => tree.insert(p, MemNode::File(text.clone().into_bytes())),
                Entry::Bytes { hex, .. } => {
                    let raw = decode_hex(hex).ok_or_else(|| CaptureError::Refused { entry: p.to_owned(), why: "its hex is malformed".into() })?;
                    tree.insert(p, MemNode::File(raw));
                }
                Entry::Name { .. } => {
                    if tree.get(p).is_none() {
                        tree.insert(p, MemNode::File(Vec::new()));
                    }
                }
                Entry::Link { target, .. } => tree.insert(p, MemNode::Link(target.clone())),
            }
        }
        Ok(tree)
    }

    pub fn unpack(&self, dir: &Path) -> Result<(), CaptureError> {
        let planned: Vec<(&Entry, PathBuf)> = self.plan()?.into_iter().map(|e| (e, dir.join(&e.path()[1..]))).collect();
        let io = |p: &Path| {
            let path = p.display().to_string();
            move |source| CaptureError::Io { path, source }
        };
        for (e, at) in planned {
            if let Some(parent) = at.parent() {
                std::fs::create_dir_all(parent).map_err(io(parent))?;
            }
            match e {
                Entry::Dir { .. } => std::fs::create_dir_all(&at).map_err(io(&at))?,
                Entry::File { text, .. } => std::fs::write(&at, text).map_err(io(&at))?,
                Entry::Bytes { hex, .. } => {
                    let raw = decode_hex(hex)
                        .ok_or_else(|| CaptureError::Refused { entry: e.path().to_owned(), why: "its hex is malformed".into() })?;
                    std::fs::write(&at, raw).map_err(io(&at))?
                }
                Entry::Name { .. } => {
                    if std::fs::symlink_metadata(&at).is_err() {
                        std::fs::write(&at, "").map_err(io(&at))?;
                    }
                }
                Entry::Link { target, .. } => std::os::unix::fs::symlink(target, &at).map_err(io(&at))?,
            }
        }
        Ok(())
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    if !hex.len().is_multiple_of(2) {
        return None;
    }
    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok()).collect()
}

/// A directory that is removed with everything in it when dropped: where
/// a capture is unpacked for one judgement.
pub struct Unpacked {
    dir: PathBuf,
}

impl Unpacked {
    /// Unpacks `capture` into a new private directory under the temporary
    /// directory.
    ///
    /// # Errors
    /// As [`Capture::unpack`].
    pub fn new(capture: &Capture) -> Result<Unpacked, CaptureError> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        let mut last = None;
        for attempt in 0..16u32 {
            let dir = base.join(format!("gpudirect-capture-{}-{attempt}", std::process::id()));
            // 0700 and must be new: nobody else's tree is judged or written into.
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    let u = Unpacked { dir };
                    capture.unpack(&u.dir)?;
                    return Ok(u);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(CaptureError::Io { path: base.display().to_string(), source: last.unwrap_or_else(|| std::io::Error::other("no free name")) })
    }

    /// The root of the unpacked tree.
    pub fn root(&self) -> SysRoot {
        SysRoot::at(&self.dir)
    }
}

impl Drop for Unpacked {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_files(files: Vec<Entry>) -> Capture {
        Capture {
            format: CAPTURE_FORMAT,
            written_by: "test".into(),
            env: JobEnv::default(),
            answers: Answers {
                rdma: Err("none".into()),
                gpus: Err("none".into()),
                host: HostFacts { kernel_release: None, peer_memory_found: vec![], peer_memory_api: None },
                ip_link: Err("none".into()),
            },
            files,
        }
    }

    /// A capture comes from someone else's machine: nothing in it may
    /// write outside the directory it is unpacked into.
    #[test]
    fn a_hostile_capture_writes_nothing_outside_its_tree() {
        let file = |p: &str| Entry::File { path: p.into(), text: "x".into() };
        let cases = [
            (vec![file("/sys/../../escape")], "not a plain absolute path"),
            (vec![file("relative")], "not a plain absolute path"),
            (vec![Entry::Link { path: "/sys/l".into(), target: "/tmp".into() }, file("/sys/l/escape")], "under a link"),
            (vec![Entry::Bytes { path: "/sys/b".into(), hex: "zz".into() }], "hex is malformed"),
        ];
        for (files, why) in cases {
            let dir = std::env::temp_dir().join(format!("gpudirect-capture-hostile-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let err = with_files(files.clone()).unpack(&dir).unwrap_err();
            assert!(err.to_string().contains(why), "{files:?}: {err}");
            assert!(!std::env::temp_dir().join("escape").exists() && !Path::new("/tmp/escape").exists());
            let _ = std::fs::remove_dir_all(&dir);
        }
        let big = vec![Entry::Name { path: "/n".into() }; MAX_ENTRIES + 1];
        assert!(with_files(big).unpack(Path::new("/nonexistent")).unwrap_err().to_string().contains("more than"));
    }

    #[test]
    fn links_and_binary_files_come_back_as_they_were() {
        let tree = testkit::Tree::new("capture-unit");
        tree.file("/sys/devices/pci0/0000:01:00.0/config", vec![0x10u8, 0xde, 0xff, 0x00])
            .file("/sys/devices/pci0/0000:01:00.0/vendor", "0x10de\n");
        tree.link("/sys/bus/pci/devices/0000:01:00.0", "../../../devices/pci0/0000:01:00.0");
        let root = SysRoot::at(tree.path()).recording();
        assert_eq!(root.read_bytes("/sys/bus/pci/devices/0000:01:00.0/config", 4096).unwrap(), [0x10, 0xde, 0xff, 0x00]);
        assert_eq!(root.read("/sys/bus/pci/devices/0000:01:00.0/vendor").unwrap(), "0x10de");
        assert_eq!(root.list_dir("/sys/bus/pci/devices").unwrap(), ["0000:01:00.0"]);
        let c = with_files(snapshot(&root));
        assert!(
            c.files.contains(&Entry::Link {
                path: "/sys/bus/pci/devices/0000:01:00.0".into(),
                target: "../../../devices/pci0/0000:01:00.0".into()
            }),
            "{:?}",
            c.files
        );
        let u = Unpacked::new(&c).unwrap();
        let back = u.root();
        assert_eq!(back.read_bytes("/sys/bus/pci/devices/0000:01:00.0/config", 4096).unwrap(), [0x10, 0xde, 0xff, 0x00]);
        assert_eq!(back.read("/sys/bus/pci/devices/0000:01:00.0/vendor").unwrap(), "0x10de");
        assert_eq!(back.list_dir("/sys/bus/pci/devices").unwrap(), ["0000:01:00.0"]);
        let at = back.root().to_owned();
        drop(u);
        assert!(!at.exists(), "the unpacked tree is removed");
    }
}
