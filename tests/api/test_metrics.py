"""/metrics answers only its bearer token, and names tenants only when the operator opts in."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.django_db

BODY = {"model": "support-bot", "prompt": "Once upon a time", "max_tokens": 4}


def scrape(client, token: str | None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token is not None else {}
    return client.get("/metrics", **headers)


def test_it_refuses_a_scrape_without_the_token(api, client, settings):
    settings.LORAFLEET_METRICS_TOKEN = "s3cret-metrics-token"
    for token in (None, "", "wrong-token", "s3cret-metrics-toke", "s3cret-metrics-token-", api.acme_secret):
        r = scrape(client, token)
        assert r.status_code == 401, token
        assert r["WWW-Authenticate"].startswith("Bearer")
        assert b"lorafleet_" not in r.content
    r = client.get("/metrics", HTTP_AUTHORIZATION="Basic czNjcmV0LW1ldHJpY3MtdG9rZW4=")
    assert r.status_code == 401
    r = scrape(client, "s3cret-metrics-token")
    assert r.status_code == 200 and b"lorafleet_http_requests_in_flight" in r.content


def test_without_a_configured_token_the_endpoint_is_off(api, client, settings):
    settings.LORAFLEET_METRICS_TOKEN = ""
    for token in (None, "", "anything"):
        assert scrape(client, token).status_code == 404


def test_the_embedded_default_has_a_documented_token(client, settings):
    assert not settings.LORAFLEET_PRODUCTION
    assert settings.LORAFLEET_METRICS_TOKEN == settings.LORAFLEET_DEV_METRICS_TOKEN
    assert scrape(client, settings.LORAFLEET_DEV_METRICS_TOKEN).status_code == 200


def test_series_are_aggregate_unless_tenant_labels_are_turned_on(api, post, client, settings):
    assert settings.LORAFLEET_METRICS_TENANT_LABELS is False  # the default
    assert post("/v1/completions", BODY, key=api.acme_secret).status_code == 200
    assert post("/v1/completions", BODY, key=api.globex_secret).status_code == 200
    text = scrape(client, settings.LORAFLEET_METRICS_TOKEN).content.decode()
    assert 'lorafleet_http_requests_total{route="completions",status="200"}' in text
    assert "tenant=" not in text and "acme" not in text and "globex" not in text

    settings.LORAFLEET_METRICS_TENANT_LABELS = True
    assert post("/v1/completions", BODY, key=api.acme_secret).status_code == 200
    text = scrape(client, settings.LORAFLEET_METRICS_TOKEN).content.decode()
    assert 'lorafleet_http_requests_total{route="completions",status="200",tenant="acme"}' in text
    # one labelling per exposition: never the same metric name twice
    assert text.count("# TYPE lorafleet_http_requests_total counter") == 1
