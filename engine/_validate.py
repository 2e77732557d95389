"""Checks of settings shared by the config dataclasses of every package."""

from __future__ import annotations

import math

from ._errors import ConfigError


def validate_seconds(what: str, value: object, low: float, high: float) -> None:
    """Check a number of seconds ``what`` lies in [``low``, ``high``].

    :raises ConfigError: ``value`` is not a finite int or float (bools are
        refused) or lies outside the range; the message names ``what``.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
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
