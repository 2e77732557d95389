"""The driver boundary: connections, the wire, SQL files, error conversion, DSNs, queue names.

The engine's bottom layer: it imports no other layer.
"""
