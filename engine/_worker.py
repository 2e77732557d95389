"""Workers: the container that runs an action for each message.

A queue's messages are commands and an *action* is their body. :class:`Actions`
pairs queues with actions; a :class:`Worker` takes one message at a time and
runs its action inside ONE transaction of its session: the dequeue, whatever
the action does through ``session.connection`` and whatever it enqueues
(chaining) commit together or not at all.

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

:class:`WorkerPool` runs N worker *processes* (each with its own session),
restarts a child that dies (with backoff) after giving its slots back at once
with :func:`~ringq.engine._recovery.recover_dead_clients`, and stops them all
on SIGTERM: the first lets messages in flight finish, a second aborts them.
"""

from __future__ import annotations

import enum
import importlib
import itertools
import logging
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Final, Self, TypeVar

import posix_ipc
import psycopg

from . import _layout as L
from . import metrics as M
from ._dsn import resolve_dsn
from ._errors import (
    ConfigError,
    DatabaseUnavailable,
    InDoubt,
    QueueNotFound,
    RingqError,
    SessionClosed,
)
from ._names import validate_queue_name
from ._section import Section, pid_alive
from ._session import Message, Session, connect

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
RESTARTS: Final = "restarts"
PROCESSES: Final = "processes"

INTERRUPT_RETRY: Final = 0.001  # seconds before a deferred interrupt is tried again

_ENGINE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_THIS_FILE = os.path.abspath(__file__)
_PSYCOPG_DIR = os.path.dirname(os.path.abspath(psycopg.__file__)) + os.sep


class WorkerExit(enum.IntEnum):
    """Exit codes of worker processes and of ``ringq worker`` (same values as ringq.cli)."""

    OK = 0  # stopped (first SIGTERM: messages in flight finished)
    FAILURE = 1  # an unexpected error
    USAGE = 2  # the actions could not be loaded, or bad settings
    DB_UNAVAILABLE = 3  # the database cannot be reached
    NOT_FOUND = 4  # a queue named by the actions does not exist
    ABORTED = 130  # a second SIGTERM aborted messages in flight (rolled back)


# -- outcomes -----------------------------------------------------------------------------


class ActionInterrupted(KeyboardInterrupt):
    """An action was interrupted by the worker; its transaction is rolled back.

    Derives from ``KeyboardInterrupt`` on purpose: psycopg cancels a running
    query on it (leaving the connection usable), and ``except Exception`` in an
    action does not swallow it.
    """


class ActionTimeout(ActionInterrupted):
    """The action ran past its time limit (``timeout`` seconds)."""


class ActionAborted(ActionInterrupted):
    """A second stop request (the second SIGTERM) aborted the action."""


@dataclass(frozen=True)
class Decline:
    """Return this from an action to decline the request: the transaction COMMITS.

    Declining is a successful outcome (insufficient funds, an order already
    cancelled): the message is consumed, whatever the action wrote stays, and
    ``reply`` is enqueued on ``reply_to`` in the same transaction (an empty
    payload if only ``reply_to`` is given).
    Returning ``None`` after enqueueing a reply yourself is equivalent; a
    Decline is counted apart (``declined``) and logged at INFO.
    """

    reason: str = ""
    reply_to: str | None = None
    reply: bytes | None = None

    def __post_init__(self) -> None:
        if self.reply is not None and self.reply_to is None:
            raise ConfigError("Decline(reply=...) needs reply_to (the queue to put the reply on)")
        if self.reply_to is not None:
            validate_queue_name(self.reply_to)


ActionFunc = Callable[[Message, Session], "Decline | None"]
F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not math.isfinite(timeout)
        or timeout <= 0
    ):
        raise ConfigError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return float(timeout)


@dataclass(frozen=True)
class Action:
    """One queue paired with the function that handles its messages."""

    queue: str
    func: ActionFunc
    timeout: float | None = None  # seconds; None: no limit

    @property
    def name(self) -> str:
        mod = getattr(self.func, "__module__", "?")
        return f"{mod}.{getattr(self.func, '__qualname__', repr(self.func))}"


class Actions:
    """A registry pairing each queue with its action (one action per queue).

    >>> app = Actions(timeout=30)
    >>> @app.action("orders")
    ... def handle(msg: Message, session: Session) -> Decline | None:
    ...     session.connection.execute("INSERT INTO ...", (...))
    ...     session.enqueue("invoices", msg.payload)   # chained: commits with it

    ``timeout`` is the default time limit in seconds (None: none); each action
    may set its own.
    """

    def __init__(self, *, timeout: float | None = None) -> None:
        self.timeout = _check_timeout(timeout)
        self._actions: dict[str, Action] = {}

    def action(self, queue: str, *, timeout: float | None = _UNSET) -> Callable[[F], F]:
        """Decorator: ``func(msg, session)`` handles the messages of ``queue``.

        :raises InvalidQueueName: bad queue name. :raises ConfigError: the queue
            already has an action, or a bad timeout.
        """

        def register(func: F) -> F:
            self.add(queue, func, timeout=timeout)
            return func

        return register

    def add(self, queue: str, func: ActionFunc, *, timeout: float | None = _UNSET) -> Action:
        """Pair ``queue`` with ``func`` (the non-decorator form of :meth:`action`)."""
        validate_queue_name(queue)
        if queue in self._actions:
            raise ConfigError(
                f"queue {queue!r} already has an action ({self._actions[queue].name})"
            )
        if not callable(func):
            raise ConfigError(f"the action for {queue!r} is not callable: {func!r}")
        limit = self.timeout if timeout is _UNSET else _check_timeout(timeout)
        act = Action(queue, func, limit)
        self._actions[queue] = act
        return act

    @property
    def queues(self) -> list[str]:
        return list(self._actions)

    def __getitem__(self, queue: str) -> Action:
        return self._actions[queue]

    def __contains__(self, queue: object) -> bool:
        return queue in self._actions

    def __iter__(self) -> Iterator[Action]:
        return iter(self._actions.values())

    def __len__(self) -> int:
        return len(self._actions)

    def __repr__(self) -> str:
        return f"Actions({', '.join(self._actions)})"


def load_actions(spec: str) -> Actions:
    """Import ``MODULE[:ATTR]`` (ATTR defaults to ``app``): an :class:`Actions`, or a
    callable without arguments returning one.

    :raises ConfigError: the module cannot be imported or ATTR is not Actions.
    """
    module_name, _, attr = spec.partition(":")
    attr = attr or "app"
    if not module_name:
        raise ConfigError(f"bad actions {spec!r}: expected MODULE[:ATTR]")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import actions module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Actions) and callable(obj):
        obj = obj()
    if not isinstance(obj, Actions):
        raise ConfigError(f"{spec!r} is {type(obj).__name__}, not ringq.engine.Actions")
    if not obj:
        raise ConfigError(f"{spec!r} has no actions")
    return obj


# -- one worker (one session, one message at a time) ------------------------------------------


@dataclass(frozen=True)
class WorkerConfig:
    """How a worker takes messages.

    ``queues``: the subset of the actions' queues to serve (empty: all).
    ``idle_wait``: seconds a worker sleeps on an empty queue before looking at
    its stop flag and its other queues again (messages wake it at once on the
    queue it sleeps on).
    """

    queues: tuple[str, ...] = ()
    idle_wait: float = 0.25
    stats_interval: float = 1.0  # seconds between stats reports from a pool child

    def __post_init__(self) -> None:
        object.__setattr__(self, "queues", tuple(self.queues))
        for q in self.queues:
            validate_queue_name(q)
        if not (0 < self.idle_wait <= 60):
            raise ConfigError(f"idle_wait must be in (0, 60] seconds, not {self.idle_wait!r}")
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
                f"no action for queue(s) {', '.join(unknown)} (actions: {', '.join(actions.queues)})"
            )
        self.queues: list[str] = list(self.config.queues or actions.queues)
        self._session: Session | None = None
        self._closed = False
        self._stop = False
        self._abort = False
        self._stats = dict.fromkeys(STATS_KEYS, 0)
        self._max_deliveries: dict[str, int] = {}
        self._rr = 0
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
            row = session.connection.execute(
                "SELECT current_setting('statement_timeout')"
            ).fetchone()
            session.commit()  # hold no transaction open while idle
        except BaseException:
            session.close()
            raise
        assert row is not None
        self._base_timeout = str(row[0])
        self._known_timeout = (session.backend_pid, self._base_timeout)
        self._session = session
        session._set_role(L.CR_WORKER)
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
        if self._session is not None:
            self._session.close()

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
        while not self._stop and (max_messages is None or n < max_messages):
            if self.run_one(wait=self.config.idle_wait):
                n += 1
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
            except RingqError as exc:
                # Refused at commit (deferred constraint, serialization): rolled back by the session.
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
        try:
            s._set_client_words((word, st[key]) for key, word in _SECTION_WORDS)
        except (ValueError, IndexError):  # the section was released under us: the next open re-publishes
            pass

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
            return act.func(msg, self.session)
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
        try:
            self.session.rollback()
        except RingqError:
            logger.warning("ringq worker: rollback after a failed action failed", exc_info=True)
        self._count_failure(msg, kind, exc, what)
        self._reopen_if_closed()

    def _count_failure(self, msg: Message, kind: str, exc: BaseException, what: str) -> None:
        self._stats[kind] += 1
        limit = self._max_deliveries.get(msg.queue, 0)
        poisoned = bool(limit) and msg.deliveries >= limit
        if poisoned:
            self._stats[POISONED] += 1
        tail = "; moved to ringq.exceptions" if poisoned else "; it will be delivered again"
        if kind == FAILED and not isinstance(exc, ActionInterrupted):
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
        """The session was lost (database gone): reconnect, or let DatabaseUnavailable end the run."""
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
        s.connection.execute("SELECT set_config('statement_timeout', %s, false)", (want,))
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
        if fn.startswith(_ENGINE_DIR) and fn != _THIS_FILE:
            return False
        if first_psycopg is None and fn.startswith(_PSYCOPG_DIR):
            first_psycopg = f
        f = f.f_back
    if first_psycopg is None:
        return True
    name = first_psycopg.f_code.co_name
    return name == "wait" or name.startswith("wait_")


# -- worker processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolConfig:
    """How many worker processes, and how their deaths are handled.

    A child that dies is restarted after ``restart_initial`` seconds, doubling
    up to ``restart_max`` while it keeps dying; a child that ran longer than
    ``stable_after`` seconds starts again at ``restart_initial``.
    """

    processes: int = 1
    # "fork": fast start, and SIGTERM is blocked in the child from its first
    # instruction (the engine re-attaches after fork; the parent holds no
    # session when it forks). "spawn": a clean interpreter per child.
    start_method: str = "fork"
    restart_initial: float = 0.1
    restart_max: float = 10.0
    stable_after: float = 30.0
    worker: WorkerConfig = field(default_factory=WorkerConfig)

    def __post_init__(self) -> None:
        if (
            isinstance(self.processes, bool)
            or not isinstance(self.processes, int)
            or not 1 <= self.processes <= 256
        ):
            raise ConfigError(f"processes must be 1..256, not {self.processes!r}")
        if self.start_method not in ("spawn", "fork", "forkserver"):
            raise ConfigError(
                f"start_method must be spawn, fork or forkserver, not {self.start_method!r}"
            )
        if not (0 < self.restart_initial <= self.restart_max):
            raise ConfigError("restart_initial must be > 0 and <= restart_max")


class _StopRequests:
    """Counts SIGTERMs of a worker process, from whichever path received them."""

    def __init__(self) -> None:
        self._seq = itertools.count(1)  # next() is atomic: the handler and the watcher may race
        self.count = 0
        self.worker: Worker | None = None

    def request(self) -> None:
        n = next(self._seq)
        self.count = max(self.count, n)
        w = self.worker
        if w is not None:
            w.stop(abort=n >= 2)

    def attach(self, worker: Worker) -> None:
        self.worker = worker
        if self.count:
            worker.stop(abort=self.count >= 2)

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.request()


def _child_main(
    target: str | Actions, dsn: str, config: WorkerConfig, index: int, report: Any, log_level: int
) -> None:
    """Body of one worker process.

    SIGTERM must never interrupt the engine in the main thread (a semaphore
    wait would fail with EINTR), so the main thread blocks it and a watcher
    thread takes it with sigtimedwait. With "fork" the mask is inherited from
    the parent (it blocks SIGTERM around start), so it is blocked in every
    thread from the first instruction. With "spawn" the new interpreter
    starts unblocked and threads made at import (OpenBLAS) keep that mask: a
    SIGTERM may land there, so a Python handler (running in the main thread,
    between bytecodes) counts it too, instead of the default action killing
    the process.
    """
    stops = _StopRequests()
    signal.signal(signal.SIGTERM, stops.on_signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    # Ctrl-C reaches the whole process group; the parent decides and forwards SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not logging.getLogger().handlers:  # spawned: a fresh interpreter
        logging.basicConfig(
            level=log_level, format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s"
        )
    ppid = os.getppid()
    code = WorkerExit.FAILURE
    worker: Worker | None = None
    done = threading.Event()
    # The watcher must not take SIGALRM (the time limits belong to the main thread).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    watcher = threading.Thread(
        target=_watch,
        args=(stops, ppid, done, report, config.stats_interval),
        name="ringq-worker-signals",
        daemon=True,
    )
    watcher.start()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    try:
        actions = load_actions(target) if isinstance(target, str) else target
        worker = Worker(actions, dsn, config=config)
        worker.open()
        stops.attach(worker)
        worker.run()
        code = WorkerExit.ABORTED if worker.aborted else WorkerExit.OK
    except QueueNotFound as exc:
        logger.error("ringq worker %d: %s", index, exc)
        code = WorkerExit.NOT_FOUND
    except ConfigError as exc:
        logger.error("ringq worker %d: %s", index, exc)
        code = WorkerExit.USAGE
    except DatabaseUnavailable as exc:
        logger.error("ringq worker %d: %s", index, exc)
        code = WorkerExit.DB_UNAVAILABLE
    except Exception:
        logger.exception("ringq worker %d: unexpected error", index)
        code = WorkerExit.FAILURE
    finally:
        done.set()
        watcher.join(2)
        if worker is not None:
            _send(report, worker.stats())  # after the watcher ended: one sender at a time
            try:
                worker.close()
            except RingqError:
                logger.warning("ringq worker %d: close failed", index, exc_info=True)
    sys.exit(int(code))


def _watch(
    stops: _StopRequests, ppid: int, done: threading.Event, report: Any, every: float
) -> None:
    """Watcher thread of a worker process: takes SIGTERM synchronously (the
    first stops the worker after its message, the second aborts it), stops it
    if the parent died, and reports its counters every ``every`` seconds."""
    last = time.monotonic()
    told = 0
    _send(report, {})  # ready: from now on SIGTERM is counted, not fatal
    while not done.is_set():
        if signal.sigtimedwait({signal.SIGTERM}, 0.1) is not None:
            stops.request()
        if stops.count > told:
            told = stops.count
            if told == 1:
                logger.info("ringq worker: SIGTERM: finishing the message in flight, then exiting")
            elif told == 2:
                logger.warning(
                    "ringq worker: second SIGTERM: aborting the message in flight (rolled back)"
                )
        w = stops.worker
        if w is None:
            continue
        if os.getppid() != ppid and not w.stopping:
            logger.warning("ringq worker: parent %d is gone: stopping", ppid)
            w.stop()
        if time.monotonic() - last >= every:
            last = time.monotonic()
            _send(report, w.stats())


def _send(report: Any, stats: dict[str, int]) -> None:
    if report is None:
        return
    try:
        report.send(stats)
    except (OSError, ValueError):
        pass  # the parent is gone or stopped listening


@dataclass
class _Child:
    index: int
    proc: Any = None  # multiprocessing.Process
    reader: Any = None  # its stats pipe
    started: float = 0.0
    failures: int = 0
    restart_at: float | None = 0.0  # when to (re)start; None: not to be started
    ready: bool = False  # reported once its SIGTERM handling was in place
    last: dict[str, int] = field(default_factory=dict)


class WorkerPool:
    """N worker processes running ``target``'s actions, supervised.

    ``target`` is ``"MODULE[:ATTR]"`` (imported in each child) or an
    :class:`Actions` (picklable by reference for "spawn"; any with "fork").
    :meth:`run` blocks until stopped and returns a :class:`WorkerExit` code;
    it installs SIGTERM/SIGINT handlers that only count the requests (and
    restores the previous ones). :meth:`request_stop` does the same from code.

    :raises ConfigError: (at start) the actions cannot be loaded.
    :raises QueueNotFound: (at start) a served queue does not exist.
    :raises DatabaseUnavailable: (at start) the database cannot be reached.
    """

    def __init__(
        self, target: str | Actions, dsn: str | None = None, *, config: PoolConfig | None = None
    ) -> None:
        self.target = target
        self.config = config or PoolConfig()
        self._dsn_arg = dsn
        self.dsn = ""
        self._ctx: Any = mp.get_context(self.config.start_method)
        self._children = [_Child(i) for i in range(self.config.processes)]
        self._section: Section | None = None
        self._started = False
        self._stop_requests = 0
        self._stops_sent = 0
        self._retired = dict.fromkeys(STATS_KEYS, 0)
        self._restarts = 0
        self._fatal: WorkerExit | None = None
        self._aborted = False
        self._killed = False
        self._to_recover: set[int] = set()

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Check the actions and queues, then start the children."""
        if self._started:
            return self
        self.dsn = resolve_dsn(self._dsn_arg)
        actions = load_actions(self.target) if isinstance(self.target, str) else self.target
        served = WorkerConfig(queues=self.config.worker.queues)  # validates names
        unknown = [q for q in served.queues if q not in actions]
        if unknown:
            raise ConfigError(
                f"no action for queue(s) {', '.join(unknown)} (actions: {', '.join(actions.queues)})"
            )
        with connect(self.dsn, application_name="ringq worker pool") as s:
            for q in served.queues or tuple(actions.queues):
                info = s.queue_info(q)
                if info.dequeue_mode == "single" and self.config.processes > 1:
                    logger.warning(
                        "ringq worker: queue %s is in single-dequeuer mode: its messages are handled one "
                        "at a time, in order, whatever the number of processes (create it with "
                        "dequeue_mode=shared for parallel handling)",
                        q,
                    )
            instance = s.instance
            s.commit()
        self._section = Section.attach(instance)
        self._started = True
        now = time.monotonic()
        for ch in self._children:
            ch.restart_at = now
        self._start_due()
        return self

    def close(self) -> None:
        """Kill children still running (use :meth:`run` to stop them gracefully); idempotent."""
        for ch in self._children:
            p = ch.proc
            if p is not None and p.exitcode is None:
                p.kill()
                p.join(5)
            ch.proc = None
            if ch.reader is not None:
                ch.reader.close()
                ch.reader = None
        if self._section is not None:
            if self._started:
                self._recover_now()
            self._section.close()
            self._section = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control -----------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Count a stop request (flag only; safe in a signal handler): the first
        drains the children, the second aborts their messages in flight, a
        third kills them (their transactions roll back; entries are recovered)."""
        self._stop_requests += 1

    def pids(self) -> list[int]:
        """Pids of the children alive now."""
        return [
            ch.proc.pid for ch in self._children if ch.proc is not None and ch.proc.exitcode is None
        ]

    def stats(self) -> dict[str, int]:
        """Totals over all children, past and present (keys: STATS_KEYS, restarts, processes)."""
        out = dict(self._retired)
        for ch in self._children:
            for k in STATS_KEYS:
                out[k] += ch.last.get(k, 0)
        out[RESTARTS] = self._restarts
        out[PROCESSES] = len(self.pids())
        return out

    def run(self) -> int:
        """Supervise until stopped; returns the exit code (a :class:`WorkerExit`)."""
        self.start()
        on_main = threading.current_thread() is threading.main_thread()
        wake_r = wake_w = -1
        prev: dict[signal.Signals, Any] = {}
        prev_fd = -1
        if on_main:
            wake_r, wake_w = os.pipe()
            os.set_blocking(wake_r, False)
            os.set_blocking(wake_w, False)
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev[sig] = signal.signal(sig, self._on_signal)
            prev_fd = signal.set_wakeup_fd(wake_w)
        try:
            return self._loop(wake_r)
        finally:
            if on_main:
                signal.set_wakeup_fd(prev_fd)
                for sig, h in prev.items():
                    signal.signal(sig, h)
                os.close(wake_r)
                os.close(wake_w)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requests += 1

    def _loop(self, wake_r: int) -> int:
        while True:
            self._forward_stops()
            stopping = self._stop_requests > 0 or self._fatal is not None
            live = [ch for ch in self._children if ch.proc is not None]
            if stopping and not live:
                break
            if not stopping:
                self._start_due()
            if self._to_recover:
                self._recover_now()
            waitables: list[Any] = [ch.proc.sentinel for ch in live] + [
                ch.reader for ch in live if ch.reader
            ]
            if wake_r >= 0:
                waitables.append(wake_r)
            timeout = 0.1 if (self._to_recover or stopping) else self._until_next_start()
            ready = mpc.wait(waitables, timeout)
            if wake_r >= 0 and wake_r in ready:
                try:
                    while os.read(wake_r, 512):
                        pass
                except BlockingIOError:
                    pass
            for ch in live:
                self._read_stats(ch)
                if ch.proc.sentinel in ready or ch.proc.exitcode is not None:
                    self._child_exited(ch, stopping)
        self._recover_now()
        if self._fatal is not None:
            return int(self._fatal)
        return int(WorkerExit.ABORTED if self._aborted else WorkerExit.OK)

    def _forward_stops(self) -> None:
        if self._stop_requests >= 3 and not self._killed:
            # An action that cannot be interrupted (stuck in C code, or blocking
            # SIGALRM): kill. PostgreSQL rolls its transaction back and the
            # recovery below gives its entries back.
            self._killed = True
            self._aborted = True
            logger.warning("ringq worker pool: third stop request: killing the workers")
            for ch in self._children:
                if ch.proc is not None and ch.proc.exitcode is None:
                    ch.proc.kill()
        while self._stops_sent < min(self._stop_requests, 2):
            self._stops_sent += 1
            what = (
                "draining (messages in flight finish)"
                if self._stops_sent == 1
                else "aborting messages in flight"
            )
            logger.warning("ringq worker pool: stop requested: %s", what)
            for ch in self._children:
                if ch.proc is not None and ch.proc.exitcode is None:
                    try:
                        os.kill(ch.proc.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass

    def _until_next_start(self) -> float:
        due = [
            ch.restart_at for ch in self._children if ch.proc is None and ch.restart_at is not None
        ]
        if not due:
            return 1.0
        return max(0.0, min(min(due) - time.monotonic(), 1.0))

    def _start_due(self) -> None:
        now = time.monotonic()
        for ch in self._children:
            if ch.proc is None and ch.restart_at is not None and ch.restart_at <= now:
                self._start_child(ch)

    def _start_child(self, ch: _Child) -> None:
        reader, writer = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_child_main,
            args=(
                self.target,
                self.dsn,
                self.config.worker,
                ch.index,
                writer,
                logging.getLogger().getEffectiveLevel(),
            ),
            name=f"ringq-worker-{ch.index}",
            daemon=False,
        )
        # Children start with SIGTERM/SIGINT blocked in every thread they will
        # have (the mask is inherited across fork and exec); their watcher
        # thread takes them with sigwait. A stop signal arriving meanwhile
        # stays pending here until the mask is restored.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        writer.close()
        ch.proc, ch.reader, ch.started, ch.restart_at, ch.last = (
            proc,
            reader,
            time.monotonic(),
            None,
            {},
        )
        ch.ready = False
        logger.info("ringq worker pool: worker %d started (pid %d)", ch.index, proc.pid)

    def _read_stats(self, ch: _Child) -> None:
        r = ch.reader
        if r is None:
            return
        try:
            while r.poll():
                got = r.recv()
                ch.ready = True
                if got:
                    ch.last = got
        except (EOFError, OSError):
            r.close()
            ch.reader = None

    def _child_exited(self, ch: _Child, stopping: bool) -> None:
        proc = ch.proc
        proc.join(5)  # reap: a zombie's slots cannot be decided yet
        self._read_stats(ch)
        if ch.reader is not None:
            ch.reader.close()
            ch.reader = None
        code = proc.exitcode
        for k in STATS_KEYS:
            self._retired[k] += ch.last.get(k, 0)
        ch.last = {}
        ch.proc = None
        self._to_recover.add(proc.pid)
        ran = time.monotonic() - ch.started
        if code == WorkerExit.ABORTED:
            self._aborted = True
        if code in (WorkerExit.USAGE, WorkerExit.NOT_FOUND):
            logger.error(
                "ringq worker pool: worker %d exited %d (bad actions or queues): stopping",
                ch.index,
                code,
            )
            if self._fatal is None:
                self._fatal = WorkerExit(code)
                self._stop_requests = max(self._stop_requests, 1)
            return
        if stopping:
            if code == -signal.SIGKILL and self._killed:
                logger.warning("ringq worker pool: worker %d (pid %d) killed", ch.index, proc.pid)
            elif code == -signal.SIGTERM and not ch.ready:
                logger.info(
                    "ringq worker pool: worker %d (pid %d) stopped while starting",
                    ch.index,
                    proc.pid,
                )
            elif code not in (WorkerExit.OK, WorkerExit.ABORTED):
                logger.warning(
                    "ringq worker pool: worker %d (pid %d) exited %s while stopping",
                    ch.index,
                    proc.pid,
                    _how(code),
                )
            return
        ch.failures = 1 if ran >= self.config.stable_after else ch.failures + 1
        delay = min(self.config.restart_initial * 2 ** (ch.failures - 1), self.config.restart_max)
        ch.restart_at = time.monotonic() + delay
        self._restarts += 1
        logger.warning(
            "ringq worker pool: worker %d (pid %d) %s after %.1fs; its entries are given back; restarting in %.2gs",
            ch.index,
            proc.pid,
            _how(code),
            ran,
            delay,
        )
        self._recover_now()

    def _recover_now(self) -> None:
        """Decide the slots of dead children from the rows now (the monitor would, later)."""
        sec = self._section
        if sec is None or not self._to_recover:
            return
        from ._recovery import recover_dead_clients  # the recovery module imports the session

        try:
            recover_dead_clients(sec, self.dsn)
        except RingqError as exc:
            logger.warning("ringq worker pool: recovery failed (will retry): %s", exc)
            return
        left = {sec.c(c, L.C_PID) for c in sec.active_clients()}
        # A client whose backend had not ended yet is decided on a later round.
        self._to_recover = {pid for pid in self._to_recover if pid in left and not pid_alive(pid)}


def _how(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    try:
        return f"exited {code} ({WorkerExit(code).name})"
    except ValueError:
        return f"exited {code}"
