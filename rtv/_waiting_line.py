"""The line a queue with entries waiting for their due time shows below its
row, in the page, the terminal view and ``ringq status`` (issue 24)::

    waiting: 12 entries, next due in 3.2 s

An entry waits when it was enqueued with a delay (or ``not_before``), or
given back with a retry backoff: it is committed (depth counts it) but no
consumer receives it before its time. ``next due now``: the earliest one's
time came, and the next claim releases it. A queue with none waiting has no
line, and no table grows a column for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringq.engine import metrics as M

from ._groups_line import _age, _count, _number


def waiting_line(queue: Mapping[str, Any]) -> str | None:
    """The line for ``queue`` (a queue of ``/api/queues``, raw or normalized),
    None when no entry of it waits (or the monitor does not say)."""
    n = _number(queue.get(M.WAITING_ENTRIES))
    if not n:
        return None
    due = _number(queue.get(M.NEXT_DUE_S))
    when = "?" if due is None else "now" if due <= 0 else f"in {_age(due)}"
    noun = "entry" if n == 1 else "entries"
    return f"waiting: {_count(n)} {noun}, next due {when}"
