//! NCCL log explainer (stub: being written).
