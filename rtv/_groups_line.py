"""The line a grouped queue shows below its row, in the page, the terminal
view and ``ringq status``::

    groups: 2 ready, 1 busy, oldest waiting 3.2 s, 5 skips

(``skips``: ready entries a claim passed over because their group had an
entry held, since the queue was loaded.) A queue without groups has no line:
its sample carries no group figures, and no table grows a column for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringq.engine import is_finite_number
from ringq.engine import metrics as M


def groups_line(queue: Mapping[str, Any]) -> str | None:
    """The line for ``queue`` (a queue of ``/api/queues``, raw or normalized),
    None when it has no group figures."""
    if all(queue.get(k) is None for k in M.GROUP_KEYS):
        return None
    age = _number(queue.get(M.GROUP_OLDEST_AGE_S))
    return (
        f"groups: {_count(queue.get(M.GROUPS_READY))} ready, "
        f"{_count(queue.get(M.GROUPS_BUSY))} busy, "
        f"oldest waiting {'?' if age is None else _age(age)}, "
        f"{_count(queue.get(M.GROUP_SKIPS))} skips"
    )


def _number(v: object) -> float | None:
    if not is_finite_number(v):
        return None
    return float(v)


def _count(v: object) -> str:
    n = _number(v)
    return "?" if n is None else f"{int(n):,}"


def _age(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s) // 60} min {int(s) % 60:02d} s"
    return f"{int(s) // 3600} h {(int(s) % 3600) // 60:02d} min"
