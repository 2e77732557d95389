"""Which server the monitor's connection is on, and whether it is the primary
(``server`` in ``/api/queues``).

With a multi-host DSN (``host=a,b target_session_attrs=read-write``) libpq
picks the server, so after a fail-over the monitor is on another one: the
document names it (``host``, ``port``), says whether it is the primary, and
shows the database history it has (system identifier, timeline) beside the
one the global section describes, so an operator sees a section that did
not follow.

The server is read once per sample, on the monitor's own connection (two
statements), never per HTTP request; the section's history is read from
shared memory when the document is made, so a section rebuilt since the
sample shows at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from ringq.engine.recovery import history_of

from . import _queries as Qy

# The keys of ``server`` in /api/queues (monitor/API.md); the viewer reads these names.
HOST: Final = "host"
PORT: Final = "port"
ADDRESS: Final = "address"  # host:port ([v6]:port), as `ringq status` prints it
PRIMARY: Final = "primary"
SYSTEM_IDENTIFIER: Final = "system_identifier"
TIMELINE: Final = "timeline"  # -1 on a standby (ringq.engine.recovery.history_of)
SECTION_HISTORY: Final = "section_history"  # {system_identifier, timeline}, or null
SECTION_FOLLOWS: Final = "section_follows"
T: Final = "t"


@dataclass(frozen=True)
class ServerState:
    """One reading: the server the connection is on (``host`` as libpq reports
    it: a name, an address or a socket directory), whether it is the primary,
    its history (``timeline`` -1 on a standby) and when it was read (``t``,
    unix seconds)."""

    host: str
    port: int
    primary: bool
    system_identifier: int
    timeline: int
    t: float

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def follows(self, section: tuple[int, int] | None) -> bool:
        """The server is the primary and ``section`` (a section's history) is its history."""
        return self.primary and section == (self.system_identifier, self.timeline)

    def as_dict(self, section: tuple[int, int] | None) -> dict[str, Any]:
        """``server`` of ``/api/queues``, with ``section``: the history the
        attached section describes (``Section.history()``; None without a
        section, (0, 0) when none was recorded yet)."""
        history = None
        if section is not None:
            section = int(section[0]), int(section[1])
            history = {SYSTEM_IDENTIFIER: section[0], TIMELINE: section[1]}
        return {
            HOST: self.host,
            PORT: self.port,
            ADDRESS: self.address,
            PRIMARY: self.primary,
            SYSTEM_IDENTIFIER: self.system_identifier,
            TIMELINE: self.timeline,
            SECTION_HISTORY: history,
            SECTION_FOLLOWS: self.follows(section),
            T: round(self.t, 3),
        }


def read_server(conn: psycopg.Connection[Any]) -> ServerState:
    """Read the server ``conn`` is on.

    :raises psycopg.Error: the statements failed (the caller drops the connection).
    """
    row = conn.execute(Qy.IN_RECOVERY).fetchone()
    assert row is not None
    sysid, timeline = history_of(conn)
    return ServerState(
        host=str(conn.info.host),
        port=int(conn.info.port),
        primary=not row[0],
        system_identifier=sysid,
        timeline=timeline,
        t=time.time(),
    )


class ReadServer:
    """Step ``server``: which server the connection is on, whether it is the
    primary, and its history (``server`` in ``/api/queues``); None while
    disconnected."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self.server: ServerState | None = None

    def run(self) -> None:
        self.server = read_server(self._connect())

    def forget(self) -> None:
        self.server = None  # the next connection may be on another server
