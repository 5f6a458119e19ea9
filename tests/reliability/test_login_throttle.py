"""Password guessing at the dashboard and admin logins: after N failures for one username from one address,
that pair is refused with 429 — a correct password included — until the lockout passes."""
from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from gateway import limits

pytestmark = pytest.mark.django_db

N = 3


@pytest.fixture
def store(monkeypatch, settings):
    settings.LORAFLEET_LOGIN_MAX_FAILURES = N
    settings.LORAFLEET_LOGIN_LOCKOUT_S = 600
    local = limits.LocalCounters()
    monkeypatch.setattr(limits, "_counters", local)
    return local


def login(client: Client, username: str, password: str, *, url: str | None = None, address: str = "203.0.113.7"):
    return client.post(url or reverse("tenants:login"), {"username": username, "password": password},
                       REMOTE_ADDR=address)


def test_the_nth_failure_locks_and_then_even_the_right_password_is_refused(world, store, client):
    for attempt in range(N):
        r = login(client, "alice", f"wrong-{attempt}")
        assert r.status_code == 200 and b"Please enter a correct username and password" in r.content
    r = login(client, "alice", "alice-password-1")
    assert r.status_code == 429
    assert b"Too many failed logins" in r.content and b"10 minutes" in r.content
    assert 590 <= int(r["Retry-After"]) <= 600
    assert "_auth_user_id" not in client.session
    assert login(client, "alice", "wrong-again").status_code == 429


def test_the_lock_is_per_username_and_address_and_a_success_clears_the_count(world, store, client):
    for attempt in range(N - 1):
        login(client, "alice", f"wrong-{attempt}")
    assert login(client, "alice", "alice-password-1").status_code == 302  # under the limit: in
    client.logout()
    for attempt in range(N - 1):  # the success started the count again
        login(client, "alice", f"wrong-{attempt}")
    assert login(client, "alice", "alice-password-1").status_code == 302
    client.logout()

    for attempt in range(N):
        login(client, "Alice", f"wrong-{attempt}")  # usernames count case-insensitively
    assert login(client, "alice", "alice-password-1").status_code == 429
    assert login(Client(), "alice", "alice-password-1", address="198.51.100.9").status_code == 302
    assert login(Client(), "charlie", "charlie-password-1").status_code == 302


def test_the_lock_ends_when_the_lockout_has_passed(world, store, client, settings):
    settings.LORAFLEET_LOGIN_LOCKOUT_S = 1
    for attempt in range(N):
        login(client, "alice", f"wrong-{attempt}")
    assert login(client, "alice", "alice-password-1").status_code == 429
    import time

    time.sleep(1.2)
    assert login(client, "alice", "alice-password-1").status_code == 302


def test_the_admin_login_is_throttled_too(world, store, client, admin_user):
    url = reverse("admin:login")
    for attempt in range(N):
        assert login(client, "admin", f"wrong-{attempt}", url=url).status_code == 200
    r = login(client, "admin", "password", url=url)  # pytest-django's admin_user password
    assert r.status_code == 429 and "_auth_user_id" not in client.session


def test_the_counters_are_shared_through_redis(world, monkeypatch, settings, redis_url, client):
    """Several web processes: the lock lives in Redis, so every process refuses the pair."""
    settings.LORAFLEET_LOGIN_MAX_FAILURES = N
    settings.LORAFLEET_LOGIN_LOCKOUT_S = 600
    first = limits.RedisCounters(redis_url)

    def forget():  # only this test's counters: the Redis database is shared with other tests
        for key in first._redis.scan_iter("lorafleet:fail:login:*"):
            first._redis.delete(key)

    forget()
    monkeypatch.setattr(limits, "_counters", first)
    try:
        for attempt in range(N):
            login(client, "alice", f"wrong-{attempt}")
        monkeypatch.setattr(limits, "_counters", limits.RedisCounters(redis_url))  # "another process"
        r = login(Client(), "alice", "alice-password-1")
        assert r.status_code == 429 and 590 <= int(r["Retry-After"]) <= 600
        assert not any(b"alice" in key for key in first._redis.scan_iter("lorafleet:fail:*"))  # hashed keys
    finally:
        forget()


def test_one_address_trying_many_usernames_is_locked_for_every_username(world, store, client, settings):
    """Credential stuffing: a few passwords on each of many usernames, every pair under its own limit. After
    LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS failures in all, the address gets the same 429 + Retry-After for any
    username, a right password included; another address is not affected, and a success does not reset it."""
    settings.LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS = 2 * (N - 1) + 1
    stuffed = ["alice", "bob", "nobody-1", "nobody-2"]
    failures = 0
    for name in stuffed[:2]:
        for attempt in range(N - 1):  # under the per-(username, address) limit
            assert login(client, name, f"wrong-{attempt}").status_code == 200
            failures += 1
    assert login(client, "charlie", "charlie-password-1").status_code == 302  # a success resets nothing...
    client.logout()
    assert login(client, "nobody-1", "wrong").status_code == 200
    failures += 1
    assert failures == settings.LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS
    r = login(client, "charlie", "charlie-password-1")  # ...so the address is locked now, for charlie too
    assert r.status_code == 429 and "_auth_user_id" not in client.session
    assert 590 <= int(r["Retry-After"]) <= 600
    assert b"Too many failed logins from your address" in r.content
    assert login(client, "nobody-2", "whatever").status_code == 429  # a username it never tried
    assert login(Client(), "charlie", "charlie-password-1", address="198.51.100.9").status_code == 302


def test_the_address_lock_counts_in_redis_too(world, monkeypatch, settings, redis_url):
    """Several web processes share the address count: failures spread over two processes lock the address."""
    settings.LORAFLEET_LOGIN_MAX_FAILURES = N
    settings.LORAFLEET_LOGIN_MAX_FAILURES_PER_ADDRESS = N + 1
    settings.LORAFLEET_LOGIN_LOCKOUT_S = 600
    first = limits.RedisCounters(redis_url)

    def forget():
        for key in first._redis.scan_iter("lorafleet:fail:login:*"):
            first._redis.delete(key)

    forget()
    monkeypatch.setattr(limits, "_counters", first)
    try:
        for name in ("alice", "bob"):
            login(Client(), name, "wrong", address="192.0.2.55")
        monkeypatch.setattr(limits, "_counters", limits.RedisCounters(redis_url))  # "another process"
        for name in ("nobody-1", "nobody-2"):
            assert login(Client(), name, "wrong", address="192.0.2.55").status_code == 200
        r = login(Client(), "charlie", "charlie-password-1", address="192.0.2.55")
        assert r.status_code == 429 and 590 <= int(r["Retry-After"]) <= 600
    finally:
        forget()
