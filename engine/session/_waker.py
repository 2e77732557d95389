"""The asyncio face's wake-up: a queue's semaphore posts reach the event loop.

A commit that makes entries ready posts the queue's 'r' semaphore (a
posix-ipc semaphore, which has no file descriptor a loop could watch). Per
process and semaphore, one daemon thread waits on it while at least one
coroutine waits for it, and hands each post to the longest-waiting coroutine
with ``loop.call_soon_threadsafe`` (the loop's own self-pipe wakes it). No
coroutine waiting: the thread sleeps on a condition, not on the semaphore,
so it takes no post that a dequeuer of another process should have.

A post taken for a coroutine that gave up meanwhile (its timeout, its
cancellation) is lost to it; it looks at the bitmaps again anyway (as the
sync dequeuer does every ``CLAIM_RECHECK_S``), so no entry waits for it.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from contextlib import suppress

import posix_ipc

_ACQUIRE_S = 0.25  # the thread looks whether anyone still waits this often

_lock = threading.Lock()
_wakers: dict[str, SemaphoreWaker] = {}
_pid = os.getpid()


def waker_for(sem: posix_ipc.Semaphore) -> SemaphoreWaker:
    """This process's waker of ``sem`` (made, with its thread, on first use;
    a forked child makes its own: threads do not cross ``fork()``)."""
    global _pid
    with _lock:
        if os.getpid() != _pid:
            _wakers.clear()
            _pid = os.getpid()
        waker = _wakers.get(sem.name)
        if waker is None:
            waker = _wakers[sem.name] = SemaphoreWaker(sem)
        return waker


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _hand(fut: asyncio.Future[None], sem: posix_ipc.Semaphore) -> None:
    """Hand a post taken for ``fut`` over; its wait may have ended since the
    thread chose it (timed out, cancelled): then the post goes back, for
    another waiter (dropped, a waiter would sleep until its next recheck)."""
    if fut.done():
        sem.release()
    else:
        fut.set_result(None)


class SemaphoreWaker:
    """Coroutines waiting on one semaphore, and the thread that wakes them."""

    def __init__(self, sem: posix_ipc.Semaphore) -> None:
        self.sem = sem
        self._cond = threading.Condition()
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._thread = threading.Thread(
            target=self._run, name=f"ringq-waker{sem.name}", daemon=True
        )
        self._thread.start()

    async def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a post: True if one came for us.
        Cancellable; nothing is left registered when it returns or raises."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cond:
            self._waiters.append(fut)
            self._cond.notify()
        try:
            async with asyncio.timeout(timeout):
                await fut
            return True
        except TimeoutError:
            return False
        finally:
            with self._cond, suppress(ValueError):  # ValueError: taken by the thread already
                self._waiters.remove(fut)

    def _run(self) -> None:
        sem, cond, waiters = self.sem, self._cond, self._waiters
        while True:
            with cond:
                while not waiters:
                    cond.wait()
            try:
                sem.acquire(_ACQUIRE_S)
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                continue
            except posix_ipc.ExistentialError:  # the section was removed: stop
                with _lock, cond:
                    if _wakers.get(sem.name) is self:
                        del _wakers[sem.name]
                    for w in waiters:
                        w.get_loop().call_soon_threadsafe(_wake, w)
                return
            fut: asyncio.Future[None] | None = None
            with cond:
                while waiters:
                    w = waiters.popleft()
                    if not w.done():
                        fut = w
                        break
            if fut is None:
                sem.release()  # nobody here wants it any more: give it back
                continue
            try:
                fut.get_loop().call_soon_threadsafe(_hand, fut, sem)
            except RuntimeError:  # its loop is closed
                sem.release()
