"""The ``ringq`` command line (entry point :func:`main`; :func:`build_parser`
and :func:`parse_args` give the parsed namespace without running a command)."""

from ._main import build_parser, main, parse_args

__all__ = ["build_parser", "main", "parse_args"]
