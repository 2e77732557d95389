"""``ringq section list|remove|prune``: the global sections in this host's shared memory.

A section (``/dev/shm/ringq.<instance id>``, with semaphores
``/dev/shm/sem.ringq.<instance id>.*``) outlives its database; these commands
show them and remove those nobody uses. Removing one is safe for the data (the
rows decide; a database that still exists gets it rebuilt at its next use);
one that a live process holds is never removed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ringq.engine import (
    DatabaseUnavailable,
    SectionError,
    SectionInUse,
    SectionOnHost,
    ServerScan,
    check_dsn,
    database_state,
    exits,
    read_dsn_file,
    redact_dsn,
    remove_section_on_host,
    ringq_home,
    scan_server,
    sections_on_host,
)

from ._args import action, command_group, failed

DESCRIPTION = """\
Every database's global section lives in /dev/shm (memory) until removed:
stopping the server or dropping the database does not free it. 'list' shows
them all, with the database each belongs to where one of the known servers
has it (the DSNs given with --dsn, RINGQ_DSN and the embedded cluster's
$RINGQ_HOME/dsn), the memory each takes and the processes attached to it.
'prune' removes every section that no live process holds and whose database
is gone or does not answer; 'remove ID' one section. A section a live process
holds is never removed; a removed section of a database that still exists is
rebuilt from its rows at its next use."""

DB_HELP = (
    "a server to ask which databases still exist (repeatable); also RINGQ_DSN and "
    "$RINGQ_HOME/dsn"
)


LIST_HELP = """\
One line per section: its instance id, its database's state (live: a known
server has it; dropped: its server answers without it; unknown: no known
server is its own), the DSN where known, the memory it takes, its queues
and the live processes attached."""

REMOVE_HELP = """\
Remove the section of instance ID (as 'ringq section list' shows it) and its
semaphores. Refused while a live process is attached (exit 5); exit 4 when
there is no such section. A database that still exists rebuilds it from
its rows at its next use."""

PRUNE_HELP = """\
Remove every section that no live process holds and whose database is not
live on a known server (dropped, or its server does not answer or is not
known). A section removed by mistake costs a rebuild from the rows, never
data."""

# What 'ringq section --help' says of each action.
ACTIONS = {
    "list": "every ringq section on this host: database, memory, attached processes",
    "remove": "remove one section and its semaphores (exit 5 if a live process holds it)",
    "prune": "remove every section nobody holds whose database is gone or does not answer",
}


def register(sub: Any) -> None:
    what = "the global sections in this host's shared memory"
    actions = command_group(sub, "section", what, DESCRIPTION)
    lst = action(actions, "list", _list, ACTIONS["list"], LIST_HELP)
    lst.add_argument("--dsn", action="append", default=[], help=DB_HELP)
    lst.add_argument("--json", action="store_true", help="print a JSON array instead of a table")
    rm = action(actions, "remove", _remove, ACTIONS["remove"], REMOVE_HELP)
    rm.add_argument("instance_id", metavar="ID", help="the section's instance id")
    prune = action(actions, "prune", _prune, ACTIONS["prune"], PRUNE_HELP)
    prune.add_argument(
        "instance_ids", metavar="ID", nargs="*", help="consider only these sections (default: all)"
    )
    prune.add_argument("--dsn", action="append", default=[], help=DB_HELP)
    prune.add_argument("--dry-run", action="store_true", help="only say what would be removed")


def known_dsns(given: Sequence[str]) -> list[str]:
    """The DSNs to ask: those given, RINGQ_DSN, the embedded cluster's (each once)."""
    out: list[str] = []
    for dsn in given:
        check_dsn(dsn, where="--dsn")
        out.append(dsn)
    env = os.environ.get("RINGQ_DSN")
    if env:
        check_dsn(env, where="RINGQ_DSN")
        out.append(env)
    home = read_dsn_file(ringq_home() / "dsn")
    if home:
        out.append(home)
    return list(dict.fromkeys(out))


def scans(dsns: Sequence[str]) -> list[ServerScan]:
    """What each server that answers tells; a silent one is said on stderr."""
    out = []
    for dsn in dsns:
        try:
            out.append(scan_server(dsn))
        except DatabaseUnavailable as exc:
            print(f"ringq: {redact_dsn(dsn)} does not answer: {exc}", file=sys.stderr)
    return out


def _list(args: argparse.Namespace) -> int:
    found = sections_on_host()
    known = scans(known_dsns(args.dsn))
    rows = [(s, *database_state(s, known)) for s in found]
    if args.json:
        doc = [dict(s.as_dict(), database=state, dsn=dsn) for s, state, dsn in rows]
        print(json.dumps(doc, indent=2))
        return exits.OK
    if not rows:
        print("no ringq global section in /dev/shm")
        return exits.OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"ringq global sections in /dev/shm ({len(rows)})", title_justify="left")
    for col, justify in (("instance id", "left"), ("database", "left"), ("dsn", "left"),
                         ("memory", "right"), ("age", "right"), ("queues", "right"),
                         ("attached pids", "left")):
        table.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for s, state, dsn in rows:
        table.add_row(
            s.instance_id, state, dsn or "unknown", _mib(s.memory), _age(s), str(len(s.queues)),
            ", ".join(map(str, s.pids)) or "-",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    total = sum(s.memory for s in found)
    print(f"{_mib(total)} of memory in all")
    return exits.OK


def _remove(args: argparse.Namespace) -> int:
    try:
        gone = remove_section_on_host(args.instance_id)
    except SectionInUse as exc:
        return failed(exc, exits.CONFLICT)
    except SectionError as exc:
        return failed(exc, exits.NOT_FOUND)
    print(f"removed {gone.name} ({_mib(gone.memory)}) and {len(gone.semaphores)} semaphore(s)")
    return exits.OK


def prunable(found: SectionOnHost, known: Sequence[ServerScan]) -> bool:
    """Nobody holds it, and its database is not live on a known server."""
    return not found.pids and database_state(found, known)[0] != "live"


def _prune(args: argparse.Namespace) -> int:
    known = scans(known_dsns(args.dsn))
    verb = "would remove" if args.dry_run else "removed"
    count = 0
    freed = 0
    only = set(args.instance_ids)
    for s in sections_on_host():
        if only and s.instance_id not in only:
            continue
        state, _ = database_state(s, known)
        if s.pids:
            print(f"kept {s.name}: live process(es) {', '.join(map(str, s.pids))} attached")
            continue
        if state == "live":
            continue
        if not args.dry_run:
            try:
                s = remove_section_on_host(s.instance_id)
            except SectionError as exc:  # attached or removed meanwhile
                print(f"kept {s.name}: {exc}")
                continue
        count += 1
        freed += s.memory
        print(f"{verb} {s.name} ({_mib(s.memory)}, database {state})")
    print(f"{verb} {count} section(s), {_mib(freed)}")
    return exits.OK


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _age(s: SectionOnHost) -> str:
    if not s.created_ns:
        return "-"
    secs = max(0.0, time.time() - s.created_ns / 1e9)
    if secs < 120:
        return f"{secs:.0f} s"
    if secs < 7200:
        return f"{secs / 60:.0f} min"
    if secs < 172800:
        return f"{secs / 3600:.0f} h"
    return f"{secs / 86400:.0f} d"
