"""What the monitor's loop runs: the :class:`Step` protocol, and :class:`StepRunner`,
which runs one step so that a failure is logged (rate-limited) and counted, never fatal.

Every maintenance duty (reclaim, recovery, leases, the inbox pump …) is an object
with one method, ``run()``, in its own module; the loop (``_service``) only
decides which steps run on a pass and hands each to the runner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
from ringq.engine import DatabaseUnavailable

from ._config import MonitorConfig

logger = logging.getLogger("ringq.monitor")

REPEAT_LOG_S = 60.0  # a step failing the same way is logged again at most this often

# The monitor's configuration as it is now (reconfigure() and a followed DSN replace it).
Settings = Callable[[], MonitorConfig]


class Step(Protocol):
    """One duty of the monitor's loop; ``run`` raises to report a failure."""

    def run(self) -> None: ...


class Note(Protocol):
    """Writes a record to ``monitor.log`` (:meth:`Monitor.note`)."""

    def __call__(self, event: str, level: int = logging.INFO, **fields: Any) -> None: ...


@dataclass
class StepStats:
    runs: int = 0
    failures: int = 0
    consecutive: int = 0
    last_error: str | None = None
    last_failure_t: float | None = None
    last_logged: float = 0.0
    seconds: float = 0.0  # time spent in the step, in all

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "failures": self.failures,
            "last_error": self.last_error,
            "last_failure_t": self.last_failure_t,
            "seconds": round(self.seconds, 6),
        }


class StepRunner:
    """Runs steps by name and keeps their figures (``steps`` in ``/api/queues``).

    A failed step is logged on its first failure, when its error changes, and
    then at most every :data:`REPEAT_LOG_S`; a database error also drops the
    connection (``drop``), which the next step needing it makes again.
    """

    def __init__(self, note: Note, drop: Callable[[], None]) -> None:
        self._note = note
        self._drop = drop
        self.stats: dict[str, StepStats] = {}

    def run(self, name: str, step: Step) -> None:
        st = self.stats.setdefault(name, StepStats())
        st.runs += 1
        t0 = time.perf_counter()
        try:
            step.run()
        except Exception as exc:
            st.failures += 1
            st.consecutive += 1
            text = f"{type(exc).__name__}: {exc}".strip()
            now = time.time()
            if (
                st.consecutive == 1
                or text != st.last_error
                or now - st.last_logged >= REPEAT_LOG_S
            ):
                st.last_logged = now
                self._note(
                    "step.failed", logging.WARNING, step=name, error=text,
                    consecutive=st.consecutive, failures=st.failures,
                )
                logger.debug("ringq monitor: step %s failed", name, exc_info=True)
            st.last_error = text
            st.last_failure_t = now
            if isinstance(exc, psycopg.Error | DatabaseUnavailable):
                self._drop()
        else:
            if st.consecutive:
                self._note("step.recovered", step=name, after_failures=st.consecutive)
            st.consecutive = 0
        finally:
            st.seconds += time.perf_counter() - t0

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {k: v.as_dict() for k, v in sorted(self.stats.items())}
