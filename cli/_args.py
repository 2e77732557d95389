"""Argument helpers: options that may also come from a ``RINGQ_*`` variable.

Such an option shows its variable in ``--help`` (``[env: RINGQ_X]``). A value
on the command line wins over the variable, which wins over the default.

A variable's text is converted (and checked against the option's choices)
only when the command that has the option runs, by :func:`resolve_env`: a
malformed ``RINGQ_MOVE_BATCH`` is a usage error naming the variable for
``ringq move``, and does not concern ``ringq db status``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ringq.engine import ConfigError, redact_dsn

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


class Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class EnvValue:
    """The unconverted text of a ``RINGQ_*`` variable, as an option's default.

    argparse leaves a non-string default alone; :func:`resolve_env` converts it
    after parsing, so that a bad value is reported against its variable.
    """

    env: str
    raw: str
    flag: str
    convert: Callable[[str], Any] | None
    choices: Sequence[Any] | None

    def __str__(self) -> str:  # what --help shows as the default; no secrets
        if "TOKEN" in self.env or "PASSWORD" in self.env:
            shown = "***"
        elif "DSN" in self.env:
            shown = redact_dsn(self.raw)
        else:
            shown = self.raw
        return f"{shown}, from {self.env}"

    def __repr__(self) -> str:
        return f"EnvValue({self.env}={self.raw!r})"

    def value(self) -> Any:
        """The converted value.

        :raises ConfigError: the text does not convert, or is not one of the choices
            (the message names the variable and the option).
        """
        where = f"environment variable {self.env}={self.raw!r} (for {self.flag})"
        try:
            value = self.convert(self.raw) if self.convert is not None else self.raw
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError):
            what = getattr(self.convert, "__name__", repr(self.convert))
            raise ConfigError(f"{where}: not a valid {what} value") from None
        if self.choices is not None and value not in self.choices:
            allowed = ", ".join(repr(c) for c in self.choices)
            raise ConfigError(f"{where}: must be one of {allowed}")
        return value


def env_option(
    parser: argparse.ArgumentParser | Any,
    *flags: str,
    env: str,
    default: Any = None,
    type: Any = str,
    help: str = "",
    **kwargs: Any,
) -> None:
    """Add an option whose default is read from the environment variable ``env``.

    The variable is read now and converted by :func:`resolve_env` after
    parsing, only for the command that runs; an empty variable counts as unset.
    """
    raw = os.environ.get(env)
    value = default
    if raw is not None and raw != "":
        flag = next((f for f in flags if f.startswith("--")), flags[0])
        value = EnvValue(env, raw, flag, type, kwargs.get("choices"))
    parser.add_argument(
        *flags, default=value, type=type, help=f"{help} [env: {env}]".strip(), **kwargs
    )


def add_cycle_options(
    p: argparse.ArgumentParser, env_prefix: str, *, entries: int, capacity: int
) -> None:
    """The regression cycle's shape, as ``ringq regress`` and ``ringq run`` (which
    passes them on to it) take it; each option's variable is ``env_prefix`` +
    its name (``RINGQ_RUN_`` + ``ENTRIES``)."""
    env_option(p, "--cycles", env=f"{env_prefix}CYCLES", default=1, type=int,
               help="cycles to run; 0 = until stopped (SIGINT/SIGTERM)")
    env_option(p, "--entries-per-queue", env=f"{env_prefix}ENTRIES", default=entries, type=int,
               help="committed entries per queue per cycle")
    env_option(p, "--capacity", env=f"{env_prefix}CAPACITY", default=capacity, type=int,
               help="slots per queue")
    env_option(p, "--payload-sizes", env=f"{env_prefix}PAYLOAD_SIZES",
               default="16,200,2000,20000,200000",
               help="one queue per size, in bytes (k = 1000, m = 1000000; at least 16)")
    env_option(p, "--grouped-consumers", env=f"{env_prefix}GROUPED_CONSUMERS", default=3,
               type=int, help="consumer processes of the grouped queue (0: no grouped queue)")
    env_option(p, "--groups", env=f"{env_prefix}GROUPS", default=50, type=int,
               help="groups the grouped queue's entries are spread over (at random)")


def resolve_env(args: argparse.Namespace) -> None:
    """Replace every variable-supplied default in ``args`` by its converted value.

    :raises ConfigError: a variable's value is malformed (the message names it).
    """
    for name, value in vars(args).items():
        if isinstance(value, EnvValue):
            setattr(args, name, value.value())


def dataclass_from_args(cls: type[D], args: argparse.Namespace, **given: Any) -> D:
    """Settings ``cls`` (a dataclass, which checks its values): each field
    from the parsed option of its name, ``given`` the fields computed apart;
    a field with neither (no such option, or one not given whose default is
    ``argparse.SUPPRESS``) keeps the dataclass's default."""
    options = vars(args)
    named = {f.name: options[f.name] for f in dataclasses.fields(cls) if f.name in options}
    return cls(**{**named, **given})


def add_dsn(parser: argparse.ArgumentParser) -> None:
    env_option(
        parser,
        "--dsn",
        env="RINGQ_DSN",
        default=None,
        help="PostgreSQL DSN; default: the embedded cluster under $RINGQ_HOME",
    )


def add_trace(parser: argparse.ArgumentParser) -> None:
    """``--trace``: for the commands that run sessions (see :func:`apply_trace`)."""
    parser.add_argument(
        "--trace",
        action="store_true",
        help="log every queue operation (enqueue, dequeue, commit, rollback, flush, prepare, "
        "recovery decision) on one line each, on the ringq.trace logger; to stderr, or to "
        "the file RINGQ_TRACE_FILE names; child processes too [env: RINGQ_TRACE=1]",
    )


def apply_trace(args: argparse.Namespace) -> None:
    """Turn the engine's trace on for ``--trace``: in this process, and (by
    ``RINGQ_TRACE``, read by the engine at import) in the processes it starts."""
    if getattr(args, "trace", False):
        from ringq.engine import enable_trace

        os.environ["RINGQ_TRACE"] = "1"
        enable_trace()


def subparser(
    sub: Any, name: str, help: str, description: str | None = None
) -> argparse.ArgumentParser:
    from ringq.engine.exits import EPILOG

    p: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=description or help, formatter_class=Formatter, epilog=EPILOG
    )
    return p


def command_group(sub: Any, name: str, help: str, description: str | None = None) -> Any:
    """A command made of actions (``ringq NAME ACTION``); ``ringq NAME`` alone prints its help.

    Returns the subparsers to add the actions to (with :func:`action`).
    """
    group = subparser(sub, name, help, description)
    group.set_defaults(_parser=group)
    return group.add_subparsers(dest=f"{name}_command", metavar="ACTION")


def action(
    actions: Any,
    name: str,
    func: Callable[[argparse.Namespace], int],
    help: str,
    description: str | None = None,
) -> argparse.ArgumentParser:
    """An action of a :func:`command_group` that runs ``func`` (its exit code is the command's)."""
    p = subparser(actions, name, help, description)
    p.set_defaults(func=func)
    return p


def failed(exc: BaseException, code: int) -> int:
    """Say ``exc`` on stderr as ``ringq: <message>`` and return the exit code ``code``."""
    print(f"ringq: {exc}", file=sys.stderr)
    return code
