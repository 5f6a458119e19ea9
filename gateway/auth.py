"""Who is calling: the API key in `Authorization: Bearer <key>`, checked by gateway.keys."""
from __future__ import annotations

from .errors import ApiError, unauthorized
from .keys import KeyRejected, authenticate_api_key


class KeyRefused(ApiError):
    """A 401 that still knows the key row when one was found (revoked, expired), for the audit log."""

    def __init__(self, reason: str, key=None):
        err = unauthorized(reason)
        super().__init__(err.status, err.code, err.message, type=err.type, headers=err.headers)
        self.reason = reason
        self.key = key


def bearer_token(request) -> str | None:
    header = request.META.get("HTTP_AUTHORIZATION", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authenticate(request):
    """Return the caller's ApiKey (with tenant and bound adapter loaded) or raise KeyRefused (401)."""
    raw = bearer_token(request)
    if raw is None:
        raise KeyRefused("missing")
    try:
        return authenticate_api_key(raw)
    except KeyRejected as exc:
        raise KeyRefused(exc.reason, exc.key) from None
