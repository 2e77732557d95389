"""The worker's named SQL (``queries.sql``), parsed once at import.

Every block is named here as a constant, so that a block missing from the
file fails at import and not in the middle of an action.
"""

from __future__ import annotations

from typing import Final

from ringq.engine.sqlfile import load

_Q: Final = load("ringq.worker", "queries.sql")

STATEMENT_TIMEOUT: Final = _Q["statement_timeout"]
SET_STATEMENT_TIMEOUT: Final = _Q["set_statement_timeout"]
