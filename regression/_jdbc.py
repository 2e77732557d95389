"""How the proof reads a run: JDBC from Spark, and a count or two through libpq.

:func:`jdbc_target` turns a libpq DSN into pgjdbc's URL and properties;
:class:`JdbcReader` reads one of ``queries.sql``'s ``jdbc_`` blocks into a
Spark DataFrame (in several partitions for large tables);
:func:`received_counts` tells how large each received table is, to choose
those partitions.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from psycopg import sql
from ringq.engine import ConfigError, check_dsn, pg
from ringq.engine.sqlfile import compose

from . import _queries as S
from ._store import RunInfo

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

DEFAULT_JDBC_JAR = "/usr/share/java/postgresql.jar"
JDBC_DRIVER = "org.postgresql.Driver"
PARTITION_BYTES = 64 << 20  # aim for this much payload per JDBC partition
FETCH_BYTES = 4 << 20  # and this much per JDBC fetch


def jdbc_target(dsn: str) -> tuple[str, dict[str, str]]:
    """The JDBC URL and connection properties for a libpq DSN (URI or key=value).

    :raises ConfigError: the DSN does not parse, or names a unix socket (JDBC speaks TCP only).
    """
    d = check_dsn(dsn)  # ConfigError "invalid DSN ..." if libpq cannot parse it
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


class JdbcReader:
    """Reads queries of one database into DataFrames of one Spark session.

    :raises ConfigError: (on creation) the DSN names a unix socket.
    """

    def __init__(self, spark: SparkSession, dsn: str) -> None:
        self.spark = spark
        self.url, self.props = jdbc_target(dsn)

    def read(self, query: sql.Composable, *, partitions: int = 1, by: str = "qseq",
             fetch: int = 1000) -> DataFrame:
        """``query`` as a DataFrame, in ``partitions`` partitions by ``by`` modulo
        the partition count, ``fetch`` rows per round trip."""
        opts = dict(self.props, driver=JDBC_DRIVER, fetchsize=str(fetch))
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
            return self.spark.read.jdbc(self.url, table, predicates=preds, properties=opts)
        return self.spark.read.format("jdbc").options(url=self.url, dbtable=table, **opts).load()


def received_counts(dsn: str, run: RunInfo, cycles: sql.Composable) -> dict[int, int]:
    """Rows per received table in ``cycles`` (a list of literals), to choose how many
    JDBC partitions to read with."""
    out = {}
    with pg.connected(dsn) as conn:
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
