"""Exit codes of the ``ringq`` command (named, documented in ``ringq --help``)."""

OK = 0
FAILURE = 1  # an operation failed (verification found violations, a check failed)
USAGE = 2  # bad arguments (argparse uses 2 as well)
DB_UNAVAILABLE = 3  # the database cannot be reached
NOT_FOUND = 4  # the named queue (or run, or entry) does not exist
CONFLICT = 5  # it exists with different settings
INTERRUPTED = 130  # stopped by SIGINT/SIGTERM before finishing
BROKEN_PIPE = 141  # the reader of stdout went away (`ringq db status | head -1`): 128 + SIGPIPE, as a shell reports

EPILOG = (
    "exit codes: 0 ok, 1 failure, 2 usage, 3 database unavailable, 4 not found, "
    "5 conflicting settings, 130 interrupted, 141 output closed by its reader"
)
