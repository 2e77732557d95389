"""The engine's runtime SQL: the named blocks of ``engine/queries.sql``, parsed
once at import. The file stays at the engine's top, the package ``ringq.engine``
(its statements serve every layer, and tests and benchmarks read them there)."""

from __future__ import annotations

from ._sqlfile import load

QUERIES = load("ringq.engine", "queries.sql")
