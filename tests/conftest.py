"""Fixtures shared by the test suite: a real PostgreSQL that the suite starts itself.

- ``pg_cluster`` (session): the project's own embedded cluster, under a
  temporary home, stopped when the session ends (even if it ends badly).
- ``dsn`` (function): a fresh database ``t_<hex>`` on that cluster for each
  test, dropped afterwards with its global section and semaphores.
- ``ringq_env`` (function): ``RINGQ_DSN``/``RINGQ_HOME`` set for the test and
  its subprocesses (``ringq`` commands), pointing at that database.
- ``make_queue`` (function): ``make_queue(capacity=64, max_payload=1024, **settings)``
  creates a queue with a fresh name in that database; afterwards the global
  section and semaphores of that database are removed.
"""

from __future__ import annotations

import os
import secrets
import signal
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from ringq.scripting import Cluster, QueueSpec, create_queue
from ringq.scripting import remove_section as remove_section_of

# Spark (the regression analysis) must not go looking for the host's public
# address in a sandbox; loopback is enough for a local master.
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


@pytest.fixture(scope="session")
def pg_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path_factory.mktemp("pg_cluster"))
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()  # also after a failed start, a failed test, Ctrl-C or SIGTERM
        if signal.getsignal(signal.SIGTERM) is _sigterm_as_interrupt:
            signal.signal(signal.SIGTERM, previous)


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    # pytest tears fixtures down on KeyboardInterrupt but simply dies on SIGTERM
    # (what `timeout` and CI runners send), which would orphan the cluster's
    # server. The first SIGTERM becomes an interrupt; a second one kills.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    raise KeyboardInterrupt(f"signal {signum}")


def _default_sigterm_in_child() -> None:
    # Processes forked by tests keep the default: killed at once by SIGTERM.
    if signal.getsignal(signal.SIGTERM) is _sigterm_as_interrupt:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        except ValueError:  # not the main thread: nothing we can do
            pass


os.register_at_fork(after_in_child=_default_sigterm_in_child)


@pytest.fixture
def dsn(pg_cluster: Cluster) -> Iterator[str]:
    name = f"t_{secrets.token_hex(6)}"
    admin = pg_cluster.url("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield pg_cluster.url(name)
    finally:
        _drop_database(pg_cluster, name)


def _drop_database(cluster: Cluster, name: str) -> None:
    # Whatever the test made in shared memory goes with its database.
    remove_section(cluster.url(name))
    # A prepared transaction left by a test would block DROP DATABASE (FORCE
    # ends sessions, not prepared transactions): roll those back first, from
    # inside the database as PostgreSQL requires.
    with psycopg.connect(cluster.url(name), autocommit=True) as conn:
        gids = conn.execute(
            "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()"
        ).fetchall()
        for (gid,) in gids:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))
    with psycopg.connect(cluster.url("postgres"), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@pytest.fixture
def ringq_env(
    dsn: str, tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> dict[str, str]:
    """The environment of a ``ringq`` command run against this test's database."""
    monkeypatch.setenv("RINGQ_DSN", dsn)
    monkeypatch.setenv("RINGQ_HOME", os.path.join(tmp_path, "ringq_home"))
    return dict(os.environ)


@pytest.fixture
def make_queue(dsn: str) -> Iterator[Callable[..., str]]:
    def make(capacity: int = 64, max_payload: int = 1024, **settings: Any) -> str:
        name = "q_" + uuid.uuid4().hex[:10]
        with psycopg.connect(dsn) as conn:
            create_queue(conn, QueueSpec(name, capacity, max_payload, **settings))
        return name

    yield make
    remove_section(dsn)


def remove_section(dsn: str) -> None:
    """Remove the global section and semaphores of the database at ``dsn``,
    those of its dropped queues too (the tests' queues live in shared memory
    beyond the database's life). Harmless without a ringq schema, and twice."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        remove_section_of(conn)
