"""`manage.py run_trainer --base SLUG`: one trainer process for one base model's fine-tuning jobs.

Consumes the base's training queue (`train.<slug>`, finetune/queue.py) with Celery's solo pool: one job at a time,
in this process, never inside an inference worker (training takes its own memory and compute, not the engine's).
Start as many as the hosts have room for; each takes the next queued job. At start it fails the base's running
jobs whose trainer stopped beating (finetune/jobs.py reap_lost_jobs).
"""
from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from adapters.models import BaseModel
from finetune import tasks
from finetune.jobs import reap_lost_jobs
from finetune.models import FineTuningJob
from finetune.queue import training_queue
from finetune.trainer import trainer_id


class Command(BaseCommand):
    help = "Run a fine-tuning trainer for one base model (one job at a time)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base", required=True, help="slug of a registered base model")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts) -> None:
        slug = (opts["base"] or "").strip()
        base = BaseModel.objects.filter(slug=slug).first() if slug else None
        if base is None:
            known = ", ".join(BaseModel.objects.values_list("slug", flat=True)) or "none registered"
            raise CommandError(f"No base model {opts['base']!r} (known: {known}).")
        if not base.checkpoint_path:
            raise CommandError(f"Base model {base.slug!r} has no local checkpoint_path to train on.")
        owner = trainer_id(base.slug)
        tasks.OWNER["id"] = owner
        reaped = reap_lost_jobs(FineTuningJob.objects.filter(base=base))
        queue = training_queue(base.slug)
        self.stdout.write(f"trainer {owner}: queue {queue}, one job at a time"
                          + (f"; failed {reaped} job(s) whose trainer was lost" if reaped else ""))
        self.stdout.flush()
        from config.celery_app import app

        app.worker_main([
            "worker", "--queues", queue, "--pool", "solo", "--concurrency", "1", "--hostname", owner,
            "--loglevel", opts["loglevel"], "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])
