"""The asyncio face (ringq.engine.connect_async): the API, the wait on the
loop, cancellation at each await of a dequeue and of a commit, and failures
(kill -9 of an async consumer, a backend terminated under a session).

Tests drive their coroutines with ``asyncio.run`` (no plugin); concurrency
is scripted with events, never with sleeps.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

import ringq.engine as engine
from conftest import drain, enqueue_committed, terminate_backend

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def test_enqueue_commit_dequeue_commit(dsn: str, make_queue: Callable[..., str]) -> None:
    q = make_queue()

    async def main() -> list[bytes]:
        async with await engine.connect_async(dsn) as s:
            seq = await s.enqueue(q, b"one")
            seqs = await s.enqueue_many(q, [b"two", b"three"])
            assert seqs == [seq + 1, seq + 2]
            await s.commit()
            got = [m.payload for m in await s.dequeue_many(q, 3)]
            await s.commit()
            assert await s.dequeue(q) is None
            return got

    assert run(main()) == [b"one", b"two", b"three"]
    assert drain(dsn, q) == []
