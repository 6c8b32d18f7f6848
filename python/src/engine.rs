//! The transfer engine from Python (work in progress: compiles, not yet
//! tested in the guest). An `Agent` over host memory from any writable,
//! C-contiguous buffer-protocol object; requests prepared from
//! `(local name, local offset, peer, remote name, remote offset, length)`
//! entries; posts and waits with the GIL released.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use pyo3::create_exception;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use gpudirect::engine::{self, AgentConfig, AgentMetadata, ClusterSecret, Op, Registration, TransferRequest, TransferStatus};
use gpudirect::Registerable;

use crate::GpudirectError;

create_exception!(_native, EngineError, GpudirectError, "A transfer-engine error: the message is the Rust EngineError's.");

fn err(e: impl std::fmt::Display) -> PyErr {
    EngineError::new_err(e.to_string())
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

/// An agent of the transfer engine (`gpudirect.Agent` adds `register`).
#[pyclass(module = "gpudirect._native", subclass)]
pub struct Agent {
    inner: Arc<engine::Agent>,
    regions: Mutex<HashMap<String, Registration>>,
}

#[pymethods]
impl Agent {
    #[new]
    #[pyo3(signature = (name, *, devices=None, listen=None, secret_file=None, insecure=false, timeout=30.0))]
    fn new(py: Python<'_>, name: String, devices: Option<Vec<String>>, listen: Option<String>, secret_file: Option<String>, insecure: bool, timeout: f64) -> PyResult<Agent> {
        let mut config = AgentConfig::named(name);
        if let Some(d) = devices {
            config.devices = d;
        }
        if let Some(l) = listen {
            config.listen = l.parse().map_err(|e| err(format!("listen address {l:?}: {e}")))?;
        }
        if let Some(f) = secret_file {
            config.secret = Some(ClusterSecret::from_file(&f).map_err(err)?);
        }
        config.insecure = insecure;
        config.timeout = Duration::try_from_secs_f64(timeout).map_err(|e| err(format!("timeout {timeout}: {e}")))?;
        let inner = py.detach(|| engine::Agent::new(config)).map_err(err)?;
        Ok(Agent { inner: Arc::new(inner), regions: Mutex::new(HashMap::new()) })
    }

    /// Registers `len` bytes at `addr`, exported by `keep` (the Python
    /// layer's ctypes view of a writable, C-contiguous buffer), under
    /// `name`; `keep` stays alive until `deregister`. Use
    /// `gpudirect.Agent.register`, which builds the view.
    fn _register_raw(&self, py: Python<'_>, name: String, addr: usize, len: usize, keep: Py<PyAny>) -> PyResult<usize> {
        if addr == 0 || len == 0 {
            return Err(err(format!("{name}: an empty buffer cannot be registered")));
        }
        let mem = PyMemory { _keep: keep, ptr: addr as *mut u8, len };
        let reg = py.detach(|| self.inner.register(&name, mem)).map_err(err)?;
        self.regions.lock().map_err(|_| err("a thread panicked holding the registrations"))?.insert(name, reg);
        Ok(len)
    }

    /// Removes a registration; its buffer is released once no request
    /// holds it.
    fn deregister(&self, name: &str) -> PyResult<()> {
        self.regions.lock().map_err(|_| err("a thread panicked holding the registrations"))?.remove(name);
        self.inner.deregister(name).map_err(err)
    }

    /// The agent's sealed metadata, for `load_remote` on its peers.
    fn metadata<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(PyBytes::new(py, &self.inner.metadata().encode().map_err(err)?))
    }

    /// Loads a peer's metadata; returns its name.
    fn load_remote(&self, md: &[u8]) -> PyResult<String> {
        let md = AgentMetadata::decode(md).map_err(err)?;
        Ok(self.inner.load_remote(&md).map_err(err)?.name().to_owned())
    }

    /// A request: `op` is "write" or "read"; each entry is `(local name,
    /// local offset, peer, remote name, remote offset, length)`.
    #[pyo3(signature = (op, entries, notify=None))]
    fn prepare(&self, op: &str, entries: Vec<(String, usize, String, String, u64, usize)>, notify: Option<Vec<u8>>) -> PyResult<Request> {
        let op = match op {
            "write" => Op::Write,
            "read" => Op::Read,
            _ => return Err(err(format!("op {op:?}: use \"write\" or \"read\""))),
        };
        let regions = self.regions.lock().map_err(|_| err("a thread panicked holding the registrations"))?;
        let mut list = Vec::with_capacity(entries.len());
        for (local, loff, peer, remote, roff, len) in entries {
            let reg = regions.get(&local).ok_or_else(|| err(format!("no registration named {local:?}")))?;
            let l = reg.range(loff..loff.checked_add(len).ok_or_else(|| err("offset + length overflows"))?).map_err(err)?;
            let rmem = self.inner.peer(&peer).map_err(err)?.memory(&remote).map_err(err)?;
            let r = rmem.range(roff..roff.checked_add(len as u64).ok_or_else(|| err("offset + length overflows"))?).map_err(err)?;
            list.push((l, r));
        }
        let req = self.inner.prepare(op, &list, notify.as_deref()).map_err(err)?;
        Ok(Request { inner: req })
    }

    /// Notifications delivered so far, as `(peer, bytes)`.
    fn notifications<'py>(&self, py: Python<'py>) -> PyResult<Vec<(String, Bound<'py, PyBytes>)>> {
        let got = py.detach(|| self.inner.notifications()).map_err(err)?;
        Ok(got.into_iter().map(|n| (n.peer, PyBytes::new(py, &n.msg))).collect())
    }

    /// Waits for the next notification (`timeout` seconds, or forever).
    #[pyo3(signature = (timeout=None))]
    fn wait_notification<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<(String, Bound<'py, PyBytes>)> {
        let timeout = timeout.map(Duration::try_from_secs_f64).transpose().map_err(err)?;
        let n = py.detach(|| self.inner.wait_notification(timeout)).map_err(err)?;
        Ok((n.peer, PyBytes::new(py, &n.msg)))
    }
}

/// A prepared request: post it, then wait or poll its status.
#[pyclass(module = "gpudirect._native")]
pub struct Request {
    inner: TransferRequest,
}

#[pymethods]
impl Request {
    /// Posts the request (again, once done).
    fn post(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.inner.post()).map_err(err)
    }

    /// "idle", "in-flight" or "done".
    fn status(&self) -> PyResult<&'static str> {
        Ok(match self.inner.status().map_err(err)? {
            TransferStatus::Idle => "idle",
            TransferStatus::InFlight => "in-flight",
            TransferStatus::Done => "done",
        })
    }

    /// Waits until every byte is in place (`timeout` seconds, or forever).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = timeout.map(Duration::try_from_secs_f64).transpose().map_err(err)?;
        py.detach(|| self.inner.wait(timeout)).map_err(err)
    }
}

/// Adds the engine's classes to the module.
pub fn add(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Agent>()?;
    m.add_class::<Request>()?;
    m.add("EngineError", m.py().get_type::<EngineError>())?;
    Ok(())
}
