//! `gpudirect doctor` (a job's environment) and `gpudirect nccl-log` (the
//! values a log shows) read NCCL's parameters by one set of rules
//! (`gpudirect::nccl`). For each value form, both must reach the same
//! reading of whether the setting rules GPUDirect RDMA out.

use crate::doctor::{env, Status};
use crate::nccl_log::{explain, Verdict};

/// The doctor's finding for one variable.
fn doctor(name: &str, value: &str) -> Status {
    let job = crate::doctor::jobenv::JobEnv { vars: vec![(name.to_string(), value.to_string())], ..Default::default() };
    let f = env::check(&job, &env::Site::default());
    let id = format!("env.{}", name.to_ascii_lowercase());
    f.iter().find(|f| f.check == id).unwrap_or_else(|| panic!("no {id} in {f:#?}")).status
}

/// nccl-log's verdict on a log whose only evidence is NCCL's own line for
/// the variable (after `internal`, when given), as NCCL prints it.
fn log_says(internal: &str, line: &str) -> Verdict {
    explain(&format!("{internal}h:1:2 [0] NCCL INFO {line}\n")).verdict
}

#[test]
fn gdr_level_forms_read_alike() {
    // NCCL logs this variable's raw string ("%s set by environment to %s").
    let forms = ["LOC", "loc", "0", "00", "0x0", "08", "1", "01", "PIX", "pix", "PXB", "2", "3", "PHB", "4", "SYS", "9", " 0", "", "abc", "NVL", "C2C"];
    for v in forms {
        let doctor_off = doctor("NCCL_NET_GDR_LEVEL", v) == Status::Fail;
        let log_off = log_says("", &format!("NCCL_NET_GDR_LEVEL set by environment to {v}")) == Verdict::NotUsed;
        assert_eq!(doctor_off, log_off, "NCCL_NET_GDR_LEVEL={v:?}: doctor says off {doctor_off}, nccl-log {log_off}");
        let nccl_off = gpudirect::nccl::gdr_level(v).is_some_and(|(l, _)| l.forbids_every_nic());
        assert_eq!(doctor_off, nccl_off, "{v:?}");
    }
    assert_eq!(doctor("NCCL_NET_GDR_LEVEL", "00"), Status::Fail);
    assert_ne!(doctor("NCCL_NET_GDR_LEVEL", "loc"), Status::Fail, "NCCL compares path names with strcmp");
}

#[test]
fn ib_disable_forms_read_alike() {
    // An integer parameter: NCCL logs the number strtoll read ("%s set by
    // environment to %lld."), and nothing when it keeps the default.
    let internal = "h:1:2 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation\n";
    for v in ["1", "01", "0x1", "2", " 1", "-1", "yes", "0", "00", "", "99999999999999999999"] {
        let doctor_off = doctor("NCCL_IB_DISABLE", v) == Status::Fail;
        let log_off = match gpudirect::nccl::param_int(v).used() {
            Some(n) => log_says(internal, &format!("NCCL_IB_DISABLE set by environment to {n}.")) == Verdict::NotUsed,
            None => false,
        };
        assert_eq!(doctor_off, log_off, "NCCL_IB_DISABLE={v:?}: doctor says off {doctor_off}, nccl-log {log_off}");
    }
    assert_eq!(doctor("NCCL_IB_DISABLE", "2"), Status::Fail, "any non-zero value disables IB");
}

#[test]
fn net_forms_read_alike() {
    for v in ["Socket", "socket", "SOCKET", "FastSocket", "IB", "ib", "AWS Libfabric", "IBext_v8"] {
        let doctor_off = doctor("NCCL_NET", v) == Status::Fail;
        let log_off = log_says("", &format!("NCCL_NET set by environment to {v}")) == Verdict::NotUsed;
        assert_eq!(doctor_off, log_off, "NCCL_NET={v:?}: doctor says off {doctor_off}, nccl-log {log_off}");
    }
}

/// The three judges of one job's environment agree, because they judge by
/// the library's one rule table (`gpudirect::nccl::stops`): for the
/// `dgx-pix` capture's GPU0 <-> mlx5_0 (PIX) and each environment, the
/// doctor's verdict names the table's stop (or is available without
/// one); the NCCL plugin names the same cause for a staged connection
/// where the stop concerns registration on its own network; and
/// nccl-log, given NCCL's lines for those variables on a two-node run,
/// says "not used" with that cause exactly where the stop holds for every
/// pair.
#[test]
fn the_doctor_nccl_log_and_the_plugin_agree_on_every_environment() {
    use gpudirect::nccl::{stops, Pair, Stop};
    use gpudirect::topology::PathLevel;
    use nccl_net_gpudirect::{judge, ConnPath, PairJudgement, Seen, Side};

    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/captures/dgx-pix.json")).unwrap();
    let envs: &[&[(&str, &str)]] = &[
        &[],
        &[("NCCL_IB_DISABLE", "1")],
        &[("NCCL_IB_DISABLE", "0")],
        &[("NCCL_NET", "Socket")],
        &[("NCCL_NET", "IB")],
        &[("NCCL_NET_GDR_LEVEL", "LOC")],
        &[("NCCL_NET_GDR_LEVEL", "0")],
        &[("NCCL_NET_GDR_LEVEL", "PIX")],
        &[("NCCL_NET_GDR_LEVEL", "SYS")],
        &[("NCCL_NET_GDR_READ", "0")],
        &[("NCCL_NET_GDR_READ", "1")],
        &[("NCCL_DMABUF_ENABLE", "0")],
        &[("NCCL_IB_HCA", "mlx5_1")],
        &[("NCCL_IB_HCA", "=mlx5_0:1")],
        &[("NCCL_IB_HCA", "^mlx5_0")],
        &[("NCCL_NET_GDR_READ", "0"), ("NCCL_NET_GDR_LEVEL", "LOC")],
        &[("NCCL_IB_HCA", "mlx5_1"), ("NCCL_NET", "Socket")],
    ];
    let opts = crate::doctor::report::Options { gpu: Some(0), device: Some("mlx5_0".into()) };
    for env in envs {
        let vars: Vec<(String, String)> = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let mut c = crate::doctor::capture::Capture::parse(&text, "dgx-pix").unwrap();
        c.env = crate::doctor::jobenv::from_process(vars.clone(), "the test");
        let (gpu, nic, host) = (c.answers.gpus.clone().unwrap()[0].clone(), c.answers.rdma.clone().unwrap()[0].clone(), c.answers.host.clone());
        let r = crate::doctor::sources::judge_capture(c, &opts).unwrap();
        assert!(r.verdict.hardware_allows && r.verdict.topology.as_deref() == Some("PIX"), "{env:?}: {}", r.verdict.line);
        let facts = gpudirect::gdr::GdrFacts { gpu, nic: gpudirect::gdr::NicFacts { device: nic.name.clone(), dma_buf: nic.dma_buf.unwrap() }, host };
        let plugin_pair = PairJudgement::new(0, facts, Some(PathLevel::Pix));
        let dma_buf_only = plugin_pair.plan.try_paths == [gpudirect::RegistrationPath::DmaBuf];
        let pair = Pair { nic: Some("mlx5_0"), level: Some(PathLevel::Pix), shown: None, dma_buf_only, plugin_missing: None, sends: true };

        // The doctor: the table's stop, or available.
        let stop = stops(&vars, &pair);
        assert_eq!(r.verdict.environment, stop.as_ref().map(ToString::to_string), "{env:?}: {}", r.verdict.line);
        assert_eq!(r.verdict.available, stop.is_none(), "{env:?}: {}", r.verdict.line);

        // The plugin: on its own network and NIC, a staged connection's
        // cause is the table's registration rule where one holds.
        for side in [Side::Send, Side::Recv] {
            let ConnPath::Staged { cause, fix } = judge(side, Seen { host: true, gpu: None }, Some(&plugin_pair), "mlx5_0", &vars) else { panic!("{env:?}") };
            let own = gpudirect::nccl::registration_stops(&vars, &Pair { dma_buf_only: false, sends: side == Side::Send, ..pair });
            match &own {
                Some(s) => assert!(cause.ends_with(&s.cause()) && fix == s.fix(), "{env:?} {side:?}: plugin says {cause} / {fix}, the table {s}"),
                None => assert!(cause.starts_with("NCCL registered only host memory"), "{env:?} {side:?}: {cause}"),
            }
            if let Some(s) = &stop {
                if matches!(s, Stop::LevelBelowPath { .. } | Stop::DefaultBelowPath { .. }) || (side == Side::Send && s.sends_only()) {
                    assert_eq!(own.as_ref().map(Stop::variable), Some(s.variable()), "{env:?} {side:?}: the doctor and the plugin name different variables");
                }
            }
        }

        // nccl-log: NCCL's lines for these variables on two nodes.
        let mut log = String::from(
            "n1:1:2 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so), using internal implementation\n\
             n1:1:2 [0] NCCL INFO comm 0x1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0\n",
        );
        for (k, v) in env.iter() {
            log.push_str(&format!("n1:1:2 [0] NCCL INFO {k} set by environment to {v}\n"));
        }
        let x = explain(&log);
        match stops(&vars, &Pair::default()) {
            Some(s) => {
                assert_eq!(x.verdict, Verdict::NotUsed, "{env:?}: {x:#?}");
                assert!(x.evidence.iter().any(|e| e.ends_with(&s.cause())), "{env:?}: {:?} should say {}", x.evidence, s.cause());
                assert!(!r.verdict.available, "{env:?}: nccl-log says not used, the doctor available");
            }
            None => assert_ne!(x.verdict, Verdict::NotUsed, "{env:?}: {x:#?}"),
        }
    }
}
