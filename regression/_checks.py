"""The checks of the proof, as Spark DataFrames over what a run stored.

:func:`check` reads what was sent, rolled back and received in the chosen
cycles (payloads reduced to their digests as they are read) and builds one
DataFrame per promise (:class:`Checked`): the first deliveries judged against
what was committed (``verdict``: ok, ``corrupt``, ``rolled_back_delivered``,
``phantom``), the extra deliveries, the committed entries never received
(split into those still queued at the cycle's end, not drained, and the
lost ones, whose rows are gone or were consumed without a recorded
delivery), the reused sequences,
the order breaks, and on the grouped queue the entries dequeued while one of
their group was held; in a run whose entries wait (delays, a retry
backoff), the takes of delayed entries against their due times and the
takes of rolled-back entries against their backoff. :func:`acked_lost` compares a fail-over cycle's
acknowledged entries with what the new primary holds. Nothing is counted
here: :mod:`._findings` turns the DataFrames into the report's numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from psycopg import sql
from ringq.engine.sqlfile import compose

from . import _queries as S
from . import _report as R
from . import _store
from ._jdbc import FETCH_BYTES, PARTITION_BYTES, JdbcReader, received_counts
from ._store import QueueRef, RunInfo

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

# Columns only the timed received tables have (the grouped queue's, and every
# queue's in a run with SQL consumers), and their Spark types.
GROUPED_COLUMNS = {
    "worker": "short",
    "msg_group": "string",
    "deq_ns": "bigint",
    "commit_ns": "bigint",
}
SYNC = "sync"


@dataclass
class Checked:
    """The DataFrames of one proof (the persisted ones freed by :meth:`unpersist`)."""

    grouped: QueueRef | None  # the run's grouped queue, if any
    sent: DataFrame  # committed entries, with their digest and group
    rolled: DataFrame  # entries of rolled-back transactions
    recv: DataFrame  # every received row, payload reduced to digest and header
    nth: DataFrame  # recv with each row's delivery number (``nth``)
    extra: DataFrame  # deliveries after the first
    lost: DataFrame  # committed, never received, not queued at the cycle's end
    undrained: DataFrame  # committed, never received, still queued at the cycle's end
    reused: DataFrame  # (cycle, queue, qseq) of more than one committed entry
    judged: DataFrame  # first deliveries with their ``verdict`` and ``latency_ms``
    ooo: DataFrame  # per (queue, producer[, group]) order breaks
    held: DataFrame | None  # the grouped queue's entries dequeued while their group was held
    waits: Waits | None = None  # a run whose entries wait: delayed and retried entries

    def unpersist(self) -> None:
        for df in (self.recv, self.nth, self.sent, self.rolled, self.judged):
            df.unpersist()
        if self.waits is not None:
            self.waits.due.unpersist()
            self.waits.retried.unpersist()


@dataclass
class Waits:
    """The entries that waited, and their takes (``after_us``: the take's
    database time minus the earliest the entry could be taken, us)."""

    due: DataFrame  # delayed entries: the delay asked for, the row's not_before (NULL: not read)
    delayed: DataFrame  # every received row of a delayed entry whose due time was read
    retried: DataFrame  # entries a consumer rolled back: the time before the rollback, backoff
    retaken: DataFrame  # every received row of a retried entry taken after that rollback

    @property
    def early(self) -> DataFrame:
        """Delayed entries taken before their due time (tolerance 0)."""
        return self.delayed.filter("after_us < 0")

    @property
    def retried_early(self) -> DataFrame:
        """Rolled-back entries taken again before the backoff (tolerance 0)."""
        return self.retaken.filter("after_us < 0")


def check(
    reader: JdbcReader,
    dsn: str,
    run: RunInfo,
    schema: sql.Composable,
    cycles: sql.Composable,
    committed_at: sql.Composable,
) -> Checked:
    """Read ``cycles`` (a list of literals) of ``run`` and build the checks."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    grouped = next((ref for ref in run.queues if ref.grouped), None)
    sent = reader.read(
        compose(S.JDBC_SENT, committed_at=committed_at, schema=schema, cycles=cycles),
        fetch=10000,
    )
    rolled = reader.read(compose(S.JDBC_ROLLED_BACK, schema=schema, cycles=cycles), fetch=10000)
    recv = _digests(_received(reader, dsn, run, schema, cycles)).persist()
    key = ["cycle", "queue", "qseq"]
    if grouped is not None:
        groups = reader.read(
            compose(S.JDBC_SENT_GROUPS, idx=sql.Literal(grouped.idx), schema=schema, cycles=cycles),
            fetch=10000,
        )
        sent = sent.join(groups, key, "left")
    else:
        sent = sent.withColumn("grp", F.lit(None).cast("string"))
    sent = sent.selectExpr(
        "cycle", "queue", "qseq", "producer", "pseq", "tx", "kind", "length",
        "lower(hex(digest)) AS sha_sent", "committed_at", "grp",
    ).persist()
    rolled = rolled.persist()

    # The first delivery: by dequeue time on the timed queues (the grouped one,
    # and all in a run with SQL consumers: each consumer's recv_order is its
    # own), by recv_order on the others (no deq_ns).
    nth = recv.withColumn(
        "nth",
        F.row_number().over(Window.partitionBy(*key).orderBy("deq_ns", "recv_order")),
    ).persist()
    first = nth.filter("nth = 1").drop("nth")
    judged = _judge(first, sent, rolled)
    # Per (queue, producer), and on the grouped queue per group too (grp is
    # NULL elsewhere), in dequeue order: across every consumer of a queue,
    # linked and SQL alike (a single-mode queue has one dequeuer at a time).
    by_producer = Window.partitionBy("cycle", "queue", "producer", "grp").orderBy(
        "deq_ns", "recv_order"
    )
    # A delay or a backoff never reorders what this order check compares: a
    # single queue's head waits for its time (holding back what is behind
    # it), and the only shared queue (the grouped one) is compared per group,
    # whose head waits too. So the check stays as strict as without waits.
    lost, undrained = split_undelivered(sent, first, _queued(reader, dsn, run, schema, cycles))
    ooo = (
        judged.filter("sent_match")
        .withColumn("prev_pseq", F.lag("pseq").over(by_producer))
        .filter("prev_pseq IS NOT NULL AND pseq < prev_pseq")
    )
    return Checked(
        grouped=grouped,
        sent=sent,
        rolled=rolled,
        recv=recv,
        nth=nth,
        extra=nth.filter("nth > 1"),
        lost=lost,
        undrained=undrained,
        reused=sent.groupBy(*key).count().filter("count > 1"),
        judged=judged,
        ooo=ooo,
        held=_groups_in_flight_twice(recv, grouped),
        waits=_waits(reader, schema, cycles, recv) if run.config.waits else None,
    )


def split_undelivered(
    sent: DataFrame, first: DataFrame, queued: DataFrame
) -> tuple[DataFrame, DataFrame]:
    """The committed entries (``sent``) never received (no row in ``first``),
    as (lost, not drained): not drained, those still queued when their
    cycle's workload ended (``queued``: a workload stopped early, or one
    that stalled); lost, the others (their rows gone, or consumed without a
    recorded delivery). All three are keyed by (cycle, queue, qseq)."""
    key = ["cycle", "queue", "qseq"]
    never = sent.join(first.select(*key), key, "left_anti")
    keys = queued.select(*key)
    return never.join(keys, key, "left_anti"), never.join(keys, key, "left_semi")


def _queued(
    reader: JdbcReader, dsn: str, run: RunInfo, schema: sql.Composable, cycles: sql.Composable
) -> DataFrame:
    """The entries still queued at the end of ``cycles`` (none kept by a run
    stored before they were)."""
    if not _store.queued_kept(dsn, run.run_id):
        return reader.spark.createDataFrame([], "cycle int, queue short, qseq long")
    return reader.read(compose(S.JDBC_QUEUED, schema=schema, cycles=cycles), fetch=10000)


def _waits(
    reader: JdbcReader, schema: sql.Composable, cycles: sql.Composable, recv: DataFrame
) -> Waits:
    """Every take of a delayed entry against the row's due time, and every
    take of a rolled-back entry after its rollback against the time read
    before the rollback plus the backoff: both the database's clock, in us,
    no tolerance. The take's time is the received row's ``deq_at``, written
    after the take in its transaction; the backoff counts from the strike,
    after the time read: both sides err towards passing by a round trip at
    most, never towards a false violation."""
    key = ["cycle", "queue", "qseq"]
    due = reader.read(compose(S.JDBC_DUE, schema=schema, cycles=cycles), fetch=10000).persist()
    retried = (
        reader.read(compose(S.JDBC_RETRIED, schema=schema, cycles=cycles), fetch=10000)
        .withColumnRenamed("deliveries", "rb_deliveries")
        .persist()
    )
    takes = recv.select(*key, "deliveries", "deq_at", "recv_order")
    delayed = (
        takes.join(due.filter("not_before IS NOT NULL"), key)
        .selectExpr(*key, "deliveries", "deq_at", "recv_order", "delay", "not_before",
                    "unix_micros(deq_at) - unix_micros(not_before) AS after_us")
    )
    retaken = (
        takes.join(retried, key)
        .filter("deliveries > rb_deliveries")
        .selectExpr(
            *key, "deliveries", "deq_at", "recv_order", "rb_at", "backoff",
            "unix_micros(deq_at) - (unix_micros(rb_at) + CAST(floor(backoff * 1e6) AS BIGINT)) "
            "AS after_us",
        )
    )
    return Waits(due=due, delayed=delayed, retried=retried, retaken=retaken)


def _received(
    reader: JdbcReader, dsn: str, run: RunInfo, schema: sql.Composable, cycles: sql.Composable
) -> DataFrame:
    """Every queue's received rows, one DataFrame (large tables in several partitions)."""
    from pyspark.sql import functions as F

    sizes = received_counts(dsn, run, cycles)
    parallelism = reader.spark.sparkContext.defaultParallelism
    parts = []
    for ref in run.queues:
        nbytes = sizes.get(ref.idx, 0) * ref.payload_size
        partitions = max(1, min(4 * parallelism, nbytes // PARTITION_BYTES))
        parts.append(
            reader.read(
                compose(
                    S.JDBC_RECEIVED_GROUPED if ref.timed else S.JDBC_RECEIVED,
                    idx=sql.Literal(ref.idx),
                    schema=schema,
                    table=S.received_table(ref.name),
                    cycles=cycles,
                ),
                partitions=int(partitions),
                fetch=max(16, min(10000, FETCH_BYTES // ref.payload_size)),
            )
        )
    raw = parts[0]
    for p in parts[1:]:
        raw = raw.unionByName(p, allowMissingColumns=True)
    # What only the timed queues' consumers record (NULL for the other queues).
    for name, kind in GROUPED_COLUMNS.items():
        if name not in raw.columns:
            raw = raw.withColumn(name, F.lit(None).cast(kind))
    return raw


def _digests(raw: DataFrame) -> DataFrame:
    """Reduce every payload to what the checks need, as it is read: its length,
    SHA-256, whether its embedded checksum holds, and its header's fields."""
    from pyspark.sql import functions as F

    def field(off: int, n: int) -> str:
        return (
            "CASE WHEN plen >= 12 THEN "
            f"CAST(conv(hex(substring(payload, {off + 1}, {n})), 16, 10) AS BIGINT) END"
        )

    return (
        raw.withColumn("plen", F.expr("length(payload)"))
        .withColumn("k", F.expr("least(32, plen - 12)"))
        .selectExpr(
            "queue",
            "cycle",
            "qseq",
            "recv_order",
            "deliveries",
            "deq_at",
            *GROUPED_COLUMNS,
            "plen",
            "sha2(payload, 256) AS sha",
            "CASE WHEN plen >= 16 THEN lower(hex(substring(payload, plen - k + 1, k))) = "
            "substring(sha2(substring(payload, 1, plen - k), 256), 1, 2 * k) ELSE false END AS "
            "check_ok",
            f"{field(0, 1)} AS h_kind",
            f"{field(1, 1)} AS h_queue",
            f"{field(2, 2)} AS h_producer",
            f"{field(4, 4)} AS h_pseq",
            f"{field(8, 4)} AS h_length",
        )
    )


def _judge(first: DataFrame, sent: DataFrame, rolled: DataFrame) -> DataFrame:
    """Each first delivery against what was committed and rolled back: its
    ``verdict`` and, when it was committed, its ``latency_ms`` (persisted)."""
    from pyspark.sql import functions as F

    key = ["cycle", "queue", "qseq"]
    rb_keys = rolled.select(*key).distinct().withColumn("rb_key", F.lit(True))
    rb_ids = rolled.selectExpr(
        "cycle", "queue AS h_queue", "producer AS h_producer", "pseq AS h_pseq"
    ).distinct().withColumn("rb_hdr", F.lit(True))
    return (
        first.join(sent, key, "left")
        .join(rb_keys, key, "left")
        .join(rb_ids, ["cycle", "h_queue", "h_producer", "h_pseq"], "left")
        .withColumn("sent_match", F.expr("producer IS NOT NULL"))
        .withColumn(
            "ident_ok",
            F.expr(
                "coalesce(h_queue = queue AND h_producer = producer AND h_pseq = pseq "
                "AND h_kind = kind "
                "AND h_length = plen, false)"
            ),
        )
        .withColumn(
            "intact",
            F.expr(
                "coalesce(plen = length AND sha = sha_sent AND check_ok, false) AND ident_ok "
                "AND grp <=> msg_group"
            ),
        )
        .withColumn(
            "verdict",
            F.expr(
                "CASE WHEN NOT sent_match "
                "AND (coalesce(rb_key, false) OR coalesce(rb_hdr, false)) "
                f"THEN '{R.ROLLED_BACK_DELIVERED}' "
                f"WHEN NOT sent_match THEN '{R.PHANTOM}' "
                "WHEN NOT ident_ok AND coalesce(rb_hdr, false) THEN "
                f"'{R.ROLLED_BACK_DELIVERED}' "
                f"WHEN NOT intact THEN '{R.CORRUPT}' ELSE 'ok' END"
            ),
        )
        .withColumn(
            "latency_ms",
            F.expr(
                "CASE WHEN sent_match "
                "THEN (unix_micros(deq_at) - unix_micros(committed_at)) / 1000.0 END"
            ),
        )
        .persist()
    )


def _groups_in_flight_twice(recv: DataFrame, grouped: QueueRef | None) -> DataFrame | None:
    """The grouped queue's deliveries dequeued while an earlier-dequeued entry
    of their group was still held (before the latest commit of those began);
    None without a grouped queue. Every received row counts, duplicates too."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    if grouped is None:
        return None
    earlier = (
        Window.partitionBy("cycle", "msg_group")
        .orderBy("deq_ns", "commit_ns", "qseq")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    return (
        recv.filter((F.col("queue") == grouped.idx) & F.col("msg_group").isNotNull())
        .withColumn("held_until_ns", F.max("commit_ns").over(earlier))
        .filter("held_until_ns IS NOT NULL AND deq_ns < held_until_ns")
    )


def acked_lost(
    reader: JdbcReader,
    run: RunInfo,
    schema: sql.Composable,
    cycles: sql.Composable,
    sent: DataFrame,
    report: R.Report,
) -> DataFrame | None:
    """Fail-over runs: the acknowledged entries the new primary does not hold
    and that count as lost (all of them with a synchronous standby, those
    outside the replication gap with an asynchronous one); the counts go to
    ``report.failover``. None for a run without fail-over."""
    from pyspark.sql import functions as F

    mode = run.config.chaos_failover
    if mode is None:
        return None
    acked = reader.read(
        compose(S.JDBC_ACKED, schema=schema, cycles=cycles), fetch=10000
    ).persist()
    ids = ["cycle", "producer", "pseq"]
    kept = sent.select(*ids)
    missing = acked.join(kept, ids, "left_anti").persist()
    # Per producer, the last entry the old primary acknowledged that the new one holds:
    # WAL goes in commit order, so whatever the producer committed before it survived.
    survived = (
        acked.filter("NOT on_new")
        .join(kept, ids, "left_semi")
        .groupBy("cycle", "producer")
        .agg(F.max("pseq").alias("kept_max"))
    )
    outside = missing.join(survived, ["cycle", "producer"], "left").filter(
        "on_new OR pseq < coalesce(kept_max, 0)"
    )
    n_missing, n_outside = missing.count(), outside.count()
    report.failover.update(
        mode=mode,
        acknowledged=acked.count(),
        lost_acknowledged=n_missing,
        lost_in_gap=0 if mode == SYNC else n_missing - n_outside,
        lost_outside_gap=n_outside,
    )
    acked.unpersist()
    return missing if mode == SYNC else outside.drop("kept_max")


def commit_time(dsn: str) -> tuple[str, sql.Composable]:
    """Where latency is measured from (commit timestamps when the server tracks
    them, else the sent row), and the SQL expression for it."""
    commit_ts = _store.commit_timestamps_on(dsn)
    return (
        "commit timestamp" if commit_ts else "sent row (just before commit)",
        sql.SQL(S.COMMITTED_AT_COMMIT_TS if commit_ts else S.COMMITTED_AT_SENT),
    )
