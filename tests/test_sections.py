"""Shared memory that outlives its database (issue 26): ``ringq db stop`` and
``Cluster.stop()`` remove the sections of their databases, ``ringq section
list|remove|prune`` show and clear them, the monitor's tidy step removes
those of dropped databases; never one a live process holds."""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from conftest import cli, enqueue_committed, present, queue_in
from psycopg import sql
from ringq.cluster import Cluster
from ringq.engine import (
    SectionInUse,
    connect,
    remove_section_on_host,
    sections_on_host,
)
from ringq.monitor._tidy import SectionTidy

SHM = Path("/dev/shm")

# A client that holds a session (and so the section) until its stdin closes.
HOLDER = """
import sys
from ringq.engine import connect
s = connect(sys.argv[1])
s.enqueue(sys.argv[2], b"held")
s.commit()
print("ready", flush=True)
sys.stdin.read()
s.close()
"""


def instance_of(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT value FROM ringq.meta WHERE key = 'instance_id'").fetchone()
    return str(present(row)[0])


def shm_of(instance: str) -> list[str]:
    """The ``ringq.<id>`` and ``sem.ringq.<id>.*`` entries of ``instance`` in /dev/shm."""
    mine = (f"ringq.{instance}", f"sem.ringq.{instance}.")
    return sorted(e for e in os.listdir(SHM) if e == mine[0] or e.startswith(mine[1]))


def use_queue(dsn: str, queue: str, n: int = 3) -> None:
    """Enqueue ``n`` entries and dequeue one, committing: the section and a semaphore exist."""
    with connect(dsn) as s:
        for i in range(n):
            s.enqueue(queue, b"m%d" % i)
        s.commit()
        assert present(s.dequeue(queue)).payload == b"m0"
        s.commit()


@contextmanager
def holder(dsn: str, queue: str) -> Iterator[subprocess.Popen[str]]:
    """A live child process with a session on ``dsn``: it maps the section."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, dsn, queue],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert present(proc.stdout).readline().strip() == "ready"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def dropped_database_section(cluster: Cluster) -> str:
    """A database with a queue that was used, then dropped: its section is stale. Its id."""
    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = cluster.url(name)
    use_queue(url, queue_in(url))
    instance = instance_of(url)
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
    assert shm_of(instance)
    return instance


# -- stopping is clean ---------------------------------------------------------------------------


@pytest.fixture
def home_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """An embedded cluster of its own that ``ringq db`` finds by $RINGQ_HOME (not started);
    stopped at the end, whatever happened."""
    home = tmp_path / "home"
    monkeypatch.setenv("RINGQ_HOME", str(home))
    monkeypatch.delenv("RINGQ_DSN", raising=False)
    cluster = Cluster(home)
    try:
        yield cluster
    finally:
        cluster.stop()


def test_db_stop_removes_the_sections_of_its_databases(
    home_cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster = home_cluster
    dsn = cluster.start()
    queue = queue_in(dsn)
    use_queue(dsn, queue)
    live = instance_of(dsn)
    dropped = dropped_database_section(cluster)  # found by the cluster's system identifier
    assert shm_of(live) and shm_of(dropped)
    code, out, _ = cli(capsys, "db", "stop")
    assert code == 0, out
    assert "removed 2 global section(s)" in out
    assert shm_of(live) == [] and shm_of(dropped) == []
    # Used again after a restart: the section is made anew from the rows.
    dsn = cluster.start()
    with connect(dsn) as s:
        assert [present(s.dequeue(queue)).payload for _ in range(2)] == [b"m1", b"m2"]
        s.commit()
    assert shm_of(live)
    cluster.stop()
    assert shm_of(live) == []


def test_db_stop_keeps_a_section_a_live_client_holds_and_says_why(
    home_cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    dsn = home_cluster.start()
    queue = queue_in(dsn)
    instance = instance_of(dsn)
    with holder(dsn, queue) as child:
        code, out, _ = cli(capsys, "db", "stop")
        assert code == 0, out
        assert f"kept global section /ringq.{instance}" in out
        assert str(child.pid) in out and "still attached" in out
        assert f"ringq.{instance}" in shm_of(instance)
    # Its holder gone, prune takes it (its server is stopped: "unknown").
    code, out, _ = cli(capsys, "section", "prune", instance)
    assert code == 0, out
    assert f"removed /ringq.{instance}" in out
    assert shm_of(instance) == []


# -- list, remove, prune -------------------------------------------------------------------------


def test_list_and_prune_remove_only_the_stale_section(
    pg_cluster: Cluster, dsn: str, dsn2: str, capsys: pytest.CaptureFixture[str]
) -> None:
    server = pg_cluster.url("postgres")
    stale = dropped_database_section(pg_cluster)
    live_q = queue_in(dsn)
    use_queue(dsn, live_q)
    live = instance_of(dsn)
    held_q = queue_in(dsn2)
    held = instance_of(dsn2)
    with holder(dsn2, held_q) as child:
        code, out, _ = cli(capsys, "section", "list", "--dsn", server, "--json")
        assert code == 0
        rows = {r["instance_id"]: r for r in json.loads(out)}
        assert rows[stale]["database"] == "dropped" and rows[stale]["pids"] == []
        assert rows[live]["database"] == "live" and rows[live]["pids"] == []
        assert rows[live]["queues"] == [live_q] and rows[live]["memory"] > 0
        assert rows[held]["database"] == "live" and child.pid in rows[held]["pids"]

        code, out, _ = cli(capsys, "section", "list", "--dsn", server)
        assert code == 0 and stale in out and "dropped" in out

        ids = (stale, live, held)
        code, out, _ = cli(capsys, "section", "prune", "--dry-run", "--dsn", server, *ids)
        assert code == 0 and f"would remove /ringq.{stale}" in out
        assert all(shm_of(i) for i in ids)

        code, out, _ = cli(capsys, "section", "prune", "--dsn", server, *ids)
        assert code == 0, out
        assert f"removed /ringq.{stale}" in out and f"kept /ringq.{held}" in out
        assert shm_of(stale) == []
        assert shm_of(live) and shm_of(held)

        code, _, err = cli(capsys, "section", "remove", held)
        assert code == 5 and "held by live process" in err and str(child.pid) in err
        with pytest.raises(SectionInUse):
            remove_section_on_host(held)
    code, _, err = cli(capsys, "section", "remove", stale)
    assert code == 4 and "no global section" in err


def test_a_removed_section_of_a_live_database_is_rebuilt_from_the_rows(
    dsn: str, make_queue: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    queue = make_queue()
    enqueue_committed(dsn, queue, *(b"e%d" % i for i in range(5)))
    instance = instance_of(dsn)
    code, out, _ = cli(capsys, "section", "remove", instance)
    assert code == 0, out
    assert shm_of(instance) == []
    with connect(dsn) as s:
        got = [present(s.dequeue(queue)).payload for _ in range(5)]
        s.commit()
        assert s.dequeue(queue) is None
    assert got == [b"e%d" % i for i in range(5)]
    assert f"ringq.{instance}" in shm_of(instance)


def test_the_host_listing_reads_without_attaching(dsn: str, make_queue: Any) -> None:
    queue = make_queue()
    use_queue(dsn, queue)
    instance = instance_of(dsn)
    found = {s.instance_id: s for s in sections_on_host()}[instance]
    assert found.queues == (queue,)
    assert found.sysid != 0 and found.timeline >= 1
    assert found.memory > 0 and found.size > found.memory  # sparse
    assert os.getpid() not in found.pids  # no session of ours is open


# -- the monitor's tidy step ---------------------------------------------------------------------


def test_the_monitor_tidy_removes_sections_of_dropped_databases(
    pg_cluster: Cluster, dsn: str, make_queue: Any
) -> None:
    use_queue(dsn, make_queue())
    live = instance_of(dsn)
    stale = dropped_database_section(pg_cluster)
    told: list[tuple[str, int, dict[str, Any]]] = []

    def journal(event: str, level: int = logging.INFO, **fields: Any) -> None:
        told.append((event, level, fields))

    tidy = SectionTidy(lambda: dsn, journal, every=3600)
    tidy.run()
    assert shm_of(stale) == []
    assert shm_of(live)
    assert [(e, f["section"]) for e, _, f in told] == [("section.removed", f"/ringq.{stale}")]
    assert tidy.removed == 1
    stale2 = dropped_database_section(pg_cluster)
    tidy.run()  # not due yet
    assert shm_of(stale2)
    SectionTidy(lambda: dsn, journal, every=0).run()
    assert shm_of(stale2) == []
