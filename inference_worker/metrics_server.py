"""The worker's Prometheus exporter, behind the same bearer token as the web's /metrics.

The exposition says which adapters a worker holds, how busy it is and how its tenants' pools are doing: it
is not public. `GET /metrics` answers only `Authorization: Bearer <LORAFLEET_METRICS_TOKEN>` (compared in
constant time), 401 with `WWW-Authenticate` otherwise, and 404 when no token is configured — as the web's
endpoint does (gateway/metrics.py), so one token and one Prometheus credentials file serve both.

It listens on 127.0.0.1 unless told otherwise (`run_worker --metrics-addr`, default from
LORAFLEET_WORKER_METRICS_ADDR); compose binds the container's interfaces so Prometheus reaches it over the
compose network, and publishes no port. No access log: a request line is all it would add, and the
Authorization header must never reach a log.

Django-free: the caller passes the token (inference_worker/worker.py reads it from the settings).
"""
from __future__ import annotations

import hmac
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

PATHS = frozenset({"/metrics", "/"})  # "/" as prometheus_client's own server answers it


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck scrape never holds the worker's shutdown


class _Server6(_Server):
    address_family = socket.AF_INET6


def _token_matches(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def serve(registry: CollectorRegistry, *, port: int, token: str, addr: str = "127.0.0.1") -> ThreadingHTTPServer:
    """Start the exporter on a daemon thread; `port` 0 picks a free one (`server.server_port`)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if not token or path not in PATHS:
                self._answer(404, b"Not found.\n")
            elif not _token_matches(self.headers.get("Authorization"), token):
                self._answer(401, b"Send 'Authorization: Bearer <LORAFLEET_METRICS_TOKEN>'.\n",
                             {"WWW-Authenticate": 'Bearer realm="lorafleet-worker-metrics"'})
            else:
                self._answer(200, generate_latest(registry), content_type=CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, headers: dict[str, str] | None = None,
                    content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
            pass

    server = (_Server6 if ":" in addr else _Server)((addr, port), Handler)  # ":": an IPv6 address
    threading.Thread(target=server.serve_forever, name="lorafleet-metrics", daemon=True).start()
    return server
