//! The transfer engine's errors: a leaf, wrapping the verbs, bootstrap and
//! metadata errors it meets and naming the peer, memory or request each
//! failure is about.

use std::time::Duration;

use gpudirect::bootstrap::BootstrapError;
use gpudirect::Error;
use gpudirect::WcError;

use crate::wire::auth::AuthError;
use crate::wire::desc::MetadataError;

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// A verbs call failed (registration, queue pair, posting).
    #[error(transparent)]
    Verbs(#[from] Error),
    /// The control connection to a peer failed (connect, handshake).
    #[error("control connection to agent {peer:?}: {source}")]
    Control {
        /// The peer agent.
        peer: String,
        /// What the bootstrap layer reported.
        #[source]
        source: BootstrapError,
    },
    /// Metadata from a peer (or handed over by the application) is not a
    /// valid agent description.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// No NIC of this agent may carry a GPU's memory under
    /// [`GpuPolicy::Require`](gpudirect::GpuPolicy::Require): every one is
    /// farther from the GPU than
    /// [`AgentConfig::gpu_path_limit`](super::AgentConfig::gpu_path_limit),
    /// or cannot reach GPU memory at all. `why` names each NIC, its
    /// distance and the fix.
    #[error("no NIC of this agent may carry {gpu}'s memory zero-copy: {why}")]
    GpuPlacement {
        /// The GPU (`GPU0 (0000:18:00.0)`).
        gpu: String,
        /// Each NIC and why not.
        why: String,
    },
    /// No agent of that name has been loaded ([`Agent::load_remote`](super::Agent::load_remote)).
    #[error("no agent named {0:?} is known here: load its metadata first (Agent::load_remote)")]
    UnknownPeer(String),
    /// The agent (a peer, as its metadata loaded here says, or this one) has no memory of that name.
    #[error("agent {peer:?} has no memory registered as {name:?} (for a peer: as of the metadata loaded here; reload it after the peer registers more)")]
    UnknownMemory {
        /// The peer agent.
        peer: String,
        /// The memory name asked for.
        name: String,
    },
    /// A name is taken: this agent already has memory registered under it.
    #[error("memory named {0:?} is already registered with this agent")]
    DuplicateName(String),
    /// A work request of a transfer to `peer` failed: the peer died, its
    /// memory went away, or the link did. Only transfers to that peer
    /// fail; its connections are dropped and the next transfer reconnects.
    #[error("transfer to agent {peer:?} failed: {completion}; the connection was retired: post again to reconnect (after the peer restarted, load its new metadata first)")]
    PeerLost {
        /// The peer agent.
        peer: String,
        /// The failed completion: status, opcode, queue pair.
        completion: WcError,
    },
    /// The caller gave up on the post with
    /// [`TransferRequest::abort`](crate::TransferRequest::abort):
    /// the queue pairs it used were moved to the error state and their
    /// connections retired. Bytes it moved before may or may not have
    /// landed; the next post reconnects.
    #[error("transfer to agent {peer:?} was aborted: its queue pairs were flushed and their connections retired (posts outstanding on them failed too); post again to reconnect")]
    Aborted {
        /// The peer agent.
        peer: String,
    },
    /// Posting stopped part way (the queue pair failed under it): the
    /// requests posted complete or fail on their own; the transfer is
    /// failed and may be posted again.
    #[error("transfer to agent {peer:?}: {posted} of {total} work requests posted, then: {reason}")]
    PartlyPosted {
        /// The peer agent.
        peer: String,
        /// Work requests posted.
        posted: usize,
        /// Work requests in the post.
        total: usize,
        /// Why posting stopped.
        reason: String,
    },
    /// A peer, its request or its metadata was not believed: it does not
    /// prove the cluster's secret, or does not match what was loaded for
    /// it. Nothing was acted on.
    #[error("agent {peer:?}: {source}")]
    Auth {
        /// The peer agent (or the address it came from).
        peer: String,
        /// Why it was not believed.
        #[source]
        source: AuthError,
    },
    /// The peer's agent refused the connection request.
    #[error("agent {peer:?} refused the connection: {reason}")]
    Refused {
        /// The peer agent.
        peer: String,
        /// Its reason.
        reason: String,
    },
    /// The control address answered as another agent (a restarted process
    /// reusing the port, or stale metadata).
    #[error("the control address of agent {expected:?} answered as agent {got:?}: its metadata is stale; reload it")]
    WrongPeer {
        /// The agent the metadata named.
        expected: String,
        /// The agent that answered.
        got: String,
    },
    /// A local and a remote range of one transfer entry differ in length.
    #[error("transfer entry {index}: local range of {local} bytes, remote range of {remote} bytes; they must match")]
    LengthMismatch {
        /// Entry index in the request.
        index: usize,
        /// Local length.
        local: u64,
        /// Remote length.
        remote: u64,
    },
    /// A request mixes remote memory of several agents; a request targets one.
    #[error("transfer entry {index} targets agent {got:?}, entry 0 agent {first:?}: a request targets one agent")]
    MixedPeers {
        /// Entry index in the request.
        index: usize,
        /// The first entry's agent.
        first: String,
        /// This entry's.
        got: String,
    },
    /// The request has no entries.
    #[error("a transfer request needs at least one entry")]
    EmptyRequest,
    /// The request is already posted and has not finished.
    #[error("transfer request is still in flight: wait for it before posting it again")]
    InFlight,
    /// Waiting for a transfer or a notification took longer than allowed.
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    /// A notification longer than the engine carries.
    #[error("notification of {len} bytes exceeds the {max}-byte limit")]
    NotificationTooLong {
        /// Its length.
        len: usize,
        /// [`MAX_NOTIFICATION`](super::MAX_NOTIFICATION).
        max: usize,
    },
    /// The agent cannot connect more peers: its completion queues are
    /// sized for [`AgentConfig::max_connections`](super::AgentConfig::max_connections).
    #[error("this agent already has its maximum of {max} connections (AgentConfig::max_connections)")]
    TooManyConnections {
        /// The limit.
        max: usize,
    },
    /// No pair of NICs (this agent's NIC `i` and the peer's NIC `i`, a
    /// rail) has every entry's memory registered on both ends.
    #[error("no NIC of this agent and its peer {peer:?} reaches all of the request's memory: {why}")]
    NoRail {
        /// The peer.
        peer: String,
        /// Which entry's memory is missing where.
        why: String,
    },
    /// A rendezvous store could not be reached, or refused a request.
    #[error("rendezvous at {server}: {reason}")]
    Rendezvous {
        /// The store's address.
        server: String,
        /// What went wrong.
        reason: String,
    },
    /// Nothing was published under the name within the wait.
    #[error("no agent {name:?} published in the rendezvous within {waited:?}")]
    NotPublished {
        /// The name looked up.
        name: String,
        /// How long the lookup waited.
        waited: Duration,
    },
    /// A posting more than one poster claims (the rendezvous server saw
    /// its name posted from two addresses; etcd or a folder, from two
    /// hosts): neither is believed as the name's, and both are named.
    #[error("the posting {posting} is claimed by more than one poster: {}; neither is believed (remove it where it was first posted, or let it expire, then post it again from its own node)", posters.join(" and "))]
    PostingConflict {
        /// The posting (`topic/name`).
        posting: String,
        /// Who posted it, as the store tells them apart.
        posters: Vec<String>,
    },
    /// A posting whose seal verifies but which cannot stand: an older one
    /// put back (after a remove, after its lease expired, or over a newer
    /// one), one posted before the job started, or one whose post never
    /// completed.
    #[error("the posting {posting} is refused: {reason}")]
    StalePosting {
        /// The posting (`topic/name`).
        posting: String,
        /// Why, with the facts compared.
        reason: String,
    },
    /// A broadcast ended without every receiver's copy whole: the
    /// receivers named died (their queue pair failed or stopped
    /// answering), or could not be written; every other receiver has its
    /// copy and its notification.
    #[error("broadcast reached {delivered} of {total} receivers; not: {}", failed.iter().map(|(n, why)| format!("{n:?} ({why})")).collect::<Vec<_>>().join(", "))]
    BroadcastIncomplete {
        /// Receivers whose copy is whole.
        delivered: usize,
        /// Receivers in all.
        total: usize,
        /// Each receiver that did not get the data, and why.
        failed: Vec<(String, String)>,
    },
    /// The configuration cannot work; the text says what to change.
    #[error("agent configuration: {0}")]
    Config(String),
    /// Something this engine does not do yet; the text says what instead.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
}
