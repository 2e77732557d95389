"""Actions: the body of a queue's messages, and how a worker's run of one ends.

:class:`Actions` pairs each queue with its action, a function
``func(msg, session)`` run inside the worker's transaction for the message;
:func:`load_actions` imports one from ``MODULE[:ATTR]``. An action returns
``None`` or a :class:`Decline` (both commit), or raises (rolled back; a
:class:`Retry` says when the message is due again); the
worker interrupts it with an :class:`ActionInterrupted` (a time limit, a
second stop request).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ringq.engine import (
    MAX_DELAY,
    AsyncSession,
    ConfigError,
    Message,
    Session,
    is_finite_number,
    validate_queue_name,
)

# -- outcomes -----------------------------------------------------------------------------


class ActionInterrupted(KeyboardInterrupt):
    """An action was interrupted by the worker; its transaction is rolled back.

    Derives from ``KeyboardInterrupt`` on purpose: psycopg cancels a running
    query on it (leaving the connection usable), and ``except Exception`` in an
    action does not swallow it.
    """


class ActionTimeout(ActionInterrupted):
    """The action ran past its time limit (``timeout`` seconds)."""


class ActionAborted(ActionInterrupted):
    """A second stop request (the second SIGTERM) aborted the action."""


class Retry(Exception):  # a request, not an error: read as "raise Retry(after=5)"
    """Raise this from an action to roll back and have the message delivered
    again no sooner than ``after`` seconds from now (the database's clock),
    whatever the queue's retry backoff says. The delivery counts (at the
    queue's max_deliveries the entry moves to ringq.exceptions as any).

    :raises ConfigError: ``after`` is not a finite number of seconds >= 0.
    """

    def __init__(self, after: float, reason: str = "") -> None:
        if not is_finite_number(after) or not 0 <= after <= MAX_DELAY:
            raise ConfigError(
                f"Retry(after=) must be a number of seconds from 0 to {MAX_DELAY:g}, "
                f"not {after!r}"
            )
        super().__init__(reason or f"retry after {after:g}s")
        self.after = float(after)


@dataclass(frozen=True)
class Decline:
    """Return this from an action to decline the request: the transaction COMMITS.

    Declining is a successful outcome (insufficient funds, an order already
    cancelled): the message is consumed, whatever the action wrote stays, and
    ``reply`` is enqueued on ``reply_to`` in the same transaction (an empty
    payload if only ``reply_to`` is given).
    Returning ``None`` after enqueueing a reply yourself is equivalent; a
    Decline is counted apart (``declined``) and logged at INFO.
    """

    reason: str = ""
    reply_to: str | None = None
    reply: bytes | None = None

    def __post_init__(self) -> None:
        if self.reply is not None and self.reply_to is None:
            raise ConfigError("Decline(reply=...) needs reply_to (the queue to put the reply on)")
        if self.reply_to is not None:
            validate_queue_name(self.reply_to)


# a sync action gets the Session; an async one (``async def``, run by the
# AsyncWorker: ``ringq worker --concurrency N``) gets an AsyncSession
ActionFunc = (
    Callable[[Message, Session], "Decline | None"]
    | Callable[[Message, AsyncSession], "Awaitable[Decline | None]"]
)
F = TypeVar("F", bound=Callable[..., Any])
_UNSET: Any = object()


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not is_finite_number(timeout) or timeout <= 0:
        raise ConfigError(f"timeout must be a positive number of seconds or None, not {timeout!r}")
    return float(timeout)


@dataclass(frozen=True)
class Action:
    """One queue paired with the function that handles its messages."""

    queue: str
    func: ActionFunc
    timeout: float | None = None  # seconds; None: no limit

    @property
    def name(self) -> str:
        mod = getattr(self.func, "__module__", "?")
        return f"{mod}.{getattr(self.func, '__qualname__', repr(self.func))}"


class Actions:
    """A registry pairing each queue with its action (one action per queue).

    >>> app = Actions(timeout=30)
    >>> @app.action("orders")
    ... def handle(msg: Message, session: Session) -> Decline | None:
    ...     session.connection.execute("INSERT INTO ...", (...))
    ...     session.enqueue("invoices", msg.payload)   # chained: commits with it

    ``timeout`` is the default time limit in seconds (None: none); each action
    may set its own.
    """

    def __init__(self, *, timeout: float | None = None) -> None:
        self.timeout = _check_timeout(timeout)
        self._actions: dict[str, Action] = {}

    def action(self, queue: str, *, timeout: float | None = _UNSET) -> Callable[[F], F]:
        """Decorator: ``func(msg, session)`` handles the messages of ``queue``.

        :raises InvalidQueueName: bad queue name. :raises ConfigError: the queue
            already has an action, or a bad timeout.
        """

        def register(func: F) -> F:
            self.add(queue, func, timeout=timeout)
            return func

        return register

    def add(self, queue: str, func: ActionFunc, *, timeout: float | None = _UNSET) -> Action:
        """Pair ``queue`` with ``func`` (the non-decorator form of :meth:`action`)."""
        validate_queue_name(queue)
        if queue in self._actions:
            raise ConfigError(
                f"queue {queue!r} already has an action ({self._actions[queue].name})"
            )
        if not callable(func):
            raise ConfigError(f"the action for {queue!r} is not callable: {func!r}")
        limit = self.timeout if timeout is _UNSET else _check_timeout(timeout)
        act = Action(queue, func, limit)
        self._actions[queue] = act
        return act

    @property
    def queues(self) -> list[str]:
        return list(self._actions)

    def __getitem__(self, queue: str) -> Action:
        return self._actions[queue]

    def __contains__(self, queue: object) -> bool:
        return queue in self._actions

    def __iter__(self) -> Iterator[Action]:
        return iter(self._actions.values())

    def __len__(self) -> int:
        return len(self._actions)

    def __repr__(self) -> str:
        return f"Actions({', '.join(self._actions)})"


def load_actions(spec: str) -> Actions:
    """Import ``MODULE[:ATTR]`` (ATTR defaults to ``app``): an :class:`Actions`, or a
    callable without arguments returning one.

    :raises ConfigError: the module cannot be imported or ATTR is not Actions.
    """
    module_name, _, attr = spec.partition(":")
    attr = attr or "app"
    if not module_name:
        raise ConfigError(f"bad actions {spec!r}: expected MODULE[:ATTR]")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import actions module {module_name!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from exc
    if not isinstance(obj, Actions) and callable(obj):
        obj = obj()
    if not isinstance(obj, Actions):
        raise ConfigError(f"{spec!r} is {type(obj).__name__}, not ringq.worker.Actions")
    if not obj:
        raise ConfigError(f"{spec!r} has no actions")
    return obj
