"""Layout of the global section (one POSIX shared-memory segment per database).

::

    [ header | queue blocks x MAX_QUEUES | queue names | clients x MAX_CLIENTS |
      ENQ bits | DEQ bits | LCK bits | OWNER int32 per slot | HOLDER int32 per slot |
      GROUP int64 per slot | DUE int64 per slot | payload cache pool ]

Every field is an int64 word at a fixed index, so the layout is plain data
that any process (and a future non-Python tool) can read. A segment whose
magic or layout version differs is refused, never reinterpreted.
"""

from __future__ import annotations

# 2: client entries of 32 words (role, last error, queues, worker counters)
# 3: owner tokens (C_GEN, C_TOKEN) and the HOLDER array (backend pid per slot)
# 4: the payload cache (a pool after HOLDER, H_NEXT_CACHE, Q_CACHE_*)
# 5: groups (the GROUP array after HOLDER, Q_GROUPED, R_GROUP_LEN and the group in a record)
# 6: Q_WAIT_WANT (what sleeping dequeuers want; older clients would not keep it)
# 7: queue blocks of 160 words: the enqueue-to-dequeue wait (Q_WAIT_US, Q_WAIT_HIST)
# 8: entries that wait (the DUE array after GROUP, Q_N_WAITING, Q_NEXT_DUE_US, H_DB_CLOCK_US)
# 9: Q_INBOX (the SQL inbox's entries waiting for the queue, as the pump counted them)
# 10: Q_SQL_PUTS (slots reserved for SQL producers; the pump reserves nothing while any is)
LAYOUT_VERSION = 10
MAGIC = 0x52494E47_51534543  # "RINGQSEC"

MAX_QUEUES = 128
MAX_CLIENTS = 1024
SLOT_POOL = 1 << 23  # slots across all queues in one section (8,388,608)
MAX_CAPACITY = 1 << 22  # slots in one queue (4,194,304)
# Bytes of payload cache across all queues (sparse: only the records written
# take memory). Each cached slot holds a record of cache_stride(cache_payload) bytes.
CACHE_POOL = 1 << 29  # 512 MiB
CACHE_PRODUCER_BYTES = 64  # an entry whose producer name is longer is not cached
GROUP_BYTES = 128  # a group name's UTF-8 bytes at most (ringq.engine.Session.enqueue(group=))
HIST_BUCKETS = 32  # latency histogram: bucket b holds [2**(b-1), 2**b) microseconds

PAGE = 4096

# -- header words --------------------------------------------------------------
H_MAGIC = 0
H_LAYOUT = 1
H_SIZE = 2
H_GENERATION = 3  # random at creation: tells a re-created section apart
H_NEXT_BASE = 4  # pool allocator: first unused slot (a multiple of 64)
H_CREATED_NS = 5
H_MONITOR_PID = 6
H_MONITOR_BEAT_NS = 7
H_READY = 8  # 1 once fully initialised
H_NEXT_CACHE = 9  # cache pool allocator: first unused byte (a multiple of 64)
# The database history the section describes: the cluster's system identifier
# (0 if unreadable) and timeline, set by the first client after creation. A
# client connected to a server of another history (a promoted standby, a
# restored backup on a new timeline) replaces the section, which is then
# rebuilt from that server's rows (Section.follow_history).
H_DB_SYSID = 10
H_DB_TIMELINE = 11
# The database's clock, as this host estimates it: the database's time (us
# since the epoch) minus time.monotonic_ns() // 1000 when a statement's
# answer stamped it (clock_timestamp() or now(), so the estimate is never
# ahead of the database). Due times are compared with it, never with the
# host's wall clock: a clock change on the host releases nothing early
# (CLOCK_MONOTONIC is one clock for every process of the host). 0: unknown.
H_DB_CLOCK_US = 12
HEADER_WORDS = 64

# -- queue block words ------------------------------------------------------------
Q_QID = 0  # ringq.queues.id; 0 = unused block
Q_STATE = 1  # QS_*
Q_CAPACITY = 2
Q_BASE = 3  # first slot of this queue in the pool (a multiple of 64)
Q_HEAD = 4  # next sequence number to reserve
Q_TAIL = 5  # oldest sequence number not yet reclaimed
Q_MAX_PAYLOAD = 6
Q_POLICY = 7  # 0 block, 1 raise
Q_MODE = 8  # 0 single dequeuer, 1 shared
Q_FULL_TIMEOUT_MS = 9
Q_MAX_DELIVERIES = 10
Q_WAIT_READY = 11  # dequeuers sleeping on the ready semaphore
Q_WAIT_SPACE = 12  # enqueuers sleeping on the space semaphore
Q_LOCK_HOLDER = 13  # pid inside the queue's critical section, 0 outside
Q_LOADED_NS = 14
Q_N_ENQ = 15  # enqueue calls (reservations)
Q_N_DEQ = 16  # dequeue calls that returned an entry
Q_N_ENQ_COMMIT = 17
Q_N_DEQ_COMMIT = 18
Q_N_ENQ_ROLLBACK = 19
Q_N_DEQ_ROLLBACK = 20  # = delivery retries
Q_N_POISONED = 21
Q_N_FULL = 22  # enqueue calls that found the queue full
Q_N_EMPTY = 23  # dequeue calls that found nothing ready
Q_N_REPAIRS = 24  # section entries corrected from the rows
Q_FULL_SINCE_NS = 25  # monotonic ns when the queue became full, 0 if not full
Q_FULL_NS = 26  # total ns spent full (closed periods)
Q_ENQ_LAT_NS = 27  # sum of enqueue call latencies (ns)
Q_DEQ_LAT_NS = 28
Q_N_WAKEUPS = 29  # posts on the ready semaphore
Q_N_RESYNC = 30  # full re-reads of the queue from its table
Q_DEQ_OWNER = 31  # single mode: owner token holding the dequeuer role, 0 if none
Q_DEQ_INFLIGHT = 32  # single mode: entries that owner has dequeued and not finished
Q_DEPTH_HINT = 33  # committed ready entries (approximate between resyncs; exact under the lock)
Q_LEASE_MS = 34  # ringq.queues.lease in ms: a dequeued entry held longer ends its session (0: none)
# The payload cache (see CACHE_* below): payload bytes a slot's record holds
# (0: no cache), the record size, where the queue's records start in the pool
# and how many bytes it has there (kept in a dropped block, for reuse).
Q_CACHE_PAYLOAD = 35
Q_CACHE_STRIDE = 36
Q_CACHE_BASE = 37
Q_CACHE_AREA = 38
# Bumped whenever the queue's bits are loaded from the rows (load, resync,
# rebuild): records written before no longer match and are read from the row.
Q_CACHE_EPOCH = 39
Q_N_CACHE_HITS = 40  # dequeues served from the cache
Q_N_CACHE_MISSES = 41  # dequeues of a cached queue that read the row
# 1 once an entry with a group was reserved in (or loaded into) the block: its
# claims then keep one entry per group held (until the next load, which
# sets it from the rows). Ungrouped queues keep the plain scan.
Q_GROUPED = 42
Q_N_GROUP_SKIPS = 43  # ready entries a claim passed over because their group was busy
# Entries the dequeuers sleeping on the ready semaphore want, summed (each
# adds its batch size with Q_WAIT_READY): a commit wakes as many waiters as
# its new ready entries make work for, not all of them.
Q_WAIT_WANT = 44
# Sum (us) of the waits Q_WAIT_HIST counts: an entry's enqueue (its row's
# enq_at) to the commit of the dequeue that consumed it.
Q_WAIT_US = 45
# Entries that wait for their due time (a delay, or a retry's backoff):
# committed, but neither ready nor done: ENQ, DEQ and LCK clear inside the
# window, their due time (the database's clock, us) in the DUE array. How
# many there are, and the earliest due time among them (0: none); a claim
# releases (sets ENQ) those due once the database's clock passes
# Q_NEXT_DUE_US, so a queue with none pays one word read per claim.
Q_N_WAITING = 46
Q_NEXT_DUE_US = 47
# single mode, SQL consumers: until this monotonic ns (0: never) a linked
# dequeuer that finds the dequeuer role free leaves it for the SQL path, whose
# agent asked for it while a linked dequeuer held it (turns between the kinds;
# short, so an agent that dies holds nobody back for long).
Q_SQL_ASKS_ROLE_NS = 48
# Entries SQL producers put on (ringq.enqueue) still waiting in ringq.inbox
# for the queue, as the monitor's inbox pump last counted them (at the end of
# each pass; 0 when it drained them): Session.stats()'s "inbox", included in
# its "depth", as ringq.depth() includes them.
Q_INBOX = 49
# Slots the SQL agent holds reserved for SQL producers (owner OWNER_SQL,
# neither bit: no entry published yet), kept under the queue's lock by the
# agent (and set by a load). While any is, the inbox's pump reserves nothing
# in the queue: entries it moved would get seqs past slots a producer's later
# puts may still fill (Session.behind_sql_puts).
Q_SQL_PUTS = 50
Q_ENQ_HIST = 64  # HIST_BUCKETS words
Q_DEQ_HIST = 96  # HIST_BUCKETS words
# HIST_BUCKETS words, bucketed as the call latencies: the waits of consumed
# entries, counted when their dequeue commits (not the calls: the entries).
Q_WAIT_HIST = 128
QUEUE_WORDS = 160

QS_UNUSED = 0
QS_READY = 1
QS_DROPPED = 2

NAME_BYTES = 64

# -- client words -----------------------------------------------------------------
# Each entry is written only by its own process (one session = one entry);
# the monitor reads them. Counters are cumulative for the entry's life.
C_PID = 0  # 0 = free entry
C_BACKEND_PID = 1
C_STATE = 2  # CS_*
# registration time, rewritten when the client reconnects (it bounds the backend's start)
C_STARTED_NS = 3
C_N_ENQ = 4
C_N_DEQ = 5
C_N_COMMIT = 6
C_N_ROLLBACK = 7
C_N_ERRORS = 8  # errors the client hit (ERR_*), bumped after the last-error words are written
C_BEAT_NS = 9
C_ROLE = 10  # CR_*
C_ERR_GEN = 11  # last-error record generation: odd while being written (a seqlock for readers)
C_ERR_CODE = 12  # ERR_* of the last error
C_ERR_QID = 13  # its queue id (0: none)
C_ERR_SEQ = 14  # its sequence number (-1: none)
C_ERR_NS = 15  # its wall-clock time (time.time_ns())
C_QUEUES = 16  # C_QUEUE_WORDS words: bit i set = the client used queue block i
C_QUEUE_WORDS = 2  # MAX_QUEUES bits
# Worker counters (role CR_WORKER), written by the worker process after each message.
C_W_HANDLED = 18  # committed (declines included)
C_W_DECLINED = 19
C_W_FAILED = 20  # rolled back: the action raised, or the commit failed
C_W_TIMEOUTS = 21
C_W_ABORTED = 22
C_W_POISONED = 23
C_W_IN_DOUBT = 24
C_W_BUSY_NS = 25  # time spent handling messages (ns)
# Registration time (time.time_ns()), never rewritten: with the index and pid it
# names one session across its reconnects. A spare word of version 2 (offsets
# unchanged): entries registered by older code read 0 here, still stable.
C_REGISTERED_NS = 26
# Owner tokens. A locked slot's OWNER word names the session that holds it by a
# token unique per (entry, connection): token_of(cidx, gen). C_GEN is bumped at
# every registration and every reconnect, and is kept when the entry is freed,
# so a token is never handed out again while slots may still carry it (until
# the generation wraps, after TOKEN_GENS uses of one entry). A slot whose token
# is not the current one of a live entry is orphaned: recovery decides it once
# the slot's HOLDER backend has ended.
C_GEN = 27
C_TOKEN = 28  # the entry's current token; 0 while free
# time.monotonic_ns() when the session dequeued the first entry of its current
# transaction, 0 when it holds none; the monitor ends a session that holds one
# past its queue's lease (Q_LEASE_MS), and then writes -1 here if that transaction
# rolled back. Spare word of version 2, 0 in older code.
C_HOLD_SINCE_NS = 29
CLIENT_WORDS = 32

# Client roles (C_ROLE).
CR_CLIENT = 0  # a program's own session
CR_WORKER = 1  # a ringq worker (ringq.worker)
CR_MONITOR = 2  # the monitor's own session (its inbox pump)

# Client error codes (C_ERR_CODE); their names are in ringq.engine.metrics.
ERR_NONE = 0
ERR_QUEUE_FULL = 1  # seq: the sequence the enqueue would have taken
ERR_PAYLOAD_TOO_LARGE = 2  # seq: none
ERR_ROW_MISMATCH = 3  # a guarded row update found another row: the section was stale (repaired)
ERR_IN_DOUBT = 4  # a commit's answer was lost and the outcome could not be read back
ERR_COMMIT_FAILED = 5  # the server refused the commit (or the connection died and it rolled back)
ERR_DATABASE = 6  # PostgreSQL failed a queue statement (enqueue, dequeue)
ERR_CONNECTION_LOST = 7  # the connection died under a queue statement or a commit

CS_FREE = 0
CS_ACTIVE = 1
OWNER_HELD = -1  # slot of a prepared transaction whose session is gone: recovery decides
# Slot set aside for SQL consumers (ringq.offers): the section's agent (the
# monitor) decides it from the rows; recovery never does (no client holds it).
OWNER_SQL = -2

CS_IN_DOUBT = 2  # lost its connection with slots held: the rows decide (monitor)

# generations before tokens of one entry repeat (int32 OWNER)
TOKEN_GENS = (2**31 - 1) // MAX_CLIENTS


# -- payload cache records ----------------------------------------------------------------
# A record is int64 words, then the producer name, the group, then the payload. It is
# trusted only while its slot is locked by the dequeuer reading it, its tag
# is the entry's seq + 1 and its epoch the queue's Q_CACHE_EPOCH; it is written
# under the queue lock by the session whose commit made the entry, before the
# ENQ bit is set, and its tag is cleared when a dequeue of it does not commit.
R_TAG = 0  # seq + 1 of the entry held; 0: none
R_EPOCH = 1
R_LEN = 2  # payload bytes
R_PRODUCER_LEN = 3
R_PRODUCER_SEQ = 4
R_ENQ_AT_US = 5  # the row's enq_at, microseconds since the epoch (UTC)
R_GROUP_LEN = 6  # the group's UTF-8 bytes; -1: no group
RECORD_WORDS = 7
RECORD_GROUP = RECORD_WORDS * 8 + CACHE_PRODUCER_BYTES  # where the group's bytes start
RECORD_HEAD = RECORD_GROUP + GROUP_BYTES  # bytes before the payload


def cache_stride(cache_payload: int) -> int:
    """Bytes of one slot's cache record for ``cache_payload`` payload bytes (0: no record)."""
    if cache_payload <= 0:
        return 0
    return RECORD_HEAD + (cache_payload + 7) // 8 * 8


def token_of(cidx: int, gen: int) -> int:
    """The owner token of client entry ``cidx`` at generation ``gen`` (> 0, an int32)."""
    return cidx + 1 + MAX_CLIENTS * (gen % TOKEN_GENS)


def token_client(token: int) -> int:
    """The client entry a token (> 0) belongs to."""
    return (token - 1) % MAX_CLIENTS


def _round(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


OFF_HEADER = 0
OFF_QUEUES = _round(HEADER_WORDS * 8)
OFF_NAMES = OFF_QUEUES + _round(MAX_QUEUES * QUEUE_WORDS * 8)
OFF_CLIENTS = OFF_NAMES + _round(MAX_QUEUES * NAME_BYTES)
BITMAP_WORDS = SLOT_POOL // 64
OFF_ENQ = OFF_CLIENTS + _round(MAX_CLIENTS * CLIENT_WORDS * 8)
OFF_DEQ = OFF_ENQ + _round(BITMAP_WORDS * 8)
OFF_LCK = OFF_DEQ + _round(BITMAP_WORDS * 8)
OFF_OWNER = OFF_LCK + _round(BITMAP_WORDS * 8)
# HOLDER: the backend pid of the connection whose transaction holds a locked
# slot, written with OWNER; recovery waits for that backend to end.
OFF_HOLDER = OFF_OWNER + _round(SLOT_POOL * 4)
# GROUP: the tag of a slot's entry's group (ringq.engine._ring.group_tag; 0: none),
# written with the reservation (or from the rows at a load).
OFF_GROUP = OFF_HOLDER + _round(SLOT_POOL * 4)
# DUE: a waiting slot's due time (the database's clock, us since the epoch);
# meaningful only while the slot waits (ENQ, DEQ, LCK clear inside the window).
OFF_DUE = OFF_GROUP + _round(SLOT_POOL * 8)
OFF_CACHE = OFF_DUE + _round(SLOT_POOL * 8)
SECTION_SIZE = OFF_CACHE + CACHE_POOL
