"""The worker pool: N worker processes, supervised.

:class:`WorkerPool` runs N worker *processes* (each with its own session),
restarts a child that dies (with backoff) after giving its slots back at once
with :func:`ringq.engine.recovery.recover_dead_clients`, and stops them all
on SIGTERM: the first lets messages in flight finish, a second aborts them.
Children exit with a :class:`WorkerExit` code (the values of
:mod:`ringq.engine.exits`).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Final, Self

from ringq.engine import (
    ConfigError,
    DatabaseUnavailable,
    QueueNotFound,
    RingqError,
    Section,
    connect,
    dsn_file,
    exits,
    pid_alive,
    read_dsn_file,
    redact_dsn,
    resolve_dsn,
    validate_int,
)
from ringq.engine import layout as L
from ringq.engine.recovery import recover_dead_clients

from ._actions import Actions, load_actions
from ._async import AsyncWorker
from ._worker import STATS_KEYS, Worker, WorkerConfig

logger = logging.getLogger("ringq.worker")

# Pool-level keys (WorkerPool.stats()).
RESTARTS: Final = "restarts"
PROCESSES: Final = "processes"


class WorkerExit(enum.IntEnum):
    """Exit codes of worker processes and of ``ringq worker`` (from :mod:`ringq.engine.exits`)."""

    OK = exits.OK  # stopped (first SIGTERM: messages in flight finished)
    FAILURE = exits.FAILURE  # an unexpected error
    USAGE = exits.USAGE  # the actions could not be loaded, or bad settings
    DB_UNAVAILABLE = exits.DB_UNAVAILABLE  # the database cannot be reached
    NOT_FOUND = exits.NOT_FOUND  # a queue named by the actions does not exist
    ABORTED = exits.INTERRUPTED  # a second SIGTERM aborted messages in flight (rolled back)


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
        validate_int("processes", self.processes, 1, 256)
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
        self.worker: Worker | AsyncWorker | None = None

    def request(self) -> None:
        n = next(self._seq)
        self.count = max(self.count, n)
        w = self.worker
        if w is not None:
            w.stop(abort=n >= 2)

    def attach(self, worker: Worker | AsyncWorker) -> None:
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
    worker: Worker | AsyncWorker | None = None
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
        worker = (
            AsyncWorker(actions, dsn, config=config, concurrency=config.concurrency)
            if config.concurrency else Worker(actions, dsn, config=config)
        )
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
    with suppress(OSError, ValueError):  # the parent is gone or stopped listening
        report.send(stats)


@dataclass
class _Child:
    index: int
    proc: Any = None  # multiprocessing.Process
    reader: Any = None  # its stats pipe
    started: float = 0.0
    failures: int = 0
    restart_at: float | None = 0.0  # when to (re)start; None: not to be started
    ready: bool = False  # reported once its SIGTERM handling was in place
    # exited because it could not reach the database: started again as soon as
    # the pool reaches it (see WorkerPool._database_back), whatever its backoff
    waits_for_db: bool = False
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
        self._dsn_file: Path | None = None
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
        # Why the last recovery failed (None: it did not): logged once, not at every retry.
        self._recovery_failed: RingqError | None = None

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> WorkerPool:
        """Check the actions and queues, then start the children."""
        if self._started:
            return self
        self.dsn = resolve_dsn(self._dsn_arg)
        self._dsn_file = dsn_file(self._dsn_arg)  # the embedded cluster's: re-read at each restart
        actions = load_actions(self.target) if isinstance(self.target, str) else self.target
        served = WorkerConfig(queues=self.config.worker.queues)  # validates names
        unknown = [q for q in served.queues if q not in actions]
        if unknown:
            raise ConfigError(
                f"no action for queue(s) {', '.join(unknown)} "
                f"(actions: {', '.join(actions.queues)})"
            )
        with connect(self.dsn, application_name="ringq worker pool") as s:
            for q in served.queues or tuple(actions.queues):
                info = s.queue_info(q)
                if info.dequeue_mode == "single" and self.config.processes > 1:
                    logger.warning(
                        "ringq worker: queue %s is in single-dequeuer mode: its messages are "
                        "handled one at a time, in order, whatever the number of processes "
                        "(create it with dequeue_mode=shared for parallel handling)",
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
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(ch.proc.pid, signal.SIGTERM)

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
        moved = None if self._dsn_file is None else read_dsn_file(self._dsn_file)
        if moved is not None and moved != self.dsn:
            logger.warning(
                "ringq worker pool: the embedded cluster came back at %s", redact_dsn(moved)
            )
            self.dsn = moved
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
        ch.waits_for_db = code == WorkerExit.DB_UNAVAILABLE
        ch.failures = 1 if ran >= self.config.stable_after else ch.failures + 1
        delay = min(self.config.restart_initial * 2 ** (ch.failures - 1), self.config.restart_max)
        ch.restart_at = time.monotonic() + delay
        self._restarts += 1
        logger.warning(
            "ringq worker pool: worker %d (pid %d) %s after %.1fs; its entries are given back; "
            "restarting in %.2gs",
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
        try:
            recover_dead_clients(sec, self.dsn)
        except RingqError as exc:
            # Retried at every turn of the loop (0.1 s) while the database is away.
            log = logger.warning if self._recovery_failed is None else logger.debug
            log("ringq worker pool: recovery failed (will retry): %s", exc)
            self._recovery_failed = exc
            return
        failed, self._recovery_failed = self._recovery_failed, None
        if isinstance(failed, DatabaseUnavailable):
            self._database_back()
        left = {sec.c(c, L.C_PID) for c in sec.active_clients()}
        # A client whose backend had not ended yet is decided on a later round.
        self._to_recover = {pid for pid in self._to_recover if pid in left and not pid_alive(pid)}


    def _database_back(self) -> None:
        """The pool reaches the database again, after its recovery could not:
        workers that exited because they could not reach it start now, their
        backoff reset. After a fail-over (a multi-host DSN, the standby
        promoted) they would otherwise wait out a backoff that doubled all
        the while the database had no primary."""
        now = time.monotonic()
        waiting = [
            ch for ch in self._children
            if ch.proc is None and ch.restart_at is not None and ch.waits_for_db
        ]
        for ch in waiting:
            ch.restart_at, ch.failures, ch.waits_for_db = now, 0, False
        logger.warning(
            "ringq worker pool: the database answers again%s",
            f": restarting {len(waiting)} worker(s) now" if waiting else "",
        )


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
