"""An asyncio request handler (FastAPI-style) that writes its row and enqueues in one transaction.

``create_order`` is what an ``async def`` endpoint of FastAPI or aiohttp
would be: it takes the request's body, writes the order row through the
session's ``AsyncConnection`` and enqueues the "order placed" event, and
commits both at once: the event exists if and only if the order does. No web
framework is needed to show it: a small asyncio driver below calls the
handler for many requests at once (one session per request in flight, as a
pool of sessions would give them), one of them failing half-way on purpose
(its order and its event both vanish). Run it::

    ringq db start                         # or: export RINGQ_DSN=...
    python examples/async_handler.py       # [--dsn DSN] [--requests N]

It prints how many orders and events exist (equal), and the failed one's
absence; the events stay queued for examples/async_worker.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import psycopg
from ringq.engine import AsyncSession, connect_async, resolve_dsn
from ringq.scripting import QueueSpec, create_queue

EVENTS = "ex_async_events"


class Refused(Exception):
    """The handler refuses the request after writing (to show the rollback)."""


async def create_order(session: AsyncSession, body: dict[str, object]) -> int:
    """The endpoint: the order's row and its event, one transaction.

    Returns the order's id. Raises :class:`Refused` for a request marked
    ``"refuse"``, after its row and event were written: neither commits.
    """
    async with session.transaction():
        cur = await session.connection.execute(
            "INSERT INTO ex_async_orders (item, qty) VALUES (%(item)s, %(qty)s) RETURNING id",
            body,
        )
        row = await cur.fetchone()
        assert row is not None
        order_id = int(row[0])
        event = {"order": order_id, "item": body["item"], "qty": body["qty"]}
        await session.enqueue(EVENTS, json.dumps(event).encode())
        if body.get("refuse"):
            raise Refused(f"order {order_id} refused")
    return order_id


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS ex_async_orders "
                     "(id bigserial PRIMARY KEY, item text, qty int)")
        conn.execute("TRUNCATE ex_async_orders")
        exists = conn.execute("SELECT to_regclass('ringq.queues') IS NOT NULL").fetchone()
        if exists and exists[0] and conn.execute(
                "SELECT 1 FROM ringq.queues WHERE name = %s", (EVENTS,)).fetchone():
            return
    with psycopg.connect(dsn) as conn:
        create_queue(conn, QueueSpec(EVENTS, 4096, 512, dequeue_mode="shared"))


async def serve(dsn: str, requests: int, concurrency: int = 8) -> tuple[int, int]:
    """Call the handler for ``requests`` requests, ``concurrency`` at a time;
    returns (orders made, requests refused)."""
    sessions: asyncio.Queue[AsyncSession] = asyncio.Queue()
    for _ in range(concurrency):
        sessions.put_nowait(await connect_async(dsn))
    made = refused = 0

    async def one(i: int) -> None:
        nonlocal made, refused
        s = await sessions.get()
        try:
            await create_order(s, {"item": f"item-{i}", "qty": i % 5 + 1,
                                   "refuse": i == requests // 2})
            made += 1
        except Refused:
            refused += 1
        finally:
            sessions.put_nowait(s)

    await asyncio.gather(*[one(i) for i in range(requests)])
    while not sessions.empty():
        await sessions.get_nowait().close()
    return made, refused


async def read_events(dsn: str, *, consume: bool) -> list[dict[str, object]]:
    """The events on the queue: consumed, or looked at and given back
    (rolled back without counting a delivery)."""
    async with await connect_async(dsn) as s:
        got = await s.dequeue_many(EVENTS, 100_000)
        if consume:
            await s.commit()
        else:
            await s.rollback(count_delivery=False)
    return [json.loads(m.payload) for m in got]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--requests", type=int, default=50)
    args = ap.parse_args()
    dsn = resolve_dsn(args.dsn)
    setup(dsn)
    asyncio.run(read_events(dsn, consume=True))  # leftovers of an earlier run
    made, refused = asyncio.run(serve(dsn, args.requests))
    events = asyncio.run(read_events(dsn, consume=False))  # left for examples/async_worker.py
    with psycopg.connect(dsn) as conn:
        orders = {r[0] for r in conn.execute("SELECT id FROM ex_async_orders")}
    print(f"requests {args.requests}, orders made {made}, refused {refused}")
    print(f"orders in the table {len(orders)}, events on the queue {len(events)}")
    print(f"every order has its event, and only those: "
          f"{orders == {e['order'] for e in events}}")


if __name__ == "__main__":
    main()
