"""Issue 47: megabyte bodies take paced turns, and the web lets go of a body once its answer is made.

The whole-stack figures (60 concurrent 2 MB prompts: web CPU per request, another tenant's latency, the web's
RSS) are tests/reliability/test_megabyte_prompts.py's; these pin the two mechanisms behind them.
"""
from __future__ import annotations

import json
import threading
import time
from itertools import pairwise
from types import SimpleNamespace

import pytest
from django.test import RequestFactory

from gateway import input_bounds
from gateway.input_bounds import LARGE_BODY_BYTES, LargeBodyTurn


def request(key: str, length: int):
    return RequestFactory().post("/v1/completions", data=b"", content_type="application/json",
                                 HTTP_AUTHORIZATION=f"Bearer {key}", CONTENT_LENGTH=str(length))


def turns(requests_and_tenants, work_s: float) -> list[tuple[float, float]]:
    """Run each request's turn (key, then tenant) in its own thread, released together; each holds its turn for
    `work_s`. Returns each turn's (start, end) in the order given."""
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * len(requests_and_tenants)
    barrier = threading.Barrier(len(requests_and_tenants))

    def run(i, req, tenant):
        barrier.wait()
        with LargeBodyTurn(req) as turn:
            turn.take(tenant)
            started = time.monotonic()
            time.sleep(work_s)
        spans[i] = (started, time.monotonic())

    threads = [threading.Thread(target=run, args=(i, r, t)) for i, (r, t) in enumerate(requests_and_tenants)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return spans


@pytest.fixture(autouse=True)
def fresh_stripes(monkeypatch):
    stripes = len(LargeBodyTurn._by_key)
    monkeypatch.setattr(LargeBodyTurn, "_key_rest_until", [0.0] * stripes)
    monkeypatch.setattr(LargeBodyTurn, "_tenant_rest_until", [0.0] * stripes)


def test_a_keys_large_bodies_take_turns_with_a_rest_between_them(monkeypatch):
    monkeypatch.setattr(input_bounds, "LARGE_BODY_REST", 1.0)
    tenant = SimpleNamespace(pk=7)
    spans = sorted(turns([(request("k1", LARGE_BODY_BYTES), tenant)] * 3, work_s=0.15))
    for (_, end), (start, _) in pairwise(spans):
        assert start - end >= 0.14, spans  # one at a time, each after a rest as long as the turn before it


def test_another_keys_turns_of_the_same_tenant_wait_too(monkeypatch):
    monkeypatch.setattr(input_bounds, "LARGE_BODY_REST", 0.0)
    tenant = SimpleNamespace(pk=7)
    spans = sorted(turns([(request("k1", LARGE_BODY_BYTES), tenant), (request("k2", LARGE_BODY_BYTES), tenant)],
                         work_s=0.15))
    assert spans[1][0] >= spans[0][1] - 0.01, spans


def test_small_bodies_and_other_tenants_never_wait_for_a_turn(monkeypatch):
    monkeypatch.setattr(input_bounds, "LARGE_BODY_REST", 1.0)
    first = LargeBodyTurn(request("k1", LARGE_BODY_BYTES))._key
    other = next(k for k in (f"k{i}" for i in range(2, 200)) if LargeBodyTurn(request(k, LARGE_BODY_BYTES))._key != first)
    spans = turns([(request("k1", LARGE_BODY_BYTES), SimpleNamespace(pk=7)),
                   (request("k1", LARGE_BODY_BYTES - 1), SimpleNamespace(pk=7)),
                   (request(other, LARGE_BODY_BYTES), SimpleNamespace(pk=8))], work_s=0.3)
    starts = [s for s, _ in spans]
    assert max(starts) - min(starts) < 0.2, spans  # all three at once


def test_a_rest_is_never_longer_than_its_cap(monkeypatch):
    monkeypatch.setattr(input_bounds, "LARGE_BODY_REST", 100.0)
    monkeypatch.setattr(input_bounds, "LARGE_BODY_MAX_REST_S", 0.2)
    spans = sorted(turns([(request("k1", LARGE_BODY_BYTES), SimpleNamespace(pk=7))] * 2, work_s=0.1))
    assert 0.15 <= spans[1][0] - spans[0][1] < 0.6, spans


@pytest.mark.django_db
def test_the_api_lets_go_of_a_body_once_it_has_answered(api, client):
    """DRF's request and view refer to each other, so the request object lives until the cyclic collector's
    next full pass; the body it cached must not live with it (gateway/middleware.py's release_body)."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900 kB: cannot fit the tiny context
    r = client.post("/v1/completions", data=json.dumps({"model": "support-bot", "prompt": prompt, "max_tokens": 4}),
                    content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {api.acme_secret}")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert len(r.wsgi_request.body) == 0  # the request the answer was made for holds no copy of the body
