//! The `UCX_*` variables that decide UCX's use of GPUDirect RDMA.

use super::{Kind, Judged};
use crate::doctor::Status;

pub(super) fn ucx_gdr(value: &str) -> Judged {
    let v = value.trim();
    let lower = v.to_ascii_lowercase();
    if lower == "try" || lower == "maybe" {
        Judged::new(Kind::Overrides, Status::Ok, "UCX's default: use GPUDirect RDMA when available, else stage")
    } else if lower == "y" || lower == "yes" || v == "1" {
        Judged::new(
            Kind::Overrides,
            Status::Ok,
            "GPUDirect RDMA required: UCX fails (\"Couldn't enable GPUDirect RDMA\") instead of silently staging \
             through host memory, which makes a missing GDR path visible",
        )
    } else if lower == "n" || lower == "no" || v == "0" {
        Judged::new(
            Kind::Overrides,
            Status::Fail,
            "UCX never lets the NIC access GPU memory: GPU buffers are staged through host memory",
        )
        .fix("Unset UCX_IB_GPU_DIRECT_RDMA (default try), or set yes to fail loudly when GDR is missing.")
    } else {
        Judged::new(
            Kind::Overrides,
            Status::Fail,
            "not a value UCX accepts (yes/no/try): UCX reports a configuration error and doesn't start",
        )
        .fix("Use yes, no or try (or unset it).")
    }
}

/// UCX transport names that use the RDMA NIC.
fn is_ib_transport(t: &str) -> bool {
    matches!(
        t,
        "ib" | "rc"
            | "rc_v"
            | "rc_verbs"
            | "rc_x"
            | "rc_mlx5"
            | "dc"
            | "dc_x"
            | "dc_mlx5"
            | "ud"
            | "ud_v"
            | "ud_verbs"
            | "ud_x"
            | "ud_mlx5"
            | "srd"
            | "gga"
            | "gga_mlx5"
    )
}

pub(super) fn ucx_tls(value: &str) -> Judged {
    let (negate, list) = match value.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, value),
    };
    let names: Vec<String> = list
        .split(',')
        .map(|t| t.trim().split(':').next().unwrap_or("").to_ascii_lowercase())
        .filter(|t| !t.is_empty())
        .collect();
    let has = |pred: &dyn Fn(&str) -> bool| names.iter().any(|n| pred(n));
    let all = has(&|n| n == "all");
    let (ib, cuda) = if negate {
        (!has(&|n| n == "ib" || n == "all"), !has(&|n| n == "cuda" || n == "cuda_copy" || n == "all"))
    } else {
        (all || has(&|n| is_ib_transport(n)), all || has(&|n| n == "cuda" || n == "cuda_copy"))
    };
    let mut v = if !ib {
        Judged::new(
            Kind::Overrides,
            Status::Fail,
            "no InfiniBand/RoCE transport (rc, dc, ud or ib) is allowed: UCX moves data over TCP or shared memory, \
             never with GPUDirect RDMA",
        )
        .fix("Allow an IB transport, e.g. UCX_TLS=rc,cuda_copy,cuda_ipc (or unset UCX_TLS).")
    } else if !cuda {
        Judged::new(
            Kind::Overrides,
            Status::Fail,
            "no CUDA transport (cuda_copy or cuda): UCX can't recognize GPU memory, so GPU buffers can't use \
             GPUDirect RDMA",
        )
        .fix("Add cuda_copy (and cuda_ipc for intra-node), e.g. UCX_TLS=rc,cuda_copy,cuda_ipc, or unset UCX_TLS.")
    } else {
        Judged::new(
            Kind::Overrides,
            Status::Ok,
            "an IB transport and a CUDA transport are allowed, which GPUDirect RDMA through UCX needs",
        )
    };
    if names.iter().any(|n| n == "gdr_copy") {
        v = v.note("gdr_copy is GDRCopy (CPU access to GPU memory for small messages), not GPUDirect RDMA");
    }
    v
}

pub(super) fn ucx_net_devices(value: &str) -> Judged {
    let devices: Vec<&str> = value.split(',').map(str::trim).filter(|d| !d.is_empty()).collect();
    if devices.iter().any(|d| d.eq_ignore_ascii_case("all")) {
        return Judged::new(Kind::Configures, Status::Ok, "all devices (UCX's default)");
    }
    let rdma: Vec<&str> = devices.iter().copied().filter(|d| d.contains(':')).collect();
    if rdma.is_empty() {
        Judged::new(
            Kind::Configures,
            Status::Warn,
            format!(
                "no entry has the device:port form that UCX's InfiniBand/RoCE transports go by (e.g. mlx5_0:1); \
                 the entries ({}) look like IP interface names, so UCX is likely left with TCP and no GPUDirect RDMA",
                devices.join(", ")
            ),
        )
        .fix("List RDMA ports, e.g. UCX_NET_DEVICES=mlx5_0:1 (see `ucx_info -d`), or unset it.")
    } else {
        Judged::new(Kind::Configures, Status::Ok, format!("UCX uses only {} for RDMA", rdma.join(", "))).note(
            "pick the port(s) closest to each GPU (the topology findings name them), or GDR may be off by distance",
        )
    }
}
