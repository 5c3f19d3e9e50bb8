"""An HTTP endpoint for the scale signal: what KEDA's ``metrics-api`` scaler reads.

``dbtrigger partitions backlog --trigger app:orders --serve 0.0.0.0:8080``
serves, from the standard library's HTTP server:

* ``GET /backlog`` - :meth:`~dbtrigger.partitions.backlog.Backlog.to_json`:
  ``desired_replicas`` (for ``valueLocation``), ``backlog_rows``,
  ``oldest_seconds`` and each partition's share. ``?target=N`` overrides the
  rows per replica the server was started with;
* ``GET /metrics`` - the same as Prometheus gauges;
* ``GET /healthz`` - ``ok`` while the server runs.

A measurement is cached for ``min_interval`` seconds, so scalers and scrapers
polling often cost the database one measurement per interval. A measurement
that fails (the database or the store is down) answers 503 with the error,
its URL redacted, and is retried at the next request: a scaler then keeps the
replicas it has (KEDA's ``fallback`` decides otherwise if configured).

Run it as its own small Deployment (one replica) rather than inside the
workers, so the signal is there when the workers are scaled to zero.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from dbtrigger.errors import ConfigurationError
from dbtrigger.partitions.backlog import DEFAULT_TARGET_ROWS, Backlog
from dbtrigger.redaction import redact

log = logging.getLogger("dbtrigger.partitions")

#: Seconds a measurement is served from the cache.
DEFAULT_MIN_INTERVAL_SECONDS = 5.0


class BacklogCache:
    """Measures on demand, at most once per ``min_interval`` seconds (thread-safe)."""

    def __init__(
        self,
        measure: Callable[[], Backlog],
        *,
        min_interval: float = DEFAULT_MIN_INTERVAL_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.measure = measure
        self.min_interval = min_interval
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._last: tuple[float, Backlog] | None = None

    def get(self) -> Backlog:
        with self._lock:
            now = self.monotonic()
            if self._last is not None and now - self._last[0] < self.min_interval:
                return self._last[1]
            backlog = self.measure()
            self._last = (now, backlog)
            return backlog


class BacklogServer(ThreadingHTTPServer):
    """A threading HTTP server answering ``/backlog``, ``/metrics`` and ``/healthz``."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        cache: BacklogCache,
        *,
        target_rows: int = DEFAULT_TARGET_ROWS,
    ) -> None:
        if target_rows < 1:
            raise ConfigurationError(f"--target must be at least 1 row, got {target_rows}")
        self.cache = cache
        self.target_rows = target_rows
        try:
            super().__init__(address, _Handler)
        except (OSError, OverflowError) as exc:  # in use, not this host's, not a port
            raise ConfigurationError(
                f"cannot serve the backlog on {address[0]}:{address[1]}: {exc}"
            ) from exc

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: BacklogServer

    def do_GET(self) -> None:
        parts = urlsplit(self.path)
        if parts.path == "/healthz":
            self._send(200, "text/plain; charset=utf-8", b"ok\n")
            return
        if parts.path not in ("/backlog", "/metrics"):
            self._send_json(404, {"error": f"no such path {parts.path!r}: /backlog, /metrics"})
            return
        try:
            target = _target(parse_qs(parts.query), self.server.target_rows)
        except ConfigurationError as exc:
            self._send_json(400, {"error": str(exc)})
            return
        try:
            backlog = self.server.cache.get()
        except Exception as exc:  # noqa: BLE001 - a scaler needs an answer, not a dead server
            log.warning(
                "backlog measurement failed: %s",
                redact(str(exc)),
                extra={"event": "backlog_failed", "error_type": type(exc).__name__},
            )
            self._send_json(503, {"error": redact(f"{type(exc).__name__}: {exc}")[:500]})
            return
        if parts.path == "/metrics":
            text = backlog.prometheus(target).encode()
            self._send(200, "text/plain; version=0.0.4; charset=utf-8", text)
        else:
            self._send_json(200, backlog.to_json(target))

    def _send_json(self, status: int, body: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(body).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("backlog endpoint: " + format, *args, extra={"event": "backlog_request"})


def _target(query: dict[str, list[str]], default: int) -> int:
    raw = query.get("target")
    if not raw:
        return default
    try:
        value = int(raw[-1])
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"target must be a whole number of rows >= 1, got {raw[-1]!r}")
    return value


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``:8080`` means every interface)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(f"--serve takes HOST:PORT (e.g. 0.0.0.0:8080), got {text!r}")
    return host or "0.0.0.0", int(port)  # noqa: S104 - the operator asked for every interface
