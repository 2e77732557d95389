"""SQL consumers through a fail-over: a plain psycopg consumer on the pair's
multi-host DSN and the monitor (their agent) in a process of its own; the
primary is killed -9 mid-traffic and the standby promoted. Synchronous: every
entry is taken exactly once, and in order (a `single` queue, one consumer)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import MonitorProcess, cli, wait_for
from ringq.engine import connect
from test_failover import kill_primary, pair_with_queue

ENTRIES = 300


@dataclass
class Client:
    """A plain psycopg client in a thread: :meth:`step` again and again,
    reconnecting after an error (the primary died), until told to stop."""

    dsn: str
    queue: str
    stop: threading.Event = field(default_factory=threading.Event)
    errors: int = 0
    last_error: str = ""
    thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self.stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                self.step(conn)
            except Exception as exc:  # the primary died (psycopg), or anything else: again
                self.errors += 1
                self.last_error = repr(exc)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()

    def step(self, conn: psycopg.Connection[Any]) -> None:
        raise NotImplementedError


class SqlConsumer(Client):
    """Takes up to 5 entries per transaction with ringq.dequeue and records
    their numbers in ``taken`` in the same transaction, so the table says what
    was consumed whatever became of a commit whose answer was lost."""

    def step(self, conn: psycopg.Connection[Any]) -> None:
        rows = conn.execute("SELECT payload FROM ringq.dequeue(%s, 5)", (self.queue,)).fetchall()
        for (payload,) in rows:
            conn.execute("INSERT INTO taken (n) VALUES (%s)", (int(payload),))
        conn.commit()
        if not rows:
            time.sleep(0.01)


def taken(dsn: str) -> list[int]:
    """The numbers taken, in the order their transactions inserted them."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return [int(r[0]) for r in c.execute("SELECT n FROM taken ORDER BY id")]


def test_sql_consumer_through_a_sync_failover_takes_every_entry_once_in_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair_with_queue(tmp_path / "home", capsys, "--sync") as (cluster, both, queue):
        with connect(both) as s:
            for n in range(ENTRIES):
                s.enqueue(queue, str(n).encode())
                if n % 50 == 49:
                    s.commit()
            s.commit()
        with psycopg.connect(both, autocommit=True) as c:
            c.execute("CREATE TABLE taken (id bigint GENERATED ALWAYS AS IDENTITY, n int)")
        monitor = MonitorProcess(both, tmp_path / "monitor")
        consumer = SqlConsumer(both, queue)
        try:
            consumer.start()
            wait_for(lambda: len(taken(both)) >= 60, 30, "the SQL consumer to take 60")
            kill_primary(cluster)
            code, _out, err = cli(capsys, "db", "promote", "--home", str(cluster.home))
            assert code == 0, err
            wait_for(lambda: len(taken(both)) >= ENTRIES, 90,
                     "the SQL consumer to take every entry after the promotion")
            time.sleep(0.5)  # nothing more comes (a duplicate would show here)
        finally:
            consumer.stop.set()
            if consumer.thread is not None:
                consumer.thread.join(30)
            monitor.stop()
        got = taken(both)
        assert sorted(got) == list(range(ENTRIES)), "an entry lost or taken twice"
        assert got == list(range(ENTRIES)), "the single queue's order did not hold"
        assert consumer.errors >= 1  # the fail-over did reach the consumer


def rows_of(dsn: str, queue: str, numbers: list[int]) -> str:
    """What the rows say of entries ``numbers`` (payloads), the slots still
    listed and the inbox, for a failure's message."""
    if not numbers:
        return ""
    with psycopg.connect(dsn, autocommit=True) as c:
        rows = c.execute(
            f"SELECT slot, seq, state, payload, producer_seq, deliveries, enq_at, deq_at "
            f"FROM ringq.q_{queue} WHERE payload = ANY(%s) ORDER BY seq",
            ([str(n).encode() for n in numbers[:40]],)).fetchall()
        listed = c.execute("SELECT seq, slot, n FROM ringq.slots ORDER BY seq").fetchall()
        inbox = c.execute("SELECT count(*) FROM ringq.inbox").fetchone()
        tail = c.execute(f"SELECT min(seq), max(seq) FROM ringq.q_{queue} WHERE state = 1"
                         ).fetchone()
    return (f"\nrows (slot, seq, state, n, producer_seq, deliveries): {rows}"
            f"\nlisted slots: {listed}\ninbox rows: {inbox}\nstate 1 seq range: {tail}")


class SqlProducer(Client):
    """Puts batches of 10 numbers with ringq.enqueue_many and records them in
    ``sent`` in the same transaction (what committed, whatever became of a
    commit whose answer was lost); after an error it goes on with the next.
    It stops before number ``limit`` (the queue, 1,024 slots, has no consumer
    until the end: a full queue would refuse the puts the test waits for)."""

    next_n: int = 0
    limit: int = 400

    def step(self, conn: psycopg.Connection[Any]) -> None:
        if self.next_n >= self.limit:
            time.sleep(0.01)
            return
        batch = list(range(self.next_n, self.next_n + 10))
        self.next_n += 10
        conn.execute("SELECT ringq.enqueue_many(%s, %s)",
                     (self.queue, [str(i).encode() for i in batch]))
        conn.execute("INSERT INTO sent SELECT unnest(%s::int[])", (batch,))
        conn.commit()
        time.sleep(0.005)


@pytest.mark.parametrize("reserve", [False, True], ids=["inbox", "reserved-slots"])
def test_sql_producer_through_a_sync_failover_loses_and_doubles_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reserve: bool
) -> None:
    # The monitor's default (slots reserved for SQL producers: puts into them
    # are under way when the primary dies), and every SQL entry through the
    # inbox (--no-sql-reserve-slots).
    with pair_with_queue(tmp_path / "home", capsys, "--sync") as (cluster, both, queue):
        with psycopg.connect(both, autocommit=True) as c:
            c.execute("CREATE TABLE sent (n int)")
        monitor = MonitorProcess(both, tmp_path / "monitor",
                                 *([] if reserve else ["--no-sql-reserve-slots"]))
        producer = SqlProducer(both, queue)

        def sent() -> list[int]:
            with psycopg.connect(both, autocommit=True) as c:
                return [int(r[0]) for r in c.execute("SELECT n FROM sent")]

        def ready() -> bool:
            if len(sent()) < 100:
                return False
            if not reserve:
                return True
            with psycopg.connect(both, autocommit=True) as c:
                return c.execute("SELECT count(*) FROM ringq.slots").fetchone() != (0,)

        try:
            producer.start()
            wait_for(ready, 30, "100 entries enqueued (and slots reserved)")
            kill_primary(cluster)
            code, _out, err = cli(capsys, "db", "promote", "--home", str(cluster.home))
            assert code == 0, err
            before = len(sent())
            producer.limit = producer.next_n + 200
            wait_for(lambda: len(sent()) >= before + 100, 90,
                     f"puts after the promotion (the producer's last error: "
                     f"{producer.last_error})")
            producer.stop.set()
            if producer.thread is not None:
                producer.thread.join(30)
            got: list[int] = []
            with connect(both) as s:
                while (m := s.dequeue(queue, wait=3.0)) is not None:
                    got.append(int(m.payload))
                    s.commit()
        except BaseException:
            print("the monitor's log:\n" + monitor.log()[-6000:])
            raise
        finally:
            producer.stop.set()
            if producer.thread is not None:
                producer.thread.join(30)
            monitor.stop()
        want = sent()
        lost = sorted(set(want) - set(got))
        twice = sorted(n for n in set(got) if got.count(n) > 1)
        extra = sorted(set(got) - set(want))
        late = [(a, b) for a, b in itertools.pairwise(got) if a > b]
        log = "\nthe monitor's log:\n" + monitor.log()[-6000:] + rows_of(both, queue, lost)
        assert (lost, twice, extra) == ([], [], []), "lost, delivered twice, never committed" + log
        assert not late, (f"the producer's order did not hold: {late[:5]}" + log + (rows_of(
            both, queue, list(range(late[0][1], late[0][0] + 1))) if late else ""))
        assert producer.errors >= 1  # the fail-over did reach the producer
