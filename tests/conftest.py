"""Suite-wide setup.

- Triton kernels can only run on this CPU-only machine through Triton's interpreter, and Triton reads
  TRITON_INTERPRET when a kernel is decorated, so it is set before anything imports `kernels`.
- PostgreSQL and Redis: tests that need them ask for the `postgres` / `redis_url` fixtures. Without
  the service they skip — unless CI=true, where a missing service is a failure, never a silent skip.
- The audit table refuses TRUNCATE; Django's test runner empties tables with one TRUNCATE between
  transactional tests, so connections to a *test* database opt in to the flush escape hatch that the
  trigger allows only for databases named ``test_*`` (see gateway/migrations/0002).
"""
from __future__ import annotations

import os
import socket
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads spin-wait by default; on a shared 2-core box a spinning torch step starves the worker
# and web subprocesses the end-to-end tests start. Set before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
REDIS_URL = os.environ.get("LORAFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _allow_test_flush(sender, connection, **kwargs):
    if connection.vendor == "postgresql" and str(connection.settings_dict.get("NAME", "")).startswith("test_"):
        with connection.cursor() as cursor:
            cursor.execute("SET lorafleet.allow_test_flush = 'on'")


def pytest_configure(config):
    from django.db.backends.signals import connection_created

    connection_created.connect(_allow_test_flush, dispatch_uid="lorafleet_allow_test_flush")


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def require_service(what: str, available: bool) -> None:
    if available:
        return
    if IN_CI:
        pytest.fail(f"{what} is required in CI (CI=true) but is not available.")
    pytest.skip(f"{what} not available (embedded default run)")


@pytest.fixture
def postgres(db):
    """The test database is PostgreSQL (DATABASE_URL). In CI it must be."""
    from django.db import connection

    require_service("PostgreSQL (set DATABASE_URL=postgres://…)", connection.vendor == "postgresql")
    return connection


@pytest.fixture(scope="session")
def redis_url() -> str:
    from urllib.parse import urlparse

    parsed = urlparse(REDIS_URL)
    require_service(f"Redis at {REDIS_URL}", _reachable(parsed.hostname or "127.0.0.1", parsed.port or 6379))
    return REDIS_URL


# --- the tenant-isolation fixture: alice owns acme, bob is a viewer in acme, charlie owns globex -----


@pytest.fixture
def world(db):
    """Two tenants with users, a base, adapters with versions and keys: the isolation fixture.

    Rows only (no blobs): for tests of scoping, pointers and invariants. Upload tests build real ones.
    """
    from types import SimpleNamespace

    from django.contrib.auth import get_user_model

    from adapters.models import AdapterVersion, BaseModel
    from adapters.services import activate_version, create_adapter
    from gateway.services import issue_api_key
    from tenants.models import Role
    from tenants.services import add_member, create_tenant

    User = get_user_model()
    alice = User.objects.create_user("alice", password="alice-password-1")
    bob = User.objects.create_user("bob", password="bob-password-1")
    charlie = User.objects.create_user("charlie", password="charlie-password-1")
    acme = create_tenant("acme", "Acme", owner=alice)
    add_member(acme, bob, Role.VIEWER)
    globex = create_tenant("globex", "Globex", owner=charlie)
    base = BaseModel.objects.create(
        slug="tiny", display_name="Tiny", sha256="0" * 64, architecture="llama",
        shape_manifest={"modules": {}}, queue_name="base.tiny",
    )

    def make_version(adapter, number, sha_char):
        return AdapterVersion.objects.create(
            adapter=adapter, number=number, sha256=sha_char * 64, storage_key=f"adapters/{sha_char * 64}.safetensors",
            size_bytes=1000, rank=8, alpha=16, target_modules=["q_proj", "v_proj"], dtype="float32",
            parameter_count=250, created_by=None,
        )

    acme_adapter = create_adapter(acme, "support-bot", base, created_by=alice)
    acme_v1 = make_version(acme_adapter, 1, "a")
    acme_v2 = make_version(acme_adapter, 2, "b")
    activate_version(acme_adapter, acme_v1, actor=alice, reason="first")
    activate_version(acme_adapter, acme_v2, actor=alice, reason="better")
    globex_adapter = create_adapter(globex, "support-bot", base, created_by=charlie)
    globex_v1 = make_version(globex_adapter, 1, "c")
    activate_version(globex_adapter, globex_v1, actor=charlie, reason="first")
    acme_key, acme_secret = issue_api_key(acme, "prod", created_by=alice)
    globex_key, globex_secret = issue_api_key(globex, "prod", created_by=charlie)
    return SimpleNamespace(**locals())


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """Tests create users by the dozen; production-strength hashing would cost seconds per test."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def adapter_storage_dir(settings, tmp_path) -> Path:
    """The "adapters" storage, pointed at tmp_path/storage (not created: a refused upload must leave none)."""
    folder = tmp_path / "storage"
    settings.STORAGES = {
        **settings.STORAGES,
        "adapters": {"BACKEND": "adapters.storage.AtomicFileSystemStorage", "OPTIONS": {"location": str(folder)}},
    }
    return folder
