//! Connections on demand: one RC queue pair per (peer, local NIC, remote
//! NIC) in use, set up on first use through the peer agent's control
//! listener and kept until it fails. Every queue pair takes its receives
//! (notifications) from its NIC's shared receive queue, so a connection
//! costs a send queue and no receive memory.
//!
//! The setup, over the library's bootstrap exchange (bounded, versioned):
//! the initiator creates its queue pair and sends its endpoint with a
//! request (its agent name, both NIC indices); the target answers with its
//! agent name; the target creates and connects its queue pair and answers
//! with its endpoint (or a refusal with the reason); the initiator
//! connects. The target is ready to receive before the initiator can send.

use std::collections::HashMap;
use std::io;
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::Duration;

use crate::bootstrap::{BootstrapError, Handshake, OobChannel};
use crate::deadline::Deadline;
use crate::qp::{QpConfig, QueuePair};
use crate::sync::Mutex;
use crate::wire::{Endpoint, Reader};

use super::desc::{AgentMetadata, MAX_NAME};
use super::error::EngineError;
use super::nic::Nic;

const REQUEST_VERSION: u8 = 1;
/// Bound on serving one connection request: requests are served one at
/// a time, so a peer that connects and stalls delays the others this long
/// at most.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(10);

/// One connected queue pair to a peer agent.
pub(crate) struct Conn {
    pub(crate) qp: QueuePair,
    pub(crate) peer: Arc<str>,
}

type Key = (Arc<str>, usize, usize);
/// A peer's connections to send on, by (local NIC, remote NIC).
type PeerConns = Vec<((usize, usize), Arc<Conn>)>;

/// The agent's NICs and its connections.
pub(crate) struct ConnPool {
    pub(crate) name: Arc<str>,
    pub(crate) nics: Vec<Nic>,
    pub(crate) qp: QpConfig,
    pub(crate) timeout: Duration,
    /// The connection each (peer, local NIC, remote NIC) sends on, by
    /// peer: a post looks its peer up by name without allocating a key.
    sending: Mutex<HashMap<Arc<str>, PeerConns>>,
    /// Every live connection, by (local NIC, queue pair number): how a
    /// completion finds its peer. Owns them: a connection the peer set up
    /// while ours was being set up too stays alive here for its sends.
    live: Mutex<HashMap<(usize, u32), Arc<Conn>>>,
    /// One setup at a time per key from this side, so concurrent first
    /// posts to one peer make one connection, and an unreachable peer
    /// delays only posts to it. (The target side takes none of these, so
    /// two agents connecting to each other cannot deadlock.) A key's lock
    /// stays for the pool's life: one small lock per peer ever connected,
    /// and never one destroyed while another thread may still hold it.
    connecting: Mutex<HashMap<Key, Arc<Mutex<()>>>>,
}

fn control_err(peer: &str) -> impl FnOnce(BootstrapError) -> EngineError + '_ {
    move |source| EngineError::Control { peer: peer.to_owned(), source }
}

fn request(name: &str, nic: usize, remote_nic: usize) -> Vec<u8> {
    let mut v = vec![REQUEST_VERSION, name.len() as u8];
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(&[nic as u8, remote_nic as u8]);
    v
}

/// (initiator name, its NIC, our NIC) from a request's bytes.
fn parse_request(b: &[u8]) -> Result<(String, usize, usize), String> {
    let mut r = Reader(b);
    let bad = |t: crate::wire::Truncated| format!("request truncated in {}", t.field);
    let v = r.u8("version").map_err(bad)?;
    if v != REQUEST_VERSION {
        return Err(format!("connection request version {v}, this agent speaks {REQUEST_VERSION}"));
    }
    let n = r.u8("name length").map_err(bad)? as usize;
    let name = std::str::from_utf8(r.take("name", n).map_err(bad)?).map_err(|_| "agent name is not UTF-8".to_string())?;
    if name.is_empty() || name.len() > MAX_NAME {
        return Err("empty agent name".into());
    }
    let theirs = r.u8("initiator NIC").map_err(bad)? as usize;
    let ours = r.u8("target NIC").map_err(bad)? as usize;
    if r.rest() != 0 {
        return Err(format!("{} trailing bytes after the request", r.rest()));
    }
    Ok((name.to_owned(), theirs, ours))
}

impl ConnPool {
    pub(crate) fn new(name: Arc<str>, nics: Vec<Nic>, qp: QpConfig, timeout: Duration) -> ConnPool {
        ConnPool {
            name,
            nics,
            qp,
            timeout,
            sending: Mutex::default(),
            live: Mutex::default(),
            connecting: Mutex::default(),
        }
    }

    /// The connection to `peer` from local NIC `nic` to its NIC
    /// `remote_nic`, set up now when there is none.
    pub(crate) fn get(&self, peer: &AgentMetadata, nic: usize, remote_nic: usize) -> Result<Arc<Conn>, EngineError> {
        if let Some(c) = self.sending_on(&peer.name, nic, remote_nic) {
            return Ok(c);
        }
        let key: Key = (peer.name.as_str().into(), nic, remote_nic);
        let turn = self.connecting.lock().entry(key.clone()).or_default().clone();
        let _one = turn.lock();
        if let Some(c) = self.sending_on(&peer.name, nic, remote_nic) {
            return Ok(c);
        }
        let conn = Arc::new(self.connect(peer, nic, remote_nic)?);
        self.live.lock().insert((nic, conn.qp.endpoint().qp_num), conn.clone());
        self.send_on(key.0, (nic, remote_nic), conn.clone(), true);
        Ok(conn)
    }

    fn sending_on(&self, peer: &str, nic: usize, remote_nic: usize) -> Option<Arc<Conn>> {
        self.sending.lock().get(peer)?.iter().find(|(k, _)| *k == (nic, remote_nic)).map(|(_, c)| c.clone())
    }

    /// Makes `conn` the one to send to `peer` on `nics`: always when
    /// `replace`, else only if there is none.
    fn send_on(&self, peer: Arc<str>, nics: (usize, usize), conn: Arc<Conn>, replace: bool) {
        let mut sending = self.sending.lock();
        let v = sending.entry(peer).or_default();
        match v.iter_mut().find(|(k, _)| *k == nics) {
            Some(slot) if replace => slot.1 = conn,
            Some(_) => {}
            None => v.push((nics, conn)),
        }
    }

    fn create_qp(&self, nic: usize) -> Result<crate::qp::PreparedQueuePair, EngineError> {
        let n = &self.nics[nic];
        let live = self.live.lock().keys().filter(|(i, _)| *i == nic).count();
        if live >= n.max_connections {
            return Err(EngineError::TooManyConnections { max: n.max_connections });
        }
        Ok(QueuePair::create_with_srq(&n.pd, &n.send_cq, &n.recv_cq, &n.srq, &self.qp)?)
    }

    fn connect(&self, peer: &AgentMetadata, nic: usize, remote_nic: usize) -> Result<Conn, EngineError> {
        let started = std::time::Instant::now();
        let prepared = self.create_qp(nic)?;
        let mut oob = OobChannel::connect(peer.control, self.timeout).map_err(control_err(&peer.name))?;
        let hello = oob
            .exchange(&Handshake { endpoint: Some(prepared.endpoint()), buffers: vec![], app: request(&self.name, nic, remote_nic) })
            .map_err(control_err(&peer.name))?;
        let got = String::from_utf8_lossy(&hello.app).into_owned();
        if got != peer.name {
            return Err(EngineError::WrongPeer { expected: peer.name.clone(), got });
        }
        let answer = oob.exchange(&Handshake::default()).map_err(control_err(&peer.name))?;
        let remote = match (answer.endpoint, answer.app.split_first()) {
            (Some(ep), Some((0, _))) => ep,
            (_, Some((_, reason))) => {
                return Err(EngineError::Refused { peer: peer.name.clone(), reason: String::from_utf8_lossy(reason).into_owned() })
            }
            _ => return Err(EngineError::Refused { peer: peer.name.clone(), reason: "an empty answer".into() }),
        };
        let qp = prepared.connect(&remote)?;
        tracing::info!(peer = %peer.name, nic, remote_nic, qp = qp.endpoint().qp_num, setup_us = started.elapsed().as_micros() as u64, "engine connected");
        Ok(Conn { qp, peer: peer.name.as_str().into() })
    }

    /// Serves one connection request on an accepted control stream.
    fn accept(&self, stream: TcpStream) -> Result<(), EngineError> {
        let from = stream.peer_addr().map(|a| a.to_string()).unwrap_or_default();
        let mut oob = OobChannel::from_stream(stream, self.timeout.min(ACCEPT_TIMEOUT)).map_err(control_err(&from))?;
        let hello = oob.exchange(&Handshake { app: self.name.as_bytes().to_vec(), ..Default::default() }).map_err(control_err(&from))?;
        let parsed = parse_request(&hello.app).and_then(|(name, theirs, ours)| match hello.endpoint {
            Some(ep) if ours < self.nics.len() => Ok((name, theirs, ours, ep)),
            Some(_) => Err(format!("this agent has {} NIC(s), NIC {ours} was asked for", self.nics.len())),
            None => Err("the request carries no endpoint".into()),
        });
        let refuse = |oob: &mut OobChannel, reason: String| -> Result<(), EngineError> {
            let mut app = vec![1];
            app.extend_from_slice(reason.as_bytes());
            oob.exchange(&Handshake { app, ..Default::default() }).map_err(control_err(&from))?;
            Err(EngineError::Refused { peer: from.clone(), reason })
        };
        let (name, theirs, ours, ep): (String, usize, usize, Endpoint) = match parsed {
            Ok(p) => p,
            Err(reason) => return refuse(&mut oob, reason),
        };
        let qp = match self.create_qp(ours).and_then(|p| Ok(p.connect(&ep)?)) {
            Ok(qp) => qp,
            Err(e) => return refuse(&mut oob, e.to_string()),
        };
        let endpoint = qp.endpoint();
        let conn = Arc::new(Conn { qp, peer: name.as_str().into() });
        self.live.lock().insert((ours, endpoint.qp_num), conn.clone());
        // Sends to that peer use it unless we set one up ourselves.
        self.send_on(name.as_str().into(), (ours, theirs), conn, false);
        oob.exchange(&Handshake { endpoint: Some(endpoint), app: vec![0], ..Default::default() }).map_err(control_err(&name))?;
        tracing::info!(peer = %name, nic = ours, remote_nic = theirs, qp = endpoint.qp_num, "engine accepted a connection");
        Ok(())
    }

    /// The peer a completion on local NIC `nic`, queue pair `qpn`, is from.
    pub(crate) fn peer_of(&self, nic: usize, qpn: u32) -> Option<Arc<str>> {
        self.live.lock().get(&(nic, qpn)).map(|c| c.peer.clone())
    }

    /// Drops a failed connection; the next transfer to its peer sets up a
    /// new one. The caller has failed the requests outstanding on it.
    pub(crate) fn retire(&self, nic: usize, qpn: u32) {
        let Some(conn) = self.live.lock().remove(&(nic, qpn)) else { return };
        let mut sending = self.sending.lock();
        if let Some(v) = sending.get_mut(&conn.peer) {
            v.retain(|(_, c)| !Arc::ptr_eq(c, &conn));
        }
        tracing::warn!(peer = %conn.peer, nic, qp = qpn, "engine connection failed; retired (the next transfer reconnects)");
    }

    /// Connections alive now.
    pub(crate) fn connections(&self) -> usize {
        self.live.lock().len()
    }
}

/// How long the listener sleeps in poll(2) before looking at its stop
/// flag again, when nothing wakes it sooner (the agent's drop does).
const IDLE_LOOK: Duration = Duration::from_millis(500);

/// The control listener's loop, until `stop`: sleeps in poll(2) on the
/// listening socket (an idle agent costs no CPU; many agents on one host
/// would otherwise wake each other out of it), serves connection requests
/// one at a time, each bounded.
pub(crate) fn serve(pool: Arc<ConnPool>, listener: TcpListener, stop: Arc<Mutex<bool>>) {
    if let Err(e) = listener.set_nonblocking(true) {
        tracing::error!("engine control listener: {e}; no connection requests will be served");
        return;
    }
    while !*stop.lock() {
        match listener.accept() {
            Ok((s, _)) => {
                // The agent's drop wakes us with a connection of its own.
                if *stop.lock() {
                    break;
                }
                if let Err(e) = pool.accept(s) {
                    tracing::warn!("engine connection request not served: {e}");
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Err(errno) = Deadline::after(IDLE_LOOK).wait_readable(listener.as_raw_fd()) {
                    tracing::warn!("engine control listener: poll: {errno}");
                    std::thread::sleep(IDLE_LOOK);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::warn!("engine control listener: accept: {e}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused_with_a_reason() {
        assert_eq!(parse_request(&request("prefill-0", 1, 0)).unwrap(), ("prefill-0".to_string(), 1, 0));
        let good = request("p", 0, 0);
        for n in 0..good.len() {
            assert!(parse_request(&good[..n]).is_err());
        }
        let mut v = good.clone();
        v[0] = 9;
        assert!(parse_request(&v).unwrap_err().contains("version 9"));
        v = good.clone();
        v.push(1);
        assert!(parse_request(&v).unwrap_err().contains("trailing"));
        assert!(parse_request(&[1, 0, 0, 0]).unwrap_err().contains("empty"));
    }
}
