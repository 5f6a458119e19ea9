"""`manage.py run_worker --base SLUG`: one Celery worker process for one base model.

Loads the base once into the process-wide engine, starts the Prometheus exporter and the heartbeat,
then runs a Celery worker on the base's queue with the *threads* pool (`-P threads -c N`): every
task thread hands its job to the one engine, which batches them. Never prefork: each child would
load its own copy of the base.
"""
from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from adapters.models import BaseModel
from inference_worker import worker
from inference_worker.replies import ensure_local_folders


class Command(BaseCommand):
    help = "Run an inference worker for one base model (Celery threads pool around one engine)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base", required=True, help="slug of a registered base model")
        parser.add_argument("--concurrency", "-c", type=int, default=settings.LORAFLEET_WORKER_CONCURRENCY,
                            help="task threads = most requests one engine runs at once (default %(default)s)")
        parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        parser.add_argument("--metrics-port", type=int, default=9100,
                            help="Prometheus exporter port; 0 picks a free one (default %(default)s)")
        parser.add_argument("--metrics-addr", default="127.0.0.1")
        parser.add_argument("--memory-fraction", type=float, default=None,
                            help="CUDA: share of the device's total memory for weights, workspace and the one "
                                 "pool of KV blocks and adapters (default 0.90)")
        parser.add_argument("--memory-gb", type=float, default=settings.LORAFLEET_WORKER_MEMORY_GB,
                            help="the same budget in GB (10**9 bytes); the CPU default is a quarter of RAM")
        parser.add_argument("--prefill-chunk", type=int, default=256,
                            help="prompt tokens per engine step (sizes the activation workspace)")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts) -> None:
        base = BaseModel.objects.filter(slug=opts["base"]).first()
        if base is None:
            known = ", ".join(BaseModel.objects.values_list("slug", flat=True)) or "none registered"
            raise CommandError(f"No base model {opts['base']!r} (known: {known}).")
        if not base.checkpoint_path:
            raise CommandError(f"Base model {base.slug!r} has no local checkpoint_path.")
        if opts["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1.")
        try:
            runtime = worker.build_runtime(
                base_slug=base.slug, base_sha256=base.sha256, queue=base.queue_name,
                checkpoint_path=base.checkpoint_path, device=opts["device"], concurrency=opts["concurrency"],
                max_lora_rank=base.max_lora_rank, memory_fraction=opts["memory_fraction"],
                memory_gb=opts["memory_gb"], prefill_chunk=opts["prefill_chunk"],
            )
        except ValueError as exc:  # a budget that cannot hold the base, or a bad flag
            raise CommandError(str(exc)) from None
        ensure_local_folders()
        port = worker.start_metrics_server(runtime, opts["metrics_port"], opts["metrics_addr"])
        worker.start_heartbeat(runtime)
        connections.close_all()  # the hot path never touches the database
        m = runtime.engine.runner.memory
        self.stdout.write(f"worker {runtime.worker_id}: queue {base.queue_name}, {opts['concurrency']} threads, "
                          f"memory {m.budget_bytes / 1e9:.2f} GB = weights {m.weights_bytes / 1e9:.2f} + workspace "
                          f"{m.workspace_bytes / 1e9:.2f} + pool of {m.num_pages} pages x {m.page_bytes / 1e6:.3f} MB "
                          f"(KV blocks and adapters), metrics on http://{opts['metrics_addr']}:{port}/metrics",
                          ending="\n")
        self.stdout.flush()

        from config.celery_app import app
        from inference_worker import broker_hardening

        broker_hardening.apply()  # a worker must survive a broker restart under traffic
        app.worker_main([
            "worker", "--queues", base.queue_name, "--pool", "threads", "--concurrency", str(opts["concurrency"]),
            "--hostname", runtime.worker_id, "--loglevel", opts["loglevel"],
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])
