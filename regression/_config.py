"""The regression cycle's settings: one frozen dataclass, validated on creation."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

from ringq.engine import (
    MAX_CAPACITY,
    ConfigError,
    is_finite_number,
    validate_int,
    validate_seconds,
)

from ._payload import MIN_PAYLOAD

DEFAULT_PAYLOAD_SIZES = (16, 200, 2000, 20000, 200000)
MAX_QUEUES = 255  # the payload header holds the queue index in one byte
MAX_PRODUCERS = 1000
MAX_PAYLOAD_SIZE = 16 << 20  # a regression entry is held in memory several times over
FILLERS = ("random", "pattern")
FAILOVER_MODES = ("sync", "async")  # the standby of a --chaos-failover cycle
MAX_GROUPED_CONSUMERS = 64
MAX_SQL_CONSUMERS = 64
MAX_GROUPS = 1_000_000
MAX_DELAY = 3600.0  # seconds: a delayed entry must fall due within a cycle

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_]{0,29}$")


def validate_run_id(run_id: object) -> str:
    """Return ``run_id`` if it can name a run (its schema is ``regress_<run id>``).

    :raises ConfigError: not 1-30 characters of lowercase letters, digits and '_'.
    """
    if not isinstance(run_id, str) or not RUN_ID_RE.fullmatch(run_id):
        raise ConfigError(
            f"invalid run id {run_id!r}: use 1-30 characters, lowercase letters, digits or '_' "
            "(a letter or digit first)"
        )
    return run_id


@dataclass(frozen=True)
class RegressConfig:
    """What one regression run does per cycle.

    Sizes are bytes, times seconds, rates probabilities in [0, 1).

    - ``payload_sizes``: one queue per size (at least 16 bytes: header and checksum).
    - ``capacity``: slots per queue; ``entries_per_queue``: committed entries per queue per cycle.
    - ``producers``: producer processes; each writes random counts to random queues,
      often several queues in one transaction.
    - ``rollback_rate``: producer transactions deliberately rolled back.
    - ``two_phase_rate``: producer transactions run as two-phase (prepare, then commit).
    - ``consumer_rollback_rate``: consumer transactions deliberately rolled back
      (their entries are delivered again).
    - ``filler``: ``random`` (incompressible) or ``pattern`` (compressible) payload bodies.
    - ``enqueue_timeout``: how long an enqueue waits on a full queue before the
      producer rolls its transaction back and tries later.
    - ``stall_timeout``: a cycle with no progress for this long is aborted as stalled.
    - ``seed``: for the random choices (None: from the clock).
    - ``chaos``: kill -9 a random producer, consumer or the run's own monitor
      every ``chaos_interval`` (min, max) seconds during a cycle and restart it;
      with ``chaos_pg_restart`` also restart the embedded PostgreSQL once per cycle.
      SQL consumers are killed too, and their backends ended (``pg_terminate_backend``).
    - ``chaos_failover``: ``sync`` or ``async``: the embedded cluster gets (or
      keeps) a standby of that kind, every process uses the multi-host DSN that
      follows the primary, and in the middle of each cycle the primary's
      postmaster is killed with SIGKILL and the standby promoted; the old
      primary comes back as the new one's standby after the cycle. Workers and
      the monitor carry on as under ``chaos`` (which it does not need: alone,
      nothing else is killed).
    - ``grouped_consumers``: one more queue, in ``shared`` dequeue mode with the
      smallest payload size, whose entries belong to groups (``g0`` ..
      ``g<groups - 1>``, one chosen at random per entry and recorded in ``sent``),
      consumed by this many consumer processes at once; the proof adds per-group
      order and "never two entries of a group held at once". 0: no such queue.
    - ``groups``: how many groups the grouped queue's entries are spread over.
    - ``sql_consumers``: consumer processes that are plain psycopg connections
      calling ``ringq.dequeue`` (the SQL path, served by the monitor's agent:
      the cycle runs a monitor if none serves the database), dealt out over
      the queues in turn, the grouped queue first; they dequeue beside the
      queue's linked consumers and record in the same received table, in the
      same transaction. Every received table of such a run records who took
      each entry and when (as the grouped queue's does), so that the proof's
      order covers linked and SQL consumers together. 0: none.
    - ``delayed_share``: entries that producers enqueue with a delay (uniformly
      random, up to ``max_delay`` seconds; one delay per ``enqueue_many`` call,
      so the share counts calls as well as entries); each records the due time
      the database gave (the row's ``not_before``, read back after the commit)
      in ``due``, and the proof checks that none was taken before it. 0: none.
    - ``retry_delay``: the retry backoff (seconds) of the run's queues: an
      entry whose consumer rolled back on purpose comes back only that much
      later; consumers log each such rollback (``retried``) and the proof
      checks that the entry was not taken again before its backoff. 0: at once.

    Every received table records the database's time of each take (``deq_at``,
    ``clock_timestamp()`` in the consumer's own transaction, after the dequeue).

    :raises ConfigError: a value is out of range (the message says which).
    """

    payload_sizes: tuple[int, ...] = DEFAULT_PAYLOAD_SIZES
    capacity: int = 2000
    entries_per_queue: int = 10000
    producers: int = 5
    rollback_rate: float = 0.05
    two_phase_rate: float = 0.3
    consumer_rollback_rate: float = 0.02
    filler: str = "random"
    enqueue_timeout: float = 2.0
    stall_timeout: float = 120.0
    seed: int | None = None
    chaos: bool = False
    chaos_interval: tuple[float, float] = (2.0, 6.0)
    chaos_pg_restart: bool = False
    chaos_failover: str | None = None
    grouped_consumers: int = 3
    groups: int = 50
    sql_consumers: int = 0
    delayed_share: float = 0.0
    max_delay: float = 0.5
    retry_delay: float = 0.0

    def __post_init__(self) -> None:
        ci = self.chaos_interval
        if (
            not isinstance(ci, tuple)
            or len(ci) != 2
            or not all(is_finite_number(v) for v in ci)
            or not 0 < ci[0] <= ci[1]
        ):
            raise ConfigError(
                f"chaos_interval must be (min, max) seconds with 0 < min <= max, not {ci!r}"
            )
        if self.chaos_pg_restart and not self.chaos:
            raise ConfigError("chaos_pg_restart needs chaos")
        if self.chaos_failover is not None and self.chaos_failover not in FAILOVER_MODES:
            raise ConfigError(
                f"chaos_failover must be one of {', '.join(FAILOVER_MODES)} or None, "
                f"not {self.chaos_failover!r}"
            )
        sizes = self.payload_sizes
        if not isinstance(sizes, tuple) or not sizes:
            raise ConfigError("payload_sizes must be a non-empty tuple of byte counts")
        if len(sizes) > MAX_QUEUES:
            raise ConfigError(
                f"at most {MAX_QUEUES} payload sizes (one queue each), not {len(sizes)}"
            )
        for s in sizes:
            validate_int("a payload size", s, MIN_PAYLOAD, MAX_PAYLOAD_SIZE)
        validate_int("capacity", self.capacity, 2, MAX_CAPACITY)
        validate_int("entries_per_queue", self.entries_per_queue, 1, 1 << 40)
        validate_int("producers", self.producers, 1, MAX_PRODUCERS)
        validate_int("grouped_consumers", self.grouped_consumers, 0, MAX_GROUPED_CONSUMERS)
        validate_int("groups", self.groups, 1, MAX_GROUPS)
        validate_int("sql_consumers", self.sql_consumers, 0, MAX_SQL_CONSUMERS)
        for name in ("rollback_rate", "two_phase_rate", "consumer_rollback_rate",
                     "delayed_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
                raise ConfigError(f"{name} must be a number from 0 to below 1, not {v!r}")
        if not is_finite_number(self.max_delay) or not 0 < self.max_delay <= MAX_DELAY:
            raise ConfigError(
                f"max_delay must be more than 0 and at most {MAX_DELAY:g} seconds, "
                f"not {self.max_delay!r}"
            )
        validate_seconds("retry_delay", self.retry_delay, 0.0, MAX_DELAY)
        for name in ("enqueue_timeout", "stall_timeout"):
            v = getattr(self, name)
            if not is_finite_number(v) or v <= 0:
                raise ConfigError(f"{name} must be a positive number of seconds, not {v!r}")
        if self.filler not in FILLERS:
            raise ConfigError(f"filler must be one of {', '.join(FILLERS)}, not {self.filler!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise ConfigError(f"seed must be an integer, not {self.seed!r}")

    @property
    def queues(self) -> int:
        """Queues of a cycle: one per payload size, and the grouped one."""
        return len(self.payload_sizes) + (1 if self.grouped else 0)

    @property
    def grouped(self) -> bool:
        """Whether a cycle has the grouped queue (the last, index ``len(payload_sizes)``)."""
        return self.grouped_consumers > 0

    @property
    def timed(self) -> bool:
        """Whether every received table records the consumer and the times
        (a run with SQL consumers; the grouped queue's always does)."""
        return self.sql_consumers > 0

    @property
    def waits(self) -> bool:
        """Whether entries wait for a due time in this run (delayed entries or a
        retry backoff): the proof then reads ``due`` and ``retried``."""
        return self.delayed_share > 0 or self.retry_delay > 0

    @property
    def resilient(self) -> bool:
        """Whether workers outlive a lost database session (reconnect and resume):
        under ``chaos`` and ``chaos_failover``."""
        return self.chaos or self.chaos_failover is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["payload_sizes"] = list(self.payload_sizes)
        d["chaos_interval"] = list(self.chaos_interval)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RegressConfig:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        # A run stored before the grouped queue existed had none.
        known.setdefault("grouped_consumers", 0)
        if "payload_sizes" in known:
            known["payload_sizes"] = tuple(known["payload_sizes"])
        if "chaos_interval" in known:
            known["chaos_interval"] = tuple(known["chaos_interval"])
        return cls(**known)


def parse_sizes(text: str) -> tuple[int, ...]:
    """``"16,200,2k,20k,200k"`` -> (16, 200, 2000, 20000, 200000); k=1000, m=1000000.

    :raises ConfigError: not a comma-separated list of sizes.
    """
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        mult = 1
        if p.endswith("k"):
            mult, p = 1000, p[:-1]
        elif p.endswith("m"):
            mult, p = 1000_000, p[:-1]
        if not p.isdigit():
            raise ConfigError(
                f"payload sizes must be comma-separated byte counts (e.g. 16,200,2k), not {text!r}"
            )
        out.append(int(p) * mult)
    return tuple(out)
