"""The SQL inbox pump: entries enqueued through ``ringq.enqueue()`` (SQL
functions, for clients that cannot link the library) wait in ``ringq.inbox``
until a linked client moves them into their ring, in order: ring slots are
reserved only through the section. An entry's due time (``not_before``)
moves with it: it is due in the ring when it was due in the inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from ringq.engine import QueueFull, RingqError, Session, check_group, connect
from ringq.engine.recovery import queue_room

from . import _queries as Qy
from ._db import connect_step

logger = logging.getLogger("ringq.monitor")


def _refuse_bad(
    conn: Any, qid: int, name: str, max_payload: int, rows: list[Any]
) -> list[Any]:
    """The ``rows`` (id, payload, producer, group, due) the library takes; the
    others (put into the inbox by hand, around ``ringq.enqueue()``, which
    checks the same) go to ``ringq.exceptions`` with the reason, in the
    pump's transaction, so they never stop the entries behind them."""
    good = []
    for row in rows:
        inbox_id, payload, producer, group, _due = row
        why = None
        if len(payload) > max_payload:
            why = f"payload of {len(payload):,} bytes exceeds max_payload {max_payload:,}"
        else:
            try:
                check_group(group)
            except RingqError as exc:
                why = str(exc)
        if why is None:
            good.append(row)
            continue
        reason = f"refused from the SQL inbox (id {inbox_id}): {why}"
        conn.execute(Qy.INBOX_REFUSE, {"queue_id": qid, "id": inbox_id, "payload": payload,
                                       "producer": producer, "group": group, "reason": reason})
        logger.warning("ringq monitor: queue %s: %s", name, reason)
    return good


def pump_inbox(
    dsn: str,
    *,
    batch: int = 500,
    skip: Collection[str] = (),
    full: dict[str, int] | None = None,
    session: Session | None = None,
) -> dict[str, int]:
    """Move entries enqueued through ``ringq.enqueue()`` into their rings, in inbox order;
    returns {queue: entries moved}. ``session``: a linked session kept by the
    caller (the monitor's pump keeps one: opening two connections per pump was
    most of an SQL enqueue's way to its consumer), else one made for the call.

    One pumper per queue at a time (advisory lock); each batch moves in one
    transaction, so an entry is in the inbox or in the ring, never both.

    Never waits for space: a batch takes at most the ring's free slots and
    enqueues with ``timeout=0``. A queue that is full while entries still wait
    for it keeps them in the inbox (its batch rolled back, nothing lost), is
    added to ``full`` ({name: queue id}) and is left for a later call; the
    other queues go on. Queues named in ``skip`` are not looked at.
    """
    if session is None:
        with connect_step(dsn) as conn:  # no session (a client entry) when nothing waits
            pending = conn.execute(Qy.INBOX_PENDING, (list(skip),)).fetchall()
        if not pending:
            return {}
        with connect(dsn) as s:
            return _pump(s, pending, batch, full)
    pending = session.connection.execute(Qy.INBOX_PENDING, (list(skip),)).fetchall()
    if not pending:
        session.rollback()
        return {}
    # The first queue's move goes on in the transaction this read opened (a
    # round trip less on an SQL enqueue's way to its consumer).
    return _pump(session, pending, batch, full)


def _pump(
    s: Session, pending: list[Any], batch: int, full: dict[str, int] | None
) -> dict[str, int]:
    """Move the ``pending`` queues' inbox entries (name, queue id) with ``s``."""
    moved: dict[str, int] = {}
    sec = s.section  # the process's attachment: the ring enqueue_many reserves in
    for name, qid in pending:
        total = 0
        while True:
            c = s.connection
            got = c.execute(Qy.INBOX_LOCK, (qid,)).fetchone()
            if not got or not got[0]:
                s.rollback()
                break
            room = queue_room(sec, qid)  # None: not loaded yet, enqueue_many loads it
            limit = batch if room is None else min(batch, room)
            if limit <= 0:
                waiting = c.execute(Qy.INBOX_WAITING, (qid,))
                row = waiting.fetchone()
                s.rollback()
                if full is not None and row and row[0]:
                    full[name] = qid
                break
            rows = c.execute(Qy.INBOX_BATCH, (qid, limit)).fetchall()
            if not rows:
                s.rollback()
                break
            rows.sort(key=lambda r: r[0])
            rows = _refuse_bad(c, qid, name, s.queue_info(name).max_payload, rows)
            try:
                i = 0
                while i < len(rows):
                    # A run: one producer and one due time (enqueue_many takes
                    # one not_before for the batch), in inbox order.
                    j = i
                    run = (rows[i][2], rows[i][4])
                    while j < len(rows) and (rows[j][2], rows[j][4]) == run:
                        j += 1
                    s.producer = rows[i][2]
                    # Producer sequences follow the inbox ids (first id of the
                    # run, then +1 each): they rise for a producer across
                    # passes and pump sessions, where the session's own
                    # counter would start again at 1 on every pass.
                    s.producer_seq = rows[i][0] - 1
                    # timeout=0: the monitor's loop must never sleep on a full queue.
                    s.enqueue_many(
                        name,
                        [bytes(r[1]) for r in rows[i:j]],
                        group=[r[3] for r in rows[i:j]],
                        timeout=0,
                        not_before=rows[i][4],  # None: due at once
                    )
                    i = j
            except QueueFull:
                # Space went between the look and the reservation (another
                # producer): the rows go back to the inbox with the rollback.
                s.rollback()
                if full is not None:
                    full[name] = qid
                break
            s.commit()
            total += len(rows)
            if len(rows) < limit:
                break
        if total:
            moved[name] = total
    return moved
