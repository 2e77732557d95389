"""A run in the database: its schema, its queues, its cycles.

A run is created once (schema ``regress_<run id>``, one ringq queue per
payload size and, with ``grouped_consumers``, the grouped queue) and kept
after it ends, so that ``ringq regress verify RUN`` can prove it again; its
queues are dropped when the run ends (the evidence is in the schema, not in
the rings).
"""

from __future__ import annotations

import json
import secrets
import socket
import time
from contextlib import AbstractContextManager, suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from ringq import __version__
from ringq.engine import QueueNotFound, RingqError, pg, queue_table
from ringq.scripting import QueueSpec, create_queue, drop_queue

from . import _queries as S
from ._config import RegressConfig, validate_run_id


class RunNotFound(RingqError):
    """No regression run of that id is stored in the database."""


@dataclass(frozen=True)
class QueueRef:
    """One queue of a run: its index in payload headers, its ringq name, its payload size
    (bytes); ``grouped``: the grouped queue (``shared`` dequeue mode, entries in groups,
    several consumers); ``timed``: its received table records the consumer (``worker``)
    and the times of each take (the grouped queue, and every queue of a run with SQL
    consumers)."""

    idx: int
    name: str
    payload_size: int
    capacity: int
    grouped: bool = False
    timed: bool = False


@dataclass(frozen=True)
class CycleRow:
    cycle: int
    started_at: datetime
    ended_at: datetime | None
    status: str
    workload_s: float | None
    stats: dict[str, Any] | None
    errors: list[str] | None
    ok: bool | None


@dataclass(frozen=True)
class RunInfo:
    """A stored run: what it was configured with and its queues."""

    run_id: str
    created_at: datetime
    finished_at: datetime | None
    status: str
    config: RegressConfig
    queues: tuple[QueueRef, ...]

    @property
    def schema(self) -> str:
        return S.SCHEMA_PREFIX + self.run_id


def new_run_id() -> str:
    """``YYYYmmdd_HHMMSS_xxxx`` (UTC): sortable, unique enough, a valid schema suffix."""
    return time.strftime("%Y%m%d_%H%M%S", time.gmtime()) + "_" + secrets.token_hex(2)


def queue_name(run_id: str, idx: int) -> str:
    return f"regress_{run_id}_{idx}"


def _connect(
    dsn: str, *, autocommit: bool = True
) -> AbstractContextManager[psycopg.Connection[Any]]:
    return pg.connected(dsn, autocommit=autocommit, application_name="ringq-regress")


def queue_refs(run_id: str, config: RegressConfig) -> tuple[QueueRef, ...]:
    """The run's queues: one per payload size, then the grouped one (if any),
    with the smallest payload size."""
    sizes = config.payload_sizes
    refs = [QueueRef(i, queue_name(run_id, i), size, config.capacity, timed=config.timed)
            for i, size in enumerate(sizes)]
    if config.grouped:
        n = len(sizes)
        refs.append(QueueRef(n, queue_name(run_id, n), min(sizes), config.capacity,
                             grouped=True, timed=True))
    return tuple(refs)


def sql_taking(
    queues: tuple[QueueRef, ...], config: RegressConfig
) -> list[tuple[int, int]]:
    """(queue, worker) of the run's SQL consumers: dealt out over ``queues`` in
    turn, the grouped queue first (its shared mode, then a ``single`` queue's);
    each numbered after its queue's linked consumers and the SQL ones before it."""
    order = sorted(range(len(queues)), key=lambda q: not queues[q].grouped)
    out: list[tuple[int, int]] = []
    count = dict.fromkeys(order, 0)
    for k in range(config.sql_consumers):
        q = order[k % len(order)]
        linked = config.grouped_consumers if queues[q].grouped else 1
        out.append((q, linked + count[q]))
        count[q] += 1
    return out


def create_run(dsn: str, config: RegressConfig, run_id: str | None = None) -> RunInfo:
    """Create the run's schema and its queues (one per payload size, and the grouped one).

    :raises ConfigError: bad run id. :raises QueueExists: a queue of the run's names exists
        with other settings. :raises DatabaseUnavailable:
    """
    run_id = validate_run_id(run_id or new_run_id())
    queues = queue_refs(run_id, config)
    with _connect(dsn, autocommit=False) as conn:
        for ref in queues:
            # Blocking policy: a full queue makes producers wait (up to their own
            # enqueue timeout), which is what "driven full" should exercise.
            create_queue(
                conn,
                QueueSpec(
                    ref.name,
                    ref.capacity,
                    ref.payload_size,
                    full_policy="block",
                    dequeue_mode="shared" if ref.grouped else "single",
                    retry_delay=config.retry_delay,
                ),
            )
        with conn.transaction():
            conn.execute(S.q(S.CREATE_RUN, run_id))
            conn.execute(
                S.q(S.INSERT_RUN, run_id),
                (run_id, socket.gethostname(), __version__, Jsonb(config.to_json())),
            )
            for ref in queues:
                conn.execute(
                    S.q(S.INSERT_QUEUE, run_id), (ref.idx, ref.name, ref.payload_size, ref.capacity)
                )
                conn.execute(S.q(S.CREATE_RECEIVED, run_id, S.received_table(ref.name)))
                if ref.timed:
                    conn.execute(S.q(S.ADD_RECEIVED_GROUPED, run_id, S.received_table(ref.name)))
    return load_run(dsn, run_id)


def load_run(dsn: str, run_id: str) -> RunInfo:
    """The stored run. :raises RunNotFound: no such run. :raises ConfigError: bad run id."""
    validate_run_id(run_id)
    with _connect(dsn) as conn:
        return _load(conn, run_id)


def _load(conn: psycopg.Connection[Any], run_id: str) -> RunInfo:
    row = conn.execute(S.RUN_EXISTS, (S.SCHEMA_PREFIX + run_id,)).fetchone()
    if not row or not row[0]:
        raise RunNotFound(
            f"no regression run {run_id!r} in this database (see 'ringq regress list')"
        )
    run = conn.execute(S.q(S.SELECT_RUN, run_id)).fetchone()
    assert run is not None
    config = RegressConfig.from_json(run[4])
    # The grouped queue is the one after the payload sizes' (not a column of
    # ``queues``, so runs stored before it existed load as they were).
    grouped = len(config.payload_sizes) if config.grouped else -1
    queues = tuple(
        QueueRef(idx, name, size, capacity, grouped=idx == grouped,
                 timed=idx == grouped or config.timed)
        for idx, name, size, capacity in conn.execute(S.q(S.SELECT_QUEUES, run_id)).fetchall()
    )
    return RunInfo(run[0], run[1], run[2], run[3], config, queues)


def list_runs(dsn: str) -> list[RunInfo]:
    """Every run stored in the database, oldest first."""
    with _connect(dsn) as conn:
        names = [r[0] for r in conn.execute(S.LIST_RUNS).fetchall()]
        out = []
        for name in names:
            try:
                out.append(_load(conn, name[len(S.SCHEMA_PREFIX) :]))
            except (RunNotFound, RingqError, ValueError, TypeError):
                continue  # not one of ours, or from an incompatible version
        return out


def cycles(dsn: str, run_id: str) -> list[CycleRow]:
    with _connect(dsn) as conn:
        return [CycleRow(*r) for r in conn.execute(S.q(S.SELECT_CYCLES, run_id)).fetchall()]


def start_cycle(dsn: str, run_id: str) -> int:
    """Number and record the next cycle; returns its number (from 1)."""
    with _connect(dsn) as conn, conn.transaction():
        row = conn.execute(S.q(S.NEXT_CYCLE, run_id)).fetchone()
        assert row is not None
        n = int(row[0])
        conn.execute(S.q(S.START_CYCLE, run_id), (n,))
        return n


def end_cycle(
    dsn: str,
    run_id: str,
    cycle: int,
    *,
    status: str,
    workload_s: float,
    stats: dict[str, Any],
    errors: list[str],
) -> None:
    with _connect(dsn) as conn:
        conn.execute(
            S.q(S.END_CYCLE, run_id),
            {
                "status": status,
                "workload_s": workload_s,
                "stats": Jsonb(stats),
                "errors": Jsonb(errors),
                "cycle": cycle,
            },
        )


def record_verified(
    dsn: str, run_id: str, cycles_: list[int], ok: bool, report: dict[str, Any]
) -> None:
    with _connect(dsn) as conn:
        conn.execute(S.q(S.VERIFIED_CYCLE, run_id), (ok, Jsonb(report), cycles_))


def finish_run(dsn: str, run: RunInfo, status: str, *, drop_queues: bool = True) -> None:
    """Mark the run ended and (by default) drop its queues; the evidence stays."""
    with _connect(dsn) as conn:
        conn.execute(S.q(S.FINISH_RUN, run.run_id), (status,))
        if drop_queues:
            _drop_queues(conn, run)


def drop_run(dsn: str, run_id: str) -> None:
    """Drop the run's schema and any of its queues still there.

    :raises RunNotFound:
    """
    with _connect(dsn) as conn:
        run = _load(conn, run_id)
        _drop_queues(conn, run)
        conn.execute(S.q(S.DROP_RUN, run_id))


def _drop_queues(conn: psycopg.Connection[Any], run: RunInfo) -> None:
    for ref in run.queues:
        with suppress(QueueNotFound):
            drop_queue(conn, ref.name)


def record_queued(dsn: str, run: RunInfo, cycle: int) -> dict[str, int]:
    """At the end of ``cycle`` (its workers stopped): keep the entries still
    queued (committed, never consumed) in each of the run's queues, for the
    proof to tell them from lost ones; how many per queue."""
    out: dict[str, int] = {}
    with _connect(dsn) as conn:
        for ref in run.queues:
            row = conn.execute(
                S.q(S.RECORD_QUEUED, run.run_id, queue_table(ref.name)),
                {"cycle": cycle, "queue": ref.idx},
            ).fetchone()
            out[ref.name] = int(row[0]) if row else 0
    return out


def queued_kept(dsn: str, run_id: str) -> bool:
    """Whether the run keeps its cycles' still-queued entries (``record_queued``;
    a run stored before that does not)."""
    with _connect(dsn) as conn:
        row = conn.execute(S.QUEUED_KEPT, (S.SCHEMA_PREFIX + run_id,)).fetchone()
        return bool(row and row[0])


def record_acked(
    dsn: str, run_id: str, cycle: int, rows: list[tuple[int, int, int, int, int, bool]]
) -> int:
    """Store acknowledged entries (producer, queue, qseq, pseq, tx, on the new
    primary) of a fail-over cycle; how many."""
    if not rows:
        return 0
    producers, queues, qseqs, pseqs, txs, on_new = (list(c) for c in zip(*rows, strict=True))
    with _connect(dsn) as conn:
        conn.execute(
            S.q(S.INSERT_ACKED, run_id),
            {
                "cycle": cycle,
                "producers": producers,
                "queues": queues,
                "qseqs": qseqs,
                "pseqs": pseqs,
                "txs": txs,
                "on_new": on_new,
            },
        )
    return len(rows)


def commit_timestamps_on(dsn: str) -> bool:
    with _connect(dsn) as conn:
        row = conn.execute(S.COMMIT_TS_ON).fetchone()
        return bool(row and row[0])


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)
