"""``ringq script create-queue``: print the SQL a DBA reviews and applies with psql."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ringq.engine import exits
from ringq.scripting import create_queue_script

from ._args import action, command_group
from ._spec import add_queue_options, spec_from_args

DESCRIPTION = """\
Print SQL for review; no database is needed. The script is one transaction and
idempotent: applying it again changes nothing, and applying it where the queue
exists with other settings fails without changing anything."""


CREATE_QUEUE_HELP = """\
Print the management schema (created if absent, versioned) and the queue:
its row in ringq.queues and its ring table with exactly --capacity rows.

  ringq script create-queue orders --capacity 1000 --max-payload 512 \\
      | psql "$DSN" -v ON_ERROR_STOP=1"""


def register(sub: Any) -> None:
    what = "print SQL scripts to review and apply with psql"
    actions = command_group(sub, "script", what, DESCRIPTION)
    one_queue = "the schema (if absent) and one queue: its row, its pre-filled table"
    create = action(actions, "create-queue", _create_queue, one_queue, CREATE_QUEUE_HELP)
    add_queue_options(create)


def _create_queue(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)  # ConfigError -> exit 2 in _main
    sys.stdout.write(create_queue_script(spec))
    return exits.OK
