"""The runtime-role configuration, without a database: which URL `migrate` uses, and the clear
refusals of settings and `manage.py grant_runtime_role` when the two URLs are wrong.
(The role itself, on PostgreSQL, is exercised by test_audit_integrity.py's real stack.)"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWNER = "postgres://owner:owner-secret@db.internal:5432/lorafleet"
RUNTIME = "postgres://app:app-secret-XYZ@db.internal:5432/lorafleet"

PRINT_USER = ("import sys; sys.argv = {argv!r}; import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = "
              "'config.settings'; django.setup(); from django.conf import settings; "
              "print(settings.DATABASES['default']['USER'])")


def _run(args: list[str], env: dict, tmp_path) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("DATABASE_URL", "MIGRATION_DATABASE_URL", "CELERY_", "LORAFLEET_STORAGE"))}
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**clean, "LORAFLEET_VAR_DIR": str(tmp_path), **env})


def _user_for(argv: list[str], tmp_path) -> str:
    out = _run(["-c", PRINT_USER.format(argv=argv)], {"DATABASE_URL": RUNTIME, "MIGRATION_DATABASE_URL": OWNER},
               tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


def test_only_migrate_connects_as_the_owner(tmp_path):
    assert _user_for(["manage.py", "migrate", "--noinput"], tmp_path) == "owner"
    assert _user_for(["/usr/bin/django-admin", "migrate"], tmp_path) == "owner"
    for argv in (["manage.py", "runserver"], ["manage.py", "run_worker", "--base", "x"], ["manage.py", "shell"],
                 ["gunicorn", "config.wsgi:application"], ["manage.py", "showmigrations", "migrate"],
                 ["celery", "-A", "config", "worker"]):
        assert _user_for(argv, tmp_path) == "app", argv


def test_settings_refuse_a_migration_url_for_another_database_or_alone(tmp_path):
    out = _run(["-c", PRINT_USER.format(argv=["manage.py", "check"])],
               {"DATABASE_URL": RUNTIME, "MIGRATION_DATABASE_URL": OWNER.replace("/lorafleet", "/other")}, tmp_path)
    assert out.returncode != 0 and "MIGRATION_DATABASE_URL must name the same database" in out.stderr
    out = _run(["-c", PRINT_USER.format(argv=["manage.py", "check"])], {"MIGRATION_DATABASE_URL": OWNER}, tmp_path)
    assert out.returncode != 0 and "DATABASE_URL is not" in out.stderr


def test_a_postgres_connection_gives_up_instead_of_hanging(tmp_path):
    code = ("import django, os; os.environ['DJANGO_SETTINGS_MODULE'] = 'config.settings'; django.setup(); "
            "from django.conf import settings; d = settings.DATABASES['default']; "
            "print(d['OPTIONS']['connect_timeout'], d['CONN_HEALTH_CHECKS'])")
    out = _run(["-c", code], {"DATABASE_URL": RUNTIME}, tmp_path)
    assert out.returncode == 0 and out.stdout.split() == ["5", "True"], out.stderr[-2000:]
    out = _run(["-c", code], {"DATABASE_URL": RUNTIME + "?connect_timeout=2"}, tmp_path)
    assert out.stdout.split() == ["2", "True"], out.stderr[-2000:]  # the URL's own value wins


def test_grant_runtime_role_refuses_what_would_not_protect_the_audit_log(tmp_path):
    cases = [
        ({}, "DATABASE_URL is not set"),  # the embedded default: nothing to grant
        ({"DATABASE_URL": RUNTIME}, "MIGRATION_DATABASE_URL is not set"),
        ({"DATABASE_URL": f"sqlite:///{tmp_path}/x.sqlite3", "MIGRATION_DATABASE_URL": OWNER},
         "must name the same database"),
        ({"DATABASE_URL": RUNTIME.replace("app:app-secret-XYZ@", ""), "MIGRATION_DATABASE_URL": OWNER},
         "names no user"),
    ]
    for env, message in cases:
        out = _run(["manage.py", "grant_runtime_role"], env, tmp_path)
        assert out.returncode != 0 and message in out.stderr, (env, out.stdout, out.stderr[-2000:])
        assert "app-secret-XYZ" not in out.stdout + out.stderr and "owner-secret" not in out.stdout + out.stderr
    # the command's own checks (settings would already refuse the sqlite/postgres mix above)
    out = _run(["manage.py", "grant_runtime_role", "--runtime-url", f"sqlite:///{tmp_path}/x.sqlite3",
                "--owner-url", OWNER], {}, tmp_path)
    assert out.returncode != 0 and "must be a postgres:// URL" in out.stderr, out.stderr[-2000:]
