"""Every failure code, triggered for real against the running stack, each leaving its audit row."""
from __future__ import annotations

import time

import httpx

from tests.e2e.conftest import series_value


def audit_row(db_rows, request_id: str) -> dict:
    rows = db_rows("SELECT * FROM gateway_auditrecord WHERE request_id::text = %s", (request_id,))
    assert len(rows) == 1
    return rows[0]


def check(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    return r.headers["X-Lorafleet-Request-Id"]


def test_a_corrupted_blob_is_a_502_integrity_error_never_served(e2e, db_rows):
    version = e2e.seed["adapters"]["corrupt"]["versions"][0]
    blob = e2e.storage / version["storage_key"]
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the weights
    blob.write_bytes(bytes(data))
    r = e2e.post(e2e.seed["keys"]["x"], {"model": "corrupt", "prompt": "Hello", "max_tokens": 4})
    row = audit_row(db_rows, check(r, 502, "adapter_integrity_error"))
    assert (row["status"], row["http_status"], row["error_code"], row["weights_sha256"]) == \
        ("error", 502, "adapter_integrity_error", "")
    assert row["expected_sha256"] == version["sha256"] and row["worker_id"]


def test_a_blob_missing_from_storage_is_a_502_load_failure(e2e, db_rows):
    version = e2e.seed["adapters"]["vanished"]["versions"][0]
    (e2e.storage / version["storage_key"]).unlink()
    r = e2e.post(e2e.seed["keys"]["x"], {"model": "vanished", "prompt": "Hello", "max_tokens": 4})
    row = audit_row(db_rows, check(r, 502, "adapter_load_failed"))
    assert (row["http_status"], row["error_code"]) == (502, "adapter_load_failed")


def test_a_deleted_adapter_is_410(e2e, db_rows):
    key = e2e.seed["keys"]["x"]
    assert e2e.post(key, {"model": "to-delete", "prompt": "Hello", "max_tokens": 2}).status_code == 200
    e2e.stack.django(
        "from adapters.models import Adapter\nfrom adapters.services import soft_delete_adapter\n"
        f"soft_delete_adapter(Adapter.objects.get(tenant__slug='e2e-x-{e2e.suffix}', name='to-delete'))\n"
        "result = {}"
    )
    for model in ("to-delete", "to-delete@1"):
        r = e2e.post(key, {"model": model, "prompt": "Hello", "max_tokens": 2})
        assert audit_row(db_rows, check(r, 410, "adapter_deleted"))["http_status"] == 410


def test_not_ready_revoked_invalid_and_limited_requests_are_refused_on_the_record(e2e, db_rows):
    x = e2e.seed["keys"]["x"]
    r = e2e.post(x, {"model": "empty", "prompt": "Hello"})
    assert audit_row(db_rows, check(r, 409, "adapter_not_ready"))["adapter_name"] == "empty"
    r = e2e.post(e2e.seed["keys"]["revoked"], {"model": "rollback", "prompt": "Hello"})
    row = audit_row(db_rows, check(r, 401, "invalid_api_key"))
    assert row["tenant_id"] == e2e.seed["tenants"]["x"]["id"] and row["key_prefix"].startswith("lf_live_")
    r = e2e.post(x, {"model": "rollback", "prompt": "Hello " * 600})
    assert audit_row(db_rows, check(r, 400, "context_length_exceeded"))["http_status"] == 400
    r = e2e.post(x, {"model": "rollback", "prompt": "Hello", "max_tokns": 3})
    assert r.json()["error"]["param"] == "max_tokns"
    assert audit_row(db_rows, check(r, 400, "unknown_parameter"))["error_code"] == "unknown_parameter"

    limited = e2e.seed["keys"]["limited"]
    codes = [e2e.post(limited, {"model": "nothing", "prompt": "Hi"}) for _ in range(5)]
    refused = [r for r in codes if r.status_code == 429]
    assert refused and all(1 <= int(r.headers["Retry-After"]) <= 60 for r in refused)
    assert audit_row(db_rows, check(refused[0], 429, "rate_limit_exceeded"))["http_status"] == 429


def test_no_worker_in_time_is_a_504_on_the_record(e2e, db_rows):
    idle = e2e.seed["bases"]["idle"]["slug"]  # a base whose queue has no worker
    started = time.monotonic()
    r = e2e.post(e2e.seed["keys"]["x"], {"model": f"base/{idle}", "prompt": "Hello"},
                 headers={"X-Lorafleet-Timeout": "1.5"})
    assert 1.4 < time.monotonic() - started < 10
    row = audit_row(db_rows, check(r, 504, "timeout"))
    assert (row["status"], row["http_status"], row["base_slug"]) == ("error", 504, idle)


def test_cross_tenant_matrix_is_404_and_enqueues_nothing(e2e, db_rows):
    """Tenant B's key against tenant A's adapter: by name, by name@N, through /v1/models. Nothing reaches
    the queue: the web's enqueue counter, shown to count by B's own request first, does not move."""
    b = e2e.seed["keys"]["b"]
    main = e2e.seed["bases"]["main"]["slug"]
    series = f'lorafleet_jobs_enqueued_total{{base="{main}"}}'

    def enqueued() -> float:
        value = series_value(e2e.web_metrics(), series)
        assert value is not None, f"{series} is not exported: the check below would prove nothing"
        return value

    unseen = series_value(e2e.web_metrics(), series) or 0.0  # absent until the first job of the session
    assert e2e.post(b, {"model": "b-0", "prompt": "Hi", "max_tokens": 2}).status_code == 200  # B's own adapter
    before = enqueued()
    assert before == unseen + 1
    for model in ("a-1", "a-1@1", "a-2@1"):
        for path, body in (("/v1/completions", {"model": model, "prompt": "Hi"}),
                           ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}]})):
            r = e2e.post(b, body, path)
            row = audit_row(db_rows, check(r, 404, "adapter_not_found"))
            assert row["tenant_id"] == e2e.seed["tenants"]["b"]["id"] and row["status"] == "error"
    headers = {"Authorization": f"Bearer {b}"}
    assert httpx.get(e2e.url + "/v1/models/a-1", headers=headers, timeout=10).status_code == 404
    assert httpx.get(e2e.url + "/v1/models/a-1@1", headers=headers, timeout=10).status_code == 404
    listed = {m["id"] for m in httpx.get(e2e.url + "/v1/models", headers=headers, timeout=10).json()["data"]}
    assert not any(name.startswith("a-") for name in listed) and {"b-0", "b-1", "b-2", "b-3"} <= listed
    assert enqueued() == before
    assert not db_rows("SELECT 1 FROM gateway_auditrecord WHERE tenant_id = %s AND status = 'pending'",
                       (e2e.seed["tenants"]["b"]["id"],))
