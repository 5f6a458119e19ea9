"""The worker's exporter answers only the web's metrics token, and listens on loopback unless told otherwise.

The real worker's exporter, started by `run_worker`, is checked the same way in tests/e2e/test_worker_metrics.py.
"""
from __future__ import annotations

import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from inference_worker.metrics_server import serve

TOKEN = "worker-metrics-token-123"


@pytest.fixture
def exporter():
    registry = CollectorRegistry()
    Counter("lorafleet_worker_tokens_generated", "Tokens.", registry=registry).inc(7)
    servers = []

    def start(token: str = TOKEN, **kwargs):
        server = serve(registry, port=0, token=token, **kwargs)
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_port}/metrics"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_no_token_or_a_wrong_one_is_a_401_and_the_right_one_reads_the_series(exporter):
    _server, url = exporter()
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"},
                    {"Authorization": "Bearer"}, {"Authorization": f"Bearer {TOKEN}x"}):
        r = httpx.get(url, headers=headers, timeout=5)
        assert r.status_code == 401, headers
        assert r.headers["WWW-Authenticate"].startswith("Bearer")
        assert "lorafleet_worker" not in r.text
    r = httpx.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    assert "lorafleet_worker_tokens_generated_total 7.0" in r.text


def test_without_a_configured_token_there_is_no_endpoint(exporter):
    """As the web's /metrics in production without LORAFLEET_METRICS_TOKEN: 404, whatever is sent."""
    _server, url = exporter(token="")
    assert httpx.get(url, timeout=5).status_code == 404
    assert httpx.get(url, headers={"Authorization": "Bearer x"}, timeout=5).status_code == 404


def test_it_listens_on_loopback_by_default(exporter):
    server, _url = exporter()
    assert server.server_address[0] == "127.0.0.1"
    outward = _outward_address()
    if outward is None:
        pytest.skip("this host has no non-loopback IPv4 address to try")
    with pytest.raises(OSError):
        socket.create_connection((outward, server.server_port), timeout=2).close()


def test_it_listens_where_it_is_told(exporter):
    server, _url = exporter(addr="0.0.0.0")
    assert server.server_address[0] == "0.0.0.0"


def test_run_worker_binds_loopback_unless_the_setting_or_the_flag_says_otherwise(settings):
    from inference_worker.management.commands.run_worker import Command

    def addr(*argv):
        return Command().create_parser("manage.py", "run_worker").parse_args(["--base", "b", *argv]).metrics_addr

    assert addr() == "127.0.0.1"
    settings.LORAFLEET_WORKER_METRICS_ADDR = "10.0.0.5"
    assert addr() == "10.0.0.5"
    assert addr("--metrics-addr", "0.0.0.0") == "0.0.0.0"


def _outward_address() -> str | None:
    """An address of this host other than loopback (the one a default route would use), if any."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent over UDP connect
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address
