"""Delays benchmark (issue 24): what entries that wait cost a claim.

Two ``shared`` queues of one database, each with ``--capacity`` slots:

- *plain*: one ready entry at the tail, nothing waits;
- *waiting*: ``--waiting`` entries delayed by an hour (``enqueue_many(...,
  delay=3600)``), then one entry due at once behind them;
- *grouped*: the same with the waiting entries spread over ``--groups``
  groups, the due entry in a group of its own;
- *grouped, behind a head*: the same, with a ready entry of one of the
  waiting groups ahead of the due one: that group waits for its head, so
  the claim passes the ready entry over (the walk a grouped claim makes
  when one of its groups waits).

Each queue's claim is timed in-process: ``Ring.claim`` under the queue lock,
the claimed entry put back at once (``finish_dequeue`` without a strike),
``--claims`` times, microseconds per claim (median and p90). The waiting
queue's claim reads past the waiting entries in the bitmaps (they are
neither ready nor done), and looks at their due times only when the earliest
falls due: so the figure shows the cost of the bitmap words, not of a walk
over 10,000 entries. A third figure times the release pass (the work of the
claim that finds the earliest due time passed: every waiting entry's due
time read once, vectorized): the queue's earliest due time is set in the past
(``Q_NEXT_DUE_US`` = 1) before each claim, so each claim makes the pass and
finds nothing due.

Run ``python bench/bench_delays.py --help``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from _benchlib import (
    add_options,
    argument_parser,
    config_from_options,
    drop_queues,
    machine,
    run_in_database,
)
from psycopg import sql
from ringq.engine import Session, connect
from ringq.engine import layout as L
from ringq.scripting import QueueSpec, create_queue


@dataclass(frozen=True)
class Config:
    capacity: int
    waiting: int
    claims: int
    late: int
    groups: int


def _time_claims(s: Session, queue: str, n: int, *, force_pass: bool = False) -> dict[str, float]:
    """Median and p90 microseconds of ``n`` ``Ring.claim`` calls under the
    queue lock, each claimed entry put back at once."""
    ring, sec = s.ring(queue), s.section
    took: list[int] = []
    for _ in range(n):
        sec.lock_queue(ring.qidx)
        try:
            if force_pass:
                ring.Q[ring.qb + L.Q_NEXT_DUE_US] = 1  # the release pass runs (finds none due)
            t0 = time.perf_counter_ns()
            got = ring.claim(s.owner, s.backend_pid, exclusive=False)
            t1 = time.perf_counter_ns()
            assert got is not None, "the due entry was not claimed"
            ring.finish_dequeue(got[0], consumed=False, exclusive=False)
        finally:
            sec.unlock_queue(ring.qidx)
        took.append(t1 - t0)
    us = np.asarray(took) / 1000.0
    return {"p50_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90))}


CASES = {  # figure -> what it times
    "plain": "plain queue, one ready entry",
    "waiting": "{cfg.waiting:,} waiting entries ahead of one due",
    "release_pass": "the same, each claim making the release pass",
    "grouped": "the same in {cfg.groups:,} groups, the due one in its own",
    "grouped_behind": "the same, a ready entry behind its group's waiting head first",
}

LATE_READ = (
    "SELECT (extract(epoch FROM deq_at - not_before) * 1000)::float8 FROM {} "
    "WHERE state = 2 AND not_before IS NOT NULL"
)


def _lateness(dsn: str, queue: str, n: int) -> dict[str, float]:
    """``n`` entries enqueued at once, each due 30 ms after the one before
    (from 0.3 s), taken one per transaction by a consumer waiting in
    ``dequeue(wait=)``: how long after its due time each was received, in ms,
    by the database's clock (the row's ``deq_at``, the consuming transaction's
    start, minus its ``not_before``)."""
    with connect(dsn) as s:
        for i in range(n):
            s.enqueue(queue, b"d", delay=0.3 + 0.03 * i)
        s.commit()
        got = 0
        while got < n:
            m = s.dequeue(queue, wait=5.0)
            assert m is not None, "a delayed entry never came"
            s.commit()
            got += 1
    with psycopg.connect(dsn) as conn:
        late = [r[0] for r in conn.execute(
            sql.SQL(LATE_READ).format(sql.Identifier("ringq", "q_" + queue))).fetchall()]
    ms = np.asarray(late)
    return {"n": float(ms.size), "p50_ms": float(np.median(ms)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max()),
            "min_ms": float(ms.min())}


def _fill_waiting(s: Session, queue: str, cfg: Config, groups: int) -> None:
    """``cfg.waiting`` entries delayed by an hour (in ``groups`` groups, 0: none)."""
    for i in range(0, cfg.waiting, 1000):
        n = min(1000, cfg.waiting - i)
        group = [f"g{(i + k) % groups}" for k in range(n)] if groups else None
        s.enqueue_many(queue, [b"later"] * n, group=group, delay=3600)
        s.commit()


def run(cfg: Config, dsn: str, names: list[str]) -> dict[str, Any]:
    plain, waiting, late, grouped, behind = names
    with psycopg.connect(dsn) as conn:
        for name in names:
            create_queue(conn, QueueSpec(name, cfg.capacity, 128, dequeue_mode="shared",
                                         cache_payload=0))
    with connect(dsn) as s:
        s.enqueue(plain, b"due")
        s.commit()
        _fill_waiting(s, waiting, cfg, 0)
        s.enqueue(waiting, b"due")
        _fill_waiting(s, grouped, cfg, cfg.groups)
        s.enqueue(grouped, b"due", group="free")
        _fill_waiting(s, behind, cfg, cfg.groups)
        s.enqueue(behind, b"behind g0's head", group="g0")
        s.enqueue(behind, b"due", group="free")
        s.commit()
        rings = [s.ring(q) for q in (waiting, grouped, behind)]
        for ring in rings:
            assert ring.Q[ring.qb + L.Q_N_WAITING] == cfg.waiting
        out = {
            "plain": _time_claims(s, plain, cfg.claims),
            "waiting": _time_claims(s, waiting, cfg.claims),
            "release_pass": _time_claims(s, waiting, cfg.claims, force_pass=True),
            "grouped": _time_claims(s, grouped, cfg.claims),
            "grouped_behind": _time_claims(s, behind, cfg.claims),
        }
        for ring in rings:
            assert ring.Q[ring.qb + L.Q_N_WAITING] == cfg.waiting  # none fell due
    out["lateness"] = _lateness(dsn, late, cfg.late)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argument_parser("ringq delays benchmark: the claim's cost with entries that wait.")
    add_options(p, {
        "capacity": (16384, "slots of each queue"),
        "waiting": (10_000, "entries delayed by an hour"),
        "claims": (2000, "claims timed per figure"),
        "groups": (100, "groups the grouped queues' waiting entries are spread over"),
        "late": (200, "delayed entries whose lateness a waiting consumer shows"),
    })
    a = p.parse_args(argv)
    if not 0 < a.waiting < a.capacity - 1 or a.claims < 1 or a.groups < 1:
        p.error("need 0 < --waiting < --capacity - 1, --claims >= 1 and --groups >= 1")
    cfg = config_from_options(Config, a)
    tag = str(time.monotonic_ns() % 1_000_000)
    names = [f"bd_plain_{tag}", f"bd_wait_{tag}", f"bd_late_{tag}", f"bd_grp_{tag}",
             f"bd_grpb_{tag}"]

    def summarize(raw: dict[str, Any]) -> dict[str, Any]:
        return ({k: raw[k]["p50_us"] for k in CASES}
                | {"lateness": raw["lateness"], "machine": machine()})

    def render(raw: dict[str, Any], summary: dict[str, Any], seconds: float) -> str:
        lines = [f"claim cost, us per call ({cfg.claims:,} claims each; {seconds:.1f} s in all)"]
        for key, what in CASES.items():
            lines.append(f"  {what.format(cfg=cfg):<62} p50 {raw[key]['p50_us']:8.2f}  "
                         f"p90 {raw[key]['p90_us']:8.2f}")
        for key in ("waiting", "grouped", "grouped_behind"):
            lines.append(f"  {key} / plain (p50): "
                         f"{raw[key]['p50_us'] / raw['plain']['p50_us']:.2f}")
        late = raw["lateness"]
        lines.append(f"received after its due time ({late['n']:.0f} entries, a waiting "
                     f"consumer, database clock): p50 {late['p50_ms']:.1f} ms, p99 "
                     f"{late['p99_ms']:.1f} ms, max {late['max_ms']:.1f} ms, "
                     f"min {late['min_ms']:.1f} ms")
        return "\n".join(lines)

    return run_in_database(
        "delays", a, cfg, lambda dsn: run(cfg, dsn, names),
        lambda dsn, embedded: drop_queues(dsn, names, embedded=embedded),
        summarize, render,
    )


if __name__ == "__main__":
    sys.exit(main())
