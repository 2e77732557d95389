"""The monitor's named SQL (``queries.sql``), parsed once at import.

Every block is named here as a constant, so that a block missing from the
file fails at import and not in the middle of a step. ``{table}`` blocks are
filled only through :func:`ringq.engine.sqlfile.compose` with
:func:`ringq.engine.queue_table`.
"""

from __future__ import annotations

from typing import Final

from ringq.engine.sqlfile import load

_Q: Final = load("ringq.monitor", "queries.sql")

TRY_MONITOR_LOCK: Final = _Q["try_monitor_lock"]
MONITOR_LOCK_HOLDER: Final = _Q["monitor_lock_holder"]
INSTANCE_ID: Final = _Q["instance_id"]
IN_RECOVERY: Final = _Q["in_recovery"]
QUEUES: Final = _Q["queues"]
EXCEPTION_COUNTS: Final = _Q["exception_counts"]
RECENT_EXCEPTIONS: Final = _Q["recent_exceptions"]
XMIN_HOLDERS: Final = _Q["xmin_holders"]
RING_STORAGE: Final = _Q["ring_storage"]
DEAD_ROWS: Final = _Q["dead_rows"]
GROUP_OLDEST_AGE: Final = _Q["group_oldest_age"]  # {table}
# the SQL inbox pump
INBOX_PENDING: Final = _Q["inbox_pending"]
INBOX_FULL: Final = _Q["inbox_full"]
PUMP_ASYNC_COMMIT: Final = _Q["pump_async_commit"]
INBOX_NEXT: Final = _Q["inbox_next"]
INBOX_REFUSE: Final = _Q["inbox_refuse"]
ROOM_PUBLISH: Final = _Q["room_publish"]
INBOX_COUNTS: Final = _Q["inbox_counts"]
ROOM_SHORT: Final = _Q["room_short"]
# idempotency-key pruning
KEYS_QUEUES: Final = _Q["keys_queues"]
KEYS_PRUNE: Final = _Q["keys_prune"]  # {table}
KEYS_PRUNE_DROPPED: Final = _Q["keys_prune_dropped"]
LISTEN_INBOX: Final = _Q["listen_inbox"]  # {channel}

INBOX_CHANNEL: Final = "ringq_inbox"  # ringq.enqueue() notifies it (scripting/ddl.sql)
