"""A real worker's answer names the adapter identity it served and how it held the weights (float32 here: the
worker runs without --adapter-dtype), and the audit row keeps both (issue 12)."""
from __future__ import annotations

import json
import re

import httpx

from protocol.jobs import adapter_identity


def _row(db_rows, request_id: str) -> dict:
    rows = db_rows("SELECT adapter_identity, adapter_dtype, weights_sha256, worker_id, status FROM gateway_auditrecord "
                   "WHERE request_id::text = %s", (request_id,))
    assert len(rows) == 1
    return rows[0]


def test_the_answer_and_its_audit_row_name_the_identity_the_worker_served(e2e, db_rows):
    key = e2e.seed["keys"]["a"]
    for name in ("a-0", "a-1"):  # r=4 on q,v and r=8 on all four attention projections: two identities
        v = e2e.seed["adapters"][name]["versions"][0]
        expected = adapter_identity(v["sha256"], v["rank"], v["alpha"], v["use_rslora"], v["target_modules"])
        r = e2e.post(key, {"model": f"{name}@{v['number']}", "prompt": "Once upon a time", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["lorafleet"]["adapter_identity"] == expected == r.headers["X-Lorafleet-Adapter-Identity"]
        row = _row(db_rows, r.headers["X-Lorafleet-Request-Id"])
        assert (row["status"], row["adapter_identity"], row["weights_sha256"]) == ("ok", expected, v["sha256"])
        assert r.json()["lorafleet"]["adapter_dtype"] == "float32" == r.headers["X-Lorafleet-Adapter-Dtype"]
        assert row["adapter_dtype"] == "float32"
        # the caller sees an opaque worker name; the record keeps the real one for staff
        shown = r.headers["X-Lorafleet-Worker"]
        assert re.fullmatch(r"[0-9a-f]{16}", shown) and row["worker_id"] and row["worker_id"] != shown
        assert row["worker_id"] not in json.dumps(r.json())


def test_a_stream_names_the_identity_in_its_last_chunk_and_on_the_record(e2e, db_rows):
    v = e2e.seed["adapters"]["a-0"]["versions"][0]
    expected = adapter_identity(v["sha256"], v["rank"], v["alpha"], v["use_rslora"], v["target_modules"])
    body = {"model": "a-0", "prompt": "Once upon a time", "max_tokens": 3, "stream": True}
    with httpx.stream("POST", e2e.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {e2e.seed['keys']['a']}"}) as r:
        assert r.status_code == 200
        request_id = r.headers["X-Lorafleet-Request-Id"]
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    named = [c["lorafleet"]["adapter_identity"] for c in chunks if "lorafleet" in c]
    assert named[-1] == expected
    assert {c["lorafleet"]["adapter_dtype"] for c in chunks if "lorafleet" in c} == {"float32"}
    row = _row(db_rows, request_id)
    assert (row["adapter_identity"], row["adapter_dtype"]) == (expected, "float32")
