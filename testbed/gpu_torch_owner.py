"""On a GPU machine with PyTorch (testbed/gpu-bundle's run.sh runs it):
what register_gpu holds keeps a tensor's memory allocated after set_(),
where holding the tensor alone let the caching allocator hand the
registered block to a new tensor; and the pointer, size and GPU read from
a real tensor's __cuda_array_interface__ and DLPack. Needs no RDMA device
and no built package: it loads gpudirect/_gpu.py by path (argv[1])."""

import importlib.util
import sys

import torch

spec = importlib.util.spec_from_file_location("_gpu", sys.argv[1])
_gpu = importlib.util.module_from_spec(spec)
spec.loader.exec_module(_gpu)
N = 8 << 20


def trial(hold):
    """(block handed to a new tensor while held, handed out once released)."""
    t = torch.empty(N, dtype=torch.uint8, device="cuda")
    p = t.data_ptr()
    assert _gpu.cuda_range(t, None) == (p, N, 0)
    keep = hold(t)
    t.set_(torch.empty(1, dtype=torch.uint8, device="cuda"))
    del t
    u = torch.empty(N, dtype=torch.uint8, device="cuda")
    reused = u.data_ptr() == p
    del keep, u
    v = torch.empty(N, dtype=torch.uint8, device="cuda")
    return reused, v.data_ptr() == p


print("torch", torch.__version__)
before = trial(lambda t: t)[0]
print("holding the tensor alone: its block handed to a new tensor after set_():", before)
reused, released = trial(_gpu.owner)
print("holding _gpu.owner(tensor): handed out while held:", reused, "| once released:", released)
t = torch.empty(4, 1024, dtype=torch.float32, device="cuda")
assert _gpu.cuda_range(t, None) == (t.data_ptr(), 16384, 0)
assert _gpu._from_dlpack(t) == (t.data_ptr(), 16384, 0)
assert not reused, "the registered block was handed to another tensor while held"
print("gpu_torch_owner: ok")
