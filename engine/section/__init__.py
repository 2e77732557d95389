"""The global section in shared memory: layout, client table, counters, attachment, segments.

Imports only the driver layer. Its face: the :class:`Section` (one segment:
queue blocks, bitmaps, locks, client table), this process's one attachment
of it, the host's segments (listing, tidying, scanning a server); and its
public modules :mod:`.layout` (every word's index and the limits) and
:mod:`.metrics` (the counters' names), read by every layer above.
"""

from __future__ import annotations

from ._clients import pid_alive
from ._process import shared_section
from ._section import Section, section_name
from ._shm import (
    SectionInUse,
    SectionOnHost,
    ServerScan,
    Tidied,
    database_state,
    remove_section_on_host,
    scan_server,
    sections_on_host,
    tidy_sections,
)

__all__ = [
    "Section",
    "SectionInUse",
    "SectionOnHost",
    "ServerScan",
    "Tidied",
    "database_state",
    "pid_alive",
    "remove_section_on_host",
    "scan_server",
    "section_name",
    "sections_on_host",
    "shared_section",
    "tidy_sections",
]
