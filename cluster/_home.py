"""The files of an embedded cluster's home that are not a server's: the
replication pair (which data directory is the primary), the DSN file the
engine reads, and the lock that serialises start and stop of the home.

Files under the home::

    pgdata/           the first data directory (initdb); see _server for what is inside
    run/              its unix socket directory
    standby/pgdata/   the standby's data directory (a base backup), standby/run its sockets
    replication       which data directory is the primary, which the standby, and how
    dsn               the primary's DSN while it runs
    lock              serialises start and stop of this home (fcntl)
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields
from pathlib import Path

from ._errors import ClusterError

DSN_FILE = "dsn"  # the contract with ringq.engine._dsn
LOCK_FILE = "lock"
PRIMARY_DIR = "pgdata"  # the first data directory, made by initdb
STANDBY_DIR = "standby/pgdata"  # the standby's, made by a base backup of the primary
PAIR_FILE = "replication"  # which of the two is the primary (absent: pgdata, no standby)
SYNC, ASYNC = "sync", "async"
STANDBY_RUNNING = "running"  # streaming; synchronous if the mode says so
STANDBY_STOPPED = "stopped"  # stopped by 'ringq db standby stop' (kept, slot kept)
STANDBY_REBUILD = "rebuild"  # the old primary after a promotion: 'ringq db standby rebuild'


@dataclass(frozen=True)
class Pair:
    """``$RINGQ_HOME/replication``: which data directory (relative to the home)
    is the primary and which the standby, the standby's mode and state."""

    primary: str = PRIMARY_DIR
    standby: str | None = None
    mode: str = SYNC
    state: str = STANDBY_RUNNING

    @classmethod
    def read(cls, home: Path) -> Pair:
        try:
            text = (home / PAIR_FILE).read_text()
        except (FileNotFoundError, NotADirectoryError):  # no home yet: a primary alone
            return cls()
        except OSError as exc:
            raise ClusterError(f"cannot read {home / PAIR_FILE}: {exc.strerror or exc}") from exc
        values = dict(parse_conf(text))
        known = {f.name for f in fields(cls)}
        pair = cls(**{k: v for k, v in values.items() if k in known})
        states = (STANDBY_RUNNING, STANDBY_STOPPED, STANDBY_REBUILD)
        if pair.mode not in (SYNC, ASYNC) or pair.state not in states:
            raise ClusterError(
                f"{home / PAIR_FILE} is damaged (mode {pair.mode!r}, "
                f"state {pair.state!r}): fix it or remove it"
            )
        return pair

    def write(self, home: Path) -> None:
        lines = [
            "# The embedded cluster's replication pair: which data directory is the",
            "# primary and which the standby. Written by 'ringq db standby|promote'.",
            f"primary = {self.primary}",
        ]
        if self.standby is not None:
            lines += [f"standby = {self.standby}", f"mode = {self.mode}", f"state = {self.state}"]
        path = home / PAIR_FILE
        tmp = path.with_name(f".{PAIR_FILE}.{os.getpid()}")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.chmod(0o644)
        os.replace(tmp, path)


def home_of(datadir: str | os.PathLike[str]) -> Path | None:
    """The home whose primary or standby data directory is ``datadir``, or
    None when ``datadir`` is no embedded cluster's (see ``Cluster.home_of``)."""
    path = Path(datadir).resolve()
    for relative in (STANDBY_DIR, PRIMARY_DIR):  # the longer first: <home>/standby/pgdata
        parts = Path(relative).parts
        if path.parts[-len(parts) :] != parts:
            continue
        home = path.parents[len(parts) - 1]
        try:
            pair = Pair.read(home)
        except ClusterError:
            return None
        if relative in (pair.primary, pair.standby):
            return home
    return None


def write_dsn(home: Path, dsn: str) -> None:
    path = home / DSN_FILE
    tmp = path.with_name(f".{DSN_FILE}.{os.getpid()}")
    tmp.write_text(dsn + "\n")
    tmp.chmod(0o644)
    os.replace(tmp, path)  # readers never see a half-written file


def remove_dsn(home: Path) -> None:
    with suppress(FileNotFoundError):
        (home / DSN_FILE).unlink()


@contextmanager
def locked(home: Path) -> Iterator[None]:
    """Serialise start/stop of this home across processes (released by the kernel on death)."""
    with open(home / LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def relative(home: Path, path: Path) -> str:
    return str(path.relative_to(home))


def parse_conf(text: str) -> Iterator[tuple[str, str]]:
    """``key = value`` lines of a settings file (comments and blanks skipped)."""
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.lstrip().startswith("#"):
            yield key.strip(), value.split("#", 1)[0].strip()
