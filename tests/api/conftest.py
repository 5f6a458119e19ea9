"""API-shape tests: the real request path down to the queue boundary, which is replaced by a scripted
dispatcher (tests/e2e drives real workers). The lead's `world` fixture provides alice/acme and
charlie/globex; here its base gets a real tiny checkpoint so prompts are tokenized for real."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapters.manifest import shape_manifest_from_checkpoint
from adapters.models import BaseModel
from demo.tiny_base import build_tiny_base
from gateway import limits, queue
from protocol.jobs import GenerationResult
from transport.replies import ReplyTimeout


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return build_tiny_base(tmp_path_factory.mktemp("api_tiny"), arch="llama", seed=5, max_position=128)


class FakeDispatcher:
    """Records what would have been published and answers from a script: `answer(job, meta)` returns
    a list of reply events, an Exception to raise while waiting, or None (silence -> timeout)."""

    def __init__(self):
        self.published: list[SimpleNamespace] = []
        self.cancelled: list[str] = []
        self.publish_error: Exception | None = None
        self.answer = self.default_answer

    @staticmethod
    def default_answer(job, meta):
        text = "hello there"
        result = GenerationResult(
            request_id=job.request_id, status="ok", text=text, token_ids=[5, 6], finish_reason="length",
            prompt_tokens=3, completion_tokens=2, adapter_sha256=job.adapter.sha256 if job.adapter else None,
            adapter_identity=job.adapter.identity if job.adapter else None,
            queued_s=0.01, first_token_s=0.02, total_s=0.03,
        ).to_dict()
        sha = job.adapter.sha256 if job.adapter else None
        events = []
        if meta["stream"]:
            events += [{"type": "delta", "text": "hello", "worker_id": "w1", "adapter_sha256": sha},
                       {"type": "delta", "text": " there", "worker_id": "w1", "adapter_sha256": sha}]
        return events + [{"type": "final", "result": result, "worker_id": "w1", "attempts": 1}]

    def publish(self, job, meta, *, queue, expires_s):
        if self.publish_error is not None:
            raise self.publish_error
        self.published.append(SimpleNamespace(job=job, meta=meta, queue=queue, expires_s=expires_s))

    def events(self, request_id, deadline):
        sent = next(p for p in self.published if p.job.request_id == request_id)
        answer = self.answer(sent.job, sent.meta)
        if isinstance(answer, Exception):
            raise answer
        if answer is None:
            raise ReplyTimeout(request_id)
        yield from answer

    def cancel(self, request_id):
        self.cancelled.append(request_id)


@pytest.fixture
def dispatcher(monkeypatch):
    fake = FakeDispatcher()
    monkeypatch.setattr(queue, "_dispatcher", fake)
    monkeypatch.setattr(limits, "_counters", limits.LocalCounters())
    return fake


@pytest.fixture
def api(world, tiny_checkpoint, dispatcher):
    """`world` with a servable base."""
    BaseModel.objects.filter(pk=world.base.pk).update(
        checkpoint_path=str(tiny_checkpoint), shape_manifest=shape_manifest_from_checkpoint(tiny_checkpoint)
    )
    world.base.refresh_from_db()
    world.dispatcher = dispatcher
    return world


@pytest.fixture
def post(client):
    """post(path, body, key=secret) -> response; JSON body, Bearer key."""

    def call(path: str, body: dict, *, key: str | None = None, **headers):
        if key is not None:
            headers["HTTP_AUTHORIZATION"] = f"Bearer {key}"
        return client.post(path, data=json.dumps(body), content_type="application/json", **headers)

    return call
