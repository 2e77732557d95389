"""The SQL agent, beside the session: acting in the section for SQL clients.

It sets ready entries aside for ``ringq.dequeue`` (other hosts, other
languages) and decides them from the rows; the monitor runs it. Imports only
the rows, ring, section and driver layers (not the session).
"""

from __future__ import annotations

from ._offers import DEMAND_S, READY_CHANNEL, WANT_CHANNEL, AgentFigures, SqlAgent
from ._puts import reserved_for_sql

__all__ = [
    "DEMAND_S",
    "READY_CHANNEL",
    "WANT_CHANNEL",
    "AgentFigures",
    "SqlAgent",
    "reserved_for_sql",
]
