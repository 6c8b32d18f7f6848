//! Peer agents as this agent knows them, from their metadata: a [`Peer`],
//! its registered memory ([`RemoteMemory`]) and the ranges of it a
//! transfer targets ([`RemoteRange`]).

use std::ops::RangeBounds;
use std::sync::Arc;

use gpudirect::Result;

use crate::wire::desc::{cut, AgentMetadata, MemoryDesc};
use crate::error::EngineError;

/// A peer agent, as of the metadata loaded for it. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Peer {
    pub(crate) md: Arc<AgentMetadata>,
}

impl Peer {
    /// The peer agent's name.
    pub fn name(&self) -> &str {
        &self.md.name
    }

    /// The metadata this handle was made from.
    pub fn metadata(&self) -> &AgentMetadata {
        &self.md
    }

    /// The peer's memory registered under `name`.
    ///
    /// # Errors
    /// [`EngineError::UnknownMemory`] when its metadata lists none.
    pub fn memory(&self, name: &str) -> Result<RemoteMemory, EngineError> {
        let index = self.md.memories.iter().position(|m| m.name == name).ok_or_else(|| EngineError::UnknownMemory {
            peer: self.md.name.clone(),
            name: name.to_owned(),
        })?;
        Ok(RemoteMemory { md: self.md.clone(), index })
    }
}

/// Memory a peer agent registered: the remote side of transfers.
#[derive(Clone, Debug)]
pub struct RemoteMemory {
    pub(crate) md: Arc<AgentMetadata>,
    index: usize,
}

impl RemoteMemory {
    pub(crate) fn desc(&self) -> &MemoryDesc {
        &self.md.memories[self.index]
    }

    /// The name the peer registered it under.
    pub fn name(&self) -> &str {
        &self.desc().name
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.desc().len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The peer agent's name.
    pub fn peer(&self) -> &str {
        &self.md.name
    }

    /// The range `range` of it, for a transfer entry.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](gpudirect::Error::OutOfBounds) for a range past its end.
    pub fn range(&self, range: impl RangeBounds<u64>) -> Result<RemoteRange> {
        let len = self.len();
        let (start, end) = (range.start_bound().cloned(), range.end_bound().cloned());
        let (offset, n) = cut("remote memory", start, end, len)?;
        Ok(RemoteRange { mem: self.clone(), offset, len: n })
    }

    /// `len` bytes at `offset + at` of it, each sum checked: numbers a
    /// peer sent (a broadcast plan's offsets) never wrap to another place.
    pub(crate) fn span(&self, offset: u64, at: u64, len: u64) -> Result<RemoteRange> {
        let start = offset.checked_add(at);
        match start.and_then(|s| Some((s, s.checked_add(len)?))) {
            Some((s, e)) => self.range(s..e),
            None => Err(gpudirect::Error::OutOfBounds { what: "remote memory", offset: start.unwrap_or(u64::MAX), requested: len, len: self.len() }),
        }
    }
}

/// A range of a peer's [`RemoteMemory`]: the remote side of a transfer
/// entry.
#[derive(Clone, Debug)]
pub struct RemoteRange {
    pub(crate) mem: RemoteMemory,
    pub(crate) offset: u64,
    pub(crate) len: u64,
}

impl RemoteRange {
    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its offset in the remote memory.
    pub fn offset(&self) -> u64 {
        self.offset
    }
}
