"""The packages' layout: dependencies point one way, and only public faces are shared.

cli -> (worker, move, monitor, rtv, regression, scripting) -> cluster -> engine.
The engine imports no other ringq package, the cluster none but the engine,
and no module imports a private ``_x`` module of another ringq package
(tests, benchmarks and examples included: for them every ringq package is
another). Read from the source with ``ast``, so imports inside functions
count too.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = ("tests", "bench", "examples")  # not ringq packages: every ringq package is another
ENGINE = "ringq.engine"
CLUSTER = "ringq.cluster"
# The bottom of the one-way order: each of these packages imports only the
# ringq packages named here (the engine none, the cluster the engine).
BELOW: dict[str, set[str]] = {ENGINE: set(), CLUSTER: {ENGINE}}
# The report draws from files: the monitor's (through its public readers) and a
# regression run's directory. The regression runner calls it, so it must not
# import the regression (nor the cli): it reads what the runner hands it.
BELOW["ringq.report"] = {ENGINE, "ringq.monitor"}

# White-box tests: these test files reach into the named private modules on
# purpose (the monitor's T4 files and samples, the viewer's models, the
# regression's SQL, a timing constant of the engine patched to rule out its
# safety net). Nothing else may: not a package, a benchmark or an example.
WHITE_BOX: dict[str, set[str]] = {
    # the server's port probes, made to offer a port held by the test
    "tests/test_cluster.py": {"ringq.cluster._server"},
    # the shared-memory filesystem's free space, made small
    "tests/test_cache.py": {"ringq.engine.section._section"},
    # the per-process attachment lock, held by a thread across a fork
    "tests/test_engine.py": {"ringq.engine.session._claim", "ringq.engine.section._process"},
    "tests/test_events.py": {"ringq.monitor._events"},
    # the wait for room's recheck, raised so that only a consumer's post wakes it
    # (and the waker's hand-over of a post, to a wait that ended meanwhile)
    "tests/test_async.py": {"ringq.engine.session._reserve", "ringq.engine.session._waker"},
    # the otel guard, patched as if the API were not installed
    "tests/test_otel.py": {"ringq.engine.session._otel"},
    # a section load's reads, a put committed between two of them
    # (and the SQL agent's read of what was put, watched for payloads it cannot cache)
    "tests/test_sql_puts.py": {"ringq.engine.rows._decide", "ringq.engine.sqlagent._runs"},
    # schema_sql (the script's own text); the HTTP servers' backlog and request logging
    "tests/test_hardening_inputs.py": {
        "ringq.scripting._ddl", "ringq.monitor._http", "ringq.rtv._server",
    },
    # wait_backend_gone, the step a reconnecting session takes
    "tests/test_follow.py": {"ringq.engine.rows._decide"},
    "tests/test_history.py": {
        "ringq.monitor._sample", "ringq.monitor._history", "ringq.monitor._t4",
        "ringq.rtv._metrics",
    },
    # (and ringq.monitor._daemon, from the script of a subprocess, which this check does not read)
    "tests/test_monitor.py": {
        "ringq.monitor._sample", "ringq.monitor._t4", "ringq.monitor._reclaim",
        "ringq.monitor._pump", "ringq.monitor._clients",
    },
    # the verdict's split and summary on constructed tables, and a cycle's runner
    "tests/test_regress_verdict.py": {
        "ringq.regression._queries", "ringq.regression._checks", "ringq.regression._runner",
    },
    # a batch's waits bucketed by numpy, against Ring.record_wait one at a time (its clock fixed)
    "tests/test_waits.py": {"ringq.engine.ring._finish"},
    # a mover killed in Transaction.finish (committed, the section not told yet)
    "tests/test_move.py": {"ringq.engine.session._transaction"},
    "tests/test_regression.py": {
        "ringq.regression._payload", "ringq.regression._queries", "ringq.regression._runner",
    },
    # the monitor's tidy step, called directly (the loop runs it once wired in)
    "tests/test_sections.py": {"ringq.monitor._tidy"},
    "tests/test_rtv.py": {
        "ringq.rtv._metrics", "ringq.rtv._source", "ringq.rtv._tui", "ringq.monitor._sample",
        "ringq.monitor._clients",
    },
}


def _packages() -> dict[str, Path]:
    """{package: folder} from pyproject's package-dir (the root ``ringq`` excluded)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in dirs.items() if name != "ringq"}


PACKAGES = _packages()


def _files() -> Iterator[tuple[str | None, Path]]:
    """(owning package or None, file) for every .py file of the packages and of OUTSIDE."""
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            yield package, path
    for outside in OUTSIDE:
        for path in sorted((ROOT / outside).rglob("*.py")):
            yield None, path


def _package_parts(package: str, path: Path) -> list[str]:
    """The dotted parts of the (sub)package that holds ``path``, for relative imports."""
    rel = path.parent.relative_to(PACKAGES[package])
    return package.split(".") + [p for p in rel.parts if p]


def _imported(source: str, base: list[str] | None) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for every module the source imports, names imported
    from a package included (``from ringq.engine import _layout``). ``base`` is
    the dotted parts of the source's own package (None outside the packages)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if base is None:
                    continue  # a test importing a sibling test module
                parts = base[: len(base) - node.level + 1]
                target = ".".join(parts + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield node.lineno, target
            for alias in node.names:
                yield node.lineno, f"{target}.{alias.name}"


def _owner(module: str) -> str | None:
    """The ringq package a dotted module belongs to (the longest match), if any."""
    best = None
    for package in PACKAGES:
        inside = module == package or module.startswith(package + ".")
        if inside and (best is None or len(package) > len(best)):
            best = package
    return best


def _private_part(module: str, owner: str) -> str | None:
    """The leading part of ``module`` up to its first private ``_x`` name under
    ``owner`` (dunders are public), or None when every part is public."""
    parts = module.split(".")
    for i in range(len(owner.split(".")), len(parts)):
        p = parts[i]
        if p.startswith("_") and not (p.startswith("__") and p.endswith("__")):
            return ".".join(parts[: i + 1])
    return None


def check(package: str | None, base: list[str] | None, source: str, where: str) -> list[str]:
    """The layout violations of one module's source, one per import and module named."""
    found: list[str] = []
    for line, module in _imported(source, base):
        owner = _owner(module)
        if owner is None or owner == package:
            continue
        private = _private_part(module, owner)
        if private is not None and private not in WHITE_BOX.get(where, ()):
            found.append(f"{where}:{line}: imports {private}, private to {owner}")
        if package in BELOW and owner not in BELOW[package]:
            found.append(f"{where}:{line}: the {package.removeprefix('ringq.')} imports {module}")
    return list(dict.fromkeys(found))


def _private_imports(path: Path) -> set[str]:
    """The private modules of ringq packages that a test file imports."""
    used = set()
    for _line, module in _imported(path.read_text(encoding="utf-8"), None):
        owner = _owner(module)
        private = _private_part(module, owner) if owner is not None else None
        if private is not None:
            used.add(private)
    return used


def violations() -> list[str]:
    found: list[str] = []
    for package, path in _files():
        base = _package_parts(package, path) if package is not None else None
        found += check(package, base, path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    return found


def test_every_package_is_mapped_and_has_a_public_face() -> None:
    for package, folder in PACKAGES.items():
        init = folder / "__init__.py"
        assert init.is_file(), f"{package}: no {init}"
        tree = ast.parse(init.read_text(encoding="utf-8"))
        names = [
            t.id
            for n in tree.body
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        ]
        assert "__all__" in names, f"{package}: __init__.py has no __all__"


def test_no_module_imports_another_packages_private_modules_and_the_engine_imports_no_other(
) -> None:
    found = violations()
    assert not found, "layout violations:\n" + "\n".join(found)


def test_every_white_box_exception_is_still_used() -> None:
    for where, allowed in WHITE_BOX.items():
        unused = allowed - _private_imports(ROOT / where)
        assert not unused, f"{where} no longer imports {sorted(unused)}: drop them from WHITE_BOX"


def test_the_check_sees_private_imports_and_an_engine_importing_another_package() -> None:
    monitor = ["ringq", "monitor"]
    source = (
        "from ringq.engine._session import Session\nfrom ..engine import _layout\n"
        "from . import _t4\n"
    )
    found = check("ringq.monitor", monitor, source, "probe.py")
    assert found == [
        "probe.py:1: imports ringq.engine._session, private to ringq.engine",
        "probe.py:2: imports ringq.engine._layout, private to ringq.engine",
    ], found
    engine = ["ringq", "engine"]
    source = "def f():\n    import ringq.monitor\nfrom ringq import __version__\n"
    found = check(ENGINE, engine, source, "e.py")
    assert found == ["e.py:2: the engine imports ringq.monitor"], found
    cluster = ["ringq", "cluster"]
    source = "from ringq.engine import RingqError\nfrom ringq.scripting import QueueSpec\n"
    found = check(CLUSTER, cluster, source, "c.py")
    assert found == [
        "c.py:2: the cluster imports ringq.scripting",
        "c.py:2: the cluster imports ringq.scripting.QueueSpec",
    ], found
    source = "from ringq.engine import Session, layout\nimport ringq.engine.recovery\n"
    assert check(None, None, source, "t.py") == []


# A statement's first word, upper case as ringq writes SQL, then more SQL-ish
# text: enough to tell "SELECT 1 FROM ..." from a help text's "create a queue".
_SQL_START = re.compile(
    r"\s*(SELECT|INSERT|UPDATE|DELETE|WITH|CREATE|ALTER|DROP|LISTEN|NOTIFY|SET|TRUNCATE)"
    r"\s+[\w\"({*'%]"
)


def sql_strings(source: str, where: str) -> list[str]:
    """The string literals of a module's source that start as a SQL statement.

    Documentation is not code: a bare string statement (a docstring, or the
    string after an attribute) is skipped, examples in it included. An
    f-string is read with ``{}`` for each of its fields.
    """
    tree = ast.parse(source)
    skip: set[int] = set()
    texts: list[tuple[ast.expr, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant | ast.JoinedStr):
            skip.add(id(node.value))
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)  # read whole, here
            parts = [v.value if isinstance(v, ast.Constant) else "{}" for v in node.values]
            texts.append((node, "".join(str(p) for p in parts)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            texts.append((node, node.value))
    return [
        f"{where}:{node.lineno}: {(text.strip().splitlines() or [''])[0][:60]!r}"
        for node, text in sorted(texts, key=lambda t: t[0].lineno)
        if id(node) not in skip and _SQL_START.match(text)
    ]


def test_no_sql_string_outside_the_packages_sql_files() -> None:
    # SQL lives in each package's .sql files as named blocks, loaded once
    # (ringq.engine.sqlfile); a .py file of a ringq package holds none.
    probe = (
        '"""SELECT 1 FROM doc"""\n'
        'Q = "SELECT 1 FROM t WHERE a = %s"\n'
        "def f(conn):\n"
        '    """DELETE FROM in a docstring."""\n'
        '    conn.execute(f"UPDATE {t} SET a = 1")\n'
        '    conn.execute(sql.SQL("\\n  CREATE TABLE {} (a int)").format(t))\n'
        '    parser.add_parser("create", help="create a queue; with --yes: drop it")\n'
        '    print("Delete exception entry SEQ", "WITH --chaos: kill", "SET-Cookie")\n'
    )
    assert [line.split(":")[1] for line in sql_strings(probe, "probe.py")] == ["2", "5", "6"]
    found = [
        hit
        for package, path in _files()
        if package is not None
        for hit in sql_strings(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]
    assert not found, "SQL outside the .sql files:\n" + "\n".join(found)
