"""What every benchmark in ``bench/`` does the same way.

- :func:`argument_parser`: the options every benchmark has (``--dsn``, ``--out``);
  :func:`add_options`: a benchmark's own, from a table of defaults and help;
  :func:`config_from_options`: its settings dataclass from them.
- :class:`RunNames`: the ringq queue, SKIP LOCKED table and log table of a run
  that sets the two against each other.
- :func:`database`: the database a run works in: the one given with ``--dsn``,
  or a private embedded PostgreSQL (``ringq.cluster.Cluster``, the same
  server settings as ``ringq db start``) under a temporary home, removed at the end.
- :func:`drop_queues`: the run's queues dropped at the end (and, on the private
  cluster, the global section and semaphores that would outlive it).
- :func:`machine`, :func:`cpu_load`, :func:`server_settings`: the notes that
  say how far the figures can be trusted (what ran them, how loaded the CPUs
  were at start and end, how the server was set).
- :func:`process_cpu_s`, :func:`postgres_cpu_s`: where the CPU went during a
  stretch (a backend, the whole local server).
- :func:`sigterm_tears_down`: SIGTERM ends a run like Ctrl-C does, through its
  ``finally`` blocks, so that the private cluster is stopped.
- :func:`write_results`: the JSON results, under ``bench/results/`` and ``--out``.
- :func:`run_together`: child processes forked, started at one moment, their
  results collected.
- :class:`TimedRound`: a producer thread and consumer threads started at one
  moment and timed for a duration, a thread's failure stopping the others.

Each script imports it as ``_benchlib`` (a script's own folder is first on
``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql
from ringq.engine import Section
from ringq.scripting import drop_queue

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

C = TypeVar("C", bound="DataclassInstance")

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SERVER_SETTINGS = (
    "server_version", "fsync", "synchronous_commit", "wal_sync_method", "shared_buffers",
    "autovacuum", "autovacuum_naptime", "max_connections",
)  # fmt: skip


def argument_parser(description: str) -> argparse.ArgumentParser:
    """A parser with the options every benchmark has: ``--dsn`` (else a private
    embedded cluster) and ``--out`` (a second copy of the JSON); ``--help``
    shows each option's default."""
    p = argparse.ArgumentParser(
        description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--dsn", help="run in this database instead of a private embedded cluster")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    return p


@dataclass(frozen=True)
class RunNames:
    """The objects a run that sets ringq against a SKIP LOCKED table creates:
    the ``queue``, the ``table`` and the ``done`` table that consumers log
    into (unique, so ``--dsn`` never touches anyone else's)."""

    queue: str
    table: str
    done: str

    @classmethod
    def fresh(cls, queue: str, table: str, done: str) -> RunNames:
        """Each name from its template, ``{}`` standing for a new random tag."""
        tag = secrets.token_hex(4)
        return cls(queue.format(tag), table.format(tag), done.format(tag))


def add_options(p: argparse.ArgumentParser, options: dict[str, tuple[int | float, str]]) -> None:
    """A benchmark's own options, from ``{field: (default, help)}``: ``--late-ms``
    for ``late_ms``, of its default's type; :func:`config_from_options` reads
    them back into the benchmark's settings."""
    for name, (default, text) in options.items():
        p.add_argument(
            "--" + name.replace("_", "-"), type=type(default), default=default, help=text
        )


def config_from_options(cls: type[C], args: argparse.Namespace, **given: Any) -> C:
    """A benchmark's settings ``cls`` (a dataclass): each field from the parsed
    option of its name, ``given`` the fields computed apart; a field with
    neither keeps its default."""
    options = vars(args)
    named = {f.name: options[f.name] for f in dataclasses.fields(cls) if f.name in options}
    return cls(**named, **given)


@contextlib.contextmanager
def database(
    dsn: str | None, home: str | None = None, prefix: str = "ringq-bench-"
) -> Iterator[tuple[str, str | None]]:
    """Yield (DSN, the embedded cluster's home or None): the database at ``dsn``
    when given, else a private embedded cluster under ``home`` (default: a new
    temporary directory named ``prefix...``), stopped and removed afterwards."""
    if dsn is not None:
        yield dsn, None
        return
    home = home or tempfile.mkdtemp(prefix=prefix)
    from ringq.cluster import Cluster  # here: --dsn runs need no cluster (nor its ringq version)

    cluster = Cluster(home)
    try:
        print(f"starting an embedded PostgreSQL under {home} ...", file=sys.stderr, flush=True)
        yield cluster.start(), home
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)


def drop_queues(
    dsn: str, queues: Sequence[str], *, embedded: bool, tables: Sequence[str] = ()
) -> None:
    """Drop the run's ``queues`` and plain ``tables`` (a queue that cannot be
    dropped is left). On the private embedded cluster (``embedded``), which
    dies with the run, also remove the database's global section and the
    queues' semaphores: shared memory outlives the server."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
        qids = [
            r[0]
            for r in admin.execute(
                "SELECT id FROM ringq.queues WHERE name = ANY(%s)", (list(queues),)
            ).fetchall()
        ]
        for name in queues:
            with contextlib.suppress(Exception):
                drop_queue(admin, name)
        for table in tables:
            admin.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(table)))
    if row and embedded:
        Section.unlink(row[0])
        Section.unlink_semaphores(row[0], qids)


def machine() -> dict[str, Any]:
    """What ran the benchmark: Python, psycopg, the platform, the CPU count."""
    return {
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def cpu_load(when: str) -> dict[str, Any]:
    """The machine's load at ``when`` ("start", "end"): ``loadavg_at_<when>``
    (1, 5 and 15 min) and ``cpu_pressure_at_<when>``. The machine is shared:
    other work competing for the CPUs moves every figure."""
    return {f"loadavg_at_{when}": os.getloadavg(), f"cpu_pressure_at_{when}": cpu_pressure()}


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used, from
    /proc/<pid>/stat (None: no such process on this host, as for the backend
    of a remote server)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu_s() -> float:
    """CPU seconds used by every process of this host named ``postgres``
    (backends, the WAL writer, autovacuum ...): with :func:`process_cpu_s` of
    one backend, what the rest of the server spent meanwhile."""
    total = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if "(postgres)" in stat:
            total += process_cpu_s(int(name)) or 0.0
    return total


def cpu_pressure() -> str | None:
    """/proc/pressure/cpu's "some" line: how much runnable work waited for a CPU
    (None where the kernel does not say)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


def server_settings(
    conn: psycopg.Connection[Any], names: Sequence[str] = SERVER_SETTINGS
) -> dict[str, str | None]:
    """The server's current value of each setting in ``names``."""
    settings = {}
    for name in names:
        row = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
        settings[name] = row[0] if row else None
    return settings


def sigterm_tears_down() -> None:
    """Make the first SIGTERM end the run like Ctrl-C (KeyboardInterrupt, so
    every ``finally`` runs and the private cluster is stopped); a second one
    kills. Left alone when the caller already set a handler."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm)


def _sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


def run_in_database(
    name: str,
    args: argparse.Namespace,
    config: Any,
    run: Callable[[str], dict[str, Any]],
    cleanup: Callable[[str, bool], None],
    summarize: Callable[[dict[str, Any]], dict[str, Any]],
    render: Callable[[dict[str, Any], dict[str, Any], float], str],
) -> int:
    """The ``main()`` of a benchmark whose objects live in one database:
    ``run(dsn)`` in ``args.dsn`` or a private embedded cluster, then
    ``cleanup(dsn, embedded)`` whatever happened; print ``render(raw,
    summary, seconds)`` and write it with ``raw``, ``summary`` and the
    dataclass ``config`` as ``bench/results/<name>-<start>.json``."""
    sigterm_tears_down()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    with database(args.dsn) as (dsn, home):
        try:
            raw = run(dsn)
        finally:
            with contextlib.suppress(Exception):
                cleanup(dsn, home is not None)
    seconds = time.perf_counter() - t0
    summary = summarize(raw)
    table = render(raw, summary, seconds)
    print(table)
    doc = {
        "benchmark": name,
        "started_at": started.isoformat(),
        "seconds": seconds,
        "command": [sys.executable, *sys.argv],
        "database": "embedded" if args.dsn is None else "given (--dsn)",
        "config": config.__dict__,
        **raw,
        **summary,
        "table": table,
    }
    write_results(name, started, doc, args.out)
    return 0


def write_results(name: str, started: datetime, doc: dict[str, Any], out: Path | None) -> None:
    """Write ``doc`` as JSON to ``bench/results/<name>-<UTC start>.json`` and to
    ``out`` when given; say where on stderr."""
    paths = [RESULTS_DIR / f"{name}-{started.strftime('%Y%m%dT%H%M%SZ')}.json"]
    if out is not None:
        paths.append(out)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print("\nwrote " + ", ".join(str(p) for p in paths), file=sys.stderr)


# -- the one-round-trip ceiling ---------------------------------------------------------------
# One row updated in autocommit: one round trip and one WAL flush per
# transaction, the least a durable transaction costs from here.

CEIL_CREATE = "CREATE TABLE {t} (id integer PRIMARY KEY, v bigint NOT NULL)"
CEIL_FILL = "INSERT INTO {t} VALUES (1, 0)"
CEIL_UPDATE = "UPDATE {t} SET v = v + 1 WHERE id = 1"


def create_ceiling(conn: psycopg.Connection[Any], table: str) -> None:
    """The ceiling's one-row table."""
    for stmt in (CEIL_CREATE, CEIL_FILL):
        conn.execute(sql.SQL(stmt).format(t=sql.Identifier(table)))


def ceiling_one_rt(conn: psycopg.Connection[Any], table: str, n: int) -> float:
    """Transactions/s of ``n`` one-row UPDATEs of ``table`` on ``conn`` (in
    autocommit), after 10 to warm up."""
    upd = sql.SQL(CEIL_UPDATE).format(t=sql.Identifier(table))
    for _ in range(10):
        conn.execute(upd)
    start = time.perf_counter_ns()
    for _ in range(n):
        conn.execute(upd)
    return n / ((time.perf_counter_ns() - start) / 1e9)


START_DELAY = 0.05  # s between the last child ready and the common start


def run_together(
    target: Callable[..., None],
    args: Sequence[tuple[Any, ...]],
    start: Callable[[float], Any],
    done_s: float,
    who: str,
) -> tuple[float, list[Any]]:
    """Fork ``target(*a, pipe)`` for each ``a`` of ``args``; once every child
    sent ``("ready", ...)``, send each ``start(t)`` (``t``: the common start,
    ``time.monotonic()``), then collect each child's ``("done", detail)``
    within ``done_s`` seconds. Returns ``t`` and the details, in ``args`` order.
    The children are joined (killed after 30 s) whatever happens."""
    fork = mp.get_context("fork")
    procs: list[tuple[Any, Connection]] = []
    try:
        for a in args:
            parent, child = fork.Pipe()
            proc = fork.Process(target=target, args=(*a, child), daemon=True)
            proc.start()
            procs.append((proc, parent))
        for _proc, pipe in procs:
            expect(pipe, "ready", 60.0, who)
        t_start = time.monotonic() + START_DELAY
        for _proc, pipe in procs:
            pipe.send(start(t_start))
        return t_start, [expect(pipe, "done", done_s, who) for _proc, pipe in procs]
    finally:
        for proc, _pipe in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()


def expect(pipe: Connection, what: str, timeout: float, who: str = "a process") -> Any:
    """The detail of the next ``(what, detail)`` message a child process sends
    on ``pipe``; raises if none comes within ``timeout`` seconds, or if the
    child reports something else (its failure)."""
    if not pipe.poll(timeout):
        raise RuntimeError(f"{who} sent no {what!r} within {timeout:.0f} s")
    got, detail = pipe.recv()
    if got != what:
        raise RuntimeError(f"{who} failed: {detail}")
    return detail


class TimedRound:
    """A producer thread and ``consumers`` consumer threads, timed for
    ``duration`` s from their common start: each body calls
    ``barrier.wait()`` once ready, runs until ``stop`` is set, and times
    what it does against ``clock["end"]`` (``clock``: ``start`` and ``end``,
    ``time.monotonic_ns()``, set when every thread and the main one are
    ready; ``at_start`` runs then too). A thread's failure stops the others
    and is raised by :meth:`run`."""

    def __init__(
        self, consumers: int, duration: float, at_start: Callable[[], None] | None = None
    ) -> None:
        self.clock: dict[str, int] = {}
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._duration = duration
        self._at_start = at_start
        self.barrier = threading.Barrier(consumers + 2, action=self._started)

    def _started(self) -> None:
        self.clock["start"] = time.monotonic_ns()
        self.clock["end"] = self.clock["start"] + int(self._duration * 1e9)
        if self._at_start is not None:
            self._at_start()

    def _guarded(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # surfaced by the main thread
                self.errors.append(exc)
                self.stop.set()
                self.barrier.abort()
                raise

        return run

    def run(
        self,
        bodies: Sequence[Callable[[], None]],
        *,
        join_s: float,
        unit: str,
        name: str,
        started: Callable[[], None] | None = None,
        ended: Callable[[], None] | None = None,
        stopped: Callable[[], None] | None = None,
    ) -> None:
        """Start a thread per body (the producer and the consumers), wait for
        the common start, run ``started``, sleep to the end, run ``ended``;
        then set ``stop``, run ``stopped`` and join the threads (for
        ``join_s`` s at the most). Raises if a thread failed or is still
        busy (``unit``: "row", "round"; ``name``: the one that failed)."""
        threads = [threading.Thread(target=self._guarded(b), daemon=True) for b in bodies]
        for th in threads:
            th.start()
        try:
            self.barrier.wait(timeout=120)
            if started is not None:
                started()
            time.sleep(max(0.0, (self.clock["end"] - time.monotonic_ns()) / 1e9))
            if ended is not None:
                ended()
        except threading.BrokenBarrierError:
            if not self.errors:
                self.errors.append(RuntimeError("the threads were not all ready within 120 s"))
        finally:
            self.stop.set()
            if stopped is not None:
                stopped()
            deadline = time.monotonic() + join_s
            for th in threads:
                th.join(max(0.0, deadline - time.monotonic()))
        if any(th.is_alive() for th in threads):
            self.errors.append(RuntimeError(f"threads still busy long after the end of the {unit}"))
        if self.errors:
            raise RuntimeError(f"{name}: a thread failed: {self.errors[0]!r}") from self.errors[0]
