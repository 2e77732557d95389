"""Sessions: enqueue and dequeue inside the caller's own PostgreSQL transaction.

One session = one PostgreSQL connection + one client entry in the global
section. Its in-flight slots (reserved for enqueue, locked for dequeue) are
finished in the section only after the database has answered the commit or
rollback; until then they stay locked, so no other client can see them.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar, Self, TypeVar

import posix_ipc
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _layout as L
from . import _wire
from ._decide import decide_ops, load_queue, resync_queue, wait_backend_gone
from ._dsn import resolve_dsn
from ._errors import (
    DatabaseUnavailable,
    InDoubt,
    PayloadTooLarge,
    QueueFull,
    QueueNotFound,
    RingqError,
    SchemaMissing,
    SectionError,
    SessionClosed,
    StaleSection,
    TransactionError,
    from_psycopg,
    redact_dsn,
)
from ._events import Subscription, publish
from ._names import queue_table, validate_queue_name
from ._ops import Op, OpKind, RowState, RowWrite
from ._queries import QUERIES as _Q
from ._queue_info import QueueInfo as QueueInfo  # noqa: PLC0414 (re-exported for ringq.engine)
from ._ring import Ring
from ._section import Section
from ._tpc import TwoPhase

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
_INTRANS = TransactionStatus.INTRANS
_INERROR = TransactionStatus.INERROR
T = TypeVar("T")

SUPPORTED_SCHEMA = "1"
POISON_REASON = "max deliveries reached"
# A waiting dequeuer is woken by the commit that makes an entry ready (a
# semaphore post); it also looks again this often, in seconds, as a safety net.
CLAIM_RECHECK_S = 1.0


@dataclass(frozen=True)
class Message:
    """An entry taken from a queue; consumed only if the transaction commits.

    ``deliveries`` counts this delivery: 1 the first time, more if earlier
    deliveries were rolled back (so the consumer can check idempotency).
    """

    queue: str
    seq: int
    payload: bytes
    producer: str
    producer_seq: int
    enqueued_at: datetime
    deliveries: int

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1


class _Process:
    """Per-process attachment: one Section per database instance, re-made after fork()."""

    lock = threading.Lock()
    pid = os.getpid()
    sections: ClassVar[dict[str, Section]] = {}

    @classmethod
    def section(cls, instance: str) -> Section:
        with cls.lock:
            if cls.pid != os.getpid():
                # Forked: the parent's mapping stays valid but its locks and
                # client entries are not ours; start afresh.
                cls.sections = {}
                cls.pid = os.getpid()
            sec = cls.sections.get(instance)
            if sec is not None and (sec.closed or sec.unlinked()):
                cls.sections.pop(instance, None)
                sec = None
            if sec is None:
                sec = Section.attach(instance)
                cls.sections[instance] = sec
            return sec


_producer_counter = iter(range(1, 1 << 62))


def connect(
    dsn: str | None = None,
    *,
    producer: str | None = None,
    connect_timeout: float = 10.0,
    application_name: str = "ringq",
    eager_begin: bool = False,
) -> Session:
    """Open a session: DSN from the argument, else ``RINGQ_DSN``, else the embedded cluster.

    A transaction costs one round trip: enqueues are kept in the session
    and sent with the BEGIN and the COMMIT; a dequeue on an idle connection
    carries its own BEGIN. Between transactions the connection is idle (no
    transaction open). ``eager_begin`` (deprecated, off by default) sends
    the next ``BEGIN`` with each ``COMMIT``/``ROLLBACK`` instead, leaving the
    connection "idle in transaction" between transactions.

    :raises DatabaseUnavailable: the database cannot be reached.
    :raises SchemaMissing: the database holds no ringq schema (create a queue first).
    :raises SectionIncompatible: the host's global section has a foreign layout.
    """
    return Session(
        resolve_dsn(dsn),
        producer=producer,
        connect_timeout=connect_timeout,
        application_name=application_name,
        eager_begin=eager_begin,
    )


class Session(TwoPhase):
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
        eager_begin: bool = False,
    ) -> None:
        self.dsn = dsn
        self._eager = eager_begin
        self._connect_timeout = connect_timeout
        self._appname = application_name
        self._pid = os.getpid()
        self.producer = producer or f"{socket.gethostname()}:{os.getpid()}:{next(_producer_counter)}"
        self._producer_seq = 0
        self._ops: list[Op] = []
        self._queues: dict[str, QueueInfo] = {}
        self._rings: dict[int, Ring] = {}
        self._stmts: dict[tuple[str, str], str] = {}
        self._closed = False
        self._tpc_reset()
        self._role = L.CR_CLIENT  # C_ROLE of our client entry (a worker sets CR_WORKER)
        self._conn = self._open_connection()
        self._attach()
        self._begin()

    # -- life cycle -----------------------------------------------------------------

    def _open_connection(self) -> psycopg.Connection[Any]:
        return self._call(
            lambda: psycopg.connect(
                self.dsn,
                autocommit=False,
                connect_timeout=max(1, int(self._connect_timeout)),
                application_name=self._appname,
            ),
            recover=False,
        )

    def _attach(self) -> None:
        def read_instance() -> tuple[Any, ...] | None:
            row = self._conn.execute(_Q["attach"]).fetchone()
            self._conn.rollback()
            return row

        try:
            row = self._call(read_instance, recover=False)
        except RingqError as exc:
            self._conn.close()
            if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
                raise SchemaMissing(
                    f"no ringq schema in {redact_dsn(self.dsn)!r}: create a queue first (ringq queue create)"
                ) from exc.__cause__
            raise
        assert row is not None
        instance, version, backend_pid, has_guard = row
        if version != SUPPORTED_SCHEMA or not instance:
            self._conn.close()
            raise SchemaMissing(f"ringq schema version {version!r} is not supported (want {SUPPORTED_SCHEMA})")
        if not has_guard:
            self._conn.close()
            raise SchemaMissing(
                "the ringq schema lacks ringq.expect_rows(), which this version's commits need: apply the "
                "schema script again (ringq queue create, or ringq script create-queue | psql)"
            )
        self.instance: str = instance
        self.backend_pid: int = backend_pid
        try:
            self._section = _Process.section(instance)
        except RingqError:  # a foreign or unusable section: do not leak the connection
            self._conn.close()
            raise
        self._register_client(backend_pid)
        self._rings = {}

    def _register_client(self, backend_pid: int) -> None:
        old = getattr(self, "_finalizer", None)
        if old is not None:
            old.detach()
        self._cidx = self._section.add_client(backend_pid)
        self.owner = self._cidx + 1
        if self._role:
            self._section.set_client_role(self._cidx, self._role)
        # A session dropped without close() hands its entry to recovery.
        self._finalizer = weakref.finalize(self, _orphaned, self._section, self._cidx, os.getpid())

    def _set_role(self, role: int) -> None:
        """Mark our client entry with ``role`` (CR_*), kept across re-registrations."""
        self._role = role
        self._section.set_client_role(self._cidx, role)

    def _set_client_words(self, words: Iterable[tuple[int, int]]) -> None:
        """Write (word, value) pairs into our client entry (a worker's counters)."""
        self._section.set_client_words(self._cidx, words)

    def _begin(self) -> None:
        """Start the next transaction now, if eager (psycopg would otherwise send
        BEGIN as an extra round trip before the first statement)."""
        if self._eager and self._conn.info.transaction_status == _IDLE:
            self._execute(self._begin_sql(), recover=False)

    def _begin_sql(self) -> str:
        iso = self._conn.isolation_level
        if iso is None:
            return "BEGIN"
        return "BEGIN ISOLATION LEVEL " + iso.name.replace("_", " ")

    def _end(self, verb: str) -> None:
        """COMMIT or ROLLBACK, and with eager begin the next BEGIN in the same round trip.

        :raises RingqError: converted, not recovered: the caller decides what the failure means.
        """
        if self._eager and self._tpc_xid is None and self._conn.info.transaction_status != _IDLE:
            self._execute(f"{verb}; {self._begin_sql()}", recover=False)  # simple protocol: one round trip
        elif verb == "COMMIT":
            self._call(self._conn.commit, recover=False)
        else:
            self._call(self._conn.rollback, recover=False)

    def close(self) -> None:
        """Roll back anything open and release the connection; a second call does nothing.

        A prepared two-phase transaction decided by :meth:`tpc_decide` is not
        rolled back (other participants may have committed): it stays
        prepared, its slots held, for recovery (``resolve_prepared``) to commit.
        """
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True  # the parent's connection and client entry are not ours
            return
        try:
            self._eager = False  # no BEGIN after the last rollback
            if self._tpc_decided:
                self._leave_decided()
            elif self._ops or self._conn.info.transaction_status != _IDLE:
                self.rollback()
        except RingqError:
            logger.warning("ringq: rollback at close failed", exc_info=True)
        finally:
            self._closed = True
            if not self._ops:
                self._section.remove_client(self._cidx)
                self._finalizer.detach()
            self._conn.close()
            if self._aux is not None:
                self._aux.close()

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
        return self._conn

    def _check(self) -> None:
        if self._closed:
            raise SessionClosed("the session is closed")
        if os.getpid() != self._pid:
            self._after_fork()
        if self._ops and self._conn.info.transaction_status == _IDLE and not self._tpc_prepared and self._sent():
            # Someone committed or rolled back on the connection directly:
            # learn the outcome from the rows. (A prepared transaction is
            # idle too, but undecided: tpc_commit/tpc_rollback finish it.)
            # If the connection is lost meanwhile, _call decides them
            # from a new one. Row writes still held in the session never
            # went: they stay, for the session's own commit or rollback.
            self._call(lambda: self._decide_from_rows(self._conn, self._sent()))
            self._ops = [op for op in self._ops if op.write is not None]
            self._begin()
        if self._section.unlinked() and not self._ops:
            self._reattach_section()

    def _sent(self) -> list[Op]:
        """The in-flight ops whose statements went to the server (all but
        enqueues whose row write the session still holds)."""
        return [op for op in self._ops if op.write is None]

    def _after_fork(self) -> None:
        # The inherited connection belongs to the parent: never close it here
        # (psycopg does not finish a connection made in another process).
        self._pid = os.getpid()
        self._ops = []
        self._aux = None  # the parent's: never close it here
        self._producer_seq = 0
        self.producer = f"{socket.gethostname()}:{os.getpid()}:{next(_producer_counter)}"
        self._conn = self._open_connection()
        self._attach()
        self._begin()

    def _reattach_section(self) -> None:
        old = self._section
        self._section = _Process.section(self.instance)
        if self._section is not old:
            self._register_client(self.backend_pid)
            self._rings = {}

    # -- queues -------------------------------------------------------------------

    def queue_info(self, name: str) -> QueueInfo:
        """The queue's settings (cached for the session's life).

        :raises InvalidQueueName: bad name. :raises QueueNotFound: no such queue.
        :raises SessionClosed: the session is closed.
        """
        self._check()
        return self._info(name)

    def _info(self, name: str) -> QueueInfo:
        info = self._queues.get(name)
        if info is None:
            validate_queue_name(name)
            row = self._execute(_Q["queue_info"], (name,)).fetchone()
            if row is None:
                raise QueueNotFound(f"queue {name!r} does not exist", queue=name)
            info = QueueInfo(*row)
            self._queues[name] = info
        return info

    def _ring(self, info: QueueInfo) -> Ring:
        ring = self._rings.get(info.id)
        if ring is None:
            qidx = self._section.find_queue(info.id)
            if qidx is None:
                qidx = self._load_queue(info)
            ring = Ring(self._section, qidx)
            self._rings[info.id] = ring
            self._section.mark_client_queue(self._cidx, qidx)  # once per session and queue
        return ring

    def _load_queue(self, info: QueueInfo) -> int:
        """Bring a queue into the section from its table (first user on this host)."""
        # Read the rows on a separate connection: outside the caller's
        # transaction, committed state only.
        def load() -> int:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout))) as aux:
                return load_queue(self._section, aux, info)

        return self._call(load, queue=info.name, recover=False)

    def _stmt(self, name: str, queue: str) -> str:
        key = (name, queue)
        stmt = self._stmts.get(key)
        if stmt is None:
            stmt = sql.SQL(_Q[name]).format(table=queue_table(queue), queue=sql.Literal(queue)).as_string(None)
            self._stmts[key] = stmt
        return stmt

    # -- the database -------------------------------------------------------------------

    def _call(
        self, fn: Callable[[], T], *, queue: str | None = None, qid: int = 0, seq: int = -1, recover: bool = True
    ) -> T:
        """Run ``fn``, the session's database work: the one place where its
        psycopg errors become ringq errors (``raise X from exc``: the psycopg
        error stays as ``__cause__``).

        With ``qid`` (a queue statement of ours) the error is also recorded in
        our client entry for the monitor. With ``recover`` (the default) a lost
        connection is handled here: our in-flight slots are decided from the
        rows on a new connection. ``recover=False`` only converts: for opening
        connections, and for the paths that decide themselves what a failure
        means (commit, rollback, strikes, recovery itself).
        """
        try:
            return fn()
        except psycopg.Error as exc:
            if recover:
                lost = self._conn.broken or isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError) and self._conn.closed
                # A statement refused because the caller's own SQL already failed
                # the transaction is the caller's error, not ours.
                if qid and not isinstance(exc, psycopg.errors.InFailedSqlTransaction):
                    self._record_error(L.ERR_CONNECTION_LOST if lost else L.ERR_DATABASE, qid, seq)
                if lost:
                    self._connection_lost(exc)
            raise from_psycopg(exc, dsn=self.dsn, queue=queue) from exc

    def _execute(
        self,
        query: str,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
        *,
        conn: psycopg.Connection[Any] | None = None,
        binary: bool = False,
        queue: str | None = None,
        qid: int = 0,
        seq: int = -1,
        recover: bool = True,
    ) -> psycopg.Cursor[Any]:
        """Run one statement on the session's connection (or ``conn``); errors as in :meth:`_call`."""
        c = self._conn if conn is None else conn
        return self._call(
            lambda: c.execute(query, params, binary=binary), queue=queue, qid=qid, seq=seq, recover=recover
        )

    def _execute_in_tx(
        self,
        query: str,
        params: Sequence[Any] | Mapping[str, Any] | None = None,
        *,
        binary: bool = False,
        queue: str | None = None,
        qid: int = 0,
        seq: int = -1,
    ) -> psycopg.Cursor[Any]:
        """As :meth:`_execute`, for a statement that may open the transaction:
        on an idle connection the BEGIN travels with it (one round trip)."""
        c = self._conn
        may_begin = self._tpc_xid is None
        return self._call(
            lambda: _wire.execute(c, query, params, binary=binary, may_begin=may_begin), queue=queue, qid=qid, seq=seq
        )

    # -- transactions -------------------------------------------------------------------

    def _record_error(self, code: int, qid: int = 0, seq: int = -1) -> None:
        """Record an error this client hit in its section entry (error paths only;
        the monitor logs it with our pid, the queue and the seq)."""
        try:
            self._section.record_client_error(self._cidx, code, qid, seq)
        except (ValueError, IndexError, TypeError):  # a released view: the section is gone
            pass

    def _record_ops_error(self, code: int, ops: Sequence[Op]) -> None:
        op = ops[0] if ops else None
        self._record_error(code, op.info.id if op else 0, op.seq if op else -1)

    def _connection_lost(self, exc: BaseException) -> None:
        """The connection died mid-transaction: nothing committed; free our slots by the rows."""
        ops, self._ops = self._ops, []
        self._recover(ops, reason=str(exc))

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
        if self._tpc_xid is not None:
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        ops = self._ops
        status = self._conn.info.transaction_status
        if status == _INERROR:
            self.rollback()
            raise TransactionError("the transaction failed earlier and was rolled back")
        writes = [op for op in ops if op.write is not None]
        try:
            if writes:
                self._send_writes(writes, commit=True)
            else:
                self._end("COMMIT")
        except StaleSection:
            raise  # rolled back and resynced already
        except RingqError as err:
            exc = err.__cause__
            self._ops = []
            if self._conn.broken or self._conn.closed:
                committed = self._recover(ops, reason=f"commit answer lost: {exc}")
                if committed is None:
                    self._record_ops_error(L.ERR_IN_DOUBT, ops)
                    raise InDoubt(f"commit outcome unknown: {exc}") from exc
                if committed:
                    logger.warning("ringq: commit answer lost, but the rows show it committed")
                    return
                self._record_ops_error(L.ERR_COMMIT_FAILED, ops)
                raise TransactionError(f"commit failed and was rolled back: {exc}") from exc
            # The server refused the commit (deferred constraint, serialization,
            # a row write that failed): rolled back, or to be rolled back when
            # a failed statement kept the COMMIT behind it from running.
            with suppress(RingqError):
                self._call(self._conn.rollback, recover=False)
            self._finish(ops, committed=False)
            if ops:
                self._record_ops_error(L.ERR_COMMIT_FAILED, ops)
            raise
        self._ops = []
        self._finish(ops, committed=True)

    def flush(self) -> None:
        """Send the row writes of this transaction's enqueues now (one round
        trip, opening the transaction if none is open) rather than with the
        COMMIT: to learn of a failed write early, or to read the queue table
        in the same transaction (the transaction's own reads do not see the
        writes the session still holds).

        :raises StaleSection: as :meth:`commit`: the transaction was rolled back.
        :raises SessionClosed, DatabaseUnavailable:
        """
        self._check()
        writes = [op for op in self._ops if op.write is not None]
        if writes:
            self._send_writes(writes, commit=False)

    def _send_writes(self, writes: list[Op], *, commit: bool) -> None:
        """Send the row writes the session holds for ``writes`` in one round
        trip: after a BEGIN if no transaction is open, one statement per
        queue, then the COMMIT if ``commit``.

        Every write is guarded: a row that does not match makes its statement
        fail (SQLSTATE RQ001), so nothing after it runs. Then the whole
        transaction is rolled back (its reservations voided, its dequeued
        entries given back without a strike: not their fault), the queue's
        block resynced from the rows, and :class:`StaleSection` raised.
        """
        by_queue: dict[str, list[Op]] = {}
        for op in writes:
            by_queue.setdefault(op.info.name, []).append(op)
        statements = [self._write_statement(name, group) for name, group in by_queue.items()]
        try:
            self._call(
                lambda: _wire.send(self._conn, statements, commit=commit, may_begin=self._tpc_xid is None),
                recover=not commit,  # commit() decides itself what a lost answer means
            )
        except StaleSection as err:
            group = by_queue.get(err.queue or "", writes)
            info = group[0].info
            self._record_error(L.ERR_ROW_MISMATCH, info.id, group[0].seq)
            self.rollback(count_delivery=False)
            self._resync(info)
            logger.warning("ringq: queue %s: stale section (a row write did not match its row): resynced", info.name)
            raise
        for op in writes:
            op.write = None

    def _write_statement(self, queue: str, ops: list[Op]) -> _wire.Statement:
        """The guarded row write of ``ops`` (enqueues of one queue): one statement."""
        if len(ops) == 1:
            op = ops[0]
            w = op.write
            assert w is not None
            return self._stmt("enqueue", queue), (op.seq, w.payload, self.producer, w.producer_seq, op.slot, op.seq)
        writes = [op.write for op in ops]
        return self._stmt("enqueue_many", queue), (
            self.producer,
            [op.slot for op in ops],
            [op.seq for op in ops],
            [w.payload for w in writes if w is not None],
            [w.producer_seq for w in writes if w is not None],
            len(ops),
        )

    def rollback(self, *, count_delivery: bool = True) -> None:
        """Roll back: enqueued entries are voided, dequeued ones become ready again
        (and count a delivery; at the queue's max_deliveries they move to
        ``ringq.exceptions``). ``count_delivery=False`` gives entries back
        without a strike (a shutdown that aborts work, not the entry's fault).

        One round trip at most: the row writes the session holds are simply
        dropped, and the strikes travel with the ROLLBACK."""
        if self._closed:
            raise SessionClosed("the session is closed")
        if os.getpid() != self._pid:
            self._after_fork()
            return
        if self._tpc_xid is not None:
            self.tpc_rollback()  # refuses once decided
            return
        ops, self._ops = self._ops, []
        deq = [op for op in ops if op.kind == OpKind.DEQUEUE] if count_delivery else []
        poisoned: set[tuple[int, int]] = set()
        try:
            if deq:
                poisoned = self._strike(deq, rollback=True)
            else:
                self._end("ROLLBACK")
        except RingqError as err:
            self._recover(ops, reason=f"rollback failed: {err.__cause__}")
            raise
        self._finish(ops, committed=False, poisoned=poisoned)
        if deq and not self._closed:
            self._begin()

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
            if not self._closed and not self._tpc_decided:
                self.rollback()
            raise
        self.commit()

    def _finish(
        self,
        ops: list[Op],
        *,
        committed: bool,
        count_delivery: bool = True,
        poisoned: set[tuple[int, int]] | None = None,
    ) -> None:
        """Tell the section the outcome of ``ops`` (the database already decided).

        Not committed, rolled-back dequeues count a delivery (unless
        ``count_delivery`` is false), unless ``poisoned`` is given: the
        strikes were written already, and these (slot, seq) were poisoned.
        """
        if not ops:
            return
        if poisoned is None:
            poisoned = set()
            if not committed and count_delivery:
                poisoned = self._strike([op for op in ops if op.kind == OpKind.DEQUEUE])
        by_ring: dict[int, list[Op]] = {}
        for op in ops:
            by_ring.setdefault(op.ring.qidx, []).append(op)
        sec = self._section
        posts: list[tuple[int, str, int]] = []
        for qidx, group in by_ring.items():
            ring = group[0].ring
            exclusive = group[0].info.dequeue_mode == "single"
            sec.lock_queue(qidx)
            try:
                wake_r, wake_s = ring.finish_batch(
                    group, self.owner, committed=committed, poisoned=poisoned, exclusive=exclusive
                )
            finally:
                sec.unlock_queue(qidx)
            if wake_r:
                posts.append((ring.qid, "r", wake_r))
            if wake_s:
                posts.append((ring.qid, "s", wake_s))
        sec.count_client(self._cidx, L.C_N_COMMIT if committed else L.C_N_ROLLBACK)
        for qid, kind, n in posts:
            sec.post(qid, kind, n)

    def _strike(self, deq_ops: list[Op], *, rollback: bool = False) -> set[tuple[int, int]]:
        """Count a failed delivery on each rolled-back dequeue; returns the poisoned ones.

        One round trip: the ROLLBACK of the open transaction (with
        ``rollback``; else the transaction has ended already), then one
        strike statement per queue, in autocommit.

        :raises RingqError: with ``rollback`` only, when the connection was
            lost (recovery decides the slots); a strike that fails otherwise
            is logged and skipped.
        """
        if not deq_ops:
            return set()
        by_queue: dict[str, list[Op]] = {}
        for op in deq_ops:
            by_queue.setdefault(op.info.name, []).append(op)
        statements: list[_wire.Statement] = []
        for name, group in by_queue.items():
            info = group[0].info
            params = {
                "max_deliveries": info.max_deliveries,
                "slots": [op.slot for op in group],
                "seqs": [op.seq for op in group],
                "queue_id": info.id,
                "reason": POISON_REASON,
            }
            statements.append((self._stmt("strike", name), params))
        try:
            cursors = self._call(lambda: _wire.rollback_then(self._conn, statements), recover=False)
        except RingqError:
            if rollback and (self._conn.broken or self._conn.closed):
                raise  # the ROLLBACK may not have run: the caller recovers
            # Losing a strike is harmless: the entry is redelivered; the
            # monitor counts strikes of clients that die.
            logger.warning("ringq: could not record a failed delivery", exc_info=True)
            return set()
        poisoned: set[tuple[int, int]] = set()
        for name, cur in zip(by_queue, cursors, strict=True):
            for slot, seq, state, deliveries, moved_to, kept_because in cur.fetchall():
                if state == RowState.CONSUMED:
                    poisoned.add((slot, seq))
                    logger.warning(
                        "ringq: entry %s/%s poisoned after %s deliveries: moved to ringq.exceptions%s",
                        name, seq, deliveries,
                        f" and queue {moved_to}" if moved_to else f" only ({kept_because})" if kept_because else "",
                    )
        return poisoned

    # -- enqueue -----------------------------------------------------------------------

    def enqueue(self, queue: str, payload: bytes, *, key: str | None = None, timeout: float | None = None) -> int:
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

        :raises QueueNotFound, PayloadTooLarge, QueueFull, SessionClosed, DatabaseUnavailable:
        :raises TransactionError: the transaction failed earlier (roll it back).
        """
        self._check()
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        payload = _as_bytes(payload)
        if len(payload) > info.max_payload:
            self._record_error(L.ERR_PAYLOAD_TOO_LARGE, info.id)
            raise PayloadTooLarge(
                f"payload of {len(payload):,} bytes exceeds queue {queue!r} max_payload {info.max_payload:,}",
                queue=queue,
            )
        self._check_not_failed()
        if key is None:
            slot, seq = self._reserve(info, timeout)
            self._producer_seq += 1
            op = Op(self._ring(info), info, slot, seq, OpKind.ENQUEUE, write=RowWrite(payload, self._producer_seq))
            self._ops.append(op)
            op.latency_ns = time.perf_counter_ns() - t0
            self._section.count_client(self._cidx, L.C_N_ENQ)
            return seq
        for _attempt in range(8):
            slot, seq = self._reserve(info, timeout)
            self._producer_seq += 1
            op = Op(self._ring(info), info, slot, seq, OpKind.ENQUEUE)
            self._ops.append(op)
            row = self._execute_in_tx(
                self._stmt("enqueue_key", queue),
                {
                    "queue_id": info.id,
                    "key": key,
                    "seq": seq,
                    "payload": payload,
                    "producer": self.producer,
                    "producer_seq": self._producer_seq,
                    "slot": slot,
                },
                queue=queue,
                qid=info.id,
                seq=seq,
            ).fetchone()
            assert row is not None
            inserted, updated, existing = row
            if inserted == 0 and existing is None:
                # Another transaction held the key uncommitted; the
                # INSERT waited for its commit, but under READ
                # COMMITTED this statement's snapshot predates it:
                # read the key again (a new statement, a new snapshot).
                again = self._execute(_Q["key_seq"], (info.id, key), queue=queue, qid=info.id, seq=seq).fetchone()
                existing = None if again is None else again[0]
            if inserted == 1 and updated == 0:
                self._execute(_Q["key_forget"], (info.id, key, seq), queue=queue, qid=info.id, seq=seq)
            if inserted == 1 and updated == 1:
                op.latency_ns = time.perf_counter_ns() - t0
                self._section.count_client(self._cidx, L.C_N_ENQ)
                return seq
            self._ops.remove(op)
            self._void(op)
            if existing is not None and not (inserted == 1 and updated == 0):
                return int(existing)  # idempotent repeat: the first entry's sequence
            # The section was stale: the row holds something newer. Re-read the queue.
            self._record_error(L.ERR_ROW_MISMATCH, info.id, seq)
            self._resync(info)
        raise SectionError(f"queue {queue!r}: could not reserve a slot after 8 attempts (section unstable)")

    def enqueue_many(self, queue: str, payloads: Iterable[bytes], *, timeout: float | None = None) -> list[int]:
        """Enqueue several entries; returns their sequence numbers, in order.

        As :meth:`enqueue` without a key: nothing goes to the database now;
        the commit writes the rows of a queue in one statement.
        """
        self._check()
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        items = [_as_bytes(p) for p in payloads]
        for p in items:
            if len(p) > info.max_payload:
                self._record_error(L.ERR_PAYLOAD_TOO_LARGE, info.id)
                raise PayloadTooLarge(
                    f"payload of {len(p):,} bytes exceeds queue {queue!r} max_payload {info.max_payload:,}",
                    queue=queue,
                )
        if not items:
            return []
        self._check_not_failed()
        ring = self._ring(info)
        reserved: list[tuple[int, int]] = []
        try:
            while len(reserved) < len(items):
                reserved.extend(self._reserve_many(info, len(items) - len(reserved), timeout))
        except BaseException:
            for slot, seq in reserved:
                self._void(Op(ring, info, slot, seq, OpKind.ENQUEUE))
            raise
        pseq = self._producer_seq
        self._producer_seq += len(items)
        lat = (time.perf_counter_ns() - t0) // len(items)
        ops = [
            Op(ring, info, slot, seq, OpKind.ENQUEUE, latency_ns=lat, write=RowWrite(payload, pseq + i))
            for i, ((slot, seq), payload) in enumerate(zip(reserved, items, strict=True), start=1)
        ]
        self._ops.extend(ops)
        self._section.count_client(self._cidx, L.C_N_ENQ, len(ops))
        return [op.seq for op in ops]

    def _check_not_failed(self) -> None:
        """An enqueue sends nothing: refuse it here if the transaction failed
        already (its commit would only roll back)."""
        if self._conn.pgconn.transaction_status == _INERROR:  # libpq's int: no objects made per call
            raise TransactionError("the transaction failed earlier: roll it back")

    def _reserve(self, info: QueueInfo, timeout: float | None) -> tuple[int, int]:
        got = self._reserve_many(info, 1, timeout)
        return got[0]

    def _reserve_many(self, info: QueueInfo, n: int, timeout: float | None) -> list[tuple[int, int]]:
        ring = self._ring(info)
        sec = self._section
        wait = info.full_timeout if timeout is None else timeout
        if info.full_policy == "raise" and timeout is None:
            wait = 0.0
        deadline = time.monotonic() + wait
        waiting = False
        while True:
            got: list[tuple[int, int]] = []
            sec.lock_queue(ring.qidx)
            try:
                if waiting:
                    ring.remove_waiter(OpKind.ENQUEUE)
                    waiting = False
                while len(got) < n:
                    r = ring.reserve(self.owner)
                    if r is None:
                        break
                    got.append(r)
                self_blocked = False
                if not got:
                    ring.note_full()
                    # The ring frees slots only in order: if the oldest busy
                    # slot is our own uncommitted reservation, waiting can
                    # never succeed (we would wait on ourselves).
                    _e, _d, locked, holder = ring.bits(ring.tail % ring.cap)
                    self_blocked = locked and holder == self.owner
                    remaining = deadline - time.monotonic()
                    if remaining > 0 and not self_blocked:
                        ring.add_waiter(OpKind.ENQUEUE)
                        waiting = True
            finally:
                sec.unlock_queue(ring.qidx)
            if got:
                return got
            if not waiting:
                self._record_error(L.ERR_QUEUE_FULL, info.id, ring.head)
            if self_blocked:
                raise QueueFull(
                    f"queue {info.name!r} is full ({info.capacity:,} slots) and its oldest slot is held "
                    "by this transaction: commit or roll back (or raise the capacity); waiting cannot help",
                    queue=info.name,
                )
            if not waiting:
                raise QueueFull(
                    f"queue {info.name!r} is full ({info.capacity:,} slots)"
                    + (f" after waiting {wait:g}s" if wait else ""),
                    queue=info.name,
                )
            try:
                sec.semaphore(info.id, "s").acquire(min(remaining, 0.5))
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out or a signal: look again (a reclaim by the monitor posts nothing)
            except BaseException:
                self._unwait(ring, OpKind.ENQUEUE)
                raise

    def _void(self, op: Op) -> None:
        sec = self._section
        sec.lock_queue(op.ring.qidx)
        try:
            if op.ring.held_by(op.slot, self.owner):
                op.ring.finish_enqueue(op.slot, committed=False)
        finally:
            sec.unlock_queue(op.ring.qidx)

    # -- dequeue -----------------------------------------------------------------------

    def dequeue(self, queue: str, *, wait: float | None = None) -> Message | None:
        """Take the oldest ready entry of ``queue`` in the current transaction.

        Returns None if nothing is ready (after sleeping up to ``wait`` seconds
        on the queue's wake-up, if given). The entry is consumed only if the
        transaction commits; on rollback it is delivered again.
        """
        got = self.dequeue_many(queue, 1, wait=wait)
        return got[0] if got else None

    def dequeue_many(self, queue: str, max_n: int, *, wait: float | None = None) -> list[Message]:
        """Take up to ``max_n`` ready entries (oldest first) in one statement."""
        self._check()
        if max_n < 1:
            raise ValueError("max_n must be >= 1")
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        ring = self._ring(info)
        exclusive = info.dequeue_mode == "single"
        deadline = None if wait is None else time.monotonic() + max(0.0, wait)
        for _attempt in range(64):
            claimed = self._claim(ring, info, max_n, deadline, exclusive)
            if not claimed:
                return []
            ops = [Op(ring, info, slot, seq, OpKind.DEQUEUE) for slot, seq in claimed]
            self._ops.extend(ops)
            if len(ops) == 1:
                row = self._execute_in_tx(
                    self._stmt("dequeue", queue), (ops[0].slot, ops[0].seq),
                    binary=True, queue=queue, qid=info.id, seq=ops[0].seq,
                ).fetchone()
                rows = [] if row is None else [(ops[0].slot, ops[0].seq, *row)]
            else:
                rows = self._execute_in_tx(
                    self._stmt("dequeue_many", queue), ([op.slot for op in ops], [op.seq for op in ops]),
                    binary=True, queue=queue, qid=info.id, seq=ops[0].seq,
                ).fetchall()
            got = {r[0]: r for r in rows}
            lat = (time.perf_counter_ns() - t0) // len(ops)
            stale = [op for op in ops if op.slot not in got]
            if stale:
                self._repair_dequeue(info, ring, stale, exclusive)
            messages = []
            for op in ops:
                if op.slot in got:
                    _slot, seq, payload, producer, pseq, enq_at, deliveries = got[op.slot]
                    op.latency_ns = lat
                    messages.append(Message(queue, seq, bytes(payload), producer, pseq, enq_at, deliveries + 1))
            if messages:
                self._section.count_client(self._cidx, L.C_N_DEQ, len(messages))
                return messages
        return []

    def _claim(
        self, ring: Ring, info: QueueInfo, max_n: int, deadline: float | None, exclusive: bool
    ) -> list[tuple[int, int]]:
        sec = self._section
        waiting = False
        sem = None
        while True:
            got: list[tuple[int, int]] = []
            sec.lock_queue(ring.qidx)
            try:
                if waiting:
                    ring.remove_waiter(OpKind.DEQUEUE)
                    waiting = False
                if max_n == 1:
                    r = ring.claim(self.owner, exclusive=exclusive)
                    if r is not None:
                        got.append(r)
                else:
                    got = ring.claim_many(self.owner, max_n, exclusive=exclusive)
                if not got:
                    ring.note_empty()
                    if deadline is not None and deadline > time.monotonic():
                        # Registered inside the same critical section as the
                        # failed scan, so a commit right after cannot miss us.
                        ring.add_waiter(OpKind.DEQUEUE)
                        waiting = True
            finally:
                sec.unlock_queue(ring.qidx)
            if got or not waiting:
                return got
            assert deadline is not None
            if sem is None:
                sem = sec.semaphore(info.id, "r")
            try:
                sem.acquire(max(0.0, min(deadline - time.monotonic(), CLAIM_RECHECK_S)))
            except (posix_ipc.BusyError, posix_ipc.SignalError):
                pass  # timed out, or a signal whose handler did not raise: look again
            except BaseException:
                self._unwait(ring, OpKind.DEQUEUE)
                raise

    def _unwait(self, ring: Ring, kind: OpKind) -> None:
        """Undo a waiter registration when an exception leaves the wait."""
        sec = self._section
        sec.lock_queue(ring.qidx)
        try:
            ring.abandon_wait(kind)
        finally:
            sec.unlock_queue(ring.qidx)

    def _repair_dequeue(self, info: QueueInfo, ring: Ring, stale: list[Op], exclusive: bool) -> None:
        """The rows did not match the section: decide those slots from the rows."""
        for op in stale:
            self._ops.remove(op)
        self._record_error(L.ERR_ROW_MISMATCH, info.id, stale[0].seq)
        rows = self._execute(
            self._stmt("rows", info.name), ([op.slot for op in stale],), queue=info.name, qid=info.id, seq=stale[0].seq
        ).fetchall()
        by_slot = {slot: (state, seq) for slot, state, seq in rows}
        need_resync = False
        sec = self._section
        sec.lock_queue(ring.qidx)
        try:
            for op in stale:
                if not ring.held_by(op.slot, self.owner):
                    continue
                state, seq = by_slot.get(op.slot, (RowState.FREE, -1))
                # Not there (void) or already consumed: the slot is done.
                ring.finish_stale(op.slot, exclusive=exclusive)
                if state == RowState.QUEUED and seq != op.seq:
                    need_resync = True  # an entry the section does not know about
        finally:
            sec.unlock_queue(ring.qidx)
        logger.warning("ringq: queue %s: %d stale section entries repaired from rows", info.name, len(stale))
        if need_resync:
            self._resync(info)

    def _resync(self, info: QueueInfo) -> None:
        """Re-read the queue's rows into the section, keeping live clients' locked slots."""
        ring = self._ring(info)
        self._call(lambda: resync_queue(self._section, ring, info, self.dsn), queue=info.name, recover=False)

    # -- recovery ------------------------------------------------------------------------

    def _recover(self, ops: list[Op], *, reason: str) -> bool | None:
        """Decide ``ops`` from the rows after the connection was lost.

        Returns True if the transaction committed, False if not, None if it
        could not be decided now (then the monitor decides later).
        """
        old_pid = self.backend_pid
        with suppress(Exception):  # already broken: closing is a courtesy
            self._conn.close()
        try:
            new = self._open_connection()
        except DatabaseUnavailable:
            # Hand the slots over to the monitor: it decides them from the rows
            # once the database is back.
            if ops:
                self._section.hand_over_client(self._cidx)
                self._finalizer.detach()
                self._register_client(0)
            self._closed = True
            return None
        self._conn = new

        def decide() -> tuple[bool | None, tuple[Any, ...] | None]:
            with psycopg.connect(self.dsn, autocommit=True) as aux:
                wait_backend_gone(aux, old_pid)
                committed = self._decide_from_rows(aux, ops)
            row = self._conn.execute(_Q["backend_pid"]).fetchone()
            self._conn.rollback()
            return committed, row

        committed, row = self._call(decide, recover=False)
        assert row is not None
        self.backend_pid = row[0]
        self._section.set_client_backend(self._cidx, self.backend_pid)
        self._begin()
        logger.warning("ringq: connection lost (%s); %d slots decided from rows", reason, len(ops))
        return committed

    def _decide_from_rows(self, conn: psycopg.Connection[Any], ops: list[Op]) -> bool | None:
        if not ops:
            return None
        return decide_ops(self._section, conn, ops, self.owner)

    # -- events ----------------------------------------------------------------------------

    def subscribe(self, *patterns: str) -> Subscription:
        """Receive the monitor's named events matching shell-style ``patterns``
        (``"queue.*.full"``, ``"consumer.died"``) on a connection of their own."""
        self._check()
        return Subscription(self.dsn, patterns)

    def publish(self, name: str, **data: Any) -> None:
        """Publish a named event in the current transaction (sent at commit)."""
        self._check()
        self._call(lambda: publish(self._conn, name, **data))

    # -- introspection ---------------------------------------------------------------------

    def stats(self, queue: str) -> dict[str, int]:
        """The queue's counters in the section (see ringq.engine.metrics)."""
        from .metrics import queue_stats

        self._check()
        info = self._info(queue)
        return queue_stats(self._section, self._ring(info).qidx)

    @property
    def section(self) -> Section:
        return self._section

    def ring(self, queue: str) -> Ring:
        """The queue's block in the global section (for inspection).

        :raises SessionClosed: the session is closed.
        """
        self._check()
        return self._ring(self._info(queue))


def _orphaned(sec: Section, cidx: int, pid: int) -> None:
    """Finalizer of a session never closed: let recovery decide its slots and free it."""
    if os.getpid() != pid or sec.closed:
        return
    sec.hand_over_client(cidx, pid=pid)


def _as_bytes(payload: object) -> bytes:
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise TypeError(f"payload must be bytes, not {type(payload).__name__}")
