"""The named SQL of ringq.cluster (``queries.sql``), parsed once at import.

Every block is named here as a constant, so that a block missing from the
file fails at import.
"""

from __future__ import annotations

from typing import Final

from ringq.engine.sqlfile import load

_Q: Final = load("ringq.cluster", "queries.sql")

DATABASE_EXISTS: Final = _Q["database_exists"]
CREATE_DATABASE: Final = _Q["create_database"]  # {database}
IN_RECOVERY: Final = _Q["in_recovery"]
CREATE_SLOT: Final = _Q["create_slot"]
DROP_SLOT: Final = _Q["drop_slot"]
REPLICATION_STATE: Final = _Q["replication_state"]
CHECKPOINT: Final = _Q["checkpoint"]
SLOT_EXISTS: Final = _Q["slot_exists"]
