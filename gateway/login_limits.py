"""Failed logins to the dashboard and the admin, counted per (username, client address) and per address.

After LORAFLEET_LOGIN_MAX_FAILURES failures the pair is locked for LORAFLEET_LOGIN_LOCKOUT_S: its login
POSTs are answered 429 with Retry-After *before* the password is checked, so a correct guess made while
locked is refused like a wrong one and guessing gains nothing. A successful login clears the count.
Other users, and the same user from another address, are not affected (a lockout an attacker could
aim at any account from anywhere would be a denial of service).

Credential stuffing tries a few passwords on *many* usernames from one address, staying under every
pair's limit; so an address is also locked, for every username, after LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS
failures in all (same 429, Retry-After and lockout length). A successful login does not clear that count:
one account the attacker owns would otherwise reset it between guesses. The address limit is set well
above the pair's, so people behind one NAT do not lock each other out by mistyping.

Failures are counted through Django's `user_login_failed` signal (every authenticate() that fails for
a request), the lock is enforced by LoginThrottleMiddleware on the login views; the counters live in
gateway/limits.py's store (Redis when the broker is Redis, so every web process shares them). The key
is a hash: neither usernames nor addresses are written to Redis in clear. The address is REMOTE_ADDR,
which behind a proxy is the proxy's: then the lock is per username.
"""
from __future__ import annotations

import hashlib
import math

from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.core.exceptions import ValidationError
from django.shortcuts import render

from .limits import counters

# Views whose POST is a password check: the dashboard's login and the admin's.
LOGIN_VIEWS = frozenset({"tenants:login", "admin:login"})


def _key(request, username: str) -> str:
    raw = f"{(username or '').strip().lower()}\x00{request.META.get('REMOTE_ADDR', '')}"
    return "login:" + hashlib.sha256(raw.encode()).hexdigest()


def _address_key(request) -> str:
    # "\x01" keeps these keys apart from every (username, address) key: no username makes the same hash input
    raw = f"\x01{request.META.get('REMOTE_ADDR', '')}"
    return "login:" + hashlib.sha256(raw.encode()).hexdigest()


def _limit() -> int:
    return max(1, int(settings.LORAFLEET_LOGIN_MAX_FAILURES))


def _address_limit() -> int:
    return max(1, int(settings.LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS))


def _locked_for(key: str, limit: int) -> int:
    count, seconds_left = counters().failures(key)
    return max(1, seconds_left) if count >= limit else 0


def address_retry_after(request) -> int:
    """Seconds until this address may try any username again; 0 when it is not locked."""
    return _locked_for(_address_key(request), _address_limit())


def retry_after(request, username: str) -> int:
    """Seconds until this username may log in again from this address (its own lock or the address's, whichever
    lasts longer); 0 when neither is locked."""
    return max(_locked_for(_key(request, username), _limit()), address_retry_after(request))


def record_failure(sender, credentials: dict, request=None, **kwargs) -> None:
    if request is not None:  # authenticate() outside a request (tests, shell) has no address to count
        ttl = int(settings.LORAFLEET_LOGIN_LOCKOUT_S)
        counters().fail(_key(request, credentials.get("username", "")), ttl, _limit())
        counters().fail(_address_key(request), ttl, _address_limit())


def clear_failures(sender, request=None, user=None, **kwargs) -> None:
    if request is not None and user is not None:
        counters().clear(_key(request, user.get_username()))


class _LockedOutForm(AuthenticationForm):
    """The login form showing the lockout as its error; it never checks the password."""

    def __init__(self, request, message: str):
        super().__init__(request, data=request.POST)
        self._message = message

    def clean(self):
        raise ValidationError(self._message, code="locked_out")


def locked_out_response(request, seconds: int):
    minutes = math.ceil(seconds / 60)
    wait = f"{minutes} minute{'s' if minutes != 1 else ''}" if seconds >= 60 else f"{seconds} seconds"
    whom = "from your address" if address_retry_after(request) else "for this username from your address"
    message = f"Too many failed logins {whom}. Try again in {wait}."
    response = render(request, "registration/login.html",
                      {"form": _LockedOutForm(request, message), "next": request.POST.get("next", "")}, status=429)
    response["Retry-After"] = str(seconds)
    return response
