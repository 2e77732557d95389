"""Named SQL blocks kept in ``.sql`` files, parsed once at import.

A file holds blocks introduced by a line ``-- name --``; the text up to the
next such line is the block. Identifiers are filled in later only through
``psycopg.sql`` composition, never by string formatting.
"""

from __future__ import annotations

import re
from importlib import resources

from psycopg import sql

_HEADER = re.compile(r"^-- ([a-z_][a-z0-9_]*) --\s*$", re.MULTILINE)


def load(package: str, filename: str) -> dict[str, str]:
    """Return ``{name: text}`` for every block in ``package/filename``."""
    text = resources.files(package).joinpath(filename).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    blocks: dict[str, str] = {}
    for i in range(1, len(parts), 2):
        name, body = parts[i], parts[i + 1].strip()
        if name in blocks:
            raise ValueError(f"{filename}: duplicate block {name!r}")
        blocks[name] = body
    return blocks


def compose(template: str, **identifiers: sql.Composable) -> sql.Composed:
    """Fill ``{name}`` placeholders of a block with composables (Identifier, Literal)."""
    return sql.SQL(template).format(**identifiers)
