"""Queue scripting: the SQL that creates ringq's schema and its queues.

The same composed SQL is printed for a DBA to review (:func:`create_queue_script`)
and applied through psycopg (:func:`create_queue`), so what is reviewed is
what runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from ringq.engine import (
    DEFAULT_LEASE,
    MAX_CAPACITY,
    ConfigError,
    QueueNotFound,
    Section,
    is_finite_number,
    pg,
    queue_table,
    validate_queue_name,
)
from ringq.engine.layout import CACHE_POOL, MAX_QUEUES, RECORD_HEAD, SLOT_POOL, cache_stride
from ringq.engine.sqlfile import compose, load

from . import _queries as Qy

SCHEMA_VERSION = 1
MAX_PAYLOAD = 1 << 30  # PostgreSQL's limit for one bytea value (1 GiB)
MAX_DELIVERIES = 1_000_000
# The global section keeps full_timeout in milliseconds in an int64 word (at
# most 2**63 - 1 ms, about 9.22e15 s); 9e15 s leaves room for float rounding.
MAX_FULL_TIMEOUT = 9e15  # seconds
MAX_LEASE = 9e15  # seconds: the section keeps the lease in milliseconds too
MAX_RETRY = 1e9  # seconds: retry_delay and retry_max (ddl.sql's checks say the same)
MAX_RETRY_FACTOR = 100.0
# Payload cache: bytes cached per slot when not given (payloads up to this
# size are served from shared memory; or max_payload, when smaller), and the
# most a queue may ask for.
DEFAULT_CACHE_PAYLOAD = 512
MAX_CACHE_PAYLOAD = 1 << 16
# The same bounds are written in ddl.sql's queues_fit_section constraint.

_BLOCKS = load("ringq.scripting", "ddl.sql")


@dataclass(frozen=True)
class QueueSpec:
    """The settings a queue is created with; validated on creation.

    :raises ConfigError: a value is out of range (the message says which).
    """

    name: str
    capacity: int
    max_payload: int
    full_policy: str = "block"
    full_timeout: float = 30.0
    dequeue_mode: str = "single"
    max_deliveries: int = 3
    exception_queue: str | None = None
    fillfactor: int = 50
    tablespace: str | None = None
    lease: float = DEFAULT_LEASE
    # payload bytes per slot cached in the global section (0: none); None:
    # min(max_payload, DEFAULT_CACHE_PAYLOAD) if the section's cache pool has
    # room for it when the queue is made, else 0
    cache_payload: int | None = None
    # Retry backoff: a delivery that did not commit makes the entry due again
    # retry_delay * retry_factor ** (deliveries before) seconds later, at most
    # retry_max (0: no cap); retry_delay 0: at once (the database's clock).
    retry_delay: float = 0.0
    retry_factor: float = 1.0
    retry_max: float = 0.0

    def __post_init__(self) -> None:
        validate_queue_name(self.name)
        _int_in("capacity", self.capacity, 1, MAX_CAPACITY)
        _int_in("max_payload", self.max_payload, 1, MAX_PAYLOAD)
        _int_in("max_deliveries", self.max_deliveries, 1, MAX_DELIVERIES)
        _int_in("fillfactor", self.fillfactor, 10, 100)
        if self.full_policy not in ("block", "raise"):
            raise ConfigError(f"full_policy must be 'block' or 'raise', not {self.full_policy!r}")
        if self.dequeue_mode not in ("single", "shared"):
            raise ConfigError(
                f"dequeue_mode must be 'single' or 'shared', not {self.dequeue_mode!r}"
            )
        timeout = self.full_timeout
        if not is_finite_number(timeout) or not 0 <= timeout <= MAX_FULL_TIMEOUT:
            raise ConfigError(
                f"full_timeout must be a number of seconds from 0 to {MAX_FULL_TIMEOUT:g}, "
                f"not {self.full_timeout!r}"
            )
        if not is_finite_number(self.lease) or not 0 <= self.lease <= MAX_LEASE:
            raise ConfigError(
                f"lease must be a number of seconds from 0 to {MAX_LEASE:g} (0: none), "
                f"not {self.lease!r}"
            )
        check_retry(self.retry_delay, self.retry_factor, self.retry_max)
        if self.cache_payload is not None:
            _int_in(
                "cache_payload", self.cache_payload, 0,
                min(self.max_payload, MAX_CACHE_PAYLOAD),
            )
        if self.exception_queue is not None:
            validate_queue_name(self.exception_queue)
            if self.exception_queue == self.name:
                raise ConfigError("a queue cannot be its own exception queue")
        if self.tablespace is not None:
            validate_tablespace_name(self.tablespace)


def check_retry(delay: object, factor: object, cap: object) -> None:
    """Check a queue's retry backoff settings (see :class:`QueueSpec`).

    :raises ConfigError: a value is not a finite number in its range.
    """
    for what, value, low, high in (("retry_delay", delay, 0.0, MAX_RETRY),
                                   ("retry_factor", factor, 1.0, MAX_RETRY_FACTOR),
                                   ("retry_max", cap, 0.0, MAX_RETRY)):
        if not is_finite_number(value) or not low <= value <= high:
            raise ConfigError(
                f"{what} must be a number from {low:g} to {high:g}, not {value!r}"
            )


def alter_retry(
    conn: psycopg.Connection[Any], name: str, *, retry_delay: float | None = None,
    retry_factor: float | None = None, retry_max: float | None = None,
) -> None:
    """Change an existing queue's retry backoff (None: keep); the next
    strike reads it (it is not in the global section).

    :raises QueueNotFound: no such queue.
    :raises ConfigError: a value out of range.
    """
    validate_queue_name(name)
    check_retry(0.0 if retry_delay is None else retry_delay,
                1.0 if retry_factor is None else retry_factor,
                0.0 if retry_max is None else retry_max)
    with pg.transaction(conn, queue=name):
        conn.execute(schema_sql())  # adds the columns to a database made before
        row = conn.execute(
            compose(_BLOCKS["alter_retry"], name=sql.Literal(name),
                    retry_delay=sql.Literal(retry_delay), retry_factor=sql.Literal(retry_factor),
                    retry_max=sql.Literal(retry_max))
        ).fetchone()
        if row is None:
            raise QueueNotFound(f"queue {name!r} does not exist", queue=name)


def validate_tablespace_name(name: object) -> str:
    """Return ``name`` if it can name a PostgreSQL tablespace, else raise.

    A tablespace is an identifier of 1 to 63 bytes (NAMEDATALEN - 1). It is
    always used quoted (``psycopg.sql.Identifier``), so any other character is
    safe and case is kept: ``Fast_SSD`` names the tablespace created as
    ``"Fast_SSD"``, not one created unquoted (that one is ``fast_ssd``).

    :raises ConfigError: empty, longer than 63 bytes, or with a control character.
    """
    if (
        not isinstance(name, str)
        or not 1 <= len(name.encode()) <= 63
        or any(ord(c) < 32 or ord(c) == 127 for c in name)
    ):
        raise ConfigError(
            f"invalid tablespace name {name!r}: a PostgreSQL identifier of 1 to 63 bytes "
            "without control characters is expected"
        )
    return name


def _int_in(what: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{what} must be an integer from {low:,} to {high:,}, not {value!r}")


def schema_sql() -> sql.SQL:
    """The management schema, tables and SQL functions (idempotent, versioned)."""
    return sql.SQL(_BLOCKS["schema"])


def queue_sql(spec: QueueSpec) -> sql.Composed:
    """The queue's management row, its pre-populated table and storage settings."""
    cache = (
        min(spec.max_payload, DEFAULT_CACHE_PAYLOAD)
        if spec.cache_payload is None
        else spec.cache_payload
    )
    # The table and its primary-key index (the only index) both go to the tablespace.
    tablespace_clause: sql.Composable = (
        sql.SQL("TABLESPACE {}").format(sql.Identifier(spec.tablespace))
        if spec.tablespace
        else sql.SQL("")
    )
    index_tablespace_clause: sql.Composable = (
        sql.SQL("USING INDEX TABLESPACE {}").format(sql.Identifier(spec.tablespace))
        if spec.tablespace
        else sql.SQL("")
    )
    return compose(
        _BLOCKS["queue"],
        name=sql.Literal(spec.name),
        capacity=sql.Literal(spec.capacity),
        max_payload=sql.Literal(spec.max_payload),
        full_policy=sql.Literal(spec.full_policy),
        full_timeout=sql.Literal(float(spec.full_timeout)),
        dequeue_mode=sql.Literal(spec.dequeue_mode),
        max_deliveries=sql.Literal(spec.max_deliveries),
        exception_queue=sql.Literal(spec.exception_queue),
        fillfactor=sql.Literal(spec.fillfactor),
        tablespace=sql.Literal(spec.tablespace),
        tablespace_clause=tablespace_clause,
        index_tablespace_clause=index_tablespace_clause,
        table=queue_table(spec.name),
        max_capacity=sql.Literal(MAX_CAPACITY),
        max_payload_limit=sql.Literal(MAX_PAYLOAD),
        max_deliveries_limit=sql.Literal(MAX_DELIVERIES),
        max_full_timeout=sql.Literal(MAX_FULL_TIMEOUT),
        lease=sql.Literal(float(spec.lease)),
        max_lease=sql.Literal(MAX_LEASE),
        retry_delay=sql.Literal(float(spec.retry_delay)),
        retry_factor=sql.Literal(float(spec.retry_factor)),
        retry_max=sql.Literal(float(spec.retry_max)),
        cache_payload=sql.Literal(cache),
        cache_given=sql.Literal(spec.cache_payload is not None),
        cache_stride=sql.Literal(cache_stride(cache)),
        cache_stride_of_column=sql.SQL(
            "(CASE WHEN cache_payload > 0 THEN {} + (cache_payload + 7) / 8 * 8 ELSE 0 END)"
        ).format(sql.Literal(RECORD_HEAD)),
        cache_pool=sql.Literal(CACHE_POOL),
        max_cache_payload=sql.Literal(MAX_CACHE_PAYLOAD),
        max_queues=sql.Literal(MAX_QUEUES),
        slot_pool=sql.Literal(SLOT_POOL),
    )


def drop_queue_sql(name: str) -> sql.Composed:
    return compose(
        _BLOCKS["drop_queue"], name=sql.Literal(validate_queue_name(name)), table=queue_table(name)
    )


def create_queue_script(spec: QueueSpec) -> str:
    """The reviewable script for psql: one transaction, safe to apply again."""
    body = sql.SQL("\n\n").join([schema_sql(), queue_sql(spec)]).as_string(None)
    return (
        f"-- ringq queue script (schema version {SCHEMA_VERSION}): queue {spec.name!r}, "
        f"{spec.capacity:,} slots, max payload {spec.max_payload:,} bytes\n"
        '-- Apply with: psql "$DSN" -v ON_ERROR_STOP=1 -f this.sql  (re-applying changes nothing)\n'
        "BEGIN;\n\n" + body + "\n\nCOMMIT;\n"
    )


def create_schema(conn: psycopg.Connection[Any]) -> None:
    """Create (or migrate) the management schema in its own transaction."""
    with pg.transaction(conn):
        conn.execute(schema_sql())


def create_queue(conn: psycopg.Connection[Any], spec: QueueSpec) -> bool:
    """Create the queue (and the schema if absent) in one transaction.

    :returns: True if the queue was created, False if it already existed with these settings.
    :raises QueueExists: it exists with different settings.
    :raises QueueNotFound: a new queue names an exception queue that does not exist.
    :raises ConfigError: the exception queue's max_payload is smaller than the queue's.
    :raises ConfigError: it would not fit in the global section beside the
        queues already in the database (``MAX_QUEUES`` queues, ``SLOT_POOL`` slots).
    """
    # creating: the queue block's own checks (ddl.sql) mean QueueExists,
    # QueueNotFound (its exception queue) or ConfigError (see pg.from_psycopg).
    with pg.transaction(conn, queue=spec.name, creating=True):
        # The schema block takes the DDL advisory lock: look only after it,
        # so that of two concurrent creators exactly one reports "created".
        conn.execute(schema_sql())
        existed = _queue_exists(conn, spec.name)
        conn.execute(queue_sql(spec))
    return not existed


def drop_queue(conn: psycopg.Connection[Any], name: str) -> None:
    """Drop the queue, its table and its side rows; then remove its wake-up
    semaphores on this host (they would outlive it in /dev/shm). A process
    still waiting on one keeps it until it lets go.

    :raises QueueNotFound: no such queue.
    """
    with pg.transaction(conn, queue=name):
        if not _queue_exists(conn, name):
            raise QueueNotFound(f"queue {name!r} does not exist", queue=name)
        row = conn.execute(Qy.QUEUE_SECTION, (name,)).fetchone()
        conn.execute(drop_queue_sql(name))
    if row is not None and row[1]:
        Section.unlink_semaphores(str(row[1]), [int(row[0])])


def _queue_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    row = conn.execute(Qy.SCHEMA_PRESENT).fetchone()
    if not row or not row[0]:
        return False
    return conn.execute(Qy.QUEUE_EXISTS, (name,)).fetchone() is not None
