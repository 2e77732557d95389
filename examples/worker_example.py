"""Worker example: pay for orders, decline when funds are short, chain shipments.

Each message is handled in one transaction: the dequeue of the order, the
debit of the account, the shipment it enqueues (chaining) and the reply of a
decline commit together or not at all. Run it::

    export RINGQ_DSN=postgresql://user@host/db     # or: ringq db start
    python examples/worker_example.py setup        # queues, table, a few orders
    cd examples && ringq worker worker_example --processes 2
    # Ctrl-C (or SIGTERM) once: messages in flight finish, exit 0.
    python examples/worker_example.py show         # balances, shipments, replies

``ringq worker worker_example`` imports this module and runs ``app``.
"""

from __future__ import annotations

import json
import sys

import psycopg
from ringq.engine import Message, Session, connect, resolve_dsn
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import Actions, Decline

ORDERS, SHIPMENTS, REPLIES = "ex_orders", "ex_shipments", "ex_replies"

# Every action gets at most 10 seconds: past that it is interrupted and rolled
# back, and the order is delivered again (after 3 failed deliveries it moves
# to ringq.exceptions).
app = Actions(timeout=10)


@app.action(ORDERS)
def pay(msg: Message, session: Session) -> Decline | None:
    order = json.loads(msg.payload)
    conn = session.connection  # the same transaction as the dequeue
    row = conn.execute(
        "UPDATE ex_accounts SET balance = balance - %(amount)s "
        "WHERE id = %(account)s AND balance >= %(amount)s RETURNING balance",
        order,
    ).fetchone()
    if row is None:
        # Declining is a success: the order is consumed, the reply commits with it.
        reply = json.dumps({"order": order["id"], "status": "declined"}).encode()
        return Decline("insufficient funds", reply_to=REPLIES, reply=reply)
    session.enqueue(SHIPMENTS, json.dumps({"order": order["id"], "to": order["account"]}).encode())
    return None


@app.action(SHIPMENTS, timeout=30)
def ship(msg: Message, session: Session) -> None:
    shipment = json.loads(msg.payload)
    session.connection.execute(
        "INSERT INTO ex_shipped (order_id, account) VALUES (%s, %s)",
        (shipment["order"], shipment["to"]),
    )
    reply = json.dumps({"order": shipment["order"], "status": "shipped"}).encode()
    session.enqueue(REPLIES, reply)


@app.action(REPLIES)
def log_reply(msg: Message, session: Session) -> None:
    print("reply:", msg.payload.decode(), flush=True)


def setup(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        for name in (ORDERS, SHIPMENTS, REPLIES):
            create_queue(conn, QueueSpec(name, 1024, 4096, dequeue_mode="shared"))
        conn.execute("CREATE TABLE IF NOT EXISTS ex_accounts (id int PRIMARY KEY, balance numeric)")
        conn.execute("CREATE TABLE IF NOT EXISTS ex_shipped (order_id int, account int)")
        conn.execute("INSERT INTO ex_accounts VALUES (1, 100), (2, 10) ON CONFLICT (id) DO NOTHING")
    with connect(dsn) as s:
        for i, (account, amount) in enumerate([(1, 30), (2, 50), (1, 30), (1, 60)], start=1):
            s.enqueue(ORDERS, json.dumps({"id": i, "account": account, "amount": amount}).encode())
        s.commit()
    print("4 orders enqueued; now run: cd examples && ringq worker worker_example")


def show(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        print("accounts:", conn.execute("SELECT * FROM ex_accounts ORDER BY id").fetchall())
        print("shipped: ", conn.execute("SELECT * FROM ex_shipped ORDER BY order_id").fetchall())


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else "setup"
    {"setup": setup, "show": show}[command](resolve_dsn())
