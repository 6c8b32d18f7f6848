//! Errors: which verb failed and why, in the words of the verbs man pages.

pub(crate) mod bootstrap;
pub(crate) mod gdr;
pub(crate) mod gpu_memory;

use bootstrap::BootstrapError;
use crate::wc::WcError;
pub use crate::errno::Errno;

/// Shorthand for results whose error is [`enum@Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What a failed verb usually means, for the errnos whose cause is
/// well known. `None` when there is nothing more useful to say.
fn verb_hint(verb: &str, errno: Errno) -> Option<&'static str> {
    Some(match (verb, errno.0) {
        (v, libc::ENOMEM) if v.contains("reg_mr") => {
            "the locked-memory limit is probably too low: raise it with `ulimit -l unlimited` \
             (or memlock in /etc/security/limits.conf, LimitMEMLOCK= for systemd services)"
        }
        (v, libc::EFAULT) if v.contains("reg_mr") => {
            "the address range is not mapped in this process, or not accessible"
        }
        (v, libc::EINVAL) if v.contains("modify_qp") => {
            "the peer's endpoint or the QP settings are invalid for this port \
             (wrong GID index, MTU above the port's, or a LID on a RoCE port)"
        }
        (v, libc::ETIMEDOUT) if v.contains("modify_qp") => {
            "the address of the peer's GID could not be resolved: check the GID index and routing"
        }
        (v, libc::ENOMEM) if v.contains("post") => {
            "the work queue is full: reap completions before posting more"
        }
        (v, libc::EPERM | libc::EACCES) if v.contains("open_device") || v.contains("alloc_pd") => {
            "no permission on /dev/infiniband/uverbs*: check the device node's mode \
             (containers need the device passed in)"
        }
        _ => return None,
    })
}

/// Every error `gpudirect` returns.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A verb returned an error.
    #[error("{verb} failed: {errno}{}", verb_hint(verb, *errno).map(|h| format!("; {h}")).unwrap_or_default())]
    Verb {
        /// The verb's C name, e.g. `ibv_reg_mr`.
        verb: &'static str,
        /// What it set `errno` to (or returned).
        errno: Errno,
    },

    /// The kernel has no RDMA (InfiniBand) subsystem: `ibv_get_device_list`
    /// reports `ENOSYS`.
    #[error(
        "no RDMA subsystem in this kernel (ibv_get_device_list: ENOSYS): \
         the kernel was built without InfiniBand support or ib_uverbs is not loaded; \
         try `modprobe ib_uverbs`, or use a kernel with CONFIG_INFINIBAND"
    )]
    NoRdmaSubsystem,

    /// Registering memory would pin more than the process's locked-memory
    /// limit (`RLIMIT_MEMLOCK`) allows, so the kernel refused with `ENOMEM`.
    /// Processes with `CAP_IPC_LOCK` (root, usually) are not limited.
    #[error(
        "{verb} failed: ENOMEM: registering {requested} bytes would exceed the locked-memory limit \
         (RLIMIT_MEMLOCK = {limit} bytes{}); raise it with `ulimit -l unlimited` (or `ulimit -l <KiB>`), \
         memlock in /etc/security/limits.conf, LimitMEMLOCK=infinity for a systemd service, \
         or `--ulimit memlock=-1` for a container",
        pinned.map(|p| format!(", of which {p} bytes are already pinned")).unwrap_or_default()
    )]
    LockedMemoryLimit {
        /// The verb, e.g. `ibv_reg_mr`.
        verb: &'static str,
        /// Bytes the registration asked to pin.
        requested: u64,
        /// The soft `RLIMIT_MEMLOCK`, in bytes.
        limit: u64,
        /// Bytes this process had pinned already (`VmPin` in
        /// /proc/self/status), when readable.
        pinned: Option<u64>,
    },

    /// The RDMA subsystem is present but reports no device.
    #[error(
        "no RDMA devices found: load the NIC's driver (mlx5_ib, efa, irdma, ...) or create a \
         Soft-RoCE device with `rdma link add rxe0 type rxe netdev <ifname>`; in a container, \
         pass /dev/infiniband in"
    )]
    NoDevices,

    /// No device has the requested name.
    #[error("RDMA device {name:?} not found; devices present: {}", available.join(", "))]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The names that do exist.
        available: Vec<String>,
    },

    /// The port number does not exist on this device.
    #[error("port {port} does not exist on {device} (it has {ports} port(s), numbered from 1)")]
    InvalidPort {
        /// The device's name.
        device: String,
        /// The port asked for.
        port: u8,
        /// How many ports the device has.
        ports: u8,
    },

    /// No usable GID on the port, or the requested index is empty.
    #[error("{0}")]
    Gid(#[from] crate::gid::GidError),

    /// A local or remote range lies outside its buffer; nothing was posted.
    #[error("{what}: range {offset}..{} is outside the {len}-byte buffer", offset.saturating_add(*requested))]
    OutOfBounds {
        /// Which buffer (e.g. "local memory region", "remote buffer").
        what: &'static str,
        /// Start of the requested range.
        offset: u64,
        /// Length of the requested range.
        requested: u64,
        /// The buffer's length.
        len: u64,
    },

    /// A message is larger than a single work request can carry (verbs'
    /// scatter/gather length is 32 bits; ports usually cap messages at
    /// 2 GiB, their `max_msg_sz`).
    #[error("a {0}-byte transfer does not fit in one work request (at most {max} bytes)", max = u32::MAX)]
    TooLong(u64),

    /// A local range is in use in a way that conflicts with the access
    /// asked for: by a posted work request whose completion has not been
    /// reaped, or by a CPU copy running on another thread.
    #[error("bytes {offset}..{end} of the memory region are in use by {holder}")]
    Busy {
        /// Start of the range asked for.
        offset: u64,
        /// End (exclusive) of the range asked for.
        end: u64,
        /// Who holds it, and what to do: `"a posted work request that has
        /// not completed; poll its completion queue first"` or `"a copy in
        /// progress on another thread (write_at, read_at, fill, stage_in);
        /// retry when it returns"`.
        holder: &'static str,
    },

    /// Posting would exceed the queue's depth.
    #[error(
        "the {queue} queue is full ({depth} work requests outstanding): reap completions first; \
         unsignaled sends only leave the queue when a later signaled one completes"
    )]
    QueueFull {
        /// `"send"` or `"receive"`.
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
    },

    /// A completion queue would be too small for the queue pairs using it.
    #[error(
        "the completion queue has {depth} entries but its queue pairs could have {needed} work requests \
         outstanding: it could overrun (the queue pairs would stall with only an asynchronous error); \
         create it with at least {needed} entries, or give the queue pairs smaller queues"
    )]
    CqTooSmall {
        /// The queue's depth.
        depth: u32,
        /// Entries needed by all its queue pairs together.
        needed: u64,
    },

    /// A memory region from another protection domain was used with a queue pair.
    #[error("the memory region belongs to a different protection domain than the queue pair")]
    ForeignMemoryRegion,

    /// An argument rejected before any verb was called; the message says
    /// which and why.
    #[error("{0}")]
    InvalidArgument(String),

    /// Waiting for a completion timed out.
    #[error("no completion arrived within {0:?}")]
    Timeout(std::time::Duration),

    /// A work request completed with an error status.
    #[error(transparent)]
    WorkCompletion(#[from] WcError),

    /// A CUDA driver call failed.
    #[error("{call} failed: {error}")]
    Cuda {
        /// The driver call, e.g. `cuMemAlloc`.
        call: &'static str,
        /// The CUDA error's name and description.
        error: String,
    },

    /// CUDA cannot be used on this machine (no driver, `cuInit` failed).
    #[error("CUDA is not available: {0}")]
    CudaUnavailable(String),

    /// Device memory a NIC cannot be given: the cause and the fix
    /// ([`GpuMemoryError`](crate::GpuMemoryError)), found before anything
    /// was registered.
    #[error(transparent)]
    GpuMemory(#[from] gpu_memory::GpuMemoryError),

    /// No GPU with that ordinal.
    #[error("GPU{ordinal} does not exist: CUDA sees {count} GPU(s) (check CUDA_VISIBLE_DEVICES)")]
    GpuNotFound {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many GPUs CUDA sees.
        count: usize,
    },

    /// GPUDirect RDMA is unavailable and the policy did not allow a fallback.
    #[error(transparent)]
    Gdr(#[from] Box<gdr::GdrError>),

    /// The out-of-band exchange with the peer failed.
    #[error(transparent)]
    Bootstrap(#[from] BootstrapError),
}

impl Error {
    /// Builds [`Error::Verb`] from a verb's name and the current `errno`.
    pub(crate) fn last(verb: &'static str) -> Error {
        Error::Verb { verb, errno: Errno::last() }
    }

    /// Builds [`Error::Verb`] from a verb that returns the error number itself
    /// (as `ibv_modify_qp`, `ibv_post_send` and `ibv_query_port` do).
    pub(crate) fn returned(verb: &'static str, ret: i32) -> Error {
        // Some providers return -1 and set errno, others return errno.
        let errno = if ret < 0 { Errno::last() } else { Errno(ret) };
        Error::Verb { verb, errno }
    }

    /// The errno of a failed verb, if this is one.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            Error::Verb { errno, .. } => Some(*errno),
            Error::LockedMemoryLimit { .. } => Some(Errno(libc::ENOMEM)),
            _ => None,
        }
    }
}

/// Turns a verb's integer return (0 = success) into a `Result`.
pub(crate) fn check(verb: &'static str, ret: i32) -> Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(Error::returned(verb, ret))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errno_displays_name_and_meaning() {
        assert_eq!(Errno(libc::EOPNOTSUPP).to_string(), "EOPNOTSUPP (Operation not supported)");
        assert_eq!(Errno(4095).to_string(), "errno 4095 (Unknown error 4095)");
    }

    #[test]
    fn verb_error_names_verb_errno_and_hint() {
        let e = Error::Verb { verb: "ibv_reg_mr", errno: Errno(libc::ENOMEM) };
        let s = e.to_string();
        assert!(s.starts_with("ibv_reg_mr failed: ENOMEM (Cannot allocate memory); "), "{s}");
        assert!(s.contains("ulimit -l"), "{s}");
        let e = Error::Verb { verb: "ibv_alloc_pd", errno: Errno(libc::EINVAL) };
        assert_eq!(e.to_string(), "ibv_alloc_pd failed: EINVAL (Invalid argument)");
    }

    #[test]
    fn locked_memory_limit_names_the_limit_and_the_fix() {
        let e = Error::LockedMemoryLimit { verb: "ibv_reg_mr", requested: 2 << 20, limit: 1 << 20, pinned: Some(4096) };
        let s = e.to_string();
        assert!(s.starts_with("ibv_reg_mr failed: ENOMEM: registering 2097152 bytes"), "{s}");
        assert!(s.contains("RLIMIT_MEMLOCK = 1048576 bytes, of which 4096 bytes are already pinned"), "{s}");
        assert!(s.contains("ulimit -l unlimited") && s.contains("LimitMEMLOCK"), "{s}");
        assert_eq!(e.errno(), Some(Errno(libc::ENOMEM)));
        let e = Error::CqTooSmall { depth: 4, needed: 9 };
        assert!(!e.to_string().contains("  "), "{e}");
    }

    #[test]
    fn returned_prefers_the_returned_number() {
        assert_eq!(Error::returned("ibv_modify_qp", libc::EINVAL).errno(), Some(Errno(libc::EINVAL)));
    }

    #[test]
    fn out_of_bounds_names_the_range() {
        let e = Error::OutOfBounds { what: "remote buffer", offset: 4090, requested: 10, len: 4096 };
        assert_eq!(e.to_string(), "remote buffer: range 4090..4100 is outside the 4096-byte buffer");
    }
}
