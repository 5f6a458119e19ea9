"""POST/GET/DELETE /v1/files: a dataset is checked line by line while it streams; a bad one is a 400 naming the first
bad line and why, and leaves nothing stored; another tenant's file is a 404 everywhere."""
from __future__ import annotations

import json

import pytest

from finetune.models import TrainingFile

from .helpers import GOOD_EXAMPLES, auth, example, jsonl, stored_files, upload

pytestmark = pytest.mark.django_db


def test_it_stores_a_valid_file_by_sha256_and_lists_it(client, ft):
    import hashlib

    data = jsonl(GOOD_EXAMPLES)
    r = upload(client, ft.acme_key, data)
    assert r.status_code == 200, r.content
    body = r.json()
    assert body["id"].startswith("file-") and body["object"] == "file" and body["purpose"] == "fine-tune"
    assert body["bytes"] == len(data) and body["status"] == "processed" and body["filename"] == "train.jsonl"
    sha = hashlib.sha256(data).hexdigest()
    assert body["lorafleet"] == {"sha256": sha, "examples": len(GOOD_EXAMPLES)}
    assert (ft.storage / "datasets" / sha[:2] / f"{sha}.jsonl").read_bytes() == data

    listed = client.get("/v1/files", **auth(ft.acme_key)).json()
    assert [f["id"] for f in listed["data"]] == [body["id"]] and listed["has_more"] is False
    assert client.get(f"/v1/files/{body['id']}", **auth(ft.acme_key)).json()["id"] == body["id"]
    content = client.get(f"/v1/files/{body['id']}/content", **auth(ft.acme_key))
    assert b"".join(content.streaming_content) == data


@pytest.mark.parametrize(("data", "line", "says"), [
    (jsonl(GOOD_EXAMPLES[:2]) + b'{"messages": [\n', 3, "is not valid JSON"),
    (jsonl(GOOD_EXAMPLES[:1]) + b'{"messages": "hi"}\n', 2, '"messages" must be a non-empty list'),
    (jsonl(GOOD_EXAMPLES[:1]) + "caf\u00e9".encode("latin-1") + b"\n", 2, "is not valid UTF-8"),
    (jsonl([{"messages": [{"role": "user", "content": "hi"}]}]), 1, "no assistant turn"),
    (jsonl([{"messages": [{"role": "robot", "content": "hi"}]}]), 1, "role 'robot'"),
    (jsonl([example("q", "a", weight=2)]), 1, "weight 2"),
    (jsonl([example("q", "a", weight=0)]), 1, "every assistant turn has weight 0"),
    (jsonl([{"messages": [{"role": "user", "content": "q", "weight": 1}, {"role": "assistant", "content": "a"}]}]),
     1, "only assistant turns carry one"),
    (jsonl([{"prompt": "q", "completion": "a"}]), 1, "prompt/completion format is not supported"),
    (jsonl([{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]}]), 1,
     "must have a string content"),
])
def test_a_bad_line_is_a_400_naming_it_and_nothing_is_stored(client, ft, data, line, says):
    r = upload(client, ft.acme_key, data)
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["code"] == "invalid_file" and error["param"] == "file"
    assert f"line {line}: " in error["message"] and says in error["message"], error["message"]
    assert not TrainingFile.objects.exists() and stored_files(ft.storage) == []


def test_an_empty_file_and_a_wrong_purpose_are_refused(client, ft):
    r = upload(client, ft.acme_key, b"\n\n")
    assert r.status_code == 400 and "no training examples" in r.json()["error"]["message"]
    r = upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES), purpose="assistants")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_purpose"
    r = client.post("/v1/files", {"purpose": "fine-tune"}, **auth(ft.acme_key))
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"
    assert not TrainingFile.objects.exists() and stored_files(ft.storage) == []


def test_a_file_over_the_size_cap_is_stopped_and_nothing_is_stored(client, ft, settings):
    settings.LORAFLEET_FINETUNE_MAX_FILE_BYTES = 1000
    r = upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES * 10))
    assert r.status_code == 413, r.content
    assert r.json()["error"]["code"] == "file_too_large" and "1000 bytes" in r.json()["error"]["message"]
    assert not TrainingFile.objects.exists() and stored_files(ft.storage) == []


def test_with_a_base_named_a_line_over_its_context_is_refused_at_upload(client, ft):
    long_answer = " ".join(f"word{i}" for i in range(600))  # far more than the tiny base's 512 tokens
    data = jsonl([*GOOD_EXAMPLES[:3], example("Say a lot", long_answer)])
    r = upload(client, ft.acme_key, data, model="tiny-ft")
    assert r.status_code == 400, r.content
    error = r.json()["error"]
    assert error["code"] == "example_too_long" and "line 4" in error["message"] and "512" in error["message"]
    assert not TrainingFile.objects.exists() and stored_files(ft.storage) == []
    # without a base the same file is structurally fine: its lengths are checked when a job names its base
    assert upload(client, ft.acme_key, data).status_code == 200


def test_without_a_key_it_is_401_in_openais_shape(client, ft):
    r = client.get("/v1/files")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = upload(client, "lf_live_not_a_key", jsonl(GOOD_EXAMPLES))
    assert r.status_code == 401 and not TrainingFile.objects.exists()


def test_another_tenants_file_is_404_everywhere(client, ft):
    file_id = upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES)).json()["id"]
    for method, path in (("get", f"/v1/files/{file_id}"), ("get", f"/v1/files/{file_id}/content"),
                         ("delete", f"/v1/files/{file_id}")):
        r = getattr(client, method)(path, **auth(ft.globex_key))
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found", (method, path)
    assert client.get("/v1/files", **auth(ft.globex_key)).json()["data"] == []
    assert TrainingFile.objects.get(public_id=file_id).deleted_at is None


def test_delete_removes_the_file_and_its_bytes_once_nothing_uses_them(client, ft):
    data = jsonl(GOOD_EXAMPLES)
    first = upload(client, ft.acme_key, data).json()["id"]
    second = upload(client, ft.acme_key, data).json()["id"]  # same bytes: one blob
    assert len(stored_files(ft.storage)) == 1
    r = client.delete(f"/v1/files/{first}", **auth(ft.acme_key))
    assert r.status_code == 200 and r.json() == {"id": first, "object": "file", "deleted": True}
    assert len(stored_files(ft.storage)) == 1  # the second file still uses them
    assert client.get(f"/v1/files/{first}", **auth(ft.acme_key)).status_code == 404
    client.delete(f"/v1/files/{second}", **auth(ft.acme_key))
    assert stored_files(ft.storage) == []


def test_pages_follow_the_after_cursor(client, ft):
    ids = [upload(client, ft.acme_key, jsonl(GOOD_EXAMPLES[i:i + 1])).json()["id"] for i in range(3)]
    page = client.get("/v1/files", {"limit": 2}, **auth(ft.acme_key)).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    rest = client.get("/v1/files", {"limit": 2, "after": page["data"][-1]["id"]}, **auth(ft.acme_key)).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert json.loads(client.get("/v1/files", {"limit": 0}, **auth(ft.acme_key)).content)["error"]["param"] == "limit"
