"""lorafleet settings, read from the environment (see README "Configuration").

With no variables set, lorafleet runs on the embedded default: SQLite, a Celery filesystem
transport and filesystem storage, all under ``var/``. Production sets DATABASE_URL (PostgreSQL),
CELERY_BROKER_URL (Redis) and LORAFLEET_STORAGE=s3.
"""
from __future__ import annotations

import sys
from pathlib import Path

from csp import constants as csp_constants
from django.core.exceptions import ImproperlyConfigured

from .env import database_from_url, env_bool, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("LORAFLEET_VAR_DIR", str(BASE_DIR / "var"))).resolve()
VAR_DIR.mkdir(parents=True, exist_ok=True)  # the embedded default keeps everything here

DEBUG = env_bool("DJANGO_DEBUG", default=False)
# The production switch (docker-compose.yml sets it): refuses the embedded default secret, serves only HTTPS
# behind a TLS-terminating proxy (see "production: HTTPS" below) and keeps /metrics closed without a token.
LORAFLEET_PRODUCTION = env_bool("LORAFLEET_PRODUCTION", default=False)
_DEV_SECRET = "insecure-embedded-default-only-never-in-production"  # noqa: S105 (refused in production, below)
SECRET_KEY = env_str("DJANGO_SECRET_KEY", _DEV_SECRET)
if not DEBUG and SECRET_KEY == _DEV_SECRET and LORAFLEET_PRODUCTION:
    raise ImproperlyConfigured("Set the DJANGO_SECRET_KEY environment variable (LORAFLEET_PRODUCTION=1).")
ALLOWED_HOSTS = env_list("DJANGO_ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("DJANGO_CSRF_TRUSTED_ORIGINS", [])

DJANGO_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
]
THIRD_PARTY_APPS = ["rest_framework", "drf_spectacular", "csp"]
LOCAL_APPS = ["tenants", "adapters", "gateway", "finetune", "dashboard", "inference_worker", "demo"]
INSTALLED_APPS = DJANGO_APPS + THIRD_PARTY_APPS + LOCAL_APPS

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "csp.middleware.CSPMiddleware",  # Content-Security-Policy (below)
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "gateway.middleware.ApiErrorsMiddleware",  # /v1/: JSON errors, 503 database_unavailable
    "gateway.middleware.LoginThrottleMiddleware",  # dashboard and admin logins: lockout after repeated failures
]

# --- Content-Security-Policy (django-csp) ------------------------------------------------------
# Every page loads its scripts and styles from this origin only (static/): no inline script, style block or
# style="" attribute, no eval, no framing, forms post only here. An inline <script> must carry
# nonce="{{ request.csp_nonce }}" (the nonce is fresh per response). The browser suite checks that every
# dashboard page renders with no violation (tests/dashboard/test_csp.py).
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": [csp_constants.SELF],
        "script-src": [csp_constants.SELF, csp_constants.NONCE],
        "style-src": [csp_constants.SELF],
        "img-src": [csp_constants.SELF, "data:"],
        "font-src": [csp_constants.SELF],
        "connect-src": [csp_constants.SELF],
        "object-src": [csp_constants.NONE],
        "base-uri": [csp_constants.NONE],
        "form-action": [csp_constants.SELF],
        "frame-ancestors": [csp_constants.NONE],
    },
}

# --- production: HTTPS ------------------------------------------------------------------------
# `manage.py check --deploy` prints no warnings in production (tests/foundation/test_deploy_settings.py).
# The web process speaks plain HTTP behind a TLS-terminating proxy that must *set* (not pass through)
# X-Forwarded-Proto; requests without `https` there are redirected, cookies are Secure-only, and HSTS is sent.
# /metrics is exempt from the redirect: Prometheus scrapes web over the compose network, with its token.
if LORAFLEET_PRODUCTION:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("DJANGO_SECURE_SSL_REDIRECT", default=True)
    SECURE_REDIRECT_EXEMPT = [r"^metrics$"]
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    SECURE_HSTS_SECONDS = env_int("DJANGO_SECURE_HSTS_SECONDS", 365 * 24 * 3600)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("DJANGO_SECURE_HSTS_INCLUDE_SUBDOMAINS", default=True)
    SECURE_HSTS_PRELOAD = env_bool("DJANGO_SECURE_HSTS_PRELOAD", default=True)

ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"
ASGI_APPLICATION = "config.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# --- database -------------------------------------------------------------------------------
# DATABASE_URL is the runtime role (web, worker, every other command). MIGRATION_DATABASE_URL, when set,
# is the role that owns the tables: `manage.py migrate` alone connects as it, so the runtime role can be
# one that does not own the tables and therefore cannot switch the audit log's append-only triggers off
# (`manage.py grant_runtime_role` creates and grants it; README "Production").
_database_url = env_str("DATABASE_URL", "")
_migration_database_url = env_str("MIGRATION_DATABASE_URL", "")
if _migration_database_url and not _database_url:
    raise ImproperlyConfigured("MIGRATION_DATABASE_URL is set but DATABASE_URL is not: set both (the owner role for "
                               "migrations, the runtime role for everything else) or neither.")


def _running_migrate(argv: list[str]) -> bool:
    """`manage.py migrate`, `django-admin migrate` or `python -m django migrate`."""
    return len(argv) > 1 and argv[1] == "migrate" and Path(argv[0]).name in ("manage.py", "django-admin",
                                                                             "__main__.py")


if _database_url:
    DATABASES = {"default": database_from_url("DATABASE_URL", _database_url)}
    if _migration_database_url:
        _owner = database_from_url("MIGRATION_DATABASE_URL", _migration_database_url)
        if (_owner["ENGINE"], _owner["NAME"]) != (DATABASES["default"]["ENGINE"], DATABASES["default"]["NAME"]):
            raise ImproperlyConfigured("MIGRATION_DATABASE_URL must name the same database as DATABASE_URL (only the "
                                       f"role differs); got {_owner['NAME']!r} and {DATABASES['default']['NAME']!r}.")
        if _running_migrate(sys.argv):
            DATABASES["default"] = _owner
    if DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
        # A database that is restarting or unreachable must not hang a request: connecting gives up after
        # 5 s (the API answers 503 database_unavailable), and a pooled connection that died is dropped.
        DATABASES["default"]["OPTIONS"].setdefault("connect_timeout", 5)
        DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
        # A pool of connections per process (psycopg_pool, Django's "pool" option) instead of a new PostgreSQL
        # backend — a fork, authentication, catalog warm-up — for every request, twice per inference request
        # (the web gives its connection back while it waits on the worker). Connections are checked before
        # use (CONN_HEALTH_CHECKS), so a restarted database costs a reconnect, not an error. `timeout`: the
        # longest a request waits for a connection — all in use, or the database down — before its 503
        # `database_unavailable`. `reconnect_timeout`: the pool stops retrying in the background (every 1, 2,
        # 4 s...) after this long and starts afresh on the next request, so recovery after a long outage
        # waits for no long backoff.
        _pool_max = env_int("LORAFLEET_DB_POOL_MAX", 16)  # 0: a new connection per request
        if _pool_max > 0:
            DATABASES["default"]["OPTIONS"]["pool"] = {"min_size": min(2, _pool_max), "max_size": _pool_max,
                                                       "timeout": 3.0, "reconnect_timeout": 10.0}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "lorafleet.sqlite3",
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE"},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)

# --- storage --------------------------------------------------------------------------------
# "adapters" holds adapter blobs, content-addressed by sha256 and never overwritten.
LORAFLEET_STORAGE = env_str("LORAFLEET_STORAGE", "filesystem")
if LORAFLEET_STORAGE == "filesystem":
    _adapter_storage = {
        "BACKEND": "adapters.storage.AtomicFileSystemStorage",  # files appear whole, as S3 objects do
        "OPTIONS": {"location": str(Path(env_str("LORAFLEET_STORAGE_DIR", str(VAR_DIR / "storage"))))},
    }
elif LORAFLEET_STORAGE == "s3":
    _adapter_storage = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env_str("AWS_STORAGE_BUCKET_NAME"),
            "endpoint_url": env_str("AWS_S3_ENDPOINT_URL", "") or None,
            "access_key": env_str("AWS_ACCESS_KEY_ID", "") or None,
            "secret_key": env_str("AWS_SECRET_ACCESS_KEY", "") or None,
            "region_name": env_str("AWS_S3_REGION_NAME", "") or None,
            "file_overwrite": False,
            "default_acl": None,
        },
    }
else:
    raise ImproperlyConfigured(f"LORAFLEET_STORAGE must be 'filesystem' or 's3'; got {LORAFLEET_STORAGE!r}.")
STORAGES = {
    "default": {
        "BACKEND": "django.core.files.storage.FileSystemStorage",
        "OPTIONS": {"location": str(VAR_DIR / "media")},
    },
    "adapters": _adapter_storage,
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}

# Uploads stream to temporary files above this size, so the web process never holds them in memory.
FILE_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024
DATA_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# --- celery ---------------------------------------------------------------------------------
_celery_dir = VAR_DIR / "celery"
CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", "filesystem://")
if CELERY_BROKER_URL.startswith("filesystem://"):
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(_celery_dir / "queue"),
        "data_folder_out": str(_celery_dir / "queue"),
        "processed_folder": str(_celery_dir / "processed"),
        # kombu's default is ./control, relative to wherever the process was started
        "control_folder": str(_celery_dir / "control"),
        "store_processed": False,
    }
    CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", f"file://{_celery_dir / 'results'}")
else:
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "visibility_timeout": env_int("LORAFLEET_VISIBILITY_TIMEOUT_S", 3600),
        # a dead broker host must not hang a connect; jobs of a killed worker come back this often
        "socket_connect_timeout": 2,
        "unacked_restore_interval": env_int("LORAFLEET_RESTORE_INTERVAL_S", 10),
        "unacked_restore_throttle": 1,
    }
    CELERY_RESULT_BACKEND = env_str("CELERY_RESULT_BACKEND", CELERY_BROKER_URL)
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]  # never pickle
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_RESULT_EXPIRES = 3600

# --- lorafleet ------------------------------------------------------------------------------
LORAFLEET_MAX_UPLOAD_BYTES = env_int("LORAFLEET_MAX_UPLOAD_BYTES", 1024 * 1024 * 1024)
LORAFLEET_DEFAULT_MAX_RANK = env_int("LORAFLEET_DEFAULT_MAX_RANK", 64)
LORAFLEET_REQUEST_TIMEOUT_S = env_float("LORAFLEET_REQUEST_TIMEOUT_S", 60.0)
# The most tokens one request may ask for. 0 (the default): the base's context, so a chat request without
# max_tokens generates until a stop or the context, as OpenAI's does (gateway/prompts.py); a value caps both an
# explicit max_tokens (a larger one is a 400) and that default.
LORAFLEET_MAX_TOKENS_CAP = env_int("LORAFLEET_MAX_TOKENS_CAP", 0)
# A worker's task threads = the jobs it holds at once; its engine runs up to LORAFLEET_WORKER_MAX_RUNNING of
# them and queues the rest, in fair order (VTC). The threads are twice a tenant's default concurrency cap, so one
# tenant at its cap never holds every thread: another tenant's job still reaches the engine's scheduler instead
# of waiting in Redis behind the flood (Tenant.clean refuses a cap at or above the threads).
LORAFLEET_WORKER_CONCURRENCY = env_int("LORAFLEET_WORKER_CONCURRENCY", 128)
LORAFLEET_WORKER_MAX_RUNNING = env_int("LORAFLEET_WORKER_MAX_RUNNING", 64)
# The worker's memory budget in GB (base weights + workspace + the one pool of KV blocks and adapters);
# unset: 0.90 of the device on CUDA, a quarter of RAM on CPU (run_worker --memory-fraction / --memory-gb).
LORAFLEET_WORKER_MEMORY_GB = env_float("LORAFLEET_WORKER_MEMORY_GB", 0.0) or None
# How a worker stores resident adapters (run_worker --adapter-dtype): "" = the model's dtype; float16 or bfloat16
# beside a float32 (CPU) model halves their pages and the bytes the LoRA term reads (fp32 uploads are rounded).
LORAFLEET_WORKER_ADAPTER_DTYPE = env_str("LORAFLEET_WORKER_ADAPTER_DTYPE", "")
# deliveries of one job before it is answered `worker_lost` (a request that kills workers must end)
LORAFLEET_MAX_ATTEMPTS = env_int("LORAFLEET_MAX_ATTEMPTS", 3)

# --- fine-tuning (finetune/, docs/fine-tuning.md) ---------------------------------------------------
# The largest JSONL file POST /v1/files accepts (the upload is cut while streaming past it).
LORAFLEET_FINETUNE_MAX_FILE_BYTES = env_int("LORAFLEET_FINETUNE_MAX_FILE_BYTES", 100 * 1024 * 1024)
# Per-tenant defaults for tenants without their own FineTuneLimits row (admin): jobs validating, queued or running
# at once; training tokens (file tokens x epochs) per job; training tokens of the jobs created in the last 24 h.
LORAFLEET_FINETUNE_MAX_CONCURRENT_JOBS = env_int("LORAFLEET_FINETUNE_MAX_CONCURRENT_JOBS", 2)
LORAFLEET_FINETUNE_MAX_TOKENS_PER_JOB = env_int("LORAFLEET_FINETUNE_MAX_TOKENS_PER_JOB", 20_000_000)
LORAFLEET_FINETUNE_MAX_TOKENS_PER_DAY = env_int("LORAFLEET_FINETUNE_MAX_TOKENS_PER_DAY", 100_000_000)
# learning_rate_multiplier multiplies this (LoRA's usual rate).
LORAFLEET_FINETUNE_BASE_LEARNING_RATE = env_float("LORAFLEET_FINETUNE_BASE_LEARNING_RATE", 2e-4)
# A trainer refreshes its running job's heartbeat every few seconds; a running job whose heartbeat is older than
# this lost its trainer (killed, host gone) and is failed with `trainer_lost`.
LORAFLEET_TRAINER_HEARTBEAT_TTL_S = env_float("LORAFLEET_TRAINER_HEARTBEAT_TTL_S", 60.0)

# /metrics (gateway/metrics.py) answers only `Authorization: Bearer <LORAFLEET_METRICS_TOKEN>`. In production
# an unset (or empty) token closes the endpoint: 404, as if it did not exist. The embedded default uses the
# documented development token below. Per-tenant series (tenant slugs as label values) are opt-in.
LORAFLEET_DEV_METRICS_TOKEN = "lorafleet-dev-metrics-token"  # noqa: S105 (documented; never used in production)
LORAFLEET_METRICS_TOKEN = env_str("LORAFLEET_METRICS_TOKEN", "" if LORAFLEET_PRODUCTION else LORAFLEET_DEV_METRICS_TOKEN)
LORAFLEET_METRICS_TENANT_LABELS = env_bool("LORAFLEET_METRICS_TENANT_LABELS", default=False)
# The worker's exporter (inference_worker/metrics_server.py) answers the same token, and listens on this address
# unless `run_worker --metrics-addr` says otherwise: loopback, so a worker host exposes nothing by default.
LORAFLEET_WORKER_METRICS_ADDR = env_str("LORAFLEET_WORKER_METRICS_ADDR", "127.0.0.1")

# Dashboard and admin logins (gateway/login_limits.py): after this many failed attempts for one username from
# one client address, that pair is refused (429) for the lockout, correct password or not.
LORAFLEET_LOGIN_MAX_FAILURES = env_int("LORAFLEET_LOGIN_MAX_FAILURES", 5)
# ...and after this many failed attempts from one address over all usernames (credential stuffing), that address
# is refused for every username for the same lockout; successes do not reset it.
LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS = env_int("LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS", 20)
LORAFLEET_LOGIN_LOCKOUT_S = env_int("LORAFLEET_LOGIN_LOCKOUT_S", 15 * 60)

# --- e-mail (invitation links, tenants/invitations.py) ------------------------------------------
# The embedded default prints mails to the web process's log (they carry the invitation link); production
# sets DJANGO_EMAIL_BACKEND=django.core.mail.backends.smtp.EmailBackend and the DJANGO_EMAIL_* server below.
EMAIL_BACKEND = env_str("DJANGO_EMAIL_BACKEND", "django.core.mail.backends.console.EmailBackend")
DEFAULT_FROM_EMAIL = env_str("DJANGO_DEFAULT_FROM_EMAIL", "lorafleet <noreply@localhost>")
SERVER_EMAIL = DEFAULT_FROM_EMAIL
EMAIL_HOST = env_str("DJANGO_EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("DJANGO_EMAIL_PORT", 587)
EMAIL_HOST_USER = env_str("DJANGO_EMAIL_HOST_USER", "")
EMAIL_HOST_PASSWORD = env_str("DJANGO_EMAIL_HOST_PASSWORD", "")
EMAIL_USE_SSL = env_bool("DJANGO_EMAIL_USE_SSL", default=False)  # implicit TLS (port 465)
EMAIL_USE_TLS = env_bool("DJANGO_EMAIL_USE_TLS", default=not EMAIL_USE_SSL)  # STARTTLS (port 587)
if EMAIL_USE_TLS and EMAIL_USE_SSL:
    raise ImproperlyConfigured("Set at most one of DJANGO_EMAIL_USE_TLS and DJANGO_EMAIL_USE_SSL.")
# An SMTP server that does not answer must not hold the inviting request (the mail is sent inline).
EMAIL_TIMEOUT = env_int("DJANGO_EMAIL_TIMEOUT", 10)

REST_FRAMEWORK = {
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "lorafleet API",
    "DESCRIPTION": "OpenAI-compatible inference over many LoRA adapters of one base model.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LORAFLEET_LOG_LEVEL", "INFO")},
}
