"""``ringq queue create|list|show|drop``: queues in the database named by --dsn.

Queries live in :mod:`ringq.scripting._admin`; this module only renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ringq.engine import ConfigError, resolve_dsn
from ringq.scripting._admin import (
    QueueDetails,
    QueueSummary,
    connect_admin,
    describe_queue,
    list_queues,
)
from ringq.scripting._ddl import create_queue, drop_queue

from . import _exit
from ._args import add_dsn, subparser
from ._spec import add_queue_options, spec_from_args

DESCRIPTION = """\
Create, list, inspect and drop queues. The database is --dsn, else RINGQ_DSN,
else the embedded cluster started by 'ringq db start'."""


def register(sub: Any) -> None:
    queue = subparser(sub, "queue", "create, list, show and drop queues", DESCRIPTION)
    queue.set_defaults(_parser=queue)
    actions = queue.add_subparsers(dest="queue_command", metavar="ACTION")

    create = subparser(
        actions,
        "create",
        "create a queue (harmless if it exists with the same settings)",
        "Apply the SQL of 'ringq script create-queue' in one transaction.\n"
        "Prints 'created', or 'exists (unchanged)' when the queue already exists\n"
        "with these settings; other settings are refused (exit 5), never altered.",
    )
    add_queue_options(create)
    create.set_defaults(func=_create)

    lst = subparser(
        actions,
        "list",
        "one line per queue: capacity, depth, max payload, mode, policy",
        "One line per queue. depth: committed entries waiting (ring + SQL inbox).",
    )
    lst.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    lst.set_defaults(func=_list)

    show = subparser(
        actions,
        "show",
        "every setting of a queue and its current figures",
        "Settings, depth, slots by state, inbox and exception counts, and the\n"
        "table's size and dead row versions. Unknown queue: exit 4.",
    )
    show.add_argument("name", metavar="NAME")
    show.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    show.set_defaults(func=_show)

    drop = subparser(
        actions,
        "drop",
        "drop a queue with its entries (asks, unless --yes)",
        "Drop the queue's table and its rows in ringq.queues, the inbox, the\n"
        "idempotency keys and the exceptions. Its entries are lost. Asks for\n"
        "confirmation on a terminal; elsewhere --yes is required. Unknown queue: exit 4.",
    )
    drop.add_argument("name", metavar="NAME")
    drop.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    drop.set_defaults(func=_drop)

    for parser in (create, lst, show, drop):
        add_dsn(parser)


def _create(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)  # validate before connecting: bad input is exit 2, not 3
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        created = create_queue(conn, spec)  # QueueExists -> exit 5 in _main
    if created:
        print(
            f"created queue {spec.name!r}: {spec.capacity:,} slots, "
            f"max payload {spec.max_payload:,} bytes"
        )
    else:
        print(f"queue {spec.name!r} exists (unchanged)")
    return _exit.OK


def _list(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        queues = list_queues(conn)
    if args.json:
        print(json.dumps([dataclasses.asdict(q) for q in queues], indent=2))
    elif not queues:
        print("no queues")
    else:
        print(render_list(queues), end="")
    return _exit.OK


def _show(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        details = describe_queue(conn, args.name)  # QueueNotFound -> exit 4 in _main
    if args.json:
        print(json.dumps(dataclasses.asdict(details), indent=2, default=str))
    else:
        print(render_details(details), end="")
    return _exit.OK


def _drop(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        details = describe_queue(conn, args.name)  # unknown: exit 4 before asking anything
        if not args.yes:
            if not sys.stdin.isatty():
                raise ConfigError(
                    f"refusing to drop queue {args.name!r} without --yes (stdin is not a terminal)"
                )
            if not _confirm(details):
                print("not dropped")
                return _exit.FAILURE
        drop_queue(conn, args.name)
    print(f"dropped queue {args.name!r}")
    return _exit.OK


def _confirm(details: QueueDetails) -> bool:
    prompt = (
        f"drop queue {details.name!r} with {details.depth:,} waiting entries "
        f"and {details.exceptions:,} exceptions? [y/N] "
    )
    try:
        answer = input(prompt)
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


# Rendering -----------------------------------------------------------------

_LIST_COLUMNS = ("NAME", "CAPACITY", "DEPTH", "MAX PAYLOAD", "MODE", "POLICY")
_NUMERIC = {"CAPACITY", "DEPTH", "MAX PAYLOAD"}


def render_list(queues: Sequence[QueueSummary]) -> str:
    """An aligned text table, numbers right-aligned, one line per queue."""
    rows = [
        (q.name, str(q.capacity), str(q.depth), str(q.max_payload), q.dequeue_mode, q.full_policy)
        for q in queues
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(_LIST_COLUMNS)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if h in _NUMERIC else c.ljust(w)
            for c, w, h in zip(cells, widths, _LIST_COLUMNS, strict=True)
        ]
        return "  ".join(parts).rstrip() + "\n"

    return line(_LIST_COLUMNS) + "".join(line(r) for r in rows)


def render_details(d: QueueDetails) -> str:
    """``key  value`` lines: settings first, then the figures of this moment."""
    pairs = [
        ("name", d.name),
        ("id", str(d.id)),
        ("created", d.created_at.isoformat(timespec="seconds")),
        ("capacity", f"{d.capacity:,} slots"),
        ("max payload", f"{d.max_payload:,} bytes"),
        ("dequeue mode", d.dequeue_mode),
        ("full policy", d.full_policy),
        ("full timeout", f"{d.full_timeout:g} s"),
        ("max deliveries", str(d.max_deliveries)),
        ("exception queue", d.exception_queue or "-"),
        ("fillfactor", str(d.fillfactor)),
        ("tablespace", d.tablespace or "(database default)"),
        ("depth", f"{d.depth:,} (ring {d.queued:,} + inbox {d.inbox:,})"),
        ("inbox", f"{d.inbox:,}"),
        ("exceptions", f"{d.exceptions:,}"),
        ("slots", f"{d.free:,} free, {d.queued:,} queued, {d.consumed:,} consumed"),
        ("table size", f"{d.table_bytes:,} bytes"),
        ("dead rows", f"{d.dead_rows:,} (statistics; grows while old snapshots block pruning)"),
    ]
    width = max(len(k) for k, _ in pairs)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in pairs)
