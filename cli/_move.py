"""``ringq move --from DSN1:outbox --to DSN2:inbox``: the mover between two databases."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from types import FrameType
from typing import Any

from ringq.engine import ConfigError, exits, redact_dsn, validate_queue_name
from ringq.move import (
    MoveConfig,
    MoveIntoItself,
    MoveLockHeld,
    Mover,
    MoveSourceShared,
    MoveWontFit,
)

from ._args import env_option, subparser

# Exit codes of `ringq move` (the shared values of `ringq --help`).
RET_OK = exits.OK
RET_SOURCE_SHARED = exits.CONFLICT  # the source queue is in 'shared' dequeue mode
RET_LOCK_HELD = exits.CONFLICT  # --once: another mover is active for the source queue

DESCRIPTION = """\
Move every entry of a queue in database 1 to a queue in database 2, without
two-phase commit: each batch is enqueued and committed in database 2 first,
then its dequeue is committed in database 1. The enqueue is idempotent by the
entry's identity (source database, queue, sequence and enqueue time), so
a mover killed between the two commits and started again delivers nothing
twice.

Several movers may run for one source queue: one moves (it holds an advisory
lock in database 1), the others stand by and take over when it dies.

The source queue must be in 'single' dequeue mode (the default): with
'shared', a mover taking over from a dead one would read past the entries
the dead one held, breaking per-producer order, and could move them twice.
A shared source is refused with exit 5.

Moved payloads carry an envelope with the origin and the original producer
and sequence (ringq.move.unwrap() opens it): about 150 bytes more than the
payload, at most about 300 (queue names of 63, producer names of 64
characters; ringq.move.envelope_overhead() tells exactly). The destination's
max_payload must be at least the source's plus that (the source's alone with
--bare, which moves payloads as they are): a smaller one is refused at start
with exit 5, before anything moves. A queue moved into itself is refused
(exit 2).

Give the source queue a roomy max_deliveries: each crash or failed batch
counts a delivery on the entries in hand.

A queue is named as DSN:queue (the text after the last ':' is the queue), or
as a bare queue name on the database of --dsn / RINGQ_DSN / the embedded
cluster. SIGTERM or SIGINT: finish the batch in hand, give up the lock, exit 0;
a second one exits at once (what was in hand is redelivered and skipped by key).
"""


def register(sub: Any) -> None:
    p = subparser(sub, "move", "move a queue's entries to a queue in another database", DESCRIPTION)
    env_option(p, "--from", dest="source", env="RINGQ_MOVE_FROM", required=False,
               help="source, DSN:queue (or a queue on the default database)")
    env_option(p, "--to", dest="target", env="RINGQ_MOVE_TO", required=False,
               help="destination, DSN:queue (or a queue on the default database)")
    env_option(p, "--dsn", env="RINGQ_DSN", default=None,
               help="database of a side named without a DSN; default: the embedded cluster")
    env_option(p, "--batch", env="RINGQ_MOVE_BATCH", type=int, default=MoveConfig.batch,
               help="entries per move (one commit in each database)")
    env_option(
        p,
        "--standby-poll",
        env="RINGQ_MOVE_STANDBY_POLL",
        type=float,
        default=MoveConfig.standby_poll,
        help="seconds between a standby's tries at the lock",
    )
    p.add_argument("--bare", action="store_true",
                   help="move payloads as they are (no envelope with origin and producer)")
    p.add_argument("--once", action="store_true",
                   help="move what is there, then exit (exit 5 if another mover is active)")
    p.set_defaults(func=_run)


def split_target(text: str | None, default_dsn: str | None, what: str) -> tuple[str | None, str]:
    """``DSN:queue`` -> (DSN, queue); a bare queue name -> (default_dsn, queue).

    :raises ConfigError: no queue name can be read from ``text``.
    """
    if not text:
        raise ConfigError(f"--{what} is required (DSN:queue)")
    dsn, sep, queue = text.rpartition(":")
    if not sep:
        return default_dsn, validate_queue_name(text)
    try:
        return dsn, validate_queue_name(queue)
    except ConfigError:
        raise ConfigError(
            f"--{what} {redact_dsn(text)!r}: expected DSN:queue, the queue name after the last ':'"
        ) from None


def _run(args: argparse.Namespace) -> int:
    src_dsn, src_q = split_target(args.source, args.dsn, "from")
    dst_dsn, dst_q = split_target(args.target, args.dsn, "to")
    cfg = MoveConfig(batch=args.batch, standby_poll=args.standby_poll, envelope=not args.bare)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        stream=sys.stderr)
    mover = Mover(src_dsn, src_q, dst_dsn, dst_q, config=cfg)
    try:
        mover.open()  # a wrong DSN or queue name fails now, with its exit code
    except MoveIntoItself as exc:
        mover.close()
        print(f"ringq move: {exc}", file=sys.stderr)
        return exits.USAGE
    except MoveWontFit as exc:
        mover.close()
        print(f"ringq move: {exc}", file=sys.stderr)
        return exits.CONFLICT
    except MoveSourceShared as exc:
        mover.close()
        print(f"ringq move: {exc}; recreate the source queue with --dequeue-mode single "
              "(the default) to move from it", file=sys.stderr)
        return RET_SOURCE_SHARED
    if args.once:
        return _once(mover)
    stop = threading.Event()
    previous: dict[int, Any] = {}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        # Only set the flag; the next signal gets the previous handler (exit now).
        stop.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, on_signal)
    print(f"ringq move: {src_q} -> {dst_q} (batch {cfg.batch}); SIGTERM stops", flush=True)
    try:
        mover.run(stop)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    _print_stats(mover)
    return RET_OK


def _once(mover: Mover) -> int:
    with mover:
        try:
            while mover.move_batch():
                pass
        except MoveLockHeld as exc:
            print(f"ringq move: {exc}", file=sys.stderr)
            return RET_LOCK_HELD
    _print_stats(mover)
    return RET_OK


def _print_stats(mover: Mover) -> None:
    stats = mover.get_stats()
    print("ringq move: " + ", ".join(f"{k} {v}" for k, v in stats.items()), flush=True)
