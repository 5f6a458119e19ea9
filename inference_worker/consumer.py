"""The worker's reliable-queue consumer on Redis: no job is ever only in a dead worker's socket.

kombu's Redis transport takes a job with BRPOP, which removes it from the queue on the server, and records
it as unacknowledged only once the worker's event loop has read the reply; a `kill -9` in between loses
the job (docs/RELIABILITY.md section 6). Here a job is taken with BLMOVE, which moves it *atomically on
the server* from the queue into a processing list of this worker and this queue:

    queue (LPUSHed by the gateway's Celery producer)  --BLMOVE-->  lorafleet:processing:<worker>:<queue>
    acknowledged = LREM from the processing list, once the task has pushed its final answer

A worker whose heartbeat key has expired is dead. Every live worker reaps the dead ones (`reap`, at each
heartbeat): a Lua script moves what the dead worker had taken *and* what still waited in its own queue
back to its pool's shared queue, oldest first, where any live worker of the pool takes it. Each delivery
of a job counts an attempt (inference_worker.tasks), so a job that kills workers still ends, answered
`worker_lost`; a job whose final answer was already pushed is not run again (replies.is_done).

A worker consumes two queues: its own (the jobs of the adapters it owns, routed by gateway/routing.py) and
its pool's shared queue (the base's, or a dedicated tenant's). One blocking fetcher thread per queue, each
on its own connection; a fetcher holds a free task slot while it waits, so the worker never takes more
jobs than it has task threads (`--concurrency`), exactly as Celery's threads pool with prefetch 1.

The messages are Celery's own (protocol 2, JSON), published by `app.send_task`; the task run is the Celery
task `lorafleet.generate`, called in-process on a task thread. The embedded default (Celery's filesystem
transport) keeps Celery's worker: this module is for Redis.
"""
from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from transport.replies import heartbeat_key

log = logging.getLogger(__name__)

REGISTRY_KEY = "lorafleet:consumers"  # worker id -> {"pool", "own", "processing": [...]}
DEAD_KEY = "lorafleet:consumers:dead"  # worker id -> when a reaper first found it dead
RECLAIM_LOG_KEY = "lorafleet:reclaimed"  # the latest reclaimed jobs, newest first (operators, tests)
RECLAIM_LOG_LEN = 10_000
FORGET_AFTER_S = 120  # a dead worker's queues are watched this long for late publishes, then forgotten
FETCH_BLOCK_S = 1.0  # one BLMOVE waits at most this long (how fast a stop is noticed)


def processing_key(worker_id: str, queue: str) -> str:
    return f"lorafleet:processing:{worker_id}:{queue}"


# Moves a dead worker's jobs back to its pool's queue. Atomic: a job is in exactly one list before and
# after. KEYS: registry, dead-since hash, reclaim log. ARGV: worker id, its heartbeat key, now (s),
# forget-after (s), "1" to reclaim a worker whose heartbeat still exists (its own clean exit or start), the
# reclaim log's length, "0" to leave its own queue alone (its start: those jobs are for it).
# Jobs are moved LEFT -> RIGHT one by one, so the oldest ends rightmost (the next one taken); the jobs
# it had taken go last, so they are taken first.
RECLAIM_LUA = """
local spec = redis.call('HGET', KEYS[1], ARGV[1])
if not spec then return {0, 0} end
if ARGV[5] ~= '1' and redis.call('EXISTS', ARGV[2]) == 1 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  return {-1, 0}
end
local s = cjson.decode(spec)
local moved = 0
local function drain(src, kind)
  while true do
    local v = redis.call('LMOVE', src, s.pool, 'LEFT', 'RIGHT')
    if not v then return end
    moved = moved + 1
    local rid = ''
    local ok, m = pcall(cjson.decode, v)
    if ok and type(m) == 'table' and type(m.headers) == 'table' and type(m.headers.id) == 'string' then
      rid = m.headers.id
    end
    redis.call('LPUSH', KEYS[3], cjson.encode({worker = ARGV[1], request_id = rid, was = kind,
                                                to = s.pool, at = tonumber(ARGV[3])}))
  end
end
if ARGV[7] ~= '0' then drain(s.own, 'queued') end
for _, src in ipairs(s.processing) do drain(src, 'taken') end

if moved > 0 then redis.call('LTRIM', KEYS[3], 0, tonumber(ARGV[6]) - 1) end
local since = redis.call('HGET', KEYS[2], ARGV[1])
if not since then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
  since = ARGV[3]
end
if tonumber(ARGV[3]) - tonumber(since) > tonumber(ARGV[4]) then
  redis.call('HDEL', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  redis.call('DEL', '_kombu.binding.' .. s.own, '_kombu.binding_permanent.' .. s.own)
  return {moved, 1}
end
return {moved, 0}
"""


def decode_task_message(raw: bytes) -> tuple[str, str, list, dict]:
    """A Celery protocol-2 message as kombu's Redis transport stores it -> (task name, id, args, kwargs)."""
    message = json.loads(raw)
    headers = message.get("headers") or {}
    body = message["body"]
    if (message.get("properties") or {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    if message.get("content-type", "application/json") != "application/json":
        raise ValueError(f"content type {message.get('content-type')!r} (only JSON is accepted)")
    args, kwargs, _embed = json.loads(body)
    return headers.get("task", ""), headers.get("id", ""), list(args), dict(kwargs)


class ReliableConsumer:
    """Takes jobs from `queues` into this worker's processing lists and runs them on `concurrency` threads.

    `tasks` maps the Celery task names this worker runs to callables (args, kwargs); anything else is
    logged and dropped (acknowledged), never retried in a loop."""

    def __init__(self, redis_url: str, *, worker_id: str, pool: str, own: str, concurrency: int,
                 tasks: dict[str, Callable[..., object]], forget_after_s: float = FORGET_AFTER_S):
        import redis

        self.worker_id, self.pool, self.own = worker_id, pool, own
        self.queues = [own, pool]  # a free slot is offered to both; the own queue's fetcher starts first
        self.concurrency = int(concurrency)
        self.tasks = dict(tasks)
        self.forget_after_s = float(forget_after_s)
        self._redis_mod = redis
        self._url = redis_url
        self._client = redis.Redis.from_url(redis_url, socket_connect_timeout=2, socket_timeout=10)
        self._reclaim = self._client.register_script(RECLAIM_LUA)
        self._errors = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
        self._slots = threading.BoundedSemaphore(self.concurrency)
        self._executor = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="lorafleet-task")
        self._stopping = threading.Event()
        self._fetchers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._unacked: list[tuple[str, bytes]] = []  # acknowledgements that failed (Redis away): retried
        self.counters = {"taken_own": 0, "taken_pool": 0, "acked": 0, "dropped": 0, "reclaimed": 0,
                         "reaped_workers": 0, "fetch_errors": 0}

    # ---- registration and reaping (called from the heartbeat thread) -----------------------------

    def spec(self) -> dict:
        return {"pool": self.pool, "own": self.own, "processing": [processing_key(self.worker_id, q) for q in self.queues]}

    def register(self) -> None:
        """Say which lists are this worker's, so a reaper can empty them once its heartbeat is gone. Called
        after each heartbeat (a broker that restarted empty learns it again within one beat)."""
        self._client.hset(REGISTRY_KEY, self.worker_id, json.dumps(self.spec()))

    def reap(self) -> int:
        """Return the jobs of every registered worker whose heartbeat expired to its pool's queue; -> jobs moved."""
        others = [w.decode() for w in self._client.hkeys(REGISTRY_KEY)]
        others = [w for w in others if w != self.worker_id]
        if not others:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for w in others:
            pipe.exists(heartbeat_key(w))
        alive = pipe.execute()
        moved = 0
        now = time.time()
        for w, is_alive in zip(others, alive, strict=True):
            if is_alive:
                continue
            n, forgotten = self._reclaim(keys=[REGISTRY_KEY, DEAD_KEY, RECLAIM_LOG_KEY],
                                         args=[w, heartbeat_key(w), now, self.forget_after_s, "0", RECLAIM_LOG_LEN, "1"])
            if n > 0:
                moved += n
                log.warning("worker %s is gone: %d of its jobs went back to its pool's queue", w, n)
            if forgotten:
                with self._lock:
                    self.counters["reaped_workers"] += 1
        with self._lock:
            self.counters["reclaimed"] += moved
        self.retry_acks()
        return moved

    def retry_acks(self) -> None:
        with self._lock:
            pending, self._unacked = self._unacked, []
        for key, raw in pending:
            self._ack(key, raw)

    # ---- consuming -------------------------------------------------------------------------------

    def start(self) -> ReliableConsumer:
        """Start the fetchers (call after the first heartbeat and `register`). Jobs left in this worker's lists by
        a previous process with the same id (a container restarted with the same hostname and pid) were never
        finished: they go back to the pool first."""
        moved, _ = self._reclaim(keys=[REGISTRY_KEY, DEAD_KEY, RECLAIM_LOG_KEY],
                                 args=[self.worker_id, heartbeat_key(self.worker_id), time.time(), self.forget_after_s,
                                       "1", RECLAIM_LOG_LEN, "0"])
        if moved:
            log.warning("%d job(s) left by a previous worker %s went back to %s", moved, self.worker_id, self.pool)
        self._client.hdel(DEAD_KEY, self.worker_id)
        for queue in self.queues:
            t = threading.Thread(target=self._fetch_loop, args=(queue,), name=f"lorafleet-fetch-{len(self._fetchers)}",
                                 daemon=True)
            t.start()
            self._fetchers.append(t)
        return self

    def _fetch_loop(self, queue: str) -> None:
        redis = self._redis_mod
        # its own connection: a blocking BLMOVE occupies it
        conn = redis.Redis.from_url(self._url, socket_connect_timeout=2, socket_timeout=FETCH_BLOCK_S + 10)
        dest = processing_key(self.worker_id, queue)
        source = "taken_own" if queue == self.own else "taken_pool"
        while not self._stopping.is_set():
            if not self._slots.acquire(timeout=FETCH_BLOCK_S):
                continue
            try:
                raw = conn.blmove(queue, dest, FETCH_BLOCK_S, "RIGHT", "LEFT")
            except self._errors as exc:
                self._slots.release()
                with self._lock:
                    self.counters["fetch_errors"] += 1
                log.warning("taking a job from %s failed (%s); retrying", queue, exc)
                time.sleep(1.0)
                continue
            except Exception:
                self._slots.release()
                log.exception("taking a job from %s failed", queue)
                time.sleep(1.0)
                continue
            if raw is None:
                self._slots.release()
                continue
            with self._lock:
                self._in_flight += 1
                self.counters[source] += 1
            # Even while stopping: it is in our processing list, so we run it (or a reaper returns it).
            self._executor.submit(self._run, dest, raw)

    def _run(self, key: str, raw: bytes) -> None:
        try:
            try:
                name, task_id, args, kwargs = decode_task_message(raw)
            except Exception as exc:
                log.error("dropping a message that is not a Celery JSON task message: %s", exc)
                with self._lock:
                    self.counters["dropped"] += 1
                return
            task = self.tasks.get(name)
            if task is None:
                log.error("dropping task %s (%s): this worker runs only %s", task_id, name, sorted(self.tasks))
                with self._lock:
                    self.counters["dropped"] += 1
                return
            try:
                task(*args, **kwargs)
            except Exception:  # the task answers its own errors; this is a bug, never a reason to loop
                log.exception("task %s (%s) raised", task_id, name)
        finally:
            self._ack(key, raw)
            self._slots.release()
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()

    def _ack(self, key: str, raw: bytes) -> None:
        try:
            self._client.lrem(key, 1, raw)
            with self._lock:
                self.counters["acked"] += 1
        except self._errors as exc:  # the job stays in our processing list; retried at the next heartbeat
            log.warning("acknowledging a job failed (%s); will retry", exc)
            with self._lock:
                self._unacked.append((key, raw))

    # ---- stopping --------------------------------------------------------------------------------

    def stop(self, grace_s: float = 30.0) -> None:
        """Stop taking jobs, let running ones finish (up to `grace_s`), then hand back what is left.

        The heartbeat key goes first, so the gateway stops routing here at its next look (about 1 s); this
        worker's registry entry stays, so jobs published to its queue after that are still reaped."""
        self._stopping.set()
        for t in self._fetchers:
            t.join(timeout=FETCH_BLOCK_S + 12)
        with self._lock:
            deadline = time.monotonic() + grace_s
            while self._in_flight and time.monotonic() < deadline:
                self._idle.wait(timeout=min(1.0, deadline - time.monotonic()))
            left = self._in_flight
        if left:
            log.warning("stopping with %d job(s) still running: they go back to %s", left, self.pool)
        self.retry_acks()
        try:
            self._client.delete(heartbeat_key(self.worker_id))
            moved, _ = self._reclaim(keys=[REGISTRY_KEY, DEAD_KEY, RECLAIM_LOG_KEY],
                                     args=[self.worker_id, heartbeat_key(self.worker_id), time.time(),
                                           self.forget_after_s, "1", RECLAIM_LOG_LEN, "1"])
            if moved:
                log.warning("handed %d job(s) back to %s", moved, self.pool)
        except self._errors as exc:
            log.warning("could not hand back this worker's queue (%s): a reaper will", exc)
        self._executor.shutdown(wait=False, cancel_futures=False)

    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "in_flight": self._in_flight, "queues": list(self.queues)}
