"""The SQL side of the schema that other hosts use without the library:
`ringq db upgrade` for a database made before SQL consumers, and ringq.stats."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from conftest import cli, enqueue_committed


def test_db_upgrade_gives_queues_made_before_their_sql_dequeue(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str],
    ringq_env: dict[str, str],
) -> None:
    q = make_queue(capacity=64)
    with psycopg.connect(dsn, autocommit=True) as c:
        # What a database made before SQL consumers lacks.
        c.execute(f"DROP FUNCTION ringq.dq_{q}(integer)")
        with pytest.raises(psycopg.errors.UndefinedFunction, match="ringq db upgrade"):
            c.execute("SELECT * FROM ringq.dequeue(%s)", (q,))
    code, out, _err = cli(capsys, "db", "upgrade", "--dsn", dsn)
    assert code == 0 and "up to date" in out
    code, _out, _err = cli(capsys, "db", "upgrade", "--dsn", dsn)  # again: harmless
    assert code == 0
    with psycopg.connect(dsn, autocommit=True) as c:
        assert c.execute("SELECT * FROM ringq.dequeue(%s)", (q,)).fetchall() == []


def test_db_upgrade_replaces_a_queues_older_sql_dequeue(
    dsn: str, make_queue: Callable[..., str], capsys: pytest.CaptureFixture[str],
    ringq_env: dict[str, str],
) -> None:
    q = make_queue(capacity=64)
    fn = f"ringq.dq_{q}(integer)"
    with psycopg.connect(dsn, autocommit=True) as c:
        # An earlier version's function: another body, no planner settings.
        c.execute(f"""CREATE OR REPLACE FUNCTION ringq.dq_{q}(max_n integer DEFAULT 1)
            RETURNS TABLE (seq bigint, payload bytea, producer text, producer_seq bigint,
                           deliveries integer, msg_group text, enqueued_at timestamptz)
            LANGUAGE plpgsql RESET ALL AS $$ BEGIN RETURN; END $$""")
        assert c.execute("SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure",
                         (fn,)).fetchone() == (None,)
    code, out, _err = cli(capsys, "db", "upgrade", "--dsn", dsn)
    assert code == 0 and "up to date" in out
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT proconfig, prosrc FROM pg_proc WHERE oid = %s::regprocedure",
                        (fn,)).fetchone()
        assert row is not None
        # This version's: index scans pinned, chunks taken, a waiter row when empty.
        assert "enable_seqscan=off" in row[0] and "ringq.waiters" in row[1]


def test_stats_by_sql_count_ready_inbox_and_exceptions(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=64)
    enqueue_committed(dsn, q, b"a", b"b")
    with psycopg.connect(dsn, autocommit=True) as c:
        c.execute("SELECT ringq.enqueue(%s, %s)", (q, b"c"))
        row = c.execute(
            "SELECT queue_name, capacity, ready, inbox, set_aside, exceptions,"
            " oldest_enqueued_at IS NOT NULL FROM ringq.stats(%s)", (q,)
        ).fetchone()
        assert row == (q, 64, 2, 1, 0, 0, True)
        with pytest.raises(psycopg.errors.UndefinedObject):
            c.execute("SELECT * FROM ringq.stats(%s)", ("no_such'; drop table x; --",))
