//! What gpudirect's NCCL network plugin (`libnccl-net-gpudirect.so`)
//! writes into NCCL's log, typed: the plugin writes these values with
//! `Display`, and `gpudirect nccl-log` reads them back with
//! [`PluginLine::parse`], so the wording lives in one place.

use std::fmt;

/// Every plugin line starts with this, after NCCL's own prefix
/// (`host:pid:tid [dev] NCCL INFO `).
pub const PLUGIN_PREFIX: &str = "NET/GPUDirect : ";

const VIA: &str = "GPUDirect RDMA via ";
const STAGED: &str = "staged through host memory: ";
const FIX: &str = ". Fix: ";
const NO_GPU: &str = "no GPU is current on NCCL's proxy thread, nothing is staged";
const REFUSING: &str = "refusing to stage ";
const REFUSING_MID: &str = "'s traffic through host memory on ";
const REQUIRE: &str = " (GPUDIRECT_NCCL_GDR=require): ";
const PREFER_TAIL: &str = ". To run staged at about half the bandwidth, set GPUDIRECT_NCCL_GDR=prefer";

/// Where one connection's bytes go between the NIC and their home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginPath {
    /// GPU memory, reached by the NIC directly, by this registration path
    /// (`dma-buf`, `peer memory`).
    Gdr(String),
    /// A GPU's traffic staged through host memory.
    Staged {
        /// Why, as the library's judge and the job's variables say.
        cause: String,
        /// What to do.
        fix: String,
    },
    /// Host memory, no GPU current on the thread that set the connection
    /// up: nothing is staged.
    Host,
}

/// One line of the plugin's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PluginLine {
    /// A connection's path, written at its first transfer.
    Path {
        /// The GPU current on NCCL's proxy thread (CUDA ordinal), if any.
        gpu: Option<u32>,
        /// The sending end (`->`), or the receiving end (`<-`).
        send: bool,
        /// The NIC port (`mlx5_3:1`).
        nic: String,
        /// Where the bytes go.
        path: PluginPath,
    },
    /// A connection refused under `GPUDIRECT_NCCL_GDR=require`.
    Refused {
        /// The GPU.
        gpu: Option<u32>,
        /// The NIC port.
        nic: String,
        /// Why it would have been staged.
        cause: String,
        /// What to do.
        fix: String,
    },
    /// Bytes one NIC port moved, by where they lived.
    Traffic {
        /// The NIC port.
        nic: String,
        /// Sent from GPU memory.
        sent_gpu: u64,
        /// Sent from host memory (NCCL's LL protocol buffers are host memory
        /// even with GPUDirect RDMA).
        sent_host: u64,
        /// Received into GPU memory.
        recv_gpu: u64,
        /// Received into host memory.
        recv_host: u64,
    },
}

fn who(gpu: Option<u32>) -> String {
    gpu.map_or_else(|| "host memory".to_owned(), |g| format!("GPU{g}"))
}

fn read_who(s: &str) -> Option<Option<u32>> {
    if s == "host memory" {
        return Some(None);
    }
    s.strip_prefix("GPU")?.parse().ok().map(Some)
}

impl fmt::Display for PluginLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PluginLine::Path { gpu, send, nic, path } => {
                let arrow = if *send { "->" } else { "<-" };
                write!(f, "{} {arrow} {nic}: ", who(*gpu))?;
                match path {
                    PluginPath::Gdr(p) => write!(f, "{VIA}{p}"),
                    PluginPath::Staged { cause, fix } => write!(f, "{STAGED}{cause}{FIX}{fix}"),
                    PluginPath::Host => f.write_str(NO_GPU),
                }
            }
            PluginLine::Refused { gpu, nic, cause, fix } => write!(f, "{REFUSING}{}{REFUSING_MID}{nic}{REQUIRE}{cause}{FIX}{fix}{PREFER_TAIL}", who(*gpu)),
            PluginLine::Traffic { nic, sent_gpu, sent_host, recv_gpu, recv_host } => write!(
                f,
                "{nic}: sent {sent_gpu} B from GPU memory, {sent_host} B from host memory; received {recv_gpu} B into GPU memory, {recv_host} B into host memory"
            ),
        }
    }
}

impl PluginLine {
    /// Reads a plugin line out of one NCCL log message (with or without
    /// NCCL's prefix; the plugin's own `NET/GPUDirect : ` must be there).
    /// `None` for anything else.
    pub fn parse(msg: &str) -> Option<PluginLine> {
        let text = &msg[msg.find(PLUGIN_PREFIX)? + PLUGIN_PREFIX.len()..];
        let text = text.trim_end();
        if let Some(at) = text.find(REFUSING) {
            let rest = &text[at + REFUSING.len()..];
            let (w, rest) = rest.split_once(REFUSING_MID)?;
            let (nic, rest) = rest.split_once(REQUIRE)?;
            let rest = rest.strip_suffix(PREFER_TAIL).unwrap_or(rest);
            let (cause, fix) = rest.rsplit_once(FIX)?;
            return Some(PluginLine::Refused { gpu: read_who(w)?, nic: nic.to_owned(), cause: cause.to_owned(), fix: fix.to_owned() });
        }
        if let Some((nic, rest)) = text.split_once(": sent ") {
            let num = |s: &str| s.trim().parse::<u64>().ok();
            let (sent_gpu, rest) = rest.split_once(" B from GPU memory, ")?;
            let (sent_host, rest) = rest.split_once(" B from host memory; received ")?;
            let (recv_gpu, rest) = rest.split_once(" B into GPU memory, ")?;
            let recv_host = rest.strip_suffix(" B into host memory")?;
            return Some(PluginLine::Traffic {
                nic: nic.to_owned(),
                sent_gpu: num(sent_gpu)?,
                sent_host: num(sent_host)?,
                recv_gpu: num(recv_gpu)?,
                recv_host: num(recv_host)?,
            });
        }
        let (head, rest) = text.split_once(": ")?;
        let (w, send, nic) = if let Some((w, nic)) = head.split_once(" -> ") {
            (w, true, nic)
        } else {
            let (w, nic) = head.split_once(" <- ")?;
            (w, false, nic)
        };
        let path = if let Some(p) = rest.strip_prefix(VIA) {
            PluginPath::Gdr(p.to_owned())
        } else if let Some(r) = rest.strip_prefix(STAGED) {
            let (cause, fix) = r.rsplit_once(FIX).unwrap_or((r, ""));
            PluginPath::Staged { cause: cause.to_owned(), fix: fix.to_owned() }
        } else if rest.starts_with(NO_GPU) {
            PluginPath::Host
        } else {
            return None;
        };
        Some(PluginLine::Path { gpu: read_who(w)?, send, nic: nic.to_owned(), path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_reads_back_as_written() {
        let lines = [
            PluginLine::Path { gpu: Some(2), send: true, nic: "mlx5_3:1".into(), path: PluginPath::Gdr("dma-buf".into()) },
            PluginLine::Path { gpu: Some(0), send: false, nic: "mlx5_0:1".into(), path: PluginPath::Staged { cause: "GPU0 is SYS from mlx5_0:1".into(), fix: "set NCCL_NET_GDR_LEVEL=SYS".into() } },
            PluginLine::Path { gpu: None, send: true, nic: "rxe0:1".into(), path: PluginPath::Host },
            PluginLine::Refused { gpu: Some(7), nic: "mlx5_1:1".into(), cause: "no peer memory. And no dma-buf".into(), fix: "modprobe nvidia-peermem".into() },
            PluginLine::Traffic { nic: "mlx5_3:1".into(), sent_gpu: 1 << 40, sent_host: 0, recv_gpu: 12, recv_host: 3 },
        ];
        for l in lines {
            let printed = format!("node1:42:43 [2] NCCL INFO {PLUGIN_PREFIX}{l}");
            assert_eq!(PluginLine::parse(&printed), Some(l.clone()), "{printed}");
        }
        let refused = PluginLine::Refused { gpu: Some(1), nic: "m:1".into(), cause: "c".into(), fix: "f".into() };
        // The plugin's boundary puts the call's name first.
        assert_eq!(PluginLine::parse(&format!("NCCL WARN {PLUGIN_PREFIX}isend: {refused}")), Some(refused));
        for other in ["NET/IB : Using [0]mlx5_0:1/IB", "NET/GPUDirect : Using rxe0:1/RoCE speed 2500 Mb/s", "NET/GPUDirect : GPUx -> m: GPUDirect RDMA via x", ""] {
            assert_eq!(PluginLine::parse(other), None, "{other}");
        }
    }
}
