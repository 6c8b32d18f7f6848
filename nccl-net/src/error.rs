//! The plugin's one error type, and the NCCL code each kind maps to.

use crate::abi::{self, NcclResult};
use crate::wire;

/// Why a call into the plugin failed. Its text goes to NCCL's log (WARN,
/// subsystem NET) before the code is returned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    /// The job's configuration is refused: a bad `GPUDIRECT_NCCL_GDR` or
    /// `NCCL_IB_*` value, no usable RDMA device.
    #[error("{0}")]
    Config(String),
    /// A GPU's traffic would be staged through host memory and the policy
    /// is `require`: the text names the GPU, the NIC, the cause and the fix.
    #[error("{0}")]
    Refused(String),
    /// NCCL (or a peer, through a handle) passed something unusable.
    #[error("{0}")]
    Invalid(String),
    /// A verbs, CUDA or registration call failed.
    #[error("{0}")]
    Library(#[from] gpudirect::Error),
    /// The peer failed, closed the connection, or went silent past the bound.
    #[error("{0}")]
    Remote(String),
    /// A socket call of connection setup failed.
    #[error("{0}")]
    Io(String),
}

impl NetError {
    /// The `ncclResult_t` NCCL gets for this error.
    pub fn code(&self) -> NcclResult {
        match self {
            NetError::Config(_) | NetError::Refused(_) => abi::INVALID_USAGE,
            NetError::Invalid(_) => abi::INVALID_ARGUMENT,
            NetError::Library(_) | NetError::Io(_) => abi::SYSTEM_ERROR,
            NetError::Remote(_) => abi::REMOTE_ERROR,
        }
    }
}

impl From<std::io::Error> for NetError {
    fn from(e: std::io::Error) -> Self {
        NetError::Io(e.to_string())
    }
}

impl From<wire::NotAHandle> for NetError {
    fn from(e: wire::NotAHandle) -> Self {
        NetError::Invalid(e.to_string())
    }
}

impl From<wire::Malformed> for NetError {
    fn from(e: wire::Malformed) -> Self {
        NetError::Remote(e.to_string())
    }
}

/// The plugin's result.
pub type Result<T> = std::result::Result<T, NetError>;
