"""The SQL inbox pump: entries enqueued through ``ringq.enqueue()`` (SQL
functions, for clients that cannot link the library) wait in ``ringq.inbox``
until a linked client moves them into their ring, in order: ring slots are
reserved only through the section. An entry's due time (``not_before``)
moves with it: it is due in the ring when it was due in the inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

from ringq.engine import QueueFull, RingqError, Section, Session, check_group, connect
from ringq.engine import layout as L
from ringq.engine.recovery import queue_room
from ringq.engine.sqlpath import BehindSqlPuts, reserved_for_sql

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
    published: dict[int, tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Move entries enqueued through ``ringq.enqueue()`` into their rings, in inbox order;
    returns {queue: entries moved}. ``session``: a linked session kept by the
    caller (the monitor's pump keeps one: opening two connections per pump was
    most of an SQL enqueue's way to its consumer), else one made for the call.

    One pumper per queue at a time (an advisory lock its batch's statement
    takes); each batch moves in one transaction, so an entry is in the inbox
    or in the ring, never both.

    Never waits for space: a batch takes at most the ring's free slots and
    enqueues with ``timeout=0``. A queue that is full while entries still wait
    for it keeps them in the inbox (its batch rolled back, nothing lost), is
    added to ``full`` ({name: queue id}) and is left for a later call; the
    other queues go on. Queues named in ``skip`` are not looked at.

    At the end of a pass it publishes, for the queues loaded in the section,
    the ring's free slots in ``ringq.room`` (what ringq.enqueue()'s room check
    reads; only those that changed since ``published``, {queue id: (free,
    waiting)},
    which the caller keeps between passes, else all) and the inbox's entries
    waiting in the section's ``Q_INBOX`` (what ``Session.stats()`` adds to
    the depth): 0 for all when the pass drained the inbox, else counted.
    """
    if session is None:
        with connect_step(dsn) as conn:  # no session (a client entry) when nothing waits
            pending = conn.execute(Qy.INBOX_PENDING, (list(skip),)).fetchall()
            # (room freed since the last pass is published even with nothing to move)
            short = pending or conn.execute(Qy.ROOM_SHORT).fetchone() == (True,)
        if not short:
            return {}
        with connect(dsn) as s:
            return _pump(s, batch, skip, full, published)
    return _pump(session, batch, skip, full, published)


def _pump(
    s: Session, batch: int, skip: Collection[str], full: dict[str, int] | None,
    published: dict[int, tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Move the inbox's entries with ``s``, a batch a transaction: each
    batch's statement finds its queue, locks it and takes the entries
    (``inbox_next``: the first statement of the transaction, so that an SQL
    enqueue's way to its consumer is that round trip and the commit's)."""
    moved: dict[str, int] = {}
    s.behind_sql_puts = True  # (checked again at each reservation, under the queue's lock)
    sec = s.section  # the process's attachment: the ring enqueue_many reserves in
    passed = set(skip)  # and the queues done with (drained, or full)
    closed: list[int] = []
    drained = False  # the pass ended with no entry waiting for any queue
    # Queues with slots reserved for SQL producers: their inbox entries wait
    # (the agent takes the slots back while they do; moved now, they would
    # get seqs past chunks a producer's later puts may still fill).
    held_back = {sec.queue_name(qidx) for qidx in sec.loaded_queues()
                 if reserved_for_sql(sec, qidx)}
    passed |= held_back
    while True:
        # None: dropped since (not loaded): a whole batch, enqueue_many loads it
        rooms = {qid: room for qid in _loaded(sec) if (room := queue_room(sec, qid)) is not None}
        closed = [qid for qid, room in rooms.items() if room <= 0]
        rows = s.execute(Qy.INBOX_NEXT, {  # its BEGIN in the same message, its plan kept
            "batch": batch, "skip": _text_array(sorted(passed)),
            "ids": _int_array(rooms), "rooms": _int_array(rooms.values()),
        }, prepare=True).fetchall()
        if not rows:
            # Nothing was taken: ended with a COMMIT, not a ROLLBACK, after
            # which psycopg forgets every statement it prepared on the
            # connection (this one is planned again five times after each).
            s.commit()
            break
        qid, name, limit, others = (int(rows[0][0]), str(rows[0][1]), int(rows[0][2]),
                                    int(rows[0][3]))
        entries = sorted((r[4:] for r in rows), key=lambda r: r[0])
        entries = _refuse_bad(s.connection, qid, name, s.queue_info(name).max_payload, entries)
        try:
            _move(s, name, entries)
        except BehindSqlPuts:
            # The agent reserved slots for SQL producers since the pass
            # began: the rows go back to the inbox, held back as above.
            s.rollback()
            held_back.add(name)
            passed.add(name)
            continue
        except QueueFull:
            # Space went between the look and the reservation (another
            # producer): the rows go back to the inbox with the rollback.
            s.rollback()
            if full is not None:
                full[name] = qid
            passed.add(name)
            continue
        s.commit()
        moved[name] = moved.get(name, 0) + len(entries)  # those refused are not moved
        if len(rows) < limit:
            if not others:
                closed = []  # none of them has entries waiting either
                drained = not skip and not held_back  # (a queue skipped may still have some)
                break  # drained, and no other queue had entries: done
            passed.add(name)  # drained: the next statement looks at the others
    if full is not None and closed:
        # Queues with no room now: those with entries waiting are full.
        for name, qid in s.connection.execute(
            Qy.INBOX_FULL, {"ids": _int_array(closed), "skip": _text_array(sorted(passed))}
        ).fetchall():
            full[name] = qid
        s.commit()  # a read only (see above)
    _publish(s, sec, drained, published)
    return moved


def _publish(
    s: Session, sec: Section, drained: bool, published: dict[int, tuple[int, int]] | None
) -> None:
    """After a pass: the inbox's entries waiting for the queues loaded in
    ``sec`` (0 for all when the pass ``drained`` the inbox, else one count
    of the inbox's rows for them: few, since ringq.enqueue() lets in only
    what the room holds) into their blocks' ``Q_INBOX``; and into
    ``ringq.room`` their free slots with those waiting and the inbox's
    highest id now (for the queues whose figures changed since
    ``published``, which is brought up to date; a queue with entries waiting
    always: the highest id moves)."""
    blocks = {int(sec.q(qidx, L.Q_QID)): qidx for qidx in sec.loaded_queues()}
    frees = {qid: room for qid in blocks if (room := queue_room(sec, qid)) is not None}
    waiting: dict[int, int] = {}
    if not drained and blocks:
        waiting = {int(qid): int(n) for qid, n in s.connection.execute(
            Qy.INBOX_COUNTS, {"ids": _int_array(blocks)}).fetchall()}
    changed = {qid: room for qid, room in frees.items()
               if published is None or waiting.get(qid)
               or published.get(qid) != (room, waiting.get(qid, 0))}
    if changed:
        s.connection.execute(Qy.ROOM_PUBLISH, {
            "ids": _int_array(changed), "frees": _int_array(changed.values()),
            "waiting": _int_array(waiting.get(qid, 0) for qid in changed)})
    if changed or not drained:
        s.commit()
    if published is not None:
        published.update({qid: (room, waiting.get(qid, 0)) for qid, room in changed.items()})
        for qid in [q for q in published if q not in frees]:
            del published[qid]
    for qid, qidx in blocks.items():
        sec.set_inbox(qidx, waiting.get(qid, 0))


def _int_array(values: Iterable[int]) -> str:
    """An integer[] literal: psycopg's list dumper costs more client CPU than
    the statement it rides in (the pump's, on an SQL enqueue's way)."""
    return "{" + ",".join(str(int(v)) for v in values) + "}"


def _text_array(values: Iterable[str]) -> str:
    """A text[] literal, every element quoted (names given to pump_inbox may be any text)."""
    return "{" + ",".join(
        '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values
    ) + "}"


def _loaded(sec: Section) -> list[int]:
    """The ids of the queues loaded in the section."""
    return [int(sec.q(qidx, L.Q_QID)) for qidx in sec.loaded_queues()]


def _move(s: Session, name: str, rows: list[Any]) -> None:
    """Enqueue inbox ``rows`` (id, payload, producer, group, due) in their
    order, in ``s``'s transaction. :raises QueueFull: no room for them now."""
    i = 0
    while i < len(rows):
        # A run: one producer and one due time (enqueue_many takes one
        # not_before for the batch), in inbox order.
        j = i
        run = (rows[i][2], rows[i][4])
        while j < len(rows) and (rows[j][2], rows[j][4]) == run:
            j += 1
        s.producer = rows[i][2]
        # Producer sequences follow the inbox ids (first id of the run, then +1
        # each): they rise for a producer across passes and pump sessions,
        # where the session's own counter would start again at 1 on every pass.
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
