"""The named SQL of ringq.move (``queries.sql``), parsed once at import."""

from __future__ import annotations

from typing import Final

from ringq.engine.sqlfile import load

SQL: Final = load("ringq.move", "queries.sql")
