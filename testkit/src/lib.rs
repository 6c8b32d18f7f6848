//! What the tests of every package of this workspace share, written once:
//! a seeded generator ([`Rng`]), temporary directory trees ([`Tree`]),
//! byte patterns, the process's open descriptors, the device under test,
//! the fixture machines and a real etcd server ([`Etcd`]). Dev-only:
//! nothing here ships.

mod etcd;

pub use etcd::Etcd;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// A seeded generator (splitmix64): every seed, 0 included, gives a full
/// sequence, and a failing case reproduces from its seed without a
/// dependency.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    /// An index in `0..n` (0 when `n` is 0).
    pub fn index(&mut self, n: usize) -> usize {
        self.below(n as u64) as usize
    }

    /// True once in `one_in` draws on average.
    pub fn chance(&mut self, one_in: u64) -> bool {
        self.below(one_in) == 0
    }

    /// `n` random bytes.
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// `len` bytes that differ from seed to seed and from offset to offset, to
/// tell apart what landed where.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    Rng(seed).bytes(len)
}

/// The open file descriptors of this process (`/proc/self/fd`).
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0)
}

/// The cluster secret of the engine tests that listen on a network
/// address (two guests): public, so a secret of tests only.
pub const SECRET: &[u8; 32] = b"gpudirect test bed: not a secret";

/// The RDMA device under test, named by `GPUDIRECT_TEST_DEVICE`
/// (`testbed/run` sets it).
///
/// # Panics
/// When the variable is not set: a device test run without a device.
pub fn device() -> String {
    std::env::var("GPUDIRECT_TEST_DEVICE")
        .expect("set GPUDIRECT_TEST_DEVICE to the RDMA device to test (e.g. rxe0); testbed/run sets it")
}

/// The fixture machine `name`: a sysfs/procfs tree under the workspace's
/// `tests/data/machines/`.
pub fn machine(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/machines").join(name)
}

/// A directory tree under the system's temporary directory, laid out like
/// `/` (paths are machine paths such as `/sys/class/...`), removed on drop.
#[derive(Debug)]
pub struct Tree(PathBuf);

impl Tree {
    /// A new, empty tree; `tag` names it for whoever finds it left behind.
    pub fn new(tag: &str) -> Tree {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!("gpudirect-{tag}-{}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed)));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("create a temporary tree");
        Tree(p)
    }

    /// The tree's root directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Where machine path `p` lives in the tree.
    pub fn at(&self, p: &str) -> PathBuf {
        self.0.join(p.trim_start_matches('/'))
    }

    /// Writes a file (and its directories).
    pub fn file(&self, p: &str, data: impl AsRef<[u8]>) -> &Self {
        let path = self.at(p);
        std::fs::create_dir_all(path.parent().expect("a file has a parent")).expect("create directories");
        std::fs::write(path, data).expect("write a file");
        self
    }

    /// Makes a symbolic link (and its directories), replacing what was there.
    pub fn link(&self, p: &str, target: &str) -> &Self {
        let path = self.at(p);
        std::fs::create_dir_all(path.parent().expect("a link has a parent")).expect("create directories");
        let _ = std::fs::remove_file(&path);
        std::os::unix::fs::symlink(target, path).expect("make a symlink");
        self
    }

    /// Makes a directory (and its parents).
    pub fn dir(&self, p: &str) -> &Self {
        std::fs::create_dir_all(self.at(p)).expect("create directories");
        self
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A 4096-byte PCIe bridge config space: AER at 0x100, then (optionally) ACS.
pub fn bridge_config(acs_ctrl: Option<u16>) -> Vec<u8> {
    let mut b = vec![0u8; 4096];
    b[0..4].copy_from_slice(&[0xb5, 0x10, 0x47, 0x87]);
    b[0x06] = 0x10;
    b[0x0b] = 0x06;
    b[0x0a] = 0x04;
    b[0x0e] = 0x01;
    b[0x34] = 0x40;
    b[0x40] = 0x10;
    b[0x42] = 0x62; // PCIe v2, downstream port
    let next = if acs_ctrl.is_some() { 0x148u32 } else { 0 };
    b[0x100..0x104].copy_from_slice(&(0x0001 | (2 << 16) | (next << 20)).to_le_bytes());
    if let Some(ctrl) = acs_ctrl {
        b[0x148..0x14c].copy_from_slice(&(0x000d_u32 | (1 << 16)).to_le_bytes());
        b[0x14c..0x14e].copy_from_slice(&0x005f_u16.to_le_bytes());
        b[0x14e..0x150].copy_from_slice(&ctrl.to_le_bytes());
    }
    b
}


#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_seeded_and_spread() {
        let (a, b) = (Rng(0).bytes(64), Rng(0).bytes(64));
        assert_eq!(a, b);
        assert_ne!(Rng(1).bytes(64), a);
        let mut r = Rng(7);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            seen[r.index(10)] = true;
        }
        assert!(seen.iter().all(|&s| s));
        assert_eq!(r.below(0), 0);
        assert_ne!(pattern(32, 1), pattern(32, 2));
    }

    #[test]
    fn trees_are_laid_out_like_root_and_removed() {
        let t = Tree::new("testkit");
        t.file("/sys/a/b", "x").link("/sys/l", "a").dir("/proc");
        assert_eq!(std::fs::read_to_string(t.at("/sys/l/b")).unwrap(), "x");
        let p = t.path().to_owned();
        drop(t);
        assert!(!p.exists());
        assert!(machine("dgx-pix").join("sys").is_dir());
    }
}

/// Which guest of the two-host test bed this process is (`GPUDIRECT_ROLE`,
/// set by `testbed/run --two`).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    /// Guest A.
    A,
    /// Guest B.
    B,
}

/// What a two-host scenario returns.
pub type ScenarioResult = Result<(), Box<dyn std::error::Error + Send + Sync>>;

/// The main of a two-host scenario binary (no libtest harness): runs the
/// scenarios named on the command line (all of `scenarios` when none is)
/// as this guest's [`Role`], each through `run(role, index, name)`, printing
/// `ok`/`FAIL` per scenario and a summary line headed `binary`. Outside the
/// bed (no `GPUDIRECT_ROLE`) it says the scenarios were not run and
/// succeeds; libtest-style flags (`--list`, `--ignored`, from tools that
/// treat every test binary alike) are ignored.
pub fn run_two_host(
    binary: &str,
    scenarios: &[&str],
    args: &[String],
    mut run: impl FnMut(Role, usize, &str) -> ScenarioResult,
) -> std::process::ExitCode {
    use std::process::ExitCode;
    let names: Vec<&str> = args.iter().map(String::as_str).filter(|a| !a.starts_with('-')).collect();
    let role = match std::env::var("GPUDIRECT_ROLE").as_deref() {
        Ok("a") => Role::A,
        Ok("b") => Role::B,
        _ => {
            if !args.iter().any(|a| a == "--list") {
                println!(
                    "{binary}: {} scenarios not run: they need two RDMA hosts (testbed/run --two boots two Soft-RoCE guests)",
                    scenarios.len()
                );
            }
            return ExitCode::SUCCESS;
        }
    };
    let chosen: Vec<&str> = if names.is_empty() { scenarios.to_vec() } else { names };
    let mut failed = 0;
    for (i, name) in chosen.iter().enumerate() {
        let started = std::time::Instant::now();
        println!("--- {name} ({role:?})");
        let r = if scenarios.contains(name) {
            run(role, i, name)
        } else {
            Err(format!("unknown scenario {name:?}; known: {}", scenarios.join(", ")).into())
        };
        match r {
            Ok(()) => println!("ok   {name} ({:.1} s)", started.elapsed().as_secs_f64()),
            Err(e) => {
                println!("FAIL {name}: {e}");
                failed += 1;
            }
        }
    }
    println!("{binary} ({role:?}): {} passed, {failed} failed", chosen.len() - failed);
    if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// A port for a server that must be named before it starts (etcd, a
/// gate waiting for a server not up yet): below Linux's ephemeral range
/// (32768 and up), where no connection's own port can take it before the
/// server binds it, picked at random and free when looked at.
///
/// # Panics
/// When none of a thousand tries is free.
pub fn port_below_ephemeral() -> u16 {
    static N: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let mut rng = Rng(u64::from(nanos) ^ u64::from(std::process::id()) << 32 ^ N.fetch_add(1, Ordering::Relaxed) as u64);
    (0..1000)
        .map(|_| 20000 + rng.below(12000) as u16)
        .find(|&p| std::net::TcpListener::bind(("127.0.0.1", p)).is_ok())
        .expect("a free port below the ephemeral range")
}

/// A server started as a child process that says where it listens: its
/// first line of standard output starting with a prefix names the
/// address it bound (`gpudirect rendezvous listening on [::]:40123`).
/// Letting the server pick its port (`:0`) and reading it back is the one
/// race-free way: a port picked by binding and closing a socket first can
/// be taken by any connection's ephemeral port before the server binds it.
/// Killed when dropped, so a failed assertion leaves nothing running.
#[derive(Debug)]
pub struct Listening {
    child: std::process::Child,
    /// The address the server printed.
    pub addr: String,
}

impl Listening {
    /// Starts `cmd` with its standard output piped and waits for the line
    /// starting with `prefix`.
    ///
    /// # Panics
    /// When the child cannot start or ends its output without that line.
    pub fn start(mut cmd: std::process::Command, prefix: &str) -> Listening {
        use std::io::BufRead;
        // Owned by the guard at once: whatever panics below, it is killed.
        let mut server = Listening { child: cmd.stdout(std::process::Stdio::piped()).spawn().expect("start the server"), addr: String::new() };
        let mut out = std::io::BufReader::new(server.child.stdout.take().expect("piped"));
        let mut line = String::new();
        loop {
            line.clear();
            if out.read_line(&mut line).expect("read the server's output") == 0 {
                panic!("the server ended its output without a line starting {prefix:?}: {:?}", server.child.try_wait());
            }
            if let Some(addr) = line.trim_end().strip_prefix(prefix) {
                server.addr = addr.trim().to_owned();
                // The rest of its output is read and dropped, so the server
                // never blocks on (or dies of) a full or closed pipe.
                std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
                return server;
            }
        }
    }

    /// The port of [`addr`](Self::addr).
    pub fn port(&self) -> u16 {
        self.addr.rsplit(':').next().and_then(|p| p.parse().ok()).expect("the address ends in its port")
    }
}

impl Drop for Listening {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
