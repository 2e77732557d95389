"""Following a fail-over: step ``section`` rebuilds the global section when it
was removed (reboot, operator, reset), or when the database it describes has
another history since the monitor (re)connected (a fail-over to a standby, a
restore on a new timeline). The connection itself follows the embedded
cluster's DSN file (``_link``)."""

from __future__ import annotations

from ringq.engine import redact_dsn
from ringq.engine.recovery import history_of, section_following

from ._link import Link
from ._section import Attachment
from ._step import Settings


class FollowFailover:
    """Step ``section``. The database's history is read once after every connect."""

    def __init__(self, attachment: Attachment, link: Link, settings: Settings) -> None:
        self._attachment = attachment
        self._link = link
        self._settings = settings
        self.due = True  # the section's history is checked after every connect
        link.on_connect.append(self._connected)

    def _connected(self) -> None:
        self.due = True  # a reconnect may have found a promoted standby

    def run(self) -> None:
        sec = self._attachment.section
        if sec is not None and not sec.closed and not sec.unlinked():
            if not self.due:
                return
            history = history_of(self._link.connect())
            self.due = False
            dsn = redact_dsn(self._settings().dsn)
            if section_following(self._link.instance, history, dsn) is sec:
                return
            reason = "database history changed (fail-over or restore)"
        else:
            reason = "section missing"
        self._attachment.attach(reason=reason)
