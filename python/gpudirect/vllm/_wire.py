"""What the trainer and the workers agree on without talking: where each
parameter's bytes lie in the stream of buckets, the header at the start of
each bucket, the notifications, and the checksum. Plain data and torch
only; nothing here imports vLLM or touches a NIC."""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

ALIGN = 256
"""Every parameter starts on this boundary in the stream (any dtype's
alignment, and whole 4-byte words for the checksum)."""

HEADER = 256
"""Bytes before a bucket's payload: the header, padded so the payload
keeps the alignment above."""

ACK_SLOT = 64
"""Bytes of the trainer's acknowledgement region per worker."""

MAX_BUCKET = 1 << 40
"""The largest bucket size taken (a typo of a few zeros is refused, not
allocated)."""

MAX_PARAMS = 1 << 20
"""The most parameters one update may list."""

MAX_BUCKETS = 1 << 20
"""The most buckets one update may take (the plan is held in memory)."""

_MAGIC = b"GDVW"
_FORMAT = 1
_HEAD = struct.Struct("<4sIQQIIQQ")
PREFIX = b"gdvw1 "
"""The start of every notification of this protocol."""


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Piece:
    """Part (or all) of one parameter inside one bucket."""

    index: int
    """The parameter's position in the update's list."""
    at: int
    """Where in the bucket's payload the piece starts."""
    start: int
    """Where in the parameter's bytes the piece starts."""
    length: int
    last: bool
    """Whether the parameter's final byte is in this piece."""


@dataclass(frozen=True)
class Plan:
    """The stream of one update cut into buckets: what each bucket holds."""

    nbytes: List[int]
    """Each parameter's size in bytes."""
    bucket_bytes: int
    total: int
    """Payload bytes over all buckets."""
    buckets: List[List[Piece]]

    @property
    def count(self) -> int:
        """How many buckets the update takes."""
        return len(self.buckets)

    def length(self, k: int) -> int:
        """Payload bytes in bucket ``k``."""
        return min(self.bucket_bytes, self.total - k * self.bucket_bytes)

    def by_parameter(self) -> List[List[Tuple[int, Piece]]]:
        """For each parameter, its pieces in order with their buckets (how
        the trainer packs them)."""
        out: List[List[Tuple[int, Piece]]] = [[] for _ in self.nbytes]
        for k, pieces in enumerate(self.buckets):
            for piece in pieces:
                out[piece.index].append((k, piece))
        return out


def plan(nbytes: Sequence[int], bucket_bytes: int) -> Plan:
    """Lays the parameters of ``nbytes`` out one after another (each on
    :data:`ALIGN`) and cuts the stream every ``bucket_bytes``; a parameter
    larger than a bucket spans several."""
    check_bucket_bytes(bucket_bytes)
    if len(nbytes) > MAX_PARAMS:
        raise ValueError(f"{len(nbytes)} parameters in one update: at most {MAX_PARAMS}")
    if any(not isinstance(n, int) or n < 0 for n in nbytes):
        raise ValueError("a parameter's size is not a whole number of bytes")
    # Bounded before anything is laid out: the sizes come from the update
    # info, which whoever reaches vLLM's routes may send.
    upper = sum(align(n) for n in nbytes)
    if upper > MAX_BUCKETS * bucket_bytes:
        raise ValueError(f"{upper} bytes in buckets of {bucket_bytes}: more than {MAX_BUCKETS} buckets (raise bucket_bytes)")
    buckets: List[List[Piece]] = []
    pos = 0
    for i, n in enumerate(nbytes):
        pos = align(pos)
        done = 0
        while done < n:
            k, at = divmod(pos, bucket_bytes)
            take = min(n - done, bucket_bytes - at)
            while len(buckets) <= k:
                buckets.append([])
            buckets[k].append(Piece(i, at, done, take, done + take == n))
            done += take
            pos += take
        if n == 0:
            # In the bucket of the byte before it, so it opens no bucket
            # of its own past the stream's end.
            k = max(pos - 1, 0) // bucket_bytes
            while len(buckets) <= k:
                buckets.append([])
            buckets[k].append(Piece(i, 0, 0, 0, True))
    total = align(pos)
    while len(buckets) * bucket_bytes < total:
        buckets.append([])
    return Plan(list(nbytes), bucket_bytes, total, buckets)


def check_bucket_bytes(n: Any) -> int:
    """``n`` when it is a usable bucket size, else ``ValueError`` saying why."""
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or n % ALIGN or n > MAX_BUCKET:
        raise ValueError(f"bucket_bytes={n!r}: a multiple of {ALIGN} bytes from {ALIGN} to {MAX_BUCKET}")
    return n


@dataclass(frozen=True)
class Header:
    """What the trainer writes before each bucket's payload, so a worker
    can tell the bytes of this bucket from bytes of another version."""

    session: int
    version: int
    bucket: int
    length: int
    checksum: int

    def pack(self) -> bytes:
        """The header's bytes, :data:`HEADER` long."""
        head = _HEAD.pack(_MAGIC, _FORMAT, self.session, self.version, self.bucket, 0, self.length, self.checksum)
        return head + bytes(HEADER - len(head))

    @staticmethod
    def unpack(raw: bytes) -> Optional["Header"]:
        """The header in ``raw``, or None when it is not one."""
        if len(raw) < _HEAD.size:
            return None
        magic, fmt, session, version, bucket, _, length, checksum = _HEAD.unpack_from(raw)
        if magic != _MAGIC or fmt != _FORMAT:
            return None
        return Header(session, version, bucket, length, checksum)


@dataclass(frozen=True)
class Note:
    """A notification of this protocol: ``put`` (a bucket is whole at a
    worker), ``ack`` (a worker loaded a bucket; its slot is free) or
    ``nak`` (a worker gave up on the update, with the reason). A put
    carries a random ``nonce`` that its ack must return: only a worker
    that received the bucket can acknowledge it."""

    kind: str
    session: int
    version: int
    bucket: int
    reason: str = ""
    nonce: int = 0

    def encode(self) -> bytes:
        """The notification's bytes."""
        tail = f" {self.reason}" if self.reason else ""
        return PREFIX + f"{self.kind} {self.session:016x} {self.version} {self.bucket} {self.nonce:08x}{tail}".encode()[:900]

    @staticmethod
    def decode(raw: bytes) -> Optional["Note"]:
        """The notification in ``raw``, or None when it is not one of this
        protocol (malformed)."""
        if not raw.startswith(PREFIX):
            return None
        try:
            parts = raw[len(PREFIX) :].decode("utf-8", "replace").split(" ", 5)
            kind, session, version, bucket, nonce = parts[:5]
            if kind not in ("put", "ack", "nak") or not _HEX16.fullmatch(session) or not _HEX8.fullmatch(nonce):
                return None
            if not (version.isascii() and version.isdigit() and bucket.isascii() and bucket.isdigit()):
                return None
            return Note(kind, int(session, 16), int(version), int(bucket), parts[5] if len(parts) > 5 else "", int(nonce, 16))
        except ValueError:
            return None


_HEX16 = re.compile("[0-9a-f]{16}")
_HEX8 = re.compile("[0-9a-f]{8}")


_WORDS: Dict[Tuple[Any, int], Any] = {}


def checksum(payload: Any) -> int:
    """A 64-bit Fletcher-style sum of a bucket's payload (a uint8 tensor of
    a multiple of 4 bytes, on any device), computed where the bytes are:
    the sum of its 32-bit words and the sum of each word times its
    position. It catches torn, stale and misplaced bytes, not an attacker
    (the control plane's secret does that)."""
    import torch

    words = payload.view(torch.int32).to(torch.int64)
    n = words.numel()
    key = (payload.device, n)
    pos = _WORDS.get(key)
    if pos is None:
        _WORDS.clear()
        pos = _WORDS[key] = torch.arange(1, n + 1, dtype=torch.int64, device=payload.device)
    a = int(words.sum().item()) & 0xFFFFFFFF
    b = int((words * pos).sum().item()) & 0xFFFFFFFF
    return (a << 32) | b
