"""The layout of the global section, public: its limits (``MAX_QUEUES``,
``SLOT_POOL`` ...) and the index of every word of its header, queue blocks and
client entries, as the monitor, the regression harness and tests read them::

    from ringq.engine import layout as L

    depth = section.q(qidx, L.Q_DEPTH_HINT)

The definitions (and their comments) are in ``ringq/engine/section/_layout.py``.
"""

from __future__ import annotations

from .section.layout import *  # noqa: F403 - every public name of the layout, nothing else
