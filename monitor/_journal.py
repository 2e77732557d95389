"""The monitor's structured log: one JSON object per line in ``data_dir/monitor.log``.

Each record has ``t`` (unix seconds), ``time`` (ISO 8601 UTC) and ``event``
(``monitor.started``, ``client.recovered``, ``queue.repaired``, ``step.failed``,
``entry.poisoned``, ``prepared.resolved`` …) plus the event's own fields (pid,
queue, seq …). Records also go to the ``ringq.monitor`` Python logger.
:meth:`Journal.reopen` (on SIGHUP) lets logrotate move the file away.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger("ringq.monitor")

LOG_NAME = "monitor.log"


class Journal:
    """Append-only JSON-lines file (or nothing but the logger when ``path`` is None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._f: IO[str] | None = None
        self._open()

    def _open(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Line buffered: a record is on disk when write() returns, even if we are killed next.
        self._f = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, event: str, level: int = logging.INFO, **fields: Any) -> None:
        now = time.time()
        record = {
            "t": round(now, 6),
            "time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds"),
            "event": event,
            "monitor_pid": os.getpid(),
            **fields,
        }
        line = json.dumps(record, separators=(",", ":"), default=str)
        if logger.isEnabledFor(level):
            logger.log(
                level, "%s %s", event, json.dumps(fields, separators=(",", ":"), default=str)
            )
        with self._lock:
            if self._f is not None:
                self._f.write(line + "\n")

    def reopen(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
            self._open()

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None
