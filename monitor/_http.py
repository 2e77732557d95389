"""The monitor's HTTP service (see ``monitor/API.md`` for every shape).

The standard library's ``ThreadingHTTPServer`` in one thread: four read-only
GET endpoints answered from memory need no framework, and the monitor
stays installable with no dependency beyond the engine's (``prometheus_client``
is used, when installed, only to render ``/metrics``).
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import json
import logging
import math
import threading
import time
import xml.etree.ElementTree as ET
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from ringq.engine import redact_dsn

from . import _sample as S
from ._config import MonitorConfig
from ._history import Answer

logger = logging.getLogger("ringq.monitor.http")

DEFAULT_HISTORY_WINDOW = 300.0  # seconds of history returned when ``since`` is absent
MAX_HISTORY_POINTS = 100_000  # per request
MAX_HISTORY_STEP = 86_400.0  # seconds per bucket, at most
# Connections waiting to be accepted (the standard library's 5 made half of
# 500 concurrent requests time out).
LISTEN_BACKLOG = 128


class ApiSource(Protocol):
    """What the HTTP service reads (:class:`~._api.Documents` implements it)."""

    @property
    def config(self) -> MonitorConfig: ...  # read per request: cors_origin
    def current_token(self) -> str | None: ...
    def queues_doc(self) -> dict[str, Any]: ...
    def clients_doc(self) -> dict[str, Any]: ...
    def history_points(
        self,
        queue: str,
        since: float,
        until: float,
        limit: int,
        step: float = 0.0,
        max_points: int | None = None,
    ) -> Answer | None: ...
    def metrics_text(self) -> tuple[bytes, str]: ...


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = LISTEN_BACKLOG
    source: ApiSource


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "ringq-monitor"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        # The request line may carry ?token=: never logged as it came.
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", self.address_string(), redact_dsn(format % args))

    # -- plumbing -------------------------------------------------------------------

    def _send(
        self, status: int, body: bytes, ctype: str, extra: dict[str, str] | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        origin = self.server.source.config.cors_origin
        if origin is not None:  # cross-origin reads only when configured
            self.send_header("Access-Control-Allow-Origin", origin)
            if origin != "*":
                self.send_header("Vary", "Origin")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
        self._send(status, body, "application/json")

    def _error(self, status: HTTPStatus, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message, "status": int(status)}).encode()
        self._send(status, body, "application/json", extra)

    def _authorized(self, query: dict[str, list[str]]) -> bool:
        token = self.server.source.current_token()
        if token is None:
            return True
        given = ""
        auth = self.headers.get("Authorization", "")
        if auth[:7].lower() == "bearer ":
            given = auth[7:].strip()
        elif "token" in query:
            given = query["token"][0]
        return hmac.compare_digest(given.encode(), token.encode())

    # -- methods ----------------------------------------------------------------------

    def do_OPTIONS(self) -> None:
        # CORS preflight, so a page of the configured origin may send the token header.
        preflight = {"Access-Control-Allow-Methods": "GET, HEAD, OPTIONS",
                     "Access-Control-Allow-Headers": "Authorization",
                     "Access-Control-Max-Age": "600"}
        cors = self.server.source.config.cors_origin is not None
        headers = preflight if cors else {"Allow": "GET, HEAD, OPTIONS"}
        self._send(HTTPStatus.NO_CONTENT, b"", "text/plain", headers)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        path = url.path.rstrip("/") or "/"
        try:
            if path == "/metrics":
                body, ctype = self.server.source.metrics_text()
                self._send(HTTPStatus.OK, body, ctype)
                return
            if path not in ROUTES:
                self._error(HTTPStatus.NOT_FOUND, f"no such path {url.path!r}; see /api")
                return
            if not self._authorized(query):
                self._error(
                    HTTPStatus.UNAUTHORIZED,
                    "a token is required: Authorization: Bearer <token> or ?token=<token>",
                    {"WWW-Authenticate": 'Bearer realm="ringq"'},
                )
                return
            ROUTES[path](self, query)
        except BadRequest as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except (BrokenPipeError, ConnectionResetError):
            pass
        except Exception as exc:
            logger.exception("ringq monitor: %s failed", redact_dsn(self.path))
            with contextlib.suppress(OSError):
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")

    # -- routes ---------------------------------------------------------------------

    def _index(self, query: dict[str, list[str]]) -> None:
        self._json(HTTPStatus.OK, {"endpoints": sorted([*ROUTES, "/metrics"])})

    def _queues(self, query: dict[str, list[str]]) -> None:
        self._json(HTTPStatus.OK, self.server.source.queues_doc())

    def _queues_xml(self, query: dict[str, list[str]]) -> None:
        body = queues_xml(self.server.source.queues_doc())
        self._send(HTTPStatus.OK, body, "application/xml; charset=utf-8")

    def _clients(self, query: dict[str, list[str]]) -> None:
        self._json(HTTPStatus.OK, self.server.source.clients_doc())

    def _history(self, query: dict[str, list[str]]) -> None:
        queue = _one(query, "queue")
        if not queue:
            raise BadRequest("missing ?queue=<name>")
        now = time.time()
        since = _time(query, "since", now - DEFAULT_HISTORY_WINDOW)
        until = _time(query, "until", float("inf"))
        limit = int(_float(query, "limit", MAX_HISTORY_POINTS))
        if not 1 <= limit <= MAX_HISTORY_POINTS:
            raise BadRequest(f"limit must be from 1 to {MAX_HISTORY_POINTS}")
        step = _float(query, "step", 0.0)
        if not 0.0 <= step <= MAX_HISTORY_STEP:
            raise BadRequest(f"step must be from 0 to {MAX_HISTORY_STEP:g} seconds")
        max_points = _one(query, "max_points")
        most = int(_float(query, "max_points", MAX_HISTORY_POINTS)) if max_points else None
        if most is not None and not 2 <= most <= MAX_HISTORY_POINTS:
            raise BadRequest(f"max_points must be from 2 to {MAX_HISTORY_POINTS}")
        answer = self.server.source.history_points(queue, since, until, limit, step, most)
        if answer is None:
            self._error(HTTPStatus.NOT_FOUND, f"no history for queue {queue!r}")
            return
        doc = self.server.source.queues_doc()
        self._json(HTTPStatus.OK, {"queue": queue, "interval": doc["monitor"]["interval"],
                                   "since": since, "step": answer.step, "points": answer.points})


ROUTES = {
    "/": _Handler._index,
    "/api": _Handler._index,
    "/api/queues": _Handler._queues,
    "/api/queues.xml": _Handler._queues_xml,
    "/api/history": _Handler._history,
    "/api/clients": _Handler._clients,
}


class BadRequest(ValueError):
    """A query parameter is missing or malformed (answered with 400)."""


def _one(query: dict[str, list[str]], key: str) -> str | None:
    vals = query.get(key)
    return vals[0] if vals else None


def _float(query: dict[str, list[str]], key: str, default: float) -> float:
    """The parameter as a finite number (``default`` when absent): inf, nan and
    1e400 are refused here, never met later as an overflow (a 500)."""
    raw = _one(query, key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{key} must be a number, not {raw!r}") from None
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, not {raw!r}")
    return value


def _time(query: dict[str, list[str]], key: str, default: float) -> float:
    """A time parameter (unix seconds), finite."""
    try:
        return _float(query, key, default)
    except BadRequest:
        raise BadRequest(
            f"{key} must be a finite number of unix seconds, not {_one(query, key)!r}"
        ) from None


def is_loopback(host: str) -> bool:
    """True if ``host`` (an address or name) is reachable only from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name, or "" / 0.0.0.0-like wildcards: reachable from elsewhere


def queues_xml(doc: dict[str, Any]) -> bytes:
    """The ``/api/queues`` document as XML (the original viewer protocol's shape)."""
    root = ET.Element("ringq", {"t": str(doc["t"])})
    mon = ET.SubElement(root, "monitor")
    for k, v in doc["monitor"].items():
        if isinstance(v, dict | list):
            continue
        ET.SubElement(mon, k).text = _xml_text(v)
    server = doc.get("server")
    if server is not None:
        _xml_fields(ET.SubElement(root, "server"), server)
    for q in doc["queues"]:
        el = ET.SubElement(root, "queue", {"name": str(q[S.NAME])})
        # a grouped queue's figures: its sample's; a monitor's own samples always have DUE_KEYS
        for k in (*S.NUMERIC_KEYS, *S.DUE_KEYS, *S.GROUP_KEYS):
            if k in q:
                ET.SubElement(el, k).text = _xml_text(q[k])
    body: bytes = ET.tostring(root, encoding="utf-8", xml_declaration=True)
    return body


def _xml_fields(parent: ET.Element, fields: dict[str, Any]) -> None:
    """One element per field; an object becomes an element of its own fields."""
    for k, v in fields.items():
        if isinstance(v, dict):
            _xml_fields(ET.SubElement(parent, k), v)
        else:
            ET.SubElement(parent, k).text = _xml_text(v)


def _xml_text(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


class HttpService:
    """The HTTP server in its own thread; ``start()``/``stop()`` are idempotent."""

    def __init__(self, source: ApiSource, host: str, port: int) -> None:
        self._source = source
        self._host = host
        self._port = port
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._server is not None:
            return
        server = _Server((self._host, self._port), _Handler)
        server.source = self._source
        self._server = server
        if not is_loopback(self._host) and self._source.current_token() is None:
            logger.warning(
                "ringq monitor: serving HTTP on %s:%d, beyond loopback, without a token: whoever "
                "reaches it reads every queue's figures "
                "(set a token: --token or RINGQ_MONITOR_TOKEN)",
                self._host, self.address[1],
            )
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="ringq-monitor-http",
            daemon=True,
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("the HTTP service is not started")
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
