"""Recovery steps: dead clients (``recover``), lock holders that died in the
critical section (``repair``), live clients whose backend ended under them
(``backends``) and prepared transactions left behind (``prepared``). Each
delegates the deciding to :mod:`ringq.engine.recovery` and logs what it did."""

from __future__ import annotations

import logging

from ringq.engine.recovery import (
    recover_dead_clients,
    recover_lost_backends,
    repair_lock_holders,
    resolve_prepared,
)

from . import _events as E
from ._link import Link
from ._section import Attachment
from ._step import Note, Settings


class RecoveryStep:
    """What a step that ends or decides clients works with: the attached
    section, the database link (to publish events), the monitor's settings
    (the DSN to reach backends) and ``monitor.log``."""

    def __init__(self, attachment: Attachment, link: Link, settings: Settings, note: Note) -> None:
        self._attachment = attachment
        self._link = link
        self._settings = settings
        self._note = note


class RecoverClients(RecoveryStep):
    """Step ``recover``: decide the slots of clients whose process died."""

    def __init__(self, attachment: Attachment, link: Link, settings: Settings, note: Note) -> None:
        super().__init__(attachment, link, settings, note)
        self.recovered = 0  # clients recovered since the monitor started

    def run(self) -> None:
        sec = self._attachment.current()
        for rec in recover_dead_clients(sec, self._settings().dsn):
            info = rec.as_dict()
            self.recovered += 1
            self._note("client.recovered", logging.WARNING, **info)
            self._link.publish(
                E.make_event(
                    E.CONSUMER_DIED, info["queues"][0] if len(info["queues"]) == 1 else None, **info
                )
            )


class RepairLocks:
    """Step ``repair``: release queue locks whose holder died inside the critical section."""

    def __init__(self, attachment: Attachment, settings: Settings, note: Note) -> None:
        self._attachment = attachment
        self._settings = settings
        self._note = note

    def run(self) -> None:
        for name in repair_lock_holders(self._attachment.current(), self._settings().dsn):
            self._note("queue.repaired", logging.WARNING, queue=name,
                       reason="lock holder died inside the critical section")


class RecoverBackends:
    """Step ``backends``: decide the slots of live clients whose backend ended
    under them (a database restart, a backend terminated by someone else)."""

    def __init__(self, attachment: Attachment, link: Link, note: Note) -> None:
        self._attachment = attachment
        self._link = link
        self._note = note

    def run(self) -> None:
        for rec in recover_lost_backends(self._attachment.current(), self._link.connect()):
            self._note(
                "client.backend_lost", logging.WARNING,
                reason="its backend ended while it held slots: decided from the rows",
                **rec.as_dict(),
            )


class ResolvePrepared:
    """Step ``prepared``: commit or roll back prepared transactions older than
    ``config.prepared_timeout`` whose client is gone."""

    def __init__(self, attachment: Attachment, settings: Settings, note: Note) -> None:
        self._attachment = attachment
        self._settings = settings
        self._note = note

    def run(self) -> None:
        cfg = self._settings()
        for gid, verb in resolve_prepared(self._attachment.current(), cfg.dsn,
                                          cfg.prepared_timeout):
            self._note("prepared.resolved", logging.WARNING, gid=gid, outcome=verb)
