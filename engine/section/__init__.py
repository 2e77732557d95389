"""The global section in shared memory: layout, client table, counters, attachment, segments.

Imports only the driver layer.
"""
