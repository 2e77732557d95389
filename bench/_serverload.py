"""Where a stretch of work spent the server's time: CPU from /proc, writes from the stats views.

``bench_hosts.py`` takes one :class:`Reading` at the start of a stretch and
one at its end, and :func:`difference` says what happened between them:

- **CPU** of one PostgreSQL server (the one the reading connection's backend
  belongs to, so that other clusters on a shared machine are not counted):
  its postmaster's ``utime + stime + cutime + cstime`` (the last two: the
  backends that exited and were reaped meanwhile) plus every live child's
  ``utime + stime``, from ``/proc/<pid>/stat``; per backend as well, so that
  the backends of one client process (the monitor) can be told apart by the
  TCP ports its sockets hold (:func:`local_ports`, matched against
  ``pg_stat_activity.client_port``);
- the machine's busy share from ``/proc/stat`` (all CPUs);
- **writes**: ``pg_stat_user_tables`` (rows inserted, updated, HOT-updated,
  deleted per table), ``pg_stat_database`` (commits, rollbacks),
  ``pg_current_wal_lsn()`` (WAL bytes);
- **statements**: ``pg_stat_statements`` when the server loads it (calls,
  rows and execution time per statement; ``track = all`` also shows the
  statements run inside functions, marked not top-level).

Everything here reads; nothing changes the server but
``pg_stat_statements_reset()`` (:func:`reset_statements`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import psycopg

TICK = os.sysconf("SC_CLK_TCK")

TABLE_STATS = """
SELECT schemaname || '.' || relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
FROM pg_stat_user_tables
"""
DB_STATS = """
SELECT xact_commit, xact_rollback, pg_current_wal_lsn() - '0/0'::pg_lsn
FROM pg_stat_database WHERE datname = current_database()
"""
ACTIVITY = """
SELECT pid, client_port, coalesce(application_name, ''), coalesce(backend_type, '')
FROM pg_stat_activity
"""
HAS_STATEMENTS = "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'"
STATEMENTS = """
SELECT s.toplevel, s.calls, s.rows, s.total_exec_time, s.query
FROM pg_stat_statements s
WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
"""
RESET_STATEMENTS = "SELECT pg_stat_statements_reset()"


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_cpu(pid: int, *, reaped: bool = False) -> float | None:
    """CPU seconds (user + system) of process ``pid``; with ``reaped``, also
    those of its children that exited and were waited for."""
    f = _stat_fields(pid)
    if f is None:
        return None
    ticks = int(f[11]) + int(f[12]) + ((int(f[13]) + int(f[14])) if reaped else 0)
    return ticks / TICK


def children_cpu(parent: int) -> dict[int, float]:
    """CPU seconds of each live child of ``parent`` (the postmaster's backends
    and auxiliary processes)."""
    out: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = _stat_fields(name)
        if f is not None and int(f[1]) == parent:
            out[int(name)] = (int(f[11]) + int(f[12])) / TICK
    return out


def parent_of(pid: int) -> int | None:
    f = _stat_fields(pid)
    return None if f is None else int(f[1])


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)  # idle + iowait
    total = sum(parts[:8])  # guest time is already inside user
    return (total - idle) / TICK, total / TICK


def local_ports(pid: int) -> set[int]:
    """The local TCP ports of the sockets process ``pid`` holds (its
    connections to the server, as ``pg_stat_activity.client_port`` shows them)."""
    inodes: set[str] = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        return set()
    ports: set[int] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    cols = line.split()
                    if len(cols) > 9 and cols[9] in inodes:
                        ports.add(int(cols[1].rsplit(":", 1)[1], 16))
        except OSError:
            continue
    return ports


@dataclass
class Reading:
    """The server's counters at one moment (see the module's docstring)."""

    at: float  # time.monotonic()
    postmaster_cpu: float | None  # s, with the reaped backends'
    backends_cpu: dict[int, float]  # pid -> s
    busy: tuple[float, float]  # the machine's (busy, total) s
    clients_cpu: dict[str, float | None]  # named client processes (the monitor) -> s
    tables: dict[str, tuple[int, int, int, int]]  # table -> ins, upd, hot_upd, del
    commits: int
    rollbacks: int
    wal_bytes: int
    activity: dict[int, tuple[int | None, str, str]]  # pid -> client port, application, type
    statements: list[tuple[bool, int, int, float, str]] | None = None
    ports: dict[str, set[int]] = field(default_factory=dict)  # client name -> local ports


class Probe:
    """Readings of the server ``conn`` is connected to (an autocommit
    connection kept for the purpose); ``clients``: processes of this host to
    follow by name (their CPU, and which backends are theirs)."""

    def __init__(self, conn: psycopg.Connection[Any], clients: dict[str, int]) -> None:
        self.conn = conn
        self.clients = clients
        ppid = parent_of(conn.info.backend_pid)
        # None: the server is not on this host (a --dsn elsewhere): no CPU figures
        self.postmaster = ppid if ppid is not None and ppid > 1 else None
        row = conn.execute(HAS_STATEMENTS).fetchone()
        self.statements = bool(row and row[0])

    def reset_statements(self) -> None:
        if self.statements:
            self.conn.execute(RESET_STATEMENTS)

    def read(self, *, statements: bool = False) -> Reading:
        import time

        c = self.conn
        c.execute("SELECT pg_stat_clear_snapshot()")
        tables = {r[0]: (int(r[1]), int(r[2]), int(r[3]), int(r[4]))
                  for r in c.execute(TABLE_STATS).fetchall()}  # fmt: skip
        db = c.execute(DB_STATS).fetchone()
        assert db is not None
        activity = {int(r[0]): (None if r[1] is None else int(r[1]), str(r[2]), str(r[3]))
                    for r in c.execute(ACTIVITY).fetchall()}  # fmt: skip
        stmts = None
        if statements and self.statements:
            stmts = [(bool(r[0]), int(r[1]), int(r[2]), float(r[3]), str(r[4]))
                     for r in c.execute(STATEMENTS).fetchall()]  # fmt: skip
        pm = self.postmaster
        return Reading(
            at=time.monotonic(),
            postmaster_cpu=None if pm is None else process_cpu(pm, reaped=True),
            backends_cpu={} if pm is None else children_cpu(pm),
            busy=machine_busy(),
            clients_cpu={name: process_cpu(pid) for name, pid in self.clients.items()},
            tables=tables,
            commits=int(db[0]),
            rollbacks=int(db[1]),
            wal_bytes=int(db[2]),
            activity=activity,
            statements=stmts,
            ports={name: local_ports(pid) for name, pid in self.clients.items()},
        )


def cpu_between(a: Reading, b: Reading) -> dict[str, Any]:
    """CPU seconds between readings ``a`` and ``b``: the server's (None when
    it is not on this host), each named client process's, the share of that
    server CPU spent by the backends each named client holds (by the TCP
    ports of its sockets at ``b``, each backend by its application name), and
    the machine's busy share."""
    out: dict[str, Any] = {}
    if a.postmaster_cpu is not None and b.postmaster_cpu is not None:
        live_a = sum(a.backends_cpu.values())
        live_b = sum(b.backends_cpu.values())
        out["server_s"] = (b.postmaster_cpu + live_b) - (a.postmaster_cpu + live_a)
    else:
        out["server_s"] = None
    for name in b.clients_cpu:
        before, after = a.clients_cpu.get(name), b.clients_cpu[name]
        out[f"{name}_s"] = None if before is None or after is None else after - before
        ports = b.ports.get(name, set())
        mine: dict[str, float] = {}
        for pid, (port, app, _kind) in b.activity.items():
            if port is None or port not in ports or pid not in b.backends_cpu:
                continue
            spent = b.backends_cpu[pid] - a.backends_cpu.get(pid, 0.0)
            label = app
            mine[label] = mine.get(label, 0.0) + spent
        out[f"{name}_backends_s"] = mine
    busy = b.busy[0] - a.busy[0]
    total = b.busy[1] - a.busy[1]
    out["machine_busy"] = busy / total if total > 0 else None
    return out


def writes_between(a: Reading, b: Reading) -> dict[str, Any]:
    """Rows written per table (only tables that changed), commits, rollbacks
    and WAL bytes between readings ``a`` and ``b``."""
    tables: dict[str, dict[str, int]] = {}
    for name, after in b.tables.items():
        before = a.tables.get(name, (0, 0, 0, 0))
        d = [x - y for x, y in zip(after, before, strict=True)]
        if any(d):
            tables[name] = {"ins": d[0], "upd": d[1], "hot_upd": d[2], "del": d[3]}
    return {
        "tables": tables,
        "commits": b.commits - a.commits,
        "rollbacks": b.rollbacks - a.rollbacks,
        "wal_bytes": b.wal_bytes - a.wal_bytes,
    }


def statements_of(b: Reading, top: int = 12) -> dict[str, Any] | None:
    """From a reading taken after :meth:`Probe.reset_statements`: calls of
    top-level statements, and the ``top`` statements by execution time
    (top-level or run inside a function), each with its calls, rows and
    milliseconds. None without pg_stat_statements."""
    if b.statements is None:
        return None
    toplevel_calls = sum(calls for toplevel, calls, _r, _t, _q in b.statements if toplevel)
    toplevel_ms = sum(ms for toplevel, _c, _r, ms, _q in b.statements if toplevel)
    ranked = sorted(b.statements, key=lambda s: -s[3])[:top]
    return {
        "toplevel_calls": toplevel_calls,
        "toplevel_exec_ms": toplevel_ms,
        "top": [{"toplevel": t, "calls": c, "rows": r, "exec_ms": ms,
                 "query": " ".join(q.split())[:160]} for t, c, r, ms, q in ranked],
    }
