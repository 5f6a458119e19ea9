"""Prometheus metrics of the web process, served at /metrics (the worker serves its own).

The endpoint is not public: it answers `Authorization: Bearer <LORAFLEET_METRICS_TOKEN>` (compared in
constant time), 401 otherwise, and 404 when no token is configured (production without one: the
endpoint is off). The embedded default's token is documented in config/settings.py.

Series are aggregate by default. With LORAFLEET_METRICS_TENANT_LABELS on, the request counter carries a
`tenant` label (the slug) instead — the same metric name, one label more — so a scrape tells one tenant's
traffic from another's; tenant slugs are the customers' names, hence opt-in.
"""
from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .auth import bearer_token

_REQUESTS_NAME = "lorafleet_http_requests_total"
_REQUESTS_DOC = "Inference API requests answered, by route and HTTP status"
# One counter per labelling, each in its own registry: the exposition holds the one the setting selects.
_AGGREGATE = CollectorRegistry(auto_describe=True)
_BY_TENANT = CollectorRegistry(auto_describe=True)
REQUESTS = Counter(_REQUESTS_NAME, _REQUESTS_DOC + ".", ["route", "status"], registry=_AGGREGATE)
REQUESTS_BY_TENANT = Counter(_REQUESTS_NAME, _REQUESTS_DOC + " and tenant.", ["route", "status", "tenant"],
                             registry=_BY_TENANT)
LATENCY = Histogram(
    "lorafleet_http_request_duration_seconds", "Time from request to the last byte of the answer, by route.",
    ["route"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
IN_FLIGHT = Gauge("lorafleet_http_requests_in_flight", "Inference API requests being answered now.")
ENQUEUED = Counter("lorafleet_jobs_enqueued_total", "Jobs published to a base model's queue.", ["base"])
# The prefix cache's hit rate: rate(lorafleet_prompt_tokens_cached_total) / rate(lorafleet_prompt_tokens_total).
PROMPT_TOKENS = Counter("lorafleet_prompt_tokens_total", "Prompt tokens of answered requests, by base model.", ["base"])
CACHED_PROMPT_TOKENS = Counter(
    "lorafleet_prompt_tokens_cached_total", "Prompt tokens of answered requests whose KV came from the worker's prefix "
    "cache, by base model.", ["base"])


def observe_prompt(base: str, result) -> None:
    """Count an answered request's prompt tokens, and those the worker's prefix cache held."""
    PROMPT_TOKENS.labels(base=base).inc(max(result.prompt_tokens, 0))
    CACHED_PROMPT_TOKENS.labels(base=base).inc(max(result.cached_tokens, 0))


def tenant_labels() -> bool:
    return bool(getattr(settings, "LORAFLEET_METRICS_TENANT_LABELS", False))


def observe(route: str, status: int, tenant: str, seconds: float) -> None:
    if tenant_labels():
        REQUESTS_BY_TENANT.labels(route=route, status=str(status), tenant=tenant or "-").inc()
    else:
        REQUESTS.labels(route=route, status=str(status)).inc()
    LATENCY.labels(route=route).observe(seconds)


def token_matches(request) -> bool:
    """The bearer token equals the configured one (constant time); never true when none is configured."""
    expected = getattr(settings, "LORAFLEET_METRICS_TOKEN", "") or ""
    given = bearer_token(request)
    if not expected or given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def metrics_view(request) -> HttpResponse:
    if not getattr(settings, "LORAFLEET_METRICS_TOKEN", ""):
        return HttpResponse("Not found.\n", status=404, content_type="text/plain")
    if not token_matches(request):
        response = HttpResponse("Send 'Authorization: Bearer <LORAFLEET_METRICS_TOKEN>'.\n", status=401,
                                content_type="text/plain")
        response["WWW-Authenticate"] = 'Bearer realm="lorafleet-metrics"'
        return response
    body = generate_latest(REGISTRY) + generate_latest(_BY_TENANT if tenant_labels() else _AGGREGATE)
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
