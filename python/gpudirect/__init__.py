"""gpudirect from Python: whether GPUDirect RDMA works here, for this job,
and what an NCCL log says about it.

The judging is the Rust library's (the same code as the ``gpudirect``
command); this package returns its reports as dicts. The transfer engine
comes next.

>>> import gpudirect
>>> report = gpudirect.doctor()
>>> report["verdict"]["line"]
'GPUDirect RDMA: ...'
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional, Union

import ctypes

from ._native import DoctorError, EngineError, GpudirectError, Request
from . import _native

__all__ = ["Agent", "Request", "doctor", "explain_nccl_log", "GpudirectError", "DoctorError", "EngineError"]


class Agent(_native.Agent):
    """An agent of the transfer engine (work in progress: host memory only)."""

    def register(self, name: str, buffer: Any) -> int:
        """Register a writable, C-contiguous buffer (bytearray, numpy array)
        under ``name``, in place; returns its length in bytes.

        The object stays alive, and a bytearray cannot be resized, until
        ``deregister(name)``: the registration holds a buffer export on it.
        """
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise EngineError(f"{name}: the buffer is read-only: register a writable one (bytearray, a numpy array)")
        # A ctypes view holds a buffer export for as long as it lives, on
        # every CPython from 3.9 (the buffer API is in the stable ABI only
        # from 3.11).
        keep = (ctypes.c_char * view.nbytes).from_buffer(view)
        return self._register_raw(name, ctypes.addressof(keep), view.nbytes, keep)

_Path = Union[str, "os.PathLike[str]"]


def _path(p: Optional[_Path]) -> Optional[str]:
    return None if p is None else os.fspath(p)


def doctor(
    *,
    env_file: Optional[_Path] = None,
    pid: Optional[int] = None,
    nccl_log: Optional[_Path] = None,
    capture: Optional[_Path] = None,
    from_capture: Optional[_Path] = None,
    gpu: Optional[int] = None,
    device: Optional[str] = None,
) -> Dict[str, Any]:
    """Judge this machine, or a capture, for the job's environment.

    Returns the report ``gpudirect doctor --json`` prints (schema in
    docs/doctor-json.md): ``report["verdict"]["available"]`` says whether
    NCCL will use GPUDirect RDMA here, ``report["verdict"]["line"]`` says it
    in a sentence, ``report["findings"]`` holds every check.

    The job's environment is this process's ``NCCL_*``/``UCX_*`` variables,
    or those of ``env_file`` (a job script; nothing in it runs), of process
    ``pid``, or those an NCCL log (``nccl_log``) shows NCCL read. With
    ``from_capture``, a capture written by ``capture=`` (or ``gpudirect
    doctor --capture``) is judged instead of this machine, with this
    process's variables laid over the captured ones.

    Raises DoctorError when an input cannot be read or a capture written.
    The GIL is released while the machine is probed.
    """
    text, _, _ = _native.doctor(
        env_file=_path(env_file),
        pid=pid,
        nccl_log=_path(nccl_log),
        capture=_path(capture),
        from_capture=_path(from_capture),
        gpu=gpu,
        device=device,
    )
    return json.loads(text)


def explain_nccl_log(text: str) -> Dict[str, Any]:
    """What an ``NCCL_DEBUG=INFO`` log says about GPUDirect RDMA.

    Returns the report ``gpudirect nccl-log --json`` prints:
    ``report["verdict"]`` is ``"used"``, ``"partial"``, ``"not-used"`` or
    ``"unknown"``; ``report["headline"]`` says it in a sentence (with the
    cost when not used); ``report["environment_judged"]`` judges the
    variables NCCL read by the doctor's rules.
    """
    out, _, _ = _native.explain_nccl_log(text)
    return json.loads(out)
