"""Schemathesis against /api/schema/, in-process against the WSGI app with a valid key.

Every operation of the published schema gets generated requests (valid and invalid bodies, odd path
parameters, odd headers); none may answer 5xx, and every answer must match the schema: a documented
status code, the documented content type, a body and headers that validate. The queue boundary is
the recording dispatcher (this test is about the API surface; tests/e2e drives real workers).
"""
from __future__ import annotations

import json
import os

import pytest
import schemathesis
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import checks

pytestmark = pytest.mark.django_db

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")
TOTAL_CASES = 1200 if FULL else 150
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance]


def _on_postgres() -> bool:
    from django.conf import settings

    return "postgresql" in settings.DATABASES["default"]["ENGINE"]


@pytest.mark.parametrize("body", [{"model": "acme-only", "prompt": "hi", "x\u0000y": 1},
                                  {"model": "acme\u0000only", "prompt": "hi"},
                                  {"model": "acme-only", "prompt": "h\u0000i", "max_tokens": 1}],
                         ids=["nul-in-field-name", "nul-in-model", "nul-in-prompt"])
def test_a_nul_byte_in_the_body_is_never_a_500(realm, client, body):
    """Answered (a NUL inside a prompt is text) or refused by name, and on the record either way."""
    from gateway.models import AuditRecord

    response = client.post("/v1/completions", data=json.dumps(body), content_type="application/json",
                           HTTP_AUTHORIZATION=f"Bearer {realm.acme_secret}")
    assert response.status_code in (200, 400, 404), response.status_code
    assert AuditRecord.objects.filter(request_id=response["X-Lorafleet-Request-Id"]).count() == 1


@pytest.fixture
def wsgi_app():
    """The real WSGI handler, minus what Django's test client also switches off: closing the database
    connection at each request's end (it would close the test's transaction, and every later request
    would run against an empty database)."""
    from django.core import signals
    from django.db import close_old_connections

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield get_wsgi_application()
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def fuzz_realm(realm):
    # One tenant takes every generated request: its per-minute quota must not turn the run into 429s.
    realm.acme.requests_per_minute = 10**6
    realm.acme.max_concurrent_requests = 10**6
    realm.acme.save()
    return realm


def _schema_json(client) -> dict:
    import json

    response = client.get("/api/schema/?format=json")
    assert response.status_code == 200
    return json.loads(response.content)


def test_published_schema_documents_request_bodies(client):
    """Found by this suite (the views' empty parser_classes hid the bodies from drf-spectacular); fixed in 6931a43."""
    paths = _schema_json(client)["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        body = paths[path]["post"].get("requestBody", {})
        assert "application/json" in body.get("content", {}), path


def test_unrouted_v1_paths_answer_json(realm, client):
    """Found by schemathesis (a newline in a model name fell through to Django's HTML 404); fixed in 669a2b3."""
    response = client.get("/v1/models/a%0Ab", HTTP_AUTHORIZATION=f"Bearer {realm.acme_secret}")
    assert response.status_code == 404
    assert response["Content-Type"].startswith("application/json")


@pytest.fixture
def published_schema(client):
    raw = _schema_json(client)
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "requestBody" in raw["paths"][path]["post"], path
    return schemathesis.openapi.from_dict(raw)


def test_schema_fuzz(fuzz_realm, published_schema, wsgi_app):
    from schemathesis import GenerationMode

    app = wsgi_app
    operations = [result.ok() for result in published_schema.get_all_operations()]
    assert len(operations) >= 4, [op.label for op in operations]
    headers = {"Authorization": f"Bearer {fuzz_realm.acme_secret}"}
    counts: dict[str, int] = {}
    statuses: dict[int, int] = {}

    def fuzz(operation, mode, budget: int, pass_no: int) -> None:
        @seed(pass_no)
        @given(case=operation.as_strategy(generation_mode=mode), real_model=st.booleans())
        @settings(max_examples=budget, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case, real_model):
            if real_model and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = "acme-only"  # half the bodies name a real adapter and can succeed
            response = case.call_and_validate(headers=headers, checks=CHECKS, app=app)
            label = f"{operation.label} [{mode.value}]"
            counts[label] = counts.get(label, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1

        try:
            run()
        except Unsatisfiable:
            # an operation with nothing to get wrong (GET /v1/models: no parameters, no body)
            assert mode is GenerationMode.NEGATIVE, operation.label

    # Reads get a small budget each; bodies are where the surface is, so the POSTs get TOTAL_CASES of
    # their own (however many read routes the schema grows), in passes with fresh seeds until it is
    # reached (Hypothesis stops a pass early when it runs out of distinct examples).
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    posts = [op for op in operations if op.method.upper() == "POST"]
    for operation in (op for op in operations if op.method.upper() != "POST"):
        for mode in modes:
            fuzz(operation, mode, 20, 0)
    reads = sum(counts.values())
    pass_no = 0
    while sum(counts.values()) - reads < TOTAL_CASES and pass_no < 20:
        left = TOTAL_CASES - (sum(counts.values()) - reads)
        for operation in posts:
            for mode in modes:
                fuzz(operation, mode, -(-left // (2 * len(posts))), pass_no)
        pass_no += 1
    total = sum(counts.values())
    print(f"\nschemathesis: {total} cases over {len(operations)} operations {counts}; statuses {statuses}")
    assert total - reads >= TOTAL_CASES
    assert not any(code >= 500 for code in statuses)
    assert statuses.get(200, 0) > 0, "nothing succeeded: the fuzz never got past authentication"
