"""Every failure of the inference API, answered in OpenAI's error shape with a stable code.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": "..."}}

The `code` is what clients (and our audit log) branch on; `message` is a sentence for a human.
"""
from __future__ import annotations

from django.http import JsonResponse


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
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.type = type
        self.param = param
        self.headers = dict(headers or {})

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
    return ApiError(500, "internal_error", "The server failed while answering this request.", type="server_error")


def timed_out(seconds: float) -> ApiError:
    return ApiError(504, "timeout", f"No answer from a worker within {seconds:g} s.", type="server_error")


# Worker error codes (inference_worker.jobs) -> HTTP status. Anything unknown is a 500.
# adapter_too_large is a 422, not a 5xx: the adapter's pages plus this request's KV blocks exceed the
# worker's whole memory pool, so it can never run there and retrying the same request cannot help (a smaller
# max_tokens or prompt, or an adapter of lower rank or fewer targets, can). Not 413: the body is not too large.
WORKER_ERROR_STATUS = {
    "adapter_load_failed": 502,
    "adapter_integrity_error": 502,
    "worker_lost": 502,
    "base_mismatch": 502,
    "prompt_too_long": 400,
    "invalid_request": 400,
    "adapter_too_large": 422,
    # the request's own logits overflowed (its adapter's weights or scale): other requests were unaffected,
    # retrying the same adapter cannot help; the adapter is the thing to fix
    "non_finite_logits": 422,
    "timeout": 504,
    "cancelled": 504,
    "engine_stopped": 503,
}


# What a client can change about a worker refusal, appended to the worker's own sentence.
_WORKER_ERROR_HINTS = {
    "non_finite_logits": "The adapter's weights, at its lora_alpha scale, overflow the serving dtype; upload a "
                         "version with smaller weights or a smaller lora_alpha.",
    "adapter_too_large": "This adapter cannot be served with this request on this base's workers: lower max_tokens "
                         "or shorten the prompt, or use an adapter of lower rank or with fewer target modules.",
}
_WORKER_ERROR_PARAM = {"prompt_too_long": "prompt", "adapter_too_large": "model", "non_finite_logits": "model"}


def from_worker(code: str | None, message: str | None) -> ApiError:
    code = code or "internal_error"
    status = WORKER_ERROR_STATUS.get(code, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    text = message or code.replace("_", " ")
    if code in _WORKER_ERROR_HINTS:
        text = f"{text.rstrip('.')}. {_WORKER_ERROR_HINTS[code]}"
    return ApiError(status, code, text, type=kind, param=_WORKER_ERROR_PARAM.get(code))
