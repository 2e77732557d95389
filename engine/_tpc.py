"""Two-phase commit for sessions (psycopg's ``tpc_*`` API), kept beside the
Session as psycopg keeps its ``_tpc.py`` beside its Connection.

Inside a distributed transaction a commit is prepare-then-commit. Row locks
of a prepared transaction are invisible to other sessions, so before it
prepares, a session logs the slots the transaction touches (``ringq.tpc_log``,
committed on its own); the coordinator's decision to commit is recorded the
same way (``ringq.tpc_decisions``). Recovery (``resolve_prepared``) reads both
for every gid in ``pg_prepared_xacts``.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus

from . import _layout as L
from ._errors import InDoubt, RingqError, SessionClosed, TransactionError, one_line
from ._queries import QUERIES as _Q
from ._section import Section

if TYPE_CHECKING:

    from ._ops import Op

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE
T = TypeVar("T")

TPC_BRANCH = "ringq"  # the branch qualifier of Session.xid(): marks the gids ringq made


def _b64(b: str) -> str:
    return base64.b64encode(b.encode()).decode()


def is_ringq_gid(gid: str) -> bool:
    """Whether ``gid`` is one :meth:`Session.xid` makes (format 0, branch
    ``ringq``, as psycopg spells an xid), so recovery may roll it back.
    Prepared transactions named otherwise are the user's own."""
    parts = gid.split("_")  # base64 never holds "_"
    return len(parts) == 3 and parts[0] == "0" and parts[2] == _b64(TPC_BRANCH)


class TwoPhase:
    """The two-phase commit half of :class:`~ringq.engine.Session` (a mixin).

    State: the open xid, whether it is prepared, whether the coordinator's
    decision to commit is recorded, and the side connection the slot log and
    the decision are written on.
    """

    _tpc_xid: Any
    _tpc_prepared: bool
    _tpc_decided: bool
    _aux: psycopg.Connection[Any] | None

    if TYPE_CHECKING:
        # Provided by Session.
        dsn: str
        _closed: bool
        _connect_timeout: float
        _conn: psycopg.Connection[Any]
        _ops: list[Op]
        _section: Section

        def _check(self) -> None: ...
        def _call(
            self,
            fn: Callable[[], T],
            *,
            queue: str | None = None,
            qid: int = 0,
            seq: int = -1,
            recover: bool = True,
        ) -> T: ...
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
        ) -> psycopg.Cursor[Any]: ...
        def flush(self) -> None: ...
        def _finish(
            self, ops: list[Op], *, committed: bool, count_delivery: bool = True
        ) -> None: ...
        def _recover(self, ops: list[Op], *, reason: str) -> bool | None: ...
        def _record_ops_error(self, code: int, ops: list[Op]) -> None: ...

    def _tpc_reset(self) -> None:
        """No two-phase transaction open (a new session, or one after fork)."""
        self._tpc_xid = None
        self._tpc_prepared = False
        self._tpc_decided = False
        self._aux = None

    def xid(self, gtrid: str) -> Any:
        """A transaction id for :meth:`tpc_begin` (format 0, branch ``ringq``)."""
        if self._closed:
            raise SessionClosed("the session is closed")
        return self._conn.xid(0, gtrid, TPC_BRANCH)

    def tpc_begin(self, xid: Any) -> None:
        """Start a two-phase transaction (psycopg's ``tpc_begin``); the connection must be idle."""
        self._check()
        if self._ops:
            raise TransactionError("tpc_begin inside a transaction with queue operations")

        def begin() -> Any:
            if self._conn.info.transaction_status != _IDLE:
                self._conn.rollback()
            x = self.xid(xid) if isinstance(xid, str) else xid
            self._conn.tpc_begin(x)
            return x

        self._tpc_xid = self._call(begin)

    def tpc_prepare(self) -> None:
        """Send the row writes the session holds (:meth:`flush`), log the
        slots this transaction touches (committed on its own), then PREPARE.

        :raises StaleSection: a row write did not match (see :meth:`flush`):
            the transaction was rolled back; retry it.
        """
        self._check()
        if self._tpc_xid is None:
            raise TransactionError("no two-phase transaction is open")
        self.flush()
        gid = self._gid()
        if self._ops:
            self._execute(
                _Q["tpc_log"],
                {
                    "gid": gid,
                    "queue_ids": [op.info.id for op in self._ops],
                    "slots": [op.slot for op in self._ops],
                    "seqs": [op.seq for op in self._ops],
                    "kinds": [op.kind.value for op in self._ops],
                },
                conn=self._aux_conn(),
            )
        self._call(self._conn.tpc_prepare)
        self._tpc_prepared = True

    def _aux_conn(self) -> psycopg.Connection[Any]:
        """A second, autocommit connection for bookkeeping outside the
        transaction (the two-phase slot log), opened once."""
        aux = self._aux
        if aux is None or aux.closed or aux.broken:
            aux = self._call(
                lambda: psycopg.connect(
                    self.dsn, autocommit=True, connect_timeout=max(1, int(self._connect_timeout))
                ),
                recover=False,
            )
            self._aux = aux
        return aux

    def _hold(self, ops: list[Op]) -> None:
        """Keep slots locked with no live owner (in doubt) for recovery to decide."""
        sec = self._section
        for op in ops:
            sec.lock_queue(op.ring.qidx)
            try:
                op.ring.hold(op.slot)
            finally:
                sec.unlock_queue(op.ring.qidx)

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
        if self._tpc_xid is None or not self._tpc_prepared:
            raise TransactionError(
                "tpc_decide needs a prepared two-phase transaction (call tpc_prepare first)"
            )
        self._execute(_Q["tpc_decide"], (self._gid(),), conn=self._aux_conn())
        self._tpc_decided = True

    def tpc_commit(self) -> None:
        """COMMIT PREPARED (or one-phase commit if not prepared); then publish.

        :raises InDoubt: the answer to COMMIT PREPARED was lost; recovery
            commits the transaction if :meth:`tpc_decide` recorded it, else
            rolls it back after a timeout.
        """
        if self._closed:
            raise SessionClosed("the session is closed")
        self._tpc_end(commit=True)

    def tpc_rollback(self) -> None:
        """ROLLBACK PREPARED (or a plain rollback if not prepared).

        :raises TransactionError: :meth:`tpc_decide` recorded the decision to
            commit: once durable it stands (other participants may have
            committed already), so only :meth:`tpc_commit` or recovery may
            finish the transaction, and both commit it.
        """
        if self._closed:
            raise SessionClosed("the session is closed")
        if self._tpc_decided:
            raise TransactionError(
                f"{self._gid()} is decided to commit: call tpc_commit(), or leave it to recovery"
            )
        self._tpc_end(commit=False)

    def _leave_decided(self) -> None:
        """At close: leave a decided prepared transaction to recovery. Its
        slots stay locked with no live owner (as an in-doubt one's do), and
        ``resolve_prepared`` commits it from the recorded decision."""
        ops, self._ops = self._ops, []
        gid = self._gid()
        self._tpc_xid = None
        self._tpc_prepared = False
        self._tpc_decided = False
        self._hold(ops)
        logger.warning(
            "ringq: session closed with %s decided but not committed: left to recovery", gid
        )

    def _gid(self) -> str:
        x = self._tpc_xid
        return f"{x.format_id}_{_b64(x.gtrid)}_{_b64(x.bqual)}"

    def _tpc_end(self, *, commit: bool) -> None:
        if self._tpc_xid is None:
            raise TransactionError("no two-phase transaction is open")
        if commit and not self._tpc_prepared:
            self.flush()  # a one-phase commit: the row writes go first
        ops, self._ops = self._ops, []
        gid = self._gid()
        try:
            self._call(self._conn.tpc_commit if commit else self._conn.tpc_rollback, recover=False)
        except RingqError as err:
            exc = err.__cause__
            self._tpc_xid = None
            self._tpc_decided = False  # a recorded decision stays for recovery
            if self._tpc_prepared:
                # A prepared transaction outlives the connection: its rows do
                # not tell the outcome yet. Hold the slots for the monitor's
                # resolve_prepared (the coordinator's decision decides).
                self._tpc_prepared = False
                self._hold(ops)
                self._record_ops_error(L.ERR_IN_DOUBT, ops)
                self._recover([], reason=f"tpc end failed: {exc}")
                raise InDoubt(
                    f"two-phase {'commit' if commit else 'rollback'} of {gid} in doubt: "
                    f"{one_line(str(exc))}"
                ) from exc
            if commit:
                self._record_ops_error(L.ERR_COMMIT_FAILED, ops)
            self._recover(ops, reason=f"tpc end failed: {exc}")
            raise
        self._tpc_xid = None
        self._tpc_prepared = False
        decided, self._tpc_decided = self._tpc_decided, False
        if decided:
            # Clear the decision at once: committed, it has done its work, and
            # a row left behind would commit a later transaction reusing the
            # gid. (If we die first, recovery drops it once the gid is no
            # longer prepared.)
            try:
                self._execute(_Q["tpc_undecide"], (gid,), conn=self._aux_conn(), recover=False)
            except RingqError:
                logger.warning("ringq: could not clear the decision for %s (recovery will)", gid)
        try:
            self._finish(ops, committed=commit)
        finally:
            if ops:
                try:
                    self._execute(_Q["tpc_forget"], (gid,), conn=self._aux_conn(), recover=False)
                except RingqError:
                    logger.warning("ringq: could not clear tpc_log for %s", gid)

