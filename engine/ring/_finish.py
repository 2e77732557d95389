"""Finishing a transaction's slots in a queue block once the database decided.

An enqueue's slot becomes ready (its cache record written first) or void;
a dequeue's slot consumed or ready again; then its entry lock is released.
A batch does each step as one array write over the block's words, in the
order the ring's crash rules ask (``_ring``'s module docstring): records
before ENQ, ENQ and DEQ before LCK is cleared, the tail moved last; a few
ops go one slot at a time (plain ints cost less than numpy's calls). Built
on the :class:`~._ring.Ring` (its one-slot finishes, its array unlocks) and
the ops in flight; called by the transaction and by the rows' decisions,
under the queue lock.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np

from ..section import layout as L
from ._kinds import DueWrite, OpKind, Write
from ._ops import Op, Run
from ._ring import VECTOR_FROM, Ring
from ._scan import SMALL_BATCH, bit_mask

# distinct enqueue times from which a batch's waits are bucketed by numpy (see _record_waits)
WAIT_VECTOR_FROM = 24


def finish_batch(
    ring: Ring,
    ops: Sequence[Op],
    owner: int,
    *,
    committed: bool,
    poisoned: set[tuple[int, int]],
    exclusive: bool,
    enq_at_us: int | None = None,
) -> tuple[int, int]:
    """Finish ``owner``'s slots ``ops`` once the database has decided:
    enqueued entries become ready (``committed``) or void, dequeued ones
    consumed (committed, or ``poisoned``: (slot, seq) pairs) or ready again.

    With ``enq_at_us`` (the rows' enqueue time in us), committed enqueues
    whose row write the op still carries (``fill``) are written to the
    payload cache before they become ready (but entries that carry a trace
    context: their dequeue reads the row, which holds it).

    Slots ``owner`` no longer holds (decided by recovery) are passed over.
    Records the latencies, reclaims once, and counts poisoned entries and
    wake-ups. Returns (ready, space): how many sleeping dequeuers and
    enqueuers the caller wakes (after releasing the lock).
    """
    # A few ops go one slot at a time (plain ints cost less than numpy's
    # per-call overhead), and so do entries with a due time (a delay, a
    # backoff): they wait rather than become ready (``_waiting``).
    if len(ops) < VECTOR_FROM or any(op.due_us for op in ops):
        n_ready = n_space = 0
        now_us = time.time_ns() // 1000 if committed else 0  # the commit, as the waits end
        for op in ops:
            if ring.held_by(op.slot, owner):  # else decided by recovery: never finish twice
                ready, space = _finish_op(ring, op, committed, poisoned, exclusive, enq_at_us,
                                          now_us)
                n_ready += ready
                n_space += space
        return after_finish(ring, n_ready, n_space)
    Q, b = ring.Q, ring.qb
    s = ring.sec
    n_ready = n_space = n_poisoned = 0
    enq = [op for op in ops if op.kind is OpKind.ENQUEUE]
    deq = [op for op in ops if op.kind is not OpKind.ENQUEUE]
    if enq:
        enq, slots = _held(ring, enq, owner)
        if slots.size:
            if committed and enq_at_us is not None and ring.stride:
                filled = [op for op in enq if _cacheable(op.fill)]
                ring.cache.put_many(
                    [op.slot for op in filled], [op.seq for op in filled],
                    [op.fill for op in filled if op.fill is not None], enq_at_us,
                )
            _end_enqueues(ring, slots, committed)
            if committed:
                n_ready += slots.size
            _record_latencies(ring, OpKind.ENQUEUE, enq)
    if deq:
        deq, slots = _held(ring, deq, owner)
        if slots.size:
            if poisoned:
                hit = [(op.slot, op.seq) in poisoned for op in deq]
                n_poisoned = sum(hit)
                consumed = np.array(hit, dtype=bool) | committed
            else:
                consumed = np.full(slots.size, committed, dtype=bool)
            n_consumed = int(np.count_nonzero(consumed))
            was_owner = Q[b + L.Q_DEQ_OWNER]
            # a consumed entry of a group frees the group: its next entry
            # may be what a sleeping dequeuer waits for
            freed = int(np.count_nonzero(consumed & (s.group[ring.base + slots] != 0)))
            Q[b + L.Q_DEPTH_HINT] -= n_consumed
            Q[b + L.Q_N_DEQ_COMMIT] += n_consumed
            back = slots[~consumed]
            if back.size:
                lo, mask = bit_mask(back)
                s.deq[ring.w0 + lo : ring.w0 + lo + mask.size] &= ~mask
                Q[b + L.Q_N_DEQ_ROLLBACK] += back.size
            ring.unlock_dequeued(slots, exclusive)
            n_space += n_consumed
            n_ready += (slots.size - n_consumed) + freed + int(
                exclusive and bool(was_owner) and not Q[b + L.Q_DEQ_OWNER]
            )
            _record_latencies(ring, OpKind.DEQUEUE, deq)
            if committed:
                _record_waits(ring, deq)
    if n_poisoned:
        Q[b + L.Q_N_POISONED] += n_poisoned
    return after_finish(ring, n_ready, n_space)


def finish_run(
    ring: Ring, run: Run, owner: int, *, exclusive: bool, enq_at_us: int | None
) -> tuple[int, int]:
    """:func:`finish_batch` of a committed :class:`~._ops.Run` (its slots
    ``owner`` still holds; the others were decided by recovery), as array
    writes with nothing per entry in Python but the payload cache's byte
    copies: enqueued entries become ready (their records written first),
    dequeued ones consumed. Returns (entries made ready or groups freed,
    slots freed) for :func:`after_finish`, which the caller runs once."""
    if run.kind is OpKind.DEQUEUE and len(run.slots) <= SMALL_BATCH:
        return _consumed_few(ring, run, owner, exclusive)
    Q, b, s = ring.Q, ring.qb, ring.sec
    slots = run.slots
    held = ring.held_mask(slots, owner)
    whole = all(held.tolist()) if held.size <= SMALL_BATCH else bool(held.all())
    if not whole:
        slots = slots[held]
    n = int(slots.size)
    if not n:
        return 0, 0
    ring.record_latency(run.kind, run.latency_ns, n)
    if run.kind is OpKind.ENQUEUE:
        payloads = run.payloads
        if enq_at_us is not None and ring.stride and payloads is not None and run.trace is None:
            pseqs = run.pseq0 + np.arange(len(run.slots), dtype=np.int64)
            seqs, groups = run.seqs, run.groups
            if not whole:
                keep = held.tolist()
                seqs, pseqs = seqs[held], pseqs[held]
                payloads = [p for p, k in zip(payloads, keep, strict=True) if k]
                if groups is not None:
                    groups = [g for g, k in zip(groups, keep, strict=True) if k]
            ring.cache.put_run(slots, seqs, payloads, run.producer, pseqs, groups, enq_at_us)
        _end_enqueues(ring, slots, committed=True)
        return n, 0
    was_owner = Q[b + L.Q_DEQ_OWNER]
    # a consumed entry of a group frees the group (see finish_batch)
    freed = int(np.count_nonzero(s.group[ring.base + slots]))
    ring.end_consumed(slots, exclusive)
    if run.enq_us is not None:
        _record_wait_times(ring, run.enq_us if whole else run.enq_us[held])
    return freed + int(exclusive and bool(was_owner) and not Q[b + L.Q_DEQ_OWNER]), n


def _consumed_few(ring: Ring, run: Run, owner: int, exclusive: bool) -> tuple[int, int]:
    """:func:`finish_run` of a dequeue run of a few entries (up to
    SMALL_BATCH), in plain ints: numpy's per-call cost was most of a take
    of 8's finish. The same writes in the same order."""
    Q, b = ring.Q, ring.qb
    slots = run.slots.tolist()
    held = ring.held_few(slots, owner)
    whole = all(held)
    if not whole:
        slots = [x for x, h in zip(slots, held, strict=True) if h]
    n = len(slots)
    if not n:
        return 0, 0
    ring.record_latency(run.kind, run.latency_ns, n)
    was_owner = Q[b + L.Q_DEQ_OWNER]
    # a consumed entry of a group frees the group (see finish_batch)
    group_w, base = ring.sec.group_w, ring.base
    freed = sum(1 for x in slots if group_w[base + x])
    ring.end_consumed_few(slots, exclusive)
    if run.enq_us is not None:
        times = run.enq_us.tolist()
        if not whole:
            times = [t for t, h in zip(times, held, strict=True) if h]
        by_enq = {times[0]: n} if times.count(times[0]) == n else Counter(times)
        by_enq.pop(0, None)
        _record_wait_counts(ring, by_enq)
    return freed + int(exclusive and bool(was_owner) and not Q[b + L.Q_DEQ_OWNER]), n


def _end_enqueues(ring: Ring, slots: np.ndarray, committed: bool) -> None:
    """Held enqueued ``slots`` (their records written first, if any) become
    ready (``committed``) or void, counted, and are unlocked."""
    Q, b, s = ring.Q, ring.qb, ring.sec
    lo, mask = bit_mask(slots)
    at = slice(ring.w0 + lo, ring.w0 + lo + mask.size)
    if committed:
        s.enq[at] |= mask
        Q[b + L.Q_DEPTH_HINT] += slots.size
        Q[b + L.Q_N_ENQ_COMMIT] += slots.size
    else:
        s.deq[at] |= mask
        Q[b + L.Q_N_ENQ_ROLLBACK] += slots.size
    s.lck[at] &= ~mask
    s.owner[ring.base + slots] = 0


def after_finish(ring: Ring, n_ready: int, n_space: int) -> tuple[int, int]:
    """Reclaim once and count the wake-ups a finish makes: (ready, space)."""
    Q, b = ring.Q, ring.qb
    if n_space:
        ring.reclaim()  # once per queue, not once per entry
    wake_r = _wake_count(ring, n_ready)
    wake_s = min(n_space, Q[b + L.Q_WAIT_SPACE])
    if n_space and Q[b + L.Q_FULL_SINCE_NS]:
        Q[b + L.Q_FULL_NS] += time.monotonic_ns() - Q[b + L.Q_FULL_SINCE_NS]
        Q[b + L.Q_FULL_SINCE_NS] = 0
    if wake_r:
        Q[b + L.Q_N_WAKEUPS] += wake_r
    return wake_r, wake_s


def finish_one(
    ring: Ring,
    op: Op,
    owner: int,
    *,
    committed: bool,
    poisoned: set[tuple[int, int]],
    exclusive: bool,
    enq_at_us: int | None,
) -> tuple[int, int]:
    """:func:`finish_batch` of one op (a single-entry transaction: no lists, no
    numpy, no grouping of latencies), in the same order of writes."""
    if not ring.held_by(op.slot, owner):
        return 0, 0  # already decided by recovery (never finish a slot twice)
    n_ready, n_space = _finish_op(ring, op, committed, poisoned, exclusive, enq_at_us, 0)
    if not n_space and ring.Q[ring.qb + L.Q_WAIT_READY] <= 0:
        return 0, 0  # nothing to reclaim, nobody to wake (after_finish's answer)
    return after_finish(ring, n_ready, n_space)


def _finish_op(
    ring: Ring,
    op: Op,
    committed: bool,
    poisoned: set[tuple[int, int]],
    exclusive: bool,
    enq_at_us: int | None,
    now_us: int,
) -> tuple[int, int]:
    """One op whose slot its owner still holds (the caller looked), finished:
    its cache record written before its ENQ bit, its latency and (consumed)
    its wait recorded, ``now_us`` being the commit's time (0: now); no
    reclaim. Returns (ready, space), as :func:`after_finish` takes them."""
    slot = op.slot
    if op.kind is OpKind.ENQUEUE:
        f = op.fill
        # (inline: _cacheable(f), a call less on the single entry's path)
        if (committed and enq_at_us is not None and f is not None
                and (type(f) is not DueWrite or f.trace is None) and ring.stride):
            ring.cache.put(
                slot, op.seq, f.payload, f.producer.encode(), f.producer_seq, enq_at_us,
                None if f.group is None else f.group.encode(),
            )
        ring.finish_enqueue(slot, committed, op.due_us)
        ring.record_latency(op.kind, op.latency_ns)
        return int(committed), 0
    Q, b = ring.Q, ring.qb
    consumed = committed or (slot, op.seq) in poisoned
    was_owner = Q[b + L.Q_DEQ_OWNER]
    freed_group = consumed and ring.sec.group_w[ring.base + slot] != 0
    ring.finish_dequeue(slot, consumed, exclusive=exclusive, reclaim=False, due_us=op.due_us)
    ready = int(
        (not consumed) or freed_group or (exclusive and was_owner and not Q[b + L.Q_DEQ_OWNER])
    )
    if consumed and not committed:
        Q[b + L.Q_N_POISONED] += 1
    elif committed and op.enq_us:
        ring.record_wait((now_us or time.time_ns() // 1000) - op.enq_us)
    ring.record_latency(op.kind, op.latency_ns)
    return ready, int(consumed)


def _held(ring: Ring, ops: list[Op], owner: int) -> tuple[list[Op], np.ndarray]:
    """``ops`` whose slots ``owner`` still holds (LCK set, its token in
    OWNER; the others were decided by recovery: never finish a slot
    twice), and their slots (int64)."""
    slots = np.fromiter((op.slot for op in ops), dtype=np.int64, count=len(ops))
    held = ring.held_mask(slots, owner)
    if held.all():
        return ops, slots
    return [op for op, h in zip(ops, held.tolist(), strict=True) if h], slots[held]


def _record_latencies(ring: Ring, kind: OpKind, ops: list[Op]) -> None:
    # a batch's ops share one latency: one histogram update per distinct value
    for ns, n in Counter(op.latency_ns for op in ops).items():
        ring.record_latency(kind, ns, n)


def _record_waits(ring: Ring, ops: list[Op]) -> None:
    """The waits of committed dequeues ``ops`` (enqueue to now, the commit)
    into the wait histogram. Entries of one enqueuing transaction share their
    enq_at: one update per distinct enqueue time, and past a few of them one
    numpy pass (buckets as :meth:`Ring.record_wait`'s: ``frexp``'s exponent of
    a positive integer is its bit length)."""
    by_enq = Counter(op.enq_us for op in ops)
    by_enq.pop(0, None)  # 0: enqueue time unknown
    _record_wait_counts(ring, by_enq)


def _record_wait_counts(ring: Ring, by_enq: dict[int, int]) -> None:
    """Waits from now back to each enqueue time (us) ``by_enq`` names, as
    many as it counts, into the wait histogram (see :func:`_record_waits`)."""
    now_us = time.time_ns() // 1000
    if len(by_enq) <= WAIT_VECTOR_FROM:
        for enq_us, n in by_enq.items():
            ring.record_wait(now_us - enq_us, n)
        return
    us = np.maximum(now_us - np.fromiter(by_enq.keys(), dtype=np.int64, count=len(by_enq)), 0)
    weight = np.fromiter(by_enq.values(), dtype=np.int64, count=len(by_enq))
    buckets = np.minimum(np.frexp(us.astype(np.float64))[1], L.HIST_BUCKETS - 1)
    counts = np.bincount(buckets, weights=weight, minlength=L.HIST_BUCKETS)
    Q, w = ring.Q, ring.qb + L.Q_WAIT_HIST
    for bucket in np.flatnonzero(counts).tolist():
        Q[w + bucket] += int(counts[bucket])
    Q[ring.qb + L.Q_WAIT_US] += int(np.dot(us, weight))


def _record_wait_times(ring: Ring, enq_us: np.ndarray) -> None:
    """:func:`_record_waits` of a run's enqueue times (int64 us; 0: unknown)."""
    first = int(enq_us[0])
    if enq_us.size <= SMALL_BATCH:  # plain ints (see SMALL_BATCH)
        one = all(t == first for t in enq_us.tolist())
    else:
        one = bool((enq_us == first).all())
    if one:  # the usual run: one enqueuing transaction's entries
        by_enq = {first: len(enq_us)}
    else:
        times, counts = np.unique(enq_us, return_counts=True)
        by_enq = dict(zip(times.tolist(), counts.tolist(), strict=True))
    by_enq.pop(0, None)
    _record_wait_counts(ring, by_enq)


def _wake_count(ring: Ring, n_ready: int) -> int:
    """How many sleeping dequeuers ``n_ready`` new ready entries make
    work for: each waiter recorded how many it wants (``Q_WAIT_WANT``),
    so a batch wakes enough waiters to take it, not every waiter."""
    Q, b = ring.Q, ring.qb
    waiters = Q[b + L.Q_WAIT_READY]
    if not n_ready or waiters <= 0:
        return 0
    per = max(1, Q[b + L.Q_WAIT_WANT] // waiters)  # entries a waiter wants, on average
    return min(waiters, -(-n_ready // per))


def _cacheable(w: Write | None) -> bool:
    """Whether an enqueue's row write goes to the payload cache: not an
    entry that carries a trace context (the cache record has no room for it)."""
    return w is not None and (type(w) is not DueWrite or w.trace is None)
