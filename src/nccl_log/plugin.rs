//! The lines gpudirect's own NCCL network plugin writes (typed in
//! [`gpudirect::nccl::PluginLine`]): each connection's path, a refusal to
//! stage, and each NIC's bytes by where they lived. Where a log has them
//! they decide, since they say per connection what the bytes did.

use gpudirect::nccl::{PluginLine, PluginPath};

use super::{quote, LogLine, Scan, Verdict, HEAD_NOT_USED, HEAD_PARTIAL, HEAD_USED, PARTIAL_COST};

fn place(at: &LogLine) -> String {
    match &at.host {
        Some(h) => format!("line {} on {h}", at.line),
        None => format!("line {}", at.line),
    }
}

fn who(gpu: Option<u32>) -> String {
    gpu.map_or_else(|| "host memory".into(), |g| format!("GPU{g}"))
}

/// The verdict, its headline and its evidence from the plugin's lines,
/// when the log has any about a GPU.
pub(super) fn decide(scan: &Scan) -> Option<(Verdict, String, Vec<String>)> {
    let mut refused = Vec::new();
    let mut gdr = Vec::new();
    let mut staged = Vec::new();
    let mut traffic = Vec::new();
    for (pl, at) in &scan.plugin {
        match pl {
            PluginLine::Refused { gpu, nic, cause, .. } => refused.push(format!(
                "the GPUDirect NCCL plugin refused to stage {}'s traffic through host memory on {nic} ({}): {cause}",
                who(*gpu),
                place(at)
            )),
            PluginLine::Path { gpu: Some(g), send, nic, path: PluginPath::Gdr(how) } => {
                gdr.push(format!("GPU{g} {} {nic} via {how} ({})", if *send { "->" } else { "<-" }, place(at)))
            }
            PluginLine::Path { gpu: Some(g), send, nic, path: PluginPath::Staged { cause, .. } } => {
                staged.push(format!("GPU{g} {} {nic} staged through host memory ({}): {cause}", if *send { "->" } else { "<-" }, place(at)))
            }
            PluginLine::Path { .. } => {}
            PluginLine::Traffic { nic, sent_gpu, sent_host, recv_gpu, recv_host } => traffic.push(format!(
                "{nic} moved {} B to and from GPU memory and {} B through host memory ({}; NCCL's LL protocol keeps its buffers in host memory even with GPUDirect RDMA)",
                sent_gpu + recv_gpu,
                sent_host + recv_host,
                place(at)
            )),
        }
    }
    if refused.is_empty() && gdr.is_empty() && staged.is_empty() {
        return None;
    }
    let (verdict, headline) = if !refused.is_empty() {
        (
            Verdict::NotUsed,
            "GPUDirect RDMA was NOT available: the GPUDirect NCCL plugin refused to stage a GPU's traffic through host memory, so NCCL stopped instead of running at about half the bandwidth".to_owned(),
        )
    } else if staged.is_empty() {
        (Verdict::Used, format!("{HEAD_USED}: all {} GPU connection(s) of the GPUDirect NCCL plugin say GPUDirect RDMA", gdr.len()))
    } else if gdr.is_empty() {
        (Verdict::NotUsed, HEAD_NOT_USED.to_owned())
    } else {
        (Verdict::Partial, format!("{HEAD_PARTIAL}: {} GPU connection(s) with it, {} staged through host memory: {PARTIAL_COST}", gdr.len(), staged.len()))
    };
    let mut evidence = refused;
    evidence.extend(staged.into_iter().take(32));
    if !gdr.is_empty() {
        evidence.push(format!("with GPUDirect RDMA: {}", gdr.iter().take(8).cloned().collect::<Vec<_>>().join("; ")));
    }
    evidence.extend(traffic.into_iter().take(16));
    Some((verdict, headline, evidence))
}

/// The plugin's own fixes for what it staged or refused.
pub(super) fn causes(scan: &Scan) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (pl, at) in &scan.plugin {
        let (cause, fix) = match pl {
            PluginLine::Refused { cause, fix, .. } | PluginLine::Path { path: PluginPath::Staged { cause, fix }, .. } => (cause, fix),
            _ => continue,
        };
        let text = format!("{cause}: {fix} (the GPUDirect NCCL plugin, {})", quote(at));
        if !out.iter().any(|o| o.starts_with(cause.as_str())) && out.len() < 16 {
            out.push(text);
        }
    }
    out
}
