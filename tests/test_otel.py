"""OpenTelemetry spans (the ``otel`` extra), recorded by the SDK's in-memory exporter.

With a tracer provider set, enqueue, dequeue, commit and rollback make spans
with the queue, the sequences and the delivery count; the entry carries its
producer span's context (a W3C traceparent in the ring row's ``trace``
column, beside the payload), and a dequeue's span links to it, whether the
entry came from the payload cache's queue or not, one at a time or in a
batch; a worker's action runs in a span that is the producer's child.
Without a provider, or without the API (the guard patched), nothing is
recorded and the sessions work as before.

The provider is the API's global, set for each test by patching it (never
``set_tracer_provider``, which takes one provider per process), so that no
other test module runs with tracing on.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from conftest import enqueue_committed, present
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from psycopg import sql
from ringq.engine import (
    InvalidArgument,
    Message,
    PayloadTooLarge,
    SchemaMissing,
    Session,
    connect,
    connect_async,
    process_span,
    queue_table,
)
from ringq.engine import layout as L
from ringq.engine.session import _otel
from ringq.scripting import create_schema
from ringq.worker import Actions, AsyncWorker, Worker

_EXPORTER = InMemorySpanExporter()
_PROVIDER = TracerProvider()
_PROVIDER.add_span_processor(SimpleSpanProcessor(_EXPORTER))


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on for this test: the in-memory exporter (emptied)."""
    monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", _PROVIDER)
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def one(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    found = named(exporter, name)
    assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
    return found[0]


def attrs(span: ReadableSpan) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in (span.attributes or {}).items()}


def message_attrs(queue: str, op_type: str, op_name: str, seq: int) -> dict[str, Any]:
    """The attributes every span about one message of ``queue`` has (the
    messaging conventions' and ``ringq.seq``); a kind's own are added to them."""
    return {
        "messaging.system": "ringq", "messaging.destination.name": queue,
        "messaging.operation.type": op_type, "messaging.operation.name": op_name,
        "messaging.message.id": str(seq), "ringq.seq": seq,
    }


def linked(span: ReadableSpan) -> list[tuple[int, int]]:
    """(trace id, span id) of each link of ``span``."""
    return [(link.context.trace_id, link.context.span_id) for link in span.links]


def ids(span: ReadableSpan) -> tuple[int, int]:
    ctx = present(span.context)
    return ctx.trace_id, ctx.span_id


def traceparent_of(span: ReadableSpan) -> str:
    ctx = present(span.context)
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def hits_misses(s: Session, queue: str) -> tuple[int, int]:
    ring = s.ring(queue)
    return (s.section.queues[ring.qb + L.Q_N_CACHE_HITS],
            s.section.queues[ring.qb + L.Q_N_CACHE_MISSES])


def test_enqueue_commit_dequeue_commit_make_spans_and_the_dequeue_links_to_the_producer(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    q = make_queue(capacity=8)
    with connect(dsn) as p:
        seq = p.enqueue(q, b"hello")
        p.commit()
    send = one(spans, f"enqueue {q}")
    assert send.kind == SpanKind.PRODUCER
    assert attrs(send) == message_attrs(q, "send", "enqueue", seq)
    commit = one(spans, "commit")
    assert commit.kind == SpanKind.CLIENT
    assert attrs(commit) == {
        "messaging.system": "ringq", "messaging.operation.type": "settle",
        "messaging.operation.name": "commit", "messaging.destination.name": q,
        "messaging.batch.message_count": 1, "ringq.seqs": [seq], "ringq.enqueued": 1,
        "ringq.dequeued": 0, "ringq.queues": [q],
    }
    spans.clear()
    with connect(dsn) as c:
        msg = present(c.dequeue(q))
        assert msg.payload == b"hello" and msg.trace == traceparent_of(send)
        assert hits_misses(c, q) == (0, 1)  # an entry with a trace context is read from its row
        c.commit()
    receive = one(spans, f"dequeue {q}")
    assert receive.kind == SpanKind.CONSUMER
    assert attrs(receive) == message_attrs(q, "receive", "dequeue", seq) | {"ringq.deliveries": 1}
    assert linked(receive) == [ids(send)]
    assert receive.context is not None and receive.context.trace_id != ids(send)[0]
    assert attrs(one(spans, "commit"))["ringq.dequeued"] == 1


def test_rollback_makes_a_span_and_the_redelivery_counts_and_still_links(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    q = make_queue(capacity=8)
    (seq,) = enqueue_committed(dsn, q, b"x")
    send = one(spans, f"enqueue {q}")
    spans.clear()
    with connect(dsn) as c:
        assert present(c.dequeue(q)).deliveries == 1
        c.rollback()
        rollback = one(spans, "rollback")
        assert attrs(rollback)["ringq.seqs"] == [seq]
        assert attrs(rollback)["ringq.dequeued"] == 1
        assert attrs(rollback)["messaging.operation.type"] == "settle"
        spans.clear()
        again = present(c.dequeue(q))
        c.commit()
    assert again.deliveries == 2 and again.trace == traceparent_of(send)
    receive = one(spans, f"dequeue {q}")
    assert attrs(receive)["ringq.deliveries"] == 2
    assert linked(receive) == [ids(send)]


@pytest.mark.parametrize("cache_payload", [0, 64], ids=["uncached-queue", "cached-queue"])
def test_dequeue_many_links_each_entry_to_its_producer(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter, cache_payload: int
) -> None:
    """Two producer spans (a batch of three, then one entry under a parent
    span of the caller's): one dequeue_many span with four links. In a queue
    with a payload cache the entries were not cached (they carry a context)."""
    q = make_queue(capacity=16, cache_payload=cache_payload)
    tracer = _PROVIDER.get_tracer("test")
    with connect(dsn) as p:
        first = p.enqueue_many(q, [b"a", b"b", b"c"])
        p.commit()
        with tracer.start_as_current_span("request") as request:
            second = p.enqueue(q, b"d")
            p.commit()
    batch, single = one(spans, f"enqueue_many {q}"), one(spans, f"enqueue {q}")
    assert attrs(batch)["messaging.batch.message_count"] == 3
    assert attrs(batch)["ringq.seqs"] == first
    assert present(single.parent).span_id == request.get_span_context().span_id
    spans.clear()
    with connect(dsn) as c:
        msgs = c.dequeue_many(q, 10)
        if cache_payload:
            assert hits_misses(c, q) == (0, 4)
        c.commit()
    assert [m.seq for m in msgs] == [*first, second]
    receive = one(spans, f"dequeue_many {q}")
    assert attrs(receive)["messaging.batch.message_count"] == 4
    assert attrs(receive)["ringq.seqs"] == [*first, second]
    assert attrs(receive)["ringq.deliveries"] == [1, 1, 1, 1]
    assert linked(receive) == [ids(batch)] * 3 + [ids(single)]
    assert [link.attributes["ringq.seq"] for link in receive.links if link.attributes] == [
        *first, second]


def test_a_cached_entry_has_no_trace_and_a_traced_one_in_the_same_queue_is_read_from_its_row(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry enqueued while tracing is off is cached (its dequeue sends
    nothing before the commit) and carries nothing; one enqueued with an
    explicit trace context (tracing off too) is not, and gives it back."""
    q = make_queue(capacity=8)
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with connect(dsn) as p:
        p.enqueue(q, b"plain")
        p.enqueue(q, b"traced", trace=given)
        p.commit()
    with connect(dsn) as c:
        plain, traced = present(c.dequeue(q)), present(c.dequeue(q))
        assert hits_misses(c, q) == (1, 1)
        c.commit()
    assert (plain.payload, plain.trace) == (b"plain", None)
    assert (traced.payload, traced.trace) == (b"traced", given)


def test_the_link_of_a_cached_queues_entry_with_a_given_context(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    """A context given by the caller (one carried from elsewhere) is what the
    entry carries, and what the dequeue's span links to; the enqueue's own
    span is made still."""
    q = make_queue(capacity=8)
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with connect(dsn) as p:
        p.enqueue(q, b"moved", trace=given)
        p.commit()
    assert one(spans, f"enqueue {q}")
    with connect(dsn) as c:
        msg = present(c.dequeue(q))
        c.commit()
    assert msg.trace == given
    assert linked(one(spans, f"dequeue {q}")) == [
        (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)]


def test_a_reused_slot_carries_no_earlier_entrys_context(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    """Every row write of an enqueue sets the trace column (NULL when none):
    a slot whose earlier entry carried a context does not hand it on, whichever
    statement writes it (alone, in a transaction, a batch, a keyed one)."""
    q = make_queue(capacity=2, cache_payload=0)
    tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    got: list[Message] = []
    with connect(dsn) as s:

        def traced_lap() -> None:
            s.enqueue_many(q, [b"t", b"t"], trace=tp)
            s.commit()
            assert [m.trace for m in s.dequeue_many(q, 2)] == [tp, tp]
            s.commit()

        def take() -> None:
            got.extend(s.dequeue_many(q, 2))
            s.commit()

        traced_lap()
        s.enqueue(q, b"alone")  # slot 0, the whole transaction: enqueue_alone
        s.commit()
        s.execute("SELECT 1")  # slot 1, in an open transaction: enqueue
        s.enqueue(q, b"in-txn")
        s.commit()
        take()
        traced_lap()
        s.enqueue_many(q, [b"batch-1", b"batch-2"])  # enqueue_many
        s.commit()
        take()
        traced_lap()
        s.enqueue(q, b"keyed", key="k")  # enqueue_key
        s.enqueue(q, b"due", delay=0.0)  # enqueue_due
        s.commit()
        take()
    assert [(m.payload, m.trace) for m in got] == [
        (b"alone", None), (b"in-txn", None), (b"batch-1", None), (b"batch-2", None),
        (b"keyed", None), (b"due", None)]


def test_the_trace_context_is_not_counted_against_max_payload(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    q = make_queue(capacity=8, max_payload=16)
    payload = b"p" * 16
    with connect(dsn) as s:
        s.enqueue(q, payload)
        s.enqueue(q, payload, key="k-1")  # written at once, with its context
        s.enqueue_many(q, [payload, payload])
        with pytest.raises(PayloadTooLarge):
            s.enqueue(q, payload + b"!")
        s.commit()
        msgs = s.dequeue_many(q, 10)
        s.commit()
    assert [m.payload for m in msgs] == [payload] * 4
    assert all(m.trace is not None and len(m.trace) == 55 for m in msgs)
    with connect(dsn) as s:
        with pytest.raises(InvalidArgument):
            s.enqueue(q, b"x", trace="\n" * 10)
        with pytest.raises(InvalidArgument):
            s.enqueue(q, b"x", trace="0" * 513)


def assert_chained_process_span(
    spans: InMemorySpanExporter, send: ReadableSpan, a: str, b: str, seq: int
) -> None:
    """A worker's action on entry ``seq`` of ``a`` (enqueued in span ``send``)
    ran in a CONSUMER span, the producer's child in its trace and linked to
    it, and the action's own enqueue into ``b`` is that span's child."""
    process = one(spans, f"process {a}")
    assert process.kind == SpanKind.CONSUMER
    assert present(process.parent).span_id == ids(send)[1]
    assert ids(process)[0] == ids(send)[0]  # the producer's trace
    assert linked(process) == [ids(send)]
    assert attrs(process) == message_attrs(a, "process", "process", seq) | {"ringq.deliveries": 1}
    chained = one(spans, f"enqueue {b}")
    assert present(chained.parent).span_id == ids(process)[1]
    assert ids(chained)[0] == ids(send)[0]


def test_the_worker_runs_the_action_in_a_span_the_producers_child(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    a, b = make_queue(), make_queue()
    app = Actions()

    @app.action(a)
    def step(msg: Message, session: Session) -> None:
        session.enqueue(b, msg.payload + b"->next")  # chained: in the action's span

    (seq,) = enqueue_committed(dsn, a, b"order")
    send = one(spans, f"enqueue {a}")
    with Worker(app, dsn) as w:
        assert w.run_one(wait=5)
    assert_chained_process_span(spans, send, a, b, seq)


def test_a_failing_action_records_its_error_in_its_span(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    a = make_queue()
    app = Actions()

    @app.action(a)
    def step(msg: Message, session: Session) -> None:
        raise ValueError("no")

    enqueue_committed(dsn, a, b"order")
    with Worker(app, dsn) as w:
        w.run_one(wait=5)
    process = one(spans, f"process {a}")
    assert not process.status.is_ok
    assert [e.name for e in process.events] == ["exception"]
    assert one(spans, "rollback")


@pytest.mark.parametrize("how", ["no-provider", "no-api"])
def test_off_nothing_is_recorded_and_sessions_work(
    dsn: str, make_queue: Callable[..., str], monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Without a provider (the API's global unset) or without the API (the
    guard patched as if the import had failed): no span, no context carried,
    the cache serves as before, and a worker's action runs outside any span."""
    _EXPORTER.clear()
    if how == "no-api":
        monkeypatch.setattr(otel_trace, "_TRACER_PROVIDER", _PROVIDER)
        monkeypatch.setattr(_otel, "API", None)
    assert _otel.spans() is None
    q = make_queue(capacity=8)
    with connect(dsn) as s:
        s.enqueue(q, b"a")
        s.enqueue_many(q, [b"b", b"c"])
        s.commit()
        msgs = [present(s.dequeue(q)), *s.dequeue_many(q, 5)]
        assert hits_misses(s, q) == (3, 0)
        s.rollback()
        assert len(s.dequeue_many(q, 5)) == 3
        s.commit()
    assert [(m.payload, m.trace) for m in msgs] == [(b"a", None), (b"b", None), (b"c", None)]
    with process_span(msgs[0]) as span:
        assert span is None
    seen: list[object] = []
    app = Actions()

    @app.action(q)
    def step(msg: Message, session: Session) -> None:
        seen.append(otel_trace.get_current_span().get_span_context().is_valid)

    enqueue_committed(dsn, q, b"d")
    with Worker(app, dsn) as w:
        assert w.run_one(wait=5)
    assert seen == [False]
    assert _EXPORTER.get_finished_spans() == ()


def test_a_schema_without_the_trace_columns_is_refused_until_the_script_adds_them(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=4)
    with psycopg.connect(dsn) as conn:
        conn.execute(sql.SQL("ALTER TABLE {} DROP COLUMN trace").format(queue_table(q)))
        conn.execute("ALTER TABLE ringq.exceptions DROP COLUMN trace")  # as made by older code
    with pytest.raises(SchemaMissing, match="traces"):
        connect(dsn)
    with psycopg.connect(dsn) as conn:
        create_schema(conn)  # ringq db upgrade's schema block: the columns back, ring's too
    with connect(dsn) as s:
        s.enqueue(q, b"x", trace="00-" + "3" * 32 + "-" + "4" * 16 + "-01")
        s.commit()
        assert present(s.dequeue(q)).trace == "00-" + "3" * 32 + "-" + "4" * 16 + "-01"
        s.commit()


def test_the_async_face_makes_the_same_spans_and_links(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    """enqueue, commit, dequeue_many, rollback and dequeue of the asyncio
    face: the sync face's spans, the dequeue linked to the producer."""
    q = make_queue(capacity=8)

    async def run() -> tuple[int, list[Message], Message | None]:
        async with await connect_async(dsn) as s:
            seq = await s.enqueue(q, b"hello")
            await s.commit()
            got = await s.dequeue_many(q, 4)
            await s.rollback()
            again = await s.dequeue(q)
            await s.commit()
        return seq, got, again

    seq, got, again = asyncio.run(run())
    send = one(spans, f"enqueue {q}")
    assert send.kind == SpanKind.PRODUCER and attrs(send)["ringq.seq"] == seq
    assert [m.seq for m in got] == [seq] and got[0].trace == traceparent_of(send)
    receive = one(spans, f"dequeue_many {q}")
    assert receive.kind == SpanKind.CONSUMER and linked(receive) == [ids(send)]
    assert attrs(one(spans, "rollback"))["ringq.seqs"] == [seq]
    assert again is not None and again.deliveries == 2 and again.trace == traceparent_of(send)
    redelivered = one(spans, f"dequeue {q}")
    assert attrs(redelivered)["ringq.deliveries"] == 2 and linked(redelivered) == [ids(send)]
    assert [attrs(c)["ringq.seqs"] for c in named(spans, "commit")] == [[seq], [seq]]


def test_the_async_workers_action_runs_in_a_span_the_producers_child(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    """``ringq worker --concurrency``'s consumers: an async action runs in the
    process span, made current, so that its own enqueue is the span's child."""
    a, b = make_queue(), make_queue()
    app = Actions()

    @app.action(a)
    async def step(msg: Message, session: Any) -> None:
        await session.enqueue(b, msg.payload + b"->next")

    (seq,) = enqueue_committed(dsn, a, b"order")
    send = one(spans, f"enqueue {a}")
    assert AsyncWorker(app, dsn, concurrency=2).run(max_messages=1) == 1
    assert_chained_process_span(spans, send, a, b, seq)


def test_the_async_enqueue_many_makes_one_span_each_entry_carries(
    dsn: str, make_queue: Callable[..., str], spans: InMemorySpanExporter
) -> None:
    q = make_queue(capacity=8)

    async def run() -> tuple[list[int], list[Message]]:
        async with await connect_async(dsn) as s:
            seqs = await s.enqueue_many(q, [b"a", b"b", b"c"])
            await s.commit()
            got = await s.dequeue_many(q, 8)
            await s.commit()
        return seqs, got

    seqs, got = asyncio.run(run())
    send = one(spans, f"enqueue_many {q}")
    assert send.kind == SpanKind.PRODUCER and attrs(send)["ringq.seqs"] == seqs
    assert [m.seq for m in got] == seqs
    assert [m.trace for m in got] == [traceparent_of(send)] * 3
    assert linked(one(spans, f"dequeue_many {q}")) == [ids(send)] * 3  # a link per entry


# Run in a fresh interpreter where ``import opentelemetry`` fails, as it does
# without the extra: the engine, both faces and the worker must work, and no
# module of the API may be imported on the way.
_WITHOUT_THE_EXTRA = textwrap.dedent("""
    import asyncio, importlib.abc, sys

    class NoOtel(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "opentelemetry" or name.startswith("opentelemetry."):
                raise ImportError("the otel extra is not installed")
            return None

    sys.meta_path.insert(0, NoOtel())
    from ringq.engine import connect, connect_async, process_span
    from ringq.engine.session import _otel
    from ringq.worker import Actions, Worker

    dsn, q = sys.argv[1], sys.argv[2]
    assert _otel.API is None and _otel.spans() is None
    with connect(dsn) as s:
        s.enqueue(q, b"a")
        s.enqueue_many(q, [b"b"])
        s.commit()
        m = s.dequeue(q)
        s.commit()
    assert m.payload == b"a" and m.trace is None
    with process_span(m) as span:
        assert span is None

    async def face():
        async with await connect_async(dsn) as s:
            got = await s.dequeue_many(q, 4)
            await s.enqueue(q, b"c")
            await s.commit()
        return got

    assert [x.payload for x in asyncio.run(face())] == [b"b"]
    seen = []
    app = Actions()

    @app.action(q)
    def step(msg, session):
        seen.append(msg.payload)

    with Worker(app, dsn) as w:
        assert w.run_one(wait=5)
    assert seen == [b"c"], seen
    loaded = sorted(n for n in sys.modules if n.split(".")[0] == "opentelemetry")
    assert not loaded, loaded
    print("ok")
""")


def test_without_the_extra_nothing_of_it_is_imported_and_everything_works(
    dsn: str, make_queue: Callable[..., str]
) -> None:
    q = make_queue(capacity=8)
    done = subprocess.run([sys.executable, "-c", _WITHOUT_THE_EXTRA, dsn, q],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"
