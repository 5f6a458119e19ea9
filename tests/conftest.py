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

os.environ.setdefault("TRITON_INTERPRET", "1")

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
