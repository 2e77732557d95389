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
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, tzinfo
from typing import Any, Self, TypeVar

import posix_ipc
import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from . import _layout as L
from . import _wire
from ._decide import (
    decide_ops,
    in_doubt_outcome,
    in_flight,
    load_queue,
    resync_queue,
    wait_backend_gone,
)
from ._dsn import resolve_dsn
from ._errors import (
    InDoubt,
    PayloadTooLarge,
    QueueError,
    QueueFull,
    QueueNotFound,
    RingqError,
    SchemaMissing,
    SectionError,
    SessionClosed,
    StaleSection,
    TransactionError,
    from_psycopg,
    one_line,
    redact_dsn,
)
from ._events import Subscription, publish
from ._names import queue_table, validate_queue_name
from ._ops import POISON_REASON, Op, OpKind, RowState, RowWrite
from ._queries import QUERIES as _Q
from ._queue_info import QueueInfo as QueueInfo  # noqa: PLC0414 (re-exported for ringq.engine)
from ._recovery import history_of, recover_dead_clients, section_following
from ._ring import Cached, Ring, group_tag
from ._section import Section
from ._tpc import TwoPhase
from ._validate import (
    as_groups,
    as_payload,
    as_payloads,
    check_count,
    check_group,
    check_key,
    check_wait,
    validate_int,
    validate_seconds,
)

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_INTRANS = TransactionStatus.INTRANS
_INERROR = TransactionStatus.INERROR
T = TypeVar("T")

SUPPORTED_SCHEMA = "1"
# A waiting dequeuer is woken by the commit that makes an entry ready (a
# semaphore post); it also looks again this often, in seconds, as a safety net.
CLAIM_RECHECK_S = 1.0
# A session that finds nothing ready (or no room) looks for dead holders in
# the queue's way at most this often, in seconds, per process and queue.
HELP_RECOVER_S = 1.0
# With a monitor serving (its heartbeat fresher than MONITOR_FRESH_S), a
# session leaves a dead holder to it (it recovers every 100 ms, and reports
# the death) for MONITOR_GRACE_S seconds before it recovers it itself.
MONITOR_FRESH_S = 2.0
MONITOR_GRACE_S = 2.0
# (instance, queue id) -> monotonic time of the last look
_last_help: dict[tuple[str, int], float] = {}
# (instance, queue id) -> when a dead holder was first seen
_dead_since: dict[tuple[str, int], float] = {}


@dataclass(frozen=True)
class Message:
    """An entry taken from a queue; consumed only if the transaction commits.

    ``deliveries`` counts this delivery: 1 the first time, more if earlier
    deliveries were rolled back (so the consumer can check idempotency).
    ``group`` is the group it was enqueued in (None: none): entries of a
    group are delivered in order, one held at a time.
    """

    queue: str
    seq: int
    payload: bytes
    producer: str
    producer_seq: int
    enqueued_at: datetime
    deliveries: int
    group: str | None = None

    @property
    def redelivered(self) -> bool:
        return self.deliveries > 1


_producer_counter = iter(range(1, 1 << 62))


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
    return Session(
        resolve_dsn(dsn),
        producer=producer,
        connect_timeout=connect_timeout,
        application_name=application_name,
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
    ) -> None:
        self.dsn = dsn
        self._connect_timeout = connect_timeout
        self._appname = application_name
        self._pid = os.getpid()
        self.producer = (
            producer or f"{socket.gethostname()}:{os.getpid()}:{next(_producer_counter)}"
        )
        self._producer_seq = 0
        # enq_at (us) of the rows the transaction's enqueue writes made, once sent
        self._enq_at_us: int | None = None
        # whether a statement went for the ops in flight (reset when there are none)
        self._sent_any = False
        self._ops: list[Op] = []
        self._queues: dict[str, QueueInfo] = {}
        self._rings: dict[int, Ring] = {}
        self._stmts: dict[tuple[str, str], str] = {}
        self._closed = False
        self._closing = False
        self._tpc_reset()
        self._role = L.CR_CLIENT  # C_ROLE of our client entry (a worker sets CR_WORKER)
        self._conn = self._open_connection()
        self._attach()

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
            with self._outside_transaction() as conn:
                return conn.execute(_Q["attach"]).fetchone()

        try:
            row = self._call(read_instance, recover=False)
        except RingqError as exc:
            self._conn.close()
            if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
                raise SchemaMissing(
                    f"no ringq schema in {redact_dsn(self.dsn)!r}: "
                    "create a queue first (ringq queue create)"
                ) from exc.__cause__
            raise
        assert row is not None
        instance, version, backend_pid, has_guard, sysid, timeline = row
        if version != SUPPORTED_SCHEMA or not instance:
            self._conn.close()
            raise SchemaMissing(
                f"ringq schema version {version!r} is not supported (want {SUPPORTED_SCHEMA})"
            )
        if not has_guard:
            self._conn.close()
            raise SchemaMissing(
                "the ringq schema lacks ringq.expect_rows() or the groups' columns, which this "
                "version needs: apply the "
                "schema script again (ringq queue create, or ringq script create-queue | psql)"
            )
        self.instance: str = instance
        self.backend_pid: int = backend_pid
        self._history = (int(sysid), int(timeline))  # of the server we are connected to
        try:
            self._section = section_following(instance, self._history, redact_dsn(self.dsn))
        except RingqError:  # a standby, a foreign or unusable section: do not leak the connection
            self._conn.close()
            raise
        self._register_client(backend_pid)
        self._rings = {}

    def _register_client(self, backend_pid: int) -> None:
        old = getattr(self, "_finalizer", None)
        if old is not None:
            old.detach()
        sec = self._section
        # owner: our token, written in the OWNER word of every slot we lock
        # (with our backend pid in its HOLDER word); renewed at every reconnect.
        self._cidx, self.owner = sec.add_client(backend_pid)
        if self._role:
            sec.set_client_role(self._cidx, self._role)
        # A session dropped without close() hands its entry to recovery.
        self._finalizer = weakref.finalize(
            self, _orphaned, sec, self._cidx, os.getpid(), sec.c(self._cidx, L.C_REGISTERED_NS)
        )

    def set_client_role(self, role: int) -> None:
        """Mark this session's client entry in the global section with
        ``role`` (``ringq.engine.layout.CR_*``; a worker sets ``CR_WORKER``),
        kept across reconnects. The monitor and the viewer show it."""
        self._role = role
        self._section.set_client_role(self._cidx, role)

    def write_client_words(self, words: Iterable[tuple[int, int]]) -> None:
        """Write (word, value) pairs into this session's client entry
        (``ringq.engine.layout.C_W_*``: a worker's counters, for the monitor)."""
        self._section.set_client_words(self._cidx, words)

    @property
    def producer_seq(self) -> int:
        """The producer sequence of the last entry this session enqueued (0:
        none); the next enqueue takes ``producer_seq + 1``. Settable, to
        carry on another producer's numbering (with :attr:`producer`; the SQL
        inbox's pump does, for the entries it moves into the ring).

        :raises ConfigError: not an int from 0 to 2**63 - 2.
        """
        return self._producer_seq

    @producer_seq.setter
    def producer_seq(self, value: int) -> None:
        validate_int("producer_seq", value, 0, (1 << 63) - 2)
        self._producer_seq = value

    @contextmanager
    def _outside_transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """The session's connection in autocommit while no transaction is open
        (each statement its own: nothing left open afterwards, no snapshot
        held); inside the caller's transaction, the connection as it is."""
        conn = self._conn
        if conn.info.transaction_status != _IDLE or conn.autocommit:
            yield conn
            return
        conn.autocommit = True  # no round trip: psycopg only stops sending BEGIN
        try:
            yield conn
        finally:
            if not conn.closed:
                conn.autocommit = False

    def close(self) -> None:
        """Roll back anything open and release the connection; a second call does nothing.

        A prepared two-phase transaction decided by :meth:`tpc_decide` is not
        rolled back (other participants may have committed): it stays
        prepared, its slots held, for recovery (``resolve_prepared``) to commit.
        """
        if os.getpid() != self._pid:
            self._closed = True  # the parent's connection and client entry are not ours
            return
        if self._closed:
            self._release_entry()  # closed by a lost connection: the entry it took since
            return
        try:
            if self._tpc_decided:
                self._leave_decided()
            elif self._conn.closed or self._conn.broken:
                # The server ended the connection and rolled back: nothing to
                # send. Slots still held go to recovery (_release_entry).
                logger.info(
                    "ringq: session closed after its connection was lost "
                    "(%d slots left to recovery)",
                    len(self._ops),
                )
            elif self._ops or self._conn.info.transaction_status != _IDLE:
                self._closing = True  # a rollback that finds the connection lost does not reconnect
                self.rollback()
        except RingqError as exc:
            logger.info("ringq: rollback at close failed (slots left to recovery): %s", exc)
        finally:
            self._closed = True
            self._release_entry()
            self._conn.close()
            if self._aux is not None:
                self._aux.close()

    def _release_entry(self) -> None:
        """Give up our client entry (once): freed if no slot is locked under
        our token, else handed over to recovery, never freed: a later session
        taking the entry must not inherit slots it knows nothing of."""
        if not self._finalizer.alive:
            return
        self._finalizer.detach()
        sec = self._section
        if sec.closed:
            return
        if self._ops or sec.locked_under(self.owner, sec.client_queues(self._cidx)):
            sec.hand_over_client(self._cidx)
        else:
            sec.remove_client(self._cidx)

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
        if not self._ops:
            self._sent_any = False
            if self._conn.closed and not self._closing:
                self._reconnect()
        elif (
            self._sent_any  # else every op is held: nothing to learn (and no scan per call)
            and self._conn.pgconn.transaction_status == _IDLE
            and not self._tpc_prepared
            and self._sent()
        ):
            # Someone committed or rolled back on the connection directly:
            # learn the outcome from the rows. (A prepared transaction is
            # idle too, but undecided: tpc_commit/tpc_rollback finish it.)
            # If the connection is lost meanwhile, _call decides them
            # from a new one. Row writes still held in the session never
            # went: they stay, for the session's own commit or rollback.
            def decide() -> None:
                with self._outside_transaction() as conn:
                    self._decide_from_rows(conn, self._sent())

            self._call(decide)
            self._ops = [op for op in self._ops if op.held]
        if not self._ops and self._section.unlinked():
            # Replaced by another client, perhaps after a fail-over that this
            # session has not seen yet (its connection may be dead): attach as
            # the server's history says now, never as this session last knew
            # it, or it would replace the new section by one of the old
            # history. A lost connection is handled (and raised) by _call.
            self._history = self._call(self._read_history)
            self._reattach_section()

    def _read_history(self) -> tuple[int, int]:
        with self._outside_transaction() as conn:
            return history_of(conn)

    def _sent(self) -> list[Op]:
        """The in-flight ops whose statements went to the server (all but
        those whose row write the session still holds)."""
        return [op for op in self._ops if not op.held]

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

    def _reattach_section(self) -> None:
        old = self._section
        self._section = section_following(self.instance, self._history, redact_dsn(self.dsn))
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

            def lookup() -> tuple[Any, ...] | None:
                with self._outside_transaction() as conn:
                    return conn.execute(_Q["queue_info"], (name,)).fetchone()

            row = self._call(lookup)
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
            with psycopg.connect(
                self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout))
            ) as aux:
                return load_queue(self._section, aux, info)

        return self._call(load, queue=info.name, recover=False)

    def _stmt(self, name: str, queue: str) -> str:
        key = (name, queue)
        stmt = self._stmts.get(key)
        if stmt is None:
            stmt = (
                sql.SQL(_Q[name])
                .format(table=queue_table(queue), queue=sql.Literal(queue))
                .as_string(None)
            )
            self._stmts[key] = stmt
        return stmt

    # -- the database -------------------------------------------------------------------

    def _call(
        self,
        fn: Callable[[], T],
        *,
        queue: str | None = None,
        qid: int = 0,
        seq: int = -1,
        recover: bool = True,
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
                lost = (
                    self._conn.broken
                    or isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
                    and self._conn.closed
                )
                # A statement refused because the caller's own SQL already failed
                # the transaction is the caller's error, not ours.
                record = qid and not isinstance(exc, psycopg.errors.InFailedSqlTransaction)
                try:
                    if lost:
                        self._connection_lost(exc)  # first: the error is told with the new backend
                finally:
                    if record:
                        self._record_error(
                            L.ERR_CONNECTION_LOST if lost else L.ERR_DATABASE, qid, seq
                        )
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
        """Run one statement on the session's connection (or ``conn``); errors as in :meth:`_call`.

        The first statement of a transaction on the session's connection
        carries its BEGIN in the same message (``BEGIN; <statement>``), not one of its own.
        """
        c = self._conn if conn is None else conn
        # Inside a two-phase transaction psycopg sends its own BEGIN.
        may_begin = c is self._conn and self._tpc_xid is None

        def run() -> psycopg.Cursor[Any]:
            return _wire.execute(c, query, params, binary=binary, may_begin=may_begin)

        self._sent_any = True
        return self._call(run, queue=queue, qid=qid, seq=seq, recover=recover)

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
        self._commit()

    def commit_and_dequeue(self, queue: str) -> Message | None:
        """Commit, then take the oldest ready entry of ``queue`` in a new
        transaction: :meth:`commit` then :meth:`dequeue`, in one round trip
        for the two when the entry is read from its row (not in the payload
        cache) and this transaction was opened by a statement (a dequeue read
        from its row, or your own SQL) and holds no row write: the COMMIT, the
        new BEGIN and the dequeue go in one message. A consumer loop of such
        entries costs one round trip per message. Returns None if nothing is
        ready (no wait).

        :raises: as :meth:`commit`; then nothing was taken.
        """
        self._check()
        if self._tpc_xid is not None:  # before anything is claimed
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        info = self._info(queue)
        ring = self._ring(info)
        exclusive = info.dequeue_mode == "single"
        ops = self._ops
        if not (
            self._conn.pgconn.transaction_status == _INTRANS
            and any(op.kind == OpKind.DEQUEUE and not op.held for op in ops)
            and not any(op.held for op in ops)
        ):
            self._commit()
            return self.dequeue(queue)
        t0 = time.perf_counter_ns()
        claimed = self._claim(ring, info, 1, None, exclusive)
        if not claimed:
            self._commit()
            return self.dequeue(queue)
        slot, seq, cached = claimed[0]
        op = Op(ring, info, slot, seq, OpKind.DEQUEUE, consume=cached is not None)
        if cached is not None:
            try:
                self._commit()
            except BaseException:
                self._finish([op], committed=False, count_delivery=False)  # not taken after all
                raise
            tz = self._conn.info.timezone
            self._taken([op], t0)
            return _cached_message(queue, seq, cached, tz)
        cur = self._commit(then=op, then_stmt=(self._stmt("dequeue", queue), (slot, seq)))
        if cur is None:
            return None  # committed; the entry was given back
        row = cur.fetchone()
        if row is None:
            self._ops.append(op)  # for the repair, which finishes it
            self._repair_dequeue(info, ring, [op], exclusive)
            return None
        self._taken([op], t0)
        payload, producer, pseq, enq_at, deliveries, group = row
        return Message(queue, seq, bytes(payload), producer, pseq, enq_at, deliveries + 1, group)

    def _taken(self, ops: list[Op], t0: int) -> None:
        """Ops of a dequeue join the transaction (its lease runs from now)."""
        lat = (time.perf_counter_ns() - t0) // len(ops)
        for op in ops:
            op.latency_ns = lat
        self._ops.extend(ops)
        self._section.note_hold(self._cidx)
        self._section.count_client(self._cidx, L.C_N_DEQ, len(ops))

    def _commit(
        self, then: Op | None = None, then_stmt: _wire.Statement | None = None
    ) -> psycopg.Cursor[Any] | None:
        """:meth:`commit`; with ``then`` (a claimed slot whose entry is read
        from its row: the transaction holds no row write and is open), the
        COMMIT carries ``then_stmt`` in a new transaction. Returns its cursor,
        or None if the COMMIT stood but the statement failed (``then`` given
        back); if the commit fails, ``then`` is given back too, without a strike."""
        if self._tpc_xid is not None:
            raise TransactionError("a two-phase transaction is open: use tpc_commit()")
        ops = self._ops
        status = self._conn.info.transaction_status
        if status == _INERROR:
            self.rollback()
            raise TransactionError("the transaction failed earlier and was rolled back")
        writes = [op for op in ops if op.held]
        cur = None
        try:
            if then is not None:
                assert then_stmt is not None and not writes
                query, params = then_stmt
                cur = self._call(
                    lambda: _wire.commit_then(self._conn, query, params), recover=False
                )
            elif writes:
                self._send_writes(writes, commit=True)
            else:
                self._call(self._conn.commit, recover=False)
        except StaleSection:
            raise  # rolled back and resynced already
        except RingqError as err:
            exc = err.__cause__
            # A stale write's rollback ran already (then its resync failed):
            # nothing committed, whatever the error says.
            rolled_back = self._ops is not ops
            self._ops = []
            lost = self._conn.broken or self._conn.closed or _answer_lost(exc) and not rolled_back
            if (
                then is not None
                and not lost
                and self._conn.pgconn.transaction_status == _INERROR
            ):
                # The COMMIT went through; the statement after it failed.
                with suppress(RingqError):
                    self._call(self._conn.rollback, recover=False)
                self._finish(ops, committed=True)
                self._finish([then], committed=False, count_delivery=False)
                logger.warning("ringq: queue %s: the dequeue sent with a commit failed: %s",
                               then.info.name, exc)
                return None
            if lost:
                # The answer may have been lost after the COMMIT ran: a backend
                # terminated during the pipeline can leave psycopg with "cannot
                # exit pipeline mode while busy" (no SQLSTATE) on a connection
                # that does not read as broken yet. Decide from the rows (the
                # slot claimed after the COMMIT, if any, with them: its
                # transaction never committed, so it comes back).
                decided = ops if then is None else [*ops, then]
                backend = (self.backend_pid, self._section.c(self._cidx, L.C_STARTED_NS))
                committed = self._recover(decided, reason=f"commit answer lost: {exc}")
                if committed is None and self._section.lease_ended(self._cidx):
                    # past the lease
                    committed = False if any(op.kind == OpKind.DEQUEUE for op in ops) else None
                if committed is None:
                    self._record_ops_error(L.ERR_IN_DOUBT, ops)
                    raise InDoubt(
                        f"commit outcome unknown: {one_line(str(exc))}",
                        entries=in_flight(ops),
                        backend=backend,
                    ) from exc
                if committed:
                    logger.warning("ringq: commit answer lost, but the rows show it committed")
                    return None
                self._record_ops_error(L.ERR_COMMIT_FAILED, ops)
                raise TransactionError(f"commit failed and was rolled back: {exc}") from exc
            # The server refused the commit (deferred constraint, serialization,
            # a row write that failed): rolled back, or to be rolled back when
            # a failed statement kept the COMMIT behind it from running.
            with suppress(RingqError):
                self._call(self._conn.rollback, recover=False)
            self._finish(ops, committed=False)
            if then is not None:
                self._finish([then], committed=False, count_delivery=False)
            if ops:
                self._record_ops_error(L.ERR_COMMIT_FAILED, ops)
            raise
        self._ops = []
        self._finish(ops, committed=True)
        return cur

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
        return in_doubt_outcome(
            self.dsn, exc, timeout=timeout, connect_timeout=max(1, int(self._connect_timeout))
        )

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
        writes = [op for op in self._ops if op.held]
        if writes:
            self._send_writes(writes, commit=False)

    def _send_writes(self, writes: list[Op], *, commit: bool) -> None:
        """Send the row writes the session holds for ``writes`` in one round
        trip: after a BEGIN if no transaction is open, one statement per
        queue and kind, then the COMMIT if ``commit``. The enqueues' payloads
        stay with their ops (``fill``) for the payload cache, with the rows'
        enqueue time (:attr:`_enq_at_us`).

        Every write is guarded: a row that does not match makes its statement
        fail (SQLSTATE RQ001), so nothing after it runs. Then the whole
        transaction is rolled back (its reservations voided, its dequeued
        entries given back without a strike: not their fault), the queue's
        block resynced from the rows, and :class:`StaleSection` raised.
        """
        by_queue: dict[str, list[Op]] = {}
        for op in writes:
            by_queue.setdefault(op.info.name, []).append(op)
        statements: list[_wire.Statement] = []
        enqueues: list[int] = []  # index of each enqueue statement in statements
        for name, group in by_queue.items():
            enq = [op for op in group if op.write is not None]
            if enq:
                enqueues.append(len(statements))
                statements.append(self._write_statement(name, enq))
            consume = [op for op in group if op.consume]
            if consume:
                statements.append(self._consume_statement(name, consume))
        self._sent_any = True
        try:
            cursors = self._call(
                lambda: _wire.send(
                    self._conn, statements, commit=commit, may_begin=self._tpc_xid is None
                ),
                recover=not commit,  # commit() decides itself what a lost answer means
            )
        except StaleSection as err:
            group = by_queue.get(err.queue or "", writes)
            info = group[0].info
            self._record_error(L.ERR_ROW_MISMATCH, info.id, group[0].seq)
            self.rollback(count_delivery=False)
            self._resync(info)
            logger.warning(
                "ringq: queue %s: stale section (a row write did not match its row): resynced",
                info.name,
            )
            raise
        if enqueues:
            row = cursors[enqueues[0]].fetchone()
            self._enq_at_us = None if row is None else int(row[1])
        for op in writes:
            op.fill, op.write, op.consume = op.write, None, False

    def _consume_statement(self, queue: str, ops: list[Op]) -> _wire.Statement:
        """The guarded consuming write of ``ops`` (cached dequeues of one queue)."""
        if len(ops) == 1:
            return self._stmt("consume", queue), (ops[0].slot, ops[0].seq)
        return self._stmt("consume_many", queue), (
            _int_array(op.slot for op in ops), _int_array(op.seq for op in ops), len(ops),
        )

    def _write_statement(self, queue: str, ops: list[Op]) -> _wire.Statement:
        """The guarded row write of ``ops`` (enqueues of one queue): one statement."""
        if len(ops) == 1:
            op = ops[0]
            w = op.write
            assert w is not None
            return self._stmt("enqueue", queue), (
                op.seq,
                w.payload,
                w.producer,
                w.producer_seq,
                w.group,
                op.slot,
                op.seq,
            )
        writes = [op.write for op in ops if op.write is not None]
        return self._stmt("enqueue_many", queue), (
            _int_array(op.slot for op in ops),
            _int_array(op.seq for op in ops),
            [w.payload for w in writes],
            _text_array([w.producer for w in writes]),
            _int_array(w.producer_seq for w in writes),
            _text_array([w.group for w in writes]),
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
                self._call(self._conn.rollback, recover=False)
        except RingqError as err:
            self._recover(ops, reason=f"rollback failed: {err.__cause__}")
            raise
        self._finish(ops, committed=False, poisoned=poisoned)

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
        self._section.clear_hold(self._cidx)
        if poisoned is None:
            poisoned = set()
            if not committed and count_delivery:
                poisoned = self._strike([op for op in ops if op.kind == OpKind.DEQUEUE])
        by_ring: dict[int, list[Op]] = {}
        for op in ops:
            by_ring.setdefault(op.ring.qidx, []).append(op)
        sec = self._section
        posts: list[tuple[int, str, int]] = []
        enq_at_us, self._enq_at_us = self._enq_at_us, None
        for qidx, group in by_ring.items():
            ring = group[0].ring
            exclusive = group[0].info.dequeue_mode == "single"
            sec.lock_queue(qidx)
            try:
                wake_r, wake_s = ring.finish_batch(
                    group, self.owner, committed=committed, poisoned=poisoned,
                    exclusive=exclusive, enq_at_us=enq_at_us,
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
            # ROLLBACK (if a transaction is open) and, after it, each queue's
            # strike in autocommit: one round trip.
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
            for slot, seq, state, deliveries, moved_to, kept_because, group in cur.fetchall():
                if state == RowState.CONSUMED:
                    poisoned.add((slot, seq))
                    logger.warning(
                        "ringq: entry %s/%s%s poisoned after %s deliveries: "
                        "moved to ringq.exceptions%s",
                        name,
                        seq,
                        "" if group is None else f" (group {group!r}, which goes on without it)",
                        deliveries,
                        f" and queue {moved_to}"
                        if moved_to
                        else f" only ({kept_because})"
                        if kept_because
                        else "",
                    )
        return poisoned

    # -- enqueue -----------------------------------------------------------------------

    def enqueue(
        self,
        queue: str,
        payload: bytes,
        *,
        key: str | None = None,
        group: str | None = None,
        timeout: float | None = None,
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

        :raises QueueNotFound, PayloadTooLarge, QueueFull, SessionClosed, DatabaseUnavailable:
        :raises TransactionError: the transaction failed earlier (roll it back).
        :raises InvalidArgumentType: the payload is not bytes-like, the key or group not a str.
        :raises InvalidArgument: the key is over 1,000 bytes, the group empty or over
            128 bytes, the timeout negative.
        """
        self._check()
        payload = as_payload(payload)
        check_key(key)
        check_group(group)
        check_wait("timeout", timeout)
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        if len(payload) > info.max_payload:
            self._record_error(L.ERR_PAYLOAD_TOO_LARGE, info.id)
            raise PayloadTooLarge(
                f"payload of {len(payload):,} bytes exceeds queue {queue!r} "
                f"max_payload {info.max_payload:,}",
                queue=queue,
            )
        self._check_not_failed()
        tag = group_tag(group)
        if key is None:
            slot, seq = self._reserve(info, timeout, tag)
            self._producer_seq += 1
            op = Op(
                self._ring(info),
                info,
                slot,
                seq,
                OpKind.ENQUEUE,
                write=RowWrite(payload, self._producer_seq, self.producer, group),
            )
            self._ops.append(op)
            op.latency_ns = time.perf_counter_ns() - t0
            self._section.count_client(self._cidx, L.C_N_ENQ)
            return seq
        for _attempt in range(8):
            slot, seq = self._reserve(info, timeout, tag)
            self._producer_seq += 1
            op = Op(self._ring(info), info, slot, seq, OpKind.ENQUEUE)
            self._ops.append(op)
            row = self._execute(
                self._stmt("enqueue_key", queue),
                {
                    "queue_id": info.id,
                    "key": key,
                    "seq": seq,
                    "payload": payload,
                    "producer": self.producer,
                    "producer_seq": self._producer_seq,
                    "group": group,
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
                again = self._execute(
                    _Q["key_seq"], (info.id, key), queue=queue, qid=info.id, seq=seq
                ).fetchone()
                existing = None if again is None else again[0]
            if inserted == 1 and updated == 0:
                self._execute(
                    _Q["key_forget"], (info.id, key, seq), queue=queue, qid=info.id, seq=seq
                )
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
        raise SectionError(
            f"queue {queue!r}: could not reserve a slot after 8 attempts (section unstable)"
        )

    def enqueue_many(
        self,
        queue: str,
        payloads: Iterable[bytes],
        *,
        group: str | Iterable[str | None] | None = None,
        timeout: float | None = None,
    ) -> list[int]:
        """Enqueue several entries; returns their sequence numbers, in order.

        As :meth:`enqueue` without a key: nothing goes to the database now;
        the commit writes the rows of a queue in one statement. ``group`` is
        one group for all the entries, or one group (or None) per entry.

        :raises InvalidArgumentType: ``payloads`` is not an iterable of bytes-like
            payloads, or ``group`` not a str, None or an iterable of them.
        :raises InvalidArgument: the timeout is negative, a group is refused
            (as :meth:`enqueue`), or the groups are not one per payload.
        """
        self._check()
        items = as_payloads(payloads)
        groups = as_groups(group, len(items))
        tags = None if groups is None else [group_tag(g) for g in groups]
        check_wait("timeout", timeout)
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        for p in items:
            if len(p) > info.max_payload:
                self._record_error(L.ERR_PAYLOAD_TOO_LARGE, info.id)
                raise PayloadTooLarge(
                    f"payload of {len(p):,} bytes exceeds queue {queue!r} "
                    f"max_payload {info.max_payload:,}",
                    queue=queue,
                )
        if not items:
            return []
        self._check_not_failed()
        ring = self._ring(info)
        reserved: list[tuple[int, int]] = []
        try:
            while len(reserved) < len(items):
                reserved.extend(
                    self._reserve_many(
                        info, len(items) - len(reserved), timeout,
                        None if tags is None else tags[len(reserved):],
                    )
                )
        except BaseException:
            for slot, seq in reserved:
                self._void(Op(ring, info, slot, seq, OpKind.ENQUEUE))
            raise
        pseq = self._producer_seq
        self._producer_seq += len(items)
        lat = (time.perf_counter_ns() - t0) // len(items)
        ops = [
            Op(
                ring,
                info,
                slot,
                seq,
                OpKind.ENQUEUE,
                latency_ns=lat,
                write=RowWrite(
                    payload, pseq + i, self.producer, None if groups is None else groups[i - 1]
                ),
            )
            for i, ((slot, seq), payload) in enumerate(zip(reserved, items, strict=True), start=1)
        ]
        self._ops.extend(ops)
        self._section.count_client(self._cidx, L.C_N_ENQ, len(ops))
        return [op.seq for op in ops]

    def _check_not_failed(self) -> None:
        """An enqueue sends nothing: refuse it here if the transaction failed
        already (its commit would only roll back)."""
        # libpq's int: no objects made per call
        if self._conn.pgconn.transaction_status == _INERROR:
            raise TransactionError("the transaction failed earlier: roll it back")

    def _reserve(self, info: QueueInfo, timeout: float | None, tag: int) -> tuple[int, int]:
        got = self._reserve_many(info, 1, timeout, (tag,) if tag else None)
        return got[0]

    def _reserve_many(
        self, info: QueueInfo, n: int, timeout: float | None, tags: Sequence[int] | None = None
    ) -> list[tuple[int, int]]:
        """Reserve up to ``n`` slots (at least one, waiting for room as the
        queue's policy says), the i-th for group tag ``tags[i]`` (None: no groups)."""
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
                    r = ring.reserve(self.owner, self.backend_pid, tags[len(got)] if tags else 0)
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
            try:
                if not self_blocked and self._help_recover(ring, info):
                    continue  # a dead holder's slots were decided: try again now
            except BaseException:
                if waiting:
                    self._unwait(ring, OpKind.ENQUEUE)
                raise
            if not waiting:
                self._record_error(L.ERR_QUEUE_FULL, info.id, ring.head)
            if self_blocked:
                raise QueueFull(
                    f"queue {info.name!r} is full ({info.capacity:,} slots) "
                    "and its oldest slot is held by this transaction: "
                    "commit or roll back (or raise the capacity); waiting cannot help",
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
        """Take up to ``max_n`` ready entries (oldest first) in one statement.

        :raises InvalidArgumentType: ``max_n`` is not an int, ``wait`` not a number.
        :raises InvalidArgument: ``max_n`` is below 1, ``wait`` negative.
        """
        self._check()
        check_count("max_n", max_n)
        check_wait("wait", wait)
        t0 = time.perf_counter_ns()
        info = self._info(queue)
        ring = self._ring(info)
        exclusive = info.dequeue_mode == "single"
        deadline = None if wait is None else time.monotonic() + wait
        holding = any(op.kind == OpKind.DEQUEUE for op in self._ops)
        for _attempt in range(64):
            claimed = self._claim(ring, info, max_n, deadline, exclusive)
            if not claimed:
                return []
            if not holding:  # the queue's lease runs from the transaction's first entry
                self._section.note_hold(self._cidx)
                holding = True
            ops = [
                Op(ring, info, slot, seq, OpKind.DEQUEUE, consume=cached is not None)
                for slot, seq, cached in claimed
            ]
            self._ops.extend(ops)
            from_cache = {
                slot: cached for slot, _seq, cached in claimed if cached is not None
            }
            if from_cache:
                # Served from the payload cache: the consuming write waits for the commit.
                lat = (time.perf_counter_ns() - t0) // len(ops)
                for op in ops:
                    op.latency_ns = lat
                if len(from_cache) == len(ops):
                    self._section.count_client(self._cidx, L.C_N_DEQ, len(ops))
                    tz = self._conn.info.timezone
                    return [
                        _cached_message(queue, op.seq, from_cache[op.slot], tz) for op in ops
                    ]
                ops = [op for op in ops if not op.consume]
            if len(ops) == 1:
                row = self._execute(
                    self._stmt("dequeue", queue), (ops[0].slot, ops[0].seq),
                    binary=True, queue=queue, qid=info.id, seq=ops[0].seq,
                ).fetchone()
                rows = [] if row is None else [(ops[0].slot, ops[0].seq, *row)]
            else:
                rows = self._execute(
                    self._stmt("dequeue_many", queue),
                    (_int_array(op.slot for op in ops), _int_array(op.seq for op in ops)),
                    binary=True,
                    queue=queue,
                    qid=info.id,
                    seq=ops[0].seq,
                ).fetchall()
            got = {r[0]: r for r in rows}
            lat = (time.perf_counter_ns() - t0) // len(ops)
            stale = [op for op in ops if op.slot not in got]
            if stale:
                self._repair_dequeue(info, ring, stale, exclusive)
            messages = []
            tz = self._conn.info.timezone
            for slot, seq, cached in claimed:
                if cached is not None:
                    messages.append(_cached_message(queue, seq, cached, tz))
                elif slot in got:
                    _slot, seq, payload, producer, pseq, enq_at, deliveries, group = got[slot]
                    messages.append(
                        Message(queue, seq, bytes(payload), producer, pseq, enq_at,
                                deliveries + 1, group)
                    )
            for op in ops:
                op.latency_ns = lat
            if messages:
                self._section.count_client(self._cidx, L.C_N_DEQ, len(messages))
                return messages
        return []

    def _claim(
        self, ring: Ring, info: QueueInfo, max_n: int, deadline: float | None, exclusive: bool
    ) -> list[tuple[int, int, Cached | None]]:
        """Claim up to ``max_n`` ready slots, each with its payload cache
        record if it holds the entry (read under the queue lock), else None."""
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
                    r = ring.claim(self.owner, self.backend_pid, exclusive=exclusive)
                    if r is not None:
                        got.append(r)
                else:
                    got = ring.claim_many(self.owner, self.backend_pid, max_n, exclusive=exclusive)
                if not got:
                    ring.note_empty()
                    if deadline is not None and deadline > time.monotonic():
                        # Registered inside the same critical section as the
                        # failed scan, so a commit right after cannot miss us.
                        ring.add_waiter(OpKind.DEQUEUE)
                        waiting = True
                elif ring.stride:
                    return [(slot, seq, ring.cache_get(slot, seq)) for slot, seq in got]
            finally:
                sec.unlock_queue(ring.qidx)
            if got:
                return [(slot, seq, None) for slot, seq in got]
            try:
                if self._help_recover(ring, info):
                    continue  # a dead holder's slots were decided: look again now
            except BaseException:
                if waiting:
                    self._unwait(ring, OpKind.DEQUEUE)
                raise
            if not waiting:
                return []
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

    def _repair_dequeue(
        self, info: QueueInfo, ring: Ring, stale: list[Op], exclusive: bool
    ) -> None:
        """The rows did not match the section: decide those slots from the rows."""
        for op in stale:
            self._ops.remove(op)
        self._record_error(L.ERR_ROW_MISMATCH, info.id, stale[0].seq)
        rows = self._execute(
            self._stmt("rows", info.name),
            ([op.slot for op in stale],),
            queue=info.name,
            qid=info.id,
            seq=stale[0].seq,
        ).fetchall()
        by_slot = {slot: (state, seq) for slot, state, seq, _group in rows}
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
        logger.warning(
            "ringq: queue %s: %d stale section entries repaired from rows", info.name, len(stale)
        )
        if need_resync:
            self._resync(info)

    def _resync(self, info: QueueInfo) -> None:
        """Re-read the queue's rows into the section, keeping live clients' locked slots."""
        ring = self._ring(info)
        self._call(
            lambda: resync_queue(self._section, ring, info, self.dsn),
            queue=info.name,
            recover=False,
        )

    # -- recovery ------------------------------------------------------------------------

    def _help_recover(self, ring: Ring, info: QueueInfo) -> bool:
        """Nothing ready (or no room): if a dead holder's slot or dequeuer role
        is in the queue's way, run recovery for it, at once when no monitor
        serves, else after ``MONITOR_GRACE_S`` if the monitor has not. Looked
        at most every ``HELP_RECOVER_S`` per process and queue; returns True
        if recovery decided anything.

        Failures are logged, not raised: the caller only found nothing.
        """
        key = (self.instance, ring.qid)
        now = time.monotonic()
        if now - _last_help.get(key, -HELP_RECOVER_S) < HELP_RECOVER_S:
            return False
        _last_help[key] = now
        if not self._dead_in_the_way(ring):
            _dead_since.pop(key, None)
            return False
        since = _dead_since.setdefault(key, now)
        if now - since < MONITOR_GRACE_S and self._section.monitor_serving(MONITOR_FRESH_S):
            return False
        try:
            recovered = recover_dead_clients(self._section, self.dsn)
        except RingqError as exc:
            logger.info(
                "ringq: queue %s: recovering a dead holder in its way failed: %s", info.name, exc
            )
            return False
        if recovered:
            logger.info(
                "ringq: queue %s: a session recovered %d dead holders in its way",
                info.name,
                len(recovered),
            )
        return bool(recovered)

    def _dead_in_the_way(self, ring: Ring) -> bool:
        """Whether a slot of the queue, or its dequeuer role, is held under a
        token whose holder is dead as the section tells (see Section.token_dead)."""
        sec = self._section
        tokens = {owner for _slot, owner, _holder in ring.locked_slots() if owner > 0}
        tokens.add(ring.role_owner())
        tokens -= {0, self.owner}
        return any(sec.token_dead(t) for t in tokens)

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
        info = self._info(queue)
        ring = self._ring(info)
        deadline = time.monotonic() + timeout
        while self._dead_in_the_way(ring):
            recover_dead_clients(self._section, self.dsn)
            if not self._dead_in_the_way(ring):
                return
            if time.monotonic() >= deadline:
                raise QueueError(
                    f"queue {queue!r}: slots of dead clients still held after {timeout:g}s",
                    queue=queue,
                )
            time.sleep(0.05)  # their backends are ending, or another process is recovering

    def _recover(self, ops: list[Op], *, reason: str) -> bool | None:
        """Decide ``ops`` from the rows after the connection was lost, then go
        on with a new connection under a new token.

        Our old backend must end first (its transaction may still be
        committing): it is ended and waited for, then ``ops`` are decided under
        our old token. If anything fails on the way, that identity (the entry,
        its token and old backend, the slots) is handed over to recovery,
        which decides later, and the session takes a fresh entry; it stays
        open if its new connection works, else it is closed.

        Returns True if the transaction committed, False if not, None if it
        could not be decided now.
        """
        old_pid, old_token, old_conn = self.backend_pid, self.owner, self._conn
        with suppress(Exception):  # already broken: closing is a courtesy
            old_conn.close()
        if self._closing:
            return None  # close() hands what we hold over to recovery
        try:
            self._conn = self._open_connection()
            committed = self._call(
                lambda: self._decide_lost(ops, old_pid, old_token), recover=False
            )
        # whatever failed, recovery decides, never a later session
        except Exception as exc:  # noqa: BLE001
            self._hand_over(old_conn, reason=f"{reason}; deciding failed: {exc}", slots=len(ops))
            return None
        self.backend_pid = self._conn.info.backend_pid
        self.owner = self._section.renew_client(self._cidx, self.backend_pid)
        logger.log(logging.WARNING if ops else logging.INFO,
                   "ringq: connection lost (%s); %d slots decided from rows",
                   one_line(reason), len(ops))
        self._follow_history()
        return committed

    def _follow_history(self) -> None:
        """After a reconnect: if the server has another database history (a
        fail-over), move to a section that describes it (the old one is
        replaced; queues load again from the new server's rows)."""
        try:
            history = self._call(self._read_history, recover=False)
        except RingqError:
            return  # the next call finds out
        if history != self._history:
            self._history = history
            self._reattach_section()

    def _decide_lost(self, ops: list[Op], old_pid: int, old_token: int) -> bool | None:
        """Decide the slots of our lost connection (backend ``old_pid``) that
        ``old_token`` still holds, once that backend has ended; then give up a
        single-dequeuer role that token holds with nothing left in flight."""
        if not ops:
            return None
        with psycopg.connect(
            self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout))
        ) as aux:
            # a backend of that pid that started after we registered is not ours
            wait_backend_gone(
                aux, old_pid, not_after_ns=self._section.c(self._cidx, L.C_STARTED_NS)
            )
            committed = decide_ops(self._section, aux, ops, old_token)
        sec = self._section
        for op in ops:
            sec.lock_queue(op.ring.qidx)
            try:
                if op.ring.role_owner() == old_token and not sec.locked_under(
                    old_token, [op.ring.qidx]
                ):
                    op.ring.release_role(old_token)
            finally:
                sec.unlock_queue(op.ring.qidx)
        return committed

    def _hand_over(self, old_conn: psycopg.Connection[Any], *, reason: str, slots: int) -> None:
        """Deciding our lost connection's slots failed: hand our entry (its
        token and old backend) over to recovery and take a fresh one. Without
        a working connection (no server is primary yet, in a fail-over) the
        session stays open with none: its next call connects again."""
        self._release_entry()  # handed over if anything is locked under our token, else freed
        conn = self._conn
        healthy = conn is not old_conn and not conn.closed and not conn.broken
        if not healthy:
            with suppress(Exception):
                conn.close()
        self.backend_pid = conn.info.backend_pid if healthy else 0
        self._register_client(self.backend_pid)
        logger.warning("ringq: connection lost (%s); %d slots left to recovery%s",
                       one_line(reason), slots,
                       "" if healthy else "; connecting again on the next call")

    def _reconnect(self) -> None:
        """Connect again after a connection lost with nothing in flight (the
        new one could not be made then: a fail-over without a primary yet).

        :raises DatabaseUnavailable: still no server to connect to.
        """
        self._conn = self._open_connection()
        self.backend_pid = self._conn.info.backend_pid
        self.owner = self._section.renew_client(self._cidx, self.backend_pid)
        self._follow_history()

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


_ENDED_STATES = frozenset({"57P01", "57P02", "57P05", "25P03"})


def _cached_message(queue: str, seq: int, cached: Cached, tz: tzinfo) -> Message:
    """The message of a cache hit: a first delivery (a dequeue that does not
    commit clears its slot's record, so redeliveries read the row); its
    enqueue time in ``tz``, the connection's time zone, as a row read gives it."""
    payload, producer, pseq, enq_at_us, group = cached
    enq_at = (_EPOCH + timedelta(microseconds=enq_at_us)).astimezone(tz)
    return Message(queue, seq, payload, producer, pseq, enq_at, 1, group)


def _int_array(values: Iterable[int]) -> str:
    """A PostgreSQL array literal of integers: one text parameter (psycopg
    dumps a list element by element, a regular expression each)."""
    return "{" + ",".join(map(str, values)) + "}"


def _text_array(values: Sequence[str | None]) -> str:
    """A PostgreSQL array literal of strings (None: NULL), each quoted; the
    usual case (one producer, or one group, for the whole batch) quoted once."""
    def quoted(v: str | None) -> str:
        if v is None:
            return "NULL"
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'

    first = values[0] if values else ""
    if all(v == first for v in values):
        return "{" + ",".join([quoted(first)] * len(values)) + "}"
    return "{" + ",".join(map(quoted, values)) + "}"


def _answer_lost(exc: BaseException | None) -> bool:
    """Whether ``exc``, raised by a commit, leaves its outcome unknown: no
    verdict of the server (a client-side error, no SQLSTATE), or the server
    ended the connection (admin or crash shutdown, a session timeout, a
    connection exception: SQLSTATE class 08), perhaps after the COMMIT ran."""
    state = getattr(exc, "sqlstate", None)
    return state is None or state in _ENDED_STATES or state.startswith("08")


def _orphaned(sec: Section, cidx: int, pid: int, registered_ns: int) -> None:
    """Finalizer of a session never closed: let recovery decide its slots and free it."""
    if os.getpid() != pid or sec.closed:
        return
    sec.hand_over_client(cidx, pid=pid, registered_ns=registered_ns)

