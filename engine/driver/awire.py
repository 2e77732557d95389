"""The wire's asyncio twin: the exchanges of :mod:`.wire` on psycopg's AsyncConnection.

The same messages go out: ringq's prepared statements through libpq in one
pipeline (:meth:`.wire.Prepared.exchange`, a psycopg generator that both
faces run: the sync one with ``Connection.wait``, this one with ``await
AsyncConnection.wait``), else psycopg's own cursors as :mod:`.wire` falls
back to them. Nothing is built here that the sync wire does not build: only
the waiting differs.

Waiting (:func:`wait`): as psycopg's ``AsyncConnection.wait``, without its
0.1 s timer per wait (a ``call_later``, its heap and its cancel on every
exchange: a few per cent of an asyncio consumer's CPU; the timer lets a
sync wait see Ctrl-C, which reaches a task as its cancellation anyway).

Cancellation: :func:`wait`, cancelled, asks the server to cancel the
statement and still reads the exchange to its end before it re-raises
``CancelledError`` (psycopg's ``AsyncConnection.wait`` does the same). A
:class:`Box` passed in keeps what the exchange returned (or raised) then, so
that the caller can tell the section the outcome the server gave instead of
guessing it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator, Sequence
from typing import Any, TypeVar

import psycopg
from psycopg import waiting
from psycopg.pq import TransactionStatus

from .wire import Prepared, Rows, Statement, begin_statement
from .wire import _no_implicit_begin as no_implicit_begin

__all__ = ["Box", "Rows", "execute", "loaded", "rollback_then", "send", "wait"]

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
_ACTIVE = TransactionStatus.ACTIVE
_INTERRUPTED = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)
_CANCEL_WAIT_S = 5.0  # as psycopg: how long a cancelled statement's end is awaited
T = TypeVar("T")


async def wait(aconn: psycopg.AsyncConnection[Any], gen: Generator[Any, Any, T]) -> T:
    """``await aconn.wait(gen)`` (see the module's docstring): the
    generator's exchange on the connection's socket; interrupted (the task
    cancelled), the statement is cancelled on the server and the exchange
    read to its end (``gen`` then returns or raises: a :class:`Box` keeps
    it), the connection closed if it cannot be, and the interruption raised."""
    fileno = aconn.pgconn.socket
    try:
        return await _wait_socket(gen, fileno)
    except _INTERRUPTED:
        # psycopg's AsyncConnection.wait, step by step
        if aconn.pgconn.transaction_status == _ACTIVE:
            try:
                await aconn._try_cancel(timeout=_CANCEL_WAIT_S)
                await waiting.wait_async(gen, fileno, interval=0.1, timeout=_CANCEL_WAIT_S)
            except psycopg.errors.QueryCanceled:
                pass  # as expected
            except psycopg.errors._WaitTimeout:
                logger.warning("ringq: a statement not ended after its cancel: closing the "
                               "connection")
                aconn.pgconn.finish()
            except BaseException as ex:  # interrupted again, or the cancel failed
                logger.warning("ringq: a statement's cancel interrupted (%s): closing the "
                               "connection", type(ex).__name__)
                aconn.pgconn.finish()
        raise


async def _wait_socket(gen: Generator[Any, Any, T], fileno: int) -> T:
    """Run ``gen`` (a psycopg generator), awaiting ``fileno`` as it asks:
    one future and one reader (or writer) per wait, no timer."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] | None = None
    ready = 0

    def wakeup(state: int) -> None:
        nonlocal ready
        ready |= state
        if fut is not None and not fut.done():
            fut.set_result(None)

    try:
        s = next(gen)
        while True:
            reader, writer = s & waiting.WAIT_R, s & waiting.WAIT_W
            ready = 0
            fut = loop.create_future()
            if reader:
                loop.add_reader(fileno, wakeup, waiting.READY_R)
            if writer:
                loop.add_writer(fileno, wakeup, waiting.READY_W)
            try:
                await fut
            finally:
                fut = None
                if reader:
                    loop.remove_reader(fileno)
                if writer:
                    loop.remove_writer(fileno)
            s = gen.send(ready)
    except StopIteration as ex:
        value: T = ex.value
        return value
    except OSError as ex:  # as psycopg: the connection was closed
        raise psycopg.OperationalError("connection socket closed") from ex


class Box:
    """What an exchange came to, kept even when the await that ran it was
    cancelled: ``done`` with its ``value``, or its ``error``; neither when it
    never finished (the connection is then closed or in an unknown state)."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = False
        self.value: Any = None
        self.error: BaseException | None = None


def _boxed(gen: Generator[Any, Any, T], box: Box | None) -> Generator[Any, Any, T]:
    if box is None:
        return gen
    return _keep(gen, box)


def _keep(gen: Generator[Any, Any, T], box: Box) -> Generator[Any, Any, T]:
    try:
        value = yield from gen
    except BaseException as exc:
        box.error = exc
        raise
    box.done, box.value = True, value
    return value


def loaded(
    aconn: psycopg.AsyncConnection[Any], cursors: Sequence[psycopg.AsyncCursor[Any]]
) -> list[Rows]:
    """The rows of cursors whose exchange is over, read without awaiting
    (an AsyncCursor's ``fetchall`` is a coroutine; the engine's steps read a
    :class:`~.wire.Fetch`)."""
    return [Rows(aconn, cur.pgresult) if cur.pgresult is not None else Rows.empty()
            for cur in cursors]


async def execute(
    aconn: psycopg.AsyncConnection[Any],
    query: str,
    params: Any,
    *,
    binary: bool = False,
    may_begin: bool = True,
    prepared: Prepared | None = None,
    box: Box | None = None,
    cursor: bool = False,
) -> Any:
    """:func:`.wire.execute` on ``aconn``: one statement in the connection's
    transaction, its BEGIN in the same message on an idle connection. Its
    rows as a :class:`~.wire.Fetch`; with ``cursor`` (the caller's own
    statement), psycopg's AsyncCursor when psycopg sent it."""
    if prepared is not None and may_begin and not aconn.autocommit:
        encoded = prepared.encoded(aconn, [(query, params)])
        if encoded is not None:
            begin = aconn.pgconn.transaction_status == _IDLE
            gen = prepared.exchange(aconn, encoded, begin=begin, commit=False)
            async with aconn.lock:
                rows = await wait(aconn, _boxed(gen, box))
            return rows[0]
    with no_implicit_begin(aconn, may_begin) as idle:
        if not idle:
            acur = await aconn.execute(query, params, binary=binary)
            return acur if cursor else loaded(aconn, [acur])[0]
        cur = psycopg.AsyncClientCursor(aconn)
        await cur.execute(begin_statement(aconn) + "; " + cur.mogrify(query, params))
        cur.nextset()  # past the BEGIN's result
        return cur if cursor else loaded(aconn, [cur])[0]


async def send(
    aconn: psycopg.AsyncConnection[Any],
    statements: Sequence[Statement],
    *,
    commit: bool,
    may_begin: bool = True,
    prepared: Prepared | None = None,
    box: Box | None = None,
) -> list[Rows]:
    """:func:`.wire.send` on ``aconn``: ``statements`` in one round trip,
    opening the transaction (BEGIN with them) or ending it (``commit``)."""
    if prepared is not None and may_begin and not aconn.autocommit:
        idle = aconn.pgconn.transaction_status == _IDLE
        begin, end = idle and not commit, commit and not idle
        encoded = prepared.encoded(aconn, statements)
        if encoded is not None:
            try:
                async with aconn.lock:
                    return await wait(aconn, _boxed(
                        prepared.exchange(aconn, encoded, begin=begin, commit=end), box))
            except psycopg.errors.InvalidSqlStatementName:
                # as wire.send: deallocated behind our back; sent alone in
                # autocommit nothing ran, so it goes again, prepared anew
                if not (idle and commit):
                    raise
                encoded = prepared.encoded(aconn, statements)
                if encoded is not None:
                    async with aconn.lock:
                        return await wait(aconn, _boxed(
                            prepared.exchange(aconn, encoded, begin=begin, commit=end), box))
    with no_implicit_begin(aconn, may_begin) as idle:
        message = list(statements)
        if idle and not commit:
            message.insert(0, (begin_statement(aconn), None))
        elif commit and not idle:
            message.append(("COMMIT", None))
        if len(message) == 1:
            query, params = message[0]
            return loaded(aconn, [await aconn.execute(query, params)])
        cursors = [aconn.cursor() for _ in statements]
        other = aconn.cursor()
        async with aconn.pipeline():
            at = 0
            for query, params in message:
                if params is None:  # BEGIN, COMMIT
                    await other.execute(query, prepare=False)
                else:
                    await cursors[at].execute(query, params)
                    at += 1
        return loaded(aconn, cursors)


async def rollback_then(
    aconn: psycopg.AsyncConnection[Any], statements: Sequence[Statement]
) -> list[Rows]:
    """:func:`.wire.rollback_then` on ``aconn``: ROLLBACK (if a transaction is
    open), then ``statements`` in autocommit, one round trip."""
    cursors = [aconn.cursor() for _ in statements]
    with no_implicit_begin(aconn) as idle:
        async with aconn.pipeline():
            if not idle:
                await aconn.execute("ROLLBACK", prepare=False)
            for cur, (query, params) in zip(cursors, statements, strict=True):
                await cur.execute(query, params)
    return loaded(aconn, cursors)
