-- SQL of the worker (ringq.worker), loaded once by worker/_queries.py.

-- statement_timeout --
-- The session's own setting, restored between actions that set their own.
SELECT current_setting('statement_timeout')

-- set_statement_timeout --
-- Not local to the transaction (false): it stays until set again, but a
-- rolled-back transaction reverts it, as SET does.
SELECT set_config('statement_timeout', %s, false)
