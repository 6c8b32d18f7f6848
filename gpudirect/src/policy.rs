//! How GPU memory is registered with the NIC ([`RegistrationPath`]) and
//! what to do when GPUDirect RDMA is not available ([`GpuPolicy`]): plain
//! data, at the crate root.

use std::fmt;

/// How a GPU memory region was registered with the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RegistrationPath {
    /// Zero-copy through a dma-buf export of the GPU memory.
    DmaBuf,
    /// Zero-copy through the `nvidia-peermem` peer-memory client.
    PeerMemory,
    /// Not zero-copy: the NIC uses a pinned host mirror and every transfer
    /// is copied between it and the GPU.
    HostStaged,
}

impl fmt::Display for RegistrationPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RegistrationPath::DmaBuf => "dma-buf",
            RegistrationPath::PeerMemory => "peer memory",
            RegistrationPath::HostStaged => "host-staged",
        })
    }
}

/// What to do when GPUDirect RDMA is not available.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GpuPolicy {
    /// GPUDirect RDMA or an error naming why not. The default.
    #[default]
    Require,
    /// GPUDirect RDMA if possible, otherwise host staging, reported by the
    /// region's path and a warning in the log.
    Prefer,
    /// Host staging, without trying GPUDirect RDMA.
    HostStaged,
}

impl std::str::FromStr for GpuPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "require" => Ok(GpuPolicy::Require),
            "prefer" => Ok(GpuPolicy::Prefer),
            "host-staged" | "hoststaged" | "staged" => Ok(GpuPolicy::HostStaged),
            _ => Err(format!("unknown GPU policy {s:?}: expected require, prefer or host-staged")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse() {
        assert_eq!("require".parse::<GpuPolicy>().unwrap(), GpuPolicy::Require);
        assert_eq!("Prefer".parse::<GpuPolicy>().unwrap(), GpuPolicy::Prefer);
        assert_eq!("host-staged".parse::<GpuPolicy>().unwrap(), GpuPolicy::HostStaged);
        assert!("always".parse::<GpuPolicy>().is_err());
        assert_eq!(GpuPolicy::default(), GpuPolicy::Require);
    }
}
