"""ringq.worker: the container that runs an action for each message.

A queue's messages are commands and an *action* is their body. :class:`Actions`
pairs queues with actions; a :class:`Worker` takes one message at a time and
runs its action inside ONE transaction of its session (the dequeue, the
action's own SQL and what it enqueues commit together or not at all), with
time limits; a :class:`WorkerPool` runs N worker processes, restarts the
ones that die and stops them on SIGTERM (the first drains, a second aborts)::

    from ringq.worker import Actions, Decline, WorkerPool

    app = Actions(timeout=30)

    @app.action("orders")
    def handle(msg, session):
        session.connection.execute("INSERT INTO shipped (id) VALUES (%s)", (msg.seq,))

    with WorkerPool(app, dsn) as pool:
        pool.run()  # until SIGTERM
"""

from ._actions import (
    Action,
    ActionAborted,
    ActionInterrupted,
    Actions,
    ActionTimeout,
    Decline,
    Retry,
    load_actions,
)
from ._async import AsyncWorker
from ._pool import PoolConfig, WorkerExit, WorkerPool
from ._worker import Worker, WorkerConfig

__all__ = [
    "Action",
    "ActionAborted",
    "ActionInterrupted",
    "ActionTimeout",
    "Actions",
    "AsyncWorker",
    "Decline",
    "PoolConfig",
    "Retry",
    "Worker",
    "WorkerConfig",
    "WorkerExit",
    "WorkerPool",
    "load_actions",
]
