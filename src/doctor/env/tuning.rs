//! The `NCCL_*` variables that tune NCCL rather than decide its network
//! path: algorithms, protocols, channels, buffers, queue pairs, QoS. None
//! turns GPUDirect RDMA on or off, but each replaces a choice NCCL makes
//! per machine and message size, and a job carrying many of them has a
//! configuration nobody has measured as a whole (`env.overrides`).

use gpudirect::nccl::param_int;

use super::{with_int_note, Kind, Judged};
use crate::doctor::Status;

/// The verdict on a tuning variable, or `None` for a name not known here.
pub(super) fn judge(name: &str, value: &str) -> Option<Judged> {
    let not_gdr = "it does not decide GPUDirect RDMA";
    Some(match name {
        "NCCL_ALGO" => Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!("limits the collective algorithms NCCL may pick to {value:?} (Ring, Tree, CollNet*, NVLS*, PAT; ^ excludes); its tuner otherwise picks per operation and size; {not_gdr}"),
        )
        .note("a forced algorithm is often slower at the sizes it was not measured at: compare nccl-tests with and without it"),
        "NCCL_PROTO" => Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!("limits the protocols NCCL may pick to {value:?} (Simple, LL, LL128; ^ excludes); {not_gdr}"),
        )
        .note("disabling LL128 is a known workaround on platforms where it is unsafe; elsewhere it costs bandwidth at medium sizes"),
        "NCCL_MIN_NCHANNELS" | "NCCL_MAX_NCHANNELS" | "NCCL_MIN_CTAS" | "NCCL_MAX_CTAS" => {
            let read = param_int(value);
            with_int_note(
                Judged::new(
                    Kind::Overrides,
                    Status::Ok,
                    format!("bounds the channels (and so the SMs) NCCL uses per communicator; {not_gdr}"),
                )
                .note("more channels take SMs from the model's kernels; fewer can leave NICs idle: NCCL sizes this per topology"),
                value,
                read,
            )
        }
        "NCCL_BUFFSIZE" => {
            let read = param_int(value);
            let mut v = Judged::new(
                Kind::Overrides,
                Status::Ok,
                format!("the buffer per channel and peer (NCCL's default 4 MiB); {not_gdr}"),
            );
            if let Some(n) = read.used().filter(|n| *n > 0 && *n < 1 << 20) {
                v = Judged::new(
                    Kind::Overrides,
                    Status::Warn,
                    format!("a buffer of {n} bytes per channel and peer, under 1 MiB: network transfers go in small steps and lose bandwidth"),
                )
                .fix("Unset NCCL_BUFFSIZE (4 MiB) unless memory is short and the loss was measured.");
            }
            with_int_note(v, value, read)
        }
        "NCCL_CROSS_NIC" => Judged::new(
            Kind::Configures,
            Status::Ok,
            match param_int(value).used() {
                Some(0) => "rings and trees keep each GPU on the same NIC index on every node: right for rail-optimized fabrics (NIC i of every node on switch i)".to_owned(),
                Some(1) => "rings and trees may cross from one NIC index to another between nodes: right for fat trees where every NIC reaches every other at full rate".to_owned(),
                _ => "NCCL's default (2): same NIC index where it can, another where it must".to_owned(),
            },
        ),
        "NCCL_IB_QPS_PER_CONNECTION" => Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!("{value} queue pair(s) per connection (default 1): more spread traffic over ECMP or adaptive-routing paths, at more QP state in the NIC; {not_gdr}"),
        ),
        "NCCL_IB_SPLIT_DATA_ON_QPS" => Judged::new(
            Kind::Overrides,
            Status::Ok,
            format!("how data is split across a connection's queue pairs; {not_gdr}"),
        ),
        "NCCL_IB_TC" => Judged::new(
            Kind::Configures,
            Status::Ok,
            format!("traffic class {value} on RoCE: the DSCP/priority the fabric's PFC and ECN are set up for (a site fact NCCL cannot discover)"),
        )
        .note("a traffic class the switches do not treat as lossless means drops and retransmissions under load"),
        "NCCL_IB_SL" => Judged::new(
            Kind::Configures,
            Status::Ok,
            format!("InfiniBand service level {value}: the virtual lane the subnet manager maps it to"),
        ),
        "NCCL_IB_TIMEOUT" | "NCCL_IB_RETRY_CNT" => Judged::new(
            Kind::Configures,
            Status::Ok,
            "the queue pairs' transport retry timing: how long a lost peer takes to be reported",
        ),
        "NCCL_SHM_DISABLE" => match param_int(value).used() {
            Some(n) if n != 0 => Judged::new(
                Kind::Overrides,
                Status::Warn,
                "turns NCCL's shared-memory transport off: GPUs of one node that cannot use peer-to-peer talk through the network instead",
            )
            .fix("Unset it unless shared memory is unavailable (a container without enough /dev/shm: give it more instead)."),
            _ => Judged::new(Kind::Overrides, Status::Ok, "leaves the shared-memory transport on (NCCL's default)"),
        },
        "NCCL_IB_PCI_RELAXED_ORDERING" => Judged::new(
            Kind::Configures,
            Status::Ok,
            "PCIe relaxed ordering for the NIC's writes (helps on some virtualized and AMD hosts)",
        ),
        _ => return None,
    })
}
