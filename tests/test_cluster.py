"""The embedded cluster, through ``ringq db`` and through :class:`ringq.cluster.Cluster`."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from conftest import cli, present
from ringq.cluster import Cluster, PostgresNotFound, find_bindir
from ringq.engine import DatabaseUnavailable, resolve_dsn

_SCRIPT = Path(sys.executable).with_name("ringq")
RINGQ = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "ringq.cli"]
PSQL = shutil.which("psql")


def ringq(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, RINGQ_HOME=str(home))
    env.pop("RINGQ_DSN", None)
    return subprocess.run(
        [*RINGQ, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def psql(*args: str) -> str:
    assert PSQL, "psql is installed with the postgresql package"
    out = subprocess.run(
        [PSQL, "-X", "-A", "-t", *args], capture_output=True, text=True, timeout=30, check=True
    )
    return out.stdout.strip()


def test_db_start_status_url_stop_round_trip(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "home"
    try:
        started = ringq(home, "db", "start")
        assert started.returncode == 0, started.stderr
        dsn = started.stdout.strip().splitlines()[-1]
        assert dsn.startswith("postgresql://postgres@127.0.0.1:") and dsn.endswith("/ringq")
        assert (home / "dsn").read_text().strip() == dsn

        again = ringq(home, "db", "start")  # idempotent: same server, same DSN
        assert again.returncode == 0 and again.stdout.strip().splitlines()[-1] == dsn
        assert "already running" in again.stdout

        status = ringq(home, "db", "status")
        assert status.returncode == 0
        assert (
            "running" in status.stdout
            and "not running" not in status.stdout
            and dsn in status.stdout
        )

        url = ringq(home, "db", "url")
        assert url.returncode == 0 and url.stdout == dsn + "\n"

        # The DSN file is the contract the engine reads.
        monkeypatch.setenv("RINGQ_HOME", str(home))
        monkeypatch.delenv("RINGQ_DSN", raising=False)
        assert resolve_dsn() == dsn

        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT current_database(), current_user").fetchone() == (
                "ringq",
                "postgres",
            )
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        assert psql(dsn, "-c", "SELECT x FROM kept") == "42"

        stopped = ringq(home, "db", "stop")
        assert stopped.returncode == 0, stopped.stderr
        assert not (home / "dsn").exists()
        status = ringq(home, "db", "status")
        assert status.returncode == 1 and "not running" in status.stdout
        url = ringq(home, "db", "url")
        assert url.returncode == 3 and url.stdout == "" and "not running" in url.stderr
        assert ringq(home, "db", "stop").returncode == 0  # harmless when stopped

        # A restart keeps the data. Whether it keeps the DSN depends on its port
        # being still free, which no test can promise here: the two cases are
        # the next two tests.
        restarted = ringq(home, "db", "start")
        assert restarted.returncode == 0, restarted.stderr
        dsn = restarted.stdout.strip().splitlines()[-1]
        assert (home / "dsn").read_text().strip() == dsn
        assert psql(dsn, "-c", "SELECT x FROM kept") == "42"
        assert ringq(home, "db", "stop").returncode == 0
    finally:
        Cluster(home).stop()  # a failed assertion must not leave the server running


@contextmanager
def port_held_for_the_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A port that no other process can take while the test runs, that the
    cluster's server can still listen on; the cluster's first start is given it
    as its "free port".

    The port is bound with SO_REUSEADDR and never listens. Linux then refuses
    every other bind to it (a bind to port 0, an outgoing connection's port, a
    probe), except by a socket that also sets SO_REUSEADDR while the port has no
    listener: how PostgreSQL binds. ringq's own probe (``_port_free``) binds
    without SO_REUSEADDR, so it is told that this port is free.
    """
    from ringq.cluster import _server

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("127.0.0.1", 0))
        port: int = held.getsockname()[1]
        real_port_free, real_free_port = _server._port_free, _server._free_port
        offered = iter([port])  # once: the first start's; a new port after that is a real one
        monkeypatch.setattr(_server, "_free_port", lambda: next(offered, None) or real_free_port())
        monkeypatch.setattr(_server, "_port_free", lambda p: p == port or real_port_free(p))
        yield port


def test_a_restart_keeps_its_port_and_dsn_while_the_port_is_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = tmp_path / "home"
    with port_held_for_the_cluster(monkeypatch) as port:
        try:
            code, out, err = cli(capsys, "db", "start", "--home", str(home))
            assert code == 0, err
            dsn = out.strip().splitlines()[-1]
            assert dsn.endswith(f":{port}/ringq")
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE kept (x int)")
                conn.execute("INSERT INTO kept VALUES (42)")
            assert cli(capsys, "db", "stop", "--home", str(home))[0] == 0

            code, out, err = cli(capsys, "db", "start", "--home", str(home))
            assert code == 0, err
            assert f"port {port})" in out and out.strip().splitlines()[-1] == dsn
            assert (home / "dsn").read_text().strip() == dsn
            assert psql(dsn, "-c", "SELECT x FROM kept") == "42"
        finally:
            Cluster(home).stop()


def test_a_restart_whose_port_was_taken_starts_on_another_and_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    try:
        started = ringq(home, "db", "start")
        assert started.returncode == 0, started.stderr
        dsn = started.stdout.strip().splitlines()[-1]
        port = Cluster(home).status().port
        assert port is not None
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE kept (x int)")
            conn.execute("INSERT INTO kept VALUES (42)")
        assert ringq(home, "db", "stop").returncode == 0

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as squatter:
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                squatter.bind(("127.0.0.1", port))
                squatter.listen()
            except OSError as exc:  # another process took it first: taken all the same
                assert exc.errno == errno.EADDRINUSE, exc
            restarted = ringq(home, "db", "start")
        assert restarted.returncode == 0, restarted.stderr
        new_dsn = restarted.stdout.strip().splitlines()[-1]
        new_port = Cluster(home).status().port
        assert new_port is not None and new_port != port
        assert f"port {new_port})" in restarted.stdout  # what start says
        assert new_dsn == dsn.replace(f":{port}/", f":{new_port}/")  # only the port moved
        assert (home / "dsn").read_text().strip() == new_dsn  # what the engine reads
        assert psql(new_dsn, "-c", "SELECT x FROM kept") == "42"
    finally:
        Cluster(home).stop()


def test_two_homes_side_by_side_and_concurrent_starts_make_one_server(tmp_path: Path) -> None:
    home_a = tmp_path / "a"
    # Too long for a unix socket path under it: the socket goes to a short /tmp dir.
    home_b = tmp_path / ("b" * 90) / "home"
    a, b = Cluster(home_a), Cluster(home_b)
    try:
        with ThreadPoolExecutor(3) as pool:
            first = pool.submit(Cluster(home_a).start)
            second = pool.submit(Cluster(home_a).start)
            other = pool.submit(b.start)
            dsn_a, dsn_a_again, dsn_b = first.result(), second.result(), other.result()
        assert dsn_a == dsn_a_again == a.url()
        sa, sb = a.status(), b.status()
        assert sa.running and sb.running and sa.port != sb.port and sa.pid != sb.pid

        with psycopg.connect(dsn_a, autocommit=True) as conn:
            conn.execute("CREATE TABLE only_in_a (x int)")
        with psycopg.connect(dsn_b, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass('only_in_a')").fetchone() == (None,)

        assert sb.socket_dir is not None
        assert sb.socket_dir.parent == Path(tempfile.gettempdir())
        assert sb.socket_dir.name.startswith("ringq-")
        via_socket = ("-h", str(sb.socket_dir), "-p", str(sb.port), "-U", "postgres", "-d", "ringq")
        assert psql(*via_socket, "-c", "SELECT 1") == "1"
    finally:
        a.stop()
        b.stop()
    assert not a.status().running and not b.status().running
    assert not sb.socket_dir.exists()  # the short socket dir is removed on stop


def test_context_manager_stops_only_what_it_started(pg_cluster: Cluster) -> None:
    with Cluster(pg_cluster.home) as same:
        assert same.url() == pg_cluster.url()
    assert pg_cluster.status().running


def test_server_settings(pg_cluster: Cluster, dsn: str) -> None:
    expected = {
        "max_prepared_transactions": "64",
        "max_connections": "200",
        "shared_buffers": "128MB",
        "listen_addresses": "127.0.0.1",
        "fsync": "on",
        "synchronous_commit": "on",
        "autovacuum_naptime": "10s",
        "track_commit_timestamp": "on",
        "logging_collector": "on",
    }
    with psycopg.connect(dsn) as conn:
        actual = {name: present(conn.execute(f"SHOW {name}").fetchone())[0] for name in expected}
        assert present(conn.execute("SELECT current_database()").fetchone())[0].startswith("t_")
        assert actual == expected
        # Two-phase commit works (max_prepared_transactions > 0).
        conn.execute("CREATE TABLE t2pc (x int)")
        conn.commit()
        xid = conn.xid(1, "ringq-test", "branch")
        conn.tpc_begin(xid)
        conn.execute("INSERT INTO t2pc VALUES (1)")
        conn.tpc_prepare()
        conn.tpc_commit()
        assert conn.execute("SELECT count(*) FROM t2pc").fetchone() == (1,)
    assert any((pg_cluster.datadir / "log").glob("postgresql-*.log"))


def test_a_cluster_never_started(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path / "nothing")
    st = cluster.status()
    assert not st.running and st.dsn is None and st.port is None
    with pytest.raises(DatabaseUnavailable, match="ringq db start"):
        cluster.url()
    cluster.stop()  # harmless, and makes nothing
    assert not (tmp_path / "nothing").exists()


def test_no_server_installed_says_how_to_install(tmp_path: Path) -> None:
    with pytest.raises(PostgresNotFound, match=r"apt-get install postgresql"):
        find_bindir(search_path="", lib_root=tmp_path)


def test_a_port_taken_before_the_server_binds_is_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ringq.cluster import _server

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        real_free_port = _server._free_port
        offered = iter([busy])  # the first "free" port is already someone else's
        monkeypatch.setattr(_server, "_free_port", lambda: next(offered, None) or real_free_port())
        cluster = Cluster(tmp_path / "home")
        try:
            dsn = cluster.start()
            port = cluster.status().port
            assert port is not None and port != busy and dsn.endswith(f":{port}/ringq")
        finally:
            cluster.stop()
