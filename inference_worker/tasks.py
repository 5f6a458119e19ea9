"""The Celery task that carries one request from the queue to the engine and its answer back.

Delivery guarantees (the message is acknowledged only when this function returns: on Redis by the
reliable consumer, inference_worker/consumer.py; on the embedded default by Celery's acks_late):
- A worker that dies mid-request leaves the message in its processing list; the other workers hand it
  back to the pool's queue once its heartbeat expires, and another worker runs it.
- A job whose final answer was already pushed (its worker died between answering and acknowledging)
  is acknowledged without running again: a request is never answered twice.
- Each delivery counts an attempt (transport.replies, keyed by request id). Past
  `max_attempts` the job is not run again: it is answered `worker_lost`, so a request that kills
  workers ends as a recorded failure instead of looping through the fleet.
- A job whose caller has given up (deadline passed or cancelled) is answered without being run.
- Whatever happens inside, exactly one `final` event is pushed: the web never waits for nothing.
- A worker of a tenant's dedicated pool runs only that tenant's jobs (the gateway routes them; this
  is the second lock).

No database here: the message carries everything (protocol.jobs: the GenerationJob and its JobMeta).
"""
from __future__ import annotations

import logging
import time

from celery import shared_task
from celery.signals import worker_init

from protocol.errors import ErrorCode
from protocol.jobs import GenerationJob, GenerationResult, JobMeta

log = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.5
GRACE_S = 2.0


@worker_init.connect
def _harden_kombu(**_kwargs) -> None:
    """A Celery worker on Redis must survive a broker restart under traffic (broker_hardening.py)."""
    from . import broker_hardening

    broker_hardening.apply()


def _error(job: GenerationJob, code: ErrorCode, message: str) -> GenerationResult:
    return GenerationResult(request_id=job.request_id, status="error", error_code=code, error_message=message)


@shared_task(name="lorafleet.generate", bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def generate(self, job_dict: dict, meta_dict: dict) -> None:
    from transport.replies import reply_channel

    from .worker import get_runtime

    job, meta = GenerationJob.from_dict(job_dict), JobMeta.from_dict(meta_dict)
    channel = reply_channel()
    runtime = get_runtime()
    done, attempts, cancelled = channel.begin(job.request_id)  # one round trip on Redis
    if done:
        log.warning("request %s was already answered; not running the redelivered copy", job.request_id)
        return

    def final(result: GenerationResult, outcome: str) -> None:
        runtime.count(outcome)
        channel.push(job.request_id, {"type": "final", "result": result.to_dict(), "worker_id": runtime.worker_id,
                                      "attempts": attempts})

    max_attempts = meta.max_attempts
    if attempts > max_attempts:
        log.error("request %s: attempt %d > %d, not running it again", job.request_id, attempts, max_attempts)
        return final(_error(job, ErrorCode.WORKER_LOST, f"the request was attempted {attempts - 1} times and each time the "
                                                f"worker running it died; it will not be retried"), "worker_lost")
    deadline = meta.deadline or time.time() + 60
    if time.time() >= deadline or cancelled:
        return final(_error(job, ErrorCode.CANCELLED, "the caller stopped waiting before a worker started this job"),
                     "skipped")
    if runtime.tenant_id and job.tenant != runtime.tenant_id:
        log.error("request %s of tenant %r reached the dedicated pool of tenant %s", job.request_id, job.tenant,
                  runtime.tenant)
        return final(_error(job, ErrorCode.INTERNAL_ERROR,
                            "this job reached another tenant's dedicated worker, which refused it"), "wrong_pool")
    if meta.base_sha256 and meta.base_sha256 != runtime.base_sha256:
        return final(_error(job, ErrorCode.BASE_MISMATCH, f"this worker serves base {runtime.base_slug} "
                                                  f"({runtime.base_sha256[:12]}), not {meta.base_sha256[:12]}"),
                     "base_mismatch")
    if job.adapter is not None:
        runtime.adapter_names[job.adapter.identity] = job.adapter.name
    try:
        result = _run(job, meta, runtime, channel, deadline)
    except Exception as exc:  # never leave the web waiting for nothing
        log.exception("request %s failed in the worker", job.request_id)
        result = _error(job, ErrorCode.INTERNAL_ERROR, f"the worker failed: {type(exc).__name__}")
    final(result, "ok" if result.ok else (result.error_code or "error"))


def _run(job: GenerationJob, meta: JobMeta, runtime, channel, deadline: float) -> GenerationResult:
    handle = runtime.engine.submit(job)
    timeout = max(0.1, deadline - time.time() + GRACE_S)
    try:
        if meta.stream:
            verified = job.adapter.sha256 if job.adapter is not None else None
            identity = job.adapter.identity if job.adapter is not None else None
            held_as = runtime.engine.runner.adapter_dtype_name if job.adapter is not None else None
            checked = time.monotonic()
            # A token exists only once the adapter was loaded and its sha256 verified against the job's.
            for delta in handle.deltas(timeout=timeout):  # {"index", "text"} (+ "logprobs", "prompt_logprobs")
                channel.push(job.request_id, {"type": "delta", **delta, "worker_id": runtime.worker_id,
                                              "adapter_sha256": verified, "adapter_identity": identity,
                                              "adapter_dtype": held_as})
                if time.monotonic() - checked > CANCEL_CHECK_S:
                    checked = time.monotonic()
                    if channel.is_cancelled(job.request_id) or time.time() > deadline + GRACE_S:
                        handle.cancel()
        return handle.result(timeout=max(0.1, deadline - time.time() + GRACE_S))
    except TimeoutError:
        handle.cancel()
        return _error(job, ErrorCode.TIMEOUT, "the worker could not finish this request before its deadline")
