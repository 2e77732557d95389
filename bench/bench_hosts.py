"""Other hosts (issue 34): the SQL path against the linked path and a visibility-timeout queue.

One database, one ``ringq monitor`` process (the SQL path's pump and agent),
one process of threads driving the issue's shape for each deployment row in
turn: a producer thread keeping about ``--ready`` (4,000) entries ready,
``--produce-batch`` (128) per transaction, and ``--consumers`` (32) consumer
threads, each on its own connection or session, that take a batch, sleep
``--work-ms`` (1 ms) per entry, record the batch's entry ids by an INSERT into a
log table in the same transaction as the take, and commit. Payloads are
``--payload`` (256) bytes and carry the time of their enqueue
(``time.monotonic_ns``, one clock for the process) and a unique id.

Rows (``--rows``, default the five below, in this order; ``--proto`` adds
the prototypes of ``_hosts_sides.py`` after them, each a candidate design
of issue 34 made of scratch SQL in the bench's database, measured in the
same run against the same baseline):

- **linked**: linked producer (``enqueue_many(128)`` + ``commit``) and linked
  consumers (``dequeue_many(8, wait=)``, the INSERT through
  ``Session.execute``, ``commit``);
- **sql**: SQL producer (``SELECT ringq.enqueue_many(q, %b::bytea[])``, one
  autocommitted statement per 128; before issue 34 it was ``SELECT
  ringq.enqueue(q, x) FROM unnest(%s::bytea[]) x``: there was no batch form)
  and SQL consumers (a default psycopg connection: ``SELECT seq, payload FROM
  ringq.dequeue(q, 64)``, the INSERT, ``COMMIT``; when it finds nothing it
  commits and waits for its wake-up (the take LISTENs on the backend's own
  channel while it waits), at most ``--wait`` s);
- **linked_sql**: linked producer, SQL consumers;
- **sql_linked**: SQL producer, linked consumers;
- **pgmq**: a visibility-timeout queue as pgmq makes it (a table ``(msg_id
  identity PRIMARY KEY, read_ct, enqueued_at, vt, message)`` with an index on
  ``vt``; ``send_batch``: ``INSERT ... SELECT unnest(%b::bytea[])``; ``read(q,
  vt, 64)``: ``UPDATE ... SET vt = clock_timestamp() + vt, read_ct = read_ct + 1
  FROM (SELECT msg_id ... WHERE vt <= clock_timestamp() ORDER BY msg_id LIMIT
  64 FOR UPDATE SKIP LOCKED)``, its own transaction; then ``DELETE ... WHERE
  msg_id = ANY(%s)``, the INSERT, ``COMMIT``), polling every ``--poll-ms``
  (10 ms) when it finds nothing; its table vacuumed before each of its rows.

Each ringq row has its own ``shared`` queue (``--capacity`` 50,000 slots, max
payload 512; a prototype's ``--proto-capacity``, warmed whole), and every
queue and the pgmq table carry ``--warm`` entries (one ring's worth) before
the rows, untimed. A row runs ``--duration`` s
(10) from a common start; ``--rounds`` repeats the rows, the order reversed
every other round, and the table shows each figure's median of the rounds
(ratios are taken within a round, then their median: the machine's other
load moves every figure). The producer keeps its own count of entries
enqueued and not yet taken at ``--ready`` (``--pace stats``: the depth a
linked session's ``stats()`` shows, as a producer on the queue host would
read it). Figures per row:

- **entries/s**: entries whose consumer's commit returned within the row;
- **claim p50 / p99**: the payload's enqueue time → the take returned (ms);
- **server CPU per entry**: the server's CPU (its postmaster, with the
  backends that exited meanwhile, and every live child, from ``/proc``) over
  the row, by the entries completed; the monitor process's own CPU per entry
  apart, and the monitor's backends (matched by the TCP ports of its
  sockets) inside the server's; the machine's busy share;
- **writes per entry**: ``pg_stat_user_tables`` rows inserted, updated and
  deleted per table, commits and WAL bytes, between the row's start and a
  reading ``--settle`` s after its drain (an idle backend's statistics reach
  the views within 10 s), by the entries enqueued (all consumed by then).
  Commits are ``pg_stat_database.xact_commit``: besides the clients' own, a
  transaction in every backend that LISTENs, at every notifying commit in
  the database whatever its channel (each reads the notification queue in a
  transaction of its own), so the fan-out of LISTEN/NOTIFY shows here;
- **statements**: with ``--statements`` (and pg_stat_statements loaded: on the
  private cluster the option loads it, ``track = all``, and restarts the
  server before the run), top-level statements per entry and the statements
  that took the most execution time, inside functions too. It costs the
  server CPU of its own: compare rows of one run;
- **depth at the end** of the row, as each side reads it: the producer's count
  (enqueued - taken), ``ringq.depth(q)`` (ring rows queued + inbox rows), a
  linked session's ``stats(q)["depth"]``, the inbox's rows and the entries set
  aside for SQL consumers (``ringq.offers``); and the medians of the linked
  ``stats`` depth and of the inbox rows sampled every ``--sample-s`` during the
  row.

After each row what is left is drained by the row's consumer kind, recorded
in the log too, and the log is checked: every entry enqueued logged exactly
once (``missing``, ``duplicates``, both 0). Prints a table and writes JSON to
``bench/results/hosts-<UTC>.json`` (and ``--out``). Runs on a private
embedded PostgreSQL unless ``--dsn``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
from _benchlib import (
    TimedRound,
    argument_parser,
    config_from_options,
    cpu_load,
    drop_queues,
    machine,
    server_settings,
    sigterm_tears_down,
    write_results,
)
from _hosts_sides import (
    BASELINE,
    DONE_CREATE,
    HEADER,
    LABELS,
    PGMQ_COUNT,
    PGMQ_CREATE,
    PGMQ_INDEX,
    PROTOTYPES,
    ROWS,
    Config,
    Names,
    PgmqConsumer,
    ProtoAgent,
    Side,
    drop_protos,
    make_payloads,
    make_protos,
    q,
)
from _serverload import Probe, Reading, cpu_between, local_ports, statements_of, writes_between
from psycopg.conninfo import make_conninfo
from ringq.engine import StaleSection, connect
from ringq.scripting import QueueSpec, create_queue

WARM_BATCH = 1000  # entries per transaction of the untimed passes (warm-up)

DONE_COUNT = "SELECT count(*), count(DISTINCT id) FROM {t} WHERE kind = %s"
DEPTHS = """
SELECT ringq.depth(%(q)s),
       (SELECT count(*) FROM ringq.inbox i WHERE i.queue_id = q.id),
       (SELECT coalesce(sum(o.n), 0) FROM ringq.offers o WHERE o.queue_id = q.id)
FROM ringq.queues q WHERE q.name = %(q)s
"""
INBOX_COUNT = (
    "SELECT count(*) FROM ringq.inbox WHERE queue_id = (SELECT id FROM ringq.queues"
    " WHERE name = %s)"
)
# The agent's connection has no application_name (the monitor's others do),
# and its first statement is its LISTEN on ringq_want.
MONITOR_AGENT = (
    "SELECT client_port FROM pg_stat_activity WHERE backend_type = 'client backend'"
    " AND application_name = '' AND query <> ''"
)
# What the monitor's backends are, by their application_name.
MONITOR_BACKENDS = {"": "agent", "ringq": "pump (its linked session)",
                    "ringq-monitor": "monitor's loop"}


# -- one row --------------------------------------------------------------------------------------


def latency_ms(diffs_ns: list[int]) -> dict[str, Any]:
    if not diffs_ns:
        return {"n": 0}
    a = np.asarray(diffs_ns, dtype=np.float64) / 1e6
    p50, p99 = np.percentile(a, [50, 99])
    return {"n": int(a.size), "p50_ms": float(p50), "p99_ms": float(p99), "max_ms": float(a.max())}


class Sampler:
    """Every ``every`` s while a row runs: a linked session's ``stats`` depth
    and the inbox's rows of the row's queue (cheap reads: shared memory, an
    index)."""

    def __init__(self, dsn: str, queue: str | None, every: float) -> None:
        self.dsn, self.queue, self.every = dsn, queue, every
        self.stats_depth: list[int] = []
        self.inbox: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        if self.queue is None or self.every <= 0:
            return
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        assert self.queue is not None
        try:
            with connect(self.dsn) as s, psycopg.connect(self.dsn, autocommit=True) as c:
                while not self._stop.wait(self.every):
                    self.stats_depth.append(int(s.stats(self.queue)["depth"]))
                    row = c.execute(INBOX_COUNT, (self.queue,)).fetchone()
                    self.inbox.append(int(row[0]) if row else 0)
        except BaseException as exc:  # reported with the row
            self.error = exc


def end_depths(side: Side, probe_conn: psycopg.Connection[Any],
               outstanding: int) -> dict[str, Any]:
    """How deep the queue is, as each side reads it."""
    out: dict[str, Any] = {"producer_view": outstanding}
    if not side.ringq:
        row = probe_conn.execute(q(PGMQ_COUNT, side.names.pgmq)).fetchone()
        out["table_rows"] = int(row[0]) if row else None
        return out
    row = probe_conn.execute(DEPTHS, {"q": side.queue}).fetchone()
    assert row is not None
    out["ringq_depth"], out["inbox"], out["set_aside"] = (int(x) for x in row)
    with connect(side.dsn) as s:
        out["linked_stats_depth"] = int(s.stats(side.queue)["depth"])
    return out


def timed_row(side: Side, probe: Probe, kind: str) -> dict[str, Any]:
    """Run the producer and the consumers for ``cfg.duration`` s from a common
    start; the row's figures (see the module's docstring). ``kind``: the
    row's key in the log."""
    cfg, row, dsn = side.cfg, side.row, side.dsn
    sample_queue = side.queue if side.ringq else None
    n = cfg.consumers
    take_n = side.take_n()
    lat: list[list[int]] = [[] for _ in range(n)]  # enqueue -> taken (ns), taken in time
    took = [0] * n
    done_in_time = [0] * n
    done_all = [0] * n
    empty_takes = [0] * n
    retries = [0] * n
    enqueued = [0]
    timed = TimedRound(n, cfg.duration)
    clock, stop, barrier = timed.clock, timed.stop, timed.barrier

    def produce() -> None:
        next_id = 0
        with side.producer() as p, contextlib.ExitStack() as more:
            # --pace stats: the depth a linked session's stats() shows (what a
            # producer on the queue host reads), not the bench's own count
            paced = (more.enter_context(connect(dsn))
                     if cfg.pace == "stats" and sample_queue is not None else None)
            barrier.wait()
            began = time.monotonic()
            while not stop.is_set():
                ready = (enqueued[0] - sum(took) if paced is None or sample_queue is None
                         else int(paced.stats(sample_queue)["depth"]))
                ahead = cfg.rate and enqueued[0] >= (time.monotonic() - began) * cfg.rate
                if ahead:  # --rate: not before its time
                    time.sleep(min(0.005, cfg.produce_batch / cfg.rate))
                elif ready < cfg.ready:
                    items, next_id = make_payloads(next_id, cfg.produce_batch, cfg.payload)
                    p.put(items)
                    enqueued[0] += len(items)
                else:
                    time.sleep(0.001)

    def consume(who: int) -> None:
        with side.consumer() as c:
            barrier.wait()
            end = clock["end"]
            mine = lat[who]
            while not stop.is_set():
                wait = min(cfg.wait, max(0.0, (end - time.monotonic_ns()) / 1e9) + 0.05)
                got = c.take(take_n, wait)
                if not got:
                    empty_takes[who] += 1
                    continue
                t = time.monotonic_ns()
                heads = [HEADER.unpack_from(p) for p in got]
                took[who] += len(got)
                if t <= end:
                    mine.extend(t - stamp for stamp, _id in heads)
                if cfg.work_ms > 0:
                    time.sleep(cfg.work_ms / 1000 * len(got))
                c.finish(kind, who, [i for _stamp, i in heads])
                done_all[who] += len(got)
                if time.monotonic_ns() <= end:
                    done_in_time[who] += len(got)
            retries[who] = c.retries

    sampler = Sampler(dsn, sample_queue, cfg.sample_s)
    agent = (ProtoAgent(side, cfg.agent_ms / 1000, reserve=side.producer_kind == "sqlr")
             if row in PROTOTYPES and side.consumer_kind == "chunk" else None)
    if agent is not None:
        agent.start()
    readings: list[Reading] = []
    depths: dict[str, Any] = {}

    def row_started() -> None:
        probe.reset_statements()
        readings.append(probe.read())
        sampler.start()

    def row_ended() -> None:
        readings.append(probe.read())
        depths.update(end_depths(side, probe.conn, enqueued[0] - sum(took)))

    timed.run([produce, *(partial(consume, w) for w in range(n))],
              join_s=cfg.statement_timeout + 30.0, unit="row", name=f"row {row}",
              started=row_started, ended=row_ended, stopped=sampler.stop)
    r0, r1 = readings
    completed = sum(done_in_time)
    return {
        "proto_agent": agent,
        "row": row,
        "log_kind": kind,
        "producer": side.producer_kind,
        "consumer": side.consumer_kind,
        "take": take_n,
        "entries_per_s": completed / cfg.duration,
        "completed": completed,
        "completed_by_reading": sum(done_all),
        "enqueued": enqueued[0],
        "empty_takes": sum(empty_takes),
        "retries": sum(retries),
        "claim_latency": latency_ms([x for per in lat for x in per]),
        "cpu": cpu_between(r0, r1),
        "start_reading": r0,
        "depth_at_end": depths,
        "depth_sampled": {
            "linked_stats_median": statistics.median(sampler.stats_depth)
            if sampler.stats_depth else None,
            "inbox_median": statistics.median(sampler.inbox) if sampler.inbox else None,
            "inbox_max": max(sampler.inbox) if sampler.inbox else None,
            "samples": len(sampler.stats_depth),
            "error": None if sampler.error is None else repr(sampler.error),
        },
    }


def drain(side: Side, kind: str, seconds: float) -> int:
    """Take what the row left, with its consumer kind and take, recorded in the
    log (consumer -1), until the queue reads empty (ringq: ``ringq.depth``,
    the inbox included; pgmq: no rows) or ``seconds`` passed; how many."""
    got_all = 0
    deadline = time.monotonic() + seconds
    looked = 0.0
    with side.consumer() as c, psycopg.connect(side.dsn, autocommit=True) as admin:
        while time.monotonic() < deadline:
            got = c.take(side.take_n(), 0.1)
            if got:
                c.finish(kind, -1, [HEADER.unpack_from(p)[1] for p in got])
                got_all += len(got)
                continue
            if time.monotonic() - looked < 0.5:
                continue  # a depth read scans the ring: not on every empty take
            looked = time.monotonic()
            if side.ringq:
                r = admin.execute("SELECT ringq.depth(%s)", (side.queue,)).fetchone()
            else:
                r = admin.execute(q(PGMQ_COUNT, side.names.pgmq)).fetchone()
            if r is not None and r[0] == 0:
                break
    return got_all


def catch_up(side: Side) -> int:
    """Bring the global section of a prototype's queue whose entries SQL
    consumers took behind its back back in step with the rows, so that its
    slots are reclaimed and the next round finds room: a linked dequeue of
    entries the section still reads as ready fails its guard at commit
    (StaleSection), and the engine then re-reads the queue from its rows.
    Returns how many times that happened."""
    resyncs = 0
    with connect(side.dsn) as s:
        for _ in range(20):
            try:
                got = s.dequeue_many(side.queue, WARM_BATCH)
                s.commit()
            except StaleSection:
                resyncs += 1
                continue
            if not got:
                break
    return resyncs


# -- the run ---------------------------------------------------------------------------------------


@contextmanager
def monitor_process(
    dsn: str, workdir: Path, reserve: bool = False
) -> Iterator[subprocess.Popen[bytes]]:
    """``ringq monitor`` as its own process, as deployed; yields once its SQL
    agent LISTENs (the first SQL consumer's ask is heard)."""
    log = (workdir / "monitor.out").open("wb")
    mon = subprocess.Popen(
        [sys.executable, "-m", "ringq.cli", "monitor", "--dsn", dsn, "--port", "0",
         "--data-dir", str(workdir), "--log-level", "warning",
         *([] if reserve else ["--no-sql-reserve-slots"])],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(dsn, autocommit=True) as c:
            while True:
                if mon.poll() is not None:
                    raise RuntimeError(f"ringq monitor exited with {mon.returncode}: "
                                       f"{(workdir / 'monitor.out').read_text()[-2000:]}")
                ports = {r[0] for r in c.execute(MONITOR_AGENT).fetchall()}
                if ports & local_ports(mon.pid):
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError("ringq monitor's agent did not LISTEN within 60 s")
                time.sleep(0.1)
        yield mon
    finally:
        mon.terminate()
        try:
            mon.wait(30)
        except subprocess.TimeoutExpired:
            mon.kill()
            mon.wait()
        log.close()


def warm(side: Side, entries: int) -> None:
    """``entries`` through the row's queue (or the pgmq table), untimed, by
    linked sessions for ringq (every ring row then holds a payload once)."""
    if entries <= 0:
        return
    payloads = [b"w" * side.cfg.payload] * WARM_BATCH
    if not side.ringq:
        with side.producer() as p, psycopg.connect(side.dsn) as conn:
            c = PgmqConsumer(conn, side.names.pgmq, side.names.done, side.cfg)
            for _ in range(-(-entries // WARM_BATCH)):
                p.put(payloads)
                while c.take(WARM_BATCH, 0.0):
                    c.ack()
        return
    with connect(side.dsn) as prod, connect(side.dsn) as cons:
        for _ in range(-(-entries // WARM_BATCH)):
            prod.enqueue_many(side.queue, payloads)
            prod.commit()
            while cons.dequeue_many(side.queue, WARM_BATCH):
                cons.commit()
            cons.commit()


def capacity_of(row: str, cfg: Config) -> int:
    return cfg.proto_capacity if row in PROTOTYPES and ROWS[row][1] == "chunk" else cfg.capacity


def run(dsn: str, cfg: Config, names: Names, workdir: Path) -> dict[str, Any]:
    bounded = make_conninfo(
        dsn, options=f"-c statement_timeout={int(cfg.statement_timeout * 1000)}"
    )
    sides: dict[str, Side] = {}
    with psycopg.connect(dsn, autocommit=True) as admin:
        for row in cfg.rows:
            cap = capacity_of(row, cfg)
            qid = 0
            if ROWS[row][0] != "pgmq":
                create_queue(admin, QueueSpec(names.queue(row), cap, cfg.max_payload,
                                              dequeue_mode="shared"))
                got = admin.execute("SELECT id FROM ringq.queues WHERE name = %s",
                                    (names.queue(row),)).fetchone()
                qid = int(got[0]) if got else 0
            sides[row] = Side(bounded, row, names.queue(row), qid, cap, names, cfg)
        admin.execute(q(PGMQ_CREATE, names.pgmq))
        admin.execute(q(PGMQ_INDEX, names.pgmq))
        admin.execute(q(DONE_CREATE, names.done))
        make_protos(admin, names, cfg, {row: (side.qid, side.queue)
                                        for row, side in sides.items() if row in PROTOTYPES})
        env = {"server": server_settings(admin), **machine(), **cpu_load("start")}
    for row, side in sides.items():
        n = max(cfg.warm, side.capacity) if row in PROTOTYPES else cfg.warm
        print(f"warm-up: {n:,} entries through {row} ...", file=sys.stderr, flush=True)
        warm(side, n)
    results: list[dict[str, Any]] = []
    with monitor_process(dsn, workdir, cfg.sql_reserve_slots) as mon, \
            psycopg.connect(dsn, autocommit=True) as pc:
        probe = Probe(pc, {"monitor": mon.pid, "bench": os.getpid()})
        env["statements_tracked"] = probe.statements
        for rnd in range(1, cfg.rounds + 1):
            order = list(sides) if rnd % 2 else list(reversed(sides))
            for row in order:
                side = sides[row]
                print(f"round {rnd}/{cfg.rounds}: row {row} ({LABELS[row]}) ...",
                      file=sys.stderr, flush=True)
                res = one_row(side, probe, rnd)
                results.append(res)
                print(f"  {res['entries_per_s']:,.0f} entries/s", file=sys.stderr, flush=True)
    with psycopg.connect(dsn, autocommit=True) as admin:
        for res in results:
            got = admin.execute(q(DONE_COUNT, names.done), (res["log_kind"],)).fetchone()
            assert got is not None
            logged, distinct = int(got[0]), int(got[1])
            res["logged"] = logged
            res["duplicates"] = logged - distinct
            res["missing"] = res["enqueued"] - distinct
    env.update(cpu_load("end"))
    return {"environment": env, "rows": results}


def one_row(side: Side, probe: Probe, rnd: int) -> dict[str, Any]:
    """One row of one round: the timed stretch, the drain, the statistics."""
    cfg = side.cfg
    kind = f"{side.row}#{rnd}"  # the log's key: ids start at 0 in every round
    if not side.ringq:
        # The pgmq-style table inserts and deletes every entry: vacuumed
        # before each of its rows (a row right after the last ran at a fifth
        # of the others' rate, on the dead rows of the one before).
        probe.conn.execute(q("VACUUM (ANALYZE) {t}", side.names.pgmq))
    res = timed_row(side, probe, kind)
    res["round"] = rnd
    res["drained"] = drain(side, kind, cfg.drain_s)
    if side.producer_kind == "linked_chunks":
        res["section_resyncs"] = catch_up(side)
    agent = res.pop("proto_agent")
    if agent is not None:  # after the drain: it verified the drain's chunks too
        agent.stop()
        res["proto_agent"] = agent.figures()
    # Live backends' statistics reach the views within PostgreSQL's idle
    # flush interval (10 s): the row's and its drain's writes all counted
    # here, none in the next row's.
    time.sleep(cfg.settle)
    r2 = probe.read(statements=True)
    res["writes"] = writes_between(res.pop("start_reading"), r2)
    res["statements"] = statements_of(r2)
    res["load_after"] = os.getloadavg()
    return res


# -- summary and table ----------------------------------------------------------------------------


def per_entry(res: dict[str, Any]) -> dict[str, Any]:
    """The row's costs per completed entry."""
    n = res["completed"] or float("nan")
    n_all = res["enqueued"] or float("nan")  # all consumed by the end of the drain
    cpu = res["cpu"]
    w = res["writes"]
    out: dict[str, Any] = {
        "server_cpu_us": None if cpu["server_s"] is None else cpu["server_s"] / n * 1e6,
        "monitor_cpu_us": None if cpu["monitor_s"] is None else cpu["monitor_s"] / n * 1e6,
        "monitor_backends_cpu_us": {k: v / n * 1e6
                                    for k, v in cpu["monitor_backends_s"].items()},
        "bench_cpu_us": None if cpu["bench_s"] is None else cpu["bench_s"] / n * 1e6,
        "machine_busy": cpu["machine_busy"],
        "commits": w["commits"] / n_all,
        "wal_bytes": w["wal_bytes"] / n_all,
        "rows_written": sum(t["ins"] + t["upd"] + t["del"] for t in w["tables"].values()) / n_all,
        "tables": {name: {k: v / n_all for k, v in t.items()}
                   for name, t in sorted(w["tables"].items())},
    }  # fmt: skip
    st = res["statements"]
    if st is not None:
        out["toplevel_statements"] = st["toplevel_calls"] / n_all
        out["toplevel_exec_us"] = st["toplevel_exec_ms"] * 1000 / n_all
    return out


FIGURES = (  # (key of a row's medians, label in the table, format)
    ("entries_per_s", "entries/s", "{:,.0f}"),
    ("claim_p50_ms", "claim p50", "{:,.1f}"),
    ("claim_p99_ms", "claim p99", "{:,.1f}"),
    ("server_cpu_us", "srv us/e", "{:,.0f}"),
    ("monitor_cpu_us", "mon us/e", "{:,.0f}"),
    ("machine_busy", "busy", "{:.0%}"),
    ("rows_written", "rows w/e", "{:.2f}"),
    ("commits", "commits/e", "{:.3f}"),
    ("wal_bytes", "WAL B/e", "{:,.0f}"),
    ("toplevel_statements", "stmts/e", "{:.3f}"),
)


def _figures(res: dict[str, Any], costs: dict[str, Any]) -> dict[str, float | None]:
    lat = res["claim_latency"]
    return {"entries_per_s": res["entries_per_s"], "claim_p50_ms": lat.get("p50_ms"),
            "claim_p99_ms": lat.get("p99_ms"),
            **{k: costs.get(k) for k, _l, _f in FIGURES[3:]}}  # fmt: skip


def _median(values: list[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _median_map(maps: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key medians of (nested) dicts of numbers; a key missing counts as 0."""
    keys = sorted({k for m in maps for k in m})
    out: dict[str, Any] = {}
    for k in keys:
        vals = [m.get(k) for m in maps]
        if any(isinstance(v, dict) for v in vals):
            out[k] = _median_map([v if isinstance(v, dict) else {} for v in vals])
        else:
            out[k] = statistics.median(float(v or 0.0) for v in vals)
    return out


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """Each row's figures as the median of its rounds [min, max]; ratios taken
    within a round (the two rows ran minutes apart at most), then their median."""
    results = raw["rows"]
    costs = [per_entry(r) for r in results]
    by_row: dict[str, list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r, c in zip(results, costs, strict=True):
        by_row.setdefault(r["row"], []).append((r, c))
    rows: dict[str, Any] = {}
    for row, pairs in by_row.items():
        figs = [_figures(r, c) for r, c in pairs]
        spread: dict[str, Any] = {}
        for k, _l, _f in FIGURES:
            vals = [v for f in figs if (v := f[k]) is not None]
            spread[k] = {"median": _median(list(vals)), "min": min(vals, default=None),
                         "max": max(vals, default=None)}
        rows[row] = {
            **spread,
            "monitor_backends_cpu_us": _median_map([c["monitor_backends_cpu_us"]
                                                    for _r, c in pairs]),
            "tables": _median_map([c["tables"] for _r, c in pairs]),
            "checks": {k: sum(r[k] for r, _c in pairs)
                       for k in ("missing", "duplicates", "drained", "retries")},
        }  # fmt: skip
    per_round: dict[int, dict[str, tuple[dict[str, Any], dict[str, Any]]]] = {}
    for r, c in zip(results, costs, strict=True):
        per_round.setdefault(r["round"], {})[r["row"]] = (r, c)
    ratios: dict[str, list[float]] = {}
    for got in per_round.values():
        for base, key in (("linked", "linked"), ("pgmq", "pgmq")):
            if base not in got:
                continue
            b_r, b_c = got[base]
            for row, (r, c) in got.items():
                if row == base:
                    continue
                ratios.setdefault(f"{row}_rate_over_{key}", []).append(
                    r["entries_per_s"] / b_r["entries_per_s"])
                if key == "linked" and c["server_cpu_us"] and b_c["server_cpu_us"]:
                    ratios.setdefault(f"{row}_server_cpu_over_linked", []).append(
                        c["server_cpu_us"] / b_c["server_cpu_us"])
    return {"per_entry": costs, "per_row": rows,
            "ratios": {k: {"median": statistics.median(v), "min": min(v), "max": max(v)}
                       for k, v in ratios.items()}}  # fmt: skip


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


def render(raw: dict[str, Any], summary: dict[str, Any], cfg: Config, seconds: float) -> str:
    env = raw["environment"]
    per_row = summary["per_row"]
    rounds = max(r["round"] for r in raw["rows"])
    lines = [
        (f"ringq from other hosts: PostgreSQL {env['server']['server_version']}, "
         f"synchronous_commit={env['server']['synchronous_commit']}, {env['cpus']} CPUs, "
         f"pg_stat_statements {'on' if env['statements_tracked'] else 'off'}"),
        (f"1 producer ({cfg.produce_batch}/tx, ~{cfg.ready:,} ready"
         f"{f', at most {cfg.rate:,.0f}/s' if cfg.rate else ''}), {cfg.consumers} consumer "
         f"threads (linked {cfg.take_linked}, SQL {cfg.take_sql}, pgmq {cfg.take_pgmq} per "
         f"take; {cfg.work_ms:g} ms work per entry; INSERT per batch in the take's "
         f"transaction), payload {cfg.payload} B, {cfg.duration:g} s per row; one ringq "
         f"monitor process; run took {seconds:.0f} s"),
        (f"{rounds} round(s), the order reversed every other round; medians of the rounds "
         f"(entries/s: [min-max]); load average at start {env['loadavg_at_start'][0]:.2f}, "
         f"at end {env['loadavg_at_end'][0]:.2f}"),
        "",
        (f"{'row':<36} {'entries/s':>23} {'claim p50/p99 ms':>17} "
         + " ".join(f"{label:>{max(7, len(label))}}" for _k, label, _f in FIGURES[3:])),
        "-" * 143,
    ]  # fmt: skip
    for row, fig in per_row.items():
        rate = fig["entries_per_s"]
        span = (f" [{rate['min']:,.0f}-{rate['max']:,.0f}]" if rounds > 1 else "")
        claim = (f"{_f(fig['claim_p50_ms']['median'], '{:,.1f}')} / "
                 f"{_f(fig['claim_p99_ms']['median'], '{:,.1f}')}")
        lines.append(
            f"{LABELS[row]:<36} {_f(rate['median'], '{:,.0f}') + span:>23} {claim:>17} "
            + " ".join(f"{_f(fig[k]['median'], f):>{max(7, len(label))}}"
                       for k, label, f in FIGURES[3:]))
    lines += ["", "ratios within a round, median [min-max]:"]
    lines += [f"  {k:<36} {v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"
              for k, v in summary["ratios"].items()]
    lines += ["", "depth at the end of each row (producer's count / ringq.depth / linked stats "
              "/ inbox / set aside; sampled medians: linked stats, inbox):"]
    for r in raw["rows"]:
        d, s = r["depth_at_end"], r["depth_sampled"]
        who = f"{r['row']}#{r['round']}"
        if "ringq_depth" in d:
            lines.append(
                f"  {who:<16} {d['producer_view']:,} / {d['ringq_depth']:,} / "
                f"{d['linked_stats_depth']:,} / {d['inbox']:,} / {d['set_aside']:,}; "
                f"sampled {s['linked_stats_median']} / {s['inbox_median']} "
                f"(inbox max {s['inbox_max']})")
        else:
            lines.append(f"  {who:<16} {d['producer_view']:,} / table rows "
                         f"{d.get('table_rows')}")
    lines += ["", "server CPU of the monitor's backends per entry (us), by what they are:"]
    for row, fig in per_row.items():
        mb = fig["monitor_backends_cpu_us"]
        lines.append(f"  {row:<16} " + ", ".join(
            f"{MONITOR_BACKENDS.get(k, k)} {v:,.1f}" for k, v in sorted(mb.items())))
    lines += ["", "rows written per entry, by table (ins/upd[hot]/del):"]
    for row, fig in per_row.items():
        lines.append(f"  {row:<16} " + "; ".join(
            f"{_short(name, row)} {v['ins']:.2f}/{v['upd']:.2f}[{v['hot_upd']:.2f}]/"
            f"{v['del']:.2f}" for name, v in fig["tables"].items()))
    if env["statements_tracked"]:
        lines += ["", "statements by execution time, first round (calls/entry, rows/call, "
                  "us/entry; * = inside a function):"]
        for r in raw["rows"]:
            st = r["statements"]
            if r["round"] != 1 or st is None:
                continue
            n_all = r["enqueued"] or 1
            lines.append(f"  {r['row']}: {st['toplevel_calls'] / n_all:.3f} top-level "
                         f"statements/entry, {st['toplevel_exec_ms'] * 1000 / n_all:,.1f} us "
                         "of top-level execution/entry")
            for s in st["top"][:8]:
                lines.append(
                    f"    {'' if s['toplevel'] else '*'}{s['calls'] / n_all:8.3f} "
                    f"{s['rows'] / max(1, s['calls']):7.1f} {s['exec_ms'] * 1000 / n_all:7.1f}  "
                    f"{s['query'][:90]}")
    lines.append("")
    for row, fig in per_row.items():
        c = fig["checks"]
        agents = [r["proto_agent"] for r in raw["rows"]
                  if r["row"] == row and r.get("proto_agent")]
        lines.append(f"{row}: missing {c['missing']}, duplicates {c['duplicates']}, drained "
                     f"after the rows {c['drained']:,}, takes refused by a guard (RQ001, "
                     f"retried) {c['retries']}" + ("" if not agents else (
                         f"; stand-in agent: "
                         f"{sum(a['verified_chunks'] for a in agents):,} chunks verified "
                         f"consumed by their rows, {sum(a['mismatched_chunks'] for a in agents)}"
                         f" not, errors {[a['error'] for a in agents if a['error']]}")))
    return "\n".join(lines)


def _short(table: str, row: str) -> str:
    return table.replace("ringq.", "").replace(f"_{row}", "").replace("public.", "")


# -- the database ----------------------------------------------------------------------------------


@contextmanager
def database(dsn: str | None, statements: bool) -> Iterator[tuple[str, bool]]:
    """(DSN, whether it is the private cluster): ``dsn``, or a private embedded
    cluster removed afterwards; with ``statements``, pg_stat_statements loaded
    (``track = all``) on it, or created in ``dsn`` when the server loads it."""
    if dsn is not None:
        if statements:
            with psycopg.connect(dsn, autocommit=True) as c, contextlib.suppress(psycopg.Error):
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        yield dsn, False
        return
    from ringq.cluster import Cluster

    home = tempfile.mkdtemp(prefix="ringq-bench-hosts-")
    cluster = Cluster(home)
    try:
        print(f"starting an embedded PostgreSQL under {home} ...", file=sys.stderr, flush=True)
        url = cluster.start()
        if statements:
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'")
            cluster.restart()
            with psycopg.connect(url, autocommit=True) as c:
                c.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                # known only once the library is loaded
                c.execute("ALTER SYSTEM SET pg_stat_statements.track = 'all'")
                c.execute("SELECT pg_reload_conf()")
        yield url, True
    finally:
        cluster.stop()
        shutil.rmtree(home, ignore_errors=True)


def parse_args(argv: list[str] | None) -> Any:
    p = argument_parser(__doc__.split("\n", 1)[0])
    p.add_argument("--rows", default=",".join(BASELINE),
                   help=f"the rows to run, comma-separated, in order ({', '.join(ROWS)})")
    p.add_argument("--proto", action="store_true",
                   help=f"also run the prototypes ({', '.join(PROTOTYPES)}) after --rows")
    p.add_argument("--proto-capacity", type=int, default=250_000,
                   help="slots of a prototype's queue (never reclaimed: no row may wrap it)")
    p.add_argument("--agent-ms", type=float, default=10.0,
                   help="the prototypes' stand-in agent: ms between its passes")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per row")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of the rows (the order reversed every other round)")
    p.add_argument("--consumers", type=int, default=32, help="consumer threads")
    p.add_argument("--take-linked", type=int, default=8, help="a linked consumer's dequeue_many")
    p.add_argument("--take-sql", type=int, default=64, help="a SQL consumer's ringq.dequeue n")
    p.add_argument("--take-pgmq", type=int, default=64, help="a pgmq consumer's read n")
    p.add_argument("--produce-batch", type=int, default=128, help="entries per enqueue")
    p.add_argument("--ready", type=int, default=4000, help="entries the producer keeps ready")
    p.add_argument("--capacity", type=int, default=50_000, help="slots of each ringq queue")
    p.add_argument("--max-payload", type=int, default=512, help="max payload of the queues")
    p.add_argument("--payload", type=int, default=256, help="payload bytes")
    p.add_argument("--work-ms", type=float, default=1.0,
                   help="a consumer's sleep per entry (ms); 0: no work")
    p.add_argument("--wait", type=float, default=1.0,
                   help="longest wait of an empty take: dequeue_many's wait, the LISTEN (s)")
    p.add_argument("--poll-ms", type=float, default=10.0,
                   help="the pgmq consumer's sleep after finding nothing (ms)")
    p.add_argument("--vt", type=float, default=30.0, help="the pgmq read's visibility timeout (s)")
    p.add_argument("--warm", type=int, default=None,
                   help="entries through each queue before the rows (default: --capacity)")
    p.add_argument("--settle", type=float, default=11.0,
                   help="seconds after a row's drain before its statistics are read "
                        "(PostgreSQL's idle backends flush theirs within 10 s)")
    p.add_argument("--sample-s", type=float, default=1.0,
                   help="seconds between depth samples during a row (0: none)")
    p.add_argument("--drain-s", type=float, default=120.0,
                   help="longest drain of what a row left (s)")
    p.add_argument("--statements", action="store_true",
                   help="profile statements with pg_stat_statements (loaded on the private "
                        "cluster; it costs CPU of its own)")
    p.add_argument("--pace", choices=("count", "stats"), default="count",
                   help="what the producer keeps at --ready: the bench's own count of "
                        "entries enqueued and not yet taken, or (ringq rows) the depth a "
                        "linked session's stats() shows")
    p.add_argument("--sql-reserve-slots", action=argparse.BooleanOptionalAction, default=True,
                   help="the monitor reserves ring slots for SQL producers' batches (its "
                        "default); --no-sql-reserve-slots: every SQL entry through the inbox")
    p.add_argument("--rate", type=float, default=0.0,
                   help="entries/s the producer puts at most (0: no cap): the claim latency "
                        "at a given rate, below what saturates the machine")
    p.add_argument("--statement-timeout", type=float, default=30.0,
                   help="statement_timeout of the rows' connections (s): a hang fails")
    a = p.parse_args(argv)
    a.rows = tuple(r.strip() for r in a.rows.split(",") if r.strip())
    if a.proto:
        a.rows += tuple(r for r in PROTOTYPES if r not in a.rows)
    unknown = [r for r in a.rows if r not in ROWS]
    if unknown or not a.rows:
        p.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if a.warm is None:
        a.warm = a.capacity
    for name in ("rounds", "consumers", "take_linked", "take_sql", "take_pgmq", "produce_batch",
                 "ready", "capacity", "payload"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (not a.duration > 0 or a.work_ms < 0 or a.wait <= 0 or a.poll_ms < 0 or a.settle < 0
            or a.rate < 0):
        p.error("--duration and --wait must be > 0; --work-ms, --poll-ms, --settle, --rate >= 0")
    if a.payload < HEADER.size or a.payload > a.max_payload:
        p.error(f"--payload must be {HEADER.size} to --max-payload bytes")
    if a.ready + a.produce_batch > a.capacity:
        p.error("--ready + --produce-batch must fit --capacity")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    cfg = config_from_options(Config, a)
    names = Names(secrets.token_hex(4))
    sigterm_tears_down()
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    with database(a.dsn, cfg.statements) as (dsn, embedded), \
            tempfile.TemporaryDirectory(prefix="bench-hosts-") as tmp:
        try:
            raw = run(dsn, cfg, names, Path(tmp))
        finally:
            with contextlib.suppress(Exception):
                queues = [names.queue(r) for r in cfg.rows if ROWS[r][0] != "pgmq"]
                drop_protos(dsn, names, [r for r in cfg.rows if r in PROTOTYPES])
                drop_queues(dsn, queues, embedded=embedded, tables=names.tables())
    seconds = time.perf_counter() - t0
    summary = summarize(raw)
    table = render(raw, summary, cfg, seconds)
    print(table)
    doc = {"benchmark": "hosts", "started_at": started.isoformat(), "seconds": seconds,
           "command": [sys.executable, *sys.argv],
           "database": "embedded" if a.dsn is None else "given (--dsn)",
           "config": cfg.__dict__, **raw, **summary, "table": table}  # fmt: skip
    write_results("hosts", started, doc, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
