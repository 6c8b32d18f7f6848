//! The scale-first measurement plan: one GPU on this node, every GPU with
//! its own NIC, then two nodes, each with the number this machine's links
//! say it should reach, measured with `gpudirect bw --compare-host` (GPU
//! memory against host memory on the same NIC pair, so the copy path shows
//! as about half).

use serde::Serialize;

use super::bandwidth::Estimate;

/// One measurement of the plan.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Step {
    /// What it measures.
    pub what: String,
    /// The commands, in order (`&` marks the server left running).
    pub commands: Vec<String>,
    /// The number it should return here, and what a bad one means.
    pub expect: String,
}

/// The pair the plan starts from: the verdict's.
pub struct Start<'a> {
    /// CUDA ordinal of the GPU.
    pub ordinal: usize,
    /// Its PCI address, to find its estimate.
    pub bdf: Option<&'a str>,
    /// The NIC.
    pub nic: &'a str,
}

/// The plan as text (`doctor --plan`).
pub struct Shown<'a>(pub &'a [Step]);

impl std::fmt::Display for Shown<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return writeln!(f, "\nNo measurement plan: there is no GPU and RDMA NIC pair to measure.");
        }
        writeln!(f, "\nMeasure in this order (scale first):")?;
        for s in self.0 {
            writeln!(f, "{}", s.what)?;
            for c in &s.commands {
                writeln!(f, "     {c}")?;
            }
            writeln!(f, "   expect: {}", s.expect)?;
        }
        Ok(())
    }
}

/// GB/s (10^9) as `gpudirect bw` prints it (MB/s, 2^20 bytes).
fn mb_s(gbs: f64) -> f64 {
    gbs * 1e9 / f64::from(1u32 << 20)
}

fn expect(e: Option<&Estimate>) -> String {
    match e {
        Some(e) => {
            // The links cap staging only where they are narrower than the
            // direct path; elsewhere the copy through host memory is what
            // halves it.
            let ceiling = if e.staged_gbs < 0.95 * e.direct_gbs {
                format!(" or at the host-staged ceiling of these links ({:.1} GB/s)", e.staged_gbs)
            } else {
                String::new()
            };
            format!(
                "GPU memory at about {:.1} GB/s ({:.0} MB/s as bw prints it; the line rate is {:.1} GB/s), host memory about the same, ratio about 1; \
                 GPU memory at about half ({:.1} GB/s){ceiling} is the copy path",
                e.direct_gbs,
                mb_s(e.direct_gbs),
                e.line_gbs,
                e.direct_gbs / 2.0
            )
        }
        None => "GPU memory at about the same rate as host memory (ratio about 1); about half is the copy path (the links' speeds are not reported here, so there is no figure)".to_owned(),
    }
}

/// The plan for this machine, from the verdict's pair and every GPU's
/// nearest pair; empty when there is no pair.
pub fn plan(start: Option<Start<'_>>, estimates: &[Estimate], ordinal_of: impl Fn(&Estimate) -> Option<usize>) -> Vec<Step> {
    let Some(s) = start else { return Vec::new() };
    let find = |e: &&Estimate| e.nic == s.nic && s.bdf.is_some_and(|b| e.gpu.contains(b));
    let first = estimates.iter().find(find);
    let (n, nic) = (s.ordinal, s.nic);
    let mut steps = vec![Step {
        what: format!("1. one GPU on this node: GPU{n} through {nic} and back (the NIC's loopback)"),
        commands: vec![format!("gpudirect bw -d {nic} --gpu {n} -p 18515 &"), format!("gpudirect bw -d {nic} --gpu {n} --compare-host -p 18515 127.0.0.1")],
        expect: expect(first),
    }];
    let others: Vec<String> = estimates
        .iter()
        .filter_map(|e| ordinal_of(e).map(|o| format!("GPU{o} with {}: {:.1} GB/s", e.nic, e.direct_gbs)))
        .collect();
    if others.len() > 1 {
        steps.push(Step {
            what: "2. every GPU of this node with its own NIC, one at a time as in step 1".to_owned(),
            commands: estimates
                .iter()
                .filter_map(|e| ordinal_of(e).map(|o| format!("gpudirect bw -d {} --gpu {o} --compare-host -p 18515 127.0.0.1", e.nic)))
                .collect(),
            expect: format!("{}; one GPU well below the others has a slow or degraded link (bandwidth.path)", others.join(", ")),
        });
    }
    steps.push(Step {
        what: format!("{}. two nodes: GPU{n} here against the same GPU and NIC on the other node", steps.len() + 1),
        commands: vec![
            format!("gpudirect bw -d {nic} --gpu {n} -p 18515 &    # on node A"),
            format!("gpudirect bw -d {nic} --gpu {n} --compare-host -p 18515 <node A>    # on node B"),
        ],
        expect: format!(
            "{}; then NCCL across the nodes (all_reduce_perf with NCCL_DEBUG=INFO): `gpudirect nccl-log` on its log says used, and the bus bandwidth per NIC is near that figure",
            expect(first)
        ),
    });
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn est(gpu: &str, idx: usize, nic: &str) -> Estimate {
        Estimate { gpu: format!("GPU{idx} ({gpu})"), gpu_index: idx, nic: nic.into(), line_gbs: 50.0, direct_gbs: 50.0, staged_gbs: 31.5 }
    }

    #[test]
    fn scale_first_with_this_machines_numbers() {
        let e = [est("0000:18:00.0", 0, "mlx5_0"), est("0000:3a:00.0", 1, "mlx5_1")];
        let p = plan(Some(Start { ordinal: 0, bdf: Some("0000:18:00.0"), nic: "mlx5_0" }), &e, |e| Some(e.gpu_index));
        assert_eq!(p.len(), 3);
        assert!(p[0].what.starts_with("1. one GPU on this node: GPU0 through mlx5_0"));
        assert_eq!(p[0].commands[1], "gpudirect bw -d mlx5_0 --gpu 0 --compare-host -p 18515 127.0.0.1");
        assert!(p[0].expect.starts_with("GPU memory at about 50.0 GB/s (47684 MB/s as bw prints it"), "{}", p[0].expect);
        assert!(p[0].expect.ends_with("at about half (25.0 GB/s) or at the host-staged ceiling of these links (31.5 GB/s) is the copy path"), "{}", p[0].expect);
        assert!(p[1].expect.starts_with("GPU0 with mlx5_0: 50.0 GB/s, GPU1 with mlx5_1: 50.0 GB/s"), "{}", p[1].expect);
        assert!(p[2].what.starts_with("3. two nodes"));
        // Links not reported: the steps remain, without a figure.
        let p = plan(Some(Start { ordinal: 0, bdf: Some("0000:18:00.0"), nic: "mlx5_0" }), &[], |_| None);
        assert_eq!(p.len(), 2);
        assert!(p[0].expect.contains("no figure"));
        assert!(plan(None, &e, |_| None).is_empty());
    }
}
