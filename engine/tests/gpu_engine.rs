//! The engine's GPU test, ignored by default; on a machine with a CUDA
//! GPU and an RDMA device:
//!
//! ```text
//! GPUDIRECT_TEST_DEVICE=mlx5_0 cargo test -p gpudirect-engine --test gpu_engine -- --ignored --nocapture
//! ```

use gpudirect::{Error, Gpu, GpuBuffer, GpuPolicy, Location, RegistrationPath};
use gpudirect_engine::{Agent, AgentConfig, AgentMetadata, EngineError, Op, Registration};

/// The transfer engine's GPU registrations: every NIC of the agent either
/// carries the memory (its path said) or is skipped with its reason, per
/// policy; a host agent's write into the GPU memory, with a notification,
/// is in place when the notification arrives (staged in, or flushed).
#[test]
#[ignore = "needs a CUDA GPU and an RDMA device"]
fn engine_gpu_memory_goes_on_the_nics_nearest_the_gpu() {
    let gpu = Gpu::open(0).expect("this test needs a CUDA GPU (GPU0)");
    let device = std::env::var("GPUDIRECT_TEST_DEVICE").expect("this test needs an RDMA device (GPUDIRECT_TEST_DEVICE)");
    let agent = |name: &str| {
        let mut c = AgentConfig::named(name);
        c.devices = device.split(',').map(str::to_owned).collect();
        c.listen = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        Agent::new(c).unwrap()
    };
    let (host, target) = (agent("gpu-host"), agent("gpu-target"));
    let len = 4 << 20;
    let every_nic_said = |reg: &Registration| {
        let mut said: Vec<String> = reg.paths().into_iter().map(|(d, _)| d).chain(reg.skipped().iter().map(|(d, _)| d.clone())).collect();
        said.sort();
        let mut want: Vec<String> = device.split(',').map(str::to_owned).collect();
        want.sort();
        assert_eq!(said, want, "{reg:?}");
    };
    match target.register_gpu("require", GpuBuffer::alloc(&gpu, len).unwrap(), GpuPolicy::Require) {
        Ok(reg) => {
            println!("Require: {reg:?}");
            every_nic_said(&reg);
            assert!(reg.paths().iter().all(|(_, l)| matches!(l, Location::Gpu { path: RegistrationPath::DmaBuf | RegistrationPath::PeerMemory, .. })));
        }
        Err(e @ (EngineError::GpuPlacement { .. } | EngineError::Verbs(Error::Gdr(_)))) => println!("Require refused, as it may here: {e}"),
        Err(e) => panic!("Require: {e:?}"),
    }
    let staged = target.register_gpu("staged", GpuBuffer::alloc(&gpu, len).unwrap(), GpuPolicy::HostStaged).unwrap();
    every_nic_said(&staged);
    assert_eq!(staged.paths().len(), 1, "one host mirror: {staged:?}");
    assert!(staged.skipped().iter().all(|(_, why)| why.contains("host-staged through") || why.contains("cannot reach")), "{staged:?}");
    assert!(!staged.is_targetable());
    assert!(target.metadata().memories.iter().all(|m| m.name != "staged"), "host-staged memory is not published");
    let kv = target.register_gpu("kv", GpuBuffer::alloc(&gpu, len).unwrap(), GpuPolicy::Prefer).unwrap();
    println!("Prefer: {kv:?}");
    every_nic_said(&kv);
    let t = Some(std::time::Duration::from_secs(20));
    let host_mem = host.alloc("host", len).unwrap();
    let data = testkit::pattern(len, 7);
    let host_md = AgentMetadata::decode(&host.metadata().encode().unwrap()).unwrap();
    let remote_host = target.load_remote(&host_md).unwrap().memory("host").unwrap();
    // Out of GPU memory (staged out before the post, or zero-copy)...
    kv.write_at(0, &data).unwrap();
    let out = target.prepare(Op::Write, &[(kv.range(..).unwrap(), remote_host.range(..).unwrap())], Some(b"out")).unwrap();
    out.post().unwrap();
    out.wait(t).unwrap();
    assert_eq!(host.wait_notification(t).unwrap().msg, b"out");
    let mut got = vec![0; len];
    host_mem.read_at(0, &mut got).unwrap();
    assert!(got == data, "the write out of GPU memory did not land whole");
    // ...into it by a read (staged in before the request completes)...
    let back = testkit::pattern(len, 8);
    host_mem.write_at(0, &back).unwrap();
    let read = target.prepare(Op::Read, &[(kv.range(..).unwrap(), remote_host.range(..).unwrap())], None).unwrap();
    read.post().unwrap();
    read.wait(t).unwrap();
    kv.read_at(0, &mut got).unwrap();
    assert!(got == back, "the read into GPU memory is not in GPU memory when it completes");
    if !kv.is_targetable() {
        return;
    }
    // ...and by a peer's write, in place when its notification arrives.
    let md = AgentMetadata::decode(&target.metadata().encode().unwrap()).unwrap();
    let remote = host.load_remote(&md).unwrap().memory("kv").unwrap();
    let req = host.prepare(Op::Write, &[(host_mem.range(..).unwrap(), remote.range(..).unwrap())], Some(b"kv done")).unwrap();
    host_mem.write_at(0, &data).unwrap();
    req.post().unwrap();
    req.wait(t).unwrap();
    let n = target.wait_notification(t).unwrap();
    assert_eq!(n.msg, b"kv done");
    kv.read_at(0, &mut got).unwrap();
    assert!(got == data, "the GPU memory does not hold what was written before its notification");
}
