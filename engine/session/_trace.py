"""The trace of queue operations: one line per call, on the ``ringq.trace`` logger.

Each traced call of a session (enqueue, dequeue, commit, rollback, flush,
two-phase prepare, commit and rollback) logs, once it returned or raised::

    commit session=<token> pid=<backend> queue=mq n=2 slots=7..8 seqs=107..108 enq=2 deq=0
        rt=1 us=212

its client token (the OWNER word of the slots it locks, renewed on a
reconnect), its PostgreSQL backend pid, each queue's slots and sequences
(runs as ``a..b``), for a dequeue how many came from the payload cache
(``cache=hits/n``), the database round trips it made and the time it took
(µs); ``error=<class>`` if it raised. Recovery logs each decision on the same
logger; the switch and the output are the logger's (``rows/_tracelog.py``).

Why the switch is read when a session opens, not per call: the logging
module has no hook for a level change, and a check on every call is what
this must not cost. So a session opened while tracing gets traced methods in
its own ``__dict__`` (shadowing the class's; no reference cycle: they hold
the session weakly), and any other session runs the class's methods
untouched: off, the hot path pays nothing at all, not even a flag read. A
session opened before the logger was enabled stays untraced.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ..ring import Item, Op, OpKind, each_op
from ..rows.tracelog import log, runs
from ._link import Link

# The Session calls traced: those that take slots, and those that end them.
TAKE = ("enqueue", "enqueue_many", "dequeue", "dequeue_many")
END = ("commit", "rollback", "tpc_commit", "tpc_rollback")
SEND = ("flush", "tpc_prepare")  # send the held row writes, end nothing
TRACED = (*TAKE, *END, *SEND, "commit_and_dequeue")


class Traceable(Protocol):
    """What a traced call reads of its session: the Session (which imports
    this module to trace itself, so it is named here by what it offers)."""

    _link: Link

    @property
    def closed(self) -> bool: ...


# -- the traced calls -------------------------------------------------------------------


def attach(session: Traceable) -> None:
    """Give ``session`` traced versions of its :data:`TRACED` calls."""
    ref = weakref.ref(session)
    cls = type(session)
    depth = [0]  # nested traced calls (dequeue -> dequeue_many) log once, as the outer
    for name in TRACED:
        session.__dict__[name] = _Traced(ref, getattr(cls, name), name, depth)


class _Traced:
    """One traced call of one session: runs the class's method and logs a line."""

    __slots__ = ("depth", "fn", "name", "ref")

    def __init__(
        self, ref: weakref.ref[Traceable], fn: Callable[..., Any], name: str, depth: list[int]
    ) -> None:
        self.ref, self.fn, self.name, self.depth = ref, fn, name, depth

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        session = self.ref()
        if session is None or self.depth[0] or session.closed:
            return self.fn(session, *args, **kwargs)
        link: Link = session._link
        before = link.ops
        n0 = len(before)
        name = self.name
        # the ops a line tells of: the held writes a flush sends, the ops a
        # commit or rollback ends (a copy: a rollback may empty the list in place)
        held = (
            before if name in TAKE
            else [op for op in before if op.held] if name in SEND
            else list(before)
        )
        rt0, pid, owner = link.round_trips, link.backend_pid, link.owner
        error = ""
        self.depth[0] += 1
        t0 = time.perf_counter_ns()
        try:
            return self.fn(session, *args, **kwargs)
        except BaseException as exc:
            error = " error=" + type(exc).__name__
            raise
        finally:
            us = (time.perf_counter_ns() - t0) // 1000
            self.depth[0] -= 1
            if log.isEnabledFor(logging.DEBUG):
                now = session._link
                rt = now.round_trips - rt0 if now is link else now.round_trips
                queue = args[0] if args else kwargs.get("queue")
                log.debug(
                    "%s session=%d pid=%d %s rt=%d us=%d%s",
                    name, owner, pid,
                    # made now: the ops change on (a commit clears ``consume``), and a
                    # handler may format the record later
                    str(_Line(name, queue, before, n0, held, now.ops)), rt, us, error,
                )


class _Line:
    """The slots part of a trace line (made only while the logger is enabled)."""

    __slots__ = ("after", "before", "held", "n0", "name", "queue")

    def __init__(
        self, name: str, queue: str | None, before: list[Item], n0: int, held: list[Item],
        after: list[Item],
    ) -> None:
        self.name, self.queue, self.before, self.n0 = name, queue, before, n0
        self.held, self.after = held, after

    def taken(self) -> list[Item]:
        """The ops the call added to the link's (appended, or on a new list)."""
        if self.after is self.before:
            return self.after[self.n0:]
        mine = {id(op) for op in self.before[: self.n0]}
        return [op for op in self.after if id(op) not in mine]

    def __str__(self) -> str:
        name = self.name
        if name in TAKE:
            return ops_text(self.taken(), self.queue, cache=name.startswith("dequeue"))
        if name == "commit_and_dequeue":
            return (ops_text(self.held, None, kinds=True) + " then "
                    + ops_text(self.taken(), self.queue, cache=True))
        return ops_text(self.held, None, kinds=name in END)


def ops_text(
    items: Sequence[Item], queue: str | None, *, cache: bool = False, kinds: bool = False
) -> str:
    """``queue=Q n=N slots=.. seqs=..`` per queue (in order of first use),
    with ``cache=hits/N`` (a dequeue: served from the payload cache) or
    ``enq=E deq=D``; ``queue=Q n=0`` (or ``n=0``) if there are none."""
    ops = each_op(items)
    if not ops:
        return f"queue={queue} n=0" if queue else "n=0"
    by_queue: dict[str, list[Op]] = {}
    for op in ops:
        by_queue.setdefault(op.info.name, []).append(op)
    parts = []
    for name, group in by_queue.items():
        text = (f"queue={name} n={len(group)} slots={runs(op.slot for op in group)} "
                f"seqs={runs(op.seq for op in group)}")
        if cache:
            text += f" cache={sum(1 for op in group if op.consume)}/{len(group)}"
        if kinds:
            enq = sum(1 for op in group if op.kind == OpKind.ENQUEUE)
            text += f" enq={enq} deq={len(group) - enq}"
        parts.append(text)
    return " ".join(parts)
