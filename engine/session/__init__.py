"""The public API: Session over its link, transaction, claims, reservations, 2PC, trace.

Imports only the rows, ring, section and driver layers (not the SQL agent beside it).
"""
