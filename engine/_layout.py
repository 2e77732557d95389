"""Layout constants of the global section (shared memory)."""

from __future__ import annotations

LAYOUT_VERSION = 1
MAGIC = 0x52494E47_51534543  # "RINGQSEC"

MAX_QUEUES = 128
MAX_CLIENTS = 1024
SLOT_POOL = 1 << 23  # slots across all queues in one section (8,388,608)
MAX_CAPACITY = 1 << 22  # slots in one queue (4,194,304)
