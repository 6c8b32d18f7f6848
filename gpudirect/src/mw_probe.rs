//! What a device does with a write just past a memory window's range:
//! seen, not assumed. A NIC that checks a window's key, queue pair and
//! lifetime may still let a write land anywhere in the region the window
//! is bound to (Soft-RoCE in Linux 6.1 checks the region's range, not the
//! window's), so a caller that promises "a key opens only its range" asks
//! the device first.

use std::time::Duration;

use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::mr::{AccessFlags, MemoryRegion};
use crate::mw::{next_rkey, MemoryWindow};
use crate::pd::ProtectionDomain;
use crate::qp::{QpConfig, QueuePair};
use crate::wc::{WcStatus, WorkCompletion};
use crate::wire::RemoteBuffer;
use crate::wr::SendWr;

/// What a device was seen to do with a write past a window's range.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WindowRange {
    /// The NIC refused the write: a window opens exactly its range.
    Enforced,
    /// The write landed: the device checks a window's key, queue pair
    /// and lifetime, but lets it reach the whole region it is bound to.
    NotEnforced,
}

/// Probes `pd`'s device: binds a type-2 window to 16 bytes of a region on
/// a queue pair connected to another of this process (both made with
/// `config`: its port, GID and timeouts), writes 16 bytes starting 8 bytes
/// into the window through it, and reports whether the NIC refused. Each
/// completion is waited for at most `within`.
///
/// # Errors
/// [`Error::Verb`] from the verbs (`ibv_alloc_mw` where the device has no
/// type-2 windows), [`Error::Timeout`] when a completion does not come,
/// [`Error::InvalidArgument`] when the bind itself fails (the device
/// advertises windows it cannot bind).
pub fn probe_window_range(pd: &ProtectionDomain, config: &QpConfig, within: Duration) -> Result<WindowRange> {
    let ctx = pd.context();
    let config = QpConfig { max_send_wr: 8, max_recv_wr: 8, max_inline_data: 0, ..config.clone() };
    let (cq_a, cq_b) = (CompletionQueue::new(ctx, 16)?, CompletionQueue::new(ctx, 16)?);
    let (a, b) = (QueuePair::create(pd, &cq_a, &cq_a, &config)?, QueuePair::create(pd, &cq_b, &cq_b, &config)?);
    let (ea, eb) = (a.endpoint(), b.endpoint());
    let (a, b) = (a.connect(&eb)?, b.connect(&ea)?);
    let target = MemoryRegion::alloc(pd, 4096, AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND)?;
    let src = MemoryRegion::alloc(pd, 64, AccessFlags::LOCAL_WRITE)?;
    let window = MemoryWindow::alloc(pd)?;
    let rkey = next_rkey(window.initial_rkey());
    let one = |cq: &CompletionQueue| -> Result<WorkCompletion> {
        let mut wc = [WorkCompletion::default(); 1];
        cq.wait(&mut wc, Some(within))?;
        Ok(wc[0])
    };
    b.post_send(&[SendWr::bind_window(&window, target.slice(1024..1040)?, AccessFlags::REMOTE_WRITE, rkey)?])?;
    let bound = one(&cq_b)?;
    if bound.status != WcStatus::Success {
        return Err(Error::InvalidArgument(format!("{} advertises type-2 memory windows but a bind failed: {}", ctx.name(), bound.status.verbs_name())));
    }
    let past = RemoteBuffer { addr: target.addr() + 1024 + 8, len: 16, rkey };
    a.post_send(&[SendWr::write(src.slice(0..16)?, &past, 0)?])?;
    Ok(if one(&cq_a)?.status == WcStatus::Success { WindowRange::NotEnforced } else { WindowRange::Enforced })
}
