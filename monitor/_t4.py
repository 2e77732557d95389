"""T4-style time-series files: ``data_dir/t4-YYYY-MM-DD.csv``, one per UTC day.

As the T4 collector's files: a header line naming the columns, then one row
per sample: the sample time first (``time`` ISO 8601 UTC, ``t`` unix seconds),
then the queue and its figures (the keys of :mod:`ringq.monitor._sample`).
One row per queue per interval ("long" form), so queues created or dropped
during the day need no new columns. The client kinds' counts
(:mod:`ringq.monitor._kinds`) are a second :class:`Format` of the same shape
(``t4-kinds-YYYY-MM-DD.csv``, one row per client kind per interval), written,
rotated, pruned and read by the same classes. A new file starts at midnight UTC; files
older than ``keep_days`` are deleted. A day file written by another version
(different header) is moved aside, never appended to with other columns.

:class:`T4Reader` reads a queue's rows back (for ``/api/history``, points
older than the monitor's memory): one pass over the bytes, the queue's lines
picked by their name field, the figures parsed by numpy in one call, and the
result cached per (file, queue) by the file's identity and size, so a finished
day is parsed once and today's file is read again only from where it was left
(and only when a request needs rows newer than what was read).
"""

from __future__ import annotations

import csv
import io
import math
import os
import re
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import IO

import numpy as np

from . import _kinds as K
from . import _sample as S

_LAST_DAY_T = 253_402_300_799.0  # 9999-12-31T23:59:59Z, the last time a date holds
CACHE_BYTES = 128 << 20  # parsed rows kept by a T4Reader (a queue-day at 1 s is about 14.5 MB)


@dataclass(frozen=True)
class Format:
    """One kind of T4 file: its name prefix, the column naming a row's series
    (a queue, a client kind) and the numeric columns (``t`` first).

    A row is ``time,t,<key>,<the other numeric columns>``; read back, a row is
    its numeric columns in ``numeric``'s order. Two formats' prefixes must not
    match each other's file names (``t4-`` is followed by a digit, ``t4-kinds-``
    by a letter)."""

    prefix: str
    key: str
    numeric: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return ("time", self.numeric[0], self.key, *self.numeric[1:])

    @property
    def header(self) -> str:
        return ",".join(self.columns)

    @property
    def width(self) -> int:
        return len(self.numeric)

    def file_for(self, data_dir: Path, day: date) -> Path:
        return data_dir / f"{self.prefix}-{day.isoformat()}.csv"

    def day_of_file(self, name: str) -> date | None:
        """The UTC day a file name of this format stands for
        (``PREFIX-YYYY-MM-DD[.old-HHMMSS].csv``), or None."""
        if not name.startswith(self.prefix + "-"):
            return None
        m = _DAY_RE.match(name, len(self.prefix) + 1)
        if not m:
            return None
        try:
            return date.fromisoformat(m.group(1))
        except ValueError:
            return None


_DAY_RE = re.compile(r"(\d{4}-\d{2}-\d{2})(?:\.old-\d{6})?\.csv$")
QUEUES = Format("t4", S.NAME, tuple(S.NUMERIC_KEYS))
KINDS = Format("t4-kinds", K.KIND, K.NUMERIC_KEYS)
COLUMNS = QUEUES.columns
HEADER = QUEUES.header


def file_for(data_dir: Path, day: date) -> Path:
    """The queues' T4 file of ``day``."""
    return QUEUES.file_for(data_dir, day)


class T4Writer:
    """Appends samples to the day's file; rotates at midnight UTC. ``close()`` is idempotent.

    ``fmt``: which file (default: the queues'); a sample is a dict holding the
    format's key and numeric columns."""

    def __init__(self, data_dir: Path, keep_days: int, fmt: Format = QUEUES) -> None:
        self.data_dir = data_dir
        self.keep_days = keep_days
        self.fmt = fmt
        self._day: date | None = None
        self._f: IO[str] | None = None
        data_dir.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path | None:
        return None if self._day is None else self.fmt.file_for(self.data_dir, self._day)

    def write(self, samples: list[dict[str, float | str]]) -> None:
        if not samples:
            return
        t = float(samples[0][self.fmt.numeric[0]])
        when = datetime.fromtimestamp(t, UTC)
        if when.date() != self._day or self._f is None:
            self._rotate(when.date())
        assert self._f is not None
        buf = io.StringIO()
        out = csv.writer(buf, lineterminator="\n")
        stamp = when.isoformat(timespec="milliseconds")
        for s in samples:
            out.writerow([stamp, *(_cell(s[k]) for k in self.fmt.columns[1:])])
        self._f.write(buf.getvalue())
        self._f.flush()

    def _rotate(self, day: date) -> None:
        self.close()
        path = self.fmt.file_for(self.data_dir, day)
        header = self.fmt.header
        if path.exists() and path.stat().st_size > 0:
            with open(path, encoding="utf-8") as f:
                first = f.readline().rstrip("\n")
            if first != header:
                stamp = datetime.now(UTC).strftime("%H%M%S")
                path.rename(path.with_name(f"{path.stem}.old-{stamp}.csv"))
        fresh = not path.exists() or path.stat().st_size == 0
        torn = not fresh and _ends_torn(path)
        self._f = open(path, "a", encoding="utf-8", newline="")  # noqa: SIM115
        if fresh:
            self._f.write(header + "\n")
            self._f.flush()
        elif torn:
            # A monitor killed in the middle of a row: end that row, so ours
            # start on a line of their own (the reader skips the torn one).
            self._f.write("\n")
            self._f.flush()
        self._day = day
        self.prune(day)

    def prune(self, today: date) -> list[Path]:
        """Delete day files older than ``keep_days`` (today's counts as one)."""
        oldest = today - timedelta(days=self.keep_days - 1)
        gone = []
        for p in self.data_dir.glob(self.fmt.prefix + "-*.csv"):
            day = self.fmt.day_of_file(p.name)
            if day is not None and day < oldest:
                p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _ends_torn(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def day_of(t: float) -> date:
    """The UTC day of unix time ``t`` (the day whose file holds its row)."""
    return datetime.fromtimestamp(t, UTC).date()


@dataclass
class _Parsed:
    """One queue's rows of one file, as far as the file was read."""

    ident: tuple[int, int]  # (st_dev, st_ino): a replaced file is read afresh
    offset: int  # bytes consumed (always at a line start)
    mtime_ns: int
    cols: list[int | None] | None  # None: the file has our header (fast path)
    width: int  # numeric columns per row
    chunks: list[np.ndarray] = field(default_factory=list)

    def rows(self) -> np.ndarray:
        if len(self.chunks) != 1:
            joined = np.concatenate(self.chunks) if self.chunks else np.empty((0, self.width))
            self.chunks = [joined]
        return self.chunks[0]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def last_t(self) -> float:
        for c in reversed(self.chunks):
            if len(c):
                return float(c[-1, 0])
        return -math.inf


class T4Reader:
    """Reads queues' samples (or, with ``fmt``, another format's rows: the
    client kinds') back from the day files in ``data_dir``.

    Thread-safe (one lock: two requests for the same day do not parse it
    twice). At most ``cache_bytes`` of parsed rows are kept, least recently
    used first out. Rows are assumed appended in time order within a file
    (they are, unless the clock steps back).
    """

    def __init__(
        self, data_dir: Path, cache_bytes: int = CACHE_BYTES, fmt: Format = QUEUES
    ) -> None:
        self.data_dir = data_dir
        self.fmt = fmt
        self.cache_bytes = cache_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[Path, str], _Parsed] = OrderedDict()
        self.parsed_rows = 0  # rows parsed so far (tests and benchmarks read it)

    def files(self, first: date, last: date) -> list[Path]:
        """The day files (and moved-aside ones) of the days ``first`` … ``last``, oldest first."""
        found: list[tuple[date, str, Path]] = []
        try:
            entries = list(os.scandir(self.data_dir))
        except OSError:
            return []
        for e in entries:
            day = self.fmt.day_of_file(e.name)
            if day is not None and first <= day <= last:
                # t4-D.old-HHMMSS.csv sorts before t4-D.csv: its rows are older.
                found.append((day, "0" if ".old-" in e.name else "1", Path(e.path)))
        return [p for _, _, p in sorted(found)]

    def read(self, name: str, t0: float, t1: float) -> np.ndarray:
        """Rows of queue ``name`` with ``t0 < t <= t1``, by time, one column per
        :data:`~ringq.monitor._sample.NUMERIC_KEYS` (``t`` first; another format:
        its ``numeric``). A row written twice (two files of one day) comes once."""
        return self.lookup(name, t0, t1)[0]

    def lookup(self, name: str, t0: float, t1: float) -> tuple[np.ndarray, bool]:
        """:meth:`read`, and whether the files of those days hold ``name`` at all."""
        width = self.fmt.width
        if not t1 > t0:
            return np.empty((0, width)), False
        first = day_of(max(t0, 0.0))
        last = day_of(min(t1, _LAST_DAY_T))
        parts = []
        seen = False
        for path in self.files(first, last):
            rows = self._rows(path, name, t1)
            if len(rows):
                seen = True
                times = rows[:, 0]
                lo, hi = np.searchsorted(times, t0, "right"), np.searchsorted(times, t1, "right")
                if hi > lo:
                    parts.append(rows[lo:hi])
        if not parts:
            return np.empty((0, width)), seen
        out = np.concatenate(parts) if len(parts) > 1 else parts[0].copy()
        if len(parts) > 1:
            out = out[np.argsort(out[:, 0], kind="stable")]
            keep = np.r_[True, out[1:, 0] != out[:-1, 0]]
            out = out[keep]
        return out, seen

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()

    def _rows(self, path: Path, name: str, need_t: float) -> np.ndarray:
        key = (path, name)
        with self._lock:
            try:
                st = path.stat()
            except OSError:
                self._cache.pop(key, None)
                return np.empty((0, self.fmt.width))
            ident = (st.st_dev, st.st_ino)
            got = self._cache.get(key)
            if got is not None and (
                got.ident != ident or st.st_size < got.offset
                or (st.st_size == got.offset and st.st_mtime_ns != got.mtime_ns)
            ):
                got = None  # replaced, truncated or rewritten: read it afresh
            if got is None:
                got = _Parsed(ident, 0, st.st_mtime_ns, None, self.fmt.width)
            # Read on only if the file grew and the request wants rows newer
            # than those already read: today's file, asked for what precedes
            # the monitor's memory, is read once.
            if st.st_size > got.offset and (got.offset == 0 or got.last_t() < need_t):
                self._read_on(path, name, got)
                got.mtime_ns = st.st_mtime_ns
            self._cache[key] = got
            self._cache.move_to_end(key)
            self._evict(keep=key)
            return got.rows()

    def _read_on(self, path: Path, name: str, got: _Parsed) -> None:
        with open(path, "rb") as f:
            f.seek(got.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1  # a row being written is left for later
        if end == 0:
            return
        data = data[:end]
        start = 0
        if got.offset == 0:
            start = data.find(b"\n") + 1
            header = data[: start - 1].decode("utf-8", "replace").rstrip("\r")
            got.cols = None if header == self.fmt.header else _column_map(header, self.fmt)
        chunk = (
            _parse_fast(data[start:], name, self.fmt.width)
            if got.cols is None
            else _parse_mapped(data[start:], name, got.cols, self.fmt.width)
        )
        got.offset += end
        if len(chunk):
            got.chunks.append(chunk)
            self.parsed_rows += len(chunk)

    def _evict(self, keep: tuple[Path, str]) -> None:
        total = sum(p.nbytes for p in self._cache.values())
        for key in list(self._cache):
            if total <= self.cache_bytes:
                break
            if key != keep:
                total -= self._cache.pop(key).nbytes


def _parse_fast(data: bytes, name: str, width: int) -> np.ndarray:
    """The rows of ``name`` in lines of our own header's columns (``width`` numbers each)."""
    marker = f",{name},".encode()
    lines = [ln for ln in data.split(b"\n") if marker in ln]
    if not lines:
        return np.empty((0, width))
    # time,t,name,rest -> t,rest (a name is [a-z][a-z0-9_]*: no quoting, no comma)
    key = marker[1:-1]
    good = [
        p[1] + b"," + p[3]
        for p in (ln.split(b",", 3) for ln in lines)
        if len(p) == 4 and p[2] == key and p[3].count(b",") == width - 2
    ]
    if not good:
        return np.empty((0, width))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # numpy warns, not raises, on a bad number
            flat = np.fromstring(b",".join(good), dtype=np.float64, sep=",")
        if flat.size == len(good) * width:
            return flat.reshape(len(good), width)
    except (ValueError, DeprecationWarning):
        pass
    # A damaged row somewhere: parse row by row and skip the bad ones.
    out = []
    for row in good:
        try:
            out.append([float(x) for x in row.split(b",")])
        except ValueError:
            continue
    return np.array(out, dtype=np.float64).reshape(-1, width)


def _column_map(header: str, fmt: Format) -> list[int | None]:
    """For a file of another version: where the key and each numeric column are
    (None: absent, read 0)."""
    names = next(csv.reader([header]), [])
    return [names.index(k) if k in names else None for k in (fmt.key, *fmt.numeric)]


def _parse_mapped(data: bytes, name: str, cols: list[int | None], width: int) -> np.ndarray:
    at_name, at = cols[0], cols[1:]
    if at_name is None or at[0] is None:
        return np.empty((0, width))
    out = []
    for row in csv.reader(io.StringIO(data.decode("utf-8", "replace"))):
        try:
            if row[at_name] != name:
                continue
            out.append([float(row[i]) if i is not None and row[i] != "" else 0.0 for i in at])
        except (IndexError, ValueError):
            continue
    return np.array(out, dtype=np.float64).reshape(-1, width)


def _cell(v: float | str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v)
