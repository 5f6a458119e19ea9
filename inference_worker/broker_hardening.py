"""A guard around a race in kombu's Redis transport that otherwise kills a threads-pool worker.

When the broker connection drops, Celery tears the connection down while task threads may still be
acknowledging messages. kombu's Redis channel then tries to restore unacknowledged messages through a
connection whose ``client`` is already gone, and ``Channel._connparams`` fails with
``AttributeError: 'NoneType' object has no attribute 'hostname'``. That error is not one of the
transport's connection errors, so Celery's cleanup does not ignore it and the worker stops with
"Unrecoverable error" instead of reconnecting (seen in tests/reliability/test_faults.py when Redis
is restarted under traffic). Raising the transport's own ConnectionError there lets Celery's normal
reconnect path run; the unacknowledged messages stay in Redis and are restored by the visibility
timeout, as for any lost connection.

`manage.py run_worker` on Redis no longer runs kombu's consumer (inference_worker/consumer.py takes its
jobs with BLMOVE); this guard is for a Celery worker on Redis (`celery -A config worker`), applied by
Celery's worker_init signal (inference_worker/tasks.py).
"""
from __future__ import annotations

_applied = False


def apply() -> None:
    global _applied
    if _applied:
        return
    import redis
    from kombu.transport import redis as kombu_redis

    original = kombu_redis.Channel._connparams

    def _connparams(self, asynchronous: bool = False):
        if getattr(self.connection, "client", None) is None:
            raise redis.exceptions.ConnectionError("the broker connection is already closed")
        return original(self, asynchronous)

    kombu_redis.Channel._connparams = _connparams
    _applied = True
