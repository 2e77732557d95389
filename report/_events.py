"""Which records of the monitor's log are marked on the time axis, and how.

The monitor writes one JSON record per event to ``monitor.log``
(``ringq.monitor.journal_records`` reads them back). The page marks the ones
an operator looks for when a chart changes shape; the rest are listed only.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Final

from ._charts import Mark

# record event -> (the kind shown in the legend and the events table, colour)
MARKED: Final = {
    "client.recovered": ("client died (consumer.died)", "tab:red"),
    "entry.lease_expired": ("lease expired", "tab:orange"),
    "database.snapshot_held": ("held snapshot", "tab:purple"),
    "database.snapshot_released": ("snapshot released", "tab:pink"),
    "section.rebuilt": ("section rebuilt / fail-over", "tab:brown"),
    "database.dsn_changed": ("fail-over (DSN changed)", "black"),
    "database.reconnected": ("database reconnected", "tab:gray"),
    "monitor.started": ("monitor started", "tab:olive"),
    "entry.poisoned": ("entry poisoned", "tab:cyan"),
}
FAILOVER_REASON: Final = "history"  # section.rebuilt's reason after a fail-over names it


@dataclass(frozen=True)
class Event:
    t: float
    kind: str
    color: str
    queue: str  # "" when the record names none
    detail: str


def events(records: list[dict[str, Any]], queues: set[str] | None = None) -> list[Event]:
    """The marked events of ``records``; with ``queues``, only those of no queue or of one of
    them (a consumer that died holding entries of another queue is not this page's)."""
    out = []
    for rec in records:
        kind = MARKED.get(str(rec.get("event")))
        if kind is None:
            continue
        label, color = kind
        if rec.get("event") == "section.rebuilt" and FAILOVER_REASON in str(rec.get("reason")):
            label, color = "fail-over", "black"
        named = _queues_of(rec)
        if queues is not None and named and not (named & queues):
            continue
        out.append(Event(float(rec["t"]), label, color, ",".join(sorted(named)), _detail(rec)))
    return out


def marks(evs: list[Event], queue: str | None = None) -> list[Mark]:
    """Marks for a chart: every event of no queue, and those of ``queue`` (None: all)."""
    return [
        Mark(e.t, e.kind, e.color)
        for e in evs
        if queue is None or not e.queue or queue in e.queue.split(",")
    ]


def client_counts(records: list[dict[str, Any]]) -> dict[str, Counter[str]]:
    """Per client kind (role: client, worker …): errors by kind, recoveries, leases expired,
    from the monitor's log (the per-session counters themselves are not in its files)."""
    out: dict[str, Counter[str]] = {}
    for rec in records:
        ev = rec.get("event")
        if ev == "client.error":
            role = str(rec.get("role") or "client")
            out.setdefault(role, Counter())[f"error {rec.get('kind')}"] += int(rec.get("count", 1))
        elif ev == "client.recovered":
            out.setdefault(str(rec.get("role") or "client"), Counter())["died, recovered"] += 1
        elif ev == "entry.lease_expired":
            out.setdefault(str(rec.get("role") or "client"), Counter())["lease expired"] += 1
    return out


def _queues_of(rec: dict[str, Any]) -> set[str]:
    q = rec.get("queue")
    if isinstance(q, str) and q:
        return {q}
    qs = rec.get("queues")
    if isinstance(qs, list):
        return {str(x) for x in qs if x}
    return set()


_SKIP: Final = {"t", "time", "event", "monitor_pid", "queue", "queues"}


def _detail(rec: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in rec.items() if k not in _SKIP and v not in (None, "", [])]
    text = " ".join(parts)
    return text if len(text) <= 160 else text[:157] + "..."
