"""Awaiting the engine on asyncio: each agent's readiness descriptor on the
running loop (``loop.add_reader``), no thread per wait and no busy polling.

A waiter polls once (never blocking: the poll reaps, arms the completion
channels and the descriptor, and looks again); if nothing is ready, its
future waits in the agent's driver. When the descriptor turns readable the
driver takes its events and polls every waiter again. A cancelled waiter
(``asyncio.wait_for``, a task cancelled) takes nothing: a notification it
did not get stays for the next call.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable, List, Optional, Tuple

_PENDING = object()


class _Driver:
    """One agent's descriptor on one event loop at a time."""

    def __init__(self, agent: Any) -> None:
        # Weak: the agent holds its driver, and a strong reference back
        # would keep a dropped agent (its NICs, its listener) alive until
        # the cyclic collector ran. A waiter's request holds the agent.
        self._agent = weakref.ref(agent)
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._fd: Optional[int] = None
        self._waiters: List[Tuple[Callable[[], Any], "asyncio.Future[Any]"]] = []

    def wait(self, poll: Callable[[], Any]) -> "asyncio.Future[Any]":
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._waiters:
                from ._native import ConfigError

                raise ConfigError(
                    "this agent is awaited on another event loop right now: await one agent from one loop at a time"
                )
            self._loop = loop
        fut = loop.create_future()
        value = poll()
        if value is not _PENDING:
            fut.set_result(value)
            return fut
        if self._fd is None:
            self._fd = self._live()._event_fd()
        if not self._waiters:
            loop.add_reader(self._fd, self._ready)
        self._waiters.append((poll, fut))
        return fut

    def _ready(self) -> None:
        try:
            self._live()._clear_events()
        except BaseException as e:  # every waiter learns why
            waiters, self._waiters = self._waiters, []
            for _, fut in waiters:
                if not fut.done():
                    fut.set_exception(e)
            self._stop()
            return
        waiters, self._waiters = self._waiters, []
        for poll, fut in waiters:
            if fut.done():
                continue
            try:
                value = poll()
            except BaseException as e:
                fut.set_exception(e)
                continue
            if value is _PENDING:
                self._waiters.append((poll, fut))
            else:
                fut.set_result(value)
        if not self._waiters:
            self._stop()

    def _live(self) -> Any:
        agent = self._agent()
        if agent is None:
            from ._native import ConfigError

            raise ConfigError("the agent was dropped while awaited")
        return agent

    def close(self, why: BaseException) -> None:
        """The agent closes: every waiter fails with ``why`` and the
        descriptor leaves the loop before it is closed."""
        waiters, self._waiters = self._waiters, []
        loop, fd = self._loop, self._fd
        self._fd = None
        if loop is None or loop.is_closed():
            return
        try:
            here = asyncio.get_running_loop() is loop
        except RuntimeError:
            here = False
        if here:
            for _, fut in waiters:
                _fail(fut, why)
            if fd is not None and waiters:
                loop.remove_reader(fd)
        else:
            # The loop is not thread-safe: it is told, and its selector
            # forgets a descriptor closed meanwhile.
            for _, fut in waiters:
                loop.call_soon_threadsafe(_fail, fut, why)
            if fd is not None and waiters:
                loop.call_soon_threadsafe(loop.remove_reader, fd)

    def _stop(self) -> None:
        if self._loop is not None and self._fd is not None:
            self._loop.remove_reader(self._fd)


def _fail(fut: "asyncio.Future[Any]", why: BaseException) -> None:
    if not fut.done():
        fut.set_exception(why)


def driver(agent: Any) -> _Driver:
    d = getattr(agent, "_aio_driver", None)
    if d is None:
        d = _Driver(agent)
        agent._aio_driver = d
    return d


async def completed(request: Any) -> None:
    """Until ``request``'s last post finished (raises its failure)."""

    def poll() -> Any:
        return None if request._poll_completed() else _PENDING

    await driver(request.agent).wait(poll)


async def notification(agent: Any) -> Tuple[str, bytes]:
    """The agent's next notification, as ``(peer, bytes)``."""

    def poll() -> Any:
        n = agent._poll_notification()
        return _PENDING if n is None else n

    return await driver(agent).wait(poll)


async def settled(cast: Any) -> None:
    """Until broadcast ``cast``'s last post settled (raises
    ``BroadcastIncompleteError`` naming the receivers that did not get the
    data). Its probes are due by time, so it looks again at least every
    0.1 s even when the descriptor stays quiet."""

    def poll() -> Any:
        return None if cast._poll_completed() else _PENDING

    while True:
        try:
            await asyncio.wait_for(driver(cast.agent).wait(poll), 0.1)
            return
        except asyncio.TimeoutError:
            continue

