"""The xmin horizon: who holds it back, and the vacuum of the rings after.

An open snapshot anywhere in the database (a long report, a REPEATABLE READ
transaction, a session idle in transaction after a write, a forgotten
prepared transaction) stops pruning: every enqueue and dequeue then leaves a
dead row version, and a fixed-size ring table grows. The monitor reads the
holders every interval (:func:`read_holders`); :class:`HorizonWatch`
turns those readings into news: *held* once a holder is older than the
threshold (named: pid, application, user, state, transaction start), and
*released* once none is. After a release the rings that gained dead rows
while it was held are vacuumed (:func:`vacuum_rings`), so that their space is
reused instead of the tables growing on. :class:`HorizonReport` is the
monitor's part of it (in step ``database``): it logs and publishes the news,
and runs that vacuum in a thread of its own.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql
from ringq.engine import queue_table

from . import _events as E
from . import _queries as Qy
from ._db import connect_step
from ._link import Link
from ._step import Note, Settings


@dataclass(frozen=True)
class Holder:
    """What holds back the xmin horizon: a backend or a prepared transaction.

    ``xact_start``/``query_start`` are unix seconds (a prepared transaction's
    ``xact_start`` is its PREPARE); ``age_s`` counts from ``xact_start``;
    ``xid_age`` is the age in transaction ids of its snapshot or transaction id.
    The query text is never read: it may hold secrets.
    """

    kind: str  # "backend" or "prepared"
    pid: int | None
    application: str | None
    user: str | None
    state: str | None
    xact_start: float | None
    query_start: float | None
    age_s: float
    xid_age: int | None
    gid: str | None

    @property
    def key(self) -> tuple[str, int | None, float | None, str | None]:
        """Names one holding: the same backend in a later transaction is another."""
        return (self.kind, self.pid, self.xact_start, self.gid)

    def as_dict(self) -> dict[str, Any]:
        """The fields in their order, the times rounded to the millisecond."""
        return asdict(self) | {
            "xact_start": None if self.xact_start is None else round(self.xact_start, 3),
            "query_start": None if self.query_start is None else round(self.query_start, 3),
            "age_s": round(self.age_s, 3),
        }


def read_holders(conn: psycopg.Connection[Any]) -> list[Holder]:
    """The transactions holding back this database's xmin horizon, oldest first."""
    out = []
    for kind, pid, app, user, state, xact_start, query_start, age_s, xid_age, gid in conn.execute(
        Qy.XMIN_HOLDERS
    ).fetchall():
        out.append(Holder(
            kind=str(kind),
            pid=None if pid is None else int(pid),
            application=app or None,
            user=user,
            state=state,
            xact_start=None if xact_start is None else float(xact_start),
            query_start=None if query_start is None else float(query_start),
            age_s=float(age_s or 0.0),
            xid_age=None if xid_age is None else int(xid_age),
            gid=gid,
        ))
    return out


@dataclass
class HorizonNews:
    """A change the monitor tells: ``held`` (``holder`` past the threshold) or
    ``released`` (``holder`` was the last one warned about; ``dead_rows``: the
    most dead rows each ring had while it was held)."""

    what: str
    holder: Holder
    held_s: float = 0.0
    dead_rows: dict[str, int] = field(default_factory=dict)


class HorizonWatch:
    """Turns each interval's holders into news, once per holding.

    A holder's age counts from its transaction's start, but not from before
    this monitor first saw that transaction hold the horizon (after the
    monitor's first reading): a transaction opened long ago that only now
    took a snapshot or a transaction id (a session idle in transaction since
    its BEGIN) holds the horizon since now, not since its BEGIN.
    """

    def __init__(self) -> None:
        self.warned: Holder | None = None  # the holder last warned about, while held
        self.oldest: Holder | None = None  # the oldest holder of the latest reading
        self._first_seen: (
            dict[tuple[str, int | None, float | None, str | None], float] | None
        ) = None
        self._since = 0.0  # monotonic: when the horizon was first held past the threshold
        self._dead: dict[str, int] = {}

    @property
    def held(self) -> bool:
        return self.warned is not None

    def _age(self, holders: list[Holder]) -> Holder | None:
        now = time.monotonic()
        first = self._first_seen is None
        seen = self._first_seen or {}
        kept = {}
        oldest = None
        for h in holders:
            trust = first or h.kind == "prepared"  # a PREPARE's time is when it began to hold
            since = seen.get(h.key, now - h.age_s if trust else now)
            kept[h.key] = since
            aged = replace(h, age_s=min(h.age_s, now - since))
            if oldest is None or aged.age_s > oldest.age_s:
                oldest = aged
        self._first_seen = kept
        return oldest

    def update(
        self, holders: list[Holder], dead_rows: dict[str, int], warn_s: float
    ) -> HorizonNews | None:
        """Take this interval's ``holders`` and each ring's dead rows; returns news, if any."""
        oldest = self.oldest = self._age(holders)
        if oldest is not None and oldest.age_s >= warn_s:
            if self.warned is None:
                self._since = time.monotonic() - oldest.age_s
                self._dead = {}
            self._note_dead(dead_rows)
            news = (
                None
                if self.warned is not None and oldest.key == self.warned.key
                else HorizonNews("held", oldest)
            )
            self.warned = oldest
            return news
        if self.warned is None:
            return None
        last, self.warned = self.warned, None
        self._note_dead(dead_rows)
        return HorizonNews(
            "released", last, held_s=time.monotonic() - self._since, dead_rows=dict(self._dead)
        )

    def _note_dead(self, dead_rows: dict[str, int]) -> None:
        for name, n in dead_rows.items():
            self._dead[name] = max(n, self._dead.get(name, 0))


def vacuum_rings(conn: psycopg.Connection[Any], queues: list[str]) -> list[dict[str, Any]]:
    """``VACUUM`` the ring tables of ``queues`` on ``conn``, which must be in
    autocommit (VACUUM runs outside any transaction): their dead row versions
    go, and the space is reused. Returns, per queue, its table's size before
    and after (bytes), the dead rows the statistics counted before, and the
    seconds spent. A queue dropped meanwhile is passed over.

    :raises psycopg.Error: the caller converts it.
    """
    done = []
    for name in queues:
        row = conn.execute(Qy.RING_STORAGE, (f"ringq.q_{name}",)).fetchone()
        if row is None:
            continue
        t0 = time.perf_counter()
        conn.execute(sql.SQL("VACUUM {}").format(queue_table(name)))
        seconds = time.perf_counter() - t0
        after = conn.execute(Qy.RING_STORAGE, (f"ringq.q_{name}",)).fetchone()
        done.append({
            "queue": name,
            "bytes_before": int(row[0]),
            "bytes_after": int(after[0]) if after else None,
            "dead_rows_before": int(row[1]),
            "seconds": round(seconds, 3),
        })
    return done


class HorizonReport:
    """Warns of a held snapshot; after its release, vacuums the rings it bloated.

    Part of step ``database``: ``update`` takes that step's connection and its
    dead-row counts. The vacuum runs in a thread (VACUUM of a bloated ring may
    take a while: not in the loop that recovers clients), one at a time.
    """

    def __init__(self, link: Link, settings: Settings, note: Note) -> None:
        self._link = link
        self._settings = settings
        self._note = note
        self.watch = HorizonWatch()
        self.xmin_age = 0.0  # seconds, of the oldest holder (0 without one)
        self.vacuums = 0  # ring tables vacuumed after a held snapshot was released
        self._thread: threading.Thread | None = None

    def update(self, conn: psycopg.Connection[Any], dead_rows: dict[str, int]) -> None:
        news = self.watch.update(read_holders(conn), dead_rows, self._settings().xmin_warn_s)
        oldest = self.watch.oldest
        self.xmin_age = oldest.age_s if oldest is not None else 0.0
        if news is not None:
            self._tell(news)

    def join(self, timeout: float | None) -> None:
        """Wait for a vacuum under way (its record goes to the journal before it closes)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _tell(self, news: HorizonNews) -> None:
        cfg = self._settings()
        if news.what == "held":
            fields = {
                **news.holder.as_dict(), "threshold_s": cfg.xmin_warn_s,
                "reason": "holds back the xmin horizon: every ring update leaves a dead row,"
                " rings grow",
            }
            self._note("database.snapshot_held", logging.WARNING, **fields)
            self._link.publish(E.make_event(E.SNAPSHOT_HELD, None, **fields))
            return
        bloated = sorted(q for q, n in news.dead_rows.items() if n >= cfg.vacuum_dead_rows)
        if self._thread is not None and self._thread.is_alive():
            self._note("database.snapshot_released", held_s=round(news.held_s, 3),
                       pid=news.holder.pid, vacuumed=[], skipped=bloated,
                       reason="a vacuum is still running")
            return
        self._thread = threading.Thread(
            target=self._vacuum_after_release, args=(news, bloated),
            name="ringq-monitor-vacuum", daemon=True,
        )
        self._thread.start()

    def _vacuum_after_release(self, news: HorizonNews, queues: list[str]) -> None:
        try:
            with connect_step(self._settings().dsn) as conn:
                done = vacuum_rings(conn, queues)
                self.vacuums += len(done)
                fields: dict[str, Any] = {
                    "held_s": round(news.held_s, 3), "pid": news.holder.pid,
                    "kind": news.holder.kind, "application": news.holder.application,
                    "vacuumed": done,
                }
                self._note("database.snapshot_released", logging.INFO, **fields)
                E.publish(conn, E.make_event(E.SNAPSHOT_RELEASED, None, **fields))
        except Exception as exc:
            self._note("step.failed", logging.WARNING, step="vacuum",
                       error=f"{type(exc).__name__}: {exc}", queues=queues)
