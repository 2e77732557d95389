"""Per-client figures: what ``/api/clients``, ``/metrics`` and ``ringq status`` show
about the sessions attached to the section, and the client-error watch.

Each session has one entry in the section's client table (pid, backend pid,
role, queues used, commit/rollback counters, the last error it hit and, for
workers, handled/failed/timeouts …), written by its own process. The monitor
reads them; nothing here touches the database.

Errors are read from each entry's last-error record and its counter: errors
a client hits between two passes of the monitor (100 ms) are coalesced into
one log record carrying the last error's queue and seq and ``count``. A client
is known by its entry index, pid and registration time, which its reconnects
do not change. The monitor's first pass only takes the counters as they are:
errors hit while no monitor watched are counted (``seen_at_start``), not logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from ringq.engine import Section
from ringq.engine import layout as L
from ringq.engine import metrics as M

# The keys of one client in /api/clients are ringq.engine.metrics' (CLIENT_KEYS);
# the service sorts and labels clients by these.
PID: Final = M.PID
ROLE: Final = M.ROLE
STARTED: Final = M.STARTED

_RATE_OF: Final = {
    M.COMMIT_RATE: (M.COMMITS,),
    M.HANDLED_RATE: (M.HANDLED,),
    M.FAILED_RATE: (M.FAILED, M.TIMEOUTS, M.ABORTED),
    M.ERROR_RATE: (M.ERRORS,),
}

# (entry index, pid, registration ns): tells a re-used entry apart, and stays the
# same over the client's reconnects (which rewrite ``started_ns``).
Key = tuple[int, int, int]


@dataclass
class Raw:
    """One client entry as read from the section."""

    cidx: int
    pid: int
    backend_pid: int
    role: str
    state: str
    started_ns: int
    registered_ns: int
    qids: list[tuple[int, str]]  # (queue id, name) of the queues it used
    stats: dict[str, int]
    error: tuple[int, int, int, int, int] | None  # (count, code, qid, seq, ns)

    @property
    def key(self) -> Key:
        return (self.cidx, self.pid, self.registered_ns)


def read_clients(sec: Section) -> list[Raw]:
    """Every client entry in use (call under the monitor's section lock)."""
    out = []
    for cidx in sec.active_clients():
        base = cidx * L.CLIENT_WORDS
        pid = sec.clients[base + L.C_PID]
        if not pid:
            continue
        # The error record first: a session records an error after it wrote
        # what the error concerns (a reconnect's new backend pid), so the
        # words read after the record are at least as new as it is.
        error = sec.client_error(cidx)
        state = sec.clients[base + L.C_STATE]
        qids = []
        for qidx in sec.client_queues(cidx):
            if sec.q(qidx, L.Q_STATE) == L.QS_READY:
                qids.append((sec.q(qidx, L.Q_QID), sec.queue_name(qidx)))
        out.append(Raw(
            cidx=cidx,
            pid=int(pid),
            backend_pid=int(sec.clients[base + L.C_BACKEND_PID]),
            role=M.role_name(sec.clients[base + L.C_ROLE]),
            state=M.STATE_IN_DOUBT if state == L.CS_IN_DOUBT else M.STATE_ACTIVE,
            started_ns=int(sec.clients[base + L.C_STARTED_NS]),
            registered_ns=int(sec.clients[base + L.C_REGISTERED_NS]),
            qids=qids,
            stats=M.client_stats(sec, cidx),
            error=error,
        ))
    return out


def queue_name_of(sec: Section, qid: int, known: dict[int, str]) -> str | None:
    """A queue's name from its id: the section's block, else the monitor's queue list."""
    if qid <= 0:
        return None
    qidx = sec.find_queue(qid)
    if qidx is not None:
        return str(sec.queue_name(qidx))
    return known.get(qid)


@dataclass
class ErrorNews:
    """New errors of one client since the monitor's last pass (coalesced)."""

    raw: Raw
    count: int  # new errors since the last pass (the record describes the last one)
    total: int
    kind: str
    qid: int
    seq: int | None
    t: float


class ErrorWatch:
    """Finds the clients whose error counter rose since the last pass."""

    def __init__(self) -> None:
        self._seen: dict[Key, int] | None = None  # None until the first pass
        self.seen_at_start = 0  # errors the clients already had at the first pass (not logged)

    def scan(self, clients: list[Raw]) -> list[ErrorNews]:
        if self._seen is None:
            # A (re)started monitor: what the counters hold happened before it
            # watched, and was logged by its predecessor if one ran. The bare
            # counter word is enough here (no record to describe).
            self._seen = {c.key: c.stats[M.ERRORS] for c in clients}
            self.seen_at_start = sum(self._seen.values())
            return []
        news = []
        seen: dict[Key, int] = {}
        for c in clients:
            if c.error is None:  # being written right now: next pass
                if c.key in self._seen:
                    seen[c.key] = self._seen[c.key]
                continue
            n, code, qid, seq, ns = c.error
            before = self._seen.get(c.key, 0)
            seen[c.key] = n
            if n > before:
                news.append(
                    ErrorNews(
                        c,
                        n - before,
                        n,
                        M.error_kind(code),
                        qid,
                        seq if seq >= 0 else None,
                        ns / 1e9,
                    )
                )
        self._seen = seen
        return news


class Rates:
    """Per-client rates over the last sampling interval."""

    def __init__(self) -> None:
        self._prev: dict[Key, tuple[int, dict[str, int]]] = {}
        self.rates: dict[Key, dict[str, float]] = {}

    def sample(self, clients: list[Raw], mono_ns: int) -> None:
        prev, cur = self._prev, {}
        rates: dict[Key, dict[str, float]] = {}
        for c in clients:
            cur[c.key] = (mono_ns, c.stats)
            p = prev.get(c.key)
            if p is None or mono_ns <= p[0]:
                continue
            dt = (mono_ns - p[0]) / 1e9
            rates[c.key] = {
                rk: round(sum(max(0, c.stats[k] - p[1][k]) for k in keys) / dt, 3)
                for rk, keys in _RATE_OF.items()
            }
        self._prev = cur
        self.rates = rates


def client_doc(
    c: Raw, rates: dict[str, float] | None, known: dict[int, str], sec: Section
) -> dict[str, Any]:
    """One client as ``/api/clients`` shows it (keys: :data:`ringq.engine.metrics.CLIENT_KEYS`)."""
    doc: dict[str, Any] = {
        PID: c.pid,
        M.BACKEND_PID: c.backend_pid,
        ROLE: c.role,
        M.STATE: c.state,
        STARTED: round(c.started_ns / 1e9, 3),
        M.QUEUES: sorted(name for _qid, name in c.qids),
    }
    for k in M.CLIENT_SHOWN_COUNTERS:
        doc[k] = c.stats[k]
    doc[M.BUSY_S] = round(c.stats[M.BUSY_NS] / 1e9, 6)
    for k in M.CLIENT_RATES:
        doc[k] = (rates or {}).get(k, 0.0)
    last = None
    if c.error is not None and c.error[0] > 0:
        _n, code, qid, seq, ns = c.error
        last = {M.ERROR_KIND: M.error_kind(code), M.ERROR_QUEUE: queue_name_of(sec, qid, known),
                M.ERROR_SEQ: seq if seq >= 0 else None, M.T: round(ns / 1e9, 6)}
    doc[M.LAST_ERROR] = last
    return doc
