"""A trainer runs one job: take it, train it (finetune/training.py), publish the result as an adapter version.

The trainer process (`manage.py run_trainer --base SLUG`) calls `run_job` for each message of its base's
training queue. Invariants:

- A job is taken only while queued, in one transaction that marks it running under this trainer's id; a
  redelivered message (Redis hands back what a killed trainer had taken) finds it running, failed or cancelled
  and does nothing to it, so a job never runs twice and the reaper (finetune/jobs.py) is the one that fails it.
- While it trains, a thread refreshes the job's heartbeat; a trainer that is killed stops beating and its job
  is failed `trainer_lost` once LORAFLEET_TRAINER_HEARTBEAT_TTL_S have passed.
- Cancel is a row change (finetune/jobs.py cancel_job); training polls it between steps (`should_cancel`) and
  stops with `Cancelled`.
- Weights are written to a temporary folder, then uploaded through the same validation and storage as a user's
  upload (adapters/uploads.py) in ONE transaction that also creates the adapter (if new), the version's
  provenance and the job's `succeeded`, and that first checks, under the job's row lock, that the job is still
  running under this trainer. A trainer killed anywhere before that commit leaves no adapter, no version and no
  provenance (at most an unreferenced blob); a job cancelled meanwhile publishes nothing.
- On a CPU host the trainer runs at a lower scheduling priority (`LORAFLEET_TRAINER_NICE`, default 10 nicer) than the
  inference worker it shares the cores with, and holds its work between layers while an engine on the host has
  requests in hand (transport/busy.py, `LORAFLEET_TRAINER_YIELD`), so a tenant's chat keeps its pace while
  another trains (bench/RESULTS.md); training's arithmetic is unchanged (the same threads, the same order of sums).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connection, transaction
from django.utils import timezone

from adapters.models import Adapter
from adapters.services import create_adapter
from adapters.storage import BlobStorageError
from adapters.uploads import create_adapter_version
from adapters.validation import CONFIG_FILE, WEIGHTS_FILE, AdapterValidationError
from gateway.errors import ApiError

from .files import read_examples
from .jobs import add_event, fail_job
from .models import AdapterProvenance, FineTuningJob, JobEvent, JobStatus

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5
DEFAULT_TRAINER_NICE = 10


def trainer_nice() -> int:
    """LORAFLEET_TRAINER_NICE: how much nicer than it was started a CPU trainer runs, 0 (leave it) to 19; default
    10 (as `nice -n 10`)."""
    raw = os.environ.get("LORAFLEET_TRAINER_NICE", "").strip()
    if not raw:
        return DEFAULT_TRAINER_NICE
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= 19:
        raise ImproperlyConfigured(f"LORAFLEET_TRAINER_NICE must be a whole number from 0 (leave the priority as it "
                                   f"is) to 19 (the lowest), got {raw!r}.")
    return value


def _thread_ids() -> list[int]:
    """This process's threads (Linux keeps a priority and a policy per thread); [0] (the calling thread, for the
    process-wide call) where there is no /proc."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def yield_cpu_to_inference(increment: int) -> int:
    """Make this process `increment` nicer than it is (as `nice -n`, at most 19) and return its niceness.

    Linux keeps a nice value per thread and a new thread inherits its creator's, so every thread alive now is
    lowered here, and the threads started later (torch's OpenMP pool, the heartbeat) inherit it from the main
    thread. Being relative, the trainer stays below an inference worker started the same way (both under
    `nice -n 5`, say)."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    target = min(19, current + increment)
    if target <= current:
        return current
    for tid in _thread_ids():
        try:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def idle_scheduling() -> bool:
    """Put every thread of this process under SCHED_IDLE (Linux): a thread of any other process that wakes takes
    the core at once, instead of after the trainer's time slice. Threads started later inherit it. False where the
    policy is not there (not Linux) or not allowed."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        for tid in _thread_ids():
            try:
                os.sched_setscheduler(tid, policy, os.sched_param(0))
            except ProcessLookupError:
                pass
    except OSError:
        return False
    return os.sched_getscheduler(0) == policy


def trainer_yields() -> bool:
    """LORAFLEET_TRAINER_YIELD: whether a CPU trainer holds its work while an inference engine on this host runs
    requests (transport/busy.py); on by default, 0 turns it off."""
    return os.environ.get("LORAFLEET_TRAINER_YIELD", "1").strip().lower() not in ("0", "false", "no", "off")


def trainer_yield_max_s() -> float:
    """LORAFLEET_TRAINER_YIELD_MAX_S: the longest a trainer holds at a stretch before it works on regardless (2 s of
    work, then it yields again): default 30."""
    raw = os.environ.get("LORAFLEET_TRAINER_YIELD_MAX_S", "").strip()
    try:
        value = float(raw) if raw else 30.0
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ImproperlyConfigured(f"LORAFLEET_TRAINER_YIELD_MAX_S must be a number of seconds above 0, got {raw!r}.")
    return value


def _yield_gate():
    """A started watcher of this host's engines and the gate training calls, or None: on CUDA (the engines' steps
    are not on these cores) or with LORAFLEET_TRAINER_YIELD=0."""
    import torch

    from transport.busy import EngineWatcher, YieldGate

    if not trainer_yields() or torch.cuda.is_available():
        return None
    watcher = EngineWatcher()
    watcher.start()
    return YieldGate(watcher, max_pause_s=trainer_yield_max_s())


def trainer_id(base_slug: str) -> str:
    return f"trainer-{base_slug}@{socket.gethostname()}:{os.getpid()}"


def trainer_version(core: ModuleType) -> str:
    """What trained the weights: the core's own version when it states one, and the libraries it ran on."""
    import peft
    import torch
    import transformers

    own = getattr(core, "TRAINER_VERSION", None) or getattr(core, "__version__", None) or "lorafleet"
    return f"{own}; peft {peft.__version__}; transformers {transformers.__version__}; torch {torch.__version__}"


class _Heartbeat(threading.Thread):
    """Refreshes the job's heartbeat while it trains (its own database connection, closed at the end)."""

    def __init__(self, job_pk: int, owner: str):
        super().__init__(name=f"heartbeat-{job_pk}", daemon=True)
        self.job_pk, self.owner = job_pk, owner
        self.stop_event = threading.Event()
        self.interval = max(0.5, min(5.0, settings.LORAFLEET_TRAINER_HEARTBEAT_TTL_S / 4))

    def run(self) -> None:
        try:
            while not self.stop_event.wait(self.interval):
                try:
                    FineTuningJob.objects.filter(pk=self.job_pk, status=JobStatus.RUNNING, trainer_id=self.owner) \
                        .update(heartbeat_at=timezone.now())
                except Exception:  # the database restarting: the next beat tries again
                    log.warning("heartbeat of job %s failed", self.job_pk, exc_info=True)
        finally:
            connection.close()

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=10)


def _take(job_id: str, owner: str) -> FineTuningJob | None:
    with transaction.atomic():
        job = FineTuningJob.objects.select_for_update().select_related("base", "tenant").filter(public_id=job_id).first()
        if job is None:
            log.error("training message for unknown job %s; dropped", job_id)
            return None
        if job.status != JobStatus.QUEUED:
            log.warning("job %s is %s, not queued; this delivery does nothing", job_id, job.status)
            return None
        now = timezone.now()
        job.status, job.trainer_id, job.started_at, job.heartbeat_at = JobStatus.RUNNING, owner, now, now
        job.save(update_fields=["status", "trainer_id", "started_at", "heartbeat_at"])
        add_event(job, f"Fine-tuning job started on {owner}")
    return job


def _settings(core: ModuleType, job: FineTuningJob):
    h = job.hyperparameters
    return core.TrainSettings(n_epochs=int(h["n_epochs"]), batch_size=int(h["batch_size"]),
                              learning_rate=float(h["learning_rate"]), rank=int(h["lora_rank"]),
                              alpha=int(round(float(h["lora_alpha"]))), target_modules=tuple(h["lora_target_modules"]),
                              seed=int(job.seed))


class _Events:
    """on_event for the training core: metrics and messages become job events (rows the API lists)."""

    def __init__(self, job: FineTuningJob):
        self.job = job
        self.last_step = 0

    def __call__(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "metrics":
            step, total, loss = int(event["step"]), int(event.get("total_steps") or 0), float(event["train_loss"])
            self.last_step = step
            data = {"step": step, "total_steps": total, "train_loss": loss}
            if event.get("valid_loss") is not None:
                data["valid_loss"] = float(event["valid_loss"])
            add_event(self.job, f"Step {step}/{total}: training loss={loss:.4f}", type=JobEvent.Type.METRICS, data=data)
        elif kind == "message":
            add_event(self.job, str(event.get("message", ""))[:2000])


def run_job(job_id: str, *, owner: str, core: ModuleType | None = None) -> str:
    """Run one queued job to its end; returns the job's final status (or what it already was)."""
    if core is None:
        from . import training as core
    job = _take(job_id, owner)
    if job is None:
        return "skipped"
    beat = _Heartbeat(job.pk, owner)
    beat.start()
    workdir = Path(tempfile.mkdtemp(prefix=f"lorafleet-{job.public_id}-"))
    try:
        return _train_and_publish(job, owner, core, workdir)
    except Exception as exc:  # never leave a job running because its trainer's code failed
        log.exception("job %s failed in the trainer", job.public_id)
        fail_job(job, "training_failed", f"The trainer failed ({type(exc).__name__}); no model was created.",
                 only_if=(JobStatus.RUNNING,), trainer_id=owner)
        return JobStatus.FAILED
    finally:
        beat.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _still_mine(job: FineTuningJob, owner: str) -> bool:
    return FineTuningJob.objects.filter(pk=job.pk, status=JobStatus.RUNNING, trainer_id=owner).exists()


def _train_and_publish(job: FineTuningJob, owner: str, core: ModuleType, workdir: Path) -> str:
    try:
        train = read_examples(job.training_file, file_label=f"training_file {job.training_file.public_id}")
        valid = (read_examples(job.validation_file, file_label=f"validation_file {job.validation_file.public_id}")
                 if job.validation_file_id else None)
    except ApiError as err:
        fail_job(job, err.code, err.message, only_if=(JobStatus.RUNNING,), trainer_id=owner)
        return JobStatus.FAILED
    polled = {"at": 0.0, "cancel": False}

    def should_cancel() -> bool:
        now = time.monotonic()
        if now - polled["at"] >= CANCEL_POLL_S:
            polled["at"], polled["cancel"] = now, not _still_mine(job, owner)
        return polled["cancel"]

    events = _Events(job)
    started = time.monotonic()
    gate = _yield_gate()
    try:
        result = core.train_lora(Path(job.base.checkpoint_path), train.examples, valid.examples if valid else None,
                                 _settings(core, job), workdir / "adapter", on_event=events, should_cancel=should_cancel,
                                 **({"pause": gate.wait} if gate is not None else {}))
    except core.Cancelled:
        add_event(job, f"Training stopped at step {events.last_step}: the job was cancelled; no model was created")
        return JobStatus.CANCELLED
    except ValueError as exc:
        fail_job(job, "invalid_training_data", str(exc), only_if=(JobStatus.RUNNING,), trainer_id=owner)
        return JobStatus.FAILED
    finally:
        if gate is not None:
            gate.watcher.stop()
    seconds = time.monotonic() - started
    if gate is not None and gate.pauses:
        add_event(job, f"Training held {gate.pauses} time(s), {gate.paused_s:.1f} s in all, while inference on the same "
                       f"CPU cores ran requests")
    if result.valid_loss is not None:
        add_event(job, f"Validation loss={result.valid_loss:.4f}", type=JobEvent.Type.METRICS,
                  data={"step": result.steps, "valid_loss": float(result.valid_loss)})
    try:
        return _publish(job, owner, core, result, seconds)
    except (AdapterValidationError, BlobStorageError) as exc:
        what = "did not pass adapter validation" if isinstance(exc, AdapterValidationError) else "could not be stored"
        fail_job(job, "adapter_upload_failed", f"The trained adapter {what}: {exc}", only_if=(JobStatus.RUNNING,),
                 trainer_id=owner)
        return JobStatus.FAILED


class _NotMine(Exception):
    """The job was cancelled (or reaped) while it trained: nothing is published."""


def _publish(job: FineTuningJob, owner: str, core: ModuleType, result, seconds: float) -> str:
    folder = Path(result.adapter_dir)
    try:
        with transaction.atomic():
            locked = FineTuningJob.objects.select_for_update().get(pk=job.pk)
            if locked.status != JobStatus.RUNNING or locked.trainer_id != owner:
                raise _NotMine
            adapter = Adapter.objects.for_tenant(job.tenant).select_for_update().filter(name=job.suffix).first()
            if adapter is None:
                adapter = create_adapter(job.tenant, job.suffix, job.base, created_by=job.created_by,
                                         description=f"fine-tuned by {job.public_id}")
            elif adapter.is_deleted or adapter.base_id != job.base_id:
                raise AdapterValidationError("suffix", f"adapter {job.suffix!r} was deleted or moved to another base "
                                                       f"while the job ran")
            with open(folder / CONFIG_FILE, "rb") as config, open(folder / WEIGHTS_FILE, "rb") as weights:
                version = create_adapter_version(adapter, config_file=config, weights_file=weights,
                                                 created_by=job.created_by, activate=True if job.auto_activate else None)
            AdapterProvenance.objects.create(
                version=version, job_public_id=job.public_id, training_file_sha256=job.training_file.sha256,
                validation_file_sha256=job.validation_file.sha256 if job.validation_file_id else "",
                base_slug=job.base.slug, base_sha256=job.base.sha256, hyperparameters=job.hyperparameters,
                seed=job.seed, steps=result.steps, trained_tokens=result.trained_tokens,
                train_loss=float(result.train_loss),
                valid_loss=float(result.valid_loss) if result.valid_loss is not None else None,
                trainer_version=trainer_version(core)[:200],
            )
            locked.status, locked.finished_at = JobStatus.SUCCEEDED, timezone.now()
            locked.result_version, locked.trained_tokens = version, result.trained_tokens
            locked.fine_tuned_model = f"{adapter.name}@{version.number}"
            locked.save(update_fields=["status", "finished_at", "result_version", "trained_tokens", "fine_tuned_model"])
            live = adapter.active_version_id == version.pk
            add_event(locked, f"New fine-tuned model created: {locked.fine_tuned_model} (weights sha256 "
                              f"{version.sha256[:12]}, {result.steps} steps in {seconds:.1f} s)"
                              + ("" if live else f"; not live yet: activate it to serve {adapter.name}"),
                      data={"fine_tuned_model": locked.fine_tuned_model, "weights_sha256": version.sha256,
                            "live": live})
            add_event(locked, "The job has successfully completed")
    except _NotMine:
        log.info("job %s was cancelled or reaped while it trained; nothing published", job.public_id)
        return FineTuningJob.objects.get(pk=job.pk).status
    return JobStatus.SUCCEEDED
