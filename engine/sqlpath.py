"""SQL consumers, public: the agent that sets entries aside for
``ringq.dequeue()`` (other hosts, other languages) and decides them from the
rows. The monitor runs it; see ``ringq/engine/sqlagent/_offers.py``."""

from __future__ import annotations

from .driver.errors import BehindSqlPuts
from .sqlagent import (
           DEMAND_S,
           READY_CHANNEL,
           WANT_CHANNEL,
           AgentFigures,
           SqlAgent,
           reserved_for_sql,
)

__all__ = ["DEMAND_S", "READY_CHANNEL", "WANT_CHANNEL", "AgentFigures", "BehindSqlPuts",
           "SqlAgent", "reserved_for_sql"]
