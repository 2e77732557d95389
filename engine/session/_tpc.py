"""Two-phase commit for sessions (psycopg's ``tpc_*`` API), kept beside the
Session as psycopg keeps its ``_tpc.py`` beside its Connection: an object
the Session holds (:class:`TwoPhase`).

Inside a distributed transaction a commit is prepare-then-commit. Row locks
of a prepared transaction are invisible to other sessions, so before it
prepares, a session logs the slots the transaction touches (``ringq.tpc_log``,
committed on its own); the coordinator's decision to commit is recorded the
same way (``ringq.tpc_decisions``). Recovery (``resolve_prepared``) reads both
for every gid in ``pg_prepared_xacts``.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from ..driver import QUERIES as _Q
from ..driver.errors import InDoubt, RingqError, RolledBack, TransactionError, one_line
from ..driver.pg import connect
from ..ring import Op, each_op
from ..rows import TPC_BRANCH, decide_ops, gid_of, in_flight, rows_outcome, wait_backend_gone
from ..section import layout as L
from ._link import Link
from ._transaction import Transaction

logger = logging.getLogger("ringq.engine")

_IDLE = TransactionStatus.IDLE


class TwoPhase:
    """The two-phase commit of a session (psycopg's ``tpc_*`` API), an
    object the :class:`~ringq.engine.Session` holds.

    State: the open xid, whether it is prepared, whether the coordinator's
    decision to commit is recorded, and the side connection the slot log and
    the decision are written on. It works through the session's link and
    transaction (the slots in flight, and telling the section their
    outcome); the session flushes the held row writes before
    :meth:`prepare`, and before :meth:`end` of a one-phase commit.
    """

    def __init__(self, link: Link, txn: Transaction) -> None:
        self.link = link
        self.txn = txn
        self.xid: Any = None
        self.prepared = False
        self.decided = False
        self.aux: psycopg.Connection[Any] | None = None

    def make_xid(self, gtrid: str) -> Any:
        """A transaction id for :meth:`begin` (format 0, branch ``ringq``)."""
        return self.link.conn.xid(0, gtrid, TPC_BRANCH)

    def require_open(self) -> None:
        """:raises TransactionError: no two-phase transaction is open."""
        if self.xid is None:
            raise TransactionError("no two-phase transaction is open")

    def begin(self, xid: Any) -> None:
        """Start a two-phase transaction; the connection must be idle."""
        link = self.link
        if link.ops:
            raise TransactionError("tpc_begin inside a transaction with queue operations")

        def begin() -> Any:
            if link.conn.info.transaction_status != _IDLE:
                link.conn.rollback()
            x = self.make_xid(xid) if isinstance(xid, str) else xid
            link.conn.tpc_begin(x)
            return x

        self.xid = link.call(begin)
        link.tpc_open = True

    def prepare(self) -> None:
        """Log the slots this transaction touches (committed on its own),
        then PREPARE (the held row writes were flushed already)."""
        link = self.link
        gid = self._gid()
        ops = each_op(link.ops)
        link.ops = [*ops]  # per entry from here: the slow paths of two-phase commit
        if ops:
            link.execute(
                _Q["tpc_log"],
                {
                    "gid": gid,
                    "queue_ids": [op.info.id for op in ops],
                    "slots": [op.slot for op in ops],
                    "seqs": [op.seq for op in ops],
                    "kinds": [op.kind.value for op in ops],
                },
                conn=self._aux_conn(),
            )
        link.call(link.conn.tpc_prepare)
        self.prepared = True

    def _aux_conn(self) -> psycopg.Connection[Any]:
        """A second, autocommit connection for bookkeeping outside the
        transaction (the two-phase slot log), opened once."""
        aux = self.aux
        if aux is None or aux.closed or aux.broken:
            link = self.link
            aux = link.call(
                lambda: connect(link.dsn, connect_timeout=link.connect_timeout),
                recover=False,
            )
            self.aux = aux
        return aux

    def close(self) -> None:
        if self.aux is not None:
            self.aux.close()

    def inherit(self, parent: TwoPhase) -> None:
        """In a forked child: the parent's open two-phase transaction, as it stood."""
        self.xid, self.prepared, self.decided = parent.xid, parent.prepared, parent.decided
        self.link.tpc_open = parent.xid is not None

    def decide(self) -> None:
        """Record the coordinator's durable decision to commit (see ``Session.tpc_decide``).

        :raises TransactionError: no prepared two-phase transaction.
        :raises DatabaseUnavailable: the decision could not be recorded.
        """
        if self.xid is None or not self.prepared:
            raise TransactionError(
                "tpc_decide needs a prepared two-phase transaction (call tpc_prepare first)"
            )
        self.link.execute(_Q["tpc_decide"], (self._gid(),), conn=self._aux_conn())
        self.decided = True

    def refuse_rollback(self) -> None:
        """:raises TransactionError: the decision to commit is recorded."""
        if self.decided:
            raise TransactionError(
                f"{self._gid()} is decided to commit: call tpc_commit(), or leave it to recovery"
            )

    def leave_decided(self) -> None:
        """At close: leave a decided prepared transaction to recovery. Its
        slots stay locked with no live owner (as an in-doubt one's do), and
        ``resolve_prepared`` commits it from the recorded decision."""
        link = self.link
        ops, link.ops = each_op(link.ops), []
        gid = self._gid()
        self._reset()
        self.txn.hold(ops)
        logger.warning(
            "ringq: session closed with %s decided but not committed: left to recovery", gid
        )

    def lost_before_commit(self, err: RingqError) -> RolledBack:
        """The connection was lost before a one-phase commit's COMMIT was sent
        (its row writes failed; the link decided their slots): nothing of the
        transaction committed. Ends it; returns the error to raise."""
        self._reset()
        return RolledBack.lost(
            "the connection was lost before the commit: nothing of the transaction committed",
            err.__cause__ or err,
        )

    def _reset(self) -> None:
        self.xid = None
        self.link.tpc_open = False
        self.prepared = False
        self.decided = False

    def _gid(self) -> str:
        x = self.xid
        return gid_of(x.format_id, x.gtrid, x.bqual)

    def end(self, *, commit: bool) -> None:
        """COMMIT PREPARED or ROLLBACK PREPARED (or one phase if not
        prepared: the session flushed the row writes first); then tell the
        section. :raises InDoubt: the answer to a prepared one was lost."""
        link = self.link
        ops, link.ops = each_op(link.ops), []
        link.deferred = []  # (flushed before a commit; a rollback drops them)
        gid = self._gid()
        try:
            link.call(link.conn.tpc_commit if commit else link.conn.tpc_rollback, recover=False)
        except RingqError as err:
            exc = err.__cause__
            self.xid = None
            link.tpc_open = False
            self.decided = False  # a recorded decision stays for recovery
            if self.prepared:
                # A prepared transaction outlives the connection: hold the
                # slots for the monitor's resolve_prepared (the coordinator's
                # decision decides), unless it is prepared no longer (our
                # COMMIT or ROLLBACK PREPARED ran, or recovery resolved it):
                # then its rows tell.
                self.prepared = False
                self.txn.hold(ops)
                backend = (link.backend_pid, link.section.c(link.cidx, L.C_STARTED_NS))
                link.recover([], reason=f"tpc end failed: {exc}")
                committed = self._resolved(gid, ops, backend)
                what = "commit" if commit else "rollback"
                if committed is None:
                    link.record_ops_error(L.ERR_IN_DOUBT, ops)
                    raise InDoubt(
                        f"two-phase {what} of {gid} in doubt: {one_line(str(exc))}"
                    ) from exc
                if committed == commit:
                    logger.warning("ringq: the answer to the two-phase %s of %s was lost, but "
                                   "it is prepared no longer and the rows show it done", what, gid)
                    return
                if commit:
                    raise RolledBack.lost(
                        f"the connection was lost at the commit of {gid}, which was rolled back "
                        "(by recovery): nothing of it committed",
                        exc or err,
                    ) from err
                raise TransactionError(
                    f"the connection was lost at the rollback of {gid}, which committed (its "
                    "decision was recorded, and recovery committed it)"
                ) from err
            if commit:
                link.record_ops_error(L.ERR_COMMIT_FAILED, ops)
            backend = (link.backend_pid, link.section.c(link.cidx, L.C_STARTED_NS))
            committed = link.recover(ops, reason=f"tpc end failed: {exc}")
            if committed is None and commit and ops:
                # as a plain commit whose answer was lost (Transaction.commit)
                raise self.txn.commit_in_doubt(ops, exc or err, backend) from err
            if committed is False:
                raise RolledBack.lost(
                    f"the connection was lost at {'commit' if commit else 'rollback'} and the "
                    "rows show nothing of the transaction committed",
                    exc or err,
                ) from err
            if committed and commit:
                logger.warning("ringq: commit answer lost, but the rows show it committed")
                return
            raise
        decided = self.decided
        self._reset()
        if decided:
            # Clear the decision at once: committed, it has done its work, and
            # a row left behind would commit a later transaction reusing the
            # gid. (If we die first, recovery drops it once the gid is no
            # longer prepared.)
            try:
                link.execute(_Q["tpc_undecide"], (gid,), conn=self._aux_conn(), recover=False)
            except RingqError:
                logger.warning("ringq: could not clear the decision for %s (recovery will)", gid)
        try:
            self.txn.finish(ops, committed=commit)
        finally:
            if ops:
                try:
                    link.execute(_Q["tpc_forget"], (gid,), conn=self._aux_conn(), recover=False)
                except RingqError:
                    logger.warning("ringq: could not clear tpc_log for %s", gid)

    def _resolved(self, gid: str, ops: list[Op], backend: tuple[int, int]) -> bool | None:
        """After the answer to COMMIT or ROLLBACK PREPARED of ``gid`` was
        lost, on the link's new connection: once the old backend has ended,
        None while ``gid`` is still prepared (nothing tells its outcome yet),
        or when nothing else can be learned; else whether it committed, from
        the rows of its slots (which are decided for the section if they are
        still held for it); its decision and slot log are deleted then."""
        link = self.link
        if not ops or link.conn.closed or link.conn.broken:
            return None
        try:
            with connect(link.dsn, connect_timeout=link.connect_timeout) as aux:
                wait_backend_gone(aux, backend[0], not_after_ns=backend[1])
                if aux.execute(_Q["tpc_is_prepared"], (gid,)).fetchone() is not None:
                    return None
                committed = decide_ops(ops[0].ring.sec, aux, ops, L.OWNER_HELD,
                                       why=f"tpc-end-lost gid={gid}")
                if committed is None:  # recovery decided the slots first
                    committed = rows_outcome(aux, in_flight(ops))
                # its decision and slot log have done their work (as after
                # a tpc_commit that was answered)
                aux.execute(_Q["tpc_undecide"], (gid,))
                aux.execute(_Q["tpc_forget"], (gid,))
                return committed
        except (psycopg.Error, RingqError) as err:
            logger.warning("ringq: could not tell from the rows what became of %s: %s",
                           gid, one_line(str(err)))
            return None
