"""A session's link to its database and to the global section.

One :class:`Link` per session: its PostgreSQL connection, its client entry
in the section (index, token, backend pid, role), the slots in flight under
that token, and the queues and rings it has looked up. It is the one place
where the session's psycopg errors become ringq errors (:meth:`Link.call`),
and where a lost connection is replaced: the slots in flight are decided
from the rows (``_decide.decide_lost``) and the entry takes a new token.

The Session, its transaction, its claims and its two-phase commit all work
through the same Link; the Link calls none of them.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus

from ..driver import QUERIES as _Q
from ..driver import queue_table, validate_queue_name, wire
from ..driver.errors import QueueNotFound, RingqError, SchemaMissing, one_line, redact_dsn
from ..driver.pg import connect, from_callers_statement, from_psycopg
from ..ring import Item, Op, QueueInfo, Ring, each_op
from ..rows import decide_lost, decide_ops, load_queue, resync_queue, wait_dead_holders
from ..rows.recovery import history_of, section_following
from ..section import Section
from ..section import layout as L
from ..section.metrics import queue_stats

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
T = TypeVar("T")

# The statements that go through libpq directly as ringq's prepared statements
# (wire.Prepared): a commit's row writes, and the dequeue that reads rows.
_FAST = frozenset({
    "enqueue", "enqueue_alone", "enqueue_many", "consume", "consume_alone", "consume_many",
    "consume_span", "dequeue", "dequeue_many", "dequeue_span",
})

SUPPORTED_SCHEMA = "1"


class Link:
    """A session's connection, its client entry, and its slots in flight.

    ``ops`` are the slots locked under our token whose outcome the section
    has yet to learn (reserved for enqueue, locked for dequeue), in the
    order taken; whoever finishes them takes them off. ``tpc_open`` is true
    while a two-phase transaction is open (psycopg then sends its own BEGIN).
    """

    def __init__(
        self,
        dsn: str,
        *,
        producer: str,
        connect_timeout: float,
        application_name: str,
        role: int,
    ) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.appname = application_name
        self.producer = producer
        self.producer_seq = 0
        # the inbox's pump: reserve nothing while SQL producers hold slots reserved
        self.behind_sql_puts = False
        # the caller's statements to send with the transaction's next round
        # trip of row writes (its commit, a flush): Session.execute(defer=True)
        self.deferred: list[wire.Statement] = []
        self.ops: list[Item] = []
        # whether a statement went for the ops in flight (reset when there are none)
        self.sent_any = False
        self.tpc_open = False
        # set by close(): a rollback that finds the connection lost does not reconnect
        self.closing = False
        self.queues: dict[str, QueueInfo] = {}
        self.rings: dict[int, Ring] = {}
        self.stmts: dict[tuple[str, str], str] = {}
        # the commit's row writes, prepared by ringq itself (see wire.Prepared)
        self.prepared = wire.Prepared()
        self.role = role  # C_ROLE of our client entry (a worker sets CR_WORKER)
        # database exchanges made (each call()), for the trace's per-call count
        self.round_trips = 0
        self.conn = self.open_connection()
        self.attach()

    # -- connecting ---------------------------------------------------------------

    def open_connection(self) -> psycopg.Connection[Any]:
        return self.call(
            lambda: connect(self.dsn, autocommit=False, connect_timeout=self.connect_timeout,
                            application_name=self.appname),
            recover=False,
        )

    def attach(self) -> None:
        """Read the database's instance and history; attach its section and
        take a client entry in it.

        :raises SchemaMissing, SectionIncompatible, DatabaseUnavailable:
        """
        def read_instance() -> tuple[Any, ...] | None:
            with self.outside_transaction() as conn:
                return conn.execute(_Q["attach"]).fetchone()

        try:
            row = self.call(read_instance, recover=False)
        except RingqError as exc:
            self.conn.close()
            if isinstance(exc.__cause__, psycopg.errors.UndefinedTable):
                raise SchemaMissing(
                    f"no ringq schema in {redact_dsn(self.dsn)!r}: "
                    "create a queue first (ringq queue create)"
                ) from exc.__cause__
            raise
        assert row is not None
        instance, version, backend_pid, has_guard, sysid, timeline, clock_us = row
        if version != SUPPORTED_SCHEMA or not instance:
            self.conn.close()
            raise SchemaMissing(
                f"ringq schema version {version!r} is not supported (want {SUPPORTED_SCHEMA})"
            )
        if not has_guard:
            self.conn.close()
            raise SchemaMissing(
                "the ringq schema lacks ringq.expect_rows() or the groups' or traces' columns, "
                "which this "
                "version needs: apply the "
                "schema script again (ringq queue create, or ringq script create-queue | psql)"
            )
        self.instance: str = instance
        self.backend_pid: int = backend_pid
        self.history = (int(sysid), int(timeline))  # of the server we are connected to
        try:
            self.section: Section = section_following(
                instance, self.history, redact_dsn(self.dsn)
            )
        except RingqError:  # a standby, a foreign or unusable section: do not leak the connection
            self.conn.close()
            raise
        self.section.note_db_clock(int(clock_us))  # the estimate that due times are compared with
        self.register_client(backend_pid)
        self.rings = {}

    def register_client(self, backend_pid: int) -> None:
        old = getattr(self, "finalizer", None)
        if old is not None:
            old.detach()
        sec = self.section
        # owner: our token, written in the OWNER word of every slot we lock
        # (with our backend pid in its HOLDER word); renewed at every reconnect.
        self.cidx, self.owner = sec.add_client(backend_pid)
        if self.role:
            sec.set_client_role(self.cidx, self.role)
        # A session dropped without close() hands its entry to recovery.
        self.finalizer = weakref.finalize(
            self, _orphaned, sec, self.cidx, os.getpid(), sec.c(self.cidx, L.C_REGISTERED_NS)
        )

    def release_entry(self) -> None:
        """Give up our client entry (once): freed if no slot is locked under
        our token, else handed over to recovery, never freed: a later session
        taking the entry must not inherit slots it knows nothing of."""
        if not self.finalizer.alive:
            return
        self.finalizer.detach()
        sec = self.section
        if sec.closed:
            return
        if self.ops or sec.locked_under(self.owner, sec.client_queues(self.cidx)):
            sec.hand_over_client(self.cidx)
        else:
            sec.remove_client(self.cidx)

    @contextmanager
    def outside_transaction(self) -> Iterator[psycopg.Connection[Any]]:
        """The connection in autocommit while no transaction is open (each
        statement its own: nothing left open afterwards, no snapshot held);
        inside the caller's transaction, the connection as it is."""
        conn = self.conn
        if conn.info.transaction_status != _IDLE or conn.autocommit:
            yield conn
            return
        conn.autocommit = True  # no round trip: psycopg only stops sending BEGIN
        try:
            yield conn
        finally:
            if not conn.closed:
                conn.autocommit = False

    def read_history(self) -> tuple[int, int]:
        with self.outside_transaction() as conn:
            return history_of(conn)

    def reattach_section(self) -> None:
        old = self.section
        self.section = section_following(self.instance, self.history, redact_dsn(self.dsn))
        if self.section is not old:
            self.register_client(self.backend_pid)
            self.rings = {}

    def settle(self, *, two_phase_prepared: bool) -> None:
        """Before each call: reconnect if the connection was lost with nothing
        in flight; learn the outcome of ops whose transaction ended on the
        connection directly; follow a section replaced by another client."""
        if not self.ops:
            self.sent_any = False
            if self.conn.closed and not self.closing:
                self.reconnect()
        elif (
            self.sent_any  # else every op is held: nothing to learn (and no scan per call)
            and self.conn.pgconn.transaction_status == _IDLE
            and not two_phase_prepared
            and self.sent()
        ):
            # Someone committed or rolled back on the connection directly:
            # learn the outcome from the rows. (A prepared transaction is
            # idle too, but undecided: tpc_commit/tpc_rollback finish it.)
            # If the connection is lost meanwhile, call() decides them
            # from a new one. Row writes still held in the session never
            # went: they stay, for the session's own commit or rollback.
            def decide() -> None:
                with self.outside_transaction() as conn:
                    self.decide_from_rows(conn, self.sent())

            self.call(decide)
            self.ops = [op for op in self.ops if op.held]
        if not self.ops and self.section.unlinked_lately():
            # Replaced by another client, perhaps after a fail-over that this
            # session has not seen yet (its connection may be dead): attach as
            # the server's history says now, never as this session last knew
            # it, or it would replace the new section by one of the old
            # history. A lost connection is handled (and raised) by call().
            self.history = self.call(self.read_history)
            self.reattach_section()

    def sent(self) -> list[Op]:
        """The in-flight ops whose statements went to the server (all but
        those whose row write the session still holds)."""
        return each_op([op for op in self.ops if not op.held])

    # -- queues -------------------------------------------------------------------

    def info(self, name: str) -> QueueInfo:
        info = self.queues.get(name)
        if info is None:
            validate_queue_name(name)

            def lookup() -> tuple[Any, ...] | None:
                with self.outside_transaction() as conn:
                    return conn.execute(_Q["queue_info"], (name,)).fetchone()

            row = self.call(lookup)
            if row is None:
                raise QueueNotFound(f"queue {name!r} does not exist", queue=name)
            info = QueueInfo(*row)
            self.queues[name] = info
        return info

    def ring(self, info: QueueInfo) -> Ring:
        ring = self.rings.get(info.id)
        if ring is None:
            qidx = self.section.find_queue(info.id)
            if qidx is None:
                qidx = self._load_queue(info)
            ring = Ring(self.section, qidx)
            self.rings[info.id] = ring
            self.section.mark_client_queue(self.cidx, qidx)  # once per session and queue
        return ring

    def wait_dead_holders(self, queue: str, timeout: float) -> None:
        """Decide the slots of ``queue`` held by dead clients (``Session.recover_dead_holders``)."""
        ring = self.ring(self.info(queue))
        wait_dead_holders(self.section, self.dsn, ring, queue, owner=self.owner, timeout=timeout)

    def queue_stats(self, queue: str) -> dict[str, int]:
        """The queue's counters in the section (``Session.stats``)."""
        return queue_stats(self.section, self.ring(self.info(queue)).qidx)

    def _load_queue(self, info: QueueInfo) -> int:
        """Bring a queue into the section from its table (first user on this host)."""
        # Read the rows on a separate connection: outside the caller's
        # transaction, committed state only.
        def load() -> int:
            with connect(self.dsn, connect_timeout=self.connect_timeout) as aux:
                return load_queue(self.section, aux, info)

        return self.call(load, queue=info.name, recover=False)

    def resync(self, info: QueueInfo) -> None:
        """Re-read the queue's rows into the section, keeping live clients' locked slots."""
        ring = self.ring(info)
        self.call(
            lambda: resync_queue(self.section, ring, info, self.dsn),
            queue=info.name,
            recover=False,
        )

    def stmt(self, name: str, queue: str) -> str:
        key = (name, queue)
        stmt = self.stmts.get(key)
        if stmt is None:
            stmt = (
                sql.SQL(_Q[name])
                .format(table=queue_table(queue), queue=sql.Literal(queue))
                .as_string(None)
            )
            if name in _FAST:
                self.prepared.add(stmt)
            self.stmts[key] = stmt
        return stmt

    # -- the database -------------------------------------------------------------------

    def call(
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
        self.round_trips += 1
        try:
            return fn()
        except psycopg.Error as exc:
            raise self.failed(exc, queue=queue, qid=qid, seq=seq, recover=recover) from exc

    def failed(
        self,
        exc: psycopg.Error,
        *,
        queue: str | None = None,
        qid: int = 0,
        seq: int = -1,
        recover: bool = True,
    ) -> RingqError:
        """What :meth:`call` does with ``exc``, a psycopg error of the
        session's database work: the ringq error to raise (``from exc``),
        having recovered a lost connection (with ``recover``) and recorded
        the error (with ``qid``). The asyncio face calls it for its own
        exchanges, in a thread when the connection was lost (the recovery
        makes round trips of its own)."""
        if recover:
            lost = (
                self.conn.broken
                or (isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
                and self.conn.closed)
            )
            # A statement refused because the caller's own SQL already failed
            # the transaction is the caller's error, not ours.
            record = qid and not isinstance(exc, psycopg.errors.InFailedSqlTransaction)
            try:
                if lost:
                    # first: the error is told with the new backend. The
                    # connection died mid-transaction: nothing committed;
                    # free our slots by the rows.
                    ops, self.ops = self.ops, []
                    self.recover(ops, reason=str(exc))
            finally:
                if record:
                    self.record_error(
                        L.ERR_CONNECTION_LOST if lost else L.ERR_DATABASE, qid, seq
                    )
        return from_psycopg(exc, dsn=self.dsn, queue=queue)

    def is_lost(self) -> bool:
        """Whether the connection is gone (the asyncio face then recovers in a thread)."""
        return self.conn.broken or self.conn.closed

    def execute(
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
    ) -> wire.Fetch:
        """Run one statement on the connection (or ``conn``); errors as in :meth:`call`.

        The first statement of a transaction on the connection carries its
        BEGIN in the same message (``BEGIN; <statement>``), not one of its own.
        """
        c = self.conn if conn is None else conn
        # Inside a two-phase transaction psycopg sends its own BEGIN.
        may_begin = c is self.conn and not self.tpc_open

        def run() -> wire.Fetch:
            return wire.execute(c, query, params, binary=binary, may_begin=may_begin,
                                 prepared=self.prepared if c is self.conn else None)

        self.sent_any = True
        return self.call(run, queue=queue, qid=qid, seq=seq, recover=recover)

    def execute_callers(self, query: str, params: Any, *, prepare: bool) -> wire.Fetch:
        """:meth:`execute` of the caller's own statement (``Session.execute``):
        ``prepare`` plans it once per connection; an error is the caller's
        (``driver.pg.from_callers_statement``)."""
        if prepare:
            self.prepared.add(query)
        try:
            return self.execute(query, params)
        except RingqError as err:
            if err.__cause__ is None:
                raise
            raise from_callers_statement(err.__cause__, err) from err.__cause__

    def inherit(self, parent: Link) -> None:
        """In a forked child, keep what the parent's link learned of the queues and
        its statements (the prepared statements' names are forgotten: the
        connection is new)."""
        self.queues, self.stmts, self.prepared = parent.queues, parent.stmts, parent.prepared

    def record_error(self, code: int, qid: int = 0, seq: int = -1) -> None:
        """Record an error this client hit in its section entry (error paths only;
        the monitor logs it with our pid, the queue and the seq)."""
        with suppress(ValueError, IndexError, TypeError):  # a released view: the section is gone
            self.section.record_client_error(self.cidx, code, qid, seq)

    def record_ops_error(self, code: int, ops: Sequence[Item]) -> None:
        op = ops[0] if ops else None
        seq = -1 if op is None else op.seq if isinstance(op, Op) else int(op.seqs[0])
        self.record_error(code, op.info.id if op else 0, seq)

    # -- a lost connection -------------------------------------------------------------

    def recover(self, items: Sequence[Item], *, reason: str) -> bool | None:
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
        ops = each_op(items)
        self.deferred = []  # the lost transaction's: they ran with it, or not at all
        old_pid, old_token, old_conn = self.backend_pid, self.owner, self.conn
        with suppress(Exception):  # already broken: closing is a courtesy
            old_conn.close()
        if self.closing:
            return None  # close() hands what we hold over to recovery
        try:
            self.conn = self.open_connection()
            committed = self.call(
                lambda: decide_lost(
                    self.section, self.dsn, ops, old_pid, old_token,
                    cidx=self.cidx, connect_timeout=self.connect_timeout,
                ),
                recover=False,
            )
        # whatever failed, recovery decides, never a later session
        except Exception as exc:
            self._hand_over(old_conn, reason=f"{reason}; deciding failed: {exc}", slots=len(ops))
            return None
        self.backend_pid = self.conn.info.backend_pid
        self.owner = self.section.renew_client(self.cidx, self.backend_pid)
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
            history = self.call(self.read_history, recover=False)
        except RingqError:
            return  # the next call finds out
        if history != self.history:
            self.history = history
            self.reattach_section()

    def _hand_over(self, old_conn: psycopg.Connection[Any], *, reason: str, slots: int) -> None:
        """Deciding our lost connection's slots failed: hand our entry (its
        token and old backend) over to recovery and take a fresh one. Without
        a working connection (no server is primary yet, in a fail-over) the
        session stays open with none: its next call connects again."""
        self.release_entry()  # handed over if anything is locked under our token, else freed
        conn = self.conn
        healthy = conn is not old_conn and not conn.closed and not conn.broken
        if not healthy:
            with suppress(Exception):
                conn.close()
        self.backend_pid = conn.info.backend_pid if healthy else 0
        self.register_client(self.backend_pid)
        logger.warning("ringq: connection lost (%s); %d slots left to recovery%s",
                       one_line(reason), slots,
                       "" if healthy else "; connecting again on the next call")

    def reconnect(self) -> None:
        """Connect again after a connection lost with nothing in flight (the
        new one could not be made then: a fail-over without a primary yet).

        :raises DatabaseUnavailable: still no server to connect to.
        """
        self.conn = self.open_connection()
        self.backend_pid = self.conn.info.backend_pid
        self.owner = self.section.renew_client(self.cidx, self.backend_pid)
        self._follow_history()

    def decide_from_rows(self, conn: psycopg.Connection[Any], ops: list[Op]) -> bool | None:
        if not ops:
            return None
        return decide_ops(self.section, conn, ops, self.owner, why="ended-on-connection")


def _orphaned(sec: Section, cidx: int, pid: int, registered_ns: int) -> None:
    """Finalizer of a session never closed: let recovery decide its slots and free it."""
    if os.getpid() != pid or sec.closed:
        return
    sec.hand_over_client(cidx, pid=pid, registered_ns=registered_ns)
