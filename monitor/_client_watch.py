"""Step ``clients``: log each client whose error counter rose since the last pass."""

from __future__ import annotations

import logging
from collections.abc import Callable

from . import _clients as C
from ._section import Attachment
from ._step import Note


class WatchClients:
    """Step ``clients``: one JSON record per client per pass (several errors in
    one pass are coalesced: ``count`` says how many, the record describes the
    last). ``queue_names`` gives the queue list's names (id -> name)."""

    def __init__(
        self, attachment: Attachment, note: Note, queue_names: Callable[[], dict[int, str]]
    ) -> None:
        self._attachment = attachment
        self._note = note
        self._queue_names = queue_names
        self.errors = C.ErrorWatch()
        self.by_kind: dict[str, int] = {}  # errors of clients logged, by kind

    def restart(self) -> None:
        """Take the clients' error counters as they are now: errors from before
        (a predecessor logged them) are not news, errors from after are."""
        self.errors = C.ErrorWatch()
        self._attachment.read(lambda sec: self.errors.scan(C.read_clients(sec)))

    def run(self) -> None:
        sec = self._attachment.current()
        for news in self.errors.scan(C.read_clients(sec)):
            raw = news.raw
            self.by_kind[news.kind] = self.by_kind.get(news.kind, 0) + news.count
            self._note(
                "client.error",
                logging.WARNING,
                pid=raw.pid,
                backend_pid=raw.backend_pid,
                role=raw.role,
                queue=C.queue_name_of(sec, news.qid, self._queue_names()),
                queue_id=news.qid or None,
                seq=news.seq,
                kind=news.kind,
                count=news.count,
                errors=news.total,
                at=round(news.t, 6),
            )
