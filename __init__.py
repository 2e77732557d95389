"""ringq: transactional message queues inside PostgreSQL.

The client API lives in :mod:`ringq.engine`; the other subpackages build on
it: workers (:mod:`ringq.worker`), moving between databases
(:mod:`ringq.move`), the monitor, queue scripting, the real time viewer, the
regression harness and the ``ringq`` command.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
