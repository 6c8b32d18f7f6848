//! The control protocol: how an agent asks a peer's control listener for
//! a connection (or to close one), proving first that it holds the
//! cluster's secret. Three bootstrap exchanges, each side sending then
//! reading:
//!
//! 1. nonces: the initiator's, and the target's with who it is (name,
//!    instance);
//! 2. proofs: the initiator's request (who it is, its control address,
//!    both NIC indices, which of the rail's queue pairs, what it asks) with its endpoint and a proof over
//!    both nonces, the target's identity and all of that; the target's
//!    proof over both nonces and its identity;
//! 3. the answer: the target's endpoint or its refusal, proven over both
//!    nonces (the initiator sends nothing new).
//!
//! The target creates no queue pair, and acts on nothing, before the
//! initiator's proof verified; the initiator connects nothing before the
//! target's did. Fresh nonces on both sides make a recorded exchange
//! worthless on another connection.

use std::net::SocketAddr;

use gpudirect::bootstrap::{BootstrapError, Handshake, OobChannel};
use gpudirect::decode::Reader;
use gpudirect::Endpoint;

use crate::wire::auth::{random, AuthError, Key, Label, TAG};
use crate::wire::desc::MAX_NAME;
use crate::error::EngineError;

/// The control protocol's version (1 and 2 had no proofs, 3 no queue
/// pair index).
pub(crate) const VERSION: u8 = 4;
/// Longest control address text in a request (`[v6]:port`).
const MAX_ADDR: usize = 64;

/// Who an agent is on the wire: its name and this run's instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) name: String,
    pub(crate) instance: u64,
}

impl Identity {
    fn bytes(&self) -> Vec<u8> {
        let mut v = vec![self.name.len() as u8];
        v.extend_from_slice(self.name.as_bytes());
        v.extend_from_slice(&self.instance.to_be_bytes());
        v
    }

    fn parse(r: &mut Reader<'_>) -> Result<Identity, String> {
        let bad = |t: gpudirect::decode::Truncated| format!("truncated in {}", t.field);
        let n = r.u8("name length").map_err(bad)? as usize;
        let name = std::str::from_utf8(r.take("name", n).map_err(bad)?).map_err(|_| "agent name is not UTF-8".to_string())?;
        if name.is_empty() || name.len() > MAX_NAME {
            return Err("empty agent name".into());
        }
        let instance = r.u64("instance").map_err(bad)?;
        Ok(Identity { name: name.to_owned(), instance })
    }
}

/// What a control request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// A new connection (the initiator's endpoint travels with it).
    Connect,
    /// Close the connection from the initiator's queue pair `from` to the
    /// target's `to`.
    Close { from: u32, to: u32 },
}

/// A control request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) from: Identity,
    /// The initiator's control listener.
    pub(crate) control: SocketAddr,
    /// The initiator's NIC, and the target's.
    pub(crate) theirs: usize,
    pub(crate) ours: usize,
    /// Which of the rail's queue pairs (from 0): a rail may carry several.
    pub(crate) qp: usize,
    pub(crate) ask: Ask,
}

impl Request {
    pub(crate) fn bytes(&self) -> Vec<u8> {
        let addr = self.control.to_string();
        let mut v = vec![VERSION];
        v.extend_from_slice(&self.from.bytes());
        v.push(addr.len() as u8);
        v.extend_from_slice(addr.as_bytes());
        v.extend_from_slice(&[self.theirs as u8, self.ours as u8, self.qp as u8]);
        match self.ask {
            Ask::Close { from, to } => {
                v.push(1);
                v.extend_from_slice(&from.to_be_bytes());
                v.extend_from_slice(&to.to_be_bytes());
            }
            Ask::Connect => v.push(0),
        }
        v
    }

    /// A request from its bytes (untrusted: every field checked).
    pub(crate) fn parse(b: &[u8]) -> Result<Request, String> {
        let mut r = Reader(b);
        let bad = |t: gpudirect::decode::Truncated| format!("request truncated in {}", t.field);
        let v = r.u8("version").map_err(bad)?;
        if v != VERSION {
            return Err(format!("control protocol version {v}, this agent speaks {VERSION}: use the same gpudirect release on every agent"));
        }
        let from = Identity::parse(&mut r).map_err(|e| format!("request: {e}"))?;
        let n = r.u8("address length").map_err(bad)? as usize;
        if n > MAX_ADDR {
            return Err(format!("control address of {n} bytes (at most {MAX_ADDR})"));
        }
        let text = std::str::from_utf8(r.take("control address", n).map_err(bad)?).map_err(|_| "control address is not UTF-8".to_string())?;
        let control: SocketAddr = text.parse().map_err(|_| format!("control address {text:?} is not IP:port"))?;
        let theirs = r.u8("initiator NIC").map_err(bad)? as usize;
        let ours = r.u8("target NIC").map_err(bad)? as usize;
        let qp = r.u8("queue pair index").map_err(bad)? as usize;
        let ask = match r.u8("kind").map_err(bad)? {
            0 => Ask::Connect,
            1 => Ask::Close { from: r.u32("initiator queue pair").map_err(bad)?, to: r.u32("target queue pair").map_err(bad)? },
            k => return Err(format!("request kind {k} (0: connect, 1: close)")),
        };
        if r.rest() != 0 {
            return Err(format!("{} trailing bytes after the request", r.rest()));
        }
        Ok(Request { from, control, theirs, ours, qp, ask })
    }
}

/// The nonces of one control connection and the target's identity as
/// sent: what every proof on it covers.
pub(crate) struct Session {
    initiator: [u8; TAG],
    target: [u8; TAG],
    identity: Vec<u8>,
}

impl Session {
    fn answer_tag(&self, key: &Key, answer: &Handshake) -> Result<[u8; TAG], BootstrapError> {
        Ok(key.tag(Label::Answer, &[&self.initiator, &self.target, &self.identity, &answer.encode()?]))
    }
}

/// What the initiator learns: the target's endpoint, or why it refused.
pub(crate) enum Answer {
    Accepted(Option<Endpoint>),
    Refused(String),
}

/// The initiator's side, on a fresh control connection to `expect`:
/// proves `req` (and `endpoint`, for a connect), checks the target is the
/// agent and instance loaded here, and returns its answer.
///
/// # Errors
/// [`EngineError::Control`] for the connection or a malformed message;
/// [`EngineError::WrongPeer`] when another agent or another run of it
/// answers; [`EngineError::Auth`] when the target's proof or answer does
/// not verify.
pub(crate) fn initiate(oob: &mut OobChannel, key: &Key, expect: &Identity, req: &Request, endpoint: Option<Endpoint>) -> Result<Answer, EngineError> {
    let peer = expect.name.as_str();
    let ctl = |source| EngineError::Control { peer: peer.to_owned(), source };
    let nonce: [u8; TAG] = random();
    let mut hello = vec![VERSION];
    hello.extend_from_slice(&nonce);
    let first = oob.exchange(&Handshake { app: hello, ..Default::default() }).map_err(ctl)?;
    let malformed = |what: &str| EngineError::Refused { peer: peer.to_owned(), reason: format!("its first message is not a control-protocol v{VERSION} hello ({what}): an older gpudirect, or not an engine agent") };
    let (theirs, identity_bytes) = match first.app.split_first() {
        Some((&VERSION, rest)) if rest.len() > TAG => (<[u8; TAG]>::try_from(&rest[..TAG]).expect("TAG bytes"), &rest[TAG..]),
        Some((&v, _)) if v != VERSION => return Err(malformed(&format!("version {v}"))),
        _ => return Err(malformed("too short")),
    };
    let mut r = Reader(identity_bytes);
    let target = Identity::parse(&mut r).map_err(|e| malformed(&e))?;
    if r.rest() != 0 {
        return Err(malformed("trailing bytes"));
    }
    if target.name != expect.name {
        return Err(EngineError::WrongPeer { expected: expect.name.clone(), got: target.name });
    }
    let session = Session { initiator: nonce, target: theirs, identity: identity_bytes.to_vec() };
    let mut mine = Handshake { endpoint, buffers: vec![], app: req.bytes() };
    let tag = key.tag(Label::Initiator, &[&session.initiator, &session.target, &session.identity, &mine.encode().map_err(ctl)?]);
    mine.app.extend_from_slice(&tag);
    let proof = oob.exchange(&mine).map_err(ctl)?;
    if !key.verify(Label::Target, &[&session.initiator, &session.target, &session.identity], &proof.app) {
        return Err(EngineError::Auth { peer: peer.to_owned(), source: AuthError::BadProof { what: format!("the handshake of {peer:?}'s control listener") } });
    }
    // Proven: the name and instance are the target's own.
    if target.instance != expect.instance {
        return Err(EngineError::WrongPeer {
            expected: format!("{} (instance {:016x})", expect.name, expect.instance),
            got: format!("{} (instance {:016x}): it restarted since its metadata was loaded; load its new metadata", target.name, target.instance),
        });
    }
    let mut answer = oob.exchange(&Handshake::default()).map_err(ctl)?;
    if answer.app.len() < 1 + TAG {
        return Err(EngineError::Refused { peer: peer.to_owned(), reason: "an answer too short to carry its proof".into() });
    }
    let tag = answer.app.split_off(answer.app.len() - TAG);
    let encoded = answer.encode().map_err(ctl)?;
    if !key.verify(Label::Answer, &[&session.initiator, &session.target, &session.identity, &encoded], &tag) {
        return Err(EngineError::Auth { peer: peer.to_owned(), source: AuthError::BadProof { what: format!("the answer of {peer:?}") } });
    }
    match answer.app.split_first() {
        Some((0, _)) => Ok(Answer::Accepted(answer.endpoint)),
        Some((_, reason)) => Ok(Answer::Refused(String::from_utf8_lossy(reason).into_owned())),
        None => Err(EngineError::Refused { peer: peer.to_owned(), reason: "an empty answer".into() }),
    }
}

/// A request that proved itself, and what answering it needs.
pub(crate) struct Proven {
    pub(crate) req: Request,
    pub(crate) endpoint: Option<Endpoint>,
    session: Session,
}

/// Why a request was not served: refused with a reason the initiator
/// gets (`answer`), or the connection failed before (no answer).
pub(crate) enum NotProven {
    Refuse { session: Box<Session>, reason: String, auth: Option<AuthError> },
    Failed(BootstrapError),
}

/// The target's side: sends its nonce and identity, takes the request
/// and verifies its proof. Nothing is acted on before this returns `Ok`.
pub(crate) fn receive(oob: &mut OobChannel, key: &Key, me: &Identity) -> Result<Proven, NotProven> {
    let nonce: [u8; TAG] = random();
    let identity = me.bytes();
    let mut hello = vec![VERSION];
    hello.extend_from_slice(&nonce);
    hello.extend_from_slice(&identity);
    let first = oob.exchange(&Handshake { app: hello, ..Default::default() }).map_err(NotProven::Failed)?;
    let initiator = match first.app.split_first() {
        Some((&VERSION, rest)) if rest.len() == TAG => <[u8; TAG]>::try_from(rest).expect("TAG bytes"),
        // No session yet: an older agent, or not an agent at all. Its
        // next message is read and answered with the reason.
        _ => [0; TAG],
    };
    let session = Session { initiator, target: nonce, identity };
    let proof = key.tag(Label::Target, &[&session.initiator, &session.target, &session.identity]);
    let mut got = oob.exchange(&Handshake { app: proof.to_vec(), ..Default::default() }).map_err(NotProven::Failed)?;
    if session.initiator == [0; TAG] {
        return Err(NotProven::Refuse { session: Box::new(session), reason: format!("not a control-protocol v{VERSION} hello: use the same gpudirect release on every agent"), auth: None });
    }
    if got.app.len() < TAG {
        return Err(NotProven::Refuse { session: Box::new(session), reason: "a request too short to carry its proof".into(), auth: None });
    }
    let tag = got.app.split_off(got.app.len() - TAG);
    let verified = got.encode().is_ok_and(|b| key.verify(Label::Initiator, &[&session.initiator, &session.target, &session.identity, &b], &tag));
    if !verified {
        let auth = AuthError::BadProof { what: "the connection request".into() };
        return Err(NotProven::Refuse { session: Box::new(session), reason: auth.to_string(), auth: Some(auth) });
    }
    match Request::parse(&got.app) {
        Ok(req) => Ok(Proven { req, endpoint: got.endpoint, session }),
        Err(reason) => Err(NotProven::Refuse { session: Box::new(session), reason, auth: None }),
    }
}

/// The target's answer: its endpoint (`Ok`), or the reason it refuses.
///
/// # Errors
/// [`BootstrapError`] sending it.
pub(crate) fn answer(oob: &mut OobChannel, key: &Key, session: &Session, result: Result<Option<Endpoint>, &str>) -> Result<(), BootstrapError> {
    let mut a = match result {
        Ok(endpoint) => Handshake { endpoint, app: vec![0], ..Default::default() },
        Err(reason) => {
            let mut app = vec![1];
            // Bounded: the reason is ours, but keep the answer in one message.
            app.extend_from_slice(&reason.as_bytes()[..reason.len().min(4096)]);
            Handshake { app, ..Default::default() }
        }
    };
    let tag = session.answer_tag(key, &a)?;
    a.app.extend_from_slice(&tag);
    oob.exchange(&a).map(drop)
}

impl Proven {
    pub(crate) fn session(&self) -> &Session {
        &self.session
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::auth::ClusterSecret;
    use std::net::TcpListener;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(5);

    fn key(b: u8) -> Key {
        Key::of(Some(ClusterSecret::new(vec![b; 32]).unwrap()))
    }

    fn req(name: &str) -> Request {
        Request { from: Identity { name: name.into(), instance: 7 }, control: "192.0.2.7:4791".parse().unwrap(), theirs: 1, ours: 0, qp: 1, ask: Ask::Connect }
    }

    fn ep() -> Endpoint {
        Endpoint { qp_num: 0x11, psn: 0x22, lid: 0, gid: gpudirect::Gid([0xfe; 16]), mtu: gpudirect::Mtu::Mtu4096 }
    }

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused_with_a_reason() {
        let close = Ask::Close { from: 0x11, to: 0x2_0000 };
        for ask in [Ask::Connect, close.clone()] {
            let mut want = req("prefill-0");
            want.ask = ask;
            assert_eq!(Request::parse(&want.bytes()).unwrap(), want);
            let good = want.bytes();
            for n in 0..good.len() {
                assert!(Request::parse(&good[..n]).is_err(), "{n} bytes");
            }
            let mut v = good.clone();
            v[0] = 2;
            assert!(Request::parse(&v).unwrap_err().contains("version 2"));
            v = good.clone();
            v.push(1);
            assert!(Request::parse(&v).unwrap_err().contains("trailing"));
        }
        let mut v6 = req("p");
        v6.control = "[2001:db8::1]:9".parse().unwrap();
        assert_eq!(Request::parse(&v6.bytes()).unwrap().control, v6.control);
        assert!(Request::parse(&[VERSION, 0, 0, 0]).unwrap_err().contains("empty"));
        let mut v = req("p").bytes();
        *v.last_mut().unwrap() = 7;
        assert!(Request::parse(&v).unwrap_err().contains("kind 7"));
    }

    /// The initiator's control address is untrusted text: a name instead
    /// of IP:port, bytes that are not UTF-8 and a length past MAX_ADDR are
    /// refused with the reason (the length before anything is read). Written
    /// back: these cases were checked before the control protocol moved
    /// out of conn.rs (ce44377) and not since.
    #[test]
    fn a_control_address_must_be_ip_port_of_at_most_64_bytes() {
        let with_address = |text: &[u8]| {
            let mut v = vec![VERSION];
            v.extend_from_slice(&Identity { name: "p".into(), instance: 7 }.bytes());
            v.push(text.len() as u8);
            v.extend_from_slice(text);
            v.extend_from_slice(&[0, 0, 0, 0]);
            Request::parse(&v)
        };
        assert_eq!(with_address(b"192.0.2.7:4791").unwrap().control, "192.0.2.7:4791".parse::<SocketAddr>().unwrap());
        assert!(with_address(b"localhost:4791").unwrap_err().contains("not IP:port"));
        assert!(with_address(b"192.0.2.7").unwrap_err().contains("not IP:port"));
        assert!(with_address(b"\xff\xfe:1").unwrap_err().contains("not UTF-8"));
        assert!(with_address(&[b'1'; MAX_ADDR]).unwrap_err().contains("not IP:port"), "64 bytes are read");
        assert!(with_address(&[b'1'; MAX_ADDR + 1]).unwrap_err().contains("at most 64"));
        // The length is refused before the bytes it names are looked for.
        let mut v = vec![VERSION];
        v.extend_from_slice(&Identity { name: "p".into(), instance: 7 }.bytes());
        v.push(200);
        assert!(Request::parse(&v).unwrap_err().contains("at most 64"));
    }

    /// What the target saw, and what the initiator got.
    type Outcome = (Result<Request, String>, Result<String, String>);

    /// One exchange over loopback TCP: the initiator with `ik` claiming
    /// `name`, the target with `tk`; the target accepts whatever proved.
    fn run(ik: Key, tk: Key, name: &str, expect_instance: u64) -> Outcome {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let target = std::thread::spawn(move || {
            let mut oob = OobChannel::accept(&l, T).unwrap();
            let me = Identity { name: "decode-0".into(), instance: 42 };
            match receive(&mut oob, &tk, &me) {
                Ok(p) => {
                    let _ = answer(&mut oob, &tk, p.session(), Ok(Some(ep())));
                    Ok(p.req)
                }
                Err(NotProven::Refuse { session, reason, .. }) => {
                    let _ = answer(&mut oob, &tk, &session, Err(&reason));
                    Err(reason)
                }
                Err(NotProven::Failed(e)) => Err(format!("failed: {e}")),
            }
        });
        let mut oob = OobChannel::connect(addr, T).unwrap();
        let got = initiate(&mut oob, &ik, &Identity { name: "decode-0".into(), instance: expect_instance }, &req(name), Some(ep()));
        let got = match got {
            Ok(Answer::Accepted(e)) => Ok(format!("accepted {:?}", e.map(|e| e.qp_num))),
            Ok(Answer::Refused(r)) => Err(format!("refused: {r}")),
            Err(e) => Err(e.to_string()),
        };
        drop(oob);
        (target.join().unwrap(), got)
    }

    #[test]
    fn holders_of_the_secret_connect_others_are_refused_before_anything() {
        let (t, i) = run(key(1), key(1), "prefill-0", 42);
        assert_eq!(t.unwrap(), req("prefill-0"));
        assert_eq!(i.unwrap(), "accepted Some(17)");
        // Wrong secret, and none against a secret: the target refuses the
        // request, and the initiator already refused the target's proof.
        for ik in [key(2), Key::of(None)] {
            let (t, i) = run(ik, key(1), "prefill-0", 42);
            assert!(t.unwrap_err().contains("did not verify"));
            let i = i.unwrap_err();
            assert!(i.contains("did not verify") && i.contains("GPUDIRECT_SECRET_FILE"), "{i}");
        }
        // Both without a secret: the public key, as on loopback.
        assert!(run(Key::of(None), Key::of(None), "p", 42).1.is_ok());
        // A restarted target (another instance) is not the one loaded.
        let i = run(key(1), key(1), "p", 41).1.unwrap_err();
        assert!(i.contains("restarted"), "{i}");
    }

    /// A recorded request replayed on a new connection: the target's new
    /// nonce makes its proof fail.
    #[test]
    fn a_replayed_handshake_is_refused() {
        let k = key(3);
        let me = Identity { name: "decode-0".into(), instance: 42 };
        // Record the initiator's messages through a target that answers.
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let tk = k.clone();
        let me2 = me.clone();
        let target = std::thread::spawn(move || {
            let mut oob = OobChannel::accept(&l, T).unwrap();
            let p = receive(&mut oob, &tk, &me2).ok().unwrap();
            answer(&mut oob, &tk, p.session(), Ok(None)).unwrap();
            (p.req, p.endpoint)
        });
        let mut oob = OobChannel::connect(addr, T).unwrap();
        assert!(matches!(initiate(&mut oob, &k, &me, &req("prefill-0"), Some(ep())), Ok(Answer::Accepted(None))));
        assert_eq!(target.join().unwrap().0, req("prefill-0"));
        // What a recording of that connection would hold: its two
        // messages, rebuilt here with the old nonces (the target's first
        // nonce is gone with it). Replayed against a new target.
        let old = Session { initiator: [9; TAG], target: [8; TAG], identity: me.bytes() };
        let mut recorded = Handshake { endpoint: Some(ep()), buffers: vec![], app: req("prefill-0").bytes() };
        let tag = k.tag(Label::Initiator, &[&old.initiator, &old.target, &old.identity, &recorded.encode().unwrap()]);
        recorded.app.extend_from_slice(&tag);
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let tk = k.clone();
        let target = std::thread::spawn(move || {
            let mut oob = OobChannel::accept(&l, T).unwrap();
            match receive(&mut oob, &tk, &me) {
                Ok(_) => "accepted".to_string(),
                Err(NotProven::Refuse { reason, .. }) => reason,
                Err(NotProven::Failed(e)) => e.to_string(),
            }
        });
        let mut oob = OobChannel::connect(addr, T).unwrap();
        let mut hello = vec![VERSION];
        hello.extend_from_slice(&old.initiator);
        oob.exchange(&Handshake { app: hello, ..Default::default() }).unwrap();
        let _ = oob.exchange(&recorded);
        let why = target.join().unwrap();
        assert!(why.contains("did not verify"), "{why}");
    }

    #[test]
    fn an_older_or_foreign_client_gets_a_reason() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let target = std::thread::spawn(move || {
            let mut oob = OobChannel::accept(&l, T).unwrap();
            match receive(&mut oob, &key(1), &Identity { name: "d".into(), instance: 1 }) {
                Err(NotProven::Refuse { reason, session, .. }) => {
                    let _ = answer(&mut oob, &key(1), &session, Err(&reason));
                    reason
                }
                _ => "served".into(),
            }
        });
        let mut oob = OobChannel::connect(addr, T).unwrap();
        // A version-2 request, as the engine sent before proofs.
        oob.exchange(&Handshake { endpoint: Some(ep()), buffers: vec![], app: vec![2, 1, b'p'] }).unwrap();
        oob.exchange(&Handshake::default()).unwrap();
        let a = oob.exchange(&Handshake::default()).unwrap();
        assert_eq!(a.app[0], 1, "a refusal");
        assert!(target.join().unwrap().contains("not a control-protocol v4 hello"));
    }
}
