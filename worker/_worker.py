"""One worker: one session, one message at a time, one transaction per message.

A :class:`Worker` takes a message from its queues and runs its action inside
ONE transaction of its session: the dequeue, whatever the action does
through ``session.connection`` and whatever it enqueues (chaining) commit
together or not at all.

Outcomes of one message:

- the action returns (``None`` or a :class:`Decline`): COMMIT. A declined
  request is a success: it commits, and may carry a reply or compensation
  that is enqueued in the same transaction;
- the action raises: ROLLBACK. The entry comes back with its delivery count
  raised; at the queue's ``max_deliveries`` the engine moves it to
  ``ringq.exceptions``;
- the action runs past its ``timeout``: it is interrupted and rolled back
  (see *Time limits* below);
- a second stop request (the second SIGTERM) aborts it: rolled back.

Time limits use both mechanisms, because neither covers everything alone:

- ``statement_timeout`` (set on the session, only when it changes) makes
  PostgreSQL cancel any statement of the action that runs past the limit,
  even while Python is blocked in the driver;
- ``signal.setitimer(ITIMER_REAL)`` raises :class:`ActionTimeout` in the main
  thread, which stops pure-Python work. The SIGALRM handler does not raise while
  the main thread is inside ringq's own engine code (a slot reserved but not yet
  recorded would leak) nor inside psycopg outside its network wait; it re-arms
  the timer for :data:`INTERRUPT_RETRY` seconds and tries again. An action
  that spends nearly all its time inside engine calls (a tight enqueue loop)
  is so interrupted up to about 0.1 s late; one doing its own SQL or Python
  work is interrupted on time. Inside
  psycopg's wait the exception is safe: psycopg cancels the running query on
  ``KeyboardInterrupt``, which is why :class:`ActionInterrupted` derives from it
  (and so an action's ``except Exception:`` cannot swallow a time limit).

The timer needs the main thread; a Worker running in another thread enforces
its limits with ``statement_timeout`` only (and says so in the log).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from types import FrameType
from typing import Any, Final, Self, cast

import posix_ipc
import psycopg
import ringq.engine
from ringq.engine import (
    ConfigError,
    InDoubt,
    Message,
    Retryable,
    RingqError,
    Session,
    SessionClosed,
    connect,
    one_line,
    validate_queue_name,
)
from ringq.engine import layout as L
from ringq.engine import metrics as M

from . import _queries as Qy
from ._actions import (
    Action,
    ActionAborted,
    ActionInterrupted,
    Actions,
    ActionTimeout,
    Decline,
    Retry,
)

logger = logging.getLogger("ringq.worker")

# -- stats keys (the names of ringq.engine.metrics; also in the worker's section entry) ------

HANDLED: Final = M.HANDLED  # messages whose transaction committed (declines included)
DECLINED: Final = M.DECLINED  # of those, actions that returned a Decline
FAILED: Final = M.FAILED  # rolled back: the action raised, or the commit failed
TIMEOUTS: Final = M.TIMEOUTS  # rolled back: the action ran past its time limit
ABORTED: Final = M.ABORTED  # rolled back: a second stop request interrupted the action
POISONED: Final = M.POISONED  # failures at the queue's max_deliveries (moved to ringq.exceptions)
IN_DOUBT: Final = M.IN_DOUBT  # commits whose answer was lost (decided later from the rows)
BUSY_NS: Final = M.BUSY_NS  # time spent handling messages (action + commit), nanoseconds
STATS_KEYS: Final = (HANDLED, DECLINED, FAILED, TIMEOUTS, ABORTED, POISONED, IN_DOUBT, BUSY_NS)
# Where each counter lives in the worker's client entry of the section (the
# monitor's /api/clients reads them there; the pool's pipe carries them too).
_SECTION_WORDS: Final = (
    (HANDLED, L.C_W_HANDLED),
    (DECLINED, L.C_W_DECLINED),
    (FAILED, L.C_W_FAILED),
    (TIMEOUTS, L.C_W_TIMEOUTS),
    (ABORTED, L.C_W_ABORTED),
    (POISONED, L.C_W_POISONED),
    (IN_DOUBT, L.C_W_IN_DOUBT),
    (BUSY_NS, L.C_W_BUSY_NS),
)
# Pool-level keys (WorkerPool.stats()).

INTERRUPT_RETRY: Final = 0.001  # seconds before a deferred interrupt is tried again

# The engine's own code must not be interrupted (a slot reserved but not yet
# recorded would leak); psycopg only in its network wait.
_ENGINE_DIR = os.path.dirname(os.path.abspath(ringq.engine.__file__)) + os.sep
_PSYCOPG_DIR = os.path.dirname(os.path.abspath(psycopg.__file__)) + os.sep


# -- one worker (one session, one message at a time) ------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker takes messages.

    ``queues``: the subset of the actions' queues to serve (empty: all).
    ``concurrency``: consumer coroutines in one event loop (0: one sync
    consumer; see ``AsyncWorker``).
    ``idle_wait``: seconds a worker sleeps on an empty queue before looking at
    its stop flag and its other queues again (messages wake it at once on the
    queue it sleeps on).
    """

    queues: tuple[str, ...] = ()
    idle_wait: float = 0.25
    stats_interval: float = 1.0  # seconds between stats reports from a pool child
    # consumer coroutines in one event loop per process (0: one sync Worker;
    # see ._async.AsyncWorker)
    concurrency: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "queues", tuple(self.queues))
        for q in self.queues:
            validate_queue_name(q)
        if not (0 < self.idle_wait <= 60):
            raise ConfigError(f"idle_wait must be in (0, 60] seconds, not {self.idle_wait!r}")
        if not (0 <= self.concurrency <= 1024):
            raise ConfigError(f"concurrency must be from 0 to 1024, not {self.concurrency!r}")
        if not (0 < self.stats_interval <= 3600):
            raise ConfigError(
                f"stats_interval must be in (0, 3600] seconds, not {self.stats_interval!r}"
            )


class Worker:
    """Runs the actions for messages of their queues, one transaction per message.

    Not thread-safe (one session); :meth:`stop` alone may be called from another
    thread or a signal handler. Use as a context manager or :meth:`open` /
    :meth:`close` (a second close does nothing).

    :raises QueueNotFound: (at open) a served queue does not exist.
    :raises DatabaseUnavailable: the database cannot be reached (at open, or
        when the session is lost while running).
    """

    def __init__(
        self, actions: Actions, dsn: str | None = None, *, config: WorkerConfig | None = None
    ) -> None:
        self.actions = actions
        self.config = config or WorkerConfig()
        self._dsn = dsn
        unknown = [q for q in self.config.queues if q not in actions]
        if unknown:
            raise ConfigError(
                f"no action for queue(s) {', '.join(unknown)} "
                f"(actions: {', '.join(actions.queues)})"
            )
        self.queues: list[str] = list(self.config.queues or actions.queues)
        asynchronous = [q for q in self.queues if inspect.iscoroutinefunction(actions[q].func)]
        if asynchronous:
            raise ConfigError(
                f"the action(s) of {', '.join(asynchronous)} are async: run them with "
                "concurrency (ringq worker --concurrency N, or AsyncWorker)"
            )
        self._session: Session | None = None
        self._closed = False
        self._stop = False
        self._abort = False
        self._stats = dict.fromkeys(STATS_KEYS, 0)
        self._max_deliveries: dict[str, int] = {}
        self._rr = 0
        # The next message, taken with the last commit (Session.commit_and_dequeue)
        # while run() wants more; given back untouched if the loop ends first.
        self._next_msg: Message | None = None
        self._prefetch = False
        # time limits
        self._timer = False  # SIGALRM installed (main thread only)
        self._main_ident = threading.main_thread().ident
        self._prev_alarm: Any = None
        self._prev_itimer: tuple[float, float] = (0.0, 0.0)
        self._opened_at = 0.0
        self._in_action = False
        self._deadline = math.inf
        self._base_timeout = ""  # the session's statement_timeout before we touched it
        self._known_timeout: tuple[int, str] | None = None  # (backend pid, committed value)
        self._pending_timeout: str | None = None

    # -- life cycle ----------------------------------------------------------------------

    def open(self) -> Worker:
        """Connect and check the served queues (done by :meth:`run` if needed).

        :raises SessionClosed: the worker was closed.
        """
        if self._session is not None:
            return self
        if self._closed:
            raise SessionClosed("the worker is closed")
        session = connect(self._dsn, application_name="ringq worker")
        try:
            for q in self.queues:
                self._max_deliveries[q] = session.queue_info(q).max_deliveries
            row = session.connection.execute(Qy.STATEMENT_TIMEOUT).fetchone()
            session.commit()  # hold no transaction open while idle
        except BaseException:
            session.close()
            raise
        assert row is not None
        self._base_timeout = str(row[0])
        self._known_timeout = (session.backend_pid, self._base_timeout)
        self._session = session
        session.set_client_role(L.CR_WORKER)
        self._publish_stats()  # a re-opened session carries the totals on
        self._install_timer()
        self._opened_at = time.monotonic()
        return self

    def close(self) -> None:
        """Roll back anything open, restore the SIGALRM handler, close the session."""
        if self._closed:
            return
        self._closed = True
        self._uninstall_timer()
        self._give_back()
        if self._session is not None:
            self._session.close()

    def _give_back(self) -> None:
        """A message taken with the last commit and not handled goes back
        untouched (no delivery counted: it was never handed to an action)."""
        msg, self._next_msg = self._next_msg, None
        s = self._session
        if msg is not None and s is not None and not s.closed:
            try:
                s.rollback(count_delivery=False)
            except RingqError:
                logger.warning("ringq worker: could not give back queue %s seq %s; "
                               "recovery decides it", msg.queue, msg.seq, exc_info=True)

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def session(self) -> Session:
        if self._session is None:
            raise SessionClosed("the worker is not open")
        return self._session

    def _install_timer(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            if any(a.timeout for a in self.actions if a.queue in self.queues):
                logger.warning(
                    "ringq worker: not in the main thread: time limits are enforced by "
                    "statement_timeout only (pure-Python work is not interrupted)"
                )
            return
        self._prev_itimer = signal.getitimer(signal.ITIMER_REAL)
        self._prev_alarm = signal.signal(signal.SIGALRM, self._on_alarm)
        self._timer = True

    def _uninstall_timer(self) -> None:
        if not self._timer:
            return
        self._timer = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self._prev_alarm)
        left, interval = self._prev_itimer
        if left > 0:
            # Someone (pytest-timeout, an outer supervisor) had a timer running: give it back.
            elapsed = time.monotonic() - self._opened_at
            signal.setitimer(signal.ITIMER_REAL, max(left - elapsed, 0.001), interval)

    # -- control ------------------------------------------------------------------------------

    def stop(self, *, abort: bool = False) -> None:
        """Ask the worker to stop after the message in flight (``abort``: roll it back now).

        Only sets flags (and, to abort, sends SIGALRM to the main thread): safe
        from a signal handler or another thread.
        """
        self._stop = True
        if abort:
            self._abort = True
            if self._in_action and self._timer and self._main_ident is not None:
                signal.pthread_kill(self._main_ident, signal.SIGALRM)

    @property
    def stopping(self) -> bool:
        return self._stop

    @property
    def aborted(self) -> bool:
        return self._abort

    def stats(self) -> dict[str, int]:
        """This worker's counters (keys: :data:`STATS_KEYS`, plus ``pid``)."""
        out = dict(self._stats)
        out["pid"] = os.getpid()
        return out

    # -- the loop ----------------------------------------------------------------------------

    def run(self, *, max_messages: int | None = None) -> int:
        """Handle messages until :meth:`stop` (or ``max_messages``); returns how many.

        :raises DatabaseUnavailable: the session was lost and could not be re-opened.
        """
        self.open()
        n = 0
        try:
            while not self._stop and (max_messages is None or n < max_messages):
                # its commit may carry the next claim while more are wanted
                self._prefetch = max_messages is None or n + 1 < max_messages
                if self.run_one(wait=self.config.idle_wait):
                    n += 1
        finally:
            self._prefetch = False
            self._give_back()
        return n

    def run_one(self, *, wait: float | None = 0.0) -> bool:
        """Take one message from the served queues (sleeping up to ``wait``
        seconds if none is ready) and handle it; True if there was one."""
        self.open()
        msg = self._next(wait)
        if msg is None:
            return False
        self._handle(msg)
        return True

    def _next(self, wait: float | None) -> Message | None:
        taken, self._next_msg = self._next_msg, None
        if taken is not None:
            return taken
        s = self.session
        qs = self.queues
        n = len(qs)
        try:
            # One pass without sleeping, starting after the queue served last (fairness).
            for i in range(n):
                q = qs[(self._rr + i) % n]
                msg = s.dequeue(q)
                if msg is not None:
                    self._rr = (self._rr + i + 1) % n
                    return msg
            if not wait or self._stop:
                return None
            # Sleep on one queue at a time (the engine wakes one queue's sleepers).
            q = qs[self._rr]
            self._rr = (self._rr + 1) % n
            return s.dequeue(q, wait=wait / n)
        except posix_ipc.SignalError:
            # A signal interrupted the engine's sleep (a pool child blocks its
            # signals so this only happens in-process): look at the flags again.
            return None

    def _handle(self, msg: Message) -> None:
        s = self.session
        act = self.actions[msg.queue]
        t0 = time.perf_counter_ns()
        try:
            try:
                self._apply_statement_timeout(act.timeout)
                result = self._call(act, msg)
                if isinstance(result, Decline) and result.reply_to is not None:
                    s.enqueue(result.reply_to, result.reply if result.reply is not None else b"")
            except BaseException as exc:
                self._rolled_back(msg, act, exc)
                if not isinstance(exc, Exception | ActionInterrupted):
                    raise  # a real KeyboardInterrupt / SystemExit of the embedding program
                return
            try:
                if self._prefetch and not self._stop:
                    # One round trip for this commit and the next claim.
                    self._next_msg = s.commit_and_dequeue(self.queues[self._rr])
                    if self._next_msg is not None:
                        self._rr = (self._rr + 1) % len(self.queues)
                else:
                    s.commit()
            except InDoubt as exc:
                self._stats[IN_DOUBT] += 1
                logger.warning(
                    "ringq worker: queue %s seq %s delivery %s: commit in doubt (%s); "
                    "the rows decide it, nothing is lost or doubled",
                    msg.queue,
                    msg.seq,
                    msg.deliveries,
                    exc,
                )
                self._pending_timeout = None
                self._reopen_if_closed()
                return
            except Retryable as exc:
                # Nothing of it committed (a conflict, a stale section, a connection
                # lost and decided from the rows): the entry comes back, as after a
                # failure, but the action did nothing wrong: no traceback.
                self._pending_timeout = None
                self._count_failure(msg, FAILED, exc, f"commit rolled back, retried "
                                    f"({type(exc).__name__}: {one_line(str(exc))})")
                self._reopen_if_closed()
                return
            except RingqError as exc:
                # Refused at commit (deferred constraint, a failed row write): rolled back by the
                # session.
                self._pending_timeout = None
                self._count_failure(msg, FAILED, exc, "commit failed")
                self._reopen_if_closed()
                return
            self._committed_timeout()
            self._stats[HANDLED] += 1
            if isinstance(result, Decline):
                self._stats[DECLINED] += 1
                logger.info(
                    "ringq worker: queue %s seq %s declined: %s",
                    msg.queue,
                    msg.seq,
                    result.reason or "(no reason)",
                )
        finally:
            self._stats[BUSY_NS] += time.perf_counter_ns() - t0
            self._publish_stats()

    def _publish_stats(self) -> None:
        """Copy the counters into our client entry of the section (a few word
        writes per message; absolute values, so a new entry after a reconnect
        starts from the totals)."""
        s = self._session
        if s is None or s.closed:
            return
        st = self._stats
        # the section was released under us: the next open re-publishes
        with suppress(ValueError, IndexError):
            s.write_client_words((word, st[key]) for key, word in _SECTION_WORDS)

    def _call(self, act: Action, msg: Message) -> object:
        timeout = act.timeout
        timed = timeout is not None and self._timer
        self._deadline = time.monotonic() + timeout if timeout is not None else math.inf
        self._in_action = True
        try:
            if timed:
                assert timeout is not None
                signal.setitimer(signal.ITIMER_REAL, timeout)
            if self._abort:
                raise ActionAborted("stop requested before the action started")
            # with the otel extra: the action runs in a span, its entry's producer's child
            with ringq.engine.process_span(msg):
                return cast("Callable[[Message, Session], object]", act.func)(msg, self.session)
        finally:
            self._in_action = False
            if timed:
                signal.setitimer(signal.ITIMER_REAL, 0)

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        if not self._in_action:
            return  # late: the action already returned
        if self._abort:
            exc: ActionInterrupted = ActionAborted("aborted by a second stop request")
        elif time.monotonic() >= self._deadline - 1e-3:
            exc = ActionTimeout("the action ran past its time limit")
        else:
            return
        if not _safe_to_interrupt(frame):
            signal.setitimer(signal.ITIMER_REAL, INTERRUPT_RETRY)
            return
        raise exc

    def _rolled_back(self, msg: Message, act: Action, exc: BaseException) -> None:
        if isinstance(exc, ActionAborted):
            kind, what = ABORTED, "aborted"
        elif isinstance(exc, ActionTimeout):
            kind, what = TIMEOUTS, f"timed out after {act.timeout:g}s"
        elif time.monotonic() >= self._deadline:
            # Interrupted past the limit some other way: PostgreSQL cancelled a
            # statement (statement_timeout), or the alarm broke an engine wait.
            kind, what = (
                (ABORTED, "aborted")
                if self._abort
                else (TIMEOUTS, f"timed out after {act.timeout:g}s")
            )
        elif self._abort and isinstance(exc, psycopg.errors.QueryCanceled):
            kind, what = ABORTED, "aborted"
        else:
            kind, what = FAILED, "failed"
        self._pending_timeout = None
        retry_after = exc.after if isinstance(exc, Retry) else None
        if retry_after is not None:
            what = f"asked to be retried after {retry_after:g}s"
        try:
            self.session.rollback(retry_after=retry_after)
        except RingqError as rb_exc:
            logger.warning("ringq worker: rollback after a failed action failed: %s",
                           one_line(rb_exc))
            logger.debug("ringq worker: rollback after a failed action failed", exc_info=True)
        self._count_failure(msg, kind, exc, what)
        self._reopen_if_closed()

    def _count_failure(self, msg: Message, kind: str, exc: BaseException, what: str) -> None:
        self._stats[kind] += 1
        limit = self._max_deliveries.get(msg.queue, 0)
        poisoned = bool(limit) and msg.deliveries >= limit
        if poisoned:
            self._stats[POISONED] += 1
        tail = "; moved to ringq.exceptions" if poisoned else "; it will be delivered again"
        if kind == FAILED and not isinstance(exc, ActionInterrupted | Retryable):
            logger.warning(
                "ringq worker: queue %s seq %s delivery %s/%s %s: %s: %s%s",
                msg.queue,
                msg.seq,
                msg.deliveries,
                limit,
                what,
                type(exc).__name__,
                exc,
                tail,
                exc_info=exc,
            )
        else:
            logger.warning(
                "ringq worker: queue %s seq %s delivery %s/%s %s (rolled back)%s",
                msg.queue,
                msg.seq,
                msg.deliveries,
                limit,
                what,
                tail,
            )

    def _reopen_if_closed(self) -> None:
        """The session was lost (database gone): reconnect, or let DatabaseUnavailable end
        the run."""
        s = self._session
        if s is not None and s.closed and not self._closed:
            self._session = None
            self._uninstall_timer()
            self.open()

    # -- statement_timeout: set only when it changes; SET is transactional ------------------

    def _apply_statement_timeout(self, timeout: float | None) -> None:
        s = self.session
        want = self._base_timeout if timeout is None else f"{max(1, math.ceil(timeout * 1000))}ms"
        known = self._known_timeout
        if known is not None and known == (s.backend_pid, want):
            return
        s.connection.execute(Qy.SET_STATEMENT_TIMEOUT, (want,))
        self._pending_timeout = want

    def _committed_timeout(self) -> None:
        if self._pending_timeout is not None:
            self._known_timeout = (self.session.backend_pid, self._pending_timeout)
            self._pending_timeout = None
        # A rolled-back SET reverts, so after a rollback the known value stays;
        # a new backend (the session reconnected) does not match the known pid.


def _safe_to_interrupt(frame: FrameType | None) -> bool:
    """May an exception be raised at ``frame`` without corrupting state?

    Not inside the engine (a slot between its reservation and its record),
    and inside psycopg only in its network wait (which cancels the query on
    KeyboardInterrupt).
    """
    if frame is None:
        return False
    first_psycopg: FrameType | None = None
    f: FrameType | None = frame
    while f is not None:
        fn = f.f_code.co_filename
        if fn.startswith(_ENGINE_DIR):
            return False
        if first_psycopg is None and fn.startswith(_PSYCOPG_DIR):
            first_psycopg = f
        f = f.f_back
    if first_psycopg is None:
        return True
    name = first_psycopg.f_code.co_name
    return name == "wait" or name.startswith("wait_")
