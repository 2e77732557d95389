"""The verification report: what Spark proved, as text for people and JSON for tools."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

# Violation kinds (the keys of ``Report.violations``; one place, like metric names).
# committed, never dequeued, and not queued when the workload ended: its row is gone,
# or was consumed without a recorded delivery
LOST: Final = "lost"
# committed, never dequeued, still queued when the workload ended (the workload
# stopped early, or stalled): nothing was lost, but the cycle did not drain it
NOT_DRAINED: Final = "not_drained"
DUPLICATE: Final = "duplicate"  # dequeued more than once (counts the extra deliveries)
# per (queue, producer), dequeued before an entry committed earlier
OUT_OF_ORDER: Final = "out_of_order"
# payload differs from what was committed (checksum, digest, header, length)
CORRUPT: Final = "corrupt"
# an entry of a rolled-back transaction was dequeued
ROLLED_BACK_DELIVERED: Final = "rolled_back_delivered"
PHANTOM: Final = "phantom"  # dequeued, but never sent (neither committed nor rolled back)
SEQ_REUSED: Final = "seq_reused"  # two committed entries got the same queue sequence
WORKLOAD: Final = "workload_error"  # a worker failed or the cycle stalled
# the grouped queue: per (producer, group), dequeued before an entry committed earlier
GROUP_ORDER: Final = "group_order_breaks"
# the grouped queue: dequeued while an entry of its group was still held
GROUP_IN_FLIGHT: Final = "group_in_flight_twice"
# a delayed entry taken before its due time (its row's not_before, the database's clock)
TAKEN_EARLY: Final = "taken_before_due"
# an entry a consumer rolled back taken again before the queue's backoff had passed
RETRIED_EARLY: Final = "retried_before_backoff"

# In the order the summary prints them: a workload error first (whatever else
# was found followed from it, or not), then what became of committed entries.
VIOLATION_KINDS: Final = (
    WORKLOAD,
    LOST,
    NOT_DRAINED,
    DUPLICATE,
    OUT_OF_ORDER,
    CORRUPT,
    ROLLED_BACK_DELIVERED,
    PHANTOM,
    SEQ_REUSED,
    GROUP_ORDER,
    GROUP_IN_FLIGHT,
    TAKEN_EARLY,
    RETRIED_EARLY,
)


@dataclass
class Report:
    """The proof for some cycles of one run. ``ok`` iff every violation count is 0."""

    run_id: str
    cycles: list[int]
    violations: dict[str, int] = field(default_factory=lambda: dict.fromkeys(VIOLATION_KINDS, 0))
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    counts: dict[str, Any] = field(default_factory=dict)
    queues: list[dict[str, Any]] = field(default_factory=list)
    throughput: dict[str, float] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    latency_from: str = "sent row"
    spark: dict[str, Any] = field(default_factory=dict)
    workload_errors: list[str] = field(default_factory=list)
    skipped_cycles: dict[int, str] = field(default_factory=dict)
    chaos: dict[str, int] = field(default_factory=dict)  # kills per kind (cycles run with --chaos)
    # --chaos-failover: promotions, timings, and what the producers were told had
    # committed against what the new primary holds (see ``failover_lines``)
    failover: dict[str, Any] = field(default_factory=dict)
    # the grouped queue: its name, groups, consumers (configured and seen taking
    # entries), entries, the most held at once, and its two counters (see ``group_lines``)
    groups: dict[str, Any] = field(default_factory=dict)
    # a run with SQL consumers: per kind ("linked", "sql"), what the workers
    # counted (entries, tx, rolled back, processes, entries/s; see ``consumer_lines``)
    consumers: dict[str, Any] = field(default_factory=dict)
    # a run with delayed entries or a retry backoff: the entries that waited,
    # how many were checked, how late after their time they were taken (see ``wait_lines``)
    waits: dict[str, Any] = field(default_factory=dict)
    path: str | None = None

    @property
    def ok(self) -> bool:
        return not any(self.violations.values())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        d.pop("path", None)
        d["skipped_cycles"] = {str(k): v for k, v in self.skipped_cycles.items()}
        return d

    def write(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(p)
        self.path = str(p)
        return p

    def summary(self) -> str:
        """A short text report (about 15 lines plus one per queue)."""
        c = self.counts
        cyc = _cycles(self.cycles)
        lines = [f"ringq regress: run {self.run_id}, {cyc}: {'PASS' if self.ok else 'FAIL'}"]
        lines += self.workload_lines()
        tx = c.get("transactions", {})
        rb_reasons = ", ".join(
            f"{k} {v:,}" for k, v in sorted(tx.get("rolled_back_by_reason", {}).items())
        )
        lines.append(
            f"  entries     committed {c.get('committed', 0):,}   "
            f"rolled back {c.get('rolled_back', 0):,}   "
            f"dequeued {c.get('delivered', 0):,} ({c.get('received_rows', 0):,} rows, "
            f"{c.get('redelivered', 0):,} after a consumer rollback)"
        )
        lines += self.drained_lines()
        lines.append(
            f"  tx          simple {tx.get('simple', 0):,}   "
            f"two-phase {tx.get('two_phase', 0):,}   "
            f"multi-queue {tx.get('multi_queue', 0):,}   rolled back {tx.get('rolled_back', 0):,}"
            + (f" ({rb_reasons})" if rb_reasons else "")
        )
        lines.append(
            f"  {'queue':<34} {'payload':>8} {'committed':>10} {'dequeued':>10} {'max depth':>10} "
            f"{'full':>6} {'empty':>7} {'p50 ms':>8} {'p99 ms':>8}"
        )
        for q in self.queues:
            lat = q.get("latency_ms", {})
            lines.append(
                f"  {q['name']:<34} {q['payload_size']:>8,} {q.get('committed', 0):>10,} "
                f"{q.get('delivered', 0):>10,} {q.get('max_depth', 0):>10,} "
                f"{q.get('full_hits', 0):>6,} "
                f"{q.get('empty_hits', 0):>7,} {lat.get('p50', 0):>8.1f} {lat.get('p99', 0):>8.1f}"
            )
        lines += self.consumer_lines()
        if self.chaos:
            ch = self.chaos
            lines.append(
                f"  chaos       producers {ch.get('producers', 0):,}  "
                f"consumers {ch.get('consumers', 0):,}  "
                f"monitor {ch.get('monitor', 0):,}  pg restarts {ch.get('pg_restarts', 0):,}"
                + (
                    f"  sql consumers {ch.get('sql_consumers', 0):,}  "
                    f"sql backends {ch.get('sql_backends', 0):,}"
                    if self.consumers
                    else ""
                )
            )
        lines += self.group_lines()
        lines += self.wait_lines()
        lines += self.failover_lines()
        lines.append(
            "  violations  " + "   ".join(f"{k} {v:,}" for k, v in self.violations.items())
        )
        for kind, rows in self.examples.items():
            for row in rows[:3]:
                lines.append(f"    {kind}: {_row(row)}")
        t = self.throughput
        lines.append(
            f"  throughput  workload {t.get('workload_s', 0):.1f} s   "
            f"{t.get('entries_per_s', 0):,.0f} entries/s   "
            f"{t.get('mb_per_s', 0):,.1f} MB/s   spark {self.spark.get('analysis_s', 0):.1f} s"
        )
        lat = self.latency_ms
        lines.append(
            f"  latency ms  p50 {lat.get('p50', 0):.1f}   p95 {lat.get('p95', 0):.1f}   p99 "
            f"{lat.get('p99', 0):.1f}   "
            f"max {lat.get('max', 0):,.1f}   ({self.latency_from} -> dequeue)"
        )
        for n, why in sorted(self.skipped_cycles.items()):
            lines.append(f"  skipped     cycle {n}: {why}")
        if self.path:
            lines.append(f"  report      {self.path}")
        return "\n".join(lines)


    def workload_lines(self) -> list[str]:
        """The workload's errors, the summary's first finding (none: it ran to its end)."""
        n = len(self.workload_errors)
        if not n:
            return []
        lines = [f"  workload    FAILED: {n:,} error{'s' if n > 1 else ''}"]
        lines += [f"    workload: {err}" for err in self.workload_errors[:5]]
        if n > 5:
            lines.append(f"    workload: ... and {n - 5:,} more")
        return lines

    def drained_lines(self) -> list[str]:
        """The entries still queued when the workload ended (none: it drained every queue)."""
        n = int(self.violations.get(NOT_DRAINED, 0))
        if not n:
            return []
        when = (
            "when the workload stopped early (its error is above): not lost"
            if self.workload_errors
            else "when the workload ended: not lost, but it never drained them (a stall)"
        )
        return [f"  not drained {n:,} entries committed and still queued {when}"]

    def consumer_lines(self) -> list[str]:
        """The line of linked and SQL consumers (none without SQL consumers)."""
        if not self.consumers:
            return []
        parts = []
        for kind, c in self.consumers.items():
            parts.append(
                f"{kind} {c.get('processes', 0)} x {c.get('committed_entries', 0):,} entries "
                f"{c.get('entries_per_s', 0):,.0f}/s "
                f"({c.get('rolled_back_tx', 0):,} tx rolled back)"
            )
        proven = self.counts.get("delivered_sql")
        tail = f"   proven by sql {proven:,}" if proven is not None else ""
        return ["  consumers   " + "   ".join(parts) + tail]

    def group_lines(self) -> list[str]:
        """The grouped queue's line of the summary (none without one)."""
        g = self.groups
        if not g:
            return []
        head = (
            f"  groups      {g.get('queue')}: {g.get('committed', 0):,} entries in "
            f"{g.get('groups_seen', 0):,} of {g.get('groups', 0):,} groups, "
            f"{g.get('consumers_seen', 0)} of "
            f"{g.get('consumers', 0) + g.get('sql_consumers', 0)} consumers"
            + (f" ({g['sql_consumers']} SQL)" if g.get("sql_consumers") else "")
            + " took entries, "
            f"up to {g.get('most_held_at_once', 0)} held at once"
        )
        checks = (
            f"              order breaks {g.get('order_breaks', 0):,}   "
            f"in flight twice {g.get('in_flight_twice', 0):,}"
        )
        return [head, checks]

    def wait_lines(self) -> list[str]:
        """The lines of delayed and retried entries (none in a run without them)."""
        w = self.waits
        if not w:
            return []

        def after(key: str) -> str:
            lat = w.get(key) or {}
            return (
                f"taken p50 {lat.get('p50', 0):.1f} / p99 {lat.get('p99', 0):.1f} / "
                f"max {lat.get('max', 0):,.1f} ms after it"
            )

        d, r = w.get("delayed", {}), w.get("retried", {})
        return [
            f"  delayed     {d.get('entries', 0):,} entries (due time read for "
            f"{d.get('due_read', 0):,}), {d.get('taken', 0):,} taken: "
            f"before their time {d.get('early', 0):,}, {after('delayed_after_ms')}",
            f"  retried     {r.get('entries', 0):,} entries rolled back by consumers "
            f"(backoff {r.get('backoff_s', 0):g} s), {r.get('taken', 0):,} taken again: "
            f"before the backoff {r.get('early', 0):,}, {after('retried_after_ms')}",
        ]

    def failover_lines(self) -> list[str]:
        """The fail-over's lines of the summary (none without ``--chaos-failover``)."""
        f = self.failover
        if not f:
            return []

        def secs(key: str) -> str:
            value = f.get(key)
            return "-" if value is None else f"{value:.2f} s"

        rebuilt = ", ".join(f.get("rebuilt") or []) or "no"
        head = (
            f"  fail-over   {f.get('mode')} standby: promotions {f.get('promotions', 0):,}   "
            f"kill -> promoted {secs('kill_to_promoted_s')}   "
            f"kill -> first dequeue {secs('kill_to_first_dequeue_s')}   "
            f"old primary rebuilt: {rebuilt}"
        )
        lines = [head]
        lost = int(f.get("lost_acknowledged", 0))
        acked = f"acknowledged {int(f.get('acknowledged', 0)):,}, lost {lost:,}"
        if f.get("mode") == "sync":
            lines.append(f"              {acked} (synchronous: none may be)")
        else:
            gap = f.get("unflushed_bytes")
            paused = f.get("walsender_paused_s")
            why = (
                "committed on the old primary after the last entry the standby received"
                + (f", its walsender paused {paused:g} s" if paused else "")
                + (f"; {gap:,} bytes of WAL not flushed by the standby at the kill"
                   if gap is not None else "")
            )
            lines.append(
                f"              {acked}: {int(f.get('lost_in_gap', 0)):,} in the replication "
                f"gap ({why}), {int(f.get('lost_outside_gap', 0)):,} outside it"
            )
        return lines


def _cycles(cycles: list[int]) -> str:
    if not cycles:
        return "no cycles"
    if len(cycles) == 1:
        return f"cycle {cycles[0]}"
    if cycles == list(range(cycles[0], cycles[-1] + 1)):
        return f"cycles {cycles[0]}-{cycles[-1]}"
    return "cycles " + ",".join(map(str, cycles))


def _row(row: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in row.items())
