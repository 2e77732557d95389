"""The primary killed (kill -9 of its postmaster) at a chosen instant of a
commit, and the synchronous standby promoted (issue 32): every client that
was committing learns what became of its transaction, and every entry is
either delivered again or consumed, never both, never neither.

The instants, made on purpose rather than hoped for:

- ``before``: the client's backend died with the primary (the test waits for
  it) before the client sent its COMMIT; the standby is promoted, then the
  client commits on its dead connection. Nothing committed.
- ``during``: the COMMIT reached the client's backend, stopped with SIGSTOP
  before it could read it; the primary is killed and the standby promoted,
  and only then is the backend resumed (SIGCONT): it commits on the dead
  primary alone and dies waiting for a standby that is no longer its own
  (PostgreSQL ends a backend whose postmaster died without an answer), so
  the client learns of it only after the promotion. Nothing committed on
  the new primary.
- ``after``: the backend committed (the synchronous standby has it) and
  answered, but a proxy between the client and the server holds the answer;
  the primary is killed, the standby promoted, then the proxy cuts the
  client's connection: the answer never reached it. Committed.

And who decides the client's slots in the global section first (its
``decider``): the client itself, when it learns its connection is lost (no
monitor runs meanwhile), or recovery (``recover_lost_backends``, what the
monitor's ``backends`` step runs, called by the test once the standby is
promoted and before those clients learn anything).

Each client goes to the server through a proxy of its own (:class:`Proxy`),
listed first in a multi-host DSN whose second host is the standby; the
proxies stop taking connections once the primary is dead, so every
reconnection reaches the promoted standby.

One test per instant: a pair of servers, one fail-over, and every kind of
client at that instant of its commit at once (:data:`CLIENTS`), twice (once
per decider): linked sessions committing an enqueue, the dequeue of entries
served from the payload cache, and of entries read from their rows; a
two-phase participant at COMMIT PREPARED, and one-phase ``tpc_commit`` calls; a
SQL consumer (plain psycopg: ``ringq.dequeue``, then COMMIT; the monitor is
its agent); movers at their destination commit and at their source commit
(their call is the rest of ``move_batch``).

Each commit must raise :class:`RolledBack` (a :class:`Retryable`; the
session is usable again) when nothing committed, return when it committed,
or raise :class:`InDoubt` only where the rows cannot decide
(``in_doubt_outcome`` says None): a two-phase transaction still prepared on
the new primary (recovery then commits it, as its coordinator decided), or a
committed dequeue whose slots recovery decided first (its consumed row
cannot tell its own commit from a redelivery's). The SQL consumer's COMMIT
never gets an answer; the table it wrote in the same transaction tells what
committed. Afterwards the queues are drained on the new primary: each entry
is delivered again (with the deliveries the engine counts) or was consumed,
once, and no row is left queued.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import traceback
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import MonitorProcess, prepared_gids, present, wait_for
from psycopg import sql
from ringq.cluster import Cluster
from ringq.engine import (
    InDoubt,
    Retryable,
    RingqError,
    RolledBack,
    Section,
    Session,
    connect,
    queue_table,
)
from ringq.engine.recovery import recover_lost_backends
from ringq.move import MoveConfig, Mover, unwrap
from ringq.scripting import QueueSpec, create_queue
from test_failover import kill_primary, pair

# ReadyForQuery, idle: the end of the server's answer to a transaction's end
READY_IDLE = b"Z\x00\x00\x00\x05I"
WAIT = 30.0  # seconds any one step may take (a fail-over takes about one)
ENTRIES = 3  # entries on each queue before the fail-over
INSTANTS = ("before", "during", "after")
DECIDERS = ("session", "recovery")


# -- a proxy between a client and the primary ------------------------------------------------


def _shut(sock: socket.socket) -> None:
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class Pipe:
    """One connection through a :class:`Proxy`: the client's socket, the
    server's, and a thread pumping each way. The test may hold what the
    client sends from now on (``hold("requests")``: kept, not forwarded,
    until :meth:`release`) or what the server answers (``hold("replies")``:
    kept for good, the end of the server's connection too, until
    :meth:`sever` cuts the client off)."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.port: int = server.getsockname()[1]  # the backend's client_port
        self._lock = threading.Lock()
        self._holding: str | None = None
        self._held = bytearray()
        self.request_held = threading.Event()  # bytes of the client are held
        self.reply_held = threading.Event()  # a whole answer is held (ReadyForQuery, idle)
        self.server_gone = threading.Event()  # the server ended the connection

    def start(self) -> None:
        for src, dst, direction in (
            (self.client, self.server, "requests"), (self.server, self.client, "replies"),
        ):
            threading.Thread(target=self._pump, args=(src, dst, direction), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    if direction == "replies":
                        self.server_gone.set()
                    if self._holding != direction:
                        _shut(dst)
                    return
                if self._holding == direction:
                    self._held += data
                    if direction == "requests":
                        self.request_held.set()
                    elif self._held.endswith(READY_IDLE):
                        self.reply_held.set()
                    continue
                try:
                    dst.sendall(data)
                except OSError:
                    _shut(src)
                    return

    def hold(self, direction: str) -> None:
        """Keep what goes that way (``requests`` or ``replies``) from now on."""
        with self._lock:
            assert self._holding is None and not self._held
            self._holding = direction

    def release(self) -> None:
        """Send the held requests on to the server, and stop holding."""
        with self._lock:
            assert self._holding == "requests"
            self.server.sendall(self._held)
            self._held.clear()
            self._holding = None

    def sever(self) -> None:
        """Cut both ends: the client reads the end of its connection."""
        _shut(self.client)
        _shut(self.server)

    def close(self) -> None:
        self.sever()
        self.client.close()
        self.server.close()


class Proxy:
    """Forwards each connection made to :attr:`port` to the server at
    ``target`` (the primary), one :class:`Pipe` each."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.pipes: dict[int, Pipe] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # refused: the listener is shut
            try:
                server = socket.create_connection(("127.0.0.1", self.target), timeout=WAIT)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            pipe = Pipe(client, server)
            self.pipes[pipe.port] = pipe
            pipe.start()

    def pipe_of(self, admin: psycopg.Connection[Any], pid: int) -> Pipe:
        """The pipe of the backend ``pid`` (its client_port is our end's port)."""
        row = admin.execute("SELECT client_port FROM pg_stat_activity WHERE pid = %s", (pid,))
        return self.pipes[present(row.fetchone())[0]]

    def refuse(self) -> None:
        """Take no more connections: a client's next host is tried instead."""
        _shut(self.listener)
        self.listener.close()

    def close(self) -> None:
        self.refuse()
        for pipe in list(self.pipes.values()):
            pipe.close()


# -- the stage: a pair, the monitor, one proxy per client ------------------------------------


@dataclass
class Stage:
    """A synchronous pair, an admin connection to its primary, a monitor
    (while one is wanted), and a proxy per client (made by :meth:`dsn`)."""

    cluster: Cluster
    both: str  # the pair's own multi-host DSN
    primary: int  # ports
    standby: int
    admin: psycopg.Connection[Any]
    proxies: list[Proxy] = field(default_factory=list)
    home: Path = Path()  # where monitors keep their files
    monitor: MonitorProcess | None = None
    monitors: int = 0
    stopped: list[int] = field(default_factory=list)  # backends stopped with SIGSTOP

    def dsn(self) -> tuple[str, Proxy]:
        """A DSN through a new proxy to the primary, then the standby; and the proxy."""
        proxy = Proxy(self.primary)
        self.proxies.append(proxy)
        return (
            f"postgresql://postgres@127.0.0.1:{proxy.port},127.0.0.1:{self.standby}/ringq"
            "?target_session_attrs=read-write", proxy,
        )

    def queue(self, **settings: Any) -> str:
        name = "q_" + uuid.uuid4().hex[:10]
        with psycopg.connect(self.both) as conn:
            create_queue(conn, QueueSpec(name, settings.pop("capacity", 64),
                                         settings.pop("max_payload", 1024), **settings))
        return name

    def enqueue(self, queue: str, entries: list[bytes]) -> None:
        """Commit ``entries`` on ``queue`` from a linked session (the payload
        cache keeps them, where the queue has one)."""
        with connect(self.both) as s:
            for p in entries:
                s.enqueue(queue, p)
            s.commit()

    def monitor_on(self) -> None:
        """A monitor (a process of its own, as it runs in production): the SQL
        consumers' agent, and recovery (prepared transactions too)."""
        self.monitors += 1
        self.monitor = MonitorProcess(self.both, self.home / f"monitor{self.monitors}")

    def monitor_off(self) -> None:
        if self.monitor is not None:
            assert self.monitor.stop() == 0
            self.monitor = None

    def release(self) -> None:
        """Let no client wait any more: stopped backends go on, proxies are cut."""
        for pid in self.stopped:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        for proxy in self.proxies:
            proxy.close()

    def fail_over(self) -> None:
        """kill -9 of the primary (unless dead already), no more connections
        through the proxies, promotion of the standby."""
        if self.cluster.status().running:
            kill_primary(self.cluster)
        for proxy in self.proxies:
            proxy.refuse()
        self.cluster.promote()
        assert self.cluster.status().in_recovery is False


@contextmanager
def stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Stage]:
    with pair(tmp_path / "home", capsys, "--sync") as cluster, ExitStack() as stack:
        admin = stack.enter_context(psycopg.connect(cluster.url(), autocommit=True))
        st = Stage(cluster, cluster.url(both=True), present(cluster.status().port),
                   present(present(cluster.standby_status()).port), admin, home=tmp_path)
        stack.callback(st.release)
        stack.callback(st.monitor_off)
        yield st


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped); ``-`` once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat.rsplit(")", 1)[1].split()[0]


# -- taking what is left on a queue -----------------------------------------------------------

Taker = Callable[[], list[tuple[bytes, int]]]  # a committed take: (payload, deliveries) each


def take_linked(dsn: str, queue: str) -> Taker:
    """Take ``queue``'s ready entries in a linked session's transaction."""
    def take() -> list[tuple[bytes, int]]:
        with connect(dsn) as s:
            msgs = s.dequeue_many(queue, 100)
            s.commit()
        return [(bytes(m.payload), m.deliveries) for m in msgs]

    return take


def take_sql(dsn: str, queue: str) -> Taker:
    """Take ``queue``'s entries as a SQL consumer does."""
    def take() -> list[tuple[bytes, int]]:
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT payload, deliveries FROM ringq.dequeue(%s, 100)", (queue,)
            ).fetchall()
        return [(bytes(p), int(d)) for p, d in rows]

    return take


def drained(take: Taker, dsn: str, queue: str, expected: set[bytes], what: str) -> dict[bytes, int]:
    """Take ``queue``'s entries until exactly ``expected`` came (each once,
    nothing else), then check that no row is left queued (nothing more can
    come); payload -> deliveries."""
    got: dict[bytes, int] = {}

    def all_in() -> bool:
        for payload, deliveries in take():
            assert payload not in got, f"{what}: {payload!r} delivered twice"
            assert payload in expected, (
                f"{what}: {payload!r} delivered, but it was consumed (or never enqueued)"
            )
            got[payload] = deliveries
        return set(got) == expected

    wait_for(all_in, WAIT, f"{what}: entries to be delivered again (expected {sorted(expected)})")
    with psycopg.connect(dsn) as conn:
        left = conn.execute(
            sql.SQL("SELECT seq FROM {} WHERE state = 1").format(queue_table(queue))
        ).fetchall()
    assert not left, f"{what}: rows still queued, never delivered: {left}"
    return got


def entries_of(prefix: str) -> list[bytes]:
    return [f"{prefix}-{i}".encode() for i in range(ENTRIES)]


# -- the clients -------------------------------------------------------------------------------

Outcome = type[BaseException] | None  # what a commit may end with (None: it returned)


class Client:
    """One client at an instant of its commit. :meth:`setup` makes its
    queues; :meth:`prepare` brings it to just before its commit (nothing of
    the commit sent yet); :meth:`start` makes the commit (in a thread);
    :meth:`result` waits for what it raised (None: it returned); :meth:`check`
    drains its queues on the new primary and compares."""

    name = "client"
    instants: tuple[str, ...] = INSTANTS  # the instants it takes part in

    def __init__(self, st: Stage, decider: str) -> None:
        self.st, self.decider = st, decider
        self.dsn, self.proxy = st.dsn()
        self.outcome: BaseException | None = None
        self._thread: threading.Thread | None = None

    def setup(self) -> None:
        """Make the queues and what is on them (all clients first: a prepared
        transaction would hold up the making of a queue)."""
        raise NotImplementedError

    def prepare(self) -> None:
        raise NotImplementedError

    def backend_pid(self) -> int:
        """The backend that gets the commit (asked while the primary lives)."""
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def section(self) -> Section | None:
        """The global section the client's slots are in (None: it has none)."""
        return None

    def holders(self, instant: str) -> int:
        """How many of its sessions hold slots at the fail-over, to be decided
        (prepared ones are left to resolve_prepared)."""
        return 0

    def start(self) -> None:
        def run() -> None:
            try:
                self.commit()
            except BaseException as exc:
                self.outcome = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self) -> BaseException | None:
        assert self._thread is not None
        self._thread.join(WAIT * 2)
        assert not self._thread.is_alive(), f"{self.name}: the commit never ended"
        return self.outcome

    def expected(self, instant: str) -> Outcome:
        """What the commit ends with at ``instant`` (``self.decider`` deciding first)."""
        return None if self.committed(instant) else RolledBack

    def committed(self, instant: str) -> bool:
        """Whether the transaction that the commit call ends committed (on the
        new primary): only if its COMMIT ran before the fail-over."""
        return instant == "after"

    def check(self, instant: str) -> str:
        """Compare the queues with what committed; a line for the record."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def check_outcome(client: Client, instant: str) -> None:
    """The commit ended as expected, and as the rows say: it returned only
    if it committed, raised RolledBack only if it did not, and InDoubt only
    where the rows do not tell."""
    got, want = client.outcome, client.expected(instant)
    assert (got is None) if want is None else isinstance(got, want), (
        f"{client.name}, {instant}: the commit ended with {got!r}, "
        f"expected {'a return' if want is None else want.__name__}\n"
        + ("".join(traceback.format_exception(got)) if got is not None else "")
    )
    if got is None or isinstance(got, RolledBack):
        assert (got is None) == client.committed(instant), f"{client.name}: {got!r}"
    if isinstance(got, RolledBack):
        assert isinstance(got, Retryable)
        if isinstance(client, LinkedClient):
            client.session.commit()  # usable again, to retry: a transaction of its own
    if isinstance(got, InDoubt):
        with connect(client.st.both) as s:
            assert s.in_doubt_outcome(got) is None, f"{client.name}: in doubt, but the rows tell"


class LinkedClient(Client):
    """A client with a linked session (``self.session``)."""

    session: Session

    def backend_pid(self) -> int:
        return self.session.backend_pid

    def section(self) -> Section | None:
        return self.session.section

    def holders(self, instant: str) -> int:
        return 1

    def close(self) -> None:
        self.session.close()


class LinkedEnqueue(LinkedClient):
    """A linked session committing one enqueue (its row write goes with the commit)."""

    name = "linked enqueue"

    def setup(self) -> None:
        self.queue = self.st.queue()

    def prepare(self) -> None:
        self.session = connect(self.dsn, application_name="fo-enqueue")
        self.entry = b"enq-0"
        self.session.enqueue(self.queue, self.entry)

    def commit(self) -> None:
        self.session.commit()

    def check(self, instant: str) -> str:
        drained(take_linked(self.st.both, self.queue), self.st.both, self.queue,
                {self.entry} if self.committed(instant) else set(), self.name)
        return f"{self.name}: {self.outcome!r}"


class LinkedDequeuer(LinkedClient):
    """A linked session whose transaction dequeues entries (``taken``) of a
    queue filled with ``entries_of(tag)``, whose payload cache serves them
    (``cached``) or not (they are read from their rows)."""

    tag: str
    taken: list[bytes]

    def __init__(self, st: Stage, decider: str, *, cached: bool) -> None:
        super().__init__(st, decider)
        self.cached = cached

    def setup(self) -> None:
        self.queue = self.st.queue(cache_payload=None if self.cached else 0)
        self.entries = entries_of(self.tag)
        self.st.enqueue(self.queue, self.entries)

    def expected(self, instant: str) -> Outcome:
        if self.committed(instant) and self.decider == "recovery":
            return InDoubt  # a consumed row: its commit, or a redelivery's?
        return super().expected(instant)

    def check(self, instant: str) -> str:
        return dequeue_check(self, self.queue, self.entries, self.taken, instant)


class LinkedDequeue(LinkedDequeuer):
    """A linked session committing the dequeue of two entries: served from
    the payload cache (``cached``: the consuming writes go with the commit),
    or read from their rows (the transaction is open on the server)."""

    tag = "deq"

    def __init__(self, st: Stage, decider: str, *, cached: bool) -> None:
        super().__init__(st, decider, cached=cached)
        self.name = f"linked dequeue ({'cached' if cached else 'read from the rows'})"

    def prepare(self) -> None:
        self.session = connect(self.dsn, application_name="fo-dequeue")
        self.taken = [bytes(m.payload) for m in self.session.dequeue_many(self.queue, 2)]
        assert self.taken == self.entries[:2]
        idle = self.session.connection.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert idle == self.cached, f"{self.name}: {'not ' if idle else ''}served from the cache"

    def commit(self) -> None:
        self.session.commit()


def dequeue_check(
    client: Client, queue: str, entries: list[bytes], taken: list[bytes], instant: str,
    *, sql_consumer: bool = False,
) -> str:
    """Every entry of ``queue`` not consumed (``taken`` is, if the commit
    committed: ``after``) comes again, once; a line for the record."""
    both = client.st.both
    take = take_sql(both, queue) if sql_consumer else take_linked(both, queue)
    consumed = set(taken) if client.committed(instant) else set()
    got = drained(take, both, queue, set(entries) - consumed, client.name)
    again = {p.decode(): d for p, d in got.items() if p in taken}
    for d in again.values():
        # Recovery counts the delivery that did not commit, as does the
        # monitor for a SQL consumer; the session deciding its own lost
        # delivery does not (README: "Not yet").
        assert d == (2 if sql_consumer or client.decider == "recovery" else 1), (client.name, again)
    return f"{client.name}: {client.outcome!r}; delivered again (deliveries): {again}"


class TwoPhase(LinkedClient):
    """A two-phase participant at COMMIT PREPARED: its transaction dequeued
    an entry of one queue and enqueued one on another, was prepared, and the
    coordinator's decision to commit was recorded (``tpc_decide``)."""

    name = "two-phase participant (COMMIT PREPARED)"

    def setup(self) -> None:
        self.source, self.target = self.st.queue(), self.st.queue()
        self.entries = entries_of("tpc")
        self.st.enqueue(self.source, self.entries)

    def prepare(self) -> None:
        self.session = connect(self.dsn, application_name="fo-2pc")
        self.session.tpc_begin(self.session.xid("fo-" + uuid.uuid4().hex))
        self.taken = [bytes(present(self.session.dequeue(self.source)).payload)]
        self.made = b"tpc-made"
        self.session.enqueue(self.target, self.made)
        self.session.tpc_prepare()
        self.session.tpc_decide()

    def commit(self) -> None:
        self.session.tpc_commit()

    def holders(self, instant: str) -> int:
        return 1 if instant == "after" else 0  # else still prepared

    def expected(self, instant: str) -> Outcome:
        # Before or during, it is still prepared on the new primary: nothing
        # tells its outcome until recovery commits it, as decided.
        return None if instant == "after" else InDoubt

    def check(self, instant: str) -> str:
        both = self.st.both
        wait_for(lambda: not prepared_gids(both), WAIT, f"{self.name}: recovery to commit it")
        drained(take_linked(both, self.source), both, self.source,
                set(self.entries) - set(self.taken), self.name)
        drained(take_linked(both, self.target), both, self.target, {self.made}, self.name)
        return f"{self.name}: {self.outcome!r}"


class OnePhase(LinkedDequeuer):
    """A two-phase transaction committed in one phase (``tpc_commit``
    without ``tpc_prepare``): the dequeue of an entry read from its row; or
    (``cached``) served from the payload cache, its consuming write sent by
    ``tpc_commit`` before the COMMIT, in a round trip of its own (so only
    ``before``: the other instants are the COMMIT's). Its outcome is a
    plain commit's dequeue's."""

    tag = "one"

    def __init__(self, st: Stage, decider: str, *, cached: bool) -> None:
        super().__init__(st, decider, cached=cached)
        self.name = f"one-phase tpc_commit ({'cached' if cached else 'read from the row'})"
        self.instants = ("before",) if cached else INSTANTS

    def prepare(self) -> None:
        self.session = connect(self.dsn, application_name="fo-1pc")
        self.session.tpc_begin(self.session.xid("fo-" + uuid.uuid4().hex))
        self.taken = [bytes(present(self.session.dequeue(self.queue)).payload)]

    def commit(self) -> None:
        self.session.tpc_commit()


class SqlConsumer(Client):
    """A SQL consumer (plain psycopg): ``ringq.dequeue`` and the record of
    what it took in a table of its own, in one transaction, then COMMIT. It
    never learns the outcome (its connection is lost each time); the table
    on the new primary tells it."""

    name = "SQL consumer"

    def setup(self) -> None:
        self.queue = self.st.queue()
        self.entries = entries_of("sql")
        self.st.enqueue(self.queue, self.entries)
        self.table = sql.Identifier(f"taken_{self.queue}")
        with psycopg.connect(self.st.both, autocommit=True) as c:
            c.execute(sql.SQL("CREATE TABLE {} (payload bytea)").format(self.table))

    def prepare(self) -> None:
        self.conn = psycopg.connect(self.dsn, application_name="fo-sql")

        def take() -> list[bytes] | None:
            rows = self.conn.execute(
                "SELECT payload FROM ringq.dequeue(%s, 2)", (self.queue,)
            ).fetchall()
            if not rows:
                self.conn.commit()  # the first call asks the monitor to set entries aside
                return None
            return [bytes(r[0]) for r in rows]

        self.taken: list[bytes] = wait_for(take, WAIT, f"{self.name}: entries set aside")
        for p in self.taken:
            self.conn.execute(sql.SQL("INSERT INTO {} VALUES (%s)").format(self.table), (p,))

    def backend_pid(self) -> int:
        return self.conn.info.backend_pid

    def commit(self) -> None:
        self.conn.commit()

    def expected(self, instant: str) -> Outcome:
        return psycopg.OperationalError  # the answer never comes, whatever happened

    def check(self, instant: str) -> str:
        with psycopg.connect(self.st.both) as c:
            rows = c.execute(sql.SQL("SELECT payload FROM {}").format(self.table)).fetchall()
        recorded = {bytes(r[0]) for r in rows}
        assert recorded == (set(self.taken) if self.committed(instant) else set()), (
            f"{self.name}, {instant}: the new primary has {recorded} taken"
        )
        return dequeue_check(self, self.queue, self.entries, self.taken, instant,
                             sql_consumer=True)

    def close(self) -> None:
        self.conn.close()


class PausingMover(Mover):
    """A mover that calls ``pause`` once, right before its destination
    commit (after the batch's enqueues)."""

    def __init__(self, *args: Any, pause: Callable[[], None] | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pause = pause
        self._enqueued = 0

    def _enqueue(
        self, dst: Session, body: bytes, key: str, group: str | None, due: datetime | None
    ) -> int:
        seq = super()._enqueue(dst, body, key, group, due)
        self._enqueued += 1
        if self._enqueued == ENTRIES and self._pause is not None:
            self._pause()
        return seq


class MoverAt(Client):
    """A mover (``ringq.move.Mover``, one batch of every entry of its source)
    stopped at its destination commit or at its source commit (``side``),
    whose commit then is the rest of that ``move_batch``. The other side
    goes through a proxy of its own."""

    def __init__(self, st: Stage, decider: str, *, side: str) -> None:
        super().__init__(st, decider)  # the proxy of the side whose commit is cut off
        self.side = side
        self.name = f"mover at its {side} commit"
        self.other_dsn, _ = st.dsn()
        self.appname = f"fo-mover-{side}"
        self.paused, self.go = threading.Event(), threading.Event()
        self.dst_committed = False  # the destination committed the batch

    def _pause(self) -> None:
        self.paused.set()
        assert self.go.wait(WAIT * 2)

    def _between_commits(self, msgs: Any) -> None:
        self.dst_committed = True
        if self.side == "source" and not self.go.is_set():
            self._pause()

    def setup(self) -> None:
        self.src, self.dst = self.st.queue(max_payload=64), self.st.queue(max_payload=512)
        self.entries = entries_of("mv")
        self.st.enqueue(self.src, self.entries)

    def prepare(self) -> None:
        src_dsn, dst_dsn = (
            (self.other_dsn, self.dsn) if self.side == "destination" else (self.dsn, self.other_dsn)
        )
        self.mover = PausingMover(
            src_dsn, self.src, dst_dsn, self.dst,
            config=MoveConfig(batch=ENTRIES, lock_check=0, wait=0),
            between_commits=self._between_commits,
            pause=self._pause if self.side == "destination" else None,
            application_name=self.appname,
        )
        super().start()  # the batch, up to the pause
        assert self.paused.wait(WAIT), f"{self.name}: never reached its commit ({self.outcome!r})"

    def commit(self) -> None:
        self.mover.move_batch()

    def backend_pid(self) -> int:
        rows = self.st.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
            "AND client_port = ANY(%s)", (self.appname, list(self.proxy.pipes)),
        ).fetchall()
        assert len(rows) == 1, rows
        return int(rows[0][0])

    def start(self) -> None:
        self.go.set()

    def holders(self, instant: str) -> int:
        # its source session (the batch's dequeues) and, until it commits,
        # its destination session (the batch's enqueues)
        return 2 if self.side == "destination" else 1

    def committed(self, instant: str) -> bool:
        # At its destination commit, the source commit that follows finds its
        # connection dead too: the batch ends rolled back there, whatever
        # the destination did.
        return self.side == "source" and super().committed(instant)

    def expected(self, instant: str) -> Outcome:
        if self.committed(instant) and self.decider == "recovery":
            return InDoubt  # its source commit: a dequeue's, as a plain session's
        return super().expected(instant)

    def check(self, instant: str) -> str:
        # by the batch cut off (moving the rest sets it too)
        dst_committed = self.dst_committed
        assert dst_committed == (instant == "after" or self.side == "source"), (
            f"{self.name}, {instant}: the destination {'' if dst_committed else 'not '}committed"
        )
        src, dst, both = self.src, self.dst, self.st.both

        def moved_all() -> bool:
            try:
                self.mover.move_batch()
            except RingqError:  # a session idle through the fail-over: again, as run() does
                return False
            with psycopg.connect(both) as c:
                return not c.execute(
                    sql.SQL("SELECT 1 FROM {} WHERE state = 1").format(queue_table(src))
                ).fetchone()

        wait_for(moved_all, WAIT, f"{self.name}: the rest to be moved")

        def take() -> list[tuple[bytes, int]]:
            return [(unwrap(p).payload, d) for p, d in take_linked(both, dst)()]

        drained(take, both, dst, set(self.entries), self.name)
        # Entries the destination had committed come again from the source:
        # counted as duplicates if they come back as redelivered (their keys
        # are looked up), else their keyed enqueue is a no-op.
        dup = self.mover.get_stats()["duplicates"]
        return f"{self.name}: {self.outcome!r}; duplicates skipped {dup}"

    def close(self) -> None:
        self.go.set()
        self.mover.close()


CLIENTS: list[Callable[[Stage, str], Client]] = [
    LinkedEnqueue,
    lambda st, decider: LinkedDequeue(st, decider, cached=True),
    lambda st, decider: LinkedDequeue(st, decider, cached=False),
    TwoPhase,
    lambda st, decider: OnePhase(st, decider, cached=False),
    lambda st, decider: OnePhase(st, decider, cached=True),
    SqlConsumer,
    lambda st, decider: MoverAt(st, decider, side="destination"),
    lambda st, decider: MoverAt(st, decider, side="source"),
]


# -- the fail-over at an instant ---------------------------------------------------------------


def recovery_decides(st: Stage, clients: list[Client], instant: str) -> None:
    """What the monitor's ``backends`` step does, now: decide from the new
    primary's rows the slots of the live ``clients`` whose backend is gone
    (in their section: the one of the history before the fail-over)."""
    sections = {id(s): s for c in clients if (s := c.section()) is not None}
    with psycopg.connect(st.both, autocommit=True) as conn:
        decided = [r for sec in sections.values() for r in recover_lost_backends(sec, conn)]
    holders = sum(c.holders(instant) for c in clients)
    assert len(decided) == holders, f"recovery decided {decided}, not {holders} clients"


def stop(st: Stage, pid: int) -> None:
    """SIGSTOP the backend ``pid``, and wait until it is stopped."""
    os.kill(pid, signal.SIGSTOP)
    st.stopped.append(pid)
    wait_for(lambda: process_state(pid) == "T", WAIT, f"backend {pid} to stop")


def fail_over(st: Stage, clients: list[Client], instant: str) -> None:
    """Each client at ``instant`` of its commit; the primary killed and the
    standby promoted; then the clients whose session decides first learn
    what became of their commit; then recovery decides the others' slots,
    and they learn."""
    pids = {c: c.backend_pid() for c in clients}
    pipes = {c: c.proxy.pipe_of(st.admin, pids[c]) for c in clients}
    st.monitor_off()  # no other recovery than the test's (the next monitor runs after)
    # A commit of its own: the synchronous standby then has every WAL record
    # written so far, those of transactions still open too (a SQL consumer's
    # take: on the new primary, its row shows a take that rolled back).
    st.admin.execute("SELECT txid_current()")
    if instant == "before":
        kill_primary(st.cluster)
        for c in clients:
            assert pipes[c].server_gone.wait(WAIT), f"{c.name}: its backend outlived the primary"
    elif instant == "during":
        for c in clients:
            pipes[c].hold("requests")
            c.start()
            assert pipes[c].request_held.wait(WAIT), f"{c.name}: no commit sent"
            stop(st, pids[c])
            pipes[c].release()  # the COMMIT waits, unread, at the stopped backend
    else:
        for c in clients:
            pipes[c].hold("replies")
            c.start()
            assert pipes[c].reply_held.wait(WAIT), f"{c.name}: the commit was not answered"
    st.fail_over()
    for decider in DECIDERS:
        group = [c for c in clients if c.decider == decider]
        if decider == "recovery":
            recovery_decides(st, group, instant)
        for c in group:
            if instant == "before":
                c.start()
            elif instant == "during":
                os.kill(pids[c], signal.SIGCONT)
            else:
                pipes[c].sever()
        for c in group:
            c.result()
    st.monitor_on()  # the SQL consumers' agent; it commits the prepared transactions


@pytest.mark.parametrize("instant", INSTANTS)
def test_a_commit_cut_off_by_a_fail_over_ends_as_its_rows_say(
    instant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with stage(tmp_path, capsys) as st:
        clients = []
        for decider in DECIDERS:
            for make in CLIENTS:
                client = make(st, decider)
                client.name += f" [{decider} first]"
                if instant in client.instants:
                    clients.append(client)
        try:
            for c in clients:
                c.setup()
            # after the queues are made: a queue made while a monitor reads the
            # tables may meet it in a deadlock (TransactionConflict: retry)
            st.monitor_on()
            for c in clients:
                c.prepare()
            fail_over(st, clients, instant)
            failures, lines = [], []
            for c in clients:
                try:
                    check_outcome(c, instant)
                    lines.append(c.check(instant))
                except AssertionError as exc:
                    failures.append(str(exc))
            print(f"\n{instant}:\n  " + "\n  ".join(lines))
            assert not failures, "\n".join(failures)
        finally:
            st.release()  # a client still waiting learns its connection is gone
            for c in clients:
                with suppress(Exception):
                    c.result()
                with suppress(Exception):
                    c.close()
