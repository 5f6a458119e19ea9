"""Prometheus metrics of the web process, served at /metrics (the worker serves its own)."""
from __future__ import annotations

from django.http import HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

REQUESTS = Counter(
    "lorafleet_http_requests_total", "Inference API requests answered, by route, HTTP status and tenant.",
    ["route", "status", "tenant"],
)
LATENCY = Histogram(
    "lorafleet_http_request_duration_seconds", "Time from request to the last byte of the answer, by route.",
    ["route"], buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
IN_FLIGHT = Gauge("lorafleet_http_requests_in_flight", "Inference API requests being answered now.")
ENQUEUED = Counter("lorafleet_jobs_enqueued_total", "Jobs published to a base model's queue.", ["base"])


def observe(route: str, status: int, tenant: str, seconds: float) -> None:
    REQUESTS.labels(route=route, status=str(status), tenant=tenant or "-").inc()
    LATENCY.labels(route=route).observe(seconds)


def metrics_view(request) -> HttpResponse:
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)
