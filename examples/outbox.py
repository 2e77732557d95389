"""Outbox to inbox between two databases, without two-phase commit.

Database 1 (the order service) writes each order and its "order placed" event
in ONE transaction: the event is in the outbox queue if and only if the order
committed. A mover takes the events to the inbox queue of database 2 (another
service): it commits the enqueue in database 2 first, then the dequeue in
database 1, with an idempotency key made from the event's identity.

The example kills the mover (kill -9) between those two commits, lets
recovery give the events back (what ``ringq monitor`` does on its own), and
starts a new mover: every event arrives once, in order, with its origin and
original producer in the envelope. Run it::

    ringq db start                       # or pass --dsn
    python examples/outbox.py            # database 2 is <database>_inbox, made if absent
    python examples/outbox.py --to-dsn postgresql://...   # or any other database

In production the mover is a service: ``ringq move --from DSN1:orders_outbox
--to DSN2:orders_inbox`` (start two for availability: one moves, one stands by).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import signal
import sys
from collections.abc import Sequence

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from ringq.engine import Message, connect, resolve_dsn
from ringq.engine.recovery import reclaim_all, recover_dead_clients
from ringq.move import MoveConfig, Mover, unwrap
from ringq.scripting import QueueSpec, create_queue

OUTBOX, INBOX = "orders_outbox", "orders_inbox"


def second_database(dsn: str) -> str:
    """``<database>_inbox`` on the same server, created if absent."""
    params = conninfo_to_dict(dsn)
    name = f"{params.get('dbname') or 'postgres'}_inbox"
    with psycopg.connect(dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            print(f"created database {name} (database 2)")
    return make_conninfo(dsn, dbname=name)


def setup(db1: str, db2: str) -> None:
    with psycopg.connect(db1) as conn:
        # Every crash of a mover counts a delivery on the events in hand: allow many.
        create_queue(conn, QueueSpec(OUTBOX, 1024, 1024, max_deliveries=1000))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS outbox_orders "
            "(id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, item text, qty int)"
        )
    with psycopg.connect(db2) as conn:
        create_queue(conn, QueueSpec(INBOX, 1024, 2048))


def place_orders(db1: str, orders: Sequence[tuple[str, int]], *, roll_back: str) -> list[int]:
    """The order service: the order row and its event commit together, or neither.

    Returns the ids of the committed orders."""
    placed: list[int] = []
    with connect(db1, producer="order-service") as s:
        for item, qty in orders:
            row = s.connection.execute(
                "INSERT INTO outbox_orders (item, qty) VALUES (%s, %s) RETURNING id", (item, qty)
            ).fetchone()
            assert row is not None
            event = {"event": "order placed", "order": row[0], "item": item, "qty": qty}
            s.enqueue(OUTBOX, json.dumps(event).encode())
            if item == roll_back:
                s.rollback()  # no order, so no event: nothing to move
                print(f"order for {item!r} rolled back: its event never existed")
            else:
                s.commit()
                placed.append(row[0])
    return placed


def _crashing_mover(db1: str, db2: str) -> None:
    def die(msgs: Sequence[Message]) -> None:
        print(f"mover {os.getpid()}: {len(msgs)} events committed in database 2, "
              "killed before database 1 commits", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    Mover(
        db1, OUTBOX, db2, INBOX, config=MoveConfig(batch=2), between_commits=die
    ).open().move_batch()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dsn", help="database 1 (default: RINGQ_DSN, else the embedded cluster)")
    p.add_argument("--to-dsn", help="database 2 (default: <database 1>_inbox on the same server)")
    args = p.parse_args(argv)
    logging.getLogger("ringq.recovery").setLevel(logging.ERROR)  # we print what it did
    db1 = resolve_dsn(args.dsn)
    db2 = args.to_dsn or second_database(db1)
    setup(db1, db2)
    with connect(db2) as consumer:
        stale = consumer.dequeue_many(INBOX, 10_000)  # a previous run's leftovers
        consumer.commit()
    if stale:
        print(f"({len(stale)} events of an earlier run taken out of the inbox)")

    placed = place_orders(
        db1,
        [("apples", 3), ("pears", 1), ("plums", 7), ("figs", 2), ("kiwis", 4)],
        roll_back="plums",
    )

    # 1. A mover that dies between the two commits.
    child = mp.get_context("fork").Process(target=_crashing_mover, args=(db1, db2))
    child.start()
    child.join()
    print(f"mover {child.pid} ended by signal {-(child.exitcode or 0)}")

    # 2. Recovery (the monitor does this by itself): the dead mover's events
    #    in database 1 become ready again; its lock was released by PostgreSQL.
    with connect(db1) as s1, connect(db2) as s2:
        for sess in (s1, s2):
            for rec in recover_dead_clients(sess.section, sess.dsn):
                print(f"recovered dead client {rec.pid}: {rec.slots} slot(s) given back")
            reclaim_all(sess.section)

    # 3. A new mover: the events already in database 2 are skipped by key.
    with Mover(db1, OUTBOX, db2, INBOX, config=MoveConfig(batch=2)) as mover:
        while mover.move_batch():
            pass
        stats = mover.get_stats()
    print(f"new mover: moved {stats['moved']}, of which already in database 2 "
          f"(skipped by key) {stats['duplicates']}")

    # 4. The other service reads its inbox.
    with connect(db2) as consumer:
        msgs = consumer.dequeue_many(INBOX, 100)
        consumer.commit()
    print(f"database 2 received {len(msgs)} events:")
    for m in msgs:
        moved = unwrap(m)
        event = json.loads(moved.payload)
        print(f"  {moved.origin_queue}#{moved.origin_seq} from {moved.producer} "
              f"#{moved.producer_seq}: {event}")
    orders = [json.loads(unwrap(m).payload)["order"] for m in msgs]
    ok = orders == placed
    print("every committed order's event arrived once, in order:", ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
