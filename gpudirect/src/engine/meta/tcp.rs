//! The embedded rendezvous: a server one process hosts (a thread keeping
//! name -> metadata blob in memory) and a client per agent, over plain
//! TCP. Each request is one connection: `"GDRV"`, version, op (publish,
//! lookup, withdraw), the name, the blob; the answer is a status and
//! bytes. Every length is checked before anything is allocated for it,
//! blobs are decoded as [`AgentMetadata`] before they are stored, and the
//! server holds at most [`MAX_ENTRIES`] names. Each connection is served
//! on a thread of its own, bounded by `SERVE_TIMEOUT`, at most
//! `MAX_CLIENTS` at once (more are closed unanswered), so a client that
//! stalls delays nobody else.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::bootstrap::{serve_each, Server, WhenFull};
use crate::sync::Mutex;

use super::super::desc::{AgentMetadata, MAX_METADATA};
use super::super::error::EngineError;
use super::{check_name, decode_for, rdv_err, Rendezvous};

const MAGIC: [u8; 4] = *b"GDRV";
const VERSION: u8 = 1;
/// Most names a [`RendezvousServer`] holds.
pub const MAX_ENTRIES: usize = 65536;
/// Bound on serving one request.
const SERVE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections served at once.
const MAX_CLIENTS: usize = 32;
/// How often a lookup asks again while the name is not there.
const LOOKUP_EVERY: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Publish = 1,
    Lookup = 2,
    Withdraw = 3,
}

const OK: u8 = 0;
const NOT_FOUND: u8 = 1;
const REFUSED: u8 = 2;

/// A rendezvous server: hosts every agent's metadata, in memory, for as
/// long as it lives. Start it in one process (any, an agent's or a
/// launcher's); stops when dropped.
pub struct RendezvousServer {
    addr: SocketAddr,
    stop: Arc<Mutex<bool>>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RendezvousServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousServer").field("addr", &self.addr).finish()
    }
}

impl RendezvousServer {
    /// Binds `addr` (port 0: a free one) and starts serving.
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] when it cannot bind or start its thread.
    pub fn bind(addr: impl ToSocketAddrs) -> Result<RendezvousServer, EngineError> {
        let listener = TcpListener::bind(addr).map_err(|e| rdv_err("(bind)", format!("cannot bind the rendezvous server: {e}")))?;
        let addr = listener.local_addr().map_err(|e| rdv_err("(bind)", e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| rdv_err("(bind)", e.to_string()))?;
        let stop = Arc::new(Mutex::new(false));
        let thread = {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name("gpudirect-rendezvous".into())
                .spawn(move || serve(listener, stop))
                .map_err(|e| rdv_err("(bind)", format!("cannot start the rendezvous thread: {e}")))?
        };
        tracing::info!(%addr, "rendezvous server started");
        Ok(RendezvousServer { addr, stop, thread: Some(thread) })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        *self.stop.lock() = true;
        crate::bootstrap::wake_listener(self.addr);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

type Store = Arc<Mutex<HashMap<String, Vec<u8>>>>;

fn serve(listener: TcpListener, stop: Arc<Mutex<bool>>) {
    let store: Store = Arc::default();
    let server = Server { name: "gpudirect-rendezvous", max: MAX_CLIENTS, when_full: WhenFull::Close };
    serve_each(&listener, &stop, &server, |s, from| {
        if let Err(e) = answer(s, &store) {
            tracing::warn!(%from, "rendezvous request not served: {e}");
        }
    });
}

/// Reads exactly `n` bytes.
fn take(s: &mut TcpStream, n: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

fn answer(mut s: TcpStream, store: &Mutex<HashMap<String, Vec<u8>>>) -> io::Result<()> {
    s.set_nonblocking(false)?;
    s.set_read_timeout(Some(SERVE_TIMEOUT))?;
    s.set_write_timeout(Some(SERVE_TIMEOUT))?;
    let req = request(&mut s)?;
    let mut store = store.lock();
    let (status, body) = match req {
        Err(why) => (REFUSED, why.into_bytes()),
        Ok((Op::Publish, name, blob)) => match AgentMetadata::decode(&blob) {
            Err(e) => (REFUSED, format!("not agent metadata: {e}").into_bytes()),
            Ok(md) if md.name != name => (REFUSED, format!("metadata of {:?} published as {name:?}", md.name).into_bytes()),
            Ok(_) if store.len() >= MAX_ENTRIES && !store.contains_key(&name) => {
                (REFUSED, format!("the server holds its maximum of {MAX_ENTRIES} names").into_bytes())
            }
            Ok(_) => {
                store.insert(name, blob);
                (OK, Vec::new())
            }
        },
        Ok((Op::Lookup, name, _)) => match store.get(&name) {
            Some(b) => (OK, b.clone()),
            None => (NOT_FOUND, Vec::new()),
        },
        Ok((Op::Withdraw, name, _)) => {
            store.remove(&name);
            (OK, Vec::new())
        }
    };
    drop(store);
    let mut out = vec![status];
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    s.write_all(&out)
}

/// A request read: (op, name, blob), or why it is refused.
type Parsed = Result<(Op, String, Vec<u8>), String>;

/// One request, or why it is refused (the connection stays usable for
/// the answer). An I/O error ends the connection.
fn request(s: &mut TcpStream) -> io::Result<Parsed> {
    let head = take(s, 7)?;
    if head[..4] != MAGIC {
        return Ok(Err("not a gpudirect rendezvous request".into()));
    }
    if head[4] != VERSION {
        return Ok(Err(format!("rendezvous request version {}, this server speaks {VERSION}", head[4])));
    }
    let op = match head[5] {
        1 => Op::Publish,
        2 => Op::Lookup,
        3 => Op::Withdraw,
        k => return Ok(Err(format!("rendezvous op {k} (1 publish, 2 lookup, 3 withdraw)"))),
    };
    let n = usize::from(head[6]);
    let name = match String::from_utf8(take(s, n)?) {
        Ok(n) if !n.is_empty() => n,
        _ => return Ok(Err("the name is empty or not UTF-8".into())),
    };
    let len = u32::from_be_bytes(take(s, 4)?.try_into().expect("4 bytes")) as usize;
    if len > MAX_METADATA {
        return Ok(Err(format!("a blob of {len} bytes (at most {MAX_METADATA})")));
    }
    if op != Op::Publish && len != 0 {
        return Ok(Err("only a publish carries a blob".into()));
    }
    Ok(Ok((op, name, take(s, len)?)))
}

/// A client of a [`RendezvousServer`]: what agents publish to and look
/// each other up in.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    server: SocketAddr,
    timeout: Duration,
}

impl TcpRendezvous {
    /// A client of the server at `server`; each request is bounded by
    /// `timeout` (connecting, sending, the answer).
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] when `server` does not resolve.
    pub fn new(server: impl ToSocketAddrs, timeout: Duration) -> Result<TcpRendezvous, EngineError> {
        let server = server
            .to_socket_addrs()
            .map_err(|e| rdv_err("(resolve)", e.to_string()))?
            .next()
            .ok_or_else(|| rdv_err("(resolve)", "the address resolves to nothing".into()))?;
        Ok(TcpRendezvous { server, timeout })
    }

    /// One request; the answer's (status, bytes).
    fn call(&self, op: Op, name: &str, blob: &[u8]) -> Result<(u8, Vec<u8>), EngineError> {
        check_name(name)?;
        let server = self.server.to_string();
        let io = |e: io::Error| rdv_err(&server, e.to_string());
        let mut s = TcpStream::connect_timeout(&self.server, self.timeout).map_err(io)?;
        s.set_read_timeout(Some(self.timeout)).map_err(io)?;
        s.set_write_timeout(Some(self.timeout)).map_err(io)?;
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[VERSION, op as u8, name.len() as u8]);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(blob.len() as u32).to_be_bytes());
        out.extend_from_slice(blob);
        s.write_all(&out).map_err(io)?;
        let head = take(&mut s, 5).map_err(io)?;
        let len = u32::from_be_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
        if len > MAX_METADATA {
            return Err(rdv_err(&server, format!("an answer of {len} bytes (at most {MAX_METADATA})")));
        }
        Ok((head[0], take(&mut s, len).map_err(io)?))
    }

    fn check(&self, (status, body): (u8, Vec<u8>)) -> Result<Vec<u8>, EngineError> {
        match status {
            OK => Ok(body),
            _ => Err(rdv_err(&self.server.to_string(), String::from_utf8_lossy(&body).into_owned())),
        }
    }
}

impl Rendezvous for TcpRendezvous {
    fn publish(&self, md: &AgentMetadata) -> Result<(), EngineError> {
        let blob = md.encode()?;
        self.call(Op::Publish, &md.name, &blob).and_then(|a| self.check(a)).map(drop)
    }

    fn lookup(&self, name: &str, timeout: Duration) -> Result<AgentMetadata, EngineError> {
        let started = Instant::now();
        loop {
            match self.call(Op::Lookup, name, &[])? {
                (OK, blob) => return decode_for(name, &blob, &self.server.to_string()),
                (NOT_FOUND, _) if started.elapsed() < timeout => std::thread::sleep(LOOKUP_EVERY.min(timeout)),
                (NOT_FOUND, _) => return Err(EngineError::NotPublished { name: name.to_owned(), waited: timeout }),
                other => return self.check(other).and(Err(rdv_err(&self.server.to_string(), "an unknown status".into()))),
            }
        }
    }

    fn withdraw(&self, name: &str) -> Result<(), EngineError> {
        self.call(Op::Withdraw, name, &[]).and_then(|a| self.check(a)).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::desc::tests::sample;

    fn client(s: &RendezvousServer) -> TcpRendezvous {
        TcpRendezvous::new(s.addr(), Duration::from_secs(5)).unwrap()
    }

    /// Raw bytes to the server; its (status, reason).
    fn raw(s: &RendezvousServer, bytes: &[u8]) -> (u8, String) {
        let mut c = TcpStream::connect(s.addr()).unwrap();
        c.write_all(bytes).unwrap();
        let mut head = [0; 5];
        c.read_exact(&mut head).unwrap();
        let mut body = vec![0; u32::from_be_bytes(head[1..].try_into().unwrap()) as usize];
        c.read_exact(&mut body).unwrap();
        (head[0], String::from_utf8_lossy(&body).into_owned())
    }

    #[test]
    fn publish_lookup_withdraw_and_a_lookup_that_waits() {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let rdv = client(&server);
        let md = sample();
        super::super::tests::publish_replace_withdraw(&rdv);
        // A lookup waits for a publish that comes later.
        std::thread::scope(|s| {
            let waiter = s.spawn(|| rdv.lookup("decode-0", Duration::from_secs(10)));
            std::thread::sleep(Duration::from_millis(200));
            rdv.publish(&md).unwrap();
            assert_eq!(waiter.join().unwrap().unwrap(), md);
        });
    }

    /// Hostile requests get a refusal with the reason; the server goes on.
    #[test]
    fn bad_requests_are_refused_and_the_server_goes_on() {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let blob = sample().encode().unwrap();
        let req = |magic: &[u8], version: u8, op: u8, name: &str, blob: &[u8]| {
            let mut v = magic.to_vec();
            v.extend_from_slice(&[version, op, name.len() as u8]);
            v.extend_from_slice(name.as_bytes());
            v.extend_from_slice(&(blob.len() as u32).to_be_bytes());
            v.extend_from_slice(blob);
            v
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (req(b"HTTP", 1, 1, "decode-0", &blob), "not a gpudirect"),
            (req(b"GDRV", 9, 1, "decode-0", &blob), "version 9"),
            (req(b"GDRV", 1, 4, "decode-0", &blob), "op 4"),
            (req(b"GDRV", 1, 1, "", &blob), "empty"),
            (req(b"GDRV", 1, 1, "decode-0", b"garbage"), "not agent metadata"),
            (req(b"GDRV", 1, 1, "someone-else", &blob), "published as"),
            (req(b"GDRV", 1, 2, "decode-0", b"x"), "only a publish"),
        ];
        for (bytes, why) in cases {
            let (status, reason) = raw(&server, &bytes);
            assert_eq!(status, REFUSED, "{why}");
            assert!(reason.contains(why), "{reason:?} should say {why:?}");
        }
        let mut huge = b"GDRV".to_vec();
        huge.extend_from_slice(&[1, 1, 1, b'x']);
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(raw(&server, &huge).1.contains("at most"), "a length is checked before allocating");
        // A client that connects and stalls, then one that hangs up mid-way.
        let stalled = TcpStream::connect(server.addr()).unwrap();
        drop(TcpStream::connect(server.addr()).map(|mut c| c.write_all(b"GDRV\x01")));
        let rdv = client(&server);
        rdv.publish(&sample()).unwrap();
        assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap(), sample());
        drop(stalled);
        // Names are checked on the client too.
        assert!(matches!(rdv.lookup("", Duration::ZERO), Err(EngineError::Config(_))));
    }

    /// The server gone: requests fail with a typed error, within the
    /// client's timeout; one started again at the same address serves.
    #[test]
    fn an_outage_is_a_typed_error_and_a_restart_serves_again() {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr();
        let rdv = client(&server);
        rdv.publish(&sample()).unwrap();
        drop(server);
        let started = Instant::now();
        match rdv.lookup("decode-0", Duration::from_secs(1)) {
            Err(EngineError::Rendezvous { server, reason }) => assert!(server == addr.to_string() && !reason.is_empty()),
            r => panic!("{r:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        let again = RendezvousServer::bind(addr).unwrap();
        rdv.publish(&sample()).unwrap();
        assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap().name, "decode-0");
        drop(again);
    }
}
