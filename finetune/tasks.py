"""The Celery task a trainer runs for each message of its base's training queue (finetune/queue.py).

Registered in every process that loads the Celery app, but consumed only by `run_trainer`, which alone listens on
`train.<base>` queues: an inference worker never receives a training job.
"""
from __future__ import annotations

from celery import shared_task

from .queue import TASK_NAME

# The trainer process sets this at start (run_trainer); a task run elsewhere names its own process.
OWNER: dict[str, str] = {}


@shared_task(name=TASK_NAME, acks_late=True, ignore_result=True)
def train(job_id: str) -> str:
    from .trainer import run_job, trainer_id

    return run_job(job_id, owner=OWNER.get("id") or trainer_id("unknown"))
