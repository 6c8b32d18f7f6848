//! The `gpudirect` command: `doctor` and `nccl-log`.

mod doctor;
mod nccl_log;

fn main() {}
