"""OpenTelemetry spans of queue operations: the ``otel`` extra (``pip install ringq[otel]``).

The hooks both faces call (the sync :class:`~._session.Session` now, the
asyncio face alike): :func:`spans` says whether to trace at all (None: off),
and its :class:`Spans` gives one context manager per kind of call. None of
them makes its span current, so they work the same around a blocking call
and around an ``await``::

    sp = spans()
    if sp is None:
        return plain_call()
    with sp.enqueue(queue, "enqueue") as s:  # a PRODUCER span, started now
        s.seqs = [reserve(..., trace=trace or s.traceparent)]  # the entry carries it
    with sp.dequeue(queue, "dequeue") as s:  # a CONSUMER span, made at exit
        s.messages = [...]  # each message's ``trace`` becomes a link
    with sp.settle("commit", ops):  # commit and rollback: the entries they end
        ...

and :func:`process_span` runs a worker's action inside a span that is its
entry's producer's child (and links to it), made current so that what the
action does (its own spans, its enqueues) joins the trace.

Off costs nothing but the guard: the ``opentelemetry`` API is imported once,
here, if installed (nothing is imported without it), and :func:`spans`
reads one attribute, whether a tracer provider was set (the API's global;
its ``get_tracer_provider()`` would make a call and hand back a proxy):
35-41 ns a call, measured, beside ~5.9 us of engine time per enqueue call
(bench/bench_otel.py). A provider set after sessions opened is picked up
at their next call.

The trace context travels with the entry as a W3C ``traceparent`` (its own
column of the ring row, not counted against ``max_payload``). An entry that
carries one is not put in the payload cache, so its dequeue reads it from
the row (a traced consumer pays the row read a cached dequeue saves).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import ModuleType
from typing import TYPE_CHECKING, Any

from ..ring import Item, Op, OpKind

if TYPE_CHECKING:
    from ._message import Message

API: ModuleType | None
try:  # once, at import: without the extra nothing more is imported, ever
    from opentelemetry import trace as _api
except ImportError:  # pragma: no cover - the extra installed in the tests
    API = None
else:
    API = _api
    if "OTEL_PYTHON_TRACER_PROVIDER" in os.environ:
        _api.get_tracer_provider()  # a provider the environment names is set on first use

SYSTEM = "ringq"
TRACER_NAME = "ringq"

# the attribute names (messaging semantic conventions, and ringq's own)
A_SYSTEM = "messaging.system"
A_DESTINATION = "messaging.destination.name"
A_OPERATION_TYPE = "messaging.operation.type"
A_OPERATION_NAME = "messaging.operation.name"
A_MESSAGE_ID = "messaging.message.id"
A_BATCH_COUNT = "messaging.batch.message_count"
A_SEQ = "ringq.seq"
A_SEQS = "ringq.seqs"
A_DELIVERIES = "ringq.deliveries"
A_QUEUES = "ringq.queues"
A_ENQUEUED = "ringq.enqueued"
A_DEQUEUED = "ringq.dequeued"

def spans() -> Spans | None:
    """The hooks, or None: tracing is off (the API is not installed, or no
    tracer provider is set). What a face checks on every call."""
    api = API
    if api is None or api._TRACER_PROVIDER is None:
        return None
    return _SPANS


def traceparent(ctx: Any) -> str | None:
    """A span context as a W3C ``traceparent`` (None: not valid)."""
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def span_context(trace: str | None) -> Any:
    """The remote span context a ``traceparent`` names (None: none, or not one)."""
    if not trace or API is None:
        return None
    parts = trace.split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3][:2], 16)
    except ValueError:
        return None
    ctx = API.SpanContext(trace_id, span_id, is_remote=True,
                          trace_flags=API.TraceFlags(flags & 0xFF))
    return ctx if ctx.is_valid else None


class Spans:
    """Context managers for each kind of queue call (see the module's text)."""

    def __init__(self) -> None:
        assert API is not None
        self.tracer = API.get_tracer(TRACER_NAME)  # a proxy: follows the provider once set

    def enqueue(self, queue: str, operation: str) -> Sending:
        """A PRODUCER span over an enqueue of ``queue``; its context is what
        the entries carry (``traceparent``); set ``seqs`` before the exit."""
        return Sending(self.tracer, queue, operation)

    def dequeue(self, queue: str, operation: str) -> Receiving:
        """A CONSUMER ``receive`` span over a dequeue of ``queue``, made at
        the exit (with its start time) so that it links to each message's
        producer; set ``messages`` before the exit."""
        return Receiving(self.tracer, queue, operation)

    def settle(self, operation: str, items: Sequence[Item]) -> Settling:
        """A CLIENT ``settle`` span over a commit or rollback of ``items`` (the
        session's ops in flight, read now: the call clears them)."""
        return Settling(self.tracer, operation, items)


class _Call:
    """What every span of a call has: its tracer, and the error it raised."""

    __slots__ = ("tracer",)

    def __init__(self, tracer: Any) -> None:
        self.tracer = tracer

    @staticmethod
    def _failed(span: Any, exc: BaseException | None) -> None:
        if exc is not None:
            span.record_exception(exc)
            assert API is not None
            span.set_status(API.Status(API.StatusCode.ERROR, type(exc).__name__))


class Sending(_Call):
    """An enqueue's span (``with``): ``traceparent`` for the row, ``seqs`` for the span."""

    __slots__ = ("seqs", "span", "traceparent")

    def __init__(self, tracer: Any, queue: str, operation: str) -> None:
        super().__init__(tracer)
        assert API is not None
        self.span = tracer.start_span(
            f"{operation} {queue}", kind=API.SpanKind.PRODUCER,
            attributes={A_SYSTEM: SYSTEM, A_DESTINATION: queue,
                        A_OPERATION_TYPE: "send", A_OPERATION_NAME: operation},
        )
        self.traceparent = traceparent(self.span.get_span_context())
        self.seqs: Sequence[int] = ()

    def __enter__(self) -> Sending:
        return self

    def __exit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        span, seqs = self.span, list(self.seqs)
        if len(seqs) == 1:
            span.set_attribute(A_MESSAGE_ID, str(seqs[0]))
            span.set_attribute(A_SEQ, seqs[0])
        elif seqs:
            span.set_attribute(A_BATCH_COUNT, len(seqs))
            span.set_attribute(A_SEQS, seqs)
        self._failed(span, exc)
        span.end()


class Receiving(_Call):
    """A dequeue's span (``with``): made at the exit, with the messages' links."""

    __slots__ = ("messages", "operation", "queue", "start_ns")

    def __init__(self, tracer: Any, queue: str, operation: str) -> None:
        super().__init__(tracer)
        self.queue, self.operation = queue, operation
        self.messages: Sequence[Message] = ()
        self.start_ns = time.time_ns()

    def __enter__(self) -> Receiving:
        return self

    def __exit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        assert API is not None
        msgs = [m for m in self.messages if m is not None]
        attributes: dict[str, Any] = {
            A_SYSTEM: SYSTEM, A_DESTINATION: self.queue,
            A_OPERATION_TYPE: "receive", A_OPERATION_NAME: self.operation,
        }
        if len(msgs) == 1:
            m = msgs[0]
            attributes.update({A_MESSAGE_ID: str(m.seq), A_SEQ: m.seq,
                               A_DELIVERIES: m.deliveries})
        elif msgs or self.operation.endswith("_many"):
            attributes.update({A_BATCH_COUNT: len(msgs), A_SEQS: [m.seq for m in msgs],
                               A_DELIVERIES: [m.deliveries for m in msgs]})
        span = self.tracer.start_span(
            f"{self.operation} {self.queue}", kind=API.SpanKind.CONSUMER,
            attributes=attributes, links=links(msgs), start_time=self.start_ns,
        )
        self._failed(span, exc)
        span.end()


class Settling(_Call):
    """A commit's or a rollback's span (``with``), over the entries it ends."""

    __slots__ = ("span",)

    def __init__(self, tracer: Any, operation: str, items: Sequence[Item]) -> None:
        super().__init__(tracer)
        assert API is not None
        queues: list[str] = []
        seqs: list[int] = []
        n_enq = n_deq = 0
        for item in items:
            name = item.info.name
            if name not in queues:
                queues.append(name)
            got = [item.seq] if isinstance(item, Op) else item.seqs.tolist()
            seqs.extend(got)
            if item.kind is OpKind.ENQUEUE:
                n_enq += len(got)
            else:
                n_deq += len(got)
        attributes: dict[str, Any] = {
            A_SYSTEM: SYSTEM, A_OPERATION_TYPE: "settle", A_OPERATION_NAME: operation,
            A_BATCH_COUNT: len(seqs), A_SEQS: seqs, A_ENQUEUED: n_enq, A_DEQUEUED: n_deq,
            A_QUEUES: queues,
        }
        if len(queues) == 1:
            attributes[A_DESTINATION] = queues[0]
        self.span = tracer.start_span(operation, kind=API.SpanKind.CLIENT,
                                      attributes=attributes)

    def __enter__(self) -> Settling:
        return self

    def __exit__(self, _t: object, exc: BaseException | None, _tb: object) -> None:
        self._failed(self.span, exc)
        self.span.end()


def links(messages: Sequence[Message]) -> list[Any]:
    """A link to each message's producer (those that carry a trace context)."""
    assert API is not None
    out = []
    for m in messages:
        ctx = span_context(m.trace)
        if ctx is not None:
            out.append(API.Link(ctx, {A_MESSAGE_ID: str(m.seq), A_SEQ: m.seq}))
    return out


def process_span(message: Message) -> AbstractContextManager[Any]:
    """A context manager that runs a consumer's processing of ``message``
    inside a CONSUMER ``process`` span, current for its duration: the child
    of the entry's producer span (a root when the entry carries no trace
    context), with a link to it, and the message's queue, seq and delivery
    count; it records an exception that leaves it. It gives the span (None,
    and nothing made, when tracing is off: then it costs the guard)."""
    sp = spans()
    if sp is None:
        return _OFF
    return _process(sp, message)


_OFF: AbstractContextManager[Any] = nullcontext()  # reusable, as nullcontext is


@contextmanager
def _process(sp: Spans, message: Message) -> Iterator[Any]:
    assert API is not None
    ctx = span_context(message.trace)
    parent = API.set_span_in_context(API.NonRecordingSpan(ctx)) if ctx is not None else None
    with sp.tracer.start_as_current_span(
        f"process {message.queue}", context=parent, kind=API.SpanKind.CONSUMER,
        links=links([message]),
        attributes={A_SYSTEM: SYSTEM, A_DESTINATION: message.queue,
                    A_OPERATION_TYPE: "process", A_OPERATION_NAME: "process",
                    A_MESSAGE_ID: str(message.seq), A_SEQ: message.seq,
                    A_DELIVERIES: message.deliveries},
    ) as span:
        yield span


_SPANS: Spans | None = Spans() if API is not None else None
