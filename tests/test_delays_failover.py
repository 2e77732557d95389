"""Entries that wait through a fail-over: their due times live in the rows, so
the promoted standby's rows give them to the new section; none is received
before its time, and a synchronous pair loses none."""

from __future__ import annotations

import time
from pathlib import Path

import psycopg
import pytest
from ringq.engine import DatabaseUnavailable, TransactionError, connect
from test_failover import kill_primary, pair_with_queue, promote


def test_delayed_entries_keep_their_due_times_through_a_sync_failover(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair_with_queue(tmp_path / "home", capsys, "--sync") as (cluster, both, queue):
        with connect(both) as s:
            for n in range(5):
                s.enqueue(queue, str(n).encode(), delay=3.0)
            s.commit()
        t_due = time.monotonic() + 3.0
        kill_primary(cluster)
        promote(cluster, capsys)
        got: list[bytes] = []
        with connect(both) as s:
            while len(got) < 5:
                try:
                    m = s.dequeue(queue, wait=0.2)
                    s.commit()
                except (DatabaseUnavailable, TransactionError):
                    continue  # the first calls find the old primary gone
                if m is not None:
                    assert time.monotonic() >= t_due - 0.3, "received before its due time"
                    got.append(m.payload)
                assert time.monotonic() < t_due + 60, "the delayed entries never came"
        assert got == [str(n).encode() for n in range(5)]
        with psycopg.connect(both) as conn:
            early = conn.execute(
                f"SELECT count(*) FROM ringq.q_{queue} WHERE state = 2 AND deq_at < not_before"
            ).fetchone()
            assert early == (0,)
