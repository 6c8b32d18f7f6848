//! Raw bindings to rdma-core's `libibverbs`.
//!
//! Generated at build time by bindgen from the installed
//! `<infiniband/verbs.h>`, so struct layouts always match the headers the
//! program is compiled against. (docs.rs builds, which have no headers, use
//! a checked-in generation from rdma-core 44.0 instead.) The `static inline` verbs (`ibv_post_send`,
//! `ibv_post_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`, `ibv_query_gid_ex`,
//! `__ibv_reg_mr`, `___ibv_query_port`, ...) are callable under their own
//! names through small C wrappers compiled from the same headers.
//!
//! Enums are plain integer constants (`IBV_WC_SUCCESS`, of type
//! `ibv_wc_status`), never Rust enums: a provider may return values this
//! header version does not know.
//!
//! Linking is dynamic: providers (rxe, mlx5, efa, ...) are loaded by
//! libibverbs at run time from the system's rdma-core.
//!
//! Everything here is `unsafe` and undocumented beyond the verbs man pages;
//! the `gpudirect` crate is the safe layer.

#![no_std]
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case)]
#![allow(clippy::all, rustdoc::all, missing_docs, unsafe_op_in_unsafe_fn)]

#[cfg(not(gpudirect_sys_pregenerated))]
include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
// docs.rs: the same build script's output, checked in (see build.rs).
#[cfg(gpudirect_sys_pregenerated)]
include!("pregenerated.rs");

/// librdmacm (`<rdma/rdma_cma.h>`): `rdma_create_id`, `rdma_resolve_addr`,
/// `rdma_connect`, `rdma_get_cm_event`, ... (feature `rdmacm`, which links
/// `librdmacm`). Its verbs types are this crate's own.
#[cfg(feature = "rdmacm")]
pub mod rdmacm {
    #[cfg(not(gpudirect_sys_pregenerated))]
    include!(concat!(env!("OUT_DIR"), "/rdmacm.rs"));
    #[cfg(gpudirect_sys_pregenerated)]
    include!("pregenerated_rdmacm.rs");
}
