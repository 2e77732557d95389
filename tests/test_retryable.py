"""``Retryable``: the one class a retry loop catches. A commit cut off by
the loss of its connection, decided from the rows as not committed, raises
``RolledBack`` (a ``Retryable``), never a bare ``TransactionError``; the
entry comes back once. And the README's retry loop runs as written.

The cut is made on purpose: a deferred constraint trigger terminates its own
backend at COMMIT, once (a sequence counts, outside the transaction).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import drain, enqueue_committed, queue_in
from ringq.engine import (
    InDoubt,
    Retryable,
    RolledBack,
    StaleSection,
    TransactionConflict,
    TransactionError,
)
from ringq.scripting import QueueSpec, create_queue

README = Path(__file__).resolve().parent.parent / "README.md"

# The first COMMIT of a transaction that wrote a row into ``table`` ends its
# own backend: the commit's connection is lost before anything commits.
CUT_AT_COMMIT = """
CREATE SEQUENCE cut_once;
CREATE FUNCTION cut_first_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF nextval('cut_once') = 1 THEN
        PERFORM pg_terminate_backend(pg_backend_pid());
        PERFORM pg_sleep(5);  -- the terminate lands here
    END IF;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER cut AFTER INSERT ON {table}
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION cut_first_commit();
"""


def _cut_first_commit(dsn: str, table: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (seq bigint PRIMARY KEY)")
        conn.execute(CUT_AT_COMMIT.format(table=table))


def _rows(dsn: str, table: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [r[0] for r in conn.execute(f"SELECT seq FROM {table} ORDER BY seq")]


def test_retryable_is_the_base_of_what_may_be_retried_and_in_doubt_is_not() -> None:
    for cls in (TransactionConflict, StaleSection, RolledBack):
        assert issubclass(cls, Retryable) and issubclass(cls, TransactionError)
    assert not issubclass(InDoubt, Retryable)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "read-from-row"])
def test_a_commit_cut_off_and_decided_raises_rolled_back_and_the_entry_comes_back_once(
    dsn: str, cached: bool, face: Callable[..., Any]
) -> None:
    q = queue_in(dsn, cache_payload=512 if cached else 0)
    _cut_first_commit(dsn, "shipped")
    [seq] = enqueue_committed(dsn, q, b"x" * 100)
    with face(dsn) as s:
        msg = s.dequeue(q)
        assert msg is not None and msg.seq == seq and msg.deliveries == 1
        s.connection.execute("INSERT INTO shipped VALUES (%s)", (msg.seq,))
        with pytest.raises(RolledBack, match="rolled back") as caught:
            s.commit()
        assert isinstance(caught.value, Retryable)
        assert _rows(dsn, "shipped") == []  # nothing of it committed
        # the session goes on, on a new connection: the retry takes the entry again
        # (a delivery its own session decided is not counted yet: README, backoff)
        again = s.dequeue(q)
        assert again is not None and again.seq == seq and again.deliveries == 1
        s.connection.execute("INSERT INTO shipped VALUES (%s)", (again.seq,))
        s.commit()
    assert _rows(dsn, "shipped") == [seq]
    assert drain(dsn, q) == []  # consumed once: nothing left


def _readme_retry_loop() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    [code] = [b for b in blocks if "except Retryable" in b]
    return "\n".join(line.removeprefix("  ") for line in code.splitlines())


def test_the_readme_retry_loop_retries_a_commit_cut_off(
    dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's loop, as written, against a commit cut off once: the
    entry is taken again and shipped once."""
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec("orders", 64, 1024))
    _cut_first_commit(dsn, "shipped")
    [seq] = enqueue_committed(dsn, "orders", b"order 42")
    monkeypatch.setenv("RINGQ_DSN", dsn)
    exec(compile(_readme_retry_loop(), str(README), "exec"), {})
    assert _rows(dsn, "shipped") == [seq]
    assert drain(dsn, "orders") == []
