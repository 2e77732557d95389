"""The payload cache of one queue block: a record per slot in the section's cache pool.

A record (``L.R_*`` words, then the producer name, the group, then the
payload) is written by the session whose commit made the entry (or, for an
entry a SQL producer put into reserved slots, by the SQL agent from its
committed row), under the queue lock, before the entry's ENQ bit is set; read by the dequeuer that
claimed the slot, under the queue lock; and trusted only when its tag is the
entry's seq + 1 and its epoch the queue's (every load from the rows starts a
new epoch). A dequeue that does not commit clears its record's tag, so a
redelivery reads the row.

A batch reads and writes the records' words as one numpy gather or scatter
over the pool; only the variable-length bytes (payload, producer, group) are
copied one entry at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from struct import Struct

import numpy as np

from ..section import Section
from ..section import layout as L
from ._kinds import RowWrite, Write
from ._scan import SMALL_BATCH

# A payload cache hit: (payload, producer, producer_seq, enqueued at in us, group).
Cached = tuple[bytes, str, int, int, str | None]

_FIELDS = np.arange(L.RECORD_WORDS, dtype=np.int64)
_HEAD = Struct(f"{L.RECORD_WORDS}q")  # a record's head words, as get_few unpacks them
_P0 = L.RECORD_WORDS * 8  # where the producer name starts in a record


class PayloadCache:
    """Records of queue block ``qb`` (cheap to make; the caller holds the queue lock)."""

    __slots__ = ("Q", "_names", "cap_bytes", "cw0", "qb", "sec", "stride", "sw")

    def __init__(self, sec: Section, qb: int) -> None:
        self.sec = sec
        self.qb = qb
        self.Q = sec.queues
        self.cap_bytes = self.Q[qb + L.Q_CACHE_PAYLOAD]  # payload bytes a record holds
        self.stride = self.Q[qb + L.Q_CACHE_STRIDE]  # 0: the queue has no cache
        self.cw0 = self.Q[qb + L.Q_CACHE_BASE] >> 3  # first record's first word
        self.sw = self.stride >> 3  # words per record
        # decoded producer and group names by their bytes: a batch's entries share them
        self._names: dict[bytes, str] = {}

    def _name(self, raw: bytes) -> str:
        name = self._names.get(raw)
        if name is None:
            if len(self._names) > 256:
                self._names.clear()
            name = self._names[raw] = raw.decode()
        return name

    def put(
        self,
        slot: int,
        seq: int,
        payload: bytes,
        producer: bytes,
        producer_seq: int,
        enq_at_us: int,
        group: bytes | None = None,
    ) -> bool:
        """Write the record of ``slot``'s new entry ``seq`` (the caller holds
        the slot and the queue lock, and has not set ENQ yet). False if the
        queue has no cache or the entry does not fit its record."""
        if (
            not self.stride
            or len(payload) > self.cap_bytes
            or len(producer) > L.CACHE_PRODUCER_BYTES
            or (group is not None and len(group) > L.GROUP_BYTES)
        ):
            return False
        s = self.sec
        w = self.cw0 + slot * self.sw
        off = w << 3
        cw = s.cache_w
        cw[w + L.R_TAG] = 0  # not trusted while half written (and a wrong tag anyway)
        cw[w + L.R_EPOCH] = self.Q[self.qb + L.Q_CACHE_EPOCH]
        cw[w + L.R_LEN] = len(payload)
        cw[w + L.R_PRODUCER_LEN] = len(producer)
        cw[w + L.R_PRODUCER_SEQ] = producer_seq
        cw[w + L.R_ENQ_AT_US] = enq_at_us
        cw[w + L.R_GROUP_LEN] = -1 if group is None else len(group)
        at = off + _P0
        s.cache[at : at + len(producer)] = producer
        if group:
            at = off + L.RECORD_GROUP
            s.cache[at : at + len(group)] = group
        at = off + L.RECORD_HEAD
        s.cache[at : at + len(payload)] = payload
        cw[w + L.R_TAG] = seq + 1
        return True

    def put_many(
        self, slots: Sequence[int], seqs: Sequence[int], writes: Sequence[Write], enq_at_us: int
    ) -> None:
        """Write the records of a batch of new entries (as :meth:`put`, each
        one that fits): the head words as one scatter, tags last."""
        if not self.stride:
            return
        if not self._put_plain(slots, seqs, writes, enq_at_us):
            self._put_each(slots, seqs, writes, enq_at_us)

    def _put_each(
        self, slots: Sequence[int], seqs: Sequence[int], writes: Sequence[Write], enq_at_us: int
    ) -> None:
        """:meth:`put_many` entry by entry (any producers and groups; an
        entry that does not fit is left out); the heads as one scatter."""
        s = self.sec
        cache = s.cache
        limit = self.cap_bytes
        epoch = self.Q[self.qb + L.Q_CACHE_EPOCH]
        rows: list[tuple[int, int, int, int, int, int, int]] = []
        at_w: list[int] = []
        tags: list[int] = []
        encoded: dict[str, bytes] = {}
        for slot, seq, wr in zip(slots, seqs, writes, strict=True):
            payload = wr.payload
            producer = encoded.get(wr.producer)
            if producer is None:
                producer = encoded[wr.producer] = wr.producer.encode()
            group = None if wr.group is None else wr.group.encode()
            if (
                len(payload) > limit
                or len(producer) > L.CACHE_PRODUCER_BYTES
                or (group is not None and len(group) > L.GROUP_BYTES)
            ):
                continue
            w = self.cw0 + slot * self.sw
            off = w << 3
            cache[off + _P0 : off + _P0 + len(producer)] = producer
            if group:
                cache[off + L.RECORD_GROUP : off + L.RECORD_GROUP + len(group)] = group
            cache[off + L.RECORD_HEAD : off + L.RECORD_HEAD + len(payload)] = payload
            at_w.append(w)
            rows.append((0, epoch, len(payload), len(producer), wr.producer_seq, enq_at_us,
                         -1 if group is None else len(group)))
            tags.append(seq + 1)
        if at_w:
            self._write_heads(at_w, np.array(rows, dtype=np.int64), np.array(tags, dtype=np.int64))

    def _write_heads(
        self, at_w: list[int] | np.ndarray, heads: np.ndarray, tags: np.ndarray
    ) -> None:
        """Write a batch's record heads (first words ``at_w``) as one
        scatter, their tags last: a tag stays 0 (untrusted) until the rest
        of its record is written (a record's old tag names an older entry
        of the slot: never the new one)."""
        at = np.asarray(at_w, dtype=np.int64)
        cq = self.sec.cache_q
        cq[at[:, None] + _FIELDS] = heads
        cq[at + L.R_TAG] = tags

    def _put_plain(
        self, slots: Sequence[int], seqs: Sequence[int], writes: Sequence[Write], enq_at_us: int
    ) -> bool:
        """:meth:`put_many` of the usual batch (one producer, no groups,
        payloads that all fit; see :meth:`_put_arrays`). False, having
        written nothing, for any other batch."""
        producer = writes[0].producer
        if any(w.group is not None or w.producer != producer for w in writes):
            return False
        return self._put_arrays(
            np.asarray(slots, dtype=np.int64), np.asarray(seqs, dtype=np.int64),
            [w.payload for w in writes], producer.encode(),
            np.fromiter((w.producer_seq for w in writes), dtype=np.int64, count=len(writes)),
            enq_at_us,
        )

    def put_run(
        self, slots: np.ndarray, seqs: np.ndarray, payloads: list[bytes], producer: str,
        pseqs: np.ndarray, groups: list[str | None] | None, enq_at_us: int,
    ) -> None:
        """:meth:`put_many` of a run's entries (int64 ``slots``, ``seqs``,
        ``pseqs``; one ``producer``; ``groups`` None: no groups)."""
        if not self.stride:
            return
        if (groups is None or all(g is None for g in groups)) and self._put_arrays(
            slots, seqs, payloads, producer.encode(), pseqs, enq_at_us
        ):
            return
        gs = groups or [None] * len(payloads)
        self._put_each(slots.tolist(), seqs.tolist(), [
            RowWrite(p, q, producer, g)
            for p, q, g in zip(payloads, pseqs.tolist(), gs, strict=True)
        ], enq_at_us)

    def _put_arrays(
        self, slots: np.ndarray, seqs: np.ndarray, payloads: list[bytes], name: bytes,
        pseqs: np.ndarray, enq_at_us: int,
    ) -> bool:
        """Records of entries of one producer ``name`` and no group: a slice
        copy per entry for its bytes and nothing else per entry in Python;
        the heads as one scatter, tags last. False, having written nothing,
        if a payload or the name does not fit."""
        lens = list(map(len, payloads))
        if len(name) > L.CACHE_PRODUCER_BYTES or max(lens) > self.cap_bytes:
            return False
        n = len(payloads)
        cache = self.sec.cache
        pn = len(name)
        at_w = self.cw0 + slots * self.sw
        for w, payload, size in zip(at_w.tolist(), payloads, lens, strict=True):
            off = w << 3
            cache[off + _P0 : off + _P0 + pn] = name
            cache[off + L.RECORD_HEAD : off + L.RECORD_HEAD + size] = payload
        heads = np.empty((n, L.RECORD_WORDS), dtype=np.int64)
        heads[:, L.R_TAG] = 0
        heads[:, L.R_EPOCH] = self.Q[self.qb + L.Q_CACHE_EPOCH]
        heads[:, L.R_LEN] = lens
        heads[:, L.R_PRODUCER_LEN] = pn
        heads[:, L.R_PRODUCER_SEQ] = pseqs
        heads[:, L.R_ENQ_AT_US] = enq_at_us
        heads[:, L.R_GROUP_LEN] = -1
        self._write_heads(at_w, heads, seqs + 1)
        return True

    def get(self, slot: int, seq: int) -> Cached | None:
        """(payload, producer, producer_seq, enqueued at in us, group) of
        entry ``seq`` from its record, if the record holds it (the caller
        holds the slot and the queue lock); else None, and the caller reads
        the row. Counted."""
        if not self.stride:
            return None
        s = self.sec
        cw = s.cache_w
        w = self.cw0 + slot * self.sw
        Q, b = self.Q, self.qb
        if cw[w + L.R_TAG] != seq + 1 or cw[w + L.R_EPOCH] != Q[b + L.Q_CACHE_EPOCH]:
            Q[b + L.Q_N_CACHE_MISSES] += 1
            return None
        Q[b + L.Q_N_CACHE_HITS] += 1
        return self._read(w, cw[w + L.R_LEN], cw[w + L.R_PRODUCER_LEN],
                          cw[w + L.R_PRODUCER_SEQ], cw[w + L.R_ENQ_AT_US], cw[w + L.R_GROUP_LEN])

    def _read(self, w: int, n: int, pn: int, pseq: int, enq_at: int, gn: int) -> Cached:
        cache = self.sec.cache
        off = w << 3
        producer = self._name(bytes(cache[off + _P0 : off + _P0 + pn]))
        group = (
            None if gn < 0
            else self._name(bytes(cache[off + L.RECORD_GROUP : off + L.RECORD_GROUP + gn]))
        )
        at = off + L.RECORD_HEAD
        return bytes(cache[at : at + n]), producer, pseq, enq_at, group

    def get_many(self, slots: np.ndarray, seqs: np.ndarray) -> list[Cached | None]:
        """:meth:`get` for a batch (int64 arrays): the record heads read as
        one gather; when every record holds its entry, the producer names
        compared as one array (a batch's entries usually share one) and the
        hits made without a call per entry. A few entries: :meth:`get_few`."""
        if len(slots) <= SMALL_BATCH:
            return self.get_few(slots.tolist(), seqs.tolist())
        if not self.stride:
            return [None] * len(slots)
        w = self.cw0 + slots * self.sw
        heads = self.sec.cache_q[w[:, None] + _FIELDS]
        hit = (heads[:, L.R_TAG] == seqs + 1) & (
            heads[:, L.R_EPOCH] == self.Q[self.qb + L.Q_CACHE_EPOCH]
        )
        n_hit = int(np.count_nonzero(hit))
        self._count(n_hit, len(slots) - n_hit)
        if n_hit == len(slots):
            return self._hits(w, heads)
        return self._read_rows(w.tolist(), heads.tolist(), hit.tolist())

    def get_few(self, slots: Sequence[int], seqs: Sequence[int]) -> list[Cached | None]:
        """:meth:`get_many` of a few entries, in plain ints (see SMALL_BATCH)
        and one pass: each record's head words unpacked from the pool, its
        bytes copied, the producer decoded once for records in a row that
        name the same one (a third of the separate passes' time for 8)."""
        if not self.stride:
            return [None] * len(slots)
        cache, cw0, sw = self.sec.cache, self.cw0, self.sw
        epoch = self.Q[self.qb + L.Q_CACHE_EPOCH]
        unpack = _HEAD.unpack_from
        out: list[Cached | None] = []
        raw_name, producer = b"", ""
        for slot, seq in zip(slots, seqs, strict=True):
            w = cw0 + slot * sw
            off = w << 3
            h = unpack(cache, off)
            n, pn = h[L.R_LEN], h[L.R_PRODUCER_LEN]
            if h[L.R_TAG] != seq + 1 or h[L.R_EPOCH] != epoch:
                out.append(None)
            elif h[L.R_GROUP_LEN] >= 0:  # an entry of a group: as get() reads it
                out.append(self._read(w, n, pn, h[L.R_PRODUCER_SEQ], h[L.R_ENQ_AT_US],
                                      h[L.R_GROUP_LEN]))
            else:
                raw = cache[off + _P0 : off + _P0 + pn].tobytes()
                if raw != raw_name:
                    raw_name, producer = raw, self._name(raw)
                at = off + L.RECORD_HEAD
                out.append((cache[at : at + n].tobytes(), producer, h[L.R_PRODUCER_SEQ],
                            h[L.R_ENQ_AT_US], None))
        hits = len(out) - out.count(None)
        self._count(hits, len(out) - hits)
        return out

    def _count(self, hits: int, misses: int) -> None:
        Q, b = self.Q, self.qb
        Q[b + L.Q_N_CACHE_HITS] += hits
        Q[b + L.Q_N_CACHE_MISSES] += misses

    def _read_rows(
        self, ws: list[int], rows: list[list[int]], hit: list[bool] | None = None
    ) -> list[Cached | None]:
        """:meth:`_read` of each record (first words ``ws``, ``rows`` their
        head words) that ``hit`` marks (None: all); None for the others."""
        read = self._read
        return [
            read(wi, h[L.R_LEN], h[L.R_PRODUCER_LEN], h[L.R_PRODUCER_SEQ], h[L.R_ENQ_AT_US],
                 h[L.R_GROUP_LEN]) if ok else None
            for wi, h, ok in zip(ws, rows, hit or [True] * len(rows), strict=True)
        ]

    def _hits(self, w: np.ndarray, heads: np.ndarray) -> list[Cached | None]:
        """The entries of records that all hold them (first words ``w``,
        ``heads`` their head words; more than SMALL_BATCH, see
        :meth:`get_few`): a slice per payload; the producer decoded once
        when every record names the same one, the group None for all when
        none has one; else per entry (:meth:`_read`)."""
        n = len(w)
        off = w << 3
        pn = heads[:, L.R_PRODUCER_LEN]
        pn0 = int(pn[0])
        if not (heads[:, L.R_GROUP_LEN] == -1).all() or not (pn == pn0).all():
            return self._read_rows(w.tolist(), heads.tolist())
        names = self.sec.cache_u8[(off + _P0)[:, None] + np.arange(pn0, dtype=np.int64)]
        if not (names == names[0]).all():
            return self._read_rows(w.tolist(), heads.tolist())
        starts = off + L.RECORD_HEAD
        payloads = self.sec.cache_bytes(starts.tolist(), (starts + heads[:, L.R_LEN]).tolist())
        producer = self._name(names[0].tobytes())
        return list(zip(
            payloads, [producer] * n, heads[:, L.R_PRODUCER_SEQ].tolist(),
            heads[:, L.R_ENQ_AT_US].tolist(), [None] * n, strict=True,
        ))

    def clear_few(self, slots: list[int]) -> None:
        """:meth:`clear` of a few slots, in plain ints (see SMALL_BATCH)."""
        if self.stride:
            cw, cw0, sw = self.sec.cache_w, self.cw0 + L.R_TAG, self.sw
            for slot in slots:
                cw[cw0 + slot * sw] = 0

    def clear(self, slots: np.ndarray) -> None:
        """Untrust the records of ``slots`` (int64 array): their entries are
        consumed, or their rows count a delivery now (a record serves one
        first delivery)."""
        if self.stride and len(slots):
            self.sec.cache_q[self.cw0 + slots * self.sw + L.R_TAG] = 0
