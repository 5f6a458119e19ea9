"""The reply channel between a worker and the web process waiting on one request.

The Celery message carries the job (protocol.jobs); this module carries everything back, and
is the whole contract between gateway and worker besides the message itself. Events, in order:

    {"type": "delta", "text": "...", "worker_id": ..., "adapter_sha256": ...}   (streamed requests only)
    {"type": "final", "result": GenerationResult.to_dict(), "worker_id": ..., "attempts": n}

Redis (when the broker is Redis): events are RPUSHed onto `lorafleet:reply:<request_id>` and the web
BLPOPs them. A list rather than pub/sub on purpose: pub/sub drops a message published before the
subscriber is attached (a fast worker can beat the web's SUBSCRIBE) and has no backlog if the web
stalls; a list keeps every event until it is read, in order, and expires on its own if nobody reads.
Filesystem (the embedded default): events are appended as JSON lines to a file under var/ that the
web polls; streaming works the same way, at the polling interval (50 ms).

Also here, because both sides need them: the per-request attempt counter (the poison-request cap),
the cancel flag (the web gave up: do not start the job), the done flag (a final answer was pushed: a
redelivered copy is not run again), worker heartbeats (worker_status, the gateway's routing) and the
names of the queues: a pool's shared queue and each worker's own queue (inference_worker/consumer.py).
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

REPLY_TTL_S = 600
ATTEMPTS_TTL_S = 24 * 3600
POLL_S = 0.05
WORKER_KEY_PREFIX = "lorafleet:worker:"
# The ids of the workers that have beaten: live_workers reads this set, then each member's heartbeat, in two round
# trips whatever else the database holds (a SCAN for the prefix walked every key — a day of requests' attempt and
# done flags — on each web process's refresh). Members whose heartbeat has expired are pruned as they are read.
WORKER_INDEX_KEY = "lorafleet:workers"


def pool_queue(base_queue: str, tenant_slug: str | None = None) -> str:
    """The shared queue of a worker pool: the base's queue, or the dedicated pool of one tenant on that base."""
    return f"{base_queue}.tenant.{tenant_slug}" if tenant_slug else base_queue


def own_queue(pool: str, worker_id: str) -> str:
    """The queue only `worker_id` consumes (beside its pool's): where the gateway sends the jobs of the
    adapters that worker owns (gateway/routing.py)."""
    return f"{pool}.worker.{worker_id}"


def heartbeat_key(worker_id: str) -> str:
    return WORKER_KEY_PREFIX + worker_id


class ChannelUnavailable(RuntimeError):
    """The reply store (Redis) cannot be reached."""


class ReplyTimeout(TimeoutError):
    """No (further) event arrived before the deadline."""


class RedisChannel:
    def __init__(self, url: str):
        import redis

        self.url = url
        # Short connect timeout: a dead Redis must turn into a fast 503, never a hang. Blocking reads
        # use BLPOP slices of at most 1 s, well inside socket_timeout.
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=5, health_check_interval=15)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except self._errors as exc:
            raise ChannelUnavailable(str(exc)) from exc

    # worker side
    def push(self, request_id: str, event: dict) -> None:
        key = f"lorafleet:reply:{request_id}"
        pipe = self._redis.pipeline()
        pipe.rpush(key, json.dumps(event))
        pipe.expire(key, REPLY_TTL_S)
        if event.get("type") == "final":  # in the same transaction: answered <=> marked done
            pipe.set(f"lorafleet:done:{request_id}", b"1", ex=ATTEMPTS_TTL_S)
        self._call(pipe.execute)

    def is_done(self, request_id: str) -> bool:
        """A final answer was already pushed for this request (a redelivered copy must not run again)."""
        return bool(self._call(self._redis.exists, f"lorafleet:done:{request_id}"))

    def is_cancelled(self, request_id: str) -> bool:
        return bool(self._call(self._redis.exists, f"lorafleet:cancel:{request_id}"))

    def begin(self, request_id: str) -> tuple[bool, int, bool]:
        """What a worker asks before it runs a job, in one round trip: (already answered, this attempt's number
        — counted even for an answered one, which is then dropped —, cancelled by the web)."""
        attempts = f"lorafleet:attempts:{request_id}"
        pipe = self._redis.pipeline()
        pipe.exists(f"lorafleet:done:{request_id}")
        pipe.incr(attempts)
        pipe.expire(attempts, ATTEMPTS_TTL_S)
        pipe.exists(f"lorafleet:cancel:{request_id}")
        done, n, _, cancelled = self._call(pipe.execute)
        return bool(done), int(n), bool(cancelled)

    def heartbeat(self, worker_id: str, status: dict, ttl_s: float) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(heartbeat_key(worker_id), json.dumps(status), px=int(ttl_s * 1000))
        pipe.sadd(WORKER_INDEX_KEY, worker_id)
        self._call(pipe.execute)

    def forget_worker(self, worker_id: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(heartbeat_key(worker_id))
        pipe.srem(WORKER_INDEX_KEY, worker_id)
        self._call(pipe.execute)

    def live_workers(self) -> list[dict]:
        """Each live worker's last status, plus `expires_in_s`: how long it stays listed without another beat
        (read on Redis's clock, so hosts with skewed clocks agree on it). Two round trips (WORKER_INDEX_KEY),
        and a third only when it prunes expired members."""
        ids = sorted(m.decode() for m in self._call(self._redis.smembers, WORKER_INDEX_KEY))
        if not ids:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.get(heartbeat_key(worker_id))
            pipe.pttl(heartbeat_key(worker_id))
        replies = self._call(pipe.execute)
        out, gone = [], []
        for worker_id, value, pttl in zip(ids, replies[::2], replies[1::2], strict=True):
            if value:
                status = json.loads(value)
                status["expires_in_s"] = max(0.0, pttl / 1000) if pttl and pttl > 0 else 0.0
                out.append(status)
            else:
                gone.append(worker_id)
        if gone:
            # A worker that beats again between the GET and this SREM re-adds itself on its next beat.
            self._call(self._redis.srem, WORKER_INDEX_KEY, *gone)
        return out

    def queue_lengths(self, queues: list[str]) -> list[int]:
        """Jobs waiting in each queue (one round trip)."""
        pipe = self._redis.pipeline(transaction=False)
        for queue in queues:
            pipe.llen(queue)
        return [int(n) for n in self._call(pipe.execute)]

    # web side
    def cancel(self, request_id: str) -> None:
        self._call(self._redis.set, f"lorafleet:cancel:{request_id}", b"1", ex=REPLY_TTL_S)

    def events(self, request_id: str, deadline: float) -> Iterator[dict]:
        """Yield events until the final one; raise ReplyTimeout at `deadline` (time.monotonic())."""
        key = f"lorafleet:reply:{request_id}"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplyTimeout(request_id)
            got = self._call(self._redis.blpop, [key], timeout=max(0.05, min(1.0, remaining)))
            if got is None:
                continue
            event = json.loads(got[1])
            yield event
            if event.get("type") == "final":
                self._call(self._redis.delete, key)
                return


class FileChannel:
    """The embedded default: JSON lines under var/celery/replies (one web and one worker host)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        (self.folder / "workers").mkdir(parents=True, exist_ok=True)

    def _path(self, kind: str, request_id: str) -> Path:
        safe = "".join(c for c in request_id if c.isalnum() or c == "-")
        return self.folder / f"{safe}.{kind}"

    def push(self, request_id: str, event: dict) -> None:
        line = (json.dumps(event) + "\n").encode()
        fd = os.open(self._path("jsonl", request_id), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, line)  # one write per line: readers never see half a line followed by another
        finally:
            os.close(fd)

    def count_attempt(self, request_id: str) -> int:
        path = self._path("attempts", request_id)
        n = self.attempts(request_id) + 1
        path.write_text(str(n))
        return n

    def attempts(self, request_id: str) -> int:
        try:
            return int(self._path("attempts", request_id).read_text() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def is_cancelled(self, request_id: str) -> bool:
        return self._path("cancel", request_id).exists()

    def is_done(self, request_id: str) -> bool:
        return False  # the embedded default's Celery worker never redelivers an answered job

    def begin(self, request_id: str) -> tuple[bool, int, bool]:
        return self.is_done(request_id), self.count_attempt(request_id), self.is_cancelled(request_id)

    def _worker_path(self, worker_id: str) -> Path:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in worker_id)
        return self.folder / "workers" / f"{safe}.json"

    def forget_worker(self, worker_id: str) -> None:
        self._worker_path(worker_id).unlink(missing_ok=True)

    def heartbeat(self, worker_id: str, status: dict, ttl_s: float) -> None:
        path = self._worker_path(worker_id)
        tmp = path.with_name(f".{path.stem}.tmp")
        tmp.write_text(json.dumps({**status, "_expires": time.time() + ttl_s}))
        tmp.replace(path)

    def live_workers(self) -> list[dict]:
        out = []
        for path in sorted((self.folder / "workers").glob("*.json")):
            try:
                status = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            expires = status.pop("_expires", 0)
            if expires > time.time():
                out.append({**status, "expires_in_s": expires - time.time()})
        return out

    def cancel(self, request_id: str) -> None:
        self._path("cancel", request_id).touch()

    def events(self, request_id: str, deadline: float) -> Iterator[dict]:
        path = self._path("jsonl", request_id)
        offset, pending = 0, b""
        while True:
            try:
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    chunk = fh.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                event = json.loads(line)
                yield event
                if event.get("type") == "final":
                    for kind in ("jsonl", "attempts", "cancel"):
                        self._path(kind, request_id).unlink(missing_ok=True)
                    return
            if not lines:
                if time.monotonic() >= deadline:
                    raise ReplyTimeout(request_id)
                time.sleep(POLL_S)


def ensure_local_folders() -> None:
    """The embedded default's filesystem broker and file result backend need their folders to exist
    (kombu and Celery do not create them). A no-op for Redis."""
    from django.conf import settings

    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {}) or {}
    folders = [options.get(k) for k in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")]
    backend = str(getattr(settings, "CELERY_RESULT_BACKEND", "") or "")
    if backend.startswith("file://"):
        folders.append(backend[len("file://"):])
    for folder in filter(None, folders):
        Path(folder).mkdir(parents=True, exist_ok=True)


_channel = None


def reply_channel():
    """The process-wide channel for this deployment: Redis when the broker is Redis, else files."""
    global _channel
    if _channel is None:
        from django.conf import settings

        url = getattr(settings, "LORAFLEET_REPLY_URL", "") or settings.CELERY_BROKER_URL
        if url.startswith(("redis://", "rediss://", "unix://")):
            _channel = RedisChannel(url)
        else:
            _channel = FileChannel(Path(settings.VAR_DIR) / "celery" / "replies")
    return _channel


def reset_channel() -> None:
    """Forget the cached channel (tests that change settings)."""
    global _channel
    _channel = None
