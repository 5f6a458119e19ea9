"""API keys in the manner of GitHub's tokens: ``lf_live_<id>_<secret><crc32>``.

- ``lf_live_`` is a fixed, recognisable prefix so secret scanners can find leaked keys.
- ``<id>`` (12 base62 chars) is public and finds the row; ``<secret>`` is 30 base62 chars
  (≈178 bits of entropy) and is only ever stored as a SHA-256 hash (NIST 800-63B allows a fast hash
  for high-entropy secrets) plus its last four characters for display.
- ``<crc32>`` (6 base62 chars) is a checksum over everything before it, so a mistyped or forged
  key is refused without a database query.
"""
from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import zlib

from django.utils import timezone

from .models import ApiKey

PREFIX = "lf_live_"
ALPHABET = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
ID_LEN = 12
SECRET_LEN = 30
CHECKSUM_LEN = 6
_KEY_RE = re.compile(rf"^{PREFIX}([0-9A-Za-z]{{{ID_LEN}}})_([0-9A-Za-z]{{{SECRET_LEN}}})([0-9A-Za-z]{{{CHECKSUM_LEN}}})$")


class KeyRejected(Exception):
    """The key cannot be used. ``reason`` is one of: malformed, bad_checksum, unknown, revoked, expired."""

    def __init__(self, reason: str, key: ApiKey | None = None):
        super().__init__(reason)
        self.reason = reason
        self.key = key  # the ApiKey row when it was found (revoked/expired), for the audit log


def _random(n: int) -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(n))


def _base62(number: int, width: int) -> str:
    out = []
    for _ in range(width):
        number, rem = divmod(number, 62)
        out.append(ALPHABET[rem])
    return "".join(reversed(out))


def checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), CHECKSUM_LEN)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_key() -> tuple[str, str, str]:
    """Return (full_key, key_id, secret)."""
    key_id, secret = _random(ID_LEN), _random(SECRET_LEN)
    body = f"{PREFIX}{key_id}_{secret}"
    return body + checksum(body), key_id, secret


def parse_key(raw: str) -> tuple[str, str]:
    """Split a presented key into (key_id, secret), checking format and checksum — no database."""
    match = _KEY_RE.match(raw.strip()) if isinstance(raw, str) else None
    if not match:
        raise KeyRejected("malformed")
    key_id, secret, check = match.groups()
    if not hmac.compare_digest(checksum(f"{PREFIX}{key_id}_{secret}"), check):
        raise KeyRejected("bad_checksum")
    return key_id, secret


def authenticate_api_key(raw: str, *, touch: bool = True) -> ApiKey:
    """Return the usable ApiKey for a presented key, or raise KeyRejected."""
    key_id, secret = parse_key(raw)
    key = ApiKey.objects.select_related("tenant", "bound_adapter").filter(key_id=key_id).first()
    if key is None or not hmac.compare_digest(key.secret_hash, hash_secret(secret)):
        raise KeyRejected("unknown")
    now = timezone.now()
    if key.revoked_at is not None:
        raise KeyRejected("revoked", key)
    if key.expires_at is not None and key.expires_at <= now:
        raise KeyRejected("expired", key)
    if touch and (key.last_used_at is None or (now - key.last_used_at).total_seconds() > 10):
        # Written at most every 10 s per key, so hot keys do not turn every request into a row update.
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=now)
        key.last_used_at = now
    return key
