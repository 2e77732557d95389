"""The randomized multi-process workload of one regression cycle.

Producers (``config.producers`` processes) write random numbers of entries to
random queues, often several queues in one transaction, as simple or two-phase
transactions, some deliberately rolled back; they alternate bursts, trickles
and pauses, so the queues are driven full and empty. Each records what it
committed in ``sent`` inside the same transaction as the enqueues (the ground
truth), and every rolled-back entry in ``rolled_back`` right after the rollback.

One consumer process per queue dequeues in random batch sizes and writes what
it took to ``received_<queue>`` in the same transaction as the dequeue; now and
then it rolls back on purpose (the entries come back), and a few times per
cycle it stops dequeuing until producers find its queue full.

The grouped queue (``grouped_consumers`` > 0) is written like the others, each
entry in a random group of ``groups``, and consumed by ``grouped_consumers``
processes at once (``shared`` mode; ``dequeue_many`` takes at most one entry
per group). They record each entry's group, the time right after the dequeue
returned and the time just before the commit (``time.monotonic_ns()``: the
clock is system-wide), so that the proof can see per-group order and whether
two entries of a group were ever held at once. They wait together at the start
of the cycle until producers find their queue full (one of them seeing it is
enough for all), so the groups have a backlog to be taken from in parallel.

Every process makes its own session after it starts (nothing crosses a fork:
the processes come from a fork server that has never opened a connection).
Workers ignore SIGINT: the parent decides when a cycle stops.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from ringq.engine import (
    DatabaseError,
    DatabaseUnavailable,
    InDoubt,
    QueueFull,
    Session,
    StaleSection,
    connect,
    exits,
    pid_alive,
    queue_table,
)
from ringq.engine import layout as L
from ringq.engine import metrics as M

from . import _payload as P
from . import _queries as S
from . import _store
from ._config import RegressConfig
from ._failover import AckLog, Failover, embedded_cluster
from ._monitors import OwnMonitor, TakenMonitor, serving_monitor
from ._store import QueueRef, RunInfo

# -- shared counters: one block of WORDS int64 per worker (each writes only its own) --
WORDS = 10
# producer words
P_ENTRIES = 0  # committed entries
P_TX = 1  # committed transactions
P_TX_2PC = 2  # of which two-phase
P_RB_TX = 3  # deliberately rolled-back transactions
P_FULL_TX = 4  # transactions rolled back because a queue stayed full
P_RB_ENTRIES = 5  # entries of rolled-back transactions (that had a sequence)
P_MULTI_TX = 6  # committed transactions that touched several queues
# consumer words
C_ENTRIES = 0  # entries taken in committed transactions
C_TX = 1
C_RB_TX = 2  # deliberately rolled-back dequeue transactions
C_STALLS = 3  # times it stopped dequeuing to let its queue fill
C_REDELIVERED = 4  # committed entries whose delivery count was > 1
C_FIRST_AFTER = 5  # fail-over: time.monotonic() in µs of its first commit after the promotion
# the grouped queue's first consumer's block only: 1 once any of its consumers
# saw the queue full at the start of the cycle (they all go on then)
C_FILLED = 6
HEARTBEAT = 7  # any step at all (the watchdog's progress measure)
RECONNECTS = 8  # both: sessions lost to a database restart and opened again (chaos)
RESUMED = 9  # both: times the worker resumed from what the database holds (restarts)

# The word after the workers' blocks: when the standby was promoted (fail-over;
# time.monotonic() in µs; 0 before, 1 if the fail-over failed), written by the
# parent only.
PROMOTED = -1

# Errors of a database going away under a session (chaos restarts PostgreSQL):
# the worker backs off, opens a new session and resumes from the database.
LOST_SESSION = (DatabaseUnavailable, InDoubt, DatabaseError, psycopg.OperationalError)
# ... and, after a fail-over, a transaction refused because the section it began
# under was replaced (nothing of it committed): the same way back.
RETRIED = (*LOST_SESSION, StaleSection)
BACKOFF_S = (0.1, 2.0)

STATS_KEYS = (
    M.FULL_HITS,
    M.EMPTY_HITS,
    M.ENQ_ROLLBACKS,
    M.DEQ_ROLLBACKS,
    M.POISONED,
    M.REPAIRS,
    M.RESYNCS,
    M.WAKEUPS,
)

POLL_S = 0.2  # the parent's loop: progress, depth samples, watchdog
# A consumer waits for producers to find its queue full at most
# max(STALL_MAX_S, capacity / STALL_MIN_RATE) seconds: long enough for a
# 2,000-slot queue to fill at the ~100 entries/s a small-payload queue gets
# while the producers are held back by the large-payload queue, and for a
# 50,000-slot queue (the original's) at the same rate (a fixed 30 s left the
# original's queues never full: ~640 entries/s per queue needs ~80 s).
STALL_MAX_S = 30.0
STALL_MIN_RATE = 100.0  # entries/s
STALL_IDLE_S = 3.0  # ... and gives up sooner when no producer writes to it any more
STALL_START_GRACE_S = 10.0  # ... at the start of a cycle, while producers start
JOIN_S = 10.0  # grace for workers after an abort before they are terminated


# An entry a producer wrote: (queue, qseq, pseq, length, digest, group or None).
Entry = tuple[int, int, int, int, bytes, str | None]


@dataclass(frozen=True)
class WorkerArgs:
    """What a worker process needs (pickled to it; no connection, no section)."""

    dsn: str
    run_id: str
    cycle: int
    config: RegressConfig
    queues: tuple[QueueRef, ...]
    index: int  # producer index, or queue index for a consumer
    slot: int  # its block in the counters
    seed: int
    quota: tuple[int, ...] = ()  # producers: committed entries owed to each queue
    ack_dir: str = ""  # fail-over: where producers log what they were told had committed
    worker: int = 0  # consumers: its number among its queue's consumers
    first_slot: int = 0  # consumers: the block of its queue's first consumer


@dataclass
class Progress:
    """A snapshot for the progress display (all counts since the cycle began)."""

    cycle: int
    elapsed_s: float
    expected: int  # committed entries the cycle will make
    committed: int
    received: int
    rolled_back_tx: int
    full_tx: int
    depth: list[int]
    capacity: int


@dataclass
class CycleResult:
    """What the workload of one cycle did (the proof comes later, from Spark)."""

    cycle: int
    status: str  # done | aborted | stalled | failed
    workload_s: float
    stats: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "done" and not self.errors


# -- workers -----------------------------------------------------------------------------


def _worker(role: str, body: Callable[..., None], args: WorkerArgs, *rest: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops cycles, not Ctrl-C
    errors: Any = rest[-1]
    try:
        body(args, *rest)
    except BaseException as exc:  # noqa: BLE001 - anything at all: report it, then exit non-zero
        # The name's last part: the producer's index, the queue's, or queue.worker
        # for a consumer of the grouped queue.
        index = mp.current_process().name.rsplit("-", 1)[-1]
        errors.put(f"{role} {index} (pid {os.getpid()}): {type(exc).__name__}: {exc}")
        errors.close()
        errors.join_thread()  # os._exit does not wait for the queue's feeder thread
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(exits.FAILURE)


def producer_main(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    _worker("producer", _produce, args, counters, abort, errors)


def consumer_main(
    args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any
) -> None:
    _worker("consumer", _consume, args, counters, producers_done, abort, errors)


class _Producer:
    def __init__(
        self, args: WorkerArgs, s: Session, counters: Any, acks: AckLog | None = None
    ) -> None:
        self.a = args
        self.acks = acks
        self.cfg = args.config
        self.s = s
        self.rng = random.Random(args.seed)
        self.c = counters
        self.base = args.slot * WORDS
        self.quota = list(args.quota)
        self.pseq = 0
        self.tx = 0
        # At most a quarter of a ring per producer in one transaction, so
        # producers' open reservations alone cannot fill a queue.
        self.max_per_tx = max(1, min(50, self.cfg.capacity // (4 * self.cfg.producers)))
        self.sent_sql = S.q(S.INSERT_SENT, args.run_id)
        self.rb_sql = S.q(S.INSERT_ROLLED_BACK, args.run_id)

    def bump(self, word: int, n: int = 1) -> None:
        self.c[self.base + word] += n

    def gtrid(self, tx: int) -> str:
        return f"regress_{self.a.run_id}_c{self.a.cycle}_p{self.a.index}_t{tx}"

    def resume(self, abort: Any) -> bool:
        """Continue from what the database durably holds for this producer in
        this cycle (a killed predecessor's open transaction never committed,
        so its entries and ``sent`` rows are gone together): the producer
        sequence and transaction number go on from the highest recorded, the
        quota shrinks by what was committed. Waits first until no prepared
        transaction of this producer is left in doubt (the monitor commits or
        rolls back a dead coordinator's), so nothing commits behind its back.
        False if aborted meanwhile."""
        conn = self.s.connection
        prefix = self.gtrid(0)[:-1]
        while True:
            gids = [g for (g,) in conn.execute(S.PREPARED_GIDS).fetchall()]
            if not any(_gtrid(g).startswith(prefix) for g in gids):
                break
            if abort.is_set():
                return False
            time.sleep(0.05)
        key = (self.a.cycle, self.a.index)
        row = conn.execute(
            S.q(S.RESUME_PRODUCER, self.a.run_id), {"cycle": self.a.cycle, "producer": self.a.index}
        ).fetchone()
        assert row is not None
        self.pseq, self.tx = int(row[0]), int(row[1])
        if self.acks is not None:
            # Entries acknowledged by a primary that died before its standby
            # had them are not in ``sent``: their numbers are not used again.
            pseq, tx = self.acks.last()
            self.pseq, self.tx = max(self.pseq, pseq), max(self.tx, tx)
        committed = [0] * len(self.quota)
        for q, n in conn.execute(S.q(S.SENT_BY_QUEUE, self.a.run_id), key).fetchall():
            committed[q] = int(n)
        self.s.commit()
        self.quota = [
            max(0, owed - done) for owed, done in zip(self.a.quota, committed, strict=True)
        ]
        self.c[self.base + P_ENTRIES] = sum(committed)
        if self.pseq or self.tx:
            self.bump(RESUMED)
        return True

    def plan(self) -> list[tuple[int, int]]:
        """(queue index, entries) for the next transaction."""
        open_ = [q for q, left in enumerate(self.quota) if left > 0]
        nq = min(len(open_), self.rng.choice((1, 1, 2, 2, 3, len(open_))))
        chosen = self.rng.sample(open_, nq)
        return [(q, self.rng.randint(1, min(self.quota[q], self.max_per_tx))) for q in chosen]

    def payload(self, q: int, kind: int) -> tuple[int, int, bytes, str | None]:
        """(producer sequence, length, payload, group) of a new entry for queue ``q``;
        the group is one of ``groups`` at random on the grouped queue, else None."""
        self.pseq += 1
        ref = self.a.queues[q]
        rng = self.rng if self.cfg.filler == "random" else None
        payload = P.build(kind, q, self.a.index, self.pseq, ref.payload_size, rng=rng)
        group = f"g{self.rng.randrange(self.cfg.groups)}" if ref.grouped else None
        return self.pseq, ref.payload_size, payload, group

    def transaction(self) -> None:
        s, rng = self.s, self.rng
        self.tx += 1
        plan = self.plan()
        kind = P.KIND_TWO_PHASE if rng.random() < self.cfg.two_phase_rate else P.KIND_SIMPLE
        rollback = rng.random() < self.cfg.rollback_rate
        timeout = self.cfg.enqueue_timeout * rng.uniform(0.5, 1.0)
        done: list[Entry] = []
        if kind == P.KIND_TWO_PHASE:
            s.tpc_begin(s.xid(self.gtrid(self.tx)))
        try:
            if rng.random() < 0.5:
                # One statement per queue.
                for q, n in plan:
                    items = [self.payload(q, kind) for _ in range(n)]
                    ref = self.a.queues[q]
                    seqs = s.enqueue_many(
                        ref.name,
                        [p for _, _, p, _ in items],
                        group=[g for _, _, _, g in items] if ref.grouped else None,
                        timeout=timeout,
                    )
                    done.extend(
                        (q, seq, ps, ln, P.digest(p), g)
                        for seq, (ps, ln, p, g) in zip(seqs, items, strict=True)
                    )
            else:
                # One call per entry, the queues interleaved.
                order = [q for q, n in plan for _ in range(n)]
                rng.shuffle(order)
                for q in order:
                    ps, ln, p, g = self.payload(q, kind)
                    seq = s.enqueue(self.a.queues[q].name, p, group=g, timeout=timeout)
                    done.append((q, seq, ps, ln, P.digest(p), g))
        except QueueFull:
            s.rollback()
            self.log_rolled_back(done, kind, "full")
            self.bump(P_FULL_TX)
            time.sleep(rng.uniform(0.01, 0.2))
            return
        self.record(self.sent_sql, done, kind)
        if rollback:
            reason = "deliberate"
            if kind == P.KIND_TWO_PHASE and rng.random() < 0.5:
                s.tpc_prepare()
                reason = "deliberate-prepared"
            s.rollback()
            self.log_rolled_back(done, kind, reason)
            self.bump(P_RB_TX)
            return
        if kind == P.KIND_TWO_PHASE:
            s.tpc_prepare()
            if self.cfg.resilient and rng.random() < 0.5:
                # Record the decision as a coordinator would: if this process
                # dies before COMMIT PREPARED, the monitor commits for it.
                s.tpc_decide()
            s.tpc_commit()  # clears a recorded decision
            self.bump(P_TX_2PC)
        else:
            s.commit()
        if self.acks is not None:  # acknowledged: the commit returned
            self.acks.record(
                self.tx, s.connection.info.port, [(q, seq, ps) for q, seq, ps, *_ in done]
            )
        for q, n in plan:
            self.quota[q] -= n
        self.bump(P_ENTRIES, len(done))
        self.bump(P_TX)
        if len(plan) > 1:
            self.bump(P_MULTI_TX)

    def record(self, stmt: Any, done: list[Entry], kind: int, **extra: Any) -> None:
        """Write ``done`` with ``stmt`` (INSERT_SENT, or INSERT_ROLLED_BACK with a ``reason``)."""
        if not done:
            return
        qs, seqs, pseqs, lens, digests, groups = (list(col) for col in zip(*done, strict=True))
        params = {
            "cycle": self.a.cycle,
            "producer": self.a.index,
            "tx": self.tx,
            "kind": kind,
            "queues": qs,
            "qseqs": seqs,
            "pseqs": pseqs,
            "lengths": lens,
            "digests": digests,
            "groups": groups,  # INSERT_SENT's; INSERT_ROLLED_BACK has no use for them
            **extra,
        }
        self.s.connection.execute(stmt, params)

    def log_rolled_back(self, done: list[Entry], kind: int, reason: str) -> None:
        if not done:
            return
        self.record(self.rb_sql, done, kind, reason=reason)
        self.s.commit()
        self.bump(P_RB_ENTRIES, len(done))


def _wait_recovered(s: Session, abort: Any) -> bool:
    """Wait until the monitor has recovered every dead (or in-doubt) client.

    A restarted worker must not overtake its predecessor: entries a killed
    producer committed but had not yet published, or entries a killed consumer
    held, become visible only when the monitor decides the dead client's slots
    from the rows. Resuming before that lets the new process's entries (or
    dequeues) pass the old ones, which breaks per-producer order.
    False if aborted meanwhile."""
    sec = s.section
    while True:
        pending = [
            c for c in sec.active_clients()
            if sec.c(c, L.C_STATE) == L.CS_IN_DOUBT or not pid_alive(sec.c(c, L.C_PID))
        ]
        if not pending:
            return True
        if abort.is_set():
            return False
        time.sleep(0.02)


def _gtrid(gid: str) -> str:
    try:
        return str(psycopg.Xid.from_string(gid).gtrid)
    except Exception:  # noqa: BLE001 - not one of ours
        return gid


def _retrying(args: WorkerArgs, counters: Any, abort: Any, body: Callable[[], bool]) -> None:
    """Run ``body`` until it returns True; with chaos, a lost database session
    (PostgreSQL restarted, or failed over) means: back off, reconnect, resume."""
    delay = BACKOFF_S[0]
    while not abort.is_set():
        try:
            if body():
                return
        except RETRIED:
            if not args.config.resilient:
                raise
            counters[args.slot * WORDS + RECONNECTS] += 1
            counters[args.slot * WORDS + HEARTBEAT] += 1
            abort.wait(delay)
            delay = min(BACKOFF_S[1], delay * 2)


def _produce(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    acks = AckLog(Path(args.ack_dir) / f"p{args.index}.log") if args.ack_dir else None
    try:
        _retrying(args, counters, abort, lambda: _produce_session(args, counters, abort, acks))
    finally:
        if acks is not None:
            acks.close()


def _produce_session(args: WorkerArgs, counters: Any, abort: Any, acks: AckLog | None) -> bool:
    with connect(
        args.dsn, producer=f"regress-{args.run_id}-p{args.index}", application_name="ringq-regress"
    ) as s:
        p = _Producer(args, s, counters, acks)
        if args.config.resilient and not _wait_recovered(s, abort):
            return True
        if not p.resume(abort):
            return True
        # A restarted producer draws other random numbers than its predecessor.
        if p.tx:
            p.rng.seed(f"{args.seed}:{p.tx}:{p.pseq}")
        rng = p.rng
        mode, left = "burst", 0
        while any(q > 0 for q in p.quota) and not abort.is_set():
            if left <= 0:
                mode = rng.choices(("burst", "trickle", "pause"), weights=(5, 3, 2))[0]
                left = rng.randint(10, 100)
                if mode == "pause":
                    # Producers pause: consumers catch up and find queues empty.
                    abort.wait(rng.uniform(0.2, 1.0))
                    left = 0
                    continue
            p.transaction()
            counters[p.base + HEARTBEAT] += 1
            left -= 1
            if mode == "trickle":
                time.sleep(rng.uniform(0.0, 0.02))
            if args.ack_dir and not any(q > 0 for q in p.quota) and not abort.is_set():
                # Fail-over: the session reconnects by itself, so what an
                # asynchronous standby never received (acknowledged, then
                # lost) shows only in the database: once the fail-over is
                # over, what is owed is read again from there.
                while not counters[PROMOTED] and not abort.is_set():
                    abort.wait(0.05)
                if not p.resume(abort):
                    return True
    return True


def _consume(args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any) -> None:
    state: dict[str, Any] = {}
    _retrying(
        args,
        counters,
        abort,
        lambda: _consume_session(args, counters, producers_done, abort, state),
    )


def _consume_session(
    args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, state: dict[str, Any]
) -> bool:
    ref = args.queues[args.index]
    cfg = args.config
    rng = random.Random(args.seed)
    base = args.slot * WORDS
    table = S.received_table(ref.name)
    stmt = S.q(S.INSERT_RECEIVED_GROUPED if ref.grouped else S.INSERT_RECEIVED, args.run_id, table)
    # A few times per cycle the consumer stops until producers find the queue
    # full (or STALL_MAX_S passes): the queues are driven full, not just busy.
    # Each stop comes when exactly ``n`` entries were taken (the batches before
    # it are cut to fit), with n at most 60% of the cycle and leaving more than
    # a ring's worth still to take: while the consumer stands still the
    # producers owe the queue more entries than it holds, so some enqueue must
    # find it full. (Only with entries_per_queue > capacity can a queue fill.)
    # (The grouped queue's consumers instead wait together once, at the start.)
    early = max(1, min(cfg.entries_per_queue * 6 // 10, cfg.entries_per_queue - cfg.capacity - 1))
    stalls = state.setdefault(
        "stalls",
        []
        if ref.grouped
        else sorted(rng.sample(range(1, early + 1), min(early, rng.randint(1, 2)))),
    )
    filled = args.first_slot * WORDS + C_FILLED
    pid = os.getpid()
    left_sql = S.q(S.LEFTOVERS, args.run_id, queue_table(ref.name))
    with connect(
        args.dsn, producer=f"regress-{args.run_id}-c{args.index}", application_name="ringq-regress"
    ) as s:
        # Resume from what the table durably holds: a killed predecessor's (or
        # a lost session's) open dequeue rolled back with its rows.
        if args.config.resilient and not _wait_recovered(s, abort):
            return True
        if ref.grouped:
            resume = S.q(S.RESUME_GROUPED_CONSUMER, args.run_id, table)
            row = s.connection.execute(resume, (args.cycle, args.worker)).fetchone()
        else:
            row = s.connection.execute(
                S.q(S.RESUME_CONSUMER, args.run_id, table), (args.cycle,)
            ).fetchone()
        s.commit()
        assert row is not None
        order, taken = int(row[0]), int(row[1])
        if taken:
            counters[base + RESUMED] += 1
            rng.seed(f"{args.seed}:{order}:{pid}")
            stalls[:] = [n for n in stalls if n > taken]
        counters[base + C_ENTRIES] = taken
        if ref.grouped and not counters[filled]:
            counters[base + C_STALLS] += 1
            if _wait_full(
                s,
                ref.name,
                producers_done,
                abort,
                max(STALL_MAX_S, cfg.capacity / STALL_MIN_RATE),
                others_saw=lambda: bool(counters[filled]),
                grace=STALL_START_GRACE_S,
            ):
                counters[filled] = 1
        while not abort.is_set():
            finished = producers_done.is_set()  # read before the dequeue: no entry can come after
            n = rng.choice((1, 1, 4, 16, 32, 64))
            if stalls:
                n = max(1, min(n, stalls[0] - taken))
            msgs = s.dequeue_many(ref.name, n, wait=POLL_S)
            deq_ns = time.monotonic_ns()
            counters[base + HEARTBEAT] += 1
            if not msgs:
                if finished:
                    # Nothing left, unless a dead client (or a lost session)
                    # still holds an entry that recovery has yet to give back.
                    (left,) = s.connection.execute(left_sql).fetchone() or (0,)
                    s.commit()
                    if not left:
                        return True
                continue
            seqs, orders, dels, payloads, groups = [], [], [], [], []
            for m in msgs:
                order += 1
                seqs.append(m.seq)
                orders.append(order)
                dels.append(m.deliveries)
                payloads.append(m.payload)
                groups.append(m.group)
            # The grouped queue's record (and the commit right after it): the
            # entries are held from deq_ns until at least commit_ns.
            s.connection.execute(
                stmt,
                {
                    "cycle": args.cycle,
                    "consumer": pid,
                    "qseqs": seqs,
                    "orders": orders,
                    "deliveries": dels,
                    "payloads": payloads,
                    "worker": args.worker,
                    "groups": groups,
                    "deq_ns": deq_ns,
                    "commit_ns": time.monotonic_ns(),
                },
            )
            if rng.random() < cfg.consumer_rollback_rate and all(m.deliveries == 1 for m in msgs):
                # Only first deliveries: an entry is never struck out to the
                # exception queue by our own choice.
                s.rollback()
                counters[base + C_RB_TX] += 1
                continue
            s.commit()
            if cfg.chaos_failover is not None and not counters[base + C_FIRST_AFTER]:
                now_us, promoted = int(time.monotonic() * 1e6), counters[PROMOTED]
                if promoted and now_us >= promoted:
                    counters[base + C_FIRST_AFTER] = now_us
            taken += len(msgs)
            counters[base + C_ENTRIES] += len(msgs)
            counters[base + C_TX] += 1
            counters[base + C_REDELIVERED] += sum(1 for m in msgs if m.deliveries > 1)
            if stalls and taken >= stalls[0]:
                stalls.pop(0)
                counters[base + C_STALLS] += 1
                _wait_full(
                    s,
                    ref.name,
                    producers_done,
                    abort,
                    max(STALL_MAX_S, cfg.capacity / STALL_MIN_RATE),
                )
    return True


def _wait_full(
    s: Session,
    queue: str,
    producers_done: Any,
    abort: Any,
    max_s: float,
    others_saw: Callable[[], bool] = lambda: False,
    grace: float = 0.0,
) -> bool:
    """Stop dequeuing until a producer finds the queue full, the producers stop
    feeding it (its head has not moved for STALL_IDLE_S), ``max_s`` seconds pass,
    or ``others_saw()`` (another consumer of the queue saw it full). The head
    may stand still ``grace`` seconds more at first (producers starting). True
    if this one saw it full."""
    st = s.stats(queue)
    start, head = st[M.FULL_HITS], st[M.HEAD]
    now = time.monotonic()
    deadline, moved = now + max_s, now + grace
    while (
        now < deadline
        and now - moved < STALL_IDLE_S
        and not producers_done.is_set()
        and not abort.is_set()
        and not others_saw()
    ):
        st = s.stats(queue)
        if st[M.FULL_HITS] > start:
            return True
        if st[M.HEAD] != head:
            head, moved = st[M.HEAD], now
        time.sleep(0.02)
        now = time.monotonic()
    return False


# -- the cycle -----------------------------------------------------------------------------

_CTX: Any = None


def _context() -> Any:
    global _CTX
    if _CTX is None:
        # A fork server that imported only this module: workers start fast and
        # inherit no connection, section mapping, thread or JVM from the parent.
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["ringq.regression._workload"])
        _CTX = ctx
    return _CTX


def quotas(entries_per_queue: int, producers: int, queues: int) -> list[tuple[int, ...]]:
    """Split each queue's entries among producers (as evenly as integers allow)."""
    base, extra = divmod(entries_per_queue, producers)
    return [tuple(base + (1 if p < extra else 0) for _ in range(queues)) for p in range(producers)]


def run_cycle(
    dsn: str,
    run: RunInfo,
    cycle: int,
    *,
    progress: Callable[[Progress], None] | None = None,
    abort_requested: Callable[[], bool] | None = None,
    monitor_dir: Path | None = None,
    monitor_dsns: tuple[str, ...] = (),
) -> CycleResult:
    """Run one cycle's workload to its end and return what it did.

    With chaos, the monitor killed is the cycle's own, or, if one already
    serves the database, that one, found by its state file in ``monitor_dir``
    and restarted as it was (see :mod:`ringq.regression._monitors`).

    With ``chaos_failover`` (``dsn`` is then the multi-host DSN of
    :func:`ringq.regression._failover.prepare`), the primary is killed and
    its standby promoted once the cycle has committed 30-60% of its entries,
    and the old primary is rebuilt as a standby when the workload ends. A
    monitor already serving the database (on ``dsn`` or one of
    ``monitor_dsns``) is restarted at once on ``dsn``, so that it follows.

    The cycle ends when every producer has committed its share and every
    consumer has found its queue empty after that. ``abort_requested`` is polled
    (every 0.2 s); when it returns True the workers are stopped and the cycle
    is marked aborted. A cycle without any progress for ``stall_timeout``
    seconds is aborted as stalled.
    """
    cfg = run.config
    ctx = _context()
    nq, np_ = len(run.queues), cfg.producers
    # (queue, worker) of each consumer: one per queue, grouped_consumers for the grouped one
    taking = [
        (q, w)
        for q, ref in enumerate(run.queues)
        for w in range(cfg.grouped_consumers if ref.grouped else 1)
    ]
    nc = len(taking)
    counters = ctx.Array("q", (np_ + nc) * WORDS + 1, lock=False)  # + PROMOTED
    producers_done = ctx.Event()
    abort = ctx.Event()
    errors_q = ctx.Queue()
    base_seed = cfg.seed if cfg.seed is not None else random.SystemRandom().getrandbits(48)
    seeds = random.Random(f"{base_seed}:{cycle}")
    expected = cfg.entries_per_queue * nq
    failover = (
        Failover(dsn, cfg.chaos_failover, random.Random(f"{base_seed}:{cycle}:failover"), expected)
        if cfg.chaos_failover is not None
        else None
    )
    ack_dir = tempfile.mkdtemp(prefix="ringq-regress-acks-") if failover is not None else ""

    def args(
        index: int, slot: int, quota: tuple[int, ...] = (), worker: int = 0, first_slot: int = 0
    ) -> WorkerArgs:
        return WorkerArgs(
            dsn, run.run_id, cycle, cfg, run.queues, index, slot, seeds.getrandbits(63), quota,
            ack_dir if quota else "", worker, first_slot,
        )

    # (target, args, name) of each worker: a killed one is started again from it.
    specs: list[tuple[Any, tuple[Any, ...], str]] = [
        (
            consumer_main,
            (
                args(q, np_ + c, worker=w, first_slot=np_ + c - w),
                counters, producers_done, abort, errors_q,
            ),
            f"regress-consumer-{q}.{w}" if run.queues[q].grouped else f"regress-consumer-{q}",
        )
        for c, (q, w) in enumerate(taking)
    ] + [
        (producer_main, (args(p, p, quota), counters, abort, errors_q), f"regress-producer-{p}")
        for p, quota in enumerate(quotas(cfg.entries_per_queue, np_, nq))
    ]
    workers = [ctx.Process(target=t, args=a, name=n) for t, a, n in specs]
    consumers, producers = workers[:nc], workers[nc:]
    chaos = (
        _Chaos(dsn, cfg, random.Random(f"{base_seed}:{cycle}:chaos"), monitor_dir, monitor_dsns)
        if cfg.resilient
        else None
    )
    status = "done"
    errors: list[str] = []
    max_depth = [0] * nq

    with connect(dsn, application_name="ringq-regress") as watcher:
        before = [watcher.stats(ref.name) for ref in run.queues]
        watcher.commit()  # the queue lookups above opened a transaction; stats need none
        t0 = time.monotonic()
        if chaos is not None:
            chaos.start(t0)
        for proc in workers:
            proc.start()
        last_beat, last_change = -1, time.monotonic()
        depths = [0] * nq
        try:
            while True:
                if chaos is not None and status == "done":
                    failed = False
                    for i, proc in enumerate(workers):
                        # Read once: exitcode polls, and a worker chaos just
                        # killed may die between two reads.
                        code = proc.exitcode
                        if code is None or code == 0:
                            continue
                        if chaos.was_killed(proc):
                            t, a, n = specs[i]
                            workers[i] = ctx.Process(target=t, args=a, name=n)
                            workers[i].start()
                        else:
                            # Not killed by chaos: failed. Its share would
                            # never come, so the others would wait for it forever.
                            failed = True
                    consumers, producers = workers[:nc], workers[nc:]
                    if failed:
                        status = "failed"
                        abort.set()
                        _stop(consumers + producers)
                alive = [p for p in workers if p.exitcode is None]
                if (
                    not producers_done.is_set()
                    and all(p.exitcode is not None for p in producers)
                    and (chaos is None or all(p.exitcode == 0 for p in producers))
                ):
                    producers_done.set()
                if not alive:
                    break
                multiprocessing.connection.wait([p.sentinel for p in alive], timeout=POLL_S)
                now = time.monotonic()
                if chaos is not None and status == "done":
                    chaos.tick(now, producers, consumers, producers_done.is_set())
                committed = sum(counters[p * WORDS + P_ENTRIES] for p in range(np_))
                if failover is not None and status == "done" and failover.due(committed):
                    failover.strike()  # kill -9 of the primary, promotion: about a second
                    counters[PROMOTED] = int(failover.promoted_at * 1e6) or 1
                    now = time.monotonic()
                try:
                    depths = [watcher.stats(ref.name)[M.DEPTH] for ref in run.queues]
                except LOST_SESSION:
                    if chaos is None:
                        raise
                    watcher.close()
                    watcher = _reconnect_watcher(dsn)
                max_depth = [max(a, b) for a, b in zip(max_depth, depths, strict=True)]
                beat = sum(counters[i * WORDS + HEARTBEAT] for i in range(np_ + nc))
                if beat != last_beat:
                    last_beat, last_change = beat, now
                if progress is not None:
                    progress(
                        Progress(
                            cycle=cycle,
                            elapsed_s=now - t0,
                            expected=expected,
                            committed=committed,
                            received=sum(
                                counters[(np_ + c) * WORDS + C_ENTRIES] for c in range(nc)
                            ),
                            rolled_back_tx=sum(counters[p * WORDS + P_RB_TX] for p in range(np_)),
                            full_tx=sum(counters[p * WORDS + P_FULL_TX] for p in range(np_)),
                            depth=depths,
                            capacity=cfg.capacity,
                        )
                    )
                if status == "done" and abort_requested is not None and abort_requested():
                    status = "aborted"
                    abort.set()
                    _stop(consumers + producers)
                elif status == "done" and now - last_change > cfg.stall_timeout:
                    status = "stalled"
                    errors.append(
                        f"no progress for {cfg.stall_timeout:g}s: the cycle was aborted "
                        f"(depths {depths}, workers alive: {[p.name for p in alive]})"
                    )
                    abort.set()
                    _stop(consumers + producers)
        except BaseException:
            abort.set()
            _stop(consumers + producers)
            if chaos is not None:
                chaos.stop()
            raise
        workload_s = time.monotonic() - t0
        if chaos is not None:
            chaos.stop()
        if failover is not None:
            failover.finish()  # the old primary back as a standby of the new one
        try:
            after = [watcher.stats(ref.name) for ref in run.queues]
        except LOST_SESSION:
            watcher.close()
            watcher = _reconnect_watcher(dsn)
            after = [watcher.stats(ref.name) for ref in run.queues]
        watcher.close()

    while not errors_q.empty():
        errors.append(errors_q.get_nowait())
    if status != "aborted":
        for proc in consumers + producers:
            if proc.exitcode == 0:
                continue
            if status == "done":
                status = "failed"
            _, role, index = proc.name.split("-")
            if not any(e.startswith(f"{role} {index} ") for e in errors):
                errors.append(f"{role} {index} exited with code {proc.exitcode}")
    errors_q.close()

    def total(slots: Sequence[int], word: int) -> int:
        return int(sum(counters[i * WORDS + word] for i in slots))

    prod_slots, cons_slots = range(np_), range(np_, np_ + nc)
    stats: dict[str, Any] = {
        "seed": base_seed,
        "producers": {
            "committed_entries": total(prod_slots, P_ENTRIES),
            "committed_tx": total(prod_slots, P_TX),
            "two_phase_tx": total(prod_slots, P_TX_2PC),
            "multi_queue_tx": total(prod_slots, P_MULTI_TX),
            "rolled_back_tx": total(prod_slots, P_RB_TX),
            "full_rolled_back_tx": total(prod_slots, P_FULL_TX),
            "rolled_back_entries": total(prod_slots, P_RB_ENTRIES),
        },
        "consumers": {
            "committed_entries": total(cons_slots, C_ENTRIES),
            "committed_tx": total(cons_slots, C_TX),
            "rolled_back_tx": total(cons_slots, C_RB_TX),
            "stalls": total(cons_slots, C_STALLS),
            "redelivered": total(cons_slots, C_REDELIVERED),
        },
        "chaos": chaos.report(counters, range(np_ + nc)) if chaos is not None else None,
        "failover": None,
        "queues": {
            ref.name: {
                "payload_size": ref.payload_size,
                "max_depth": max_depth[i],
                **{k: int(after[i][k] - before[i][k]) for k in STATS_KEYS},
            }
            for i, ref in enumerate(run.queues)
        },
    }
    if status != "aborted":
        left = _store.leftovers(dsn, run)
        for name, count in left.items():
            stats["queues"][name]["leftover"] = count
    if failover is not None:
        firsts = [counters[i * WORDS + C_FIRST_AFTER] for i in cons_slots]
        first = min((t for t in firsts if t), default=0)
        stats["failover"] = failover.report(first / 1e6 if first else None)
        try:
            stats["failover"]["acknowledged"] = failover.store_acks(
                dsn, run.run_id, cycle, Path(ack_dir)
            )
        finally:
            shutil.rmtree(ack_dir, ignore_errors=True)
        errors.extend(failover.errors)
        if status == "done" and not failover.promoted_at and not failover.errors:
            errors.append(
                f"fail-over: the cycle ended before {failover.at:,} entries were committed: "
                "no primary was killed"
            )
    return CycleResult(cycle, status, workload_s, stats, errors)


def _stop(procs: Sequence[Any]) -> None:
    """Give workers JOIN_S to notice the abort, then terminate, then kill."""
    deadline = time.monotonic() + JOIN_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    for p in procs:
        p.join(2.0)
        if p.exitcode is None:
            p.kill()
            p.join()


def _reconnect_watcher(dsn: str) -> Session:
    """The parent's stats session, opened again after PostgreSQL restarted."""
    deadline = time.monotonic() + 60.0
    while True:
        try:
            w = connect(dsn, application_name="ringq-regress")
            w.commit()
            return w
        except LOST_SESSION:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


# -- chaos -----------------------------------------------------------------------------------


class _Chaos:
    """Fault injection of a cycle: every ``chaos_interval`` seconds kill -9 a
    random producer, consumer or the monitor (restarted at once; the workers
    are restarted by the cycle's loop), and with ``chaos_pg_restart`` restart
    the embedded PostgreSQL once (``pg_ctl restart -m fast``). The monitor is
    the cycle's own, or the one already serving the database, taken over
    (:mod:`._monitors`). Killing stops once the producers are done, so the
    cycle can drain. Without ``chaos`` (a ``chaos_failover`` cycle alone) it
    only runs the monitor, on the DSN that follows the primary.

    :raises ForeignMonitor: (start) a monitor serves the database that cannot be taken over.
    """

    def __init__(
        self,
        dsn: str,
        cfg: RegressConfig,
        rng: random.Random,
        monitor_dir: Path | None = None,
        monitor_dsns: tuple[str, ...] = (),
    ) -> None:
        self.dsn = dsn
        self.monitor_dsns = monitor_dsns
        self.cfg = cfg
        self.rng = rng
        self.monitor_dir = monitor_dir
        self.kills = {"producers": 0, "consumers": 0, "monitor": 0, "pg_restarts": 0}
        self.killed: set[int] = set()  # pids we killed (their exit is not a failure)
        self.monitor: OwnMonitor | TakenMonitor | None = None
        self.next_at = 0.0
        self.events = 0
        self.pg_event = rng.randint(2, 3) if cfg.chaos_pg_restart else -1
        # The first kills cover every kind (in random order), then any kind.
        self.first_kinds = ["producers", "consumers", "monitor"]
        rng.shuffle(self.first_kinds)
        self.pg_errors: list[str] = []
        self.logdir = ""

    def start(self, now: float) -> None:
        serving = serving_monitor(self.dsn, self.monitor_dir, also=self.monitor_dsns)
        self.logdir = tempfile.mkdtemp(prefix="ringq-regress-chaos-")
        if serving is None:
            self.monitor = OwnMonitor(self.dsn, self.logdir)
        elif self.cfg.chaos_failover is not None:
            # Restarted at once on the DSN that follows the primary: on a
            # single-host DSN it would lose the database for good at the kill.
            self.monitor = TakenMonitor(serving, self.logdir, dsn=self.dsn)
            if serving.dsn_option() != self.dsn:
                self.monitor.kill()
        else:
            self.monitor = TakenMonitor(serving, self.logdir)
        self.monitor.start()
        self._schedule(now)

    def _schedule(self, now: float) -> None:
        lo, hi = self.cfg.chaos_interval
        self.next_at = now + self.rng.uniform(lo, hi)

    def was_killed(self, proc: Any) -> bool:
        if proc.pid in self.killed:
            self.killed.discard(proc.pid)
            return True
        return False

    def tick(
        self, now: float, producers: Sequence[Any], consumers: Sequence[Any], producers_done: bool
    ) -> None:
        if self.monitor is not None:
            self.monitor.tick()  # restarts it if it died, follows a restart under way
        if not self.cfg.chaos or producers_done or now < self.next_at:
            return
        self.events += 1
        if self.events == self.pg_event:
            self._restart_pg()
        else:
            choices = {
                "producers": [
                    p for p in producers if p.exitcode is None and p.pid not in self.killed
                ],
                "consumers": [
                    c for c in consumers if c.exitcode is None and c.pid not in self.killed
                ],
                "monitor": [self.monitor]
                if self.monitor is not None and self.monitor.alive()
                else [],
            }
            kinds = [k for k, v in choices.items() if v]
            first = [k for k in self.first_kinds if k in kinds]
            if first:
                kinds = first[:1]
                self.first_kinds.remove(first[0])
            if kinds:
                kind = self.rng.choice(kinds)
                victim = self.rng.choice(choices[kind])
                if kind == "monitor":
                    if victim.kill():  # and restart it
                        self.kills[kind] += 1
                else:
                    try:
                        os.kill(victim.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    else:
                        self.kills[kind] += 1
                        self.killed.add(victim.pid)
        self._schedule(time.monotonic())

    def _restart_pg(self) -> None:
        try:
            cluster = embedded_cluster(self.dsn)
            if cluster is None:
                self.pg_errors.append(
                    "the DSN is not the embedded cluster: PostgreSQL not restarted"
                )
                return
            log = cluster.datadir / "log" / "startup.log"
            proc = cluster._pg_ctl("restart", "-m", "fast", "-t", "60", "-l", str(log))
            if proc.returncode != 0:
                self.pg_errors.append(f"pg_ctl restart failed: {proc.stdout.strip()[-300:]}")
                return
            self.kills["pg_restarts"] += 1
        except Exception as exc:  # noqa: BLE001 - reported, the cycle goes on
            self.pg_errors.append(f"PostgreSQL restart failed: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Stop the cycle's own monitor; leave a taken-over one serving (restarted if need be)."""
        if self.monitor is not None:
            self.monitor.stop()

    def report(self, counters: Any, slots: Sequence[int]) -> dict[str, Any]:
        return {
            **self.kills,
            "interval_s": list(self.cfg.chaos_interval),
            "monitor_starts": self.monitor.starts if self.monitor is not None else 0,
            "monitor_taken_over": bool(self.monitor is not None and self.monitor.taken_over),
            "monitor_url": self.monitor.url if self.monitor is not None else None,
            "reconnects": int(sum(counters[i * WORDS + RECONNECTS] for i in slots)),
            "resumed": int(sum(counters[i * WORDS + RESUMED] for i in slots)),
            "errors": self.pg_errors + (self.monitor.errors if self.monitor is not None else []),
            "logs": self.logdir,
        }
