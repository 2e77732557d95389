"""The viewer's web server: the page, its static files, and a proxy of the monitor's API.

The browser talks only to this server (never to the monitor), so the
monitor's token stays here and the page needs one origin. Every path asks for
the viewer's token: ``Authorization: Bearer``, ``?token=`` (which also sets a
cookie scoped to this port, so the page's own requests carry it) or that
cookie. Without it: 401.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import threading
import time
from http import HTTPStatus
from http.cookies import CookieError, SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from importlib.resources.abc import Traversable
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qs, quote, unquote, urlsplit

from ringq.engine import RingqError, redact_dsn

from ._config import MAX_WINDOW, WINDOWS, ViewerConfig
from ._groups_line import groups_line
from ._server_line import server_line
from ._source import MonitorClient, MonitorError, MonitorUnavailable, thin
from ._waiting_line import waiting_line

log = logging.getLogger("ringq.rtv")

STATIC = "static"
SECURITY_HEADERS = {
    # The page loads nothing from elsewhere: the charting library is shipped.
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",  # the token may be in the address bar
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
}


# By extension, not from the host's mime.types (which varies): the browser
# must get JavaScript as JavaScript under X-Content-Type-Options: nosniff.
CONTENT_TYPES = {
    "html": "text/html; charset=utf-8",
    "js": "text/javascript; charset=utf-8",
    "css": "text/css; charset=utf-8",
    "svg": "image/svg+xml",
    "png": "image/png",
}


class ViewerError(RingqError):
    """The viewer's server could not start (the port is taken, the address is wrong)."""


class Viewer:
    """The Real Time Viewer's web server, on ``config.host:config.port``.

    ``start()`` binds and serves in a background thread; ``stop()`` (or
    ``close()``, or leaving a ``with`` block) shuts it down, and a second
    call is harmless. ``url`` is the address to open, token included.

    :raises ViewerError: from ``start()`` when the address cannot be bound.
    """

    def __init__(self, config: ViewerConfig, *, client: MonitorClient | None = None) -> None:
        self.config = config
        self.client = client or MonitorClient(
            config.monitor_url, config.monitor_token, timeout=config.timeout
        )
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port (the configured one until started; useful with port 0)."""
        return self._httpd.server_address[1] if self._httpd else self.config.port

    @property
    def base_url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    @property
    def url(self) -> str:
        """The page's address with the token, as printed by ``ringq rtv``."""
        return f"{self.base_url}/?token={quote(self.config.token, safe='')}"

    def start(self) -> Self:
        with self._lock:
            if self._httpd is not None:
                return self
            try:
                httpd = _Server((self.config.host, self.config.port), _Handler)
            except OSError as exc:
                raise ViewerError(
                    f"cannot serve on {self.config.host}:{self.config.port}: {exc.strerror or exc}"
                ) from exc
            httpd.viewer = self
            self._httpd = httpd
            self._thread = threading.Thread(
                target=httpd.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="ringq-rtv",
                daemon=True,
            )
            self._thread.start()
            return self

    def stop(self) -> None:
        with self._lock:
            httpd, thread = self._httpd, self._thread
            self._httpd = self._thread = None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    close = stop

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # What the proxy answers: the API's shapes, normalized (see _source).

    def api_queues(self) -> dict[str, Any]:
        """The monitor's ``/api/queues``, normalized, with ``server_line``: the
        line the page shows about the server the monitor is on (``text``,
        ``alarm``), or null from a monitor that does not say; and per queue
        a grouped queue's ``groups_line``, the line it shows below its row (a
        queue without groups has none), and ``waiting_line`` for a queue with
        entries waiting for their due time."""
        overview = self.client.overview()
        doc = overview.as_json()
        line = None if overview.server is None else server_line(overview.server)
        doc["server_line"] = None if line is None else {"text": line.text, "alarm": line.alarm}
        for q in doc["queues"]:
            glines = groups_line(q)
            if glines is not None:  # a queue without groups has no such key
                q["groups_line"] = glines
            wline = waiting_line(q)
            if wline is not None:  # nor one with no entry waiting for its time
                q["waiting_line"] = wline
        return doc

    def api_clients(self) -> dict[str, Any]:
        """Every session attached to the section, workers first (the monitor's
        ``/api/clients``, normalized)."""
        return self.client.clients().as_json()

    def api_history(
        self, queue: str, since: float | None, window: float | None, max_points: int | None = None
    ) -> dict[str, Any]:
        """The queue's history for the page: ``since`` (epoch seconds) or the last
        ``window`` seconds, at most ``max_points`` points (the page's width in
        pixels; never more than ``config.max_points``). The monitor thins a long
        window itself (the day comes from its T4 files); ``thin`` only guards
        against a monitor that does not."""
        now = time.time()
        if since is None:
            since = now - (window or WINDOWS[0][1])
        since = max(since, now - MAX_WINDOW)
        most = (
            self.config.max_points
            if max_points is None
            else max(10, min(max_points, self.config.max_points))
        )
        history = self.client.history(queue, since, max_points=most)
        return {
            "t": now,
            "queue": queue,
            "interval": history.interval,
            "step": history.step,
            "points": thin(history.points, most),
            "thinned": history.step > 0 or len(history.points) > most,
        }


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # connections waiting to be accepted (the standard library's 5 is too few)
    request_queue_size = 128
    viewer: Viewer


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "ringq-rtv"
    sys_version = ""

    # Routing.

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        query = parse_qs(parts.query)
        via_query = self._token_from_query(query)
        if not self._authorized(via_query):
            self._send_text(
                HTTPStatus.UNAUTHORIZED,
                "401 Unauthorized: this ringq viewer needs its token; open the address "
                "printed by `ringq rtv` (http://HOST:PORT/?token=...).\n",
                {"WWW-Authenticate": 'Bearer realm="ringq rtv"'},
            )
            return
        path = parts.path
        if path == "/" or path == "/index.html":
            self._send_static("index.html", set_cookie=via_query is not None)
        elif path.startswith("/static/"):
            self._send_static(path[len("/static/") :])
        elif path == "/api/queues":
            self._send_api(lambda: self.server.viewer.api_queues())
        elif path == "/api/clients":
            self._send_api(lambda: self.server.viewer.api_clients())
        elif path == "/api/history":
            queue = _first(query, "queue")
            if not queue:
                self._send_json(HTTPStatus.BAD_REQUEST, {"error": "queue= is required"})
                return
            try:
                since = _float(_first(query, "since"))
                window = _float(_first(query, "window"))
                most = _float(_first(query, "max_points"))
            except ValueError as exc:
                self._send_json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
                return
            points = None if most is None else int(most)
            self._send_api(lambda: self.server.viewer.api_history(queue, since, window, points))
        elif path == "/api/config":
            cfg = self.server.viewer.config
            self._send_json(
                HTTPStatus.OK,
                {
                    "monitor": cfg.monitor_url,
                    "refresh": cfg.refresh,
                    "window": cfg.window,
                    "windows": [{"label": label, "seconds": s} for label, s in WINDOWS],
                },
            )
        else:
            self._send_text(HTTPStatus.NOT_FOUND, "404 Not Found\n")

    def do_HEAD(self) -> None:
        self._send_text(HTTPStatus.METHOD_NOT_ALLOWED, "", {"Allow": "GET"})

    def do_POST(self) -> None:
        self._send_text(
            HTTPStatus.METHOD_NOT_ALLOWED, "405 the viewer is read-only\n", {"Allow": "GET"}
        )

    do_PUT = do_DELETE = do_PATCH = do_POST

    # Authentication.

    def _cookie_name(self) -> str:
        return f"ringq_rtv_{self.server.server_address[1]}"

    def _token_from_query(self, query: dict[str, list[str]]) -> str | None:
        values = query.get("token")
        return values[0] if values else None

    def _authorized(self, via_query: str | None) -> bool:
        # One credential is judged, the most explicit one offered: a fresh
        # ?token= wins over a cookie left by an earlier run on this port.
        offered = via_query
        if offered is None:
            header = self.headers.get("Authorization", "")
            if header[:7].lower() == "bearer ":
                offered = header[7:].strip()
        if offered is None:
            offered = self._token_from_cookie()
        if offered is None:
            return False
        expected = self.server.viewer.config.token
        return hmac.compare_digest(offered.encode(), expected.encode())

    def _token_from_cookie(self) -> str | None:
        raw = self.headers.get("Cookie")
        if not raw:
            return None
        try:
            morsel = SimpleCookie(raw).get(self._cookie_name())
        except CookieError:
            return None
        return unquote(morsel.value) if morsel is not None else None

    # Responses.

    def _send_api(self, produce: Any) -> None:
        try:
            body = produce()
        except MonitorUnavailable as exc:
            self._send_json(HTTPStatus.BAD_GATEWAY, {"error": str(exc), "monitor": "unreachable"})
        except MonitorError as exc:
            # The monitor's "no such queue" stays a 404; anything else is a bad gateway.
            status = HTTPStatus.NOT_FOUND if exc.status == 404 else HTTPStatus.BAD_GATEWAY
            self._send_json(status, {"error": str(exc), "monitor": "error", "status": exc.status})
        else:
            self._send_json(HTTPStatus.OK, body)

    def _send_static(self, name: str, *, set_cookie: bool = False) -> None:
        resource = _static(name)
        if resource is None:
            self._send_text(HTTPStatus.NOT_FOUND, "404 Not Found\n")
            return
        data = resource.read_bytes()
        ctype = CONTENT_TYPES.get(name.rsplit(".", 1)[-1], "text/plain; charset=utf-8")
        headers = {}
        if set_cookie:
            headers["Set-Cookie"] = (
                f"{self._cookie_name()}={quote(self.server.viewer.config.token, safe='')}; "
                "Path=/; HttpOnly; SameSite=Strict"
            )
        self._send(HTTPStatus.OK, data, ctype, headers)

    def _send_json(self, status: HTTPStatus, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
        self._send(status, data, "application/json")

    def _send_text(
        self, status: HTTPStatus, text: str, headers: dict[str, str] | None = None
    ) -> None:
        self._send(status, text.encode(), "text/plain; charset=utf-8", headers)

    def _send(
        self, status: HTTPStatus, data: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        try:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            for key, value in {**SECURITY_HEADERS, **(headers or {})}.items():
                self.send_header(key, value)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the page went away mid-answer

    def log_message(self, format: str, *args: Any) -> None:
        # No access log (the token may be in the request line); errors only.
        pass

    def log_error(self, format: str, *args: Any) -> None:
        # A malformed request is quoted in the message, ?token= included: redacted.
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rtv http: %s", redact_dsn(format % args))


def _static(name: str) -> Traversable | None:
    """The packaged file ``static/<name>``, or ``None`` (no path outside it)."""
    segments = name.split("/")
    if not name or any(s in ("", ".", "..") or "\\" in s for s in segments):
        return None
    node: Traversable = resources.files("ringq.rtv").joinpath(STATIC)
    for s in segments:
        node = node.joinpath(s)
    return node if node.is_file() else None


def _first(query: dict[str, list[str]], key: str) -> str | None:
    values = query.get(key)
    return values[0] if values else None


def _float(raw: str | None) -> float | None:
    if raw is None or raw == "":
        return None
    value = float(raw)
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {raw!r}")
    return value

