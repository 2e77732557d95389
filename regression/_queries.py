"""The regression run store's named SQL (``queries.sql``), parsed once at import.

Every block is named here as a constant, so that a block missing from the
file fails at import and not in the middle of a cycle. ``{schema}`` is
``regress_<run id>`` and ``{table}`` a received table (or a queue's), both
filled only through :func:`psycopg.sql.Identifier` from validated names.
Everything a run needs to be verified again lives in its schema:

- ``run``          one row: the configuration, when, where
- ``queues``       the run's ringq queues and their payload sizes
- ``cycles``       one row per cycle: status, timings, section counters, errors, report
- ``sent``         the ground truth: every committed entry, written by the producer
                   in the same transaction as the enqueue
- ``acked``        (fail-over cycles) every entry whose producer's commit
                   returned, from the producers' logs kept outside the database
- ``rolled_back``  every entry of a transaction that was rolled back (written
                   right after the rollback, in its own transaction)
- ``due``          every delayed entry: the delay asked for (in the enqueue's
                   transaction) and its row's due time (read after the commit)
- ``retried``      every deliberate consumer rollback's entries: the database's
                   time just before the rollback and the queue's backoff
- ``queued``       every entry still queued in a queue's table at the end of a
                   cycle (its workers stopped): committed, not drained
- ``received_<queue>``  what the queue's consumer took, written in the same
                   transaction as the dequeue (payload included); the grouped
                   queue's (and, in a run with SQL consumers, every queue's)
                   also records who took it, its group, and when it was
                   dequeued and committed (monotonic ns)

No indexes beyond primary keys on the small tables: the writers stay cheap and
Spark does the joins.
"""

from __future__ import annotations

from typing import Final

from psycopg import sql
from ringq.engine.sqlfile import compose, load

SCHEMA_PREFIX = "regress_"

_Q: Final = load("ringq.regression", "queries.sql")

# the run store ({schema}, and {table} where noted)
CREATE_RUN: Final = _Q["create_run"]
CREATE_RECEIVED: Final = _Q["create_received"]  # {table}
ADD_RECEIVED_GROUPED: Final = _Q["add_received_grouped"]  # {table}
INSERT_RUN: Final = _Q["insert_run"]
INSERT_QUEUE: Final = _Q["insert_queue"]
SELECT_RUN: Final = _Q["select_run"]
SELECT_QUEUES: Final = _Q["select_queues"]
FINISH_RUN: Final = _Q["finish_run"]
START_CYCLE: Final = _Q["start_cycle"]
NEXT_CYCLE: Final = _Q["next_cycle"]
END_CYCLE: Final = _Q["end_cycle"]
VERIFIED_CYCLE: Final = _Q["verified_cycle"]
SELECT_CYCLES: Final = _Q["select_cycles"]
LIST_RUNS: Final = _Q["list_runs"]
RUN_EXISTS: Final = _Q["run_exists"]
DROP_RUN: Final = _Q["drop_run"]
COMMIT_TS_ON: Final = _Q["commit_ts_on"]
LEFTOVERS: Final = _Q["leftovers"]  # {table}: a queue's table, no {schema}
RECORD_QUEUED: Final = _Q["record_queued"]  # {table}: a queue's table
QUEUED_KEPT: Final = _Q["queued_kept"]
# the workload's writers: the ground truth and the consumers' records
INSERT_SENT: Final = _Q["insert_sent"]
INSERT_ROLLED_BACK: Final = _Q["insert_rolled_back"]
INSERT_ACKED: Final = _Q["insert_acked"]
INSERT_DUE: Final = _Q["insert_due"]
READ_DUE: Final = _Q["read_due"]  # {table}: the queue's table
DB_CLOCK: Final = _Q["db_clock"]
INSERT_RETRIED: Final = _Q["insert_retried"]
INSERT_RECEIVED: Final = _Q["insert_received"]  # {table}
INSERT_RECEIVED_GROUPED: Final = _Q["insert_received_grouped"]  # {table}
# what a restarted worker resumes from (chaos)
RESUME_PRODUCER: Final = _Q["resume_producer"]
SENT_BY_QUEUE: Final = _Q["sent_by_queue"]
RESUME_CONSUMER: Final = _Q["resume_consumer"]  # {table}
RESUME_GROUPED_CONSUMER: Final = _Q["resume_grouped_consumer"]  # {table}
# the SQL consumers (plain psycopg, ringq.dequeue) and what chaos does to them
SQL_DEQUEUE: Final = _Q["sql_dequeue"]
SQL_DEPTH: Final = _Q["sql_depth"]
TERMINATE_SQL_CONSUMER: Final = _Q["terminate_sql_consumer"]
PREPARED_GIDS: Final = _Q["prepared_gids"]
MONITOR_LOCK_HOLDER: Final = _Q["monitor_lock_holder"]
DATA_DIRECTORY: Final = _Q["data_directory"]
REPLICATION_GAP: Final = _Q["replication_gap"]  # on the primary (fail-over)
# the proof: what Spark reads through JDBC, and how many rows there are ({cycles})
RECEIVED_COUNT: Final = _Q["received_count"]  # {table}
JDBC_SENT: Final = _Q["jdbc_sent"]  # {committed_at}
COMMITTED_AT_COMMIT_TS: Final = _Q["committed_at_commit_ts"]
COMMITTED_AT_SENT: Final = _Q["committed_at_sent"]
JDBC_ROLLED_BACK: Final = _Q["jdbc_rolled_back"]
JDBC_QUEUED: Final = _Q["jdbc_queued"]
JDBC_ACKED: Final = _Q["jdbc_acked"]
JDBC_DUE: Final = _Q["jdbc_due"]
JDBC_RETRIED: Final = _Q["jdbc_retried"]
JDBC_RECEIVED: Final = _Q["jdbc_received"]  # {table}, {idx}
JDBC_RECEIVED_GROUPED: Final = _Q["jdbc_received_grouped"]  # {table}, {idx}
JDBC_SENT_GROUPS: Final = _Q["jdbc_sent_groups"]  # {idx}
JDBC_DBTABLE: Final = _Q["jdbc_dbtable"]  # {query}
JDBC_PARTITION: Final = _Q["jdbc_partition"]  # {column}, {partitions}, {part}


def schema_of(run_id: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA_PREFIX + run_id)


def received_table(queue_name: str) -> sql.Identifier:
    return sql.Identifier("received_" + queue_name)


def q(text: str, run_id: str, table: sql.Composable | None = None) -> sql.Composed:
    """Compose a named statement for ``run_id`` (and a table)."""
    kw: dict[str, sql.Composable] = {"schema": schema_of(run_id)}
    if table is not None:
        kw["table"] = table
    return compose(text, **kw)
