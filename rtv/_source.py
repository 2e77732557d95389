"""Data access: the monitor's HTTP API, read and normalized (no rendering here).

The page and the terminal view both read through :class:`MonitorClient`, so
whatever shape the monitor serves is mended in one place: every row comes out
with every key of :data:`~ringq.rtv._metrics.NUMERIC` as a float (missing ones
``None``; every row also every key of :data:`~ringq.engine.metrics.DUE_KEYS`,
a float or ``None``; a grouped queue's row also every key of
:data:`~ringq.engine.metrics.GROUP_KEYS`, an ungrouped one's none), queues
sorted by name, history points sorted by time, clients with every key of
:data:`~ringq.engine.metrics.CLIENT_KEYS`, workers first; the server the
monitor is on with every key of :data:`SERVER_FIELDS`.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard
from urllib.parse import urlencode

from ringq.engine import RingqError
from ringq.engine import metrics as M

from . import _metrics as K

Row = dict[str, Any]


class MonitorError(RingqError):
    """The monitor answered, but not with what the viewer asked for (an HTTP
    error status such as 401 for a wrong ``monitor_token``, or a body that is
    not the API's JSON). ``status`` is the HTTP status, or ``None``."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class MonitorUnavailable(MonitorError):
    """The monitor cannot be reached at its address (refused, timed out, reset)."""


# The monitor's own figures passed on to the page (``monitor`` in /api/queues).
MONITOR_FIELDS = (
    "interval",
    "beat",
    "started",
    "running",
    "database",
    "clients",
    "xmin_age_s",
    "version",
)

# The server the monitor's connection is on (``server`` in /api/queues, monitor/API.md).
SERVER_FIELDS = (
    "host",
    "port",
    "address",
    "primary",
    "system_identifier",
    "timeline",
    "section_history",
    "section_follows",
    "t",
)


@dataclass(frozen=True)
class Overview:
    """One answer of ``GET /api/queues``: the sample time ``t`` (epoch
    seconds), the monitor's sampling ``interval`` (seconds), some of its own
    figures (``monitor``), every queue's row, sorted by name, and the server
    the monitor is on (``server``, from :func:`normalize_server`; None from a
    monitor that does not say)."""

    t: float | None
    interval: float | None
    monitor: dict[str, Any]
    queues: list[Row]
    server: Row | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Clients:
    """One answer of ``GET /api/clients``: the time ``t`` (epoch seconds) the
    counters were read, the monitor's sampling ``interval`` (seconds, the span
    of the rates) and every session attached to the section, workers first,
    then by pid (rows from :func:`normalize_client`)."""

    t: float | None
    interval: float | None
    clients: list[Row]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class History:
    """One answer of ``GET /api/history``: the monitor's sampling ``interval``
    (seconds), the points, oldest first, and ``step``: the seconds each point
    summarizes when the monitor thinned them (0: raw samples)."""

    interval: float | None
    points: list[Row]
    step: float = 0.0


class MonitorClient:
    """Reads ``GET /api/queues``, ``GET /api/history`` and ``GET /api/clients``
    from a monitor (``monitor/API.md``).

    Thread-safe: each call opens its own connection. ``timeout`` (seconds)
    bounds each request; ``history_timeout`` a history request.

    :raises MonitorUnavailable: from every call when the monitor cannot be reached.
    :raises MonitorError: from every call when it answers with an error or bad JSON.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout: float = 5.0,
        history_timeout: float = 60.0,
    ) -> None:
        self.url = url.rstrip("/")
        self._token = token
        self._timeout = timeout
        # A day of history is tens of megabytes of JSON: more time for it.
        self._history_timeout = max(timeout, history_timeout)

    def overview(self) -> Overview:
        """Every queue's current figures and the monitor's own."""
        body = self._get("/api/queues")
        items = body.get("queues") if isinstance(body, Mapping) else body
        if not _is_list(items):
            raise MonitorError("GET /api/queues: expected a list of queues")
        rows = [normalize(item) for item in items if isinstance(item, Mapping) and item.get(M.NAME)]
        rows.sort(key=lambda r: str(r[M.NAME]))
        status = body.get("monitor") if isinstance(body, Mapping) else None
        monitor = (
            {k: status[k] for k in MONITOR_FIELDS if k in status}
            if isinstance(status, Mapping)
            else {}
        )
        t = _number(body.get(M.T)) if isinstance(body, Mapping) else None
        server = (
            normalize_server(body["server"])
            if isinstance(body, Mapping) and "server" in body
            else None
        )
        return Overview(
            t=t,
            interval=_number(monitor.get(K.INTERVAL)),
            monitor=monitor,
            queues=rows,
            server=server,
        )

    def queues(self) -> list[Row]:
        """Every queue's current figures, sorted by name."""
        return self.overview().queues

    def clients(self) -> Clients:
        """Every session attached to the section (a program's own, or a worker
        process): its counters now and its rates over the monitor's last
        interval; workers first, then by pid."""
        body = self._get("/api/clients")
        items = body.get("clients") if isinstance(body, Mapping) else body
        if not _is_list(items):
            raise MonitorError("GET /api/clients: expected a list of clients")
        rows = [normalize_client(item) for item in items if isinstance(item, Mapping)]
        rows = [r for r in rows if r[M.PID] is not None]
        rows.sort(key=client_order)
        t = _number(body.get(M.T)) if isinstance(body, Mapping) else None
        interval = _number(body.get(K.INTERVAL)) if isinstance(body, Mapping) else None
        return Clients(t=t, interval=interval, clients=rows)

    def history(self, queue: str, since: float, max_points: int | None = None) -> History:
        """The queue's samples taken after ``since`` (seconds since the epoch), oldest first.

        With ``max_points`` the monitor thins a longer answer into at most that
        many buckets (``History.step`` says how wide); the day it serves from its
        T4 files is 86,400 points per queue at 1 s, so ask for what you can draw.

        :raises MonitorError: with ``status`` 404 when the monitor never sampled ``queue``.
        """
        params: dict[str, str] = {"queue": queue, "since": f"{since:.3f}"}
        if max_points is not None:
            params["max_points"] = str(max_points)
        body = self._get("/api/history?" + urlencode(params), self._history_timeout)
        items = body.get("points") if isinstance(body, Mapping) else body
        if not _is_list(items):
            raise MonitorError("GET /api/history: expected a list of points")
        points = [normalize(p) for p in items if isinstance(p, Mapping)]
        points = [p for p in points if p[M.T] is not None and p[M.T] > since]
        points.sort(key=lambda p: p[M.T])
        interval = _number(body.get(K.INTERVAL)) if isinstance(body, Mapping) else None
        step = _number(body.get("step")) if isinstance(body, Mapping) else None
        return History(interval=interval, points=points, step=step or 0.0)

    def _get(self, path: str, timeout: float | None = None) -> Any:
        request = urllib.request.Request(self.url + path, headers={"Accept": "application/json"})
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        what = "GET " + path.split("?", 1)[0]
        try:
            with urllib.request.urlopen(request, timeout=timeout or self._timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read(2000).decode("utf-8", "replace").strip()
            exc.close()
            try:  # the monitor's error document: {"error": ..., "status": ...}
                detail = str(json.loads(detail)["error"])
            except (ValueError, KeyError, TypeError):
                detail = detail[:300]
            hint = " (check --monitor-token)" if exc.code in (401, 403) else ""
            raise MonitorError(
                f"monitor {self.url}: {what} answered {exc.code} {exc.reason}{hint}: {detail}",
                status=exc.code,
            ) from exc
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise MonitorUnavailable(f"monitor {self.url} unreachable: {reason}") from exc
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise MonitorError(f"monitor {self.url}: {what} did not answer JSON") from exc


def _is_list(value: object) -> TypeGuard[Sequence[Any]]:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


_FIELDS = (M.T, *K.NUMERIC)


def normalize(item: Mapping[str, Any]) -> Row:
    """One queue or one history point with every known figure as a float or ``None``."""
    row: Row = {}
    if M.NAME in item:
        row[M.NAME] = str(item[M.NAME])
    get = item.get
    for key in _FIELDS:
        value: Any = get(key)
        kind = type(value)
        # The common case first: a day of history is 86,400 points per queue.
        if (kind is float or kind is int) and math.isfinite(value):
            row[key] = float(value)
        else:
            row[key] = _number(value)
    for key in M.DUE_KEYS:  # every queue's (None from a monitor older than issue 24)
        row[key] = _number(get(key))
    if any(k in item for k in M.GROUP_KEYS):  # a grouped queue's figures: all of them or none
        for key in M.GROUP_KEYS:
            row[key] = _number(get(key))
    return row


def normalize_client(item: Mapping[str, Any]) -> Row:
    """One client with every key of :data:`~ringq.engine.metrics.CLIENT_KEYS`:
    pids as ints, figures as floats (missing ones ``None``), ``role`` and
    ``state`` as text, ``queues`` as a list of names, ``last_error`` as
    ``{kind, queue, seq, t}`` or ``None``."""
    row: Row = {M.PID: _int(item.get(M.PID)), M.BACKEND_PID: _int(item.get(M.BACKEND_PID))}
    row[M.ROLE] = str(item.get(M.ROLE) or M.ROLE_CLIENT)
    row[M.STATE] = str(item.get(M.STATE) or M.STATE_ACTIVE)
    queues = item.get(M.QUEUES)
    row[M.QUEUES] = sorted(str(q) for q in queues) if _is_list(queues) else []
    for key in K.CLIENT_NUMERIC:
        row[key] = _number(item.get(key))
    last = item.get(M.LAST_ERROR)
    row[M.LAST_ERROR] = (
        {
            M.ERROR_KIND: str(last.get(M.ERROR_KIND) or "error"),
            M.ERROR_QUEUE: None if last.get(M.ERROR_QUEUE) is None else str(last[M.ERROR_QUEUE]),
            M.ERROR_SEQ: _int(last.get(M.ERROR_SEQ)),
            M.T: _number(last.get(M.T)),
        }
        if isinstance(last, Mapping)
        else None
    )
    return row


def normalize_server(item: object) -> Row:
    """``server`` of ``/api/queues`` with every key of :data:`SERVER_FIELDS`:
    ``host`` and ``address`` as text, ``port``, ``system_identifier`` and
    ``timeline`` as ints, ``primary`` and ``section_follows`` as bools,
    ``section_history`` as ``{system_identifier, timeline}`` or ``None``, ``t``
    as a float (missing ones ``None``); and ``known``: False when the monitor
    had no reading (it serves null while it has no database connection)."""
    if not isinstance(item, Mapping):
        return {"known": False, **dict.fromkeys(SERVER_FIELDS)}
    section = item.get("section_history")
    row: Row = {
        "known": True,
        "host": None if item.get("host") is None else str(item["host"]),
        "port": _int(item.get("port")),
        "address": None if item.get("address") is None else str(item["address"]),
        "primary": _bool(item.get("primary")),
        # Not through a float: a system identifier is above 2**53.
        "system_identifier": _whole(item.get("system_identifier")),
        "timeline": _whole(item.get("timeline")),
        "section_history": (
            {
                "system_identifier": _whole(section.get("system_identifier")),
                "timeline": _whole(section.get("timeline")),
            }
            if isinstance(section, Mapping)
            else None
        ),
        "section_follows": _bool(item.get("section_follows")),
        "t": _number(item.get("t")),
    }
    if row["address"] is None and row["host"] is not None and row["port"] is not None:
        row["address"] = f"{row['host']}:{row['port']}"
    return row


def client_order(row: Row) -> tuple[bool, int, float]:
    """Workers first, then by pid (the monitor's own order)."""
    return (row[M.ROLE] != M.ROLE_WORKER, row[M.PID] or 0, row[M.STARTED] or 0.0)


def _int(value: object) -> int | None:
    number = _number(value)
    return None if number is None or isinstance(value, bool) else int(number)


def _whole(value: object) -> int | None:
    """An int as it is (a float would round a 64-bit identifier), else via :func:`_int`."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return _int(value)


def _bool(value: object) -> bool | None:
    return value if isinstance(value, bool) else None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if isinstance(value, int | float):
        f = float(value)
        return f if math.isfinite(f) else None
    if isinstance(value, str):
        try:
            f = float(value)
        except ValueError:
            return None
        return f if math.isfinite(f) else None
    return None


def thin(points: Sequence[Row], max_points: int) -> list[Row]:
    """At most about ``max_points`` points: equal time buckets over the span,
    each summarized per :data:`~ringq.rtv._metrics.BUCKET` and stamped with
    its last point's time (so later samples append after it)."""
    if len(points) <= max_points:
        return list(points)
    first, last = points[0][M.T], points[-1][M.T]
    width = (last - first) / max_points or 1.0
    out: list[Row] = []
    bucket: list[Row] = []
    edge = first + width
    for p in points:
        if p[M.T] > edge and bucket:
            out.append(_summarize(bucket))
            bucket = []
            edge += width * max(1, math.ceil((p[M.T] - edge) / width))
        bucket.append(p)
    if bucket:
        out.append(_summarize(bucket))
    return out


def _summarize(bucket: Sequence[Row]) -> Row:
    row: Row = {M.T: bucket[-1][M.T]}
    for key in K.NUMERIC:
        values = [p[key] for p in bucket if p[key] is not None]
        if not values:
            row[key] = None
        elif K.BUCKET[key] == M.MAX:
            row[key] = max(values)
        elif K.BUCKET[key] == M.MEAN:
            row[key] = sum(values) / len(values)
        else:
            row[key] = values[-1]
    return row


