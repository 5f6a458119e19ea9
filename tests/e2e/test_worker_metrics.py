"""The real worker's exporter (started by `run_worker`) answers only the web's metrics token, on loopback."""
from __future__ import annotations

import socket

import httpx

from tests.e2e.conftest import bearer


def test_the_workers_metrics_need_the_webs_token(e2e):
    url, token = e2e.worker.metrics_url, e2e.env["LORAFLEET_METRICS_TOKEN"]
    assert token == e2e.worker.metrics_token  # one token for web and worker
    for headers in ({}, bearer("not-the-token"), bearer(token + "x")):
        r = httpx.get(url, headers=headers, timeout=10)
        assert r.status_code == 401 and "lorafleet_worker" not in r.text
    r = httpx.get(url, headers=bearer(token), timeout=10)
    assert r.status_code == 200 and "lorafleet_worker_tokens_generated_total" in r.text
    # the web's endpoint answers the same token
    assert httpx.get(e2e.url + "/metrics", headers=bearer(token), timeout=10).status_code == 200


def test_the_worker_listens_on_loopback_by_default(e2e):
    """run_worker without --metrics-addr: the exporter's listening socket is bound to 127.0.0.1 only."""
    port = int(e2e.worker.metrics_url.rsplit(":", 1)[1].split("/")[0])
    assert listening_addresses(port) == ["127.0.0.1"]


def listening_addresses(port: int) -> list[str]:
    """IPv4/IPv6 addresses with a socket listening on `port` (Linux's /proc/net/tcp{,6}: state 0A is LISTEN)."""
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:
                    raw = bytes.fromhex(address)
                    if width == 8:
                        found.append(socket.inet_ntop(socket.AF_INET, raw[::-1]))
                    else:  # four little-endian 32-bit words
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                        found.append(socket.inet_ntop(socket.AF_INET6, words))
    return found
