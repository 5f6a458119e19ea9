"""Production settings (LORAFLEET_PRODUCTION=1, as docker-compose.yml sets) pass Django's deployment checklist
without a warning, and behave as the compose file expects: HTTPS behind a proxy, /metrics closed without
its token and scrapeable over plain HTTP with it."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def production_env(tmp_path) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("DATABASE_URL", "MIGRATION_DATABASE_URL", "CELERY_", "LORAFLEET_", "DJANGO_"))}
    return {**clean, "LORAFLEET_VAR_DIR": str(tmp_path), "LORAFLEET_PRODUCTION": "1",
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50), "DJANGO_SETTINGS_MODULE": "config.settings"}


def run(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_check_deploy_prints_no_warnings_in_production(production_env):
    out = run(["manage.py", "check", "--deploy", "--fail-level", "WARNING"], production_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "System check identified no issues (0 silenced)." in out.stdout
    assert "WARNINGS" not in out.stdout + out.stderr


def test_the_embedded_default_is_not_production(tmp_path):
    """Without the switch nothing redirects to HTTPS: `make demo` runs on plain http://localhost."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LORAFLEET_", "DJANGO_"))}
    out = run(["-c", "import django; django.setup(); from django.conf import settings; "
                     "print(settings.SECURE_SSL_REDIRECT, settings.SESSION_COOKIE_SECURE)"],
              {**env, "LORAFLEET_VAR_DIR": str(tmp_path), "DJANGO_SETTINGS_MODULE": "config.settings"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]


# Requests through the real middleware stack in a production-configured process (no database needed).
_PROBE = """
import json, django
django.setup()
from django.test import Client
c = Client()
def status(path, **headers):
    r = c.get(path, **headers)
    return [r.status_code, r.get("Location", ""), r.get("Strict-Transport-Security", "")]
token = {"HTTP_AUTHORIZATION": "Bearer " + __import__("os").environ.get("LORAFLEET_METRICS_TOKEN", "")}
print(json.dumps({
    "login_http": status("/login/"),
    "login_https": status("/login/", HTTP_X_FORWARDED_PROTO="https"),
    "metrics_http_token": status("/metrics", **token),
    "metrics_http_no_token": status("/metrics"),
}))
"""


def test_production_redirects_to_https_except_metrics_which_needs_its_token(production_env):
    out = run(["-c", _PROBE], {**production_env, "LORAFLEET_METRICS_TOKEN": "prod-metrics-token-123"})
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["login_http"][0] == 301 and seen["login_http"][1].startswith("https://")
    assert seen["login_https"][0] == 200 and "includeSubDomains" in seen["login_https"][2]
    assert seen["metrics_http_token"][0] == 200  # Prometheus scrapes web over the compose network
    assert seen["metrics_http_no_token"][0] == 401


def test_production_without_a_metrics_token_has_no_metrics_endpoint(production_env):
    out = run(["-c", _PROBE], production_env)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["metrics_http_token"][0] == seen["metrics_http_no_token"][0] == 404
