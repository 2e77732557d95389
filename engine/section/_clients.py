"""The client table of the global section: one entry per attached session.

Each entry is written by its own process (registration, counters, the last
error, the queues it used, the start of its held entries' lease); the
monitor and recovery read every entry to find dead clients and decide the
slots locked under their tokens. :class:`ClientTable` is a base of
:class:`~._section.Section` and works on its views.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Final

import numpy as np

from ..driver.errors import SectionError
from . import layout as L

_U64: Final = (1 << 64) - 1


def pid_alive(pid: int) -> bool:
    """True if a process with this pid exists on this host."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (killed, not yet reaped by its parent) is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class ClientTable:
    """The client entries of a section (``clients``: int64 words)."""

    pid: int
    clients: memoryview
    queues: memoryview
    owner: np.ndarray
    lck: np.ndarray

    def lock_section(self) -> None:
        raise NotImplementedError

    def unlock_section(self) -> None:
        raise NotImplementedError

    def c(self, cidx: int, word: int) -> int:
        return self.clients[cidx * L.CLIENT_WORDS + word]

    def add_client(self, backend_pid: int) -> tuple[int, int]:
        """Register this process as a client with its backend; returns (index, token).

        The token (``L.token_of``) is new: no slot locked under an earlier
        user of the entry carries it.

        :raises SectionError: the client table is full (dead clients not yet recovered).
        """
        self.lock_section()
        try:
            for i in range(L.MAX_CLIENTS):
                base = i * L.CLIENT_WORDS
                if self.clients[base + L.C_STATE] == L.CS_FREE:
                    gen = self.clients[base + L.C_GEN] + 1
                    for w in range(L.CLIENT_WORDS):
                        self.clients[base + w] = 0
                    token = L.token_of(i, gen)
                    self.clients[base + L.C_GEN] = gen
                    self.clients[base + L.C_TOKEN] = token
                    self.clients[base + L.C_PID] = self.pid
                    self.clients[base + L.C_BACKEND_PID] = backend_pid
                    now = time.time_ns()
                    self.clients[base + L.C_STARTED_NS] = now
                    self.clients[base + L.C_REGISTERED_NS] = now
                    self.clients[base + L.C_STATE] = L.CS_ACTIVE
                    return i, token
        finally:
            self.unlock_section()
        raise SectionError(
            f"global section client table full ({L.MAX_CLIENTS}): dead clients wait for the monitor"
        )

    def renew_client(self, cidx: int, backend_pid: int) -> int:
        """Client ``cidx`` (this process's entry) reconnected: record its new
        backend and give it a new token, which it returns. Its time bounds the
        backend's start. Slots still locked under the old token are orphaned
        from now on (recovery decides them once their holder backend is gone).

        ``C_REGISTERED_NS`` is left alone: the monitor knows the client by it.
        """
        base = cidx * L.CLIENT_WORDS
        C = self.clients
        gen = C[base + L.C_GEN] + 1
        token = L.token_of(cidx, gen)
        C[base + L.C_STARTED_NS] = time.time_ns()
        C[base + L.C_BACKEND_PID] = backend_pid
        C[base + L.C_GEN] = gen
        C[base + L.C_TOKEN] = token
        return token

    def token_holder(self, token: int) -> int | None:
        """The client entry whose current token is ``token`` (any state but
        free), or None: the token is orphaned (its entry was freed or has
        renewed its token since)."""
        if token <= 0:
            return None
        cidx = L.token_client(token)
        base = cidx * L.CLIENT_WORDS
        if self.clients[base + L.C_STATE] == L.CS_FREE or self.clients[base + L.C_TOKEN] != token:
            return None
        return cidx

    def token_dead(self, token: int) -> bool:
        """Whether the holder of slots locked under ``token`` is dead, as far
        as the section tells: the token is orphaned, its entry in doubt, or
        its process gone. (Its backend may still be ending: recovery waits.)"""
        cidx = self.token_holder(token)
        if cidx is None:
            return token > 0
        base = cidx * L.CLIENT_WORDS
        return self.clients[base + L.C_STATE] == L.CS_IN_DOUBT or not pid_alive(
            self.clients[base + L.C_PID]
        )

    def locked_under(self, token: int, qidxs: Iterable[int]) -> bool:
        """Whether any slot of queue blocks ``qidxs`` is locked under ``token`` (vectorized)."""
        for qidx in qidxs:
            qb = qidx * L.QUEUE_WORDS
            base, cap = self.queues[qb + L.Q_BASE], self.queues[qb + L.Q_CAPACITY]
            slots = np.flatnonzero(self.owner[base : base + cap] == token)
            if slots.size:
                g = base + slots
                if np.any((self.lck[g >> 6] >> (g & 63).astype(np.uint64)) & np.uint64(1)):
                    return True
        return False

    def set_client_role(self, cidx: int, role: int) -> None:
        """Mark client ``cidx`` (this process's entry) with ``role`` (CR_*)."""
        self.clients[cidx * L.CLIENT_WORDS + L.C_ROLE] = role

    def set_client_words(self, cidx: int, words: Iterable[tuple[int, int]]) -> None:
        """Write (word, value) pairs into client ``cidx``'s entry (a worker's counters)."""
        C = self.clients
        base = cidx * L.CLIENT_WORDS
        for word, value in words:
            C[base + word] = value

    def count_client(self, cidx: int, word: int, n: int = 1) -> None:
        """Add ``n`` to counter ``word`` (C_N_*) of client ``cidx``."""
        self.clients[cidx * L.CLIENT_WORDS + word] += n

    def hand_over_client(
        self, cidx: int, *, pid: int | None = None, registered_ns: int | None = None
    ) -> None:
        """Mark client ``cidx`` in doubt: recovery decides the slots locked
        under its token from the rows, once its backend has ended, and frees
        it. With ``pid`` and ``registered_ns``, only if the entry is still that
        registration's and active (a finalizer that runs late)."""
        base = cidx * L.CLIENT_WORDS
        C = self.clients
        if pid is None or (
            C[base + L.C_PID] == pid
            and C[base + L.C_STATE] == L.CS_ACTIVE
            and (registered_ns is None or C[base + L.C_REGISTERED_NS] == registered_ns)
        ):
            C[base + L.C_STATE] = L.CS_IN_DOUBT

    def free_client(self, cidx: int) -> None:
        """Free client ``cidx``'s entry, whoever made it (recovery, once its slots are decided)."""
        self.lock_section()
        try:
            base = cidx * L.CLIENT_WORDS
            self.clients[base + L.C_STATE] = L.CS_FREE
            self.clients[base + L.C_PID] = 0
            self.clients[base + L.C_TOKEN] = 0
        finally:
            self.unlock_section()

    def remove_client(self, cidx: int) -> None:
        """Free a client entry; the caller must hold no entry locks under it."""
        self.lock_section()
        try:
            base = cidx * L.CLIENT_WORDS
            if self.clients[base + L.C_PID] == self.pid:
                self.clients[base + L.C_STATE] = L.CS_FREE
                self.clients[base + L.C_PID] = 0
                self.clients[base + L.C_TOKEN] = 0
        finally:
            self.unlock_section()

    def record_client_error(self, cidx: int, code: int, qid: int, seq: int) -> None:
        """Record an error client ``cidx`` (this process's entry) hit: the last
        error's code, queue id, sequence (-1: none) and time, then the count.

        Called only on error paths. The generation word makes the record a
        seqlock: odd while written, so a reader never takes a torn record.
        """
        base = cidx * L.CLIENT_WORDS
        C = self.clients
        if C[base + L.C_PID] != self.pid:
            return  # not ours (freed by recovery): nothing to tell
        gen = C[base + L.C_ERR_GEN]
        C[base + L.C_ERR_GEN] = gen | 1
        C[base + L.C_ERR_CODE] = code
        C[base + L.C_ERR_QID] = qid
        C[base + L.C_ERR_SEQ] = seq
        C[base + L.C_ERR_NS] = time.time_ns()
        C[base + L.C_N_ERRORS] += 1
        C[base + L.C_ERR_GEN] = (gen | 1) + 1

    def client_error(self, cidx: int) -> tuple[int, int, int, int, int] | None:
        """(count, code, queue id, seq, time ns) of client ``cidx``'s last error,
        read consistently; None if it could not be read between two writes."""
        base = cidx * L.CLIENT_WORDS
        C = self.clients
        for _ in range(100):
            g1 = C[base + L.C_ERR_GEN]
            if g1 & 1:
                continue
            rec = (C[base + L.C_N_ERRORS], C[base + L.C_ERR_CODE], C[base + L.C_ERR_QID],
                   C[base + L.C_ERR_SEQ], C[base + L.C_ERR_NS])
            if C[base + L.C_ERR_GEN] == g1:
                return rec
        return None

    def mark_client_queue(self, cidx: int, qidx: int) -> None:
        """Note that client ``cidx`` uses queue block ``qidx`` (once per session and queue)."""
        w = cidx * L.CLIENT_WORDS + L.C_QUEUES + qidx // 64
        v = (self.clients[w] & _U64) | (1 << (qidx % 64))
        self.clients[w] = v - (1 << 64) if v >= 1 << 63 else v

    def client_queues(self, cidx: int) -> list[int]:
        """Queue blocks client ``cidx`` used (see :meth:`mark_client_queue`)."""
        out = []
        for k in range(L.C_QUEUE_WORDS):
            v = self.clients[cidx * L.CLIENT_WORDS + L.C_QUEUES + k] & _U64
            while v:
                low = v & -v
                out.append(k * 64 + low.bit_length() - 1)
                v ^= low
        return out

    def note_hold(self, cidx: int) -> None:
        """Client ``cidx`` took the first dequeued entry of its transaction now."""
        self.clients[cidx * L.CLIENT_WORDS + L.C_HOLD_SINCE_NS] = time.monotonic_ns()

    def end_hold(self, cidx: int, since_ns: int) -> None:
        """Record that the monitor ended client ``cidx``'s transaction that took
        its first entry at ``since_ns``, past the lease, and that it rolled back."""
        w = cidx * L.CLIENT_WORDS + L.C_HOLD_SINCE_NS
        if self.clients[w] == since_ns:
            self.clients[w] = -1

    def lease_ended(self, cidx: int) -> bool:
        """True if the monitor ended client ``cidx``'s transaction past the lease (see
        :meth:`end_hold`); the word is set anew by the next transaction's first entry."""
        return self.clients[cidx * L.CLIENT_WORDS + L.C_HOLD_SINCE_NS] < 0

    def clear_hold(self, cidx: int) -> None:
        """Client ``cidx``'s transaction finished: it holds no dequeued entry."""
        self.clients[cidx * L.CLIENT_WORDS + L.C_HOLD_SINCE_NS] = 0

    def active_clients(self) -> list[int]:
        return [
            i
            for i in range(L.MAX_CLIENTS)
            if self.clients[i * L.CLIENT_WORDS + L.C_STATE] != L.CS_FREE
        ]

    def dead_clients(self) -> list[int]:
        """Entries in use whose client is dead: handed over (in doubt), or its
        process gone.

        Read under the section lock. Unlocked, an entry its owner freed
        between the reads (state FREE, pid 0) passed for a dead one, and
        recovery then ended the backend of, decided the slots of, and freed,
        the session that registered in it next. A dead entry stays as it is
        until recovery frees it: nobody else frees it or registers in it.
        """
        self.lock_section()
        try:
            return [
                cidx
                for cidx in self.active_clients()
                if self.c(cidx, L.C_STATE) == L.CS_IN_DOUBT
                or (self.c(cidx, L.C_STATE) == L.CS_ACTIVE and not pid_alive(self.c(cidx, L.C_PID)))
            ]
        finally:
            self.unlock_section()

