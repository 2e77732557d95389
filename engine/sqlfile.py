"""Named SQL blocks kept in ``.sql`` files, parsed once at import (public: every
ringq package keeps its SQL this way).

A file holds blocks introduced by a line ``-- name --``; the text up to the
next such line is the block::

    from ringq.engine.sqlfile import compose, load

    Q = load("ringq.monitor", "queries.sql")  # {name: text}, once per process
    conn.execute(compose(Q["keys_prune"], table=queue_table(name)), args)
"""

from __future__ import annotations

from .driver import compose, load

__all__ = ["compose", "load"]
