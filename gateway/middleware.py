"""Every answer under /v1/ is in OpenAI's JSON error shape, even when a view fails outside serving.py.

serving.py answers the completion routes' own failures; this catches what escapes any /v1/ view
(the model list, a model's detail): PostgreSQL restarting or unreachable becomes a 503
`database_unavailable` with Retry-After, which OpenAI clients retry, and anything else a JSON 500
`internal_error` — never Django's HTML error page, which an API client cannot parse.
"""
from __future__ import annotations

import logging

from django.db import InterfaceError, OperationalError

from .errors import database_unavailable, internal_error

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
        log.error("internal error on %s", request.path, exc_info=exception)
        return internal_error().response()
