"""T4-style time-series files: ``data_dir/t4-YYYY-MM-DD.csv``, one per UTC day.

As the T4 collector's files: a header line naming the columns, then one row
per sample: the sample time first (``time`` ISO 8601 UTC, ``t`` unix seconds),
then the queue and its figures (the keys of :mod:`ringq.monitor._sample`).
One row per queue per interval ("long" form), so queues created or dropped
during the day need no new columns. A new file starts at midnight UTC; files
older than ``keep_days`` are deleted. A day file written by another version
(different header) is moved aside, never appended to with other columns.
"""

from __future__ import annotations

import csv
import io
import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO

from . import _sample as S

COLUMNS = ("time", S.T, S.NAME, *[k for k in S.NUMERIC_KEYS if k != S.T])
HEADER = ",".join(COLUMNS)
_FILE_RE = re.compile(r"^t4-(\d{4}-\d{2}-\d{2})(?:\.old-\d{6})?\.csv$")


def file_for(data_dir: Path, day: date) -> Path:
    return data_dir / f"t4-{day.isoformat()}.csv"


class T4Writer:
    """Appends samples to the day's file; rotates at midnight UTC. ``close()`` is idempotent."""

    def __init__(self, data_dir: Path, keep_days: int) -> None:
        self.data_dir = data_dir
        self.keep_days = keep_days
        self._day: date | None = None
        self._f: IO[str] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path | None:
        return None if self._day is None else file_for(self.data_dir, self._day)

    def write(self, samples: list[dict[str, float | str]]) -> None:
        if not samples:
            return
        t = float(samples[0][S.T])
        when = datetime.fromtimestamp(t, UTC)
        if when.date() != self._day or self._f is None:
            self._rotate(when.date())
        assert self._f is not None
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        stamp = when.isoformat(timespec="milliseconds")
        for s in samples:
            out.writerow([stamp, *(_cell(s[k]) for k in COLUMNS[1:])])
        self._f.write(buf.getvalue())
        self._f.flush()

    def _rotate(self, day: date) -> None:
        self.close()
        path = file_for(self.data_dir, day)
        if path.exists() and path.stat().st_size > 0:
            with open(path, encoding="utf-8") as f:
                first = f.readline().rstrip("\n")
            if first != HEADER:
                stamp = datetime.now(UTC).strftime("%H%M%S")
                path.rename(path.with_name(f"{path.stem}.old-{stamp}.csv"))
        fresh = not path.exists() or path.stat().st_size == 0
        self._f = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115
        if fresh:
            self._f.write(HEADER + "\n")
            self._f.flush()
        self._day = day
        self.prune(day)

    def prune(self, today: date) -> list[Path]:
        """Delete day files older than ``keep_days`` (today's counts as one)."""
        oldest = today - timedelta(days=self.keep_days - 1)
        gone = []
        for p in self.data_dir.glob("t4-*.csv"):
            m = _FILE_RE.match(p.name)
            if not m:
                continue
            try:
                day = date.fromisoformat(m.group(1))
            except ValueError:
                continue
            if day < oldest:
                p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _cell(v: float | str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)
