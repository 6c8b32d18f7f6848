"""Two agents in one process on one RDMA device: a write with a notification,
every byte checked. Needs an RDMA device (GPUDIRECT_TEST_DEVICE, as the
guest sets it)."""
import os
import sys

import gpudirect

dev = os.environ.get("GPUDIRECT_TEST_DEVICE", "rxe0")
a = gpudirect.Agent("prefill", devices=[dev], listen="127.0.0.1:0")
b = gpudirect.Agent("decode", devices=[dev], listen="127.0.0.1:0")
src = bytearray(os.urandom(1 << 20))
dst = bytearray(1 << 20)
assert a.register("kv", src) == len(src)
assert b.register("kv", dst) == len(dst)
peer = a.load_remote(b.metadata())
assert peer == "decode"
req = a.prepare("write", [("kv", 0, "decode", "kv", 0, len(src))], notify=b"layer 0")
req.post()
req.wait(10.0)
assert req.status() == "done"
who, msg = b.wait_notification(10.0)
assert (who, msg) == ("prefill", b"layer 0"), (who, msg)
assert dst == src
try:
    src.extend(b"x")
    raise SystemExit("a registered bytearray was resized")
except BufferError:
    pass
del req  # a posted request holds its memory until it goes
a.deregister("kv")
src.extend(b"x")
print("engine smoke: 1 MiB written with a notification, every byte checked; the registered bytearray could not be resized until deregistered")
