"""A money transfer chopped into transactions that talk through queues.

Bank A (the queues' database) holds account y, bank B holds account z. A
transfer of x from y to z is a business transaction made of ACID transactions:

1. **withdraw** (bank A): dequeue the request, take x from y, enqueue a note
   "deposit x on z" -- one transaction. With too little money the withdrawal
   is *declined*: a successful outcome that commits and replies "declined".
2. **deposit** (bank B): dequeue the note, add x to z in bank B's own
   transaction, then commit the dequeue. Bank B may be another database, so
   these are two commits; a crash between them delivers the note again, and
   the "updates applied" table (``ringq.applied``, through
   :func:`ringq.move.already_applied`), written in bank B's transaction,
   recognizes it: the deposit happens once.
3. **compensation**: if z is closed, bank B records the money as returned and
   the deposit step enqueues a refund note; **refund** (bank A) dequeues it and
   gives x back to y -- through a queue too, so it happens even if every
   process dies on the way.

Each transfer ends with exactly one reply: done, declined or refunded.

Run it (the embedded cluster: ``ringq db start``; or pass --dsn)::

    python examples/transfer.py demo            # set up, 3 transfers, run a worker, show
    python examples/transfer.py submit --count 200
    python examples/transfer.py work --chaos 0.05   # kill -9 itself sometimes between
                                                    # bank B's commit and the dequeue's
    python examples/transfer.py report          # balances; is money conserved?
    cd examples && ringq worker transfer --processes 3   # or the worker pool (bank B = bank A)

``--bank-b DSN`` puts bank B in another database (default: the same one, on a
connection of its own, which is what matters here).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import uuid
from typing import Any

import psycopg
from ringq.engine import Message, QueueNotFound, Session, connect, resolve_dsn
from ringq.move import already_applied
from ringq.scripting import QueueSpec, create_queue
from ringq.worker import Actions, Decline, Worker, WorkerConfig

REQUESTS, DEPOSITS, REFUNDS, REPLIES = (
    "transfer_requests",
    "transfer_deposits",
    "transfer_refunds",
    "transfer_replies",
)
QUEUES = (REQUESTS, DEPOSITS, REFUNDS, REPLIES)

# Bank A's accounts (the y side) and bank B's (the z side); "carol" at B is closed.
ACCOUNTS_A = {"alice": 1000, "bob": 500, "dave": 50}
ACCOUNTS_B = {"erin": 0, "frank": 200, "carol": 0}
CLOSED_B = {"carol"}

TABLES = """
CREATE TABLE IF NOT EXISTS transfer_accounts (
    bank    text   NOT NULL,
    name    text   NOT NULL,
    balance bigint NOT NULL CHECK (balance >= 0),
    open    boolean NOT NULL DEFAULT true,
    PRIMARY KEY (bank, name)
);
-- Every movement of money, on purpose without a unique key: a step applied
-- twice would show here as two rows.
CREATE TABLE IF NOT EXISTS transfer_ledger (
    transfer text   NOT NULL,
    bank     text   NOT NULL,
    account  text   NOT NULL,
    amount   bigint NOT NULL,
    kind     text   NOT NULL CHECK (kind IN ('withdraw', 'deposit', 'returned', 'refund')),
    at       timestamptz NOT NULL DEFAULT now()
);
"""

app = Actions(timeout=30)
_chaos = 0.0  # probability of kill -9 between bank B's commit and the dequeue's
_bank_b_dsn: str | None = None
_bank_b: tuple[int, psycopg.Connection[Any]] | None = None


def bank_b() -> psycopg.Connection[Any]:
    """This process's connection to bank B (never shared across fork)."""
    global _bank_b
    if _bank_b is None or _bank_b[0] != os.getpid() or _bank_b[1].closed or _bank_b[1].broken:
        # Under `ringq worker transfer` nobody calls configure(): bank B is then
        # the queues' database (RINGQ_DSN or the embedded cluster).
        where = _bank_b_dsn or resolve_dsn()
        _bank_b = (os.getpid(), psycopg.connect(where, application_name="transfer bank B"))
    return _bank_b[1]


def _reply(transfer: dict[str, Any], status: str) -> bytes:
    return json.dumps({"id": transfer["id"], "status": status}).encode()


# -- the steps -------------------------------------------------------------------------------


@app.action(REQUESTS)
def withdraw(msg: Message, session: Session) -> Decline | None:
    """Step 1, in the dequeue's transaction: take the money from y, leave a note."""
    t = json.loads(msg.payload)
    conn = session.connection
    row = conn.execute(
        "UPDATE transfer_accounts SET balance = balance - %(amount)s "
        "WHERE bank = 'A' AND name = %(from)s AND balance >= %(amount)s RETURNING balance",
        t,
    ).fetchone()
    if row is None:
        # Declining is the right action, not a failure: commit, reply.
        return Decline("insufficient funds", reply_to=REPLIES, reply=_reply(t, "declined"))
    conn.execute(
        "INSERT INTO transfer_ledger (transfer, bank, account, amount, kind) "
        "VALUES (%(id)s, 'A', %(from)s, -%(amount)s, 'withdraw')",
        t,
    )
    session.enqueue(DEPOSITS, msg.payload)
    return None


@app.action(DEPOSITS)
def deposit(msg: Message, session: Session) -> None:
    """Step 2: deposit in bank B's own transaction, then (on return) the dequeue commits."""
    t = json.loads(msg.payload)
    bank = bank_b()
    with bank.transaction():
        if already_applied(bank, "transfer-deposit", msg):
            # Applied before a crash: find out what was done, do not do it again.
            row = bank.execute(
                "SELECT kind FROM transfer_ledger WHERE transfer = %s AND bank = 'B' "
                "AND kind IN ('deposit', 'returned')",
                (t["id"],),
            ).fetchone()
            assert row is not None, f"transfer {t['id']} recorded as applied without a ledger row"
            outcome = row[0]
            print(f"transfer {t['id']}: note delivered again, already applied ({outcome}): skipped",
                  flush=True)
        else:
            row = bank.execute(
                "UPDATE transfer_accounts SET balance = balance + %(amount)s "
                "WHERE bank = 'B' AND name = %(to)s AND open RETURNING balance",
                t,
            ).fetchone()
            outcome = "deposit" if row is not None else "returned"
            bank.execute(
                "INSERT INTO transfer_ledger (transfer, bank, account, amount, kind) "
                "VALUES (%s, 'B', %s, %s, %s)",
                (t["id"], t["to"], t["amount"] if outcome == "deposit" else 0, outcome),
            )
    # Bank B has committed; the dequeue has not.
    if _chaos and random.random() < _chaos:
        os.kill(os.getpid(), signal.SIGKILL)
    if outcome == "deposit":
        session.enqueue(REPLIES, _reply(t, "done"))
    else:
        session.enqueue(REFUNDS, msg.payload)  # compensation, through a queue too


@app.action(REFUNDS)
def refund(msg: Message, session: Session) -> None:
    """Compensation, in the dequeue's transaction: give the money back to y."""
    t = json.loads(msg.payload)
    conn = session.connection
    conn.execute(
        "UPDATE transfer_accounts SET balance = balance + %(amount)s "
        "WHERE bank = 'A' AND name = %(from)s",
        t,
    )
    conn.execute(
        "INSERT INTO transfer_ledger (transfer, bank, account, amount, kind) "
        "VALUES (%(id)s, 'A', %(from)s, %(amount)s, 'refund')",
        t,
    )
    session.enqueue(REPLIES, _reply(t, "refunded"))


# -- set-up, clients, report ----------------------------------------------------------------------


def configure(dsn: str, bank_b_dsn: str | None, chaos: float = 0.0) -> None:
    global _bank_b_dsn, _chaos
    _bank_b_dsn = bank_b_dsn or dsn
    _chaos = chaos


def setup(dsn: str, bank_b_dsn: str) -> None:
    """Queues, tables and accounts, if absent (safe to run again)."""
    with psycopg.connect(dsn) as conn:
        for q in QUEUES:
            # Shared: several workers take entries at once (transfers need no
            # order between them). Crashes count deliveries: allow plenty.
            create_queue(conn, QueueSpec(q, 4096, 1024, dequeue_mode="shared", max_deliveries=50))
    for bank, where, accounts in (("A", dsn, ACCOUNTS_A), ("B", bank_b_dsn, ACCOUNTS_B)):
        with psycopg.connect(where) as conn:
            conn.execute(TABLES)
            for name, balance in accounts.items():
                conn.execute(
                    "INSERT INTO transfer_accounts (bank, name, balance, open) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (bank, name, balance, name not in CLOSED_B or bank != "B"),
                )


def submit(dsn: str, transfers: list[dict[str, Any]]) -> None:
    """The client: one request per transfer, idempotent by its id (a retry adds nothing)."""
    with connect(dsn) as s:
        for t in transfers:
            s.enqueue(REQUESTS, json.dumps(t).encode(), key=f"transfer:{t['id']}")
        s.commit()


def random_transfers(n: int, seed: int | None = None) -> list[dict[str, Any]]:
    rnd = random.Random(seed)
    return [
        {
            "id": uuid.UUID(int=rnd.getrandbits(128)).hex[:12],
            "from": rnd.choice(sorted(ACCOUNTS_A)),
            "to": rnd.choice(sorted(ACCOUNTS_B)),
            "amount": rnd.randint(1, 120),
        }
        for _ in range(n)
    ]


def replies(dsn: str, want: int, wait: float = 30.0) -> list[dict[str, Any]]:
    """Take up to ``want`` replies (waiting up to ``wait`` s for each)."""
    out: list[dict[str, Any]] = []
    with connect(dsn) as s:
        while len(out) < want:
            msgs = s.dequeue_many(REPLIES, want - len(out), wait=wait)
            if not msgs:
                break
            out.extend(json.loads(m.payload) for m in msgs)
            s.commit()
    return out


def report(dsn: str, bank_b_dsn: str) -> dict[str, Any]:
    """Balances, money in flight, and whether it adds up; ledger anomalies."""
    total = sum(ACCOUNTS_A.values()) + sum(ACCOUNTS_B.values())
    rows: dict[str, int] = {}
    ledger: list[tuple[str, str, str]] = []
    for bank, where in (("A", dsn), ("B", bank_b_dsn)):
        with psycopg.connect(where) as conn:
            for name, balance in conn.execute(
                "SELECT name, balance FROM transfer_accounts WHERE bank = %s ORDER BY name", (bank,)
            ).fetchall():
                rows[f"{bank}:{name}"] = balance
            ledger += conn.execute(
                "SELECT transfer, bank, kind FROM transfer_ledger WHERE bank = %s", (bank,)
            ).fetchall()
    with psycopg.connect(dsn) as conn:
        # Money in flight: withdrawn, not yet deposited or refunded.
        amounts: dict[str, int] = dict(
            conn.execute(
                "SELECT transfer, -amount FROM transfer_ledger WHERE kind = 'withdraw'"
            ).fetchall()
        )
    steps: dict[str, list[str]] = {}
    for transfer, _bank, kind in ledger:
        steps.setdefault(transfer, []).append(kind)
    in_flight = sum(
        amounts.get(t, 0) for t, k in steps.items() if "deposit" not in k and "refund" not in k
    )
    twice = sorted(t for t, k in steps.items() if len(k) != len(set(k)))
    held = sum(rows.values())
    return {
        "balances": rows,
        "total_expected": total,
        "total_held": held,
        "in_flight": in_flight,
        "conserved": held + in_flight == total,
        "applied_twice": twice,
        "transfers": len(steps),
    }


def demo(dsn: str, bank_b_dsn: str) -> None:
    setup(dsn, bank_b_dsn)
    before = report(dsn, bank_b_dsn)["balances"]
    tag = uuid.uuid4().hex[:6]
    transfers = [
        {"id": f"{tag}-ok", "from": "alice", "to": "erin", "amount": 70},
        {"id": f"{tag}-declined", "from": "dave", "to": "frank", "amount": 10_000},
        {"id": f"{tag}-compensated", "from": "bob", "to": "carol", "amount": 25},
    ]
    submit(dsn, transfers)
    submit(dsn, transfers[:1])  # a client retry: the key makes it a no-op
    print(
        "submitted:",
        ", ".join(f"{t['id']} {t['from']}->{t['to']} {t['amount']}" for t in transfers),
    )
    with Worker(app, dsn, config=WorkerConfig(idle_wait=0.1)) as w:
        got: list[dict[str, Any]] = []
        while len(got) < len(transfers):
            w.run_one(wait=0.1)
            got += replies(dsn, len(transfers) - len(got), wait=0)
    for r in got:
        print(f"reply: transfer {r['id']}: {r['status']}")
    rep = report(dsn, bank_b_dsn)
    for k, v in rep["balances"].items():
        print(f"  {k:10} {before.get(k, 0):>6} -> {v:>6}")
    print(f"money conserved: {rep['conserved']} (held {rep['total_held']}, "
          f"in flight {rep['in_flight']}, expected {rep['total_expected']})")


def work(dsn: str, chaos: float) -> None:
    """Run one worker until SIGTERM (a second SIGTERM aborts the step in hand)."""
    w = Worker(app, dsn, config=WorkerConfig(idle_wait=0.2))

    def on_term(signum: int, frame: object) -> None:
        w.stop(abort=w.stopping)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    with w:
        print(f"worker {os.getpid()} ready (chaos {chaos})", flush=True)
        w.run()
    print(f"worker {os.getpid()} stopped: {w.stats()}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dsn", help="bank A and the queues (default: RINGQ_DSN, else the embedded cluster)"
    )
    p.add_argument("--bank-b", help="bank B's database (default: the same as --dsn)")
    sub = p.add_subparsers(dest="command")
    sub.add_parser("setup", help="queues, tables, accounts (if absent)")
    sub.add_parser("demo", help="set up, run three transfers (done, declined, compensated), show")
    s = sub.add_parser("submit", help="enqueue random transfers")
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--seed", type=int)
    w = sub.add_parser("work", help="run a worker for the three steps until SIGTERM")
    w.add_argument("--chaos", type=float, default=0.0,
                   help="probability of kill -9 between bank B's commit and the dequeue's")
    sub.add_parser("report", help="balances and the conservation check (exit 1 if violated)")
    args = p.parse_args(argv)
    dsn = resolve_dsn(args.dsn)
    bank_b_dsn = args.bank_b or dsn
    configure(dsn, bank_b_dsn, getattr(args, "chaos", 0.0))
    command = args.command or "demo"
    try:
        if command == "setup":
            setup(dsn, bank_b_dsn)
        elif command == "demo":
            demo(dsn, bank_b_dsn)
        elif command == "submit":
            transfers = random_transfers(args.count, args.seed)
            submit(dsn, transfers)
            print(f"{len(transfers)} transfers submitted")
        elif command == "work":
            work(dsn, args.chaos)
        elif command == "report":
            rep = report(dsn, bank_b_dsn)
            print(json.dumps(rep, indent=2))
            return 0 if rep["conserved"] and not rep["applied_twice"] else 1
    except QueueNotFound as exc:
        print(f"transfer: {exc}: run 'python examples/transfer.py setup' first", file=sys.stderr)
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
