"""The monitor's tidy step: the global sections of databases dropped from its server.

A dropped database's section stays in this host's shared memory (memory,
``/dev/shm``) until someone removes it. The monitor knows its server: a
section that describes the server's history (its system identifier) and
whose instance id no database there has any more belonged to a dropped
database (or to a ringq schema dropped and made again), and goes at the
next pass, with a log line. One a live process still holds is left (it goes
at a later pass, once they exit). When a database could not be read (no
permission to connect), nothing is removed: its instance id may be the one
missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from ringq.engine import SectionError, remove_section_on_host, scan_server, sections_on_host


class Journal(Protocol):
    def __call__(self, event: str, level: int = logging.INFO, **fields: Any) -> None: ...


# Seconds between two looks: each connects to every database of the server.
TIDY_EVERY = 60.0


class SectionTidy:
    """Removes the sections of databases dropped from the monitor's server.

    ``dsn``: the monitor's DSN, asked at every pass (it may follow the
    embedded cluster to another port). ``journal``: where a removal is told
    (event ``section.removed``). ``every``: seconds between two looks.
    """

    def __init__(
        self, dsn: Callable[[], str], journal: Journal, *, every: float = TIDY_EVERY
    ) -> None:
        self._dsn = dsn
        self._journal = journal
        self._every = every
        self._due = 0.0
        self.removed = 0  # sections removed since the start

    def run(self) -> None:
        """One pass (a no-op until ``every`` seconds after the last).

        :raises DatabaseUnavailable: the server does not answer (the loop counts a failed step).
        """
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self._every
        scan = scan_server(self._dsn())
        if not scan.sysid or not scan.complete:
            return  # cannot tell a dropped database from one we may not read
        for found in sections_on_host():
            if found.sysid != scan.sysid or found.instance_id in scan.instances:
                continue
            if found.pids:
                continue  # held: a later pass, once its processes are gone
            try:
                remove_section_on_host(found.instance_id)
            except SectionError:
                continue  # attached or removed meanwhile
            self.removed += 1
            self._journal(
                "section.removed", logging.INFO, section=found.name, memory=found.memory,
                queues=list(found.queues),
                reason="its database is no longer on the monitor's server (dropped)",
            )
