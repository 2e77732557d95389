"""The engine's runtime SQL: the named blocks of ``queries.sql``, parsed once at import."""

from __future__ import annotations

from ._sqlfile import load

QUERIES = load("ringq.engine", "queries.sql")
