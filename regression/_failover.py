"""The fail-over of a ``--chaos-failover`` cycle, on the embedded cluster.

Before the cycle, :func:`prepare` finds the embedded cluster that serves the
run's DSN, gives it a streaming standby of the wanted kind (made, started, or
brought back after an earlier fail-over) and returns the multi-host DSN that
follows the primary (``Cluster.url(both=True)``), which every process of the
run uses from then on.

In the middle of the cycle :class:`Failover` kills the primary's postmaster
with SIGKILL (the pid in its ``postmaster.pid``) and promotes the standby
(``Cluster.promote``, which also points ``$RINGQ_HOME/dsn`` at it). With an
asynchronous standby it first pauses the primary's walsender for
:data:`ASYNC_GAP_S` (SIGSTOP: a standby falling behind, as over a slow
network), so what producers commit meanwhile stays on the old primary alone:
the replication gap that the proof counts as lost. Just before the kill it
reads how far behind the standby is (``pg_stat_replication``: bytes of WAL not
flushed, not replayed).

After the cycle the old primary comes back as the new one's standby
(``Cluster.rebuild_standby``: pg_rewind, or a fresh copy), so the next cycle,
or ``ringq run``, finds a primary with a standby and ``$RINGQ_HOME/dsn``
naming the live primary.

Producers keep, outside the database, what they were told had committed
(:class:`AckLog`: one line per entry, written after the commit returned): a
commit lost with the old primary takes its ``sent`` rows along, so only this
log can tell what was acknowledged and then lost.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict
from ringq.cluster import Cluster, ClusterError
from ringq.engine import ConfigError, pg

from . import _queries as S
from . import _store

SYNC = "sync"
FAILOVER_AT = (0.3, 0.6)  # share of the cycle's entries committed when the primary dies
ASYNC_GAP_S = 0.5  # async: the primary's walsender is paused this long before the kill
GONE_S = 30.0  # for the killed postmaster to be gone
ACK_BATCH = 10_000  # acknowledged entries per INSERT when the logs are loaded


def embedded_cluster(dsn: str) -> Cluster | None:
    """The running embedded cluster whose primary serves ``dsn`` (found by its
    data directory, ``<home>/pgdata`` or, after a promotion,
    ``<home>/standby/pgdata``); None if ``dsn`` is some other server."""
    with pg.connected(dsn) as conn:
        row = conn.execute(S.DATA_DIRECTORY).fetchone()
    if not row:
        return None
    home = Cluster.home_of(row[0])
    if home is None:
        return None
    cluster = Cluster(home)
    st = cluster.status()
    return cluster if st.running and st.datadir.resolve() == Path(row[0]).resolve() else None


def prepare(dsn: str, mode: str, say: Callable[[str], None]) -> str:
    """Give the embedded cluster serving ``dsn`` a running standby of ``mode``
    (``sync`` or ``async``) and return the multi-host DSN of ``dsn``'s database
    that follows the primary.

    :raises ConfigError: ``dsn`` is not the embedded cluster's primary.
    :raises ClusterError: the standby could not be made, rebuilt or started.
    """
    cluster = embedded_cluster(dsn)
    if cluster is None:
        raise ConfigError(
            "--chaos-failover kills and promotes servers of the embedded cluster "
            "(ringq db start): the DSN must name its primary"
        )
    standby = cluster.standby_status()
    if standby is not None and standby.state == "rebuild":
        say(f"fail-over: bringing the old primary back as a standby ({standby.datadir})")
        cluster.rebuild_standby()
    before = cluster.standby_status()
    cluster.start_standby(sync=mode == SYNC)
    if before is None:
        say(f"fail-over: made a {mode} standby of the embedded cluster under {cluster.home}")
    dbname = str(conninfo_to_dict(dsn).get("dbname") or "ringq")
    return cluster.url(dbname, both=True)


@dataclass
class Failover:
    """The kill -9 of the primary and the promotion of its standby, once per cycle,
    when ``due`` (committed entries) says; then the old primary rebuilt."""

    dsn: str
    mode: str
    rng: random.Random
    expected: int  # committed entries the cycle will make
    at: int = 0
    cluster: Cluster | None = None
    old_port: int | None = None
    new_port: int | None = None
    struck: bool = False
    killed_at: float = 0.0  # time.monotonic(), as every process of the host reads it
    promoted_at: float = 0.0
    times: dict[str, float] = field(default_factory=dict)
    gap: dict[str, Any] = field(default_factory=dict)
    rebuilt: str | None = None
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.at = max(1, int(self.expected * self.rng.uniform(*FAILOVER_AT)))

    def due(self, committed: int) -> bool:
        return not self.struck and committed >= self.at

    def strike(self) -> None:
        """Kill the primary, promote the standby. Errors are recorded, not raised:
        the cycle fails by them, and its workers go on against whatever runs."""
        self.struck = True
        try:
            self._strike()
        except (ClusterError, ConfigError, OSError, psycopg.Error) as exc:
            self.errors.append(f"fail-over: {type(exc).__name__}: {exc}")

    def _strike(self) -> None:
        cluster = embedded_cluster(self.dsn)
        if cluster is None:
            raise ConfigError("the DSN no longer leads to the embedded cluster's primary")
        self.cluster = cluster
        old = cluster.status()
        standby = cluster.standby_status()
        if old.pid is None or old.dsn is None or standby is None or standby.port is None:
            raise ClusterError("no running primary with a standby to fail over to")
        self.old_port, self.new_port = old.port, standby.port
        walsender = None
        if self.mode != SYNC:
            walsender = self._read_gap(old.dsn)
            if walsender is not None:
                os.kill(walsender, signal.SIGSTOP)
                time.sleep(ASYNC_GAP_S)  # producers commit on the primary alone
                self.gap["walsender_paused_s"] = ASYNC_GAP_S
        self._read_gap(old.dsn)
        try:
            self.killed_at = time.monotonic()
            os.kill(old.pid, signal.SIGKILL)
            deadline = self.killed_at + GONE_S
            while cluster.status().running:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        f"the killed postmaster {old.pid} still runs after {GONE_S:g} s"
                    )
                time.sleep(0.005)
            self.times["kill_to_gone_s"] = time.monotonic() - self.killed_at
        finally:
            if walsender is not None:
                with suppress(ProcessLookupError):
                    os.kill(walsender, signal.SIGKILL)  # the rest of the old primary
        cluster.promote()
        self.promoted_at = time.monotonic()
        self.times["kill_to_promoted_s"] = self.promoted_at - self.killed_at

    def _read_gap(self, primary_dsn: str) -> int | None:
        """Record how far behind the standby is; its walsender's pid."""
        with pg.connected(primary_dsn, connect_timeout=5) as conn:
            row = conn.execute(S.REPLICATION_GAP).fetchone()
        if row is None:
            self.gap.update(unflushed_bytes=None, unreplayed_bytes=None, sync_state=None)
            return None
        pid, state, unflushed, unreplayed = row
        self.gap.update(sync_state=state, unflushed_bytes=unflushed, unreplayed_bytes=unreplayed)
        return int(pid)

    def finish(self) -> None:
        """Bring the old primary back as the new one's standby (after the cycle)."""
        if self.cluster is None or not self.promoted_at:
            return
        began = time.monotonic()
        try:
            self.rebuilt = self.cluster.rebuild_standby()
        except (ClusterError, OSError, psycopg.Error) as exc:
            self.errors.append(
                f"fail-over: the old primary was not rebuilt as a standby ({exc}); "
                "'ringq db standby rebuild' does it"
            )
            return
        self.times["rebuild_s"] = time.monotonic() - began

    def report(self, first_dequeue_at: float | None) -> dict[str, Any]:
        """The cycle's ``stats["failover"]``."""
        times = dict(self.times)
        if first_dequeue_at is not None and self.killed_at:
            times["kill_to_first_dequeue_s"] = first_dequeue_at - self.killed_at
        return {
            "mode": self.mode,
            "promotions": 1 if self.promoted_at else 0,
            "at_committed": self.at,
            "old_port": self.old_port,
            "new_port": self.new_port,
            "gap": self.gap,
            **{k: round(v, 4) for k, v in times.items()},
            "rebuilt": self.rebuilt,
            "errors": list(self.errors),
        }

    def store_acks(self, dsn: str, run_id: str, cycle: int, ack_dir: Path) -> int:
        """Load the producers' logs into ``acked``; the number of entries."""
        n = 0
        batch: list[tuple[int, int, int, int, int, bool]] = []
        for path in sorted(ack_dir.glob("p*.log")):
            producer = int(path.stem[1:])
            for tx, port, queue, qseq, pseq in AckLog.entries(path):
                batch.append((producer, queue, qseq, pseq, tx, port == self.new_port))
                if len(batch) >= ACK_BATCH:
                    n += _store.record_acked(dsn, run_id, cycle, batch)
                    batch = []
        if batch:
            n += _store.record_acked(dsn, run_id, cycle, batch)
        return n


class AckLog:
    """A producer's record of its acknowledged entries, kept outside the database:
    after each commit that returned, one ``write`` (append) of one line per
    entry: ``tx port queue qseq pseq``. A kill -9 cannot cut a line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, tx: int, port: int, entries: list[tuple[int, int, int]]) -> None:
        """``entries``: (queue, qseq, pseq) of the transaction ``tx`` committed on ``port``."""
        text = "".join(f"{tx} {port} {q} {qseq} {pseq}\n" for q, qseq, pseq in entries)
        os.write(self._fd, text.encode())

    def last(self) -> tuple[int, int]:
        """(highest pseq, highest tx) acknowledged so far: a producer that lost
        entries with the old primary must not number new ones the same."""
        pseq = tx = 0
        for t, _port, _q, _qseq, p in self.entries(self.path):
            pseq, tx = max(pseq, p), max(tx, t)
        return pseq, tx

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    @staticmethod
    def entries(path: Path) -> Iterator[tuple[int, int, int, int, int]]:
        with path.open() as f:
            for line in f:
                parts = line.split()
                if len(parts) == 5:
                    tx, port, q, qseq, pseq = (int(x) for x in parts)
                    yield tx, port, q, qseq, pseq
