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

Every process makes its own session after it starts (nothing crosses a fork:
the processes come from a fork server that has never opened a connection).
Workers ignore SIGINT: the parent decides when a cycle stops.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringq.engine import QueueFull, Session, connect
from ringq.engine import metrics as M

from . import _payload as P
from . import _sql as S
from . import _store
from ._config import RegressConfig
from ._store import QueueRef, RunInfo

# -- shared counters: one block of WORDS int64 per worker (each writes only its own) --
WORDS = 8
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
HEARTBEAT = 7  # any step at all (the watchdog's progress measure)

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
# A consumer waits at most this long for producers to find its queue full. Long
# enough for a 2,000-slot queue to fill at the ~100 entries/s a small-payload
# queue gets while the producers are held back by the large-payload queue.
STALL_MAX_S = 30.0
STALL_IDLE_S = 3.0  # ... and gives up sooner when no producer writes to it any more
JOIN_S = 10.0  # grace for workers after an abort before they are terminated


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
        errors.put(f"{role} {args.index} (pid {os.getpid()}): {type(exc).__name__}: {exc}")
        errors.close()
        errors.join_thread()  # os._exit does not wait for the queue's feeder thread
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)


def producer_main(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    _worker("producer", _produce, args, counters, abort, errors)


def consumer_main(args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any) -> None:
    _worker("consumer", _consume, args, counters, producers_done, abort, errors)


class _Producer:
    def __init__(self, args: WorkerArgs, s: Session, counters: Any) -> None:
        self.a = args
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

    def plan(self) -> list[tuple[int, int]]:
        """(queue index, entries) for the next transaction."""
        open_ = [q for q, left in enumerate(self.quota) if left > 0]
        nq = min(len(open_), self.rng.choice((1, 1, 2, 2, 3, len(open_))))
        chosen = self.rng.sample(open_, nq)
        return [(q, self.rng.randint(1, min(self.quota[q], self.max_per_tx))) for q in chosen]

    def payload(self, q: int, kind: int) -> tuple[int, int, bytes]:
        self.pseq += 1
        size = self.a.queues[q].payload_size
        rng = self.rng if self.cfg.filler == "random" else None
        return self.pseq, size, P.build(kind, q, self.a.index, self.pseq, size, rng=rng)

    def transaction(self) -> None:
        s, rng = self.s, self.rng
        self.tx += 1
        plan = self.plan()
        kind = P.KIND_TWO_PHASE if rng.random() < self.cfg.two_phase_rate else P.KIND_SIMPLE
        rollback = rng.random() < self.cfg.rollback_rate
        timeout = self.cfg.enqueue_timeout * rng.uniform(0.5, 1.0)
        done: list[tuple[int, int, int, int, bytes]] = []  # (queue, qseq, pseq, length, digest)
        if kind == P.KIND_TWO_PHASE:
            s.tpc_begin(s.xid(f"regress_{self.a.run_id}_c{self.a.cycle}_p{self.a.index}_t{self.tx}"))
        try:
            if rng.random() < 0.5:
                # One statement per queue.
                for q, n in plan:
                    items = [self.payload(q, kind) for _ in range(n)]
                    seqs = s.enqueue_many(self.a.queues[q].name, [p for _, _, p in items], timeout=timeout)
                    done.extend((q, seq, ps, ln, P.digest(p)) for seq, (ps, ln, p) in zip(seqs, items, strict=True))
            else:
                # One call per entry, the queues interleaved.
                order = [q for q, n in plan for _ in range(n)]
                rng.shuffle(order)
                for q in order:
                    ps, ln, p = self.payload(q, kind)
                    seq = s.enqueue(self.a.queues[q].name, p, timeout=timeout)
                    done.append((q, seq, ps, ln, P.digest(p)))
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
            s.tpc_commit()
            self.bump(P_TX_2PC)
        else:
            s.commit()
        for q, n in plan:
            self.quota[q] -= n
        self.bump(P_ENTRIES, len(done))
        self.bump(P_TX)
        if len(plan) > 1:
            self.bump(P_MULTI_TX)

    def record(self, stmt: Any, done: list[tuple[int, int, int, int, bytes]], kind: int, *extra: Any) -> None:
        if not done:
            return
        qs, seqs, pseqs, lens, digests = (list(col) for col in zip(*done, strict=True))
        params: tuple[Any, ...]
        if extra:
            params = (self.a.cycle, self.a.index, self.tx, kind, *extra, qs, seqs, pseqs, lens, digests)
        else:
            params = (self.a.cycle, self.a.index, self.tx, kind, qs, seqs, pseqs, lens, digests)
        self.s.connection.execute(stmt, params)

    def log_rolled_back(self, done: list[tuple[int, int, int, int, bytes]], kind: int, reason: str) -> None:
        if not done:
            return
        self.record(self.rb_sql, done, kind, reason)
        self.s.commit()
        self.bump(P_RB_ENTRIES, len(done))


def _produce(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    with connect(args.dsn, producer=f"regress-{args.run_id}-p{args.index}", application_name="ringq-regress") as s:
        p = _Producer(args, s, counters)
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


def _consume(args: WorkerArgs, counters: Any, producers_done: Any, abort: Any, errors: Any) -> None:
    ref = args.queues[args.index]
    cfg = args.config
    rng = random.Random(args.seed)
    base = args.slot * WORDS
    stmt = S.q(S.INSERT_RECEIVED, args.run_id, S.received_table(ref.name))
    # A few times per cycle the consumer stops until producers find the queue
    # full (or STALL_MAX_S passes): the queues are driven full, not just busy.
    # In the first 60% of the cycle: later, producers may owe this queue too
    # little to fill it.
    early = max(1, cfg.entries_per_queue * 6 // 10)
    stalls = sorted(rng.sample(range(1, early + 1), min(early, rng.randint(1, 2))))
    pid = os.getpid()
    order = 0
    taken = 0
    with connect(args.dsn, producer=f"regress-{args.run_id}-c{args.index}", application_name="ringq-regress") as s:
        while not abort.is_set():
            finished = producers_done.is_set()  # read before the dequeue: no entry can come after
            n = rng.choice((1, 1, 4, 16, 32, 64))
            msgs = s.dequeue_many(ref.name, n, wait=POLL_S)
            counters[base + HEARTBEAT] += 1
            if not msgs:
                if finished:
                    break
                continue
            seqs, orders, dels, payloads = [], [], [], []
            for m in msgs:
                order += 1
                seqs.append(m.seq)
                orders.append(order)
                dels.append(m.deliveries)
                payloads.append(m.payload)
            s.connection.execute(stmt, (args.cycle, pid, seqs, orders, dels, payloads))
            if rng.random() < cfg.consumer_rollback_rate and all(m.deliveries == 1 for m in msgs):
                # Only first deliveries: an entry is never struck out to the
                # exception queue by our own choice.
                s.rollback()
                counters[base + C_RB_TX] += 1
                continue
            s.commit()
            taken += len(msgs)
            counters[base + C_ENTRIES] += len(msgs)
            counters[base + C_TX] += 1
            counters[base + C_REDELIVERED] += sum(1 for m in msgs if m.deliveries > 1)
            if stalls and taken >= stalls[0]:
                stalls.pop(0)
                counters[base + C_STALLS] += 1
                _wait_full(s, ref.name, producers_done, abort)


def _wait_full(s: Session, queue: str, producers_done: Any, abort: Any) -> None:
    """Stop dequeuing until a producer finds the queue full, the producers stop
    feeding it (its head has not moved for STALL_IDLE_S), or STALL_MAX_S passes."""
    st = s.stats(queue)
    start, head = st[M.FULL_HITS], st[M.HEAD]
    now = time.monotonic()
    deadline, moved = now + STALL_MAX_S, now
    while now < deadline and now - moved < STALL_IDLE_S and not producers_done.is_set() and not abort.is_set():
        st = s.stats(queue)
        if st[M.FULL_HITS] > start:
            return
        if st[M.HEAD] != head:
            head, moved = st[M.HEAD], now
        time.sleep(0.02)
        now = time.monotonic()


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
) -> CycleResult:
    """Run one cycle's workload to its end and return what it did.

    The cycle ends when every producer has committed its share and every
    consumer has found its queue empty after that. ``abort_requested`` is polled
    (every 0.2 s); when it returns True the workers are stopped and the cycle
    is marked aborted. A cycle without any progress for ``stall_timeout``
    seconds is aborted as stalled.
    """
    cfg = run.config
    ctx = _context()
    nq, np_ = len(run.queues), cfg.producers
    counters = ctx.Array("q", (np_ + nq) * WORDS, lock=False)
    producers_done = ctx.Event()
    abort = ctx.Event()
    errors_q = ctx.Queue()
    base_seed = cfg.seed if cfg.seed is not None else random.SystemRandom().getrandbits(48)
    seeds = random.Random(f"{base_seed}:{cycle}")

    def args(index: int, slot: int, quota: tuple[int, ...] = ()) -> WorkerArgs:
        return WorkerArgs(dsn, run.run_id, cycle, cfg, run.queues, index, slot, seeds.getrandbits(63), quota)

    consumers = [
        ctx.Process(
            target=consumer_main,
            args=(args(q, np_ + q), counters, producers_done, abort, errors_q),
            name=f"regress-consumer-{q}",
        )
        for q in range(nq)
    ]
    producers = [
        ctx.Process(target=producer_main, args=(args(p, p, quota), counters, abort, errors_q), name=f"regress-producer-{p}")
        for p, quota in enumerate(quotas(cfg.entries_per_queue, np_, nq))
    ]
    expected = cfg.entries_per_queue * nq
    status = "done"
    errors: list[str] = []
    max_depth = [0] * nq

    with connect(dsn, application_name="ringq-regress", eager_begin=False) as watcher:
        before = [watcher.stats(ref.name) for ref in run.queues]
        watcher.commit()  # the queue lookups above opened a transaction; stats need none
        t0 = time.monotonic()
        for proc in consumers + producers:
            proc.start()
        last_beat, last_change = -1, time.monotonic()
        try:
            while True:
                alive = [p for p in consumers + producers if p.exitcode is None]
                if not producers_done.is_set() and all(p.exitcode is not None for p in producers):
                    producers_done.set()
                if not alive:
                    break
                multiprocessing.connection.wait([p.sentinel for p in alive], timeout=POLL_S)
                now = time.monotonic()
                depths = [watcher.stats(ref.name)[M.DEPTH] for ref in run.queues]
                max_depth = [max(a, b) for a, b in zip(max_depth, depths, strict=True)]
                beat = sum(counters[i * WORDS + HEARTBEAT] for i in range(np_ + nq))
                if beat != last_beat:
                    last_beat, last_change = beat, now
                if progress is not None:
                    progress(
                        Progress(
                            cycle=cycle,
                            elapsed_s=now - t0,
                            expected=expected,
                            committed=sum(counters[p * WORDS + P_ENTRIES] for p in range(np_)),
                            received=sum(counters[(np_ + q) * WORDS + C_ENTRIES] for q in range(nq)),
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
            raise
        workload_s = time.monotonic() - t0
        after = [watcher.stats(ref.name) for ref in run.queues]

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

    prod_slots, cons_slots = range(np_), range(np_, np_ + nq)
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
        for name, n in left.items():
            stats["queues"][name]["leftover"] = n
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
