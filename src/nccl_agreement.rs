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
