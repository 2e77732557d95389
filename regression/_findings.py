"""The report's numbers and tables, from the proof's DataFrames and the cycles' rows.

:func:`tally` counts the checks of :mod:`._checks` (one Spark job per
question) into ``Report.violations``, ``examples``, ``counts``, ``latency_ms``,
the per-queue rows and the grouped queue's figures, and the waits of delayed and retried entries
(:func:`_wait_figures`). The rest folds what the
workload itself recorded per cycle (``regress_cycle.stats``) into the report:
the global section's per-queue counters, chaos kills, fail-over timings.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from . import _report as R
from . import _store
from ._checks import Checked, Waits
from ._store import QueueRef, RunInfo, sql_taking

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

EXAMPLES = 5
VERDICTS = (R.CORRUPT, R.ROLLED_BACK_DELIVERED, R.PHANTOM)  # the judged first deliveries' kinds
CHAOS_COUNTS = (
    "producers", "consumers", "monitor", "pg_restarts", "reconnects", "resumed",
    "sql_consumers", "sql_backends",
)
# per kind of consumer, what the cycles' workers counted (stats "consumers", "sql_consumers")
CONSUMER_KINDS = {"linked": "consumers", "sql": "sql_consumers"}
CONSUMER_COUNTS = ("committed_entries", "committed_tx", "rolled_back_tx", "redelivered")


@dataclass
class _Counts:
    """What the Spark jobs counted, before it goes into the report."""

    recv_tot: Any  # rows, extra, redelivered over every received row
    per_queue: dict[Any, Any]  # judged rollup by queue (None: the totals)
    lost_q: dict[int, int]
    undrained_q: dict[int, int]  # committed, still queued when the workload ended
    ooo_q: dict[int, int]
    group_breaks: int
    in_flight_twice: int
    reused: int
    sent_tx: list[Any]  # per transaction kind: n, multi
    sent_q: dict[int, tuple[int, int]]  # per queue: entries, bytes
    rb_tx: list[Any]  # per rolled-back transaction and reason
    by_sql: int  # first deliveries taken by SQL consumers


def tally(run: RunInfo, c: Checked, acked_lost: DataFrame | None, report: R.Report) -> None:
    """Count the checks into ``report`` (violations, examples, figures); frees ``c``."""
    counts = _count(run, c, acked_lost)
    _violations(counts, report)
    report.examples = _examples(run, c, acked_lost, report.violations)
    _figures(run, counts, report)
    if c.grouped is not None:
        report.groups = _group_figures(run, c.grouped, c.recv, c.sent)
        report.groups.update(
            order_breaks=counts.group_breaks, in_flight_twice=counts.in_flight_twice
        )
    if c.waits is not None:
        _wait_figures(run, c.waits, report)
    c.unpersist()


def _wait_figures(run: RunInfo, w: Waits, report: R.Report) -> None:
    """Delayed and retried entries: how many, how many of their takes were
    checked, the violations (with examples) and how late after their time
    they were taken (ms)."""
    from pyspark.sql import functions as F

    names = {ref.idx: ref.name for ref in run.queues}

    def takes(df: DataFrame) -> Any:
        ms = F.col("after_us") / 1000.0
        return df.agg(
            F.count("*").alias("n"),
            F.count_if(F.col("after_us") < 0).alias("early"),
            F.percentile_approx(ms, [0.5, 0.95, 0.99], 10000).alias("pct"),
            F.max(ms).alias("max"),
            F.avg(ms).alias("avg"),
        ).collect()[0]

    def examples(df: DataFrame, *cols: str) -> list[dict[str, Any]]:
        out = []
        for r in df.select(*cols).limit(EXAMPLES).collect():
            d: dict[str, Any] = {
                k: str(v) if isinstance(v, datetime) else v for k, v in r.asDict().items()
            }
            d["queue"] = names.get(d["queue"], d["queue"])
            out.append(d)
        return out

    due = w.due.agg(F.count("*").alias("n"), F.count("not_before").alias("read")).collect()[0]
    delayed, retaken = takes(w.delayed), takes(w.retaken)
    n_retried = w.retried.count()
    v = report.violations
    v[R.TAKEN_EARLY] = int(delayed["early"] or 0)
    v[R.RETRIED_EARLY] = int(retaken["early"] or 0)
    if v[R.TAKEN_EARLY]:
        report.examples[R.TAKEN_EARLY] = examples(
            w.early, "cycle", "queue", "qseq", "deliveries", "delay", "not_before", "deq_at",
            "after_us",
        )
    if v[R.RETRIED_EARLY]:
        report.examples[R.RETRIED_EARLY] = examples(
            w.retried_early, "cycle", "queue", "qseq", "deliveries", "rb_at", "backoff",
            "deq_at", "after_us",
        )
    report.waits = {
        "delayed": {
            "entries": int(due["n"] or 0),
            "due_read": int(due["read"] or 0),
            "taken": int(delayed["n"] or 0),
            "early": v[R.TAKEN_EARLY],
            "max_delay_s": run.config.max_delay,
            "share": run.config.delayed_share,
        },
        "retried": {
            "entries": n_retried,
            "taken": int(retaken["n"] or 0),
            "early": v[R.RETRIED_EARLY],
            "backoff_s": run.config.retry_delay,
        },
        "delayed_after_ms": _lat(delayed) if delayed["n"] else {},
        "retried_after_ms": _lat(retaken) if retaken["n"] else {},
    }


def _count(run: RunInfo, c: Checked, acked_lost: DataFrame | None) -> _Counts:
    from pyspark.sql import functions as F

    # One job per question; the per-queue rows of a rollup carry the totals in the row
    # whose queue is null.
    recv_tot = c.nth.agg(
        F.count("*").alias("rows"),
        F.count_if(F.col("nth") > 1).alias("extra"),
        F.count_if(F.col("deliveries") > 1).alias("redelivered"),
    ).collect()[0]
    per_queue = {
        r["queue"]: r
        for r in c.judged.rollup("queue").agg(
            F.count("*").alias("delivered"),
            *[F.count_if(F.col("verdict") == k).alias(k) for k in VERDICTS],
            F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], 10000).alias("pct"),
            F.max("latency_ms").alias("max"),
            F.avg("latency_ms").alias("avg"),
        ).collect()
    }
    lost_q = {r["queue"]: int(r["count"]) for r in c.lost.groupBy("queue").count().collect()}
    undrained_q = {
        r["queue"]: int(r["count"]) for r in c.undrained.groupBy("queue").count().collect()
    }
    ooo_q = {r["queue"]: int(r["count"]) for r in c.ooo.groupBy("queue").count().collect()}
    group_breaks = ooo_q.pop(c.grouped.idx, 0) if c.grouped is not None else 0
    in_flight_twice = c.held.count() if c.held is not None else 0
    n_reused = c.reused.count()
    sent_tx = (
        c.sent.groupBy("cycle", "producer", "tx")
        .agg(F.first("kind").alias("kind"), F.countDistinct("queue").alias("nq"))
        .groupBy("kind")
        .agg(F.count("*").alias("n"), F.count_if(F.col("nq") > 1).alias("multi"))
        .collect()
    )
    sent_q = {
        r["queue"]: (int(r["n"]), int(r["bytes"] or 0))
        for r in c.sent.groupBy("queue")
        .agg(F.count("*").alias("n"), F.sum("length").alias("bytes"))
        .collect()
    }
    rb_tx = c.rolled.groupBy("cycle", "producer", "tx", "reason").count().collect()
    if acked_lost is not None:
        for r in acked_lost.groupBy("queue").count().collect():
            lost_q[r["queue"]] = lost_q.get(r["queue"], 0) + int(r["count"])
    return _Counts(
        recv_tot, per_queue, lost_q, undrained_q, ooo_q, group_breaks, in_flight_twice,
        n_reused, sent_tx, sent_q, rb_tx, _by_sql(run, c),
    )


def _by_sql(run: RunInfo, c: Checked) -> int:
    """First deliveries taken by SQL consumers: their worker numbers follow
    their queue's linked consumers' (one, or ``grouped_consumers``)."""
    from pyspark.sql import functions as F

    if not run.config.sql_consumers:
        return 0
    linked = F.lit(1)
    if c.grouped is not None:
        linked = F.when(F.col("queue") == c.grouped.idx, run.config.grouped_consumers).otherwise(1)
    return int(c.judged.filter(F.col("worker") >= linked).count())


def _violations(n: _Counts, report: R.Report) -> None:
    total = n.per_queue.get(None)
    v = report.violations
    v[R.LOST] = sum(n.lost_q.values())
    v[R.NOT_DRAINED] = sum(n.undrained_q.values())
    v[R.DUPLICATE] = int(n.recv_tot["extra"] or 0)
    v[R.OUT_OF_ORDER] = sum(n.ooo_q.values())
    v[R.GROUP_ORDER] = n.group_breaks
    v[R.GROUP_IN_FLIGHT] = n.in_flight_twice
    for k in VERDICTS:
        v[k] = int(total[k]) if total else 0
    v[R.SEQ_REUSED] = n.reused


def _examples(
    run: RunInfo, c: Checked, acked_lost: DataFrame | None, v: dict[str, int]
) -> dict[str, list[dict[str, Any]]]:
    """Up to EXAMPLES rows of each kind of violation found (queues by name)."""
    from pyspark.sql import functions as F

    names = {ref.idx: ref.name for ref in run.queues}

    def rows(df: DataFrame, *cols: str) -> list[dict[str, Any]]:
        out = []
        for r in df.select(*cols).limit(EXAMPLES).collect():
            d = r.asDict()
            if "queue" in d:
                d["queue"] = names.get(d["queue"], d["queue"])
            out.append(d)
        return out

    ex: dict[str, list[dict[str, Any]]] = {}
    if v[R.LOST]:
        ex[R.LOST] = rows(c.lost, "cycle", "queue", "qseq", "producer", "pseq", "tx")
        if acked_lost is not None and len(ex[R.LOST]) < EXAMPLES:
            ex[R.LOST] += rows(
                acked_lost.withColumn("acknowledged", F.lit(True)),
                "cycle", "queue", "qseq", "producer", "pseq", "tx", "acknowledged",
            )
    if v[R.NOT_DRAINED]:
        ex[R.NOT_DRAINED] = rows(c.undrained, "cycle", "queue", "qseq", "producer", "pseq", "tx")
    if v[R.DUPLICATE]:
        ex[R.DUPLICATE] = rows(c.extra, "cycle", "queue", "qseq", "recv_order", "deliveries")
    if v[R.OUT_OF_ORDER]:
        ex[R.OUT_OF_ORDER] = rows(
            c.ooo.filter(F.col("grp").isNull()),
            "cycle", "queue", "producer", "pseq", "prev_pseq", "recv_order",
        )
    if v[R.GROUP_ORDER]:
        ex[R.GROUP_ORDER] = rows(
            c.ooo.filter(F.col("grp").isNotNull()),
            "cycle", "queue", "grp", "producer", "pseq", "prev_pseq", "deq_ns",
        )
    if v[R.GROUP_IN_FLIGHT] and c.held is not None:
        ex[R.GROUP_IN_FLIGHT] = rows(
            c.held, "cycle", "queue", "msg_group", "qseq", "worker", "deq_ns", "held_until_ns"
        )
    for kind in VERDICTS:
        if v[kind]:
            ex[kind] = rows(
                c.judged.filter(F.col("verdict") == kind),
                "cycle",
                "queue",
                "qseq",
                "plen",
                "length",
                "check_ok",
                "h_producer",
                "h_pseq",
                "producer",
                "pseq",
                "grp",
                "msg_group",
            )
    if v[R.SEQ_REUSED]:
        ex[R.SEQ_REUSED] = rows(c.reused, "cycle", "queue", "qseq", "count")
    return ex


def _figures(run: RunInfo, n: _Counts, report: R.Report) -> None:
    """Counts, latency and the per-queue rows."""
    total = n.per_queue.get(None)
    kinds = {int(r["kind"]): int(r["n"]) for r in n.sent_tx}
    rb_by_reason: dict[str, int] = {}
    for r in n.rb_tx:
        rb_by_reason[str(r["reason"])] = rb_by_reason.get(str(r["reason"]), 0) + 1
    report.counts = {
        "committed": sum(k for k, _ in n.sent_q.values()),
        "committed_bytes": sum(b for _, b in n.sent_q.values()),
        "rolled_back": sum(int(r["count"]) for r in n.rb_tx),
        "received_rows": int(n.recv_tot["rows"]),
        "delivered": int(total["delivered"]) if total else 0,
        "redelivered": int(n.recv_tot["redelivered"] or 0),
        "delivered_sql": n.by_sql,
        "transactions": {
            "simple": kinds.get(1, 0),
            "two_phase": kinds.get(2, 0),
            "multi_queue": sum(int(r["multi"]) for r in n.sent_tx),
            "rolled_back": len({(r["cycle"], r["producer"], r["tx"]) for r in n.rb_tx}),
            "rolled_back_by_reason": rb_by_reason,
        },
    }
    report.latency_ms = _lat(total) if total else {}
    report.queues = []
    for ref in run.queues:
        entries, nbytes = n.sent_q.get(ref.idx, (0, 0))
        row = n.per_queue.get(ref.idx)
        report.queues.append({
            "name": ref.name,
            "index": ref.idx,
            "payload_size": ref.payload_size,
            "capacity": ref.capacity,
            "committed": entries,
            "committed_bytes": nbytes,
            "delivered": int(row["delivered"]) if row else 0,
            "violations": {
                R.LOST: n.lost_q.get(ref.idx, 0),
                R.NOT_DRAINED: n.undrained_q.get(ref.idx, 0),
                R.OUT_OF_ORDER: n.ooo_q.get(ref.idx, 0),
                **{k: int(row[k]) if row else 0 for k in VERDICTS},
                **(
                    {R.GROUP_ORDER: n.group_breaks, R.GROUP_IN_FLIGHT: n.in_flight_twice}
                    if ref.grouped
                    else {}
                ),
            },
            "latency_ms": _lat(row) if row else {},
        })


def _group_figures(
    run: RunInfo, grouped: QueueRef, recv: DataFrame, sent: DataFrame
) -> dict[str, Any]:
    """What the grouped queue did: entries, groups, consumers, and the most
    entries held at once (dequeued, commit not begun), over all groups."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    rows = recv.filter(F.col("queue") == grouped.idx)
    got = rows.agg(
        F.count("*").alias("rows"),
        F.countDistinct("msg_group").alias("groups"),
        F.countDistinct("worker").alias("workers"),
    ).collect()[0]
    committed = sent.filter(F.col("queue") == grouped.idx).count()
    # Held at once: +1 at each dequeue, -1 at each commit, summed in time order
    # (a commit before a dequeue of the same nanosecond).
    edges = rows.selectExpr("cycle", "deq_ns AS t", "1 AS d").unionByName(
        rows.selectExpr("cycle", "commit_ns AS t", "-1 AS d")
    )
    running = edges.withColumn(
        "held", F.sum("d").over(Window.partitionBy("cycle").orderBy("t", "d"))
    )
    most = running.agg(F.max("held").alias("most")).collect()[0]["most"]
    return {
        "queue": grouped.name,
        "groups": run.config.groups,
        "groups_seen": int(got["groups"] or 0),
        "consumers": run.config.grouped_consumers,
        "sql_consumers": sum(1 for q, _w in sql_taking(run.queues, run.config)
                             if q == grouped.idx),
        "consumers_seen": int(got["workers"] or 0),
        "committed": committed,
        "received_rows": int(got["rows"] or 0),
        "most_held_at_once": int(most or 0),
    }


def _lat(row: Any) -> dict[str, float]:
    pct = row["pct"] or [0.0, 0.0, 0.0]
    return {
        "p50": round(float(pct[0]), 3),
        "p95": round(float(pct[1]), 3),
        "p99": round(float(pct[2]), 3),
        "max": round(float(row["max"] or 0.0), 3),
        "avg": round(float(row["avg"] or 0.0), 3),
    }


def add_section_stats(report: R.Report, run: RunInfo, rows: list[_store.CycleRow]) -> None:
    """Fold the workload's own counters (from the global section) into the per-queue figures."""
    by_name = {q["name"]: q for q in report.queues}
    for ref in run.queues:
        q = by_name.get(ref.name)
        if q is None:
            q = {
                "name": ref.name,
                "index": ref.idx,
                "payload_size": ref.payload_size,
                "capacity": ref.capacity,
            }
            report.queues.append(q)
        for row in rows:
            st = ((row.stats or {}).get("queues") or {}).get(ref.name) or {}
            q["max_depth"] = max(int(q.get("max_depth", 0)), int(st.get("max_depth", 0)))
            for k in ("full_hits", "empty_hits", "poisoned", "repairs", "resyncs", "leftover"):
                q[k] = int(q.get(k, 0)) + int(st.get(k, 0))


def chaos_totals(rows: list[_store.CycleRow]) -> dict[str, int]:
    """Kills per kind over the cycles that ran with chaos (empty: none did)."""
    out: dict[str, int] = {}
    for row in rows:
        ch = (row.stats or {}).get("chaos")
        if not ch:
            continue
        for k in CHAOS_COUNTS:
            out[k] = out.get(k, 0) + int(ch.get(k, 0))
    return out


def consumer_totals(rows: list[_store.CycleRow], workload_s: float) -> dict[str, Any]:
    """What each kind of consumer (linked, SQL) took over ``rows``, with its
    processes and entries/s over ``workload_s`` (empty: a run without SQL consumers)."""
    if not any((row.stats or {}).get("sql_consumers", {}).get("processes") for row in rows):
        return {}
    out: dict[str, Any] = {}
    for kind, key in CONSUMER_KINDS.items():
        tot: dict[str, Any] = dict.fromkeys(CONSUMER_COUNTS, 0)
        tot["processes"] = 0
        for row in rows:
            st = (row.stats or {}).get(key) or {}
            for k in CONSUMER_COUNTS:
                tot[k] += int(st.get(k, 0))
            tot["processes"] = max(tot["processes"], int(st.get("processes", 0)))
        tot["entries_per_s"] = (
            round(tot["committed_entries"] / workload_s, 1) if workload_s else 0.0
        )
        out[kind] = tot
    return out


def failover_totals(rows: list[_store.CycleRow]) -> dict[str, Any]:
    """The fail-overs of ``rows`` (cycles of a --chaos-failover run): promotions,
    the slowest timings, the largest gap measured before a kill, how the old
    primaries were rebuilt."""
    out: dict[str, Any] = {"promotions": 0, "rebuilt": []}
    for row in rows:
        f = (row.stats or {}).get("failover")
        if not f:
            continue
        out["promotions"] += int(f.get("promotions", 0))
        for key in ("kill_to_promoted_s", "kill_to_first_dequeue_s", "rebuild_s"):
            if f.get(key) is not None:
                out[key] = max(float(f[key]), float(out.get(key, 0.0)))
        gap = f.get("gap") or {}
        for key in ("unflushed_bytes", "unreplayed_bytes", "walsender_paused_s"):
            if gap.get(key) is not None:
                out[key] = max(gap[key], out.get(key, 0))
        if f.get("rebuilt"):
            out["rebuilt"].append(str(f["rebuilt"]))
    return out
