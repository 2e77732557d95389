"""The producer process of a regression cycle.

Producers (``config.producers`` processes) write random numbers of entries to
random queues, often several queues in one transaction, as simple or two-phase
transactions, some deliberately rolled back; they alternate bursts, trickles
and pauses, so the queues are driven full and empty. Each records what it
committed in ``sent`` inside the same transaction as the enqueues (the ground
truth), and every rolled-back entry in ``rolled_back`` right after the rollback.
On the grouped queue each entry goes to a random group of ``groups``.
With ``delayed_share``, that share of the entries is enqueued with a random
delay (up to ``max_delay``): the producer records the delay in ``due`` in
the same transaction and, right after the commit, the due time the database
gave the row (its ``not_before``: the delay counts from the row's write, at
the commit).

A producer killed by chaos (or whose session was lost) is started again and
resumes from what the database durably holds for it (:meth:`_Producer.resume`).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import psycopg
from ringq.engine import QueueFull, Session, connect, queue_table

from . import _payload as P
from . import _queries as S
from . import _worker as W
from ._failover import AckLog
from ._worker import WorkerArgs, retrying, run_worker, wait_recovered

# An entry a producer wrote: (queue, qseq, pseq, length, digest, group or None).
Entry = tuple[int, int, int, int, bytes, str | None]
# A delayed entry: (queue, qseq, delay in seconds).
Delayed = tuple[int, int, float]


def producer_main(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    """The producer process's target (started by the cycle, again after a chaos kill)."""
    run_worker("producer", _produce, args, counters, abort, errors)


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
        self.base = args.slot * W.WORDS
        self.quota = list(args.quota)
        self.pseq = 0
        self.tx = 0
        # At most a quarter of a ring per producer in one transaction, so
        # producers' open reservations alone cannot fill a queue.
        self.max_per_tx = max(1, min(50, self.cfg.capacity // (4 * self.cfg.producers)))
        self.sent_sql = S.q(S.INSERT_SENT, args.run_id)
        self.rb_sql = S.q(S.INSERT_ROLLED_BACK, args.run_id)
        self.due_sql = S.q(S.INSERT_DUE, args.run_id)
        self.read_due_sql = [
            S.q(S.READ_DUE, args.run_id, queue_table(ref.name)) for ref in args.queues
        ]

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
        self.c[self.base + W.P_ENTRIES] = sum(committed)
        if self.pseq or self.tx:
            self.bump(W.RESUMED)
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
        """One transaction: enqueue a plan's entries, record them in ``sent``,
        then commit (simple or two-phase) or roll back on purpose; rolled back
        (and logged) instead when a queue stays full."""
        s, rng = self.s, self.rng
        self.tx += 1
        plan = self.plan()
        kind = P.KIND_TWO_PHASE if rng.random() < self.cfg.two_phase_rate else P.KIND_SIMPLE
        rollback = rng.random() < self.cfg.rollback_rate
        timeout = self.cfg.enqueue_timeout * rng.uniform(0.5, 1.0)
        done: list[Entry] = []
        delayed: list[Delayed] = []
        if kind == P.KIND_TWO_PHASE:
            s.tpc_begin(s.xid(self.gtrid(self.tx)))
        try:
            self.enqueue(plan, kind, timeout, done, delayed)
        except QueueFull:
            s.rollback()
            self.log_rolled_back(done, kind, "full")
            self.bump(W.P_FULL_TX)
            time.sleep(rng.uniform(0.01, 0.2))
            return
        self.record(self.sent_sql, done, kind)
        if delayed:
            dq, dseqs, delays = (list(col) for col in zip(*delayed, strict=True))
            s.connection.execute(
                self.due_sql,
                {"cycle": self.a.cycle, "queues": dq, "qseqs": dseqs, "delays": delays},
            )
        if rollback:
            reason = "deliberate"
            if kind == P.KIND_TWO_PHASE and rng.random() < 0.5:
                s.tpc_prepare()
                reason = "deliberate-prepared"
            s.rollback()
            self.log_rolled_back(done, kind, reason)
            self.bump(W.P_RB_TX)
            return
        self.commit(kind, done)
        if delayed:
            self.read_due(delayed)
        for q, n in plan:
            self.quota[q] -= n
        self.bump(W.P_ENTRIES, len(done))
        self.bump(W.P_TX)
        if len(plan) > 1:
            self.bump(W.P_MULTI_TX)

    def delay(self) -> float | None:
        """A delay for the next enqueue call (None: none), ``delayed_share`` of the time.
        (No random number is drawn without delays: such runs stay as they were.)"""
        cfg = self.cfg
        if cfg.delayed_share <= 0 or self.rng.random() >= cfg.delayed_share:
            return None
        return self.rng.uniform(0.0, cfg.max_delay)

    def enqueue(
        self,
        plan: list[tuple[int, int]],
        kind: int,
        timeout: float,
        done: list[Entry],
        delayed: list[Delayed],
    ) -> None:
        """Enqueue ``plan``'s entries, appending each to ``done`` as it is
        written (and the delayed ones to ``delayed``).

        :raises QueueFull: a queue stayed full ``timeout`` seconds (``done`` holds
            what was written before).
        """
        s, rng = self.s, self.rng
        if rng.random() < 0.5:
            # One statement per queue.
            for q, n in plan:
                items = [self.payload(q, kind) for _ in range(n)]
                ref = self.a.queues[q]
                delay = self.delay()
                seqs = s.enqueue_many(
                    ref.name,
                    [p for _, _, p, _ in items],
                    group=[g for _, _, _, g in items] if ref.grouped else None,
                    timeout=timeout,
                    delay=delay,
                )
                if delay is not None:
                    delayed.extend((q, seq, delay) for seq in seqs)
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
                delay = self.delay()
                seq = s.enqueue(self.a.queues[q].name, p, group=g, timeout=timeout, delay=delay)
                if delay is not None:
                    delayed.append((q, seq, delay))
                done.append((q, seq, ps, ln, P.digest(p), g))

    def commit(self, kind: int, done: list[Entry]) -> None:
        """Commit the transaction (two-phase: prepare, maybe record the decision,
        commit prepared), then log the entries as acknowledged (fail-over)."""
        s = self.s
        if kind == P.KIND_TWO_PHASE:
            s.tpc_prepare()
            if self.cfg.resilient and self.rng.random() < 0.5:
                # Record the decision as a coordinator would: if this process
                # dies before COMMIT PREPARED, the monitor commits for it.
                s.tpc_decide()
            s.tpc_commit()  # clears a recorded decision
            self.bump(W.P_TX_2PC)
        else:
            s.commit()
        if self.acks is not None:  # acknowledged: the commit returned
            self.acks.record(
                self.tx, s.connection.info.port, [(q, seq, ps) for q, seq, ps, *_ in done]
            )

    def read_due(self, delayed: list[Delayed]) -> None:
        """After the commit: store the due time the database gave each delayed
        entry (its row's ``not_before``), per queue, and commit. Right after
        the commit none can be consumed yet and its slot reused (a whole ring
        later) unless the engine released it early: the proof counts a due
        time not read."""
        by_queue: dict[int, list[int]] = {}
        for q, seq, _delay in delayed:
            by_queue.setdefault(q, []).append(seq)
        conn = self.s.connection
        for q, seqs in by_queue.items():
            cap = self.a.queues[q].capacity
            conn.execute(
                self.read_due_sql[q],
                {
                    "cycle": self.a.cycle,
                    "queue": q,
                    "qseqs": seqs,
                    "slots": [seq % cap for seq in seqs],
                },
            )
        self.s.commit()
        self.bump(W.P_DELAYED, len(delayed))

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
        self.bump(W.P_RB_ENTRIES, len(done))



def _gtrid(gid: str) -> str:
    try:
        return str(psycopg.Xid.from_string(gid).gtrid)
    except Exception:
        return gid



def _produce(args: WorkerArgs, counters: Any, abort: Any, errors: Any) -> None:
    acks = AckLog(Path(args.ack_dir) / f"p{args.index}.log") if args.ack_dir else None
    try:
        retrying(args, counters, abort, lambda: _produce_session(args, counters, abort, acks))
    finally:
        if acks is not None:
            acks.close()


def _produce_session(args: WorkerArgs, counters: Any, abort: Any, acks: AckLog | None) -> bool:
    with connect(
        args.dsn, producer=f"regress-{args.run_id}-p{args.index}", application_name="ringq-regress"
    ) as s:
        p = _Producer(args, s, counters, acks)
        if args.config.resilient and not wait_recovered(s, abort):
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
            counters[p.base + W.HEARTBEAT] += 1
            left -= 1
            if mode == "trickle":
                time.sleep(rng.uniform(0.0, 0.02))
            if args.ack_dir and not any(q > 0 for q in p.quota) and not abort.is_set():
                # Fail-over: the session reconnects by itself, so what an
                # asynchronous standby never received (acknowledged, then
                # lost) shows only in the database: once the fail-over is
                # over, what is owed is read again from there.
                while not counters[W.PROMOTED] and not abort.is_set():
                    abort.wait(0.05)
                if not p.resume(abort):
                    return True
    return True

