"""The named SQL of ringq.scripting's functions (``queries.sql``), parsed once at import.

The DDL itself is in ``ddl.sql`` and the queue administration's queries in
``admin.sql``; this holds the rest. Every block is named here as a constant,
so that a block missing from the file fails at import.
"""

from __future__ import annotations

from typing import Final

from ringq.engine.sqlfile import load

_Q: Final = load("ringq.scripting", "queries.sql")

SCHEMA_PRESENT: Final = _Q["schema_present"]
QUEUE_EXISTS: Final = _Q["queue_exists"]
QUEUE_SECTION: Final = _Q["queue_section"]
