"""Moving entries from a queue in one database to a queue in another, without 2PC.

A :class:`Mover` is a consumer of the source queue (database 1) and a producer
of the destination queue (database 2). For each batch it

1. dequeues up to N entries from the source, in a database-1 transaction;
2. enqueues each in the destination, in a database-2 transaction, with an
   idempotency key made from the entry's identity (:func:`move_key`: its
   source, sequence and enqueue time);
3. commits database 2 FIRST;
4. then commits the dequeue in database 1.

A mover killed between 3 and 4 leaves the entries committed in database 2
and not consumed in database 1: once recovery (the monitor, or the next
mover: a mover taking over decides a dead predecessor's slots in both queues
before it moves anything) has released them, they are delivered again, and
the destination enqueue is a no-op by key. Nothing is lost (database 1 is
committed last) and nothing arrives twice (the key). The two databases never
learn that they took part in one move.

Order: the source is dequeued oldest first by one mover at a time, so the
destination receives entries in source order; per-producer order holds. That
needs a source queue in ``single`` dequeue mode, and the mover refuses any
other (:class:`MoveSourceShared`): in ``shared`` mode a standby that takes
over reads past the entries a dead mover still holds (they come back only
when recovery releases them), so a producer's later entries would arrive
before its earlier ones; and the new mover could prune the spent keys of
those entries before they are delivered again, which would move them twice. The
destination sees the mover as the producer; the original producer, its
sequence, the source queue and sequence travel in an envelope around the
payload (:func:`wrap`/:func:`unwrap`, :class:`Moved`) unless the mover is
told to move bare payloads.

Due times (issue 24): an entry that waits in the source (a delayed enqueue,
or a retry's backoff) is taken only once due, as by any consumer; its row's
``not_before`` is read in the source transaction (one statement per batch)
and the destination enqueue carries it, so it is due in the destination when
it was due in the source, never earlier by the destination's clock.

Availability: several movers may run for one source queue; only the one that
holds a PostgreSQL advisory lock on database 1 (on a connection of its own,
released by the server when that connection ends) moves. The others are on
standby and try the lock every ``standby_poll`` seconds.

Retries cost strikes: a mover that dies, or rolls back a batch, counts a
failed delivery on each entry of the batch in the source queue; give the
source queue a ``max_deliveries`` well above the number of crashes you
expect, or entries go to the exception table.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Self

import posix_ipc
import psycopg
from ringq.engine import (
    ConfigError,
    Message,
    PayloadTooLarge,
    QueueFull,
    QueueInfo,
    Retryable,
    RingqError,
    Session,
    dsn_file,
    one_line,
    pg,
    queue_table,
    read_dsn_file,
    redact_dsn,
    resolve_dsn,
    validate_queue_name,
)
from ringq.engine.sqlfile import compose

from ._queries import SQL

logger = logging.getLogger("ringq.move")

ENVELOPE_MAGIC = b"\x00RQMV1"
_LEN = struct.Struct(">I")


class MoveLockHeld(RingqError):
    """Another mover holds the source queue's move lock: this one is on standby."""


class MoveSourceShared(ConfigError):
    """The source queue is in ``shared`` dequeue mode; a mover needs ``single``.

    In shared mode a mover taking over would read past the entries a dead
    mover still holds (breaking per-producer order) and could prune their
    idempotency keys before they are delivered again (moving them twice).
    Move from a queue created with ``dequeue_mode='single'`` (the default).
    """


class MoveIntoItself(ConfigError):
    """The source and the destination are the same queue of the same database."""


class MoveWontFit(ConfigError):
    """The destination's ``max_payload`` is smaller than the source's plus the
    envelope: entries near the source's limit could never be moved.

    Refused at start, before anything moves; otherwise each such entry would
    fail its deliveries and end in the source's exception table.
    """


# -- the envelope ----------------------------------------------------------------------------

# What the envelope adds, at most, for a producer name of up to this many characters
# (ringq's own are host:pid:n); the bound a destination must leave room for.
ENVELOPE_PRODUCER_CHARS = 64


@dataclass(frozen=True)
class Moved:
    """An entry as it left its source queue (the content of a moved payload)."""

    origin_instance: str
    origin_queue: str
    origin_queue_id: int
    origin_seq: int
    producer: str
    producer_seq: int
    enqueued_at: datetime
    payload: bytes

    @property
    def key(self) -> str:
        """The idempotency key the entry was moved with."""
        return move_key(
            self.origin_instance, self.origin_queue_id, self.origin_seq, self.enqueued_at
        )

    @property
    def origin(self) -> str:
        """``instance:queue``, the entry's origin (unique across databases)."""
        return f"{self.origin_instance}:{self.origin_queue}"


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def move_key(instance: str, queue_id: int, seq: int, enqueued_at: datetime) -> str:
    """The idempotency key of a source entry: unique across databases, queue
    wraps and fail-overs.

    ``instance`` names the source database (``ringq.meta.instance_id``),
    ``queue_id`` the source queue (a queue dropped and created again gets a new
    id, its sequence starting over), ``seq`` the queue-wide sequence (the slot
    is ``seq % capacity``, the sequence grows on) and ``enqueued_at`` the
    entry's enqueue time, to the microsecond (a naive time is taken as UTC).
    The sequence alone is not enough: after an asynchronous fail-over of the
    source, the sequences of entries lost in the replication gap are given
    again, to new entries; had the lost ones been moved already, their keys
    would make the destination skip the new ones.
    """
    if enqueued_at.tzinfo is None:
        enqueued_at = enqueued_at.replace(tzinfo=UTC)
    micros = (enqueued_at - _EPOCH) // timedelta(microseconds=1)
    return f"{_key_prefix(instance, queue_id)}{seq}@{micros}"


def _key_prefix(instance: str, queue_id: int) -> str:
    return f"mv:{instance}:{queue_id}:"


def wrap(msg: Message, instance: str, queue_id: int) -> bytes:
    """The payload of a moved entry: a small JSON header, then the original bytes."""
    head = json.dumps(
        {
            "i": instance,
            "q": msg.queue,
            "qid": queue_id,
            "s": msg.seq,
            "p": msg.producer,
            "ps": msg.producer_seq,
            "t": msg.enqueued_at.isoformat(),
        },
        separators=(",", ":"),
    ).encode()
    return b"".join((ENVELOPE_MAGIC, _LEN.pack(len(head)), head, msg.payload))


def envelope_overhead(instance: str, queue: str, queue_id: int) -> int:
    """Bytes the envelope adds to a payload of ``queue`` (producer names of up to
    :data:`ENVELOPE_PRODUCER_CHARS` characters, the largest sequences)."""
    probe = Message(
        queue, (1 << 63) - 1, b"", "p" * ENVELOPE_PRODUCER_CHARS, (1 << 63) - 1,
        datetime(9999, 12, 31, 23, 59, 59, 999999).astimezone(), 1,
    )
    return len(wrap(probe, instance, queue_id))


def is_moved(payload: bytes) -> bool:
    """True if ``payload`` is an envelope written by a mover."""
    return payload[: len(ENVELOPE_MAGIC)] == ENVELOPE_MAGIC


def unwrap(data: bytes | Message) -> Moved:
    """Open a moved entry's envelope.

    :raises ConfigError: ``data`` is not an envelope written by a mover.
    """
    payload = data.payload if isinstance(data, Message) else bytes(data)
    if not is_moved(payload):
        raise ConfigError("not a moved entry (no mover envelope)")
    start = len(ENVELOPE_MAGIC) + _LEN.size
    (n,) = _LEN.unpack_from(payload, len(ENVELOPE_MAGIC))
    try:
        h = json.loads(payload[start : start + n])
        return Moved(
            origin_instance=str(h["i"]),
            origin_queue=str(h["q"]),
            origin_queue_id=int(h["qid"]),
            origin_seq=int(h["s"]),
            producer=str(h["p"]),
            producer_seq=int(h["ps"]),
            enqueued_at=datetime.fromisoformat(h["t"]),
            payload=payload[start + n :],
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"corrupt mover envelope: {exc}") from exc


# -- configuration -----------------------------------------------------------------------------


@dataclass(frozen=True)
class MoveConfig:
    """How a mover works; validated on creation.

    :raises ConfigError: a value is out of range.
    """

    batch: int = 100  # entries per move (one db2 and one db1 commit)
    wait: float = 0.5  # seconds to sleep on the source's wake-up when it is empty
    standby_poll: float = 1.0  # seconds between a standby's attempts at the lock
    lock_check: float = 5.0  # seconds between checks that the lock connection lives
    full_wait: float = 1.0  # seconds per wait for room when the destination is full
    envelope: bool = True  # keep origin and producer in an envelope (else bare payloads)
    prune_every: int = 64  # batches between prunes of this mover's spent keys (0: never)
    retry_backoff: float = 1.0  # seconds to wait after a failed batch in run()

    def __post_init__(self) -> None:
        if (
            isinstance(self.batch, bool)
            or not isinstance(self.batch, int)
            or not 1 <= self.batch <= 100_000
        ):
            raise ConfigError(f"batch must be an integer from 1 to 100,000, not {self.batch!r}")
        if not isinstance(self.prune_every, int) or self.prune_every < 0:
            raise ConfigError(f"prune_every must be an integer >= 0, not {self.prune_every!r}")
        for name in ("wait", "standby_poll", "lock_check", "full_wait", "retry_backoff"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 86_400:
                raise ConfigError(f"{name} must be a number of seconds from 0 to 86,400, not {v!r}")


# Stats keys (constant; see Mover.get_stats).
STAT_BATCHES = "batches"
STAT_MOVED = "moved"
STAT_DUPLICATES = "duplicates"
STAT_REDELIVERED = "redelivered"
STAT_FAILURES = "failures"
STAT_DST_FULL_WAITS = "dst_full_waits"
STAT_PRUNED_KEYS = "pruned_keys"
STAT_TAKEOVERS = "takeovers"

Hook = Callable[[Sequence[Message]], None]


@dataclass
class _State:
    active: bool = False
    lock_conn: psycopg.Connection[Any] | None = None
    lock_checked: float = 0.0
    src: Session | None = None
    dst: Session | None = None
    src_qid: int = 0
    dst_qid: int = 0
    instance: str = ""
    careful: int = 0  # entries still to move one at a time after a failed batch
    # a dead predecessor's slots in both queues decided since we became active
    settled: bool = False
    batches_since_prune: int = 0
    prune_upto: int = -1  # highest destination seq whose source dequeue committed
    stats: dict[str, int] = field(default_factory=dict)


class Mover:
    """Moves entries from ``src_queue`` in ``src_dsn`` to ``dst_queue`` in ``dst_dsn``.

    Use :meth:`run` as a service (standby until it holds the lock, then moves
    until ``stop_event`` is set), or :meth:`move_batch` for one step. The
    destination queue's ``max_payload`` must be at least the source's plus
    :func:`envelope_overhead` (the source's alone with ``envelope=False``):
    :meth:`open` refuses a smaller one with :class:`MoveWontFit`.

    ``between_commits`` (for tests and fault drills) is called with the batch
    after database 2 committed and before database 1 commits.
    """

    def __init__(
        self,
        src_dsn: str | None,
        src_queue: str,
        dst_dsn: str | None,
        dst_queue: str,
        *,
        config: MoveConfig | None = None,
        between_commits: Hook | None = None,
        application_name: str = "ringq-move",
    ) -> None:
        self.src_dsn = resolve_dsn(src_dsn)
        self.dst_dsn = resolve_dsn(dst_dsn)
        # Where a DSN came from the embedded cluster's file: re-read after a failure.
        self._dsn_files = {"src_dsn": dsn_file(src_dsn), "dst_dsn": dsn_file(dst_dsn)}
        self.src_queue = validate_queue_name(src_queue)
        self.dst_queue = validate_queue_name(dst_queue)
        self.config = config or MoveConfig()
        self._hook = between_commits
        self._appname = application_name
        self._s = _State()
        self._s.stats = dict.fromkeys(
            (STAT_BATCHES, STAT_MOVED, STAT_DUPLICATES, STAT_REDELIVERED, STAT_FAILURES,
             STAT_DST_FULL_WAITS, STAT_PRUNED_KEYS, STAT_TAKEOVERS),
            0,
        )
        self._stop: threading.Event | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<Mover {redact_dsn(self.src_dsn)}:{self.src_queue} -> "
            f"{redact_dsn(self.dst_dsn)}:{self.dst_queue} {'active' if self.active else 'standby'}>"
        )

    # -- life cycle -------------------------------------------------------------------------

    def open(self) -> Self:
        """Connect to both databases (the lock is taken by :meth:`try_acquire`, :meth:`run`).

        :raises DatabaseUnavailable, QueueNotFound, SchemaMissing:
        :raises MoveSourceShared: the source queue is not in ``single`` dequeue mode.
        :raises MoveIntoItself: the destination is the source.
        :raises MoveWontFit: the destination's ``max_payload`` is too small.
        """
        s = self._s
        if s.src is None or s.src.closed:
            src = Session(self.src_dsn, application_name=self._appname)
            try:
                info = src.queue_info(self.src_queue)
                if info.dequeue_mode != "single":
                    raise MoveSourceShared(
                        f"queue {self.src_queue!r} is in {info.dequeue_mode!r} dequeue mode: "
                        "a mover needs a source in 'single' mode (one dequeuer at a time), "
                        "or a standby taking over could break per-producer order and move an "
                        "entry twice"
                    )
            except BaseException:
                src.close()
                raise
            s.src = src
            s.instance = src.instance
            s.src_qid = info.id
        if s.dst is None or s.dst.closed:
            dst = Session(self.dst_dsn, application_name=self._appname)
            try:
                self._check_destination(dst, s.src.queue_info(self.src_queue))
            except BaseException:
                dst.close()
                self.close()  # the source session too: a refused mover holds nothing
                raise
            s.dst = dst
            s.dst_qid = dst.queue_info(self.dst_queue).id
        self._closed = False
        return self

    def _check_destination(self, dst: Session, src_info: QueueInfo) -> None:
        """Refuse, before anything moves, a queue moved into itself (it would run
        until killed) and a destination too small for the source's entries (each
        would become poison)."""
        s = self._s
        dst_info = dst.queue_info(self.dst_queue)
        if dst.instance == s.instance and dst_info.id == src_info.id:
            raise MoveIntoItself(
                f"queue {self.src_queue!r} would be moved into itself (same database, same queue)"
            )
        overhead = (
            envelope_overhead(s.instance, self.src_queue, src_info.id)
            if self.config.envelope else 0
        )
        needed = src_info.max_payload + overhead
        if dst_info.max_payload < needed:
            envelope = f" + {overhead:,} bytes of envelope" if overhead else ""
            raise MoveWontFit(
                f"queue {self.dst_queue!r} takes payloads of up to "
                f"{dst_info.max_payload:,} bytes, but queue {self.src_queue!r}'s entries need "
                f"up to {needed:,} ({src_info.max_payload:,}{envelope}): give the destination "
                f"a max_payload of at least {needed:,}"
            )

    def close(self) -> None:
        """Roll back anything open, give up the lock, disconnect; a second call does nothing."""
        s = self._s
        for sess in (s.src, s.dst):
            if sess is not None:
                try:
                    sess.close()
                except RingqError:
                    logger.warning("ringq.move: close failed", exc_info=True)
        s.src = s.dst = None
        self._release()
        self._closed = True

    def __enter__(self) -> Self:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def active(self) -> bool:
        """True while this mover holds the source queue's move lock."""
        return self._s.active

    def get_stats(self) -> dict[str, int]:
        """Counters since creation (keys are the ``STAT_*`` constants)."""
        return dict(self._s.stats)

    # -- the lock ---------------------------------------------------------------------------

    def try_acquire(self) -> bool:
        """Try once to become the active mover of the source queue; True if it is.

        :raises DatabaseUnavailable: database 1 cannot be reached.
        """
        s = self._s
        if s.active and not self._lock_lost():
            return True
        self.open()
        if s.lock_conn is None or s.lock_conn.closed:
            s.lock_conn = pg.connect(
                self.src_dsn, application_name=self._appname + "-lock", connect_timeout=10
            )
        try:
            row = pg.run(s.lock_conn, SQL["try_lock"], (s.src_qid,), dsn=self.src_dsn).fetchone()
        except RingqError:
            self._release()
            raise
        assert row is not None
        if not row[0]:
            return False
        s.active = True
        s.lock_checked = time.monotonic()
        s.stats[STAT_TAKEOVERS] += 1
        logger.info("ringq.move: %s: active (lock held by backend %s)", self.src_queue, row[1])
        return True

    def _lock_lost(self) -> bool:
        """Check (at most every ``lock_check`` s) that the lock's connection still lives."""
        s = self._s
        now = time.monotonic()
        if s.lock_conn is None or s.lock_conn.closed:
            self._release()
            return True
        if now - s.lock_checked < self.config.lock_check:
            return False
        try:
            pg.run(s.lock_conn, SQL["ping"])
        except RingqError:
            logger.warning("ringq.move: %s: lock connection lost; back to standby", self.src_queue)
            self._release()
            return True
        s.lock_checked = now
        return False

    def _lock_held_now(self) -> bool:
        """Check the lock's connection now (before deleting keys, which is safe
        only if no other mover can have been active meanwhile)."""
        self._s.lock_checked = 0.0
        return not self._lock_lost()

    def _release(self) -> None:
        s = self._s
        s.active = False
        s.settled = False
        # Spent keys may be pruned only up to what we moved while holding the
        # lock without a break: start that count again.
        s.prune_upto = -1
        s.batches_since_prune = 0
        conn, s.lock_conn = s.lock_conn, None
        if conn is not None and not conn.closed:
            with suppress(psycopg.Error):  # closing the connection releases it anyway
                conn.execute(SQL["unlock"], (s.src_qid,))
            conn.close()

    # -- moving -----------------------------------------------------------------------------

    def move_batch(self, max_n: int | None = None, *, wait: float = 0.0) -> int:
        """Move up to ``max_n`` entries (default: the configured batch); return how many.

        Waits up to ``wait`` seconds for a first entry. Entries found already in
        the destination (moved before a crash) are counted but not enqueued again.

        :raises MoveLockHeld: another mover is active for this source queue.
        :raises PayloadTooLarge: an entry (with its envelope) does not fit the
            destination; the batch was rolled back (the entry counts a strike and
            ends in the source's exception table after ``max_deliveries``).
        :raises RingqError: a database failed; the batch was rolled back (or, if
            database 2 had committed, it is redelivered and skipped by key).
        """
        if not self.try_acquire():
            raise MoveLockHeld(f"another mover is active for queue {self.src_queue!r}")
        s = self._s
        src, dst = s.src, s.dst
        assert src is not None and dst is not None
        if not s.settled:
            # A mover that died before us may hold slots in both queues: in
            # the destination, entries it committed but had not yet published.
            # Anything we moved now would come out before them (a consumer
            # reads past locked slots): a producer's order broken. So decide
            # them first (no monitor needed), then move.
            src.recover_dead_holders(self.src_queue)
            dst.recover_dead_holders(self.dst_queue)
            s.settled = True
        n = max_n or self.config.batch
        if s.careful:
            n = 1
        try:
            msgs = src.dequeue_many(self.src_queue, n, wait=wait)
        except posix_ipc.SignalError:
            return 0  # a signal woke the wait: let the caller look at its stop flag
        if not msgs:
            return 0
        try:
            dues = self._due_times(src, msgs)
            dst_seqs = self._to_destination(dst, msgs, dues)
        except BaseException:
            s.stats[STAT_FAILURES] += 1
            s.careful = n if n > 1 else max(0, s.careful - 1)
            self._rollback(dst)
            self._rollback(src)
            raise
        # Database 2 has committed: from here a crash redelivers, the key skips.
        if self._hook is not None:
            try:
                self._hook(msgs)
            except BaseException:
                self._rollback(src)  # as if we died here: redelivered, skipped by key
                raise
        try:
            src.commit()
        except RingqError as exc:
            s.stats[STAT_FAILURES] += 1
            logger.warning(
                "ringq.move: %s: source commit failed after the destination committed (%s); "
                "the batch will be delivered again and skipped by key",
                self.src_queue, one_line(exc),
            )
            raise
        if s.careful:
            s.careful -= 1
        s.prune_upto = max(s.prune_upto, *dst_seqs)
        s.batches_since_prune += 1
        s.stats[STAT_BATCHES] += 1
        s.stats[STAT_MOVED] += len(msgs)
        return len(msgs)

    def _due_times(self, src: Session, msgs: list[Message]) -> dict[int, datetime]:
        """{source seq: due time} of the batch's entries that have one, read
        from their rows in the source transaction (one statement)."""
        cap = src.queue_info(self.src_queue).capacity
        rows = pg.run(
            src.connection,
            compose(SQL["due_times"], table=queue_table(self.src_queue)),
            ([m.seq % cap for m in msgs], [m.seq for m in msgs]),
            dsn=self.src_dsn,
            queue=self.src_queue,
        ).fetchall()
        return {int(seq): due for seq, due in rows}

    def _to_destination(
        self, dst: Session, msgs: list[Message], dues: dict[int, datetime]
    ) -> list[int]:
        """Enqueue the batch in database 2 and commit there; return destination
        seqs. An entry with a due time in ``dues`` (by source seq) is enqueued
        with it: due in the destination when it was due in the source."""
        s = self._s
        cfg = self.config
        dst_info = dst.queue_info(self.dst_queue)
        bodies = [wrap(m, s.instance, s.src_qid) if cfg.envelope else m.payload for m in msgs]
        keys = [move_key(s.instance, s.src_qid, m.seq, m.enqueued_at) for m in msgs]
        for m, body in zip(msgs, bodies, strict=True):
            if len(body) > dst_info.max_payload:
                raise PayloadTooLarge(
                    f"entry {self.src_queue}/{m.seq}: {len(body):,} bytes"
                    f"{' with its envelope' if cfg.envelope else ''} exceed queue "
                    f"{self.dst_queue!r} max_payload {dst_info.max_payload:,}",
                    queue=self.dst_queue,
                )
        conn = dst.connection
        if (
            cfg.prune_every
            and s.batches_since_prune >= cfg.prune_every
            and s.prune_upto >= 0
            and self._lock_held_now()
        ):
            prefix = _key_prefix(s.instance, s.src_qid)
            cur = pg.run(
                conn, SQL["prune_keys"], (s.dst_qid, s.prune_upto, prefix),
                dsn=self.dst_dsn, queue=self.dst_queue,
            )
            s.stats[STAT_PRUNED_KEYS] += max(0, cur.rowcount)
            s.batches_since_prune = 0
        redelivered = [k for m, k in zip(msgs, keys, strict=True) if m.redelivered]
        found: dict[str, int] = {}
        if redelivered:
            s.stats[STAT_REDELIVERED] += len(redelivered)
            rows = pg.run(
                conn, SQL["moved_keys"], (s.dst_qid, redelivered),
                dsn=self.dst_dsn, queue=self.dst_queue,
            ).fetchall()
            found = {k: int(q) for k, q in rows}
        seqs: list[int] = []
        for msg, body, key in zip(msgs, bodies, keys, strict=True):
            if key in found:
                s.stats[STAT_DUPLICATES] += 1
                seqs.append(found[key])
                continue
            seqs.append(self._enqueue(dst, body, key, msg.group, dues.get(msg.seq)))
        dst.commit()
        return seqs

    def _enqueue(
        self, dst: Session, body: bytes, key: str, group: str | None, due: datetime | None
    ) -> int:
        """Enqueue one entry (in its source group: a source batch holds at
        most one entry per group, so a group keeps its order across the move);
        a full destination is waited out, never a reason to roll back.

        What is enqueued so far is committed before waiting (the source side is
        still uncommitted, so a crash meanwhile redelivers and the keys skip),
        so our own reservations never block the room we wait for.
        """
        while True:
            try:
                return dst.enqueue(
                    self.dst_queue, body, key=key, group=group, timeout=self.config.full_wait,
                    not_before=due,
                )
            except QueueFull:
                self._s.stats[STAT_DST_FULL_WAITS] += 1
                dst.commit()
                if self._stop is not None and self._stop.is_set():
                    raise
            except posix_ipc.SignalError as exc:
                dst.commit()
                if self._stop is not None and self._stop.is_set():
                    raise QueueFull(
                        "stopped while the destination was full", queue=self.dst_queue
                    ) from exc

    @staticmethod
    def _rollback(sess: Session | None) -> None:
        if sess is None or sess.closed:
            return
        try:
            sess.rollback()
        except RingqError as exc:
            # the connection went (a restart, a fail-over): the session
            # decides its slots on its next call; one line, no traceback
            logger.warning("ringq.move: rollback failed: %s", one_line(exc))
            logger.debug("ringq.move: rollback failed", exc_info=True)

    # -- the service --------------------------------------------------------------------------

    def run(self, stop_event: threading.Event) -> None:
        """Stand by until active, then move until ``stop_event`` is set.

        A batch in hand when the event is set is finished (both commits) before
        returning; failures are logged and counted, and the mover reconnects.

        :raises MoveSourceShared: the source queue is not in ``single`` dequeue mode.
        :raises MoveIntoItself: the destination is the source.
        :raises MoveWontFit: the destination's ``max_payload`` is too small.
        """
        self._stop = stop_event
        cfg = self.config
        try:
            while not stop_event.is_set():
                try:
                    if not self.try_acquire():
                        stop_event.wait(cfg.standby_poll)
                        continue
                    self.move_batch(cfg.batch, wait=cfg.wait)
                except MoveLockHeld:
                    continue
                except MoveSourceShared:
                    raise  # a setting, not a failure: retrying cannot help
                except Retryable as exc:
                    # Nothing of the batch committed on the side that raised (a
                    # conflict, a stale section, a commit cut off by a fail-over
                    # and decided from the rows): move it again now; entries that
                    # database 2 had committed are skipped by key.
                    logger.warning("ringq.move: %s: batch rolled back, retried: %s",
                                   self.src_queue, one_line(exc))
                    self._reset_after_failure()
                except RingqError as exc:
                    self._s.stats[STAT_FAILURES] += 1
                    logger.warning("ringq.move: %s: step failed: %s", self.src_queue,
                                   one_line(exc))
                    self._reset_after_failure()
                    stop_event.wait(cfg.retry_backoff)
        finally:
            self._stop = None
            self.close()

    def _reset_after_failure(self) -> None:
        """Drop closed sessions, and the lock if its connection broke.

        A session whose connection was lost stays open and connects again on
        its next call (through a multi-host DSN, to the promoted standby after
        a fail-over): asking it for its connection here would connect now, and
        raise while there is no primary. Its lost connection to database 1 may
        have gone with the lock's (the same server), so the lock is checked now.
        """
        s = self._s
        for name in ("src", "dst"):
            sess: Session | None = getattr(s, name)
            if sess is not None and sess.closed:
                setattr(s, name, None)
        if s.src is None:
            self._release()  # a new source session means a new standby round
        self._lock_held_now()
        for attr, path in self._dsn_files.items():
            new = None if path is None else read_dsn_file(path)
            if new is not None and new != getattr(self, attr):
                logger.warning("ringq.move: the embedded cluster came back at %s", redact_dsn(new))
                setattr(self, attr, new)
