"""Metric names: one place, read by the engine, the monitor and the viewer.

``queue_stats(section, qidx)`` returns a dict with exactly these keys
(counters are cumulative since the queue was loaded into the section);
``client_stats(section, cidx)`` the keys of :data:`CLIENT_COUNTERS`. At the
end, the figures the monitor derives from them and serves (``GET
/api/queues``, ``/api/history``, ``/api/clients``, the T4 files), by the names
the viewer reads.
"""

from __future__ import annotations

import time
from typing import Final

from . import layout as L
from ._section import Section

CAPACITY: Final = "capacity"
# committed entries not yet consumed: ready in the ring, and waiting in the
# SQL inbox (INBOX) as the pump last counted them, as ringq.depth() counts
DEPTH: Final = "depth"
INBOX: Final = "inbox"  # entries SQL producers put on, still in ringq.inbox (Q_INBOX)
HEAD: Final = "head"
TAIL: Final = "tail"
ENQUEUED: Final = "enqueued"  # enqueue calls
DEQUEUED: Final = "dequeued"  # dequeue calls that returned an entry
ENQ_COMMITS: Final = "enq_commits"
DEQ_COMMITS: Final = "deq_commits"
ENQ_ROLLBACKS: Final = "enq_rollbacks"
DEQ_ROLLBACKS: Final = "deq_rollbacks"  # delivery retries
POISONED: Final = "poisoned"
FULL_HITS: Final = "full_hits"
EMPTY_HITS: Final = "empty_hits"
REPAIRS: Final = "repairs"
RESYNCS: Final = "resyncs"
WAKEUPS: Final = "wakeups"
FULL_NS: Final = "full_ns"
ENQ_LAT_NS: Final = "enq_latency_ns_sum"
DEQ_LAT_NS: Final = "deq_latency_ns_sum"
# consumed entries' waits, enqueue (the row's enq_at) to the dequeue's commit, summed (us)
WAIT_US: Final = "wait_us_sum"
WAIT_READY: Final = "waiting_dequeuers"
WAIT_SPACE: Final = "waiting_enqueuers"
GROUP_SKIPS: Final = "group_skips"  # ready entries claims passed over: their group was busy

_WORDS: Final = {
    CAPACITY: L.Q_CAPACITY,
    DEPTH: L.Q_DEPTH_HINT,
    HEAD: L.Q_HEAD,
    TAIL: L.Q_TAIL,
    ENQUEUED: L.Q_N_ENQ,
    DEQUEUED: L.Q_N_DEQ,
    ENQ_COMMITS: L.Q_N_ENQ_COMMIT,
    DEQ_COMMITS: L.Q_N_DEQ_COMMIT,
    ENQ_ROLLBACKS: L.Q_N_ENQ_ROLLBACK,
    DEQ_ROLLBACKS: L.Q_N_DEQ_ROLLBACK,
    POISONED: L.Q_N_POISONED,
    FULL_HITS: L.Q_N_FULL,
    EMPTY_HITS: L.Q_N_EMPTY,
    REPAIRS: L.Q_N_REPAIRS,
    RESYNCS: L.Q_N_RESYNC,
    WAKEUPS: L.Q_N_WAKEUPS,
    FULL_NS: L.Q_FULL_NS,
    ENQ_LAT_NS: L.Q_ENQ_LAT_NS,
    DEQ_LAT_NS: L.Q_DEQ_LAT_NS,
    WAIT_US: L.Q_WAIT_US,
    WAIT_READY: L.Q_WAIT_READY,
    WAIT_SPACE: L.Q_WAIT_SPACE,
    GROUP_SKIPS: L.Q_N_GROUP_SKIPS,
    INBOX: L.Q_INBOX,
}

HIST_BUCKETS: Final = L.HIST_BUCKETS


def queue_stats(sec: Section, qidx: int) -> dict[str, int]:
    base = qidx * L.QUEUE_WORDS
    stats = {key: int(sec.queues[base + word]) for key, word in _WORDS.items()}
    stats[DEPTH] += stats[INBOX]
    return stats


def due_figures(sec: Section, qidx: int) -> dict[str, float]:
    """:data:`DUE_KEYS` of queue block ``qidx`` now, read without the queue's
    lock (for display). The earliest due time is the database's clock; it is
    compared with the host's estimate of that clock (the wall clock while no
    answer stamped one)."""
    base = qidx * L.QUEUE_WORDS
    n = max(0, int(sec.queues[base + L.Q_N_WAITING]))
    due_us = int(sec.queues[base + L.Q_NEXT_DUE_US])
    if not n or not due_us:
        return {WAITING_ENTRIES: n, NEXT_DUE_S: 0.0}
    now_us = sec.db_clock_us() or time.time_ns() // 1000
    return {WAITING_ENTRIES: n, NEXT_DUE_S: round(max(0.0, (due_us - now_us) / 1e6), 3)}


def latency_histograms(sec: Section, qidx: int) -> tuple[list[int], list[int]]:
    """(enqueue, dequeue) call-latency histograms: bucket b counts calls of
    [2**(b-1), 2**b) microseconds (bucket 0: under 1 us)."""
    base = qidx * L.QUEUE_WORDS
    enq = [int(sec.queues[base + L.Q_ENQ_HIST + b]) for b in range(L.HIST_BUCKETS)]
    deq = [int(sec.queues[base + L.Q_DEQ_HIST + b]) for b in range(L.HIST_BUCKETS)]
    return enq, deq


def wait_histogram(sec: Section, qidx: int) -> list[int]:
    """The enqueue-to-dequeue wait histogram: bucket b counts consumed
    entries that waited [2**(b-1), 2**b) microseconds from their enqueue (the
    row's enq_at) to the commit of the dequeue that consumed them (bucket 0:
    under 1 us; counted at that commit)."""
    base = qidx * L.QUEUE_WORDS + L.Q_WAIT_HIST
    return [int(sec.queues[base + b]) for b in range(L.HIST_BUCKETS)]


def percentile_us(hist: list[int], q: float) -> float:
    """Upper bound (microseconds) of the bucket holding quantile ``q`` (0..1); 0 if empty."""
    total = sum(hist)
    if not total:
        return 0.0
    rank = q * total
    run = 0
    for b, n in enumerate(hist):
        run += n
        if run >= rank:
            return float(1 << b)
    return float(1 << (len(hist) - 1))


# -- the monitor's own figures (the "monitor" object of /api/queues, read by /metrics) ----------

XMIN_AGE_S: Final = "xmin_age_s"  # seconds the oldest transaction has held back the xmin horizon
SNAPSHOT_HELD: Final = "snapshot_held"  # it is past the monitor's xmin_warn_s
# that transaction: kind, pid, application, user, state, ... (or null)
XMIN_HOLDER: Final = "xmin_holder"
VACUUMS: Final = "vacuums"  # ring tables the monitor vacuumed after a held snapshot was released
EXPIRED_LEASES: Final = "expired_leases"  # sessions ended past their queue's lease


# -- clients (one entry per session in the section's client table) --------------------------

COMMITS: Final = "commits"  # transactions committed through the session
ROLLBACKS: Final = "rollbacks"
ERRORS: Final = "errors"  # errors the client hit (ERROR_KINDS), see Session's error paths
# worker counters (role "worker"; ringq.worker keeps the same names)
HANDLED: Final = "handled"  # messages whose transaction committed (declines included)
DECLINED: Final = "declined"  # of those, actions that returned a Decline
FAILED: Final = "failed"  # rolled back: the action raised, or the commit failed
TIMEOUTS: Final = "timeouts"  # rolled back: the action ran past its time limit
ABORTED: Final = "aborted"  # rolled back: a second stop request interrupted the action
IN_DOUBT: Final = "in_doubt"  # commits whose answer was lost (decided later from the rows)
BUSY_NS: Final = "busy_ns"  # time spent handling messages (action + commit), nanoseconds

_CLIENT_WORDS: Final = {
    ENQUEUED: L.C_N_ENQ,
    DEQUEUED: L.C_N_DEQ,
    COMMITS: L.C_N_COMMIT,
    ROLLBACKS: L.C_N_ROLLBACK,
    ERRORS: L.C_N_ERRORS,
    HANDLED: L.C_W_HANDLED,
    DECLINED: L.C_W_DECLINED,
    FAILED: L.C_W_FAILED,
    TIMEOUTS: L.C_W_TIMEOUTS,
    ABORTED: L.C_W_ABORTED,
    POISONED: L.C_W_POISONED,
    IN_DOUBT: L.C_W_IN_DOUBT,
    BUSY_NS: L.C_W_BUSY_NS,
}
CLIENT_COUNTERS: Final = tuple(_CLIENT_WORDS)

ROLE_CLIENT: Final = "client"
ROLE_WORKER: Final = "worker"
ROLE_MONITOR: Final = "monitor"
ROLES: Final = {L.CR_CLIENT: ROLE_CLIENT, L.CR_WORKER: ROLE_WORKER, L.CR_MONITOR: ROLE_MONITOR}

# error kinds (the monitor's log and metrics use these names)
ERROR_KINDS: Final = {
    L.ERR_QUEUE_FULL: "queue_full",
    L.ERR_PAYLOAD_TOO_LARGE: "payload_too_large",
    L.ERR_ROW_MISMATCH: "row_mismatch",
    L.ERR_IN_DOUBT: "in_doubt",
    L.ERR_COMMIT_FAILED: "commit_failed",
    L.ERR_DATABASE: "database_error",
    L.ERR_CONNECTION_LOST: "connection_lost",
}


def client_stats(sec: Section, cidx: int) -> dict[str, int]:
    """Client entry ``cidx``'s counters (keys: :data:`CLIENT_COUNTERS`)."""
    base = cidx * L.CLIENT_WORDS
    return {key: int(sec.clients[base + word]) for key, word in _CLIENT_WORDS.items()}


def role_name(code: int) -> str:
    return ROLES.get(code, f"role{code}")


def error_kind(code: int) -> str:
    return ERROR_KINDS.get(code, f"error{code}")


# -- the monitor's figures ---------------------------------------------------------------------
# One queue's sample over the monitor's interval: the section's figures CAPACITY,
# DEPTH, HEAD, TAIL, WAIT_READY and WAIT_SPACE as they are, and these. In a
# sample COMMITS and ROLLBACKS count the queue's enqueue + dequeue commits and
# rollbacks in the interval, POISONED its entries poisoned in the interval.

NAME: Final = "name"  # the queue's name (GET /api/queues)
T: Final = "t"  # unix seconds at the end of the interval
ENQ_RATE: Final = "enq_rate"  # committed enqueues per second over the interval
DEQ_RATE: Final = "deq_rate"  # committed dequeues per second over the interval
ENQ_P50: Final = "enq_p50_us"  # enqueue call latency over the interval, microseconds (0: no call)
ENQ_P99: Final = "enq_p99_us"
DEQ_P50: Final = "deq_p50_us"
DEQ_P99: Final = "deq_p99_us"
# An entry's wait from its enqueue (the row's enq_at) to the commit of the
# dequeue that consumed it, over the entries consumed in the interval,
# microseconds (the upper bound of the histogram bucket; 0: none consumed,
# or a T4 file written before these columns).
WAIT_P50: Final = "wait_p50_us"
WAIT_P95: Final = "wait_p95_us"
WAIT_P99: Final = "wait_p99_us"
WAIT_KEYS: Final = (WAIT_P50, WAIT_P95, WAIT_P99)
FULL: Final = "full"  # seconds of the interval the queue had no free slot
EMPTY: Final = "empty"  # seconds of the interval nothing was ready (recovery-pass resolution)
RETRIES: Final = "retries"  # dequeues rolled back in the interval (delivery retries)
EXCEPTIONS: Final = "exceptions"  # entries in the exception table now
DEAD_ROWS: Final = "dead_rows"  # dead row versions in the queue's table (pg_stat_user_tables)

# A grouped queue's sample (one an entry with a group was enqueued to) also
# has these, and only it (an ungrouped queue's sample leaves them out); they
# are figures of now, not of the interval, and stay out of the history.
GROUPS_READY: Final = "groups_ready"  # groups with a ready entry and none held
GROUPS_BUSY: Final = "groups_busy"  # groups with an entry held by a dequeuer
GROUP_OLDEST_AGE_S: Final = "group_oldest_age_s"  # seconds the oldest ready group entry waited
# GROUP_SKIPS as the section counts it (cumulative since the queue was loaded)
GROUP_KEYS: Final = (GROUPS_READY, GROUPS_BUSY, GROUP_OLDEST_AGE_S, GROUP_SKIPS)

# Every queue's sample also has these (issue 24): figures of now, read from
# the queue block's two words (Q_N_WAITING, Q_NEXT_DUE_US), not in the history
# or the T4 files. An entry that waits is committed (depth counts it) but no
# consumer receives it before its due time: a delayed enqueue, or a delivery
# given back with a retry backoff. Until a claim releases it, an entry whose
# time came still counts here (NEXT_DUE_S is then 0).
WAITING_ENTRIES: Final = "waiting_entries"  # committed entries waiting for their due time
NEXT_DUE_S: Final = "next_due_s"  # seconds until the earliest falls due (0: none, or due now)
DUE_KEYS: Final = (WAITING_ENTRIES, NEXT_DUE_S)

# Every numeric figure of a sample, in this order: the T4 columns and the history's.
SAMPLE_KEYS: Final = (
    T, CAPACITY, DEPTH, HEAD, TAIL, ENQ_RATE, DEQ_RATE, ENQ_P50, ENQ_P99, DEQ_P50, DEQ_P99,
    FULL, EMPTY, RETRIES, EXCEPTIONS, COMMITS, ROLLBACKS, WAIT_READY, WAIT_SPACE, POISONED,
    DEAD_ROWS, *WAIT_KEYS,  # new columns go at the end: older readers map T4 columns by name
)

# How a bucket of samples sums each figure up when a long window of history is
# thinned (by the monitor, and by the viewer for its plots): the worst case where
# an operator looks for spikes (depth, p99, retries, waiters), the mean for
# steady figures and for the full/empty seconds (so a bucket reads as "seconds
# full per interval, on average"), the last value for positions and for T (the
# bucket is stamped with its last point's time).
MAX: Final = "max"
MEAN: Final = "mean"
LAST: Final = "last"
BUCKET: Final = {
    T: LAST,
    CAPACITY: LAST,
    DEPTH: MAX,
    HEAD: LAST,
    TAIL: LAST,
    ENQ_RATE: MEAN,
    DEQ_RATE: MEAN,
    ENQ_P50: MEAN,
    ENQ_P99: MAX,
    DEQ_P50: MEAN,
    DEQ_P99: MAX,
    FULL: MEAN,
    EMPTY: MEAN,
    RETRIES: MAX,
    EXCEPTIONS: MAX,
    COMMITS: MEAN,
    ROLLBACKS: MEAN,
    WAIT_READY: MAX,
    WAIT_SPACE: MAX,
    POISONED: MAX,
    DEAD_ROWS: MAX,
    WAIT_P50: MEAN,
    WAIT_P95: MAX,
    WAIT_P99: MAX,
}

# One client of GET /api/clients (a session attached to the section): these, the
# counters of CLIENT_COUNTERS but BUSY_NS (totals since the session opened; a
# worker's carry over a reconnect), and the rates over the monitor's interval.
PID: Final = "pid"
BACKEND_PID: Final = "backend_pid"
ROLE: Final = "role"  # ROLE_CLIENT or ROLE_WORKER
STATE: Final = "state"  # STATE_ACTIVE, or STATE_IN_DOUBT (lost its connection holding slots)
STARTED: Final = "started"  # unix seconds the entry was registered (or its backend last changed)
QUEUES: Final = "queues"  # names of the queues the session used
BUSY_S: Final = "busy_s"  # seconds spent handling messages (workers)
COMMIT_RATE: Final = "commit_rate"  # commits per second over the interval
HANDLED_RATE: Final = "handled_rate"  # messages handled per second over the interval
FAILED_RATE: Final = "failed_rate"  # messages failed, timed out or aborted per second
ERROR_RATE: Final = "error_rate"  # errors per second over the interval
LAST_ERROR: Final = "last_error"  # the last error {ERROR_KIND, ERROR_QUEUE, ERROR_SEQ, T}, or None
ERROR_KIND: Final = "kind"  # one of ERROR_KINDS' names
ERROR_QUEUE: Final = "queue"
ERROR_SEQ: Final = "seq"

STATE_ACTIVE: Final = "active"
STATE_IN_DOUBT: Final = "in_doubt"

CLIENT_SHOWN_COUNTERS: Final = tuple(k for k in CLIENT_COUNTERS if k != BUSY_NS)
CLIENT_RATES: Final = (COMMIT_RATE, HANDLED_RATE, FAILED_RATE, ERROR_RATE)
CLIENT_KEYS: Final = (
    PID, BACKEND_PID, ROLE, STATE, STARTED, QUEUES, *CLIENT_SHOWN_COUNTERS, BUSY_S, *CLIENT_RATES,
    LAST_ERROR,
)
