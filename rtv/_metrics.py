"""The figures the viewer reads from the monitor's HTTP API, by name.

Names shared with the engine's section come from :mod:`ringq.engine.metrics`;
the rest are the monitor's derived figures, as ``GET /api/queues`` and
``GET /api/history`` serve them (``monitor/_sample.py`` defines them there; the
viewer does not import the monitor, and ``tests/test_rtv.py`` checks that the
two lists agree), and at the end the keys of ``GET /api/clients``
(``monitor/_clients.py``, checked the same way). The page (``static/app.js``)
and the terminal view read the normalized rows built by :mod:`ringq.rtv._source`.
"""

from __future__ import annotations

from typing import Final

from ringq.engine import metrics as M

NAME: Final = "name"
TIME: Final = "t"  # seconds since the epoch (float)

CAPACITY: Final = M.CAPACITY
DEPTH: Final = M.DEPTH
HEAD: Final = M.HEAD
TAIL: Final = M.TAIL
ENQ_RATE: Final = "enq_rate"  # committed enqueues per second over the interval
DEQ_RATE: Final = "deq_rate"  # committed dequeues per second over the interval
ENQ_P50: Final = "enq_p50_us"  # enqueue call latency over the interval, microseconds (0: no call)
ENQ_P99: Final = "enq_p99_us"
DEQ_P50: Final = "deq_p50_us"
DEQ_P99: Final = "deq_p99_us"
FULL: Final = "full"  # seconds of the interval the queue had no free slot
EMPTY: Final = "empty"  # seconds of the interval nothing was ready
RETRIES: Final = "retries"  # dequeues rolled back in the interval (delivery retries)
EXCEPTIONS: Final = "exceptions"  # entries in the exception queue now
COMMITS: Final = "commits"  # enqueue + dequeue commits in the interval
ROLLBACKS: Final = "rollbacks"  # enqueue + dequeue rollbacks in the interval
WAITING_DEQUEUERS: Final = M.WAIT_READY  # dequeuers sleeping now
WAITING_ENQUEUERS: Final = M.WAIT_SPACE  # enqueuers sleeping now
POISONED: Final = "poisoned"  # entries poisoned in the interval
DEAD_ROWS: Final = "dead_rows"  # dead row versions in the queue's table

INTERVAL: Final = "interval"  # the monitor's sampling interval, seconds

# Every numeric figure of a queue, in the order the table shows them.
NUMERIC: Final = (
    CAPACITY,
    DEPTH,
    HEAD,
    TAIL,
    ENQ_RATE,
    DEQ_RATE,
    ENQ_P50,
    ENQ_P99,
    DEQ_P50,
    DEQ_P99,
    FULL,
    EMPTY,
    RETRIES,
    EXCEPTIONS,
    COMMITS,
    ROLLBACKS,
    WAITING_DEQUEUERS,
    WAITING_ENQUEUERS,
    POISONED,
    DEAD_ROWS,
)

# How a history bucket summarizes its points when a long window is thinned
# for the page: the worst case where an operator looks for spikes (depth,
# p99, retries, waiters), the mean for steady figures and for the full/empty
# seconds (so a bucket reads as "seconds full per interval, on average"), the
# last value for positions.
MAX: Final = "max"
MEAN: Final = "mean"
LAST: Final = "last"
BUCKET: Final = {
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
    WAITING_DEQUEUERS: MAX,
    WAITING_ENQUEUERS: MAX,
    POISONED: MAX,
    DEAD_ROWS: MAX,
}

# -- clients: ``GET /api/clients``, one row per session attached to the section -----------
# The keys are the monitor's (monitor/_clients.py) and the counters the engine's
# (engine/metrics.py); tests/test_rtv.py checks the three lists agree.

PID: Final = "pid"
BACKEND_PID: Final = "backend_pid"
ROLE: Final = "role"  # ROLE_WORKER (a `ringq worker` process) or ROLE_CLIENT
STATE: Final = "state"  # "active", or "in_doubt" (lost its connection holding slots)
STARTED: Final = "started"  # seconds since the epoch the entry was registered
QUEUES: Final = "queues"  # names of the queues the session used
BUSY_S: Final = "busy_s"  # seconds spent handling messages (workers)
COMMIT_RATE: Final = "commit_rate"  # commits per second over the monitor's last interval
HANDLED_RATE: Final = "handled_rate"  # messages handled per second over that interval
FAILED_RATE: Final = "failed_rate"  # messages failed, timed out or aborted per second
ERROR_RATE: Final = "error_rate"  # client errors per second
LAST_ERROR: Final = "last_error"  # {kind, queue, seq, t} of the last error, or None
ERROR_KIND: Final = "kind"
ERROR_QUEUE: Final = "queue"
ERROR_SEQ: Final = "seq"

ROLE_WORKER: Final = M.ROLE_WORKER
ROLE_CLIENT: Final = M.ROLE_CLIENT
STATE_ACTIVE: Final = "active"

# Totals since the session opened (a worker's carry over a reconnect).
ENQUEUED: Final = M.ENQUEUED
DEQUEUED: Final = M.DEQUEUED
CLIENT_COMMITS: Final = M.COMMITS
CLIENT_ROLLBACKS: Final = M.ROLLBACKS
ERRORS: Final = M.ERRORS
HANDLED: Final = M.HANDLED
DECLINED: Final = M.DECLINED
FAILED: Final = M.FAILED
TIMEOUTS: Final = M.TIMEOUTS
ABORTED: Final = M.ABORTED
CLIENT_POISONED: Final = M.POISONED
IN_DOUBT: Final = M.IN_DOUBT

CLIENT_COUNTERS: Final = tuple(k for k in M.CLIENT_COUNTERS if k != M.BUSY_NS)
CLIENT_RATES: Final = (COMMIT_RATE, HANDLED_RATE, FAILED_RATE, ERROR_RATE)
# Every numeric figure of a client (floats in the normalized rows, None when
# missing); the pids are ints, the rest of CLIENT_KEYS text or lists.
CLIENT_NUMERIC: Final = (STARTED, *CLIENT_COUNTERS, BUSY_S, *CLIENT_RATES)
CLIENT_KEYS: Final = (PID, BACKEND_PID, ROLE, STATE, QUEUES, *CLIENT_NUMERIC, LAST_ERROR)
