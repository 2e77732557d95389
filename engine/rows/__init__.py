"""Deciding from the rows what the section cannot: recovery, in-doubt outcomes, leases.

Imports only the ring, section and driver layers.
"""
