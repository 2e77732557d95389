"""The public API: Session over its link, transaction, claims, reservations, 2PC, trace.

Imports only the rows, ring, section and driver layers (not the SQL agent
beside it). Its face is what ``ringq.engine`` shows of it: the Session and
``connect``, the Message a dequeue returns, named events, the span a consumer's
processing runs in (the ``otel`` extra), and the checks of
settings that every package's configuration shares.
"""

from __future__ import annotations

from ._async import AsyncSession, connect_async
from ._events import CHANNEL, Event, Subscription, publish, subscribe
from ._message import Message
from ._otel import process_span
from ._session import Session, connect
from ._validate import MAX_DELAY, check_group, is_finite_number, validate_int, validate_seconds

__all__ = [
    "CHANNEL",
    "MAX_DELAY",
    "AsyncSession",
    "Event",
    "Message",
    "Session",
    "Subscription",
    "check_group",
    "connect",
    "connect_async",
    "is_finite_number",
    "process_span",
    "publish",
    "subscribe",
    "validate_int",
    "validate_seconds",
]
