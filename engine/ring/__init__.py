"""One queue block's operations: scan, claim bits, waiting entries, cache, finish, load.

Imports only the section and driver layers.
"""
