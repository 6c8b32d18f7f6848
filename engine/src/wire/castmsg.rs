//! A broadcast's messages between agents, plain data and codec. They
//! travel as sends into the target NIC's shared receive queue, like
//! notifications, told apart by their magic (`"GB"`, notifications are
//! `"GN"`), and are never handed to the application:
//!
//! - `Start`: the source opens broadcast `id` at a receiver with its
//!   plan: the source, the length, the chunk size, every receiver's
//!   (agent, memory, offset), and the notification each receiver gets
//!   once its copy is whole. Only the source sends it, first, and sends
//!   nothing else of `id` until every receiver answered: so every
//!   receiver holds the plan, from the source itself, before any chunk of
//!   it can arrive, and a chunk message need not (and cannot) carry one.
//! - `Ready` / `Refuse`: a receiver's answer to `Start` (to the source):
//!   it took the plan, or why not (its memory is not published, it has
//!   not loaded another receiver's metadata, it has too many broadcasts
//!   in progress).
//! - `Chunk`: chunk `index` of broadcast `id` is in place in the
//!   receiver's range (it follows the chunk's write on one queue pair);
//!   `forward` (the source's only) asks the receiver to write it on to
//!   every other receiver but those in the `skip` mask (receivers that
//!   refused or were dead at the start).
//! - `Ack`: a receiver's copy of `id` is whole (to the source).
//! - `Miss`: a receiver could not forward chunk `index` to receiver
//!   `target` (to the source, which writes it there itself).
//! - `Probe`: the source asks nothing; its completion says the receiver's
//!   queue pair still answers.
//!
//! Bytes from peers are untrusted: every count and index is bounded here.

use gpudirect::decode::Reader;

use crate::wire::desc::MAX_NAME;

const MAGIC: [u8; 2] = *b"GB";
const VERSION: u8 = 2;
/// Most receivers of one broadcast.
pub const MAX_BROADCAST_TARGETS: usize = 64;
/// Most chunks of one broadcast: bounds what a receiver keeps of one.
pub(crate) const MAX_CHUNKS: u64 = 1 << 20;

/// One receiver: its agent, the memory registered under `memory` there,
/// and where in it the copy goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) agent: String,
    pub(crate) memory: String,
    pub(crate) offset: u64,
}

/// What every receiver of one broadcast needs to know.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) source: String,
    pub(crate) len: u64,
    pub(crate) chunk: u64,
    pub(crate) targets: Vec<Target>,
    /// The notification each receiver gets when its copy is whole.
    pub(crate) msg: Vec<u8>,
}

impl Plan {
    pub(crate) fn chunks(&self) -> u64 {
        self.len.div_ceil(self.chunk)
    }

    /// The bytes of chunk `index`: (offset, length).
    pub(crate) fn span(&self, index: u64) -> (u64, u64) {
        let at = index * self.chunk;
        (at, self.chunk.min(self.len - at))
    }

    /// The receiver that forwards chunk `index` to the others.
    pub(crate) fn owner(&self, index: u64) -> usize {
        (index % self.targets.len() as u64) as usize
    }

    fn encode(&self, out: &mut Vec<u8>) {
        put_str(out, &self.source);
        out.extend_from_slice(&self.len.to_be_bytes());
        out.extend_from_slice(&self.chunk.to_be_bytes());
        out.push(self.targets.len() as u8);
        for t in &self.targets {
            put_str(out, &t.agent);
            put_str(out, &t.memory);
            out.extend_from_slice(&t.offset.to_be_bytes());
        }
        out.extend_from_slice(&(self.msg.len() as u16).to_be_bytes());
        out.extend_from_slice(&self.msg);
    }

    fn parse(r: &mut Reader<'_>) -> Result<Plan, String> {
        let source = get_str(r, "source")?;
        let len = r.u64("length").map_err(bad)?;
        let chunk = r.u64("chunk size").map_err(bad)?;
        if len == 0 || chunk == 0 || len.div_ceil(chunk) > MAX_CHUNKS {
            return Err(format!("{len} bytes in chunks of {chunk}: at most {MAX_CHUNKS} chunks, none empty"));
        }
        let n = r.u8("receiver count").map_err(bad)? as usize;
        if n == 0 || n > MAX_BROADCAST_TARGETS {
            return Err(format!("{n} receivers (1 to {MAX_BROADCAST_TARGETS})"));
        }
        let mut targets = Vec::with_capacity(n);
        for _ in 0..n {
            let agent = get_str(r, "receiver")?;
            let memory = get_str(r, "memory")?;
            let offset = r.u64("offset").map_err(bad)?;
            targets.push(Target { agent, memory, offset });
        }
        let m = r.u16("notification length").map_err(bad)? as usize;
        let msg = r.take("notification", m).map_err(bad)?.to_vec();
        Ok(Plan { source, len, chunk, targets, msg })
    }
}

/// A broadcast message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Msg {
    Start { id: u64, me: u8, plan: Plan },
    Ready { id: u64 },
    Refuse { id: u64, why: String },
    Chunk { id: u64, index: u32, forward: bool, skip: u64 },
    Ack { id: u64 },
    Miss { id: u64, index: u32, target: u8 },
    Probe { id: u64 },
}

fn bad(t: gpudirect::decode::Truncated) -> String {
    format!("truncated in {}", t.field)
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

fn get_str(r: &mut Reader<'_>, field: &'static str) -> Result<String, String> {
    let n = r.u8(field).map_err(bad)? as usize;
    let b = r.take(field, n).map_err(bad)?;
    match std::str::from_utf8(b) {
        Ok(s) if !s.is_empty() && s.len() <= MAX_NAME => Ok(s.to_owned()),
        _ => Err(format!("{field} is empty or not UTF-8")),
    }
}

/// Whether `bytes` are a broadcast message (by their magic).
pub(crate) fn is_broadcast(bytes: &[u8]) -> bool {
    bytes.starts_with(&MAGIC)
}

impl Msg {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.push(VERSION);
        match self {
            Msg::Chunk { id, index, forward, skip } => {
                out.push(1);
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
                out.push(u8::from(*forward));
                out.extend_from_slice(&skip.to_be_bytes());
            }
            Msg::Ack { id } => {
                out.push(2);
                out.extend_from_slice(&id.to_be_bytes());
            }
            Msg::Miss { id, index, target } => {
                out.push(3);
                out.extend_from_slice(&id.to_be_bytes());
                out.extend_from_slice(&index.to_be_bytes());
                out.push(*target);
            }
            Msg::Probe { id } => {
                out.push(4);
                out.extend_from_slice(&id.to_be_bytes());
            }
            Msg::Start { id, me, plan } => {
                out.push(5);
                out.extend_from_slice(&id.to_be_bytes());
                out.push(*me);
                plan.encode(&mut out);
            }
            Msg::Ready { id } => {
                out.push(6);
                out.extend_from_slice(&id.to_be_bytes());
            }
            Msg::Refuse { id, why } => {
                out.push(7);
                out.extend_from_slice(&id.to_be_bytes());
                // Cut on a character boundary to what its length byte holds.
                let mut end = why.len().min(u8::MAX as usize);
                while !why.is_char_boundary(end) {
                    end -= 1;
                }
                out.push(end as u8);
                out.extend_from_slice(&why.as_bytes()[..end]);
            }
        }
        out
    }

    /// A message from its bytes, or why they are not one.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Msg, String> {
        let mut r = Reader(bytes);
        let head: [u8; 4] = r.array("header").map_err(bad)?;
        if head[..2] != MAGIC || head[2] != VERSION {
            return Err(format!("header {:02x?} is not a version-{VERSION} broadcast message", &head[..3]));
        }
        let id = r.u64("id").map_err(bad)?;
        let msg = match head[3] {
            1 => {
                let index = r.u32("chunk").map_err(bad)?;
                let forward = r.u8("forward").map_err(bad)? != 0;
                let skip = r.u64("skip").map_err(bad)?;
                Msg::Chunk { id, index, forward, skip }
            }
            2 => Msg::Ack { id },
            3 => Msg::Miss { id, index: r.u32("chunk").map_err(bad)?, target: r.u8("receiver").map_err(bad)? },
            4 => Msg::Probe { id },
            5 => {
                let me = r.u8("receiver index").map_err(bad)?;
                let plan = Plan::parse(&mut r)?;
                if me as usize >= plan.targets.len() {
                    return Err(format!("receiver {me} of {}", plan.targets.len()));
                }
                Msg::Start { id, me, plan }
            }
            6 => Msg::Ready { id },
            7 => {
                let n = r.u8("reason length").map_err(bad)? as usize;
                let why = String::from_utf8_lossy(r.take("reason", n).map_err(bad)?).into_owned();
                Msg::Refuse { id, why }
            }
            k => return Err(format!("broadcast message kind {k}")),
        };
        if r.rest() != 0 {
            return Err(format!("{} trailing bytes", r.rest()));
        }
        Ok(msg)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Plan {
        let t = |i: u64| Target { agent: format!("infer-{i}"), memory: "weights".into(), offset: i * 4096 };
        Plan { source: "trainer".into(), len: 10 << 20, chunk: 1 << 20, targets: (0..8).map(t).collect(), msg: b"step 7".to_vec() }
    }

    #[test]
    fn messages_round_trip_and_bad_ones_are_refused() {
        let msgs = [
            Msg::Start { id: 9, me: 7, plan: plan() },
            Msg::Ready { id: 9 },
            Msg::Refuse { id: 9, why: "memory \"w\" is not published here".into() },
            Msg::Chunk { id: 9, index: 9, forward: true, skip: 1 << 63 },
            Msg::Ack { id: u64::MAX },
            Msg::Miss { id: 1, index: 3, target: 2 },
            Msg::Probe { id: 5 },
        ];
        for m in &msgs {
            let b = m.encode();
            assert!(is_broadcast(&b));
            assert_eq!(&Msg::decode(&b).unwrap(), m);
            for n in 0..b.len() {
                assert!(Msg::decode(&b[..n]).is_err(), "{m:?} cut at {n}");
            }
            let mut long = b.clone();
            long.push(0);
            assert!(Msg::decode(&long).unwrap_err().contains("trailing"));
        }
        // 8 receivers with their names and a notification fit one slot.
        assert!(msgs[0].encode().len() < 1024);
        assert!(Msg::decode(&Msg::Start { id: 1, me: 8, plan: plan() }.encode()).unwrap_err().contains("receiver 8 of 8"));
        let mut p = plan();
        p.chunk = 1;
        p.len = MAX_CHUNKS + 1;
        assert!(Msg::decode(&Msg::Start { id: 1, me: 0, plan: p }.encode()).unwrap_err().contains("at most"));
        // A reason too long for its length byte is cut on a character
        // boundary, and still decodes.
        let long = Msg::Refuse { id: 1, why: "é".repeat(200) }.encode();
        match Msg::decode(&long).unwrap() {
            Msg::Refuse { why, .. } => assert_eq!(why, "é".repeat(127)),
            m => panic!("{m:?}"),
        }
        assert!(Msg::decode(b"GN\x01\x00").is_err());
    }

    #[test]
    fn chunks_cover_the_length_and_owners_take_turns() {
        let p = plan();
        assert_eq!(p.chunks(), 10);
        assert_eq!(p.span(9), (9 << 20, 1 << 20));
        let mut odd = p.clone();
        odd.len = (9 << 20) + 5;
        assert_eq!((odd.chunks(), odd.span(9)), (10, (9 << 20, 5)));
        assert_eq!((0..10).map(|i| p.owner(i)).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5, 6, 7, 0, 1]);
    }
}
