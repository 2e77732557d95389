"""The PostgreSQL server programs: where they are installed, and running them
for one home.

As root, the server programs run as the ``postgres`` OS user (``initdb`` and
``postgres`` refuse root): the home is given to that user and every directory
above it is made traversable (search permission only) for it.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import stat
import subprocess
from collections.abc import Sequence
from pathlib import Path

from ._errors import ClusterError, PostgresNotFound
from ._home import Pair

SERVER_OS_USER = "postgres"  # the OS user the server runs as when we are root
INSTALL_HINT = "install postgresql (apt-get install postgresql)"

_VERSION_RE = re.compile(r"\(PostgreSQL\)\s+(\S+)")


def find_bindir(
    *,
    search_path: str | None = None,
    lib_root: Path = Path("/usr/lib/postgresql"),
    prefer_major: str | None = None,
) -> Path:
    """The directory holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looked for in order: ``PATH`` (symlinks followed, so Debian's wrappers in
    /usr/local/bin find their real directory), ``pg_config --bindir``, then
    ``<lib_root>/<major>/bin``, highest major first (``prefer_major``, the
    version of an existing data directory, first of all).

    :raises PostgresNotFound: none holds all three programs.
    """
    candidates: list[Path] = []
    initdb = shutil.which("initdb", path=search_path)
    if initdb:
        candidates.append(Path(initdb).resolve().parent)
    pg_config = shutil.which("pg_config", path=search_path)
    if pg_config:
        try:
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out = ""
        if out:
            candidates.append(Path(out))
    versioned = sorted(
        (Path(p) for p in glob.glob(str(lib_root / "*" / "bin"))),
        key=lambda p: _version_key(p.parent.name),
        reverse=True,
    )
    candidates.extend(versioned)
    if prefer_major:
        # A data directory only opens with its own major version's server.
        candidates.sort(key=lambda p: _major_of(p) != prefer_major)
    for bindir in candidates:
        if all(os.access(bindir / prog, os.X_OK) for prog in ("initdb", "pg_ctl", "postgres")):
            return bindir
    looked = ", ".join(str(c) for c in candidates) or "nothing on PATH"
    raise PostgresNotFound(
        f"no PostgreSQL server found (initdb, pg_ctl, postgres; looked at PATH, pg_config "
        f"--bindir and {lib_root}/*/bin: {looked}): {INSTALL_HINT}"
    )


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name)) or (-1,)


def _major_of(bindir: Path) -> str | None:
    if bindir.parent.parent.name == "postgresql":
        return bindir.parent.name
    try:
        out = subprocess.run(
            [str(bindir / "pg_ctl"), "--version"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = _VERSION_RE.search(out)
    return m.group(1).split(".")[0] if m else None


class Programs:
    """The server programs one home uses (found once, by the major version of
    its primary's data directory), run as the server's OS user from the home."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self._bindir: Path | None = None
        self._version: str | None = None

    @property
    def bindir(self) -> Path:
        """The directory of the server programs used (see :func:`find_bindir`)."""
        if self._bindir is None:
            major = None
            try:
                primary = self.home / Pair.read(self.home).primary
                major = (primary / "PG_VERSION").read_text().strip()
            except OSError:
                pass
            self._bindir = find_bindir(prefer_major=major)
        return self._bindir

    @property
    def version(self) -> str:
        """The server's version, e.g. ``15.18``."""
        if self._version is None:
            out = subprocess.run(
                [str(self.bindir / "postgres"), "--version"],
                check=False,
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            m = _VERSION_RE.search(out)
            self._version = m.group(1) if m else out.strip()
        return self._version

    def run(self, argv: Sequence[str], *, timeout: float) -> subprocess.CompletedProcess[str]:
        """Run a server program (as the server user when we are root), output captured.

        :raises ClusterError: it could not run, or did not finish in ``timeout`` s.
        """
        cmd = list(argv)
        user = self._server_user()
        if user is not None:
            # Before every program, not once: a pytest session starting meanwhile
            # resets /tmp/pytest-of-root to 0700, closing the path again.
            self._prepare_server_user()
            runuser = shutil.which("runuser") or "/usr/sbin/runuser"
            cmd = [runuser, "-u", user.pw_name, "--", *cmd]
        env = dict(os.environ, LC_ALL="C", LANG="C")  # we read the messages; keep them English
        env.pop("PGDATA", None)
        try:
            return subprocess.run(
                cmd,
                check=False,
                cwd=self.home,  # the caller's cwd (/root) may be closed to the server user
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{argv[0]} did not finish in {timeout:g} s") from exc
        except OSError as exc:
            raise ClusterError(f"cannot run {cmd[0]}: {exc}") from exc

    def give(self, path: Path) -> None:
        """Make ``path`` (made by us) belong to the server user."""
        user = self._server_user()
        if user is not None:
            os.chown(path, user.pw_uid, user.pw_gid)

    def _server_user(self) -> pwd.struct_passwd | None:
        """The OS user to run the server as, or None to run it as ourselves."""
        if os.geteuid() != 0:
            return None
        try:
            return pwd.getpwnam(SERVER_OS_USER)
        except KeyError:
            raise ClusterError(
                f"running as root, the server must run as the OS user {SERVER_OS_USER!r} "
                f"(PostgreSQL refuses root), and there is none: {INSTALL_HINT}"
            ) from None

    def _prepare_server_user(self) -> None:
        """As root: give the home to the server user and make its path traversable."""
        user = self._server_user()
        if user is None:
            return
        os.chown(self.home, user.pw_uid, user.pw_gid)
        gids = set(os.getgrouplist(user.pw_name, user.pw_gid))
        for directory in reversed(self.home.parents):
            st = directory.stat()
            if st.st_uid == user.pw_uid:
                bit = stat.S_IXUSR
            elif st.st_gid in gids:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                # Search permission only: the server user can reach the home but
                # cannot list what is beside it. (pytest's /tmp/pytest-of-root is 0700.)
                os.chmod(directory, stat.S_IMODE(st.st_mode) | bit)
