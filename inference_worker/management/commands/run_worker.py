"""`manage.py run_worker --base SLUG [--tenant SLUG]`: one worker process for one base model.

Loads the base once into the process-wide engine, starts the Prometheus exporter and the heartbeat,
then consumes the pool's queues with N task threads (`--concurrency`): every task thread hands its job
to the one engine, which batches them. Never prefork: each child would load its own copy of the base.

The pool is the base's shared queue (`base.<slug>`), or with `--tenant` that tenant's dedicated pool on
the base: only its requests come here, and its requests go nowhere else (Tenant.dedicated, in admin).
On Redis the worker also consumes a queue of its own, where the gateway routes the adapters it owns
(gateway/routing.py), and takes jobs with the reliable consumer (inference_worker/consumer.py). On the
embedded default (Celery's filesystem transport) it runs Celery's worker, threads pool, on the pool queue.
"""
from __future__ import annotations

import logging
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from adapters.models import BaseModel
from inference_worker import worker
from tenants.models import Tenant
from transport.replies import ensure_local_folders, own_queue, pool_queue

STOP_GRACE_S = 50  # in-flight generations finish on SIGTERM (compose's stop_grace_period is 60 s)


class Command(BaseCommand):
    help = "Run an inference worker for one base model (Celery threads pool around one engine)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base", required=True, help="slug of a registered base model")
        parser.add_argument("--tenant", default=None,
                            help="serve only this tenant, as a worker of its dedicated pool on the base (turn the "
                                 "tenant's 'dedicated worker pool' setting on in admin to route it here)")
        parser.add_argument("--concurrency", "-c", type=int, default=settings.LORAFLEET_WORKER_CONCURRENCY,
                            help="task threads = most jobs this worker holds at once; its engine runs up to "
                                 "--max-running of them and queues the rest in fair order (default %(default)s)")
        parser.add_argument("--max-running", type=int, default=None,
                            help="most sequences the engine runs in one batch (sizes the activation workspace; "
                                 f"default {settings.LORAFLEET_WORKER_MAX_RUNNING}, or --concurrency if lower)")
        parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
        parser.add_argument("--metrics-port", type=int, default=9100,
                            help="Prometheus exporter port; 0 picks a free one (default %(default)s)")
        parser.add_argument("--metrics-addr", default=settings.LORAFLEET_WORKER_METRICS_ADDR,
                            help="address the exporter listens on (default %(default)s, from "
                                 "LORAFLEET_WORKER_METRICS_ADDR); it answers only the bearer LORAFLEET_METRICS_TOKEN")
        parser.add_argument("--memory-fraction", type=float, default=None,
                            help="CUDA: share of the device's total memory for weights, workspace and the one "
                                 "pool of KV blocks and adapters (default 0.90)")
        parser.add_argument("--memory-gb", type=float, default=settings.LORAFLEET_WORKER_MEMORY_GB,
                            help="the same budget in GB (10**9 bytes); the CPU default is a quarter of RAM")
        parser.add_argument("--host-cache-mb", type=float, default=None,
                            help="bytes of parsed adapters kept in host memory (LRU), in MB (default 2 GiB); a "
                                 "miss there is a cold load from storage")
        parser.add_argument("--adapter-dtype", choices=worker.ADAPTER_DTYPES, default=settings.LORAFLEET_WORKER_ADAPTER_DTYPE,
                            help="how resident adapters are stored: the model's dtype (default), or float16 / "
                                 "bfloat16 beside a float32 (CPU) model: half the pages and half the bytes the LoRA "
                                 "term reads each step; fp32 uploads are then rounded to nearest")
        parser.add_argument("--prefill-chunk", type=int, default=256,
                            help="prompt tokens per engine step (sizes the activation workspace)")
        parser.add_argument("--loglevel", default="INFO")

    def handle(self, *args, **opts) -> None:
        if not opts["base"].strip():
            raise CommandError("--base needs a base model slug.")
        base = BaseModel.objects.filter(slug=opts["base"]).first()
        if base is None:
            known = ", ".join(BaseModel.objects.values_list("slug", flat=True)) or "none registered"
            raise CommandError(f"No base model {opts['base']!r} (known: {known}).")
        if not base.checkpoint_path:
            raise CommandError(f"Base model {base.slug!r} has no local checkpoint_path.")
        if opts["concurrency"] < 1:
            raise CommandError("--concurrency must be at least 1.")
        if opts["max_running"] is None:
            opts["max_running"] = min(settings.LORAFLEET_WORKER_MAX_RUNNING, opts["concurrency"])
        if opts["max_running"] < 1:
            raise CommandError("--max-running must be at least 1.")
        tenant = None
        if opts["tenant"] is not None and not opts["tenant"].strip():
            raise CommandError("--tenant needs a tenant slug (an empty one would make this a shared worker).")
        if opts["tenant"]:
            tenant = Tenant.objects.filter(slug=opts["tenant"]).first()
            if tenant is None:
                raise CommandError(f"No tenant {opts['tenant']!r}.")
            if not tenant.dedicated:
                self.stderr.write(f"note: tenant {tenant.slug!r} does not have its dedicated worker pool turned on: "
                                  f"its requests go to the shared pool until it is (admin, Tenants).")
        if tenant is None:  # a shared worker: no one tenant at its cap may hold every task thread
            greedy = Tenant.objects.filter(dedicated=False, max_concurrent_requests__gte=opts["concurrency"])
            names = sorted(greedy.values_list("slug", flat=True)[:5])
            if names:
                self.stderr.write(f"note: tenant(s) {', '.join(names)} may have {opts['concurrency']} or more requests "
                                  f"in flight, as many as this worker's --concurrency: at their cap they hold every "
                                  f"task thread and other tenants' jobs wait in the queue, unscheduled. Give the "
                                  f"worker more threads than the largest tenant cap.")
        pool = pool_queue(base.queue_name, tenant.slug if tenant else None)
        redis_broker = str(settings.CELERY_BROKER_URL).startswith(("redis://", "rediss://", "unix://"))
        try:
            runtime = worker.build_runtime(
                base_slug=base.slug, base_sha256=base.sha256, queue=pool,
                checkpoint_path=base.checkpoint_path, device=opts["device"], concurrency=opts["concurrency"],
                max_running=opts["max_running"],
                max_lora_rank=base.max_lora_rank, memory_fraction=opts["memory_fraction"],
                memory_gb=opts["memory_gb"], prefill_chunk=opts["prefill_chunk"], host_cache_mb=opts["host_cache_mb"],
                adapter_dtype=opts["adapter_dtype"] or None,
                tenant=tenant.slug if tenant else "", tenant_id=str(tenant.pk) if tenant else "",
            )
        except ValueError as exc:  # a budget that cannot hold the base, or a bad flag
            raise CommandError(str(exc)) from None
        ensure_local_folders()
        port = worker.start_metrics_server(runtime, opts["metrics_port"], opts["metrics_addr"])
        if redis_broker:
            from inference_worker.consumer import ReliableConsumer
            from inference_worker.tasks import generate

            runtime.own_queue = own_queue(pool, runtime.worker_id)
            runtime.consumer = ReliableConsumer(settings.CELERY_BROKER_URL, worker_id=runtime.worker_id, pool=pool,
                                                own=runtime.own_queue, concurrency=opts["concurrency"],
                                                tasks={generate.name: generate})
        worker.start_heartbeat(runtime)  # listed (and registered) before the first job is taken
        connections.close_all()  # the hot path never touches the database
        m = runtime.engine.runner.memory
        queues = f"queues {runtime.own_queue} + {pool}" if redis_broker else f"queue {pool}"
        self.stdout.write(f"worker {runtime.worker_id}{' (tenant ' + tenant.slug + ')' if tenant else ''}: {queues}, "
                          f"{opts['concurrency']} threads, engine batch up to {opts['max_running']}, "
                          f"memory {m.budget_bytes / 1e9:.2f} GB = weights {m.weights_bytes / 1e9:.2f} + workspace "
                          f"{m.workspace_bytes / 1e9:.2f} + pool of {m.num_pages} pages x {m.page_bytes / 1e6:.3f} MB "
                          f"(KV blocks and adapters), metrics on http://{opts['metrics_addr']}:{port}/metrics",
                          ending="\n")
        self.stdout.flush()

        if redis_broker:
            self._consume(runtime, opts["loglevel"])
            return
        from config.celery_app import app

        app.worker_main([
            "worker", "--queues", pool, "--pool", "threads", "--concurrency", str(opts["concurrency"]),
            "--hostname", runtime.worker_id, "--loglevel", opts["loglevel"],
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ])

    def _consume(self, runtime, loglevel: str) -> None:
        """Run the reliable consumer until SIGTERM or SIGINT, then stop cleanly: no new jobs, running ones
        finish (up to STOP_GRACE_S), what is left goes back to the pool's queue."""
        logging.getLogger().setLevel(loglevel.upper())
        logging.getLogger("inference_worker").setLevel(loglevel.upper())
        stop = threading.Event()

        def on_signal(signum, _frame) -> None:
            stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        runtime.consumer.start()
        while not stop.wait(1.0):
            pass
        self.stdout.write(f"worker {runtime.worker_id}: stopping")
        self.stdout.flush()
        runtime.stopping.set()
        runtime.consumer.stop(grace_s=STOP_GRACE_S)
        runtime.engine.stop()
