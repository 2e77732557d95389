"""``/metrics``: Prometheus text format from a custom collector that reads the section.

Counters are the section's own cumulative counters (they restart when a
queue is reloaded into a new section, which Prometheus treats as a counter
reset). Latency histograms map the section's power-of-two buckets: bucket
``b`` holds calls under ``2**b`` microseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ringq.engine import Section
from ringq.engine import layout as L
from ringq.engine import metrics as M

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"

# section counter key -> (prometheus name without _total, help)
_COUNTERS: Final = {
    M.ENQUEUED: ("ringq_queue_enqueued", "Enqueue calls (slot reservations)."),
    M.DEQUEUED: ("ringq_queue_dequeued", "Dequeue calls that returned an entry."),
    M.ENQ_COMMITS: ("ringq_queue_enqueue_commits", "Enqueued entries committed."),
    M.DEQ_COMMITS: ("ringq_queue_dequeue_commits", "Dequeued entries committed (consumed)."),
    M.ENQ_ROLLBACKS: ("ringq_queue_enqueue_rollbacks", "Enqueues rolled back (void slots)."),
    M.DEQ_ROLLBACKS: ("ringq_queue_dequeue_rollbacks", "Dequeues rolled back (delivery retries)."),
    M.POISONED: ("ringq_queue_poisoned", "Entries moved to the exception queue."),
    M.FULL_HITS: ("ringq_queue_full_hits", "Enqueue attempts that found the queue full."),
    M.EMPTY_HITS: ("ringq_queue_empty_hits", "Dequeue attempts that found nothing ready."),
    M.REPAIRS: ("ringq_queue_repairs", "Section entries corrected from the rows."),
    M.RESYNCS: ("ringq_queue_resyncs", "Full re-reads of the queue from its table."),
    M.WAKEUPS: ("ringq_queue_wakeups", "Posts on the queue's ready semaphore."),
    M.GROUP_SKIPS: (
        "ringq_queue_group_skips",
        "Ready entries a claim passed over because their group had an entry held.",
    ),
}
_GAUGES: Final = {
    M.CAPACITY: ("ringq_queue_capacity", "Slots in the ring."),
    M.DEPTH: ("ringq_queue_depth", "Committed entries not yet consumed."),
    M.HEAD: ("ringq_queue_head", "Next sequence number to reserve."),
    M.TAIL: ("ringq_queue_tail", "Oldest sequence number not yet reclaimed."),
    M.WAIT_READY: ("ringq_queue_waiting_dequeuers", "Dequeuers sleeping on the queue."),
    M.WAIT_SPACE: ("ringq_queue_waiting_enqueuers", "Enqueuers sleeping on a full queue."),
    M.WAITING_ENTRIES: (
        "ringq_queue_waiting_entries",
        "Committed entries waiting for their due time (a delay or a retry's backoff).",
    ),
    M.NEXT_DUE_S: (
        "ringq_queue_next_due_seconds",
        "Seconds until the earliest waiting entry falls due (0: none waits, or it is due).",
    ),
}
# gauges from the monitor's last sample (need the database)
_SAMPLED: Final = {
    M.EXCEPTIONS: ("ringq_queue_exceptions", "Entries in the exception table."),
    M.DEAD_ROWS: ("ringq_queue_dead_rows", "Dead row versions in the queue's table."),
}
# gauges of grouped queues' samples (a queue without groups has no series)
_SAMPLED_GROUPS: Final = {
    M.GROUPS_READY: ("ringq_queue_groups_ready", "Groups with a ready entry and none held."),
    M.GROUPS_BUSY: ("ringq_queue_groups_busy", "Groups with an entry held by a dequeuer."),
    M.GROUP_OLDEST_AGE_S: (
        "ringq_queue_group_oldest_age_seconds",
        "How long the oldest ready entry of any group has waited.",
    ),
}

# per-client counters, labels pid and role (client key -> (name without _total, help))
_CLIENT_COUNTERS: Final = {
    M.COMMITS: ("ringq_client_commits", "Transactions the client committed through its session."),
    M.ROLLBACKS: ("ringq_client_rollbacks", "Transactions the client rolled back."),
    M.ERRORS: (
        "ringq_client_errors",
        "Errors the client hit (queue full, payload too large, in doubt ...).",
    ),
    M.HANDLED: (
        "ringq_client_handled",
        "Messages a worker handled (committed, declines included).",
    ),
    M.FAILED: ("ringq_client_failed", "Messages whose action failed (rolled back)."),
    M.TIMEOUTS: ("ringq_client_timeouts", "Messages whose action ran past its time limit."),
}
# Per-client series are bounded: workers first, then the busiest clients.
MAX_CLIENT_SERIES: Final = 64


def _bucket_bounds() -> list[str]:
    return [repr((1 << b) / 1e6) for b in range(L.HIST_BUCKETS - 1)] + ["+Inf"]


@dataclass(frozen=True, eq=False)  # identity: the registry keys its collectors by them
class SectionCollector:
    """A ``prometheus_client`` collector: call :meth:`collect` per scrape.

    ``read`` runs a function on the live section under the monitor's lock (None
    if no section is attached); ``status`` returns the monitor's own figures,
    ``sampled`` its last sample of each queue, ``clients`` and ``client_errors``
    (when given) its clients' figures.
    """

    read: Callable[[Callable[[Section], Any]], Any]
    status: Callable[[], dict[str, Any]]
    sampled: Callable[[], dict[str, dict[str, float | str]]]
    clients: Callable[[], dict[str, Any]] | None = None
    client_errors: Callable[[], dict[str, int]] | None = None

    def describe(self) -> list[Metric]:
        return []  # dynamic: no describe-time registration checks

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        rows = self.read(_read_queues) or []
        labels = ["queue"]
        counters = {k: CounterMetricFamily(n, h, labels=labels) for k, (n, h) in _COUNTERS.items()}
        gauges = {k: GaugeMetricFamily(n, h, labels=labels) for k, (n, h) in _GAUGES.items()}
        full_s = CounterMetricFamily(
            "ringq_queue_full_seconds", "Time the queue spent full.", labels=labels
        )
        enq_lat = HistogramMetricFamily(
            "ringq_queue_enqueue_latency_seconds", "Enqueue call latency.", labels=labels
        )
        deq_lat = HistogramMetricFamily(
            "ringq_queue_dequeue_latency_seconds", "Dequeue call latency.", labels=labels
        )
        bounds = _bucket_bounds()
        for name, stats, enq_h, deq_h in rows:
            for k, fam in counters.items():
                fam.add_metric([name], stats[k])
            for k, g in gauges.items():
                g.add_metric([name], stats[k])
            full_s.add_metric([name], stats[M.FULL_NS] / 1e9)
            for lat, hist, sum_key in (
                (enq_lat, enq_h, M.ENQ_LAT_NS),
                (deq_lat, deq_h, M.DEQ_LAT_NS),
            ):
                run, buckets = 0, []
                for bound, n in zip(bounds, hist, strict=True):
                    run += n
                    buckets.append((bound, float(run)))
                lat.add_metric([name], buckets, stats[sum_key] / 1e9)
        yield from counters.values()
        yield full_s
        yield from gauges.values()
        yield enq_lat
        yield deq_lat

        sampled = self.sampled()
        for key, (n, h) in _SAMPLED.items():
            g = GaugeMetricFamily(n, h, labels=labels)
            for name, sample in sampled.items():
                g.add_metric([name], float(sample.get(key, 0)))
            yield g
        for key, (n, h) in _SAMPLED_GROUPS.items():
            g = GaugeMetricFamily(n, h, labels=labels)
            for name, sample in sampled.items():
                if key in sample:
                    g.add_metric([name], float(sample[key]))
            yield g

        st = self.status()
        up = GaugeMetricFamily("ringq_monitor_up", "1 while the monitor's loop runs.")
        up.add_metric([], 1.0 if st["running"] else 0.0)
        yield up
        beat = GaugeMetricFamily(
            "ringq_monitor_heartbeat_timestamp_seconds", "Last pass of the monitor's loop."
        )
        beat.add_metric([], st["beat"])
        yield beat
        clients = GaugeMetricFamily("ringq_monitor_clients", "Client entries in the section.")
        clients.add_metric([], st["clients"])
        yield clients
        xmin = GaugeMetricFamily(
            "ringq_xmin_horizon_age_seconds",
            "Age of the oldest transaction holding back the xmin horizon (stops pruning).",
        )
        xmin.add_metric([], st[M.XMIN_AGE_S])
        yield xmin
        yield from _horizon_metrics(st)
        runs = CounterMetricFamily(
            "ringq_monitor_step_runs", "Runs of each monitor step.", labels=["step"]
        )
        fails = CounterMetricFamily(
            "ringq_monitor_step_failures", "Failed runs of each monitor step.", labels=["step"]
        )
        for step, s in st["steps"].items():
            runs.add_metric([step], s["runs"])
            fails.add_metric([step], s["failures"])
        yield runs
        yield fails
        rec = CounterMetricFamily(
            "ringq_monitor_recovered_clients", "Dead clients whose slots were recovered."
        )
        rec.add_metric([], st["recovered_clients"])
        yield rec
        if self.clients is not None:
            yield from _client_metrics(self.clients()["clients"])
        if self.client_errors is not None:
            logged = CounterMetricFamily(
                "ringq_monitor_client_errors",
                "Client errors the monitor logged, by kind.",
                labels=["kind"],
            )
            for kind, n in sorted(self.client_errors().items()):
                logged.add_metric([kind], n)
            yield logged


def _client_metrics(clients: list[dict[str, Any]]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    by_role = GaugeMetricFamily(
        "ringq_clients", "Client entries in the section, by role.", labels=["role"]
    )
    roles: dict[str, int] = {}
    for c in clients:
        roles[c[M.ROLE]] = roles.get(c[M.ROLE], 0) + 1
    for role, n in sorted(roles.items()):
        by_role.add_metric([role], n)
    yield by_role
    shown = sorted(
        clients, key=lambda c: (c[M.ROLE] != M.ROLE_WORKER, -c[M.COMMITS], c[M.PID])
    )[:MAX_CLIENT_SERIES]
    omitted = GaugeMetricFamily(
        "ringq_client_series_omitted",
        f"Clients left out of the per-client series (at most {MAX_CLIENT_SERIES}).",
    )
    omitted.add_metric([], len(clients) - len(shown))
    yield omitted
    labels = ["pid", "role"]
    fams = {k: CounterMetricFamily(n, h, labels=labels) for k, (n, h) in _CLIENT_COUNTERS.items()}
    rate = GaugeMetricFamily(
        "ringq_client_commit_rate", "Commits per second over the last interval.", labels=labels
    )
    # One session per process is the usual case; several sessions of one process are summed.
    merged: dict[tuple[str, str], dict[str, float]] = {}
    for c in shown:
        m = merged.setdefault((str(c[M.PID]), c[M.ROLE]), {})
        for k in (*_CLIENT_COUNTERS, M.COMMIT_RATE):
            m[k] = m.get(k, 0) + c[k]
    for lv, m in merged.items():
        for k, fam in fams.items():
            fam.add_metric(list(lv), m[k])
        rate.add_metric(list(lv), m[M.COMMIT_RATE])
    yield from fams.values()
    yield rate


def _horizon_metrics(st: dict[str, Any]) -> Iterator[Metric]:
    """A held snapshot, its holder (one series, only while held), vacuums and leases."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    held = GaugeMetricFamily(
        "ringq_snapshot_held", "1 while a transaction holds back the xmin horizon past xmin_warn_s."
    )
    held.add_metric([], 1.0 if st[M.SNAPSHOT_HELD] else 0.0)
    yield held
    holder = GaugeMetricFamily(
        "ringq_snapshot_holder_age_seconds",
        "Age of the transaction holding back the xmin horizon past xmin_warn_s"
        " (present only then).",
        labels=["kind", "pid", "application", "user"],
    )
    h = st[M.XMIN_HOLDER]
    if st[M.SNAPSHOT_HELD] and h is not None:
        holder.add_metric(
            [h["kind"], str(h["pid"] or ""), h["application"] or "", h["user"] or ""], h["age_s"]
        )
    yield holder
    vac = CounterMetricFamily(
        "ringq_monitor_vacuums", "Ring tables vacuumed after a held snapshot was released."
    )
    vac.add_metric([], st[M.VACUUMS])
    yield vac
    leases = CounterMetricFamily(
        "ringq_monitor_expired_leases",
        "Sessions ended for holding a dequeued entry past the queue's lease.",
    )
    leases.add_metric([], st[M.EXPIRED_LEASES])
    yield leases


def _read_queues(sec: Section) -> list[tuple[str, dict[str, float], list[int], list[int]]]:
    out = []
    for qidx in sec.loaded_queues():
        enq, deq = M.latency_histograms(sec, qidx)
        stats: dict[str, float] = {**M.queue_stats(sec, qidx), **M.due_figures(sec, qidx)}
        out.append((sec.queue_name(qidx), stats, enq, deq))
    return out


def render(collector: SectionCollector) -> bytes:
    """The text exposition of ``collector`` alone (no process/platform collectors)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
