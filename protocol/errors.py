"""Every error a worker's answer may carry, and the HTTP status the gateway answers it with.

The code travels in `GenerationResult.error_code` as the enum's value (a plain string in the JSON
message), is what the API's `error.code` says, and is what the audit row records. A value this enum does
not know (a newer worker) is read as INTERNAL_ERROR (`ErrorCode.parse`).
"""
from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """A worker error code; ``.http_status`` is the gateway's answer to it."""

    http_status: int

    def __new__(cls, value: str, http_status: int) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.http_status = http_status
        return member

    # The blob's sha256 is not the one the job names, or the worker served other weights or another identity.
    ADAPTER_INTEGRITY_ERROR = "adapter_integrity_error", 502
    # Storage could not be read, the blob is not a valid adapter, or this worker serves the base model only.
    ADAPTER_LOAD_FAILED = "adapter_load_failed", 502
    # The prompt plus max_tokens does not fit the model's context or the worker's KV pool.
    PROMPT_TOO_LONG = "prompt_too_long", 400
    # The adapter's pages plus this request's KV blocks exceed the worker's whole memory pool: it can never run
    # there and retrying cannot help (a smaller max_tokens or prompt, or a lower rank, can). Not 413: the body
    # is not too large.
    ADAPTER_TOO_LARGE = "adapter_too_large", 422
    # This request's own logits overflowed (its adapter's weights or scale); other requests were unaffected,
    # retrying the same adapter cannot help: the adapter is the thing to fix.
    NON_FINITE_LOGITS = "non_finite_logits", 422
    # Parameters the engine cannot honour (an empty prompt, token ids outside the vocabulary).
    INVALID_REQUEST = "invalid_request", 400
    # The caller stopped waiting (or cancelled) before the worker finished.
    CANCELLED = "cancelled", 504
    # The worker could not finish before the request's deadline.
    TIMEOUT = "timeout", 504
    # The engine stopped (worker shutting down) before the request finished.
    ENGINE_STOPPED = "engine_stopped", 503
    # Every worker that took the request died running it; it is not retried again.
    WORKER_LOST = "worker_lost", 502
    # The job reached a worker serving another base model (another checkpoint sha256).
    BASE_MISMATCH = "base_mismatch", 502
    # Anything else that failed inside the worker.
    INTERNAL_ERROR = "internal_error", 500

    @classmethod
    def parse(cls, value: str | None) -> ErrorCode:
        """The member for a code read from a message; INTERNAL_ERROR for a missing or unknown one."""
        return next((member for member in cls if member.value == value), cls.INTERNAL_ERROR)
