"""Sessions: enqueue and dequeue inside the caller's own PostgreSQL transaction.

One session = one PostgreSQL connection + one client entry in the global
section. Its in-flight slots (reserved for enqueue, locked for dequeue) are
finished in the section only after the database has answered the commit or
rollback; until then they stay locked, so no other client can see them.

The :class:`Session` is the front: it checks the arguments and its own
state, and delegates to the objects it holds, each calling down only:
its :class:`~._link.Link` (the connection, the client entry, the slots in
flight, a lost connection), its :class:`~._transaction.Transaction` (what is
written and when: commit, flush, rollback, the in-doubt path), its
:class:`~._reserve.Reservations` (the slots its enqueues take),
:class:`~._claim.Claims` (the slots its dequeues take, served from the cache
or the rows) and its :class:`~._tpc.TwoPhase` (two-phase commit).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Self

import psycopg
from psycopg.pq import TransactionStatus

from ..driver import resolve_dsn
from ..driver.errors import (
    DatabaseUnavailable,
    InDoubt,
    RingqError,
    SessionClosed,
    StaleSection,
    TransactionError,
)
from ..ring import QueueInfo, Ring
from ..rows import in_doubt_outcome, tracelog
from ..section import Section
from ..section import layout as L
from . import _otel, _trace
from ._claim import Claims
from ._events import Subscription, publish
from ._link import Link
from ._message import Message
from ._reserve import Reservations
from ._tpc import TwoPhase
from ._transaction import Transaction
from ._validate import check_due, check_producer, validate_int, validate_seconds

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
_INTRANS = TransactionStatus.INTRANS

_producer_counter = iter(range(1, 1 << 62))


def _new_producer() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{next(_producer_counter)}"


def connect(
    dsn: str | None = None,
    *,
    producer: str | None = None,
    connect_timeout: float = 10.0,
    application_name: str = "ringq",
) -> Session:
    """Open a session: DSN from the argument, else ``RINGQ_DSN``, else the embedded cluster.

    A transaction costs one round trip: enqueues are kept in the session
    and sent with the COMMIT; a dequeue on an idle connection carries its
    own BEGIN. Between transactions the session's connection is idle, never
    "idle in transaction": it holds no snapshot, its table statistics reach
    PostgreSQL, and ``idle_in_transaction_session_timeout`` cannot end it.

    :raises DatabaseUnavailable: the database cannot be reached.
    :raises SchemaMissing: the database holds no ringq schema (create a queue first).
    :raises SectionIncompatible: the host's global section has a foreign layout.
    """
    return Session(resolve_dsn(dsn), producer=producer, connect_timeout=connect_timeout,
                   application_name=application_name)


class Session:
    """A connection to one database's queues. Not thread-safe: one per thread.

    ``session.connection`` is the psycopg connection whose transaction the
    queue operations join; run your own SQL on it, then :meth:`commit` or
    :meth:`rollback` through the session (never on the connection directly,
    or the section learns the outcome late, from the rows).
    """

    def __init__(
        self,
        dsn: str,
        *,
        producer: str | None = None,
        connect_timeout: float = 10.0,
        application_name: str = "ringq",
    ) -> None:
        check_producer(producer or "")
        self._open(dsn, producer or _new_producer(), connect_timeout, application_name,
                   L.CR_CLIENT)  # C_ROLE of our client entry (a worker sets CR_WORKER)

    def _open(self, dsn: str, producer: str, timeout: float, appname: str, role: int) -> None:
        """Connect, take a client entry, and make the objects the session delegates to."""
        self._pid, self._closed = os.getpid(), False
        self._link = Link(dsn, producer=producer, connect_timeout=timeout,
                          application_name=appname, role=role)
        self._txn = Transaction(self._link)
        self._claims = Claims(self._link)
        self._reservations = Reservations(self._link)
        self._tpc = TwoPhase(self._link, self._txn)
        self.dsn, self.instance = dsn, self._link.instance
        if tracelog.wanted():  # decided per session: off, its calls are the class's, untouched
            _trace.attach(self)

    @property
    def backend_pid(self) -> int:
        return self._link.backend_pid

    @property
    def owner(self) -> int:  # our token in the section (the OWNER word of the slots we lock)
        return self._link.owner

    @property
    def producer(self) -> str:  # the producer name written with each entry we enqueue
        return self._link.producer

    @producer.setter
    def producer(self, value: str) -> None:
        self._link.producer = value

    @property
    def producer_seq(self) -> int:
        """The producer sequence of the last entry this session enqueued (0:
        none); the next enqueue takes ``producer_seq + 1``. Settable, to
        carry on another producer's numbering (with :attr:`producer`; the SQL
        inbox's pump does, for the entries it moves into the ring).

        :raises ConfigError: not an int from 0 to 2**63 - 2.
        """
        return self._link.producer_seq

    @producer_seq.setter
    def producer_seq(self, value: int) -> None:
        validate_int("producer_seq", value, 0, (1 << 63) - 2)
        self._link.producer_seq = value

    @property
    def behind_sql_puts(self) -> bool:
        """The SQL inbox's pump sets it: while slots of a queue are reserved
        for SQL producers, an enqueue into it reserves nothing and raises
        :class:`BehindSqlPuts` (checked under the queue's lock, where the
        monitor's agent reserves them)."""
        return self._link.behind_sql_puts

    @behind_sql_puts.setter
    def behind_sql_puts(self, value: bool) -> None:
        self._link.behind_sql_puts = bool(value)

    def set_client_role(self, role: int) -> None:
        """Mark this session's client entry in the global section with
        ``role`` (``ringq.engine.layout.CR_*``; a worker sets ``CR_WORKER``),
        kept across reconnects. The monitor and the viewer show it."""
        self._link.role = role
        self._link.section.set_client_role(self._link.cidx, role)

    def write_client_words(self, words: Iterable[tuple[int, int]]) -> None:
        """Write (word, value) pairs into this session's client entry
        (``ringq.engine.layout.C_W_*``: a worker's counters, for the monitor)."""
        self._link.section.set_client_words(self._link.cidx, words)

    # -- life cycle -----------------------------------------------------------------

    def close(self) -> None:
        """Roll back anything open and release the connection; a second call does nothing.

        A prepared two-phase transaction decided by :meth:`tpc_decide` is not
        rolled back (other participants may have committed): it stays
        prepared, its slots held, for recovery (``resolve_prepared``) to commit.
        """
        link = self._link
        if os.getpid() != self._pid:
            self._closed = True  # the parent's connection and client entry are not ours
            return
        if self._closed:
            link.release_entry()  # closed by a lost connection: the entry it took since
            return
        try:
            if self._tpc.decided:
                self._tpc.leave_decided()
            elif link.conn.closed or link.conn.broken:
                # The server ended the connection and rolled back: nothing to
                # send. Slots still held go to recovery (release_entry).
                logger.info("ringq: session closed after its connection was lost "
                            "(%d slots left to recovery)", len(link.ops))
            elif link.ops or link.conn.info.transaction_status != _IDLE:
                link.closing = True  # a rollback that finds the connection lost does not reconnect
                self.rollback()
        except RingqError as exc:
            logger.info("ringq: rollback at close failed (slots left to recovery): %s", exc)
        finally:
            self._closed = True
            link.release_entry()
            link.conn.close()
            self._tpc.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connection(self) -> psycopg.Connection[Any]:
        """The psycopg connection whose transaction queue operations join."""
        self._check()
        return self._link.conn

    def execute(
        self, query: str, params: Any = None, *, prepare: bool = False, defer: bool = False
    ) -> Any:
        """Run your own ``query`` in the session's transaction in one round trip (its
        BEGIN in the same message; ``connection.execute`` takes two): its rows'
        cursor. ``prepare``: planned once per connection (params None, int, str, bytes,
        lists of int; like a text parameter each takes the type its place in the query says).

        ``defer``: a statement whose rows you do not need (an INSERT recording
        your work) is not sent now but with the transaction's row writes, in
        the commit's round trip (or :meth:`flush`'s, :meth:`tpc_prepare`'s;
        before your next statement that is not deferred): a consumer's
        transaction then costs one round trip. Returns None. If it fails,
        the commit raises its error and the transaction is rolled back (its
        dequeued entries come back); a rollback drops it unsent.

        :raises StatementRejected, TransactionConflict, DatabaseError: it failed
            (``__cause__``: psycopg's error); the transaction is failed: roll it back.
        """
        self._check()
        link = self._link
        if defer:
            if prepare:
                link.prepared.add(query)
            link.deferred.append((query, params))
            return None
        if link.deferred:
            self._flush()  # they run first, in order
        return link.execute_callers(query, params, prepare=prepare)

    def _check(self) -> None:
        self._require_open()
        if os.getpid() != self._pid:
            self._after_fork()
        self._link.settle(two_phase_prepared=self._tpc.prepared)

    def _require_open(self) -> None:
        if self._closed:
            raise SessionClosed("the session is closed")

    def _after_fork(self) -> None:
        """A new connection and entry; the parent's (and its two-phase side
        connection) are never closed here: psycopg does not finish a
        connection made in another process. The queues known stay known."""
        old, tpc = self._link, self._tpc
        self._open(old.dsn, _new_producer(), old.connect_timeout, old.appname, old.role)
        self._link.inherit(old)
        self._tpc.inherit(tpc)

    def queue_info(self, name: str) -> QueueInfo:
        """The queue's settings (cached for the session's life).

        :raises InvalidQueueName: bad name. :raises QueueNotFound: no such queue.
        :raises SessionClosed: the session is closed.
        """
        self._check()
        return self._link.info(name)

    # -- transactions -------------------------------------------------------------------

    def commit(self) -> None:
        """Commit the transaction in one round trip: the BEGIN (when no
        statement opened it yet), the row writes of its enqueues and the
        COMMIT. Then its enqueued entries become ready and its dequeued
        entries consumed.

        :raises StaleSection: a row write did not find its row as the global
            section said; nothing committed: the transaction was rolled back
            and the section resynced. Retry the transaction.
        :raises InDoubt: the commit's answer was lost and the outcome could not
            be read back (the rows decide later; nothing is lost or doubled).
        :raises TransactionError: the transaction had failed; it was rolled back.
        """
        self._check()
        sp = _otel.spans()
        if sp is None:
            self._txn.commit()
            return
        with sp.settle("commit", self._link.ops):
            self._txn.commit()

    def commit_and_dequeue(self, queue: str) -> Message | None:
        """:meth:`commit`, then :meth:`dequeue` of ``queue`` in a new transaction:
        one message (COMMIT, BEGIN, the dequeue) when the entry is read from
        its row and this transaction, opened by a statement (a dequeue read
        from its row, your own SQL), holds no row write: a consumer loop of
        such entries costs one round trip per message. None if nothing is ready.

        :raises: as :meth:`commit`; then nothing was taken.
        """
        self._check()
        if self._tpc.xid is not None:  # before anything is claimed
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        sp = _otel.spans()
        if sp is None:
            return self._commit_and_dequeue(queue)
        with sp.settle("commit", self._link.ops), sp.dequeue(queue, "dequeue") as got:
            msg = self._commit_and_dequeue(queue)
            got.messages = () if msg is None else (msg,)
        return msg

    def _commit_and_dequeue(self, queue: str) -> Message | None:
        info = self._link.info(queue)
        got = self._claims.commit_and_dequeue(self._txn, info)
        if got is None:  # committed alone: the dequeue goes on its own
            return self._claims.dequeue_one(queue, None)
        return got[0]

    def in_doubt_outcome(self, exc: InDoubt, *, timeout: float = 30.0) -> bool | None:
        """Whether the transaction whose :meth:`commit` raised ``exc``
        committed: True or False, read from the rows of the server the DSN
        reaches now (the new primary after a fail-over), once the backend that
        ran the commit has ended (it is ended if it still runs, waiting up to
        ``timeout`` seconds). None when the rows no longer tell: every slot
        the transaction used holds a later entry, or its only operations were
        dequeues of entries since consumed (a redelivery's commit looks the
        same), or it was two-phase (its coordinator's decision settles it).
        It changes nothing; the section decides the slots by itself.

        :raises DatabaseUnavailable: no server answers yet: ask again later.
        :raises DatabaseError:
        """
        return in_doubt_outcome(self.dsn, exc, timeout=timeout,
                                connect_timeout=self._link.connect_timeout)

    def flush(self) -> None:
        """Send the row writes the session holds now (one round trip, opening
        the transaction if none is open) rather than with the COMMIT: the
        writes of its enqueues, and the consuming writes of its dequeues
        served from the payload cache. To learn of a failed write early, or
        to read the queue table in the same transaction (the transaction's
        own reads do not see the writes the session still holds).

        :raises StaleSection: as :meth:`commit`: the transaction was rolled back.
        :raises SessionClosed, DatabaseUnavailable:
        """
        self._check()
        self._flush()

    def _flush(self) -> None:
        """Send the held row writes; a stale one rolls the transaction back (two-phase
        too; no strikes), resyncs the queue's block, and raises :class:`StaleSection`."""
        writes = self._txn.held_writes()
        if not writes and not self._link.deferred:
            return
        try:
            self._txn.send_writes(writes, commit=False)
        except StaleSection as err:
            info = self._txn.stale_queue(err, writes)
            self.rollback(count_delivery=False)
            self._txn.resync_stale(info)
            raise

    def rollback(self, *, count_delivery: bool = True, retry_after: float | None = None) -> None:
        """Roll back, in one round trip at most (the row writes the session holds
        are dropped, the strikes travel with the ROLLBACK): enqueued entries
        are voided, dequeued ones become ready again after the queue's retry
        backoff, or ``retry_after`` seconds (the database's clock) when given,
        and count a delivery (at the queue's max_deliveries they move to
        ``ringq.exceptions``). ``count_delivery=False`` gives entries back
        without a strike (a shutdown that aborts work, not the entry's fault).

        :raises InvalidArgument: ``retry_after`` negative, NaN or infinite."""
        self._require_open()
        if os.getpid() != self._pid:
            self._after_fork()
            return
        retry_after = None if retry_after is None else check_due(retry_after, None)[0]
        if self._tpc.xid is not None:
            self.tpc_rollback()  # refuses once decided
            return
        sp = _otel.spans()
        if sp is None:
            self._txn.rollback(count_delivery=count_delivery, retry_after=retry_after)
            return
        with sp.settle("rollback", self._link.ops):
            self._txn.rollback(count_delivery=count_delivery, retry_after=retry_after)

    @contextmanager
    def transaction(self) -> Iterator[Session]:
        """Commit on normal exit, roll back on an exception (which propagates).

        A two-phase transaction decided by :meth:`tpc_decide` is never rolled
        back: on an exception it stays prepared (call :meth:`tpc_commit`, or
        leave it to recovery).
        """
        self._check()
        try:
            yield self
        except BaseException:
            if not self._closed and not self._tpc.decided:
                self.rollback()
            raise
        self.commit()

    # -- two-phase commit -------------------------------------------------------------

    def xid(self, gtrid: str) -> Any:
        """A transaction id for :meth:`tpc_begin` (format 0, branch ``ringq``)."""
        self._require_open()
        return self._tpc.make_xid(gtrid)

    def tpc_begin(self, xid: Any) -> None:
        """Start a two-phase transaction (psycopg's ``tpc_begin``); the connection must be idle."""
        self._check()
        self._tpc.begin(xid)

    def tpc_prepare(self) -> None:
        """Send the row writes the session holds (:meth:`flush`), log the
        slots this transaction touches (committed on its own), then PREPARE.

        :raises StaleSection: a row write did not match (see :meth:`flush`):
            the transaction was rolled back; retry it.
        """
        self._check()
        self._tpc.require_open()
        self._flush()
        self._tpc.prepare()

    def tpc_decide(self) -> None:
        """Record the coordinator's durable decision to commit the prepared transaction.

        Call it after :meth:`tpc_prepare` (on every participant, once all have
        prepared) and before :meth:`tpc_commit`. The decision is committed on
        the session's side connection, on its own: if this process dies
        before COMMIT PREPARED, recovery (the monitor's ``resolve_prepared``)
        commits the transaction; without a decision it rolls it back once
        older than its timeout. :meth:`tpc_commit` clears the decision right
        after COMMIT PREPARED. Once decided, the transaction only commits:
        :meth:`tpc_rollback` (and :meth:`rollback`) refuse, and :meth:`close`
        leaves it prepared for recovery.

        :raises TransactionError: no prepared two-phase transaction.
        :raises DatabaseUnavailable: the decision could not be recorded (then
            it is not made: roll back, or retry).
        """
        self._check()
        self._tpc.decide()

    def tpc_commit(self) -> None:
        """COMMIT PREPARED (or one-phase commit if not prepared); then publish.

        :raises InDoubt: the answer to COMMIT PREPARED was lost; recovery
            commits the transaction if :meth:`tpc_decide` recorded it, else
            rolls it back after a timeout.
        :raises RolledBack: the connection was lost and nothing of the
            transaction committed (the rows show it, or it was lost before
            its COMMIT): retry it.
        """
        self._require_open()
        self._tpc.require_open()
        sp = _otel.spans()
        if sp is None:
            self._tpc_commit()
            return
        with sp.settle("tpc_commit", self._link.ops):
            self._tpc_commit()

    def _tpc_commit(self) -> None:
        if not self._tpc.prepared:
            try:
                self._flush()  # a one-phase commit: the row writes go first
            except DatabaseUnavailable as err:
                if self._link.ops:
                    raise  # the connection stands: the writes are still the session's
                # Lost before the COMMIT was sent: nothing of it committed
                # (the link decided its slots from the rows).
                raise self._tpc.lost_before_commit(err) from err
        self._tpc.end(commit=True)

    def tpc_rollback(self) -> None:
        """ROLLBACK PREPARED (or a plain rollback if not prepared).

        :raises TransactionError: :meth:`tpc_decide` recorded the decision to
            commit: once durable it stands (other participants may have
            committed already), so only :meth:`tpc_commit` or recovery may
            finish the transaction, and both commit it.
        """
        self._require_open()
        self._tpc.refuse_rollback()
        self._tpc.require_open()
        sp = _otel.spans()
        if sp is None:
            self._tpc.end(commit=False)
            return
        with sp.settle("tpc_rollback", self._link.ops):
            self._tpc.end(commit=False)

    # -- enqueue -----------------------------------------------------------------------

    def enqueue(
        self,
        queue: str,
        payload: bytes,
        *,
        key: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        not_before: datetime | None = None,
        trace: str | None = None,
    ) -> int:
        """Put ``payload`` on ``queue`` in the current transaction; returns its sequence number.

        The entry is on the queue only once the transaction commits. Without
        ``key`` nothing goes to the database now: the slot is reserved in the
        global section and the row write is kept in the session until
        :meth:`commit` (or :meth:`flush`) sends it, so a failure of the write
        surfaces there (:class:`StaleSection`: retry the transaction). With
        ``key``, the write is made now (one round trip), and a second enqueue
        of the same key returns the first entry's sequence and adds nothing.
        A full queue blocks up to ``timeout`` seconds (default: the queue's
        full_timeout) under the 'block' policy.

        With ``group``, the entry joins that group: entries of a group are
        delivered in order (an entry enqueued after another's transaction
        committed comes after it) and at most one of them is held by a
        dequeuer at a time, across all consumers on the host; entries of
        other groups are taken in parallel.

        With ``delay`` (seconds, counted from the commit's row write by the
        database's clock) or ``not_before`` (an aware datetime), the entry
        exists from the commit (depth counts it) but no consumer receives it
        before that time: in a shared queue consumers read past it, in a
        group the group waits for it, in a single-dequeuer queue the queue
        waits for it (order is the promise).

        With ``trace`` (a W3C ``traceparent``), the entry carries that trace
        context, beside its payload (not counted against the queue's
        max_payload); its dequeue's :attr:`Message.trace` gives it back.
        With the ``otel`` extra and a tracer provider set, the enqueue makes
        a producer span, whose context the entry carries unless ``trace`` is
        given (see ``engine/session/_otel.py``).

        :raises QueueNotFound, PayloadTooLarge, QueueFull, SessionClosed, DatabaseUnavailable:
        :raises TransactionError: the transaction failed earlier (roll it back).
        :raises InvalidArgumentType: the payload is not bytes-like, the key or group not a str.
        :raises InvalidArgument: the key is over 1,000 bytes, the group empty or over
            128 bytes, the timeout negative; ``delay`` negative, NaN or infinite,
            ``not_before`` naive, or both given; ``trace`` not printable ASCII or
            over 512 characters.
        """
        self._check()
        sp = _otel.spans()
        if sp is None:
            return self._reservations.enqueue_checked(queue, payload, key, group, timeout,
                                                      delay, not_before, trace)
        with sp.enqueue(queue, "enqueue") as s:
            seq = self._reservations.enqueue_checked(queue, payload, key, group, timeout,
                                                     delay, not_before, trace or s.traceparent)
            s.seqs = (seq,)
        return seq

    def enqueue_many(
        self,
        queue: str,
        payloads: Iterable[bytes],
        *,
        group: str | Iterable[str | None] | None = None,
        timeout: float | None = None,
        delay: float | None = None,
        not_before: datetime | None = None,
        trace: str | None = None,
    ) -> list[int]:
        """Enqueue several entries; returns their sequence numbers, in order.

        As :meth:`enqueue` without a key: nothing goes to the database now;
        the commit writes the rows of a queue in one statement. ``group`` is
        one group for all the entries, or one group (or None) per entry;
        ``delay``, ``not_before`` and ``trace`` (as :meth:`enqueue`) hold for
        all (with the ``otel`` extra: one producer span, for the batch).

        :raises InvalidArgumentType: ``payloads`` is not an iterable of bytes-like
            payloads, or ``group`` not a str, None or an iterable of them.
        :raises InvalidArgument: the timeout is negative, a group is refused
            (as :meth:`enqueue`), or the groups are not one per payload.
        """
        self._check()
        sp = _otel.spans()
        if sp is None:
            return self._reservations.enqueue_many_checked(queue, payloads, group, timeout,
                                                           delay, not_before, trace)
        with sp.enqueue(queue, "enqueue_many") as s:
            s.seqs = seqs = self._reservations.enqueue_many_checked(
                queue, payloads, group, timeout, delay, not_before, trace or s.traceparent)
        return seqs

    # -- dequeue -----------------------------------------------------------------------

    def dequeue(self, queue: str, *, wait: float | None = None) -> Message | None:
        """Take the oldest ready entry of ``queue`` in the current transaction.

        Returns None if nothing is ready (after sleeping up to ``wait`` seconds
        on the queue's wake-up, if given). The entry is consumed only if the
        transaction commits; on rollback it is delivered again.
        """
        self._check()
        sp = _otel.spans()
        if sp is None:
            return self._claims.dequeue_one(queue, wait)
        with sp.dequeue(queue, "dequeue") as s:
            msg = self._claims.dequeue_one(queue, wait)
            s.messages = () if msg is None else (msg,)
        return msg

    def dequeue_many(self, queue: str, max_n: int, *, wait: float | None = None) -> list[Message]:
        """Take up to ``max_n`` ready entries (oldest first) in one statement.

        :raises InvalidArgumentType: ``max_n`` is not an int, ``wait`` not a number.
        :raises InvalidArgument: ``max_n`` is below 1, ``wait`` negative.
        """
        self._check()
        sp = _otel.spans()
        if sp is None:
            return self._claims.dequeue_checked(queue, max_n, wait)
        with sp.dequeue(queue, "dequeue_many") as s:
            s.messages = msgs = self._claims.dequeue_checked(queue, max_n, wait)
        return msgs

    # -- recovery ------------------------------------------------------------------------

    def recover_dead_holders(self, queue: str, *, timeout: float = 30.0) -> None:
        """Decide the slots of ``queue`` held by dead clients (a killed process,
        a session that handed its slots over, an orphaned token), and its
        dequeuer role, as the monitor would, and wait until none is left.

        For a client taking over from a dead one (a mover) before it adds
        anything behind those slots. Recovery waits for the dead holders'
        backends to end, so this takes at least that long.

        :raises QueueError: dead holders remain after ``timeout`` seconds.
        :raises DatabaseUnavailable: the database cannot be reached.
        """
        self._check()
        validate_seconds("timeout", timeout, 0.0, 86400.0)
        self._link.wait_dead_holders(queue, timeout)

    # -- events and introspection ----------------------------------------------------------

    def subscribe(self, *patterns: str) -> Subscription:
        """Receive the monitor's named events matching shell-style ``patterns``
        (``"queue.*.full"``, ``"consumer.died"``) on a connection of their own."""
        self._check()
        return Subscription(self.dsn, patterns)

    def publish(self, name: str, **data: Any) -> None:
        """Publish a named event in the current transaction (sent at commit)."""
        self._check()
        self._link.call(lambda: publish(self._link.conn, name, **data))

    def stats(self, queue: str) -> dict[str, int]:
        """The queue's counters in the section (see ringq.engine.metrics)."""
        self._check()
        return self._link.queue_stats(queue)

    @property
    def section(self) -> Section:
        return self._link.section

    def ring(self, queue: str) -> Ring:
        """The queue's block in the global section (for inspection).

        :raises SessionClosed: the session is closed.
        """
        self._check()
        return self._link.ring(self._link.info(queue))
