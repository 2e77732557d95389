"""Where the database is: an explicit DSN, else ``RINGQ_DSN``, else the embedded cluster.

The embedded cluster (``ringq db start``) writes its DSN to ``$RINGQ_HOME/dsn``
(``RINGQ_HOME`` defaults to ``./.ringq``); the engine reads that file rather
than importing the cluster code, so the engine depends on no other package.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from .errors import ConfigError, DatabaseUnavailable, scrub
from .pg import from_psycopg

DEFAULT_HOME = ".ringq"
DSN_FILE = "dsn"

_PORT_RE = re.compile(r"\s*[0-9]{1,5}\s*")


def ringq_home() -> Path:
    """The directory of the embedded cluster: ``$RINGQ_HOME`` or ``./.ringq``."""
    return Path(os.environ.get("RINGQ_HOME") or DEFAULT_HOME).resolve()


def resolve_dsn(dsn: str | None = None) -> str:
    """Return the DSN to use: ``dsn`` > ``$RINGQ_DSN`` > the embedded cluster's.

    :raises ConfigError: the DSN is malformed (see :func:`check_dsn`).
    :raises DatabaseUnavailable: none is given and no embedded cluster runs.
    """
    if dsn:
        check_dsn(dsn)
        return dsn
    env = os.environ.get("RINGQ_DSN")
    if env:
        check_dsn(env, where="RINGQ_DSN")
        return env
    path = ringq_home() / DSN_FILE
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError):
        text = ""
    except OSError as exc:
        raise DatabaseUnavailable(
            f"no database: cannot read {path}: {exc.strerror or exc}"
        ) from exc
    if not text:
        raise DatabaseUnavailable(
            f"no database: pass --dsn, set RINGQ_DSN, or start the embedded cluster "
            f"with 'ringq db start' (looked for {path})"
        )
    check_dsn(text, where=str(path))
    return text


def dsn_file(dsn: str | None = None) -> Path | None:
    """The file :func:`resolve_dsn` reads the DSN from, given ``dsn``: the
    embedded cluster's ``$RINGQ_HOME/dsn``, or None when the DSN is given
    (``dsn`` or ``RINGQ_DSN``). A long-running process re-reads it (see
    :func:`read_dsn_file`) to follow a cluster that came back on another port.
    """
    if dsn or os.environ.get("RINGQ_DSN"):
        return None
    return ringq_home() / DSN_FILE


def read_dsn_file(path: Path) -> str | None:
    """The DSN in ``path`` (see :func:`dsn_file`), or None if it is absent,
    empty, unreadable or malformed (the cluster is stopped, or being started)."""
    try:
        text = path.read_text().strip()
        if text:
            check_dsn(text, where=str(path))
    except (OSError, ConfigError):
        return None
    return text or None


def check_dsn(dsn: str, *, where: str = "DSN") -> dict[str, Any]:
    """Parse ``dsn`` as libpq does (URL or key=value) and check its ports,
    before any connection is tried: a malformed DSN is bad input, not an
    unavailable database. Returns the parsed parameters.

    :raises ConfigError: it does not parse, a port is not a number from 1 to
        65535, or several ports do not pair with the hosts. The DSN itself is
        not echoed (one that does not parse may hide its password from
        :func:`redact_dsn`); libpq's message names the spot, with any text of
        the DSN that could be a password hidden (:func:`scrub`).
    """
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.Error as exc:
        # from None: the chained error may quote the DSN, password and all
        raise from_psycopg(exc, dsn=dsn, parsing=where) from None
    ports = str(params.get("port") or "")
    port_list = ports.split(",") if ports else []
    for port in port_list:
        if port.strip() and not (_PORT_RE.fullmatch(port) and 1 <= int(port) <= 65535):
            # libpq reads "u:pa/ss@h" as host "u", port "pa": the port may be a password's piece
            shown = scrub(repr(port.strip()), dsn)
            raise ConfigError(f"invalid {where}: port {shown} is not a number from 1 to 65535")
    hosts = str(params.get("host") or params.get("hostaddr") or "")
    n_hosts = len(hosts.split(",")) if hosts else 1
    if len(port_list) > 1 and len(port_list) != n_hosts:
        raise ConfigError(f"invalid {where}: {len(port_list)} ports for {n_hosts} hosts")
    return params
