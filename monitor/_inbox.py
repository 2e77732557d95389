"""The SQL inbox pump: entries enqueued through ``ringq.enqueue()`` (SQL
functions, for clients that cannot link the library) wait in ``ringq.inbox``
until a linked client moves them into their ring, in order: ring slots are
reserved only through the section.
"""

from __future__ import annotations

from collections.abc import Collection

from ringq.engine import QueueFull, connect
from ringq.engine.recovery import queue_room

from . import _queries as Qy
from ._db import connect_step


def pump_inbox(
    dsn: str,
    *,
    batch: int = 500,
    skip: Collection[str] = (),
    full: dict[str, int] | None = None,
) -> dict[str, int]:
    """Move entries enqueued through ``ringq.enqueue()`` into their rings, in inbox order;
    returns {queue: entries moved}.

    One pumper per queue at a time (advisory lock); each batch moves in one
    transaction, so an entry is in the inbox or in the ring, never both.

    Never waits for space: a batch takes at most the ring's free slots and
    enqueues with ``timeout=0``. A queue that is full while entries still wait
    for it keeps them in the inbox (its batch rolled back, nothing lost), is
    added to ``full`` ({name: queue id}) and is left for a later call; the
    other queues go on. Queues named in ``skip`` are not looked at.
    """
    moved: dict[str, int] = {}
    with connect_step(dsn) as conn:
        pending = conn.execute(Qy.INBOX_PENDING, (list(skip),)).fetchall()
    if not pending:
        return moved
    with connect(dsn) as s:
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
                try:
                    i = 0
                    while i < len(rows):
                        j = i
                        while j < len(rows) and rows[j][2] == rows[i][2]:
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
