"""The web keeps its PostgreSQL connections in a pool (LORAFLEET_DB_POOL_MAX, config/settings.py) instead of
opening a backend — a fork, authentication, catalog warm-up — per request, twice per inference request (it gives
its connection back while it waits on the worker). Under one tenant's flood that was most of the other
tenants' web time (bench/RESULTS.md, "Fairness"). On the real stack, as the runtime role."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg

POOL_MAX = 16  # settings' default, per process


def _answer_all(rel_stack, n: int) -> None:
    models = sorted(rel_stack.seed["adapters"])

    def call(i: int) -> int:
        return httpx.post(rel_stack.url + "/v1/completions", timeout=120,
                          headers={"Authorization": f"Bearer {rel_stack.seed['keys']['a']}"},
                          json={"model": models[i % len(models)], "prompt": f"Pool {i}", "max_tokens": 2}).status_code

    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(call, range(n))) == {200}


def _app_connections(rel_stack, conn) -> list[tuple]:
    return conn.execute("SELECT pid, backend_start FROM pg_stat_activity WHERE usename = %s AND datname = %s",
                        (rel_stack.role, rel_stack.db_name)).fetchall()


def test_the_web_reuses_pooled_connections_instead_of_one_per_request(rel_stack):
    _answer_all(rel_stack, 24)  # the pool grows to what 8 concurrent clients need
    with psycopg.connect(rel_stack.owner_url, autocommit=True) as conn:
        mark = conn.execute("SELECT now()").fetchone()[0]
        _answer_all(rel_stack, 48)
        rows = _app_connections(rel_stack, conn)
    # Without a pool every connection is closed at the end of its request: none would be left.
    assert rows, "no connection of the runtime role outlived its request"
    assert len(rows) <= POOL_MAX + 2, rows  # the web's pool, and the worker's two idle ones
    opened = [pid for pid, started in rows if started > mark]
    # 48 requests = 96 connections without the pool; with it, at most a little growth of the pool
    assert len(opened) <= 4, f"{len(opened)} of {len(rows)} pooled connections were opened during 48 requests"
