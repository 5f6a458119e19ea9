"""The training queue of a base: the web publishes a job's id there, its trainers (`run_trainer`) consume it.

A message carries only the job's public id: the trainer reads the job, its files and its base from the database
and storage (training is not a hot path, and the row is the one place its status lives). Publishing fails fast,
as the inference queue's does (gateway/queue.py): one connection attempt, no retries.
"""
from __future__ import annotations

import logging

log = logging.getLogger(__name__)

TASK_NAME = "lorafleet.train"
CONNECT_TIMEOUT_S = 1.0


class QueueUnavailable(RuntimeError):
    """The broker cannot be reached."""


def training_queue(base_slug: str) -> str:
    """Never the inference queue of the base (`base.<slug>`): training must not run in an inference worker."""
    return f"train.{base_slug}"


def publish_training_job(job_id: str, base) -> None:
    from config.celery_app import app

    queue = training_queue(base.slug)
    try:
        with app.producer_pool.acquire(block=True, timeout=CONNECT_TIMEOUT_S) as producer:
            producer.connection.ensure_connection(max_retries=1, interval_start=0, interval_step=0.2,
                                                  interval_max=0.2, timeout=CONNECT_TIMEOUT_S)
            app.send_task(TASK_NAME, args=[job_id], queue=queue, routing_key=queue, task_id=job_id, retry=False,
                          ignore_result=True, producer=producer)
    except Exception as exc:  # kombu OperationalError, socket errors, pool timeout: all mean "down"
        log.warning("publishing %s on %s failed: %s", job_id, queue, exc)
        raise QueueUnavailable(str(exc) or type(exc).__name__) from exc
