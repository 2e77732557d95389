"""The proof: Spark reads a stored run through JDBC and checks every promise.

For the chosen cycles of a run it proves:

- every committed entry (``sent``) was dequeued (``received_*``) exactly once
  (else ``lost`` / ``duplicate``; ``seq_reused`` if two committed entries share
  a queue sequence). An entry never dequeued but still queued when the
  cycle's workload ended (``queued``, kept by the cycle) is ``not_drained``,
  not ``lost``: the workload stopped early (its ``workload_error`` says why)
  or, without one, stalled; both fail the proof. ``lost`` is left with the
  entries whose rows are gone or were consumed without a recorded delivery;
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

A run whose entries wait (``delayed_share``, ``retry_delay``) adds, by the
database's clock and with no tolerance:

- no delayed entry was taken before its due time, the ``not_before`` its row
  got (``taken_before_due``); a take's time is the received row's ``deq_at``
  (``clock_timestamp()`` in the consumer's transaction, after the take);
- no entry a consumer rolled back on purpose was taken again (a take with
  more deliveries) before the time read just before the rollback plus the
  queue's backoff (``retried_before_backoff``).

Both sides lean towards passing by at most a round trip, never towards a
false violation. The order checks stay as strict: a single queue's head
waits for its due time (holding back what is behind it), and the grouped
queue, the only shared one, is checked per group, whose head waits too.

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

This module holds :class:`Verifier`, the Spark session and the proof's entry;
the reading is in :mod:`._jdbc`, the checks in :mod:`._checks`, the counting
into the report in :mod:`._findings`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Self

from psycopg import sql
from ringq.engine import ConfigError

from . import _queries as S
from . import _report as R
from . import _store
from ._checks import acked_lost, check, commit_time
from ._findings import (
    add_section_stats,
    chaos_totals,
    consumer_totals,
    failover_totals,
    tally,
)
from ._jdbc import DEFAULT_JDBC_JAR, JdbcReader
from ._store import RunInfo

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

logger = logging.getLogger("ringq.regression")

VERIFIABLE = ("done", "failed", "stalled")  # cycle states whose data is complete


class SparkUnavailable(ConfigError):
    """PySpark, Java or the PostgreSQL JDBC driver is missing (the message says how to get it)."""


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
        add_section_stats(report, run, [rows[n] for n in chosen])
        report.chaos = chaos_totals([rows[n] for n in chosen])
        report.consumers = consumer_totals([rows[n] for n in chosen], workload_s)
        if run.config.chaos_failover is not None:
            report.failover.update(failover_totals([rows[n] for n in chosen]))
        committed = int(report.counts.get("committed", 0))
        nbytes = int(report.counts.get("committed_bytes", 0))
        report.throughput = {
            "workload_s": round(workload_s, 3),
            "entries_per_s": round(committed / workload_s, 1) if workload_s else 0.0,
            "mb_per_s": round(nbytes / workload_s / 1e6, 2) if workload_s else 0.0,
        }
        return report

    def _prove(self, dsn: str, run: RunInfo, chosen: list[int], report: R.Report) -> None:
        reader = JdbcReader(self.spark, dsn)
        schema = S.schema_of(run.run_id)
        cycles = sql.SQL(", ").join(sql.Literal(n) for n in chosen)
        report.latency_from, committed_at = commit_time(dsn)
        checked = check(reader, dsn, run, schema, cycles, committed_at)
        lost = acked_lost(reader, run, schema, cycles, checked.sent, report)
        tally(run, checked, lost, report)
