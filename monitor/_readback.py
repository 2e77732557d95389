"""The monitor's files read back without a monitor: the T4 day files and ``monitor.log``.

``ringq report`` and the regression's pages (``ringq.report``) draw a period
from these files alone, after the monitor stopped or on another host. They are
public here, beside the writers, so that a reader never imports the monitor's
private modules and the file formats stay known in one package.

- :func:`t4_rows`: every queue's samples of a period, one array per queue,
  columns as :data:`ringq.engine.metrics.SAMPLE_KEYS` (``t`` first);
- :func:`journal_records`: the records of ``monitor.log`` (and of the files
  logrotate moved aside, ``monitor.log.1`` …, not compressed ones) in a period.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from . import _sample as S
from ._journal import LOG_NAME
from ._t4 import HEADER, T4Reader, day_of

_MAX_T = 253_402_300_799.0  # the last second a date holds (9999-12-31)


def t4_queues(data_dir: Path, t0: float, t1: float) -> list[str]:
    """The names of the queues the T4 files of the days of ``t0 < t <= t1`` hold, sorted."""
    if not t1 > t0:
        return []
    reader = T4Reader(data_dir)
    names: set[str] = set()
    for path in reader.files(day_of(max(t0, 0.0)), day_of(min(t1, _MAX_T))):
        names.update(_names_in(path))
    return sorted(names)


def t4_rows(
    data_dir: Path, t0: float, t1: float, queues: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Samples with ``t0 < t <= t1`` of ``queues`` (default: every queue of those
    days), by queue, oldest first; a queue without a sample in the period is left out."""
    reader = T4Reader(data_dir)
    wanted = list(queues) if queues is not None else t4_queues(data_dir, t0, t1)
    out: dict[str, np.ndarray] = {}
    for name in wanted:
        rows = reader.read(name, t0, t1)
        if len(rows):
            out[name] = rows
    return out


def journal_records(data_dir: Path, t0: float, t1: float) -> list[dict[str, Any]]:
    """The records of the monitor's log with ``t0 < t <= t1``, oldest first.
    A line that is not a JSON object with a numeric ``t`` (a torn last line) is skipped."""
    paths = sorted(data_dir.glob(LOG_NAME + ".*"), key=_rotation, reverse=True)
    paths.append(data_dir / LOG_NAME)
    out: list[dict[str, Any]] = []
    for path in paths:
        if path.suffix in (".gz", ".bz2", ".xz", ".zst"):
            continue
        try:
            f = open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
        except OSError:
            continue
        with f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                t = rec.get("t") if isinstance(rec, dict) else None
                if isinstance(t, int | float) and t0 < t <= t1 and not math.isnan(t):
                    out.append(rec)
    out.sort(key=lambda r: float(r["t"]))
    return out


def _rotation(path: Path) -> int:
    """monitor.log.3 before monitor.log.1 (reverse order of this key): older first."""
    tail = path.name[len(LOG_NAME) + 1 :]
    return int(tail) if tail.isdigit() else 0


def _names_in(path: Path) -> set[str]:
    names: set[str] = set()
    try:
        f = open(path, encoding="utf-8", errors="replace", newline="")  # noqa: SIM115
    except OSError:
        return names
    with f:
        header = f.readline().rstrip("\r\n")
        if header == HEADER:
            at = HEADER.split(",").index(S.NAME)
            for line in f:
                parts = line.split(",", at + 1)
                if len(parts) > at + 1 and parts[at]:
                    names.add(parts[at])
        else:  # a file of another version: its own columns
            cols = next(csv.reader([header]), [])
            if S.NAME not in cols:
                return names
            at = cols.index(S.NAME)
            for row in csv.reader(f):
                if len(row) > at and row[at]:
                    names.add(row[at])
    return names
