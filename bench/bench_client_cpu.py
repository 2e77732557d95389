"""Client CPU per transaction and per entry: where ringq's own Python time goes.

The engine-speed issue's targets on the client: at most 1.5 us of Python per
entry in a 100-entry batch, at most 20 us per single-entry transaction beside
psycopg's own. Wall time hides them (a round trip is ~100-300 us), so this
counts the calling thread's CPU time (``time.thread_time_ns``: user and
system, the socket's kernel work included) around each transaction, for:

- ringq (two sessions on one queue): a single-entry enqueue+commit and
  dequeue+commit, an ``enqueue_many(100)``+commit and a ``dequeue_many(100)``+commit;
- the SKIP LOCKED table driven the same way on default psycopg connections
  (``INSERT``, ``DELETE ... FOR UPDATE SKIP LOCKED ... RETURNING``, 100 per
  statement through ``unnest`` / ``LIMIT``; BEGIN, the statement, COMMIT);
- psycopg's own cost of one round trip: the one-row UPDATE of the ceiling in
  autocommit, and the SKIP LOCKED table's 100-entry statements in autocommit
  (100 payloads sent, 100 rows back).

"ringq's own" is ringq's CPU minus psycopg's for one round trip of the same
size: a single-entry transaction minus the ceiling's UPDATE, a batch minus the
100-entry statement of its direction (ringq sends its statements through
libpq itself; a dequeue served from the payload cache reads no rows, so its
baseline is generous to ringq). Rounds alternate the contenders; the table
shows medians. With ``--profile``, cProfile (counting thread CPU, not wall
time) then runs over ringq's batch loops and prints the functions that take
the most time of their own, grouped by package.

It measures; it asserts no timing. ``python bench/bench_client_cpu.py --help``.
"""

from __future__ import annotations

import cProfile
import pstats
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from _benchlib import (
    CEIL_UPDATE,
    argument_parser,
    config_from_options,
    cpu_load,
    create_ceiling,
    drop_queues,
    machine,
    run_in_database,
)
from _contenders import (
    SKQ_CREATE,
    SKQ_DEQUEUE_MANY,
    SKQ_ENQUEUE_MANY,
    Driver,
    q,
    ringq_driver,
    skq_driver,
)
from psycopg import sql
from ringq.scripting import QueueSpec, create_queue

BATCH_TARGET_US = 1.5  # ringq's own Python per entry of a 100-entry batch, at most
SINGLE_TARGET_US = 20.0  # ringq's own CPU per single-entry transaction, at most


@dataclass(frozen=True)
class Config:
    rounds: int = 5
    single: int = 500  # single-entry transactions each way per round
    batches: int = 40  # batched transactions each way per round
    batch: int = 100
    payload: int = 100
    profile: bool = False


def _thread_us(fn: Callable[[], Any], n: int) -> float:
    """Mean thread CPU (us) of ``fn()`` over ``n`` calls."""
    t = time.thread_time_ns
    start = t()
    for _ in range(n):
        fn()
    return (t() - start) / n / 1000


def _cpu(d: Driver, cfg: Config) -> dict[str, float]:
    """Thread CPU (us) per single-entry transaction and per batched transaction, each way."""
    def enq() -> None:
        d.enqueue()
        d.enqueue_commit()

    def deq() -> None:
        if not d.dequeue():
            raise RuntimeError(f"{d.label}: ran dry")
        d.dequeue_commit()

    def enq_many() -> None:
        d.enqueue_batch(cfg.batch)

    def deq_many() -> None:
        if d.dequeue_batch(cfg.batch) != cfg.batch:
            raise RuntimeError(f"{d.label}: a batch came back short")

    for _ in range(10):  # warm up: statements prepared, caches filled
        enq()
        deq()
    return {
        "enqueue_tx_us": _thread_us(enq, cfg.single),
        "dequeue_tx_us": _thread_us(deq, cfg.single),
        "enqueue_batch_us": _thread_us(enq_many, cfg.batches),
        "dequeue_batch_us": _thread_us(deq_many, cfg.batches),
    }


def _one_round_trip(
    dsn: str, ceiling: str, skq: str, payload: bytes, cfg: Config
) -> dict[str, float]:
    """psycopg's CPU for one statement in one round trip (autocommit): the
    ceiling's one-row UPDATE, and the SKIP LOCKED table's 100-entry INSERT
    and DELETE ... RETURNING (refilled between rounds, untimed)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        upd = sql.SQL(CEIL_UPDATE).format(t=sql.Identifier(ceiling))
        ins, dele = q(SKQ_ENQUEUE_MANY, skq), q(SKQ_DEQUEUE_MANY, skq)
        items = [payload] * cfg.batch
        for _ in range(10):
            conn.execute(upd)
            conn.execute(ins, (items,))
            conn.execute(dele, (cfg.batch,)).fetchall()
        out = {"tx_us": _thread_us(lambda: conn.execute(upd), cfg.single)}
        out["enqueue_batch_us"] = _thread_us(lambda: conn.execute(ins, (items,)), cfg.batches)

        def take() -> None:
            if len(conn.execute(dele, (cfg.batch,)).fetchall()) != cfg.batch:
                raise RuntimeError("the SKIP LOCKED table came back short")

        out["dequeue_batch_us"] = _thread_us(take, cfg.batches)
        return out


def _profile(dsn: str, queue: str, payload: bytes, cfg: Config) -> list[dict[str, Any]]:
    """cProfile over ringq's batch loops: the top functions by their own time, per entry."""
    prof = cProfile.Profile(time.thread_time)
    with ringq_driver(dsn, queue, payload) as d:
        for _ in range(5):
            d.enqueue_batch(cfg.batch)
            d.dequeue_batch(cfg.batch)
        prof.enable()
        for _ in range(cfg.batches):
            d.enqueue_batch(cfg.batch)
            d.dequeue_batch(cfg.batch)
        prof.disable()
    entries = cfg.batches * cfg.batch * 2
    st = pstats.Stats(prof)
    rows = []
    for (path, line, func), (_cc, calls, tt, _ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({
            "function": f"{_short(path)}:{line}({func})",
            "package": _package(path),
            "calls_per_entry": calls / entries,
            "own_us_per_entry": tt * 1e6 / entries,
        })
    rows.sort(key=lambda r: -r["own_us_per_entry"])
    return rows


def _short(path: str) -> str:
    for mark in ("/ringq/", "/site-packages/"):
        if mark in path:
            return path.split(mark, 1)[1]
    return path.rsplit("/", 1)[-1]


def _package(path: str) -> str:
    if "psycopg" in path:
        return "psycopg"
    if "numpy" in path:
        return "numpy"
    if path.startswith("~") or path == "~":
        return "builtins"
    if "/engine/" in path:
        return "ringq.engine"
    if "bench" in path:
        return "bench"
    return "other"


def run(dsn: str, cfg: Config, queue: str, skq: str, ceiling: str) -> dict[str, Any]:
    payload = secrets.token_bytes(cfg.payload)
    with psycopg.connect(dsn, autocommit=True) as admin:
        create_queue(admin, QueueSpec(queue, capacity=20_000, max_payload=max(cfg.payload, 256)))
        admin.execute(q(SKQ_CREATE, skq))
        create_ceiling(admin, ceiling)
    rounds: list[dict[str, Any]] = []
    print(f"{cfg.rounds} rounds ...", file=sys.stderr, flush=True)
    for r in range(cfg.rounds):
        order = ["ringq", "skip_locked", "one_round_trip"]
        order = order[r % 3:] + order[: r % 3]
        one: dict[str, Any] = {}
        for name in order:
            if name == "ringq":
                with ringq_driver(dsn, queue, payload) as d:
                    one[name] = _cpu(d, cfg)
            elif name == "skip_locked":
                with skq_driver(dsn, skq, payload) as d:
                    one[name] = _cpu(d, cfg)
            else:
                one[name] = _one_round_trip(dsn, ceiling, skq, payload, cfg)
        rounds.append(one)
        print(f"  round {r + 1}/{cfg.rounds} done", file=sys.stderr, flush=True)
    out: dict[str, Any] = {"rounds": rounds, "machine": machine(), **cpu_load("end")}
    if cfg.profile:
        out["profile"] = _profile(dsn, queue, payload, cfg)[:25]
    return out


FIGURES = ("enqueue_tx_us", "dequeue_tx_us", "enqueue_batch_us", "dequeue_batch_us")


def summarize(raw: dict[str, Any], cfg: Config) -> dict[str, Any]:
    rounds = raw["rounds"]
    med = statistics.median
    s: dict[str, Any] = {}
    for f in FIGURES:
        base = f if "batch" in f else "tx_us"
        ringq = med(r["ringq"][f] for r in rounds)
        skq = med(r["skip_locked"][f] for r in rounds)
        one = med(r["one_round_trip"][base] for r in rounds)
        own = med(r["ringq"][f] - r["one_round_trip"][base] for r in rounds)
        per = cfg.batch if "batch" in f else 1
        s[f] = {"ringq": ringq, "skip_locked": skq, "one_round_trip": one, "ringq_own": own,
                "ringq_own_per_entry": own / per}
    s["targets"] = {
        "batch_own_per_entry_us": {
            "target": BATCH_TARGET_US,
            "enqueue": s["enqueue_batch_us"]["ringq_own_per_entry"],
            "dequeue": s["dequeue_batch_us"]["ringq_own_per_entry"],
        },
        "single_own_us": {
            "target": SINGLE_TARGET_US,
            "enqueue": s["enqueue_tx_us"]["ringq_own"],
            "dequeue": s["dequeue_tx_us"]["ringq_own"],
        },
    }
    return s


def render(raw: dict[str, Any], s: dict[str, Any], cfg: Config, seconds: float) -> str:
    lines = [
        f"client CPU (thread time), medians of {cfg.rounds} rounds; {cfg.payload} B payloads, "
        f"batches of {cfg.batch}",
        "",
        f"{'transaction':<34} {'ringq us':>10} {'SKIP LOCKED us':>15} {'1 round trip':>13} "
        f"{'ringq own us':>13} {'own/entry':>10}",
    ]
    names = {
        "enqueue_tx_us": "enqueue + commit (1 entry)",
        "dequeue_tx_us": "dequeue + commit (1 entry)",
        "enqueue_batch_us": f"enqueue_many({cfg.batch}) + commit",
        "dequeue_batch_us": f"dequeue_many({cfg.batch}) + commit",
    }
    for f in FIGURES:
        v = s[f]
        lines.append(
            f"{names[f]:<34} {v['ringq']:>10.1f} {v['skip_locked']:>15.1f} "
            f"{v['one_round_trip']:>13.1f} {v['ringq_own']:>13.1f} "
            f"{v['ringq_own_per_entry']:>10.2f}"
        )
    lines.append("(1 round trip: psycopg, autocommit: the one-row UPDATE for a single entry, "
                 "the SKIP LOCKED table's 100-entry statement for a batch)")
    t = s["targets"]
    b, one = t["batch_own_per_entry_us"], t["single_own_us"]

    def verdict(v: float, target: float) -> str:
        return "met" if v <= target else "NOT MET"

    lines += [
        "",
        f"targets: ringq's own per batched entry <= {b['target']} us: enqueue {b['enqueue']:.2f} "
        f"({verdict(b['enqueue'], b['target'])}), dequeue {b['dequeue']:.2f} "
        f"({verdict(b['dequeue'], b['target'])})",
        f"         ringq's own per single-entry transaction <= {one['target']:.0f} us: enqueue "
        f"{one['enqueue']:.1f} ({verdict(one['enqueue'], one['target'])}), dequeue "
        f"{one['dequeue']:.1f} ({verdict(one['dequeue'], one['target'])})",
    ]
    if "profile" in raw:
        lines += ["", "where ringq's batch loops spend their own time (cProfile, us per entry):"]
        by_pkg: dict[str, float] = {}
        for r in raw["profile"]:
            by_pkg[r["package"]] = by_pkg.get(r["package"], 0.0) + r["own_us_per_entry"]
        for r in raw["profile"][:15]:
            lines.append(f"  {r['own_us_per_entry']:6.2f}  {r['calls_per_entry']:6.2f} calls  "
                         f"{r['function']}")
        lines.append(
            "  top 25 by package: "
            + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_pkg.items(), key=lambda kv: -kv[1]))
        )
    lines.append(f"\n{seconds:.0f} s; load at end {raw['loadavg_at_end'][0]:.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argument_parser(__doc__.split("\n", 1)[0])
    p.add_argument("--rounds", type=int, default=Config.rounds, help="alternated rounds")
    p.add_argument("--single", type=int, default=Config.single,
                   help="single-entry transactions each way per round")
    p.add_argument("--batches", type=int, default=Config.batches,
                   help="batched transactions each way per round")
    p.add_argument("--batch", type=int, default=Config.batch, help="entries per batch")
    p.add_argument("--payload", type=int, default=Config.payload, help="payload bytes")
    p.add_argument("--profile", action="store_true",
                   help="then profile ringq's batch loops (cProfile) and print the top functions")
    args = p.parse_args(argv)
    cfg = config_from_options(Config, args)
    tag = secrets.token_hex(4)
    queue, skq, ceiling = f"bcpu_{tag}", f"bcpu_skq_{tag}", f"bcpu_ceil_{tag}"

    def cleanup(dsn: str, embedded: bool) -> None:
        drop_queues(dsn, [queue], embedded=embedded, tables=[skq, ceiling])

    return run_in_database(
        "client_cpu", args, cfg,
        lambda dsn: run(dsn, cfg, queue, skq, ceiling),
        cleanup,
        lambda raw: summarize(raw, cfg),
        lambda raw, s, secs: render(raw, s, cfg, secs),
    )


if __name__ == "__main__":
    sys.exit(main())
