"""Exit codes of ringq's processes: the ``ringq`` command, worker processes,
the regression harness's child monitor. One definition, named; ``ringq --help``
shows :data:`EPILOG`.
"""

from __future__ import annotations

from typing import Final

OK: Final = 0
FAILURE: Final = 1  # an operation failed (verification found violations, a check failed)
USAGE: Final = 2  # bad arguments (argparse uses 2 as well)
DB_UNAVAILABLE: Final = 3  # the database cannot be reached
NOT_FOUND: Final = 4  # the named queue (or run, or entry) does not exist
CONFLICT: Final = 5  # it exists with different settings (or another process holds it)
INTERRUPTED: Final = 130  # stopped by SIGINT/SIGTERM before finishing
# the reader of stdout went away (`ringq db status | head -1`): 128 + SIGPIPE, as a shell reports
BROKEN_PIPE: Final = 141

EPILOG: Final = (
    "exit codes: 0 ok, 1 failure, 2 usage, 3 database unavailable, 4 not found, "
    "5 conflicting settings, 130 interrupted, 141 output closed by its reader"
)
