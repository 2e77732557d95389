"""Argument helpers: every option may come from a ``RINGQ_*`` variable, shown in ``--help``."""

from __future__ import annotations

import argparse
import os
from typing import Any


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def env_option(
    parser: argparse.ArgumentParser | Any,
    *flags: str,
    env: str,
    default: Any = None,
    type: Any = str,  # noqa: A002 - mirrors argparse
    help: str = "",  # noqa: A002
    **kwargs: Any,
) -> None:
    """Add an option whose default is read from the environment variable ``env``."""
    raw = os.environ.get(env)
    value = default
    if raw is not None and raw != "":
        value = type(raw) if type is not None else raw
    parser.add_argument(
        *flags, default=value, type=type, help=f"{help} [env: {env}]".strip(), **kwargs
    )


def add_dsn(parser: argparse.ArgumentParser) -> None:
    env_option(
        parser,
        "--dsn",
        env="RINGQ_DSN",
        default=None,
        help="PostgreSQL DSN; default: the embedded cluster under $RINGQ_HOME",
    )


def subparser(sub: Any, name: str, help: str, description: str | None = None) -> argparse.ArgumentParser:  # noqa: A002
    from ._exit import EPILOG

    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description or help, formatter_class=Formatter, epilog=EPILOG
    )
    return p
