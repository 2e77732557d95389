"""Per client kind, what its clients did over each sample interval (the T4 kinds file).

The section's client table has one entry per session: its kind (the entry's
role, ``client`` or ``worker``: :func:`ringq.engine.metrics.role_name`) and
counters that are totals since the session registered (calls, commits,
rollbacks, errors and, for a worker, the messages it handled, failed …).

A sum of the live clients' totals would run backwards each time a client
exits (its totals leave the sum), so a kind's figures are sums of per-client
*deltas* over the interval: for a client seen at both ends, what its counters
grew by; for one that registered within the interval, all of its counters
(they started at 0). What a client did between the last sample and its exit
is not counted, since its entry is gone when the next sample reads the table:
at most one interval of that client's work. The counts are exact for every
client that is still attached at a sample after its last call.
"""

from __future__ import annotations

import time
from typing import Final

from ringq.engine import metrics as M

from ._clients import Key, Raw

KIND: Final = M.ROLE  # the row's series: the clients' role
CLIENTS: Final = "clients"  # clients of the kind attached at the sample
INTERVAL_S: Final = "interval_s"  # seconds since the previous sample: the counts' interval
# counted over the interval (summed per-client deltas); BUSY_S: seconds workers spent handling
COUNTERS: Final = (
    M.ENQUEUED, M.DEQUEUED, M.COMMITS, M.ROLLBACKS, M.ERRORS, M.HANDLED, M.DECLINED, M.FAILED,
    M.TIMEOUTS, M.ABORTED, M.POISONED, M.IN_DOUBT,
)
NUMERIC_KEYS: Final = (M.T, CLIENTS, INTERVAL_S, *COUNTERS, M.BUSY_S)
KEYS: Final = (KIND, *NUMERIC_KEYS)  # one row, as the sampler makes it


class KindCounts:
    """Turns successive reads of the client table into one row per kind per interval."""

    def __init__(self) -> None:
        self._prev: dict[Key, dict[str, int]] = {}
        self._known: set[str] = set()  # every kind seen since restart: a row each sample
        self._prev_wall_ns = 0
        self._prev_mono_ns = 0
        self.restart()

    def restart(self) -> None:
        """Count from now (the monitor starts, or a new segment replaced the old
        one): the next sample counts the clients that register from now on
        whole, and those already attached from that sample on."""
        self._prev = {}
        self._known = set()
        self._prev_wall_ns, self._prev_mono_ns = time.time_ns(), time.monotonic_ns()

    def sample(
        self, clients: list[Raw], *, t: float, wall_ns: int, mono_ns: int
    ) -> list[dict[str, float | str]]:
        """The rows of the interval ending now (since the last sample or restart), by kind.

        ``wall_ns`` (``time.time_ns()``) and ``mono_ns`` are read before
        ``clients``: a client registered after ``wall_ns`` is seen by the next
        sample as new, with all of its counts in that sample's interval."""
        prev, prev_wall_ns, prev_mono_ns = self._prev, self._prev_wall_ns, self._prev_mono_ns
        cur: dict[Key, dict[str, int]] = {}
        kinds: dict[str, dict[str, float]] = {}
        for c in clients:
            if c.role == M.ROLE_MONITOR:
                continue  # the monitor's own session (its inbox pump): not a kind of client
            cur[c.key] = c.stats
            row = kinds.setdefault(c.role, _zero())
            row[CLIENTS] += 1
            before = prev.get(c.key)
            if before is None and c.registered_ns < prev_wall_ns:
                # Attached before the previous sample (or restart) yet not seen
                # by it: there was none, or the entry was being registered then.
                # Its counts before now are not the interval's: count from now.
                continue
            for k in COUNTERS:
                row[k] += max(0, c.stats[k] - (before[k] if before else 0))
            busy = max(0, c.stats[M.BUSY_NS] - (before[M.BUSY_NS] if before else 0))
            row[M.BUSY_S] += busy / 1e9
        self._prev, self._prev_wall_ns, self._prev_mono_ns = cur, wall_ns, mono_ns
        self._known.update(kinds)
        if mono_ns <= prev_mono_ns:
            return []
        for kind in self._known - set(kinds):  # no client of it now: a row of 0, not a gap
            kinds[kind] = _zero()
        dt = (mono_ns - prev_mono_ns) / 1e9
        out: list[dict[str, float | str]] = []
        for kind in sorted(kinds):
            row = kinds[kind]
            doc: dict[str, float | str] = {KIND: kind, M.T: round(t, 3),
                                           INTERVAL_S: round(dt, 6)}
            doc.update({k: int(row[k]) for k in (CLIENTS, *COUNTERS)})
            doc[M.BUSY_S] = round(row[M.BUSY_S], 6)
            out.append(doc)
        return out


def _zero() -> dict[str, float]:
    return {k: 0.0 for k in (CLIENTS, *COUNTERS, M.BUSY_S)}
