"""``ringq queue create|list|show|drop|exceptions|requeue|discard``: queues in
the database named by --dsn.

Queries live in :mod:`ringq.scripting` (its admin functions); this module only renders.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from typing import Any

from ringq.engine import ConfigError, exits, resolve_dsn
from ringq.scripting import (
    ExceptionEntry,
    QueueDetails,
    QueueSummary,
    alter_retry,
    connect_admin,
    create_queue,
    describe_queue,
    discard_exception,
    drop_queue,
    exception_queue_of,
    list_exceptions,
    list_queues,
    requeue_exception,
)

from ._args import action, add_dsn, command_group
from ._spec import add_queue_options, add_retry_options, spec_from_args

DESCRIPTION = """\
Create, list, inspect and drop queues; inspect, requeue and discard their
poison entries. The database is --dsn, else RINGQ_DSN, else the embedded
cluster started by 'ringq db start'."""

EXCEPTIONS_HELP = """\
The queue's poison entries: entries whose deliveries were rolled back
max_deliveries times, moved aside to ringq.exceptions with the reason. If the
queue has an exception queue, each was also put on it as a new entry for its
consumers (the reason says when that was not possible). Columns: SEQ (the
entry's sequence on NAME), DELIVERIES, MOVED (when), SIZE (payload bytes),
REASON. Unknown queue: exit 4."""

REQUEUE_HELP = """\
Put exception entry SEQ back on queue NAME, in one transaction: it leaves
ringq.exceptions and enters the queue's SQL inbox, so it is neither lost nor
doubled. A running monitor moves it into the ring at once (woken by NOTIFY),
as a new entry (new seq, deliveries from 0); until then it counts in the
queue's depth. A copy already put on the exception queue is not touched.
Unknown queue or SEQ: exit 4."""

DISCARD_HELP = """\
Delete exception entry SEQ of queue NAME for good (its payload is lost).
A copy already put on the exception queue is not touched. Unknown queue or
SEQ: exit 4."""


CREATE_HELP = """\
Apply the SQL of 'ringq script create-queue' in one transaction.
Prints 'created', or 'exists (unchanged)' when the queue already exists
with these settings; other settings are refused (exit 5), never altered.
A new queue's --exception-queue must exist (else exit 4) and take payloads
at least as large (else exit 2)."""

SHOW_HELP = """\
Settings, depth, slots by state, inbox and exception counts, and the
table's size and dead row versions. Unknown queue: exit 4."""

DROP_HELP = """\
Drop the queue's table and its rows in ringq.queues, the inbox, the
idempotency keys and the exceptions. Its entries are lost. Asks for
confirmation on a terminal; elsewhere --yes is required. Unknown queue: exit 4."""

# What 'ringq queue --help' says of each action.
ACTIONS = {
    "create": "create a queue (harmless if it exists with the same settings)",
    "list": "one line per queue: capacity, depth, max payload, mode, policy",
    "show": "every setting of a queue and its current figures",
    "drop": "drop a queue with its entries (asks, unless --yes)",
    "exceptions": "list a queue's poison entries (seq, deliveries, reason, when, size)",
    "requeue": "put a poison entry back on its queue",
    "discard": "delete a poison entry for good",
    "alter": "change a queue's retry backoff (--retry-delay, --retry-factor, --retry-max)",
}
ALTER_HELP = """\
Change the retry backoff of queue NAME in place: an entry whose delivery did
not commit is due again --retry-delay * --retry-factor ** (deliveries before)
seconds later, at most --retry-max (0: no cap). Settings not given are kept.
Unknown queue: exit 4."""
LIST_HELP = "One line per queue. depth: committed entries waiting (ring + SQL inbox)."
SEQ_HELP = "the entry's SEQ in 'ringq queue exceptions NAME'"
JSON_TABLE_HELP = "print a JSON array instead of a table"


def register(sub: Any) -> None:
    what = "create, list, show and drop queues; their poison entries"
    actions = command_group(sub, "queue", what, DESCRIPTION)
    create = action(actions, "create", _create, ACTIONS["create"], CREATE_HELP)
    add_queue_options(create)
    lst = action(actions, "list", _list, ACTIONS["list"], LIST_HELP)
    show = action(actions, "show", _show, ACTIONS["show"], SHOW_HELP)
    drop = action(actions, "drop", _drop, ACTIONS["drop"], DROP_HELP)
    exceptions = action(actions, "exceptions", _exceptions, ACTIONS["exceptions"], EXCEPTIONS_HELP)
    requeue = action(actions, "requeue", _requeue, ACTIONS["requeue"], REQUEUE_HELP)
    discard = action(actions, "discard", _discard, ACTIONS["discard"], DISCARD_HELP)
    alter = action(actions, "alter", _alter, ACTIONS["alter"], ALTER_HELP)
    add_retry_options(alter, defaults=False)
    for named in (show, drop, exceptions, requeue, discard, alter):
        named.add_argument("name", metavar="NAME")
    for entry in (requeue, discard):
        entry.add_argument("seq", metavar="SEQ", type=int, help=SEQ_HELP)
    for table in (lst, exceptions):
        table.add_argument("--json", action="store_true", help=JSON_TABLE_HELP)
    show.add_argument("--json", action="store_true", help="print a JSON object instead of text")
    drop.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    for parser in (create, lst, show, drop, exceptions, requeue, discard, alter):
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
    return exits.OK


def _alter(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        alter_retry(conn, args.name, retry_delay=args.retry_delay,
                    retry_factor=args.retry_factor, retry_max=args.retry_max)
    print(f"queue {args.name!r}: retry backoff altered")
    return exits.OK


def _list(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        queues = list_queues(conn)
    if args.json:
        print(json.dumps([dataclasses.asdict(q) for q in queues], indent=2))
    elif not queues:
        print("no queues")
    else:
        print(render_list(queues), end="")
    return exits.OK


def _show(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        details = describe_queue(conn, args.name)  # QueueNotFound -> exit 4 in _main
    if args.json:
        print(json.dumps(dataclasses.asdict(details), indent=2, default=str))
    else:
        print(render_details(details), end="")
    return exits.OK


def _drop(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        details = describe_queue(conn, args.name)  # unknown: exit 4 before asking anything
        if users := exception_queue_of(conn, args.name):
            print(
                f"ringq: queue {args.name!r} is the exception queue of "
                f"{', '.join(map(repr, users))}: "
                "once it is dropped, their poison entries stay in ringq.exceptions only",
                file=sys.stderr,
            )
        if not args.yes:
            if not sys.stdin.isatty():
                raise ConfigError(
                    f"refusing to drop queue {args.name!r} without --yes (stdin is not a terminal)"
                )
            if not _confirm(details):
                print("not dropped")
                return exits.FAILURE
        drop_queue(conn, args.name)
    print(f"dropped queue {args.name!r}")
    return exits.OK


def _exceptions(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        entries = list_exceptions(conn, args.name)  # QueueNotFound -> exit 4 in _main
    if args.json:
        print(json.dumps([dataclasses.asdict(e) for e in entries], indent=2, default=str))
    elif not entries:
        print(f"queue {args.name!r} has no exception entries")
    else:
        print(render_exceptions(entries), end="")
    return exits.OK


def _requeue(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        inbox_id = requeue_exception(conn, args.name, args.seq)  # unknown: exit 4 in _main
    print(
        f"requeued entry {args.seq} on queue {args.name!r} (SQL inbox id {inbox_id}; "
        "the monitor moves it into the ring)"
    )
    return exits.OK


def _discard(args: argparse.Namespace) -> int:
    with connect_admin(resolve_dsn(args.dsn)) as conn:
        discard_exception(conn, args.name, args.seq)  # unknown: exit 4 in _main
    print(f"discarded exception entry {args.seq} of queue {args.name!r}")
    return exits.OK


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
    return _table(_LIST_COLUMNS, _NUMERIC, rows)


_EXC_COLUMNS = ("SEQ", "DELIVERIES", "MOVED", "SIZE", "GROUP", "REASON")
_EXC_NUMERIC = {"SEQ", "DELIVERIES", "SIZE"}


def render_exceptions(entries: Sequence[ExceptionEntry]) -> str:
    """An aligned text table of poison entries, numbers right-aligned, reason last."""
    rows = [
        (
            str(e.seq),
            str(e.deliveries),
            e.moved_at.isoformat(sep=" ", timespec="seconds"),
            "-" if e.size is None else str(e.size),
            "-" if e.group is None else e.group,
            e.reason,
        )
        for e in entries
    ]
    return _table(_EXC_COLUMNS, _EXC_NUMERIC, rows)


def _table(columns: Sequence[str], numeric: set[str], rows: Sequence[Sequence[str]]) -> str:
    """The header line and one line per row, each column as wide as its widest
    cell; the ``numeric`` columns right-aligned, the others left-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(w) if h in numeric else c.ljust(w)
            for c, w, h in zip(cells, widths, columns, strict=True)
        ]
        return "  ".join(parts).rstrip() + "\n"

    return line(columns) + "".join(line(r) for r in rows)


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
        ("lease", f"{d.lease:g} s" if d.lease else "none"),
        ("payload cache", f"{d.cache_payload:,} bytes per slot" if d.cache_payload else "none"),
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
