//! The embedded rendezvous's protocol and client ([`TcpRendezvous`]);
//! the server is `server`. Each request is one TCP connection: the server
//! opens with `"GDRV"`, the version and a fresh nonce; the client sends
//! `"GDRV"`, version, op (publish, lookup, withdraw; post, fetch, list,
//! remove for postings, whose name is `topic/name`), the name, the blob
//! and its proof (the cluster's secret over the nonce and all of that);
//! the answer is a status, bytes, and the server's proof over the nonce
//! and them. A fetched posting's answer starts with how long the server
//! has held it (8 bytes, milliseconds); a post or fetch of a name two
//! addresses posted answers "conflict" with their addresses, one a line.
//! Every length is checked before anything is allocated for it;
//! blobs are decoded as [`AgentMetadata`] before they are stored, and
//! again (as hostile input) by the client that looks them up.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant, SystemTime};

use gpudirect::deadline::{Bounded, Deadline};

use crate::wire::auth::{ClusterSecret, Key, Label, TAG};
use crate::wire::desc::{AgentMetadata, MAX_METADATA};
use crate::error::EngineError;
use super::board::{check_blob, check_posting, plain_poster, Board, Posting, MAX_ENTRIES, MAX_POSTING, MAX_POSTING_NAME};
use super::{check_name, decode_for, rdv_err, Rendezvous};

pub(super) const MAGIC: [u8; 4] = *b"GDRV";
/// 3: a fetch's answer carries the posting's age; "conflict" answers.
pub(super) const VERSION: u8 = 3;
/// How often a lookup asks again while the name is not there, or the
/// server is not up yet.
const LOOKUP_EVERY: Duration = Duration::from_millis(50);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Publish = 1,
    Lookup = 2,
    Withdraw = 3,
    Post = 4,
    Fetch = 5,
    List = 6,
    Remove = 7,
}

impl Op {
    /// The most bytes a request of this op carries.
    fn max_blob(self) -> usize {
        match self {
            Op::Publish => MAX_METADATA,
            Op::Post => MAX_POSTING,
            _ => 0,
        }
    }
}

/// The most bytes an answer carries: a posting and its age, or a topic's
/// names.
const MAX_ANSWER: usize = {
    let list = MAX_ENTRIES * (MAX_POSTING_NAME + 1);
    let most = 8 + if MAX_POSTING > MAX_METADATA { MAX_POSTING } else { MAX_METADATA };
    if list > most {
        list
    } else {
        most
    }
};

pub(super) const OK: u8 = 0;
pub(super) const NOT_FOUND: u8 = 1;
pub(super) const REFUSED: u8 = 2;
pub(super) const CONFLICT: u8 = 3;

/// Reads exactly `n` bytes.
fn take(s: &mut impl Read, n: usize) -> io::Result<Vec<u8>> {
    let mut v = vec![0; n];
    s.read_exact(&mut v)?;
    Ok(v)
}

/// A request as read, not yet proven: `signed` is every byte its `tag`
/// covers (with the server's nonce before them).
pub(super) struct Incoming {
    pub(super) op: Op,
    pub(super) name: String,
    pub(super) blob: Vec<u8>,
    pub(super) signed: Vec<u8>,
    pub(super) tag: Vec<u8>,
}

/// One request, or why it is refused (the connection stays usable for
/// the answer). An I/O error ends the connection.
pub(super) fn read_request(s: &mut impl Read) -> io::Result<Result<Incoming, String>> {
    let head = take(s, 7)?;
    if head[..4] != MAGIC {
        return Ok(Err("not a gpudirect rendezvous request".into()));
    }
    if head[4] != VERSION {
        return Ok(Err(format!("rendezvous request version {}, this server speaks {VERSION}: use the same gpudirect release everywhere", head[4])));
    }
    let op = match head[5] {
        1 => Op::Publish,
        2 => Op::Lookup,
        3 => Op::Withdraw,
        4 => Op::Post,
        5 => Op::Fetch,
        6 => Op::List,
        7 => Op::Remove,
        k => return Ok(Err(format!("rendezvous op {k} (1 publish, 2 lookup, 3 withdraw, 4 post, 5 fetch, 6 list, 7 remove)"))),
    };
    let n = usize::from(head[6]);
    let raw_name = take(s, n)?;
    let name = match String::from_utf8(raw_name.clone()) {
        Ok(n) if !n.is_empty() => n,
        _ => return Ok(Err("the name is empty or not UTF-8".into())),
    };
    let len_bytes = take(s, 4)?;
    let len = u32::from_be_bytes(len_bytes[..].try_into().expect("4 bytes")) as usize;
    if len > op.max_blob() {
        return Ok(Err(match op {
            Op::Publish | Op::Post => format!("a blob of {len} bytes (at most {})", op.max_blob()),
            _ => "only a publish or a post carries a blob".into(),
        }));
    }
    let blob = take(s, len)?;
    let tag = take(s, TAG)?;
    let mut signed = head;
    signed.extend_from_slice(&raw_name);
    signed.extend_from_slice(&len_bytes);
    signed.extend_from_slice(&blob);
    Ok(Ok(Incoming { op, name, blob, signed, tag }))
}

/// A client of a [`RendezvousServer`](super::RendezvousServer): what
/// agents publish to and look each other up in.
#[derive(Clone, Debug)]
pub struct TcpRendezvous {
    server: SocketAddr,
    timeout: Duration,
    key: Key,
}

impl TcpRendezvous {
    /// A client of the server at `server`, proving the environment's
    /// cluster secret (`GPUDIRECT_SECRET_FILE`, `GPUDIRECT_SECRET`; none:
    /// only a server without one answers); each request is bounded by
    /// `timeout` (connecting, sending, the answer).
    ///
    /// # Errors
    /// [`EngineError::Rendezvous`] when `server` does not resolve;
    /// [`EngineError::Auth`] for an unusable secret in the environment.
    pub fn new(server: impl ToSocketAddrs, timeout: Duration) -> Result<TcpRendezvous, EngineError> {
        let server = server
            .to_socket_addrs()
            .map_err(|e| rdv_err("(resolve)", e.to_string()))?
            .next()
            .ok_or_else(|| rdv_err("(resolve)", "the address resolves to nothing".into()))?;
        let secret = ClusterSecret::from_env().map_err(|source| EngineError::Auth { peer: format!("rendezvous {server}"), source })?;
        Ok(TcpRendezvous { server, timeout, key: Key::of(secret) })
    }

    /// The same client, proving `secret` instead.
    pub fn with_secret(mut self, secret: ClusterSecret) -> TcpRendezvous {
        self.key = Key::of(Some(secret));
        self
    }

    /// One request; the answer's (status, bytes).
    /// A server that closed it unanswered is asked again within the
    /// timeout: it was busy, not gone.
    fn call(&self, op: Op, name: &str, blob: &[u8]) -> Result<(u8, Vec<u8>), EngineError> {
        self.call_within(op, name, blob, false)
    }

    /// [`call`](Self::call); with `wait_up`, a server not up yet is also
    /// asked again within the timeout (a node posting before the gate's
    /// server has started).
    fn call_within(&self, op: Op, name: &str, blob: &[u8], wait_up: bool) -> Result<(u8, Vec<u8>), EngineError> {
        let started = Instant::now();
        loop {
            match self.try_call(op, name, blob, self.timeout) {
                Ok(a) => return Ok(a),
                Err(Call::Busy(_)) if started.elapsed() < self.timeout => std::thread::sleep(LOOKUP_EVERY),
                Err(Call::NotUp(_)) if wait_up && started.elapsed() < self.timeout => std::thread::sleep(LOOKUP_EVERY),
                Err(Call::NotUp(e) | Call::Busy(e)) => return Err(rdv_err(&self.server.to_string(), e.to_string())),
                Err(Call::Failed(e)) => return Err(e),
            }
        }
    }

    /// [`call`](Self::call), telling a server that is not up (nothing
    /// listens: the connection is refused) from every other failure.
    fn try_call(&self, op: Op, name: &str, blob: &[u8], within: Duration) -> Result<(u8, Vec<u8>), Call> {
        // Postings' `topic/name` were checked by the board's methods.
        if matches!(op, Op::Publish | Op::Lookup | Op::Withdraw) {
            check_name(name)?;
        }
        let server = self.server.to_string();
        let io = |e: io::Error| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => rdv_err(&server, format!("no whole answer within {within:?}")),
            _ => rdv_err(&server, e.to_string()),
        };
        // The whole exchange within the bound, not each read.
        let deadline = Deadline::after(within);
        let stream = TcpStream::connect_timeout(&self.server, within.max(Duration::from_millis(1))).map_err(|e| match e.kind() {
            io::ErrorKind::ConnectionRefused => Call::NotUp(e),
            _ => Call::Failed(io(e)),
        })?;
        let mut s = Bounded::new(&stream, deadline);
        // A server with every slot taken closes a newcomer unanswered: it
        // is busy, not gone, and a lookup asks again within its wait.
        let busy = |e: io::Error| match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => Call::Busy(e),
            _ => Call::Failed(io(e)),
        };
        let hello = take(&mut s, 5 + TAG).map_err(busy)?;
        if hello[..4] != MAGIC || hello[4] != VERSION {
            return Err(Call::Failed(rdv_err(&server, format!("not a gpudirect rendezvous v{VERSION} server (it opened with {:02x?})", &hello[..5]))));
        }
        let nonce = &hello[5..];
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&[VERSION, op as u8, name.len() as u8]);
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&(blob.len() as u32).to_be_bytes());
        out.extend_from_slice(blob);
        let tag = self.key.tag(Label::RendezvousRequest, &[nonce, &out]);
        out.extend_from_slice(&tag);
        s.write_all(&out).map_err(io)?;
        let mut answer = take(&mut s, 5).map_err(busy)?;
        let len = u32::from_be_bytes(answer[1..5].try_into().expect("4 bytes")) as usize;
        if len > MAX_ANSWER {
            return Err(Call::Failed(rdv_err(&server, format!("an answer of {len} bytes (at most {MAX_ANSWER})"))));
        }
        answer.extend_from_slice(&take(&mut s, len).map_err(io)?);
        let tag = take(&mut s, TAG).map_err(io)?;
        if !self.key.verify(Label::RendezvousAnswer, &[nonce, &answer], &tag) {
            if answer[0] == REFUSED {
                // A server with another secret says why it refused.
                return Err(Call::Failed(rdv_err(&server, String::from_utf8_lossy(&answer[5..]).into_owned())));
            }
            return Err(Call::Failed(rdv_err(&server, "its answer's proof did not verify: the server holds another cluster secret (or none)".into())));
        }
        Ok((answer[0], answer.split_off(5)))
    }

    fn check(&self, (status, body): (u8, Vec<u8>)) -> Result<Vec<u8>, EngineError> {
        match status {
            OK => Ok(body),
            _ => Err(rdv_err(&self.server.to_string(), String::from_utf8_lossy(&body).into_owned())),
        }
    }

    /// [`check`](Self::check) for a posting's answer, where "conflict"
    /// names the addresses that posted it.
    fn check_posting(&self, topic: &str, name: &str, (status, body): (u8, Vec<u8>)) -> Result<Vec<u8>, EngineError> {
        if status != CONFLICT {
            return self.check((status, body));
        }
        let posters = String::from_utf8_lossy(&body).split('\n').filter(|p| !p.is_empty()).map(plain_poster).collect();
        Err(EngineError::PostingConflict { posting: format!("{topic}/{name}"), posters })
    }
}

/// Why a request failed: nothing listens at the server (yet), it closed
/// the connection unanswered (every slot taken), or any other failure.
enum Call {
    NotUp(io::Error),
    Busy(io::Error),
    Failed(EngineError),
}

impl From<EngineError> for Call {
    fn from(e: EngineError) -> Call {
        Call::Failed(e)
    }
}

impl Rendezvous for TcpRendezvous {
    fn publish(&self, md: &AgentMetadata) -> Result<(), EngineError> {
        let blob = md.encode()?;
        self.call(Op::Publish, &md.name, &blob).and_then(|a| self.check(a)).map(drop)
    }

    /// Waits up to `timeout` also for the server itself: a server not up
    /// yet (connection refused) is asked again, as a name not there is.
    fn lookup(&self, name: &str, timeout: Duration) -> Result<AgentMetadata, EngineError> {
        let started = Instant::now();
        loop {
            let waited = started.elapsed();
            // Each try within what is left of the wait (and the timeout).
            let left = timeout.saturating_sub(waited).max(LOOKUP_EVERY).min(self.timeout);
            match self.try_call(Op::Lookup, name, &[], left) {
                Ok((OK, blob)) => return decode_for(name, &blob, &self.server.to_string()),
                Ok((NOT_FOUND, _)) if waited < timeout => {}
                Ok((NOT_FOUND, _)) => return Err(EngineError::NotPublished { name: name.to_owned(), waited: timeout }),
                Err(Call::NotUp(_) | Call::Busy(_)) if waited < timeout => {}
                Err(Call::NotUp(e) | Call::Busy(e)) => return Err(rdv_err(&self.server.to_string(), e.to_string())),
                Err(Call::Failed(e)) => return Err(e),
                Ok(other) => return self.check(other).and(Err(rdv_err(&self.server.to_string(), "an unknown status".into()))),
            }
            std::thread::sleep(LOOKUP_EVERY.min(timeout - waited));
        }
    }

    fn withdraw(&self, name: &str) -> Result<(), EngineError> {
        self.call(Op::Withdraw, name, &[]).and_then(|a| self.check(a)).map(drop)
    }
}

/// Postings in the server: each request proven with the cluster's secret
/// like the rest; a server not up yet is waited for within the timeout.
impl Board for TcpRendezvous {
    fn post(&self, topic: &str, name: &str, blob: &[u8]) -> Result<(), EngineError> {
        check_posting(topic, Some(name))?;
        check_blob(topic, name, blob)?;
        self.call_within(Op::Post, &format!("{topic}/{name}"), blob, true).and_then(|a| self.check_posting(topic, name, a)).map(drop)
    }

    fn names(&self, topic: &str) -> Result<Vec<String>, EngineError> {
        check_posting(topic, None)?;
        let body = self.call_within(Op::List, topic, &[], true).and_then(|a| self.check(a))?;
        let text = String::from_utf8(body).map_err(|_| rdv_err(&self.server.to_string(), "a listing that is not UTF-8".into()))?;
        Ok(text.split('\n').filter(|n| !n.is_empty()).map(str::to_owned).collect())
    }

    fn fetch(&self, topic: &str, name: &str) -> Result<Option<Posting>, EngineError> {
        check_posting(topic, Some(name))?;
        let mut body = match self.call_within(Op::Fetch, &format!("{topic}/{name}"), &[], true)? {
            (NOT_FOUND, _) => return Ok(None),
            a => self.check_posting(topic, name, a)?,
        };
        if body.len() < 8 {
            return Err(rdv_err(&self.server.to_string(), format!("a posting's answer of {} bytes, shorter than its age", body.len())));
        }
        let blob = body.split_off(8);
        let age = Duration::from_millis(u64::from_be_bytes(body[..].try_into().expect("8 bytes")));
        // Never before the epoch, whatever age a server says.
        let posted_at = SystemTime::now().checked_sub(age).unwrap_or(SystemTime::UNIX_EPOCH);
        Ok(Some(Posting { blob, posted_at: Some(posted_at) }))
    }

    fn remove(&self, topic: &str, name: &str) -> Result<(), EngineError> {
        check_posting(topic, Some(name))?;
        self.call_within(Op::Remove, &format!("{topic}/{name}"), &[], true).and_then(|a| self.check(a)).map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::super::server::{RendezvousConfig, RendezvousServer};
    use super::*;
    use crate::wire::desc::tests::sample;

    fn client(s: &RendezvousServer) -> TcpRendezvous {
        TcpRendezvous::new(s.addr(), Duration::from_secs(5)).unwrap()
    }

    fn secret(b: u8) -> ClusterSecret {
        ClusterSecret::new(vec![b; 32]).unwrap()
    }

    /// Raw bytes to the server, proven with `key` when `sign`; its
    /// (status, reason).
    fn raw(s: &RendezvousServer, bytes: &[u8], sign: Option<&Key>) -> (u8, String) {
        let mut c = TcpStream::connect(s.addr()).unwrap();
        let hello = take(&mut c, 5 + TAG).unwrap();
        let mut out = bytes.to_vec();
        if let Some(k) = sign {
            out.extend_from_slice(&k.tag(Label::RendezvousRequest, &[&hello[5..], bytes]));
        }
        c.write_all(&out).unwrap();
        let head = take(&mut c, 5).unwrap();
        let body = take(&mut c, u32::from_be_bytes(head[1..].try_into().unwrap()) as usize).unwrap();
        (head[0], String::from_utf8_lossy(&body).into_owned())
    }

    fn req(magic: &[u8], version: u8, op: u8, name: &str, blob: &[u8]) -> Vec<u8> {
        let mut v = magic.to_vec();
        v.extend_from_slice(&[version, op, name.len() as u8]);
        v.extend_from_slice(name.as_bytes());
        v.extend_from_slice(&(blob.len() as u32).to_be_bytes());
        v.extend_from_slice(blob);
        v
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

    /// Postings: the board's contract, apart from agents' names, proven
    /// with the secret (another is refused before acting), bounded by the
    /// server's budgets, and a post waits for a server not up yet.
    #[test]
    fn postings_are_a_board_proven_and_bounded() {
        let config = RendezvousConfig { secret: Some(secret(1)), max_names_per_client: 8, ..Default::default() };
        let server = RendezvousServer::bind_with("127.0.0.1:0", config).unwrap();
        let good = client(&server).with_secret(secret(1));
        super::super::board::tests::post_list_fetch_remove(&good);
        // An agent and a posting never take each other's place.
        good.publish(&sample()).unwrap();
        good.post("decode-0", "decode-0", b"a posting").unwrap();
        assert_eq!(good.lookup("decode-0", Duration::ZERO).unwrap(), sample());
        assert_eq!(good.names("decode-0").unwrap(), ["decode-0"]);
        // Without the secret, or with another: refused, nothing changed.
        for bad in [client(&server), client(&server).with_secret(secret(2))] {
            for e in [bad.post("decode-0", "decode-0", b"forged").unwrap_err(), bad.names("decode-0").unwrap_err(), bad.remove("decode-0", "decode-0").unwrap_err()] {
                assert!(e.to_string().contains("did not verify"), "{e}");
            }
        }
        assert_eq!(good.fetch("decode-0", "decode-0").unwrap().map(|p| p.blob).as_deref(), Some(&b"a posting"[..]));
        // Postings count in the client's budget (the agent and one posting
        // held: 6 more fit).
        for n in 0..6 {
            good.post("job-9", &format!("n{n}"), b"x").unwrap();
        }
        let e = good.post("job-9", "n6", b"x").unwrap_err().to_string();
        assert!(e.contains("max_names_per_client"), "{e}");
        // A post made before the server is up waits for it.
        let addr = server.addr();
        drop(server);
        std::thread::scope(|s| {
            let poster = s.spawn(|| good.post("job-1", "late", b"waited"));
            std::thread::sleep(Duration::from_millis(300));
            let again = RendezvousServer::bind_with(addr, RendezvousConfig { secret: Some(secret(1)), ..Default::default() }).unwrap();
            poster.join().unwrap().unwrap();
            assert_eq!(good.fetch("job-1", "late").unwrap().map(|p| p.blob).as_deref(), Some(&b"waited"[..]));
            drop(again);
        });
    }

    /// A member holding the secret posts a node's name first, from its
    /// own address: the node's post (from another) is refused naming
    /// both, and every fetch after is a conflict naming both, never the
    /// squatter's bytes as the node's; the other order too. Two addresses
    /// of this host: IPv4 and IPv6 loopback to a dual-stack listener.
    #[test]
    fn a_squatted_posting_is_a_conflict_naming_both_addresses() {
        let config = RendezvousConfig { secret: Some(secret(1)), ..Default::default() };
        let server = RendezvousServer::bind_with("[::]:0", config).unwrap();
        let port = server.addr().port();
        let at = |host: &str| TcpRendezvous::new(format!("{host}:{port}"), Duration::from_secs(5)).unwrap().with_secret(secret(1));
        let (squatter, node) = (at("127.0.0.1"), at("[::1]"));
        super::super::board::tests::a_second_poster_is_a_conflict(&squatter, &node, ("127.0.0.1", "::1"));
        // The holder may post again (the conflict stays); removing it and
        // posting again does not end it either: the node's claim stays.
        squatter.post("job-s", "node2", b"again").unwrap();
        assert!(matches!(squatter.fetch("job-s", "node2"), Err(EngineError::PostingConflict { .. })));
        squatter.remove("job-s", "node2").unwrap();
        assert_eq!(node.fetch("job-s", "node2").unwrap(), None, "one claim, no posting");
        match squatter.post("job-s", "node2", b"squat again") {
            Err(EngineError::PostingConflict { posters, .. }) => assert_eq!(posters, ["::1", "127.0.0.1"]),
            r => panic!("{r:?}"),
        }
        assert!(matches!(node.fetch("job-s", "node2"), Err(EngineError::PostingConflict { .. })));
        // It ends when all but one withdraw.
        squatter.remove("job-s", "node2").unwrap();
        node.post("job-s", "node2", b"node2's").unwrap();
        let got = node.fetch("job-s", "node2").unwrap().unwrap();
        assert_eq!(got.blob, b"node2's");
        let age = SystemTime::now().duration_since(got.posted_at.unwrap()).unwrap();
        assert!(age < Duration::from_secs(5), "posted {age:?} ago by the server's clock");
    }

    /// Hostile requests get a refusal with the reason; the server goes on.
    #[test]
    fn bad_requests_are_refused_and_the_server_goes_on() {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let blob = sample().encode().unwrap();
        let open = Key::of(None);
        let cases: Vec<(Vec<u8>, Option<&Key>, &str)> = vec![
            (req(b"HTTP", VERSION, 1, "decode-0", &blob), None, "not a gpudirect"),
            (req(b"GDRV", 9, 1, "decode-0", &blob), None, "version 9"),
            (req(b"GDRV", VERSION, 9, "decode-0", &blob), None, "op 9"),
            (req(b"GDRV", VERSION, 4, "no-slash", b"x"), Some(&open), "not topic/name"),
            (req(b"GDRV", VERSION, 4, "job/../x", b"x"), Some(&open), "not topic/name"),
            (req(b"GDRV", VERSION, 6, "job/x", &[]), Some(&open), "topic"),
            (req(b"GDRV", VERSION, 1, "", &blob), None, "empty"),
            (req(b"GDRV", VERSION, 1, "decode-0", b"garbage"), Some(&open), "not agent metadata"),
            (req(b"GDRV", VERSION, 1, "someone-else", &blob), Some(&open), "published as"),
            (req(b"GDRV", VERSION, 2, "decode-0", b"x"), None, "only a publish"),
        ];
        for (bytes, sign, why) in cases {
            let (status, reason) = raw(&server, &bytes, sign);
            assert_eq!(status, REFUSED, "{why}");
            assert!(reason.contains(why), "{reason:?} should say {why:?}");
        }
        let mut huge = b"GDRV".to_vec();
        huge.extend_from_slice(&[VERSION, 1, 1, b'x']);
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(raw(&server, &huge, None).1.contains("at most"), "a length is checked before allocating");
        // A client that connects and stalls, then one that hangs up mid-way.
        let stalled = TcpStream::connect(server.addr()).unwrap();
        drop(TcpStream::connect(server.addr()).map(|mut c| c.write_all(b"GDRV\x02")));
        let rdv = client(&server);
        rdv.publish(&sample()).unwrap();
        assert_eq!(rdv.lookup("decode-0", Duration::ZERO).unwrap(), sample());
        drop(stalled);
        // Names are checked on the client too.
        assert!(matches!(rdv.lookup("", Duration::ZERO), Err(EngineError::Config(_))));
    }

    /// Only holders of the server's secret are served: without it, with
    /// another, or replaying a proof made for another connection's nonce.
    #[test]
    fn requests_without_the_secret_are_refused_before_acting() {
        let config = RendezvousConfig { secret: Some(secret(1)), ..Default::default() };
        let server = RendezvousServer::bind_with("127.0.0.1:0", config).unwrap();
        let good = client(&server).with_secret(secret(1));
        good.publish(&sample()).unwrap();
        for bad in [client(&server), client(&server).with_secret(secret(2))] {
            for e in [bad.withdraw("decode-0").unwrap_err(), bad.lookup("decode-0", Duration::ZERO).unwrap_err()] {
                assert!(e.to_string().contains("did not verify"), "{e}");
            }
            let mut other = sample();
            other.control = "192.0.2.66:1".parse().unwrap();
            assert!(bad.publish(&other).is_err());
        }
        assert_eq!(good.lookup("decode-0", Duration::ZERO).unwrap(), sample(), "nothing changed");
        // A proof for another nonce: the request of an earlier connection.
        let bytes = req(b"GDRV", VERSION, 3, "decode-0", &[]);
        let k = Key::of(Some(secret(1)));
        let stale = k.tag(Label::RendezvousRequest, &[&[0u8; TAG], &bytes]);
        let mut c = TcpStream::connect(server.addr()).unwrap();
        take(&mut c, 5 + TAG).unwrap();
        c.write_all(&[&bytes[..], &stale[..]].concat()).unwrap();
        assert_eq!(take(&mut c, 1).unwrap()[0], REFUSED);
        assert_eq!(good.lookup("decode-0", Duration::ZERO).unwrap(), sample());
        // A network address needs a secret (or `insecure`).
        match RendezvousServer::bind("0.0.0.0:0") {
            Err(EngineError::Auth { source: crate::wire::auth::AuthError::Unprotected { .. }, .. }) => {}
            Ok(_) if ClusterSecret::from_env().unwrap().is_some() => {}
            r => panic!("{r:?}"),
        }
    }

    /// What one client may make the server hold is bounded, with the
    /// limit named; a lease expires what is not published again.
    #[test]
    fn budgets_and_leases_bound_what_the_server_holds() {
        let len = sample().encode().unwrap().len();
        let config = RendezvousConfig { max_names_per_client: 3, max_bytes: 1 << 20, lease: Some(Duration::from_millis(600)), ..Default::default() };
        let server = RendezvousServer::bind_with("127.0.0.1:0", config).unwrap();
        let rdv = client(&server);
        let named = |n: usize| {
            let mut m = sample();
            m.name = format!("agent-{n}");
            m
        };
        for n in 0..3 {
            rdv.publish(&named(n)).unwrap();
        }
        rdv.publish(&named(1)).unwrap();
        let e = rdv.publish(&named(3)).unwrap_err().to_string();
        assert!(e.contains("max_names_per_client"), "{e}");
        rdv.withdraw("agent-0").unwrap();
        rdv.publish(&named(3)).unwrap();
        // The lease: kept alive by publishing again, gone without.
        for _ in 0..4 {
            std::thread::sleep(Duration::from_millis(250));
            rdv.publish(&named(3)).unwrap();
        }
        assert!(rdv.lookup("agent-3", Duration::ZERO).is_ok(), "published again within the lease");
        assert!(matches!(rdv.lookup("agent-1", Duration::ZERO), Err(EngineError::NotPublished { .. })), "expired");
        // Bytes in all.
        let config = RendezvousConfig { max_bytes: 2 * len, ..Default::default() };
        let server = RendezvousServer::bind_with("127.0.0.1:0", config).unwrap();
        let rdv = client(&server);
        rdv.publish(&named(0)).unwrap();
        rdv.publish(&named(1)).unwrap();
        let e = rdv.publish(&named(2)).unwrap_err().to_string();
        assert!(e.contains("max_bytes"), "{e}");
        rdv.publish(&named(1)).unwrap();
    }

    /// The server gone: requests fail with a typed error, within the
    /// client's timeout; one started again at the same address serves; a
    /// lookup started before the server is up waits for it.
    #[test]
    fn an_outage_is_a_typed_error_and_a_restart_serves_again() {
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let addr = server.addr();
        let rdv = client(&server);
        rdv.publish(&sample()).unwrap();
        drop(server);
        let started = Instant::now();
        match rdv.withdraw("decode-0") {
            Err(EngineError::Rendezvous { server, reason }) => assert!(server == addr.to_string() && !reason.is_empty()),
            r => panic!("{r:?}"),
        }
        match rdv.lookup("decode-0", Duration::from_millis(300)) {
            Err(EngineError::Rendezvous { reason, .. }) => assert!(reason.contains("refused"), "{reason}"),
            r => panic!("{r:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        std::thread::scope(|s| {
            let waiter = s.spawn(|| rdv.lookup("decode-0", Duration::from_secs(10)));
            std::thread::sleep(Duration::from_millis(300));
            let again = RendezvousServer::bind(addr).unwrap();
            rdv.publish(&sample()).unwrap();
            assert_eq!(waiter.join().unwrap().unwrap().name, "decode-0", "the lookup waited for the server");
            drop(again);
        });
    }

    /// Clients that trickle their bytes (each reconnecting when cut off)
    /// and hundreds of silent ones, all from this address, starve no
    /// lookup: 128 at once of a published name all succeed.
    #[test]
    fn trickling_and_silent_clients_starve_no_lookup() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
        let rdv = client(&server);
        rdv.publish(&sample()).unwrap();
        let addr = server.addr();
        let stop = AtomicBool::new(false);
        let (ok, failed) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let started = Instant::now();
        let mut slowest = Duration::ZERO;
        std::thread::scope(|sc| {
            for _ in 0..32 {
                sc.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(mut c) = TcpStream::connect(addr) else { continue };
                        let _ = take(&mut c, 5 + TAG);
                        // One byte every 200 ms: each read in time, the
                        // request never whole.
                        while !stop.load(Ordering::Relaxed) && c.write_all(&MAGIC[..1]).is_ok() {
                            std::thread::sleep(Duration::from_millis(200));
                        }
                    }
                });
            }
            let silent: Vec<TcpStream> = (0..300).filter_map(|_| TcpStream::connect(addr).ok()).collect();
            std::thread::sleep(Duration::from_millis(500));
            let lookups: Vec<_> = (0..128)
                .map(|_| {
                    sc.spawn(|| {
                        let t = Instant::now();
                        match client(&server).lookup("decode-0", Duration::from_secs(20)) {
                            Ok(md) if md.name == "decode-0" => ok.fetch_add(1, Ordering::Relaxed),
                            other => {
                                eprintln!("lookup: {other:?}");
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        t.elapsed()
                    })
                })
                .collect();
            for l in lookups {
                slowest = slowest.max(l.join().unwrap());
            }
            stop.store(true, Ordering::Relaxed);
            drop(silent);
        });
        let (ok, failed) = (ok.into_inner(), failed.into_inner());
        println!("128 lookups beside 32 trickling and 300 silent clients: {ok} ok, {failed} failed, the slowest {slowest:?} ({:?} in all)", started.elapsed());
        assert_eq!((ok, failed), (128, 0));
    }

    /// A server that trickles its opening cannot hold a lookup past the
    /// lookup's own wait.
    #[test]
    fn a_trickling_server_holds_a_lookup_no_longer_than_its_wait() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let done = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|sc| {
            sc.spawn(|| {
                listener.set_nonblocking(true).unwrap();
                let mut held = Vec::new();
                while !done.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok((c, _)) = listener.accept() {
                        held.push(c);
                    }
                    for c in &mut held {
                        let _ = c.write_all(b"G");
                    }
                    std::thread::sleep(Duration::from_millis(300));
                }
            });
            let rdv = TcpRendezvous::new(addr, Duration::from_secs(30)).unwrap();
            let t = Instant::now();
            let got = rdv.lookup("decode-0", Duration::from_secs(2));
            let took = t.elapsed();
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            println!("a lookup of 2 s against a trickling server: {took:?}, {got:?}");
            assert!(got.is_err() && took < Duration::from_secs(4), "{took:?}: {got:?}");
        });
    }
}
