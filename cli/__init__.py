"""The ``ringq`` command line (entry point :func:`main`)."""

from ._main import main

__all__ = ["main"]
