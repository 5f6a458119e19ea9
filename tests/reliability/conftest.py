"""Reliability fixtures: sizes (short in `make test`, full in `make faults`), the alice/bob/charlie
world extended with a member and hostile credentials, a recording queue boundary, and real tiny
checkpoints/PEFT folders for uploads.

The queue boundary is replaced by `RecordingDispatcher` only where a test is about the web surface
(authorisation, property-level writes, the schema fuzz); tests that need workers use tests/e2e's
real stack.
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

FULL = os.environ.get("LORAFLEET_FAULTS_FULL", "").lower() in ("1", "true", "yes")


def size(short: int, full: int) -> int:
    """The short figure in `make test`, the full one in `make faults` (LORAFLEET_FAULTS_FULL=1)."""
    return full if FULL else short


class RecordingDispatcher:
    """The queue boundary, counted: every job that would reach a worker is recorded here, and each
    is answered at once with a plausible result so the request path runs to the end."""

    def __init__(self):
        self.published: list[SimpleNamespace] = []
        self.cancelled: list[str] = []

    def publish(self, job, meta, *, queue, expires_s):
        self.published.append(SimpleNamespace(job=job, meta=meta, queue=queue, expires_s=expires_s))

    def events(self, request_id, deadline):
        from protocol.jobs import GenerationResult

        sent = next(p for p in self.published if p.job.request_id == request_id)
        job = sent.job
        sha = job.adapter.sha256 if job.adapter else None
        result = GenerationResult(
            request_id=job.request_id, status="ok", text="ok then", token_ids=[5, 6], finish_reason="length",
            prompt_tokens=3, completion_tokens=2, adapter_sha256=sha, queued_s=0.0, first_token_s=0.0, total_s=0.0,
            adapter_identity=job.adapter.identity if job.adapter else None,
        ).to_dict()
        if sent.meta.get("stream"):
            yield {"type": "delta", "text": "ok", "worker_id": "w-test", "adapter_sha256": sha}
        yield {"type": "final", "result": result, "worker_id": "w-test", "attempts": 1}

    def cancel(self, request_id):
        self.cancelled.append(request_id)


@pytest.fixture
def dispatcher(monkeypatch) -> RecordingDispatcher:
    from gateway import limits, queue

    fake = RecordingDispatcher()
    monkeypatch.setattr(queue, "_dispatcher", fake)
    monkeypatch.setattr(limits, "_counters", limits.LocalCounters())
    return fake


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from demo.tiny_base import build_tiny_base

    return build_tiny_base(tmp_path_factory.mktemp("rel_tiny"), arch="llama", seed=3, max_position=128)


@pytest.fixture(scope="session")
def peft_folder(tiny_checkpoint, tmp_path_factory) -> Path:
    from tests.support.peft_factory import make_random_peft_adapter

    return make_random_peft_adapter(tiny_checkpoint, tmp_path_factory.mktemp("rel_peft") / "good", r=8, alpha=16,
                                    seed=4)


@pytest.fixture
def realm(world, tiny_checkpoint, dispatcher, adapter_storage_dir):
    """`world` plus everything the matrix needs: dave (member of acme), eve (no tenant), an adapter
    only acme has (so another tenant's key cannot resolve the same name in its own tenant), acme
    keys that are revoked, expired, or carry a bad checksum, and an open acme invitation addressed to
    charlie (its link token in `acme_invitation_token`). The base is servable (real tokenizer)."""
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from adapters.manifest import shape_manifest_from_checkpoint
    from adapters.models import BaseModel
    from adapters.services import activate_version, create_adapter
    from gateway.models import ApiKey, AuditRecord
    from gateway.services import issue_api_key, revoke_api_key
    from tenants.models import Role
    from tenants.services import add_member, do_invite

    w = world
    BaseModel.objects.filter(pk=w.base.pk).update(
        checkpoint_path=str(tiny_checkpoint), shape_manifest=shape_manifest_from_checkpoint(tiny_checkpoint))
    w.base.refresh_from_db()
    User = get_user_model()
    w.dave = User.objects.create_user("dave", password="dave-password-1")
    add_member(w.acme, w.dave, Role.MEMBER)
    w.eve = User.objects.create_user("eve", password="eve-password-1")
    w.acme_only = create_adapter(w.acme, "acme-only", w.base, created_by=w.alice)
    w.acme_only_v1 = w.make_version(w.acme_only, 1, "d")
    activate_version(w.acme_only, w.acme_only_v1, actor=w.alice, reason="first")
    revoked, w.revoked_secret = issue_api_key(w.acme, "revoked", created_by=w.alice)
    revoke_api_key(revoked, actor=w.alice)
    expired, w.expired_secret = issue_api_key(w.acme, "expired", created_by=w.alice)
    ApiKey.objects.filter(pk=expired.pk).update(expires_at=timezone.now() - timedelta(days=1))
    last = w.acme_secret[-1]
    w.badsum_secret = w.acme_secret[:-1] + ("A" if last != "A" else "B")
    # Addressed to charlie, a user of another tenant: only he may see and answer it.
    w.acme_invitation, w.acme_invitation_token = do_invite(w.acme, "charlie", Role.VIEWER, actor=w.alice)
    # An acme audit row with a marker a cross-tenant page must never show.
    w.acme_audit = AuditRecord.objects.create(route="completions", tenant=w.acme, key_prefix=w.acme_key.prefix,
                                              adapter=w.acme_only, adapter_name="acme-only", status="ok",
                                              http_status=200)
    w.dispatcher = dispatcher
    return w


# --- a real stack (PostgreSQL, Redis, a worker subprocess, gunicorn) for audit and fault tests -----


def runtime_role_stack_env(admin_url: str, db_name: str, role: str, base_env: dict) -> tuple[dict, str]:
    """Migrate `db_name` as the owner (admin_url's role) and grant `role` with `grant_runtime_role`; return
    the environment the stack runs with (DATABASE_URL = the runtime role, MIGRATION_DATABASE_URL = the owner)
    and the command's output. The caller drops the database, then the role."""
    import subprocess
    from urllib.parse import urlparse

    from tests.e2e import conftest as e2e_helpers

    owner_url = urlparse(admin_url)._replace(path=f"/{db_name}").geturl()
    parsed = urlparse(owner_url)
    import secrets

    password = secrets.token_urlsafe(18)  # set by grant_runtime_role (unused where pg_hba trusts 127.0.0.1)
    runtime_url = parsed._replace(netloc=f"{role}:{password}@{parsed.hostname}:{parsed.port or 5432}").geturl()
    env = {**base_env, "DATABASE_URL": runtime_url, "MIGRATION_DATABASE_URL": owner_url}
    run = dict(cwd=e2e_helpers.REPO, env=env, capture_output=True, text=True, timeout=300)
    out = subprocess.run([e2e_helpers.PYTHON, "manage.py", "migrate", "--noinput"], **run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    out = subprocess.run([e2e_helpers.PYTHON, "manage.py", "grant_runtime_role"], **run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return env, out.stdout


def drop_role(admin_url: str, role: str) -> None:
    from tests.e2e import conftest as e2e_helpers

    with e2e_helpers.pg_connect(admin_url) as admin:
        admin.execute(f'DROP ROLE IF EXISTS "{role}"')


@pytest.fixture(scope="session")
def rel_stack(tmp_path_factory):
    """A light copy of tests/e2e's stack (one tenant, two adapters, or 20 for the worker faults) in its own
    database, built with tests/e2e's helpers so the two cannot drift; its queues carry a per-session
    suffix, so the shared Redis is never flushed. Migrations run as the owner (the admin URL's role); the
    web, the worker and every seeding step run as a runtime role created by `manage.py grant_runtime_role`
    — the production shape, in which the audit triggers bind the application. With CI=true a missing
    PostgreSQL or Redis fails instead of skipping."""
    import json
    import secrets
    import subprocess

    from tests.e2e import conftest as e2e_helpers

    e2e_helpers._require(f"PostgreSQL at {e2e_helpers.ADMIN_DB_URL}", e2e_helpers._reachable(e2e_helpers.ADMIN_DB_URL, 5432))
    e2e_helpers._require(f"Redis at {e2e_helpers.REDIS_URL}", e2e_helpers._reachable(e2e_helpers.REDIS_URL, 6379))
    root = tmp_path_factory.mktemp("rel_stack")
    suffix = "r" + secrets.token_hex(3)
    db_name = f"lorafleet_rel_{suffix}"
    role = f"lorafleet_rel_app_{suffix}"
    with e2e_helpers.pg_connect(e2e_helpers.ADMIN_DB_URL) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    base_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONPATH": str(e2e_helpers.REPO),
                "CELERY_BROKER_URL": e2e_helpers.REDIS_URL, "LORAFLEET_VAR_DIR": str(root / "var"),
                "LORAFLEET_STORAGE_DIR": str(root / "storage"), "LORAFLEET_LOG_LEVEL": "WARNING",
                "TRITON_INTERPRET": "1"}
    base_env.pop("CELERY_RESULT_BACKEND", None)
    stack = None
    try:
        env, granted = runtime_role_stack_env(e2e_helpers.ADMIN_DB_URL, db_name, role, base_env)
        stack = e2e_helpers.Stack(root, env)
        run = dict(cwd=e2e_helpers.REPO, env=env, capture_output=True, text=True, timeout=300)
        from demo.tiny_base import build_tiny_base

        checkpoint = build_tiny_base(root / "tiny", arch="llama", seed=11)
        out = subprocess.run([e2e_helpers.PYTHON, str(e2e_helpers.REPO / "tests/e2e/seed_stack.py"), str(checkpoint),
                              str(root), suffix, "light"], **run)
        assert out.returncode == 0, out.stderr[-4000:]
        seed = json.loads(out.stdout.strip().splitlines()[-1])
        # The audit sample and the fault traffic send far more than the default 600/min as tenant a:
        # lift its quota so they measure what they are about (the load test has its own limited tenant).
        stack.django(f"from tenants.models import Tenant\n"
                     f"Tenant.objects.filter(slug={seed['tenants']['a']['slug']!r}).update(requests_per_minute=10**6)\n"
                     f"result = {{}}")
        stack.start_web()
        worker = stack.start_worker(seed["bases"]["main"]["slug"])
        yield SimpleNamespace(stack=stack, seed=seed, url=stack.web_url, worker=worker, root=root, env=env,
                              storage=root / "storage", db_url=env["DATABASE_URL"], owner_url=env["MIGRATION_DATABASE_URL"],
                              role=role, granted=granted, db_name=db_name, suffix=suffix, checkpoint=checkpoint)
    finally:
        if stack is not None:
            stack.close()
        with e2e_helpers.pg_connect(e2e_helpers.ADMIN_DB_URL) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        drop_role(e2e_helpers.ADMIN_DB_URL, role)
