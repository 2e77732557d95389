"""The regression payload: a header, a filler and a checksum, all in the bytes.

Layout (big-endian), ``L`` bytes in all::

    0   u8   transaction kind (1 simple, 2 two-phase)
    1   u8   queue index in the run
    2   u16  producer index
    4   u32  producer sequence (per producer per cycle, from 1; never reused, not even
             by a rolled-back attempt)
    8   u32  length L
    12  ...  filler (random or a pattern)
    L-k k    the first k bytes of SHA-256 of bytes [0, L-k), k = min(32, L - 12)

So a 16-byte payload carries a 4-byte check and anything from 44 bytes on the
whole SHA-256. The Spark analysis recomputes the check with ``sha2`` on the
bytes it read, and compares the header with what the producer recorded.
"""

from __future__ import annotations

import hashlib
import random
import struct
from dataclasses import dataclass

HEADER = struct.Struct(">BBHII")
HEADER_SIZE = HEADER.size  # 12
MIN_CHECK = 4
MAX_CHECK = 32
MIN_PAYLOAD = HEADER_SIZE + MIN_CHECK  # 16

KIND_SIMPLE = 1
KIND_TWO_PHASE = 2
KIND_NAMES = {KIND_SIMPLE: "simple", KIND_TWO_PHASE: "two-phase"}


@dataclass(frozen=True)
class Header:
    kind: int
    queue: int
    producer: int
    pseq: int
    length: int


def check_size(length: int) -> int:
    """Bytes of checksum carried by a payload of ``length`` bytes."""
    return min(MAX_CHECK, length - HEADER_SIZE)


def build(
    kind: int,
    queue: int,
    producer: int,
    pseq: int,
    length: int,
    *,
    rng: random.Random | None = None,
) -> bytes:
    """A payload of exactly ``length`` bytes (>= 16). With ``rng`` the filler is
    random bytes from it, else a compressible pattern derived from the header."""
    head = HEADER.pack(kind, queue, producer, pseq, length)
    k = check_size(length)
    n = length - HEADER_SIZE - k
    if rng is not None:
        filler = rng.randbytes(n)
    else:
        unit = hashlib.blake2b(head, digest_size=32).digest()
        filler = (unit * (n // len(unit) + 1))[:n]
    body = head + filler
    return body + hashlib.sha256(body).digest()[:k]


def parse(payload: bytes) -> Header | None:
    """The header, or None if the payload is too short to hold one."""
    if len(payload) < HEADER_SIZE:
        return None
    return Header(*HEADER.unpack_from(payload))


def intact(payload: bytes) -> bool:
    """Whether the embedded checksum matches and the length field is the length."""
    h = parse(payload)
    if h is None or h.length != len(payload) or len(payload) < MIN_PAYLOAD:
        return False
    k = check_size(len(payload))
    return hashlib.sha256(payload[:-k]).digest()[:k] == payload[-k:]


def digest(payload: bytes) -> bytes:
    """What the producer records with the entry: SHA-256 of the whole payload."""
    return hashlib.sha256(payload).digest()
