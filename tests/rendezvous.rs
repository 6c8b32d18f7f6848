//! `gpudirect rendezvous`: the standalone server agents publish to and
//! look each other up in, started as a process.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use gpudirect_engine::{AgentMetadata, ClusterSecret, EngineError, Rendezvous, TcpRendezvous, SEAL_LEN};

/// Kills the server when the test ends, passed or not.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(args: &[&str]) -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_gpudirect"))
        .arg("rendezvous")
        .args(args)
        .env_remove("GPUDIRECT_SECRET_FILE")
        .env_remove("GPUDIRECT_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit(' ').next().unwrap().to_owned();
    assert!(line.starts_with("gpudirect rendezvous listening on"), "{line:?}");
    (Server(child), addr)
}

fn metadata(name: &str) -> AgentMetadata {
    AgentMetadata { name: name.into(), instance: 1, control: "192.0.2.1:9".parse().unwrap(), nics: vec![], memories: vec![], seal: [0; SEAL_LEN] }
}

#[test]
fn the_standalone_server_serves_holders_of_its_secret() {
    let dir = std::env::temp_dir().join(format!("gpudirect-rdv-{}", std::process::id()));
    std::fs::write(&dir, b"a secret of thirty-two bytes....").unwrap();
    let (_server, addr) = start(&["--listen", "127.0.0.1:0", "--secret-file", dir.to_str().unwrap()]);
    let secret = ClusterSecret::from_file(&dir).unwrap();
    std::fs::remove_file(&dir).unwrap();
    let t = Duration::from_secs(5);
    let member = TcpRendezvous::new(addr.as_str(), t).unwrap().with_secret(secret);
    member.publish(&metadata("decode-0")).unwrap();
    assert_eq!(member.lookup("decode-0", Duration::ZERO).unwrap(), metadata("decode-0"));
    let stranger = TcpRendezvous::new(addr.as_str(), t).unwrap().with_secret(ClusterSecret::new(vec![9; 32]).unwrap());
    match stranger.withdraw("decode-0") {
        Err(EngineError::Rendezvous { reason, .. }) => assert!(reason.contains("did not verify"), "{reason}"),
        r => panic!("{r:?}"),
    }
    assert!(member.lookup("decode-0", Duration::ZERO).is_ok());
}

#[test]
fn a_network_address_without_a_secret_is_refused_at_start() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpudirect"))
        .args(["rendezvous", "--listen", "0.0.0.0:0"])
        .env_remove("GPUDIRECT_SECRET_FILE")
        .env_remove("GPUDIRECT_SECRET")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no cluster secret") && err.contains("GPUDIRECT_SECRET_FILE"), "{err}");
}
