"""Groups benchmark (issue 16): a grouped queue against a ``shared`` and a ``single`` queue.

The same traffic on three queues of one database: ``--entries`` entries in
``--groups`` groups (round-robin: entry ``i`` is in group ``i % groups``), each
payload naming its group and its sequence within the group. The grouped queue
gets them with ``enqueue_many(..., group=...)``; the ``shared`` and ``single``
queues get the same payloads without a group. Each queue is filled (not
timed), then ``--consumers`` forked processes, started together, drain it one
entry per transaction: dequeue, INSERT a row into a log table (the kind, the
round, the consumer, the group, the per-group sequence, the queue sequence,
the monotonic time the dequeue returned and the time just before the commit),
commit. The clock runs from the common start to the last commit.

From the log: every entry handled exactly once; per group, ordered by
dequeue time, an *order break* is an entry whose group sequence is below its
predecessor's, an *overlap* an entry dequeued before its predecessor's
transaction began to commit (two of a group in flight). A grouped queue must
show neither; a shared queue shows both (it does not order groups); a single
queue neither.

The group bookkeeping is also timed in-process: ``Ring.claim`` under the
queue lock on a grouped and an ungrouped queue holding the same window, with
no group busy and with many busy (entries held, one per group), microseconds
per claim.

Rounds interleave the three kinds (the order rotates); the ratios are taken
within a round and the table shows their median. Run ``python
bench/bench_groups.py --help``; ``bench/README.md`` says what each figure means.
"""

from __future__ import annotations

import multiprocessing as mp
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from _benchlib import (
    argument_parser,
    cpu_load,
    drop_queues,
    machine,
    run_in_database,
    run_together,
    server_settings,
)
from psycopg import sql
from ringq.engine import Session, connect
from ringq.engine import layout as L
from ringq.scripting import QueueSpec, create_queue

FORK = mp.get_context("fork")
WHO = "groups: a consumer"  # named in a failure
KINDS = ("grouped", "shared", "single")
IDLE_WAIT = 0.05  # s a consumer waits in dequeue() before it looks whether the run is over
FILL_BATCH = 500  # entries per enqueue transaction of the (untimed) fill

LOG_CREATE = (
    "CREATE TABLE {t} (kind text, round int, consumer int, grp int, gseq int, seq bigint,"
    " taken bigint, committing bigint)"
)
LOG_INSERT = "INSERT INTO {t} VALUES (%s, %s, %s, %s, %s, %s, %s, %s)"
LOG_READ = (
    "SELECT grp, gseq, seq, taken, committing FROM {t} WHERE kind = %s AND round = %s"
    " ORDER BY grp, taken"
)


@dataclass(frozen=True)
class Config:
    entries: int
    groups: int
    consumers: int
    rounds: int
    payload: int
    claims: int
    busy: tuple[int, ...]


@dataclass(frozen=True)
class Names:
    """The objects one run creates (unique, so ``--dsn`` never touches anyone else's)."""

    tag: str

    def queue(self, kind: str) -> str:
        return f"bench_{self.tag}_{kind[:2]}"

    @property
    def log(self) -> str:
        return f"gbench_{self.tag}_log"

    @property
    def queues(self) -> list[str]:
        return [self.queue(k) for k in KINDS]


def payload_of(group: int, gseq: int, size: int) -> bytes:
    """``<group>:<sequence in the group>:`` padded with ``x`` to ``size`` bytes."""
    head = f"{group}:{gseq}:".encode()
    return head + b"x" * max(0, size - len(head))


def parse_payload(payload: bytes) -> tuple[int, int]:
    group, gseq, _rest = payload.split(b":", 2)
    return int(group), int(gseq)


def fill(dsn: str, queue: str, cfg: Config, *, grouped: bool) -> float:
    """Enqueue the run's entries (round-robin over the groups); seconds it took."""
    t0 = time.perf_counter()
    with connect(dsn, producer="bench-fill") as s:
        for start in range(0, cfg.entries, FILL_BATCH):
            idx = range(start, min(cfg.entries, start + FILL_BATCH))
            items = [payload_of(i % cfg.groups, i // cfg.groups, cfg.payload) for i in idx]
            groups = [f"g{i % cfg.groups}" for i in idx] if grouped else None
            s.enqueue_many(queue, items, group=groups)
            s.commit()
    return time.perf_counter() - t0


# -- the consumers ---------------------------------------------------------------------------


def _consumer(
    dsn: str, queue: str, log: str, kind: str, rnd: int, idx: int, total: int,
    done: Any, pipe: Connection,
) -> None:  # fmt: skip
    try:
        with connect(dsn) as s:
            s.queue_info(queue)
            conn = s.connection
            insert = sql.SQL(LOG_INSERT).format(t=sql.Identifier(log))
            pipe.send(("ready", None))
            t_start = pipe.recv()
            time.sleep(max(0.0, t_start - time.monotonic()))
            n = idle = 0
            last_ns = 0
            while done.value < total:
                m = s.dequeue(queue, wait=IDLE_WAIT)
                if m is None:
                    idle += 1
                    continue
                taken = time.monotonic_ns()
                grp, gseq = parse_payload(m.payload)
                conn.execute(insert, (kind, rnd, idx, grp, gseq, m.seq, taken,
                                      time.monotonic_ns()))  # fmt: skip
                s.commit()
                last_ns = time.monotonic_ns()
                n += 1
                with done.get_lock():
                    done.value += 1
            pipe.send(("done", {"entries": n, "idle": idle, "last_commit_ns": last_ns}))
    except BaseException as exc:  # report to the parent instead of hanging it
        pipe.send(("error", repr(exc)))
        raise


def drain_round(dsn: str, queue: str, log: str, kind: str, rnd: int, cfg: Config) -> dict[str, Any]:
    """Fork the consumers, start them together, wait until they drained the queue."""
    done = FORK.Value("q", 0)
    t_start, counts = run_together(
        _consumer,
        [(dsn, queue, log, kind, rnd, i, cfg.entries, done) for i in range(cfg.consumers)],
        lambda t: t, 3600.0, WHO,
    )
    seconds = (max(c["last_commit_ns"] for c in counts) - t_start * 1e9) / 1e9
    return {
        "seconds": seconds,
        "entries_per_s": cfg.entries / seconds,
        "per_consumer": [c["entries"] for c in counts],
        "idle_dequeues": sum(c["idle"] for c in counts),
    }


def check_log(conn: psycopg.Connection[Any], log: str, kind: str, rnd: int,
              total: int) -> dict[str, int]:  # fmt: skip
    """Once, order breaks and overlaps of one round, from its log rows."""
    rows = conn.execute(
        sql.SQL(LOG_READ).format(t=sql.Identifier(log)), (kind, rnd)
    ).fetchall()
    order_breaks = overlaps = 0
    prev: tuple[Any, ...] | None = None
    for r in rows:  # by group, then dequeue time
        if prev is not None and prev[0] == r[0]:
            order_breaks += r[1] < prev[1]
            overlaps += r[3] < prev[4]
        prev = r
    handled = len(rows)
    distinct = len({(r[0], r[1]) for r in rows})
    return {
        "handled": handled,
        "duplicates": handled - distinct,
        "missing": total - distinct,
        "order_breaks": order_breaks,
        "overlaps": overlaps,
    }


COUNTERS = {
    "group_skips": L.Q_N_GROUP_SKIPS,  # ready entries a claim passed over: group busy
    "cache_hits": L.Q_N_CACHE_HITS,
    "cache_misses": L.Q_N_CACHE_MISSES,
    "empty_hits": L.Q_N_EMPTY,  # claims that found nothing
    "wakeups": L.Q_N_WAKEUPS,
}


def counters(s: Session, queue: str) -> dict[str, int]:
    """The queue's section counters the table explains the figures with."""
    q = s.section.queues
    qb = s.ring(queue).qb
    return {name: int(q[qb + word]) for name, word in COUNTERS.items()}


def bench_round(
    dsn: str, names: Names, cfg: Config, kind: str, rnd: int
) -> dict[str, Any]:
    queue = names.queue(kind)
    fill_s = fill(dsn, queue, cfg, grouped=kind == "grouped")
    with connect(dsn) as s:
        before = counters(s, queue)
    out = {"fill_seconds": fill_s, **drain_round(dsn, queue, names.log, kind, rnd, cfg)}
    with connect(dsn) as s:
        after = counters(s, queue)
        out["counters"] = {k: after[k] - before[k] for k in after}
        left = len(s.dequeue_many(queue, cfg.entries))
        s.rollback()
        out["left_on_queue"] = left
    with psycopg.connect(dsn, autocommit=True) as conn:
        out.update(check_log(conn, names.log, kind, rnd, cfg.entries))
    return out


# -- the group bookkeeping, in-process ----------------------------------------------------------


def _hold(s: Session, queue: str, n: int) -> list[int]:
    """Claim ``n`` entries under the queue lock (one per group in a grouped queue); their slots."""
    if not n:
        return []
    ring, sec = s.ring(queue), s.section
    sec.lock_queue(ring.qidx)
    try:
        got = ring.claim_many(s.owner, s.backend_pid, n, exclusive=False)
    finally:
        sec.unlock_queue(ring.qidx)
    return [slot for slot, _seq in got]


def _release(s: Session, queue: str, slots: list[int]) -> None:
    ring, sec = s.ring(queue), s.section
    sec.lock_queue(ring.qidx)
    try:
        for slot in slots:
            ring.finish_dequeue(slot, consumed=False, exclusive=False)
    finally:
        sec.unlock_queue(ring.qidx)


def _time_claims(s: Session, queue: str, n: int) -> dict[str, float]:
    """Median and p90 microseconds of ``n`` ``Ring.claim`` calls under the queue lock
    (each claimed entry is put back at once), and of ``Ring.busy_groups``."""
    ring, sec = s.ring(queue), s.section
    claim_ns: list[int] = []
    busy_ns: list[int] = []
    for _ in range(n):
        sec.lock_queue(ring.qidx)
        try:
            t0 = time.perf_counter_ns()
            got = ring.claim(s.owner, s.backend_pid, exclusive=False)
            t1 = time.perf_counter_ns()
            ring.busy_groups()
            t2 = time.perf_counter_ns()
            if got is None:
                raise RuntimeError(f"claim found nothing in {queue}")
            ring.finish_dequeue(got[0], consumed=False, exclusive=False)
        finally:
            sec.unlock_queue(ring.qidx)
        claim_ns.append(t1 - t0)
        busy_ns.append(t2 - t1)
    c = np.asarray(claim_ns) / 1000.0
    return {
        "claim_p50_us": float(np.percentile(c, 50)),
        "claim_p90_us": float(np.percentile(c, 90)),
        "busy_groups_p50_us": float(np.median(np.asarray(busy_ns) / 1000.0)),
    }


def claim_cost(dsn: str, names: Names, cfg: Config) -> list[dict[str, Any]]:
    """``Ring.claim`` on the grouped and the shared queue, each filled with the run's
    entries, with ``busy`` entries held (one per group) for each level of ``cfg.busy``."""
    grouped, plain = names.queue("grouped"), names.queue("shared")
    fill(dsn, grouped, cfg, grouped=True)
    fill(dsn, plain, cfg, grouped=False)
    out = []
    with connect(dsn) as s:
        for busy in cfg.busy:
            row: dict[str, Any] = {"busy_groups": busy}
            for kind, queue in (("grouped", grouped), ("ungrouped", plain)):
                held = _hold(s, queue, busy)
                try:
                    row[kind] = _time_claims(s, queue, cfg.claims)
                finally:
                    _release(s, queue, held)
            row["cost_us"] = row["grouped"]["claim_p50_us"] - row["ungrouped"]["claim_p50_us"]
            out.append(row)
        for queue in (grouped, plain):  # empty them again (a grouped batch: one per group)
            while s.dequeue_many(queue, cfg.entries):
                s.commit()
    return out


# -- the run --------------------------------------------------------------------------------------


def run(dsn: str, cfg: Config, names: Names) -> dict[str, Any]:
    capacity = cfg.entries + 64
    with psycopg.connect(dsn, autocommit=True) as admin:
        for kind in KINDS:
            mode = "single" if kind == "single" else "shared"
            create_queue(admin, QueueSpec(names.queue(kind), capacity, max(cfg.payload, 64),
                                          dequeue_mode=mode))  # fmt: skip
        admin.execute(sql.SQL(LOG_CREATE).format(t=sql.Identifier(names.log)))
        env = {
            "server": server_settings(admin),
            **machine(),
            "psycopg_impl": psycopg.pq.__impl__,
            "numpy": np.__version__,
            **cpu_load("start"),
        }
    rounds: list[dict[str, Any]] = []
    for r in range(cfg.rounds):
        order = list(KINDS[r % 3 :] + KINDS[: r % 3])
        res: dict[str, Any] = {"round": r + 1, "order": order}
        for kind in order:
            print(f"round {r + 1}/{cfg.rounds}: {kind} ...", file=sys.stderr, flush=True)
            res[kind] = bench_round(dsn, names, cfg, kind, r + 1)
            print(f"  {res[kind]['entries_per_s']:,.0f} entries/s", file=sys.stderr, flush=True)
        rounds.append(res)
    print("claim cost ...", file=sys.stderr, flush=True)
    claims = claim_cost(dsn, names, cfg)
    env.update(cpu_load("end"))
    return {"environment": env, "rounds": rounds, "claim_cost": claims}


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    rounds = raw["rounds"]

    def med(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    figures = {k: med([r[k]["entries_per_s"] for r in rounds]) for k in KINDS}
    ratios = {
        "grouped_over_shared": med([r["grouped"]["entries_per_s"] / r["shared"]["entries_per_s"]
                                    for r in rounds]),
        "grouped_over_single": med([r["grouped"]["entries_per_s"] / r["single"]["entries_per_s"]
                                    for r in rounds]),
    }  # fmt: skip
    checks = {
        k: {c: sum(r[k][c] for r in rounds)
            for c in ("order_breaks", "overlaps", "duplicates", "missing", "left_on_queue")}
        for k in KINDS
    }  # fmt: skip
    g = checks["grouped"]
    targets = [
        {"name": "grouped / shared entries/s", "value": ratios["grouped_over_shared"]["median"],
         "target": ">= 0.8", "met": ratios["grouped_over_shared"]["median"] >= 0.8},
        {"name": "grouped / single entries/s", "value": ratios["grouped_over_single"]["median"],
         "target": ">= 2", "met": ratios["grouped_over_single"]["median"] >= 2.0},
        {"name": "grouped per-group order breaks", "value": g["order_breaks"], "target": "== 0",
         "met": g["order_breaks"] == 0},
        {"name": "grouped overlaps (two of a group in flight)", "value": g["overlaps"],
         "target": "== 0", "met": g["overlaps"] == 0},
        {"name": "grouped entries lost or duplicated",
         "value": g["missing"] + g["duplicates"] + g["left_on_queue"], "target": "== 0",
         "met": g["missing"] + g["duplicates"] + g["left_on_queue"] == 0},
    ]  # fmt: skip
    return {"figures": figures, "ratios": ratios, "checks": checks, "targets": targets}


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    e = raw["environment"]
    fig, rat, chk = summary["figures"], summary["ratios"], summary["checks"]
    header = (
        f"groups benchmark: {cfg.entries:,} entries in {cfg.groups:,} groups, "
        f"{cfg.consumers} consumer processes, {cfg.rounds} rounds; median [min-max]; "
        f"run took {seconds:.0f} s"
    )
    load = (
        f"load average at start {e['loadavg_at_start'][0]:.2f}, at end "
        f"{e['loadavg_at_end'][0]:.2f} ({e['cpus']} CPUs); server fsync="
        f"{e['server']['fsync']}, synchronous_commit={e['server']['synchronous_commit']}"
    )
    lines = [
        header,
        load,
        "",
        f"{'queue':<9} {'entries/s':>24} {'order breaks':>13} {'overlaps':>9} {'lost/dup':>9}",
    ]
    for k in KINDS:
        d, c = fig[k], chk[k]
        cell = f"{d['median']:,.0f} [{d['min']:,.0f}-{d['max']:,.0f}]"
        bad = c["missing"] + c["duplicates"] + c["left_on_queue"]
        lines.append(f"{k:<9} {cell:>24} {c['order_breaks']:>13} {c['overlaps']:>9} {bad:>9}")
    lines += ["", "ratio (per round, median [min-max]):"]
    for key, label in (("grouped_over_shared", "grouped / shared"),
                       ("grouped_over_single", "grouped / single")):  # fmt: skip
        d = rat[key]
        lines.append(f"  {label:<18} {d['median']:.2f} [{d['min']:.2f}-{d['max']:.2f}]")
    title = (
        f"Ring.claim under the queue lock, p50 us (p90), same window ({cfg.entries:,} entries), "
        f"{cfg.claims} claims each:"
    )
    columns = f"{'busy groups':>11} {'grouped':>16} {'ungrouped':>16} {'cost':>8}"
    lines += ["", title, f"  {columns} {'busy_groups()':>14}"]
    for row in raw["claim_cost"]:
        g, u = row["grouped"], row["ungrouped"]
        lines.append(
            f"  {row['busy_groups']:>11,} {g['claim_p50_us']:>8.1f} ({g['claim_p90_us']:>5.1f})"
            f" {u['claim_p50_us']:>8.1f} ({u['claim_p90_us']:>5.1f}) {row['cost_us']:>+8.1f}"
            f" {g['busy_groups_p50_us']:>14.1f}"
        )
    lines += ["", "targets:"]
    for t in summary["targets"]:
        v = t["value"]
        shown = f"{v:.2f}" if isinstance(v, float) else str(v)
        lines.append(f"  {t['name']:<46} {shown:>8} {t['target']:>6}  "
                     f"{'met' if t['met'] else 'NOT MET'}")  # fmt: skip
    return "\n".join(lines)


def cleanup(dsn: str, names: Names, *, embedded: bool) -> None:
    drop_queues(dsn, names.queues, embedded=embedded, tables=[names.log])


def parse_args(argv: list[str] | None) -> Any:
    p = argument_parser(__doc__.split("\n", 1)[0])
    p.add_argument("--json", dest="out", type=Path, help="the same as --out")
    p.add_argument("--entries", type=int, default=20_000, help="entries per queue and round")
    p.add_argument("--groups", type=int, default=1_000, help="groups of the grouped queue")
    p.add_argument("--consumers", type=int, default=4, help="consumer processes")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (each kind once)")
    p.add_argument("--payload", type=int, default=100, help="payload bytes")
    p.add_argument("--claims", type=int, default=2_000, help="timed Ring.claim calls per case")
    p.add_argument("--busy", default="0,4,100,999",
                   help="busy groups (entries held) for the claim timing, comma-separated")
    a = p.parse_args(argv)
    for name in ("entries", "groups", "consumers", "rounds", "payload", "claims"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1")
    try:
        a.busy = tuple(int(x) for x in a.busy.split(","))
    except ValueError:
        p.error("--busy must be integers separated by commas")
    if any(not 0 <= b < min(a.groups, a.entries) for b in a.busy):
        p.error("each --busy level must be below --groups and --entries")
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cfg = Config(args.entries, args.groups, args.consumers, args.rounds, args.payload,
                 args.claims, args.busy)  # fmt: skip
    names = Names(secrets.token_hex(4))
    return run_in_database(
        "groups",
        args,
        cfg,
        run=lambda dsn: run(dsn, cfg, names),
        cleanup=lambda dsn, embedded: cleanup(dsn, names, embedded=embedded),
        summarize=lambda raw: summarize(raw),
        render=lambda raw, summary, seconds: render(raw, summary, cfg, seconds),
    )


if __name__ == "__main__":
    sys.exit(main())
