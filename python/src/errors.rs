//! The engine's errors as Python exceptions: `EngineError` and one
//! subclass per kind of the Rust `EngineError`, each with the Rust
//! message, so `except gpudirect.PeerLostError` catches what
//! `EngineError::PeerLost` is in Rust.

use pyo3::create_exception;
use pyo3::prelude::*;

use gpudirect_engine::EngineError as Rust;

use crate::GpudirectError;

create_exception!(gpudirect._native, EngineError, GpudirectError, "A transfer-engine error; each kind has its subclass. The message is the Rust EngineError's, in Python's spellings.");

/// Declares each kind's exception and what `add` puts in the module.
macro_rules! kinds {
    ($($name:ident: $doc:literal),* $(,)?) => {
        $(create_exception!(gpudirect._native, $name, EngineError, $doc);)*

        /// Adds `EngineError` and every kind's exception to the module.
        pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
            m.add("EngineError", m.py().get_type::<EngineError>())?;
            $(m.add(stringify!($name), m.py().get_type::<$name>())?;)*
            Ok(())
        }
    };
}

kinds! {
    VerbsError: "A verbs call failed (registration, queue pair, posting, polling).",
    GpuMemoryError: "Device memory a NIC cannot be given (a VMM mapping without the GPUDirect RDMA flag, a stream-ordered pool, a range across unmapped or shared pages, another GPU's); the message names the fix.",
    CudaError: "CUDA cannot be used: no driver, no such GPU, or a driver call failed.",
    ControlError: "The control connection to a peer failed (connect, handshake).",
    MetadataError: "Metadata from a peer, or handed over, is not a valid agent description.",
    GpuPlacementError: "No NIC of this agent may carry the GPU's memory zero-copy; the message names each NIC and the fix.",
    UnknownPeerError: "No agent of that name was loaded here: load its metadata first.",
    UnknownMemoryError: "The agent has no memory registered under that name.",
    DuplicateNameError: "Memory is already registered under that name.",
    PeerLostError: "A transfer to the peer failed (it died, its memory went away, the link did); post again to reconnect.",
    AbortedError: "The transfer was aborted (Request.abort()): its connection was flushed and retired; post again to reconnect.",
    PartlyPostedError: "Posting stopped part way; the transfer failed and may be posted again.",
    AuthError: "A peer, its request or its metadata was not believed (the cluster's secret, or not what was loaded).",
    RefusedError: "The peer's agent refused the connection.",
    WrongPeerError: "The control address answered as another agent: its metadata is stale.",
    LengthMismatchError: "A local and a remote range of one entry differ in length.",
    MixedPeersError: "A request names the memory of several agents; a request targets one.",
    EmptyRequestError: "A transfer request needs at least one entry.",
    InFlightError: "The request is still in flight: wait for it before posting it again.",
    EngineTimeoutError: "Waiting for a transfer or a notification took longer than allowed.",
    NotificationTooLongError: "A notification longer than the engine carries.",
    TooManyConnectionsError: "The agent has its maximum of connections.",
    NoRailError: "No pair of NICs reaches all of the request's memory.",
    RendezvousError: "A rendezvous store could not be reached, or refused a request.",
    NotPublishedError: "Nothing was published under the name within the wait.",
    BroadcastIncompleteError: "A broadcast ended with receivers that did not get the data (named in the message); every other receiver has its copy.",
    ConfigError: "The configuration cannot work; the message says what to change.",
    UnsupportedError: "Something the engine does not do yet; the message says what instead.",
}

/// Rust spellings the library's messages use, as a Python user writes
/// them; the longest first where one begins another.
const SPELLINGS: &[(&str, &str)] = &[
    ("AgentConfig::secret", "Agent(secret_file=...)"),
    ("AgentConfig::qps_per_rail", "Agent(qps_per_rail=...)"),
    ("AgentConfig::listen", "Agent(listen=...)"),
    ("AgentConfig::devices", "Agent(devices=...)"),
    ("AgentConfig::timeout", "Agent(timeout=...)"),
    ("AgentConfig::max_connections", "Agent(max_connections=...)"),
    ("AgentConfig::metrics", "Agent(metrics=...)"),
    // Settings Python does not take yet: the Rust field, as an attribute.
    ("AgentConfig::", "AgentConfig."),
    ("RendezvousConfig::", "RendezvousConfig."),
    ("RendezvousConfig::secret", "RendezvousServer(secret_file=...)"),
    ("TcpRendezvous::with_secret", "Rendezvous(secret_file=...)"),
    ("TransferRequest::post", "Request.post()"),
    ("TransferRequest::wait", "Request.wait()"),
    ("Agent::load_remote", "Agent.load_remote()"),
    ("Agent::register_gpu", "Agent.register_gpu()"),
    ("Agent::register", "Agent.register()"),
    ("Agent::publish", "Agent.publish()"),
    ("Agent::lookup", "Agent.lookup()"),
    ("Agent::prepare", "Agent.prepare()"),
    ("Agent::broadcast", "Agent.broadcast()"),
    ("Agent::", "Agent."),
    ("TransferRequest::", "Request."),
    ("Broadcast::", "Broadcast."),
];

/// `msg` with the library's Rust spellings in Python's.
pub fn spelled(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut rest = msg;
    'scan: while let Some(at) = rest.find("::") {
        // The type name before the `::`.
        let start = rest[..at].rfind(|c: char| !c.is_ascii_alphanumeric()).map_or(0, |i| i + 1);
        for (rust, python) in SPELLINGS {
            let tail = &rest[start..];
            // A whole name: `Agent::register` must not take `Agent::register_gpu`.
            let whole = tail.starts_with(rust) && (rust.ends_with("::") || !tail[rust.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_'));
            if whole {
                out.push_str(&rest[..start]);
                out.push_str(python);
                rest = &tail[rust.len()..];
                continue 'scan;
            }
        }
        out.push_str(&rest[..at + 2]);
        rest = &rest[at + 2..];
    }
    out.push_str(rest);
    out
}

/// The Python exception for a Rust engine error, with its message in
/// Python's spellings.
pub fn to_py(e: Rust) -> PyErr {
    let msg = spelled(&e.to_string());
    match e {
        Rust::Verbs(gpudirect::Error::GpuMemory(_)) => GpuMemoryError::new_err(msg),
        Rust::Verbs(gpudirect::Error::Cuda { .. } | gpudirect::Error::CudaUnavailable(_) | gpudirect::Error::GpuNotFound { .. }) => CudaError::new_err(msg),
        Rust::Verbs(_) => VerbsError::new_err(msg),
        Rust::Control { .. } => ControlError::new_err(msg),
        Rust::Metadata(_) => MetadataError::new_err(msg),
        Rust::GpuPlacement { .. } => GpuPlacementError::new_err(msg),
        Rust::UnknownPeer(_) => UnknownPeerError::new_err(msg),
        Rust::UnknownMemory { .. } => UnknownMemoryError::new_err(msg),
        Rust::DuplicateName(_) => DuplicateNameError::new_err(msg),
        Rust::PeerLost { .. } => PeerLostError::new_err(msg),
        Rust::Aborted { .. } => AbortedError::new_err(msg),
        Rust::PartlyPosted { .. } => PartlyPostedError::new_err(msg),
        Rust::Auth { .. } => AuthError::new_err(msg),
        Rust::Refused { .. } => RefusedError::new_err(msg),
        Rust::WrongPeer { .. } => WrongPeerError::new_err(msg),
        Rust::LengthMismatch { .. } => LengthMismatchError::new_err(msg),
        Rust::MixedPeers { .. } => MixedPeersError::new_err(msg),
        Rust::EmptyRequest => EmptyRequestError::new_err(msg),
        Rust::InFlight => InFlightError::new_err(msg),
        Rust::Timeout(_) => EngineTimeoutError::new_err(msg),
        Rust::NotificationTooLong { .. } => NotificationTooLongError::new_err(msg),
        Rust::TooManyConnections { .. } => TooManyConnectionsError::new_err(msg),
        Rust::NoRail { .. } => NoRailError::new_err(msg),
        Rust::Rendezvous { .. } => RendezvousError::new_err(msg),
        Rust::NotPublished { .. } => NotPublishedError::new_err(msg),
        Rust::BroadcastIncomplete { .. } => BroadcastIncompleteError::new_err(msg),
        Rust::Config(_) => ConfigError::new_err(msg),
        Rust::Unsupported(_) => UnsupportedError::new_err(msg),
        // A kind added to the Rust enum later: the base class, same message.
        _ => EngineError::new_err(msg),
    }
}

/// Every kind the map above covers, each with an error of it, so a test
/// can check each maps to its class with the Rust message
/// (`gpudirect._native._error_kinds()`).
#[pyfunction]
pub fn _error_kinds() -> Vec<(String, PyErr)> {
    use std::time::Duration;
    let all = vec![
        Rust::Verbs(gpudirect::Error::InvalidArgument("x".into())),
        Rust::Verbs(gpudirect::GpuMemoryError::StreamOrderedPool { at: 0x1000 }.into()),
        Rust::Verbs(gpudirect::Error::CudaUnavailable("no driver".into())),
        Rust::Control { peer: "p".into(), source: gpudirect::bootstrap::BootstrapError::Timeout(Duration::from_secs(1)) },
        gpudirect_engine::AgentMetadata::decode(b"junk").expect_err("junk is no metadata").into(),
        Rust::GpuPlacement { gpu: "GPU0".into(), why: "w".into() },
        Rust::UnknownPeer("p".into()),
        Rust::UnknownMemory { peer: "p".into(), name: "m".into() },
        Rust::DuplicateName("m".into()),
        Rust::PeerLost {
            peer: "p".into(),
            completion: gpudirect::WcError {
                status: gpudirect::WcStatus::RetryExceeded,
                opcode: gpudirect::WcOpcode::RdmaWrite,
                wr_id: 1,
                qp_num: 0x11,
                vendor_err: 0,
            },
        },
        Rust::Aborted { peer: "p".into() },
        Rust::PartlyPosted { peer: "p".into(), posted: 1, total: 2, reason: "r".into() },
        Rust::Auth { peer: "p".into(), source: gpudirect_engine::AuthError::Secret("s".into()) },
        Rust::Refused { peer: "p".into(), reason: "r".into() },
        Rust::WrongPeer { expected: "a".into(), got: "b".into() },
        Rust::LengthMismatch { index: 0, local: 1, remote: 2 },
        Rust::MixedPeers { index: 1, first: "a".into(), got: "b".into() },
        Rust::EmptyRequest,
        Rust::InFlight,
        Rust::Timeout(Duration::from_secs(1)),
        Rust::NotificationTooLong { len: 2000, max: 1000 },
        Rust::TooManyConnections { max: 4 },
        Rust::NoRail { peer: "p".into(), why: "w".into() },
        Rust::Rendezvous { server: "s".into(), reason: "r".into() },
        Rust::NotPublished { name: "n".into(), waited: Duration::from_secs(1) },
        Rust::BroadcastIncomplete { delivered: 7, total: 8, failed: vec![("infer-3".into(), "its queue pair failed".into())] },
        Rust::Config("c".into()),
        Rust::Unsupported("u"),
    ];
    all.into_iter().map(|e| (spelled(&e.to_string()), to_py(e))).collect()
}
