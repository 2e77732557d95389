"""The gids of ringq's two-phase transactions: the branch that
``Session.xid`` gives them, and how recovery tells them from the user's own
prepared transactions (which it never rolls back)."""

from __future__ import annotations

import base64

TPC_BRANCH = "ringq"  # the branch qualifier of Session.xid(): marks the gids ringq made


def _b64(b: str) -> str:
    return base64.b64encode(b.encode()).decode()


def gid_of(format_id: int, gtrid: str, bqual: str) -> str:
    """The gid PostgreSQL knows a prepared xid by, as psycopg spells it
    (``pg_prepared_xacts.gid``, ``tpc_log.gid``)."""
    return f"{format_id}_{_b64(gtrid)}_{_b64(bqual)}"


def is_ringq_gid(gid: str) -> bool:
    """Whether ``gid`` is one :meth:`Session.xid` makes (format 0, branch
    ``ringq``, as psycopg spells an xid), so recovery may roll it back.
    Prepared transactions named otherwise are the user's own."""
    parts = gid.split("_")  # base64 never holds "_"
    return len(parts) == 3 and parts[0] == "0" and parts[2] == _b64(TPC_BRANCH)
