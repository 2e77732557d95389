"""The queue settings options shared by ``ringq script create-queue`` and ``ringq queue create``.

Defaults come from :class:`ringq.scripting.QueueSpec` itself, so the
help text and the library cannot disagree; the values are validated there.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from ringq.engine import MAX_CAPACITY
from ringq.scripting import DEFAULT_CACHE_PAYLOAD, MAX_CACHE_PAYLOAD, MAX_PAYLOAD, QueueSpec

from ._args import dataclass_from_args

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(QueueSpec)}


def add_queue_options(parser: argparse.ArgumentParser) -> None:
    def spec_option(flag: str, **kwargs: Any) -> None:
        """``flag``, its default the QueueSpec field it sets (``--lease``: ``lease``)."""
        parser.add_argument(flag, default=_DEFAULTS[flag[2:].replace("-", "_")], **kwargs)

    parser.add_argument(
        "name",
        metavar="NAME",
        help="queue name: 1-48 characters, a lowercase letter first, then a-z, 0-9 or '_'",
    )
    for flag, metavar, text in (
        ("--capacity", "N",
         f"slots in the ring, 1 to {MAX_CAPACITY:,}; the table is created with exactly N rows"),
        ("--max-payload", "BYTES", f"largest payload accepted, 1 to {MAX_PAYLOAD:,} bytes"),
    ):
        parser.add_argument(
            flag, type=int, required=True, default=argparse.SUPPRESS, metavar=metavar, help=text
        )
    parser.add_argument(
        "--tablespace",
        metavar="T",
        default=argparse.SUPPRESS,  # None; SUPPRESS keeps "(default: None)" out of --help
        help="tablespace of the ring table and its index (default: the database's); "
        "used quoted, so case matters: Fast_SSD is not fast_ssd",
    )
    spec_option(
        "--fillfactor", type=int, metavar="F",
        help="table fillfactor, 10 to 100; below 100 leaves room for HOT updates",
    )
    parser.add_argument(
        "--exception-queue",
        metavar="NAME",
        default=argparse.SUPPRESS,
        help=(
            "an existing queue (max payload at least this one's) that also receives poison entries"
        ),
    )
    spec_option(
        "--max-deliveries", type=int, metavar="K",
        help="deliveries that do not commit before an entry is moved aside as poison",
    )
    spec_option(
        "--full-policy", choices=("block", "raise"),
        help="when the ring is full: wait for a free slot, or raise QueueFull at once",
    )
    spec_option(
        "--full-timeout", type=float, metavar="S",
        help="seconds a 'block' enqueue waits for a free slot before QueueFull",
    )
    spec_option(
        "--lease", type=float, metavar="S",
        help="seconds a session may hold a dequeued entry without committing; past it the monitor "
        "ends the session and the entry comes back, counted as a delivery (0: no lease)",
    )
    parser.add_argument(
        "--cache-payload",
        type=int,
        metavar="BYTES",
        default=argparse.SUPPRESS,  # None: the default below
        help="payload bytes per slot cached in the global section (0 to max payload, at most "
        f"{MAX_CACHE_PAYLOAD:,}; 0: no cache): a dequeue of a cached entry is served from shared "
        f"memory (default: {DEFAULT_CACHE_PAYLOAD}, or the max payload when smaller, if the "
        "section's cache has room; else 0)",
    )
    add_retry_options(parser, defaults=True)
    spec_option(
        "--dequeue-mode", choices=("single", "shared"),
        help="one dequeuer at a time (strict FIFO), or several reading past each other",
    )


def add_retry_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--retry-delay, --retry-factor, --retry-max (``defaults``: the
    QueueSpec's; else None: not given, kept by 'queue alter')."""
    def default(name: str) -> Any:
        return _DEFAULTS[name] if defaults else None

    parser.add_argument(
        "--retry-delay", type=float, metavar="S", default=default("retry_delay"),
        help="seconds before an entry whose delivery did not commit is due again "
        "(0: at once)",
    )
    parser.add_argument(
        "--retry-factor", type=float, metavar="F", default=default("retry_factor"),
        help="each further failed delivery multiplies the delay by F (1: constant)",
    )
    parser.add_argument(
        "--retry-max", type=float, metavar="S", default=default("retry_max"),
        help="the longest retry delay, seconds (0: no cap)",
    )


def spec_from_args(args: argparse.Namespace) -> QueueSpec:
    """Build the validated settings: each from its option, the options not
    given (``--tablespace``, ``--exception-queue``, ``--cache-payload``) the
    QueueSpec's defaults.

    :raises ConfigError: a value is out of range (the message says which).
    """
    return dataclass_from_args(QueueSpec, args)
