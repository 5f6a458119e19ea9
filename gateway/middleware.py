"""Every answer under /v1/ is in OpenAI's JSON error shape, even when a view fails outside serving.py.

serving.py answers the completion routes' own failures; this catches what escapes any /v1/ view
(the model list, a model's detail): PostgreSQL restarting or unreachable becomes a 503
`database_unavailable` with Retry-After, which OpenAI clients retry, a body over the web's limit a 413
`request_too_large`, and anything else a JSON 500 `internal_error` — never Django's HTML error page,
which an API client cannot parse.
"""
from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.db import InterfaceError, OperationalError

from . import login_limits
from .errors import database_unavailable, internal_error, request_too_large

log = logging.getLogger(__name__)


class ApiErrorsMiddleware:
    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_exception(self, request, exception):
        if not request.path.startswith("/v1/"):
            return None  # the dashboard keeps Django's own error handling
        if isinstance(exception, (OperationalError, InterfaceError)):
            log.warning("database unavailable on %s: %s", request.path, type(exception).__name__)
            return database_unavailable().response()
        if isinstance(exception, RequestDataTooBig):
            return request_too_large(settings.DATA_UPLOAD_MAX_MEMORY_SIZE).response()
        log.error("internal error on %s", request.path, exc_info=exception)
        return internal_error().response()


class LoginThrottleMiddleware:
    """Refuses a login POST for a (username, address) pair, or from an address, that failed too often
    (gateway/login_limits.py).

    Listed after CsrfViewMiddleware, so a forged cross-site POST is refused before it counts for anything."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request):
        return self.get_response(request)

    def process_view(self, request, view_func, view_args, view_kwargs):
        match = request.resolver_match
        if request.method != "POST" or match is None or match.view_name not in login_limits.LOGIN_VIEWS:
            return None
        seconds = login_limits.retry_after(request, request.POST.get("username", ""))
        if seconds:
            log.warning("login refused: too many failures from %s", request.META.get("REMOTE_ADDR"))
            return login_limits.locked_out_response(request, seconds)
        return None
