"""docker-compose.yml and the Dockerfile, checked statically (no Docker engine runs here).

What an operator would trip over: a service missing, web or worker starting before migrations, the worker
without a GPU, web and worker configured differently (uploads land in one bucket, the worker reads
another), or a setting config/settings.py requires that compose never sets.
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
DJANGO_SERVICES = ("migrate", "web", "worker")
# Compose interpolation: ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?error}, ${NAME?error}
_INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def _resolve(value: str) -> str:
    """What compose makes of a value with nothing set in the environment: defaults, '$$' -> '$'.

    A required variable (`:?`) stands for itself as `<NAME>` so the test can still compare strings."""
    def sub(match: re.Match) -> str:
        name, op, arg = match.groups()
        if op in (":-", "-"):
            return arg
        return f"<{name}>"

    return _INTERPOLATION.sub(sub, str(value)).replace("$$", "$")


def _settings_env_reads() -> dict[str, bool]:
    """Every env_*("NAME", ...) call in config/settings.py -> whether it has a default."""
    tree = ast.parse((ROOT / "config" / "settings.py").read_text())
    reads: dict[str, bool] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.startswith("env_")):
            continue
        if not (node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            continue
        default = node.args[1] if len(node.args) > 1 else next(
            (kw.value for kw in node.keywords if kw.arg == "default"), None
        )
        has_default = default is not None and not (isinstance(default, ast.Constant) and default.value is None)
        # env_bool/env_int/... always have one in config/env.py's signatures; env_str's is optional.
        reads[node.args[0].value] = has_default or node.func.id != "env_str"
    return reads


def _commands_as_text(service: dict) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else str(command)


def test_the_production_services_are_all_there():
    assert {"postgres", "redis", "minio", "minio-init", "migrate", "web", "worker"} <= set(SERVICES)


def test_migrate_is_a_one_shot_that_runs_before_web_and_worker():
    migrate = SERVICES["migrate"]
    assert migrate["restart"] == "no"
    assert "manage.py migrate" in _commands_as_text(migrate)
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("web", "worker"):
        assert SERVICES[name]["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name


def test_the_bucket_exists_before_anything_stores_adapters_and_is_the_one_settings_use():
    init = SERVICES["minio-init"]
    assert init["restart"] == "no"
    assert "mc mb --ignore-existing" in _commands_as_text(init)
    env = COMPOSE["x-lorafleet-env"]
    assert _resolve(init["environment"]["BUCKET"]) == _resolve(env["AWS_STORAGE_BUCKET_NAME"])
    # MinIO's root credentials are the ones the app signs with.
    minio_env = SERVICES["minio"]["environment"]
    assert _resolve(minio_env["MINIO_ROOT_USER"]) == _resolve(env["AWS_ACCESS_KEY_ID"])
    assert _resolve(minio_env["MINIO_ROOT_PASSWORD"]) == _resolve(env["AWS_SECRET_ACCESS_KEY"])
    for name in ("web", "worker"):
        assert SERVICES[name]["depends_on"]["minio-init"]["condition"] == "service_completed_successfully"


def test_migrate_connects_as_the_postgres_owner_and_web_and_worker_as_a_runtime_role():
    """The owner (POSTGRES_USER) could switch the audit triggers off; only `migrate` may connect as it."""
    pg = SERVICES["postgres"]["environment"]
    user, password, db = (_resolve(pg[k]) for k in ("POSTGRES_USER", "POSTGRES_PASSWORD", "POSTGRES_DB"))
    owner_url = _resolve(SERVICES["migrate"]["environment"]["MIGRATION_DATABASE_URL"])
    assert owner_url == f"postgres://{user}:{password}@postgres:5432/{db}"
    runtime = re.fullmatch(r"postgres://([^:@]+):([^@]+)@postgres:5432/(\w+)",
                           _resolve(COMPOSE["x-lorafleet-env"]["DATABASE_URL"]))
    assert runtime and runtime.group(3) == db and runtime.group(1) != user
    assert "MIGRATION_DATABASE_URL" not in COMPOSE["x-lorafleet-env"]  # web and worker never see the owner
    assert "manage.py grant_runtime_role" in _commands_as_text(SERVICES["migrate"])


def test_worker_reserves_an_nvidia_gpu_and_serves_one_base():
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] and d.get("count", 0) >= 1 for d in devices)
    command = SERVICES["worker"]["command"]
    assert command[:4] == ["python", "manage.py", "run_worker", "--base"]
    assert command[4].startswith("${LORAFLEET_BASE_SLUG:?")  # refuses to start without a base


def test_web_serves_the_wsgi_app_with_gunicorn():
    command = _commands_as_text(SERVICES["web"])
    assert command.startswith("gunicorn config.wsgi:application")


def _gunicorn_threads(command: str) -> int:
    """Request threads of a gunicorn gthread command line: workers (default 1) x threads."""
    workers = re.search(r"--workers[= ](\d+)", command)
    threads = re.search(r"--threads[= ](\d+)", command)
    assert threads, command
    return (int(workers.group(1)) if workers else 1) * int(threads.group(1))


def test_one_tenant_at_its_cap_holds_at_most_half_the_webs_threads():
    """Every inference request holds a web thread until the worker answers. With fewer threads than twice the
    default per-tenant cap, one busy tenant could take most or all of them, and everyone else's requests would
    wait in gunicorn's backlog, before any limit or fair scheduler sees them (the seed's 2 x 16 threads
    against a cap of 64)."""
    from tenants.models import Tenant

    cap = Tenant._meta.get_field("max_concurrent_requests").default
    compose = _resolve(_commands_as_text(SERVICES["web"]))
    dockerfile = next(line for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("CMD "))
    for where, command in (("docker-compose.yml", compose), ("Dockerfile", dockerfile)):
        assert "gthread" in command, where
        assert _gunicorn_threads(command) >= 2 * cap, f"{where}: {_gunicorn_threads(command)} web threads, cap {cap}"


def test_web_worker_and_migrate_read_the_same_settings_from_one_image():
    shared = COMPOSE["x-lorafleet-env"]
    for name in DJANGO_SERVICES:
        extra = {"MIGRATION_DATABASE_URL"} if name == "migrate" else set()  # the owner's URL: migrate alone
        env = SERVICES[name]["environment"]
        assert {k: v for k, v in env.items() if k not in extra} == shared and extra <= set(env), name
        assert SERVICES[name]["image"] == SERVICES["web"]["image"] and SERVICES[name]["build"] == "."
    for variable in (
        "DJANGO_SECRET_KEY", "DATABASE_URL", "CELERY_BROKER_URL", "CELERY_RESULT_BACKEND", "LORAFLEET_STORAGE",
        "AWS_STORAGE_BUCKET_NAME", "AWS_S3_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
    ):
        assert shared.get(variable), variable
    assert shared["LORAFLEET_STORAGE"] == "s3"
    assert _resolve(shared["CELERY_BROKER_URL"]).startswith("redis://redis:")
    assert str(shared["LORAFLEET_PRODUCTION"]) == "1"  # the embedded default secret is refused


def test_every_setting_is_set_in_compose_or_has_a_default():
    reads = _settings_env_reads()
    assert len(reads) >= 10, "the parser found too few env_* reads in config/settings.py"
    shared = COMPOSE["x-lorafleet-env"]
    missing = [name for name, has_default in reads.items() if not has_default and shared.get(name) is None]
    assert not missing, f"config/settings.py requires {missing} but docker-compose.yml does not set them"


def test_compose_sets_no_variable_the_project_never_reads():
    """A misspelt name in compose would be silently ignored while the setting keeps its default."""
    reads = set(_settings_env_reads())
    source = "\n".join(
        p.read_text() for p in ROOT.rglob("*.py") if ".venv" not in p.parts and "tests" not in p.parts
    )
    unread = [name for name in COMPOSE["x-lorafleet-env"] if name not in reads and f'"{name}"' not in source]
    assert not unread, f"docker-compose.yml sets {unread}, which nothing in the project reads"


def test_every_interpolated_variable_has_a_default_or_demands_a_value():
    """`${NAME}` with NAME unset becomes an empty string without a word; we want a default or an error."""
    text = (ROOT / "docker-compose.yml").read_text()
    bare = [m.group(1) for m in _INTERPOLATION.finditer(text) if m.group(2) is None]
    assert not bare, f"add :-default or :?message to {bare}"


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_builds_on_python_311_slim_and_installs_the_pinned_dependencies(dockerfile):
    assert re.search(r"^FROM python:3\.11-slim\s*$", dockerfile, re.MULTILINE)
    assert "COPY pyproject.toml" in dockerfile and "pip install -r" in dockerfile
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    unpinned = [d for d in dependencies if "==" not in d]
    assert not unpinned, f"the image would not be reproducible: {unpinned}"
    assert re.search(r"^USER (?!root)", dockerfile, re.MULTILINE)  # the app does not run as root


# --- metrics: Prometheus scrapes web with its token and the worker's exporter ------------------------

PROMETHEUS_CONFIG = ROOT / "deploy" / "prometheus.yml"


def _prometheus_config() -> dict:
    return yaml.safe_load(PROMETHEUS_CONFIG.read_text())


def _job(name: str) -> dict:
    return next(job for job in _prometheus_config()["scrape_configs"] if job["job_name"] == name)


def _mounts(service: dict) -> dict[str, str]:
    """container path -> host path of a service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):
        host, container, *_ = str(volume).split(":")
        out[container] = host
    return out


def test_prometheus_runs_from_a_pinned_image_with_the_config_file_of_this_repository():
    prom = SERVICES["prometheus"]
    assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", prom["image"])
    config_path = next(arg.split("=", 1)[1] for arg in prom["command"] if arg.startswith("--config.file="))
    host = _mounts(prom)[config_path]
    assert (ROOT / host).resolve() == PROMETHEUS_CONFIG and PROMETHEUS_CONFIG.is_file()
    assert str(prom["volumes"][0]).endswith(":ro")
    # its UI has no login: published on this host's loopback only
    assert all(_resolve(port).startswith("127.0.0.1:") for port in prom["ports"])


def test_prometheus_scrapes_web_with_the_token_web_requires():
    web_job = _job("lorafleet-web")
    assert web_job["metrics_path"] == "/metrics" and web_job["static_configs"][0]["targets"] == ["web:8000"]
    auth = web_job["authorization"]
    assert auth.get("type", "Bearer") == "Bearer" and "credentials" not in auth  # never the token itself
    # the credentials file is the compose secret, and the secret is the variable web checks against
    secret = auth["credentials_file"].removeprefix("/run/secrets/")
    assert secret in SERVICES["prometheus"]["secrets"]
    source = COMPOSE["secrets"][secret]["environment"]
    assert source == "LORAFLEET_METRICS_TOKEN" and source in _settings_env_reads()
    assert COMPOSE["x-lorafleet-env"][source].startswith("${LORAFLEET_METRICS_TOKEN:?")  # web refuses to start without
    assert "--bind=0.0.0.0:8000" in SERVICES["web"]["command"]


def test_prometheus_scrapes_the_workers_exporter_on_the_port_and_address_the_worker_listens_on():
    command = SERVICES["worker"]["command"]
    port = command[command.index("--metrics-port") + 1]
    assert command[command.index("--metrics-addr") + 1] == "0.0.0.0"  # reachable from prometheus' container
    assert _job("lorafleet-worker")["static_configs"][0]["targets"] == [f"worker:{port}"]
    assert "ports" not in SERVICES["worker"]  # ...and from nothing outside the compose network


def test_prometheus_scrapes_the_workers_exporter_with_the_token_web_requires():
    """The worker's exporter answers only LORAFLEET_METRICS_TOKEN (inference_worker/metrics_server.py): the
    worker job sends the same secret as the web job, and every worker service gets the variable."""
    assert _job("lorafleet-worker")["authorization"] == _job("lorafleet-web")["authorization"]
    for name in ("worker", "worker-dedicated"):
        assert "LORAFLEET_METRICS_TOKEN" in SERVICES[name]["environment"]
        assert "ports" not in SERVICES[name]


def test_the_web_healthcheck_is_not_redirected_to_https():
    test = " ".join(SERVICES["web"]["healthcheck"]["test"])
    assert "X-Forwarded-Proto': 'https'" in test
