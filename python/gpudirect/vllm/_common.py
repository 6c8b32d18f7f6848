"""What the worker and the trainer engines share: the errors, the secret
check, agent names, and the thread that waits for notifications."""

from __future__ import annotations

import os
import queue
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .. import Agent, EngineTimeoutError, GpudirectError

SECRET_FIX = (
    "gpudirect weight transfer needs the cluster's secret on the trainer and on every vLLM server: "
    "a file of 32 random bytes (head -c 32 /dev/urandom > secret; chmod 600 secret) named by "
    "GPUDIRECT_SECRET_FILE in the environment of the trainer and of every vLLM server (the trainer may name its copy "
    "with secret_file=)"
)


class WeightTransferError(GpudirectError):
    """A weight update did not complete: the message names who (the
    trainer or a worker), which version and which bucket, and why. The
    receiving model is not at that version (its weights may be partly of
    it); send the update again."""


class WeightTransferTimeout(WeightTransferError):
    """A weight update waited longer than its bound for the other side."""


def require_secret(secret_file: Optional[str]) -> Optional[str]:
    """The secret file to use (``secret_file``, else the environment's), or
    :class:`WeightTransferError` naming the fix when there is none."""
    if secret_file:
        if not os.path.isfile(secret_file):
            raise WeightTransferError(f"secret_file {secret_file!r} is not a readable file: {SECRET_FIX}")
        return secret_file
    if os.environ.get("GPUDIRECT_SECRET_FILE") or os.environ.get("GPUDIRECT_SECRET"):
        return None
    raise WeightTransferError(f"no cluster secret: {SECRET_FIX}")


def check_timeout(t: Any) -> float:
    """``t`` as seconds when it is a finite positive bound."""
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < 86400 * 7):
        raise ValueError(f"timeout={t!r}: seconds, more than 0 and less than a week")
    return float(t)


def check_workers(n: Any) -> int:
    """``n`` when it is a usable number of workers."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 4096:
        raise ValueError(f"num_workers={n!r}: a whole number from 1 to 4096")
    return n


def worker_name(group: str, rank: int) -> str:
    """The agent name of worker ``rank`` of ``group``."""
    return f"{group}.w{rank}"


def trainer_name(group: str) -> str:
    """The agent name of ``group``'s trainer."""
    return f"{group}.t"


class Inbox:
    """Notifications taken off an agent by a thread of their own: a relay
    broadcast moves a receiver's chunks on only while someone waits on its
    agent, so a worker busy loading weights must keep waiting meanwhile.

    Notifications from peers ``accept`` refuses are counted (under
    ``reason``, in ``refusals``) and dropped at once, and at most ``limit``
    wait to be read (past that the newest are dropped and counted as
    ``dropped``): a member that floods notifications costs memory and
    time of neither side, and can at worst make an update fail on its
    bound."""

    def __init__(
        self,
        agent: Any,
        accept: Optional[Callable[[str], bool]] = None,
        refusals: Optional[Dict[str, int]] = None,
        reason: str = "not_expected",
        limit: int = 4096,
    ) -> None:
        self._agent = agent
        self._accept = accept
        self._refusals = refusals if refusals is not None else {}
        self._reason = reason
        self._q: "queue.Queue[Tuple[str, bytes]]" = queue.Queue(limit)
        self._stop = threading.Event()
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name=f"gpudirect-inbox-{agent.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                got = self._agent.wait_notification(0.2)
            except EngineTimeoutError:
                continue
            except Exception as e:  # the agent closed, or failed: said to the reader
                if not self._stop.is_set():
                    self.error = e
                    try:
                        self._q.put_nowait(("", b""))
                    except queue.Full:
                        pass
                return
            if self._accept is not None and not self._accept(got[0]):
                count(self._refusals, self._reason)
                continue
            try:
                self._q.put_nowait(got)
            except queue.Full:
                count(self._refusals, "dropped")

    def get(self, deadline: float) -> Optional[Tuple[str, bytes]]:
        """The next notification, or None once ``deadline`` (a
        ``time.monotonic()`` value) passed, whatever is still queued."""
        left = deadline - time.monotonic()
        if left <= 0 and self.error is None:
            return None
        try:
            got = self._q.get(timeout=max(left, 0.001))
        except queue.Empty:
            got = None
        if self.error is not None and (got is None or got == ("", b"")):
            raise WeightTransferError(f"waiting for notifications on {self._agent.name!r} failed: {self.error}")
        return got

    def close(self) -> None:
        """Stops the thread (within its 0.2 s wait)."""
        self._stop.set()
        self._thread.join(5)


def count(counts: Dict[str, int], reason: str) -> None:
    """One more refusal for ``reason``."""
    counts[reason] = counts.get(reason, 0) + 1
