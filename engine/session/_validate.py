"""Checks of settings shared by the config dataclasses of every package, and
of the arguments of the session's calls (checked before anything is done)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime
from typing import TypeGuard

from ..driver.errors import ConfigError, InvalidArgument, InvalidArgumentType

MAX_KEY_BYTES = 1000  # an idempotency key, UTF-8 encoded
MAX_GROUP_BYTES = 128  # a group name, UTF-8 encoded (ringq.engine.layout.GROUP_BYTES)


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is a finite int or float: a bool is refused (it is an
    int to Python, but never a number of seconds or a rate here), and so are
    NaN and the infinities."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_seconds(what: str, value: object, low: float, high: float) -> None:
    """Check a number of seconds ``what`` lies in [``low``, ``high``].

    :raises ConfigError: ``value`` is not a finite int or float (bools are
        refused) or lies outside the range; the message names ``what``.
    """
    if not is_finite_number(value) or not low <= value <= high:
        raise ConfigError(f"{what} must be a number from {low:g} to {high:g}, not {value!r}")


def validate_int(what: str, value: object, low: int, high: int | None = None) -> None:
    """Check an integer ``what`` lies in [``low``, ``high``] (``high`` None: no upper bound).

    :raises ConfigError: ``value`` is not an int (bools are refused) or lies
        outside the range; the message names ``what``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
        bounds = f">= {low:,}" if high is None else f"from {low:,} to {high:,}"
        raise ConfigError(f"{what} must be an integer {bounds}, not {value!r}")


def check_wait(what: str, value: object) -> None:
    """Check a wait or timeout argument: None, or a finite number of seconds >= 0.

    :raises InvalidArgumentType: not a number (bools are refused).
    :raises InvalidArgument: negative, infinite or NaN.
    """
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentType(
            f"{what} must be a number of seconds or None, not {type(value).__name__}"
        )
    if not math.isfinite(value) or value < 0:
        raise InvalidArgument(f"{what} must be a finite number of seconds >= 0, not {value!r}")


def check_count(what: str, value: object) -> int:
    """Check a count argument: an int >= 1.

    :raises InvalidArgumentType: not an int (bools are refused).
    :raises InvalidArgument: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentType(f"{what} must be an int, not {type(value).__name__}")
    if value < 1:
        raise InvalidArgument(f"{what} must be >= 1, not {value}")
    return value


MAX_TRACE_BYTES = 512  # a trace context an entry carries (a W3C traceparent is 55)


def check_trace(trace: object) -> None:
    """Check a trace context an entry carries: None, or a str of ASCII text of at
    most ``MAX_TRACE_BYTES`` (a W3C ``traceparent``, ``00-<trace id>-<span id>-<flags>``).

    :raises InvalidArgumentType: not a str.
    :raises InvalidArgument: too long, or not printable ASCII.
    """
    if trace is None:
        return
    if not isinstance(trace, str):
        raise InvalidArgumentType(f"trace must be a str or None, not {type(trace).__name__}")
    if len(trace) > MAX_TRACE_BYTES or not (trace.isascii() and trace.isprintable()):
        raise InvalidArgument(
            f"trace must be printable ASCII of at most {MAX_TRACE_BYTES} characters"
        )


def check_key(key: object) -> None:
    """Check an idempotency key: None, or a str of at most ``MAX_KEY_BYTES`` UTF-8 bytes
    without NUL.

    :raises InvalidArgumentType: not a str.
    :raises InvalidArgument: too long, or holds a NUL character (PostgreSQL text cannot).
    """
    if key is None:
        return
    if not isinstance(key, str):
        raise InvalidArgumentType(f"key must be a str or None, not {type(key).__name__}")
    if "\x00" in key:
        raise InvalidArgument("key must not contain NUL characters")
    size = len(key.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidArgument(f"key is {size:,} bytes long (UTF-8): {MAX_KEY_BYTES:,} at most")


def check_producer(producer: object) -> None:
    """Check a producer name given to ``connect``: a str, valid UTF-8, without
    NUL (it is written with every entry, as PostgreSQL text).

    :raises InvalidArgumentType: not a str. :raises InvalidArgument: not
        encodable, or holds a NUL character.
    """
    if not isinstance(producer, str):
        raise InvalidArgumentType(f"producer must be a str, not {type(producer).__name__}")
    _text_bytes("producer", producer)


def _text_bytes(what: str, text: str) -> int:
    """The UTF-8 size of ``text`` that PostgreSQL is to store as text.

    :raises InvalidArgument: it holds a NUL character, or is not encodable.
    """
    if "\x00" in text:
        raise InvalidArgument(f"{what} must not contain NUL characters")
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{what} is not encodable as UTF-8: {exc.reason}") from None


def check_group(group: object, what: str = "group") -> str | None:
    """Check a group name: None, or a non-empty str of at most
    ``MAX_GROUP_BYTES`` UTF-8 bytes without NUL.

    :raises InvalidArgumentType: not a str.
    :raises InvalidArgument: empty, too long, not encodable, or holds a NUL character.
    """
    if group is None:
        return None
    if not isinstance(group, str):
        raise InvalidArgumentType(f"{what} must be a str or None, not {type(group).__name__}")
    if not group:
        raise InvalidArgument(f"{what} must not be empty (None: no group)")
    size = _text_bytes(what, group)
    if size > MAX_GROUP_BYTES:
        raise InvalidArgument(
            f"{what} is {size:,} bytes long (UTF-8): {MAX_GROUP_BYTES:,} at most"
        )
    return group


def as_groups(group: object, n: int) -> list[str | None] | None:
    """The groups of a batch of ``n`` entries: None (no group), one str for
    all, or an iterable of ``n`` str-or-None, one per entry.

    :raises InvalidArgumentType: not one of those, or an element not a str or None.
    :raises InvalidArgument: a count other than ``n``, or a group :func:`check_group` refuses.
    """
    if group is None:
        return None
    if isinstance(group, str):
        one = check_group(group)
        return [one] * n
    if isinstance(group, bytes | bytearray | memoryview) or not isinstance(group, Iterable):
        raise InvalidArgumentType(
            f"group must be a str, None or an iterable of them, not {type(group).__name__}"
        )
    groups = [check_group(g, "each group") for g in group]
    if len(groups) != n:
        raise InvalidArgument(f"group has {len(groups):,} groups for {n:,} payloads")
    return groups


def as_payload(payload: object) -> bytes:
    """A payload as bytes: bytes, bytearray or memoryview.

    :raises InvalidArgumentType: anything else (a str must be encoded first).
    """
    if isinstance(payload, bytes):
        return payload
    if isinstance(payload, bytearray | memoryview):
        return bytes(payload)
    raise InvalidArgumentType(
        "payload must be bytes-like (bytes, bytearray, memoryview),"
        f" not {type(payload).__name__}"
    )


def as_payloads(payloads: object) -> list[bytes]:
    """Payloads as a list of bytes, from any iterable of bytes-like payloads.

    :raises InvalidArgumentType: not an iterable of them (one bytes-like object is refused).
    """
    if isinstance(payloads, str | bytes | bytearray | memoryview) or not isinstance(
        payloads, Iterable
    ):
        raise InvalidArgumentType(
            f"payloads must be an iterable of bytes-like payloads, not {type(payloads).__name__}"
        )
    return [as_payload(p) for p in payloads]


MAX_DELAY = 1e9  # seconds (about 31 years): what make_interval and the section's us words hold


def check_due(delay: object, not_before: object) -> tuple[float | None, datetime | None]:
    """Check when an entry falls due: ``delay`` (seconds from the commit's
    row write, by the database's clock) or ``not_before`` (an aware
    datetime), not both; None both: at once.

    :raises InvalidArgumentType: ``delay`` not a number (bools refused),
        ``not_before`` not a datetime.
    :raises InvalidArgument: both given, ``delay`` negative, NaN, infinite or
        over ``MAX_DELAY``, ``not_before`` naive (no time zone).
    """
    if delay is None and not_before is None:
        return None, None
    if delay is not None and not_before is not None:
        raise InvalidArgument("give delay or not_before, not both")
    if delay is not None:
        if isinstance(delay, bool) or not isinstance(delay, int | float):
            raise InvalidArgumentType(
                f"delay must be a number of seconds or None, not {type(delay).__name__}"
            )
        if not math.isfinite(delay) or not 0 <= delay <= MAX_DELAY:
            raise InvalidArgument(
                f"delay must be a finite number of seconds from 0 to {MAX_DELAY:g}, not {delay!r}"
            )
        return float(delay), None
    if not isinstance(not_before, datetime):
        raise InvalidArgumentType(
            f"not_before must be a datetime or None, not {type(not_before).__name__}"
        )
    if not_before.tzinfo is None or not_before.utcoffset() is None:
        raise InvalidArgument(
            "not_before must be an aware datetime (with a time zone): a naive one "
            "would be read in the server's time zone"
        )
    return None, not_before
