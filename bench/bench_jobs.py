"""A job queue's shape: ringq against a SKIP LOCKED table queue, driven the same way.

One process. A producer thread keeps about ``--ready`` (4,000) entries ready,
``--produce-batch`` (128) per transaction; ``--consumers`` (32) consumer
threads each take up to ``--take`` (8) entries in a transaction, sleep
``--work-ms`` (1 ms) per entry (the "work"), record the batch's completion by
an INSERT into a log table in the same transaction, and commit. Each thread
has its own connection (or ringq session).

- **ringq**: a ``shared`` queue (``--capacity`` 50,000 slots, max payload 512);
  the producer calls ``enqueue_many`` + ``commit``; a consumer
  ``dequeue_many(take, wait=1.0)`` (it sleeps on the queue's wake-up when
  empty), the INSERT through ``Session.execute`` (its BEGIN in the same
  message, as a ringq user's own statement goes), ``commit``.
- **skip_locked**: a table ``(id bigserial PRIMARY KEY, payload bytea, enq_at
  timestamptz)``; the producer ``INSERT ... SELECT unnest(%s::bytea[])`` +
  commit; a consumer ``DELETE ... WHERE id IN (SELECT id ... ORDER BY id FOR
  UPDATE SKIP LOCKED LIMIT take) RETURNING ...``, the INSERT, commit. When it
  finds nothing it commits and sleeps ``--poll-ms`` (10 ms) before it looks
  again (polling; no LISTEN/NOTIFY).

Both contenders run in the same database, in interleaved rounds (the order
alternates: ringq then skip-locked, then skip-locked then ringq, ...), after an
untimed pass of ``--capacity`` entries through each. A
round runs ``--duration`` s from a common start (a barrier). Figures per round:
entries completed per second (consumer commits that returned by the end),
claim latency (producer's commit returned → a consumer's take returned, one
``time.monotonic_ns`` clock) p50/p99, and this process's CPU seconds
(``time.process_time``, user + system from ``getrusage``) per 1,000 entries
completed: the client's cost, the server's backends not included. Afterwards
what is left is drained and counted: every entry enqueued is completed once or
left (``lost``, ``duplicates`` expected 0). Medians of rounds [min-max];
ratios are ringq over skip-locked within a round, then the median.

Prints a table and writes JSON to ``bench/results/jobs-<UTC>.json`` (and
``--out``). Runs on a private embedded PostgreSQL unless ``--dsn``.
"""

from __future__ import annotations

import resource
import secrets
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import psycopg
from _benchlib import (
    RunNames,
    TimedRound,
    argument_parser,
    cpu_load,
    drop_queues,
    machine,
    run_in_database,
)
from _benchlib import server_settings as settings_of
from psycopg import sql
from psycopg.conninfo import make_conninfo
from ringq.engine import Session, connect
from ringq.scripting import QueueSpec, create_queue

KINDS = ("ringq", "skip_locked")
DRAIN_BATCH = 1000  # entries per transaction of the untimed passes (warm-up, drain)

SKQ_CREATE = (
    "CREATE TABLE {t} (id bigserial PRIMARY KEY, payload bytea, enq_at timestamptz DEFAULT now())"
)
SKQ_PUT = "INSERT INTO {t} (payload) SELECT unnest(%s::bytea[]) RETURNING id"
SKQ_TAKE = (
    "DELETE FROM {t} WHERE id IN (SELECT id FROM {t} ORDER BY id FOR UPDATE SKIP LOCKED LIMIT %s)"
    " RETURNING id, payload"
)
DONE_CREATE = "CREATE TABLE {t} (kind text, round int, consumer int, id bigint)"
DONE_INSERT = "INSERT INTO {t} SELECT %s, %s, %s, unnest(%s::bigint[])"
DONE_COUNT = "SELECT count(*), count(DISTINCT id) FROM {t} WHERE kind = %s AND round = %s"


def q(template: str, table: str) -> sql.Composed:
    return sql.SQL(template).format(t=sql.Identifier(table))


@dataclass(frozen=True)
class Config:
    duration: float
    consumers: int
    rounds: int
    take: int
    produce_batch: int
    ready: int
    capacity: int
    max_payload: int
    payload: int
    work_ms: float
    wait: float
    poll_ms: float
    statement_timeout: float


# -- the contenders: the same four operations each ----------------------------------------------


class Producer(Protocol):
    def put(self, payloads: list[bytes]) -> list[int]:
        """Enqueue ``payloads`` and commit; their ids, once committed."""


class Consumer(Protocol):
    def take(self, n: int) -> list[int]:
        """Up to ``n`` entries' ids, in an open transaction; [] (nothing open)
        after waiting or polling when there were none."""

    def finish(self, rnd: int, who: int, ids: list[int]) -> None:
        """Record ``ids`` as done in the open transaction, and commit."""

    def drain(self, n: int) -> int:
        """Take up to ``n`` entries and commit at once (untimed passes)."""


class Contender(Protocol):
    def producer(self) -> AbstractContextManager[Producer]: ...

    def consumer(self) -> AbstractContextManager[Consumer]: ...


class _RingqProducer:
    def __init__(self, s: Session, queue: str) -> None:
        self.s, self.queue = s, queue

    def put(self, payloads: list[bytes]) -> list[int]:
        seqs = self.s.enqueue_many(self.queue, payloads)
        self.s.commit()
        return seqs


class _RingqConsumer:
    def __init__(self, s: Session, queue: str, done: sql.Composed, wait: float) -> None:
        self.s, self.queue, self.wait = s, queue, wait
        self.done = done.as_string(s.connection)  # a str, for Session.execute

    def take(self, n: int) -> list[int]:
        got = self.s.dequeue_many(self.queue, n, wait=self.wait)  # sleeps on the wake-up
        if not got:
            self.s.commit()
        return [m.seq for m in got]

    def finish(self, rnd: int, who: int, ids: list[int]) -> None:
        # as a ringq user's own statement goes: its BEGIN in the same message,
        # planned once (psycopg prepares the SKIP LOCKED side's after 5 runs)
        self.s.execute(self.done, ("ringq", rnd, who, ids), prepare=True)
        self.s.commit()

    def drain(self, n: int) -> int:
        got = self.s.dequeue_many(self.queue, n)
        self.s.commit()
        return len(got)


@dataclass(frozen=True)
class Ringq:
    dsn: str
    queue: str
    done: str
    wait: float

    @contextmanager
    def producer(self) -> Iterator[Producer]:
        with connect(self.dsn) as s:
            s.queue_info(self.queue)
            yield _RingqProducer(s, self.queue)

    @contextmanager
    def consumer(self) -> Iterator[Consumer]:
        with connect(self.dsn) as s:
            s.queue_info(self.queue)
            yield _RingqConsumer(s, self.queue, q(DONE_INSERT, self.done), self.wait)


class _SkqProducer:
    def __init__(self, conn: psycopg.Connection[Any], table: str) -> None:
        self.conn, self.put_sql = conn, q(SKQ_PUT, table)

    def put(self, payloads: list[bytes]) -> list[int]:
        ids = [r[0] for r in self.conn.execute(self.put_sql, (payloads,)).fetchall()]
        self.conn.commit()
        return ids


class _SkqConsumer:
    def __init__(self, conn: psycopg.Connection[Any], table: str, done: str, poll: float) -> None:
        self.conn, self.poll = conn, poll
        self.take_sql, self.done = q(SKQ_TAKE, table), q(DONE_INSERT, done)

    def take(self, n: int) -> list[int]:
        rows = self.conn.execute(self.take_sql, (n,)).fetchall()
        if not rows:
            self.conn.commit()  # never sleep inside a transaction
            time.sleep(self.poll)
        return [r[0] for r in rows]

    def finish(self, rnd: int, who: int, ids: list[int]) -> None:
        self.conn.execute(self.done, ("skip_locked", rnd, who, ids))
        self.conn.commit()

    def drain(self, n: int) -> int:
        got = len(self.conn.execute(self.take_sql, (n,)).fetchall())
        self.conn.commit()
        return got


@dataclass(frozen=True)
class SkipLocked:
    dsn: str
    table: str
    done: str
    poll: float

    @contextmanager
    def producer(self) -> Iterator[Producer]:
        with psycopg.connect(self.dsn) as conn:
            yield _SkqProducer(conn, self.table)

    @contextmanager
    def consumer(self) -> Iterator[Consumer]:
        with psycopg.connect(self.dsn) as conn:
            yield _SkqConsumer(conn, self.table, self.done, self.poll)


# -- one round, the same loop for both ----------------------------------------------------------


def latency_ms(diffs_ns: list[int]) -> dict[str, Any]:
    if not diffs_ns:
        return {"n": 0}
    a = np.asarray(diffs_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(a, [50, 99])
    return {"n": int(a.size), "p50_ms": float(p50), "p99_ms": float(p99),
            "max_ms": float(a.max()), "negative": int((a < 0).sum())}  # fmt: skip


def _cpu() -> tuple[float, float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return time.process_time(), ru.ru_utime, ru.ru_stime


def one_round(side: Contender, kind: str, rnd: int, cfg: Config, payload: bytes) -> dict[str, Any]:
    """Run the producer and the consumers for ``cfg.duration`` s from a common
    start; return the round's figures (the untimed drain afterwards included)."""
    n = cfg.consumers
    committed: dict[int, int] = {}  # id -> monotonic ns after the producer's commit returned
    taken: list[list[tuple[int, int]]] = [[] for _ in range(n)]  # (id, ns) taken in time
    took = [0] * n  # entries taken, per consumer (the producer's view of what is ready)
    done_in_time = [0] * n
    done_all = [0] * n
    enqueued = [0]
    seen = [0, 0]  # the producer's view of the ready entries: sum, looks (timed part)
    cpu0: list[float] = []
    cpu1: list[float] = []
    timed = TimedRound(n, cfg.duration, at_start=lambda: cpu0.extend(_cpu()))
    clock, stop, barrier = timed.clock, timed.stop, timed.barrier

    def produce() -> None:
        items = [payload] * cfg.produce_batch
        with side.producer() as p:
            barrier.wait()
            while not stop.is_set():
                ready = enqueued[0] - sum(took)
                if time.monotonic_ns() <= clock["end"]:
                    seen[0] += ready
                    seen[1] += 1
                if ready < cfg.ready:
                    ids = p.put(items)
                    t = time.monotonic_ns()
                    for i in ids:
                        committed[i] = t
                    enqueued[0] += len(ids)
                else:
                    time.sleep(0.001)

    def consume(who: int) -> None:
        with side.consumer() as c:
            barrier.wait()
            end = clock["end"]
            while not stop.is_set():
                ids = c.take(cfg.take)
                if not ids:
                    continue
                t = time.monotonic_ns()
                took[who] += len(ids)
                if t <= end:
                    taken[who].extend((i, t) for i in ids)
                time.sleep(cfg.work_ms / 1000 * len(ids))
                c.finish(rnd, who, ids)
                done_all[who] += len(ids)
                if time.monotonic_ns() <= end:
                    done_in_time[who] += len(ids)

    timed.run([produce, *(partial(consume, w) for w in range(n))],
              join_s=cfg.statement_timeout + 30.0, unit="round", name=f"{kind} round {rnd}",
              ended=lambda: cpu1.extend(_cpu()))
    left = 0
    with side.consumer() as c:
        while got := c.drain(DRAIN_BATCH):
            left += got
    completed = sum(done_in_time)
    cpu = [b - a for a, b in zip(cpu0, cpu1, strict=True)]
    return {
        "entries_per_s": completed / cfg.duration,
        "completed": completed,
        "completed_all": sum(done_all),
        "enqueued": enqueued[0],
        "left": left,
        "ready_mean": seen[0] / seen[1] if seen[1] else None,
        "lost": enqueued[0] - sum(done_all) - left,
        "claim_latency": latency_ms(
            [t - committed[i] for per in taken for i, t in per if i in committed]
        ),
        "cpu_s": cpu[0],
        "cpu_user_s": cpu[1],
        "cpu_system_s": cpu[2],
        "cpu_s_per_1000": 1000 * cpu[0] / completed if completed else None,
    }


def pass_through(side: Contender, entries: int, payload: bytes) -> None:
    """``entries`` through the contender, untimed (every ring row and table page used once)."""
    items = [payload] * DRAIN_BATCH
    with side.producer() as p, side.consumer() as c:
        for _ in range(-(-entries // DRAIN_BATCH)):
            p.put(items)
            while c.drain(DRAIN_BATCH):
                pass


def run(dsn: str, cfg: Config, names: RunNames) -> dict[str, Any]:
    payload = secrets.token_bytes(cfg.payload)
    with psycopg.connect(dsn, autocommit=True) as admin:
        create_queue(
            admin, QueueSpec(names.queue, cfg.capacity, cfg.max_payload, dequeue_mode="shared")
        )
        admin.execute(q(SKQ_CREATE, names.table))
        admin.execute(q(DONE_CREATE, names.done))
        env = {"server": settings_of(admin), **machine(), **cpu_load("start")}
    # A statement that hangs fails the round instead of the run waiting for ever (seen
    # once: 32 SKIP LOCKED DELETEs stuck for minutes on the LockManager lock on a machine
    # loaded 8x over).
    bounded = make_conninfo(
        dsn, options=f"-c statement_timeout={int(cfg.statement_timeout * 1000)}"
    )
    sides: dict[str, Contender] = {
        "ringq": Ringq(bounded, names.queue, names.done, cfg.wait),
        "skip_locked": SkipLocked(bounded, names.table, names.done, cfg.poll_ms / 1000),
    }
    for kind, side in sides.items():
        print(f"warm-up: {cfg.capacity:,} entries through {kind} ...", file=sys.stderr, flush=True)
        pass_through(side, cfg.capacity, payload)
    rounds: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
        res: dict[str, Any] = {"round": r + 1, "order": order}
        for kind in order:
            print(f"round {r + 1}/{cfg.rounds}: {kind} ...", file=sys.stderr, flush=True)
            res[kind] = one_round(sides[kind], kind, r + 1, cfg, payload)
        rounds.append(res)
    with psycopg.connect(dsn, autocommit=True) as admin:
        for res in rounds:
            for kind in KINDS:
                row = admin.execute(q(DONE_COUNT, names.done), (kind, res["round"])).fetchone()
                assert row is not None
                res[kind]["logged"], distinct = row
                res[kind]["duplicates"] = row[0] - distinct
    env.update(cpu_load("end"))
    return {"environment": env, "rounds": rounds}


# -- summary and table ----------------------------------------------------------------------------

FIGURES = (  # (label, key in the summary, path into a round's result, format)
    ("entries/s completed", "entries_per_s", ("entries_per_s",), "{:,.0f}"),
    ("claim latency p50 (ms)", "claim_p50_ms", ("claim_latency", "p50_ms"), "{:,.1f}"),
    ("claim latency p99 (ms)", "claim_p99_ms", ("claim_latency", "p99_ms"), "{:,.1f}"),
    ("CPU s per 1,000 entries", "cpu_s_per_1000", ("cpu_s_per_1000",), "{:.3f}"),
    ("ready, producer's view", "ready_mean", ("ready_mean",), "{:,.0f}"),
)


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float:
    for p in path:
        d = d[p]
    return float("nan") if d is None else float(d)  # type: ignore[arg-type]


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _med(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    rounds = raw["rounds"]
    fig: dict[str, dict[str, Any]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for _label, key, path, _f in FIGURES:
        fig[key] = {kind: _med([_get(r[kind], path) for r in rounds]) for kind in KINDS}
        ratios[f"{key}_ringq_over_skq"] = _med(
            [_ratio(_get(r["ringq"], path), _get(r["skip_locked"], path)) for r in rounds]
        )
    checks = {
        kind: {k: sum(r[kind][k] for r in rounds) for k in ("lost", "duplicates", "left")}
        | {"logged_vs_completed": sum(r[kind]["logged"] - r[kind]["completed_all"] for r in rounds)}
        for kind in KINDS
    }
    return {"figures": fig, "ratios": ratios, "checks": checks}


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    env = raw["environment"]
    fig, ratios = summary["figures"], summary["ratios"]
    lines = [
        (
            f"ringq job-queue benchmark: PostgreSQL {env['server']['server_version']}, "
            f"synchronous_commit={env['server']['synchronous_commit']}, {env['cpus']} CPUs"
        ),
        (
            f"1 producer ({cfg.produce_batch}/tx, ~{cfg.ready:,} ready), {cfg.consumers} "
            f"consumer threads ({cfg.take}/tx, {cfg.work_ms:g} ms work per entry, INSERT per "
            f"batch), payload {cfg.payload} B; skip-locked polls every {cfg.poll_ms:g} ms "
            "when empty"
        ),
        (
            f"{cfg.rounds} interleaved rounds of {cfg.duration:g} s per contender; median of "
            f"rounds [min-max]; run took {seconds:.0f} s"
        ),
        (
            f"load average at start {env['loadavg_at_start'][0]:.2f}, at end "
            f"{env['loadavg_at_end'][0]:.2f} (anything else running on the machine moves the "
            "figures)"
        ),
        "",
        f"{'figure':<26} {'ringq':>26} {'skip-locked':>26} {'ringq/skq':>10}",
        "-" * 91,
    ]
    for label, key, _path, f in FIGURES:
        cells = [
            f"{f.format(fig[key][k]['median'])} [{f.format(fig[key][k]['min'])}-"
            f"{f.format(fig[key][k]['max'])}]"
            for k in KINDS
        ]
        rat = ratios[f"{key}_ringq_over_skq"]["median"]
        lines.append(f"{label:<26} {cells[0]:>26} {cells[1]:>26} {rat:>10.2f}")
    lines.append("")
    for kind in KINDS:
        c = summary["checks"][kind]
        lines.append(
            f"{kind}: lost {c['lost']}, duplicates {c['duplicates']}, log rows - completed "
            f"{c['logged_vs_completed']}, left after the rounds {c['left']:,}"
        )
    return "\n".join(lines)


def cleanup(dsn: str, names: RunNames, *, embedded: bool) -> None:
    drop_queues(dsn, [names.queue], embedded=embedded, tables=[names.table, names.done])


def parse_args(argv: list[str] | None) -> Any:
    p = argument_parser(__doc__.split("\n", 1)[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds per contender and round")
    p.add_argument("--consumers", type=int, default=32, help="consumer threads")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds (each contender once)")
    p.add_argument("--take", type=int, default=8, help="entries a consumer takes per transaction")
    p.add_argument("--produce-batch", type=int, default=128, help="entries per enqueue transaction")
    p.add_argument("--ready", type=int, default=4000, help="entries the producer keeps ready")
    p.add_argument("--capacity", type=int, default=50_000, help="slots of the ringq queue")
    p.add_argument("--max-payload", type=int, default=512, help="max payload of the ringq queue")
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument("--work-ms", type=float, default=1.0, help="a consumer's sleep per entry (ms)")
    p.add_argument("--wait", type=float, default=1.0, help="ringq dequeue_many's wait (s)")
    p.add_argument(
        "--poll-ms",
        type=float,
        default=10.0,
        help="skip-locked consumer's sleep after finding nothing (ms)",
    )
    p.add_argument(
        "--statement-timeout",
        type=float,
        default=30.0,
        help="statement_timeout of the contenders' connections (s): a hang fails",
    )
    a = p.parse_args(argv)
    for name in ("consumers", "rounds", "take", "produce_batch", "ready", "capacity", "payload"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (
        not a.duration > 0
        or not a.statement_timeout > 0
        or a.work_ms < 0
        or a.wait < 0
        or a.poll_ms < 0
    ):
        p.error(
            "--duration and --statement-timeout must be > 0; --work-ms, --wait and --poll-ms >= 0"
        )
    if a.payload > a.max_payload or a.ready + a.produce_batch > a.capacity:
        p.error("--payload must fit --max-payload, --ready + --produce-batch fit --capacity")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = Config(a.duration, a.consumers, a.rounds, a.take, a.produce_batch, a.ready, a.capacity,
                 a.max_payload, a.payload, a.work_ms, a.wait, a.poll_ms,
                 a.statement_timeout)  # fmt: skip
    names = RunNames.fresh("bench_{}_jobs", "skq_{}_jobs", "jobs_{}_done")
    return run_in_database(
        "jobs",
        a,
        cfg,
        run=lambda dsn: run(dsn, cfg, names),
        cleanup=lambda dsn, embedded: cleanup(dsn, names, embedded=embedded),
        summarize=summarize,
        render=lambda raw, summary, seconds: render(raw, summary, cfg, seconds),
    )


if __name__ == "__main__":
    sys.exit(main())
