"""The SQL agent, beside the session: acting in the section for SQL clients.

Sets ready entries aside for ``ringq.dequeue`` and decides them from the rows. Imports
only the rows, ring, section and driver layers (not the session).
"""
