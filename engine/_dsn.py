"""Where the database is: an explicit DSN, else ``RINGQ_DSN``, else the embedded cluster.

The embedded cluster (``ringq db start``) writes its DSN to ``$RINGQ_HOME/dsn``
(``RINGQ_HOME`` defaults to ``./.ringq``); the engine reads that file rather
than importing the cluster code, so the engine depends on no other package.
"""

from __future__ import annotations

import os
from pathlib import Path

from ._errors import DatabaseUnavailable

DEFAULT_HOME = ".ringq"
DSN_FILE = "dsn"


def ringq_home() -> Path:
    """The directory of the embedded cluster: ``$RINGQ_HOME`` or ``./.ringq``."""
    return Path(os.environ.get("RINGQ_HOME") or DEFAULT_HOME).resolve()


def resolve_dsn(dsn: str | None = None) -> str:
    """Return the DSN to use: ``dsn`` > ``$RINGQ_DSN`` > the embedded cluster's.

    :raises DatabaseUnavailable: none is given and no embedded cluster runs.
    """
    if dsn:
        return dsn
    env = os.environ.get("RINGQ_DSN")
    if env:
        return env
    path = ringq_home() / DSN_FILE
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        text = ""
    if not text:
        raise DatabaseUnavailable(
            f"no database: pass --dsn, set RINGQ_DSN, or start the embedded cluster "
            f"with 'ringq db start' (looked for {path})"
        )
    return text
