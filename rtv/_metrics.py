"""What the viewer shows of the figures the monitor's HTTP API serves.

The figures' names are :mod:`ringq.engine.metrics`' (one place for the monitor
and the viewer): a queue's sample keys, the rule that sums each up when history
is thinned (:data:`~ringq.engine.metrics.BUCKET`), the keys of one client of
``GET /api/clients``. Here: which the viewer shows, in which order. The page
(``static/app.js``) and the terminal view read the normalized rows built by
:mod:`ringq.rtv._source`.
"""

from __future__ import annotations

from typing import Final

from ringq.engine import metrics as M

INTERVAL: Final = "interval"  # the monitor's sampling interval, seconds

# Every numeric figure of a queue (a sample's but its time), in the order the table shows them.
NUMERIC: Final = tuple(k for k in M.SAMPLE_KEYS if k != M.T)
# How a bucket of thinned history sums up each of them (the monitor's rules).
BUCKET: Final = {k: M.BUCKET[k] for k in NUMERIC}

# Every numeric figure of a client (floats in the normalized rows, None when
# missing); the pids are ints, the rest of M.CLIENT_KEYS text or lists.
CLIENT_NUMERIC: Final = (M.STARTED, *M.CLIENT_SHOWN_COUNTERS, M.BUSY_S, *M.CLIENT_RATES)
