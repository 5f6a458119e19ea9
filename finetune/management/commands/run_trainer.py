"""`manage.py run_trainer --base SLUG`: one trainer process for one base model's fine-tuning jobs.

Consumes the base's training queue (`train.<slug>`, finetune/queue.py) with Celery's solo pool: one job at a time,
in this process, never inside an inference worker (training takes its own memory and compute, not the engine's).
Start as many as the hosts have room for; each takes the next queued job. At start it fails the base's running
jobs whose trainer stopped beating (finetune/jobs.py reap_lost_jobs).

On the CPU the trainer shares the cores with the inference worker, so it yields them: it runs
LORAFLEET_TRAINER_NICE nicer than it was started (default 10, as `nice -n 10`; 0 leaves it) and its OpenMP threads
sleep when idle (OMP_WAIT_POLICY=PASSIVE unless set), both set before torch is loaded. And it holds its work between
one layer and the next while an inference engine on this host has requests in hand (transport/busy.py;
LORAFLEET_TRAINER_YIELD=0 turns that off, LORAFLEET_TRAINER_YIELD_MAX_S bounds a hold, default 30 s). The thread
count, hence the arithmetic, is unchanged. On CUDA the trainer has its own device and keeps its priority.
"""
from __future__ import annotations

import os
import sys

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError

from adapters.models import BaseModel
from finetune import tasks
from finetune.jobs import reap_lost_jobs
from finetune.models import FineTuningJob
from finetune.queue import training_queue
from finetune.trainer import (
    idle_scheduling,
    trainer_id,
    trainer_nice,
    trainer_yield_max_s,
    trainer_yields,
    yield_cpu_to_inference,
)


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
        try:
            nice = trainer_nice()
            hold = trainer_yield_max_s()
        except ImproperlyConfigured as exc:
            raise CommandError(str(exc)) from exc
        priority = self._yield_cpu(nice, hold)
        owner = trainer_id(base.slug)
        tasks.OWNER["id"] = owner
        reaped = reap_lost_jobs(FineTuningJob.objects.filter(base=base))
        queue = training_queue(base.slug)
        self.stdout.write(f"trainer {owner}: queue {queue}, one job at a time, {priority}"
                          + (f"; failed {reaped} job(s) whose trainer was lost" if reaped else ""))
        self.stdout.flush()
        from config.celery_app import app

        app.worker_main([
            "worker", "--queues", queue, "--pool", "solo", "--concurrency", "1", "--hostname", owner,
            "--loglevel", opts["loglevel"], "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])

    @staticmethod
    def _yield_cpu(nice: int, hold: float) -> str:
        """Lower the priority before torch starts its threads (they inherit it); say what the trainer runs at."""
        if "torch" not in sys.modules:  # OpenMP reads its wait policy once, when torch loads it
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        import torch

        if torch.cuda.is_available():
            return f"on CUDA at niceness {os.getpriority(os.PRIO_PROCESS, 0)}"
        niceness = yield_cpu_to_inference(nice)
        yields = trainer_yields()
        idle = nice > 0 and yields and idle_scheduling()  # both off: the trainer keeps its priority
        holds = f"; holds its work while an inference engine on this host runs requests (at most {hold:g} s at a " \
                f"stretch)" if yields else ""
        return f"on the CPU at niceness {niceness}{' under SCHED_IDLE' if idle else ''}, OMP_WAIT_POLICY " \
               f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}{holds}"
