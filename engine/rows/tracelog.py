"""The ``ringq.trace`` logger: its switch, its output, and the lines that tell
recovery's decisions (``_decide.decide_ops``, ``recovery``); the session's
traced calls log on it too (``session/_trace.py``).

Turned on by ``RINGQ_TRACE=1`` (read here, once, at import: a user's own
program must be able to turn it on without code), by :func:`enable_trace`
(the CLI's ``--trace``), or by the ``ringq.trace`` logger enabled for DEBUG
when a session opens (:func:`wanted`).

``RINGQ_TRACE=1`` alone, in a program that configures no logging, writes the
lines to stderr (a handler that stands aside as soon as any other handler
would take them), or appends them to the file ``RINGQ_TRACE_FILE`` names
(then only there: a trace is long, and not the application's log).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import TextIO

from ..ring import Op

log = logging.getLogger("ringq.trace")

# Runs of slots or seqs shown per queue before the rest is only counted.
MAX_RUNS = 16

ON = False  # RINGQ_TRACE=1 at import, or enable_trace(): every session opened is traced


def enable_trace(file: str | None = None) -> None:
    """Trace every session opened from now on (as ``RINGQ_TRACE=1``): set
    the ``ringq.trace`` logger to DEBUG and give it an output: the file
    ``file`` (else ``RINGQ_TRACE_FILE``) if named, else stderr while no
    other logging handler takes its lines."""
    global ON
    ON = True
    if not log.isEnabledFor(logging.DEBUG):
        log.setLevel(logging.DEBUG)
    if any(isinstance(h, _Stderr | _File) for h in log.handlers):
        return
    path = file or os.environ.get("RINGQ_TRACE_FILE") or None
    handler: logging.Handler
    if path:
        handler = _File(path)
        log.propagate = False
    else:
        handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(asctime)s %(process)d %(name)s: %(message)s"))
    log.addHandler(handler)


def wanted() -> bool:
    """Whether a session opening now is traced (once per session open)."""
    return ON or log.isEnabledFor(logging.DEBUG)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr (as it is when a line is written), only while no other handler
    on the logger's way up would take the line: a program that configures
    logging gets the trace through its own handlers, once."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass  # always the stderr of the moment (as logging's last resort)

    def handle(self, record: logging.LogRecord) -> bool:
        logger: logging.Logger | None = log
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return False
            if not logger.propagate:
                break
            logger = logger.parent
        return bool(super().handle(record))


class _File(logging.FileHandler):
    """Appends to RINGQ_TRACE_FILE, opened at the first line (several
    processes may append to one file: a line is one write)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, mode="a", encoding="utf-8", delay=True)


if os.environ.get("RINGQ_TRACE", "").strip().lower() in ("1", "true", "yes", "on"):
    enable_trace()


# -- the lines -----------------------------------------------------------------------


def runs(values: Iterable[int]) -> str:
    """``3..7,9,12..13``: consecutive values as runs; past :data:`MAX_RUNS`
    runs, ``+N`` counts the values left out."""
    spans: list[list[int]] = []  # [first, last]
    for v in values:
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    shown = ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in spans[:MAX_RUNS])
    left = sum(b - a + 1 for a, b in spans[MAX_RUNS:])
    return shown + (f",+{left}" if left else "")


def decided(
    why: str, queue: str, owner: int | None, committed: list[Op], rolled_back: list[Op]
) -> None:
    """A recovery decision: ``queue``'s slots that ``owner`` held (None:
    whoever holds them), committed and rolled back, decided from their rows
    (call only if :data:`log` is enabled for DEBUG)."""
    log.debug(
        "decide why=%s queue=%s owner=%s committed=%d slots=%s seqs=%s rolled_back=%d "
        "slots=%s seqs=%s",
        why, queue, owner, len(committed), runs(op.slot for op in committed),
        runs(op.seq for op in committed), len(rolled_back),
        runs(op.slot for op in rolled_back), runs(op.seq for op in rolled_back),
    )
