"""The ``ringq`` command: a thin dispatcher over the packages.

Each ``cli/_<command>.py`` module has ``register(subparsers)``, which adds its
parser and sets ``func`` (taking the parsed namespace, returning an exit code).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from ringq import __version__
from ringq.engine import (
    ConfigError,
    DatabaseUnavailable,
    EntryNotFound,
    QueueExists,
    QueueNotFound,
    RingqError,
    exits,
    scrub_exception,
)

from ._args import Formatter, add_trace, apply_trace, failed, resolve_env

# The exit code of an error that reaches the top, by its class: the first row
# the error is an instance of decides; any other RingqError is FAILURE.
EXIT_CODES: tuple[tuple[type[RingqError] | tuple[type[RingqError], ...], int], ...] = (
    (DatabaseUnavailable, exits.DB_UNAVAILABLE),
    ((QueueNotFound, EntryNotFound), exits.NOT_FOUND),
    (QueueExists, exits.CONFLICT),
    (ConfigError, exits.USAGE),
)

# Subcommand modules, loaded lazily so `ringq --help` stays fast and a missing
# optional dependency (pyspark) only affects its own command.
COMMANDS = (
    "_db",
    "_script",
    "_queue",
    "_monitor",
    "_status",
    "_rtv",
    "_worker",
    "_move",
    "_regress",
    "_run",
    "_section",
    "_report",
)

# The commands that run sessions: they take --trace (the engine's trace of queue operations).
TRACED_COMMANDS = ("worker", "move", "monitor", "regress", "run")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringq",
        description=(
            "ringq: transactional message queues inside PostgreSQL.\n\n"
            "Environment: RINGQ_DSN (database), RINGQ_HOME (embedded cluster, default ./.ringq).\n"
            "Options a deployment sets once (DSNs, homes, ports, hosts, tokens, intervals,\n"
            "directories, log level, workload sizes) may also come from a RINGQ_*\n"
            "variable, shown as [env: RINGQ_...] in each command's --help; a value on the\n"
            "command line wins over the variable. Per-invocation choices (a queue's name\n"
            "and settings, --json, --yes, --once, --tui, --detach, --chaos ...) have no variable."
        ),
        formatter_class=Formatter,
        epilog=exits.EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"ringq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"ringq.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("ringq"):
                continue  # not written yet
            raise
        module.register(sub)
    for name in TRACED_COMMANDS:
        if name in sub.choices:
            add_trace(sub.choices[name])
    return parser


def parse_args(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse the command line, then convert the values taken from ``RINGQ_*`` variables.

    :raises ConfigError: a variable the chosen command reads is malformed.
    """
    args = (parser or build_parser()).parse_args(argv)
    resolve_env(args)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parse_args(argv, parser)
    except ConfigError as exc:  # a malformed RINGQ_* variable: named in the message
        scrub_exception(exc, *_given(argv))
        return failed(exc, exits.USAGE)
    func = getattr(args, "func", None)
    if func is None:
        # `ringq` or `ringq db` alone: show the relevant help.
        (getattr(args, "_parser", None) or parser).print_help()
        return exits.USAGE
    apply_trace(args)
    try:
        code = int(func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at exit as a traceback
        return code
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, as Unix tools do, and
        # keep Python from failing again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return exits.BROKEN_PIPE
    except KeyboardInterrupt:
        print("ringq: interrupted", file=sys.stderr)
        return exits.INTERRUPTED
    except RingqError as exc:
        scrub_exception(exc, *_given(argv))
        return failed(exc, exit_code(exc))
    except OSError as exc:  # a file or directory in the way, a device full: one line, no traceback
        where = f": {exc.filename}" if exc.filename else ""
        print(f"ringq: {exc.strerror or exc}{where}", file=sys.stderr)
        return exits.FAILURE


def _given(argv: Sequence[str] | None) -> list[str]:
    """What a DSN of this command may come from: its arguments and the RINGQ_*
    variables. Any text of these that could be a password is hidden from the
    error printed (the engine hides its DSN's already; this also covers a DSN
    given as ``--from DSN:queue``, or one no error of the engine was told)."""
    given = list(sys.argv[1:] if argv is None else argv)
    return given + [v for k, v in os.environ.items() if k.startswith("RINGQ_")]


def exit_code(exc: RingqError) -> int:
    """The exit code ``ringq`` ends with when ``exc`` reaches the top (see :data:`EXIT_CODES`)."""
    return next((code for kind, code in EXIT_CODES if isinstance(exc, kind)), exits.FAILURE)
