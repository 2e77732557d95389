"""``ringq worker``: run the actions of a module for the messages of their queues."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from ringq.worker import PoolConfig, WorkerConfig, WorkerExit, WorkerPool

from ._args import add_dsn, env_option, subparser

DESCRIPTION = """\
Run the actions that MODULE[:ATTR] pairs with queues (ATTR defaults to `app`,
a ringq.worker.Actions, or a function returning one), each message in one
transaction: the dequeue, the action's SQL and anything it enqueues commit
together or not at all. An action that raises is rolled back (the message comes
back; after the queue's max_deliveries it moves to ringq.exceptions).

Worker processes each have their own session; one that dies is restarted (with
backoff) after its entries are given back. SIGTERM (or Ctrl-C) stops them: the
first lets messages in flight finish (exit 0), a second aborts them (exit 130).

MODULE is imported from the current directory and PYTHONPATH.
"""


def register(sub: Any) -> None:
    p = subparser(
        sub, "worker", "run the actions of a module for messages of their queues", DESCRIPTION
    )
    p.add_argument(
        "target", metavar="MODULE[:ATTR]", help="the Actions to run, e.g. myapp.tasks:app"
    )
    env_queues = [q for q in os.environ.get("RINGQ_WORKER_QUEUES", "").split(",") if q.strip()]
    p.add_argument(
        "--queue",
        dest="queues",
        action="append",
        default=argparse.SUPPRESS,  # keeps "(default: None)" out of --help
        metavar="NAME",
        help="serve only this queue (repeatable); default: every queue of the actions "
        "[env: RINGQ_WORKER_QUEUES, comma-separated]",
    )
    p.set_defaults(env_queues=[q.strip() for q in env_queues])
    env_option(
        p,
        "--processes",
        "-p",
        env="RINGQ_WORKER_PROCESSES",
        default=1,
        type=int,
        help="worker processes (on a single-dequeuer queue only one handles messages at a time)",
    )
    env_option(
        p,
        "--concurrency",
        "-c",
        env="RINGQ_WORKER_CONCURRENCY",
        default=0,
        type=int,
        help="consumer coroutines per worker process, one event loop, each message its own "
        "transaction (async actions are awaited, sync ones run in threads); 0: one "
        "sync consumer per process",
    )
    env_option(
        p,
        "--start-method",
        env="RINGQ_WORKER_START_METHOD",
        default="fork",
        choices=["spawn", "fork", "forkserver"],
        help="how worker processes are started",
    )
    env_option(
        p,
        "--idle-wait",
        env="RINGQ_WORKER_IDLE_WAIT",
        default=0.25,
        type=float,
        help="seconds an idle worker sleeps on a queue before re-checking its stop flag",
    )
    env_option(
        p,
        "--log-level",
        env="RINGQ_LOG_LEVEL",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level (stderr)",
    )
    add_dsn(p)
    p.set_defaults(func=run, _parser=p)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Like `python -m`, import the actions module from the current directory.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    queues = tuple(getattr(args, "queues", None) or args.env_queues)
    config = PoolConfig(
        processes=args.processes,
        start_method=args.start_method,
        worker=WorkerConfig(queues=queues, idle_wait=args.idle_wait,
                            concurrency=args.concurrency),
    )
    pool = WorkerPool(args.target, args.dsn, config=config)
    try:
        code = pool.run()
    finally:
        pool.close()
        stats = pool.stats()
        logging.getLogger("ringq.worker").info(
            "ringq worker: stopped: %s", " ".join(f"{k}={v}" for k, v in stats.items())
        )
    return int(WorkerExit(code))
