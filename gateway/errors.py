"""Every failure of the inference API, answered in OpenAI's error shape with a stable code.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

The `code` is what clients (and our audit log) branch on; `message` is a sentence for a human, always ours:
no answer carries an exception's or a library's own text (issue 47). Where a worker's internal failure says
more, that goes to the audit row only (`ApiError.detail`).
"""
from __future__ import annotations

import re

from django.http import JsonResponse

from protocol.errors import ErrorCode


class ApiError(Exception):
    """An answer that is not a completion. Raised anywhere in the request path, rendered once by the view."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
        detail: str | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.param = param
        self.headers = dict(headers or {})
        self.detail = detail  # for the audit row, never the answer

    @property
    def audit_text(self) -> str:
        """What the audit row records: the detail where there is one, else the answer's sentence."""
        return self.detail or self.message

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, extra_headers: dict[str, str] | None = None) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in {**(extra_headers or {}), **self.headers}.items():
            response[name] = value
        return response


def unauthorized(reason: str) -> ApiError:
    messages = {
        "missing": "No API key: send 'Authorization: Bearer <key>'.",
        "revoked": "This API key has been revoked.",
        "expired": "This API key has expired.",
    }
    return ApiError(
        401,
        "invalid_api_key",
        messages.get(reason, "Incorrect API key provided."),
        type="authentication_error",
        headers={"WWW-Authenticate": 'Bearer realm="lorafleet"'},
    )


def invalid(message: str, *, param: str | None = None, code: str = "invalid_parameter") -> ApiError:
    return ApiError(400, code, message, param=param)


def adapter_not_found(name: str) -> ApiError:
    # The same answer for "missing", "another tenant's" and "malformed": existence is not leaked.
    return ApiError(404, "adapter_not_found", f"The model {name!r} does not exist or you do not have access to it.",
                    param="model")


def request_too_large(limit_bytes: int) -> ApiError:
    return ApiError(413, "request_too_large", f"The request body is larger than this server accepts "
                                              f"({limit_bytes} bytes).")


def adapter_deleted(name: str) -> ApiError:
    return ApiError(410, "adapter_deleted", f"The adapter {name!r} has been deleted.", param="model")


def adapter_not_ready(name: str) -> ApiError:
    return ApiError(409, "adapter_not_ready", f"The adapter {name!r} has no ready version yet.", param="model")


def rate_limited(code: str, message: str, retry_after_s: int) -> ApiError:
    return ApiError(429, code, message, type="rate_limit_error", headers={"Retry-After": str(max(1, retry_after_s))})


def queue_unavailable(detail: str = "") -> ApiError:
    message = "The inference queue is unavailable; retry shortly."
    return ApiError(503, "queue_unavailable", message + (f" ({detail})" if detail else ""), type="server_error",
                    headers={"Retry-After": "2"})


def database_unavailable() -> ApiError:
    return ApiError(503, "database_unavailable", "The service database is unavailable; retry shortly.",
                    type="server_error", headers={"Retry-After": "2"})


def internal_error() -> ApiError:
    code = ErrorCode.INTERNAL_ERROR
    return ApiError(code.http_status, code.value, "The server failed while answering this request.", type="server_error")


def timed_out(seconds: float) -> ApiError:
    code = ErrorCode.TIMEOUT
    return ApiError(code.http_status, code.value, f"No answer from a worker within {seconds:g} s.", type="server_error")


# What a client can change about a worker refusal, appended to the worker's own sentence. The codes and their
# HTTP statuses are protocol.errors.ErrorCode.
_WORKER_ERROR_HINTS = {
    ErrorCode.NON_FINITE_LOGITS: "The adapter's weights, at its lora_alpha scale, overflow the serving dtype; upload a "
                                 "version with smaller weights or a smaller lora_alpha.",
    ErrorCode.ADAPTER_TOO_LARGE: "This adapter cannot be served with this request on this base's workers: lower "
                                 "max_tokens or shorten the prompt, or use an adapter of lower rank or with fewer "
                                 "target modules.",
}
_WORKER_ERROR_PARAM = {ErrorCode.PROMPT_TOO_LONG: "prompt", ErrorCode.ADAPTER_TOO_LARGE: "model",
                       ErrorCode.NON_FINITE_LOGITS: "model"}


_UNKNOWN_CODE = re.compile(r" \(worker error code '[^']{0,50}'\)$")


def from_worker(code: ErrorCode | str | None, message: str | None) -> ApiError:
    """The API's answer to a worker's error: the code's HTTP status, and its value as `error.code` (and so in
    the audit row). A code this server does not know (a newer worker) is an internal_error naming it."""
    known = ErrorCode.parse(code)
    text = message or known.value.replace("_", " ")
    detail = None
    if known is ErrorCode.INTERNAL_ERROR:
        # An internal failure's text may be an exception's (torch's, the tokenizer's): the audit row keeps it.
        # protocol.jobs.GenerationResult names a code it did not know at the end of the message: that stays.
        named = _UNKNOWN_CODE.search(text)
        detail, text = text, f"The worker failed while answering this request{named.group(0) if named else ''}."
    if code and code != known:
        text = f"{text.rstrip('.')} (worker error code {str(code)[:50]!r})"
    if known in _WORKER_ERROR_HINTS:
        text = f"{text.rstrip('.')}. {_WORKER_ERROR_HINTS[known]}"
    kind = "invalid_request_error" if known.http_status < 500 else "server_error"
    return ApiError(known.http_status, known.value, text, type=kind, param=_WORKER_ERROR_PARAM.get(known),
                    detail=detail)
