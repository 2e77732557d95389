"""The proof: Spark reads a stored run through JDBC and checks every promise.

For the chosen cycles of a run it proves:

- every committed entry (``sent``) was dequeued (``received_*``) exactly once
  (else ``lost`` / ``duplicate``; ``seq_reused`` if two committed entries share
  a queue sequence);
- nothing rolled back was ever dequeued (``rolled_back_delivered``), and nothing
  dequeued came from nowhere (``phantom``);
- per (queue, producer) the dequeue order follows the commit order, i.e. the
  producer sequence (``out_of_order``);
- every payload is intact (``corrupt``): Spark recomputes SHA-256 over the bytes
  it read and checks it against the producer's digest, the checksum embedded in
  the payload, and the header (queue, producer, sequence, kind, length).

The grouped queue (several consumers, entries in groups) is held to its own
promises instead of one consumer's order:

- per (producer, group), the dequeue order (by the time the consumers
  recorded right after each dequeue) follows the producer sequence
  (``group_order_breaks``, in place of ``out_of_order``);
- per group, sorted by dequeue time, no entry was dequeued before the commit
  of an entry dequeued earlier had begun (``group_in_flight_twice``): at most
  one entry of a group is held at a time, across every consumer;
- the group an entry came out with is the one it was sent with (else
  ``corrupt``, like any other difference from what was committed).

Rolled-back dequeues wrote nothing, so they are not seen; the times are
taken a little after the real claim and a little before the real commit
(one round trip each), so an overlap shorter than that would go unseen.

A fail-over cycle (``--chaos-failover``) also compares what producers were
told had committed (``acked``: their commit returned) with what the new
primary holds (``sent``). With a synchronous standby every acknowledged entry
must be there (else ``lost``). With an asynchronous one an acknowledged entry
may be missing only if it was in the replication gap: WAL goes in commit
order, so per producer the missing entries must all come after the last of
its entries the old primary acknowledged and the standby kept; any other
missing entry (or one acknowledged by the new primary) is ``lost``, those in
the gap are counted and reported (``Report.failover``), not violations.
Entries whose commit raised (``InDoubt``, a lost connection) are not
acknowledged: they are judged by ``sent`` alone, like every other entry.

Payloads are reduced to their digests as they are read, so Spark holds no
payload in memory; tables of large payloads are read in several partitions.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from ringq.engine import ConfigError, converted
from ringq.engine.sqlfile import compose

from . import _queries as S
from . import _report as R
from . import _store
from ._store import QueueRef, RunInfo

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

logger = logging.getLogger("ringq.regression")

DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_DRIVER = "org.postgresql.Driver"
PARTITION_BYTES = 64 << 20  # aim for this much payload per JDBC partition
FETCH_BYTES = 4 << 20  # and this much per JDBC fetch
EXAMPLES = 5
VERIFIABLE = ("done", "failed", "stalled")  # cycle states whose data is complete


class SparkUnavailable(ConfigError):
    """PySpark, Java or the PostgreSQL JDBC driver is missing (the message says how to get it)."""


def jdbc_target(dsn: str) -> tuple[str, dict[str, str]]:
    """The JDBC URL and connection properties for a libpq DSN (URI or key=value).

    :raises ConfigError: the DSN names a unix socket (JDBC speaks TCP only).
    """
    try:
        d = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"invalid DSN: {exc}") from exc
    hosts = str(d.get("hostaddr") or d.get("host") or "localhost").split(",")
    ports = str(d.get("port") or "5432").split(",")
    if any(h.startswith(("/", "@")) for h in hosts):
        raise ConfigError(
            "the Spark analysis reads through JDBC, which needs a TCP host, not a unix socket; "
            "pass a DSN with host=127.0.0.1 (or the server's address)"
        )
    if len(ports) == 1:
        ports = ports * len(hosts)
    netloc = ",".join(
        f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in zip(hosts, ports, strict=False)
    )
    db = str(d.get("dbname") or d.get("user") or os.environ.get("USER", "postgres"))
    props: dict[str, str] = {}
    for key, prop in (("user", "user"), ("password", "password"), ("sslmode", "sslmode"),
                      ("sslrootcert", "sslrootcert"), ("sslcert", "sslcert"), ("sslkey", "sslkey")):
        if d.get(key):
            props[prop] = str(d[key])
    props.setdefault("user", os.environ.get("PGUSER") or os.environ.get("USER") or "postgres")
    if "password" not in props and os.environ.get("PGPASSWORD"):
        props["password"] = os.environ["PGPASSWORD"]
    if len(hosts) > 1 and d.get("target_session_attrs") in ("read-write", "primary"):
        # As libpq would: the primary of the servers named, never a standby
        # (which may not have replayed the last commits yet).
        props["targetServerType"] = "primary"
        # pgjdbc remembers each host's role for hostRecheckSeconds (10 s): a
        # fail-over within that time (the next cycle's) would leave it
        # trying only the host it knew as the primary, now down.
        props["hostRecheckSeconds"] = "0"
    props["ApplicationName"] = "ringq-regress-spark"
    # Binary transfer from the first execution: bytea arrives as bytes, not hex text
    # (about twice as fast for large payloads).
    props["prepareThreshold"] = "-1"
    return f"jdbc:postgresql://{netloc}/{db}", props


class Verifier:
    """A Spark session for proving runs; start it once, verify many cycles.

    ``open()`` starts Spark (about 10 s for a local master); ``close()`` stops
    it, unless the session was given to us or was already active in this
    process (then its owner stops it). Works as
    a context manager; a second ``close()`` does nothing.

    :raises SparkUnavailable: from ``open()``, when PySpark, Java or the JDBC jar is missing.
    """

    def __init__(
        self,
        master: str = "local[*]",
        *,
        jdbc_jar: str = DEFAULT_JDBC_JAR,
        driver_memory: str = "1g",
        shuffle_partitions: int = 4,
        spark: SparkSession | None = None,
    ) -> None:
        self.master = master
        self.jdbc_jar = jdbc_jar
        self.driver_memory = driver_memory
        self.shuffle_partitions = shuffle_partitions
        self._spark = spark
        self._owned = False
        self.startup_s = 0.0

    def check(self) -> None:
        """Check what Spark needs without starting it (cheap; ``open()`` calls it).

        :raises SparkUnavailable: the JDBC jar, PySpark or Java is missing.
        """
        if self._spark is not None:
            return
        if not Path(self.jdbc_jar).is_file():
            raise SparkUnavailable(
                f"PostgreSQL JDBC driver not found at {self.jdbc_jar}: "
                "apt-get install -y libpostgresql-jdbc-java (or pass --jdbc-jar)"
            )
        if importlib.util.find_spec("pyspark") is None:
            raise SparkUnavailable("PySpark is not installed: pip install 'ringq[regression]'")
        java_home = os.environ.get("JAVA_HOME")
        if (
            not (java_home and Path(java_home, "bin", "java").exists())
            and shutil.which("java") is None
        ):
            raise SparkUnavailable(
                "Java is not installed (Spark needs Java 17): apt-get install -y "
                "default-jre-headless"
            )

    def open(self) -> Verifier:
        if self._spark is not None:
            return self
        self.check()
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            # Someone in this process already runs Spark (a test module, a
            # notebook): use it, and leave stopping it to its owner.
            self._spark = active
            return self
        if self.master.startswith("local"):
            # Loopback is enough for a local master (and works in sandboxes
            # where the host name does not resolve).
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        t0 = time.monotonic()
        try:
            self._spark = (
                SparkSession.builder.master(self.master)
                .appName("ringq-regress")
                .config("spark.jars", self.jdbc_jar)
                .config("spark.driver.memory", self.driver_memory)
                .config("spark.sql.shuffle.partitions", str(self.shuffle_partitions))
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.sql.session.timeZone", "UTC")
                .getOrCreate()
            )
        except Exception as exc:  # Java missing, bad master URL, ...
            raise SparkUnavailable(f"could not start Spark ({self.master}): {exc}") from exc
        self._spark.sparkContext.setLogLevel("ERROR")
        self._owned = True
        self.startup_s = time.monotonic() - t0
        return self

    def close(self) -> None:
        spark, self._spark = self._spark, None
        if spark is not None and self._owned:
            spark.stop()
        self._owned = False

    def __enter__(self) -> Self:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def spark(self) -> SparkSession:
        if self._spark is None:
            self.open()
        assert self._spark is not None
        return self._spark

    # -- the proof -------------------------------------------------------------------------

    def verify(self, dsn: str, run_id: str, cycles: list[int] | None = None) -> R.Report:
        """Prove ``cycles`` of run ``run_id`` (default: every complete cycle).

        :raises RunNotFound: no such run. :raises ConfigError: a cycle that does not exist.
        :raises DatabaseUnavailable:
        """
        run = _store.load_run(dsn, run_id)
        rows = {c.cycle: c for c in _store.cycles(dsn, run_id)}
        report = R.Report(run_id, [])
        if cycles is None:
            chosen = [n for n, c in sorted(rows.items()) if c.status in VERIFIABLE]
            report.skipped_cycles = {
                n: f"status {c.status} (its data is incomplete)"
                for n, c in rows.items()
                if c.status not in VERIFIABLE
            }
        else:
            missing = [n for n in cycles if n not in rows]
            if missing:
                raise ConfigError(f"run {run_id} has no cycle {', '.join(map(str, missing))}")
            chosen = sorted(set(cycles))
        report.cycles = chosen
        for n in chosen:
            report.workload_errors.extend(f"cycle {n}: {e}" for e in (rows[n].errors or []))
        report.violations[R.WORKLOAD] = len(report.workload_errors)
        workload_s = sum(rows[n].workload_s or 0.0 for n in chosen)
        t0 = time.monotonic()
        if chosen:
            self._prove(dsn, run, chosen, report)
        report.spark = {
            "master": self.master,
            "analysis_s": round(time.monotonic() - t0, 3),
            "startup_s": round(self.startup_s, 3),
        }
        _add_section_stats(report, run, [rows[n] for n in chosen])
        report.chaos = _chaos_totals([rows[n] for n in chosen])
        if run.config.chaos_failover is not None:
            report.failover.update(_failover_totals([rows[n] for n in chosen]))
        committed = int(report.counts.get("committed", 0))
        nbytes = int(report.counts.get("committed_bytes", 0))
        report.throughput = {
            "workload_s": round(workload_s, 3),
            "entries_per_s": round(committed / workload_s, 1) if workload_s else 0.0,
            "mb_per_s": round(nbytes / workload_s / 1e6, 2) if workload_s else 0.0,
        }
        return report

    def _read(self, url: str, props: dict[str, str], query: sql.Composable, *,
              partitions: int = 1, by: str = "qseq", fetch: int = 1000) -> DataFrame:
        opts = dict(props, driver=JDBC_DRIVER, fetchsize=str(fetch))
        table = compose(S.JDBC_DBTABLE, query=query).as_string(None)
        if partitions > 1:
            preds = [
                compose(
                    S.JDBC_PARTITION,
                    column=sql.Identifier(by),
                    partitions=sql.Literal(partitions),
                    part=sql.Literal(i),
                ).as_string(None)
                for i in range(partitions)
            ]
            return self.spark.read.jdbc(url, table, predicates=preds, properties=opts)
        return self.spark.read.format("jdbc").options(url=url, dbtable=table, **opts).load()

    def _prove(self, dsn: str, run: RunInfo, chosen: list[int], report: R.Report) -> None:
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        url, props = jdbc_target(dsn)
        schema = S.schema_of(run.run_id)
        cycles = sql.SQL(", ").join(sql.Literal(n) for n in chosen)
        commit_ts = _store.commit_timestamps_on(dsn)
        report.latency_from = "commit timestamp" if commit_ts else "sent row (just before commit)"
        committed_at = sql.SQL(S.COMMITTED_AT_COMMIT_TS if commit_ts else S.COMMITTED_AT_SENT)

        sent = self._read(
            url,
            props,
            compose(S.JDBC_SENT, committed_at=committed_at, schema=schema, cycles=cycles),
            fetch=10000,
        )
        rolled = self._read(
            url, props, compose(S.JDBC_ROLLED_BACK, schema=schema, cycles=cycles), fetch=10000
        )

        sizes = _received_counts(dsn, run, cycles)
        grouped = next((ref for ref in run.queues if ref.grouped), None)
        parts = []
        for ref in run.queues:
            nbytes = sizes.get(ref.idx, 0) * ref.payload_size
            partitions = max(
                1, min(4 * self.spark.sparkContext.defaultParallelism, nbytes // PARTITION_BYTES)
            )
            parts.append(
                self._read(
                    url,
                    props,
                    compose(
                        S.JDBC_RECEIVED_GROUPED if ref.grouped else S.JDBC_RECEIVED,
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
        # What only the grouped queue's consumers record (NULL for the other queues).
        for name, kind in GROUPED_COLUMNS.items():
            if name not in raw.columns:
                raw = raw.withColumn(name, F.lit(None).cast(kind))

        def field(off: int, n: int) -> str:
            return (
                "CASE WHEN plen >= 12 THEN "
                f"CAST(conv(hex(substring(payload, {off + 1}, {n})), 16, 10) AS BIGINT) END"
            )

        # Reduce every payload to what the checks need, as it is read.
        recv = (
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
            .persist()
        )
        key = ["cycle", "queue", "qseq"]
        if grouped is not None:
            groups = self._read(
                url,
                props,
                compose(
                    S.JDBC_SENT_GROUPS, idx=sql.Literal(grouped.idx), schema=schema, cycles=cycles
                ),
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

        # The first delivery: by dequeue time on the grouped queue (its consumers'
        # recv_order are their own), by recv_order on the others (no deq_ns).
        nth = recv.withColumn(
            "nth",
            F.row_number().over(Window.partitionBy(*key).orderBy("deq_ns", "recv_order")),
        ).persist()
        first = nth.filter("nth = 1").drop("nth")
        extra = nth.filter("nth > 1")
        lost = sent.join(first.select(*key), key, "left_anti")
        reused = sent.groupBy(*key).count().filter("count > 1")

        rb_keys = rolled.select(*key).distinct().withColumn("rb_key", F.lit(True))
        rb_ids = rolled.selectExpr(
            "cycle", "queue AS h_queue", "producer AS h_producer", "pseq AS h_pseq"
        ).distinct().withColumn("rb_hdr", F.lit(True))
        judged = (
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
        # Per (queue, producer), and on the grouped queue per group too (grp is
        # NULL elsewhere), in dequeue order.
        by_producer = Window.partitionBy("cycle", "queue", "producer", "grp").orderBy(
            "deq_ns", "recv_order"
        )
        ooo = (
            judged.filter("sent_match")
            .withColumn("prev_pseq", F.lag("pseq").over(by_producer))
            .filter("prev_pseq IS NOT NULL AND pseq < prev_pseq")
        )
        held = self._groups_in_flight_twice(recv, grouped)

        # One job per question; the per-queue rows of a rollup carry the totals in the row
        # whose queue is null.
        recv_tot = nth.agg(
            F.count("*").alias("rows"),
            F.count_if(F.col("nth") > 1).alias("extra"),
            F.count_if(F.col("deliveries") > 1).alias("redelivered"),
        ).collect()[0]
        verdict_cols = [R.CORRUPT, R.ROLLED_BACK_DELIVERED, R.PHANTOM]
        per_queue = {
            r["queue"]: r
            for r in judged.rollup("queue").agg(
                F.count("*").alias("delivered"),
                *[F.count_if(F.col("verdict") == k).alias(k) for k in verdict_cols],
                F.percentile_approx("latency_ms", [0.5, 0.95, 0.99], 10000).alias("pct"),
                F.max("latency_ms").alias("max"),
                F.avg("latency_ms").alias("avg"),
            ).collect()
        }
        lost_q = {r["queue"]: int(r["count"]) for r in lost.groupBy("queue").count().collect()}
        ooo_q = {r["queue"]: int(r["count"]) for r in ooo.groupBy("queue").count().collect()}
        group_breaks = ooo_q.pop(grouped.idx, 0) if grouped is not None else 0
        in_flight_twice = held.count() if held is not None else 0
        n_reused = reused.count()
        sent_tx = (
            sent.groupBy("cycle", "producer", "tx")
            .agg(F.first("kind").alias("kind"), F.countDistinct("queue").alias("nq"))
            .groupBy("kind")
            .agg(F.count("*").alias("n"), F.count_if(F.col("nq") > 1).alias("multi"))
            .collect()
        )
        sent_q = {
            r["queue"]: (int(r["n"]), int(r["bytes"] or 0))
            for r in sent.groupBy("queue")
            .agg(F.count("*").alias("n"), F.sum("length").alias("bytes"))
            .collect()
        }
        rb_tx = rolled.groupBy("cycle", "producer", "tx", "reason").count().collect()

        acked_lost = self._acked_lost(url, props, run, schema, cycles, sent, report)
        if acked_lost is not None:
            for r in acked_lost.groupBy("queue").count().collect():
                lost_q[r["queue"]] = lost_q.get(r["queue"], 0) + int(r["count"])

        total = per_queue.get(None)
        v = report.violations
        v[R.LOST] = sum(lost_q.values())
        v[R.DUPLICATE] = int(recv_tot["extra"] or 0)
        v[R.OUT_OF_ORDER] = sum(ooo_q.values())
        v[R.GROUP_ORDER] = group_breaks
        v[R.GROUP_IN_FLIGHT] = in_flight_twice
        for k in verdict_cols:
            v[k] = int(total[k]) if total else 0
        v[R.SEQ_REUSED] = n_reused

        names = {ref.idx: ref.name for ref in run.queues}

        def rows(df: DataFrame, *cols: str) -> list[dict[str, Any]]:
            out = []
            for r in df.select(*cols).limit(EXAMPLES).collect():
                d = r.asDict()
                if "queue" in d:
                    d["queue"] = names.get(d["queue"], d["queue"])
                out.append(d)
            return out

        ex: dict[str, list[dict[str, Any]]] = {}
        if v[R.LOST]:
            ex[R.LOST] = rows(lost, "cycle", "queue", "qseq", "producer", "pseq", "tx")
            if acked_lost is not None and len(ex[R.LOST]) < EXAMPLES:
                ex[R.LOST] += rows(
                    acked_lost.withColumn("acknowledged", F.lit(True)),
                    "cycle", "queue", "qseq", "producer", "pseq", "tx", "acknowledged",
                )
        if v[R.DUPLICATE]:
            ex[R.DUPLICATE] = rows(extra, "cycle", "queue", "qseq", "recv_order", "deliveries")
        if v[R.OUT_OF_ORDER]:
            ex[R.OUT_OF_ORDER] = rows(
                ooo.filter(F.col("grp").isNull()),
                "cycle", "queue", "producer", "pseq", "prev_pseq", "recv_order",
            )
        if v[R.GROUP_ORDER]:
            ex[R.GROUP_ORDER] = rows(
                ooo.filter(F.col("grp").isNotNull()),
                "cycle", "queue", "grp", "producer", "pseq", "prev_pseq", "deq_ns",
            )
        if v[R.GROUP_IN_FLIGHT] and held is not None:
            ex[R.GROUP_IN_FLIGHT] = rows(
                held, "cycle", "queue", "msg_group", "qseq", "worker", "deq_ns", "held_until_ns"
            )
        for kind in verdict_cols:
            if v[kind]:
                ex[kind] = rows(
                    judged.filter(F.col("verdict") == kind),
                    "cycle",
                    "queue",
                    "qseq",
                    "plen",
                    "length",
                    "check_ok",
                    "h_producer",
                    "h_pseq",
                    "producer",
                    "pseq",
                    "grp",
                    "msg_group",
                )
        if v[R.SEQ_REUSED]:
            ex[R.SEQ_REUSED] = rows(reused, "cycle", "queue", "qseq", "count")
        report.examples = ex

        # -- figures -------------------------------------------------------------------------
        kinds = {int(r["kind"]): int(r["n"]) for r in sent_tx}
        rb_by_reason: dict[str, int] = {}
        for r in rb_tx:
            rb_by_reason[str(r["reason"])] = rb_by_reason.get(str(r["reason"]), 0) + 1
        report.counts = {
            "committed": sum(n for n, _ in sent_q.values()),
            "committed_bytes": sum(b for _, b in sent_q.values()),
            "rolled_back": sum(int(r["count"]) for r in rb_tx),
            "received_rows": int(recv_tot["rows"]),
            "delivered": int(total["delivered"]) if total else 0,
            "redelivered": int(recv_tot["redelivered"] or 0),
            "transactions": {
                "simple": kinds.get(1, 0),
                "two_phase": kinds.get(2, 0),
                "multi_queue": sum(int(r["multi"]) for r in sent_tx),
                "rolled_back": len({(r["cycle"], r["producer"], r["tx"]) for r in rb_tx}),
                "rolled_back_by_reason": rb_by_reason,
            },
        }
        report.latency_ms = _lat(total) if total else {}
        report.queues = []
        for ref in run.queues:
            n, nbytes = sent_q.get(ref.idx, (0, 0))
            row = per_queue.get(ref.idx)
            report.queues.append({
                "name": ref.name,
                "index": ref.idx,
                "payload_size": ref.payload_size,
                "capacity": ref.capacity,
                "committed": n,
                "committed_bytes": nbytes,
                "delivered": int(row["delivered"]) if row else 0,
                "violations": {
                    R.LOST: lost_q.get(ref.idx, 0),
                    R.OUT_OF_ORDER: ooo_q.get(ref.idx, 0),
                    **{k: int(row[k]) if row else 0 for k in verdict_cols},
                    **(
                        {R.GROUP_ORDER: group_breaks, R.GROUP_IN_FLIGHT: in_flight_twice}
                        if ref.grouped
                        else {}
                    ),
                },
                "latency_ms": _lat(row) if row else {},
            })
        if grouped is not None:
            report.groups = self._group_figures(run, grouped, recv, sent)
            report.groups.update(order_breaks=group_breaks, in_flight_twice=in_flight_twice)
        for df in (recv, nth, sent, rolled, judged):
            df.unpersist()

    @staticmethod
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

    @staticmethod
    def _group_figures(
        run: RunInfo, grouped: QueueRef, recv: DataFrame, sent: DataFrame
    ) -> dict[str, Any]:
        """What the grouped queue did: entries, groups, consumers, and the most
        entries held at once (dequeued, commit not begun), over all groups."""
        from pyspark.sql import Window
        from pyspark.sql import functions as F

        rows = recv.filter(F.col("queue") == grouped.idx)
        got = rows.agg(
            F.count("*").alias("rows"),
            F.countDistinct("msg_group").alias("groups"),
            F.countDistinct("worker").alias("workers"),
        ).collect()[0]
        committed = sent.filter(F.col("queue") == grouped.idx).count()
        # Held at once: +1 at each dequeue, -1 at each commit, summed in time order
        # (a commit before a dequeue of the same nanosecond).
        edges = rows.selectExpr("cycle", "deq_ns AS t", "1 AS d").unionByName(
            rows.selectExpr("cycle", "commit_ns AS t", "-1 AS d")
        )
        running = edges.withColumn(
            "held", F.sum("d").over(Window.partitionBy("cycle").orderBy("t", "d"))
        )
        most = running.agg(F.max("held").alias("most")).collect()[0]["most"]
        return {
            "queue": grouped.name,
            "groups": run.config.groups,
            "groups_seen": int(got["groups"] or 0),
            "consumers": run.config.grouped_consumers,
            "consumers_seen": int(got["workers"] or 0),
            "committed": committed,
            "received_rows": int(got["rows"] or 0),
            "most_held_at_once": int(most or 0),
        }

    def _acked_lost(
        self,
        url: str,
        props: dict[str, str],
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
        acked = self._read(
            url, props, compose(S.JDBC_ACKED, schema=schema, cycles=cycles), fetch=10000
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


def _lat(row: Any) -> dict[str, float]:
    pct = row["pct"] or [0.0, 0.0, 0.0]
    return {
        "p50": round(float(pct[0]), 3),
        "p95": round(float(pct[1]), 3),
        "p99": round(float(pct[2]), 3),
        "max": round(float(row["max"] or 0.0), 3),
        "avg": round(float(row["avg"] or 0.0), 3),
    }


def _received_counts(dsn: str, run: RunInfo, cycles: sql.Composable) -> dict[int, int]:
    """Rows per received table in ``cycles`` (a list of literals), to choose how many
    JDBC partitions to read with."""
    out = {}
    with converted(dsn=dsn), psycopg.connect(dsn, autocommit=True) as conn:
        for ref in run.queues:
            row = conn.execute(
                compose(
                    S.RECEIVED_COUNT,
                    schema=S.schema_of(run.run_id),
                    table=S.received_table(ref.name),
                    cycles=cycles,
                )
            ).fetchone()
            out[ref.idx] = int(row[0]) if row else 0
    return out


def _add_section_stats(report: R.Report, run: RunInfo, rows: list[_store.CycleRow]) -> None:
    """Fold the workload's own counters (from the global section) into the per-queue figures."""
    by_name = {q["name"]: q for q in report.queues}
    for ref in run.queues:
        q = by_name.get(ref.name)
        if q is None:
            q = {
                "name": ref.name,
                "index": ref.idx,
                "payload_size": ref.payload_size,
                "capacity": ref.capacity,
            }
            report.queues.append(q)
        for row in rows:
            st = ((row.stats or {}).get("queues") or {}).get(ref.name) or {}
            q["max_depth"] = max(int(q.get("max_depth", 0)), int(st.get("max_depth", 0)))
            for k in ("full_hits", "empty_hits", "poisoned", "repairs", "resyncs", "leftover"):
                q[k] = int(q.get(k, 0)) + int(st.get(k, 0))


# Columns only the grouped queue's received table has, and their Spark types.
GROUPED_COLUMNS = {
    "worker": "short",
    "msg_group": "string",
    "deq_ns": "bigint",
    "commit_ns": "bigint",
}
CHAOS_COUNTS = ("producers", "consumers", "monitor", "pg_restarts", "reconnects", "resumed")
SYNC = "sync"


def _chaos_totals(rows: list[_store.CycleRow]) -> dict[str, int]:
    """Kills per kind over the cycles that ran with chaos (empty: none did)."""
    out: dict[str, int] = {}
    for row in rows:
        ch = (row.stats or {}).get("chaos")
        if not ch:
            continue
        for k in CHAOS_COUNTS:
            out[k] = out.get(k, 0) + int(ch.get(k, 0))
    return out


def _failover_totals(rows: list[_store.CycleRow]) -> dict[str, Any]:
    """The fail-overs of ``rows`` (cycles of a --chaos-failover run): promotions,
    the slowest timings, the largest gap measured before a kill, how the old
    primaries were rebuilt."""
    out: dict[str, Any] = {"promotions": 0, "rebuilt": []}
    for row in rows:
        f = (row.stats or {}).get("failover")
        if not f:
            continue
        out["promotions"] += int(f.get("promotions", 0))
        for key in ("kill_to_promoted_s", "kill_to_first_dequeue_s", "rebuild_s"):
            if f.get(key) is not None:
                out[key] = max(float(f[key]), float(out.get(key, 0.0)))
        gap = f.get("gap") or {}
        for key in ("unflushed_bytes", "unreplayed_bytes", "walsender_paused_s"):
            if gap.get(key) is not None:
                out[key] = max(gap[key], out.get(key, 0))
        if f.get("rebuilt"):
            out["rebuilt"].append(str(f["rebuilt"]))
    return out
