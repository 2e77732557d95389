"""Engine benchmarks: ringq against a SKIP LOCKED queue and a one-row-update ceiling.

Prints a table and writes JSON (``bench/results/engine-<timestamp>.json`` and
``--out PATH``). It measures; it never asserts a timing. Each target is
reported as met or not met.

Everything runs in ONE process tree on ONE database: the project's embedded
PostgreSQL (``ringq.cluster.Cluster``, started under a temporary home and
removed afterwards) unless ``--dsn`` names another. The machine is noisy, so
the short measurements run in interleaved rounds (ringq, SKIP LOCKED, ceiling,
ringq SQL only, concurrent, rotating the order each round) and the table shows
the median of the rounds with their spread; ratios are taken within a round,
then the median of those. The targets of the engine-speed issue are printed as
met / NOT MET.

ringq, the SKIP LOCKED table and ringq's SQL alone are each a driver of
``_contenders`` timed by the one loop there (``measure``); the wake-up figures
are in ``_wakeup``, the table-size test in ``_volume``, the concurrent figure in
``_concurrent``; this module creates the objects, runs the rounds, and
summarizes and prints.

Run ``python bench/bench_engine.py --help``; ``bench/README.md`` says what each
figure means.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from _benchlib import (
    CEIL_UPDATE,
    argument_parser,
    ceiling_one_rt,
    config_from_options,
    cpu_load,
    create_ceiling,
    drop_queues,
    machine,
    run_in_database,
    server_settings,
)
from _concurrent import concurrent_ringq, concurrent_skq
from _contenders import (
    SKQ_CREATE,
    SKQ_DEQUEUE,
    SKQ_DEQUEUE_MANY,
    SKQ_ENQUEUE,
    Driver,
    RingSQL,
    measure,
    pass_through,
    q,
    ring_sql_driver,
    ringq_driver,
    skq_driver,
)
from _volume import volume
from _wakeup import bench_sem_wakeup, bench_wakeup
from ringq.scripting import QueueSpec, create_queue

# The next BEGIN riding on COMMIT (ringq's former eager-begin protocol).
CEIL_UPDATE_EAGER = "COMMIT; BEGIN"


@dataclass(frozen=True)
class Names:
    """The objects one run creates (unique, so ``--dsn`` never touches anyone else's)."""

    ring: str  # rounds
    ring_wake: str
    ring_volume: str
    ring_sql: str  # the SQL-only baseline: the engine never touches it
    ring_concurrent: str  # shared mode: the consumers dequeue side by side
    skq: str
    skq_concurrent: str
    skq_volume: str
    ceiling: str

    @classmethod
    def fresh(cls) -> Names:
        tag = secrets.token_hex(4)
        return cls(ring=f"bench_{tag}", ring_wake=f"bench_{tag}_w", ring_volume=f"bench_{tag}_v",
                   ring_sql=f"bench_{tag}_s", ring_concurrent=f"bench_{tag}_c",
                   skq=f"skq_{tag}", skq_concurrent=f"skq_{tag}_c", skq_volume=f"skq_{tag}_v",
                   ceiling=f"ceil_{tag}")  # fmt: skip


def ring_table(queue: str) -> str:
    return f"ringq.q_{queue}"


def create_skq(admin: psycopg.Connection[Any], table: str) -> None:
    admin.execute(q(SKQ_CREATE, table))


# -- ceiling -------------------------------------------------------------------------------------


def bench_ceiling(dsn: str, table: str, n: int) -> dict[str, float]:
    """One-row UPDATE + COMMIT transactions/s, three ways.

    ``one_rt``: autocommit, the UPDATE is its own transaction: one round trip,
    one WAL flush, the least a durable one-row transaction costs from here (the
    targets use this one). ``eager_2rt``: UPDATE, then ``COMMIT; BEGIN`` in one
    message: two round trips, as many as ringq's own protocol. ``psycopg_3rt``: a default
    psycopg connection, BEGIN + UPDATE + COMMIT (three round trips).
    """
    upd = q(CEIL_UPDATE, table)
    out: dict[str, float] = {}
    pc = time.perf_counter_ns
    with psycopg.connect(dsn, autocommit=True) as conn:
        out["one_rt_tx_per_s"] = ceiling_one_rt(conn, table, n)

        conn.execute("BEGIN")
        for _ in range(10):
            conn.execute(upd)
            conn.execute(CEIL_UPDATE_EAGER)
        start = pc()
        for _ in range(n):
            conn.execute(upd)
            conn.execute(CEIL_UPDATE_EAGER)
        out["eager_2rt_tx_per_s"] = n / ((pc() - start) / 1e9)
        conn.execute("ROLLBACK")
    with psycopg.connect(dsn) as conn:
        for _ in range(10):
            conn.execute(upd)
            conn.commit()
        start = pc()
        for _ in range(n):
            conn.execute(upd)
            conn.commit()
        out["psycopg_3rt_tx_per_s"] = n / ((pc() - start) / 1e9)
    return out


# -- the run -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    rounds: int
    single: int
    batches: int
    batch: int
    wakeups: int
    volume: int
    volume_capacity: int
    payload: int
    capacity: int
    concurrent_seconds: float
    producers: int
    consumers: int


def run(dsn: str, cfg: Config, names: Names) -> dict[str, Any]:
    payload = secrets.token_bytes(cfg.payload)
    with psycopg.connect(dsn, autocommit=True) as admin:
        for name, cap in (
            (names.ring, cfg.capacity),
            (names.ring_sql, cfg.capacity),
            (names.ring_wake, 1024),
            (names.ring_volume, cfg.volume_capacity),
        ):
            create_queue(admin, QueueSpec(name, cap, max(cfg.payload, 1)))
        create_queue(
            admin,
            QueueSpec(names.ring_concurrent, cfg.capacity, cfg.payload, dequeue_mode="shared"),
        )
        create_skq(admin, names.skq)
        create_skq(admin, names.skq_volume)
        create_skq(admin, names.skq_concurrent)
        create_ceiling(admin, names.ceiling)
        env = environment(admin)
    ring_sql = RingSQL(names.ring_sql, cfg.capacity)
    # Steady state first: every ring row has held a payload once (the first wrap widens
    # the pre-populated rows, see the volume part), and the SKIP LOCKED table has had the
    # same traffic. The rounds then measure a queue in use, not a fresh one.
    print(f"warm-up: {cfg.capacity:,} entries through each queue ...", file=sys.stderr, flush=True)
    warm_up(dsn, names, ring_sql, cfg, payload)

    rounds: list[dict[str, Any]] = []
    # Each takes the round's index (0, 1, ...); the same loop times the three contenders.
    n = (cfg.single, cfg.batches, cfg.batch)
    kinds: list[tuple[str, Callable[[int], Any]]] = [
        ("ringq", lambda r: _measured(ringq_driver(dsn, names.ring, payload), n)),
        ("skip_locked", lambda r: _measured(skq_driver(dsn, names.skq, payload), n)),
        ("ceiling", lambda r: bench_ceiling(dsn, names.ceiling, cfg.single)),
        ("ringq_sql", lambda r: _measured(ring_sql_driver(dsn, ring_sql, payload), n)),
    ]
    if cfg.concurrent_seconds:
        kinds.append(("concurrent", lambda r: bench_concurrent(dsn, names, cfg, payload, r)))
    for r in range(cfg.rounds):
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        res: dict[str, Any] = {"round": r + 1, "order": [k for k, _ in order]}
        for kind, fn in order:
            print(f"round {r + 1}/{cfg.rounds}: {kind} ...", file=sys.stderr, flush=True)
            res[kind] = fn(r)
            if kind == "ringq" and cfg.wakeups:
                res["ringq"]["wakeup"] = bench_wakeup(dsn, names.ring_wake, payload, cfg.wakeups)
                res["ringq"]["semaphore_wakeup"] = bench_sem_wakeup(cfg.wakeups)
        rounds.append(res)

    vol: dict[str, Any] = {}
    if cfg.volume:
        print(f"volume: {cfg.volume:,} entries through a {cfg.volume_capacity:,}-slot ringq queue, "
              f"then through the SKIP LOCKED table, {cfg.batch} per transaction",
              file=sys.stderr, flush=True)  # fmt: skip
        for kind, label, driver, table in (
            ("ringq", "ringq", ringq_driver(dsn, names.ring_volume, payload),
             ring_table(names.ring_volume)),
            ("skip_locked", "skip-locked", skq_driver(dsn, names.skq_volume, payload),
             names.skq_volume),
        ):  # fmt: skip
            vol[kind] = volume(
                dsn, driver, table, label, cfg.volume, cfg.batch, cfg.volume_capacity
            )
    env.update(cpu_load("end"))
    return {"environment": env, "rounds": rounds, "volume": vol}


def bench_concurrent(
    dsn: str, names: Names, cfg: Config, payload: bytes, round_index: int
) -> dict[str, Any]:
    """Both sides of the concurrent figure, one after the other; which goes first alternates
    with the round."""
    skq_statements = [q(t, names.skq_concurrent) for t in (SKQ_ENQUEUE, SKQ_DEQUEUE,
                                                           SKQ_DEQUEUE_MANY)]  # fmt: skip
    sides: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("ringq", lambda: concurrent_ringq(
            dsn, names.ring_concurrent, payload, cfg.producers, cfg.consumers,
            cfg.concurrent_seconds)),
        ("skip_locked", lambda: concurrent_skq(
            dsn, skq_statements, payload, cfg.producers, cfg.consumers, cfg.concurrent_seconds)),
    ]  # fmt: skip
    if round_index % 2:
        sides.reverse()
    out: dict[str, Any] = {"order": [side for side, _ in sides]}
    for side, fn in sides:
        out[side] = fn()
    return out


def _measured(driver: AbstractContextManager[Driver], n: tuple[int, int, int]) -> dict[str, Any]:
    """``measure`` the contender ``driver`` opens, on connections opened for the round."""
    with driver as d:
        return measure(d, *n)


def warm_up(dsn: str, names: Names, ring_sql: RingSQL, cfg: Config, payload: bytes) -> None:
    """Pass ``cfg.capacity`` entries through each contender, ``cfg.batch`` per transaction."""
    for driver in (
        ringq_driver(dsn, names.ring, payload),
        ringq_driver(dsn, names.ring_concurrent, payload),
        ring_sql_driver(dsn, ring_sql, payload),
        skq_driver(dsn, names.skq, payload),
        skq_driver(dsn, names.skq_concurrent, payload),
    ):
        with driver as d:
            pass_through(d, cfg.capacity, cfg.batch)


def environment(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    return {
        "server": server_settings(conn),
        **machine(),
        "psycopg_impl": psycopg.pq.__impl__,
        "numpy": np.__version__,
        **cpu_load("start"),
    }


# -- summary: medians, ratios, targets -------------------------------------------------------------

# (key in the summary, path into a round's result)
FIGURES: list[tuple[str, str, tuple[str, ...]]] = [
    ("enqueue call p50 (us)", "enq_p50", ("enqueue_latency", "p50_us")),
    ("enqueue call p99 (us)", "enq_p99", ("enqueue_latency", "p99_us")),
    ("dequeue call p50 (us)", "deq_p50", ("dequeue_latency", "p50_us")),
    ("dequeue call p99 (us)", "deq_p99", ("dequeue_latency", "p99_us")),
    ("enqueue+commit tx/s", "enq_tps", ("enqueue_tx_per_s",)),
    ("dequeue+commit tx/s", "deq_tps", ("dequeue_tx_per_s",)),
    ("batched enqueue entries/s", "enq_many", ("enqueue_many_entries_per_s",)),
    ("batched dequeue entries/s", "deq_many", ("dequeue_many_entries_per_s",)),
]


def _get(d: dict[str, Any], path: tuple[str, ...]) -> float:
    for p in path:
        d = d[p]
    return float(d)  # type: ignore[arg-type]


def _med(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(raw: dict[str, Any], cfg: Config) -> dict[str, Any]:
    rounds = raw["rounds"]
    fig: dict[str, dict[str, Any]] = {}
    for _label, key, path in FIGURES:
        fig[key] = {
            kind: _med([_get(r[kind], path) for r in rounds])
            for kind in ("ringq", "ringq_sql", "skip_locked")
        }
    for key in ("one_rt_tx_per_s", "eager_2rt_tx_per_s", "psycopg_3rt_tx_per_s"):
        fig["ceiling_" + key] = {"ceiling": _med([r["ceiling"][key] for r in rounds])}
    if "wakeup" in rounds[0]["ringq"]:
        for p in ("p50_us", "p99_us"):
            fig["wakeup_" + p] = {"ringq": _med([r["ringq"]["wakeup"][p] for r in rounds])}
            fig["sem_wakeup_" + p] = {
                "ringq": _med([r["ringq"]["semaphore_wakeup"][p] for r in rounds])
            }

    R = "ringq"
    S = "skip_locked"
    ratios: dict[str, dict[str, float]] = {}
    for _label, key, path in FIGURES:
        for other, suffix in ((S, "skq"), ("ringq_sql", "sql")):
            per_round = [_get(r[R], path) / _get(r[other], path) for r in rounds]
            ratios[f"{key}_ringq_over_{suffix}"] = _med(per_round)
    # one transaction per entry against the ceilings (one round trip; the former two)
    against = ((R, "ringq", "one_rt", ""), (R, "ringq", "eager_2rt", "_2rt"),
               (S, "skq", "one_rt", ""))
    for who, name, ceiling, suffix in against:
        for op, verb in (("enq", "enqueue"), ("deq", "dequeue")):
            ratios[f"{op}_tps_{name}_over_ceiling{suffix}"] = _med(
                [r[who][f"{verb}_tx_per_s"] / r["ceiling"][f"{ceiling}_tx_per_s"] for r in rounds]
            )

    if "concurrent" in rounds[0]:
        for key, field in (
            ("concurrent", "committed_entries_per_s"),
            ("concurrent_enqueued", "enqueued_entries_per_s"),
        ):
            fig[key] = {
                kind: _med([r["concurrent"][kind][field] for r in rounds]) for kind in (R, S)
            }
            ratios[f"{key}_ringq_over_skq"] = _med(
                [r["concurrent"][R][field] / r["concurrent"][S][field] for r in rounds]
            )

    # Engine time per call outside the database, median of rounds. An enqueue sends nothing
    # at call time (its write goes with the commit), so the call is the engine's time alone;
    # a dequeue sends its UPDATE, so the engine's time is the call minus the same SQL sent
    # straight through psycopg.
    engine_us = {
        "enqueue_call_p50": fig["enq_p50"]["ringq"],
        "enqueue_call_p99": fig["enq_p99"]["ringq"],
    }
    for p in ("p50", "p99"):
        deq = [_get(r[R], ("dequeue_latency", f"{p}_us")) for r in rounds]
        sql_only = [_get(r["ringq_sql"], ("dequeue_latency", f"{p}_us")) for r in rounds]
        engine_us[f"dequeue_call_{p}_minus_sql"] = _med(
            [a - b for a, b in zip(deq, sql_only, strict=True)]
        )

    targets: list[dict[str, Any]] = []

    def target(name: str, value: float | None, op: str, bound: float) -> None:
        met = (
            None
            if value is None
            else (value <= bound if op == "<=" else value < bound if op == "<" else value >= bound)
        )
        targets.append({"name": name, "value": value, "target": f"{op} {bound:,g}", "met": met})

    def median(table: dict[str, Any], key: str, *path: str) -> float | None:
        if key not in table:
            return None  # the part was skipped (--wakeups 0, --concurrent-seconds 0)
        d = table[key]
        for p in path:
            d = d[p]
        return float(d["median"])

    conc = f"{cfg.producers}+{cfg.consumers}"
    for name, value, op, bound in (
        ("enqueue call p50, ringq/skip-locked", median(ratios, "enq_p50_ringq_over_skq"),
         "<=", 0.1),
        ("dequeue call p50, ringq/skip-locked", median(ratios, "deq_p50_ringq_over_skq"),
         "<=", 0.2),
        ("enqueue+commit tx/s, ringq/1-rt ceiling", median(ratios, "enq_tps_ringq_over_ceiling"),
         ">=", 0.9),
        ("enqueue+commit tx/s, ringq/skip-locked", median(ratios, "enq_tps_ringq_over_skq"),
         ">=", 1.3),
        ("dequeue+commit tx/s, ringq/1-rt ceiling", median(ratios, "deq_tps_ringq_over_ceiling"),
         ">=", 0.9),
        ("dequeue+commit tx/s, ringq/skip-locked", median(ratios, "deq_tps_ringq_over_skq"),
         ">=", 1.3),
        ("batched enqueue, ringq entries/s", median(fig, "enq_many", "ringq"), ">=", 60_000),
        ("batched dequeue, ringq entries/s", median(fig, "deq_many", "ringq"), ">=", 100_000),
        ("wake-up p50, ringq (us)", median(fig, "wakeup_p50_us", "ringq"), "<", 200),
        (f"concurrent {conc} entries/s, ringq/skip-locked",
         median(ratios, "concurrent_ringq_over_skq"), ">=", 1.5),
        ("engine time per enqueue call, p50 (us)", median(engine_us, "enqueue_call_p50"),
         "<=", 20),
    ):  # fmt: skip
        target(name, value, op, bound)
    targets.append({
        "name": "engine time per dequeue call, p50 (us): ringq - ringq SQL only",
        "value": median(engine_us, "dequeue_call_p50_minus_sql"), "target": "info", "met": None,
    })  # fmt: skip
    return {"figures": fig, "ratios": ratios, "engine_us": engine_us, "targets": targets}


def _fmt(v: float, unit: str = "") -> str:
    if unit == "B":
        for u in ("B", "kB", "MB", "GB"):
            if abs(v) < 1024 or u == "GB":
                return f"{v:,.0f} {u}" if u == "B" else f"{v:,.1f} {u}"
            v /= 1024
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    fig, ratios = summary["figures"], summary["ratios"]
    lines: list[str] = []
    env = raw["environment"]["server"]
    lines.append(
        f"ringq engine benchmark: PostgreSQL {env['server_version']}, "
        f"synchronous_commit={env['synchronous_commit']}, "
        f"fsync={env['fsync']}, {raw['environment']['cpus']} CPUs, payload {cfg.payload} B"
    )
    lines.append(
        f"{cfg.rounds} interleaved rounds of {cfg.single:,} single-entry tx each way, "
        f"{cfg.batches} x {cfg.batch} batched, "
        f"{cfg.wakeups} wake-ups; median of rounds [min-max]; run took {seconds:.0f} s"
    )
    if cfg.concurrent_seconds:
        lines.append(
            f"concurrent: {cfg.producers} producer + {cfg.consumers} consumer processes, "
            f"{cfg.concurrent_seconds:g} s per side per round, one-entry transactions "
            "(ringq queue in shared dequeue mode)"
        )
    e = raw["environment"]
    lines.append(
        f"load average at start {e['loadavg_at_start'][0]:.2f}, "
        f"at end {e['loadavg_at_end'][0]:.2f} "
        "(anything else running on the machine inflates the figures)"
    )
    lines.append("")
    w = 28
    lines.append(
        f"{'figure':<{w}} {'ringq':>24} {'ringq SQL only':>24} {'skip-locked':>24} "
        f"{'ringq/skq':>10}"
    )
    lines.append("-" * (w + 86))

    def cell(d: dict[str, float]) -> str:
        return f"{_fmt(d['median'])} [{_fmt(d['min'])}-{_fmt(d['max'])}]"

    for label, key, _path in FIGURES:
        f = fig[key]
        rat = ratios[f"{key}_ringq_over_skq"]["median"]
        lines.append(
            f"{label:<{w}} {cell(f['ringq']):>24} {cell(f['ringq_sql']):>24} "
            f"{cell(f['skip_locked']):>24} {rat:>10.2f}"
        )
    if "concurrent" in fig:
        conc = f"{cfg.producers}+{cfg.consumers}"
        for label, key in (
            (f"concurrent {conc} entries/s", "concurrent"),
            ("  producers' commits/s", "concurrent_enqueued"),
        ):
            f = fig[key]
            rat = ratios[f"{key}_ringq_over_skq"]["median"]
            lines.append(
                f"{label:<{w}} {cell(f['ringq']):>24} {'-':>24} "
                f"{cell(f['skip_locked']):>24} {rat:>10.2f}"
            )
    for label, key in (
        ("ceiling tx/s, 1 round trip", "ceiling_one_rt_tx_per_s"),
        ("ceiling tx/s, 2 round trips", "ceiling_eager_2rt_tx_per_s"),
        ("ceiling tx/s, 3 (psycopg)", "ceiling_psycopg_3rt_tx_per_s"),
    ):
        lines.append(f"{label:<{w}} {cell(fig[key]['ceiling']):>24}")
    if "wakeup_p50_us" in fig:
        lines.append(f"{'wake-up p50 (us)':<{w}} {cell(fig['wakeup_p50_us']['ringq']):>24}")
        lines.append(f"{'wake-up p99 (us)':<{w}} {cell(fig['wakeup_p99_us']['ringq']):>24}")
        lines.append(
            f"{'  bare semaphore p50 (us)':<{w}} {cell(fig['sem_wakeup_p50_us']['ringq']):>24}"
        )
        lines.append(
            f"{'  bare semaphore p99 (us)':<{w}} {cell(fig['sem_wakeup_p99_us']['ringq']):>24}"
        )
    lost = {
        side: sum(r["concurrent"][side]["lost"] for r in raw["rounds"])
        for side in ("ringq", "skip_locked")
        if "concurrent" in raw["rounds"][0]
    }
    if any(lost.values()):
        lines.append(f"LOST in the concurrent runs (committed enqueues never seen again): {lost}")
    eng = summary["engine_us"]
    lines.append("")
    lines.append(
        "engine time per call outside the database, us: enqueue call (it sends no SQL) "
        f"p50 {eng['enqueue_call_p50']['median']:.1f}, "
        f"p99 {eng['enqueue_call_p99']['median']:.1f}; "
        "dequeue call - ringq SQL only "
        f"p50 {eng['dequeue_call_p50_minus_sql']['median']:+.1f}, "
        f"p99 {eng['dequeue_call_p99_minus_sql']['median']:+.1f}"
    )
    lines.append(
        "single-entry tx/s over the 1-round-trip ceiling: "
        f"ringq enq {ratios['enq_tps_ringq_over_ceiling']['median']:.2f}, "
        f"deq {ratios['deq_tps_ringq_over_ceiling']['median']:.2f}; "
        f"skip-locked enq {ratios['enq_tps_skq_over_ceiling']['median']:.2f}, "
        f"deq {ratios['deq_tps_skq_over_ceiling']['median']:.2f}; "
        "ringq over the 2-round-trip ceiling: enq "
        f"{ratios['enq_tps_ringq_over_ceiling_2rt']['median']:.2f}, "
        f"deq {ratios['deq_tps_ringq_over_ceiling_2rt']['median']:.2f}"
    )
    vol = raw["volume"]
    if vol:
        lines.append("")
        lines.append(
            f"volume: {cfg.volume:,} entries, {cfg.batch}/tx, ringq queue of "
            f"{cfg.volume_capacity:,} slots "
            "(table size = pg_total_relation_size: heap + toast + indexes)"
        )
        lines.append(f"{'':<{w}} {'ringq':>24} {'skip-locked':>24}")
        lines.append("-" * (w + 50))
        rq, sk = vol["ringq"], vol["skip_locked"]
        for label, f in (
            ("total before", lambda v: _fmt(v["before"]["total"], "B")),
            (
                "total after 1st wrap",
                lambda v: (
                    _fmt(v["after_first_wrap"]["total"], "B") if v["after_first_wrap"] else "-"
                ),
            ),
            ("total after", lambda v: _fmt(v["after"]["total"], "B")),
            ("  heap after", lambda v: _fmt(v["after"]["heap"], "B")),
            ("  toast after", lambda v: _fmt(v["after"]["toast"], "B")),
            ("  indexes before", lambda v: _fmt(v["before"]["indexes"], "B")),
            ("  indexes after", lambda v: _fmt(v["after"]["indexes"], "B")),
            ("growth", lambda v: _pct(v["growth"])),
            ("growth since 1st wrap", lambda v: _pct(v["growth_after_first_wrap"])),
            ("dead tuples after", lambda v: f"{v['after'].get('n_dead_tup') or 0:,}"),
            ("HOT updates / updates", lambda v: _hot(v)),
            (
                "autovacuums during",
                lambda v: str(
                    (v["after"].get("autovacuum_count") or 0)
                    - (v["before"].get("autovacuum_count") or 0)
                ),
            ),
            ("entries/s each way", lambda v: _fmt(v["entries_per_s_each_way"])),
        ):
            lines.append(f"{label:<{w}} {f(rq):>24} {f(sk):>24}")
    lines.append("")
    lines.append("targets (engine speed)")
    for t in summary["targets"]:
        if t["target"] == "info":
            verdict = "(info)"
        else:
            verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT MET")
        val = "n/a" if t["value"] is None else f"{t['value']:,.2f}"
        lines.append(f"  {t['name']:<62} {val:>12} {t['target']:<10} {verdict}")
    return "\n".join(lines)


def _pct(g: float | None) -> str:
    return "n/a (was empty)" if g is None else f"{100 * g:+.1f}%"


def _hot(v: dict[str, Any]) -> str:
    a, b = v["after"], v["before"]
    upd = (a.get("n_tup_upd") or 0) - (b.get("n_tup_upd") or 0)
    hot = (a.get("n_tup_hot_upd") or 0) - (b.get("n_tup_hot_upd") or 0)
    return f"{hot:,}/{upd:,}" if upd else "-"


# -- set-up and tear-down ----------------------------------------------------------------------


def cleanup(dsn: str, names: Names, *, embedded: bool) -> None:
    drop_queues(
        dsn,
        [names.ring, names.ring_sql, names.ring_wake, names.ring_volume, names.ring_concurrent],
        embedded=embedded,
        tables=[names.skq, names.skq_volume, names.skq_concurrent, names.ceiling],
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(
        "ringq engine benchmarks: ringq vs a SKIP LOCKED queue vs a one-row-update ceiling."
    )
    p.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds (medians are reported)"
    )
    p.add_argument(
        "--single", type=int, default=2000, help="single-entry transactions each way, per round"
    )
    p.add_argument(
        "--batches", type=int, default=100, help="batched transactions each way, per round"
    )
    p.add_argument("--batch", type=int, default=100, help="entries per batched transaction")
    p.add_argument(
        "--wakeups", type=int, default=200, help="commit-to-dequeue wake-ups per round (0: skip)"
    )
    p.add_argument(
        "--volume", type=int, default=1_000_000, help="entries for the table-size test (0: skip)"
    )
    p.add_argument(
        "--volume-capacity",
        type=int,
        default=50_000,
        help="slots of the ringq queue in the table-size test",
    )
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument(
        "--concurrent-seconds",
        type=float,
        default=5.0,
        help="seconds each side of the concurrent figure runs, per round (0: skip)",
    )
    p.add_argument(
        "--producers", type=int, default=4, help="producer processes of the concurrent figure"
    )
    p.add_argument(
        "--consumers", type=int, default=2, help="consumer processes of the concurrent figure"
    )
    a = p.parse_args(argv)
    for name in ("rounds", "single", "batches", "batch", "volume_capacity", "payload",
                 "producers", "consumers"):  # fmt: skip
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.wakeups < 0 or a.volume < 0 or not a.concurrent_seconds >= 0:
        p.error("--wakeups, --volume and --concurrent-seconds must be >= 0")
    if a.batch > a.volume_capacity:
        p.error("--batch must not exceed --volume-capacity")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = config_from_options(
        Config,
        args,
        # Entries of one round sit in the queue between its enqueue and dequeue passes.
        capacity=max(args.single, args.batches * args.batch) + 64,
    )
    names = Names.fresh()
    return run_in_database(
        "engine",
        args,
        cfg,
        run=lambda dsn: run(dsn, cfg, names),
        cleanup=lambda dsn, embedded: cleanup(dsn, names, embedded=embedded),
        summarize=lambda raw: summarize(raw, cfg),
        render=lambda raw, summary, seconds: render(raw, summary, cfg, seconds),
    )


if __name__ == "__main__":
    sys.exit(main())
