"""The global section: one POSIX shared-memory segment per database on the queue host.

It holds every queue's head and tail, counters, the ENQ/DEQ/LCK bitmaps (numpy
views), the entry-lock owner (a session's token) and holder (its backend pid)
of every slot, a table of attached clients, and the payload cache (each
cached slot's payload, producer and enqueue time, tagged with its seq).

Locks: the short critical sections use ``fcntl`` byte-range locks on the
segment's own file descriptor (byte 0 for the section, byte 1+i for queue
block i, byte 1+MAX_QUEUES for recovery), which the kernel releases when a
holder dies, plus a per-process
``threading.Lock`` because fcntl locks do not exclude threads of one process.
posix-ipc semaphores are used only to count wake-ups.

The section is a cache: the database rows decide. Everything here can be
rebuilt from the tables (:mod:`ringq.engine._ring`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
from contextlib import suppress
from typing import Final

import numpy as np
import posix_ipc

from ..driver.errors import SectionError, SectionIncompatible
from . import layout as L
from ._clients import ClientTable, pid_alive

_U64: Final = (1 << 64) - 1

logger = logging.getLogger("ringq")
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory (glibc's shm_open)
# how often (ns) Section.unlinked_lately asks the kernel whether the segment was removed
UNLINK_CHECK_NS: Final = 5_000_000


def section_name(instance_id: str) -> str:
    """The shared-memory name of a database's section: ``/ringq.<instance id>``."""
    if not instance_id.isalnum():
        raise SectionError(f"bad instance id {instance_id!r}")
    return f"/ringq.{instance_id[:32]}"


def shm_free_bytes() -> int | None:
    """Bytes free on the filesystem of POSIX shared memory (/dev/shm), None if unknown."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class Section(ClientTable):
    """An attached global section. Use :meth:`attach`; ``close()`` is idempotent.

    :raises SectionIncompatible: the segment was made by another layout version.
    """

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap) -> None:
        self.name = name
        self.pid = os.getpid()
        self._shm = shm
        self._fd = shm.fd
        self._mm: mmap.mmap | None = mm
        buf = memoryview(mm)
        self._buf = buf
        self.header = buf[L.OFF_HEADER : L.OFF_HEADER + L.HEADER_WORDS * 8].cast("q")
        self.queues = buf[L.OFF_QUEUES : L.OFF_QUEUES + L.MAX_QUEUES * L.QUEUE_WORDS * 8].cast("q")
        self.clients = buf[
            L.OFF_CLIENTS : L.OFF_CLIENTS + L.MAX_CLIENTS * L.CLIENT_WORDS * 8
        ].cast("q")
        self.names = buf[L.OFF_NAMES : L.OFF_NAMES + L.MAX_QUEUES * L.NAME_BYTES]
        # Word views for single-bit updates (fast) and numpy views for scans.
        self.enq_w = buf[L.OFF_ENQ : L.OFF_ENQ + L.BITMAP_WORDS * 8].cast("Q")
        self.deq_w = buf[L.OFF_DEQ : L.OFF_DEQ + L.BITMAP_WORDS * 8].cast("Q")
        self.lck_w = buf[L.OFF_LCK : L.OFF_LCK + L.BITMAP_WORDS * 8].cast("Q")
        self.enq = np.frombuffer(mm, dtype=np.uint64, count=L.BITMAP_WORDS, offset=L.OFF_ENQ)
        self.deq = np.frombuffer(mm, dtype=np.uint64, count=L.BITMAP_WORDS, offset=L.OFF_DEQ)
        self.lck = np.frombuffer(mm, dtype=np.uint64, count=L.BITMAP_WORDS, offset=L.OFF_LCK)
        self.owner = np.frombuffer(mm, dtype=np.int32, count=L.SLOT_POOL, offset=L.OFF_OWNER)
        self.owner_w = buf[L.OFF_OWNER : L.OFF_OWNER + L.SLOT_POOL * 4].cast("i")
        self.holder = np.frombuffer(mm, dtype=np.int32, count=L.SLOT_POOL, offset=L.OFF_HOLDER)
        self.holder_w = buf[L.OFF_HOLDER : L.OFF_HOLDER + L.SLOT_POOL * 4].cast("i")
        self.group = np.frombuffer(mm, dtype=np.int64, count=L.SLOT_POOL, offset=L.OFF_GROUP)
        self.group_w = buf[L.OFF_GROUP : L.OFF_GROUP + L.SLOT_POOL * 8].cast("q")
        self.due = np.frombuffer(mm, dtype=np.int64, count=L.SLOT_POOL, offset=L.OFF_DUE)
        self.due_w = buf[L.OFF_DUE : L.OFF_DUE + L.SLOT_POOL * 8].cast("q")
        # The payload cache pool: bytes, and the same as int64 words (record heads).
        self.cache = buf[L.OFF_CACHE : L.OFF_CACHE + L.CACHE_POOL]
        self.cache_w = self.cache.cast("q")
        # the same as a numpy array, for a batch's record heads (sparse: untouched pages stay free)
        self.cache_q = np.frombuffer(
            mm, dtype=np.int64, count=L.CACHE_POOL // 8, offset=L.OFF_CACHE
        )
        # and as bytes: a copy of pool bytes a..b is cache_bytes(slice(a, b)) (an
        # mmap slice: half a memoryview's cost, which makes a view first)
        self.cache_u8 = np.frombuffer(mm, dtype=np.uint8, count=L.CACHE_POOL, offset=L.OFF_CACHE)
        # section, queues, recovery
        self._tlocks = [threading.Lock() for _ in range(L.MAX_QUEUES + 2)]
        self._sems: dict[tuple[int, str], posix_ipc.Semaphore] = {}
        self.generation = self.header[L.H_GENERATION]
        # unlinked_lately(): once seen unlinked it stays so (a name never comes back
        # to a segment); until then looked at no sooner than this (monotonic ns)
        self._gone = False
        self._look_at_ns = 0

    # -- life cycle ---------------------------------------------------------------

    @classmethod
    def attach(cls, instance_id: str, *, create: bool = True) -> Section:
        """Attach the section of a database, creating and initialising it if absent.

        :raises SectionError: it is absent and ``create`` is false, or it cannot be made.
        :raises SectionIncompatible: it has a foreign magic or layout version.
        """
        name = section_name(instance_id)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREAT if create else 0, mode=0o660)
        except posix_ipc.ExistentialError as exc:
            raise SectionError(
                f"global section {name} does not exist (is the monitor running?)"
            ) from exc
        except OSError as exc:
            raise SectionError(f"cannot open global section {name}: {exc}") from exc
        try:
            # Section-wide lock while checking / initialising, so a half-made
            # segment (its creator killed) is finished by the next one to come.
            fcntl.lockf(shm.fd, fcntl.LOCK_EX, 1, 0)
            try:
                size = os.fstat(shm.fd).st_size
                if size == 0:
                    if not create:
                        raise SectionError(f"global section {name} is empty")
                    os.ftruncate(shm.fd, L.SECTION_SIZE)
                    size = L.SECTION_SIZE
                if size < L.OFF_QUEUES:
                    raise SectionIncompatible(f"global section {name} has a foreign size {size}")
                mm = mmap.mmap(shm.fd, size)
                header = memoryview(mm)[: L.HEADER_WORDS * 8].cast("q")
                if header[L.H_READY] == 0 and header[L.H_MAGIC] == 0:
                    if size != L.SECTION_SIZE:
                        raise SectionIncompatible(
                            f"global section {name} has a foreign size {size}"
                        )
                    header[L.H_LAYOUT] = L.LAYOUT_VERSION
                    header[L.H_SIZE] = L.SECTION_SIZE
                    header[L.H_GENERATION] = secrets.randbits(62) | 1
                    header[L.H_NEXT_BASE] = 0
                    header[L.H_NEXT_CACHE] = 0
                    header[L.H_CREATED_NS] = time.time_ns()
                    header[L.H_MAGIC] = L.MAGIC
                    header[L.H_READY] = 1
                if (
                    header[L.H_MAGIC] != L.MAGIC
                    or header[L.H_LAYOUT] != L.LAYOUT_VERSION
                    or size != L.SECTION_SIZE
                ):
                    found = (header[L.H_MAGIC], header[L.H_LAYOUT], size)
                    header.release()
                    mm.close()
                    raise SectionIncompatible(
                        f"global section {name} has layout {found[1]} (magic {found[0]:#x}, "
                        f"{found[2]} bytes); this ringq uses layout {L.LAYOUT_VERSION}: "
                        "stop every client and the monitor, then remove it "
                        "(ringq monitor --reset-section)"
                    )
                header.release()
            finally:
                fcntl.lockf(shm.fd, fcntl.LOCK_UN, 1, 0)
        except BaseException:
            shm.close_fd()
            raise
        return cls(name, shm, mm)

    def close(self) -> None:
        if self._mm is None:
            return
        for sem in self._sems.values():
            sem.close()
        self._sems.clear()
        for view in (self.header, self.queues, self.clients, self.names, self.enq_w, self.deq_w,
                     self.lck_w, self.owner_w, self.holder_w, self.group_w, self.due_w,
                     self.cache_w, self.cache):
            view.release()
        del self.enq, self.deq, self.lck, self.owner, self.holder, self.group, self.due
        del self.cache_q, self.cache_u8
        self._buf.release()
        mm, self._mm = self._mm, None
        with suppress(BufferError):  # a numpy view still referenced elsewhere: it dies with it
            mm.close()
        self._shm.close_fd()

    def cache_bytes(self, starts: list[int], ends: list[int]) -> list[bytes]:
        """Copies of the payload cache pool's bytes ``starts[i]..ends[i]``."""
        mm = self._mm
        if mm is None:
            raise ValueError("the section is closed")
        at = L.OFF_CACHE
        return [mm[a + at : e + at] for a, e in zip(starts, ends, strict=True)]

    @property
    def closed(self) -> bool:
        return self._mm is None

    def unlinked(self) -> bool:
        """True if the segment was removed (the monitor made a new one, or an operator did)."""
        try:
            return os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def unlinked_lately(self) -> bool:
        """:meth:`unlinked`, asked of the kernel at most every
        ``UNLINK_CHECK_NS`` per section object (a session asks before each
        call: an ``fstat`` each was a syscall per enqueue). A replacement made
        through this object (:meth:`replace`) is seen at once; one made
        elsewhere within that time. Using a replaced section a little longer
        is what a call that began just before the unlink does anyway: the
        rows decide, and a stale section costs a retryable error."""
        if self._gone:
            return True
        now = time.monotonic_ns()
        if now < self._look_at_ns:
            return False
        self._look_at_ns = now + UNLINK_CHECK_NS
        self._gone = self.unlinked()
        return self._gone

    @staticmethod
    def unlink(instance_id: str) -> bool:
        """Remove a database's section (clients attached keep their mapping). True if it existed."""
        name = section_name(instance_id)
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            return False
        return True

    # -- locks --------------------------------------------------------------------

    def lock_section(self) -> None:
        self._tlocks[0].acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, 0)
        except BaseException:
            self._tlocks[0].release()
            raise

    def unlock_section(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, 0)
        self._tlocks[0].release()

    def lock_queue(self, qidx: int) -> None:
        """Enter queue block ``qidx``'s critical section (short: no I/O inside)."""
        self._tlocks[qidx + 1].acquire()
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, 1, qidx + 1)
        except BaseException:
            self._tlocks[qidx + 1].release()
            raise
        # Recorded so the monitor can tell a holder that died inside from a live one.
        self.queues[qidx * L.QUEUE_WORDS + L.Q_LOCK_HOLDER] = self.pid

    def unlock_queue(self, qidx: int) -> None:
        self.queues[qidx * L.QUEUE_WORDS + L.Q_LOCK_HOLDER] = 0
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, qidx + 1)
        self._tlocks[qidx + 1].release()

    def try_lock_recovery(self) -> bool:
        """Take the recovery lock if nobody holds it (no wait); True if taken.

        One recoverer at a time per section (the monitor, a dequeuer, a
        mover): two would both count a failed delivery on the same entry.
        The kernel releases it if the holder dies.
        """
        t = self._tlocks[L.MAX_QUEUES + 1]
        if not t.acquire(blocking=False):
            return False
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, L.MAX_QUEUES + 1)
        except OSError as exc:
            t.release()
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        except BaseException:
            t.release()
            raise
        return True

    def unlock_recovery(self) -> None:
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, L.MAX_QUEUES + 1)
        self._tlocks[L.MAX_QUEUES + 1].release()

    def queue_lock_probe(self, qidx: int) -> bool:
        """True if nobody holds the queue's lock right now (takes and drops it)."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, qidx + 1)
        except OSError as exc:
            if exc.errno in (errno.EACCES, errno.EAGAIN):
                return False
            raise
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, qidx + 1)
        return True

    # -- queue blocks ----------------------------------------------------------------

    def q(self, qidx: int, word: int) -> int:
        return self.queues[qidx * L.QUEUE_WORDS + word]

    def find_queue(self, qid: int) -> int | None:
        """The block index of queue ``qid``, or None if it is not loaded."""
        for i in range(L.MAX_QUEUES):
            base = i * L.QUEUE_WORDS
            if self.queues[base + L.Q_QID] == qid and self.queues[base + L.Q_STATE] == L.QS_READY:
                return i
        return None

    def loaded_queues(self) -> list[int]:
        return [
            i
            for i in range(L.MAX_QUEUES)
            if self.queues[i * L.QUEUE_WORDS + L.Q_STATE] == L.QS_READY
        ]

    def queue_name(self, qidx: int) -> str:
        raw = bytes(self.names[qidx * L.NAME_BYTES : (qidx + 1) * L.NAME_BYTES])
        return raw.rstrip(b"\0").decode()

    def allocate_queue(self, qid: int, name: str, capacity: int, cache_payload: int = 0) -> int:
        """Reserve a block and pool space for a queue (caller holds the section lock).

        Returns the block index; the caller fills it and sets ``Q_STATE`` ready.
        ``cache_payload`` bytes of each slot's payload are cached when the cache
        pool has room (else the queue runs without a cache: a warning, no error).
        :raises SectionError: no free block, or the slot pool is exhausted.
        """
        free = None
        dropped: list[int] = []
        for i in range(L.MAX_QUEUES):
            base = i * L.QUEUE_WORDS
            state = self.queues[base + L.Q_STATE]
            if self.queues[base + L.Q_QID] == qid and state != L.QS_READY:
                # A block for this queue left half-loaded (its loader died): reuse it.
                free = i
                break
            if state == L.QS_UNUSED and self.queues[base + L.Q_QID] == 0 and free is None:
                free = i
            if state == L.QS_DROPPED:
                dropped.append(i)
        if free is None or self.queues[free * L.QUEUE_WORDS + L.Q_QID] != qid:
            # Prefer a dropped queue's block whose pool space fits: dropped
            # queues give their blocks and slots back.
            fits = [
                i
                for i in dropped
                if (self.queues[i * L.QUEUE_WORDS + L.Q_CAPACITY] + 63) // 64
                >= (capacity + 63) // 64
            ]
            if fits:
                free = min(fits, key=lambda i: self.queues[i * L.QUEUE_WORDS + L.Q_CAPACITY])
            elif free is None and dropped:
                free = dropped[0]
                self.queues[free * L.QUEUE_WORDS + L.Q_CAPACITY] = 0  # its pool space is too small
        if free is None:
            raise SectionError(f"global section full: {L.MAX_QUEUES} queues at most")
        base = free * L.QUEUE_WORDS
        reuse = self.queues[base + L.Q_QID] == qid or self.queues[base + L.Q_STATE] == L.QS_DROPPED
        if reuse and (self.queues[base + L.Q_CAPACITY] + 63) // 64 >= (capacity + 63) // 64 > 0:
            slot_base = self.queues[base + L.Q_BASE]
        else:
            slot_base = self.header[L.H_NEXT_BASE]
            end = slot_base + (capacity + 63) // 64 * 64
            if end > L.SLOT_POOL:
                raise SectionError(
                    f"global section slot pool exhausted: {L.SLOT_POOL:,} slots in all, "
                    f"{slot_base:,} used, queue needs {capacity:,}"
                )
            self.header[L.H_NEXT_BASE] = end
        cache_base, cache_area = self._cache_space(base, reuse, capacity, cache_payload, name)
        self.queues[base + L.Q_STATE] = L.QS_UNUSED
        for w in range(L.QUEUE_WORDS):
            self.queues[base + w] = 0
        if cache_area:
            self.queues[base + L.Q_CACHE_PAYLOAD] = cache_payload
            self.queues[base + L.Q_CACHE_STRIDE] = L.cache_stride(cache_payload)
            self.queues[base + L.Q_CACHE_BASE] = cache_base
            self.queues[base + L.Q_CACHE_AREA] = cache_area
        # No stale locks or owners from a former occupant of this pool space.
        words = (capacity + 63) // 64
        self.lck[slot_base // 64 : slot_base // 64 + words] = 0
        self.owner[slot_base : slot_base + capacity] = 0
        self.holder[slot_base : slot_base + capacity] = 0
        self.queues[base + L.Q_QID] = qid
        self.queues[base + L.Q_CAPACITY] = capacity
        self.queues[base + L.Q_BASE] = slot_base
        raw = name.encode()[: L.NAME_BYTES]
        self.names[free * L.NAME_BYTES : (free + 1) * L.NAME_BYTES] = raw.ljust(L.NAME_BYTES, b"\0")
        return free

    def _cache_space(
        self, base: int, reuse: bool, capacity: int, cache_payload: int, name: str
    ) -> tuple[int, int]:
        """(first byte, bytes) of the cache pool space for a queue being
        allocated at block word ``base``: the former occupant's when it is big
        enough, else fresh space; (0, 0) without a cache or room for one."""
        need = capacity * L.cache_stride(cache_payload)
        if need == 0:
            return 0, 0
        if reuse and self.queues[base + L.Q_CACHE_AREA] >= need:
            return self.queues[base + L.Q_CACHE_BASE], self.queues[base + L.Q_CACHE_AREA]
        start = self.header[L.H_NEXT_CACHE]
        dropped = None
        if start + need > L.CACHE_POOL:
            # The pool's end is reached: a dropped queue's space that is big
            # enough serves (its records carry that queue's epoch: never trusted).
            dropped = _dropped_cache_area(self.queues, base, need)
            if dropped is None:
                logger.warning(
                    "ringq: queue %s runs without its payload cache: it needs %d bytes, "
                    "the section's cache pool has %d of %d left, and no dropped "
                    "queue's space is that large", name, need, L.CACHE_POOL - start,
                    L.CACHE_POOL,
                )
                return 0, 0
        free = shm_free_bytes()
        if free is not None and need > free:
            # The pool is sparse: its pages are taken when records are written,
            # and a write the filesystem has no page for kills the writer
            # (SIGBUS). A small /dev/shm (a container's 64 MB) cannot hold it.
            logger.warning(
                "ringq: queue %s runs without its payload cache: it needs %d bytes, "
                "the shared-memory filesystem has %d free", name, need, free,
            )
            return 0, 0
        if dropped is not None:
            owner = dropped * L.QUEUE_WORDS
            area = (self.queues[owner + L.Q_CACHE_BASE], self.queues[owner + L.Q_CACHE_AREA])
            self.queues[owner + L.Q_CACHE_BASE] = 0  # now the new queue's
            self.queues[owner + L.Q_CACHE_AREA] = 0
            return area
        self.header[L.H_NEXT_CACHE] = start + (need + 63) // 64 * 64
        return start, need

    def note_db_clock(self, db_us: int) -> None:
        """A statement's answer stamped the database's time ``db_us`` (us since
        the epoch, ``clock_timestamp()`` or ``now()``): keep the latest as the
        offset of the database's clock from this host's monotonic clock (one
        word: readers never see half of it). The stamp was taken before the
        answer arrived, so the estimate stays behind the database's clock by
        about a round trip: entries fall due late by that, never early."""
        if db_us > 0:
            self.header[L.H_DB_CLOCK_US] = db_us - time.monotonic_ns() // 1000

    def db_clock_us(self) -> int:
        """The database's clock now as this host estimates it (us since the
        epoch; 0 while no answer stamped it: nothing falls due)."""
        off = self.header[L.H_DB_CLOCK_US]
        return time.monotonic_ns() // 1000 + off if off else 0

    def history(self) -> tuple[int, int]:
        """(system identifier, timeline) of the database history described; (0, 0) if not set."""
        return self.header[L.H_DB_SYSID], self.header[L.H_DB_TIMELINE]

    def follow_history(self, sysid: int, timeline: int) -> bool:
        """Check that this section describes the database history of a server
        (``sysid``, ``timeline``); set it if none is set yet. False if it
        describes another one: the caller must replace it (:func:`replace`),
        never use it: its bits may show entries that history never committed.
        """
        if self.history() == (sysid, timeline):
            return True
        self.lock_section()
        try:
            if self.history() == (0, 0):
                self.header[L.H_DB_SYSID] = sysid
                self.header[L.H_DB_TIMELINE] = timeline
                return True
            return self.history() == (sysid, timeline)
        finally:
            self.unlock_section()

    def replace(self, instance_id: str, why: str) -> None:
        """Remove this section's name so that the next attach makes a new one
        (clients attached keep their mapping until they re-attach). Done once,
        whoever of several clients asks: under the section lock, and only
        while the name is still this segment's."""
        self.lock_section()
        try:
            if not self.unlinked():
                Section.unlink(instance_id)
                logger.warning("ringq: global section %s replaced: %s", self.name, why)
            self._gone = True
        finally:
            self.unlock_section()

    def mark_queue_ready(self, qidx: int) -> None:
        """Open a loaded block to clients (caller holds the section lock)."""
        self.queues[qidx * L.QUEUE_WORDS + L.Q_STATE] = L.QS_READY

    def mark_queue_dropped(self, qidx: int) -> None:
        """Retire the block of a queue dropped from the database; its space is reused."""
        self.queues[qidx * L.QUEUE_WORDS + L.Q_STATE] = L.QS_DROPPED

    def set_inbox(self, qidx: int, waiting: int) -> None:
        """Queue block ``qidx``'s SQL inbox entries waiting (``Q_INBOX``), as the pump counted."""
        self.queues[qidx * L.QUEUE_WORDS + L.Q_INBOX] = max(0, int(waiting))

    # -- leases -------------------------------------------------------------------

    def set_lease(self, qidx: int, lease_s: float) -> None:
        """Queue block ``qidx``'s lease (``Q_LEASE_MS``), in seconds; 0: none."""
        self.queues[qidx * L.QUEUE_WORDS + L.Q_LEASE_MS] = max(0, round(lease_s * 1000))

    def monitor_serving(self, fresh_s: float) -> bool:
        """Whether a monitor's heartbeat is fresher than ``fresh_s`` seconds and its process
        lives."""
        pid = self.header[L.H_MONITOR_PID]
        beat = self.header[L.H_MONITOR_BEAT_NS]
        return bool(pid) and time.time_ns() - beat < fresh_s * 1e9 and pid_alive(pid)

    # -- wake-ups -----------------------------------------------------------------

    def semaphore(self, qid: int, kind: str) -> posix_ipc.Semaphore:
        """The counting semaphore ``kind`` ('r' ready, 's' space) of queue ``qid``."""
        key = (qid, kind)  # no string made per call
        sem = self._sems.get(key)
        if sem is None:
            sem = posix_ipc.Semaphore(
                f"{self.name}.{qid}{kind}", posix_ipc.O_CREAT, mode=0o660, initial_value=0
            )
            self._sems[key] = sem
        return sem

    def post(self, qid: int, kind: str, times: int) -> None:
        sem = self.semaphore(qid, kind)
        for _ in range(times):
            sem.release()

    @staticmethod
    def unlink_semaphores(instance_id: str, qids: list[int]) -> None:
        name = section_name(instance_id)
        for qid in qids:
            for kind in "rs":
                with contextlib.suppress(posix_ipc.ExistentialError):
                    posix_ipc.unlink_semaphore(f"{name}.{qid}{kind}")


def _dropped_cache_area(queues: memoryview, base: int, need: int) -> int | None:
    """The dropped queue block in the section's ``queues`` words (other than
    the one at word ``base``) whose cache space is the smallest of at least
    ``need`` bytes, or None."""
    best, best_area = None, 0
    for i in range(L.MAX_QUEUES):
        b = i * L.QUEUE_WORDS
        area = queues[b + L.Q_CACHE_AREA]
        if b == base or queues[b + L.Q_STATE] != L.QS_DROPPED or area < need:
            continue
        if best is None or area < best_area:
            best, best_area = i, area
    return best
