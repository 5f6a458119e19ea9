"""Rollback under traffic, and the official openai client against the running stack."""
from __future__ import annotations

import json
import threading
import time

import openai
import pytest


def _version_of(r) -> tuple[int, str]:
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        chunks = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")]
        meta = chunks[0]["lorafleet"]
        assert chunks[-1]["lorafleet"]["weights_sha256"] == meta["weights_sha256"]
    else:
        meta = r.json()["lorafleet"]
    return meta["version"], meta["weights_sha256"]


def test_rollback_under_traffic_switches_requests_after_the_commit(e2e, db_rows):
    key = e2e.seed["keys"]["x"]
    v1, v2 = e2e.seed["adapters"]["rollback"]["versions"]
    assert (v1["number"], v2["number"]) == (1, 2)
    results: list[tuple[float, float, int, str]] = []  # sent, answered, version, sha256
    failures: list[str] = []
    stop = threading.Event()

    def client(i: int) -> None:
        while not stop.is_set():
            sent = time.time()
            r = e2e.post(key, {"model": "rollback", "prompt": "Once upon a time", "max_tokens": 6,
                               "temperature": 0, "stream": i % 2 == 0})
            if r.status_code != 200:
                failures.append(r.text)
                continue
            results.append((sent, time.time(), *_version_of(r)))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    snippet_started = time.time()
    committed_at = e2e.stack.django(
        "import time\nfrom adapters.models import Adapter\nfrom adapters.services import activate_version\n"
        f"a = Adapter.objects.get(tenant__slug='e2e-x-{e2e.suffix}', name='rollback')\n"
        "activate_version(a, a.versions.get(number=1), actor=None, reason='e2e: roll back under traffic')\n"
        "result = {'at': time.time()}"
    )["at"]
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(timeout=60)

    assert not failures
    sha_of = {1: v1["sha256"], 2: v2["sha256"]}
    assert all(sha == sha_of[version] for _, _, version, sha in results)
    before = [version for _, answered, version, _ in results if answered < snippet_started]
    after = [version for sent, _, version, _ in results if sent > committed_at]
    assert before and set(before) == {2}
    assert after and set(after) == {1}, "a request sent after the commit was answered by v2"
    rows = db_rows("SELECT version_number, weights_sha256 FROM gateway_auditrecord r JOIN adapters_adapter a "
                   "ON a.id = r.adapter_id WHERE a.name = 'rollback' AND r.status = 'ok'")
    assert {(row["version_number"], row["weights_sha256"]) for row in rows} == {(1, v1["sha256"]), (2, v2["sha256"])}


def test_the_official_openai_client_works_unchanged(e2e):
    client = openai.OpenAI(base_url=e2e.url + "/v1", api_key=e2e.seed["keys"]["a"], max_retries=0)
    sha = e2e.seed["adapters"]["a-0"]["versions"][0]["sha256"]

    completion = client.completions.create(model="a-0", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert completion.model == "a-0@1" and completion.choices[0].text
    assert completion.model_extra["lorafleet"]["weights_sha256"] == sha
    assert completion.usage.completion_tokens >= 1

    streamed = client.completions.create(model="a-0", prompt="Once upon a time", max_tokens=8, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text

    messages = [{"role": "user", "content": "Tell me a story"}]
    chat = client.chat.completions.create(model="a-1", messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="a-1", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[0].model_extra["lorafleet"]["adapter"] == "a-1"
    assert chunks[-1].usage.total_tokens == chat.usage.total_tokens

    models = {m.id for m in client.models.list()}
    assert {"a-0", "a-1", "a-2", "a-3"} <= models and not any(m.startswith("b-") for m in models)

    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="b-0", prompt="Hi", max_tokens=2)
    assert err.value.code == "adapter_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=e2e.url + "/v1", api_key="lf_live_nope", max_retries=0).models.list()
