"""The one line that says which server the monitor is on and whether it is
the primary, as the terminal view, the page and ``ringq status`` show it::

    server 127.0.0.1:5433 primary, timeline 2 (section: timeline 2)

It is flagged (``alarm``) when the server is not the primary, when the global
section describes another database history than the server's (a fail-over
the section has not followed yet), and when the monitor has no reading (no
database connection).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._source import normalize_server

NOT_PRIMARY = "NOT THE PRIMARY"
MISMATCH = "HISTORY MISMATCH"


@dataclass(frozen=True)
class ServerLine:
    """The line's ``text`` and whether it reports trouble (``alarm``)."""

    text: str
    alarm: bool


def server_line(server: Mapping[str, Any] | None) -> ServerLine:
    """The line for ``server`` of the monitor's ``/api/queues`` (as served,
    null included, or as :func:`~ringq.rtv._source.normalize_server` made it)."""
    row = normalize_server(server)
    if not row["known"]:
        return ServerLine("server unknown: the monitor has no database connection", True)
    address = row["address"] or "?"
    sysid, timeline = row["system_identifier"], row["timeline"]
    section = row["section_history"]
    history = None if section is None else (section["system_identifier"], section["timeline"])
    # The system identifiers only when they differ: they are long, and mostly the same.
    systems = history is not None and history[0] != sysid and history != (0, 0)
    text = f"server {address} "
    if row["primary"] is False:
        text += "standby (in recovery)"
    else:
        text += (f"primary, system {sysid}, " if systems else "primary, ") + f"timeline {timeline}"
    if history is None:
        text += " (section: none attached)"
    elif history == (0, 0):
        text += " (section: no history recorded)"
    elif systems:
        text += f" (section: system {history[0]}, timeline {history[1]})"
    else:
        text += f" (section: timeline {history[1]})"
    follows = row["section_follows"]
    if follows is None:  # a monitor that does not say: the same rule
        follows = row["primary"] is True and history == (sysid, timeline)
    if row["primary"] is False:
        return ServerLine(f"{text}  {NOT_PRIMARY}", True)
    if not follows:
        return ServerLine(f"{text}  {MISMATCH}", True)
    return ServerLine(text, False)
