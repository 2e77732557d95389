"""The volume part of ``bench_engine.py``: a table's size after many entries went through it.

:func:`volume` passes entries through a contender (a ``_contenders`` driver),
a batch each way per step, and reads the table's sizes
(``pg_total_relation_size`` and its parts) and ``pg_stat_user_tables``
counters before, after the ring's first wrap and at the end.
"""

from __future__ import annotations

import sys
import time
from contextlib import AbstractContextManager
from typing import Any

import psycopg
from _contenders import Driver

SIZES = """
SELECT pg_relation_size(c.oid),
       COALESCE(pg_total_relation_size(NULLIF(c.reltoastrelid, 0)), 0),
       pg_indexes_size(c.oid),
       pg_total_relation_size(c.oid)
FROM pg_class c WHERE c.oid = %s::regclass
"""
TABLE_STATS = """
SELECT n_live_tup, n_dead_tup, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del,
       autovacuum_count, vacuum_count
FROM pg_stat_user_tables WHERE relid = %s::regclass
"""


def table_sizes(conn: psycopg.Connection[Any], table: str) -> dict[str, int]:
    row = conn.execute(SIZES, (table,)).fetchone()
    assert row is not None
    heap, toast, indexes, total = row
    st = conn.execute(TABLE_STATS, (table,)).fetchone()
    keys = ("n_live_tup", "n_dead_tup", "n_tup_ins", "n_tup_upd", "n_tup_hot_upd", "n_tup_del",
            "autovacuum_count", "vacuum_count")  # fmt: skip
    stats = dict(zip(keys, st, strict=True)) if st else {}
    return {"heap": heap, "toast": toast, "indexes": indexes, "total": total, **stats}


class Progress:
    """One status line on a terminal (rewritten), a line every 10% otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total = label, total
        self.tty = sys.stderr.isatty()
        self.start = time.perf_counter()
        self.last_tenth = -1
        self.last_draw = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        rate = done / max(now - self.start, 1e-9)
        text = (
            f"  {self.label}: {done:,}/{self.total:,} ({100 * done / self.total:3.0f}%) "
            f"{rate:,.0f} entries/s"
        )
        if self.tty:
            if now - self.last_draw > 0.25 or done == self.total:
                sys.stderr.write("\r" + text + "   ")
                sys.stderr.flush()
                self.last_draw = now
        else:
            tenth = 10 * done // self.total
            if tenth != self.last_tenth:
                self.last_tenth = tenth
                print(text, file=sys.stderr, flush=True)

    def done(self) -> float:
        if self.tty:
            sys.stderr.write("\n")
        return time.perf_counter() - self.start


def settled_sizes(
    conn: psycopg.Connection[Any], table: str, before: dict[str, int]
) -> dict[str, int]:
    """Sizes and statistics once the closed sessions' backends have flushed their counters
    (they do at exit; until then pg_stat_user_tables lags): counters steady for 0.5 s, at most
    10 s."""
    deadline = time.monotonic() + 10.0
    last = table_sizes(conn, table)
    steady_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = table_sizes(conn, table)
        if now != last:
            last, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since >= 0.5 and now.get("n_tup_ins", 0) + now.get(
            "n_tup_upd", 0
        ) > before.get("n_tup_ins", 0) + before.get("n_tup_upd", 0):
            break
    return last


def volume(
    dsn: str,
    driver: AbstractContextManager[Driver],
    table: str,
    label: str,
    entries: int,
    batch: int,
    wrap_at: int,
) -> dict[str, Any]:
    """``entries`` through the ``driver``'s contender (opened here), ``batch`` per transaction
    each way; the sizes of ``table`` before, after ``wrap_at`` entries (a ring's first wrap:
    every row has held a payload) and after, once the closed connections' statistics arrived."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        before = table_sizes(admin, table)
        wrap: dict[str, int] | None = None
        with driver as d:
            prog = Progress(f"{label} volume", entries)
            done = 0
            while done < entries:
                n = min(batch, entries - done)
                d.enqueue_batch(n)
                got = d.dequeue_batch(n)
                if got != n:
                    raise RuntimeError(f"{d.label} volume: dequeued {got} of {n}")
                if done < wrap_at <= done + n:
                    wrap = table_sizes(admin, table)
                done += n
                prog.update(done)
            elapsed = prog.done()
        after = settled_sizes(admin, table, before)
    return _volume_result(before, wrap, after, entries, elapsed)


def _volume_result(
    before: dict[str, int],
    wrap: dict[str, int] | None,
    after: dict[str, int],
    volume: int,
    elapsed: float,
) -> dict[str, Any]:
    def growth(a: dict[str, int] | None, b: dict[str, int]) -> float | None:
        return (b["total"] - a["total"]) / a["total"] if a and a["total"] else None

    return {
        "entries": volume,
        "seconds": elapsed,
        "entries_per_s_each_way": volume / elapsed,
        "before": before,
        "after_first_wrap": wrap,
        "after": after,
        "growth": growth(before, after),
        "growth_after_first_wrap": growth(wrap, after),
    }
