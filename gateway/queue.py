"""The queue client: publish a job on its base model's Celery queue, then read the worker's replies.

This is the only place the web process talks to workers, and it talks only through the broker and the
reply channel (transport.replies). Publishing fails fast: one connection attempt with a 1 s
timeout and no publish retries, so a broker that is down becomes a 503 within about a second instead
of a hang.

Which queue: `queue` is the base's; gateway/routing.py turns it into the tenant's pool (a dedicated one
where the tenant has it) and, with adapter affinity on, the own queue of the worker that owns the adapter.

Tests of pure API shapes replace the dispatcher with `set_dispatcher(fake)`; everything else uses
the real one.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from protocol.jobs import GenerationJob
from transport.replies import ChannelUnavailable, ReplyTimeout, ensure_local_folders, reply_channel

from .routing import Route, Router, RoutingUnavailable

log = logging.getLogger(__name__)

TASK_NAME = "lorafleet.generate"
CONNECT_TIMEOUT_S = 1.0

__all__ = ["QueueUnavailable", "ReplyTimeout", "Dispatcher", "CeleryDispatcher", "get_dispatcher", "set_dispatcher"]


class QueueUnavailable(RuntimeError):
    """The broker (or the reply store) cannot be reached."""


class Dispatcher(Protocol):
    def publish(self, job: GenerationJob, meta: dict, *, queue: str, expires_s: float) -> None: ...

    def events(self, request_id: str, deadline: float) -> Iterator[dict]: ...

    def cancel(self, request_id: str) -> None: ...


class CeleryDispatcher:
    def __init__(self, router: Router | None = None):
        ensure_local_folders()
        self.router = router or Router()

    def route(self, job: GenerationJob, queue: str) -> Route:
        try:
            return self.router.route(base_queue=queue, tenant_id=job.tenant,
                                     adapter_identity=job.adapter.identity if job.adapter is not None else None)
        except RoutingUnavailable as exc:
            log.warning("routing %s failed: %s", job.request_id, exc)
            raise QueueUnavailable(str(exc)) from exc

    def publish(self, job: GenerationJob, meta: dict, *, queue: str, expires_s: float) -> None:
        from config.celery_app import app

        route = self.route(job, queue)
        queue = route.queue
        log.debug("request %s -> %s (%s)", job.request_id, queue, route.reason)
        try:
            with app.producer_pool.acquire(block=True, timeout=CONNECT_TIMEOUT_S) as producer:
                producer.connection.ensure_connection(
                    max_retries=1, interval_start=0, interval_step=0.2, interval_max=0.2, timeout=CONNECT_TIMEOUT_S
                )
                app.send_task(
                    TASK_NAME,
                    args=[job.to_dict(), meta],
                    queue=queue,
                    routing_key=queue,
                    task_id=job.request_id,
                    # a job nobody picked up before the web gave up is dropped by the worker unrun
                    expires=expires_s,
                    retry=False,
                    ignore_result=True,  # answers travel on the reply channel, not Celery's result backend
                    producer=producer,
                )
        except Exception as exc:  # kombu OperationalError, socket errors, pool timeout: all mean "down"
            log.warning("publishing %s on %s failed: %s", job.request_id, queue, exc)
            raise QueueUnavailable(str(exc) or type(exc).__name__) from exc

    def events(self, request_id: str, deadline: float) -> Iterator[dict]:
        try:
            yield from reply_channel().events(request_id, deadline)
        except ChannelUnavailable as exc:
            raise QueueUnavailable(str(exc)) from exc

    def cancel(self, request_id: str) -> None:
        try:
            reply_channel().cancel(request_id)
        except ChannelUnavailable:
            pass  # nothing to tell a worker that cannot be reached either


_dispatcher: Dispatcher | None = None


def get_dispatcher() -> Dispatcher:
    global _dispatcher
    if _dispatcher is None:
        _dispatcher = CeleryDispatcher()
    return _dispatcher


def set_dispatcher(dispatcher: Dispatcher | None) -> None:
    global _dispatcher
    _dispatcher = dispatcher
