"""The monitor's files read back without a monitor: the T4 day files and ``monitor.log``.

``ringq report`` and the regression's pages (``ringq.report``) draw a period
from these files alone, after the monitor stopped or on another host. They are
public here, beside the writers, so that a reader never imports the monitor's
private modules and the file formats stay known in one package.

- :func:`t4_rows`: every queue's samples of a period, one array per queue,
  columns as :data:`ringq.engine.metrics.SAMPLE_KEYS` (``t`` first);
- :func:`kind_rows`: per client kind (``client``, ``worker``), what its clients
  did over each sample interval, columns as :data:`KIND_KEYS` (``t`` first);
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

from . import _kinds as K
from ._journal import LOG_NAME
from ._t4 import KINDS, QUEUES, Format, T4Reader, day_of

_MAX_T = 253_402_300_799.0  # the last second a date holds (9999-12-31)

# The columns of a :func:`kind_rows` array, in order: ``t`` (unix seconds, the
# sample's time), ``clients`` (of the kind attached then), ``interval_s`` (the
# seconds since the previous sample), then what the kind's clients did over
# that interval: ``enqueued`` and ``dequeued`` calls, ``commits``,
# ``rollbacks``, ``errors``, the workers' ``handled``, ``declined``,
# ``failed``, ``timeouts``, ``aborted``, ``poisoned``, ``in_doubt``, and
# ``busy_s`` (seconds spent handling). A count divided by ``interval_s`` is a
# rate. Counts are sums of per-client deltas: a client's exit never makes
# them run backwards; its calls after the last sample before its exit are
# not counted.
KIND_KEYS: tuple[str, ...] = tuple(K.NUMERIC_KEYS)


def t4_queues(data_dir: Path, t0: float, t1: float) -> list[str]:
    """The names of the queues the T4 files of the days of ``t0 < t <= t1`` hold, sorted."""
    return _series(data_dir, t0, t1, QUEUES)


def t4_rows(
    data_dir: Path, t0: float, t1: float, queues: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Samples with ``t0 < t <= t1`` of ``queues`` (default: every queue of those
    days), by queue, oldest first; a queue without a sample in the period is left out."""
    return _rows(data_dir, t0, t1, queues, QUEUES)


def client_kinds(data_dir: Path, t0: float, t1: float) -> list[str]:
    """The client kinds the kinds' T4 files of the days of ``t0 < t <= t1`` hold, sorted."""
    return _series(data_dir, t0, t1, KINDS)


def kind_rows(
    data_dir: Path, t0: float, t1: float, kinds: Iterable[str] | None = None
) -> dict[str, np.ndarray]:
    """Rows with ``t0 < t <= t1`` of client ``kinds`` (default: every kind of
    those days), by kind, oldest first, columns as :data:`KIND_KEYS`; a kind
    without a row in the period is left out. Monitors before this file: none."""
    return _rows(data_dir, t0, t1, kinds, KINDS)


def _series(data_dir: Path, t0: float, t1: float, fmt: Format) -> list[str]:
    if not t1 > t0:
        return []
    reader = T4Reader(data_dir, fmt=fmt)
    names: set[str] = set()
    for path in reader.files(day_of(max(t0, 0.0)), day_of(min(t1, _MAX_T))):
        names.update(_names_in(path, fmt))
    return sorted(names)


def _rows(
    data_dir: Path, t0: float, t1: float, wanted: Iterable[str] | None, fmt: Format
) -> dict[str, np.ndarray]:
    reader = T4Reader(data_dir, fmt=fmt)
    names = list(wanted) if wanted is not None else _series(data_dir, t0, t1, fmt)
    out: dict[str, np.ndarray] = {}
    for name in names:
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


def _names_in(path: Path, fmt: Format) -> set[str]:
    names: set[str] = set()
    try:
        f = open(path, encoding="utf-8", errors="replace", newline="")  # noqa: SIM115
    except OSError:
        return names
    with f:
        header = f.readline().rstrip("\r\n")
        if header == fmt.header:
            at = fmt.columns.index(fmt.key)
            for line in f:
                parts = line.split(",", at + 1)
                if len(parts) > at + 1 and parts[at]:
                    names.add(parts[at])
        else:  # a file of another version: its own columns
            cols = next(csv.reader([header]), [])
            if fmt.key not in cols:
                return names
            at = cols.index(fmt.key)
            for row in csv.reader(f):
                if len(row) > at and row[at]:
                    names.add(row[at])
    return names
