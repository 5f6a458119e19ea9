"""The worker's guard against kombu's Redis teardown race (inference_worker/broker_hardening.py)."""
import pytest
import redis
from kombu import Connection
from kombu.transport.redis import Channel

from inference_worker import broker_hardening


def test_a_torn_down_connection_raises_an_error_celery_treats_as_a_lost_connection():
    broker_hardening.apply()
    broker_hardening.apply()  # idempotent
    torn_down = Channel.__new__(Channel)
    torn_down.connection = type("Transport", (), {"client": None, "default_port": 6379})()
    with pytest.raises(redis.exceptions.ConnectionError):
        torn_down._connparams()
    # Celery's cleanup ignores exactly the transport's connection errors, and then reconnects.
    conn = Connection("redis://127.0.0.1:6399/0")  # never connected
    assert any(issubclass(redis.exceptions.ConnectionError, err) for err in conn.connection_errors)
