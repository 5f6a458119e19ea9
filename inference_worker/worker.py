"""The worker process around the engine: one engine per process, built once at start.

    python manage.py run_worker --base SLUG      (see management/commands/run_worker.py)

Celery's threads pool runs the tasks (inference_worker/tasks.py); every task thread hands its job to
the single in-process engine, which batches them — never the prefork pool, whose children would each
load their own copy of the base. Besides the engine this module holds the process's identity (worker
id), the Prometheus exporter and the heartbeat that `manage.py worker_status` reads.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

HEARTBEAT_S = 5
HEARTBEAT_TTL_S = 15


def make_worker_id(base_slug: str) -> str:
    return f"{base_slug}@{socket.gethostname()}:{os.getpid()}"


@dataclass
class WorkerRuntime:
    base_slug: str
    base_sha256: str
    queue: str
    checkpoint_path: str
    engine: object
    worker_id: str
    device: str
    concurrency: int
    metrics_port: int | None = None
    started_at: float = field(default_factory=time.time)
    adapter_names: dict[str, str] = field(default_factory=dict)  # sha256 -> "name@N", for worker_status
    tasks_done: dict[str, int] = field(default_factory=dict)  # outcome -> count
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.tasks_done[outcome] = self.tasks_done.get(outcome, 0) + 1

    def status(self) -> dict:
        stats = self.engine.stats()
        resident = list(stats.get("resident_adapters") or [])
        return {
            "worker_id": self.worker_id, "base": self.base_slug, "base_sha256": self.base_sha256, "queue": self.queue,
            "host": socket.gethostname(), "pid": os.getpid(), "device": self.device, "concurrency": self.concurrency,
            "metrics_port": self.metrics_port, "started_at": self.started_at, "seen_at": time.time(),
            "running": stats.get("running", 0), "queue_depth": stats.get("queue_depth", 0),
            "steps": stats.get("steps", 0), "tokens_generated": stats.get("tokens_generated", 0),
            "resident_adapters": [{"sha256": sha, "name": self.adapter_names.get(sha, "")} for sha in resident],
            "tasks": dict(self.tasks_done),
        }


def load_blob(key: str):
    """The engine's loader: a private mapping of the blob when the adapters storage is a local filesystem
    (no copy; ~40 ms less per 80 MB cold load), else the blob's bytes (S3)."""
    from adapters.storage import adapter_storage, read_blob

    from .adapter_cache import map_file

    try:
        path = adapter_storage().path(key)
    except NotImplementedError:
        return read_blob(key)
    return map_file(path)


_runtime: WorkerRuntime | None = None
_runtime_lock = threading.Lock()


def build_runtime(*, base_slug: str, base_sha256: str, queue: str, checkpoint_path: str, device: str | None = None,
                  concurrency: int = 64, max_lora_slots: int = 8, max_lora_rank: int = 64) -> WorkerRuntime:
    """Load the base once and start the engine; the process-wide singleton every task uses."""
    global _runtime
    import torch

    from .engine import Engine
    from .model import ModelRunner

    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        started = time.perf_counter()
        runner = ModelRunner(checkpoint_path, device=device, max_lora_slots=max_lora_slots, max_lora_rank=max_lora_rank)
        engine = Engine(runner, load_blob, max_running=concurrency)  # the engine verifies each blob's sha256
        engine.start()
        _runtime = WorkerRuntime(base_slug=base_slug, base_sha256=base_sha256, queue=queue,
                                 checkpoint_path=str(checkpoint_path), engine=engine,
                                 worker_id=make_worker_id(base_slug), device=device, concurrency=concurrency)
        log.info("worker %s: base %s loaded on %s in %.1f s", _runtime.worker_id, base_slug, device,
                 time.perf_counter() - started)
        return _runtime


def get_runtime() -> WorkerRuntime:
    """The engine of this process. Built by run_worker; a worker started with the bare celery CLI builds
    it on first use from LORAFLEET_WORKER_BASE (one database read, at start only)."""
    if _runtime is not None:
        return _runtime
    slug = os.environ.get("LORAFLEET_WORKER_BASE")
    if not slug:
        raise RuntimeError("This process has no engine: start workers with `manage.py run_worker --base SLUG`.")
    from adapters.models import BaseModel

    base = BaseModel.objects.get(slug=slug)
    return build_runtime(base_slug=base.slug, base_sha256=base.sha256, queue=base.queue_name,
                         checkpoint_path=base.checkpoint_path, max_lora_rank=base.max_lora_rank)


def set_runtime(runtime: WorkerRuntime | None) -> None:
    """Tests install their own runtime (or remove it)."""
    global _runtime
    _runtime = runtime


# ---- Prometheus --------------------------------------------------------------------------------

class EngineCollector:
    """Reads engine.stats() at scrape time, so the engine thread never does exporter work."""

    def __init__(self, runtime: WorkerRuntime):
        self.runtime = runtime
        self._last = (time.monotonic(), 0)
        self._tps = 0.0

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        rt = self.runtime
        s = rt.engine.stats()
        cache = s.get("cache") or {}
        labels = ["worker", "base"]
        ids = [rt.worker_id, rt.base_slug]

        def counter(name, doc, value):
            m = CounterMetricFamily(f"lorafleet_worker_{name}", doc, labels=labels)
            m.add_metric(ids, float(value or 0))
            return m

        def gauge(name, doc, value):
            m = GaugeMetricFamily(f"lorafleet_worker_{name}", doc, labels=labels)
            m.add_metric(ids, float(value or 0))
            return m

        now, tokens = time.monotonic(), int(s.get("tokens_generated", 0))
        last_t, last_tokens = self._last
        if now - last_t >= 1.0:
            self._tps = (tokens - last_tokens) / (now - last_t)
            self._last = (now, tokens)
        yield counter("steps", "Forward passes (batches) run.", s.get("steps"))
        yield counter("batch_size_sum", "Sequences per batch, summed over batches.", s.get("batch_size_sum"))
        yield gauge("batch_size_max", "Largest batch so far (sequences).", s.get("batch_size_max"))
        yield gauge("batch_size_mean", "Mean sequences per batch.", s.get("batch_size_mean"))
        yield counter("distinct_adapters_per_batch_sum", "Distinct adapters (base = one) per batch, summed.",
                      s.get("distinct_adapters_sum"))
        yield gauge("distinct_adapters_per_batch_max", "Most distinct adapters seen in one batch.",
                    s.get("distinct_adapters_max"))
        yield gauge("distinct_adapters_per_batch_mean", "Mean distinct adapters per batch.",
                    s.get("distinct_adapters_mean"))
        yield counter("tokens_generated", "Tokens generated.", tokens)
        yield counter("prompt_tokens", "Prompt tokens read.", s.get("prompt_tokens"))
        yield gauge("tokens_per_second", "Generated tokens per second since the previous scrape.", self._tps)
        yield gauge("queue_depth", "Requests submitted to the engine and not yet running.", s.get("queue_depth"))
        yield gauge("running", "Requests in the running batch.", s.get("running"))
        yield counter("cache_hits", "Adapter cache hits.", cache.get("hits"))
        yield counter("cache_misses", "Adapter cold loads (storage -> verified -> slot).", cache.get("cold_loads"))
        yield counter("cache_load_failures", "Adapter loads that failed (integrity or format).", cache.get("load_failures"))
        yield counter("cache_evictions", "Adapters evicted from device slots.", cache.get("slot_evictions"))
        yield counter("cache_host_evictions", "Adapters evicted from the host cache.", cache.get("host_evictions"))
        yield counter("cold_load_seconds", "Seconds spent reading, verifying and parsing adapters.",
                      cache.get("load_seconds"))
        yield gauge("resident_adapters", "Adapters resident in device slots.", len(s.get("resident_adapters") or []))
        tasks = CounterMetricFamily("lorafleet_worker_tasks", "Tasks finished, by outcome.", labels=labels + ["outcome"])
        for outcome, n in sorted(rt.tasks_done.items()):
            tasks.add_metric(ids + [outcome], n)
        yield tasks


def start_metrics_server(runtime: WorkerRuntime, port: int, addr: str = "127.0.0.1") -> int:
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry()
    registry.register(EngineCollector(runtime))
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    runtime.metrics_port = server.server_port
    return runtime.metrics_port


def start_heartbeat(runtime: WorkerRuntime) -> threading.Thread:
    from .replies import reply_channel

    def beat() -> None:
        while True:
            try:
                reply_channel().heartbeat(runtime.worker_id, runtime.status(), HEARTBEAT_TTL_S)
            except Exception as exc:  # Redis away for a moment: the next beat retries
                log.debug("heartbeat failed: %s", exc)
            time.sleep(HEARTBEAT_S)

    thread = threading.Thread(target=beat, name="lorafleet-heartbeat", daemon=True)
    thread.start()
    return thread
