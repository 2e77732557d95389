"""``monitor.json`` in the data directory: the pid and URL of the running
monitor, read by ``ringq status`` (:func:`ringq.monitor.read_state`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ringq.engine import redact_dsn

STATE_FILE = "monitor.json"  # data_dir: pid and URL of the running monitor (read by `ringq status`)


def write_state_file(data_dir: Path | None, url: str | None, started: float, dsn: str) -> None:
    """Write (atomically) this process's state file; nothing without a data directory."""
    if data_dir is None:
        return
    path = data_dir / STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "url": url, "started": started,
                               "dsn": redact_dsn(dsn)}))
    tmp.replace(path)


def remove_state_file(data_dir: Path | None) -> None:
    """Remove the state file if this process wrote it (a successor's stays)."""
    if data_dir is None:
        return
    path = data_dir / STATE_FILE
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass
