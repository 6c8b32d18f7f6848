//! NCCL_* and UCX_* environment variables that affect GPUDirect RDMA (stub: being written).
