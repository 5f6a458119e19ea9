"""Settings come from the environment and fail loudly, naming the variable."""
import os
import subprocess
import sys

import pytest
from django.core.exceptions import ImproperlyConfigured

from config.env import database_from_url, env_bool, env_int


def test_bad_integer_names_the_variable(monkeypatch):
    monkeypatch.setenv("LORAFLEET_MAX_UPLOAD_BYTES", "lots")
    with pytest.raises(ImproperlyConfigured, match="LORAFLEET_MAX_UPLOAD_BYTES"):
        env_int("LORAFLEET_MAX_UPLOAD_BYTES", 1)


def test_bad_boolean_names_the_variable(monkeypatch):
    monkeypatch.setenv("DJANGO_DEBUG", "maybe")
    with pytest.raises(ImproperlyConfigured, match="DJANGO_DEBUG"):
        env_bool("DJANGO_DEBUG")


def test_database_url_is_parsed():
    db = database_from_url("DATABASE_URL", "postgres://app:s%40cret@db.internal:6543/lorafleet?sslmode=require")
    assert db["ENGINE"] == "django.db.backends.postgresql"
    assert (db["USER"], db["PASSWORD"], db["HOST"], db["PORT"], db["NAME"]) == \
        ("app", "s@cret", "db.internal", "6543", "lorafleet")
    assert db["OPTIONS"] == {"sslmode": "require"}
    with pytest.raises(ImproperlyConfigured, match="DATABASE_URL"):
        database_from_url("DATABASE_URL", "mysql://x/y")


def _settings_in_subprocess(env: dict, expr: str) -> subprocess.CompletedProcess:
    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE']='config.settings'; django.setup(); "
            f"from django.conf import settings; print({expr})")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "CELERY_", "LORAFLEET_STORAGE"))}
    return subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60)


def test_embedded_default_keeps_everything_under_var(tmp_path):
    out = _settings_in_subprocess(
        {"LORAFLEET_VAR_DIR": str(tmp_path)},
        "settings.DATABASES['default']['ENGINE'], settings.CELERY_BROKER_URL, "
        "settings.STORAGES['adapters']['OPTIONS']['location'], settings.CELERY_BROKER_TRANSPORT_OPTIONS['data_folder_in']",
    )
    assert out.returncode == 0, out.stderr
    assert "sqlite3" in out.stdout and "filesystem://" in out.stdout
    assert out.stdout.count(str(tmp_path)) == 2


def test_s3_storage_requires_a_bucket(tmp_path):
    out = _settings_in_subprocess({"LORAFLEET_VAR_DIR": str(tmp_path), "LORAFLEET_STORAGE": "s3"}, "1")
    assert out.returncode != 0 and "AWS_STORAGE_BUCKET_NAME" in out.stderr


def test_unknown_storage_is_refused(tmp_path):
    out = _settings_in_subprocess({"LORAFLEET_VAR_DIR": str(tmp_path), "LORAFLEET_STORAGE": "ftp"}, "1")
    assert out.returncode != 0 and "LORAFLEET_STORAGE" in out.stderr
