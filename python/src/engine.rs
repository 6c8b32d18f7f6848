//! The transfer engine from Python: `Agent` over host memory from any
//! writable, C-contiguous buffer-protocol object; requests prepared from
//! `(local name, local offset, peer, remote name, remote offset, length)`
//! entries; posts and waits with the GIL released; the readiness
//! descriptor and never-blocking polls that `gpudirect/_aio.py` puts on an
//! asyncio loop; statistics as dicts (the agent's whole snapshot too,
//! and its metrics endpoint's address); publish and lookup through a
//! rendezvous server.

use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use gpudirect_engine::{
    AgentConfig, AgentMetadata, AgentStats, Broadcast as RustBroadcast, BroadcastRefusals, ClusterSecret, EngineError as Rust, Histogram, Op,
    ReceiverStatus, RendezvousConfig, RendezvousServer as RustServer, TcpRendezvous, TransferRequest, TransferStats, TransferStatus, LATENCY_BOUNDS, METRICS_ENV,
};
use gpudirect::{Gpu, GpuBuffer, GpuPolicy, Registerable};

use crate::errors::{to_py, ConfigError};

fn seconds(what: &str, s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s).map_err(|e| PyValueError::new_err(format!("{what} {s}: {e}")))
}

/// A request's or broadcast's status as Python sees it.
fn status_name(s: TransferStatus) -> &'static str {
    match s {
        TransferStatus::Idle => "idle",
        TransferStatus::InFlight => "in-flight",
        TransferStatus::Done => "done",
    }
}

/// The cluster secret in the file `path` names, if given.
fn secret_from(path: Option<String>) -> PyResult<Option<ClusterSecret>> {
    path.map(|f| ClusterSecret::from_file(&f).map_err(|source| to_py(Rust::Auth { peer: format!("secret file {f}"), source }))).transpose()
}

/// Where the metrics endpoint goes: `metrics` parsed as
/// `GPUDIRECT_METRICS` is (a port alone on loopback, or IP:PORT; empty:
/// none), or, when not given, `GPUDIRECT_METRICS` itself.
fn metrics_from(metrics: Option<String>) -> PyResult<Option<SocketAddr>> {
    let Some(v) = metrics else {
        return gpudirect_engine::metrics_addr().map_err(to_py);
    };
    let t = v.trim();
    if t.is_empty() {
        return Ok(None);
    }
    gpudirect_engine::parse_metrics_addr(t).map(Some).map_err(|_| ConfigError::new_err(format!("metrics={v:?}: a port (served on loopback) or IP:PORT, as {METRICS_ENV}")))
}

/// False when `status` says it was never posted: waiting for that would
/// return at once and hide the missing `post()`. A failed status is left
/// to the wait, which raises it.
fn posted_status(status: &Result<TransferStatus, gpudirect_engine::EngineError>) -> bool {
    !matches!(status, Ok(TransferStatus::Idle))
}

/// The error of a wait or an await on a `what` never posted.
fn never_posted(what: &str) -> PyErr {
    crate::errors::EngineError::new_err(format!("this {what} was never posted (or its post was refused): call post() first, then wait or await"))
}

/// What a transfer request and a broadcast share, so that their Python
/// classes post, wait and are awaited by one code path each.
trait Postable: Sync {
    /// How an error names it.
    const KIND: &'static str;
    /// The asyncio driver in `gpudirect._aio` that awaits it.
    const AWAIT: &'static str;
    fn status(&self) -> Result<TransferStatus, Rust>;
    fn wait(&self, timeout: Option<Duration>) -> Result<(), Rust>;
}

impl Postable for TransferRequest {
    const KIND: &'static str = "request";
    const AWAIT: &'static str = "completed";
    fn status(&self) -> Result<TransferStatus, Rust> {
        TransferRequest::status(self)
    }
    fn wait(&self, timeout: Option<Duration>) -> Result<(), Rust> {
        TransferRequest::wait(self, timeout)
    }
}

impl Postable for RustBroadcast {
    const KIND: &'static str = "broadcast";
    const AWAIT: &'static str = "settled";
    fn status(&self) -> Result<TransferStatus, Rust> {
        RustBroadcast::status(self)
    }
    fn wait(&self, timeout: Option<Duration>) -> Result<(), Rust> {
        RustBroadcast::wait(self, timeout)
    }
}

/// `wait(timeout)` of either, without the GIL; one never posted raises.
/// The check and the wait share one release of the GIL: each release and
/// retake costs about 160 user-space instructions (`testbed/python-insns`).
fn wait_on<T: Postable>(py: Python<'_>, inner: &T, timeout: Option<f64>) -> PyResult<()> {
    let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
    let waited = py.detach(|| {
        let status = inner.status();
        posted_status(&status).then(|| inner.wait(timeout))
    });
    match waited {
        Some(r) => r.map_err(to_py),
        None => Err(never_posted(T::KIND)),
    }
}

/// `await` of either, on the running asyncio loop (`gpudirect._aio`).
fn await_on<'py, T: Postable>(slf: &Bound<'py, PyAny>, inner: &T) -> PyResult<Bound<'py, PyAny>> {
    if !posted_status(&slf.py().detach(|| inner.status())) {
        return Err(never_posted(T::KIND));
    }
    let aio = slf.py().import("gpudirect._aio")?;
    aio.call_method1(T::AWAIT, (slf,))?.call_method0("__await__")
}

fn poisoned() -> PyErr {
    ConfigError::new_err("a thread panicked holding this agent's handle")
}

/// A Python object's bytes, registered in place. `keep` is the object that
/// holds a buffer export on them (the Python layer's ctypes view: the
/// buffer API is not in the stable ABI before CPython 3.11): while it
/// lives, the bytes stay at `ptr` and a bytearray cannot be resized.
struct PyMemory {
    _keep: Py<PyAny>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only handed to the NIC (the region never reads or
// writes through it), and the object holding the export may be released
// from any thread (PyO3 defers the decref to a thread holding the GIL).
unsafe impl Send for PyMemory {}
// SAFETY: as for Send: no shared access goes through the pointer.
unsafe impl Sync for PyMemory {}

// SAFETY: `_keep`'s export pins the object's bytes at `ptr` for `len` bytes
// until it is dropped with the region; this crate never reads or writes them
// through Rust (Python code and the NIC do, as with any registered memory).
unsafe impl Registerable for PyMemory {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
}

fn stats_dict<'py>(py: Python<'py>, s: TransferStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("posts", s.posts)?;
    d.set_item("bytes", s.bytes)?;
    d.set_item("completed", s.completed)?;
    d.set_item("failed", s.failed)?;
    d.set_item("refused", s.refused)?;
    d.set_item("connects", s.connects)?;
    Ok(d)
}

/// An op as Python spells it (`gpudirect.types.Op`).
fn op_name(op: Op) -> &'static str {
    match op {
        Op::Write => "write",
        Op::Read => "read",
    }
}

/// Broadcast refusals by reason (`gpudirect.types.BroadcastRefusals`).
fn broadcast_refusals_dict<'py>(py: Python<'py>, r: BroadcastRefusals) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for (k, v) in [
        ("forged", r.forged),
        ("unknown", r.unknown),
        ("not_owner", r.not_owner),
        ("unpublished", r.unpublished),
        ("unknown_peers", r.unknown_peers),
        ("busy", r.busy),
        ("malformed", r.malformed),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// A latency histogram: `bounds` (seconds), `counts` per bucket (not
/// cumulative; one more than `bounds`, the last above every bound),
/// `count`, `sum_seconds`.
fn histogram_dict<'py>(py: Python<'py>, h: Histogram) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bounds", LATENCY_BOUNDS.to_vec())?;
    d.set_item("counts", h.counts)?;
    d.set_item("count", h.count)?;
    d.set_item("sum_seconds", h.sum_seconds)?;
    Ok(d)
}

/// `Agent.stats()`: the snapshot as nested dicts (`gpudirect.types.AgentStats`).
fn agent_stats_dict<'py>(py: Python<'py>, s: AgentStats) -> PyResult<Bound<'py, PyDict>> {
    let nics = s
        .nics
        .into_iter()
        .map(|n| {
            let traffic = n
                .traffic
                .into_iter()
                .map(|t| {
                    let d = PyDict::new(py);
                    d.set_item("direction", t.direction.as_str())?;
                    d.set_item("path", t.path.as_str())?;
                    d.set_item("bytes", t.bytes)?;
                    d.set_item("posts", t.posts)?;
                    Ok(d)
                })
                .collect::<PyResult<Vec<_>>>()?;
            let d = PyDict::new(py);
            d.set_item("device", n.device)?;
            d.set_item("traffic", traffic)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let ops = s
        .ops
        .into_iter()
        .map(|o| {
            let d = PyDict::new(py);
            d.set_item("op", op_name(o.op))?;
            d.set_item("requests", stats_dict(py, o.requests)?)?;
            d.set_item("latency", histogram_dict(py, o.latency)?)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let peers = s
        .peers
        .into_iter()
        .map(|p| {
            let d = PyDict::new(py);
            d.set_item("name", p.name)?;
            d.set_item("requests", stats_dict(py, p.requests)?)?;
            d.set_item("connections", p.connections)?;
            Ok(d)
        })
        .collect::<PyResult<Vec<_>>>()?;
    let other = PyDict::new(py);
    other.set_item("peers", s.other_peers.peers)?;
    other.set_item("requests", stats_dict(py, s.other_peers.requests)?)?;
    other.set_item("connections", s.other_peers.connections)?;
    let events = PyDict::new(py);
    events.set_item("lost", s.peer_events.lost)?;
    events.set_item("replaced", s.peer_events.replaced)?;
    events.set_item("impostors", s.peer_events.impostors)?;
    let refusals = PyDict::new(py);
    refusals.set_item("control", s.refusals.control)?;
    refusals.set_item("unknown_sender", s.refusals.unknown_sender)?;
    refusals.set_item("metadata_seal", s.refusals.metadata_seal)?;
    refusals.set_item("broadcast", broadcast_refusals_dict(py, s.refusals.broadcast)?)?;
    let d = PyDict::new(py);
    d.set_item("agent", s.agent)?;
    d.set_item("uptime_seconds", s.uptime.as_secs_f64())?;
    d.set_item("nics", nics)?;
    d.set_item("ops", ops)?;
    d.set_item("peers", peers)?;
    d.set_item("other_peers", other)?;
    d.set_item("connections", s.connections)?;
    d.set_item("peer_events", events)?;
    d.set_item("refusals", refusals)?;
    Ok(d)
}

/// An agent of the transfer engine (`gpudirect.Agent` adds `register`
/// and `notification`).
#[pyclass(module = "gpudirect._native", subclass)]
pub struct Agent {
    /// `None` once closed.
    inner: RwLock<Option<Arc<gpudirect_engine::Agent>>>,
    name: String,
}

impl Agent {
    /// The agent, unless it was closed.
    fn agent(&self) -> PyResult<Arc<gpudirect_engine::Agent>> {
        let inner = self.inner.read().map_err(|_| poisoned())?;
        inner.clone().ok_or_else(|| {
            crate::errors::EngineError::new_err(format!(
                "the agent {:?} is closed (close() or the end of its with block): make a new Agent",
                self.name
            ))
        })
    }
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (name, *, devices=None, listen=None, secret_file=None, insecure=false, timeout=30.0, qps_per_rail=None, max_connections=None, metrics=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        name: String,
        devices: Option<Vec<String>>,
        listen: Option<String>,
        secret_file: Option<String>,
        insecure: bool,
        timeout: f64,
        qps_per_rail: Option<u8>,
        max_connections: Option<usize>,
        metrics: Option<String>,
    ) -> PyResult<Agent> {
        let mut config = AgentConfig::named(name);
        config.qps_per_rail = qps_per_rail;
        if let Some(n) = max_connections {
            config.max_connections = n;
        }
        if let Some(d) = devices {
            config.devices = d;
        }
        if let Some(l) = listen {
            config.listen = l.parse().map_err(|e| PyValueError::new_err(format!("listen address {l:?}: {e} (give IP:PORT)")))?;
        }
        config.secret = secret_from(secret_file)?;
        config.insecure = insecure;
        config.timeout = seconds("timeout", timeout)?;
        config.metrics = metrics_from(metrics)?;
        let inner = py.detach(|| gpudirect_engine::Agent::new(config)).map_err(to_py)?;
        let name = inner.name().to_owned();
        Ok(Agent { inner: RwLock::new(Some(Arc::new(inner))), name })
    }

    /// This agent's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Closes the agent now rather than when it is collected: its
    /// registrations are dropped (each buffer is released once no request
    /// holds it), its control port stops listening and, once no request
    /// or broadcast holds them, its NICs' resources go. Every later call
    /// on it raises `EngineError`; requests already made keep working or
    /// fail on their own. Closing twice does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let agent = self.inner.write().map_err(|_| poisoned())?.take();
        // Joining the listener thread waits: without the GIL.
        py.detach(move || drop(agent));
        Ok(())
    }


    /// Where its control port listens, as "IP:PORT".
    #[getter]
    fn control_addr(&self) -> PyResult<String> {
        Ok(self.agent()?.control_addr().to_string())
    }

    /// Where its metrics endpoint listens, as "IP:PORT" (the port it got
    /// when 0 was asked for); `None` when it serves none.
    #[getter]
    fn metrics_addr(&self) -> PyResult<Option<String>> {
        Ok(self.agent()?.metrics_addr().map(|a| a.to_string()))
    }

    /// What the agent did so far, in one snapshot (what its metrics
    /// endpoint serves): per NIC the bytes and posts by direction and
    /// path, per op the requests and their latency histogram, the busiest
    /// peers and the rest summed, connections, peer events, refusals.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        // Relaxed loads and a few short table reads: no need to release the GIL.
        agent_stats_dict(py, self.agent()?.stats())
    }

    /// Registers `len` bytes at `addr`, exported by `keep` (the Python
    /// layer's ctypes view of a writable, C-contiguous buffer), under
    /// `name`; `keep` stays alive until `deregister`. Use
    /// `gpudirect.Agent.register`, which builds the view.
    fn _register_raw(&self, py: Python<'_>, name: String, addr: usize, len: usize, keep: Py<PyAny>) -> PyResult<usize> {
        if addr == 0 || len == 0 {
            return Err(PyValueError::new_err(format!("{name}: an empty buffer cannot be registered")));
        }
        let mem = PyMemory { _keep: keep, ptr: addr as *mut u8, len };
        let agent = self.agent()?;
        py.detach(|| agent.register(&name, mem)).map_err(to_py)?;
        Ok(len)
    }

    /// Registers `len` bytes of GPU `gpu`'s memory at device address `ptr`
    /// under `name`, holding `keep` (the object owning the memory) until
    /// the registration and every request naming it are gone. The range is
    /// judged before anything is registered (VMM mappings, pools,
    /// alignment). `policy`: "require", "prefer" or "host-staged". Use
    /// `gpudirect.Agent.register_gpu`, which reads the pointer from
    /// `__cuda_array_interface__` or DLPack.
    #[allow(clippy::too_many_arguments)] // Python's call, one argument each
    fn _register_gpu_raw(&self, py: Python<'_>, name: String, gpu: usize, ptr: u64, len: usize, keep: Py<PyAny>, policy: &str) -> PyResult<usize> {
        let policy = match policy {
            "require" => GpuPolicy::Require,
            "prefer" => GpuPolicy::Prefer,
            "host-staged" => GpuPolicy::HostStaged,
            _ => return Err(PyValueError::new_err(format!("policy {policy:?}: use \"require\", \"prefer\" or \"host-staged\""))),
        };
        let agent = self.agent()?;
        py.detach(|| {
                let g = Gpu::open(gpu)?;
                // SAFETY: `keep` owns the memory (the Python object the
                // pointer came from, which frees it only when it goes),
                // and the buffer holds it for as long as it lives.
                let buf = unsafe { GpuBuffer::from_raw_owned(&g, ptr, len, Box::new(keep)) }?;
                agent.register_gpu(&name, buf, policy)
            })
            .map_err(to_py)?;
        Ok(len)
    }

    /// What a registration is: `{"name", "nbytes", "took" (seconds),
    /// "paths": [(device, how the NIC reaches it)], "skipped": [(device,
    /// why)]}`.
    fn registration<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let reg = self.agent()?.registration(name).map_err(to_py)?;
        let d = PyDict::new(py);
        d.set_item("name", reg.name())?;
        d.set_item("nbytes", reg.len())?;
        d.set_item("took", reg.took().as_secs_f64())?;
        d.set_item("paths", reg.paths().into_iter().map(|(dev, loc)| (dev, loc.to_string())).collect::<Vec<_>>())?;
        d.set_item("skipped", reg.skipped().to_vec())?;
        Ok(d)
    }

    /// Removes a registration; its buffer is released once no request
    /// holds it (drop or re-prepare the requests that name it).
    fn deregister(&self, name: &str) -> PyResult<()> {
        self.agent()?.deregister(name).map_err(to_py)
    }

    /// The agent's sealed metadata, for `load_remote` on its peers.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.agent()?.metadata().encode().map_err(|e| to_py(e.into()))?))
    }

    /// Loads a peer's metadata; returns its name.
    fn load_remote(&self, py: Python<'_>, md: &[u8]) -> PyResult<String> {
        let md = AgentMetadata::decode(md).map_err(|e| to_py(e.into()))?;
        let agent = self.agent()?;
        py.detach(|| agent.load_remote(&md).map(|p| p.name().to_owned())).map_err(to_py)
    }

    /// Publishes this agent's metadata in the rendezvous (again after
    /// registering more).
    fn publish(&self, py: Python<'_>, rendezvous: &Rendezvous) -> PyResult<()> {
        let agent = self.agent()?;
        py.detach(|| agent.publish(&rendezvous.inner)).map_err(to_py)
    }

    /// Looks the agent `name` up in the rendezvous, waiting up to `timeout`
    /// seconds for it to be published, and loads it; returns its name.
    #[pyo3(signature = (name, rendezvous, timeout=30.0))]
    fn lookup(&self, py: Python<'_>, name: &str, rendezvous: &Rendezvous, timeout: f64) -> PyResult<String> {
        let t = seconds("timeout", timeout)?;
        let agent = self.agent()?;
        py.detach(|| agent.lookup(name, &rendezvous.inner, t).map(|p| p.name().to_owned())).map_err(to_py)
    }

    /// A request: `op` is "write" or "read"; each entry is `(local name,
    /// local offset, peer, remote name, remote offset, length)`.
    #[pyo3(signature = (op, entries, notify=None))]
    fn prepare(slf: &Bound<'_, Self>, op: &str, entries: Vec<(String, usize, String, String, u64, usize)>, notify: Option<Vec<u8>>) -> PyResult<Request> {
        let this = slf.borrow();
        let op = match op {
            "write" => Op::Write,
            "read" => Op::Read,
            _ => return Err(PyValueError::new_err(format!("op {op:?}: use \"write\" or \"read\""))),
        };
        let range = |e: gpudirect::Error| PyValueError::new_err(e.to_string());
        let agent = this.agent()?;
        let mut list = Vec::with_capacity(entries.len());
        for (local, loff, peer, remote, roff, len) in entries {
            let reg = agent.registration(&local).map_err(to_py)?;
            let l = reg.range(loff..loff.checked_add(len).ok_or_else(|| PyValueError::new_err("offset + length overflows"))?).map_err(range)?;
            let rmem = this.agent()?.peer(&peer).map_err(to_py)?.memory(&remote).map_err(to_py)?;
            let r = rmem.range(roff..roff.checked_add(len as u64).ok_or_else(|| PyValueError::new_err("offset + length overflows"))?).map_err(range)?;
            list.push((l, r));
        }
        let req = this.agent()?.prepare(op, &list, notify.as_deref()).map_err(to_py)?;
        Ok(Request { inner: req, agent: slf.clone().into_any().unbind() })
    }

    /// A broadcast of `length` bytes of local memory `source` from
    /// `offset` into each target `(peer, remote name, remote offset)`,
    /// each receiver notified `notify` once its copy is whole.
    #[pyo3(signature = (source, offset, length, targets, notify))]
    fn broadcast(slf: &Bound<'_, Self>, source: &str, offset: usize, length: usize, targets: Vec<(String, String, u64)>, notify: Vec<u8>) -> PyResult<Broadcast> {
        let this = slf.borrow();
        let range = |e: gpudirect::Error| PyValueError::new_err(e.to_string());
        let end = offset.checked_add(length).ok_or_else(|| PyValueError::new_err("offset + length overflows"))?;
        let local = this.agent()?.registration(source).map_err(to_py)?.range(offset..end).map_err(range)?;
        let mut list = Vec::with_capacity(targets.len());
        for (peer, remote, roff) in targets {
            let rmem = this.agent()?.peer(&peer).map_err(to_py)?.memory(&remote).map_err(to_py)?;
            let rend = roff.checked_add(length as u64).ok_or_else(|| PyValueError::new_err("offset + length overflows"))?;
            list.push(rmem.range(roff..rend).map_err(range)?);
        }
        let inner = this.agent()?.broadcast(&local, &list, &notify).map_err(to_py)?;
        Ok(Broadcast { inner, agent: slf.clone().into_any().unbind() })
    }

    /// Notifications delivered so far, as `(peer, bytes)`.
    fn notifications<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let agent = self.agent()?;
        let got = py.detach(|| agent.notifications()).map_err(to_py)?;
        Ok(got.into_iter().map(|n| (n.peer, PyBytes::new(py, &n.msg))).collect())
    }

    /// Waits for the next notification (`timeout` seconds, or forever).
    #[pyo3(signature = (timeout=None))]
    fn wait_notification<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let timeout = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let agent = self.agent()?;
        let n = py.detach(|| agent.wait_notification(timeout)).map_err(to_py)?;
        Ok((n.peer, PyBytes::new(py, &n.msg)))
    }

    /// The descriptor an event loop watches (readable: poll again).
    fn _event_fd(&self) -> PyResult<i32> {
        Ok(self.agent()?.readiness().map_err(to_py)?.as_raw_fd())
    }

    /// Takes the events that made the descriptor readable.
    fn _clear_events(&self) -> PyResult<()> {
        self.agent()?.readiness().map_err(to_py)?.clear().map_err(|e| to_py(e.into()))
    }

    /// The next notification if one is here; `None` arms the descriptor.
    fn _poll_notification<'py>(&self, py: Python<'py>) -> PyResult<Option<(String, Bound<'py, PyBytes>)>> {
        // Reaping takes locks other threads hold while they post: without
        // the GIL, as every call that may wait on another thread.
        let agent = self.agent()?;
        let n = py.detach(|| agent.poll_notification()).map_err(to_py)?;
        Ok(n.map(|n| (n.peer, PyBytes::new(py, &n.msg))))
    }

    /// What each NIC carried: `[{"device", "bytes", "posts", "qp_bytes"}]`.
    fn nic_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.agent()?
            .nic_stats()
            .into_iter()
            .map(|s| {
                let d = PyDict::new(py);
                d.set_item("device", s.device)?;
                d.set_item("bytes", s.bytes)?;
                d.set_item("posts", s.posts)?;
                d.set_item("qp_bytes", s.qp_bytes)?;
                Ok(d)
            })
            .collect()
    }

    /// What every request to the peer did (`posts`, `bytes`, `completed`,
    /// `failed`, `refused`, `connects`); `None` before one was prepared.
    fn peer_stats<'py>(&self, py: Python<'py>, peer: &str) -> PyResult<Option<Bound<'py, PyDict>>> {
        self.agent()?.peer_stats(peer).map(|s| stats_dict(py, s)).transpose()
    }

    /// Connections alive now (set up by either side).
    fn connections(&self) -> PyResult<usize> {
        Ok(self.agent()?.connections())
    }

    /// What happened to peers since the last call: `(events, dropped)`,
    /// each event a dict (`kind` "lost" with `peer` and `completion`,
    /// "replaced" with `peer`, `old` and `new` instance ids, or "impostor"
    /// with `peer`, `control` and `gid`: connections made under a peer's
    /// name from elsewhere than its metadata, retired when it was loaded).
    fn peer_events<'py>(&self, py: Python<'py>) -> PyResult<(Vec<Bound<'py, PyDict>>, u64)> {
        let (events, dropped) = self.agent()?.peer_events();
        let events = events
            .into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                match e {
                    gpudirect_engine::PeerEvent::Lost { peer, completion } => {
                        d.set_item("kind", "lost")?;
                        d.set_item("peer", peer)?;
                        d.set_item("completion", completion.to_string())?;
                    }
                    gpudirect_engine::PeerEvent::Replaced { peer, old, new } => {
                        d.set_item("kind", "replaced")?;
                        d.set_item("peer", peer)?;
                        d.set_item("old", old)?;
                        d.set_item("new", new)?;
                    }
                    gpudirect_engine::PeerEvent::Impostor { peer, control, gid } => {
                        d.set_item("kind", "impostor")?;
                        d.set_item("peer", peer)?;
                        d.set_item("control", control.to_string())?;
                        d.set_item("gid", gid.to_string())?;
                    }
                    other => d.set_item("kind", format!("{other:?}"))?,
                }
                Ok(d)
            })
            .collect::<PyResult<_>>()?;
        Ok((events, dropped))
    }

    /// Control requests refused so far (unproven, not as loaded, malformed).
    fn refused_requests(&self) -> PyResult<u64> {
        Ok(self.agent()?.refused_requests())
    }

    /// Broadcast messages this agent refused, by reason: a dict of
    /// `forged`, `unknown`, `not_owner`, `unpublished`, `unknown_peers`,
    /// `busy` and `malformed` counts (each also logged with the peer).
    fn broadcast_refusals<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        broadcast_refusals_dict(py, self.agent()?.broadcast_refusals())
    }
}

/// A prepared request: post it, then wait, poll its status, or `await` it.
#[pyclass(module = "gpudirect._native")]
pub struct Request {
    inner: TransferRequest,
    /// The Python agent, for `await` (its asyncio driver).
    #[pyo3(get, name = "agent")]
    agent: Py<PyAny>,
}

#[pymethods]
impl Request {
    /// Posts the request (again, once done); connects on first use.
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.post()).map_err(to_py)
    }

    /// "idle", "in-flight" or "done"; raises the failure of a failed post.
    fn status(&self, py: Python<'_>) -> PyResult<&'static str> {
        py.detach(|| self.inner.status()).map(status_name).map_err(to_py)
    }

    /// Waits until every byte is in place (`timeout` seconds, or forever).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        wait_on(py, &self.inner, timeout)
    }

    /// Gives up on the post in flight: it fails with `AbortedError`, its
    /// connection is flushed and retired (other posts on it fail too);
    /// whether one was in flight.
    fn abort(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.abort()).map_err(to_py)
    }

    /// Whether the last post finished, never waiting; `False` arms the
    /// agent's descriptor.
    fn _poll_completed(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.poll_completed()).map_err(to_py)
    }

    /// `await request`: until the last post finished, on the running
    /// asyncio loop (`gpudirect._aio`).
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        await_on(slf.as_any(), &slf.borrow().inner)
    }

    /// The peer it targets.
    #[getter]
    fn peer(&self) -> &str {
        self.inner.peer()
    }

    /// Bytes it moves per post.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.bytes()
    }

    /// What this request did so far (as `Agent.peer_stats`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        stats_dict(py, self.inner.stats())
    }
}

/// A prepared broadcast (`Agent.broadcast`): `post`, then `wait`,
/// `status` or `await`.
#[pyclass(module = "gpudirect._native")]
pub struct Broadcast {
    inner: RustBroadcast,
    /// The Python agent, for `await` (its asyncio driver).
    #[pyo3(get, name = "agent")]
    agent: Py<PyAny>,
}

#[pymethods]
impl Broadcast {
    /// Posts it (again, once the last post settled).
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.post()).map_err(to_py)
    }

    /// "idle", "in-flight" or "done"; raises `BroadcastIncompleteError`
    /// once settled with receivers that did not get the data.
    fn status(&self, py: Python<'_>) -> PyResult<&'static str> {
        py.detach(|| self.inner.status()).map(status_name).map_err(to_py)
    }

    /// Waits until every receiver is whole or named failed (`timeout`
    /// seconds, or forever).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        wait_on(py, &self.inner, timeout)
    }

    /// Whether the last post settled, never waiting; `False` arms the
    /// agent's descriptor (look again within a second regardless).
    fn _poll_completed(&self, py: Python<'_>) -> PyResult<bool> {
        py.detach(|| self.inner.poll_completed()).map_err(to_py)
    }

    /// `await broadcast`: until the last post settled, on the running
    /// asyncio loop (`gpudirect._aio`).
    fn __await__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        await_on(slf.as_any(), &slf.borrow().inner)
    }

    /// Each receiver and how it stands: "pending", "whole" or
    /// "failed: <why>".
    fn receivers(&self) -> Vec<(String, String)> {
        self.inner
            .receivers()
            .into_iter()
            .map(|(n, s)| {
                let s = match s {
                    ReceiverStatus::Pending => "pending".to_owned(),
                    ReceiverStatus::Whole => "whole".to_owned(),
                    ReceiverStatus::Failed(why) => format!("failed: {why}"),
                };
                (n, s)
            })
            .collect()
    }

    /// Bytes each receiver gets.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.bytes()
    }
}

/// A client of a rendezvous server, proving the environment's cluster
/// secret (`GPUDIRECT_SECRET_FILE`, `GPUDIRECT_SECRET`); each request is
/// bounded by `timeout` seconds.
#[pyclass(module = "gpudirect._native", frozen)]
pub struct Rendezvous {
    inner: TcpRendezvous,
}

#[pymethods]
impl Rendezvous {
    #[new]
    #[pyo3(signature = (server, *, timeout=10.0, secret_file=None))]
    fn new(server: &str, timeout: f64, secret_file: Option<String>) -> PyResult<Rendezvous> {
        let mut inner = TcpRendezvous::new(server, seconds("timeout", timeout)?).map_err(to_py)?;
        if let Some(secret) = secret_from(secret_file)? {
            inner = inner.with_secret(secret);
        }
        Ok(Rendezvous { inner })
    }
}

/// A rendezvous server in this process (`gpudirect rendezvous` as a
/// command), serving until `close()` or until it is dropped.
#[pyclass(module = "gpudirect._native")]
pub struct RendezvousServer {
    inner: Option<RustServer>,
}

#[pymethods]
impl RendezvousServer {
    /// Binds `listen` ("IP:PORT"; port 0: a free one). A network address
    /// needs the cluster's secret: `secret_file`, or the environment's.
    #[new]
    #[pyo3(signature = (listen="127.0.0.1:0", *, secret_file=None))]
    fn new(py: Python<'_>, listen: &str, secret_file: Option<String>) -> PyResult<RendezvousServer> {
        let config = RendezvousConfig { secret: secret_from(secret_file)?, ..RendezvousConfig::default() };
        let s = py.detach(|| RustServer::bind_with(listen, config)).map_err(to_py)?;
        Ok(RendezvousServer { inner: Some(s) })
    }

    /// Where it listens, as "IP:PORT".
    #[getter]
    fn addr(&self) -> PyResult<String> {
        self.inner.as_ref().map(|s| s.addr().to_string()).ok_or_else(|| ConfigError::new_err("the rendezvous server is closed"))
    }

    /// Stops serving.
    fn close(&mut self, py: Python<'_>) {
        if let Some(s) = self.inner.take() {
            py.detach(|| drop(s));
        }
    }
}

/// Adds the engine's classes and exceptions to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Agent>()?;
    m.add_class::<Request>()?;
    m.add_class::<Broadcast>()?;
    m.add_class::<Rendezvous>()?;
    m.add_class::<RendezvousServer>()?;
    crate::errors::add(m)?;
    m.add_function(wrap_pyfunction!(crate::errors::_error_kinds, m)?)?;
    Ok(())
}
