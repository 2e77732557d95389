"""Step ``reclaim``: take back the slots of every queue whose entries were
consumed, and let the inbox pump try at once a full queue that has room again."""

from __future__ import annotations

from ringq.engine.recovery import queue_room, reclaim_all

from ._pump import Inbox
from ._section import Attachment


class Reclaim:
    """Step ``reclaim``."""

    def __init__(self, attachment: Attachment, inbox: Inbox) -> None:
        self._attachment = attachment
        self._inbox = inbox

    def run(self) -> None:
        sec = self._attachment.current()
        reclaim_all(sec)
        for name, qid in list(self._inbox.full.items()):
            room = queue_room(sec, qid)
            if room is None or room > 0:  # consumed (or dropped): its inbox entries can move now
                del self._inbox.full[name]
                self._inbox.due = True
