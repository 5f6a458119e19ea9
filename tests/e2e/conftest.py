"""The real stack, started once per test session: PostgreSQL, Redis, a worker subprocess on a tiny
checkpoint, and the web app under gunicorn — nothing stubbed.

Data lives in a dedicated database created for the session (and dropped after it): the audit table
refuses TRUNCATE, so nothing here depends on flushing. Queues and bases carry a per-session suffix,
so the shared Redis is never flushed either. Without PostgreSQL or Redis these tests skip, except in
CI (CI=true), where that is a failure.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def _env_url(own: str, shared: str, schemes: tuple[str, ...], default: str) -> str:
    """This suite's own variable, else the suite-wide one when it names the right service, else the default."""
    if os.environ.get(own):
        return os.environ[own]
    if os.environ.get(shared, "").startswith(schemes):
        return os.environ[shared]
    return default


# The session's database is created next to this one (CREATE DATABASE), so any database of the server will do.
ADMIN_DB_URL = _env_url("LORAFLEET_E2E_DATABASE_URL", "DATABASE_URL", ("postgres://", "postgresql://"),
                        "postgres://postgres@127.0.0.1:5432/postgres")
REDIS_URL = _env_url("LORAFLEET_E2E_REDIS_URL", "CELERY_BROKER_URL", ("redis://",), "redis://127.0.0.1:6379/13")
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _require(what: str, ok: bool) -> None:
    if not ok:
        if IN_CI:
            pytest.fail(f"{what} is required in CI (CI=true) but is not available.")
        pytest.skip(f"{what} not available")


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout=1):
            return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _db_url(name: str) -> str:
    parsed = urlparse(ADMIN_DB_URL)
    return parsed._replace(path=f"/{name}").geturl()


def pg_connect(url: str):
    import psycopg

    return psycopg.connect(url, autocommit=True)


class Proc:
    """A subprocess of ours with its output in a log file; stopped by its own pid (or its group)."""

    def __init__(self, name: str, args: list[str], env: dict, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}-{int(time.time() * 1000)}.log"
        self._log = open(self.log_path, "wb")
        self.popen = subprocess.Popen(args, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.alive():
            try:
                os.killpg(self.popen.pid, sig)  # the group we created: gunicorn's forked worker too
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=8)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)
        self._log.close()

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


def wait_until(check, timeout: float, what: str, procs: tuple = ()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        try:
            value = check()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(0.2)
    tails = "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tails}")


class Stack:
    """One web + worker stack over a database and a broker; several may share the database."""

    def __init__(self, root: Path, env: dict):
        self.root, self.env, self.procs = root, env, []

    def django(self, code: str) -> dict:
        """Run Django code in a subprocess with this stack's settings; `result` (a dict) comes back."""
        wrapped = ("import json, django; django.setup()\n" + code +
                   "\nprint('@@RESULT@@' + json.dumps(result))")
        out = subprocess.run([PYTHON, "-c", wrapped], cwd=REPO, env=self.env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr[-4000:]
        return json.loads(out.stdout.rsplit("@@RESULT@@", 1)[1])

    def start_web(self, name: str = "web") -> str:
        port = free_port()
        proc = Proc(name, [PYTHON, "-m", "gunicorn", "config.wsgi:application", "-b", f"127.0.0.1:{port}",
                           "-k", "gthread", "-w", "1", "--threads", "100", "--timeout", "300",
                           "--graceful-timeout", "5"], self.env, self.root)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: httpx.get(url + "/v1/models", timeout=2).status_code == 401, 60, f"{name} up", (proc,))
        self.web_url, self.web = url, proc
        return url

    def start_worker(self, base_slug: str, name: str = "worker", env: dict | None = None,
                     args: tuple[str, ...] = ()) -> SimpleNamespace:
        port = free_port()
        proc = Proc(name, [PYTHON, "manage.py", "run_worker", "--base", base_slug, "--concurrency", "64",
                           "--metrics-port", str(port), "--loglevel", "WARNING", *args], {**self.env, **(env or {})},
                    self.root)
        self.procs.append(proc)
        metrics_url, token = f"http://127.0.0.1:{port}/metrics", metrics_token({**self.env, **(env or {})})
        wait_until(lambda: httpx.get(metrics_url, headers=bearer(token), timeout=2).status_code == 200, 120,
                   f"{name} metrics", (proc,))
        return SimpleNamespace(proc=proc, metrics_url=metrics_url, metrics_token=token)

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


def metrics_token(env: dict) -> str:
    """The token a process started with `env` wants on /metrics (web and worker alike): LORAFLEET_METRICS_TOKEN, or
    the documented development one that config/settings.py falls back to outside production."""
    from django.conf import settings

    return env.get("LORAFLEET_METRICS_TOKEN") or settings.LORAFLEET_DEV_METRICS_TOKEN


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def worker_metric(worker, name: str) -> float:
    """One series of a worker's exporter (`worker.metrics_url`), fetched with its token (`worker.metrics_token`)."""
    return scrape_metric(worker.metrics_url, name, worker.metrics_token)


def scrape_metric(metrics_url: str, name: str, token: str) -> float:
    """One series of an exporter that answers the bearer `token` (inference_worker/metrics_server.py)."""
    r = httpx.get(metrics_url, headers=bearer(token), timeout=5)
    assert r.status_code == 200, f"{metrics_url} with the token: {r.status_code} {r.text[:300]}"
    for line in r.text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported at {metrics_url}")


def web_metrics(url: str, token: str) -> str:
    """The web's /metrics exposition, fetched with its bearer token (LORAFLEET_METRICS_TOKEN)."""
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, f"/metrics with the token: {r.status_code} {r.text[:300]}"
    return r.text


def series_value(exposition: str, series: str) -> float | None:
    """The value of one series (`name{labels}` exactly as exported), or None when it is not exported."""
    for line in exposition.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def _poster(url: str):
    def post(key: str | None, body: dict, path: str = "/v1/completions", *, headers: dict | None = None,
             timeout: float = 120) -> httpx.Response:
        hdrs = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url + path, json=body, headers={**hdrs, **(headers or {})}, timeout=timeout)

    return post


@pytest.fixture(scope="session")
def e2e(tmp_path_factory):
    """The main stack: fresh database, seeded; one worker for the main base; gunicorn."""
    _require(f"PostgreSQL at {ADMIN_DB_URL}", _reachable(ADMIN_DB_URL, 5432))
    _require(f"Redis at {REDIS_URL}", _reachable(REDIS_URL, 6379))
    root = tmp_path_factory.mktemp("e2e")
    suffix = secrets.token_hex(3)
    db_name = f"lorafleet_e2e_{suffix}"
    with pg_connect(ADMIN_DB_URL) as admin:
        admin.execute(f'CREATE DATABASE "{db_name}"')
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "config.settings",
        "PYTHONPATH": str(REPO),
        "DATABASE_URL": _db_url(db_name),
        "CELERY_BROKER_URL": REDIS_URL,
        "LORAFLEET_VAR_DIR": str(root / "var"),
        "LORAFLEET_STORAGE_DIR": str(root / "storage"),
        "LORAFLEET_LOG_LEVEL": "WARNING",
        "TRITON_INTERPRET": "1",
        # /metrics answers only this token; per-tenant request series so tests can tell tenants apart
        "LORAFLEET_METRICS_TOKEN": secrets.token_urlsafe(24),
        "LORAFLEET_METRICS_TENANT_LABELS": "1",
    }
    env.pop("CELERY_RESULT_BACKEND", None)
    stack = Stack(root, env)
    try:
        out = subprocess.run([PYTHON, "manage.py", "migrate", "--noinput"], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        from demo.tiny_base import build_tiny_base

        checkpoint = build_tiny_base(root / "tiny", arch="llama", seed=11)
        out = subprocess.run([PYTHON, str(REPO / "tests/e2e/seed_stack.py"), str(checkpoint), str(root), suffix],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-4000:]
        seed = json.loads(out.stdout.strip().splitlines()[-1])
        stack.start_web()
        worker = stack.start_worker(seed["bases"]["main"]["slug"])
        yield SimpleNamespace(stack=stack, seed=seed, url=stack.web_url, worker=worker, root=root,
                              storage=root / "storage", checkpoint=checkpoint, db_url=env["DATABASE_URL"],
                              suffix=suffix, env=env, post=_poster(stack.web_url),
                              metric=lambda url, name: scrape_metric(url, name, env["LORAFLEET_METRICS_TOKEN"]),
                              web_metrics=lambda: web_metrics(stack.web_url, env["LORAFLEET_METRICS_TOKEN"]))
    finally:
        stack.close()
        with pg_connect(ADMIN_DB_URL) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')


@pytest.fixture
def db_rows(e2e):
    """Read audit rows straight from PostgreSQL: `db_rows(sql, params)` -> list of dicts."""
    from psycopg.rows import dict_row

    conn = pg_connect(e2e.db_url)
    conn.row_factory = dict_row

    def query(sql: str, params=()) -> list[dict]:
        return conn.execute(sql, params).fetchall()

    yield query
    conn.close()


@pytest.fixture
def redis_server(tmp_path):
    """A private redis-server on its own port, so a test may stop it (never the shared one on 6379)."""
    binary = shutil.which("redis-server")
    _require("redis-server binary", binary is not None)
    port = free_port()
    proc = Proc("redis", [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--dir", str(tmp_path)], dict(os.environ), tmp_path)
    url = f"redis://127.0.0.1:{port}/0"
    wait_until(lambda: _reachable(url, port), 20, "redis-server up", (proc,))
    yield SimpleNamespace(url=url, port=port, proc=proc)
    proc.kill()
