"""The worker process around the engine: one engine per process, built once at start.

    python manage.py run_worker --base SLUG      (see management/commands/run_worker.py)

Task threads run the tasks (inference_worker/tasks.py): the reliable consumer's on Redis, Celery's threads
pool on the embedded default; every task thread hands its job to the single in-process engine, which
batches them — never a prefork pool, whose children would each load their own copy of the base. Besides
the engine this module holds the process's identity (worker id, pool, own queue), the Prometheus exporter
and the heartbeat that `manage.py worker_status` and the gateway's routing read. On Redis the jobs come
through inference_worker/consumer.py (a reliable-queue consumer); each heartbeat also registers this
worker's lists there and reaps dead workers' jobs.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# A worker is live while its heartbeat key exists: written every HEARTBEAT_S, expiring HEARTBEAT_TTL_S
# after the last beat. Within one TTL of a worker's death the gateway stops routing to it and the other
# workers hand its jobs back to its pool (consumer.reap).
HEARTBEAT_S = float(os.environ.get("LORAFLEET_HEARTBEAT_S") or 5)
HEARTBEAT_TTL_S = float(os.environ.get("LORAFLEET_HEARTBEAT_TTL_S") or 15)


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
    own_queue: str = ""  # the queue only this worker consumes (adapter affinity); "" without one
    tenant: str = ""  # slug of the tenant whose dedicated pool this is; "" for the base's shared pool
    tenant_id: str = ""  # that tenant's id, as jobs carry it
    consumer: object | None = None  # consumer.ReliableConsumer (Redis), None under Celery's worker
    stopping: threading.Event = field(default_factory=threading.Event)
    started_at: float = field(default_factory=time.time)
    adapter_names: dict[str, str] = field(default_factory=dict)  # identity -> "name@N", for worker_status
    tasks_done: dict[str, int] = field(default_factory=dict)  # outcome -> count
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, outcome: str) -> None:
        with self._lock:
            self.tasks_done[outcome] = self.tasks_done.get(outcome, 0) + 1

    def status(self) -> dict:
        stats = self.engine.stats()
        resident = list(stats.get("resident_adapters") or [])
        cache = self.engine.cache
        sha_of = cache.resident_sha256() if cache is not None else {}
        counters = stats.get("cache") or {}
        return {
            "worker_id": self.worker_id, "base": self.base_slug, "base_sha256": self.base_sha256, "queue": self.queue,
            "pool_queue": self.queue, "own_queue": self.own_queue, "tenant": self.tenant,
            "heartbeat_s": HEARTBEAT_S, "heartbeat_ttl_s": HEARTBEAT_TTL_S,
            "consumer": self.consumer.stats() if self.consumer is not None else None,
            # the lists holding the jobs this worker has taken and not finished: the gateway's measure of its load
            "processing": self.consumer.spec()["processing"] if self.consumer is not None else [],
            "host": socket.gethostname(), "pid": os.getpid(), "device": self.device, "concurrency": self.concurrency,
            "max_running": self.engine.max_running,
            "metrics_port": self.metrics_port, "started_at": self.started_at, "seen_at": time.time(),
            "running": stats.get("running", 0), "queue_depth": stats.get("queue_depth", 0),
            "steps": stats.get("steps", 0), "tokens_generated": stats.get("tokens_generated", 0),
            "resident_adapters": [{"identity": ident, "sha256": sha_of.get(ident, ""),
                                   "name": self.adapter_names.get(ident, "")} for ident in resident],
            "memory": {**(stats.get("memory") or {}), "evictions": counters.get("evictions", 0),
                       "device_loads": counters.get("device_loads", 0), "cold_loads": counters.get("cold_loads", 0),
                       "admissions_waited_memory": stats.get("admissions_waited_memory", 0)},
            "tasks": dict(self.tasks_done),
        }

    def minimal_status(self) -> dict:
        """What a heartbeat says when engine.stats() fails: enough to stay live and routable."""
        return {"worker_id": self.worker_id, "base": self.base_slug, "base_sha256": self.base_sha256,
                "queue": self.queue, "pool_queue": self.queue, "own_queue": self.own_queue, "tenant": self.tenant,
                "processing": self.consumer.spec()["processing"] if self.consumer is not None else [],
                "heartbeat_s": HEARTBEAT_S, "heartbeat_ttl_s": HEARTBEAT_TTL_S, "host": socket.gethostname(),
                "pid": os.getpid(), "device": self.device, "concurrency": self.concurrency,
                "started_at": self.started_at, "seen_at": time.time(), "running": 0, "queue_depth": 0,
                "resident_adapters": [], "memory": {}, "tasks": dict(self.tasks_done)}


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


CPU_MEMORY_SHARE = 0.25  # the CPU default budget: a quarter of physical RAM (the web, the OS, tests keep the rest)
CUDA_MEMORY_FRACTION = 0.90  # the CUDA default: 0.90 of the device's total memory


def memory_budget(device: str, *, memory_fraction: float | None = None, memory_gb: float | None = None) -> int:
    """The worker's memory budget in bytes: base weights + activation workspace + the one pool.

    CUDA: `memory_fraction` (default 0.90) of the device's total memory (torch.cuda.mem_get_info), or
    `memory_gb`. CPU: `memory_gb`, default CPU_MEMORY_SHARE of physical RAM. GB = 10**9 bytes."""
    import torch

    if memory_gb is not None:
        if memory_gb <= 0:
            raise ValueError("--memory-gb must be positive")
        return int(memory_gb * 10**9)
    if torch.device(device).type == "cuda":
        fraction = CUDA_MEMORY_FRACTION if memory_fraction is None else memory_fraction
        if not 0 < fraction <= 1:
            raise ValueError("--memory-fraction must be in (0, 1]")
        free, total = torch.cuda.mem_get_info(torch.device(device))
        budget = int(fraction * total)
        if budget > free:
            raise ValueError(f"--memory-fraction {fraction} asks for {budget / 1e9:.1f} GB but only {free / 1e9:.1f} GB "
                             f"of the device's {total / 1e9:.1f} GB are free (another process holds the rest)")
        return budget
    if memory_fraction is not None:
        raise ValueError("--memory-fraction is for CUDA devices; on CPU give --memory-gb")
    return int(CPU_MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


ADAPTER_DTYPES = ("", "float32", "bfloat16", "float16")  # "": the model's own


def adapter_dtype_of(name: str | None):
    """The torch dtype `--adapter-dtype` / LORAFLEET_WORKER_ADAPTER_DTYPE names; None (the model's) for ""."""
    import torch

    if not name:
        return None
    if name not in ADAPTER_DTYPES:
        raise ValueError(f"adapter dtype {name!r}: expected one of {', '.join(d for d in ADAPTER_DTYPES if d)}")
    return getattr(torch, name)


def build_runtime(*, base_slug: str, base_sha256: str, queue: str, checkpoint_path: str, device: str | None = None,
                  concurrency: int = 64, max_running: int | None = None, max_lora_rank: int = 64,
                  memory_fraction: float | None = None,
                  memory_gb: float | None = None, prefill_chunk: int = 256, tenant: str = "",
                  tenant_id: str = "", worker_id: str | None = None,
                  host_cache_mb: float | None = None, adapter_dtype: str | None = None) -> WorkerRuntime:
    """Load the base once and start the engine; the process-wide singleton every task uses.

    `concurrency` task threads hand jobs to the engine, which runs up to `max_running` sequences at once
    (default: `concurrency`) and queues the rest in its scheduler's order."""
    global _runtime
    import torch

    from transport.busy import EngineBusyFlag

    from .engine import Engine
    from .model import ModelRunner

    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        max_running = concurrency if max_running is None else max_running
        started = time.perf_counter()
        budget = memory_budget(device, memory_fraction=memory_fraction, memory_gb=memory_gb)
        # 0: a tied LM head runs on the embedding table as stored, no packed copy (bench/RESULTS.md: the copy, +113 MB
        # for SmolLM2, was 1.04-1.07x the throughput on CPU); otherwise the runner's default
        pack_tied = os.environ.get("LORAFLEET_WORKER_PACK_TIED_HEAD", "1").lower() not in ("0", "false", "no")
        # 0: the packed projections run on oneDNN instead of the native GEMM (kernels.gemm, where it runs: AVX-512, or AVX2 + FMA)
        native_gemm = os.environ.get("LORAFLEET_WORKER_NATIVE_GEMM", "1").lower() not in ("0", "false", "no")
        # 0: the native GEMMs do not prefetch the step's adapter matrices for the LoRA calls after them; 1: they do;
        # unset (auto): where that was measured to help (kernels.gemm_side_helps: AMD CPUs)
        prefetch_env = os.environ.get("LORAFLEET_WORKER_LORA_PREFETCH", "auto").lower()
        lora_prefetch = None if prefetch_env == "auto" else prefetch_env not in ("0", "false", "no")
        # 0: a decode step's LoRA term runs after each native GEMM; 1: inside it (kernels.gemm_lora); unset (auto):
        # where that was measured to help (kernels.gemm_side_helps: AMD CPUs; ModelRunner's fuse_lora says why)
        fused_env = os.environ.get("LORAFLEET_WORKER_FUSED_LORA", "auto").lower()
        fuse_lora = None if fused_env == "auto" else fused_env not in ("0", "false", "no")
        runner = ModelRunner(checkpoint_path, device=device, max_lora_rank=max_lora_rank, memory_bytes=budget,
                             max_running=max_running, max_batch_tokens=prefill_chunk + max_running,
                             adapter_dtype=adapter_dtype_of(adapter_dtype), pack_tied_head=None if pack_tied else False,
                             native_gemm=None if native_gemm else False, lora_prefetch=lora_prefetch,
                             fuse_lora=fuse_lora)
        # the engine verifies each blob's sha256
        fair = os.environ.get("LORAFLEET_WORKER_FAIR", "1").lower() not in ("0", "false", "no")  # 0: FIFO
        host_cache = {} if host_cache_mb is None else {"host_cache_bytes": int(host_cache_mb * 1e6)}
        # 0: no prefix cache (every prompt read in full); the step factor bounds the prefill a step carries while
        # other tenants' decodes ride in it (engine.py, step_cost.py)
        prefix_cache = os.environ.get("LORAFLEET_WORKER_PREFIX_CACHE", "1").lower() not in ("0", "false", "no")
        step_factor = float(os.environ.get("LORAFLEET_WORKER_PREFILL_STEP_FACTOR", "1.5"))
        if not step_factor > 1.0:
            raise ValueError("LORAFLEET_WORKER_PREFILL_STEP_FACTOR must be a number above 1 (1.5 by default)")
        # on CPU: a file that says while requests are in hand, for a trainer on these cores to hold its work
        # (transport/busy.py); a GPU engine's steps leave the host's cores to others anyway
        busy_flag = EngineBusyFlag() if torch.device(device).type == "cpu" else None
        engine = Engine(runner, load_blob, max_running=max_running, prefill_chunk=prefill_chunk, fair=fair,
                        prefix_cache=prefix_cache, prefill_step_factor=step_factor, busy_flag=busy_flag, **host_cache)
        engine.start()
        _runtime = WorkerRuntime(base_slug=base_slug, base_sha256=base_sha256, queue=queue,
                                 checkpoint_path=str(checkpoint_path), engine=engine,
                                 worker_id=worker_id or make_worker_id(base_slug), device=device,
                                 concurrency=concurrency, tenant=tenant, tenant_id=tenant_id)
        m = runner.memory
        log.info("worker %s: base %s loaded on %s in %.1f s; budget %.2f GB = weights %.2f + workspace %.2f + "
                 "pool %d pages x %.2f MB", _runtime.worker_id, base_slug, device, time.perf_counter() - started,
                 m.budget_bytes / 1e9, m.weights_bytes / 1e9, m.workspace_bytes / 1e9, m.num_pages, m.page_bytes / 1e6)
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
    gb = os.environ.get("LORAFLEET_WORKER_MEMORY_GB")
    return build_runtime(base_slug=base.slug, base_sha256=base.sha256, queue=base.queue_name,
                         checkpoint_path=base.checkpoint_path, max_lora_rank=base.max_lora_rank,
                         memory_gb=float(gb) if gb else None,
                         adapter_dtype=os.environ.get("LORAFLEET_WORKER_ADAPTER_DTYPE") or None)


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
        yield counter("cache_evictions", "Adapters evicted from the device pool.", cache.get("evictions"))
        yield counter("cache_device_loads", "Adapters placed in the device pool.", cache.get("device_loads"))
        yield counter("cache_host_evictions", "Adapters evicted from the host cache.", cache.get("host_evictions"))
        yield counter("cold_load_seconds", "Seconds spent reading, verifying and parsing adapters.",
                      cache.get("load_seconds"))
        yield gauge("resident_adapters", "Adapters resident in the device pool.", len(s.get("resident_adapters") or []))
        mem = s.get("memory") or {}
        yield gauge("pool_bytes", "Bytes of the one pool shared by KV blocks and adapters.", mem.get("pool_bytes"))
        yield gauge("pool_page_bytes", "Bytes of one pool page (one KV block of every layer).", mem.get("page_bytes"))
        yield gauge("pool_pages", "Pages in the pool.", mem.get("pages"))
        yield gauge("kv_blocks_used", "Pool pages holding KV blocks.", mem.get("kv_blocks_used"))
        yield gauge("pool_pages_free", "Pool pages free.", mem.get("free_pages"))
        yield gauge("adapter_pages", "Pool pages holding adapter weights.", mem.get("adapter_pages"))
        yield gauge("adapter_bytes_resident", "Bytes of adapter weights resident in the pool.",
                    mem.get("adapter_bytes_resident"))
        yield counter("admissions_waited_memory", "Requests that waited at admission for KV or adapter pages.",
                      s.get("admissions_waited_memory"))
        yield gauge("running_sequences", "Sequences running (n per request; a prompt's waiting choices included).",
                    s.get("running_sequences"))
        yield gauge("preempted_sequences", "Sequences preempted and waiting to re-read their tokens.",
                    s.get("preempted_sequences"))
        yield counter("preemptions", "Sequences preempted (KV given back, recomputed later).", s.get("preemptions"))
        yield counter("preemptions_for_share", "Preemptions of a tenant above its share for one within its own.",
                      s.get("preemptions_for_share"))
        yield counter("recomputed_tokens", "Tokens re-read after preemptions.", s.get("recomputed_tokens"))
        yield counter("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache.",
                      s.get("prefix_cache_query_tokens"))
        yield counter("prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache gave (hit rate: divide by the "
                      "query tokens).", s.get("prefix_cache_hit_tokens"))
        yield gauge("prefix_cache_blocks", "KV blocks the prefix cache names (in use or free but remembered).",
                    s.get("prefix_cache_blocks"))
        yield counter("prefix_cache_evictions", "Cached KV blocks whose pages were taken for something else.",
                      s.get("prefix_cache_evictions"))
        by_rank = GaugeMetricFamily("lorafleet_worker_resident_adapters_by_rank", "Resident adapters by LoRA rank.",
                                    labels=labels + ["rank"])
        for rank, n in (mem.get("resident_adapters_by_rank") or {}).items():
            by_rank.add_metric(ids + [str(rank)], n)
        yield by_rank
        tasks = CounterMetricFamily("lorafleet_worker_tasks", "Tasks finished, by outcome.", labels=labels + ["outcome"])
        for outcome, n in sorted(rt.tasks_done.items()):
            tasks.add_metric(ids + [outcome], n)
        yield tasks
        if rt.consumer is not None:
            c = rt.consumer.stats()
            taken = CounterMetricFamily("lorafleet_worker_jobs_taken", "Jobs taken, by queue: own (routed to this "
                                        "worker by adapter affinity) or pool (the shared queue).",
                                        labels=labels + ["queue"])
            taken.add_metric(ids + ["own"], c["taken_own"])
            taken.add_metric(ids + ["pool"], c["taken_pool"])
            yield taken
            yield counter("jobs_reclaimed", "Jobs of dead workers this worker handed back to their pool.", c["reclaimed"])


def start_metrics_server(runtime: WorkerRuntime, port: int, addr: str = "127.0.0.1", token: str | None = None) -> int:
    """The exporter (inference_worker/metrics_server.py), behind `token`: by default the web's metrics token
    (LORAFLEET_METRICS_TOKEN), so one Prometheus credential scrapes both."""
    from prometheus_client import CollectorRegistry

    from .metrics_server import serve

    if token is None:
        from django.conf import settings

        token = settings.LORAFLEET_METRICS_TOKEN
    registry = CollectorRegistry()
    registry.register(EngineCollector(runtime))
    server = serve(registry, port=port, addr=addr, token=token)
    runtime.metrics_port = server.server_port
    return runtime.metrics_port


def beat_once(runtime: WorkerRuntime) -> None:
    """One heartbeat: the status (or a minimal one if the engine cannot say), then the consumer's registration
    and a reaping pass. Order matters: a worker is registered only while its heartbeat exists, so no reaper
    ever takes the jobs of a worker that is starting."""
    from transport.replies import reply_channel

    try:
        status = runtime.status()
    except Exception:
        log.exception("worker status failed; sending a minimal heartbeat")
        status = runtime.minimal_status()
    reply_channel().heartbeat(runtime.worker_id, status, HEARTBEAT_TTL_S)
    if runtime.consumer is not None:
        runtime.consumer.register()
        runtime.consumer.reap()


def start_heartbeat(runtime: WorkerRuntime) -> threading.Thread:
    """The first beat runs here (the worker is listed before it takes any job), the rest on a thread until
    `runtime.stopping` is set."""
    try:
        beat_once(runtime)
    except Exception as exc:
        log.warning("first heartbeat failed: %s", exc)

    def beat() -> None:
        while not runtime.stopping.wait(HEARTBEAT_S):
            try:
                beat_once(runtime)
            except Exception as exc:  # Redis away for a moment: the next beat retries
                log.warning("heartbeat failed: %s", exc)

    thread = threading.Thread(target=beat, name="lorafleet-heartbeat", daemon=True)
    thread.start()
    return thread
