"""This host's ringq shared memory: the global sections (``/dev/shm/ringq.<instance id>``)
and their wake-up semaphores (``/dev/shm/sem.ringq.<instance id>.<queue id><r|s>``).

A section is memory, and it outlives its database: nothing of the kernel's
removes it when the server stops or the database is dropped. This module
lists them (:func:`sections_on_host`), tells which processes hold them (a
mapping in ``/proc/<pid>/maps`` or a descriptor in ``/proc/<pid>/fd``),
tells which databases still answer (:func:`scan_server`) and removes the ones
nobody holds (:func:`remove_section_on_host`, :func:`tidy_sections`).

Removing a section is always safe for the data: the rows decide, and the next
client of a database that still exists rebuilds its section from them. It is
not safe for a process that still maps it (it would go on with its old copy
while newcomers make a new one), so a held section is never removed.

This process's own attachment is the exception to the /proc rule: a section
this process maps only through the engine's per-process attachment, with no
session registered in it, is not in use (the attachment notices the removal
and makes a new one). Reading a section's header through a new descriptor
would drop this process's fcntl locks on it at close, so the header of a
section this process maps is read from the attachment instead.
"""

from __future__ import annotations

import contextlib
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import posix_ipc
from psycopg import conninfo

from ..driver import load
from ..driver.errors import RingqError, SectionError, redact_dsn
from ..driver.pg import connected
from . import layout as L
from ._clients import pid_alive
from ._process import _Process
from ._section import SHM_DIR, Section, section_name

SECTION_PREFIX = "ringq."
SEMAPHORE_PREFIX = "sem.ringq."
# What a section's entry in the scan reads: the header, the queue blocks and names.
_Q = load("ringq.engine.section", "shm.sql")
_HEAD_BYTES = L.OFF_NAMES + L.MAX_QUEUES * L.NAME_BYTES


class SectionInUse(SectionError):
    """A live process maps (or holds open) the section: it is not removed."""


@dataclass(frozen=True)
class SectionOnHost:
    """One global section in ``/dev/shm``, as found (never attached).

    ``memory``: bytes of RAM its pages take (the section is sparse: its
    apparent ``size`` is far larger), its semaphores' included. ``sysid`` and
    ``timeline``: the database history it describes (0 when none was set or it
    could not be read). ``pids``: live processes that hold it.
    """

    instance_id: str
    path: Path
    size: int
    memory: int
    semaphores: tuple[Path, ...]
    sysid: int
    timeline: int
    created_ns: int
    layout: int
    queues: tuple[str, ...]
    pids: tuple[int, ...]

    @property
    def name(self) -> str:
        """The shared-memory name, ``/ringq.<instance id>``."""
        return "/" + self.path.name

    def as_dict(self) -> dict[str, Any]:
        """The section as plain data (``ringq section list --json``)."""
        return {
            "instance_id": self.instance_id,
            "name": self.name,
            "memory": self.memory,
            "size": self.size,
            "semaphores": len(self.semaphores),
            "system_identifier": self.sysid,
            "timeline": self.timeline,
            "created_ns": self.created_ns,
            "layout": self.layout,
            "queues": list(self.queues),
            "pids": list(self.pids),
        }


@dataclass
class ServerScan:
    """What one server tells: its system identifier (0 when the role may not
    read it), and the instance id of every database with a ringq schema,
    mapped to that database's DSN (redacted). ``complete`` is false when a
    database could not be read: an instance id missing from ``instances`` may
    then still exist."""

    dsn: str
    sysid: int = 0
    instances: dict[str, str] = field(default_factory=dict)
    complete: bool = True


@dataclass
class Tidied:
    """What a tidy did: the sections removed, and those kept because live processes hold them."""

    removed: list[SectionOnHost] = field(default_factory=list)
    kept: list[SectionOnHost] = field(default_factory=list)


# -- finding ------------------------------------------------------------------------------


def _instance_of(entry: str) -> str | None:
    """The instance id of a section's file name (``ringq.<id>``), None for anything else."""
    if not entry.startswith(SECTION_PREFIX):
        return None
    rest = entry[len(SECTION_PREFIX) :]
    return rest if rest.isalnum() else None


def holders(shm_dir: str = SHM_DIR) -> dict[str, set[int]]:
    """Every live process (this one left out) that maps or holds open a ringq
    file of ``shm_dir``, by the file's name (``ringq.<id>``, ``sem.ringq.<id>.<q><k>``).
    Files already removed (``(deleted)``) are not counted: they hold nobody up."""
    me = os.getpid()
    found: dict[str, set[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        names = holders_of_pid(pid, shm_dir)
        if names and pid_alive(pid):
            for name in names:
                found.setdefault(name, set()).add(pid)
    return found


def _own_attachment(instance_id: str) -> Section | None:
    """This process's engine attachment of the section, if it has one still open."""
    if _Process.pid != os.getpid():
        return None
    sec = _Process.sections.get(instance_id)
    return None if sec is None or sec.closed else sec


def _mapped_here(shm_dir: str) -> set[str]:
    """Names of the ringq files of ``shm_dir`` this process maps or holds open."""
    return holders_of_pid(os.getpid(), shm_dir)


def holders_of_pid(pid: int, shm_dir: str = SHM_DIR) -> set[str]:
    """The ringq files of ``shm_dir`` that process ``pid`` maps or holds open
    (empty when it is gone or its /proc entries may not be read)."""
    prefix = shm_dir.rstrip("/") + "/"
    wanted = (prefix + SECTION_PREFIX, prefix + SEMAPHORE_PREFIX)
    names: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                at = line.find(prefix)
                if at >= 0 and line.startswith(wanted, at) and not line.endswith("(deleted)\n"):
                    names.add(line[at + len(prefix) :].rstrip("\n"))
        for fd in os.scandir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(fd.path)
            except OSError:
                continue
            if target.startswith(wanted) and not target.endswith("(deleted)"):
                names.add(target[len(prefix) :])
    except OSError:
        pass
    return names


def _head(path: Path, own: Section | None) -> bytes:
    """The section's first bytes (header, queue blocks, names); empty if unreadable."""
    if own is not None:
        return bytes(own._buf[:_HEAD_BYTES])
    try:
        with open(path, "rb") as f:
            return f.read(_HEAD_BYTES)
    except OSError:
        return b""


def _client_here(own: Section) -> bool:
    """Whether a session of this process is registered in the section."""
    me = os.getpid()
    return any(own.c(i, L.C_PID) == me for i in own.active_clients())


def sections_on_host(shm_dir: str = SHM_DIR) -> list[SectionOnHost]:
    """Every ringq global section in ``shm_dir``, oldest first, with who holds it.

    This process counts as a holder only when a session of its own is
    registered in the section, or it maps it other than through the engine's
    per-process attachment (see the module's docstring).
    """
    try:
        entries = sorted(os.listdir(shm_dir))
    except OSError:
        return []
    held = holders(shm_dir)
    here = _mapped_here(shm_dir)
    out: list[SectionOnHost] = []
    for entry in entries:
        instance = _instance_of(entry)
        if instance is None:
            continue
        path = Path(shm_dir, entry)
        sems = tuple(Path(shm_dir, e) for e in entries if e.startswith(f"sem.{entry}."))
        try:
            st = path.stat()
        except OSError:
            continue  # removed meanwhile
        memory = st.st_blocks * 512
        for sem in sems:
            with contextlib.suppress(OSError):
                memory += sem.stat().st_blocks * 512
        pids = set(held.get(entry, ()))
        for sem in sems:
            pids |= held.get(sem.name, set())
        own = _own_attachment(instance) if entry in here else None
        if entry in here and (own is None or _client_here(own)):
            pids.add(os.getpid())
        head = _head(path, own)
        out.append(_describe(instance, path, st.st_size, memory, sems, head, pids))
    out.sort(key=lambda s: (s.created_ns, s.instance_id))
    return out


def _describe(
    instance: str, path: Path, size: int, memory: int, sems: tuple[Path, ...], head: bytes,
    pids: set[int],
) -> SectionOnHost:
    whole = len(head) >= L.HEADER_WORDS * 8
    words = struct.unpack_from(f"={L.HEADER_WORDS}q", head) if whole else ()
    ours = bool(words) and words[L.H_MAGIC] == L.MAGIC
    queues: list[str] = []
    if ours and words[L.H_LAYOUT] == L.LAYOUT_VERSION and len(head) >= _HEAD_BYTES:
        for i in range(L.MAX_QUEUES):
            base = L.OFF_QUEUES + i * L.QUEUE_WORDS * 8
            state = struct.unpack_from("=q", head, base + L.Q_STATE * 8)[0]
            if state == L.QS_READY:
                raw = head[L.OFF_NAMES + i * L.NAME_BYTES : L.OFF_NAMES + (i + 1) * L.NAME_BYTES]
                queues.append(raw.rstrip(b"\0").decode(errors="replace"))
    return SectionOnHost(
        instance_id=instance,
        path=path,
        size=size,
        memory=memory,
        semaphores=sems,
        sysid=words[L.H_DB_SYSID] & ((1 << 64) - 1) if ours else 0,
        timeline=words[L.H_DB_TIMELINE] if ours else 0,
        created_ns=words[L.H_CREATED_NS] if ours else 0,
        layout=words[L.H_LAYOUT] if ours else 0,
        queues=tuple(queues),
        pids=tuple(sorted(pids)),
    )


# -- removing -----------------------------------------------------------------------------


def _unlink(found: SectionOnHost) -> None:
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(found.name)
    for sem in found.semaphores:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore("/" + sem.name[len("sem.") :])


def remove_section_on_host(instance_id: str, shm_dir: str = SHM_DIR) -> SectionOnHost:
    """Remove the section of ``instance_id`` and its semaphores; what was removed.

    The next client of its database, if that still exists, rebuilds it from the rows.

    :raises SectionInUse: a live process holds it (its pids are in the message).
    :raises SectionError: there is no such section (or the id is malformed).
    """
    name = section_name(instance_id)[1:]
    found = next((s for s in sections_on_host(shm_dir) if s.path.name == name), None)
    if found is None:
        raise SectionError(f"no global section /{name} on this host")
    if found.pids:
        raise SectionInUse(
            f"global section /{name} is held by live process(es) "
            f"{', '.join(map(str, found.pids))}: not removed"
        )
    _unlink(found)
    return found


def tidy_sections(
    instance_ids: Iterable[str] = (), sysid: int = 0, shm_dir: str = SHM_DIR
) -> Tidied:
    """Remove the sections of databases that are gone: those of ``instance_ids``,
    and with ``sysid`` every section describing that cluster's history, unless
    a live process holds them (then they are kept, and told).

    For a stopped cluster: its databases' sections would outlive it."""
    ids = set(instance_ids)
    done = Tidied()
    for found in sections_on_host(shm_dir):
        if found.instance_id not in ids and not (sysid and found.sysid == sysid):
            continue
        if found.pids:
            done.kept.append(found)
        else:
            _unlink(found)
            done.removed.append(found)
    return done


def orphan_semaphores(shm_dir: str = SHM_DIR) -> list[Path]:
    """Semaphores of sections that are no longer there (a removal by hand, an old version)."""
    try:
        entries = os.listdir(shm_dir)
    except OSError:
        return []
    sections = {e for e in entries if _instance_of(e) is not None}
    out = []
    for e in sorted(entries):
        if e.startswith(SEMAPHORE_PREFIX):
            owner = e[len("sem.") :].split(".")[:2]
            if ".".join(owner) not in sections:
                out.append(Path(shm_dir, e))
    return out


def remove_orphan_semaphores(shm_dir: str = SHM_DIR) -> list[Path]:
    """Remove the semaphores :func:`orphan_semaphores` finds that nobody holds; those removed."""
    held = holders(shm_dir)
    removed = []
    for sem in orphan_semaphores(shm_dir):
        if sem.name in held or sem.name in _mapped_here(shm_dir):
            continue
        try:
            posix_ipc.unlink_semaphore("/" + sem.name[len("sem.") :])
        except posix_ipc.ExistentialError:
            continue
        removed.append(sem)
    return removed


# -- asking the databases -----------------------------------------------------------------


def scan_server(dsn: str, *, timeout: int = 3) -> ServerScan:
    """Connect to the server of ``dsn`` and read the instance id of every
    database on it that has a ringq schema (connecting to each in turn).

    :raises DatabaseUnavailable: the server does not answer at ``dsn``.
    """
    scan = ServerScan(dsn=redact_dsn(dsn))
    with connected(dsn, connect_timeout=timeout) as conn:
        row = conn.execute(_Q["history"]).fetchone()
        scan.sysid = int(row[0]) & ((1 << 64) - 1) if row else 0
        names = [r[0] for r in conn.execute(_Q["databases"]).fetchall()]
    for name in names:
        url = conninfo.make_conninfo(dsn, dbname=name)
        try:
            with connected(url, connect_timeout=timeout) as conn:
                has = conn.execute(_Q["has_meta"]).fetchone()
                row = conn.execute(_Q["instance_id"]).fetchone() if has and has[0] else None
        except RingqError:
            scan.complete = False  # no permission, or dropped meanwhile: cannot tell
            continue
        if row is not None and row[0]:
            scan.instances[str(row[0])] = redact_dsn(url)
    return scan


def database_state(found: SectionOnHost, scans: Iterable[ServerScan]) -> tuple[str, str | None]:
    """Whether the section's database still exists, from ``scans``: ``live``
    (with its DSN), ``dropped`` (its server answers, and no database there has
    its instance id), or ``unknown`` (no server scanned is its own)."""
    for scan in scans:
        if found.instance_id in scan.instances:
            return "live", scan.instances[found.instance_id]
    for scan in scans:
        if scan.complete and found.sysid and scan.sysid == found.sysid:
            return "dropped", scan.dsn
    return "unknown", None
