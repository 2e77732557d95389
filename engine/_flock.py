"""A queue lock's fcntl record lock, taken and dropped without releasing the GIL.

Python's ``fcntl.lockf`` releases the GIL around its system call. Taken
while the per-process ``threading.Lock`` of a queue is held, that hands the
GIL to another thread, and the lock holder then waits for the GIL (up to the
interpreter's switch interval, 5 ms) before it can finish its critical
section and release the queue: with many threads in one process, every
other thread of the queue waits behind it (a convoy; with 32 consumer
threads, 40 % of thread samples waited on the queue lock).

Here the uncontended case (no other process holds the byte) is one
non-blocking ``fcntl(F_SETLK)`` called through ``ctypes.PyDLL``, which keeps
the GIL; only when another process holds the lock does the caller fall back
to the blocking ``fcntl.lockf`` (which releases the GIL while it waits, as
it must). The lock is the same POSIX record lock either way (owned by the
process, released by the kernel when it dies), so the monitor's probes and
repairs see no difference.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from typing import Any

_SEEK_SET = os.SEEK_SET


class _Flock(ctypes.Structure):
    # struct flock (Linux): l_type, l_whence, l_start, l_len, l_pid
    _fields_ = (
        ("l_type", ctypes.c_short),
        ("l_whence", ctypes.c_short),
        ("l_start", ctypes.c_int64),
        ("l_len", ctypes.c_int64),
        ("l_pid", ctypes.c_int),
    )


def _libc_fcntl() -> Any | None:
    """libc's fcntl through PyDLL (the GIL stays held), or None where that
    layout of struct flock is not known to hold."""
    if not sys.platform.startswith("linux") or ctypes.sizeof(ctypes.c_long) != 8:
        return None
    try:
        fn = ctypes.PyDLL(None, use_errno=True).fcntl
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_fcntl = _libc_fcntl()


class ByteLocks:
    """Exclusive fcntl locks on single bytes of one file descriptor."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock: dict[int, Any] = {}  # byte -> pointer to its F_WRLCK struct flock
        self._unlock: dict[int, Any] = {}

    def _structs(self, byte: int) -> tuple[Any, Any]:
        lk = _Flock(fcntl.F_WRLCK, _SEEK_SET, byte, 1, 0)
        un = _Flock(fcntl.F_UNLCK, _SEEK_SET, byte, 1, 0)
        # the structs live as long as the pointers: kept in the dicts with them
        self._lock[byte] = (lk, ctypes.pointer(lk))
        self._unlock[byte] = (un, ctypes.pointer(un))
        return self._lock[byte], self._unlock[byte]

    def lock(self, byte: int) -> None:
        """Take the lock on ``byte``, waiting while another process holds it."""
        if _fcntl is not None:
            got = self._lock.get(byte)
            if got is None:
                got = self._structs(byte)[0]
            if _fcntl(self.fd, fcntl.F_SETLK, got[1]) == 0:
                return
        # Held by another process (or no PyDLL path): wait, the GIL released.
        fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, byte)

    def unlock(self, byte: int) -> None:
        if _fcntl is not None:
            got = self._unlock.get(byte)
            if got is None:
                got = self._structs(byte)[1]
            if _fcntl(self.fd, fcntl.F_SETLK, got[1]) == 0:
                return
        fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, byte)  # raises what went wrong
