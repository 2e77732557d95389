"""An async worker: ``async def`` actions run by many coroutines in one process.

Each message is its own transaction, as with the sync worker: the dequeue,
the action's SQL (through ``session.connection``, an ``AsyncConnection``) and
what it enqueues commit together or not at all. ``notify`` below records the
event of examples/async_handler.py in a table and enqueues an e-mail to send;
an action that raises is rolled back and its message comes back. Run it::

    python examples/async_handler.py                 # makes events
    cd examples && ringq worker async_worker --concurrency 32
    # Ctrl-C once: messages in flight finish, exit 0.

or, as the test does, ``python examples/async_worker.py --dsn DSN --once``
(handle what is there with 16 coroutines, then print what was done).
"""

from __future__ import annotations

import argparse
import asyncio
import json

import psycopg
from ringq.engine import AsyncSession, Message, resolve_dsn
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import Actions, AsyncWorker, WorkerConfig

EVENTS, MAILS = "ex_async_events", "ex_async_mails"

app = Actions(timeout=10)


@app.action(EVENTS)
async def notify(msg: Message, session: AsyncSession) -> None:
    event = json.loads(msg.payload)
    await session.connection.execute(
        "INSERT INTO ex_async_notified (order_id, seq) VALUES (%s, %s)",
        (event["order"], msg.seq),
    )
    await asyncio.sleep(0.001)  # an await of the action's own (a web call, say)
    await session.enqueue(MAILS, json.dumps({"to": "shop", "order": event["order"]}).encode())


def setup(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS ex_async_notified "
                     "(order_id bigint, seq bigint PRIMARY KEY)")
        schema = conn.execute("SELECT to_regclass('ringq.queues') IS NOT NULL").fetchone()
        have = ({r[0] for r in conn.execute("SELECT name FROM ringq.queues")}
                if schema == (True,) else set())
    with psycopg.connect(dsn) as conn:
        for q in (EVENTS, MAILS):
            if q not in have:
                create_queue(conn, QueueSpec(q, 4096, 512, dequeue_mode="shared"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--dsn", default=None)
    ap.add_argument("--once", action="store_true", help="handle what is there, then stop")
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    dsn = resolve_dsn(args.dsn)
    setup(dsn)
    worker = AsyncWorker(app, dsn, config=WorkerConfig(queues=(EVENTS,), idle_wait=0.2),
                         concurrency=args.concurrency)

    async def until_empty() -> int:
        async def stop_when_idle() -> None:
            idle = 0
            while idle < 3:  # three quiet looks in a row: done
                await asyncio.sleep(0.2)
                before = worker.stats()["handled"]
                await asyncio.sleep(0.2)
                idle = idle + 1 if worker.stats()["handled"] == before else 0
            worker.stop()

        stopper = asyncio.create_task(stop_when_idle())
        n = await worker.run_async()
        await stopper
        return n

    n = asyncio.run(until_empty()) if args.once else worker.run()
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT count(*), count(DISTINCT seq) FROM ex_async_notified") \
            .fetchone()
    print(f"handled {n} with {args.concurrency} coroutines; stats {worker.stats()}")
    print(f"notified rows {rows[0] if rows else 0}, distinct events {rows[1] if rows else 0}")


if __name__ == "__main__":
    main()
