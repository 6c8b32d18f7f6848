"""Where a framework's GPU array lives: the device pointer, the byte count
and the GPU, read from ``__cuda_array_interface__`` (PyTorch, CuPy, Numba)
or DLPack (``__dlpack__``/``__dlpack_device__``: JAX, PyTorch, CuPy).
Only contiguous, writable CUDA memory is accepted; anything else is a
``ValueError`` saying why."""

from __future__ import annotations

import ctypes
import math
from typing import Any, Optional, Tuple

# DLPack's DLDeviceType values for CUDA memory the NIC may be given.
_KDLCUDA = 2
_DL_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDA host (pinned)", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 10: "ROCm", 13: "CUDA managed"}


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _c_contiguous(shape, strides, itemsize: int) -> bool:
    """Whether ``strides`` (in elements, or None) lay ``shape`` out in C order."""
    if strides is None:
        return True
    expect = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def _from_cai(cai: dict) -> Tuple[int, int]:
    ptr, readonly = cai["data"]
    if readonly:
        raise ValueError("the CUDA array is read-only: register a writable one")
    shape = tuple(cai["shape"])
    itemsize = int(cai["typestr"][2:])
    strides = cai.get("strides")
    if strides is not None:
        if any(s % itemsize for s in strides):
            raise ValueError("the CUDA array's strides are not whole elements: register a contiguous one")
        strides = [s // itemsize for s in strides]
    if not _c_contiguous(shape, strides, itemsize):
        raise ValueError("the CUDA array is not C-contiguous: register a contiguous one (.contiguous(), cupy.ascontiguousarray)")
    return int(ptr or 0), math.prod(shape) * itemsize


def _from_dlpack(obj: Any) -> Tuple[int, int, int]:
    dev_type, dev_id = obj.__dlpack_device__()
    if int(dev_type) != _KDLCUDA:
        name = _DL_NAMES.get(int(dev_type), f"type {int(dev_type)}")
        raise ValueError(f"the array is in {name} memory, not CUDA device memory: register host memory with register()")
    capsule = obj.__dlpack__()
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    # The capsule stays unconsumed ("dltensor"): its destructor releases
    # the producer's reference when it goes; `obj` keeps the memory.
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    shape = [t.shape[i] for i in range(t.ndim)]
    bits = t.dtype.bits * t.dtype.lanes
    if bits % 8:
        raise ValueError(f"the array's elements are {bits} bits: register whole bytes")
    itemsize = bits // 8
    strides = None if not t.strides else [t.strides[i] for i in range(t.ndim)]
    if not _c_contiguous(shape, strides, itemsize):
        raise ValueError("the array is not C-contiguous: register a contiguous one")
    return int(t.data or 0) + int(t.byte_offset), math.prod(shape) * itemsize, int(dev_id)


def owner(obj: Any) -> Any:
    """What keeps ``obj``'s memory allocated while it is registered: the
    object, and for a PyTorch tensor its storage too. ``tensor.set_()`` or
    assigning ``tensor.data`` moves a tensor to other memory and frees the
    old storage when nothing else holds it, which would leave the NIC
    writing memory the allocator hands to other tensors. Holding the
    storage keeps those bytes allocated instead. (A ``resize_`` that grows
    the storage itself reallocates it in place: do not resize a registered
    tensor.)"""
    storage = getattr(obj, "untyped_storage", None)
    if callable(storage):
        return (obj, storage())
    return obj


def cuda_range(obj: Any, gpu: Optional[int]) -> Tuple[int, int, int]:
    """(device pointer, bytes, GPU ordinal) of a CUDA array."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if cai is not None:
        ptr, nbytes = _from_cai(cai)
        if gpu is None:
            dev = getattr(obj, "device", None)
            index = getattr(dev, "index", None)
            gpu = index if isinstance(index, int) else getattr(dev, "id", None)
        return ptr, nbytes, 0 if gpu is None else int(gpu)
    if hasattr(obj, "__dlpack_device__") and hasattr(obj, "__dlpack__"):
        ptr, nbytes, dev_id = _from_dlpack(obj)
        return ptr, nbytes, dev_id if gpu is None else int(gpu)
    raise ValueError(
        f"{type(obj).__name__} has neither __cuda_array_interface__ nor DLPack: register_gpu takes a CUDA array "
        "(a torch.Tensor on a GPU, CuPy, JAX); register() takes host buffers"
    )
