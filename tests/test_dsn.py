"""DSN redaction (``ringq.engine.redact_dsn``) for every shape libpq accepts,
and for some it rejects.

Each case writes its password in capitals and everything else in lower case,
digits and punctuation, so "no character of the password survives" is: no
capital letter in what is shown. Each case also names the text (host, port,
database, other parameters) that must stay readable. The cases marked "was
wrong" showed part of the password before this file.

What libpq reads (``conninfo_to_dict``): a URL's user information ends at the
FIRST "@" before any "/" (``u:pa@ss/word@h/db`` is password "pa", host "ss",
dbname "word@h/db"; ``u:pass/word@h/db`` is host "u", port "pass"); spaces in a
URL, and ``'it''s'`` in key=value form, are rejected. Redaction hides the
longer reading: the password as its writer meant it, up to the LAST "@" before
the host part.
"""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict
from ringq.engine import redact_dsn

# (dsn, texts that must stay readable)
URLS = [
    # was wrong: the password ran only to its first "@"
    ("postgresql://u:PA@SS/WORD@h/db", ["postgresql://u:", "@h/db"]),
    ("postgresql://u:PA@S?S@h/db", ["@h/db"]),
    ("postgresql://u:PA@S#S/X@h/db?sslmode=require", ["@h/db?sslmode=require"]),
    ("postgres://u:PA@SS/WORD@h1:5432,h2:5433/db", ["postgres://u:", "@h1:5432,h2:5433/db"]),
    # was wrong: a password with a blank (libpq rejects it) was shown whole
    ("postgresql://u:P W@h/db", ["postgresql://u:", "@h/db"]),
    ("postgresql://u:PASS/WORD@h/db", ["postgresql://u:", "@h/db"]),
    ("postgresql://u:PA@SS@WORD@h:5432/db", ["@h:5432/db"]),
    ("postgres://u:PA?SS@h/db", ["@h/db"]),
    ("postgres://u:PA#SS@h/db", ["@h/db"]),
    ("postgresql://u:P:W@h/db", ["postgresql://u:", "@h/db"]),
    ("postgresql://:PW@h/db", ["postgresql://:", "@h/db"]),
    ("postgresql://u:P%40SS%2FW%3FD%23@h/db", ["@h/db"]),
    (
        "postgresql://u:PW@h1:5432,h2:5433/db?target_session_attrs=read-write",
        ["@h1:5432,h2:5433/db?target_session_attrs=read-write"],
    ),
    ("postgresql://u:PW@[::1]:5432/db", ["@[::1]:5432/db"]),
    ("postgresql://u:PW@h/db?application_name=a@b", ["@h/db?application_name=a@b"]),
    ("postgresql://u:PW@h:notaport/db", ["postgresql://u:", "@h:notaport/db"]),
]
QUERIES = [
    # was wrong: the parameters after the password were hidden with it
    ("postgresql://u@h/db?password=PW&sslmode=require", ["u@h/db?password=", "&sslmode=require"]),
    (
        "postgresql://u@h/db?sslmode=require&password=P@W&Q&host=x",
        ["u@h/db?sslmode=require&", "&host=x"],
    ),
    ("postgresql://h1:5432,h2:5433/db?password=P%20W", ["h1:5432,h2:5433/db?password="]),
    ("postgresql://h/db?password=P@SS", ["postgresql://h/db?password="]),
]
KEYWORDS = [
    # was wrong: libpq reads a backslash-escaped blank as part of the value
    ("host=h password=A\\ B dbname=db", ["host=h", "dbname=db"]),
    # was wrong: libpq rejects 'it''s'; the second quoted piece was shown
    ("host=h password='IT''S QUOTED' dbname=db", ["host=h", "dbname=db"]),
    # was wrong: PGPASSWORD=... (as in an environment dump) was shown
    ("host=h dbname=db pgpassword=SECRET", ["host=h dbname=db pgpassword="]),
    ("host=h password='A B\\'C' dbname=db", ["host=h", "dbname=db"]),
    ("host=h password = 'A B\\'C' dbname=db", ["host=h", "dbname=db"]),
    ("host=h user=u password=P@SS@WORD dbname=db", ["host=h user=u", "dbname=db"]),
    ("host=h dbname=db password='UNTERMINATED QUOTE", ["host=h dbname=db"]),
    ("host=h sslpassword=KEYPASS dbname=db", ["host=h", "dbname=db"]),
    ("host=h password= PW dbname=db", ["host=h", "dbname=db"]),
]
IN_TEXT = [
    # was wrong: a DSN quoted inside an error message, as from_psycopg writes it
    (
        "database unavailable at 'postgresql://u:PA@SS/WORD@h/db': connection refused",
        ["@h/db'", ": connection refused"],
    ),
    (
        "<mover postgresql://u:PW@h/a:q -> postgresql://v:QX@k/b:r active>",
        ["@h/a:q -> postgresql://v:", "@k/b:r active>"],
    ),
    (
        "get /api/queues?queue=a&token=TOKEN http/1.1",
        ["get /api/queues?queue=a&token=", " http/1.1"],
    ),
]


def _secret_letters(dsn: str) -> set[str]:
    return {c for c in dsn if c.isupper()}


@pytest.mark.parametrize(("dsn", "readable"), URLS + QUERIES + KEYWORDS + IN_TEXT)
def test_no_character_of_the_password_survives(dsn: str, readable: list[str]) -> None:
    shown = redact_dsn(dsn)
    assert _secret_letters(dsn), "the case has no password in capitals"
    assert not set(shown) & _secret_letters(dsn), shown
    assert "***" in shown
    for text in readable:
        assert text in shown, (text, shown)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://u@h/db",
        "postgresql://h1:5432,h2:5433/db?sslmode=require",
        "postgresql://[::1]:5432/db",
        "postgresql://h:/db",
        "host=h port=5432 dbname=db user=u",
        "http://127.0.0.1:8080/api/queues?queue=a@b",
    ],
)
def test_a_dsn_without_a_password_is_shown_as_it_is(dsn: str) -> None:
    assert redact_dsn(dsn) == dsn


@pytest.mark.parametrize(
    ("dsn", "libpq_password"),
    [
        ("postgresql://u:PA@SS/WORD@h/db", "PA"),
        ("postgresql://u:PA@SS@WORD@h:5432/db", "PA"),
        ("postgresql://u:PA?SS@h/db", "PA?SS"),
        ("postgresql://u:P%40SS%2FW%3FD%23@h/db", "P@SS/W?D#"),
        ("postgresql://u@h/db?sslmode=require&password=P@W", "P@W"),
        ("host=h password = 'A B\\'C' dbname=db", "A B'C"),
        ("host=h password=A\\ B dbname=db", "A B"),
    ],
)
def test_redaction_hides_at_least_what_libpq_reads_as_the_password(
    dsn: str, libpq_password: str
) -> None:
    assert conninfo_to_dict(dsn)["password"] == libpq_password
    shown = redact_dsn(dsn)
    assert not set(shown) & {c for c in libpq_password if c.isupper()}, shown
