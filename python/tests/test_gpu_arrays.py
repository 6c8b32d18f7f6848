"""register_gpu's reading of CUDA arrays (``__cuda_array_interface__``,
DLPack) on a machine without a GPU: pointers, sizes and GPUs read right,
what cannot be registered refused with a ValueError saying why, and on a
machine without CUDA a typed CudaError before anything is registered.
Which device memory a NIC may be given (VMM mappings, pools, alignment)
is judged in Rust on injected driver answers (gpudirect's segments tests)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import gpudirect
from gpudirect import _gpu
from conftest import DEVICE, needs_device


class CudaArray:
    """What PyTorch and CuPy expose for a GPU tensor."""

    def __init__(self, ptr=0x7F00_0000_0000, shape=(4, 1024), typestr="<f4", strides=None, readonly=False, index=None):
        self.__cuda_array_interface__ = {"data": (ptr, readonly), "shape": shape, "typestr": typestr, "strides": strides, "version": 3}
        if index is not None:
            self.device = type("Device", (), {"index": index})()


class DLPackArray:
    """A DLPack producer of CUDA memory, with a real capsule."""

    def __init__(self, data, device_type, device_id, shape, bits=32, strides=None, byte_offset=0):
        self._shape = (ctypes.c_int64 * len(shape))(*shape)
        self._strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        self._t = _gpu._DLTensor(
            data=data,
            device=_gpu._DLDevice(device_type, device_id),
            ndim=len(shape),
            dtype=_gpu._DLDataType(2, bits, 1),
            shape=self._shape,
            strides=self._strides,
            byte_offset=byte_offset,
        )
        self._dev = (device_type, device_id)

    def __dlpack_device__(self):
        return self._dev

    def __dlpack__(self, stream=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        return new(ctypes.addressof(self._t), b"dltensor", None)


def test_cuda_array_interface_gives_pointer_size_and_gpu():
    assert _gpu.cuda_range(CudaArray(), None) == (0x7F00_0000_0000, 4 * 1024 * 4, 0)
    assert _gpu.cuda_range(CudaArray(index=3), None)[2] == 3
    assert _gpu.cuda_range(CudaArray(index=3), 1)[2] == 1
    # Explicit C strides are contiguous too.
    assert _gpu.cuda_range(CudaArray(strides=(4096, 4)), None)[1] == 16384


def test_cuda_arrays_that_cannot_be_registered_say_why():
    with pytest.raises(ValueError, match="not C-contiguous"):
        _gpu.cuda_range(CudaArray(strides=(4, 16)), None)
    with pytest.raises(ValueError, match="read-only"):
        _gpu.cuda_range(CudaArray(readonly=True), None)
    with pytest.raises(ValueError, match="neither __cuda_array_interface__ nor DLPack"):
        _gpu.cuda_range(object(), None)


def test_dlpack_gives_pointer_size_and_gpu():
    a = DLPackArray(0x7F00_0000_0000, 2, 1, (4, 8), byte_offset=256)
    assert _gpu.cuda_range(a, None) == (0x7F00_0000_0000 + 256, 4 * 8 * 4, 1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        _gpu.cuda_range(DLPackArray(0x1000, 2, 0, (4, 8), strides=(1, 4)), None)
    with pytest.raises(ValueError, match="CUDA managed memory"):
        _gpu.cuda_range(DLPackArray(0x1000, 13, 0, (4,)), None)
    # NumPy speaks DLPack for host memory: refused, pointing at register().
    with pytest.raises(ValueError, match=r"CPU memory.*register\(\)"):
        _gpu.cuda_range(np.zeros(16, dtype=np.uint8), None)


@needs_device
def test_register_gpu_without_cuda_is_a_typed_error_and_registers_nothing():
    agent = gpudirect.Agent("gpu-less", devices=[DEVICE], listen="127.0.0.1:0")
    array = CudaArray(index=0)
    with pytest.raises(gpudirect.CudaError, match="CUDA is not available"):
        agent.register_gpu("kv", array)
    with pytest.raises(gpudirect.UnknownMemoryError):
        agent.registration("kv")
    with pytest.raises(ValueError, match="policy"):
        agent.register_gpu("kv", array, policy="sometimes")
    # Host memory registers, and says how long it took.
    agent.register("host", bytearray(1 << 20))
    info = agent.registration("host")
    assert info["nbytes"] == 1 << 20 and 0 < info["took"] < 10 and info["paths"] == [(DEVICE, "host memory")]


class Tensor(CudaArray):
    """A PyTorch tensor's shape: the array, and the storage it sits in,
    which ``set_()`` swaps for another."""

    def __init__(self):
        super().__init__(index=0)
        self.storage = type("UntypedStorage", (), {})()

    def untyped_storage(self):
        return self.storage

    def set_(self, other):
        self.storage = other.storage


def test_a_registered_tensor_s_storage_is_held_not_only_the_tensor():
    import weakref

    t = Tensor()
    first = weakref.ref(t.storage)
    keep = _gpu.owner(t)
    # set_() moves the tensor to other memory; the registered storage stays.
    t.set_(Tensor())
    del t
    assert first() is not None, "the registered storage went with set_()"
    del keep
    assert first() is None
    # Anything else is held as itself.
    a = CudaArray()
    assert _gpu.owner(a) is a


@needs_device
def test_host_registration_holds_a_tensor_s_storage():
    import weakref

    class HostTensor:
        def __init__(self):
            self.array = np.zeros(1 << 16, dtype=np.uint8)
            self.__array_interface__ = self.array.__array_interface__
            self.storage = type("UntypedStorage", (), {})()

        def untyped_storage(self):
            return self.storage

    agent = gpudirect.Agent("storage-holder", devices=[DEVICE], listen="127.0.0.1:0")
    t = HostTensor()
    first = weakref.ref(t.storage)
    agent.register("t", t)
    t.storage = None
    assert first() is not None, "the storage went while registered"
    agent.deregister("t")
    assert first() is None
