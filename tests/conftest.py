"""Fixtures shared by the test suite: a real PostgreSQL that the suite starts itself.

- ``shm_left_as_found`` (session, autouse): fails the session if it leaves
  global sections of its own clusters' databases in /dev/shm.
- ``pg_cluster`` (session): the project's own embedded cluster, under a
  temporary home, stopped when the session ends (even if it ends badly).
- ``dsn`` (function): a fresh database ``t_<hex>`` on that cluster for each
  test, dropped afterwards with its global section and semaphores; ``dsn2``
  (function): a second one beside it, likewise.
- ``ringq_env`` (function): ``RINGQ_DSN``/``RINGQ_HOME`` set for the test and
  its subprocesses (``ringq`` commands), pointing at that database.
- ``make_queue`` (function): ``make_queue(capacity=64, max_payload=1024, **settings)``
  creates a queue with a fresh name in that database; afterwards the global
  section and semaphores of that database are removed.
- ``verifier`` (session): one Spark session (``local[2]``) that proves the
  regression runs of every module that asks for it, started once (about 10 s).

And the helpers that several test modules share (``from conftest import ...``):
:func:`present`, :func:`wait_for`, :func:`drain`, :func:`queue_in`,
:func:`remove_section`, :func:`fresh_database`, :func:`terminate_backend`,
:func:`activity_of`, :func:`make_stale`,
:func:`worker_of`, :func:`handle_one`,
:func:`cli`, :func:`closed_port`, :func:`prepared_gids`, :func:`decided_gids`
and :class:`MonitorProcess`.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, LiteralString, TypeVar

import psycopg
import pytest
from psycopg import pq, sql
from ringq.cli import main
from ringq.cluster import Cluster
from ringq.engine import Message, Section, Session, connect, sections_on_host
from ringq.engine import layout as L
from ringq.monitor import Monitor, MonitorConfig
from ringq.regression import Verifier
from ringq.scripting import QueueSpec, create_queue
from ringq.scripting import remove_section as remove_section_of
from ringq.worker import Actions, AsyncWorker, Worker

SHM_DIR = "/dev/shm"

# Spark (the regression analysis) must not go looking for the host's public
# address in a sandbox; loopback is enough for a local master.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

T = TypeVar("T")
MONITOR_INTERVAL = 0.2  # the sample interval (s) of the monitors tests start


@pytest.fixture(scope="session", autouse=True)
def shm_left_as_found(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Fail the session if it leaves global sections of its own in /dev/shm:
    new ones that describe a cluster the suite made (their system identifier
    is one of the clusters under the session's temporary directory). Other
    runs on the host (another suite, a benchmark) may add and remove theirs
    meanwhile; those are not counted."""
    before = set(os.listdir(SHM_DIR))
    yield
    sysids = _cluster_sysids(tmp_path_factory.getbasetemp())
    left = [
        s for s in sections_on_host()
        if s.path.name not in before and s.sysid and s.sysid in sysids
    ]
    if left:
        names = ", ".join(f"{s.name} (pids {list(s.pids)}, queues {list(s.queues)})" for s in left)
        raise AssertionError(
            f"the test suite left {len(left)} global section(s) in /dev/shm: {names}"
        )


def _cluster_sysids(base: Path) -> set[int]:
    """The system identifiers of the PostgreSQL data directories under ``base``."""
    out = set()
    for here, dirs, files in os.walk(base):
        if "PG_VERSION" in files:
            dirs.clear()
            try:
                head = Path(here, "global", "pg_control").read_bytes()[:8]
            except OSError:
                continue
            if len(head) == 8:
                out.add(struct.unpack("=Q", head)[0])
    return out


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("pg_cluster"))
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()  # also after a failed start, a failed test, Ctrl-C or SIGTERM
        if signal.getsignal(signal.SIGTERM) is _sigterm_as_interrupt:
            signal.signal(signal.SIGTERM, previous)


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    # pytest tears fixtures down on KeyboardInterrupt but simply dies on SIGTERM
    # (what `timeout` and CI runners send), which would orphan the cluster's
    # server. The first SIGTERM becomes an interrupt; a second one kills.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


def _default_sigterm_in_child() -> None:
    # Processes forked by tests keep the default: killed at once by SIGTERM.
    if signal.getsignal(signal.SIGTERM) is _sigterm_as_interrupt:
        with suppress(ValueError):  # not the main thread: nothing we can do
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


os.register_at_fork(after_in_child=_default_sigterm_in_child)


@pytest.fixture(scope="session")
def verifier() -> Iterator[Verifier]:
    """The suite's Spark session for the regression's proofs: Spark takes
    about 10 s to start, and four modules prove runs. Stopped at the end."""
    with Verifier("local[2]") as v:
        yield v


@pytest.fixture
def dsn(pg_cluster: Cluster) -> Iterator[str]:
    with fresh_database(pg_cluster) as url:
        yield url


@pytest.fixture
def dsn2(pg_cluster: Cluster) -> Iterator[str]:
    """A second database beside ``dsn`` (the other side of a move or a transfer)."""
    with fresh_database(pg_cluster) as url:
        yield url


@contextmanager
def fresh_database(cluster: Cluster, prefix: str = "t") -> Iterator[str]:
    """A new database ``<prefix>_<hex>`` on ``cluster`` (its URL), dropped
    afterwards."""
    name = f"{prefix}_{secrets.token_hex(6)}"
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield cluster.url(name)
    finally:
        _drop_database(cluster, name)


def _drop_database(cluster: Cluster, name: str) -> None:
    # Whatever the test made in shared memory goes with its database.
    remove_section(cluster.url(name))
    # A prepared transaction left by a test would block DROP DATABASE (FORCE
    # ends sessions, not prepared transactions): roll those back first, from
    # inside the database as PostgreSQL requires.
    with psycopg.connect(cluster.url(name), autocommit=True) as conn:
        gids = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchall()
        for (gid,) in gids:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def ringq_env(
    dsn: str, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The environment of a ``ringq`` command run against this test's database."""
    monkeypatch.setenv("RINGQ_DSN", dsn)
    monkeypatch.setenv("RINGQ_HOME", os.path.join(tmp_path, "ringq_home"))
    return dict(os.environ)


@pytest.fixture
def section() -> Iterator[Section]:
    """A private global section, no database: made for the test, removed after."""
    instance = "sectest" + secrets.token_hex(6)
    sec = Section.attach(instance)
    try:
        yield sec
    finally:
        Section.unlink(instance)


@pytest.fixture
def make_queue(dsn: str) -> Iterator[Callable[..., str]]:
    def make(capacity: int = 64, max_payload: int = 1024, **settings: Any) -> str:
        return queue_in(dsn, capacity, max_payload, **settings)

    yield make
    remove_section(dsn)


@pytest.fixture
def monitor(dsn: str, tmp_path: Path) -> Iterator[Callable[..., Monitor]]:
    """In-process monitors, stopped after the test."""
    made: list[Monitor] = []

    def start(**kw: Any) -> Monitor:
        kw.setdefault("port", 0)
        kw.setdefault("interval", MONITOR_INTERVAL)
        kw.setdefault("data_dir", tmp_path / "monitor")
        m = Monitor(MonitorConfig(dsn, **kw))
        m.start()
        made.append(m)
        return m

    yield start
    for m in made:
        m.stop()


@contextmanager
def own_server_queue(home: Path, **settings: Any) -> Iterator[tuple[Cluster, str, str]]:
    """A PostgreSQL server of the test's own (it may stop and start it) with
    one queue (``settings`` as QueueSpec's, 64 slots of 100 bytes unless
    given): (the cluster, its DSN, the queue). The database's section is
    removed and the server stopped afterwards, whatever happened."""
    cluster = Cluster(home)
    dsn = cluster.start()
    instance = None
    try:
        q = "q_" + uuid.uuid4().hex[:10]
        with psycopg.connect(dsn) as conn:
            create_queue(conn, QueueSpec(q, settings.pop("capacity", 64),
                                         settings.pop("max_payload", 100), **settings))
            instance = present(conn.execute(
                "SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone())[0]
        yield cluster, dsn, q
    finally:
        if instance is not None and cluster.status().running:
            remove_section(dsn)
        cluster.stop()
        if instance is not None:
            Section.unlink(instance)


# -- helpers shared by the test modules ----------------------------------------------------


def queue_in(dsn: str, capacity: int = 64, max_payload: int = 1024, **settings: Any) -> str:
    """Create a queue with a fresh name in the database at ``dsn`` (``dsn`` or
    ``dsn2``, whose teardown removes its section) and return the name."""
    name = "q_" + uuid.uuid4().hex[:10]
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(name, capacity, max_payload, **settings))
    return name


def remove_section(dsn: str) -> None:
    """Remove the global section and semaphores of the database at ``dsn``,
    those of its dropped queues too (the tests' queues live in shared memory
    beyond the database's life). Harmless without a ringq schema, and twice."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        remove_section_of(conn)


def present(value: T | None) -> T:
    """``value``, which the test expects to be there (a row, an entry, a pid):
    fails the test where it is None."""
    assert value is not None, "expected a value, got None"
    return value


def wait_for(
    cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition", every: float = 0.02
) -> Any:
    """Poll ``cond`` every ``every`` seconds until it returns something truthy, and
    return that; fail after ``timeout`` seconds. OSError, KeyError and ValueError
    from ``cond`` count as "not yet" (a file or a server not up yet)."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            got = cond()
        except (OSError, KeyError, ValueError) as exc:  # not up yet
            last_exc = exc
            got = None
        if got:
            return got
        time.sleep(every)  # polling a condition with a deadline, not synchronizing by sleep
    last = f" (last: {last_exc!r})" if last_exc else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{last}")


def worker_of(actions: Actions, dsn: str, concurrency: int) -> Worker | AsyncWorker:
    """A worker of ``actions``, opened: one sync consumer (``concurrency``
    0) or an AsyncWorker of ``concurrency`` consumers (``ringq worker
    --concurrency``), for tests that hold both to the same assertions."""
    if concurrency:
        return AsyncWorker(actions, dsn, concurrency=concurrency).open()
    return Worker(actions, dsn).open()


def handle_one(w: Worker | AsyncWorker) -> bool:
    """Let ``w`` handle one message (waiting for one to be ready): True."""
    if isinstance(w, Worker):
        return w.run_one(wait=5)
    return w.run(max_messages=1) == 1


def enqueue_committed(dsn: str, queue: str, *payloads: bytes, **options: Any) -> list[int]:
    """Enqueue ``payloads`` in one transaction of a session of its own, and
    commit; their seqs. ``options`` go to every enqueue (``group``, ``delay`` ...)."""
    with connect(dsn) as s:
        seqs = [s.enqueue(queue, p, **options) for p in payloads]
        s.commit()
    return seqs


def sql_enqueue(dsn: str, entries: Iterable[tuple[str, bytes]]) -> None:
    """Enqueue each (queue, payload) as a client outside the engine does: a
    ``SELECT ringq.enqueue(queue, payload)`` of its own, autocommitted (into
    ``ringq.inbox``, for the monitor's pump)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for queue, payload in entries:
            conn.execute("SELECT ringq.enqueue(%s, %s)", (queue, payload))


def inbox_insert(dsn: str, entries: Iterable[tuple[str, bytes]]) -> None:
    """Put each (queue, payload) into ``ringq.inbox`` directly, past the
    queue's room: what SQL producers racing for its last slots may overshoot
    (``ringq.enqueue`` refuses an entry it sees no room for, RQ002), so that
    a test can face the pump with more inbox rows than the ring takes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for queue, payload in entries:
            conn.execute(
                "INSERT INTO ringq.inbox (queue_id, payload) "
                "SELECT id, %s FROM ringq.queues WHERE name = %s",
                (payload, queue),
            )


def drain(dsn: str, queue: str, *, wait: float | None = None, batch: int = 1) -> list[Message]:
    """Dequeue every ready entry of ``queue``, oldest first, committing each
    transaction of ``batch`` entries; the messages. ``wait``: how long each
    dequeue may wait for an entry (s), the last one included."""
    out: list[Message] = []
    with connect(dsn) as s:
        while True:
            if batch == 1:
                m = s.dequeue(queue, wait=wait)
                got = [] if m is None else [m]
            else:
                got = s.dequeue_many(queue, batch, wait=wait)
            s.commit()
            if not got:
                return out
            out.extend(got)


def terminate_backend(dsn: str, pid: int) -> None:
    """End the backend ``pid`` (a session's connection dies under it, as when
    the server kills it) and wait until PostgreSQL has let it go."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        while present(
            admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
        )[0]:
            time.sleep(0.01)


def make_stale(s: Session, queue: str) -> None:
    """Move the queue's block back to seq 0, as a section restored from an old copy would be."""
    ring = s.ring(queue)
    s.section.queues[ring.qb + L.Q_HEAD] = 0
    s.section.queues[ring.qb + L.Q_TAIL] = 0
    s.section.enq[ring.w0 : ring.w0 + (ring.cap + 63) // 64] = 0


def activity_of(dsn: str, pid: int, columns: LiteralString) -> tuple[Any, ...]:
    """``columns`` (expressions over pg_stat_activity, e.g. ``"state, backend_xmin"``)
    of the backend ``pid``, which must be there."""
    query = sql.SQL("SELECT {} FROM pg_stat_activity WHERE pid = %s").format(sql.SQL(columns))
    with psycopg.connect(dsn, autocommit=True) as admin:
        return tuple(present(admin.execute(query, (pid,)).fetchone()))


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run ``ringq ARGV`` in-process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own --help and usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def closed_port() -> int:
    """A local port that nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def prepared_gids(dsn: str) -> list[str]:
    """The gids of the database's prepared transactions, sorted."""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")
        return sorted(r[0] for r in rows)


def decided_gids(dsn: str) -> list[str]:
    """The gids in ``ringq.tpc_decisions`` (decided to commit), sorted."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return sorted(r[0] for r in c.execute("SELECT gid FROM ringq.tpc_decisions"))


class MonitorProcess:
    """``ringq monitor`` as a real process (a pass every ``INTERVAL`` s, ``extra``
    arguments after the defaults); ``url`` once it serves. Its stderr goes to
    ``monitor.err`` in ``data_dir`` (a file: a pipe nobody reads could fill
    and stall the monitor's logging); :meth:`log` reads it."""

    INTERVAL = 0.2

    def __init__(
        self, dsn: str, data_dir: Path, *extra: str, env: dict[str, str] | None = None
    ) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.err_path = data_dir / "monitor.err"
        with self.err_path.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ringq.cli", "monitor", "--dsn", dsn, "--port", "0",
                 "--data-dir", str(data_dir), "--interval", str(self.INTERVAL), *extra],
                stdout=subprocess.DEVNULL, stderr=err, text=True, env=env,
            )
        self.url: str = wait_for(self._url, 30, "the monitor to serve")

    def log(self) -> str:
        """What the monitor wrote to stderr so far."""
        try:
            return self.err_path.read_text(errors="replace")
        except OSError:
            return ""

    def _url(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"monitor exited {self.proc.returncode}: {self.log()}")
        state = json.loads((self.data_dir / "monitor.json").read_text())
        return state["url"] if state.get("pid") == self.proc.pid else None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.stop()


@contextmanager
def wire_trace(conn: psycopg.Connection[Any]) -> Iterator[list[str]]:
    """The protocol messages ``conn`` exchanges inside the block (libpq's trace)."""
    lines: list[str] = []
    with tempfile.TemporaryFile("w+") as f:
        conn.pgconn.trace(f.fileno())
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield lines
        finally:
            conn.pgconn.untrace()
            f.seek(0)
            lines.extend(f.read().splitlines())


def round_trips(lines: list[str]) -> int:
    """Exchanges in a trace: each one ends with the server's ReadyForQuery."""
    return sum(1 for line in lines if "\tReadyForQuery\t" in line)


class AsyncFace:
    """A sync front over an :class:`~ringq.engine.AsyncSession`: each call
    runs the coroutine on the face's own event loop. Lets a test of the sync
    API's guarantees run against the asyncio face unchanged (the ``face``
    fixture). ``connection`` is the sync front of the same libpq connection."""

    def __init__(self, dsn: str, **kwargs: Any) -> None:
        import asyncio

        from ringq.engine import connect_async

        self._loop = asyncio.new_event_loop()
        self._a = self._loop.run_until_complete(connect_async(dsn, **kwargs))

    def __getattr__(self, name: str) -> Any:
        import inspect

        attr = getattr(self._a, name)
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **k: self._run(attr(*a, **k))
        if callable(attr):
            return attr
        return getattr(self._a.session, name) if attr is None else attr

    def _run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        import asyncio

        if self._loop.is_closed():  # after close(): what a closed session still answers
            return asyncio.run(coro)  # (in_doubt_outcome), on a loop of its own
        return self._loop.run_until_complete(coro)

    @property
    def connection(self) -> psycopg.Connection[Any]:
        return self._a.session.connection

    def ring(self, queue: str) -> Any:
        return self._a.session.ring(queue)

    @property
    def section(self) -> Section:
        return self._a.session.section

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._a.close())
            self._loop.close()

    def __enter__(self) -> AsyncFace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def stranger(dsn: str) -> Iterator[str]:
    """A login role of its own on the cluster (dropped afterwards)."""
    role = "r_" + uuid.uuid4().hex[:10]
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    yield role
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        c.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.fixture(params=["sync", "async"])
def face(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``connect``, or the asyncio face behind a sync front (:class:`AsyncFace`):
    a test of a guarantee taking it runs against both faces."""
    return connect if request.param == "sync" else AsyncFace
