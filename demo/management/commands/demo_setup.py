"""`manage.py demo_setup`: everything `make demo` needs, built locally and idempotently.

1. trains the tiny demo base into ``var/demo/base`` (skipped when a complete one is there) and
   registers it as ``tiny-demo``;
2. creates the tenants ``acme`` (alice owner, bob viewer) and ``globex`` (charlie owner) and the
   ``admin`` superuser;
3. trains three style adapters with PEFT LoRA — acme: ``shouty`` (two versions, so rollback can be
   tried) and ``lister``; globex: ``echo`` — and uploads each as a real version through the same
   validation and storage path as a customer's upload;
4. issues one API key per tenant and writes keys and logins to ``var/demo/keys.json`` (mode 0600):
   secrets exist in clear only once, so the file is where the demo script reads them from.

Running it again changes nothing that is already in place; ``--reset`` starts the embedded demo over
(deletes its SQLite database, adapter blobs and trained files, then migrates).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from demo import training

BASE_SLUG = "tiny-demo"
ADAPTERS_UPLOADED_BY = {"acme": "alice", "globex": "charlie"}


@dataclass(frozen=True)
class DemoVersion:
    seed: int
    steps: int  # planned steps; the --adapter-seconds cap may end training earlier


@dataclass(frozen=True)
class DemoAdapter:
    tenant: str
    name: str
    style: str
    description: str
    versions: tuple[DemoVersion, ...]


# shouty v1 is trained for fewer steps with another seed: rolling back to it visibly changes answers.
DEMO_ADAPTERS = (
    DemoAdapter("acme", "shouty", "shouty", "Answers in CAPITALS.", (DemoVersion(seed=11, steps=60),
                                                                    DemoVersion(seed=12, steps=150))),
    DemoAdapter("acme", "lister", "lister", "Answers as a list of key words.", (DemoVersion(seed=21, steps=150),)),
    DemoAdapter("globex", "echo", "echo", "Repeats the question, then answers.", (DemoVersion(seed=31, steps=150),)),
)
DEMO_TENANTS = {"acme": "Acme Corp", "globex": "Globex Corporation"}
DEMO_USERS = (("alice", "acme", "owner"), ("bob", "acme", "viewer"), ("charlie", "globex", "owner"))


class Command(BaseCommand):
    help = "Train the tiny demo base and three style adapters, create demo tenants, users and API keys."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--base-seconds", type=float, default=60.0,
                            help="most wall-clock seconds to train the base (default %(default)s)")
        parser.add_argument("--adapter-seconds", type=float, default=20.0,
                            help="most wall-clock seconds to train each adapter version (default %(default)s)")
        parser.add_argument("--base-steps", type=int, default=None,
                            help="planned base training steps (default: training.train_base's); with a generous "
                                 "--base-seconds the result is deterministic")
        parser.add_argument("--adapter-steps", type=int, default=None,
                            help="cap on each adapter version's planned steps (tests use it for determinism)")
        parser.add_argument("--dir", default=None, help="where the demo's files go (default: var/demo)")
        parser.add_argument("--reset", action="store_true",
                            help="start the embedded demo over: delete its database, blobs and trained files")
        parser.add_argument("--no-progress", action="store_true", help="no progress bars")

    def handle(self, *args, **opts) -> None:
        started = time.perf_counter()
        demo_dir = Path(opts["dir"] or Path(settings.VAR_DIR) / "demo").resolve()
        self.progress = not opts["no_progress"]
        if opts["reset"]:
            self._reset(demo_dir)
        demo_dir.mkdir(parents=True, exist_ok=True)
        state = _read_state(demo_dir / "keys.json")

        steps = 6
        self._step(1, steps, "demo base")
        base = self._base(demo_dir / "base", opts["base_seconds"], opts["base_steps"])
        self._step(2, steps, "tenants and users")
        tenants, users = self._tenants_and_users(state)
        self._step(3, steps, "style adapters")
        trained = self._train_adapters(demo_dir / "adapters", demo_dir / "base", base.sha256, opts["adapter_seconds"],
                                       opts["adapter_steps"])
        self._step(4, steps, "adapter versions")
        self._upload(trained, tenants, users, base)
        self._step(5, steps, "API keys")
        self._keys(tenants, users, state)
        self._step(6, steps, "keys.json")
        state["base"] = {"slug": base.slug, "sha256": base.sha256, "path": base.checkpoint_path}
        state["adapters"] = {t: [a.name for a in DEMO_ADAPTERS if a.tenant == t] for t in DEMO_TENANTS}
        _write_state(demo_dir / "keys.json", state)
        self.stdout.write(self.style.SUCCESS(
            f"Demo ready in {time.perf_counter() - started:.0f} s: logins and API keys in {demo_dir / 'keys.json'}"))

    # ---- steps -------------------------------------------------------------------------------------

    def _step(self, n: int, total: int, what: str) -> None:
        self.stdout.write(f"[{n}/{total}] {what}")
        self.stdout.flush()

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

    def _base(self, base_dir: Path, seconds: float, steps: int | None):
        from adapters.services import checkpoint_sha256, register_base_model

        if training.base_is_trained(base_dir):
            self.stdout.write(f"    trained base found in {base_dir}; not training again")
        else:
            shutil.rmtree(base_dir, ignore_errors=True)  # an interrupted run leaves no marker: start clean
            report = training.train_base(base_dir, seconds=seconds, progress=self.progress,
                                         **({"steps": steps} if steps else {}))
            self.stdout.write(f"    {report.steps} steps in {report.seconds:.0f} s, loss {report.first_loss:.2f} -> "
                              f"{report.final_loss:.2f}")
        from adapters.models import BaseModel

        base = BaseModel.objects.filter(slug=BASE_SLUG).first()
        if base is None or base.checkpoint_path != str(base_dir) or base.sha256 != checkpoint_sha256(base_dir):
            base = register_base_model(BASE_SLUG, base_dir, display_name="Tiny demo Llama (trained locally)")
            self.stdout.write(f"    registered base {BASE_SLUG} ({base.sha256[:12]})")
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

    def _train_adapters(self, root: Path, base_dir: Path, base_sha256: str, seconds: float,
                        max_steps: int | None) -> dict:
        """Train every demo adapter version not already trained on this very base; returns their folders.

        Two at a time, in separate processes: training runs on one thread (see training.py), so on a
        two-core machine two trainings take the wall time of one.
        """
        out, todo = {}, []
        for spec in DEMO_ADAPTERS:
            longest = max(v.steps for v in spec.versions)
            for number, version in enumerate(spec.versions, start=1):
                folder = root / f"{spec.tenant}-{spec.name}-v{number}"
                out[(spec.tenant, spec.name, number)] = folder
                report = training.read_report(folder) or {}
                if report.get("extra", {}).get("base_sha256") == base_sha256 and (
                        folder / "adapter_model.safetensors").is_file():
                    self.stdout.write(f"    {spec.tenant}/{spec.name} v{number}: trained already")
                    continue
                shutil.rmtree(folder, ignore_errors=True)
                # A version planned shorter gets a proportionally shorter clock cap too.
                todo.append((f"{spec.tenant}/{spec.name} v{number} ({spec.style})", dict(
                    base_dir=base_dir, out_dir=folder, style=spec.style, seconds=seconds * version.steps / longest,
                    seed=version.seed, steps=min(version.steps, max_steps or version.steps), progress=False,
                    extra={"base_sha256": base_sha256})))
        if not todo:
            return out
        from concurrent.futures import ProcessPoolExecutor, as_completed
        from multiprocessing import get_context

        from tqdm.auto import tqdm

        workers = max(1, min(2, len(todo), os.cpu_count() or 1))
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool, \
                tqdm(total=len(todo), desc=f"train adapters ({workers} at a time)", unit="adapter",
                     disable=not self.progress) as bar:
            futures = {pool.submit(_train_one, kwargs): label for label, kwargs in todo}
            for future in as_completed(futures):
                r = future.result()
                bar.write(f"    {futures[future]}: {r.steps} steps in {r.seconds:.0f} s, loss "
                          f"{r.first_loss:.2f} -> {r.final_loss:.2f}", file=self.stdout)
                bar.update(1)
        return out

    def _upload(self, trained: dict, tenants: dict, users: dict, base) -> None:
        """Upload each trained folder unless a version with exactly these weights exists already."""
        import hashlib

        from adapters.models import Adapter
        from adapters.services import create_adapter
        from adapters.uploads import create_adapter_version

        for spec in DEMO_ADAPTERS:
            tenant, owner = tenants[spec.tenant], users[ADAPTERS_UPLOADED_BY[spec.tenant]]
            adapter = Adapter.objects.for_tenant(tenant).filter(name=spec.name).first()
            if adapter is not None and adapter.is_deleted:
                raise CommandError(f"The demo adapter {spec.tenant}/{spec.name} was deleted; run with --reset.")
            if adapter is not None and adapter.base_id != base.pk:
                raise CommandError(f"The demo adapter {spec.tenant}/{spec.name} belongs to another base; "
                                   "run with --reset.")
            if adapter is None:
                adapter = create_adapter(tenant, spec.name, base, created_by=owner, description=spec.description)
            for number in range(1, len(spec.versions) + 1):
                folder = trained[(spec.tenant, spec.name, number)]
                weights = folder / "adapter_model.safetensors"
                sha256 = hashlib.sha256(weights.read_bytes()).hexdigest()
                existing = adapter.versions.filter(sha256=sha256).first()
                if existing is not None:
                    self.stdout.write(f"    {spec.tenant}/{spec.name}: v{existing.number} uploaded already")
                    continue
                with open(folder / "adapter_config.json", "rb") as config, open(weights, "rb") as blob:
                    # The last trained version goes live; earlier ones stay for rollback.
                    version = create_adapter_version(adapter, config_file=config, weights_file=blob,
                                                     created_by=owner,
                                                     activate=True if number == len(spec.versions) else None)
                self.stdout.write(f"    {spec.tenant}/{spec.name}: uploaded v{version.number} ({version.sha256[:12]}, "
                                  f"rank {version.rank}, {version.size_bytes // 1024} KiB)")

    def _keys(self, tenants: dict, users: dict, state: dict) -> None:
        from tenants.keys import KeyRejected, authenticate_api_key
        from tenants.services import issue_api_key

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


def _train_one(kwargs: dict) -> training.TrainReport:
    """Runs in a spawned process (no Django there: training is Django-free)."""
    return training.train_style_adapter(**kwargs)


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
