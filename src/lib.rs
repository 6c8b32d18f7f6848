//! The library behind the `gpudirect` command: the doctor (does GPUDirect
//! RDMA work here, for this job, and why not), the NCCL log reader, and the
//! perftest-style measurements. It gathers and judges; the command line
//! (and the Python package) only render.
//!
//! - [`doctor`]: findings and a verdict for a machine, a tree under a root,
//!   or a capture, in the job's environment ([`doctor::sources::judge`]).
//! - [`nccl_log`]: what an `NCCL_DEBUG=INFO` log says about GPUDirect RDMA.
//! - [`perf`]: `bw` and `lat`, perftest's method and columns.
//! - [`fleet`]: every node's capture of a job judged together.
//! - [`stats`]: an agent's metrics endpoint, scraped, read and judged
//!   (`gpudirect stats`).
//! - [`cli`]: the command's flags, decided once into typed requests.

pub mod cli;
pub mod doctor;
pub mod fleet;
pub mod nccl_log;
pub mod perf;
pub mod stats;
#[cfg(test)]
mod nccl_agreement;
