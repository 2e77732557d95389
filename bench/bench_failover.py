"""Fail-over benchmark (issue 15): how long a queue stops when its primary dies.

Each run makes a fresh private embedded cluster (``ringq.cluster.Cluster``,
the same server settings as ``ringq db start``) under a temporary home, with a
streaming standby (synchronous by default, ``--async``), and one shared-mode
queue. ``--producers`` processes commit one-entry enqueue transactions and
``--consumers`` processes one-entry dequeue transactions, all forked, all on
the multi-host DSN (``cluster.url(both=True)``: libpq picks whichever server
is the primary). Every client keeps, for each committed transaction, the time
it returned (``time.monotonic()``: one clock for all processes of a host), the
entry and the port of the server that committed it; it sends them to this
process at the end. A transaction that raises a ``RingqError`` counts as
failed; the client sleeps 10 ms and goes on (the engine reconnects by itself).

After ``--warmup`` seconds of traffic this process kills the primary's
postmaster with SIGKILL (T0), waits until it is gone and promotes the standby
at once (``Cluster.promote``, as fail-over tooling would), lets the traffic run
``--after`` seconds more, stops the producers, lets the consumers drain the
queue, and takes what they left. Measured per run:

- the dequeue rate before the kill (entries/s over the ``--window`` s before T0);
- T0 to the first dequeue committed on the new primary (and the same for enqueues);
- T0 to full throughput: the start of the first 1 s window, beginning at a
  dequeue on the new primary, that holds >= 90 % of the pre-kill rate;
- the failed transactions of each kind of client, and its last failure;
- every committed enqueue dequeued exactly once, and in each producer's order
  (the queue sequence numbers of its entries follow its commits). With a
  synchronous standby nothing committed may be lost; with an asynchronous one
  the entries lost (the replication gap) are counted, as are the dequeues
  committed on the old primary alone and so delivered again.

``--runs`` runs (each on its own cluster); the table shows median [min-max].
Prints the table and writes JSON to ``bench/results/failover-<UTC
timestamp>.json`` (and ``--out``). It measures; it never asserts a timing.
Every server and temporary directory is removed at the end, also after an
error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import itertools
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from typing import Any

import psycopg
from _benchlib import (
    argument_parser,
    cpu_load,
    expect,
    machine,
    sigterm_tears_down,
    write_results,
)
from ringq.cluster import Cluster
from ringq.engine import InDoubt, QueueFull, RingqError, Session, connect
from ringq.scripting import QueueSpec, create_queue, remove_section

FORK = mp.get_context("fork")
QUEUE = "bench_failover"
MAX_PAYLOAD = 64
RETRY_PAUSE = 0.01  # s a client sleeps after a failed transaction
CONNECT_TIMEOUT = 2.0  # s; the old primary refuses at once, the standby answers "read-only"
ENQUEUE_TIMEOUT = 0.5  # s a producer waits on a full queue before it looks at the stop flag
DEQUEUE_WAIT = 0.05  # s a consumer sleeps on an empty queue
RATE_WINDOW = 1.0  # s: the sliding window of "back to full throughput"
BACK_SHARE = 0.9  # of the pre-kill rate
READY_TIMEOUT = 60.0  # s for the clients to connect
GONE_TIMEOUT = 30.0  # s for the killed postmaster to be gone
END_TIMEOUT = 120.0  # s for a client to stop (consumers: to drain) and report
CONNECT_FAILURE = "connect: "  # before the error's class: a failed connect(), not a transaction


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argument_parser(
        "ringq fail-over benchmark: kill -9 of the primary, promotion of the standby, "
        "time to the first dequeue and to full throughput on the new primary."
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--sync", dest="sync", action="store_true", default=True,
        help="synchronous standby: nothing committed may be lost",
    )  # fmt: skip
    mode.add_argument(
        "--async", dest="sync", action="store_false",
        help="asynchronous standby: the replication gap is lost, and counted",
    )  # fmt: skip
    p.add_argument("--producers", type=int, default=2, help="producer processes")
    p.add_argument("--consumers", type=int, default=2, help="consumer processes")
    p.add_argument("--warmup", type=float, default=5.0, help="s of traffic before the kill")
    p.add_argument(
        "--window", type=float, default=3.0, help="s before the kill that the rate is taken over"
    )
    p.add_argument("--after", type=float, default=10.0, help="s of traffic after the promotion")
    p.add_argument("--runs", type=int, default=3, help="runs, each on a fresh cluster")
    p.add_argument("--capacity", type=int, default=20_000, help="slots of the queue")
    a = p.parse_args(argv)
    if a.dsn is not None:
        p.error("--dsn: this benchmark kills its primary, so it needs its own embedded cluster")
    if min(a.producers, a.consumers, a.runs, a.capacity) < 1:
        p.error("--producers, --consumers, --runs and --capacity must be >= 1")
    if not 0 < a.window <= a.warmup:
        p.error("--window must be > 0 and <= --warmup")
    if a.after < 2 * RATE_WINDOW:
        p.error(f"--after must be >= {2 * RATE_WINDOW:g} s")
    return a


# -- the clients (forked processes) ---------------------------------------------------------


@dataclass
class ClientLog:
    """What one client did, sent to the parent at its end. ``committed`` holds
    (monotonic time the commit returned, producer index, entry number, queue
    sequence, port of the server that committed it)."""

    kind: str  # "producer" or "consumer"
    index: int
    committed: list[tuple[float, int, int, int, int]] = field(default_factory=list)
    in_doubt: list[tuple[int, int]] = field(default_factory=list)  # (producer, number)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (time, [connect: ]error)
    idle: int = 0  # enqueues that found the queue full / dequeues that found it empty


def _client(kind: str, index: int, dsn: str, go: Event, stop: Event, pipe: Connection) -> None:
    """A forked client: connect, say ready, wait for ``go``, work until told to
    stop, send its log (or its error) to the parent. The parent alone handles
    Ctrl-C and SIGTERM: it ends its clients with SIGTERM, which kills."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        log = ClientLog(kind, index)
        session = _connect(dsn, log)
        pipe.send(("ready", None))
        go.wait()
        try:
            work = _produce if kind == "producer" else _consume
            session = work(session, dsn, stop, log)
        finally:
            with contextlib.suppress(RingqError):
                session.close()
        pipe.send(("done", log))
    except BaseException as exc:  # report to the parent instead of leaving it waiting
        with contextlib.suppress(OSError):
            pipe.send(("error", repr(exc)))
        raise


def _connect(dsn: str, log: ClientLog) -> Session:
    """A session on the primary, retried until one opens (each failure logged)."""
    while True:
        try:
            return connect(dsn, connect_timeout=CONNECT_TIMEOUT)
        except RingqError as exc:
            log.failures.append((time.monotonic(), CONNECT_FAILURE + type(exc).__name__))
            time.sleep(RETRY_PAUSE)


def _failed(session: Session, dsn: str, log: ClientLog, exc: RingqError) -> Session:
    """Log a failed transaction, roll back what is left of it, pause, and
    return a session to go on with (a new one if the error closed it)."""
    log.failures.append((time.monotonic(), type(exc).__name__))
    if not session.closed:
        with contextlib.suppress(RingqError):
            session.rollback()
    time.sleep(RETRY_PAUSE)
    return session if not session.closed else _connect(dsn, log)


def _produce(session: Session, dsn: str, stop: Event, log: ClientLog) -> Session:
    """One-entry enqueue transactions until ``stop``; each attempt has its own
    number, so an entry in doubt is never sent twice."""
    n = 0
    while not stop.is_set():
        n += 1
        try:
            seq = session.enqueue(QUEUE, b"%d:%d" % (log.index, n), timeout=ENQUEUE_TIMEOUT)
            session.commit()
        except QueueFull:
            log.idle += 1
        except InDoubt as exc:
            log.in_doubt.append((log.index, n))
            session = _failed(session, dsn, log, exc)
        except RingqError as exc:
            session = _failed(session, dsn, log, exc)
        else:
            port = session.connection.info.port
            log.committed.append((time.monotonic(), log.index, n, seq, port))
    return session


def _consume(session: Session, dsn: str, producers_done: Event, log: ClientLog) -> Session:
    """One-entry dequeue transactions until the producers are done and the queue is empty."""
    while True:
        msg = None
        try:
            msg = session.dequeue(QUEUE, wait=DEQUEUE_WAIT)
            if msg is None:  # nothing was sent: no transaction is open
                log.idle += 1
                if producers_done.is_set():
                    return session
                continue
            session.commit()
        except InDoubt as exc:
            if msg is not None:
                log.in_doubt.append(entry_of(msg.payload))
            session = _failed(session, dsn, log, exc)
        except RingqError as exc:
            session = _failed(session, dsn, log, exc)
        else:
            port = session.connection.info.port
            log.committed.append((time.monotonic(), *entry_of(msg.payload), msg.seq, port))


def entry_of(payload: bytes) -> tuple[int, int]:
    """(producer index, entry number) of a payload ``b"<producer>:<number>"``."""
    producer, n = payload.split(b":")
    return int(producer), int(n)


# -- one run ----------------------------------------------------------------------------------


@dataclass
class Timeline:
    """The parent's times (monotonic) and the two servers' ports."""

    old_port: int
    new_port: int
    go: float = 0.0
    killed: float = 0.0  # T0: just before the SIGKILL
    gone: float = 0.0  # the postmaster was seen dead
    promoted: float = 0.0  # Cluster.promote() returned
    stopped: float = 0.0  # the producers were told to stop


def one_run(args: argparse.Namespace, number: int) -> dict[str, Any]:
    """A fresh cluster with a standby, traffic, kill -9, promotion, drain; the run's figures.
    Every server and the home are removed, whatever happens."""
    home = tempfile.mkdtemp(prefix="ringq-bench-failover-")
    cluster = Cluster(home)
    killed = promoted = False
    try:
        say(f"run {number}: starting a primary and its {mode_name(args)} standby under {home} ...")
        primary = cluster.start()
        cluster.start_standby(sync=args.sync)
        both = cluster.url(both=True)
        with psycopg.connect(primary) as conn:
            create_queue(conn, QueueSpec(QUEUE, args.capacity, MAX_PAYLOAD, dequeue_mode="shared"))
        standby = cluster.standby_status()
        assert standby is not None and standby.port is not None
        old_port = cluster.status().port
        assert old_port is not None
        tl = Timeline(old_port=old_port, new_port=standby.port)
        with clients(args, both) as (go, stop, producers_done, procs):
            say(f"run {number}: traffic for {args.warmup:g} s, then kill -9 of the primary")
            tl.go = time.monotonic()
            go.set()
            time.sleep(args.warmup)
            pid = cluster.status().pid
            assert pid is not None
            tl.killed = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            killed = True
            wait_until(lambda: not cluster.status().running, GONE_TIMEOUT, "the killed postmaster")
            tl.gone = time.monotonic()
            cluster.promote()
            tl.promoted = time.monotonic()
            promoted = True
            say(
                f"run {number}: promoted {1000 * (tl.promoted - tl.killed):,.0f} ms after the "
                f"kill; traffic for {args.after:g} s more, then the drain"
            )
            time.sleep(args.after)
            tl.stopped = time.monotonic()
            stop.set()
            logs = [collect(proc, pipe) for kind, proc, pipe in procs if kind == "producer"]
            producers_done.set()
            logs += [collect(proc, pipe) for kind, proc, pipe in procs if kind == "consumer"]
        left = drain(both, tl.new_port)
        return analyse(args, tl, logs, left)
    finally:
        tear_down(cluster, home, killed=killed, promoted=promoted)


@contextlib.contextmanager
def clients(
    args: argparse.Namespace, dsn: str
) -> Iterator[tuple[Event, Event, Event, list[tuple[str, Any, Connection]]]]:
    """Fork the producers and consumers, wait until each has connected; yield
    (go, stop, producers done, [(kind, process, pipe)]). Every process is
    ended on the way out."""
    go, stop, producers_done = FORK.Event(), FORK.Event(), FORK.Event()
    procs: list[tuple[str, Any, Connection]] = []
    try:
        for kind, count in (("producer", args.producers), ("consumer", args.consumers)):
            for index in range(count):
                parent, child = FORK.Pipe()
                flag = stop if kind == "producer" else producers_done
                proc = FORK.Process(
                    target=_client, args=(kind, index, dsn, go, flag, child), daemon=True
                )
                proc.start()
                child.close()
                procs.append((kind, proc, parent))
        for _kind, _proc, pipe in procs:
            expect(pipe, "ready", READY_TIMEOUT, "a client")
        yield go, stop, producers_done, procs
    finally:
        for _kind, proc, _pipe in procs:
            if proc.is_alive():
                proc.terminate()
        for _kind, proc, _pipe in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()


def collect(proc: Any, pipe: Connection) -> ClientLog:
    log: ClientLog = expect(pipe, "done", END_TIMEOUT, "a client")
    proc.join(10)
    return log




def drain(dsn: str, port: int) -> list[tuple[float, int, int, int, int]]:
    """Take what the consumers left on the queue (nothing, normally), as consumer records."""
    left: list[tuple[float, int, int, int, int]] = []
    failures = 0
    with connect(dsn, connect_timeout=CONNECT_TIMEOUT) as session:
        while True:
            try:
                got = session.dequeue_many(QUEUE, 1000)
                session.commit()
            except RingqError:
                failures += 1
                if failures > 3:
                    raise
                time.sleep(RETRY_PAUSE)
                continue
            if not got:
                return left
            now = time.monotonic()
            left += [(now, *entry_of(m.payload), m.seq, port) for m in got]


def tear_down(cluster: Cluster, home: str, *, killed: bool, promoted: bool) -> None:
    """Stop every server and remove the home, best effort at each step: the
    section and semaphores (shared memory outlives the servers), the killed
    old primary (recovered and removed with the standby's data directory, which
    frees the shared memory it left), the new primary."""
    try:
        with contextlib.suppress(Exception):
            if killed and not promoted:
                cluster.promote()
        with (
            contextlib.suppress(Exception),
            psycopg.connect(cluster.url(both=True), connect_timeout=5) as conn,
        ):
            remove_section(conn)
        with contextlib.suppress(Exception):
            standby = cluster.standby_status()
            if standby is not None and standby.state == "rebuild":
                cluster.remove_standby()
        cluster.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


# -- the figures ------------------------------------------------------------------------------


def analyse(
    args: argparse.Namespace,
    tl: Timeline,
    logs: list[ClientLog],
    left: list[tuple[float, int, int, int, int]],
) -> dict[str, Any]:
    """One run's figures from the clients' logs (times relative to T0, in seconds)."""
    producers = [log for log in logs if log.kind == "producer"]
    consumers = [log for log in logs if log.kind == "consumer"]
    enqueues = sorted(r for log in producers for r in log.committed)
    dequeues = sorted(r for log in consumers for r in log.committed)
    t0 = tl.killed
    times = [r[0] for r in dequeues]
    before = bisect.bisect_left(times, t0) - bisect.bisect_left(times, t0 - args.window)
    rate = before / args.window

    def first_on_new(records: list[tuple[float, int, int, int, int]]) -> float | None:
        return next((r[0] - t0 for r in records if r[0] >= t0 and r[4] == tl.new_port), None)

    back = None
    for t, *_rest, port in dequeues:
        if t < t0 or port != tl.new_port:
            continue
        if t + RATE_WINDOW > tl.stopped:
            break
        in_window = bisect.bisect_left(times, t + RATE_WINDOW) - bisect.bisect_left(times, t)
        if in_window >= BACK_SHARE * rate * RATE_WINDOW:
            back = t - t0
            break

    per_kind: dict[str, Any] = {}
    for kind, group in (("producer", producers), ("consumer", consumers)):
        fails = [f for log in group for f in log.failures]
        connects = sum(1 for _t, name in fails if name.startswith(CONNECT_FAILURE))
        per_kind[kind] = {
            "failed": len(fails) - connects,
            "failed_connects": connects,
            "failed_by_error": dict(Counter(name for _t, name in fails)),
            "last_failure_s": max((t - t0 for t, _name in fails), default=None),
            "in_doubt": sum(len(log.in_doubt) for log in group),
            "idle": sum(log.idle for log in group),
            "committed": sum(len(log.committed) for log in group),
        }
    return {
        "run": {
            "old_port": tl.old_port,
            "new_port": tl.new_port,
            "warmup_s": t0 - tl.go,
            "after_s": tl.stopped - tl.promoted,
        },
        "rate_before_per_s": rate,
        "gone_s": tl.gone - t0,
        "promote_s": tl.promoted - tl.gone,
        "promoted_s": tl.promoted - t0,
        "first_dequeue_s": first_on_new(dequeues),
        "first_enqueue_s": first_on_new(enqueues),
        "back_to_rate_s": back,
        "rate_after_per_s": rate_between(times, tl.stopped - args.window, tl.stopped),
        "old_primary_dequeues_after_kill": sum(
            1 for r in dequeues if r[0] >= t0 and r[4] == tl.old_port
        ),
        "old_primary_enqueues_after_kill": sum(
            1 for r in enqueues if r[0] >= t0 and r[4] == tl.old_port
        ),
        "clients": per_kind,
        "check": check(tl, producers, consumers, dequeues + left),
        "drained": len(left),
    }


def rate_between(times: list[float], start: float, end: float) -> float:
    """Dequeues per second in [start, end) of the sorted ``times``."""
    return (bisect.bisect_left(times, end) - bisect.bisect_left(times, start)) / (end - start)


def check(
    tl: Timeline,
    producers: list[ClientLog],
    consumers: list[ClientLog],
    deliveries: list[tuple[float, int, int, int, int]],
) -> dict[str, int]:
    """Every committed enqueue dequeued exactly once, in each producer's order.

    - ``lost``: committed, never dequeued (and no dequeue of it in doubt);
      ``lost_outside_gap``: of those, entries a producer committed on the old
      primary before one of its entries that survived (a replication gap is
      the tail of what each producer committed there), or on the new primary;
    - ``duplicates``: deliveries beyond the first; ``redelivered_after_gap``:
      of those, an entry dequeued on the old primary after the kill, then again
      on the new one (its dequeue was in the gap); ``duplicates_on_new``: the rest;
    - ``out_of_order``: entries of a producer, by queue sequence, whose number
      is not above the previous one's; ``phantom``: dequeued, never enqueued;
    - ``enqueue_in_doubt`` / ``dequeue_in_doubt``: commits whose outcome the
      engine could not tell (counted, not judged), ``..._delivered``: of the
      enqueues in doubt, how many were dequeued (they had committed).
    """
    committed = {(r[1], r[2]): r for log in producers for r in log.committed}
    enq_doubt = {e for log in producers for e in log.in_doubt}
    deq_doubt = {e for log in consumers for e in log.in_doubt}
    seen: dict[tuple[int, int], list[tuple[float, int, int, int, int]]] = defaultdict(list)
    for r in sorted(deliveries):
        seen[(r[1], r[2])].append(r)
    lost = set(committed) - set(seen) - deq_doubt
    survivors: dict[int, int] = defaultdict(int)  # producer -> last number committed on the old
    for (p, n), r in committed.items():
        if (p, n) in seen and r[4] == tl.old_port:
            survivors[p] = max(survivors[p], n)
    outside_gap = sum(1 for p, n in lost if committed[(p, n)][4] != tl.old_port or n < survivors[p])
    duplicates = redelivered = 0
    for got in seen.values():
        duplicates += len(got) - 1
        if len(got) > 1 and got[0][4] == tl.old_port and got[0][0] >= tl.killed:
            redelivered += len(got) - 1 if all(r[4] == tl.new_port for r in got[1:]) else 0
    out_of_order = 0
    by_producer: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for (p, n), got in seen.items():
        by_producer[p].append((got[0][3], n))
    for entries in by_producer.values():
        entries.sort()
        out_of_order += sum(1 for a, b in itertools.pairwise(entries) if b[1] <= a[1])
    return {
        "committed": len(committed),
        "delivered": len(seen),
        "lost": len(lost),
        "lost_outside_gap": outside_gap,
        "duplicates": duplicates,
        "redelivered_after_gap": redelivered,
        "duplicates_on_new": duplicates - redelivered,
        "out_of_order": out_of_order,
        "phantom": len(set(seen) - set(committed) - enq_doubt),
        "enqueue_in_doubt": len(enq_doubt),
        "enqueue_in_doubt_delivered": len(enq_doubt & set(seen)),
        "dequeue_in_doubt": len(deq_doubt),
    }


# -- the table --------------------------------------------------------------------------------

ROWS: tuple[tuple[str, Callable[[dict[str, Any]], float | None], str], ...] = (
    ("dequeue rate before the kill (entries/s)", lambda r: r["rate_before_per_s"], ",.0f"),
    ("kill -> postmaster gone (ms)", lambda r: ms(r["gone_s"]), ",.0f"),
    ("promote call (ms)", lambda r: ms(r["promote_s"]), ",.0f"),
    ("kill -> promoted (ms)", lambda r: ms(r["promoted_s"]), ",.0f"),
    ("kill -> first dequeue on the new primary (ms)", lambda r: ms(r["first_dequeue_s"]), ",.0f"),
    ("kill -> first enqueue on the new primary (ms)", lambda r: ms(r["first_enqueue_s"]), ",.0f"),
    ("promoted -> first dequeue on the new primary (ms)",
     lambda r: ms(since_promoted(r, "first_dequeue_s")), ",.0f"),
    ("kill -> >= 90 % of the rate, 1 s window (ms)", lambda r: ms(r["back_to_rate_s"]), ",.0f"),
    ("dequeue rate before the stop (entries/s)", lambda r: r["rate_after_per_s"], ",.0f"),
    ("failed transactions, producers", lambda r: r["clients"]["producer"]["failed"], "d"),
    ("failed transactions, consumers", lambda r: r["clients"]["consumer"]["failed"], "d"),
    ("failed connects, producers", lambda r: r["clients"]["producer"]["failed_connects"], "d"),
    ("failed connects, consumers", lambda r: r["clients"]["consumer"]["failed_connects"], "d"),
    ("kill -> last producer failure (ms)", lambda r: ms(last_failure(r, "producer")), ",.0f"),
    ("kill -> last consumer failure (ms)", lambda r: ms(last_failure(r, "consumer")), ",.0f"),
    ("dequeues committed on the old primary after the kill",
     lambda r: r["old_primary_dequeues_after_kill"], "d"),
    ("enqueues committed", lambda r: r["check"]["committed"], ",d"),
)  # fmt: skip
CHECKS = (
    "lost", "lost_outside_gap", "duplicates_on_new", "redelivered_after_gap", "out_of_order",
    "phantom", "enqueue_in_doubt", "enqueue_in_doubt_delivered", "dequeue_in_doubt",
)  # fmt: skip


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def since_promoted(run: dict[str, Any], key: str) -> float | None:
    """``run[key]`` (seconds after the kill) counted from the promotion's end instead."""
    value: float | None = run[key]
    return None if value is None else value - run["promoted_s"]


def last_failure(run: dict[str, Any], kind: str) -> float | None:
    value: float | None = run["clients"][kind]["last_failure_s"]
    return value


def cell_value(value: float | None, fmt: str) -> str:
    """``value`` in ``fmt``; a count's median may fall between two runs (x.5): rounded."""
    if value is None:
        return "-"
    return format(round(value), fmt) if fmt.endswith("d") else format(value, fmt)


def summary(values: list[float | None]) -> dict[str, float | None]:
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "missing": len(values)}
    return {
        "median": statistics.median(got),
        "min": min(got),
        "max": max(got),
        "missing": len(values) - len(got),
    }


def table(args: argparse.Namespace, runs: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        (
            f"ringq fail-over: {mode_name(args)} standby, {args.producers} producers + "
            f"{args.consumers} consumers (one-entry transactions, shared-mode queue), "
            f"kill -9 of the primary after {args.warmup:g} s, {args.after:g} s after the promotion"
        ),
        f"{len(runs)} runs, each on a fresh cluster: median [min-max]",
    ]
    for label, get, fmt in ROWS:
        s = summary([get(r) for r in runs])
        cell = (
            "-"
            if s["median"] is None
            else (
                f"{cell_value(s['median'], fmt)} "
                f"[{cell_value(s['min'], fmt)}-{cell_value(s['max'], fmt)}]"
            )
        )
        missing = f"  ({s['missing']} runs without)" if s["missing"] else ""
        lines.append(f"  {label:<54} {cell}{missing}")
    lines.append("  check, per run: " + "; ".join(
        f"{name} {'/'.join(str(r['check'][name]) for r in runs)}" for name in CHECKS
    ))  # fmt: skip
    expect_lost = "none lost" if args.sync else "loss = the replication gap"
    lines.append(f"  expected ({mode_name(args)}): {expect_lost}, no duplicate on the new "
                 "primary, none out of order, no phantom")  # fmt: skip
    lines.append(
        f"  load average   {env['loadavg_at_start'][0]:.2f} at start, "
        f"{env['loadavg_at_end'][0]:.2f} at end"
    )
    return "\n".join(lines)


# -- main -------------------------------------------------------------------------------------


def mode_name(args: argparse.Namespace) -> str:
    return "sync" if args.sync else "async"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:g} s for {what}")
        time.sleep(0.005)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sigterm_tears_down()
    started = datetime.now(UTC)
    env: dict[str, Any] = {**machine(), **cpu_load("start")}
    runs = [one_run(args, number) for number in range(1, args.runs + 1)]
    env.update(cpu_load("end"))
    doc: dict[str, Any] = {
        "benchmark": "failover",
        "started_at": started.isoformat(),
        "command": [sys.executable, *sys.argv],
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "dsn")},
        "environment": env,
        "summary": {label: summary([get(r) for r in runs]) for label, get, _fmt in ROWS},
        "runs": runs,
    }
    doc["table"] = table(args, runs, env)
    print(doc["table"])
    write_results("failover", started, doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
