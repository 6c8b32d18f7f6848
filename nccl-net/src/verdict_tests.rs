//! The refusal path on the doctor's fixture machines: properties and the
//! judgement of a connection's first transfer, under each policy.

use super::*;
use gpudirect::gdr::{DmaBufProbe, GpuFacts, HostFacts, ModuleFlavour, NicFacts};
use gpudirect::topology::discover;
use gpudirect::nccl::PluginLine;
use gpudirect::Errno;

fn machine(name: &str) -> (SysRoot, PciTopology) {
    let root = SysRoot::at(format!("{}/../tests/data/machines/{name}", env!("CARGO_MANIFEST_DIR")));
    let topo = discover(&root);
    (root, topo)
}

/// Facts of a healthy pair (open module, CUDA 12.8, dma-buf everywhere),
/// then `change` applied.
fn facts(bus: &str, nic: &str, change: impl FnOnce(&mut GdrFacts)) -> GdrFacts {
    let mut f = GdrFacts {
        gpu: GpuFacts {
            ordinal: 0,
            label: format!("GPU0 (NVIDIA A100, {bus})"),
            pci_bus_id: Some(bus.to_owned()),
            cuda_unavailable: None,
            driver_version: Some(12080),
            gdr_supported: Some(true),
            dma_buf_supported: Some(true),
            module: ModuleFlavour::Open,
        },
        nic: NicFacts { device: nic.to_owned(), dma_buf: DmaBufProbe::from_errno(Errno(libc::EBADF)) },
        host: HostFacts { kernel_release: Some("6.8.0-45-generic".into()), peer_memory_found: vec![], peer_memory_api: Some(false) },
    };
    change(&mut f);
    f
}

fn pair(machine_name: &str, nic: &str, change: impl FnOnce(&mut GdrFacts)) -> PairJudgement {
    let (root, topo) = machine(machine_name);
    let bus = topo.gpus[0].bdf.clone();
    let levels = levels(&root, &topo, &bus, nic);
    PairJudgement::new(0, facts(&bus, nic, change), levels.map(|(nccl, _)| nccl)).shown_as(levels.map(|(_, shown)| shown))
}

const HOST_ONLY: Seen = Seen { host: true, gpu: None };
const GDR_SEND: Seen = Seen { host: true, gpu: Some(RegistrationPath::DmaBuf) };

fn env(list: &[(&str, &str)]) -> Vec<(String, String)> {
    list.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[test]
fn a_far_nic_is_offered_gpu_memory_but_its_staged_connection_is_refused_under_require() {
    // two-socket-sys: the A100 on socket 0, the ConnectX-6 Dx on socket 1.
    let p = pair("two-socket-sys", "mlx5_0", |_| {});
    assert_eq!(p.nccl_level, Some(PathLevel::Sys));
    assert_eq!(ptr_support(std::slice::from_ref(&p)), abi::PTR_HOST | abi::PTR_CUDA | abi::PTR_DMABUF);
    let path = judge(Side::Recv, HOST_ONLY, Some(&p), "mlx5_0", &[]);
    let ConnPath::Staged { cause, fix } = &path else { panic!("{path:?}") };
    // The library's rule, worded as the doctor words it.
    let stop = gpudirect::nccl::Stop::DefaultBelowPath { level: "SYS".into(), value: "SYS".into() };
    assert_eq!(cause, &format!("GPU0 (NVIDIA A100, 0000:3b:00.0) <-> mlx5_0: {}", stop.cause()));
    assert_eq!(fix, &stop.fix());
    assert!(fix.starts_with("set NCCL_NET_GDR_LEVEL=SYS"), "{fix}");

    let (line, action) = decide(GdrPolicy::Require, Side::Recv, &path, Some(0), "mlx5_0");
    let line = line.to_string();
    assert!(line.starts_with("GPU0 <- mlx5_0: staged through host memory: GPU0 (NVIDIA A100"), "{line}");
    let Action::Refuse(refusal) = action else { panic!("{action:?}") };
    let text = refusal.to_string();
    assert!(text.starts_with("refusing to stage GPU0's traffic through host memory on mlx5_0 (GPUDIRECT_NCCL_GDR=require): GPU0"), "{text}");
    assert!(text.contains("Fix: set NCCL_NET_GDR_LEVEL=SYS") && text.ends_with("set GPUDIRECT_NCCL_GDR=prefer"), "{text}");
    assert_eq!(PluginLine::parse(&format!("NCCL WARN NET/GPUDirect : isend: {text}")), Some(refusal), "nccl-log reads it back");

    assert_eq!(decide(GdrPolicy::Prefer, Side::Recv, &path, Some(0), "mlx5_0").1, Action::Warn, "prefer: the path line at WARN");
    assert_eq!(decide(GdrPolicy::Off, Side::Recv, &path, Some(0), "mlx5_0").1, Action::Proceed);
}

#[test]
fn the_job_s_gdr_level_moves_the_cause_but_never_lets_staging_through() {
    let p = pair("two-socket-sys", "mlx5_0", |_| {});
    let path = judge(Side::Recv, HOST_ONLY, Some(&p), "mlx5_0", &env(&[("NCCL_NET_GDR_LEVEL", "SYS")]));
    let ConnPath::Staged { cause, .. } = &path else { panic!("{path:?}") };
    assert!(cause.starts_with("NCCL registered only host memory for this connection although dma-buf works"), "{cause}");
    assert!(matches!(decide(GdrPolicy::Require, Side::Recv, &path, Some(0), "mlx5_0").1, Action::Refuse(_)));
}

#[test]
fn a_nic_no_gpu_can_reach_offers_host_memory_only_and_names_each_cause() {
    // dgx-pix: a PIX pair, but no peer memory and a provider without dma-buf.
    let p = pair("dgx-pix", "mlx5_0", |f| f.nic.dma_buf = DmaBufProbe::from_errno(Errno(libc::EOPNOTSUPP)));
    assert_eq!(p.nccl_level, Some(PathLevel::Pix));
    assert_eq!(ptr_support(std::slice::from_ref(&p)), abi::PTR_HOST);
    let path = judge(Side::Send, HOST_ONLY, Some(&p), "mlx5_0", &[]);
    let ConnPath::Staged { cause, fix } = &path else { panic!("{path:?}") };
    assert!(cause.starts_with("no zero-copy path between GPU0 (NVIDIA A100, 0000:18:00.0) and mlx5_0"), "{cause}");
    assert!(cause.contains("the provider cannot register dma-buf memory") && cause.contains("/sys/module/nvidia_peermem/version"), "{cause}");
    assert!(fix.contains("Soft-RoCE (rxe) never does"), "{fix}");
    let line = decide(GdrPolicy::Require, Side::Send, &path, Some(0), "mlx5_0").0.to_string();
    assert!(line.starts_with("GPU0 -> mlx5_0: staged through host memory: no zero-copy path"), "{line}");
}

#[test]
fn nccl_net_gdr_read_0_is_named_for_sends_only() {
    let p = pair("dgx-pix", "mlx5_0", |_| {});
    let vars = env(&[("NCCL_NET_GDR_READ", "0")]);
    let ConnPath::Staged { cause, fix } = judge(Side::Send, HOST_ONLY, Some(&p), "mlx5_0", &vars) else { panic!() };
    assert!(cause.starts_with("GPU0 (NVIDIA A100, 0000:18:00.0) <-> mlx5_0: NCCL_NET_GDR_READ=0") && fix.starts_with("unset NCCL_NET_GDR_READ"), "{cause} / {fix}");
    let ConnPath::Staged { cause, .. } = judge(Side::Recv, HOST_ONLY, Some(&p), "mlx5_0", &vars) else { panic!() };
    assert!(!cause.contains("GDR_READ"), "{cause}");
}

#[test]
fn a_gdr_connection_is_never_refused_though_its_ll_buffer_is_host_memory() {
    let p = pair("dgx-pix", "mlx5_0", |_| {});
    for policy in [GdrPolicy::Require, GdrPolicy::Prefer, GdrPolicy::Off] {
        let path = judge(Side::Send, GDR_SEND, Some(&p), "mlx5_0", &[]);
        assert_eq!(path, ConnPath::Gdr(RegistrationPath::DmaBuf));
        let (line, action) = decide(policy, Side::Send, &path, Some(0), "mlx5_0");
        assert_eq!((line.to_string().as_str(), action), ("GPU0 -> mlx5_0: GPUDirect RDMA via dma-buf", Action::Proceed));
    }
    let path = judge(Side::Recv, Seen { host: false, gpu: Some(RegistrationPath::PeerMemory) }, Some(&p), "mlx5_0", &[]);
    assert_eq!(decide(GdrPolicy::Require, Side::Recv, &path, Some(0), "mlx5_0").0.to_string(), "GPU0 <- mlx5_0: GPUDirect RDMA via peer memory");
}

#[test]
fn host_memory_without_a_gpu_is_not_staging() {
    let path = judge(Side::Send, HOST_ONLY, None, "rxe0", &[]);
    assert_eq!(path, ConnPath::Host);
    let (line, action) = decide(GdrPolicy::Require, Side::Send, &path, None, "rxe0");
    let line = line.to_string();
    assert_eq!(action, Action::Proceed);
    assert!(line.starts_with("host memory -> rxe0: no GPU is current"), "{line}");
}

#[test]
fn a_soft_roce_device_has_no_place_in_the_pci_tree() {
    let (root, topo) = machine("vm-soft-roce");
    let bus = topo.gpus[0].bdf.clone();
    assert_eq!(levels(&root, &topo, &bus, "rxe0"), None);
}

/// A byte's path comes from its registration and the connection's
/// judgement: a staged connection's host memory is `staged`, never
/// `gdr` or `host`, under every policy that lets it run; GPU memory is
/// `gdr` unless it went through a host mirror.
#[test]
fn a_staged_byte_is_never_counted_as_gdr() {
    let p = pair("two-socket-sys", "mlx5_0", |_| {});
    for policy in [GdrPolicy::Prefer, GdrPolicy::Off] {
        let path = judge(Side::Send, HOST_ONLY, Some(&p), "mlx5_0", &[]);
        assert!(matches!(path, ConnPath::Staged { .. }), "{path:?}");
        let (_, action) = decide(policy, Side::Send, &path, Some(0), "mlx5_0");
        assert!(!matches!(action, Action::Refuse(_)), "{policy:?} lets it run");
        let staged = matches!(path, ConnPath::Staged { .. });
        assert_eq!(data_path(None, staged), DataPath::Staged);
    }
    assert_eq!(data_path(Some(RegistrationPath::HostStaged), false), DataPath::Staged);
    for gpu in [RegistrationPath::DmaBuf, RegistrationPath::PeerMemory] {
        assert_eq!(data_path(Some(gpu), false), DataPath::Gdr);
        assert_eq!(data_path(Some(gpu), true), DataPath::Gdr);
    }
    let host = judge(Side::Send, HOST_ONLY, None, "rxe0", &[]);
    assert_eq!(host, ConnPath::Host);
    assert_eq!(data_path(None, matches!(host, ConnPath::Staged { .. })), DataPath::Host);
}

/// Attack (review): every mix of registrations seen before the first
/// transfer, GPU or none, side and policy, and every registration a later
/// send or receive (of a group mixing GPU and host buffers) names: host
/// memory of a connection judged staged is `staged`, a host mirror is
/// `staged`, GPU memory `gdr`, and nothing staged is `gdr` or `host`.
#[test]
fn no_staged_byte_under_any_mix() {
    let healthy = pair("two-socket-sys", "mlx5_0", |_| {});
    let broken = pair("two-socket-sys", "mlx5_0", |f| {
        f.gpu.gdr_supported = Some(false);
        f.gpu.dma_buf_supported = Some(false);
    });
    let gpus = [None, Some(RegistrationPath::DmaBuf), Some(RegistrationPath::PeerMemory), Some(RegistrationPath::HostStaged)];
    for side in [Side::Send, Side::Recv] {
        for host in [false, true] {
            for first in gpus {
                for gpu in [None, Some(&healthy), Some(&broken)] {
                    let path = judge(side, Seen { host, gpu: first }, gpu, "mlx5_0", &[]);
                    let staged = matches!(path, ConnPath::Staged { .. });
                    // A GPU current and only host memory seen, or a mirror: staged.
                    let must_stage = first == Some(RegistrationPath::HostStaged) || (first.is_none() && gpu.is_some());
                    assert_eq!(staged, must_stage, "{side:?} host={host} first={first:?} gpu={} -> {path:?}", gpu.is_some());
                    for policy in [GdrPolicy::Off, GdrPolicy::Prefer, GdrPolicy::Require] {
                        let (_, action) = decide(policy, side, &path, gpu.map(|_| 0), "mlx5_0");
                        if matches!(action, Action::Refuse(_)) {
                            assert!(staged && policy == GdrPolicy::Require);
                            continue;
                        }
                        // A group of receives mixing every kind of buffer.
                        for reg in gpus {
                            let dp = data_path(reg, staged);
                            let want = match reg {
                                Some(RegistrationPath::HostStaged) => DataPath::Staged,
                                Some(_) => DataPath::Gdr,
                                None if staged => DataPath::Staged,
                                None => DataPath::Host,
                            };
                            assert_eq!(dp, want, "{policy:?} {path:?} reg={reg:?}");
                        }
                    }
                }
            }
        }
    }
}
