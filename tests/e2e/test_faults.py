"""Faults on a private stack (its own redis-server, web and worker), so stopping them hurts nobody:
a worker killed mid-request (the attempt cap ends the request as a recorded failure) and a broker
that is down (503 within 2 s, on the record)."""
from __future__ import annotations

import threading
import time

import httpx
import redis

from tests.e2e.conftest import Stack


def test_a_request_that_kills_its_worker_ends_recorded_and_a_dead_broker_is_a_fast_503(e2e, redis_server, db_rows):
    root = e2e.root / f"fault-{redis_server.port}"
    root.mkdir()
    env = {**e2e.env, "CELERY_BROKER_URL": redis_server.url,
           "LORAFLEET_MAX_ATTEMPTS": "1",  # one delivery; the redelivery after a crash is answered worker_lost
           "LORAFLEET_VISIBILITY_TIMEOUT_S": "3", "LORAFLEET_RESTORE_INTERVAL_S": "1",
           "LORAFLEET_REQUEST_TIMEOUT_S": "180"}
    stack = Stack(root, env)
    crash_base = e2e.seed["bases"]["crash"]["slug"]
    broker = redis.Redis.from_url(redis_server.url)
    key = e2e.seed["keys"]["x"]
    try:
        url = stack.start_web("web-fault")
        first = stack.start_worker(crash_base, "worker-crash-1")
        answer: dict = {}

        def call() -> None:
            answer["r"] = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=240,
                                     json={"model": "crash", "prompt": "Once", "max_tokens": 480, "ignore_eos": True})

        caller = threading.Thread(target=call)
        caller.start()
        # the job has started on the worker once its first attempt is counted: kill the worker then
        attempt_key = stack_wait(lambda: next(iter(broker.scan_iter("lorafleet:attempts:*")), None), 60)
        first.proc.kill()
        assert not answer, "the request finished before its worker was killed"
        stack.start_worker(crash_base, "worker-crash-2")
        caller.join(timeout=200)
        r = answer["r"]
        assert r.status_code == 502, r.text
        assert r.json()["error"]["code"] == "worker_lost"
        request_id = r.headers["X-Lorafleet-Request-Id"]
        assert attempt_key.decode().endswith(request_id)
        rows = db_rows("SELECT * FROM gateway_auditrecord WHERE request_id::text = %s", (request_id,))
        assert len(rows) == 1
        row = rows[0]
        assert (row["status"], row["http_status"], row["error_code"], row["attempts"]) == ("error", 502, "worker_lost", 2)
        assert row["worker_id"].startswith(crash_base + "@")

        # the broker goes away: the API answers 503 at once, and says so in the audit log
        redis_server.proc.kill()
        started = time.monotonic()
        r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=30,
                       json={"model": "crash", "prompt": "Once", "max_tokens": 4})
        elapsed = time.monotonic() - started
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_unavailable", r.text
        assert elapsed < 2.0, f"503 took {elapsed:.2f} s"
        print(f"\nbroker down: 503 in {elapsed * 1000:.0f} ms")
        rows = db_rows("SELECT status, http_status, error_code FROM gateway_auditrecord WHERE request_id::text = %s",
                       (r.headers["X-Lorafleet-Request-Id"],))
        assert rows == [{"status": "error", "http_status": 503, "error_code": "queue_unavailable"}]
    finally:
        stack.close()


def stack_wait(check, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("timed out")
