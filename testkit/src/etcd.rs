//! A real etcd server for the tests (Debian's `etcd-server`: the `etcd`
//! binary on `PATH`), one member, its data in a temporary directory that
//! outlives a stop, so a restart comes back with what was stored.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::Tree;

/// How long a start may take: etcd in a one-vCPU emulated guest is slow.
const START_WITHIN: Duration = Duration::from_secs(60);

/// One etcd member, killed when dropped.
#[derive(Debug)]
pub struct Etcd {
    child: Option<Child>,
    dir: Tree,
    listen: String,
    advertise: String,
    client_port: u16,
    peer_port: u16,
}

impl Etcd {
    /// A member on 127.0.0.1, on free ports.
    ///
    /// # Panics
    /// When `etcd` cannot be started or is not ready within a minute: a
    /// test that needs etcd cannot run without it.
    pub fn local() -> Etcd {
        let client = crate::port_below_ephemeral();
        let peer = (1..).map(|_| crate::port_below_ephemeral()).find(|&p| p != client).expect("two ports");
        Etcd::start("127.0.0.1", "127.0.0.1", client, peer)
    }

    /// A member listening on `listen` (an address of this host, or
    /// 0.0.0.0) and telling clients `advertise`, on the given ports.
    ///
    /// # Panics
    /// As [`Etcd::local`].
    pub fn start(listen: &str, advertise: &str, client_port: u16, peer_port: u16) -> Etcd {
        let mut e = Etcd {
            child: None,
            dir: Tree::new("etcd"),
            listen: listen.to_owned(),
            advertise: advertise.to_owned(),
            client_port,
            peer_port,
        };
        e.restart();
        e
    }

    /// The client URL (`http://host:port`).
    pub fn url(&self) -> String {
        format!("http://{}:{}", self.advertise, self.client_port)
    }

    /// Kills the member and waits for it to exit. Its data stays.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the member (again, on the same ports and data) and waits
    /// until it answers `/health`.
    ///
    /// # Panics
    /// As [`Etcd::local`].
    pub fn restart(&mut self) {
        self.stop();
        let peer = format!("http://{}:{}", self.advertise, self.peer_port);
        let log = std::fs::File::create(self.dir.path().join("etcd.log")).expect("create etcd's log");
        let child = Command::new("etcd")
            .args(["--name", "t", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .arg(format!("--listen-client-urls=http://{}:{}", self.listen, self.client_port))
            .arg(format!("--advertise-client-urls={}", self.url()))
            .arg(format!("--listen-peer-urls=http://{}:{}", self.listen, self.peer_port))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=t={peer}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup etcd's log"))
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcd (Debian: apt install etcd-server): {e}"));
        self.child = Some(child);
        let started = Instant::now();
        while !self.healthy() {
            if let Some(Ok(Some(st))) = self.child.as_mut().map(Child::try_wait) {
                panic!("etcd exited ({st}) at start; its log:\n{}", self.log());
            }
            assert!(started.elapsed() < START_WITHIN, "etcd not healthy within {START_WITHIN:?}; its log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// What etcd has written to its log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }

    fn healthy(&self) -> bool {
        let addr: SocketAddr = match format!("{}:{}", self.advertise, self.client_port).parse() {
            Ok(a) => a,
            Err(_) => return false,
        };
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) else { return false };
        let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
        if s.write_all(b"GET /health HTTP/1.0\r\n\r\n").is_err() {
            return false;
        }
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer.contains("\"health\":\"true\"")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}
