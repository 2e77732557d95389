"""The monitor through a fail-over: started with the pair's multi-host DSN,
it reconnects to the promoted standby by itself and replaces the global
section (the database's history changed) before any client comes back; a
client then gets every entry whose dequeue the async replication lost, once.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from conftest import MonitorProcess, wait_for
from ringq.engine import Section, SectionError, connect
from ringq.engine.recovery import history_of
from test_failover import (
    commit_numbers,
    dequeues_lost_in_the_gap,
    drain_after_reattach,
    pair_with_queue,
    queued_in_table,
)


def section_history(instance: str) -> tuple[int, int] | None:
    """The history the host's section of ``instance`` describes (None: no section)."""
    try:
        sec = Section.attach(instance, create=False)
    except SectionError:
        return None
    try:
        return sec.history()
    finally:
        sec.close()


def test_the_monitor_follows_a_fail_over_and_replaces_the_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pair_with_queue(tmp_path / "home", capsys, "--async") as (cluster, both, queue):
        with psycopg.connect(both, autocommit=True) as conn:
            sysid, timeline = history_of(conn)
        monitor = MonitorProcess(both, tmp_path / "monitor")
        try:
            with connect(both) as session:
                instance = session.instance
                commit_numbers(session, queue, 10)
                assert section_history(instance) == (sysid, timeline)
                dequeues_lost_in_the_gap(cluster, capsys, session, queue, 3)
                assert queued_in_table(both, queue) == list(range(10))
                # No client has called yet: the monitor alone moves the section on.
                wait_for(
                    lambda: section_history(instance) == (sysid, timeline + 1),
                    30, "the monitor to replace the section",
                )
                assert monitor.proc.poll() is None
                got = drain_after_reattach(session, queue)
            assert got == list(range(10))
        finally:
            monitor.stop()
