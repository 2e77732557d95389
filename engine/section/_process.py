"""The per-process attachment of global sections: one :class:`Section` per
database instance in a process, shared by its sessions, its recovery and its
monitor, and made again after ``fork()`` (nothing shared crosses a fork).

The lock guarding it is made again in a forked child too: another thread of
the parent (a monitor's or a pool's recovery) may hold it at the fork, and
the child, which has no such thread, would wait for it for ever.

One attachment per process matters: fcntl locks belong to the process, and
closing any descriptor of the segment drops them all.
"""

from __future__ import annotations

import os
import threading
from typing import ClassVar

from ._section import Section


class _Process:
    """Per-process attachment: one Section per database instance, re-made after fork()."""

    lock = threading.Lock()
    pid = os.getpid()
    sections: ClassVar[dict[str, Section]] = {}

    @classmethod
    def section(cls, instance: str) -> Section:
        with cls.lock:
            if cls.pid != os.getpid():
                # Forked: the parent's mapping stays valid but its locks and
                # client entries are not ours; start afresh.
                cls.sections = {}
                cls.pid = os.getpid()
            sec = cls.sections.get(instance)
            if sec is not None and (sec.closed or sec.unlinked()):
                cls.sections.pop(instance, None)
                sec = None
            if sec is None:
                sec = Section.attach(instance)
                cls.sections[instance] = sec
            return sec

    @classmethod
    def _after_fork_in_child(cls) -> None:
        cls.lock = threading.Lock()
        cls.sections = {}
        cls.pid = os.getpid()


os.register_at_fork(after_in_child=_Process._after_fork_in_child)


def shared_section(instance_id: str) -> Section:
    """This process's one attachment of the section of ``instance_id`` (created
    if absent), the same object its sessions use; made again after ``fork()``.

    A second attachment in one process would not exclude the first one's
    users: fcntl locks belong to the process, and closing any descriptor of
    the segment drops them all.

    :raises SectionIncompatible: the host's section has a foreign layout.
    """
    return _Process.section(instance_id)
