"""ringq.regression: the randomized multi-process workload and its Spark proof.

A *run* lives in schema ``regress_<run id>`` of the queue database, with one
ringq queue per payload size. Each *cycle* starts producer processes (random
entries to random queues, several queues per transaction, simple or two-phase,
some rolled back on purpose, bursts and pauses) and one consumer process per
queue (dequeue and record in the same transaction), and several on the grouped
queue (``grouped_consumers``: entries in groups, ``shared`` mode); then Spark
reads what was sent, rolled back and received through JDBC and proves
exactly-once delivery, no delivered rollback, FIFO per (queue, producer) (per
(producer, group) on the grouped queue, where no two entries of a group may be
held at once) and intact payloads. With ``sql_consumers``, some dequeuers
are plain psycopg connections calling ``ringq.dequeue`` beside the linked
ones, recording in the same tables, held to the same proof. With
``delayed_share`` and ``retry_delay``, entries wait for a due time (a delay,
a backoff after a consumer's rollback), and the proof adds that none was
taken before it.

    from ringq.regression import RegressConfig, Verifier, run, verify

    with Verifier("local[*]") as v:
        outcome = run(
            dsn, RegressConfig(capacity=2000, entries_per_queue=10000), cycles=1, verifier=v
        )
        print(outcome.reports[0].summary())
        again = verify(dsn, outcome.run_id, verifier=v)
"""

from ._config import DEFAULT_PAYLOAD_SIZES, RegressConfig, parse_sizes, validate_run_id
from ._cycle import CycleResult, Progress, run_cycle
from ._jdbc import DEFAULT_JDBC_JAR, jdbc_target
from ._monitors import ForeignMonitor, ServingMonitor, serving_monitor
from ._payload import MIN_PAYLOAD
from ._report import VIOLATION_KINDS, Report
from ._runner import RunOutcome, run, verify
from ._store import (
    CycleRow,
    QueueRef,
    RunInfo,
    RunNotFound,
    create_run,
    cycles,
    drop_run,
    list_runs,
    load_run,
    new_run_id,
)
from ._verify import SparkUnavailable, Verifier

__all__ = [
    "DEFAULT_JDBC_JAR",
    "DEFAULT_PAYLOAD_SIZES",
    "MIN_PAYLOAD",
    "VIOLATION_KINDS",
    "CycleResult",
    "CycleRow",
    "ForeignMonitor",
    "Progress",
    "QueueRef",
    "RegressConfig",
    "Report",
    "RunInfo",
    "RunNotFound",
    "RunOutcome",
    "ServingMonitor",
    "SparkUnavailable",
    "Verifier",
    "create_run",
    "cycles",
    "drop_run",
    "jdbc_target",
    "list_runs",
    "load_run",
    "new_run_id",
    "parse_sizes",
    "run",
    "run_cycle",
    "serving_monitor",
    "validate_run_id",
    "verify",
]
