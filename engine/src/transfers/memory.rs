//! Memory an agent registered: one [`MemoryRegion`] per NIC the agent
//! uses, under a name peers target ([`Registration`]), and the ranges of
//! it a transfer names ([`LocalRange`]). The agent's registry keeps each
//! registration, and lists it in the agent's metadata, until the agent
//! deregisters it; the memory itself is deregistered once no handle,
//! range or transfer request names it either (a peer's later access fails
//! on its side with a remote access error, never touches freed memory).

use std::ops::RangeBounds;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use gpudirect::sync::Mutex;
use gpudirect::sysroot::SysRoot;
use gpudirect::topology::PathLevel;
use gpudirect::{AccessFlags, GpuBuffer, GpuPolicy, Location, MemoryRegion, Registerable, RemoteBuffer, Result};

use crate::error::EngineError;
use crate::nics::nic::Nic;
use crate::transfers::placement::{self, Place};
use crate::wire::desc::{cut, MemoryDesc};

pub(crate) struct RegInner {
    pub(crate) name: String,
    /// Index `i` is the region on the agent's NIC `i`, `None` where the
    /// memory is not registered (GPU memory on a NIC too far from it).
    pub(crate) regions: Vec<Option<MemoryRegion>>,
    /// The device name of each NIC, for [`Registration::paths`].
    devices: Vec<String>,
    /// The NICs without a region, and why.
    skipped: Vec<(String, String)>,
    took: std::time::Duration,
    /// Whether the agent's metadata listed it (peers can name it only
    /// then): set by the first metadata made after it was registered.
    published: AtomicBool,
}

/// Memory registered with an agent under a name: on each of its NICs, a
/// memory region that peers may write and read. Cheap to clone. It stays
/// registered, and in the agent's metadata, until
/// [`Agent::deregister`](crate::Agent::deregister); then for as long as a
/// clone, a [`LocalRange`] of it or a transfer request naming it lives.
///
/// CPU copies go through [`write_at`](Self::write_at) and
/// [`read_at`](Self::read_at), guarded as [`MemoryRegion`]'s are: a copy
/// that would race with a posted transfer on the same bytes fails with
/// [`Error::Busy`](gpudirect::Error::Busy).
#[derive(Clone)]
pub struct Registration {
    pub(crate) inner: Arc<RegInner>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("name", &self.inner.name)
            .field("len", &self.len())
            .field("paths", &self.paths())
            .field("skipped", &self.inner.skipped)
            .finish()
    }
}

impl Registration {
    /// `regions` holds at least one region.
    pub(crate) fn new(name: String, regions: Vec<Option<MemoryRegion>>, devices: Vec<String>, skipped: Vec<(String, String)>, took: std::time::Duration) -> Registration {
        debug_assert!(regions.iter().any(Option::is_some));
        Registration { inner: Arc::new(RegInner { name, regions, devices, skipped, took, published: AtomicBool::new(false) }) }
    }

    /// How long registering it took, on every NIC, the checks included:
    /// pinning tens of GB takes seconds, and this says where a start-up
    /// went (also logged at `info`).
    pub fn took(&self) -> std::time::Duration {
        self.inner.took
    }

    /// The region on the first NIC that has one (every registration has
    /// one): the CPU's way to the bytes.
    fn any(&self) -> &MemoryRegion {
        self.inner.any()
    }

    /// Whether peers may target it: every registration but host-staged
    /// GPU memory, whose peers' one-sided writes and reads would reach
    /// its host mirror, not the GPU's bytes. Such memory is the local side
    /// of transfers only (the source of writes, staged out before each
    /// post; the destination of reads, staged in before the request
    /// completes), and is left out of the agent's metadata.
    pub fn is_targetable(&self) -> bool {
        !self.any().is_host_staged()
    }

    /// The name peers target it by.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.any().len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the memory lives and, for GPU memory, the path each NIC's
    /// registration took, for each NIC that carries it (device name
    /// first).
    pub fn paths(&self) -> Vec<(String, Location)> {
        let on = self.inner.devices.iter().zip(&self.inner.regions);
        on.filter_map(|(d, r)| Some((d.clone(), r.as_ref()?.location()))).collect()
    }

    /// The agent's NICs that do not carry it, and why (GPU memory only:
    /// a NIC farther from the GPU than the nearest, beyond
    /// [`AgentConfig::gpu_path_limit`](crate::AgentConfig::gpu_path_limit),
    /// a software NIC, a failed zero-copy registration under
    /// [`GpuPolicy::Prefer`](gpudirect::GpuPolicy::Prefer), or host staging's
    /// single mirror). Transfers of it use the other NICs only.
    pub fn skipped(&self) -> &[(String, String)] {
        &self.inner.skipped
    }

    /// The range `range` of it, for a transfer entry.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`](gpudirect::Error::OutOfBounds) for a range past the end (or reversed).
    pub fn range(&self, range: impl RangeBounds<usize>) -> Result<LocalRange> {
        let len = self.len() as u64;
        let (start, end) = (range.start_bound().map(|&s| s as u64), range.end_bound().map(|&e| e as u64));
        let (offset, n) = cut("registration", start, end, len)?;
        Ok(LocalRange { reg: self.clone(), offset: offset as usize, len: n as usize })
    }

    /// Copies `src` into the memory at `offset` (see
    /// [`MemoryRegion::write_at`]).
    ///
    /// # Errors
    /// As [`MemoryRegion::write_at`].
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.any().write_at(offset, src)
    }

    /// Copies the memory at `offset` into `dst` (see
    /// [`MemoryRegion::read_at`]).
    ///
    /// # Errors
    /// As [`MemoryRegion::read_at`].
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.any().read_at(offset, dst)
    }

    /// Sets `range` to `byte`.
    ///
    /// # Errors
    /// As [`MemoryRegion::fill`].
    pub fn fill(&self, range: impl RangeBounds<usize>, byte: u8) -> Result<()> {
        self.any().fill(range, byte)
    }

    fn desc(&self) -> MemoryDesc {
        let keys = self
            .inner
            .regions
            .iter()
            .enumerate()
            .filter_map(|(i, r)| r.as_ref().map(|r| (i as u8, RemoteBuffer { addr: r.addr(), len: r.len() as u64, rkey: r.rkey() })))
            .collect();
        MemoryDesc { name: self.inner.name.clone(), len: self.len() as u64, keys }
    }
}

/// A range of a [`Registration`]: the local side of a transfer entry.
#[derive(Clone, Debug)]
pub struct LocalRange {
    pub(crate) reg: Registration,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

impl LocalRange {
    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its offset in the registration.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl RegInner {
    fn any(&self) -> &MemoryRegion {
        self.regions.iter().flatten().next().expect("a registration has a region on at least one NIC")
    }

    /// Its region on NIC `nic`, if it has one there.
    #[inline]
    pub(crate) fn on(&self, nic: usize) -> Option<&MemoryRegion> {
        self.regions.get(nic)?.as_ref()
    }

    /// Its region on NIC `nic`, which the caller checked it has (the post
    /// path: a transfer's rails are NICs every entry is registered on).
    #[inline(always)]
    pub(crate) fn on_rail(&self, nic: usize) -> &MemoryRegion {
        match self.regions.get(nic) {
            Some(Some(r)) => r,
            _ => not_on_rail(nic),
        }
    }
}

#[cold]
#[inline(never)]
fn not_on_rail(nic: usize) -> ! {
    panic!("a transfer's rail {nic} carries memory not registered on it: rails() checks every entry")
}

/// The registrations of an agent, in registration order.
#[derive(Default)]
pub(crate) struct Registry(Mutex<Vec<Arc<RegInner>>>);

impl Registry {
    /// Lists `reg`, unless its name is taken.
    pub(crate) fn add(&self, reg: &Registration) -> Result<(), EngineError> {
        let mut v = self.0.lock();
        if v.iter().any(|r| r.name == reg.inner.name) {
            return Err(EngineError::DuplicateName(reg.inner.name.clone()));
        }
        v.push(reg.inner.clone());
        Ok(())
    }

    /// Unlists the registration named `name`; whether there was one.
    pub(crate) fn remove(&self, name: &str) -> bool {
        let mut v = self.0.lock();
        let before = v.len();
        v.retain(|r| r.name != name);
        v.len() != before
    }

    /// The registration named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<Registration> {
        self.0.lock().iter().find(|r| r.name == name).map(|inner| Registration { inner: inner.clone() })
    }

    /// Whether `name` is taken.
    pub(crate) fn contains(&self, name: &str) -> bool {
        self.0.lock().iter().any(|r| r.name == name)
    }

    /// The descriptors of the registrations, for the metadata: each
    /// listed is published from now on.
    pub(crate) fn descs(&self) -> Vec<MemoryDesc> {
        let v = self.0.lock();
        let listed = v.iter().map(|inner| Registration { inner: inner.clone() }).filter(Registration::is_targetable);
        listed.map(|r| {
            // Locked update, as the pool's use counter: seen by helgrind.
            r.inner.published.swap(true, Ordering::Relaxed);
            r.desc()
        })
        .collect()
    }

    /// The registration named `name` if this agent's metadata listed it:
    /// what a peer may name (never host-staged GPU memory, nor memory
    /// registered since the last metadata was made).
    pub(crate) fn published(&self, name: &str) -> Option<Registration> {
        self.get(name).filter(|r| r.inner.published.fetch_or(false, Ordering::Relaxed))
    }

    /// Makes what the NICs wrote into GPU registrations visible to GPU
    /// kernels ([`MemoryRegion::flush_gpu_writes`]), before notifications
    /// are handed out; host memory needs nothing.
    pub(crate) fn flush_gpu_writes(&self) -> Result<()> {
        let live: Vec<_> = self.0.lock().clone();
        for r in live {
            // One flush per GPU buffer: its regions on other NICs share it.
            let region = r.any();
            if matches!(region.location(), Location::Gpu { .. }) {
                region.flush_gpu_writes()?;
            }
        }
        Ok(())
    }
}

/// What engine memory grants peers: writes and reads.
fn access() -> AccessFlags {
    AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ
}

/// Host memory registers on every NIC of the agent: once, then shared
/// with each other NIC's protection domain.
pub(crate) fn register_host<B: Registerable>(nics: &[Nic], buf: B) -> Result<Vec<Option<MemoryRegion>>, EngineError> {
    let first = MemoryRegion::register(&nics[0].pd, buf, access())?;
    let mut regions = Vec::with_capacity(nics.len());
    for n in &nics[1..] {
        regions.push(Some(first.register_in(&n.pd, access())?));
    }
    regions.insert(0, Some(first));
    Ok(regions)
}

/// The engine's GPU registration policy: GPU memory registers zero-copy
/// on the NICs [`placement`] chooses (the nearest to its GPU within
/// `gpu_path_limit`), each path judged on its own; under
/// [`GpuPolicy::Prefer`] what cannot go zero-copy is host-staged through
/// one NIC, under [`GpuPolicy::Require`] it is an error naming why, and
/// under [`GpuPolicy::HostStaged`] it is staged by choice. Returns each
/// NIC's region (or none) and, for each NIC without one, why.
#[allow(clippy::type_complexity)]
pub(crate) fn register_gpu(
    nics: &[Nic],
    agent: &str,
    name: &str,
    buf: GpuBuffer,
    policy: GpuPolicy,
    root: &SysRoot,
    gpu_path_limit: PathLevel,
) -> Result<(Vec<Option<MemoryRegion>>, Vec<(String, String)>), EngineError> {
    let devices: Vec<&str> = nics.iter().map(|n| n.desc.device.as_str()).collect();
    let gpu = format!("GPU{} ({})", buf.gpu().ordinal(), buf.gpu().pci_bus_id().unwrap_or("no PCI address"));
    let placement = placement::place(root, buf.gpu().pci_bus_id(), &devices, gpu_path_limit);
    for note in &placement.notes {
        tracing::warn!(agent = agent, memory = name, "{note}");
    }
    // Per NIC: its region, or why it has none.
    let mut regions: Vec<Option<MemoryRegion>> = vec![None; nics.len()];
    let mut why_not: Vec<Option<String>> = placement.places.iter().map(|p| if let Place::Skip(w) = p { Some(w.clone()) } else { None }).collect();
    let stage = |buf: GpuBuffer, why: String, regions: &mut Vec<Option<MemoryRegion>>| -> Result<(), EngineError> {
        let on = placement.stage_on;
        let line = format!("{gpu}: host-staged through {} (local side of transfers only, not in the metadata peers target): {why}", devices[on]);
        if policy == GpuPolicy::HostStaged {
            tracing::info!(agent = agent, memory = name, device = devices[on], "{line}");
        } else {
            tracing::warn!(agent = agent, memory = name, device = devices[on], "{line}");
        }
        regions[on] = Some(MemoryRegion::register_gpu(&nics[on].pd, buf, access(), GpuPolicy::HostStaged)?);
        Ok(())
    };
    let chosen = placement.chosen();
    if policy == GpuPolicy::HostStaged {
        stage(buf, "GpuPolicy::HostStaged".into(), &mut regions)?;
    } else if chosen.is_empty() {
        let why = placement.why_none();
        if policy == GpuPolicy::Require {
            return Err(EngineError::GpuPlacement { gpu, why });
        }
        stage(buf, format!("no NIC near enough for zero-copy: {why}"), &mut regions)?;
    } else {
        let mut buf = Some(buf);
        let mut first: Option<MemoryRegion> = None;
        for &i in &chosen {
            let got = match &first {
                None => MemoryRegion::register_gpu_direct(&nics[i].pd, buf.take().expect("back after each failed try"), access(), root)
                    .map_err(|(b, e)| {
                        buf = Some(b);
                        gpudirect::Error::Gdr(e)
                    }),
                Some(f) => f.register_gpu_in_at(&nics[i].pd, access(), root),
            };
            match got {
                Ok(r) => {
                    first.get_or_insert_with(|| r.clone());
                    regions[i] = Some(r);
                }
                Err(e) if policy == GpuPolicy::Require => return Err(e.into()),
                Err(e) => {
                    tracing::warn!(agent = agent, memory = name, device = devices[i], "{gpu} not registered on {}: {e}", devices[i]);
                    why_not[i] = Some(format!("zero-copy registration failed (GpuPolicy::Prefer skips it): {e}"));
                }
            }
        }
        if let Some(b) = buf.take() {
            stage(b, "no NIC could register it zero-copy".into(), &mut regions)?;
        }
    }
    let staged_on = devices[placement.stage_on];
    let skipped = regions
        .iter()
        .zip(why_not)
        .zip(&devices)
        .filter(|((r, _), _)| r.is_none())
        .map(|((_, why), d)| (d.to_string(), why.unwrap_or_else(|| format!("the memory is host-staged through {staged_on} (one host mirror)"))))
        .collect();
    Ok((regions, skipped))
}
